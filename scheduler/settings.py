"""The scheduler process's settings (env prefix ``LANES_``)."""

from __future__ import annotations

from lanes.queue.fleet import MAX_OBSERVATIONS
from lanes.queue.messages import REFRESH_WINDOW
from lanes.queue.settings import RedisSettings
from lanes.scheduler.predictor.train import MEMORY_WEIGHT
from pydantic import Field, model_validator


class SchedulerSettings(RedisSettings):
    #: How often the reaper runs and depth snapshots are published. 0 or less made each loop
    #: spin without sleeping (80 % of a core), NaN likewise: both are refused at start.
    reap_interval_s: float = Field(default=0.25, gt=0.0, allow_inf_nan=False)
    depth_interval_s: float = Field(default=0.5, gt=0.0, allow_inf_nan=False)
    #: Port for Prometheus metrics (0 = off).
    metrics_port: int = Field(default=0, ge=0, le=65535)
    #: Address it binds (0.0.0.0 for a Prometheus on another host: the autoscaling gauge).
    metrics_host: str = "127.0.0.1"
    #: Refit the length predictor from observed lengths every this many minutes (arq cron; 0 = off;
    #: a negative number, once silently off too, is refused).
    predictor_refresh_minutes: int = Field(default=5, ge=0)
    predictor_min_observations: int = Field(default=50, ge=1)
    #: The refresh's window: the newest this many observations (at most what the list keeps)...
    predictor_max_observations: int = Field(default=REFRESH_WINDOW, ge=1, le=MAX_OBSERVATIONS)
    #: ...in which one API key's entries beyond this share give way to other keys' older ones
    #: (1 = no limit): one key's traffic cannot push the others out of the refit. Its surplus
    #: fills the places no other key has entries for.
    predictor_max_key_share: float = Field(default=0.5, gt=0.0, le=1.0)
    #: Each refit keeps a nearest-neighbour memory of its window and blends it in with this share
    #: (0 = none; ``train.MEMORY_WEIGHT``). Needs an encoder graph with an ``embedding`` output.
    predictor_memory_weight: float = Field(default=MEMORY_WEIGHT, ge=0.0, le=1.0)
    #: Pools to watch even before a worker of theirs is up (comma list); pools of live workers
    #: are added by themselves.
    pools: str = "default"
    #: The edges' routing rules (``LANES_ROUTING_FILE``), when the scheduler is given them too
    #: (``lanes up`` and the Procfile share one environment): their pools are watched as
    #: ``pools`` are, so a pool the rules route to but no worker serves shows as a pool with
    #: no workers, not as nothing.
    routing_file: str = ""
    #: A pool with requests waiting and no live worker for this long fails them with
    #: ``unavailable`` (the edges already refuse new ones while it has none). 0: they wait for
    #: a worker however long it takes (a replacement that loads a big model for minutes).
    no_worker_timeout_s: float = Field(default=60.0, ge=0.0, allow_inf_nan=False)
    #: Autoscaling signal (``lanes_desired_workers{pool}``): keep the predicted lane wait under
    #: ``target_wait_s`` with ``autoscale_headroom`` spare capacity, between these bounds.
    #: Both are checked at start: ``autoscale.desired_workers`` refuses a target of 0 or less and
    #: a negative or non-finite headroom, which crashed the scheduler at its first snapshot.
    target_wait_s: float = Field(default=2.0, gt=0.0, allow_inf_nan=False)
    autoscale_headroom: float = Field(default=0.2, ge=0.0, allow_inf_nan=False)
    #: 0 lets a pool stand at zero workers: edges then queue its chats for the worker an
    #: autoscaler starts (each snapshot says so), instead of refusing them.
    min_workers: int = Field(default=1, ge=0)
    max_workers: int = Field(default=64, ge=1)

    @model_validator(mode="after")
    def _workers_bounds(self) -> SchedulerSettings:
        if self.max_workers < self.min_workers:
            raise ValueError(f"LANES_MAX_WORKERS ({self.max_workers}) is below LANES_MIN_WORKERS ({self.min_workers}): "
                             "raise the first or lower the second")
        return self

    def pool_names(self) -> list[str]:
        return [p.strip() for p in self.pools.split(",") if p.strip()] or ["default"]
