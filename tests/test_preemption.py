"""Pure tests of demotion by attained service, hand-back choice and the policy switch (no loop, no Redis)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lanes.queue.messages import Lane
from lanes.scheduler.live_policy import PolicyName, lanes_slot_config, make_live_policy
from lanes.scheduler.policy import (
    NO_BOUND_TOKENS,
    LaneThresholds,
    SlotConfig,
    effective_lane,
    lane_bound_tokens,
    lanes_to_pop,
    long_threshold_from_observations,
    running_by_lane,
    thresholds_from_shares,
)
from lanes.scheduler.preemption import (
    NEVER_MS,
    PreemptionConfig,
    RunView,
    choose_preemption,
    earn_reprefill_budget,
    expected_remaining_tokens,
    hand_back_cost,
    reprefill_tokens,
    requeue_lane,
)

S, M, L = Lane.SHORT, Lane.MEDIUM, Lane.LONG
BOUNDS = LaneThresholds(short_max_tokens=100, medium_max_tokens=400)
NOW_MS = 100_000.0
#: A re-prefill budget no test below exhausts (the budget's own test is further down).
BUDGET = 1e9


def run(id: str, lane: Lane = L, *, prompt: int = 500, generated: int = 300, max_tokens: int = 4096,
        predicted: int = 800, preempted: int = 0, started_at_ms: float = 0.0) -> RunView:
    return RunView(id, lane, prompt, generated, max_tokens, predicted, preempted, started_at_ms)


def test_effective_lane_demotes_past_the_lane_bound_and_never_promotes() -> None:
    assert [effective_lane(S, g, BOUNDS) for g in (0, 100, 101, 400, 401)] == [S, S, M, M, L]
    assert [effective_lane(M, g, BOUNDS) for g in (0, 400, 401)] == [M, M, L]
    assert effective_lane(L, 0, BOUNDS) is L  # a long request that ends early stays long
    assert lane_bound_tokens(S, BOUNDS) == 100 and lane_bound_tokens(L, BOUNDS) == float("inf")


def test_running_by_lane_counts_demoted_runs_against_the_next_lane() -> None:
    runs = [(S, 10), (S, 150), (S, 900), (M, 50), (L, 5)]
    assert running_by_lane(runs, BOUNDS) == {S: 1, M: 2, L: 2}
    assert running_by_lane(runs, None) == {S: 3, M: 1, L: 1}


def test_demotion_stops_claims_from_the_long_lane_over_its_cap() -> None:
    config = SlotConfig(max_slots=8, max_long=2, max_medium_long=8)
    runs = [(S, 900), (S, 800), (S, 5)]  # two short-lane runs that turned out long
    assert L in lanes_to_pop(running_by_lane(runs, None), {S: 1.0, L: 1.0}, config)
    assert L not in lanes_to_pop(running_by_lane(runs, BOUNDS), {S: 1.0, L: 1.0}, config)


def test_fcfs_below_pops_the_oldest_lane_until_the_short_lane_waits() -> None:
    config = SlotConfig(max_slots=8, fcfs_below_ms=5000)
    assert lanes_to_pop({}, {S: 1000.0, L: 3000.0}, config)[:2] == (L, S)
    assert lanes_to_pop({}, {S: 5000.0, L: 9000.0}, config)[:2] == (S, M)
    assert lanes_to_pop({}, {S: 1000.0, L: 3000.0}, SlotConfig(max_slots=8))[:2] == (S, M)


def test_long_threshold_from_observations_bounds_the_short_misroute() -> None:
    predicted = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 500, 600]
    observed = [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 900, 900]
    assert long_threshold_from_observations(predicted, observed, 50, 0.0) == 100
    assert long_threshold_from_observations(predicted, observed, 50, 0.1) == 90  # one short of ten may go long
    assert long_threshold_from_observations([1, 2], [900, 900], 50, 0.1) == NO_BOUND_TOKENS
    with pytest.raises(ValueError):
        long_threshold_from_observations([1], [1, 2], 50, 0.1)


def test_thresholds_from_shares() -> None:
    t = thresholds_from_shares(list(range(1, 101)), 0.5, 0.1)
    assert (t.short_max_tokens, t.medium_max_tokens) == (50, 90)
    assert thresholds_from_shares([1, 2, 3], 0.5, 0.0).medium_max_tokens == NO_BOUND_TOKENS
    with pytest.raises(ValueError):
        thresholds_from_shares([1], 0.8, 0.5)


def test_reprefill_cost_and_remaining_estimate() -> None:
    assert reprefill_tokens(1000, 200) == 1200
    assert reprefill_tokens(1000, 200, prompt_cached_share=0.75) == 450
    assert expected_remaining_tokens(run("a", generated=300, predicted=800)) == 500
    assert expected_remaining_tokens(run("a", generated=300, predicted=100)) == 300  # outlived its prediction
    assert expected_remaining_tokens(run("a", generated=300, predicted=100, max_tokens=350)) == 50


def test_no_preemption_without_an_overdue_lane_or_candidate() -> None:
    config = PreemptionConfig(demotion=BOUNDS, wait_bound_ms=5000)
    runs = [run("a")]
    assert choose_preemption(runs, {S: 4999.0}, NOW_MS, NEVER_MS, config, BUDGET) is None
    assert choose_preemption(runs, {L: 60_000.0}, NOW_MS, NEVER_MS, config, BUDGET) is None  # nothing later than long
    assert choose_preemption([run("s", S, generated=10)], {S: 9000.0}, NOW_MS, NEVER_MS, config, BUDGET) is None
    assert choose_preemption(runs, {S: 5000.0}, NOW_MS, NEVER_MS, config, BUDGET) == "a"


def test_preemption_picks_the_cheapest_reprefill_per_token_freed() -> None:
    config = PreemptionConfig(demotion=BOUNDS, wait_bound_ms=0)
    runs = [run("big-prompt", prompt=3000, generated=400, predicted=900),
            run("cheap", prompt=200, generated=400, predicted=900),
            run("nearly-done", prompt=200, generated=400, predicted=420)]
    # cheap: 600 / 500; nearly-done: 600 / 400 (twice what it generated: 800 - 400); big: 3400 / 500.
    assert choose_preemption(runs, {S: 1.0}, NOW_MS, NEVER_MS, config, BUDGET) == "cheap"
    assert choose_preemption(runs[::-1], {S: 1.0}, NOW_MS, NEVER_MS, config, BUDGET) == "cheap"


def test_preemption_is_bounded_per_request_near_the_end_and_in_time() -> None:
    config = PreemptionConfig(demotion=BOUNDS, wait_bound_ms=0, max_preemptions=2, min_remaining_tokens=32,
                              min_run_ms=1000, min_interval_ms=500)
    overdue = {S: 10.0}
    assert choose_preemption([run("a", preempted=2)], overdue, NOW_MS, NEVER_MS, config, BUDGET) is None
    assert choose_preemption([run("a", preempted=1)], overdue, NOW_MS, NEVER_MS, config, BUDGET) == "a"
    near_end = run("a", generated=4070, max_tokens=4096, predicted=8000)
    assert choose_preemption([near_end], overdue, NOW_MS, NEVER_MS, config, BUDGET) is None
    # Near the end its prediction gives: the max_tokens clients send (and the simulator's 4,096)
    # rarely bound, so that guard alone never fired in the simulator (one hand-back re-prefilled
    # 1,603 tokens to free 23).
    predicted_end = run("a", prompt=100, generated=980, max_tokens=4096, predicted=1000)
    assert choose_preemption([predicted_end], overdue, NOW_MS, NEVER_MS, config, BUDGET) is None
    assert choose_preemption([run("a", prompt=100, generated=960, max_tokens=4096, predicted=1000)], overdue,
                             NOW_MS, NEVER_MS, config, BUDGET) == "a"
    assert choose_preemption([run("a", started_at_ms=NOW_MS - 999)], overdue, NOW_MS, NEVER_MS, config, BUDGET) is None
    assert choose_preemption([run("a")], overdue, NOW_MS, NOW_MS - 499, config, BUDGET) is None
    assert choose_preemption([run("a")], overdue, NOW_MS, NOW_MS - 500, config, BUDGET) == "a"


def test_preemption_refuses_a_reprefill_dearer_than_the_slot_time_it_frees() -> None:
    config = PreemptionConfig(demotion=BOUNDS, wait_bound_ms=0, max_cost_ratio=4.0)
    code_like = run("a", prompt=2000, generated=20, predicted=100)  # 2020 tokens to free ~80
    assert choose_preemption([code_like], {S: 1.0}, NOW_MS, NEVER_MS, config, BUDGET) is None
    assert choose_preemption([code_like], {S: 1.0}, NOW_MS, NEVER_MS, replace(config, max_cost_ratio=200), BUDGET) == "a"


def test_demoted_runs_are_handed_back_only_when_asked_and_go_to_their_effective_lane() -> None:
    demoted = run("d", S, generated=450, prompt=100)
    config = PreemptionConfig(demotion=BOUNDS, wait_bound_ms=0)
    assert choose_preemption([demoted], {S: 1.0}, NOW_MS, NEVER_MS, config, BUDGET) is None
    assert choose_preemption([demoted], {S: 1.0}, NOW_MS, NEVER_MS, replace(config, hand_back_demoted=True), BUDGET) == "d"
    assert requeue_lane(demoted, config) is L
    # A medium-lane wait never takes a slot from a run counted as medium.
    medium = run("m", S, generated=150, prompt=100, predicted=1000)
    assert choose_preemption([medium], {M: 1.0}, NOW_MS, NEVER_MS, replace(config, hand_back_demoted=True), BUDGET) is None


def test_the_reprefill_budget_is_earned_by_generated_tokens_spent_by_hand_backs_and_capped() -> None:
    config = PreemptionConfig(demotion=BOUNDS, wait_bound_ms=0, max_reprefill_share=0.05, reprefill_burst_tokens=1000)
    a = run("a", prompt=500, generated=300)  # costs 800 re-prefill tokens (ratio 800 / 500 = 1.6)
    assert hand_back_cost(a, config) == 800
    assert hand_back_cost(a, replace(config, prompt_cached_share=0.5)) == 550
    assert choose_preemption([a], {S: 1.0}, NOW_MS, NEVER_MS, config, 799.0) is None
    assert choose_preemption([a], {S: 1.0}, NOW_MS, NEVER_MS, config, 800.0) == "a"
    # Within the budget the cheapest per token freed wins; past it the next that fits.
    b = run("b", prompt=100, generated=300, predicted=2000)  # 400 tokens, ratio 400 / 1700
    assert choose_preemption([a, b], {S: 1.0}, NOW_MS, NEVER_MS, config, 1000.0) == "b"
    dear = replace(b, prompt_tokens=900)  # 1,200 tokens, ratio 1200 / 1700: cheapest per token, dearest in all
    assert choose_preemption([a, dear], {S: 1.0}, NOW_MS, NEVER_MS, config, 1200.0) == "b"
    assert choose_preemption([a, dear], {S: 1.0}, NOW_MS, NEVER_MS, config, 999.0) == "a"  # not full
    # Earned at 0.05 per generated token, never past the burst: after a hand-back of 800 the
    # next one waits for 16,000 generated tokens.
    assert earn_reprefill_budget(200.0, 16_000, config) == 1000.0
    assert earn_reprefill_budget(200.0, 15_980, config) == pytest.approx(999.0)
    assert earn_reprefill_budget(0.0, 100_000, config) == 1000.0
    # A run dearer than the whole burst: a full budget pays for it, into debt (else it could
    # never be handed back); anything short of full does not; a burst of 0 pays for none.
    big = run("big", prompt=9000, generated=300, predicted=30_000)
    assert choose_preemption([big], {S: 1.0}, NOW_MS, NEVER_MS, config, 1000.0) == "big"
    assert choose_preemption([big], {S: 1.0}, NOW_MS, NEVER_MS, config, 999.0) is None
    none = replace(config, reprefill_burst_tokens=0, max_reprefill_share=0.0)
    assert choose_preemption([a], {S: 1.0}, NOW_MS, NEVER_MS, none, 0.0) is None


def test_preemption_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError):
        PreemptionConfig(max_preemptions=-1)
    with pytest.raises(ValueError):
        PreemptionConfig(prompt_cached_share=1.5)
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError):
            PreemptionConfig(max_reprefill_share=bad)
    with pytest.raises(ValueError):
        PreemptionConfig(reprefill_burst_tokens=-1)


def test_policy_switch_fcfs_is_one_open_lane() -> None:
    slots = SlotConfig(max_slots=8, max_long=2, max_medium_long=4, min_long=2)
    fcfs = make_live_policy("fcfs", BOUNDS, slots)
    assert fcfs.name is PolicyName.FCFS
    assert {fcfs.lane_for(p) for p in (1, 300, 5000)} == {M}
    assert fcfs.slots == SlotConfig(max_slots=8, max_long=8, max_medium_long=8)
    assert fcfs.preemption is None and fcfs.demotion is None
    assert fcfs.running_by_lane([(M, 5000), (M, 1)]) == {M: 2}


def test_policy_switch_lanes_routes_demotes_and_shares_bounds() -> None:
    slots = lanes_slot_config(64)
    assert (slots.min_long, slots.max_long, slots.max_medium_long, slots.fcfs_below_ms) == (6, 48, 60, 8000.0)
    lanes = make_live_policy(PolicyName.LANES, BOUNDS, slots, demotion=LaneThresholds(200, 200))
    assert [lanes.lane_for(p) for p in (100, 101, 401)] == [S, M, L]
    assert lanes.running_by_lane([(S, 250), (S, 10)]) == {L: 1, S: 1}
    assert lanes.preemption is not None and lanes.preemption.demotion == LaneThresholds(200, 200)
    plain = make_live_policy("lanes", BOUNDS, slots, demotion=None, preemption=None)
    assert plain.running_by_lane([(S, 250)]) == {S: 1} and plain.preemption is None
    with pytest.raises(ValueError, match="known: fcfs, lanes"):
        make_live_policy("sjf", BOUNDS, slots)
