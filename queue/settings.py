"""Settings every process shares: where Redis is and how leases behave."""

from __future__ import annotations

import importlib.util
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")



def _check_url_options(url: str) -> None:
    """The URL's ``?option=value`` part as redis-py will read it: an unknown option, a value of
    the wrong kind or an ``ssl_*`` option on ``redis://`` failed only when the first connection
    was made, with a traceback (exit 1: ``lanes up`` and honcho then stop or restart)."""
    from redis.asyncio.connection import Connection, parse_url

    try:
        options = parse_url(url)
        connection_class = options.pop("connection_class", Connection)
        connection_class(**options)  # builds the object only: nothing connects
    except (TypeError, ValueError) as exc:
        words = str(exc).replace("AbstractConnection.__init__() got an ", "").replace("__init__() got an ", "")
        hint = " (ssl_* options need rediss://)" if "ssl_" in words else ""
        raise ValueError(f"the URL's options are not ones redis-py takes: {words}{hint}") from None


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported; ``find_spec`` raises, not returns None, when a parent
    package is missing (``opentelemetry.exporter`` without the ``[otlp]`` extra)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False

class RedisSettings(BaseSettings):
    """Base for each process's settings object (env prefix ``LANES_``)."""

    model_config = SettingsConfigDict(env_prefix="LANES_", extra="ignore")

    #: ``redis://``, ``rediss://`` (TLS) or ``unix://``; a password goes in the URL. A Redis
    #: Cluster: ``redis+cluster://host:port`` (``rediss+cluster://`` for TLS), one seed node
    #: (docs/redis-cluster.md).
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: Prefix of every key and channel (lets several deployments share one Redis); never empty
    #: (an empty one was taken as given: keys starting ``:``, shared with any other empty prefix).
    key_prefix: str = Field("lanes", min_length=1)
    #: A connection that waits on Redis (the worker's blocking pop, each pub/sub subscription)
    #: and hears nothing from it this long beyond what it asked to wait is taken as dead and
    #: opened again: a Redis host that vanished without closing its connections (a partition,
    #: an address moved to a new primary on failover) left them waiting for good. A
    #: subscription PINGs after a third of it in silence; the pop's read timeout is its block
    #: plus this.
    #: At least 1 s: below a busy Redis's answer time, healthy connections would be dropped.
    redis_dead_after_s: float = Field(15.0, ge=1.0, allow_inf_nan=False)
    #: A running request's lease; a worker renews it every ``heartbeat_s``.
    lease_ms: int = Field(2000, gt=0)
    heartbeat_s: float = Field(0.5, gt=0, allow_inf_nan=False)
    #: How long a queued request may sit unwatched before the reaper re-checks it.
    start_timeout_ms: int = Field(3000, gt=0)
    #: A request whose lease expired this many times is failed instead of retried.
    max_attempts: int = Field(3, ge=1)
    #: ``lanes`` (length-aware lanes, demotion, slot reservation) or ``fcfs`` (one lane, open
    #: slots: a real baseline). Every edge and worker of a deployment must run the same one.
    policy: Literal["lanes", "fcfs"] = "lanes"
    #: DEBUG, INFO, WARNING, ERROR or CRITICAL (any case).
    log_level: str = "INFO"
    #: OpenTelemetry exporter: ``none``, ``console`` or ``otlp`` (needs the ``[otlp]`` extra).
    otel_exporter: Literal["none", "console", "otlp"] = "none"

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in REDIS_SCHEMES:
            schemes = ", ".join(f"{s}://" for s in REDIS_SCHEMES)
            scheme = parts.scheme + "://" if parts.scheme else "nothing"
            raise ValueError(f"the URL must start with one of {schemes} (not {scheme})")
        if parts.scheme == "unix":
            return url
        try:
            port = parts.port  # urlsplit checks the port only when it is read
        except ValueError:
            port = -1
        if port is not None and not 1 <= port <= 65535:  # redis-py reads port 0 as "the default", 6379
            raise ValueError("the port must be a number in 1-65535")
        db = parts.path.strip("/")
        if db and not db.isdigit():  # redis-py would quietly use database 0
            raise ValueError(f"the database after the host must be a number (redis://host:port/0), not {db!r}")
        if db and int(db) != 0 and parts.scheme.endswith("+cluster"):
            raise ValueError(f"the URL names database {db}, but a Redis Cluster has only database 0: "
                             "drop the /<db> part of the URL")
        if parts.query and not parts.scheme.endswith("+cluster"):
            _check_url_options(url)
        return url

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, level: str) -> str:
        if level.upper() not in LOG_LEVELS:
            raise ValueError(f"use one of {', '.join(LOG_LEVELS)}")
        return level.upper()

    @field_validator("otel_exporter")
    @classmethod
    def _otlp_installed(cls, exporter: str) -> str:
        if exporter == "otlp" and not _installed("opentelemetry.exporter.otlp.proto.http"):
            raise ValueError("otlp needs the OTLP exporter: pip install -e '.[otlp]' in the lanes checkout")
        return exporter

    @model_validator(mode="after")
    def _heartbeat_within_lease(self) -> RedisSettings:
        if self.heartbeat_s * 1000 >= self.lease_ms:
            raise ValueError(f"LANES_HEARTBEAT_S ({self.heartbeat_s:g} s) must be shorter than LANES_LEASE_MS "
                             f"({self.lease_ms} ms), or every lease runs out between renewals")
        return self
