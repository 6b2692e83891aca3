"""The outgoing side of one WebSocket connection: a bounded frame queue and its writer.

The Redis reader never awaits a socket: the delivery core's ``Send`` actions only put frames
on the session's bounded queue. A client that does not read fills its queue and is closed
(close code 4008), so one slow client cannot stall token delivery for the others.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from lanes.telemetry import metrics

log = logging.getLogger(__name__)

SLOW_CLIENT_CLOSE_CODE = 4008


class Session:
    """Outgoing side of one connection: frames wait in a list; the writer sends everything
    that is waiting in one socket write."""

    def __init__(self, ws: Any, max_queue_frames: int, close_timeout_s: float = 5.0) -> None:
        self.ws = ws
        self.pending: list[bytes] = []
        self.max_queue_frames = max_queue_frames
        self.closed = False
        #: How long a too-slow client gets to read up to the 4008 close frame.
        self.close_timeout_s = close_timeout_s
        self._wake = asyncio.Event()
        self._closer: asyncio.Task[None] | None = None

    def send(self, frame: bytes) -> None:
        """Queue a frame without waiting; too many unsent frames mark the client as too slow."""
        if self.closed:
            return
        if len(self.pending) >= self.max_queue_frames:
            metrics.SLOW_CLIENTS.inc()
            self.closed = True
            self._closer = asyncio.get_running_loop().create_task(self._close_slow())
            return
        self.pending.append(frame)
        self._wake.set()

    async def _close_slow(self) -> None:
        """Close with 4008; drop the TCP connection if that does not finish in time.

        ``close()`` first waits for the socket to drain, which a client that stopped reading
        never lets happen, so without the timeout the connection (and its running requests)
        would live on until the keepalive ping gave up.
        """
        closing = self.ws.close(SLOW_CLIENT_CLOSE_CODE, "client too slow: output buffer full")
        try:
            await asyncio.wait_for(closing, self.close_timeout_s)
        except TimeoutError:
            self.ws.transport.abort()

    async def writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            frames, self.pending = self.pending, []
            if frames:
                await send_frames(self.ws, frames)


async def send_frames(ws: Any, frames: list[bytes]) -> None:
    """Send text ``frames`` in one socket write: one syscall per client per token batch, not per
    frame (each write on loopback costs a kernel round of the TCP stack).

    Drives the connection's sans-I/O protocol directly inside its ``send_context`` (which checks
    the state and applies flow control on exit, as ``send`` does); frames are never fragmented,
    so nothing else interleaves. Raises ``ConnectionClosed`` like ``send``.
    """
    async with ws.send_context():
        protocol = ws.protocol
        for frame in frames:
            protocol.send_text(frame)
        ws.transport.write(b"".join(protocol.data_to_send()))
