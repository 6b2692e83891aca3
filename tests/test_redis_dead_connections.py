"""The connections that wait on Redis, the worker's blocking pop and ``pubsub.listen``, against
a Redis host that vanished without closing them (``BlackHoleProxy``: a partition, a failover
that moved Redis's address). Each must give up within ``redis_dead_after_s`` and connect again;
before, each waited for good. And neither may give up on a Redis that is merely quiet."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from blackhole import BlackHoleProxy
from conftest import scaled
from lanes.queue.backoff import Backoff
from lanes.queue.embedded import EmbeddedRedis
from lanes.queue.errors import QueueUnavailable
from lanes.queue.messages import Lane
from lanes.queue.plane import QueuePlane
from lanes.queue.pubsub import listen
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


@contextlib.asynccontextmanager
async def listening(client: aioredis.Redis, channels: list[str]) -> AsyncIterator[tuple[list[float], list[bytes]]]:
    """``listen`` on ``channels`` in a task, for the block's length: (when each subscription,
    first or again, was confirmed; the messages' data as they came)."""
    subscriptions: list[float] = []
    got: list[bytes] = []

    async def subscriber() -> None:
        async for _, data in listen(client, channels, Backoff("test", logging.getLogger()),
                                    lambda: subscriptions.append(time.monotonic()), dead_after_s=DEAD_AFTER_S):
            got.append(data)

    task = asyncio.create_task(subscriber())
    try:
        yield subscriptions, got
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


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


async def test_a_black_holed_subscription_resubscribes_and_says_so(proxy: BlackHoleProxy, key_prefix: str,
                                                                   direct: aioredis.Redis) -> None:
    plane = proxied_plane(proxy, key_prefix)
    channel = f"{key_prefix}:chan"
    try:
        async with listening(plane.redis, [channel, f"{key_prefix}:other"]) as (subscriptions, got):
            await wait_for(lambda: len(subscriptions) == 1, "subscribed")
            # on_subscribed runs once Redis has the subscription: a message published now arrives.
            assert await direct.publish(channel, b"before") == 1
            await wait_for(lambda: got == [b"before"], "the first message")

            assert proxy.black_hole(sent=b"SUBSCRIBE") == 1
            holed_at = time.monotonic()
            # Redis still counts the black-holed subscriber: this one goes into the hole.
            assert await direct.publish(channel, b"lost") >= 1
            await wait_for(lambda: len(subscriptions) == 2, "subscribed again", scaled(DEAD_AFTER_S + 5))
            took = subscriptions[1] - holed_at
            print(f"\nsubscribed again {took:.2f} s after the black hole")
            assert DEAD_AFTER_S - 0.1 <= took <= DEAD_AFTER_S + scaled(1.5)
            await direct.publish(channel, b"after")
            await wait_for(lambda: got[-1:] == [b"after"], "a message after the resubscription")
            assert got == [b"before", b"after"]
    finally:
        await plane.close()


async def test_a_quiet_subscription_is_kept(proxy: BlackHoleProxy, key_prefix: str, direct: aioredis.Redis) -> None:
    """No message for several bounds in a row: its PINGs are answered, it stays subscribed."""
    plane = proxied_plane(proxy, key_prefix)
    channel = f"{key_prefix}:quiet"
    try:
        async with listening(plane.redis, [channel]) as (subscriptions, got):
            await wait_for(lambda: len(subscriptions) == 1, "subscribed")
            await asyncio.sleep(4 * DEAD_AFTER_S)
            assert len(subscriptions) == 1, "a quiet subscription was taken as dead"
            assert await direct.publish(channel, b"still here") == 1
            await wait_for(lambda: got == [b"still here"], "the message")
    finally:
        await plane.close()


async def test_a_reset_subscription_catches_up(plane: QueuePlane, key_prefix: str, direct: aioredis.Redis) -> None:
    """Redis closes the subscriber's connection (``CLIENT KILL``; a restart, an output buffer
    limit): redis-py reconnects and resubscribes by itself inside ``get_message``, and whatever
    was published meanwhile is gone. ``on_subscribed`` must run again so the caller catches up
    (the edge refills its requests from their streams)."""
    channel = f"{key_prefix}:reset"
    async with listening(plane.redis, [channel]) as (subscriptions, got):
        await wait_for(lambda: len(subscriptions) == 1, "subscribed")
        assert await direct.publish(channel, b"one") == 1
        await wait_for(lambda: got == [b"one"], "the first message")
        assert await direct.client_kill_filter(_type="pubsub") >= 1
        await wait_for(lambda: len(subscriptions) == 2, "told of the resubscription", scaled(DEAD_AFTER_S + 5))
        assert await direct.publish(channel, b"two") == 1
        await wait_for(lambda: got == [b"one", b"two"], "a message after it")


def test_the_bound_is_at_least_a_second() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        RedisSettings(redis_dead_after_s=0.5)
    assert RedisSettings().redis_dead_after_s == 15.0


async def wait_for(done, what: str, timeout_s: float | None = None) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + (timeout_s or scaled(5))
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting: {what}"
        await asyncio.sleep(0.01)


async def test_the_schedulers_arq_cron_outlives_a_black_hole(proxy: BlackHoleProxy, key_prefix: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The predictor refresh runs as an arq cron job; arq polls its queue every second on a
    pool of its own. That pool had no command timeout (arq's settings have none to give), so
    a black-holed connection stopped the cron for good, without a word. The scheduler's arq
    worker, as it runs it, with a cron job every second in place of the refresh."""
    from lanes.scheduler import service
    from lanes.scheduler.settings import SchedulerSettings

    ticks: list[float] = []

    async def tick(ctx: dict[str, object]) -> None:
        ticks.append(time.monotonic())

    monkeypatch.setattr(service, "refresh_cron", lambda prefix, every, cron: cron(
        tick, name=f"cron:tick:{prefix}", second=set(range(60)), unique=True, timeout=5))
    settings = SchedulerSettings(redis_url=proxy.url(), key_prefix=key_prefix, predictor_refresh_minutes=1,
                                 redis_dead_after_s=DEAD_AFTER_S)
    plane = QueuePlane.from_settings(settings)
    task = asyncio.create_task(service.Scheduler(settings, plane)._arq_cron())
    try:
        await wait_for(lambda: len(ticks) >= 2, "the cron job ran", scaled(10))
        assert proxy.black_hole() >= 1
        holed_at = time.monotonic()
        # A command on a black-holed connection fails after its 5 s timeout; arq's worker stops,
        # and the scheduler starts another (backoff from 1 s) on new connections.
        await wait_for(lambda: sum(t > holed_at for t in ticks) >= 2, "the cron job ran after the black hole",
                       scaled(15))
        print(f"\nthe cron job ran again {next(t for t in ticks if t > holed_at) - holed_at:.1f} s after the black hole")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await plane.close()
