"""Helpers for the hostile-input and overload end-to-end tests: process probes (/proc RSS,
/metrics) and three kinds of client (processes come from the harness, ``e2e_support``).

- blocking ``websockets.sync`` clients (``open_client``, ``Bystander``): the live fuzz runs
  hypothesis, which drives plain functions, and a bystander chats from its own thread;
- ``TimedClient`` (asyncio): stamps every frame, for latencies under a burst;
- ``RawClient``: a socket with a tiny receive buffer that reads nothing until told to.

Every wait is bounded by a timeout.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import websockets
from websockets.sync.client import ClientConnection, connect

from e2e_support import System


def start_edge(system: System, name: str, **env: str) -> str:
    """Start an edge whose settings come from ``env`` (``LANES_*``); returns its chat URL."""
    return system.start_edge(name, **env)


def open_client(url: str, **kwargs: Any) -> ClientConnection:
    """A blocking client that buffers everything the edge sends (no backpressure of its own)."""
    return connect(url, max_size=None, max_queue=None, open_timeout=10, **kwargs)


def recv_json(ws: ClientConnection, timeout_s: float) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=timeout_s))


def close_code_after(url: str, payload: str | bytes, *, text: bool, timeout_s: float = 10) -> int | None:
    """Send one frame on a fresh connection and return the close code the edge answers with
    (None if the edge answered with a frame and kept the connection open)."""
    with open_client(url) as ws:
        ws.send(payload, text=text)
        try:
            ws.recv(timeout=timeout_s)
        except websockets.ConnectionClosed as exc:
            return exc.rcvd.code if exc.rcvd is not None else None
        return None


def edge_rss_kib(system: System, name: str) -> int:
    """Resident memory of an edge process, from /proc (Linux)."""
    with open(f"/proc/{system.procs[name].pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc status")


def metric(system: System, name: str, sample: str) -> float:
    """Sum of one Prometheus sample (e.g. ``lanes_slow_clients_total``) on an edge's /metrics."""
    url = f"http://127.0.0.1:{system.edge_ports[name]}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(sample) and not line.startswith("#") and line[len(sample)] in " {")


def tiny_rcvbuf_socket(port: int, rcvbuf_bytes: int = 4096) -> socket.socket:
    """A connected loopback socket whose receive window stays small (set before connect)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
    sock.connect(("127.0.0.1", port))
    return sock


@dataclass
class Answer:
    """One complete answer as a client saw it."""

    id: str
    frames: list[dict[str, Any]]

    @property
    def text(self) -> str:
        return "".join(f["text"] for f in self.frames if f["type"] == "delta")

    def check_complete(self) -> dict[str, Any]:
        """Accepted first, contiguous seqs from 0, one terminal ``done`` last; returns it."""
        types = [f["type"] for f in self.frames]
        assert types[0] == "accepted" and types[-1] == "done", (self.id, types)
        assert types.count("done") == 1 and "error" not in types, (self.id, types)
        seqs = [f["seq"] for f in self.frames if f["type"] == "delta"]
        assert seqs == list(range(len(seqs))), (self.id, seqs)
        return self.frames[-1]


def chat_once(ws: ClientConnection, request_id: str, content: str, max_tokens: int,
              timeout_s: float = 60) -> Answer:
    """Send one greedy chat and read until its terminal frame (the connection carries nothing else)."""
    ws.send(json.dumps({"type": "chat", "id": request_id, "messages": [{"role": "user", "content": content}],
                        "max_tokens": max_tokens, "temperature": 0}))
    frames: list[dict[str, Any]] = []
    while not frames or frames[-1]["type"] not in ("done", "error"):
        frame = recv_json(ws, timeout_s)
        assert frame.get("id") == request_id, frame
        frames.append(frame)
    return Answer(request_id, frames)


@dataclass
class Bystander:
    """A well-behaved client chatting in a loop on its own connection while something hostile
    happens elsewhere; every answer must come back complete."""

    url: str
    content: str
    max_tokens: int
    answers: list[Answer] = field(default_factory=list)
    failure: BaseException | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    #: Request ids stay known to Redis after they end, so each bystander needs its own.
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def run(self) -> None:
        try:
            with open_client(self.url) as ws:
                while not self.stop.is_set() or not self.answers:
                    rid = f"by-{self.tag}-{len(self.answers)}"
                    self.answers.append(chat_once(ws, rid, self.content, self.max_tokens))
        except BaseException as exc:  # reported by the test thread, not lost in this one
            self.failure = exc


@contextmanager
def bystander(url: str, content: str, max_tokens: int) -> Iterator[Bystander]:
    """Run a ``Bystander`` for the duration of the block, then check every answer it got."""
    by = Bystander(url, content, max_tokens)
    thread = threading.Thread(target=by.run, name="bystander", daemon=True)
    thread.start()
    try:
        yield by
    finally:
        by.stop.set()
        thread.join(timeout=120)
    assert not thread.is_alive(), "the bystander's answer never finished"
    assert by.failure is None, f"the bystander failed: {by.failure!r}"
    for answer in by.answers:
        answer.check_complete()
    assert len({a.text for a in by.answers}) == 1, "greedy answers to one prompt must not change under fuzzing"


class TimedClient:
    """An asyncio client that stamps every frame it receives (``time.perf_counter``) and
    files it by request id, for latency measurements under load."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.sent_at: dict[str, float] = {}
        self.frames: dict[str, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, url: str) -> TimedClient:
        return cls(await websockets.connect(url, max_size=None, max_queue=None))

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                frame = json.loads(raw)
                self.frames[frame.get("id")].append((time.perf_counter(), frame))
        except websockets.ConnectionClosed:
            pass

    async def chat(self, request_id: str, content: str, max_tokens: int) -> None:
        self.sent_at[request_id] = time.perf_counter()
        await self.ws.send(json.dumps({"type": "chat", "id": request_id, "max_tokens": max_tokens,
                                       "messages": [{"role": "user", "content": content}]}))

    def terminal(self, request_id: str) -> list[tuple[float, dict[str, Any]]]:
        return [(t, f) for t, f in self.frames[request_id] if f["type"] in ("done", "error")]

    async def wait_all(self, timeout_s: float) -> None:
        """Until every request sent has a terminal frame."""
        async def all_ended() -> None:
            while any(not self.terminal(rid) for rid in self.sent_at):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(all_ended(), timeout_s)

    def latency_s(self, request_id: str) -> float:
        """Send to the first terminal frame."""
        return self.terminal(request_id)[0][0] - self.sent_at[request_id]

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()


class RawClient:
    """A WebSocket client over a plain blocking socket, driven by websockets' sans-I/O
    ``ClientProtocol``: it reads nothing unless told to, so the edge's frames pile up in the
    kernel buffers (a small SO_RCVBUF keeps those small) and then in the edge's own queue."""

    def __init__(self, port: int, rcvbuf_bytes: int = 4096) -> None:
        from websockets.client import ClientProtocol
        from websockets.uri import parse_uri

        self.sock = tiny_rcvbuf_socket(port, rcvbuf_bytes)
        self.sock.settimeout(10)
        self.protocol = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/v1/chat"), max_size=None)
        self.protocol.send_request(self.protocol.connect())
        self._flush()
        while self.protocol.handshake_exc is None and not self.protocol.events_received():
            self._feed(self.sock.recv(4096))
        assert self.protocol.handshake_exc is None, self.protocol.handshake_exc
        self.num_frames = 0

    def _flush(self) -> None:
        for data in self.protocol.data_to_send():
            self.sock.sendall(data)

    def _feed(self, data: bytes) -> None:
        if data:
            self.protocol.receive_data(data)
        else:
            self.protocol.receive_eof()

    def send_text(self, text: str) -> None:
        self.protocol.send_text(text.encode())
        self._flush()

    def read_until_closed(self) -> int | None:
        """Read everything left; returns the close code the edge sent (None: no close frame)."""
        try:
            while (data := self.sock.recv(65536)):
                self._feed(data)
                self.num_frames += sum(1 for e in self.protocol.events_received() if e.opcode.name == "TEXT")
        except (ConnectionResetError, TimeoutError):
            pass
        self.sock.close()
        return self.protocol.close_rcvd.code if self.protocol.close_rcvd is not None else None
