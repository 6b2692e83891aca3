"""The end-to-end tests' side of the process harness (``lanes.cli.cluster``) and a small
WebSocket client that collects frames per request id.

``System`` is the harness ``Cluster`` with the tests' fast fail-over settings (short leases and
heartbeats); new tests get one from the ``make_cluster`` fixture (``conftest.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import websockets

from lanes.cli.cluster import FAST_FAILOVER_ENV, ChildExited, Cluster, wait_http

__all__ = ["ChildExited", "Client", "System", "fixed_http_server", "wait_http"]


@contextlib.contextmanager
def fixed_http_server(body: bytes, content_type: str) -> Iterator[int]:
    """A loopback HTTP server (a thread) that answers every GET with ``body``; yields its port."""

    class Fixed(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fixed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class System(Cluster):
    """A ``Cluster`` whose children fail over fast (``FAST_FAILOVER_ENV``)."""

    base_env: dict[str, str] = field(default_factory=lambda: dict(FAST_FAILOVER_ENV))


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
