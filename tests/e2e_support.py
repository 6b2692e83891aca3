"""Start the real processes (scheduler, edges, workers) for end-to-end tests, and a small
WebSocket client that collects frames per request id."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import websockets

from lanes.cli.procs import stop_all, wait_http
from lanes.queue.embedded import free_port


@dataclass
class System:
    redis_url: str
    prefix: str
    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    edge_ports: dict[str, int] = field(default_factory=dict)

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "LANES_REDIS_URL": self.redis_url, "LANES_KEY_PREFIX": self.prefix,
                "HF_HUB_OFFLINE": "1", "LANES_LEASE_MS": "1500", "LANES_HEARTBEAT_S": "0.3",
                "LANES_START_TIMEOUT_MS": "1500", **extra}

    def start(self, name: str, args: list[str], **env: str) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "lanes.cli.main", *args], env=self.env(**env),
                                stdout=log, stderr=subprocess.STDOUT)
        self.procs[name] = proc
        return proc

    def start_edge(self, name: str = "edge", **env: str) -> str:
        port = free_port()
        self.start(name, ["edge"], LANES_PORT=str(port), LANES_EDGE_ID=f"{self.prefix}-{name}", **env)
        self.edge_ports[name] = port
        wait_http(f"http://127.0.0.1:{port}/healthz", 60, [self.procs[name]])
        return f"ws://127.0.0.1:{port}/v1/chat"

    def start_worker(self, name: str, model: str, *extra: str) -> None:
        self.start(name, ["worker", "--model", model, *extra], LANES_WORKER_ID=f"{self.prefix}-{name}")

    def wait_workers(self, count: int, timeout_s: float = 120) -> None:
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + timeout_s
        try:
            while client.zcard(f"{self.prefix}:{{q}}:workers") < count:
                for name, proc in self.procs.items():
                    if proc.poll() is not None:
                        raise RuntimeError(f"{name} exited: {(self.log_dir / f'{name}.log').read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError("workers did not register")
                time.sleep(0.2)
        finally:
            client.close()

    def kill(self, name: str, sig: int = 9) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        proc.wait(timeout=30)

    def stop(self) -> None:
        stop_all(self.procs.values())


class Client:
    """A WebSocket client that files frames by request id."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.frames: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
        self.finished: dict[str, asyncio.Event] = defaultdict(asyncio.Event)
        #: Arrival time (``time.monotonic()``) of each frame, parallel to ``frames``.
        self.arrivals: dict[str | None, list[float]] = defaultdict(list)
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, url: str) -> Client:
        return cls(await websockets.connect(url, max_size=None))

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                frame = json.loads(raw)
                self.frames[frame.get("id")].append(frame)
                self.arrivals[frame.get("id")].append(time.monotonic())
                if frame["type"] in ("done", "error") and frame.get("id"):
                    self.finished[frame["id"]].set()
        except websockets.ConnectionClosed:
            pass

    async def send(self, frame: dict[str, Any] | str) -> None:
        await self.ws.send(frame if isinstance(frame, str) else json.dumps(frame))

    async def chat(self, request_id: str, content: str, max_tokens: int = 16, temperature: float = 0.0) -> None:
        await self.send({"type": "chat", "id": request_id, "messages": [{"role": "user", "content": content}],
                         "max_tokens": max_tokens, "temperature": temperature})

    async def wait(self, request_id: str, timeout_s: float = 60) -> dict[str, Any]:
        """The first done/error frame of a request."""
        await asyncio.wait_for(self.finished[request_id].wait(), timeout_s)
        return next(f for f in self.frames[request_id] if f["type"] in ("done", "error"))

    async def wait_done(self, request_id: str, timeout_s: float = 60) -> dict[str, Any]:
        async def done() -> dict[str, Any]:
            while not any(f["type"] == "done" for f in self.frames[request_id]):
                await asyncio.sleep(0.01)
            return next(f for f in self.frames[request_id] if f["type"] == "done")

        return await asyncio.wait_for(done(), timeout_s)

    def deltas(self, request_id: str) -> list[dict[str, Any]]:
        return [f for f in self.frames[request_id] if f["type"] == "delta"]

    def text(self, request_id: str) -> str:
        return "".join(f["text"] for f in self.deltas(request_id))

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()
