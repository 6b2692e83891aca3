"""The edge's use of the length predictor: load once, predict off the event loop when heavy."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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


#: Predictions run at most this many at a time, off the loop. The lexical part holds the GIL
#: and the encoder's ONNX Runtime call releases it, so two overlap; more would only take the
#: GIL from the event loop (every thread of the default executor predicting at once slowed
#: the loop's own work, and every other client's, under a flood of long prompts).
PREDICT_THREADS = 2


@dataclass
class _Job:
    messages: Sequence[ChatMessage]
    max_tokens: int
    future: asyncio.Future[int]


class LengthEstimator:
    """The edge's length predictions: inline when the predictor is fast, else on a few threads,
    taken from the waiting requests' tenants in turn (round robin over ``tenant``, the pool and
    API key), so a flood of long prompts from one key or to one pool waits behind itself, not
    in front of everyone else's requests."""

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
        self._executor: ThreadPoolExecutor | None = None
        #: Each tenant's waiting jobs, in arrival order; ``_turns``: the tenants with any, in turn.
        self._waiting: dict[Hashable, deque[_Job]] = {}
        self._turns: deque[Hashable] = deque()
        self._running = 0

    async def predict(self, messages: Sequence[ChatMessage], max_tokens: int, tenant: Hashable = None) -> int:
        if self.inline:
            return self._timed(messages, max_tokens)
        job = _Job(messages, max_tokens, asyncio.get_running_loop().create_future())
        if (queue := self._waiting.get(tenant)) is None:
            queue = self._waiting[tenant] = deque()
            self._turns.append(tenant)
        queue.append(job)
        self._start_next()
        return await job.future

    def waiting(self) -> int:
        """Predictions not started yet."""
        return sum(len(queue) for queue in self._waiting.values())

    def _start_next(self) -> None:
        while self._running < PREDICT_THREADS and self._turns:
            tenant = self._turns.popleft()
            queue = self._waiting[tenant]
            job = queue.popleft()
            if queue:
                self._turns.append(tenant)
            else:
                del self._waiting[tenant]
            if job.future.done():  # its caller was cancelled while it waited (the edge stopping)
                continue
            if self._executor is None:
                self._executor = ThreadPoolExecutor(PREDICT_THREADS, thread_name_prefix="lanes-predict")
            self._running += 1
            running = asyncio.get_running_loop().run_in_executor(self._executor, self._timed, job.messages,
                                                                 job.max_tokens)
            running.add_done_callback(lambda done, job=job: self._finished(done, job))

    def _finished(self, done: asyncio.Future[int], job: _Job) -> None:
        self._running -= 1
        if not job.future.done():
            if (error := done.exception()) is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(done.result())
        self._start_next()

    def _timed(self, messages: Sequence[ChatMessage], max_tokens: int) -> int:
        """The prediction, its time observed in ``lanes_edge_predict_seconds`` (the predictor's
        own time: not the wait for the thread, which the request's queue time already shows)."""
        started = time.perf_counter()
        try:
            return self.predictor.predict(messages, max_tokens)
        finally:
            metrics.PREDICT.observe(time.perf_counter() - started)
