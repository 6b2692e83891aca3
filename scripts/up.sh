#!/usr/bin/env bash
# Install (first run only) and start the whole system on the CPU: embedded Redis, one edge,
# one worker on the shipped demo model, the scheduler. Ctrl-C stops everything.
# Arguments go to `lanes up` (e.g. --port 8001 --workers 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
exec .venv/bin/lanes up "$@"
