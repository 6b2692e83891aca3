"""Fleet statistics that cross Redis (msgspec, JSON): each edge's one-second window and the
scheduler's one sample per second that the dashboard draws.

An edge measures what only it sees (time to first token, refusals) and ships a small window
of it every second; the scheduler merges every edge's windows with its depth snapshot and the
workers' reports into one ``StatsSample`` (``scheduler/sampling.py``) and keeps the last 15
minutes of them in Redis. Units live in field names.
"""

from __future__ import annotations

import msgspec

#: The lane of a refusal that came before a lane was chosen (no worker, rate limit, Redis down).
NO_LANE = "none"
#: The lane a fixed answer reports (the edge's own answer: it never waits in one).
FIXED_LANE = "fixed"
#: A log-bucket histogram: bucket index -> count (``scheduler/histogram.py`` maps ms to buckets).
Histogram = dict[int, int]


class EdgeWindow(msgspec.Struct, frozen=True):
    """What one edge saw between ``start_ms`` and ``end_ms`` (its wall clock)."""

    edge: str
    start_ms: int
    end_ms: int
    #: Lane -> histogram of times to first token (ms).
    ttft_ms: dict[str, Histogram] = {}
    #: Lane (``NO_LANE`` before a lane was chosen) -> reason -> requests refused.
    refusals: dict[str, dict[str, int]] = {}
    #: Lane -> requests that ended (any outcome but a refusal) on the edge that accepted them.
    finished: dict[str, int] = {}
    #: Pool -> histogram of times to first token (ms), every lane (the lanes above add up pools).
    pool_ttft_ms: dict[str, Histogram] = {}


class LaneStats(msgspec.Struct, frozen=True):
    """One lane in one sample."""

    depth: int = 0
    running: int = 0
    oldest_wait_ms: int = 0
    #: Over the last ``ttft_window_s`` of the sample (None: no first token in that time).
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    num_first_tokens: int = 0
    #: Reason -> refusals in this second.
    refusals: dict[str, int] = {}
    #: Requests that ended in this second.
    finished: int = 0


class PoolStats(msgspec.Struct, frozen=True):
    """One model pool's lanes and workers in a sample (the lane table adds every pool up)."""

    #: Waiting / running requests per lane.
    waiting: dict[str, int]
    running: dict[str, int]
    workers: int
    desired_workers: int
    oldest_wait_ms: int = 0
    #: This pool's time to first token over the sample's ``ttft_window_s``, every lane (None:
    #: no first token in that time).
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None


#: A worker not heard from for longer than this (ms) is silent, not live (four missed
#: heartbeats): its sample row says so (``WorkerStats.silent``, which the dashboard reads; it
#: holds no copy of this bound), and its tokens/s leave the sample's total.
SILENT_AFTER_MS = 2_000
#: A worker the scheduler dropped (not heard from for 10 s: killed, hung, cut off) is listed in
#: the samples as lost for this long after its last heartbeat (ms), then forgotten.
LOST_SHOWN_MS = 300_000
#: At most this many lost workers are listed in a sample (the newest); ``num_lost_workers``
#: counts them all.
MAX_LOST_SHOWN = 10


class WorkerStats(msgspec.Struct, frozen=True):
    """One worker in one sample (from its latest heartbeat report)."""

    worker: str
    pool: str = "default"
    engine: str = ""
    slots: int = 0
    #: Lane -> slots in use.
    running: dict[str, int] = {}
    tokens_per_s: float = 0.0
    #: Share of the engine's KV cache in use, 0..1 (None: the engine does not say).
    kv_cache_usage: float | None = None
    #: Share of drafted tokens accepted, 0..1 (None: no speculation).
    spec_acceptance: float | None = None
    #: How long before the sample its last heartbeat came (ms, Redis clock). Heartbeats come
    #: every ~0.5 s: past ``SILENT_AFTER_MS`` the worker has gone quiet (killed, paused, cut off
    #: from Redis) and the rest of this row is its last word, not now; it is dropped at 10 s.
    silent_ms: int = 0
    #: ``silent_ms`` is past ``SILENT_AFTER_MS``: the dashboard dims the row and leaves it out
    #: of the live count (the decision is made here, once).
    silent: bool = False


class LostWorker(msgspec.Struct, frozen=True):
    """A worker the scheduler dropped after 10 s of silence (not one that stopped cleanly: that
    one deregisters), listed for ``LOST_SHOWN_MS`` after its last heartbeat."""

    worker: str
    #: Its pool as the scheduler last knew it ("" when unknown, e.g. after a scheduler restart).
    pool: str
    #: Its last heartbeat (Redis clock, ms); the scheduler dropped it 10 s later.
    last_heard_ms: int


class StatsSample(msgspec.Struct, frozen=True):
    """The fleet in one second: what ``/v1/stats/history`` and ``/v1/stats/stream`` carry."""

    #: Redis clock (ms) when the scheduler took the sample.
    at_ms: int
    #: ``at_ms`` of the depth snapshot the depths come from (the same one ``/v1/depths`` served).
    depths_at_ms: int
    lanes: dict[str, LaneStats]
    #: Generated tokens per second over every worker that is not ``silent``.
    tokens_per_s: float
    workers: list[WorkerStats]
    #: Trailing time over which the TTFT percentiles are taken (s).
    ttft_window_s: float
    #: Edges whose windows arrived for this sample.
    num_edges: int = 0
    #: Reason -> refusals in this second that came before a lane was chosen.
    refusals_no_lane: dict[str, int] = {}
    #: Each pool's own depths and workers (``lanes`` is every pool added up).
    pools: dict[str, PoolStats] = {}
    #: Workers lost (dropped after 10 s of silence) whose last heartbeat came within the last
    #: ``lost_window_s``, newest first, at most ``MAX_LOST_SHOWN``; ``num_lost_workers`` counts
    #: all of them. A worker heard from again is live, not lost.
    lost_workers: list[LostWorker] = []
    num_lost_workers: int = 0
    lost_window_s: float = LOST_SHOWN_MS / 1000
