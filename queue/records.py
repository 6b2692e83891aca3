"""What a request's record in Redis must hold for the queue scripts and the workers to use it.

Lanes writes these records itself, so a malformed one comes from elsewhere: a hand edit, another
program sharing the key prefix, a version of lanes with another layout. ``record_fault`` names
what is wrong, so that the one request is failed with a reason (``QueuePlane.quarantine``)
instead of killing every worker that claims it, or stopping the reaper for its whole pool.
Pure: no I/O.
"""

from __future__ import annotations

import math

import msgspec
from lanes.queue.messages import Lane, RequestPayload, RequestState

#: The states the queue scripts write.
STATES = frozenset(m.value for m in RequestState)
#: Fields every record lanes writes has (``ENQUEUE``), which the scripts read.
_REQUIRED = ("p", "lane", "edge", "state", "attempt", "enq_ms")
#: Fields that scripts use as numbers: integers (``HINCRBY``) or finite numbers (scores, clocks).
_NUMERIC: dict[str, type[int] | type[float]] = {
    "attempt": int, "expired": int, "preempted": int,
    "enq_ms": float, "ready_ms": float, "claim_ms": float, "first_claim_ms": float,
}
_LANES = frozenset(m.value for m in Lane)
_payload = msgspec.json.Decoder(RequestPayload)


def record_fault(request_id: str, fields: dict[bytes, bytes]) -> str | None:
    """What is wrong with request ``request_id``'s record (its hash's fields), or None."""
    def text(name: str) -> str | None:
        raw = fields.get(name.encode())
        return None if raw is None else raw.decode("utf-8", "replace")

    if missing := [name for name in _REQUIRED if name.encode() not in fields]:
        return f"it has no field {', '.join(repr(m) for m in missing)}"
    for name, kind in _NUMERIC.items():
        if (value := text(name)) is not None and not _parses(value, kind):
            return f"field '{name}' is {value[:40]!r}, not {'an integer' if kind is int else 'a number'}"
    if (state := text("state")) is not None and state not in STATES:
        return f"field 'state' is {state[:40]!r}, not one of {', '.join(sorted(STATES))}"
    if (lane := text("lane")) is not None and lane not in _LANES:
        return f"field 'lane' is {lane[:40]!r}, not short, medium or long"
    try:
        payload = _payload.decode(fields[b"p"])
    except msgspec.DecodeError as exc:  # ValidationError too
        return f"its payload (field 'p') is not a request: {str(exc)[:120]}"
    if payload.id != request_id:
        return f"its payload names another request ({payload.id[:64]!r})"
    return None


def _parses(value: str, kind: type[int] | type[float]) -> bool:
    try:
        return math.isfinite(kind(value))
    except ValueError:
        return False
