"""``lanes up``: the whole system on one machine (embedded Redis, edge, workers, scheduler).

A small supervisor: it restarts a child that dies (with backoff), and on Ctrl-C stops every
child with SIGTERM (workers hand their leases back), then Redis.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from rich.console import Console

from lanes.cli.procs import wait_http
from lanes.queue.embedded import EmbeddedRedis
from lanes.queue.settings import RedisSettings

console = Console(stderr=True)


@dataclass
class Child:
    name: str
    args: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = field(default=0.0)

    def start(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "lanes.cli.main", *self.args], env=self.env)
        self.started_at = time.monotonic()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        if self.process is None:
            return
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _wait_workers(redis_url: str, prefix: str, count: int, timeout_s: float) -> bool:
    import redis

    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if client.zcard(f"{prefix}:{{q}}:workers") >= count:
                return True
            time.sleep(0.3)
        return False
    finally:
        client.close()


def up(port: int, num_workers: int, worker_args: list[str], host: str = "127.0.0.1") -> None:
    settings = RedisSettings()  # the LANES_* environment, parsed once
    redis_url = settings.redis_url if "redis_url" in settings.model_fields_set else ""
    embedded = None
    if not redis_url:
        embedded = EmbeddedRedis().start()
        redis_url = embedded.url
        console.print(f"[green]redis[/] embedded redis-server on {redis_url}")
    env = {**os.environ, "LANES_REDIS_URL": redis_url, "LANES_PORT": str(port), "LANES_HOST": host}
    prefix = settings.key_prefix
    children = [Child("scheduler", ["scheduler"], env), Child("edge", ["edge"], env)]
    children += [Child(f"worker-{i}", ["worker", *worker_args], env) for i in range(num_workers)]
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for child in children:
            child.start()
        try:
            wait_http(f"http://{host}:{port}/healthz", 60, [c.process for c in children if c.process])
        except (RuntimeError, TimeoutError) as exc:
            console.print(f"[red]the edge did not come up ({exc}); see the log above[/]")
            return
        if _wait_workers(redis_url, prefix, num_workers, 180):
            console.print(f"[green]ready[/]: chat at [bold]ws://{host}:{port}/v1/chat[/] "
                          f"· dashboard http://{host}:{port}/dashboard · metrics http://{host}:{port}/metrics")
            console.print(f'try: lanes chat --url ws://{host}:{port}/v1/chat "Explain what a class definition does"')
        else:
            console.print("[yellow]workers are slow to start; the edge accepts requests meanwhile[/]")
        while not stopping:
            for child in children:
                if child.process and child.process.poll() is not None and not stopping:
                    code = child.process.returncode
                    backoff_s = min(2 ** child.restarts, 30) if time.monotonic() - child.started_at < 30 else 1
                    console.print(f"[yellow]{child.name} exited with {code}; restarting in {backoff_s} s[/]")
                    time.sleep(backoff_s)
                    child.restarts += 1
                    child.start()
            time.sleep(0.2)
    finally:
        console.print("stopping…")
        for child in children:
            child.stop()
        for child in children:
            child.wait(15)
        if embedded is not None:
            embedded.stop()
        console.print("stopped")
