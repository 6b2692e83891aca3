"""The edge's use of the length predictor: load once, predict off the event loop when heavy."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Protocol

from lanes.queue.messages import ChatMessage
from lanes.telemetry import metrics

log = logging.getLogger(__name__)

#: A prediction slower than this (measured at start-up) runs in a thread, not on the loop.
_INLINE_LIMIT_S = 0.001
_PROBES = ("Explain what a class definition does.", "Write a haiku about the sea.",
           "List three differences between TCP and UDP, with an example of each.")


class Predictor(Protocol):
    def predict(self, messages: Sequence[ChatMessage], max_tokens: int) -> int: ...


class LengthEstimator:
    def __init__(self, predictor: Predictor | None = None) -> None:
        if predictor is None:
            from lanes.scheduler.predictor import load_default

            predictor = load_default()
        self.predictor = predictor
        # Three different prompts: a predictor that caches (the encoder's scores) must be timed on
        # prompts it has not seen, as most requests' are.
        started = time.perf_counter()
        for prompt in _PROBES:
            predictor.predict((ChatMessage("user", prompt),), 256)
        self.inline = (time.perf_counter() - started) / len(_PROBES) < _INLINE_LIMIT_S
        log.info("length predictor %s runs %s", type(predictor).__name__, "inline" if self.inline else "in a thread")

    async def predict(self, messages: Sequence[ChatMessage], max_tokens: int) -> int:
        if self.inline:
            return self._timed(messages, max_tokens)
        return await asyncio.to_thread(self._timed, messages, max_tokens)

    def _timed(self, messages: Sequence[ChatMessage], max_tokens: int) -> int:
        """The prediction, its time observed in ``lanes_edge_predict_seconds`` (the predictor's
        own time: not the wait for the thread, which the request's queue time already shows)."""
        started = time.perf_counter()
        try:
            return self.predictor.predict(messages, max_tokens)
        finally:
            metrics.PREDICT.observe(time.perf_counter() - started)
