"""What the delivery core asks its shell to do (see ``core.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Send:
    """Queue ``frame`` on connection ``conn``."""

    conn: int
    frame: bytes
    #: Set for ``error`` frames (the shell counts them by code).
    error_code: str | None = None


@dataclass(frozen=True)
class ReadStream:
    """Read the request's stream after ``after_seq`` and call ``stream_read`` with it; with
    ``with_last`` pass the stream's last entry too (to end a finished request)."""

    request_id: str
    after_seq: int
    with_last: bool = False


@dataclass(frozen=True)
class CancelRequest:
    """Cancel the request in Redis, unless another edge has taken it over; a ``cancel`` from
    the client wants ``cancel_result`` back."""

    request_id: str
    report: bool = False


@dataclass(frozen=True)
class Repoint:
    """Point the request's tokens at this edge if ``key`` submitted it; call ``repointed``."""

    request_id: str
    key: str


@dataclass(frozen=True)
class CheckRequests:
    """Look up each request's edge and state (None: gone); call ``checked``."""

    request_ids: tuple[str, ...]
    #: The tick's check of quiet requests (one at a time), not a takeover notice's.
    periodic: bool = True
    #: Takeover notices the core had heard of when it asked: an answer settles a notice only
    #: if it was asked for after it (an older read may predate the other edge's re-point).
    notices: int = 0


@dataclass(frozen=True)
class FirstToken:
    """A request's first delta went out (for metrics)."""

    lane: str
    ttft_s: float
    request_id: str = ""


@dataclass(frozen=True)
class Finished:
    """A request ended on this edge (for metrics and logs)."""

    request_id: str
    lane: str
    outcome: str
    e2e_s: float | None = None
    queue_ms: float | None = None
    #: Refused before it was enqueued (``outcome`` is the error code), and why (admission's
    #: reason such as ``lane_full``; "" when the code says it all).
    refused: bool = False
    reason: str = ""


Action = Send | ReadStream | CancelRequest | Repoint | CheckRequests | FirstToken | Finished
