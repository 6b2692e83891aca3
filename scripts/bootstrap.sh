#!/usr/bin/env bash
# Create .venv and install lanes with its test tools. Idempotent: a re-run with an unchanged
# pyproject.toml does nothing. Needs Python >= 3.11 (set PYTHON to pick one).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# Refused at once, not after minutes of installing torch into a venv pip then cannot serve.
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "bootstrap: lanes needs Python >= 3.11; $PYTHON is $("$PYTHON" -V 2>&1 || echo missing) (set PYTHON=python3.11 or newer)" >&2
  exit 2
fi
# A venv made where python3-venv is missing (Debian, Ubuntu) has a python but no pip: a re-run
# must not take it as done, it recreates it.
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  rm -rf .venv
  if ! "$PYTHON" -m venv .venv || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
    rm -rf .venv
    echo "bootstrap: $PYTHON cannot make a virtual environment with pip: install python3-venv (apt-get install python3-venv), then re-run" >&2
    exit 2
  fi
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
