"""Redis connections for the queue plane: retries of transient errors with capped backoff,
never of a refused login. A ``redis+cluster://`` (or ``rediss+cluster://``) URL gives a Redis
Cluster client instead (``cluster.py``)."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError


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


def redis_db(url: str) -> int:
    """The database number ``url`` names (0 when none; a cluster has only 0)."""
    if is_cluster_url(url):
        return 0
    from redis.asyncio.connection import parse_url

    try:
        return int(parse_url(url).get("db") or 0)
    except (TypeError, ValueError):
        return 0


class _NoRetry(Exception):
    def __init__(self, error: AuthenticationError) -> None:
        self.error = error


#: How long a command (and a connection attempt) may wait for Redis before it fails with
#: ``QueueUnavailable``. A Redis that stops answering without closing its connections (a hung
#: server, a network partition) would otherwise hold every chat, handshake and health check
#: until it answers again. The URL's ``socket_timeout`` / ``socket_connect_timeout`` win.
COMMAND_TIMEOUT_S = 5.0


def connect(url: str, **kwargs: object) -> aioredis.Redis:
    """A client that retries transient connection errors with capped exponential backoff, and
    gives up on a command after ``COMMAND_TIMEOUT_S`` (not retried: the command may have run);
    a ``ClusterClient`` (a ``RedisCluster``) for a cluster URL (``kwargs`` do not apply)."""
    if is_cluster_url(url):
        from lanes.queue.cluster import connect_cluster

        return connect_cluster(url)  # type: ignore[return-value]
    return aioredis.Redis.from_url(url, **connection_options(**kwargs))


def connection_options(**kwargs: object) -> dict[str, object]:
    """``connect``'s options for a single Redis (``kwargs`` over the timeouts), for a client
    or a ``ConnectionPool.from_url`` (the URL's own options win over both)."""
    return {
        "socket_timeout": COMMAND_TIMEOUT_S, "socket_connect_timeout": COMMAND_TIMEOUT_S, **kwargs,
        "retry": TransientRetry(ExponentialBackoff(cap=1.0, base=0.02), retries=5,
                                supported_errors=(RedisConnectionError,)),
        "retry_on_error": [RedisConnectionError],
        "health_check_interval": 10,
    }


def raise_if_cancelled() -> None:
    """Raise a cancellation that redis-py swallowed. A task cancelled during a Redis call can
    come out of it with its cancellation requested but never delivered (redis-py 5.3.1 on
    Python 3.11: an edge's ``subscribe`` in about one SIGTERM in two in its first second, the
    scheduler's first round); a loop that then sleeps and calls again never stops, and the
    process ignores SIGTERM. Loops that are never meant to outlive their task's cancellation
    call this after their Redis calls."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
