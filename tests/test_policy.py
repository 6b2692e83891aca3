"""Pure tests of lane choice, slot reservation, anti-starvation and admission (no loop, no Redis)."""

from __future__ import annotations

import math

import pytest
from lanes.queue.messages import Lane
from lanes.scheduler.admission import (
    AdmissionConfig,
    RejectReason,
    admit,
    predict_wait_ms,
    refusal_in_every_lane,
)
from lanes.scheduler.policy import (
    LaneThresholds,
    RoutingCalibration,
    SlotConfig,
    choose_lane,
    eligible_lanes,
    lanes_to_pop,
    routing_from_observations,
    short_to_long_rate,
    thresholds_from_error,
    trtllm_priority,
    vllm_priority,
)

S, M, L = Lane.SHORT, Lane.MEDIUM, Lane.LONG


def running(short: int = 0, medium: int = 0, long: int = 0) -> dict[Lane, int]:
    return {S: short, M: medium, L: long}


def test_choose_lane_boundaries() -> None:
    t = LaneThresholds(short_max_tokens=100, medium_max_tokens=400)
    assert [choose_lane(n, t) for n in (1, 100, 101, 400, 401)] == [S, S, M, M, L]


def test_eligible_lanes_keeps_reserved_slots() -> None:
    config = SlotConfig(max_slots=8, max_long=4, max_medium_long=6)
    assert eligible_lanes(running(), config) == (S, M, L)
    assert eligible_lanes(running(long=4), config) == (S, M)
    assert eligible_lanes(running(medium=3, long=3), config) == (S,)
    assert eligible_lanes(running(short=8), config) == ()


def test_lanes_to_pop_plain_priority_without_starvation() -> None:
    config = SlotConfig(max_slots=8, max_long=4, max_medium_long=6, min_long=2, starve_after_ms=1000)
    ages = {S: 10.0, M: 10.0, L: 999.0}
    assert lanes_to_pop(running(), ages, config) == (S, M, L)


def test_starving_long_lane_takes_its_guaranteed_share_first() -> None:
    config = SlotConfig(max_slots=8, max_long=4, max_medium_long=6, min_long=2, starve_after_ms=1000)
    ages = {S: 10.0, L: 1000.0}
    assert lanes_to_pop(running(long=1), ages, config) == (L, S, M)
    # At its guaranteed share it falls back behind the shorter lanes.
    assert lanes_to_pop(running(long=2), ages, config) == (S, M, L)


def test_guaranteed_share_overrides_caps_but_not_a_full_worker() -> None:
    config = SlotConfig(max_slots=4, max_long=0, max_medium_long=0, min_medium=1, min_long=1, starve_after_ms=0)
    assert lanes_to_pop(running(short=1), {L: 5.0}, config) == (L, S)
    assert lanes_to_pop(running(short=4), {L: 5.0}, config) == ()


def test_longest_starving_lane_goes_first() -> None:
    config = SlotConfig(max_slots=8, min_medium=2, min_long=2, starve_after_ms=100)
    assert lanes_to_pop(running(), {M: 200.0, L: 300.0}, config)[:2] == (L, M)
    assert lanes_to_pop(running(), {M: 400.0, L: 300.0}, config)[:2] == (M, L)


def test_protected_lane_keeps_priority_under_overload() -> None:
    config = SlotConfig(max_slots=8, min_long=4, starve_after_ms=1000, protect_after_ms=500)
    assert lanes_to_pop(running(), {S: 100.0, L: 5000.0}, config)[0] == L
    assert lanes_to_pop(running(), {S: 600.0, L: 5000.0}, config)[0] == S


def test_wait_bound_pops_an_overdue_lane_first_past_caps_guarantees_and_protection() -> None:
    config = SlotConfig(max_slots=8, max_long=0, max_medium_long=0, min_long=1, starve_after_ms=1000,
                        protect_after_ms=500, max_wait_ms=10_000)
    # Below the bound: the long lane is capped at 0 and its guarantee is held off by the short lane.
    assert lanes_to_pop(running(long=0), {S: 600.0, L: 9_999.0}, config)[0] == S
    # At the bound it goes first; among overdue lanes the longest-waiting one leads.
    assert lanes_to_pop(running(long=0), {S: 600.0, L: 10_000.0}, config)[0] == L
    assert lanes_to_pop(running(), {S: 12_000.0, L: 10_000.0}, config)[:2] == (S, L)
    # Never past a full worker, and no bound by default.
    assert lanes_to_pop(running(short=8), {L: 1e9}, config) == ()
    unbounded = SlotConfig(max_slots=8, max_long=0, max_medium_long=0, borrow_when_idle=True)
    assert lanes_to_pop(running(), {S: 600.0, L: 1e9}, unbounded)[0] == S


def test_a_lane_that_could_never_run_is_named() -> None:
    """A lane capped at 0 slots with no share, no wait bound and no borrowing is never popped:
    right for a worker that leaves it to others (a worker logs it), never for a whole fleet (the
    simulator stopped with "backlog can never be popped"; bench policy refuses such flags)."""
    from lanes.scheduler.policy import lanes_never_served

    assert lanes_never_served(SlotConfig(max_slots=8, max_long=0, max_medium_long=0)) == (M, L)
    assert lanes_never_served(SlotConfig(max_slots=8, max_long=0, max_medium_long=4)) == (L,)
    assert lanes_never_served(SlotConfig(max_slots=8, max_long=0, max_medium_long=0, max_wait_ms=600_000)) == ()
    assert lanes_never_served(SlotConfig(max_slots=8, max_long=0, max_medium_long=0, min_medium=1, min_long=1)) == ()
    assert lanes_never_served(SlotConfig(max_slots=8, max_long=0, max_medium_long=0, borrow_when_idle=True)) == ()
    assert lanes_never_served(SlotConfig(max_slots=1, max_long=1, max_medium_long=1)) == ()


def test_an_empty_lane_ahead_does_not_block_a_guarantee_at_protect_after_0() -> None:
    """``protect_after_ms=0`` read an empty lane ahead as one that had waited 0 ms, so protected:
    the long lane's guarantee never applied."""
    config = SlotConfig(8, max_long=2, max_medium_long=6, min_long=3, starve_after_ms=1000, protect_after_ms=0)
    assert lanes_to_pop(running(long=2), {L: 5000.0}, config) == (L, S, M)
    assert lanes_to_pop(running(long=2), {S: 0.0, L: 5000.0}, config)[0] == S, "a waiting short lane is protected"


def test_borrow_when_idle_lets_long_use_reserved_slots() -> None:
    config = SlotConfig(max_slots=8, max_long=2, max_medium_long=2, borrow_when_idle=True)
    assert lanes_to_pop(running(long=2), {L: 1.0}, config) == (S, M, L)
    assert lanes_to_pop(running(long=2), {S: 1.0, L: 1.0}, config) == (S,)
    # Medium may borrow past the empty short lane; long may not jump waiting medium requests.
    assert lanes_to_pop(running(long=2), {M: 1.0, L: 1.0}, config) == (S, M)


def test_slot_config_rejects_oversized_guarantees() -> None:
    with pytest.raises(ValueError):
        SlotConfig(max_slots=4, min_medium=3, min_long=2)


def test_engine_priorities_follow_lane_order() -> None:
    assert [vllm_priority(x) for x in (S, M, L)] == [0, 1, 2]
    assert trtllm_priority(S) > trtllm_priority(M) > trtllm_priority(L)


def test_misroute_rate_and_thresholds_from_error() -> None:
    observed = list(range(1, 1001))
    assert short_to_long_rate([100], 0.0, 99) == 1.0
    assert short_to_long_rate([100], 0.5, 100) == pytest.approx(0.5)
    t = thresholds_from_error(observed, 0.8, max_short_to_long=0.01)
    shorts = [x for x in observed if x <= t.short_max_tokens]
    assert t.short_max_tokens == 501
    assert short_to_long_rate(shorts, 0.8, t.medium_max_tokens) <= 0.01
    assert short_to_long_rate(shorts, 0.8, t.medium_max_tokens * 0.95) > 0.01
    # Noisier predictions push the long lane further out.
    noisy, sharp = thresholds_from_error(observed, 1.0), thresholds_from_error(observed, 0.5)
    assert noisy.medium_max_tokens > sharp.medium_max_tokens
    two_lanes = thresholds_from_error(observed, 0.8, max_short_to_long=0.01, max_short_to_medium=0.0)
    assert two_lanes.short_max_tokens == two_lanes.medium_max_tokens


def test_predict_wait_counts_lanes_ahead() -> None:
    depth = {S: 10, M: 20, L: 5}
    rates = {S: 5.0, M: 5.0, L: 1.0}
    assert predict_wait_ms(S, depth, rates) == pytest.approx(2000.0)
    assert predict_wait_ms(M, depth, rates) == pytest.approx(3000.0)
    assert predict_wait_ms(L, {}, {}) == 0.0
    assert math.isinf(predict_wait_ms(L, {L: 1}, {}))


def test_admit_refuses_full_lane_and_unmeetable_deadline() -> None:
    config = AdmissionConfig(max_depth={L: 5})
    rates = {S: 5.0, M: 5.0, L: 1.0}
    ok = admit(S, 10_000, {S: 10}, rates, config)
    assert ok.admitted and ok.reason is None and ok.retry_after_ms == 0
    full = admit(L, None, {L: 5}, rates, config)
    assert (full.admitted, full.reason) == (False, RejectReason.LANE_FULL)
    assert full.retry_after_ms == 100  # 1 excess request at 11 req/s = 91 ms, clamped up
    late = admit(S, 1000, {S: 15}, rates, config)
    assert (late.admitted, late.reason) == (False, RejectReason.DEADLINE)
    assert late.predicted_wait_ms == pytest.approx(3000.0) and late.retry_after_ms == 2000
    dead = admit(L, 1000, {L: 1}, {}, AdmissionConfig())
    # No drain measured (idle until now, or stuck): a short hint, not the 60 s ceiling that
    # parked OpenAI clients for a minute after any lull.
    assert (dead.reason, dead.retry_after_ms) == (RejectReason.NO_CAPACITY, 2_000)


def test_a_request_no_lane_can_take_is_refused_before_its_lane_is_known() -> None:
    """The edge asks this before predicting a length: only when every lane would refuse."""
    config = AdmissionConfig(max_depth={S: 4, M: 4, L: 4})
    rates = {S: 5.0, M: 5.0, L: 1.0}
    assert refusal_in_every_lane(None, {S: 4, M: 4, L: 3}, rates, config) is None  # the long lane has room
    everywhere = refusal_in_every_lane(None, {S: 4, M: 6, L: 9}, rates, config)
    assert everywhere is not None and everywhere.reason is RejectReason.LANE_FULL
    # The soonest retry of the three: the short lane's (1 excess at 5 req/s = 200 ms).
    assert everywhere.retry_after_ms == min(admit(lane, None, {S: 4, M: 6, L: 9}, rates, config).retry_after_ms
                                            for lane in (S, M, L)) == 200
    # A deadline no lane can meet, with room in every lane, refuses too.
    late = refusal_in_every_lane(1000, {S: 3, M: 3, L: 3}, {S: 1.0, M: 1.0, L: 1.0}, config)
    assert late is not None and late.reason is RejectReason.DEADLINE
    # Requests whose length is still being predicted will take the room that is left: 1 + 1 + 1
    # places, so a fourth arrival behind three undecided ones is refused, a third is not.
    assert refusal_in_every_lane(None, {S: 3, M: 3, L: 3}, rates, config, undecided=2) is None
    full = refusal_in_every_lane(None, {S: 3, M: 3, L: 3}, rates, config, undecided=3)
    assert full is not None and full.reason is RejectReason.LANE_FULL
    # A lane without a depth limit always has room.
    assert refusal_in_every_lane(None, {S: 9, M: 9}, rates, AdmissionConfig(max_depth={S: 4, M: 4}),
                                 undecided=100) is None


def test_routing_from_observations_keeps_the_short_budget_and_needs_enough_shorts() -> None:
    # 400 finished requests: 200 short ones (2 tokens) predicted 1..200, 200 long ones (900) predicted 150..349.
    predicted = list(range(1, 201)) + list(range(150, 350))
    observed = [2] * 200 + [900] * 200
    routing = routing_from_observations(predicted, observed)
    # 0.5 % of 200 shorts: one may lie above; the threshold is the second-highest short prediction.
    assert routing == LaneThresholds(199, 199)
    assert sum(p > routing.medium_max_tokens for p, t in zip(predicted, observed) if t <= 2) == 1
    assert choose_lane(200, routing) is L and choose_lane(199, routing) is S, "two lanes: no medium"
    assert routing_from_observations(predicted, observed, RoutingCalibration(max_short_to_long=0.05)) == \
        LaneThresholds(190, 190)
    assert routing_from_observations(predicted[:300], observed[:300], RoutingCalibration(min_shorts=250)) is None
    assert routing_from_observations([], []) is None
    with pytest.raises(ValueError, match="one prediction per observation"):
        routing_from_observations([1, 2], [3])


def test_routing_also_holds_answers_short_by_the_longer_window_after_a_drift() -> None:
    """Traffic drifted to shorter answers: the newest 400 have median 39 while the whole window's is
    100, so the first budget covers only answers <= 40 and answers of 41-100 would go long at will."""
    shorts = [(10 + i % 30, 10 + i % 30) for i in range(200)]  # (predicted, true): <= 40, predicted low
    middle = [(300 + i, 60 + i % 40) for i in range(100)]  # 60-99 tokens, predicted 300-399
    longs = [(400 + i, 900) for i in range(100)]
    predicted, observed = [p for p, _ in shorts + middle + longs], [t for _, t in shorts + middle + longs]
    window = observed + [100] * 1200 + [900] * 1200  # the older part of the window: median 100
    newest_only = routing_from_observations(predicted, observed)
    assert newest_only == LaneThresholds(39, 39), "the newest median (39) alone: every middle answer goes long"
    routing = routing_from_observations(predicted, observed, RoutingCalibration(), window)
    held = [p for p, t in zip(predicted, observed, strict=True) if t < 100]
    assert sum(p > routing.medium_max_tokens for p in held) == int(0.025 * len(held)), \
        "at most 2.5 % of the answers shorter than the window's median go long"
    assert routing == LaneThresholds(392, 392)
    assert routing_from_observations(predicted, observed, RoutingCalibration(max_window_short_to_long=1.0),
                                     window) == newest_only, "1.0: off"
    assert routing_from_observations(predicted, [1] * 400, RoutingCalibration(), [1] * 5) == \
        routing_from_observations(predicted, [1] * 400), "never below the first budget's threshold"


def test_a_budget_of_every_short_request_sends_them_all_long() -> None:
    """At ``max_short_to_long`` 1.0 the index wrapped to the highest prediction: the threshold
    sent no short request long, where it should send them all (0.99 sent nearly all)."""
    from lanes.scheduler.policy import long_threshold_from_observations

    predicted, observed = [10, 20, 30, 40, 50], [5, 5, 5, 5, 5]
    assert long_threshold_from_observations(predicted, observed, 100, 0.8) == 10
    assert long_threshold_from_observations(predicted, observed, 100, 1.0) == 9
    assert long_threshold_from_observations(predicted, observed, 100, 0.0) == 50
