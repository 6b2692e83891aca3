"""Admission control: refuse at once, with a reason and a retry hint, what cannot be served.

Pure: lane depths, measured service rates and the time are arguments. The edge calls
``admit`` after choosing the lane and answers a refusal with ``overloaded`` + ``retry_after_ms``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from lanes.queue.messages import Lane
from lanes.scheduler.policy import LANE_ORDER


class RejectReason(str, enum.Enum):
    """Why a request was refused (the ``overloaded`` frame and the metric label carry it)."""

    LANE_FULL = "lane_full"
    DEADLINE = "deadline_unmeetable"
    NO_CAPACITY = "no_capacity"


@dataclass(frozen=True)
class AdmissionConfig:
    #: Most requests a lane may hold; a missing lane is unlimited.
    max_depth: Mapping[Lane, int] = field(default_factory=dict)
    #: Retry hints are clamped to this range.
    min_retry_after_ms: int = 100
    max_retry_after_ms: int = 60_000
    #: The hint when the lanes ahead drain at no measured rate (idle until now, or stuck): a
    #: wait cannot be estimated, and the largest hint would park clients for a minute after any
    #: lull (the OpenAI SDKs obey ``Retry-After`` up to 60 s).
    unmeasured_retry_after_ms: int = 2_000


@dataclass(frozen=True)
class AdmissionDecision:
    admitted: bool
    #: Expected queueing before a worker pops the request, ms.
    predicted_wait_ms: float
    reason: RejectReason | None = None
    #: When the client may try again (0 when admitted).
    retry_after_ms: int = 0


def predict_wait_ms(lane: Lane, depth: Mapping[Lane, int], service_rps: Mapping[Lane, float]) -> float:
    """Expected wait of a request joining the tail of ``lane``.

    Lanes are popped in priority order, so the requests ahead are this lane's depth plus the
    depth of every lane ahead of it; they drain at the summed measured pop rate of those
    lanes (requests/s). Returns ``inf`` when that rate is 0 and anything is ahead.
    """
    ahead = LANE_ORDER[: LANE_ORDER.index(lane) + 1]
    num_ahead = sum(depth.get(a, 0) for a in ahead)
    rate_rps = sum(service_rps.get(a, 0.0) for a in ahead)
    if num_ahead == 0:
        return 0.0
    return math.inf if rate_rps <= 0.0 else 1000.0 * num_ahead / rate_rps


def admit(
    lane: Lane,
    deadline_ms: float | None,
    depth: Mapping[Lane, int],
    service_rps: Mapping[Lane, float],
    config: AdmissionConfig,
) -> AdmissionDecision:
    """Admit or refuse a request for ``lane`` that must start within ``deadline_ms`` (None: no deadline).

    Refuses when the lane is at its depth limit, or when the predicted wait exceeds the
    deadline; ``retry_after_ms`` is how long the backlog ahead needs to shrink enough.
    """
    wait_ms = predict_wait_ms(lane, depth, service_rps)
    rate_rps = sum(service_rps.get(a, 0.0) for a in LANE_ORDER[: LANE_ORDER.index(lane) + 1])
    limit = config.max_depth.get(lane)
    if limit is not None and depth.get(lane, 0) >= limit:
        excess = depth.get(lane, 0) - limit + 1
        return _refuse(RejectReason.LANE_FULL, wait_ms, excess, rate_rps, config)
    if deadline_ms is not None and wait_ms > deadline_ms:
        if math.isinf(wait_ms):
            return _refuse(RejectReason.NO_CAPACITY, wait_ms, 1, 0.0, config)
        excess = math.ceil((wait_ms - deadline_ms) * rate_rps / 1000.0)
        return _refuse(RejectReason.DEADLINE, wait_ms, excess, rate_rps, config)
    return AdmissionDecision(True, wait_ms)


def refusal_in_every_lane(
    deadline_ms: float | None,
    depth: Mapping[Lane, int],
    service_rps: Mapping[Lane, float],
    config: AdmissionConfig,
    undecided: int = 0,
) -> AdmissionDecision | None:
    """None when some lane would ``admit`` a request now; else the refusal to retry soonest.

    The edge asks this before it predicts a length: a request that no lane could take is refused
    without paying for the prediction, so a burst's refusals come back at once however costly the
    predictor is. ``undecided``: requests past this check whose length is still being predicted;
    each will take a place in some lane, so once they alone fill the room the depth limits leave,
    every lane counts as full.
    """
    room = sum(max(0, config.max_depth[lane] - depth.get(lane, 0)) if lane in config.max_depth else math.inf
               for lane in LANE_ORDER)
    if undecided >= room:
        depth = {lane: max(depth.get(lane, 0), config.max_depth[lane]) for lane in LANE_ORDER}
    decisions = [admit(lane, deadline_ms, depth, service_rps, config) for lane in LANE_ORDER]
    if any(d.admitted for d in decisions):
        return None
    return min(decisions, key=lambda d: d.retry_after_ms)


def _refuse(reason: RejectReason, wait_ms: float, num_excess: int, rate_rps: float,
            config: AdmissionConfig) -> AdmissionDecision:
    retry_ms = config.unmeasured_retry_after_ms if rate_rps <= 0 else 1000.0 * num_excess / rate_rps
    retry_ms = min(max(retry_ms, config.min_retry_after_ms), config.max_retry_after_ms)
    return AdmissionDecision(False, wait_ms, reason, int(math.ceil(retry_ms)))
