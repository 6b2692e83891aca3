"""A lean WebSocket load client: one asyncio ``Protocol`` per connection, frames parsed in
``data_received`` with no task or await per frame, JSON decoded by msgspec into a small struct.

It shares the machine with the system it measures, so every microsecond it spends is one the
server does not get: it costs ~2-3 us per received frame (``bench fanout`` reports its CPU).
Client frames are masked with an all-zero key (RFC 6455 asks for an unpredictable key against
proxy cache poisoning; on loopback it only costs a copy), so sending needs no per-byte work.
"""

from __future__ import annotations

import asyncio
import base64
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec


class ServerFrame(msgspec.Struct):
    type: str
    id: str | None = None
    seq: int = -1
    code: str | None = None
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    timing: dict[str, float] | None = None
    #: ``accepted``: the lane the edge chose and its predicted answer length.
    lane: str | None = None
    predicted_tokens: int | None = None


_decode = msgspec.json.Decoder(ServerFrame).decode
_MASK = b"\x00\x00\x00\x00"


def _frame(opcode: int, payload: bytes) -> bytes:
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n < 65536:
        head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    return head + _MASK + payload


@dataclass
class Stream:
    """What one request received."""

    sent_at: float
    accepted_at: float | None = None
    first_delta_at: float | None = None
    ended_at: float | None = None
    next_seq: int = 0
    num_deltas: int = 0
    gaps: int = 0
    end: ServerFrame | None = None
    #: The ``accepted`` frame (lane, predicted tokens).
    accepted: ServerFrame | None = None


@dataclass
class LeanClient(asyncio.Protocol):
    """One WebSocket connection; ``on_end`` is called with each request's last frame."""

    on_end: Callable[[str, Stream], None] = lambda rid, stream: None
    streams: dict[str, Stream] = field(default_factory=dict)
    num_frames: int = 0
    #: ``delta`` frames among them (``num_frames`` also counts ``accepted``, ``done``, ``error``).
    num_deltas: int = 0
    #: The server's close code, once it closed the connection (4008: this client read too slowly).
    close_code: int | None = None
    closed: bool = False
    _buf: bytearray = field(default_factory=bytearray)
    _open: asyncio.Future[None] | None = None
    _transport: asyncio.Transport | None = None
    _handshake_done: bool = False

    @classmethod
    async def connect(cls, host: str, port: int, path: str = "/v1/chat", headers: dict[str, str] | None = None,
                      **kwargs: object) -> LeanClient:
        loop = asyncio.get_running_loop()
        client = cls(**kwargs)  # type: ignore[arg-type]
        client._open = loop.create_future()
        await loop.create_connection(lambda: client, host, port)
        key = base64.b64encode(os.urandom(16)).decode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        assert client._transport is not None
        client._transport.write(
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n".encode())
        await client._open
        return client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._open is not None and not self._open.done():
            self._open.set_exception(ConnectionError(f"connection lost during the handshake: {exc}"))

    def send_json(self, payload: bytes) -> None:
        assert self._transport is not None
        self._transport.write(_frame(0x1, payload))

    def chat(self, rid: str, content: str, max_tokens: int, *, messages: list[dict[str, str]] | None = None,
             **fields: object) -> Stream:
        """Send a chat request: one user message ``content``, after ``messages`` if given
        (e.g. a system message); ``fields`` are further request fields (``stop``, ...)."""
        stream = self.streams[rid] = Stream(time.perf_counter())
        self.send_json(msgspec.json.encode({"type": "chat", "id": rid, "max_tokens": max_tokens,
                                            "messages": [*(messages or []), {"role": "user", "content": content}],
                                            **fields}))
        return stream

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        if not self._handshake_done:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            status = bytes(buf[:12])
            del buf[: end + 4]
            self._handshake_done = True
            if self._open is not None and not self._open.done():
                if b" 101" in status:
                    self._open.set_result(None)
                else:
                    self._open.set_exception(ConnectionError(f"handshake refused: {status!r}"))
                    return
        pos, size = 0, len(buf)
        now = time.perf_counter()
        while size - pos >= 2:
            opcode, n = buf[pos] & 0x0F, buf[pos + 1] & 0x7F
            head = 2
            if n == 126:
                if size - pos < 4:
                    break
                n, head = struct.unpack_from("!H", buf, pos + 2)[0], 4
            elif n == 127:
                if size - pos < 10:
                    break
                n, head = struct.unpack_from("!Q", buf, pos + 2)[0], 10
            if size - pos < head + n:
                break
            payload = bytes(buf[pos + head: pos + head + n])
            pos += head + n
            if opcode == 0x1:
                self._on_text(payload, now)
            elif opcode == 0x9 and self._transport is not None:  # ping -> pong
                self._transport.write(_frame(0xA, payload))
            elif opcode == 0x8:
                self.close_code = struct.unpack_from("!H", payload)[0] if len(payload) >= 2 else 1005
        del buf[:pos]

    def _on_text(self, payload: bytes, now: float) -> None:
        self.num_frames += 1
        frame = _decode(payload)
        stream = self.streams.get(frame.id) if frame.id else None
        if stream is None:
            return
        kind = frame.type
        if kind == "delta":
            self.num_deltas += 1
            if frame.seq != stream.next_seq:
                stream.gaps += 1
            stream.next_seq = frame.seq + 1
            stream.num_deltas += 1
            if stream.first_delta_at is None:
                stream.first_delta_at = now
        elif kind == "accepted":
            stream.accepted_at, stream.accepted = now, frame
        elif kind in ("done", "error"):
            stream.ended_at, stream.end = now, frame
            self.on_end(frame.id or "", stream)
