#!/usr/bin/env bash
# Install (first run only) and start the whole system on the CPU: embedded Redis, one edge,
# one worker on the shipped demo model, the scheduler. Ctrl-C stops everything.
# Arguments go to `lanes up` (e.g. --port 8001 --workers 2).
set -euo pipefail
# lanes up runs in the caller's directory (no cd): the commands it prints (`.venv/bin/lanes
# chat ...`, or the absolute path from elsewhere) and a relative --model mean what they say there.
root=$(CDPATH= cd -- "$(dirname -- "$0")/.." >/dev/null && pwd)  # CDPATH: cd would print the path
bash "$root/scripts/bootstrap.sh"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
exec "$root/.venv/bin/lanes" up "$@"
