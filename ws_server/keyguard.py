"""Per-connection API-key bookkeeping at the edge: who each handshake authenticated as, and
whether a key may start one more request (its rate and its in-flight cap)."""

from __future__ import annotations

import dataclasses
import time
import weakref

from websockets.asyncio.server import ServerConnection

from lanes.queue.plane import QueuePlane
from lanes.ws_server.auth import ANONYMOUS, Identity
from lanes.ws_server.ratelimit import KeyLimiter, Refusal, RefusalCode
from lanes.ws_server.session import Session


class KeyGuard:
    def __init__(self, plane: QueuePlane, fleet_rate: bool) -> None:
        self.plane = plane
        #: True: a key's rate is one token bucket in Redis shared by every edge.
        self.fleet_rate = fleet_rate
        self.limiter = KeyLimiter()
        #: Who each handshake authenticated as (weak: a handshake that fails later leaves nothing).
        self.identities: weakref.WeakKeyDictionary[ServerConnection, Identity] = weakref.WeakKeyDictionary()
        #: Sessions per API key id: the key's in-flight count is the sum of their routes.
        self.key_sessions: dict[str, weakref.WeakSet[Session]] = {}

    def identity(self, session: Session) -> Identity:
        return self.identities.get(session.ws, ANONYMOUS)  # type: ignore[arg-type]

    def owner(self, session: Session) -> str:
        """The API key id a session authenticated with ("" when auth is off)."""
        return self.identity(session).key_id

    async def refusal(self, session: Session) -> Refusal | None:
        """Why this session's key may not start another request now, or None."""
        identity = self.identity(session)
        if identity is ANONYMOUS:
            return None
        sessions = self.key_sessions.setdefault(identity.key_id, weakref.WeakSet())
        sessions.add(session)
        num_in_flight = sum(len(s.routes) for s in sessions)
        limits = identity.limits
        if self.fleet_rate:  # the rate is checked in Redis instead, below
            limits = dataclasses.replace(limits, rate_per_s=0.0)
        refusal = self.limiter.check(identity.key_id, limits, num_in_flight, time.monotonic())
        if refusal is None and self.fleet_rate and identity.limits.rate_per_s > 0:
            wait_ms = await self.plane.take_token(identity.key_id, identity.limits.rate_per_s, identity.limits.burst)
            if wait_ms > 0:
                refusal = Refusal(RefusalCode.RATE_LIMITED,
                                  f"over {identity.limits.rate_per_s:g} requests/s for this key", retry_after_ms=wait_ms)
        return refusal
