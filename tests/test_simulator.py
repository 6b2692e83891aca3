"""The trace simulator on small synthetic traces whose answers are known."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lanes.queue.messages import Lane
from lanes.scheduler.costmodel import SpecDecoding, get_profile
from lanes.scheduler.policy import LaneThresholds, SlotConfig
from lanes.scheduler.preemption import PreemptionConfig
from lanes.scheduler.sim import predictions
from lanes.scheduler.sim.engine import EngineConfig
from lanes.scheduler.sim.metrics import summarize
from lanes.scheduler.sim.noise import kendall_tau, noisy_predictions, sigma_for_tau
from lanes.scheduler.sim.policies import LanesTuning, SimPolicy, make_policy
from lanes.scheduler.sim.run import fcfs_capacity_rps, run_policy
from lanes.scheduler.sim.simulator import simulate
from lanes.scheduler.sim.trace import Trace, synthetic

PROFILE = get_profile("l70-h100")
ONE = EngineConfig(PROFILE, max_num_seqs=1)
OPEN1 = SlotConfig(max_slots=1, max_long=1, max_medium_long=1)
PREFILL_512_MS, DECODE_1_MS = 53.4, 29.8


def policy(lanes: list[Lane], slots: SlotConfig = OPEN1, **kwargs: object) -> SimPolicy:
    return SimPolicy("test", lanes, slots, **kwargs)  # type: ignore[arg-type]


def random_trace(n: int, seed: int, mean_gap_s: float = 0.25) -> Trace:
    rng = np.random.default_rng(seed)
    return synthetic(list(np.cumsum(rng.exponential(mean_gap_s, n))), list(rng.integers(100, 2000, n)),
                     list(rng.lognormal(4.8, 0.8, n).astype(int) + 1))


def test_single_request_timing_matches_cost_model() -> None:
    trace = synthetic([0.0], [1024], [11])
    result = simulate(trace, policy([Lane.SHORT]), ONE)
    assert result.ttft_s[0] == pytest.approx(0.0779)
    assert result.e2e_s[0] == pytest.approx(0.0779 + 10 * DECODE_1_MS / 1000)


def test_short_requests_behind_a_long_one_wait_less_with_lanes() -> None:
    n = 21
    trace = synthetic([0.0] + [0.001 * i for i in range(1, n)], [512] * n, [500] + [10] * (n - 1))
    fcfs = simulate(trace, policy([Lane.MEDIUM] * n), ONE)
    by_lane = simulate(trace, policy([Lane.LONG] + [Lane.SHORT] * (n - 1)), ONE)
    assert np.all(by_lane.ttft_s[1:] <= fcfs.ttft_s[1:] + 1e-9)
    assert by_lane.finish_s.max() == pytest.approx(fcfs.finish_s.max())  # nothing to win with one slot


def test_lanes_reorder_a_backlog_and_conserve_work() -> None:
    n = 41
    trace = synthetic([0.0, 0.0005] + [0.001 * i for i in range(2, n)], [512] * n, [400, 400] + [20] * (n - 2))
    fcfs = simulate(trace, policy([Lane.MEDIUM] * n), ONE)
    lanes = simulate(trace, policy([Lane.LONG, Lane.LONG] + [Lane.SHORT] * (n - 2)), ONE)
    assert np.all(lanes.ttft_s[2:] < fcfs.ttft_s[2:] - 10.0)  # every short skips the second long one
    assert lanes.finish_s.max() == pytest.approx(fcfs.finish_s.max())
    assert lanes.num_iterations == fcfs.num_iterations
    assert lanes.e2e_s[1] > fcfs.e2e_s[1]


def test_guaranteed_share_bounds_long_wait() -> None:
    n = 400
    arrivals = [1.0] + [0.05 * i for i in range(1, n)]
    trace = synthetic(arrivals, [512] * n, [50] + [20] * (n - 1))
    engine = EngineConfig(PROFILE, max_num_seqs=2)
    lanes = [Lane.LONG] + [Lane.SHORT] * (n - 1)
    strict = SlotConfig(max_slots=2, max_long=2, max_medium_long=2)
    guarded = replace(strict, min_long=1, starve_after_ms=2000)
    starved = simulate(trace, policy(lanes, strict), engine)
    served = simulate(trace, policy(lanes, guarded), engine)
    assert served.wait_s[0] <= 2.0 + 1.0 < 10.0 < starved.wait_s[0]


def test_prefill_budget_and_batching() -> None:
    trace = synthetic([0.0] * 3, [5000, 5000, 100], [2, 2, 2])
    result = simulate(trace, policy([Lane.MEDIUM] * 3, SlotConfig(max_slots=64, max_long=64, max_medium_long=64)),
                      EngineConfig(PROFILE))
    assert result.first_token_s[0] < result.first_token_s[1]
    assert result.start_s[1] == pytest.approx(result.first_token_s[0])


def test_chunked_prefill_splits_a_prompt_over_iterations_at_the_same_total_work() -> None:
    """A 5,000-token prompt alone, budget 2,048: three prefill-only iterations, each paying the fixed
    per-iteration cost once plus its chunk's share of the unchunked prefill curve."""
    engine = EngineConfig(PROFILE, max_num_seqs=4, chunked_prefill_tokens=2048)
    result = simulate(synthetic([0.0], [5000], [3]), policy([Lane.SHORT], SlotConfig(4, 4, 4)), engine)
    fixed_ms = PROFILE.prefill_step_ms(0)
    expected_ttft_ms = PROFILE.prefill_step_ms(5000) + 2 * fixed_ms
    assert result.ttft_s[0] == pytest.approx(expected_ttft_ms / 1000)
    assert result.e2e_s[0] == pytest.approx((expected_ttft_ms + 2 * PROFILE.decode_step_ms(1)) / 1000)
    assert result.num_iterations == 3 + 2


def test_chunked_prefill_keeps_decoding_through_a_long_prompt() -> None:
    """vLLM v0 stalls every running request for a long prefill; with chunked prefill (V1) each
    decodes one token per iteration alongside the chunks. The work is the same (the chunks add up
    to the unchunked prefill; the decode steps pay the per-iteration fixed cost), so the running
    answer ends one fixed cost earlier, and the long prompt's first token comes later: its
    iterations carry the decodes."""
    trace = synthetic([0.0, 0.2], [100, 8000], [40, 2])
    lanes, slots = policy([Lane.SHORT, Lane.SHORT], SlotConfig(4, 4, 4)), EngineConfig(PROFILE, max_num_seqs=4)
    v0 = simulate(trace, lanes, slots)
    chunked = simulate(trace, lanes, replace(slots, chunked_prefill_tokens=2048))
    assert chunked.e2e_s[0] == pytest.approx(v0.e2e_s[0] - PROFILE.prefill_step_ms(0) / 1000, abs=1e-6)
    assert chunked.ttft_s[1] > v0.ttft_s[1]
    assert chunked.first_token_s[1] < chunked.finish_s[0], "the long prompt finished prefilling while it decoded"


def test_chunked_prefill_holds_a_slot_while_prefilling() -> None:
    """Two 600-token prompts fit one 1,024-token iteration (the second in part); the third waits
    for a slot (max_num_seqs 2) although the next iterations have budget left."""
    trace = synthetic([0.0, 0.0, 0.0], [600, 600, 600], [3, 3, 3])
    engine = EngineConfig(PROFILE, max_num_seqs=2, chunked_prefill_tokens=1024)
    result = simulate(trace, policy([Lane.SHORT] * 3, SlotConfig(2, 2, 2)), engine)
    assert result.start_s[0] == result.start_s[1] == 0.0
    assert result.first_token_s[1] > result.first_token_s[0], "its prompt took a second iteration"
    assert result.start_s[2] == pytest.approx(result.finish_s[0]), "the third waits for a slot, not for the budget"
    with pytest.raises(ValueError, match="more than max_num_seqs"):
        EngineConfig(PROFILE, max_num_seqs=64, chunked_prefill_tokens=64)


def test_speculative_decoding_shortens_decode() -> None:
    trace = synthetic([0.0], [512], [101])
    plain = simulate(trace, policy([Lane.SHORT]), ONE)
    spec = SpecDecoding(acceptance_rate=0.75, num_draft_tokens=3, draft_cost_ratio=0.0)
    fast = simulate(trace, policy([Lane.SHORT]), EngineConfig(PROFILE, max_num_seqs=1, spec=spec))
    steps = int(np.ceil(100 / spec.tokens_per_step()))
    assert fast.e2e_s[0] == pytest.approx((PREFILL_512_MS + steps * DECODE_1_MS) / 1000)
    assert fast.e2e_s[0] < plain.e2e_s[0]


def test_queue_key_lets_a_shorter_later_request_go_first() -> None:
    trace = synthetic([0.0, 0.01, 0.02], [512] * 3, [50, 300, 10])
    fifo = simulate(trace, policy([Lane.LONG] * 3), ONE)
    keyed = simulate(trace, policy([Lane.LONG] * 3, queue_key=np.array([0.0, 300.0, 10.0])), ONE)
    assert fifo.start_s[1] < fifo.start_s[2] and keyed.start_s[2] < keyed.start_s[1]
    assert keyed.finish_s.max() == pytest.approx(fifo.finish_s.max())


def test_demotion_frees_short_capacity_and_stops_long_claims() -> None:
    # Two slots, at most one long. Request 0 was predicted short but runs 400 tokens; a long-lane
    # request arrives at 2 s and a short one at 3 s.
    trace = synthetic([0.0, 2.0, 3.0], [512] * 3, [400, 300, 10])
    lanes = [Lane.SHORT, Lane.LONG, Lane.SHORT]
    slots = SlotConfig(max_slots=2, max_long=1, max_medium_long=1)
    engine = EngineConfig(PROFILE, max_num_seqs=2)
    blind = simulate(trace, policy(lanes, slots), engine)
    demoting = simulate(trace, policy(lanes, slots, demotion=LaneThresholds(20, 20)), engine)
    assert blind.start_s[1] == pytest.approx(2.0, abs=0.05)  # the long one took the second slot...
    assert blind.ttft_s[2] > 5.0  # ...so the short one waited for a slot
    assert demoting.ttft_s[2] < 0.1  # request 0 counts as long: its slot is not the short lane's
    assert demoting.start_s[1] > demoting.finish_s[0] - 1e-9  # no long claim while over the cap


def handback_setup(cached: float = 0.0, short_at_s: float = 0.5,
                   **config: float) -> tuple[Trace, SimPolicy, EngineConfig]:
    """One slot: a long-lane run, then a short request that waits for it."""
    trace = synthetic([0.0, short_at_s], [512, 512], [101, 1])
    config = {"max_cost_ratio": 100.0, **config}
    preemption = PreemptionConfig(demotion=LaneThresholds(20, 20), wait_bound_ms=0.0, min_run_ms=0.0,
                                  **config)  # type: ignore[arg-type]
    return (trace, policy([Lane.LONG, Lane.SHORT], preemption=preemption, demotion=LaneThresholds(20, 20)),
            EngineConfig(PROFILE, max_num_seqs=1, prompt_cached_share=cached))


@pytest.mark.parametrize("cached", [0.0, 0.5])
def test_handback_charges_the_reprefill(cached: float) -> None:
    trace, pol, engine = handback_setup(cached)
    result = simulate(trace, pol, engine)
    assert list(result.num_preemptions) == [1, 0]
    assert result.ttft_s[1] < 0.1  # the short one did not wait for 100 decode steps
    generated = result.num_reprefill_tokens - round(512 * (1 - cached))
    assert 1 <= generated < 101
    # Same 99 decode steps as without the hand-back, plus the short prefill and the re-prefill.
    reprefill_ms = PROFILE.prefill_step_ms(result.num_reprefill_tokens)
    expected_ms = PREFILL_512_MS + 99 * DECODE_1_MS + PREFILL_512_MS + reprefill_ms
    assert result.e2e_s[0] == pytest.approx(expected_ms / 1000)
    assert result.ttft_s[0] == pytest.approx(PREFILL_512_MS / 1000)  # its first token came before


def test_capacity_is_each_policys_own_saturation_throughput() -> None:
    """``throughput_rps`` of an open-loop trace is its arrival rate whatever a policy wastes
    (the four policies of the default run: 3.669 req/s each); ``capacity_rps`` serves the same
    requests all queued at once under each policy, so MLFQ's swaps show (about 0.89 of FCFS on
    4,000 conv rows)."""
    from lanes.scheduler.sim.run import compare

    trace = random_trace(300, seed=3, mean_gap_s=0.05)
    engine = EngineConfig(PROFILE, max_num_seqs=8, chunked_prefill_tokens=2048)
    out = compare(trace, engine, 0.9, ["fcfs", "lanes", "mlfq"], predictions.oracle(trace.output_tokens))
    assert out["fcfs"]["capacity_rps"] == pytest.approx(out["fcfs"]["fcfs_capacity_rps"])
    assert out["mlfq"]["num_preemptions"] > 0
    assert out["mlfq"]["capacity_rps"] < 0.98 * out["fcfs"]["capacity_rps"]
    assert out["mlfq"]["throughput_rps"] > 0.98 * out["fcfs"]["throughput_rps"], "what throughput_rps cannot see"


def test_handback_never_near_the_end() -> None:
    # At 2.6 s the long run has generated ~85 tokens: 25 from a max_tokens of 110.
    trace, pol, engine = handback_setup(short_at_s=2.6, min_remaining_tokens=32)
    result = simulate(trace, replace(pol, max_tokens=110), engine)
    assert result.num_preemptions.sum() == 0
    # Nor near its predicted end (here the true length, 101): max_tokens rarely bound.
    assert simulate(trace, replace(pol, max_tokens=4096), engine).num_preemptions.sum() == 0
    far = replace(pol, max_tokens=4096, predicted_tokens=np.array([400, 1]))
    assert simulate(trace, far, engine).num_preemptions.sum() == 1


def test_handback_bounded_per_request() -> None:
    n = 30
    trace = synthetic([0.0] + [1.0 + 2.0 * i for i in range(n)], [100] * (n + 1), [2000] + [5] * n)
    for bound in (1, 3):
        preemption = PreemptionConfig(demotion=LaneThresholds(20, 20), wait_bound_ms=500.0, min_run_ms=0.0,
                                      max_preemptions=bound, max_cost_ratio=100.0)
        pol = policy([Lane.LONG] + [Lane.SHORT] * n, preemption=preemption, demotion=LaneThresholds(20, 20))
        result = simulate(trace, pol, ONE)
        assert result.num_preemptions[0] == bound
        assert np.isfinite(result.finish_s).all()


def test_mlfq_preempts_by_swapping_without_reprefill() -> None:
    trace = synthetic([0.0, 3.0], [512, 512], [200, 5])
    result = simulate(trace, make_policy("mlfq", trace, trace.output_tokens, 1), ONE)
    assert list(result.num_preemptions) == [1, 0]
    assert result.num_reprefill_tokens == 0
    assert result.ttft_s[1] < 0.1
    plain_ms = PREFILL_512_MS + 199 * DECODE_1_MS
    assert result.e2e_s[0] * 1000 > plain_ms + PREFILL_512_MS  # waited for the short one, paid a swap


def test_engine_priority_serves_the_shortest_prediction_first() -> None:
    trace = synthetic([0.0, 0.01, 0.02], [512] * 3, [50, 300, 10])
    pol = make_policy("priority", trace, np.array([50.0, 300.0, 10.0]), 1)
    result = simulate(trace, pol, ONE)
    assert result.start_s[2] < result.start_s[1]


def test_policies_end_to_end_on_a_random_trace() -> None:
    trace = random_trace(600, seed=1)
    engine = EngineConfig(PROFILE, max_num_seqs=8)
    scaled = trace.time_scaled(0.9 * fcfs_capacity_rps(trace, engine, 2) / trace.rate_rps)
    results = {}
    for name in ("fcfs", "lanes", "lanes-static", "priority", "mlfq", "oracle-2q", "oracle-sjf", "lanes-oracle"):
        result = run_policy(scaled, make_policy(name, scaled, scaled.output_tokens * 1.0, 8), engine, num_workers=2)
        assert np.isfinite(result.finish_s).all()
        results[name] = summarize(result, scaled.output_tokens)
    assert results["oracle-2q"]["short"]["ttft_s_p99"] < results["fcfs"]["short"]["ttft_s_p99"]
    assert results["lanes"]["throughput_rps"] == pytest.approx(results["fcfs"]["throughput_rps"], rel=0.05)
    assert 0.0 <= results["lanes"]["short"]["ttft_within_1s"] <= results["lanes"]["short"]["ttft_within_30s"] <= 1.0
    with pytest.raises(ValueError, match="known"):
        make_policy("sjf", scaled, scaled.output_tokens, 8)


def test_lanes_with_a_random_predictor_stay_close_to_fcfs() -> None:
    # The safety property: predictions without skill route (almost) nothing to the long lane.
    trace = random_trace(3000, seed=4, mean_gap_s=0.1)
    engine = EngineConfig(PROFILE, max_num_seqs=8)
    scaled = trace.time_scaled(0.88 * fcfs_capacity_rps(trace, engine) / trace.rate_rps)
    fcfs = summarize(run_policy(scaled, make_policy("fcfs", scaled, scaled.output_tokens, 8), engine),
                     scaled.output_tokens)
    for seed in (0, 1, 2):
        blind = predictions.shuffled(predictions.oracle(scaled.output_tokens), scaled.output_tokens, seed)
        assert abs(blind.tau) < 0.05
        lanes = summarize(run_policy(scaled, make_policy("lanes", scaled, blind.tokens, 8), engine),
                          scaled.output_tokens)
        for group in ("short", "long"):
            for metric in ("ttft_s_p99", "e2e_s_p99"):
                assert lanes[group][metric] <= 1.10 * fcfs[group][metric], (seed, group, metric)


def test_pairing_reuses_each_prompt_evenly_and_keeps_rank() -> None:
    trace_tokens = np.array([5, 900, 50, 400, 7, 60, 1000, 300])
    pool = np.array([10, 500, 100, 1000])
    paired = predictions.pair_prompts(trace_tokens, pool)
    assert sorted(np.bincount(paired, minlength=4)) == [2, 2, 2, 2]
    assert list(pool[paired]) == [10, 1000, 100, 500, 10, 100, 1000, 500]
    with pytest.raises(ValueError):
        predictions.pair_prompts(trace_tokens, np.array([]))


def test_fewer_rows_than_prompts_get_the_closest_distinct_prompts() -> None:
    """Rank matching spread a slice's rows over the pool's quantiles: rows of 300-320 tokens got
    prompts of 7, 261 and 460 though prompts of exactly their lengths were there. Checked against
    every assignment of distinct prompts on small random cases."""
    import itertools

    pool = np.array([7, 173, 261, 300, 310, 320, 423, 460, 561] * 3)
    assert list(pool[predictions.pair_prompts(np.array([320, 300, 310]), pool)]) == [320, 300, 310]
    assert sorted(pool[predictions.pair_prompts(np.array([100] * 5), pool)]) == [7] * 2 + [173] * 3
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 5))
        rows, prompts = rng.integers(0, 60, n), rng.integers(0, 60, int(rng.integers(n + 1, 8)))
        paired = predictions.pair_prompts(rows, prompts)
        assert len(set(paired.tolist())) == n, "each prompt at most once"
        best = min(np.abs(rows - prompts[list(c)]).sum() for c in itertools.permutations(range(len(prompts)), n))
        assert np.abs(rows - prompts[paired]).sum() == best


def test_a_pairing_seed_breaks_length_ties_at_random_and_keeps_the_pairing_as_close() -> None:
    trace_tokens = np.array([10] * 6 + [500] * 6)
    pool = np.array([10, 10, 10, 500, 500, 500])
    unseeded = predictions.pair_prompts(trace_tokens, pool)
    assert list(unseeded) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    pairings = {tuple(predictions.pair_prompts(trace_tokens, pool, seed)) for seed in range(5)}
    assert len(pairings) > 1  # different prompts for the same rows
    for paired in map(np.array, pairings):
        assert list(pool[paired]) == list(trace_tokens)  # every row still gets a prompt of its length
        assert sorted(np.bincount(paired, minlength=6)) == [2] * 6  # and each prompt is used evenly
    assert list(predictions.pair_prompts(trace_tokens, pool, 3)) == list(predictions.pair_prompts(trace_tokens, pool, 3))


def test_pool_predictions_are_charged_their_measured_latency() -> None:
    ticks = iter(np.arange(0.0, 10.0, 0.001))  # every clock read advances 1 ms
    calls: list[int] = []

    def predict(messages: object, max_tokens: int) -> int:
        calls.append(max_tokens)
        return 42

    tokens, latency_ms = predictions.predict_prompts(predict, ["a", "b"], 4096, clock=lambda: float(next(ticks)))
    assert list(tokens) == [42, 42] and len(calls) == 3  # one warm-up call
    assert latency_ms == pytest.approx([1.0, 1.0])
    trace_tokens = np.array([1, 2, 3, 4])
    pool = predictions.from_pool(trace_tokens, predictions.pair_prompts(trace_tokens, np.array([1.0, 4.0])),
                                 np.array([7.0, 9.0]), np.array([0.5, 2.0]))
    assert list(pool.tokens) == [7, 7, 9, 9] and list(pool.latency_ms) == [0.5, 0.5, 2.0, 2.0]
    assert pool.tau > 0.5


def test_noise_model_hits_target_tau() -> None:
    true = np.random.default_rng(0).lognormal(4.8, 0.9, 4000).astype(int) + 1
    sigma = sigma_for_tau(true, 0.55)
    assert kendall_tau(true, noisy_predictions(true, sigma, seed=3)) == pytest.approx(0.55, abs=0.03)


def test_the_refresh_in_the_loop_refits_and_routes_by_the_thresholds_it_ships() -> None:
    """``sim.refresh``: every ``every_s`` the rows finished by then refit the predictor, and the
    rows after are predicted by it and routed by the thresholds it carries (the live refresh)."""
    from lanes.scheduler.policy import RoutingCalibration, choose_lane
    from lanes.scheduler.predictor import load_default
    from lanes.scheduler.sim.refresh import RefreshConfig, refreshed_predictions

    n = 600
    arrival = np.arange(n, dtype=float)
    true = np.where(np.arange(n) % 2 == 0, 900, 3)
    prompts = [f"Write a detailed essay about topic {i}." if i % 2 == 0 else f"Say yes or no, case {i}."
               for i in range(n)]
    config = RefreshConfig(every_s=100, finish_delay_s=10, calibration=RoutingCalibration(min_shorts=10), folds=1)
    out = refreshed_predictions(arrival, true, prompts, load_default(), config, max_tokens=4096)
    assert [r["at_s"] for r in out.refreshes] == [100, 200, 300, 400, 500]
    assert out.refreshes[0]["observations"] == 91 and out.refreshes[0]["long_above_tokens"] is None, \
        "9 short rows held out: too few to fit thresholds, the edges keep theirs"
    assert set(out.routing[:200]) == {config.initial_routing}
    fitted = out.routing[200]
    assert fitted != config.initial_routing and fitted.medium_max_tokens == out.refreshes[1]["long_above_tokens"]
    lanes = [choose_lane(int(p), r) for p, r in zip(out.tokens, out.routing)]
    after = list(zip(lanes[200:], true[200:]))
    assert all(lane is Lane.LONG for lane, t in after if t == 900), "after the refresh the long answers go long"
    assert sum(lane is Lane.LONG for lane, t in after if t == 3) <= 2, "and all but ~1 % of the short ones short"
    assert out.seen_share == 0.0 and out.tau == out.tau_unseen and out.tau > 0.5
    with pytest.raises(ValueError, match="one prompt per row"):
        refreshed_predictions(arrival, true, prompts[:-1], load_default(), config, max_tokens=4096)


def test_the_refresh_in_the_loop_predicts_no_row_by_a_model_that_saw_its_prompt() -> None:
    """A pool smaller than the trace is reused: 60 prompts (nonsense words, so nothing in them
    tells a length) over 1,200 rows, each prompt always paired with the same length. One refit
    on the whole window recalls those lengths; cross-fitted by prompt, no row's model has seen
    its prompt, and the ranking is what the prompts' words carry: nothing."""
    from lanes.scheduler.policy import RoutingCalibration
    from lanes.scheduler.predictor import load_default
    from lanes.scheduler.sim.refresh import RefreshConfig, refreshed_predictions

    rng = np.random.default_rng(5)
    words = ["".join(rng.choice(list("bcdfghjklmnpqrstvwxz"), 7)) for _ in range(60 * 4)]
    pool = [" ".join(words[4 * j:4 * j + 4]) for j in range(60)]
    length = rng.permutation(np.geomspace(5, 1500, 60).astype(int))
    which = rng.integers(0, 60, 1200)
    arrival, true, prompts = np.arange(1200, dtype=float), length[which], [pool[j] for j in which]
    calibration = RoutingCalibration(min_shorts=10)
    recalled = refreshed_predictions(arrival, true, prompts, load_default(),
                                     RefreshConfig(every_s=100, finish_delay_s=10, calibration=calibration, folds=1),
                                     max_tokens=4096)
    crossed = refreshed_predictions(arrival, true, prompts, load_default(),
                                    RefreshConfig(every_s=100, finish_delay_s=10, calibration=calibration),
                                    max_tokens=4096)
    assert recalled.seen_share > 0.85 and recalled.tau > 0.6, "one refit recalls the reused prompts' lengths"
    assert crossed.seen_share == 0.0 and abs(crossed.tau) < 0.15, "cross-fitted: no recall, no skill to find"
    # A neighbour memory in each refit (one entry per prompt of the window) recalls nothing
    # either: a row's own prompt is never in its model's memory.
    remembered = refreshed_predictions(arrival, true, prompts, load_default(),
                                       RefreshConfig(every_s=100, finish_delay_s=10, calibration=calibration,
                                                     memory_weight=0.5), max_tokens=4096)
    assert remembered.seen_share == 0.0 and abs(remembered.tau) < 0.15
    assert not np.array_equal(remembered.tokens, crossed.tokens), "the memory took part"
    # Each model reads only the other fold's rows: at 100 s (91 finished) neither fold has the
    # 50 observations a refit needs; from 200 s on both refit.
    assert [r["at_s"] for r in crossed.refreshes] == list(range(200, 1200, 100))
    assert all(r["models"] == 2 for r in crossed.refreshes)
    with pytest.raises(ValueError, match="folds"):
        RefreshConfig(folds=0)


def test_lanes_step_aside_on_prompt_heavy_traffic() -> None:
    # Long prompts, short answers (15 % long ones): an answer's length is not what a request
    # costs, and reordering by it plus the slot caps made both classes wait longer.
    rng = np.random.default_rng(3)
    n = 3000
    output = np.where(rng.random(n) < 0.15, rng.integers(150, 400, n), rng.integers(3, 30, n))
    trace = synthetic(list(np.cumsum(rng.exponential(0.1, n))), list(rng.integers(2000, 6000, n)), list(output))
    engine = EngineConfig(PROFILE, max_num_seqs=16)
    scaled = trace.time_scaled(0.7 * fcfs_capacity_rps(trace, engine) / trace.rate_rps)
    fcfs = summarize(run_policy(scaled, make_policy("fcfs", scaled, scaled.output_tokens, 16), engine),
                     scaled.output_tokens)
    runs = {}
    for share in (0.6, 1.0):  # the default, and never
        tuning = replace(LanesTuning(), fcfs_above_prefill_share=share)
        result = run_policy(scaled, make_policy("lanes-oracle", scaled, scaled.output_tokens * 1.0, 16, tuning=tuning),
                            engine)
        runs[share] = (summarize(result, scaled.output_tokens), result.info)
    (stepped, info), (kept, kept_info) = runs[0.6], runs[1.0]
    assert info["prefill_share"] > 0.6 and info["prefill_heavy_pop_share"] > 0.9  # all but the first 100
    assert kept_info["prefill_heavy_pop_share"] == 0.0
    assert kept["long"]["ttft_s_p99"] > 2 * fcfs["long"]["ttft_s_p99"]
    for group in ("short", "long"):
        assert stepped[group]["ttft_s_p99"] <= 1.05 * fcfs[group]["ttft_s_p99"], group
