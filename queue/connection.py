"""Redis connections for the queue plane: retries of transient errors with capped backoff,
never of a refused login. A ``redis+cluster://`` (or ``rediss+cluster://``) URL gives a Redis
Cluster client instead (``cluster.py``)."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


class TransientRetry(Retry):
    """Retries connection errors, except a refused login: a wrong or missing password never
    heals by retrying (redis-py's AuthenticationError is a ConnectionError subclass)."""

    async def call_with_retry(self, do, fail):  # type: ignore[no-untyped-def]
        async def once():  # type: ignore[no-untyped-def]
            try:
                return await do()
            except AuthenticationError as exc:
                raise _NoRetry(exc) from exc

        try:
            return await super().call_with_retry(once, fail)
        except _NoRetry as wrapped:
            raise wrapped.error from None


#: URL scheme of a Redis Cluster -> the scheme of its nodes.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    """``redis+cluster://...`` or ``rediss+cluster://...``: a Redis Cluster (``cluster.py``)."""
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


class _NoRetry(Exception):
    def __init__(self, error: AuthenticationError) -> None:
        self.error = error


def connect(url: str, **kwargs: object) -> aioredis.Redis:
    """A client that retries transient connection errors with capped exponential backoff;
    a ``ClusterClient`` (a ``RedisCluster``) for a cluster URL (``kwargs`` do not apply)."""
    if is_cluster_url(url):
        from lanes.queue.cluster import connect_cluster

        return connect_cluster(url)  # type: ignore[return-value]
    return aioredis.Redis.from_url(
        url,
        retry=TransientRetry(ExponentialBackoff(cap=1.0, base=0.02), retries=5),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=10,
        **kwargs,
    )
