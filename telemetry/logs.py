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
    # huggingface_hub installs a stderr handler of its own when imported, and propagates too:
    # each of its lines (a download retry every second while the hub is unreachable) came out
    # twice. Through ours only, once. (~10 ms: the module configures itself at import.)
    import huggingface_hub.utils.logging  # noqa: F401 - configures the library's logger

    hub = logging.getLogger("huggingface_hub")
    for handler in list(hub.handlers):
        hub.removeHandler(handler)
    hub.propagate = True
