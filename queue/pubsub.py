"""Subscribe with backoff: the one loop every process uses to read pub/sub channels.

Redis drops a subscriber that falls behind (or restarts), and messages published meanwhile are
gone; ``on_subscribed`` runs after every (re)subscription so the caller can recover them from
the streams (the edge refills its requests; a worker needs nothing).

On a Redis Cluster the subscription sits on the master serving the first channel's slot (see
``cluster.py`` for why) and moves when that master changes: after a failover the old master
lives on as a replica and would keep delivering, but ``PUBLISH`` then goes to the new one, which
would count no subscriber.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import redis.asyncio as aioredis
from lanes.queue.backoff import Backoff
from lanes.queue.connection import raise_if_cancelled
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

#: On a cluster: how often a subscriber checks that its node still serves its channel's slot.
OWNER_CHECK_S = 1.0
#: What a subscription's own PINGs carry (redis-py swallows the replies to its health checks,
#: so a PING of its own is what tells that the connection still answers).
_PING = b"lanes-listen"


async def listen(client: aioredis.Redis | RedisCluster, channels: Sequence[str], backoff: Backoff,
                 on_subscribed: Callable[[], None] | None = None, *,
                 dead_after_s: float = 15.0) -> AsyncIterator[tuple[bytes, bytes]]:
    """Yield ``(channel, data)`` of every message on ``channels``, forever; resubscribe after
    a lost connection, waiting as ``backoff`` says (on a cluster also when the slot moves).

    A connection that has sent nothing for a third of ``dead_after_s`` is sent a PING; one
    silent for ``dead_after_s`` is taken as dead (``LANES_REDIS_DEAD_AFTER_S``): a Redis host
    that vanished without closing it (a partition, a failover that moved its address) left the
    subscription waiting for good. ``on_subscribed`` runs once Redis has confirmed every
    channel, so a message published after it runs is certain to arrive.
    """
    from lanes.queue.cluster import node_client, slot_owner

    cluster = client if isinstance(client, RedisCluster) else None
    # A single Redis waits for the next message; a cluster subscriber wakes to check its owner.
    wake_s = None if cluster is None else OWNER_CHECK_S
    loop = asyncio.get_running_loop()
    while True:
        conn: aioredis.Redis | None = None
        pubsub = None
        timeout_before: tuple[float | None] | None = None  # the connection's own, once changed
        try:
            if cluster is None:
                pubsub = client.pubsub()
            else:
                address = await slot_owner(cluster, channels[0])
                conn = node_client(cluster, *address, single_connection=False)
                pubsub = conn.pubsub()
            await pubsub.subscribe(*channels)
            raise_if_cancelled()
            assert pubsub.connection is not None
            # Waiting for the next message is not a command: each wait passes its own timeout.
            # The connection's own (writes, a PING's reply) becomes the silence bound.
            timeout_before = (pubsub.connection.socket_timeout,)
            pubsub.connection.socket_timeout = dead_after_s
            silence = _Silence(loop, dead_after_s)
            confirmed = 0
            check_at = loop.time() + OWNER_CHECK_S
            while True:
                message = await silence.next(pubsub, wake_s)
                raise_if_cancelled()
                kind = None if message is None else message["type"]
                if kind == "message":
                    yield message["channel"], message["data"]  # type: ignore[index]
                elif kind == "subscribe":
                    # Every channel confirmed: ours now. Again later when redis-py reconnected
                    # and resubscribed by itself (after a reset connection), which also missed
                    # whatever was published in between.
                    confirmed += 1
                    if confirmed % len(channels) == 0:
                        backoff.succeeded()
                        if on_subscribed is not None:
                            on_subscribed()
                if cluster is not None and loop.time() >= check_at:
                    check_at = loop.time() + OWNER_CHECK_S
                    if await _moved(cluster, channels[0], address):
                        break
        except (RedisError, OSError) as exc:
            await asyncio.sleep(backoff.failed(exc))
        finally:
            if pubsub is not None:
                if pubsub.connection is not None and timeout_before is not None:
                    # It goes back to the client's pool: commands on it get their timeout again.
                    pubsub.connection.socket_timeout = timeout_before[0]
                await pubsub.aclose()
            if conn is not None:
                await conn.aclose()


class _Silence:
    """How long a subscription has heard nothing from Redis: a PING after a third of
    ``dead_after_s``, a ``ConnectionError`` (the caller subscribes again) after all of it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, dead_after_s: float) -> None:
        self.loop = loop
        self.dead_after_s = dead_after_s
        self.ping_after_s = dead_after_s / 3
        self.heard_at = loop.time()
        self.pinged = False

    async def next(self, pubsub: PubSub, wake_s: float | None) -> dict[str, Any] | None:
        """The next reply (a message, a confirmation, a pong), or None after ``wake_s``
        (None: not before the silence calls for a PING)."""
        silent_s = self.loop.time() - self.heard_at
        if silent_s >= self.dead_after_s:
            raise RedisConnectionError(f"nothing from Redis in {silent_s:.1f} s on a subscription, not even the "
                                       "answer to a PING (LANES_REDIS_DEAD_AFTER_S): taken as dead")
        if silent_s >= self.ping_after_s and not self.pinged:
            await pubsub.ping(_PING)
            self.pinged = True
        wait_s = (self.dead_after_s if self.pinged else self.ping_after_s) - silent_s
        if wake_s is not None:
            wait_s = min(wait_s, wake_s)
        message: dict[str, Any] | None = await pubsub.get_message(timeout=max(wait_s, 0.001))
        if message is not None:
            self.heard_at = self.loop.time()
            self.pinged = False
        return message


async def _moved(cluster: RedisCluster, channel: str, address: tuple[str, int]) -> bool:
    """Whether another master serves ``channel``'s slot now (a failed check keeps the
    subscription: it still delivers, broadcast)."""
    from lanes.queue.cluster import slot_owner

    try:
        owner = await slot_owner(cluster, channel)
    except (RedisError, OSError):
        return False
    if owner != address:
        log.info("%s: its slot moved from %s:%d to %s:%d; subscribing there", channel, *address, *owner)
        return True
    return False
