"""Whether an API key may start one more request now (its rate, per edge or fleet-wide), and
open one more connection on this edge. The in-flight cap is counted by the delivery core, which
owns every request (``delivery/``)."""

from __future__ import annotations

import time
from collections import Counter

from lanes.queue.plane import QueuePlane
from lanes.ws_server import auth
from lanes.ws_server.auth import ANONYMOUS, Identity
from lanes.ws_server.ratelimit import KeyLimiter, Refusal, rate_limited


class KeyGuard:
    def __init__(self, plane: QueuePlane, fleet_rate: bool) -> None:
        self.plane = plane
        #: True: a key's rate is one token bucket in Redis shared by every edge.
        self.fleet_rate = fleet_rate
        self.limiter = KeyLimiter()
        #: Open WebSockets and dashboard streams per key on this edge (``max_connections``).
        self.connections = ConnectionCounts()

    def connection_refusal(self, identity: Identity) -> auth.Refusal | None:
        """429 when the key already holds ``max_connections`` open here, else None."""
        limit = identity.limits.max_connections
        if identity.key_id and limit and self.connections.open[identity.key_id] >= limit:
            return auth.too_many_connections(limit)
        return None

    async def rate_refusal(self, identity: Identity) -> Refusal | None:
        """Why this key may not start another request now (over its rate), or None."""
        if identity is ANONYMOUS:
            return None
        if not self.fleet_rate:  # this edge's bucket (the delivery core counts requests in flight)
            return self.limiter.check(identity.key_id, identity.limits, 0, time.monotonic())
        if identity.limits.rate_per_s <= 0:
            return None
        wait_ms = await self.plane.take_token(identity.key_id, identity.limits.rate_per_s, identity.limits.burst)
        return rate_limited(identity.limits, wait_ms) if wait_ms > 0 else None

    async def ticket_refusal(self, identity: Identity) -> str | None:
        """Why this key may not have another WebSocket ticket now (its rate: each ticket is a
        key in Redis), or None."""
        refusal = await self.rate_refusal(identity)
        return None if refusal is None else refusal.message


class ConnectionCounts:
    """Connections open per key id; a key with none is forgotten."""

    def __init__(self) -> None:
        self.open: Counter[str] = Counter()

    def opened(self, key_id: str) -> None:
        self.open[key_id] += 1

    def closed(self, key_id: str) -> None:
        self.open[key_id] -= 1
        if self.open[key_id] <= 0:
            del self.open[key_id]
