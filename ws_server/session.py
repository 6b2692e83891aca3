"""One WebSocket connection: its outgoing frame queue and the requests it has in flight.

The Redis reader never awaits a socket: it calls ``Route.deliver`` which only puts frames
on the session's bounded queue. A client that does not read fills its queue and is closed
(close code 4008), so one slow client cannot stall token delivery for the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from lanes.queue.messages import Finish, FinishReason, TokenEvent, Usage
from lanes.telemetry import metrics
from lanes.ws_server import protocol

log = logging.getLogger(__name__)

SLOW_CLIENT_CLOSE_CODE = 4008


class Session:
    """Outgoing side of one connection."""

    def __init__(self, ws: object, max_queue_frames: int, close_timeout_s: float = 5.0) -> None:
        self.ws = ws
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(max_queue_frames)
        self.routes: dict[str, Route] = {}
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


@dataclass
class Route:
    """Delivery state of one request on one session: in order, no duplicates, no gaps."""

    id: str
    session: Session
    lane: str
    received_at: float = field(default_factory=time.perf_counter)
    next_seq: int = 0
    first_token_at: float | None = None
    num_tokens: int = 0
    done: bool = False
    buffered: dict[int, TokenEvent] = field(default_factory=dict)
    #: Called with the seq after which the stream must be read to fill a gap.
    fill_gap: Callable[[Route, int], Awaitable[None]] | None = None
    filling: bool = False
    #: When this route last heard of its request (for the lost-request check).
    last_heard_at: float = field(default_factory=time.monotonic)

    def deliver(self, event: TokenEvent) -> None:
        self.last_heard_at = time.monotonic()
        if self.done or event.seq < self.next_seq:
            return  # duplicate (retry, replay or gap fill overlap)
        if event.seq > self.next_seq:
            self.buffered[event.seq] = event
            if self.fill_gap is not None and not self.filling:
                self.filling = True
                asyncio.get_running_loop().create_task(self.fill_gap(self, self.next_seq - 1))
            return
        self._emit(event)
        while not self.done and self.next_seq in self.buffered:
            self._emit(self.buffered.pop(self.next_seq))

    def _emit(self, event: TokenEvent) -> None:
        self.next_seq = event.seq + 1
        self.num_tokens += len(event.token_ids)
        if event.text or event.finish is None:
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
                metrics.TTFT.labels(self.lane).observe(self.first_token_at - self.received_at)
            self.session.send(protocol.delta_frame(self.id, event.seq, event.text))
        if event.finish is not None:
            self.finish(event.finish)

    def finish(self, finish: Finish) -> None:
        """Send the terminal frame once."""
        if self.done:
            return
        self.done = True
        self.buffered.clear()
        self.session.routes.pop(self.id, None)
        metrics.IN_FLIGHT.dec()
        now = time.perf_counter()
        metrics.E2E.labels(self.lane).observe(now - self.received_at)
        metrics.QUEUE_WAIT.labels(self.lane).observe(finish.queue_ms / 1000)
        metrics.REQUESTS.labels(self.lane, finish.reason.value).inc()
        if finish.reason is FinishReason.ERROR:
            code = finish.error_code or "internal"
            metrics.ERRORS.labels(code).inc()
            self.session.send(protocol.error_frame(code, finish.error_message or code, self.id))
            return
        ttft = (self.first_token_at or now) - self.received_at
        timing = protocol.Timing(
            queue_ms=round(finish.queue_ms, 3), ttft_ms=round(ttft * 1000, 3),
            total_ms=round((now - self.received_at) * 1000, 3),
        )
        self.session.send(protocol.done_frame(self.id, finish.reason, finish.usage, timing))

    def lost(self) -> None:
        """The request vanished from Redis (restarted without persistence, or flushed)."""
        self.finish(Finish(FinishReason.ERROR, Usage(0, self.num_tokens), error_code="request_lost",
                           error_message="the request's state was lost (queue restarted); resubmit it"))

    def cancelled_locally(self) -> None:
        """End a request that never reached a worker (or whose worker never answered)."""
        self.finish(Finish(FinishReason.CANCELLED, Usage(0, self.num_tokens)))
