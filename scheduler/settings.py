"""The scheduler process's settings (env prefix ``LANES_``)."""

from __future__ import annotations

from lanes.queue.settings import RedisSettings


class SchedulerSettings(RedisSettings):
    reap_interval_s: float = 0.25
    depth_interval_s: float = 0.5
    #: Port for Prometheus metrics (0 = off).
    metrics_port: int = 0
