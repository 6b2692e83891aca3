"""Batches token events per engine step: one pipeline of fenced stream appends, then one
PUBLISH per edge. Redis messages therefore grow with edges x steps, not with requests.

Events submitted while a flush is in flight wait for the next one, so batching adds no
delay when Redis is idle and coalesces naturally when it is busy. A failed flush keeps its
events and retries: no token is dropped because Redis blinked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from lanes.queue.messages import TokenBatch, TokenEvent
from lanes.queue.plane import QueuePlane
from lanes.telemetry import metrics

log = logging.getLogger(__name__)


@dataclass
class Outgoing:
    """What the publisher needs to know about a run."""

    id: str
    edge: str
    #: Set when this run's final event is in the stream and published.
    flushed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set when the stream refused our writes (a newer attempt owns the request).
    stale: bool = False
    #: Since when (monotonic s) nobody has been subscribed to this run's edge channel.
    orphan_since: float | None = None


class Publisher:
    def __init__(self, plane: QueuePlane, worker_id: str, on_stale: Callable[[str], None],
                 on_orphan: Callable[[str], None] = lambda _id: None, orphan_grace_s: float = 15.0) -> None:
        self.plane = plane
        self.worker_id = worker_id
        self._on_stale = on_stale
        self._on_orphan = on_orphan
        self.orphan_grace_s = orphan_grace_s
        self._outbox: list[tuple[Outgoing, TokenEvent]] = []
        self._wake = asyncio.Event()

    def submit(self, run: Outgoing, event: TokenEvent) -> None:
        self._outbox.append((run, event))
        self._wake.set()

    async def run(self) -> None:
        backoff_s = 0.05
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._outbox = self._outbox, []
            try:
                await self._flush(batch)
                backoff_s = 0.05
            except RedisError as exc:
                log.warning("publish failed (%s); retrying in %.2f s", exc, backoff_s)
                self._outbox[:0] = batch  # keep order: the failed batch goes first
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 2.0)
                self._wake.set()

    async def _flush(self, batch: list[tuple[Outgoing, TokenEvent]]) -> None:
        by_request: dict[str, list[TokenEvent]] = defaultdict(list)
        runs: dict[str, Outgoing] = {}
        for run, event in batch:
            if not run.stale:
                by_request[run.id].append(event)
                runs[run.id] = run
        if not by_request:
            return
        results = await self.plane.append(by_request)
        by_edge: dict[str, list[TokenEvent]] = defaultdict(list)
        for request_id, appended in results.items():
            run = runs[request_id]
            if appended < 0:
                run.stale = True
                run.flushed.set()
                self._on_stale(request_id)
                continue
            by_edge[run.edge].extend(by_request[request_id])
        if by_edge:
            receivers = await self.plane.publish(
                {edge: TokenBatch(self.worker_id, tuple(evs)) for edge, evs in by_edge.items()})
            self._track_orphans(runs, receivers)
        metrics.BATCH_SIZE.observe(len(by_request))
        for request_id in by_request:
            if by_request[request_id][-1].finish is not None:
                runs[request_id].flushed.set()

    def _track_orphans(self, runs: dict[str, Outgoing], receivers: dict[str, int]) -> None:
        """A run whose edge channel has had no subscriber for ``orphan_grace_s`` serves nobody
        (its edge died and its client never resumed elsewhere): stop spending the GPU on it."""
        now = time.monotonic()
        for run in runs.values():
            if receivers.get(run.edge, 1) > 0:
                run.orphan_since = None
            elif run.orphan_since is None:
                run.orphan_since = now
            elif now - run.orphan_since > self.orphan_grace_s:
                log.info("request %s has had no listener for %.0f s; cancelling", run.id, now - run.orphan_since)
                run.orphan_since = None
                self._on_orphan(run.id)
