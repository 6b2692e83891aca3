#!/usr/bin/env bash
# Create .venv and install lanes with its test tools. Idempotent: a re-run with an unchanged
# pyproject.toml does nothing. Needs Python >= 3.11 (set PYTHON to pick one).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
stamp=.venv/.lanes-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # torch first, pinned: a CPU build is enough here. An unpinned torch would pull a multi-GB
  # CUDA build; to get the CPU wheel elsewhere, point PIP_INDEX_URL at PyTorch's CPU index.
  .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==${LANES_TORCH_VERSION:-2.13.0}"
  # setuptools prints an "Editable installation" notice for every editable install of a
  # package mapped from a folder of another name (the repository root IS `lanes`, DESIGN.md
  # "Layout"); it warns of a `lanes/` folder in the working directory, which we do not have.
  PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
