"""The edge's side of admission control: the latest depth snapshot plus what this edge
enqueued since, fed to the pure ``scheduler.admission.admit``.

Between snapshots (every 0.5 s) a burst would otherwise look like an empty lane, so the
edge counts its own enqueues on top of the last snapshot. Without a fresh snapshot (the
scheduler is down) it admits: refusing everything would turn a monitoring outage into an
outage of the service.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import msgspec
from lanes.queue.messages import DepthSnapshot, Lane
from lanes.scheduler.admission import AdmissionConfig, AdmissionDecision, admit
from lanes.ws_server.settings import EdgeSettings

log = logging.getLogger(__name__)

_decoder = msgspec.json.Decoder(DepthSnapshot)
#: A snapshot older than this is ignored (ms).
_STALE_MS = 5_000


class EdgeAdmission:
    def __init__(self, settings: EdgeSettings) -> None:
        self.config = AdmissionConfig(max_depth={
            Lane.SHORT: settings.max_depth_short, Lane.MEDIUM: settings.max_depth_medium,
            Lane.LONG: settings.max_depth_long,
        })
        self.default_deadline_ms = settings.default_deadline_ms or None
        self._snapshot: DepthSnapshot | None = None
        self._received_at = 0.0
        self._since: Counter[Lane] = Counter()

    def observe(self, data: bytes) -> None:
        try:
            self._snapshot = _decoder.decode(data)
        except msgspec.DecodeError:
            log.warning("ignoring malformed depth snapshot")
            return
        self._received_at = time.monotonic()
        self._since.clear()

    def enqueued(self, lane: Lane) -> None:
        self._since[lane] += 1

    def fresh(self) -> DepthSnapshot | None:
        """The latest snapshot if it is recent enough to act on."""
        snap = self._snapshot
        if snap is None or (time.monotonic() - self._received_at) * 1000 > _STALE_MS:
            return None
        return snap

    def num_workers(self) -> int | None:
        """Live (warm) workers per the latest fresh snapshot; None when unknown (no scheduler)."""
        snap = self.fresh()
        return None if snap is None else snap.workers

    def decide(self, lane: Lane, deadline_ms: int | None) -> AdmissionDecision:
        snap = self.fresh()
        if snap is None:
            return AdmissionDecision(True, 0.0)
        depth = {ln: snap.pending.get(ln.value, 0) + self._since[ln] for ln in Lane}
        rates = {ln: snap.service_rps.get(ln.value, 0.0) for ln in Lane}
        deadline = deadline_ms if deadline_ms is not None else self.default_deadline_ms
        return admit(lane, deadline, depth, rates, self.config)
