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

import redis.asyncio as aioredis
from lanes.queue.backoff import Backoff
from lanes.queue.connection import raise_if_cancelled
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

#: On a cluster: how often a subscriber checks that its node still serves its channel's slot.
OWNER_CHECK_S = 1.0


async def listen(client: aioredis.Redis | RedisCluster, channels: Sequence[str], backoff: Backoff,
                 on_subscribed: Callable[[], None] | None = None) -> AsyncIterator[tuple[bytes, bytes]]:
    """Yield ``(channel, data)`` of every message on ``channels``, forever; resubscribe after
    a lost connection, waiting as ``backoff`` says (on a cluster also when the slot moves)."""
    from lanes.queue.cluster import node_client, slot_owner

    cluster = client if isinstance(client, RedisCluster) else None
    # A single Redis blocks for the next message; a cluster subscriber wakes to check its owner.
    timeout = None if cluster is None else OWNER_CHECK_S
    loop = asyncio.get_running_loop()
    while True:
        conn: aioredis.Redis | None = None
        pubsub = None
        try:
            if cluster is None:
                pubsub = client.pubsub()
            else:
                address = await slot_owner(cluster, channels[0])
                conn = node_client(cluster, *address, single_connection=False)
                pubsub = conn.pubsub()
            await pubsub.subscribe(*channels)
            raise_if_cancelled()
            if cluster is None and pubsub.connection is not None:
                # Waiting for the next message is not a command: no command timeout on it.
                pubsub.connection.socket_timeout = None
            backoff.succeeded()
            if on_subscribed is not None:
                on_subscribed()
            check_at = loop.time() + OWNER_CHECK_S
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout)
                raise_if_cancelled()
                if message is not None and message["type"] == "message":
                    yield message["channel"], message["data"]
                if cluster is not None and loop.time() >= check_at:
                    check_at = loop.time() + OWNER_CHECK_S
                    if await _moved(cluster, channels[0], address):
                        break
        except (RedisError, OSError) as exc:
            await asyncio.sleep(backoff.failed(exc))
        finally:
            if pubsub is not None:
                if cluster is None and pubsub.connection is not None:
                    # It goes back to the client's pool: commands on it get their timeout again.
                    pubsub.connection.socket_timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
                await pubsub.aclose()
            if conn is not None:
                await conn.aclose()


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
