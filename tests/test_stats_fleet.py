"""The dashboard's statistics in a real Redis: edges' windows are merged exactly once, one
scheduler takes each second's sample, the history keeps 15 minutes and every sample is
published; the scheduler's own sample step end to end on real lanes."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from lanes.queue.backoff import Backoff
from lanes.queue.keys import STATS_HISTORY_LEN
from lanes.queue.messages import ChatMessage, Lane, RequestPayload, WorkerReport
from lanes.queue.plane import QueuePlane
from lanes.queue.pubsub import listen
from lanes.queue.settings import RedisSettings
from lanes.queue.stats import EdgeWindow, StatsSample
from lanes.scheduler.sampling import Sampler
from lanes.scheduler.service import Scheduler
from lanes.scheduler.settings import SchedulerSettings


def a_window(edge: str, n: int) -> EdgeWindow:
    return EdgeWindow(edge, 0, 1000, {"short": {50: n}}, {}, {"short": n})


async def test_windows_are_taken_once_and_in_order(plane: QueuePlane) -> None:
    fleet = plane.fleet
    assert await fleet.take_edge_windows() == []
    await asyncio.gather(*(fleet.push_edge_window(a_window(f"e{i}", i)) for i in range(20)))
    await plane.redis.rpush(plane.keys.stats_windows, b"{not json")  # skipped, not fatal
    first, second = await asyncio.gather(fleet.take_edge_windows(), fleet.take_edge_windows())
    taken = first + second
    assert sorted(w.edge for w in taken) == sorted(f"e{i}" for i in range(20)), "each window in exactly one take"
    assert await fleet.take_edge_windows() == []


async def test_one_claim_per_second(plane: QueuePlane) -> None:
    claims = await asyncio.gather(*(plane.fleet.claim_stats_second(1_796_000_000) for _ in range(5)))
    assert sorted(claims) == [False, False, False, False, True]
    assert await plane.fleet.claim_stats_second(1_796_000_001)


async def test_history_keeps_the_newest_900_and_publishes_each(plane: QueuePlane) -> None:
    fleet = plane.fleet
    got: list[bytes] = []
    subscribed = asyncio.Event()

    async def subscribe() -> None:
        async for _, data in listen(plane.redis, [plane.keys.stats_channel], Backoff("t", logging.getLogger()),
                                    subscribed.set):
            got.append(data)

    task = asyncio.create_task(subscribe())
    await asyncio.wait_for(subscribed.wait(), 5)
    sampler = Sampler()
    for i in range(STATS_HISTORY_LEN + 25):
        await fleet.append_stats_sample(sampler.sample(1_000 * (i + 1), None, [], []))
    for _ in range(100):
        if len(got) == STATS_HISTORY_LEN + 25:
            break
        await asyncio.sleep(0.05)
    task.cancel()
    assert len(got) == STATS_HISTORY_LEN + 25, "every sample published"
    stored = await fleet.stats_history()
    assert len(stored) == STATS_HISTORY_LEN
    assert [at for at, _ in stored] == [1_000 * (i + 1) for i in range(25, STATS_HISTORY_LEN + 25)]
    assert msgspec.json.decode(stored[-1][1], type=StatsSample).at_ms == stored[-1][0]
    after = await fleet.stats_history(after_ms=stored[-3][0])
    assert [at for at, _ in after] == [at for at, _ in stored[-2:]]
    assert await plane.redis.pttl(plane.keys.stats_history) > 0, "an abandoned history expires"


async def test_scheduler_sample_merges_real_depths_reports_and_windows(redis_settings: RedisSettings,
                                                                       plane: QueuePlane) -> None:
    settings = SchedulerSettings(**redis_settings.model_dump())
    scheduler = Scheduler(settings, plane)
    for i in range(3):
        payload = RequestPayload(id=f"r{i}", messages=(ChatMessage("user", "hi"),), max_tokens=8, lane=Lane.LONG)
        assert (await plane.enqueue(payload, "edge-x")).created
    now_ms = await plane.server_time_ms()
    await plane.fleet.report(WorkerReport("w1", {"short": 2}, 8, tokens_per_s=12.5, engine={"kv_cache_usage": 0.5}),
                             now_ms, ttl_ms=10_000)
    await plane.fleet.push_edge_window(EdgeWindow("edge-x", 0, 1000, {"short": {60: 4}},
                                                  {"long": {"lane_full": 2}}, {"short": 4}))
    (snapshot,) = await scheduler.snapshot_once()  # one pool: the default
    assert await scheduler.sample_once()
    (at_ms, data), *_ = await plane.fleet.stats_history()
    sample = msgspec.json.decode(data, type=StatsSample)
    assert sample.depths_at_ms == snapshot.at_ms and sample.at_ms == at_ms
    assert sample.lanes["long"].depth == 3 and sample.lanes["long"].oldest_wait_ms >= 0
    assert sample.lanes["short"].running == 2 and sample.lanes["short"].num_first_tokens == 4
    assert sample.lanes["long"].refusals == {"lane_full": 2}
    assert [(w.worker, w.tokens_per_s, w.kv_cache_usage) for w in sample.workers] == [("w1", 12.5, 0.5)]
    assert await plane.fleet.take_edge_windows() == [], "the window went into that sample"


async def test_a_worker_registers_on_the_redis_clock(plane: QueuePlane, monkeypatch) -> None:
    """The scheduler judges liveness on the Redis clock: a worker whose own clock ran 12 s behind
    registered 12 s in the past and never counted as live (its pool refused every chat)."""
    import time

    from lanes.workers.reporting import Reporter

    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 12.0)
    await Reporter(plane, "skewed", heartbeat_s=0.5, pool="default").report({}, 8, {}, {})
    now_ms = await plane.server_time_ms()
    assert abs(await plane.redis.zscore(plane.keys.workers, "skewed") - now_ms) < 2000
    assert list(await plane.fleet.heard_from(now_ms, max_age_ms=10_000)) == ["skewed"]


async def test_a_dropped_worker_is_listed_as_lost_for_a_while(redis_settings: RedisSettings, plane: QueuePlane,
                                                               monkeypatch) -> None:
    """A worker the scheduler dropped after 10 s of silence vanished from the samples without a
    word. Now it is recorded as lost when dropped and listed (with its pool) in the samples for
    ``LOST_SHOWN_MS`` after its last heartbeat; one that deregistered (a clean stop) is not
    lost, nor one heard from again; the record is bounded (``MAX_LOST_KEPT``, here 3)."""
    from lanes.queue import fleet as fleet_module
    from lanes.queue.stats import LOST_SHOWN_MS, LostWorker

    monkeypatch.setattr(fleet_module, "MAX_LOST_KEPT", 3)
    scheduler = Scheduler(SchedulerSettings(**redis_settings.model_dump()), plane)
    fleet = plane.fleet
    now_ms = await plane.server_time_ms()
    for worker in ("dies", "leaves", "returns"):
        await fleet.report(WorkerReport(worker, {}, 4, pool="small"), now_ms - 9_000, ttl_ms=60_000)
    await scheduler.snapshot_once()  # all three live: the scheduler learns their pools
    await fleet.deregister("leaves")  # a clean stop
    await fleet.report(WorkerReport("long-ago", {}, 4), now_ms - LOST_SHOWN_MS - 1000, ttl_ms=60_000)
    now_ms = await plane.server_time_ms()
    for worker in ("dies", "returns"):  # 11 s without a heartbeat
        await fleet.report(WorkerReport(worker, {}, 4, pool="small"), now_ms - 11_000, ttl_ms=60_000)
    await fleet.report(WorkerReport("live", {}, 4), now_ms, ttl_ms=60_000)
    await scheduler.snapshot_once()
    assert sorted(scheduler.heard_at_ms) == ["live"]
    await fleet.report(WorkerReport("returns", {}, 4, pool="small"), now_ms, ttl_ms=60_000)  # heard again
    await scheduler.snapshot_once()
    assert await scheduler.sample_once()
    (_, data), *_ = await fleet.stats_history()
    sample = msgspec.json.decode(data, type=StatsSample)
    assert sorted(w.worker for w in sample.workers) == ["live", "returns"]
    assert sample.lost_workers == [LostWorker("dies", "small", now_ms - 11_000)]
    assert sample.num_lost_workers == 1 and sample.lost_window_s == LOST_SHOWN_MS / 1000
    # Many lost at once: the record keeps the newest MAX_LOST_KEPT.
    for i in range(5):
        await fleet.report(WorkerReport(f"gone-{i}", {}, 4), now_ms - 20_000 + i, ttl_ms=60_000)
    await fleet.heard_from(now_ms, max_age_ms=10_000)
    assert await fleet.recently_lost(now_ms, 2) == ([("dies", now_ms - 11_000), ("gone-4", now_ms - 19_996)], 3)
