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
