"""One fleet sample per second for the dashboard, merged from what each process knows (pure).

- **Depths, oldest waits, running per lane**: the scheduler's own depth snapshot (the same
  object ``/v1/depths`` serves, named by ``depths_at_ms``).
- **TTFT, refusals, finished requests**: the edges' one-second windows (``EdgeWindow``); every
  edge's windows that arrived since the previous sample count in this one. TTFT percentiles are
  taken over the trailing ``ttft_window_s`` (one second holds too few first tokens for a p99).
- **Tokens/s, slots, KV cache, acceptance**: each live worker's latest heartbeat report, with
  how long ago it came (``silent_ms``, and ``silent`` past ``SILENT_AFTER_MS``): a worker
  killed with ``kill -9`` stays live for 10 s, and its last report must not read as now.
- **Lost workers**: those the scheduler dropped after 10 s of silence lately (recorded in
  Redis when it drops them, ``Fleet.heard_from`` / ``recently_lost``); passed in as they are.

``Sampler`` keeps the trailing TTFT histograms between calls; time comes in as ``at_ms``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from lanes.queue.keys import LANE_ORDER
from lanes.queue.messages import DepthSnapshot, WorkerReport
from lanes.queue.stats import (
    MAX_LOST_SHOWN,
    NO_LANE,
    SILENT_AFTER_MS,
    EdgeWindow,
    Histogram,
    LaneStats,
    LostWorker,
    PoolStats,
    StatsSample,
    WorkerStats,
)
from lanes.scheduler import histogram

#: Names engines give the same stat (they differ per engine; see ``workers/reporting.py``).
KV_CACHE_NAMES = ("kv_cache_usage", "kv_cache_usage_perc")
ACCEPTANCE_NAMES = ("spec_acceptance_rate", "acceptance")
LANES = tuple(lane.value for lane in LANE_ORDER)


class Sampler:
    """Builds ``StatsSample``s; remembers the last ``ttft_window_s`` of TTFT histograms."""

    def __init__(self, ttft_window_s: float = 10.0) -> None:
        self.ttft_window_s = ttft_window_s
        #: Per sample: its time, TTFT histograms by lane and by pool.
        self._recent: deque[tuple[int, dict[str, Histogram], dict[str, Histogram]]] = deque()

    def sample(self, at_ms: int, snapshot: DepthSnapshot | None, reports: Sequence[WorkerReport],
               windows: Sequence[EdgeWindow], pools: Sequence[DepthSnapshot] = (),
               heard_at_ms: Mapping[str, int] | None = None, lost: Sequence[LostWorker] = (),
               num_lost: int | None = None) -> StatsSample:
        """The fleet at ``at_ms`` (Redis clock). ``snapshot`` None: no depths known yet (zeros);
        ``pools``: each pool's own snapshot (``snapshot`` adds them up); ``heard_at_ms``: each
        worker's last heartbeat (Redis clock; one missing counts as heard now); ``lost``: workers
        dropped lately, newest first (the first ``MAX_LOST_SHOWN`` are listed), ``num_lost`` all
        of them (default ``len(lost)``)."""
        self._remember(at_ms, windows)
        recent = [by_lane for _, by_lane, _ in self._recent]
        lane_names = _lane_names(snapshot, windows)
        lanes = {lane: _lane(lane, snapshot, windows, recent) for lane in lane_names}
        heard = heard_at_ms or {}
        workers = [worker_stats(report, max(0, at_ms - heard.get(report.worker, at_ms)))
                   for report in sorted(reports, key=lambda r: r.worker)]
        return StatsSample(
            at_ms=at_ms, depths_at_ms=snapshot.at_ms if snapshot else 0, lanes=lanes,
            tokens_per_s=round(sum(w.tokens_per_s for w in workers if not w.silent), 1),
            workers=workers,
            ttft_window_s=self.ttft_window_s, num_edges=len({w.edge for w in windows}),
            refusals_no_lane=_count_reasons(windows, NO_LANE),
            pools={s.pool: self._pool(s) for s in pools},
            lost_workers=list(lost[:MAX_LOST_SHOWN]), num_lost_workers=len(lost) if num_lost is None else num_lost,
        )

    def _pool(self, snapshot: DepthSnapshot) -> PoolStats:
        ttft = histogram.merge(by_pool.get(snapshot.pool, {}) for _, _, by_pool in self._recent)
        return PoolStats(dict(snapshot.pending), dict(snapshot.running), snapshot.workers, snapshot.desired_workers,
                         max(snapshot.oldest_wait_ms.values(), default=0),
                         ttft_p50_ms=histogram.percentile(ttft, 0.5), ttft_p99_ms=histogram.percentile(ttft, 0.99))

    def _remember(self, at_ms: int, windows: Sequence[EdgeWindow]) -> None:
        merged = {lane: histogram.merge(w.ttft_ms.get(lane, {}) for w in windows)
                  for lane in {lane for w in windows for lane in w.ttft_ms}}
        by_pool = {pool: histogram.merge(w.pool_ttft_ms.get(pool, {}) for w in windows)
                   for pool in {pool for w in windows for pool in w.pool_ttft_ms}}
        self._recent.append((at_ms, merged, by_pool))
        oldest_ms = at_ms - self.ttft_window_s * 1000
        while self._recent and self._recent[0][0] <= oldest_ms:
            self._recent.popleft()


def _lane_names(snapshot: DepthSnapshot | None, windows: Sequence[EdgeWindow]) -> list[str]:
    """The three lanes first, in priority order; any other lane a process reports after them."""
    seen = set(snapshot.pending) if snapshot else set()
    for window in windows:
        seen.update(window.refusals, window.ttft_ms, window.finished)
    return list(LANES) + sorted(seen - set(LANES) - {NO_LANE})


def _count_reasons(windows: Sequence[EdgeWindow], lane: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for window in windows:
        for reason, n in window.refusals.get(lane, {}).items():
            counts[reason] = counts.get(reason, 0) + n
    return counts


def _lane(lane: str, snapshot: DepthSnapshot | None, windows: Sequence[EdgeWindow],
          recent: Sequence[Mapping[str, Histogram]]) -> LaneStats:
    ttft = histogram.merge(by_lane.get(lane, {}) for by_lane in recent)
    return LaneStats(
        depth=snapshot.pending.get(lane, 0) if snapshot else 0,
        running=snapshot.running.get(lane, 0) if snapshot else 0,
        oldest_wait_ms=snapshot.oldest_wait_ms.get(lane, 0) if snapshot else 0,
        ttft_p50_ms=histogram.percentile(ttft, 0.5), ttft_p99_ms=histogram.percentile(ttft, 0.99),
        num_first_tokens=sum(ttft.values()), refusals=_count_reasons(windows, lane),
        finished=sum(w.finished.get(lane, 0) for w in windows),
    )


def worker_stats(report: WorkerReport, silent_ms: int = 0) -> WorkerStats:
    """A worker's heartbeat report as the dashboard shows it, ``silent_ms`` after it came."""
    engine = report.engine
    name = engine.get("engine")
    return WorkerStats(
        worker=report.worker, pool=report.pool, engine=name if isinstance(name, str) else "",
        slots=report.slots, running={lane: n for lane, n in report.running.items() if n},
        tokens_per_s=report.tokens_per_s, kv_cache_usage=_number(engine, KV_CACHE_NAMES),
        spec_acceptance=_number(engine, ACCEPTANCE_NAMES), silent_ms=silent_ms,
        silent=silent_ms > SILENT_AFTER_MS,
    )


def _number(stats: Mapping[str, object], names: Iterable[str]) -> float | None:
    for name in names:
        value = stats.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None
