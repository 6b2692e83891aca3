"""Cancels Redis has not taken yet: one queue per edge, drained by one loop (``Edge.send_cancels``).

A cancel Redis does not answer (an outage) stays here and is sent again until Redis answers, for
up to ``CANCEL_RETRY_S``: dropped, its request ran on for nobody once Redis was back (the edge is
alive, so no worker's orphan check ends it). One loop with one ``Backoff`` sends every pending
cancel, each pool's in one pipeline per attempt: one warning when it starts failing (with the
count pending), one line when Redis takes them. Before, each cancel had a retry loop of its own:
N commands every 1-5 s, N warnings and N recovery lines.

At most ``MAX_PENDING_CANCELS`` wait: a cancel past that is refused (the edge logs it and counts
it in ``lanes_edge_cancels_dropped_total{reason="full"}``; a client's own is still answered, as
any cancel during an outage). Those pending keep their place: they wait longest, and each is a
request running for nobody until it lands, as the refused one is.

Sans-I/O: no Redis, no clock (times are arguments), no logging.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: How long a cancel Redis does not answer is retried before it is given up (s).
CANCEL_RETRY_S = 600.0
#: Most cancels pending at once; one more is refused (a few hundred bytes each, one script each
#: in the pipeline of the next attempt).
MAX_PENDING_CANCELS = 10_000


@dataclass
class Pending:
    """One cancel Redis has not taken."""

    #: The pool whose keys hold the request.
    pool: str
    #: When it was queued (s, the caller's monotonic clock).
    since_s: float
    #: A client's own cancel not answered yet (``cancel_result``, or ``cancel_failed`` once an
    #: attempt failed): its client resumed it meanwhile only if this is unset (``batch``).
    report: bool


class PendingCancels:
    """Cancels to send to Redis, oldest first, each once however often it was asked for."""

    def __init__(self, max_pending: int = MAX_PENDING_CANCELS, retry_s: float = CANCEL_RETRY_S) -> None:
        self.max_pending = max_pending
        self.retry_s = retry_s
        self._pending: dict[str, Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def add(self, request_id: str, pool: str, report: bool, now_s: float) -> bool:
        """Queue a cancel; False when it is refused (``max_pending`` wait already). A request
        already pending keeps its place (and wants its answer if either cancel does)."""
        pending = self._pending.get(request_id)
        if pending is not None:
            pending.report = pending.report or report
            return True
        if len(self._pending) >= self.max_pending:
            return False
        self._pending[request_id] = Pending(pool, now_s, report)
        return True

    def batch(self, now_s: float, stands: Callable[[str], bool]) -> tuple[dict[str, list[str]], list[str]]:
        """What to send now, per pool; and the ids given up (pending ``retry_s``), forgotten.

        A cancel already answered to its client (or never asked for by one) is dropped without a
        word when ``stands`` says no: its client resumed the request here meanwhile (a fresh
        entry nobody cancelled, ``Delivery.cancel_stands``)."""
        given_up = [rid for rid, p in self._pending.items() if now_s - p.since_s >= self.retry_s]
        dropped = [rid for rid, p in self._pending.items() if not p.report and not stands(rid)]
        for request_id in (*given_up, *dropped):
            self._pending.pop(request_id, None)
        by_pool: dict[str, list[str]] = {}
        for request_id, pending in self._pending.items():
            by_pool.setdefault(pending.pool, []).append(request_id)
        return by_pool, given_up

    def sent(self, request_id: str) -> bool:
        """Redis took it: forgotten. Returns whether its client wants ``cancel_result``."""
        pending = self._pending.pop(request_id, None)
        return pending is not None and pending.report

    def unanswered(self) -> list[str]:
        """Clients' own cancels not answered yet, now marked answered (the caller tells each
        ``cancel_failed``: its answer ends after the cancel grace; the cancel stays pending)."""
        ids = [rid for rid, p in self._pending.items() if p.report]
        for request_id in ids:
            self._pending[request_id].report = False
        return ids

    def answered(self, request_id: str) -> bool:
        """``unanswered`` for one cancel: whether it waited for its client's answer (now marked
        answered)."""
        pending = self._pending.get(request_id)
        if pending is None or not pending.report:
            return False
        pending.report = False
        return True

    def first(self, limit: int = 5) -> list[str]:
        """The oldest pending ids (for log lines)."""
        return list(self._pending)[:limit]
