#!/usr/bin/env bash
# Create .venv and install lanes with its test tools. Idempotent: a re-run with an unchanged
# pyproject.toml does nothing. Needs Python >= 3.11 (set PYTHON to pick one).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
new_enough='import sys; sys.exit(sys.version_info < (3, 11))'
if [ -x .venv/bin/python ] && .venv/bin/python -c "$new_enough" 2>/dev/null; then
  # A venv already made (with PYTHON=python3.11 where python3 is older, say) is used as it is.
  # One without pip (left by a failed first try where python3-venv is missing, or made by
  # `uv venv`) gets pip from ensurepip before anything is deleted.
  if ! .venv/bin/python -m pip --version >/dev/null 2>&1 && ! .venv/bin/python -m ensurepip -q >/dev/null 2>&1; then
    echo "bootstrap: recreating .venv: it has no pip and ensurepip cannot add one" >&2
    rm -rf .venv
  fi
fi
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  # Refused at once, not after minutes of installing torch into a venv pip then cannot serve.
  PYTHON_PATH=$(command -v "$PYTHON" || true)  # resolved before .venv (maybe on PATH) goes
  if [ -z "$PYTHON_PATH" ] || ! "$PYTHON_PATH" -c "$new_enough" 2>/dev/null; then
    echo "bootstrap: lanes needs Python >= 3.11; $PYTHON is $("$PYTHON" -V 2>&1 || echo missing) (set PYTHON=python3.11 or newer)" >&2
    exit 2
  fi
  rm -rf .venv
  if ! "$PYTHON_PATH" -m venv .venv || ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
    rm -rf .venv
    version=$("$PYTHON_PATH" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    echo "bootstrap: $PYTHON cannot make a virtual environment with pip: install python$version-venv (apt-get install python$version-venv), then re-run" >&2
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
