"""Logging setup. Prompts and answers are never logged (only ids, lanes and counts)."""

from __future__ import annotations

import logging


def setup_logging(level: str, process: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {process} %(levelname)s %(name)s: %(message)s",
    )
    # transformers' continuous batching logs its cache sizing and thread life at INFO under a
    # logger of its own; ``lanes up`` shows every child's output, so keep it to warnings.
    for noisy in ("transformers", "httpx", "websockets.server", "ContinuousBatchingLogger"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
