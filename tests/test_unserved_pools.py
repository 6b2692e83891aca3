"""A pool whose last worker is gone, in a real Redis: the scheduler keeps reaping and
snapshotting it, fails what waits there with ``unavailable`` after ``no_worker_timeout_s``
(the edges refuse new chats meanwhile), and forgets the pool once it has stood empty."""

from __future__ import annotations

import asyncio

import pytest
from lanes.queue.errors import ErrorCode
from lanes.queue.messages import (
    ChatMessage,
    FinishReason,
    Lane,
    RequestPayload,
    WorkerReport,
)
from lanes.queue.plane import QueuePlane
from lanes.queue.settings import RedisSettings
from lanes.scheduler import service
from lanes.scheduler.service import Scheduler
from lanes.scheduler.settings import SchedulerSettings


async def _setup(redis_settings: RedisSettings, plane: QueuePlane, timeout_s: float) -> tuple[Scheduler, QueuePlane]:
    scheduler = Scheduler(SchedulerSettings(**redis_settings.model_dump(), no_worker_timeout_s=timeout_s), plane)
    small = plane.for_pool("small")
    await plane.fleet.report(WorkerReport("w1", {}, 8, pool="small"), await plane.server_time_ms(), ttl_ms=10_000)
    for i, lane in enumerate((Lane.SHORT, Lane.LONG)):
        payload = RequestPayload(id=f"r{i}", messages=(ChatMessage("user", "hi"),), max_tokens=8, lane=lane)
        assert (await small.enqueue(payload, "edge-x")).created
    snapshots = await scheduler.snapshot_once()
    assert [(s.pool, s.workers) for s in snapshots] == [("default", 0), ("small", 1)]
    # The worker dies: it leaves the registry (a kill -9 stops its heartbeats).
    await plane.redis.zrem(plane.keys.workers, "w1")
    await plane.redis.delete(plane.keys.worker_info("w1"))
    return scheduler, small


async def test_requests_in_a_pool_without_workers_fail_after_the_timeout(redis_settings: RedisSettings,
                                                                         plane: QueuePlane) -> None:
    scheduler, small = await _setup(redis_settings, plane, timeout_s=0.3)
    snapshots = await scheduler.snapshot_once()
    assert [(s.pool, s.workers, sum(s.pending.values())) for s in snapshots] == [("default", 0, 0), ("small", 0, 2)], \
        "still snapshotted (before, the pool left the snapshots with its last worker and nothing watched it)"
    assert [await small.request_status(rid) for rid in ("r0", "r1")] == [("queued", "")] * 2, "not before the timeout"
    await asyncio.sleep(0.35)
    await scheduler.snapshot_once()
    for rid in ("r0", "r1"):
        assert await small.request_status(rid) == ("failed", "")
        (event,) = await small.read_stream(rid)
        assert event.finish is not None and event.finish.reason is FinishReason.ERROR
        assert event.finish.error_code == ErrorCode.UNAVAILABLE and "no worker of pool 'small'" in \
            (event.finish.error_message or "")
    assert await small.queued_ids() == []
    assert await small.claim("r0", "w2") is None, "a worker that comes late cannot run a failed request"


async def test_without_a_timeout_they_wait_and_an_empty_pool_is_forgotten(redis_settings: RedisSettings,
                                                                           plane: QueuePlane,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler, small = await _setup(redis_settings, plane, timeout_s=0)  # 0: they wait for a worker, however long
    monkeypatch.setattr(service, "_FORGET_POOL_MS", 0)
    await scheduler.snapshot_once()
    await asyncio.sleep(0.1)
    await scheduler.snapshot_once()
    assert sorted(await small.queued_ids()) == ["r0", "r1"], "waiting, however long"
    assert "small" in await plane.fleet.served_pools(), "not forgotten while requests wait"
    for rid in ("r0", "r1"):
        await small.cancel(rid)
    await scheduler.snapshot_once()
    assert await plane.fleet.served_pools() == set()
    assert [s.pool for s in await scheduler.snapshot_once()] == ["default"], "the configured pool stays"


async def test_the_routing_rules_pools_are_watched_before_any_worker(redis_settings: RedisSettings,
                                                                     plane: QueuePlane, tmp_path) -> None:
    """A pool the rules route to but no worker serves, and not in LANES_POOLS, had no snapshot,
    no lanes_pool_workers series and no /v1/depths: an alert on 0 workers never fired. With the
    rules in its environment the scheduler watches their pools too."""
    from pathlib import Path

    from lanes.scheduler.router.rules import RulesError

    rules = Path(__file__).resolve().parents[1] / "deploy" / "routing.toml"
    scheduler = Scheduler(SchedulerSettings(**redis_settings.model_dump(), routing_file=str(rules)), plane)
    assert [(s.pool, s.workers) for s in await scheduler.snapshot_once()] == [
        ("default", 0), ("large", 0), ("small", 0)]
    broken = tmp_path / "rules.toml"
    broken.write_text("pools = [")
    with pytest.raises(RulesError, match="LANES_ROUTING_FILE"):
        Scheduler(SchedulerSettings(**redis_settings.model_dump(), routing_file=str(broken)), plane)


async def test_a_pool_empty_for_long_gives_its_first_chat_the_whole_timeout(redis_settings: RedisSettings,
                                                                             plane: QueuePlane,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The timeout counted from when the pool stood empty: a pool scaled to zero for longer than
    the timeout failed the first chat of the morning at the next snapshot, before any worker
    could start. It counts from when requests wait. A pool that scales from zero
    (``LANES_MIN_WORKERS=0``) is never forgotten, or it could never wake."""
    monkeypatch.setattr(service, "_FORGET_POOL_MS", 0)
    scheduler = Scheduler(SchedulerSettings(**redis_settings.model_dump(), no_worker_timeout_s=0.5, min_workers=0),
                          plane)
    small = plane.for_pool("small")
    await plane.fleet.report(WorkerReport("w1", {}, 8, pool="small"), await plane.server_time_ms(), ttl_ms=10_000)
    await scheduler.snapshot_once()
    await plane.fleet.deregister("w1")
    await scheduler.snapshot_once()
    await asyncio.sleep(0.6)  # empty for longer than the timeout, with nothing waiting
    assert [s.pool for s in await scheduler.snapshot_once()] == ["default", "small"], "not forgotten"
    payload = RequestPayload(id="morning", messages=(ChatMessage("user", "hi"),), max_tokens=8, lane=Lane.SHORT)
    assert (await small.enqueue(payload, "edge-x")).created
    await scheduler.snapshot_once()
    assert await small.request_status("morning") == ("queued", ""), "it gets the whole timeout"
    await asyncio.sleep(0.3)
    later = RequestPayload(id="later", messages=(ChatMessage("user", "hi"),), max_tokens=8, lane=Lane.SHORT)
    assert (await small.enqueue(later, "edge-x")).created
    await asyncio.sleep(0.3)
    await scheduler.snapshot_once()
    # Each gets the whole timeout: the one in line for 0.3 s waits on (found in review: every
    # request failed once the oldest reached it).
    assert [await small.request_status(rid) for rid in ("morning", "later")] == [("failed", ""), ("queued", "")]
    await asyncio.sleep(0.3)
    await scheduler.snapshot_once()
    assert await small.request_status("later") == ("failed", "")


async def test_auto_chats_fail_for_a_retry_only_where_a_larger_pool_could_take_them(
        redis_settings: RedisSettings, plane: QueuePlane) -> None:
    """While small has no worker and large has one: a chat auto could have sent large fails at
    once (a retry goes there); a chat that named small, or whose only fitting pool is small,
    waits for the timeout."""
    scheduler = Scheduler(SchedulerSettings(**redis_settings.model_dump(), pools="small,large",
                                            no_worker_timeout_s=60), plane)
    small = plane.for_pool("small")
    for rid, later in (("up", ("large",)), ("named", ()), ("elsewhere", ("xl",))):
        payload = RequestPayload(id=rid, messages=(ChatMessage("user", "hi"),), max_tokens=8, lane=Lane.SHORT,
                                 fallback_pools=later)
        assert (await small.enqueue(payload, "edge-x")).created
    await plane.fleet.report(WorkerReport("w9", {}, 8, pool="large"), await plane.server_time_ms(), ttl_ms=10_000)
    await scheduler.snapshot_once()
    assert [await small.request_status(rid) for rid in ("up", "named", "elsewhere")] == [
        ("failed", ""), ("queued", ""), ("queued", "")]
    (end,) = await small.read_stream("up")
    assert end.finish.error_code == ErrorCode.UNAVAILABLE and "another pool" in end.finish.error_message
