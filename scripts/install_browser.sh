#!/usr/bin/env bash
# Install Debian's Chromium for the browser tests (tests/test_ui_browser.py) where it is missing.
# Idempotent; needs root and apt-get (the tests skip, saying why, where this cannot run). The
# Playwright Python package (a dev dependency, installed by bootstrap.sh) drives this browser;
# never `playwright install`, which downloads a browser build of its own.
set -euo pipefail
CHROMIUM=/usr/bin/chromium
if [ -x "$CHROMIUM" ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "$CHROMIUM is missing and this is not root: run 'apt-get install -y chromium' as root" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "$CHROMIUM is missing and there is no apt-get here: install Chromium at $CHROMIUM" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium >/dev/null
test -x "$CHROMIUM"
