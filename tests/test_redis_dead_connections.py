"""The worker's blocking pop against a Redis host that vanished without closing its connection
(``BlackHoleProxy``: a partition, a failover that moved Redis's address): it must give up within
its block plus ``redis_dead_after_s`` and connect again; before, it waited for good."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from blackhole import BlackHoleProxy
from conftest import scaled
from lanes.queue.embedded import EmbeddedRedis
from lanes.queue.errors import QueueUnavailable
from lanes.queue.messages import Lane
from lanes.queue.plane import QueuePlane
from lanes.queue.settings import RedisSettings

DEAD_AFTER_S = 1.0
POP_S = 0.5


@pytest.fixture
def proxy(redis_server: EmbeddedRedis) -> Iterator[BlackHoleProxy]:
    with BlackHoleProxy("127.0.0.1", redis_server.port) as p:
        yield p


@pytest.fixture
async def direct(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def proxied_plane(proxy: BlackHoleProxy, key_prefix: str, query: str = "") -> QueuePlane:
    return QueuePlane.from_settings(RedisSettings(redis_url=proxy.url(query=query), key_prefix=key_prefix,
                                                  redis_dead_after_s=DEAD_AFTER_S))


async def test_a_black_holed_pop_fails_within_its_block_plus_the_bound(proxy: BlackHoleProxy, key_prefix: str,
                                                                       direct: aioredis.Redis) -> None:
    # A URL's short command timeout must not fail idle pops (it did once: the worker claimed
    # nothing more); its pop waits its block, then the bound, whatever the URL says.
    plane = proxied_plane(proxy, key_prefix, query="socket_timeout=0.2")
    blocker = plane.blocking_client(POP_S)
    try:
        for _ in range(2):
            assert await plane.pop(blocker, (Lane.SHORT,), timeout_s=POP_S) is None
        assert proxy.black_hole() >= 1
        started = time.monotonic()
        with pytest.raises(QueueUnavailable):
            await asyncio.wait_for(plane.pop(blocker, (Lane.SHORT,), timeout_s=POP_S), scaled(30))
        took = time.monotonic() - started
        print(f"\na pop on a black-holed connection failed after {took:.2f} s")
        assert POP_S + DEAD_AFTER_S - 0.1 <= took <= POP_S + DEAD_AFTER_S + scaled(1.0)
        # The same client reconnects on its next pop (a new connection: forwarded again) and
        # pops what was queued meanwhile.
        await direct.zadd(plane.keys.pending(Lane.SHORT), {"r1": 1})
        assert await plane.pop(blocker, (Lane.SHORT,), timeout_s=POP_S) == ("r1", Lane.SHORT)
    finally:
        await blocker.aclose()
        await plane.close()


async def wait_for(done, what: str, timeout_s: float | None = None) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + (timeout_s or scaled(5))
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        await asyncio.sleep(0.01)
