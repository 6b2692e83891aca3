"""The edge's side of admission control: the latest depth snapshot plus what this edge
enqueued since, fed to the pure ``scheduler.admission.admit``.

Between snapshots (every 0.5 s) a burst would otherwise look like an empty lane, so the
edge counts its own enqueues on top of the last snapshot. Without a fresh snapshot (the
scheduler is down) it admits: refusing everything would turn a monitoring outage into an
outage of the service.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Iterator

import msgspec
from lanes.queue.keys import DEFAULT_POOL
from lanes.queue.messages import DepthSnapshot, Lane
from lanes.scheduler.admission import (
    AdmissionConfig,
    AdmissionDecision,
    admit,
    refusal_in_every_lane,
)
from lanes.ws_server.settings import EdgeSettings

log = logging.getLogger(__name__)

_decoder = msgspec.json.Decoder(DepthSnapshot)
#: A snapshot older than this is ignored (ms).
_STALE_MS = 5_000


class EdgeAdmission:
    """Admission per model pool, from each pool's latest depth snapshot."""

    def __init__(self, settings: EdgeSettings) -> None:
        self.config = AdmissionConfig(max_depth={
            Lane.SHORT: settings.max_depth_short, Lane.MEDIUM: settings.max_depth_medium,
            Lane.LONG: settings.max_depth_long,
        })
        self.default_deadline_ms = settings.default_deadline_ms or None
        #: Per pool: the latest snapshot and when it arrived (monotonic s).
        self._snapshots: dict[str, tuple[DepthSnapshot, float]] = {}
        #: Per pool: this edge's enqueues (wall-clock ms when Redis confirmed them, lane, request
        #: id) that the latest snapshot may not count yet.
        self._since: dict[str, deque[tuple[float, Lane, str]]] = {}
        #: The same per lane (kept with the list: admission reads it on every request).
        self._since_count: dict[str, Counter[Lane]] = {}
        #: Those still counted, by request id: one this edge sees start or end is no longer
        #: waiting, whatever the last snapshot says (else one client's requests in a row, each
        #: done in 30 ms, counted as a queue for the snapshot's half second).
        self._counted: dict[str, tuple[str, Lane]] = {}
        self._predicting: Counter[str] = Counter()
        #: Per pool: admitted requests whose enqueue Redis has not confirmed yet (counted as pending,
        #: or concurrent admissions between a decision and its enqueue would all see the same room).
        self._enqueueing: dict[str, Counter[Lane]] = {}

    def observe(self, data: bytes) -> None:
        try:
            snapshot = _decoder.decode(data)
        except msgspec.DecodeError:
            log.warning("ignoring malformed depth snapshot")
            return
        self._snapshots[snapshot.pool] = (snapshot, time.monotonic())
        # The snapshot (Redis time at_ms, taken before it read the depths) counts what was enqueued
        # before at_ms; later enqueues stay counted here. Clearing them all lost the enqueues that
        # landed while the snapshot was on its way, and a burst straddling it over-admitted.
        self._forget(snapshot.pool, snapshot.at_ms)

    def enqueued(self, pool: str, lane: Lane, request_id: str = "") -> None:
        now_ms = time.time() * 1000.0
        self._since.setdefault(pool, deque()).append((now_ms, lane, request_id))
        self._since_count.setdefault(pool, Counter())[lane] += 1
        if request_id:
            self._counted[request_id] = (pool, lane)
        self._forget(pool, now_ms - _STALE_MS)  # bounded even when no snapshot comes

    def left_lane(self, request_id: str) -> None:
        """``request_id`` (enqueued here) started or ended: it waits in no lane any more."""
        if (found := self._counted.pop(request_id, None)) is not None:
            self._since_count[found[0]][found[1]] -= 1

    def _forget(self, pool: str, before_ms: float) -> None:
        recent = self._since.get(pool)
        while recent and recent[0][0] <= before_ms:
            _, lane, request_id = recent.popleft()
            if not request_id or self._counted.pop(request_id, None) is not None:
                self._since_count[pool][lane] -= 1

    def fresh(self, pool: str = DEFAULT_POOL) -> DepthSnapshot | None:
        """``pool``'s latest snapshot if it is recent enough to act on."""
        found = self._snapshots.get(pool)
        if found is None or (time.monotonic() - found[1]) * 1000 > _STALE_MS:
            return None
        return found[0]

    def num_workers(self, pool: str | None = None) -> int | None:
        """Live (warm) workers of ``pool`` (all pools: None) per the fresh snapshots; None when
        unknown (no scheduler)."""
        snapshots = [s for p in (self._snapshots if pool is None else [pool]) if (s := self.fresh(p))]
        return sum(s.workers for s in snapshots) if snapshots else None

    def pools(self) -> list[str]:
        """Pools the scheduler snapshots (fresh ones)."""
        return sorted(p for p in self._snapshots if self.fresh(p))

    def scales_from_zero(self, pool: str) -> bool:
        """Whether the scheduler lets ``pool`` stand at zero workers (``LANES_MIN_WORKERS=0``),
        per its fresh snapshot: then a chat waits in the lane for the worker an autoscaler
        starts, rather than being refused."""
        snapshot = self.fresh(pool)
        return snapshot is not None and snapshot.scales_from_zero

    def live_pools(self) -> list[str]:
        """Pools whose fresh snapshot counts a live worker."""
        return sorted(p for p in self._snapshots if (s := self.fresh(p)) and s.workers > 0)

    def decide(self, pool: str, lane: Lane, deadline_ms: int | None) -> AdmissionDecision:
        snap = self.fresh(pool)
        if snap is None:
            return AdmissionDecision(True, 0.0)
        depth, rates = self._state(pool, snap)
        deadline = deadline_ms if deadline_ms is not None else self.default_deadline_ms
        return admit(lane, deadline, depth, rates, self.config)

    def refusal_in_every_lane(self, pool: str, deadline_ms: int | None) -> AdmissionDecision | None:
        """The refusal when no lane of ``pool`` could take a request now, else None (asked before
        the length prediction, ``scheduler.admission.refusal_in_every_lane``)."""
        snap = self.fresh(pool)
        if snap is None:
            return None
        depth, rates = self._state(pool, snap)
        deadline = deadline_ms if deadline_ms is not None else self.default_deadline_ms
        return refusal_in_every_lane(deadline, depth, rates, self.config, self._predicting[pool])

    @contextlib.contextmanager
    def predicting(self, pool: str) -> Iterator[None]:
        """Count a request of ``pool`` whose length is being predicted (``refusal_in_every_lane``)."""
        self._predicting[pool] += 1
        try:
            yield
        finally:
            self._predicting[pool] -= 1

    @contextlib.contextmanager
    def enqueueing(self, pool: str, lane: Lane) -> Iterator[None]:
        """Count an admitted request of ``pool`` as pending in ``lane`` until its enqueue returns
        (then ``enqueued`` counts it, if Redis took it)."""
        counts = self._enqueueing.setdefault(pool, Counter())
        counts[lane] += 1
        try:
            yield
        finally:
            counts[lane] -= 1

    def _state(self, pool: str, snap: DepthSnapshot) -> tuple[dict[Lane, int], dict[Lane, float]]:
        since = self._since_count.get(pool, Counter())
        enqueueing = self._enqueueing.get(pool, Counter())
        depth = {ln: snap.pending.get(ln.value, 0) + since[ln] + enqueueing[ln] for ln in Lane}
        return depth, {ln: snap.service_rps.get(ln.value, 0.0) for ln in Lane}
