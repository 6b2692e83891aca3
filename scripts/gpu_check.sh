#!/usr/bin/env bash
# GPU check for one NVIDIA GPU, 12 minutes at most. First the hf engine (transformers, what
# `lanes up` runs by default) on CUDA: the gpu-marked test (greedy speculative decoding on CUDA
# gives the CPU's tokens, acceptance 1.0 with draft = target) and its tokens/s table
# (workers/engines/gpu_check.py). Then, for vLLM and for TensorRT-LLM (each where it
# is installed, each in its own process with its own time limit) it builds a random-weight model
# on the spot (Llama, head dim 64, bf16) and proves, through the lanes adapter:
#   1. the engine starts with the adapter's arguments (only known-optional ones may be missing)
#   2. it streams through the chat template with lane priorities, two requests at once
#   3. an abort ends a running request with `cancelled`
#   4. n-gram speculation reports acceptance above zero
#   5. an over-long prompt is rejected (`prompt_too_long`)
#   6. after an engine shutdown the adapter raises EngineDead
# (workers/engines/conformance.py; the same checks run on CPU against stand-ins in
# tests/test_conformance.py.) Exit status 1 if any check fails or an engine runs out of time
# (also where torch sees no CUDA GPU: the table then says so in one line).
# The gpu-marked pytest tests are separate: pytest -m gpu tests/test_vllm_adapter.py ...
# Usage: scripts/gpu_check.sh [PYTHON]   (default: .venv/bin/python, else python3)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${1:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-$(mktemp -d)}"
#: Seconds per engine: start-up (eager mode) plus six checks; two engines fit in 10 minutes.
PER_ENGINE_S="${PER_ENGINE_S:-270}"

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
"$PY" - <<'PY'
import importlib.metadata as md, importlib.util, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
for module, dist in (("vllm", "vllm"), ("tensorrt_llm", "tensorrt-llm")):
    print(module, md.version(dist) if importlib.util.find_spec(module) else "not installed")
PY

status=0
ran=0
timeout --kill-after=10 90 "$PY" -m pytest -p no:cacheprovider -q -m gpu tests/test_hf_spec.py || status=1
timeout --kill-after=10 90 "$PY" -m lanes.workers.engines.gpu_check --device cuda --runs 3 \
    --out-dir "$OUT/hf" || status=1
for engine in vllm trtllm; do
  module=$([ "$engine" = vllm ] && echo vllm || echo tensorrt_llm)
  if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"; then
    echo "$engine: not installed, skipped"
    continue
  fi
  ran=$((ran + 1))
  started=$(date +%s)
  timeout --kill-after=10 "$PER_ENGINE_S" "$PY" -m lanes.workers.engines.conformance \
      --engine "$engine" --out-dir "$OUT/$engine"
  rc=$?
  [ "$rc" -eq 124 ] && echo "$engine: FAIL, out of time after ${PER_ENGINE_S} s"
  echo "$engine: exit $rc after $(( $(date +%s) - started )) s"
  [ "$rc" -ne 0 ] && status=1
done
[ "$ran" -eq 0 ] && echo "neither vllm nor tensorrt_llm is installed: only the hf engine was checked"
exit "$status"
