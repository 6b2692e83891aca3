"""The edge's admission: latest snapshot + its own enqueues since, through the pure policy."""

from __future__ import annotations

from lanes.queue.messages import DepthSnapshot, Lane, encode
from lanes.scheduler.admission import RejectReason
from lanes.ws_server.admission import EdgeAdmission
from lanes.ws_server.settings import EdgeSettings


def snapshot(short: int, rps: float) -> bytes:
    return encode(DepthSnapshot(at_ms=1, pending={"short": short, "medium": 0, "long": 0},
                                running={}, oldest_wait_ms={}, service_rps={"short": rps}))


def test_admits_without_a_snapshot() -> None:
    assert EdgeAdmission(EdgeSettings(max_depth_short=1)).decide(Lane.SHORT, 1).admitted


def test_lane_depth_limit_counts_own_enqueues_between_snapshots() -> None:
    adm = EdgeAdmission(EdgeSettings(max_depth_short=3))
    adm.observe(snapshot(short=1, rps=10.0))
    assert adm.decide(Lane.SHORT, None).admitted
    adm.enqueued(Lane.SHORT)
    adm.enqueued(Lane.SHORT)
    refused = adm.decide(Lane.SHORT, None)
    assert not refused.admitted and refused.reason is RejectReason.LANE_FULL and refused.retry_after_ms >= 100
    adm.observe(snapshot(short=0, rps=10.0))
    assert adm.decide(Lane.SHORT, None).admitted, "a new snapshot replaces the local count"


def test_deadline_from_request_or_default() -> None:
    adm = EdgeAdmission(EdgeSettings(default_deadline_ms=1000))
    adm.observe(snapshot(short=50, rps=10.0))  # 5 s of backlog ahead
    assert not adm.decide(Lane.SHORT, None).admitted
    assert adm.decide(Lane.SHORT, 10_000).admitted
    decision = adm.decide(Lane.SHORT, 2000)
    assert decision.reason is RejectReason.DEADLINE and 2500 <= decision.retry_after_ms <= 3500


def test_malformed_snapshot_is_ignored() -> None:
    adm = EdgeAdmission(EdgeSettings(max_depth_short=1))
    adm.observe(b"{garbage")
    assert adm.decide(Lane.SHORT, None).admitted
