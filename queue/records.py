"""What a request's record in Redis must hold for the queue scripts and the workers to use it.

Lanes writes these records itself, so a malformed one comes from elsewhere: a hand edit, another
program sharing the key prefix, a version of lanes with another layout. ``record_fault`` names
what is wrong, so that the one request is failed with a reason (``QueuePlane.quarantine``)
instead of killing every worker that claims it, or stopping the reaper for its whole pool.
Pure: no I/O.
"""

from __future__ import annotations

import msgspec
from lanes.queue.messages import Lane, RequestPayload, RequestState

#: The states the queue scripts write.
STATES = frozenset(m.value for m in RequestState)
#: Fields every record lanes writes has (``ENQUEUE``), which the scripts read.
_REQUIRED = ("p", "lane", "edge", "state", "attempt", "enq_ms")
#: Fields that scripts use as integers (``HINCRBY``) or numbers (scores, clocks).
_INTEGERS = ("attempt", "expired", "preempted")
_NUMBERS = ("enq_ms", "ready_ms", "claim_ms", "first_claim_ms")
_payload = msgspec.json.Decoder(RequestPayload)


def record_fault(request_id: str, fields: dict[bytes, bytes]) -> str | None:
    """What is wrong with request ``request_id``'s record (its hash's fields), or None."""
    def text(name: str) -> str | None:
        raw = fields.get(name.encode())
        return None if raw is None else raw.decode("utf-8", "replace")

    if missing := [name for name in _REQUIRED if name.encode() not in fields]:
        return f"it has no field {', '.join(repr(m) for m in missing)}"
    for name in _INTEGERS:
        if (value := text(name)) is not None and not _is_int(value):
            return f"field '{name}' is {value[:40]!r}, not an integer"
    for name in _NUMBERS:
        if (value := text(name)) is not None and not _is_number(value):
            return f"field '{name}' is {value[:40]!r}, not a number"
    if (state := text("state")) is not None and state not in STATES:
        return f"field 'state' is {state[:40]!r}, not one of {', '.join(sorted(STATES))}"
    if (lane := text("lane")) is not None and lane not in {m.value for m in Lane}:
        return f"field 'lane' is {lane[:40]!r}, not short, medium or long"
    try:
        payload = _payload.decode(fields[b"p"])
    except msgspec.DecodeError as exc:  # ValidationError too
        return f"its payload (field 'p') is not a request: {str(exc)[:120]}"
    if payload.id != request_id:
        return f"its payload names another request ({payload.id[:64]!r})"
    return None


def _is_int(value: str) -> bool:
    try:
        int(value)
    except ValueError:
        return False
    return True


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return value.strip().lower() not in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity")
