"""The processes ``lanes chaos`` breaks: its own redis-server, a scheduler, edges and workers.

Each is a real child process started exactly as in production (``lanes edge|worker|
scheduler``), so every fault is real: SIGKILL for a worker or an edge, redis-server stopped
and started again on the same port. Loopback only; logs go to a temporary directory.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis

from redis.exceptions import RedisError

from lanes.cli.procs import stop_all, wait_http
from lanes.queue.embedded import EmbeddedRedis, free_port

#: Short leases so that a dead worker's requests come back within ~2 s (as in the e2e tests),
#: and a short resume grace so a departed client's requests are cancelled within the run.
LEASE_ENV = {"LANES_LEASE_MS": "1500", "LANES_HEARTBEAT_S": "0.3", "LANES_START_TIMEOUT_MS": "1500",
             "LANES_RESUME_GRACE_S": "1"}


@dataclass
class Cluster:
    """Processes of one chaos run, all under one key prefix on one redis-server."""

    log_dir: Path
    time_scale: float
    slots_per_worker: int
    #: Admission limit per lane at the edges, so an overload burst is refused, not queued forever.
    max_depth: int
    redis_port: int = field(default_factory=free_port)
    prefix: str = field(default_factory=lambda: f"chaos{uuid.uuid4().hex[:6]}")
    redis: EmbeddedRedis | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    edge_urls: dict[str, str] = field(default_factory=dict)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def client(self) -> aioredis.Redis:
        """A plain client for the harness's own reads (request states, worker registry)."""
        return aioredis.Redis.from_url(self.redis_url, socket_connect_timeout=1, socket_timeout=2)

    def start_redis(self) -> None:
        """Start (or restart, empty) the redis-server on this cluster's fixed port."""
        self.redis = EmbeddedRedis(port=self.redis_port).start()

    def stop_redis(self) -> None:
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def _spawn(self, name: str, args: list[str], **env: str) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
        full_env = {**os.environ, "LANES_REDIS_URL": self.redis_url, "LANES_KEY_PREFIX": self.prefix,
                    "HF_HUB_OFFLINE": "1", **LEASE_ENV, **env}
        proc = subprocess.Popen([sys.executable, "-m", "lanes.cli.main", *args], env=full_env,
                                stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_scheduler(self) -> None:
        self._spawn("scheduler", ["scheduler"], LANES_PREDICTOR_REFRESH_MINUTES="0")

    def start_edge(self, name: str, timeout_s: float = 60) -> str:
        port = free_port()
        depth = str(self.max_depth)
        proc = self._spawn(name, ["edge"], LANES_PORT=str(port), LANES_EDGE_ID=f"{self.prefix}-{name}",
                           LANES_MAX_DEPTH_SHORT=depth, LANES_MAX_DEPTH_MEDIUM=depth, LANES_MAX_DEPTH_LONG=depth)
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout_s, [proc])
        self.edge_urls[name] = f"ws://127.0.0.1:{port}/v1/chat"
        return self.edge_urls[name]

    def start_worker(self, name: str) -> str:
        """A sim worker whose every slot may run any lane; returns its worker id."""
        slots = str(self.slots_per_worker)
        self._spawn(name, ["worker", "--engine", "sim", "--sim-time-scale", str(self.time_scale),
                           "--max-slots", slots],
                    LANES_WORKER_ID=f"{self.prefix}-{name}", LANES_MAX_LONG_SLOTS=slots,
                    LANES_MAX_MEDIUM_LONG_SLOTS=slots)
        return f"{self.prefix}-{name}"

    def num_workers(self) -> int:
        """Worker processes alive now."""
        return sum(1 for name, p in self.procs.items() if name.startswith("w") and p.poll() is None)

    def kill(self, name: str) -> None:
        """SIGKILL: no ``finally`` runs, no lease is handed back, no socket is closed politely."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def crashed(self) -> list[str]:
        """Processes that exited although nobody killed them."""
        return [name for name, p in self.procs.items() if p.poll() not in (None, -signal.SIGKILL)]

    async def wait_workers(self, count: int, timeout_s: float = 60) -> None:
        """Until ``count`` workers have heartbeats in the registry (live ones only)."""
        deadline = time.monotonic() + timeout_s
        client = self.client()
        try:
            while True:
                try:
                    now_ms = int(time.time() * 1000)
                    if await client.zcount(f"{self.prefix}:{{q}}:workers", now_ms - 1500, "+inf") >= count:
                        return
                except (OSError, RedisError):
                    pass
                if crashed := self.crashed():
                    raise RuntimeError(f"{crashed} exited; see {self.log_dir}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{count} workers did not register within {timeout_s} s")
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    def close(self) -> None:
        stop_all(self.procs.values(), timeout_s=15)
        self.stop_redis()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
