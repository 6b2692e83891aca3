#!/usr/bin/env bash
# GPU smoke check (< 10 minutes): builds the tiny model, runs the hf speculative engine on CUDA
# with speculation off and on, and the vLLM / TensorRT-LLM engines when installed; prints
# tokens/s, TTFT and acceptance. Then runs the gpu-marked real-engine tests.
# Usage: scripts/gpu_check.sh [PYTHON]   (default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-$(mktemp -d)}"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
"$PY" - <<'PY'
import importlib.util, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for m in ("vllm", "tensorrt_llm"):
    print(m, "installed" if importlib.util.find_spec(m) else "not installed")
PY
DEVICE=$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
timeout 420 "$PY" -m lanes.workers.engines.gpu_check --out-dir "$OUT/tiny" --device "$DEVICE" \
    --max-tokens 128 --runs 3
timeout 150 "$PY" -m pytest -q -m gpu tests/test_vllm_adapter.py tests/test_trtllm_adapter.py \
    tests/test_hf_spec.py -p no:cacheprovider || echo "gpu tests failed (rc=$?)"
