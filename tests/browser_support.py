"""A real browser for the page tests: Debian's Chromium driven by Playwright for Python.

``chromium_or_reason()`` installs Chromium where it is missing (``scripts/install_browser.sh``:
``apt-get install chromium`` as root), so ``./scripts/test.sh`` on a fresh machine runs the
browser tests instead of skipping them; only where that cannot work (not root, no apt) does it
return the reason to skip with. Playwright never downloads a browser here (no ``playwright
install``): it launches ``/usr/bin/chromium`` with the flags below.
"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
#: Headless in a container: no sandbox (root), no GPU, and nothing that calls home.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
INSTALL_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install_browser.sh"
#: apt-get update + install of Chromium on a fresh machine.
INSTALL_TIMEOUT_S = 900


def chromium_or_reason() -> str | None:
    """None when Playwright and Chromium are ready (installing Chromium if needed), else why not."""
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is missing: run scripts/bootstrap.sh (it is a dev dependency)"
    if CHROMIUM.exists():
        return None
    try:
        done = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True,
                              timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"installing Chromium took over {INSTALL_TIMEOUT_S} s"
    if done.returncode != 0 or not CHROMIUM.exists():
        return f"Chromium could not be installed: {(done.stderr or done.stdout).strip()[-300:]}"
    return None
