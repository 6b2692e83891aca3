"""The dashboard's numbers, pure: log-bucket histograms, the edge's one-second window and the
scheduler's merge of windows, depth snapshot and worker reports into one sample. No Redis, no
event loop."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from lanes.queue.messages import DepthSnapshot, WorkerReport
from lanes.queue.stats import NO_LANE, EdgeWindow, StatsSample
from lanes.scheduler import histogram
from lanes.scheduler.sampling import Sampler, worker_stats
from lanes.ws_server.delivery import Finished
from lanes.ws_server.stats import EdgeStats, sse_event

# -- histograms ------------------------------------------------------------------------


def test_buckets_hold_their_values_within_two_percent() -> None:
    for value in (0.15, 1.0, 7.3, 42.0, 999.0, 12_345.6, 3_600_000.0):
        bucket = histogram.bucket_of(value)
        low, high = histogram.MIN_MS * histogram.GROWTH ** (bucket - 1), histogram.MIN_MS * histogram.GROWTH ** bucket
        assert low < value <= high * (1 + 1e-9), value
        assert abs(histogram.bucket_value(bucket) - value) / value < 0.021, value


def test_out_of_range_values_land_in_the_end_buckets() -> None:
    assert histogram.bucket_of(0) == histogram.bucket_of(-5) == histogram.bucket_of(math.nan) == 0
    assert histogram.bucket_of(1e12) == histogram.MAX_BUCKET
    assert histogram.MAX_BUCKET < 500


def test_percentiles_of_merged_histograms_match_the_exact_ones() -> None:
    rng = random.Random(7)
    samples = [rng.lognormvariate(4, 1.2) for _ in range(5000)]  # ms, long right tail
    parts: list[dict[int, int]] = [{}, {}, {}]
    for i, value in enumerate(samples):  # three edges, each seeing a third
        bucket = histogram.bucket_of(value)
        parts[i % 3][bucket] = parts[i % 3].get(bucket, 0) + 1
    merged = histogram.merge(parts)
    ordered = sorted(samples)
    for q in (0.5, 0.9, 0.99):
        exact = ordered[math.ceil(q * len(ordered)) - 1]
        got = histogram.percentile(merged, q)
        assert got is not None and abs(got - exact) / exact < 0.021, (q, got, exact)


def test_percentile_of_nothing_is_none_and_quantiles_are_checked() -> None:
    assert histogram.percentile({}, 0.5) is None
    assert histogram.percentile({3: 0}, 0.99) is None
    with pytest.raises(ValueError, match="quantile"):
        histogram.percentile({1: 1}, 0)
    assert histogram.percentile({10: 1}, 1.0) == round(histogram.bucket_value(10), 3)


# -- the edge's window -----------------------------------------------------------------


def test_edge_window_counts_first_tokens_refusals_and_ends_then_starts_over() -> None:
    stats = EdgeStats("edge-a", now_ms=1_000)
    assert stats.take(1_500) is None, "nothing happened: nothing to ship"
    stats.first_token("short", 0.020)
    stats.first_token("short", 0.021)
    stats.first_token("long", 1.5)
    stats.finished(Finished("r1", "medium", "overloaded", refused=True, reason="lane_full"))
    stats.finished(Finished("r2", "medium", "overloaded", refused=True, reason="lane_full"))
    stats.finished(Finished("r3", NO_LANE, "rate_limited", refused=True))
    stats.finished(Finished("r4", "short", "stop", e2e_s=0.5))
    stats.finished(Finished("r5", "short", "cancelled", e2e_s=0.2))
    stats.finished(Finished("r6", "short", "resumed_elsewhere"))  # ends on the edge that took it over
    stats.finished(Finished("r7", "resumed", "stop", e2e_s=0.1))  # taken over here: lane unknown
    window = stats.take(2_500)
    assert window is not None and (window.edge, window.start_ms, window.end_ms) == ("edge-a", 1_500, 2_500)
    assert sum(window.ttft_ms["short"].values()) == 2 and sum(window.ttft_ms["long"].values()) == 1
    assert window.refusals == {"medium": {"lane_full": 2}, NO_LANE: {"rate_limited": 1}}
    assert window.finished == {"short": 2}
    assert stats.take(3_000) is None, "taken windows start over"


def test_a_fixed_answer_counts_in_its_lane_not_in_its_pools_ttft() -> None:
    """The edge's own answers (0.1 ms) read, in the pool's TTFT, as the pool's model answering in
    0.1 ms at the median (found in a multi-pool audit)."""
    stats = EdgeStats("edge-a", now_ms=0)
    stats.first_token("short", 0.050, pool="large")
    for _ in range(5):
        stats.first_token("fixed", 0.0001, pool="large")
    window = stats.take(1_000)
    assert window is not None and sum(window.ttft_ms["fixed"].values()) == 5
    assert sum(window.pool_ttft_ms["large"].values()) == 1


def test_an_unshipped_window_is_merged_into_the_next() -> None:
    stats = EdgeStats("edge-a", now_ms=0)
    stats.first_token("short", 0.01)
    stats.finished(Finished("r1", "short", "overloaded", refused=True, reason="no_capacity"))
    first = stats.take(1_000)
    assert first is not None
    stats.first_token("short", 0.01)
    stats.restore(first)  # Redis was down
    second = stats.take(2_000)
    assert second is not None and second.start_ms == 0 and second.end_ms == 2_000
    assert sum(second.ttft_ms["short"].values()) == 2 and second.refusals == {"short": {"no_capacity": 1}}


# -- the scheduler's merge -------------------------------------------------------------


def snapshot(at_ms: int, pending: dict[str, int], running: dict[str, int] | None = None) -> DepthSnapshot:
    return DepthSnapshot(at_ms=at_ms, pending=pending, running=running or {lane: 0 for lane in pending},
                         oldest_wait_ms={lane: 100 * n for lane, n in pending.items()}, workers=2)


def window(edge: str, ttft: dict[str, list[float]], refusals: dict[str, dict[str, int]] | None = None,
           finished: dict[str, int] | None = None) -> EdgeWindow:
    histograms: dict[str, dict[int, int]] = {}
    for lane, values in ttft.items():
        for value in values:
            bucket = histogram.bucket_of(value)
            histograms.setdefault(lane, {})[bucket] = histograms.setdefault(lane, {}).get(bucket, 0) + 1
    return EdgeWindow(edge, 0, 1000, histograms, refusals or {}, finished or {})


def test_sample_merges_the_snapshot_the_windows_and_the_reports() -> None:
    reports = [
        WorkerReport("w2", {"short": 1, "long": 2}, 8, tokens_per_s=40.0, pool="small",
                     engine={"engine": "vllm", "kv_cache_usage": 0.25, "spec_acceptance_rate": 0.6}),
        WorkerReport("w1", {"medium": 0}, 4, tokens_per_s=10.5, engine={"engine": "hf", "acceptance": None}),
    ]
    windows = [window("a", {"short": [10.0] * 99 + [500.0]}, {"short": {"lane_full": 2}}, {"short": 5}),
               window("b", {"short": [10.0]}, {"short": {"lane_full": 1, "deadline_unmeetable": 1},
                                                NO_LANE: {"no_workers": 3}}, {"medium": 1})]
    snap = snapshot(9_900, {"short": 4, "medium": 0, "long": 7}, {"short": 1, "medium": 0, "long": 2})
    sample = Sampler().sample(10_000, snap, reports, windows)
    assert sample.at_ms == 10_000 and sample.depths_at_ms == 9_900 and sample.num_edges == 2
    assert list(sample.lanes) == ["short", "medium", "long"]
    short, long = sample.lanes["short"], sample.lanes["long"]
    assert (short.depth, short.running, short.oldest_wait_ms) == (4, 1, 400)
    assert (long.depth, long.running, long.oldest_wait_ms) == (7, 2, 700)
    assert short.num_first_tokens == 101 and short.ttft_p50_ms == pytest.approx(10.0, rel=0.021)
    assert short.ttft_p99_ms == pytest.approx(10.0, rel=0.021), "the 101st-slowest of 101 is p99's rank 100"
    assert sample.lanes["medium"].ttft_p50_ms is None and sample.lanes["medium"].num_first_tokens == 0
    assert short.refusals == {"lane_full": 3, "deadline_unmeetable": 1}
    assert sample.refusals_no_lane == {"no_workers": 3}
    assert (short.finished, sample.lanes["medium"].finished) == (5, 1)
    assert sample.tokens_per_s == 50.5
    assert [w.worker for w in sample.workers] == ["w1", "w2"]
    w1, w2 = sample.workers
    assert (w2.pool, w2.engine, w2.slots, w2.running) == ("small", "vllm", 8, {"short": 1, "long": 2})
    assert (w2.kv_cache_usage, w2.spec_acceptance) == (0.25, 0.6)
    assert (w1.kv_cache_usage, w1.spec_acceptance, w1.running) == (None, None, {})


def test_ttft_percentiles_cover_the_trailing_window_only() -> None:
    sampler = Sampler(ttft_window_s=3)
    assert sampler.sample(1_000, None, [], [window("a", {"short": [1000.0] * 10})]).lanes["short"].ttft_p50_ms \
        == pytest.approx(1000, rel=0.021)
    sampler.sample(2_000, None, [], [window("a", {"short": [10.0] * 30})])
    mixed = sampler.sample(3_000, None, [], [])
    assert mixed.lanes["short"].num_first_tokens == 40
    assert mixed.lanes["short"].ttft_p99_ms == pytest.approx(1000, rel=0.021)
    later = sampler.sample(4_500, None, [], [])  # the 1 s sample is older than 3 s now
    assert later.lanes["short"].num_first_tokens == 30 and later.lanes["short"].ttft_p99_ms == pytest.approx(10, rel=0.021)
    assert sampler.sample(9_000, None, [], []).lanes["short"].num_first_tokens == 0


def test_each_pool_gets_its_own_ttft_across_edges_and_the_window() -> None:
    """With two models side by side the lane table adds their first tokens up; each pool's row
    has its own TTFT (through the edge's window, merged over edges and the trailing window)."""
    edges = [EdgeStats("a", 0), EdgeStats("b", 0)]
    for i in range(50):
        edges[i % 2].first_token("short", 0.02, "small")
        edges[i % 2].first_token("short", 2.0, "large")
    edges[0].first_token("medium", 4.0, "large")
    sampler = Sampler(ttft_window_s=5)
    windows = [e.take(1_000) for e in edges]
    pools = [DepthSnapshot(at_ms=900, pending={"short": 1}, running={"short": 0}, oldest_wait_ms={}, workers=1,
                           pool=name) for name in ("small", "large")]
    sampler.sample(1_000, None, [], [w for w in windows if w is not None], pools)
    sample = sampler.sample(2_000, None, [], [], pools)  # no new first token: the window still holds them
    small, large = sample.pools["small"], sample.pools["large"]
    assert small.ttft_p50_ms == pytest.approx(20, rel=0.021) and small.ttft_p99_ms == pytest.approx(20, rel=0.021)
    assert large.ttft_p50_ms == pytest.approx(2000, rel=0.021) and large.ttft_p99_ms == pytest.approx(4000, rel=0.021)
    assert sample.lanes["short"].num_first_tokens == 100, "the lane table still adds the pools up"
    assert sampler.sample(9_000, None, [], [], pools).pools["small"].ttft_p99_ms is None


def test_no_snapshot_yet_gives_zero_depths_and_every_lane() -> None:
    sample = Sampler().sample(5_000, None, [], [])
    assert sample.depths_at_ms == 0 and sample.workers == [] and sample.tokens_per_s == 0
    assert {lane: s.depth for lane, s in sample.lanes.items()} == {"short": 0, "medium": 0, "long": 0}


def test_samples_round_trip_as_json() -> None:
    sample = Sampler().sample(5_000, snapshot(4_900, {"short": 1, "medium": 2, "long": 3}),
                              [WorkerReport("w", {"short": 1}, 8)], [window("a", {"medium": [5.0]})])
    data = msgspec.json.encode(sample)
    assert msgspec.json.decode(data, type=StatsSample) == sample
    assert sse_event(sample.at_ms, data) == b"id: 5000\ndata: " + data + b"\n\n"
    assert b"\n" not in data, "one data line per event"


def test_worker_stats_ignore_non_numbers() -> None:
    report = WorkerReport("w", {}, 2, engine={"engine": 3, "kv_cache_usage": True, "kv_cache_usage_perc": 0.5,
                                              "acceptance": "n/a"})
    stats = worker_stats(report)
    assert (stats.engine, stats.kv_cache_usage, stats.spec_acceptance) == ("", 0.5, None)


def test_a_silent_workers_age_is_in_the_sample_and_its_tokens_leave_the_total() -> None:
    """``kill -9`` leaves a worker live for 10 s: its last report must say how old it is."""
    from lanes.queue.stats import SILENT_AFTER_MS

    reports = [WorkerReport("fresh", {"short": 1}, 4, tokens_per_s=10.0),
               WorkerReport("quiet", {"short": 2}, 4, tokens_per_s=30.0)]
    heard = {"fresh": 9_700, "quiet": 10_000 - SILENT_AFTER_MS - 1500}
    sample = Sampler().sample(10_000, None, reports, [], heard_at_ms=heard)
    assert [(w.worker, w.silent_ms) for w in sample.workers] == [("fresh", 300), ("quiet", SILENT_AFTER_MS + 1500)]
    assert sample.workers[1].running == {"short": 2}, "its last report, kept for the dashboard to dim"
    assert sample.tokens_per_s == 10.0, "the silent worker's last tokens/s is not the fleet's now"


def test_the_sample_says_which_workers_are_silent() -> None:
    """The sample carries the decision (``silent``), so the dashboard holds no copy of the bound:
    past ``SILENT_AFTER_MS`` silent, at it not yet; and it crosses the wire as JSON."""
    from lanes.queue.stats import SILENT_AFTER_MS

    reports = [WorkerReport(name, {}, 4) for name in ("at", "fresh", "past")]
    heard = {"fresh": 10_000, "at": 10_000 - SILENT_AFTER_MS, "past": 10_000 - SILENT_AFTER_MS - 1}
    sample = Sampler().sample(10_000, None, reports, [], heard_at_ms=heard)
    assert [(w.worker, w.silent) for w in sample.workers] == [("at", False), ("fresh", False), ("past", True)]
    assert [w["silent"] for w in msgspec.json.decode(msgspec.json.encode(sample))["workers"]] == [False, False, True]


def test_a_sample_lists_at_most_the_newest_lost_workers_and_counts_them_all() -> None:
    from lanes.queue.stats import MAX_LOST_SHOWN, LostWorker

    lost = [LostWorker(f"w{i}", "default", 10_000 - i) for i in range(MAX_LOST_SHOWN + 5)]
    sample = Sampler().sample(20_000, None, [], [], lost=lost, num_lost=40)
    assert sample.lost_workers == lost[:MAX_LOST_SHOWN] and sample.num_lost_workers == 40
    assert Sampler().sample(20_000, None, [], [], lost=lost[:2]).num_lost_workers == 2
    assert Sampler().sample(20_000, None, [], []).lost_workers == []
