"""Settings every process shares: where Redis is and how leases behave."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


class RedisSettings(BaseSettings):
    """Base for each process's settings object (env prefix ``LANES_``)."""

    model_config = SettingsConfigDict(env_prefix="LANES_", extra="ignore")

    #: ``redis://``, ``rediss://`` (TLS) or ``unix://``; a password goes in the URL. A Redis
    #: Cluster: ``redis+cluster://host:port`` (``rediss+cluster://`` for TLS), one seed node
    #: (docs/redis-cluster.md).
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: Prefix of every key and channel (lets several deployments share one Redis).
    key_prefix: str = "lanes"
    #: A running request's lease; a worker renews it every ``heartbeat_s``.
    lease_ms: int = 2000
    heartbeat_s: float = 0.5
    #: How long a queued request may sit unwatched before the reaper re-checks it.
    start_timeout_ms: int = 3000
    #: A request whose lease expired this many times is failed instead of retried.
    max_attempts: int = 3
    #: ``lanes`` (length-aware lanes, demotion, slot reservation) or ``fcfs`` (one lane, open
    #: slots: a real baseline). Every edge and worker of a deployment must run the same one.
    policy: Literal["lanes", "fcfs"] = "lanes"
    log_level: str = "INFO"
    #: OpenTelemetry exporter: ``none``, ``console`` or ``otlp`` (needs the ``[otlp]`` extra).
    otel_exporter: str = "none"

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str) -> str:
        scheme = urlsplit(url).scheme
        if scheme not in REDIS_SCHEMES:
            schemes = ", ".join(f"{s}://" for s in REDIS_SCHEMES)
            raise ValueError(f"the URL must start with one of {schemes} (not {scheme + '://' if scheme else 'nothing'})")
        return url
