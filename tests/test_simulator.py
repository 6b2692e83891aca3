"""The trace simulator on small synthetic traces whose answers are known."""

from __future__ import annotations

import numpy as np
import pytest

from lanes.queue.messages import Lane
from lanes.scheduler.costmodel import SpecDecoding, get_profile
from lanes.scheduler.noise import kendall_tau, noisy_predictions, sigma_for_tau
from lanes.scheduler.policy import LaneOrder, SlotConfig, lane_score_ms
from lanes.scheduler.simmetrics import summarize
from lanes.scheduler.simpolicies import LanesTuning, make_policy
from lanes.scheduler.simrun import fcfs_capacity_rps, run_policy
from lanes.scheduler.simulator import EngineConfig, simulate
from lanes.scheduler.trace import synthetic

PROFILE = get_profile("l70-h100")
OPEN = SlotConfig(max_slots=1, max_long=1, max_medium_long=1)


def test_single_request_timing_matches_cost_model() -> None:
    trace = synthetic([0.0], [1024], [11])
    result = simulate(trace, [Lane.SHORT], OPEN, EngineConfig(PROFILE, max_num_seqs=1))
    assert result.ttft_s[0] == pytest.approx(0.0779)
    assert result.e2e_s[0] == pytest.approx(0.0779 + 10 * 0.0298)


def test_short_requests_behind_a_long_one_wait_less_with_lanes() -> None:
    # One slot; a long request arrives first, 20 short ones just after it.
    n = 21
    trace = synthetic([0.0] + [0.001 * i for i in range(1, n)], [512] * n, [500] + [10] * (n - 1))
    engine = EngineConfig(PROFILE, max_num_seqs=1)
    fcfs = simulate(trace, [Lane.MEDIUM] * n, OPEN, engine)
    lanes = [Lane.LONG] + [Lane.SHORT] * (n - 1)
    by_lane = simulate(trace, lanes, OPEN, engine)
    assert np.all(by_lane.ttft_s[1:] <= fcfs.ttft_s[1:] + 1e-9)
    # The long request was already running: with one slot, nothing to win.
    assert by_lane.finish_s.max() == pytest.approx(fcfs.finish_s.max())


def test_lanes_reorder_a_backlog_and_conserve_work() -> None:
    n = 41
    long_first = [0.0, 0.0005] + [0.001 * i for i in range(2, n)]
    outputs = [400, 400] + [20] * (n - 2)
    trace = synthetic(long_first, [512] * n, outputs)
    engine = EngineConfig(PROFILE, max_num_seqs=1)
    fcfs = simulate(trace, [Lane.MEDIUM] * n, OPEN, engine)
    lanes = simulate(trace, [Lane.LONG, Lane.LONG] + [Lane.SHORT] * (n - 2), OPEN, engine)
    short = slice(2, n)
    # Every short request skips the second long one (~12 s of decoding).
    assert np.all(lanes.ttft_s[short] < fcfs.ttft_s[short] - 10.0)
    # Same requests, same tokens, one slot: the last finish is the same (work conserved).
    assert lanes.finish_s.max() == pytest.approx(fcfs.finish_s.max())
    assert lanes.num_iterations == fcfs.num_iterations
    assert lanes.e2e_s[1] > fcfs.e2e_s[1]  # the second long request paid for it


def test_guaranteed_share_bounds_long_wait() -> None:
    # Two slots, a steady stream of short requests that alone keeps both slots busy.
    n = 400
    arrivals = [0.0] + [0.05 * i for i in range(1, n)]
    trace = synthetic(arrivals, [512] * n, [50] + [20] * (n - 1))
    engine = EngineConfig(PROFILE, max_num_seqs=2)
    lanes = [Lane.LONG] + [Lane.SHORT] * (n - 1)
    strict = SlotConfig(max_slots=2, max_long=2, max_medium_long=2)
    guarded = SlotConfig(max_slots=2, max_long=2, max_medium_long=2, min_long=1, starve_after_ms=2000)
    # Delay the long request behind a busy short lane by starting it late.
    starved = simulate(synthetic([1.0] + arrivals[1:], [512] * n, [50] + [20] * (n - 1)), lanes, strict, engine)
    served = simulate(synthetic([1.0] + arrivals[1:], [512] * n, [50] + [20] * (n - 1)), lanes, guarded, engine)
    assert served.wait_s[0] <= 2.0 + 1.0  # the bound plus one short request freeing a slot
    assert starved.wait_s[0] > 10.0
    assert served.wait_s[0] <= starved.wait_s[0]
    assert np.isfinite(simulate(trace, lanes, guarded, engine).finish_s).all()


def test_prefill_budget_and_batching() -> None:
    trace = synthetic([0.0] * 3, [5000, 5000, 100], [2, 2, 2])
    result = simulate(trace, [Lane.MEDIUM] * 3, SlotConfig(max_slots=64, max_long=64, max_medium_long=64),
                      EngineConfig(PROFILE))
    # 5000 + 5000 > 8192: the second prompt waits for the next prefill iteration.
    assert result.first_token_s[0] < result.first_token_s[1]
    assert result.start_s[1] == pytest.approx(result.first_token_s[0])


def test_speculative_decoding_shortens_decode() -> None:
    trace = synthetic([0.0], [512], [101])
    plain = simulate(trace, [Lane.SHORT], OPEN, EngineConfig(PROFILE, max_num_seqs=1))
    spec = SpecDecoding(acceptance_rate=0.75, num_draft_tokens=3, draft_cost_ratio=0.0)
    fast = simulate(trace, [Lane.SHORT], OPEN, EngineConfig(PROFILE, max_num_seqs=1, spec=spec))
    steps = int(np.ceil(100 / spec.tokens_per_step()))
    assert fast.e2e_s[0] == pytest.approx(0.0534 + steps * 0.0298)
    assert fast.e2e_s[0] < plain.e2e_s[0]


def test_policies_end_to_end_on_a_random_trace() -> None:
    rng = np.random.default_rng(1)
    n = 600
    trace = synthetic(list(np.cumsum(rng.exponential(0.25, n))), list(rng.integers(100, 2000, n)),
                      list(rng.lognormal(4.8, 0.8, n).astype(int) + 1))
    engine = EngineConfig(PROFILE, max_num_seqs=8)
    capacity = fcfs_capacity_rps(trace, engine, num_workers=2)
    scaled = trace.time_scaled(0.9 * capacity / trace.rate_rps)
    results = {}
    for name in ("fcfs", "lanes", "oracle-2q", "oracle-sjf"):
        result = run_policy(scaled, make_policy(name, scaled, 8, seed=0), engine, num_workers=2)
        assert np.isfinite(result.finish_s).all()
        results[name] = summarize(result, scaled.output_tokens)
    assert results["oracle-2q"]["short"]["ttft_s_p99"] < results["fcfs"]["short"]["ttft_s_p99"]
    assert results["lanes"]["throughput_rps"] == pytest.approx(results["fcfs"]["throughput_rps"], rel=0.05)


def test_noise_model_hits_target_tau() -> None:
    true = np.random.default_rng(0).lognormal(4.8, 0.9, 4000).astype(int) + 1
    sigma = sigma_for_tau(true, 0.55)
    assert kendall_tau(true, noisy_predictions(true, sigma, seed=3)) == pytest.approx(0.55, abs=0.03)


def test_score_key_lets_a_shorter_later_request_go_first_in_its_lane() -> None:
    # One slot, busy with request 0; 1 (long) and 2 (short, 10 ms later) wait in the same lane.
    trace = synthetic([0.0, 0.01, 0.02], [512] * 3, [50, 300, 10])
    engine = EngineConfig(PROFILE, max_num_seqs=1)
    order = LaneOrder(weight=1.0)
    keys = [lane_score_ms(t * 1000.0, n, order) / 1000.0 for t, n in zip([0.0, 0.01, 0.02], [50, 300, 10])]
    fifo = simulate(trace, [Lane.LONG] * 3, OPEN, engine)
    scored = simulate(trace, [Lane.LONG] * 3, OPEN, engine, queue_key=keys, age_from_key=True)
    assert fifo.start_s[1] < fifo.start_s[2]
    assert scored.start_s[2] < scored.start_s[1]
    assert scored.finish_s.max() == pytest.approx(fifo.finish_s.max())  # same work, one slot


def test_lanes_score_with_weight_zero_matches_lanes() -> None:
    rng = np.random.default_rng(2)
    n = 400
    trace = synthetic(list(np.cumsum(rng.exponential(0.2, n))), list(rng.integers(100, 2000, n)),
                      list(rng.lognormal(4.8, 0.8, n).astype(int) + 1))
    engine = EngineConfig(PROFILE, max_num_seqs=8)
    fcfs_order = LanesTuning(lane_order=LaneOrder(weight=0.0))
    plain = run_policy(trace, make_policy("lanes", trace, 8, seed=0), engine, num_workers=1)
    scored = run_policy(trace, make_policy("lanes-score", trace, 8, seed=0, tuning=fcfs_order), engine, num_workers=1)
    np.testing.assert_allclose(scored.start_s, plain.start_s)
    weighted = make_policy("lanes-score", trace, 8, seed=0)
    assert weighted.queue_key is not None and weighted.age_from_key
    assert not make_policy("lanes-score", trace, 8, tuning=LanesTuning(age_from_score=False)).age_from_key
    assert np.isfinite(run_policy(trace, weighted, engine, num_workers=1).finish_s).all()
