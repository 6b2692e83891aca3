"""The edge's part of the dashboard: what only an edge sees, shipped every second, and the
scheduler's samples relayed to browsers as server-sent events.

- ``EdgeStats`` collects one window: time to first token per lane (a mergeable histogram,
  ``scheduler/histogram.py``), refusals per lane and reason, finished requests per lane. The
  edge feeds it the delivery core's ``FirstToken`` / ``Finished`` actions.
- ``ship_windows`` hands the window to Redis once a second (``Fleet.push_edge_window``); when
  Redis is down the window is kept and the next one covers both.
- ``StatsRelay`` holds one subscription to the samples channel per edge and fans each sample
  out to the open ``/v1/stats/stream`` responses; ``sse_stream`` first replays the stored
  history after the client's last sample (``Last-Event-ID``), so a page opened now shows the
  last 15 minutes and a reconnecting one misses nothing still stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator

import msgspec
from lanes.queue.backoff import Backoff
from lanes.queue.errors import ErrorCode, QueueUnavailable
from lanes.queue.fleet import sample_time_ms
from lanes.queue.plane import QueuePlane
from lanes.queue.pubsub import listen
from lanes.queue.stats import FIXED_LANE, EdgeWindow, Histogram
from lanes.scheduler import histogram
from lanes.telemetry import metrics
from lanes.ws_server.delivery import Entry, Finished

log = logging.getLogger(__name__)

#: How often an edge ships its window (s): the dashboard's resolution.
WINDOW_S = 1.0
#: Samples queued for one slow SSE client before the oldest are dropped.
MAX_QUEUED_SAMPLES = 64
#: A comment line this often keeps proxies from closing an idle stream (s).
KEEPALIVE_S = 15.0
#: The lane the delivery core gives a request this edge took over by ``resume``.
_RESUMED = Entry.lane


class EdgeStats:
    """This edge's current window. No I/O and no clock: times come in as arguments."""

    def __init__(self, edge_id: str, now_ms: int) -> None:
        self.edge_id = edge_id
        self._start_ms = now_ms
        self._ttft: dict[str, Histogram] = {}
        self._pool_ttft: dict[str, Histogram] = {}
        self._refusals: dict[str, dict[str, int]] = {}
        self._finished: dict[str, int] = {}

    def first_token(self, lane: str, ttft_s: float, pool: str = metrics.NO_POOL) -> None:
        bucket = histogram.bucket_of(ttft_s * 1000)
        by_lane = self._ttft.setdefault(lane, {})
        by_lane[bucket] = by_lane.get(bucket, 0) + 1
        if lane != FIXED_LANE:
            # A fixed answer (the edge's own, in ~0.1 ms) is not the pool's model serving: in
            # the pool's TTFT it read as a pool answering in 0.1 ms at the median.
            by_pool = self._pool_ttft.setdefault(pool, {})
            by_pool[bucket] = by_pool.get(bucket, 0) + 1

    def finished(self, action: Finished, pool: str = metrics.NO_POOL) -> None:
        if action.refused:
            reason = action.reason or action.outcome
            by_reason = self._refusals.setdefault(action.lane, {})
            by_reason[reason] = by_reason.get(reason, 0) + 1
            metrics.REJECTIONS.labels(pool, action.lane, reason).inc()
        elif action.outcome != ErrorCode.RESUMED_ELSEWHERE and action.lane != _RESUMED:
            # A request taken over by another edge ends there, where its lane is not known
            # (the resume frame does not say it): counted nowhere rather than twice.
            self._finished[action.lane] = self._finished.get(action.lane, 0) + 1

    def take(self, now_ms: int) -> EdgeWindow | None:
        """The window so far (None when nothing happened); a new one starts at ``now_ms``."""
        empty = not (self._ttft or self._refusals or self._finished)
        window = None if empty else EdgeWindow(self.edge_id, self._start_ms, now_ms, self._ttft, self._refusals,
                                               self._finished, self._pool_ttft)
        self._start_ms, self._ttft, self._refusals, self._finished, self._pool_ttft = now_ms, {}, {}, {}, {}
        return window

    def restore(self, window: EdgeWindow) -> None:
        """Put back a window that could not be shipped: the next one covers both."""
        self._start_ms = window.start_ms
        for lane, by_bucket in window.ttft_ms.items():
            self._ttft[lane] = histogram.merge([by_bucket, self._ttft.get(lane, {})])
        for pool, by_bucket in window.pool_ttft_ms.items():
            self._pool_ttft[pool] = histogram.merge([by_bucket, self._pool_ttft.get(pool, {})])
        for lane, by_reason in window.refusals.items():
            mine = self._refusals.setdefault(lane, {})
            for reason, n in by_reason.items():
                mine[reason] = mine.get(reason, 0) + n
        for lane, n in window.finished.items():
            self._finished[lane] = self._finished.get(lane, 0) + n


async def ship_windows(stats: EdgeStats, plane: QueuePlane, interval_s: float = WINDOW_S) -> None:
    """Forever: every ``interval_s`` hand the window to the scheduler's next sample."""
    failing = False
    while True:
        await asyncio.sleep(interval_s)
        window = stats.take(int(time.time() * 1000))
        if window is None:
            continue
        try:
            await plane.fleet.push_edge_window(window)
            failing = False
        except QueueUnavailable as exc:
            if not failing:
                log.warning("stats window not shipped (kept for the next one): %s", exc)
            failing = True
            stats.restore(window)


class StatsRelay:
    """One subscription to the samples channel, fanned out to every open stream."""

    def __init__(self, plane: QueuePlane) -> None:
        self.plane = plane
        self._queues: set[asyncio.Queue[bytes]] = set()
        self.closed = False

    async def run(self) -> None:
        async for _, data in listen(self.plane.redis, [self.plane.keys.stats_channel], Backoff("stats channel", log),
                                    dead_after_s=self.plane.settings.redis_dead_after_s):
            for queue in self._queues:
                _put(queue, data)

    def close(self) -> None:
        """The edge is stopping: every open stream ends now (the dashboard reconnects to another
        edge). Before, each held the graceful shutdown up to its timeout, which then cancelled it
        with an ERROR and a traceback."""
        self.closed = True
        for queue in self._queues:
            _put(queue, _END)

    @contextlib.contextmanager
    def subscription(self) -> Iterator[asyncio.Queue[bytes]]:
        queue: asyncio.Queue[bytes] = asyncio.Queue(MAX_QUEUED_SAMPLES)
        self._queues.add(queue)
        try:
            yield queue
        finally:
            self._queues.discard(queue)


#: Put in a stream's queue by ``StatsRelay.close``: the stream ends.
_END = b""


def _put(queue: asyncio.Queue[bytes], data: bytes) -> None:
    if queue.full():  # a client that does not read loses its oldest samples, not the edge
        queue.get_nowait()
    queue.put_nowait(data)


def sse_event(at_ms: int, data: bytes) -> bytes:
    """One server-sent event; its id lets a reconnecting client say where it left off."""
    return b"id: %d\ndata: %s\n\n" % (at_ms, data)


async def sse_stream(relay: StatsRelay, plane: QueuePlane, after_ms: int) -> AsyncIterator[bytes]:
    """The stored samples newer than ``after_ms``, then each new one as it is published.

    Subscribes before reading the history, so a sample published in between is not lost; one
    that is both stored and queued is sent once (samples are sent in ``at_ms`` order).
    """
    with relay.subscription() as queue:
        yield b"retry: 1000\n\n"
        newest_ms = after_ms
        for at_ms, data in await plane.fleet.stats_history(after_ms):
            newest_ms = at_ms
            yield sse_event(at_ms, data)
        while not relay.closed:
            try:
                data = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except TimeoutError:
                yield b": keep-alive\n\n"
                continue
            if data is _END:
                return
            try:
                at_ms = sample_time_ms(data)
            except msgspec.DecodeError:
                continue
            if at_ms > newest_ms:
                newest_ms = at_ms
                yield sse_event(at_ms, data)
