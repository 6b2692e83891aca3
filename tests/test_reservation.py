"""Slot reservation with real Redis and two real worker processes (sim engine): a burst of
long requests cannot take the slots reserved for short ones."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from conftest import scaled
from e2e_support import System

from lanes.queue.messages import ChatMessage, Lane, RequestPayload
from lanes.queue.plane import QueuePlane
from lanes.queue.settings import RedisSettings

pytestmark = pytest.mark.e2e


async def test_long_burst_leaves_short_slots_free(redis_url: str, tmp_path) -> None:
    system = System(redis_url, f"r{uuid.uuid4().hex[:6]}", tmp_path)
    plane = QueuePlane.from_settings(RedisSettings(redis_url=redis_url, key_prefix=system.prefix))
    slots = ["--max-slots", "4", "--engine", "sim", "--sim-time-scale", "1"]
    env = {"LANES_MAX_LONG_SLOTS": "2", "LANES_MAX_MEDIUM_LONG_SLOTS": "3", "LANES_MIN_LONG_SLOTS": "0"}
    try:
        system.start("scheduler", ["scheduler"])
        for name in ("w1", "w2"):
            system.start(name, ["worker", *slots], LANES_WORKER_ID=f"{system.prefix}-{name}", **env)
        system.wait_workers(2, timeout_s=60)
        msg = (ChatMessage("user", "x" * 400),)
        # 20 long requests of ~150 decode steps (~5 s each on the l70-h100 profile).
        for i in range(20):
            await plane.enqueue(RequestPayload(id=f"long{i}", messages=msg, max_tokens=150, lane=Lane.LONG), "e")
        await asyncio.sleep(scaled(1.0))
        running_long = await _running(plane, "long", 20)
        assert running_long == 4, "2 workers x max 2 long slots each"
        # A burst of short requests starts at once on the reserved slots.
        for i in range(4):
            await plane.enqueue(RequestPayload(id=f"short{i}", messages=msg, max_tokens=60, lane=Lane.SHORT), "e")
        await asyncio.sleep(scaled(0.5))
        waits = []
        for i in range(4):
            h = await plane.redis.hgetall(plane.keys.request(f"short{i}"))
            assert h[b"state"] in (b"running", b"done"), f"short{i} still {h[b'state']}"
            waits.append(int(h[b"claim_ms"]) - int(h[b"enq_ms"]))
        assert max(waits) < scaled(0.4) * 1000, f"short requests waited {waits} ms behind the long burst"
        assert await _running(plane, "long", 20) == 4, "long requests did not grow into reserved slots"
        infos = [json.loads(await plane.redis.get(plane.keys.worker_info(f"{system.prefix}-{w}")) or "{}")
                 for w in ("w1", "w2")]
        assert all(info["running"].get("long", 0) <= 2 for info in infos), infos
    finally:
        system.stop()
        await plane.close()


async def _running(plane: QueuePlane, prefix: str, count: int) -> int:
    states = [await plane.redis.hget(plane.keys.request(f"{prefix}{i}"), "state") for i in range(count)]
    return sum(s == b"running" for s in states)
