"""Logging setup. Prompts and answers are never logged (only ids, lanes and counts)."""

from __future__ import annotations

import logging


def setup_logging(level: str, process: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {process} %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("transformers", "httpx", "websockets.server"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
