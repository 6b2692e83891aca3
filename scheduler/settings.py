"""The scheduler process's settings (env prefix ``LANES_``)."""

from __future__ import annotations

from lanes.queue.settings import RedisSettings


class SchedulerSettings(RedisSettings):
    reap_interval_s: float = 0.25
    depth_interval_s: float = 0.5
    #: Port for Prometheus metrics (0 = off).
    metrics_port: int = 0
    #: Refit the length predictor from observed lengths every this many minutes (arq cron; 0 = off).
    predictor_refresh_minutes: int = 5
    predictor_min_observations: int = 50
    predictor_max_observations: int = 5000
