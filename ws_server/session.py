"""The outgoing side of one WebSocket connection: a bounded list of frames and its writer.

The Redis reader never awaits a socket: the delivery core's ``Send`` actions only append to
the session's list. The writer sends everything waiting in one socket write, so a token batch
costs one write per client, not one per frame (each write on loopback runs the kernel's TCP
stack). A client that does not read backs the transport up (flow control stops the writer);
frames then pile up until ``max_queue_frames``, and the client is closed (4008), so one slow
client cannot stall delivery for the others. Frames queued while the transport still takes data
never count: a burst (a replay of a whole answer, a worker's backlog after a Redis stall) may
exceed the cap before the writer has had its turn, and is sent at the writer's next turn.

Under uvicorn's sans-I/O WebSocket protocol the writer drives the connection's protocol object
directly (the ASGI ``send`` is that object's bound method): ``send_text`` for each frame, then
one ``transport.write``, with the same flow control as ``send``. Any other ASGI server gets one
``websocket.send`` per frame.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from lanes.telemetry import metrics
from websockets.protocol import State

log = logging.getLogger(__name__)

SLOW_CLIENT_CLOSE_CODE = 4008
#: The connection's API key was revoked since its handshake.
KEY_REVOKED_CLOSE_CODE = 4003
Send = Callable[[dict[str, Any]], Awaitable[None]]


def _text_header(size: int) -> bytes:
    if size < 126:
        return bytes((0x81, size))
    if size < 65536:
        return b"\x81\x7e" + size.to_bytes(2, "big")
    return b"\x81\x7f" + size.to_bytes(8, "big")


class ClientGone(Exception):
    """The connection closed under the writer."""


class Session:
    """Outgoing side of one connection."""

    def __init__(self, send: Send, max_queue_frames: int, close_timeout_s: float = 5.0,
                 send_buffer_bytes: int = 0) -> None:
        self._send = send
        self._proto = _sansio_protocol(send)
        self.pending: list[bytes] = []
        self.max_queue_frames = max_queue_frames
        self.closed = False
        #: How long a too-slow client gets to read up to the 4008 close frame.
        self.close_timeout_s = close_timeout_s
        self._wake = asyncio.Event()
        if send_buffer_bytes > 0 and self._proto is not None:
            _limit_send_buffer(self._proto.transport, send_buffer_bytes)

    def send(self, frame: bytes) -> None:
        """Queue a frame without waiting; too many unsent frames while the transport is backed up
        mark the client as too slow."""
        if self.closed:
            return
        if len(self.pending) >= self.max_queue_frames and self._backed_up():
            metrics.SLOW_CLIENTS.inc()
            self.close(SLOW_CLIENT_CLOSE_CODE, "client too slow: output buffer full")
            return
        self.pending.append(frame)
        self._wake.set()

    def _backed_up(self) -> bool:
        """The client is not reading what was written: the transport is over its high mark, so
        the writer waits (always true for servers whose flow control we cannot see)."""
        proto = self._proto
        return proto is None or not proto.writable.is_set()

    async def writer(self) -> None:
        """Send what is pending, batch by batch, until the connection goes."""
        try:
            while not self.closed:
                await self._wake.wait()
                self._wake.clear()
                frames, self.pending = self.pending, []
                if frames:
                    await self._write(frames)
        except ClientGone:
            self.closed = True

    async def _write(self, frames: list[bytes]) -> None:
        proto = self._proto
        if proto is None:
            for frame in frames:
                await self._send({"type": "websocket.send", "text": frame.decode()})
            return
        await proto.writable.wait()  # flow control: the transport's buffer is over its high mark
        # A transport that is closing (a failed write, the close handshake) takes no more data:
        # asyncio counts such writes and logs "socket.send() raised exception." from the fifth.
        if proto.disconnected or proto.close_sent or proto.transport.is_closing():
            raise ClientGone
        conn = proto.conn
        if conn.extensions or conn.state is not State.OPEN or conn.expect_continuation_frame:
            for frame in frames:
                conn.send_text(frame)  # compression negotiated, or closing: the library frames them
            proto.transport.write(b"".join(conn.data_to_send()))
            return
        # Plain server frames are a 2-10 byte header and the payload (RFC 6455 5.2: FIN, opcode
        # 1, unmasked): built here, once per frame, instead of a Frame object and its serializer
        # per token. Whatever the library had queued (a pong) goes first.
        out = conn.data_to_send()
        out += [_text_header(len(frame)) + frame for frame in frames]
        proto.transport.write(b"".join(out))

    def close(self, code: int, reason: str) -> None:
        """Close the connection now with ``code``, dropping what is still unsent."""
        if self.closed:
            return
        self.closed = True
        self.pending = []
        self._wake.set()
        asyncio.get_running_loop().create_task(self._close(code, reason))

    async def _close(self, code: int, reason: str) -> None:
        """Send the close frame; drop the TCP connection if the client has not read up to it in
        time (a client that stopped reading never would, and its requests would live on until
        the keepalive ping gave up)."""
        proto = self._proto
        if proto is None:
            try:
                await asyncio.wait_for(self._send({"type": "websocket.close", "code": code, "reason": reason}),
                                       self.close_timeout_s)
            except (TimeoutError, OSError, RuntimeError):
                pass
            return
        if not proto.close_sent and not proto.transport.is_closing():
            proto.conn.send_close(code, reason)
            proto.transport.write(b"".join(proto.conn.data_to_send()))
            proto.close_sent = True
        # uvicorn closes the transport on the client's echo only for a close it sent itself: a
        # client that reads gets its TCP close once it echoes, one that does not at the timeout.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.close_timeout_s
        while not proto.disconnected and proto.conn.close_rcvd is None and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not proto.disconnected:
            if proto.conn.close_rcvd is not None:
                proto.transport.close()
            else:
                proto.transport.abort()


def _sansio_protocol(send: Send) -> Any | None:
    """uvicorn's sans-I/O WebSocket protocol behind ``send``, if that is what serves us."""
    proto = getattr(send, "__self__", None)
    conn = getattr(proto, "conn", None)
    if all(hasattr(proto, a) for a in ("transport", "writable", "disconnected", "close_sent")) and \
            hasattr(conn, "send_text") and hasattr(conn, "data_to_send"):
        return proto
    return None


def _limit_send_buffer(transport: asyncio.Transport, num_bytes: int) -> None:
    """Cap the kernel's send buffer for one client: with Linux autotuning (up to 4 MiB) a client
    that stops reading would park that much in the kernel before the pending list filled and
    the 4008 close could happen."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, num_bytes)
