"""The delivery core's per-request state and its settings."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from lanes.queue.messages import Finish, TokenEvent


class Phase(enum.Enum):
    OPENING = "opening"  # chat registered, limits / prediction / enqueue in flight
    RESUMING = "resuming"  # resume registered, re-point in flight
    ACTIVE = "active"


@dataclass(frozen=True)
class DeliveryConfig:
    """How long a request survives its client's disconnect before it is cancelled (s)."""

    resume_grace_s: float = 15.0
    #: After a cancel of a running request, how long to wait for the worker's final frame (s).
    cancel_grace_s: float = 2.0
    #: After a resume, re-read the stream this much later (s): the worker learns the new edge
    #: only at its next heartbeat, and what it publishes before that goes to the old one.
    refill_after_s: float = 0.7
    #: A running request silent this long is checked in Redis (gone? moved to another edge?).
    quiet_s: float = 3.0
    #: A running request of which nothing was heard this long (no token, no check of it
    #: answered: Redis is out of reach) ends ``unavailable`` instead of waiting for Redis for ever.
    unreachable_s: float = 30.0
    max_in_flight_per_connection: int = 64


@dataclass
class Entry:
    """Everything about one request this edge serves."""

    id: str
    #: API key id that owns the request ("" with auth off).
    key: str
    #: Connection delivering it; None during the disconnect grace.
    conn: int | None
    phase: Phase
    lane: str = "resumed"
    received_at: float = 0.0
    #: Next seq the current connection expects.
    next_seq: int = 0
    #: Events that arrived ahead of ``next_seq`` or before ``accepted``.
    buffered: dict[int, TokenEvent] = field(default_factory=dict)
    #: The current connection got its opening frame (``accepted`` or ``resumed``).
    announced: bool = False
    filling: bool = False
    first_token_at: float | None = None
    num_tokens: int = 0
    last_heard_at: float = 0.0
    grace_until: float | None = None
    cancel_until: float | None = None
    refill_at: float | None = None
    #: A cancel arrived before the enqueue finished (or the connection left with no grace, or
    #: its key was revoked): cancel once accepted.
    cancel_pending: bool = False
    #: The request's state in Redis when last looked up (re-point or check), "" before.
    redis_state: str = ""
    #: A resume took over this chat before its enqueue returned: announce with ``resumed``
    #: (after this seq) instead of ``accepted`` once it is accepted.
    resumed_after: int | None = None
    #: Another edge said it took the request over, and the check of Redis has not answered:
    #: an end that arrives meanwhile waits in ``held_end`` for it (the worker may still send
    #: here, not knowing of the resume, and the end may be the new owner's cancel).
    takeover_pending: bool = False
    held_end: Finish | None = None
    #: The core's notice count at the latest notice for this request.
    notice_no: int = 0
