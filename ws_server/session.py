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
    """Outgoing side of one connection."""

    def __init__(self, ws: object, max_queue_frames: int, close_timeout_s: float = 5.0) -> None:
        self.ws = ws
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(max_queue_frames)
        self.closed = False
        #: How long a too-slow client gets to read up to the 4008 close frame.
        self.close_timeout_s = close_timeout_s
        self._closer: asyncio.Task[None] | None = None

    def send(self, frame: bytes) -> None:
        """Queue a frame without waiting; a full queue marks the client as too slow."""
        if self.closed:
            return
        try:
            self.queue.put_nowait(frame)
        except asyncio.QueueFull:
            metrics.SLOW_CLIENTS.inc()
            self.closed = True
            self._closer = asyncio.get_running_loop().create_task(self._close_slow())

    async def _close_slow(self) -> None:
        """Close with 4008; drop the TCP connection if that does not finish in time.

        ``close()`` first waits for the socket to drain, which a client that stopped reading
        never lets happen, so without the timeout the connection (and its running requests)
        would live on until the keepalive ping gave up.
        """
        ws: Any = self.ws
        closing = ws.close(SLOW_CLIENT_CLOSE_CODE, "client too slow: output buffer full")
        try:
            await asyncio.wait_for(closing, self.close_timeout_s)
        except TimeoutError:
            ws.transport.abort()

    async def writer(self) -> None:
        while (frame := await self.queue.get()) is not None:
            await self.ws.send(frame, text=True)  # type: ignore[attr-defined]
