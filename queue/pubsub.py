"""Subscribe with backoff: the one loop every process uses to read pub/sub channels.

Redis drops a subscriber that falls behind (or restarts), and messages published meanwhile are
gone; ``on_subscribed`` runs after every (re)subscription so the caller can recover them from
the streams (the edge refills its requests; a worker needs nothing).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

import redis.asyncio as aioredis
from lanes.queue.backoff import Backoff
from redis.exceptions import RedisError


async def listen(client: aioredis.Redis, channels: Sequence[str], backoff: Backoff,
                 on_subscribed: Callable[[], None] | None = None) -> AsyncIterator[tuple[bytes, bytes]]:
    """Yield ``(channel, data)`` of every message on ``channels``, forever; resubscribe after
    a lost connection, waiting as ``backoff`` says."""
    while True:
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(*channels)
            backoff.succeeded()
            if on_subscribed is not None:
                on_subscribed()
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=None)
                if message is not None and message["type"] == "message":
                    yield message["channel"], message["data"]
        except (RedisError, OSError) as exc:
            await asyncio.sleep(backoff.failed(exc))
        finally:
            await pubsub.aclose()
