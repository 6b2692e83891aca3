"""The system ``lanes chaos`` breaks: a process-harness ``Cluster`` with its own redis-server,
a scheduler, two edges and ``sim`` workers whose every slot may run any lane.

Every child is a real process started exactly as in production, so every fault is real:
SIGKILL for a worker or an edge, redis-server stopped and started again on the same port.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from pathlib import Path

from lanes.cli.cluster import FAST_FAILOVER_ENV, Cluster


@dataclass
class Rig:
    cluster: Cluster
    #: Sim engine speed-up over the GPU cost model.
    time_scale: float
    slots_per_worker: int
    #: Admission limit per lane at the edges, so an overload burst is refused, not queued forever.
    max_depth: int

    @classmethod
    def create(cls, log_dir: Path, *, time_scale: float, slots_per_worker: int, max_depth: int) -> Rig:
        depth = str(max_depth)
        # A short resume grace: a client that leaves for good has its requests cancelled within the run.
        env = {**FAST_FAILOVER_ENV, "LANES_RESUME_GRACE_S": "1", "LANES_PREDICTOR_REFRESH_MINUTES": "0",
               "LANES_MAX_DEPTH_SHORT": depth,
               "LANES_MAX_DEPTH_MEDIUM": depth, "LANES_MAX_DEPTH_LONG": depth}
        cluster = Cluster.embedded(f"chaos{uuid.uuid4().hex[:6]}", log_dir, base_env=env)
        return cls(cluster, time_scale, slots_per_worker, max_depth)

    def start_worker(self, name: str) -> str:
        """A sim worker whose every slot may run any lane; returns its worker id."""
        slots = str(self.slots_per_worker)
        return self.cluster.start_worker(
            name, "", "--engine", "sim", "--sim-time-scale", str(self.time_scale), "--max-slots", slots,
            LANES_MAX_LONG_SLOTS=slots, LANES_MAX_MEDIUM_LONG_SLOTS=slots)

    async def wait_workers(self, count: int, timeout_s: float = 60) -> None:
        await asyncio.to_thread(self.cluster.wait_workers, count, timeout_s)

    async def request_states(self, ids: list[str]) -> dict[str, tuple[str, str]]:
        """``(state, worker)`` of each request, from Redis."""
        plane = self.cluster.plane()
        try:
            return {rid: await plane.request_status(rid) for rid in ids}
        finally:
            await plane.close()

    def close(self) -> None:
        self.cluster.close()
