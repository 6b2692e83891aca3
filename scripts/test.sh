#!/usr/bin/env bash
# Install (first run only) and run the whole test suite: unit, integration (real redis-server
# on a random loopback port), end-to-end (real processes and WebSockets, tiny model).
# Arguments go to pytest (e.g. -m "not e2e" for the fast part).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"
