"""The edge's delivery core, sans-I/O: one object owns every request this edge serves, from
``accepted`` to its terminal frame.

Events go in (a chat or resume registered, the enqueue's outcome, token batches from the edge's
channel, a stream read back, a connection closed, the clock ticking); actions come out (send a
frame, read the stream, cancel in Redis, re-point, check requests, record a finished request).
``Edge`` (``edge.py``) reads sockets and Redis and carries the actions out; nothing here awaits,
reads the clock or touches a socket, so every interleaving is testable without a loop.

Invariants (checked by ``tests/test_delivery_state.py`` over random interleavings):

- A connection's first frame for a request is ``accepted`` (chat) or ``resumed`` (resume), or
  else its only one, an ``error``: a refusal, or ``resumed_elsewhere`` for a resume that another
  resume of the request overtook before it was answered. Its last is exactly one terminal
  frame: ``done``, ``error``, or ``resumed_elsewhere`` when a resume on another connection took
  the request over. No stream ends silently.
- Deltas reach a connection in seq order, contiguous, never twice.
- A request id is registered atomically with its duplicate check (no await in between).
- An entry is forgotten at its terminal frame, or at the end of its disconnect grace: nothing
  outlives its request's end plus the grace, except an end held for a takeover notice's check
  of Redis, which waits for Redis to answer one (a quiet check retries it), for at most
  ``unreachable_s`` of silence: a running request of which nothing was heard that long (no
  token, no check answered: Redis is out of reach) ends ``unavailable``.
- Only the API key that submitted a request can resume or cancel it; another key's resume is
  answered ``unknown_id`` and changes nothing.

Seqs: a request's events carry seq 0, 1, 2 ...; the last carries ``finish``. A finish whose seq
lies below what the connection has seen (a resume with ``last_seq`` past the end) still ends the
request, so such a resume never waits for tokens that will not come.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from lanes.queue.errors import ErrorCode
from lanes.queue.messages import Finish, FinishReason, TokenEvent, Usage
from lanes.queue.stats import NO_LANE
from lanes.ws_server import protocol
from lanes.ws_server.delivery.actions import (
    Action,
    CancelRequest,
    CheckRequests,
    Finished,
    FirstToken,
    ReadStream,
    Repoint,
    Send,
)
from lanes.ws_server.delivery.entry import DeliveryConfig, Entry, Phase

#: The outcome label of a request that ended because its client left and never came back.
DISCONNECTED = "disconnected"
_TERMINAL_STATES = frozenset({"done", "cancelled", "failed"})


class Delivery:
    """Owner of every request on one edge. Times are seconds on one monotonic clock."""

    def __init__(self, edge_id: str, config: DeliveryConfig) -> None:
        self.edge_id = edge_id
        #: Takeover notices heard so far (``CheckRequests.notices``).
        self.notices = 0
        self.config = config
        self.entries: dict[str, Entry] = {}
        #: Requests in flight per connection and per API key (what the caps count).
        self.per_conn: Counter[int] = Counter()
        self.per_key: Counter[str] = Counter()
        self._checking = False

    # -- registration ------------------------------------------------------------------

    def open_chat(self, conn: int, request_id: str, key: str, key_max_in_flight: int,
                  now: float) -> tuple[bool, list[Action]]:
        """Register a chat (the duplicate check and registration are one step). Returns
        whether it is registered; if not, the actions carry its error frame."""
        refusal = None
        if request_id in self.entries:
            refusal = (ErrorCode.DUPLICATE_ID, f"{_request(request_id)} is already in flight")
        elif self.per_conn[conn] >= self.config.max_in_flight_per_connection:
            refusal = (ErrorCode.TOO_MANY_IN_FLIGHT,
                       f"at most {self.config.max_in_flight_per_connection} requests in flight per connection")
        elif self._key_full(key, key_max_in_flight):
            refusal = (ErrorCode.TOO_MANY_IN_FLIGHT, _key_cap_message(key_max_in_flight))
        if refusal is not None:
            # Counted with the other refusals (metrics, the dashboard); a duplicate's id is still
            # in flight here, which the shell must not take for this refusal's end.
            return False, [Finished(request_id, NO_LANE, refusal[0].value, refused=True),
                           _send_error(conn, refusal[0], refusal[1], request_id)]
        self._add(Entry(request_id, key, conn, Phase.OPENING, received_at=now, last_heard_at=now))
        return True, []

    def accepted(self, request_id: str, lane: str, predicted_tokens: int, now: float,
                 pool: str | None = None) -> list[Action]:
        """The enqueue succeeded (into ``pool``): ``accepted`` first, then whatever arrived meanwhile."""
        entry = self.entries.get(request_id)
        if entry is None or entry.phase is not Phase.OPENING:
            return []
        entry.phase, entry.lane, entry.last_heard_at = Phase.ACTIVE, lane, now
        actions: list[Action] = []
        if entry.conn is not None and not entry.announced:
            entry.announced = True
            if entry.resumed_after is None:
                actions.append(Send(entry.conn, protocol.accepted_frame(request_id, lane, predicted_tokens, pool)))
            else:
                actions.append(Send(entry.conn, protocol.resumed_frame(request_id, entry.resumed_after)))
        if entry.cancel_pending:
            actions.append(CancelRequest(request_id, report=True))
        if entry.takeover_pending:  # a notice came while the enqueue was out
            actions.append(CheckRequests((request_id,), periodic=False, notices=self.notices))
        return actions + self._drain(entry, now)

    def refuse(self, request_id: str, code: ErrorCode, message: str, lane: str = NO_LANE,
               **extra: object) -> list[Action]:
        """The chat was not enqueued (limit, admission, Redis): its error frame, and forget it."""
        entry = self.entries.get(request_id)
        if entry is None or entry.phase is not Phase.OPENING:
            return []
        if code == ErrorCode.DUPLICATE_ID and entry.resumed_after is not None:
            # A resume took this registration over while the enqueue was out, and Redis says
            # the id exists (a resubmitted chat): the refusal is the chat's, which already got
            # ``resumed_elsewhere``; the resume goes on as one of a request this edge does not
            # hold. Before, the resume was answered the chat's ``duplicate_id`` and got nothing.
            return [Finished(request_id, lane, str(code), refused=True), self._repoint(entry)]
        self._remove(entry)
        actions: list[Action] = [Finished(request_id, lane, str(code), refused=True,
                                           reason=str(extra.get("reason", "")))]
        if entry.conn is not None:
            actions.append(_send_error(entry.conn, code, message, request_id, **extra))
        return actions

    def resume(self, conn: int, request_id: str, last_seq: int, key: str, now: float,
               key_max_in_flight: int = 0) -> list[Action]:
        """A client wants the rest of a request after ``last_seq``. A request new to this edge
        counts against the key's cap here as a chat does: else submitting on one edge and
        resuming on another ran any number of a key's requests at once."""
        entry = self.entries.get(request_id)
        full = self.per_conn[conn] >= self.config.max_in_flight_per_connection
        if entry is None:
            if full:
                return [self._too_many(conn, request_id)]
            if self._key_full(key, key_max_in_flight):
                return [_send_error(conn, ErrorCode.TOO_MANY_IN_FLIGHT, _key_cap_message(key_max_in_flight), request_id)]
            self.notices += 1
            self._add(Entry(request_id, key, conn, Phase.RESUMING, received_at=now, next_seq=last_seq + 1,
                            last_heard_at=now, notice_no=self.notices))
            return [Repoint(request_id, key)]
        if entry.key != key:  # another key's id must look exactly like an unknown one
            return [_unknown(conn, request_id)]
        if entry.conn == conn:
            return [_send_error(conn, ErrorCode.DUPLICATE_ID,
                                f"{_request(request_id)} is already in flight on this connection", request_id)]
        if full:  # taking over another connection's request counts against this one's cap too
            return [self._too_many(conn, request_id)]
        actions = self._take_over(entry, conn)
        entry.next_seq = last_seq + 1
        entry.buffered = {s: e for s, e in entry.buffered.items() if s > last_seq or e.finish is not None}
        entry.grace_until = None
        entry.cancel_pending = False  # a cancel belonged to the connection that lost the request
        if entry.phase is not Phase.ACTIVE:  # announced once Redis has confirmed the request
            entry.announced, entry.resumed_after = False, last_seq
            return actions
        # Redis may point the request at another edge by now (a client that hopped there and
        # back; this edge would hear of it only at its next check): point it here again first,
        # exactly as for a request this edge does not hold. Tokens meanwhile are buffered.
        # The re-point settles any notice heard so far (it is later than their re-points); an
        # end held for one is in the stream, which the resume reads once re-pointed.
        entry.takeover_pending, entry.held_end = False, None
        return actions + [self._repoint(entry)]

    def _repoint(self, entry: Entry) -> Repoint:
        """Resume ``entry`` as one of a request this edge does not hold: re-point it here in
        Redis and announce it once that is done."""
        entry.phase, entry.announced = Phase.RESUMING, False
        self.notices += 1  # a check read before this re-point must not say it moved
        entry.notice_no = self.notices
        return Repoint(entry.id, entry.key)

    def refuse_resume(self, request_id: str, key: str, message: str) -> list[Action]:
        """The re-point ``key`` asked for could not be made (Redis down): tell the client, forget
        the resume."""
        entry = self.entries.get(request_id)
        if entry is None or entry.phase is not Phase.RESUMING or entry.key != key:
            return []
        self._remove(entry)
        return [] if entry.conn is None else [_send_error(entry.conn, ErrorCode.UNAVAILABLE, message, request_id)]

    def repointed(self, request_id: str, key: str, state: str | None, now: float) -> list[Action]:
        """Redis answered the re-point ``Repoint(request_id, key)`` asked for: ``state`` of the
        request, None when unknown (or another key's: the same answer).

        An answer for another key than the resume waiting now is stale and changes nothing: a
        resume whose connection left and whose grace ran out before Redis answered, while
        another key resumes the same id. Applied, it would hand that key the first key's answer.
        """
        entry = self.entries.get(request_id)
        if entry is None or entry.phase is not Phase.RESUMING or entry.key != key:
            return []
        if state is None:
            self._remove(entry)
            return [] if entry.conn is None else [_unknown(entry.conn, request_id)]
        entry.phase, entry.last_heard_at = Phase.ACTIVE, now
        entry.redis_state = state
        actions: list[Action] = []
        if entry.conn is not None and not entry.announced:
            entry.announced = True
            actions.append(Send(entry.conn, protocol.resumed_frame(request_id, entry.next_seq - 1)))
        ended = state in _TERMINAL_STATES
        if not ended:
            entry.refill_at = now + self.config.refill_after_s
        if entry.takeover_pending:  # a notice came while re-pointing: whose re-point was last?
            actions.append(CheckRequests((request_id,), periodic=False, notices=self.notices))
        actions += self._drain(entry, now)
        if request_id in self.entries:
            entry.filling = True
            actions.append(ReadStream(request_id, entry.next_seq - 1, with_last=ended))
        return actions

    # -- tokens ------------------------------------------------------------------------

    def tokens(self, events: Iterable[TokenEvent], now: float) -> list[Action]:
        """A token batch from this edge's channel."""
        actions: list[Action] = []
        for event in events:
            entry = self.entries.get(event.id)
            if entry is not None:
                actions += self._deliver(entry, event, now)
        return actions

    def stream_read(self, request_id: str, events: Iterable[TokenEvent], last: TokenEvent | None,
                    now: float) -> list[Action]:
        """A ``ReadStream`` came back (``last`` only when asked ``with_last``)."""
        entry = self.entries.get(request_id)
        if entry is None:
            return []
        entry.filling = False
        actions: list[Action] = []
        for event in events:
            actions += self._deliver(entry, event, now, fill=False)
            if request_id not in self.entries:
                return actions
        if entry.redis_state in _TERMINAL_STATES and entry.phase is Phase.ACTIVE:
            if last is not None and last.finish is not None:
                return actions + self._end(entry, last.finish, now)
            if entry.redis_state == "cancelled":
                # Cancelled while queued (no worker ever wrote to its stream), or its worker
                # has not written the end yet: either way the answer ends as cancelled.
                return actions + self._end(entry, Finish(FinishReason.CANCELLED, Usage(0, entry.num_tokens)), now)
            if entry.redis_state == "done":
                return actions + self._lost(entry, now)  # done is set only after the end is written
            # failed: the scheduler writes the end right after; the next check reads it
        return actions

    def stream_failed(self, request_id: str) -> None:
        """A ``ReadStream`` failed (Redis down): the next gap or check will try again."""
        entry = self.entries.get(request_id)
        if entry is not None:
            entry.filling = False

    # -- cancel, disconnect, time --------------------------------------------------------

    def cancel(self, conn: int, request_id: str, now: float) -> list[Action]:
        """The client cancels one of its requests."""
        entry = self.entries.get(request_id)
        if entry is None or entry.conn != conn:
            return [_send_error(conn, ErrorCode.UNKNOWN_ID, f"no {_request(request_id)} in flight on this connection",
                                request_id)]
        if entry.phase is Phase.OPENING:
            entry.cancel_pending = True  # ``accepted`` must come first: cancel after it
            return []
        return [CancelRequest(request_id, report=True)]

    def cancel_result(self, request_id: str, previous_state: str, now: float) -> list[Action]:
        """Redis cancelled it: a queued (or vanished) request ends now; a running one ends with
        the worker's final frame, or locally after ``cancel_grace_s``."""
        entry = self.entries.get(request_id)
        if entry is None:
            return []
        if previous_state in ("queued", "absent"):
            return self._end(entry, Finish(FinishReason.CANCELLED, Usage(0, entry.num_tokens)), now)
        if entry.cancel_until is None:
            entry.cancel_until = now + self.config.cancel_grace_s
        return []

    def cancel_failed(self, request_id: str, now: float) -> list[Action]:
        """Redis did not take the cancel: stop delivering after the cancel grace all the same
        (the shell keeps retrying the cancel itself while ``cancel_stands``)."""
        return self.cancel_result(request_id, "running", now)

    def cancel_stands(self, request_id: str) -> bool:
        """Whether a cancel of ``request_id`` that has not reached Redis should still be sent:
        the request is no longer served here, or is ending cancelled; False once its client
        resumed it here (a fresh entry that nobody cancelled)."""
        entry = self.entries.get(request_id)
        return entry is None or entry.cancel_until is not None

    def disconnected(self, conn: int, now: float, grace_s: float | None = None) -> list[Action]:
        """A connection closed: its requests keep running for the resume grace (``grace_s``
        instead when given: 0 for a client that cannot resume, as over HTTP)."""
        if conn not in self.per_conn:  # it owns no request (a finished HTTP exchange, an idle socket)
            return []
        grace_s = self.config.resume_grace_s if grace_s is None else grace_s
        actions: list[Action] = []
        for entry in [e for e in self.entries.values() if e.conn == conn]:
            entry.conn, entry.announced = None, False
            entry.grace_until = now + grace_s
            entry.buffered = {s: e for s, e in entry.buffered.items() if e.finish is not None}
            if grace_s <= 0:
                if entry.phase is Phase.OPENING:
                    # Its enqueue is under way: forgotten now, it would be enqueued all the same
                    # and run with nobody listening (a cancel sent first finds nothing to cancel).
                    # ``accepted`` cancels it; ``refuse`` ends it.
                    entry.cancel_pending = True
                else:
                    actions += self._expire(entry)
        self.per_conn.pop(conn, None)
        return actions

    def tick(self, now: float) -> list[Action]:
        """Timers: grace and cancel deadlines, refills after a resume, quiet-request checks."""
        actions: list[Action] = []
        quiet: list[str] = []
        for entry in list(self.entries.values()):
            if entry.phase is Phase.OPENING:
                continue  # its enqueue settles it (``accepted`` or ``refuse``), then the timers run
            if entry.grace_until is not None and now >= entry.grace_until:
                actions += self._expire(entry)
            elif entry.phase is Phase.ACTIVE and now - entry.last_heard_at > self.config.unreachable_s:
                actions += self._unreachable(entry, now)
            elif entry.takeover_pending and entry.phase is Phase.ACTIVE:
                # Its notice's check went unanswered (or came while a resume here was out):
                # Redis must say whose it is before anything ends it here.
                if now - entry.last_heard_at > self.config.quiet_s:
                    quiet.append(entry.id)
            elif entry.cancel_until is not None and now >= entry.cancel_until:
                actions += self._end(entry, Finish(FinishReason.CANCELLED, Usage(0, entry.num_tokens)), now)
            elif entry.phase is Phase.ACTIVE and entry.refill_at is not None and now >= entry.refill_at:
                entry.refill_at = None
                actions += self._fill(entry)
            elif entry.phase is Phase.ACTIVE and now - entry.last_heard_at > self.config.quiet_s:
                quiet.append(entry.id)
        if quiet and not self._checking:
            self._checking = True
            actions.append(CheckRequests(tuple(quiet), notices=self.notices))
        return actions

    def takeover_notice(self, request_id: str) -> list[Action]:
        """Another edge says it took this request over: check Redis now (the notice may be
        stale: the request may have come back here since), not at the next quiet check."""
        entry = self.entries.get(request_id)
        if entry is None:
            return []
        self.notices += 1
        entry.takeover_pending, entry.notice_no = True, self.notices
        if entry.phase is not Phase.ACTIVE:  # the enqueue or a re-point here is out: check once answered
            return []
        return [CheckRequests((request_id,), periodic=False, notices=self.notices)]

    def checked(self, found: dict[str, tuple[str, str] | None], now: float, periodic: bool = True,
                notices: int | None = None) -> list[Action]:
        """Answer to ``CheckRequests``: per request ``(edge, state)`` from Redis, None if gone.
        ``notices``: the check's own count (``CheckRequests.notices``; None: asked after all)."""
        if periodic:
            self._checking = False
        actions: list[Action] = []
        for request_id, record in found.items():
            entry = self.entries.get(request_id)
            if entry is None or entry.phase is not Phase.ACTIVE:
                continue
            if notices is not None and notices < entry.notice_no:
                continue  # read before the latest notice or re-point here: it may predate either
            if record is None:
                entry.takeover_pending = False
                actions += self._lost(entry, now)
                continue
            edge, state = record
            entry.last_heard_at = now
            if edge != self.edge_id:  # resumed on another edge: this connection lost it
                actions += self._moved(entry)
                continue
            if entry.takeover_pending:
                held, entry.held_end, entry.takeover_pending = entry.held_end, None, False
                if held is not None:  # the notice was stale: the end is this connection's
                    actions += self._end(entry, held, now)
                    continue
            if state != "queued":  # tokens may have gone to another edge, or the end was missed
                entry.redis_state = state
                if not entry.filling:
                    entry.filling = True
                    actions.append(ReadStream(request_id, entry.next_seq - 1, with_last=state in _TERMINAL_STATES))
        return actions

    def resubscribed(self) -> list[Action]:
        """The token channel was (re)subscribed: anything published meanwhile is in the streams."""
        actions: list[Action] = []
        for entry in self.entries.values():
            if entry.phase is Phase.ACTIVE and entry.conn is not None:
                actions += self._fill(entry)
        return actions

    def check_failed(self, periodic: bool = True) -> None:
        if periodic:
            self._checking = False

    # -- internals ---------------------------------------------------------------------

    def _add(self, entry: Entry) -> None:
        self.entries[entry.id] = entry
        if entry.conn is not None:
            self.per_conn[entry.conn] += 1
        self.per_key[entry.key] += 1

    def _remove(self, entry: Entry) -> None:
        del self.entries[entry.id]
        if entry.conn is not None:
            _decrement(self.per_conn, entry.conn)
        _decrement(self.per_key, entry.key)

    def _key_full(self, key: str, key_max_in_flight: int) -> bool:
        return bool(key and key_max_in_flight and self.per_key[key] >= key_max_in_flight)

    def _too_many(self, conn: int, request_id: str) -> Action:
        return _send_error(conn, ErrorCode.TOO_MANY_IN_FLIGHT, f"at most {self.config.max_in_flight_per_connection} "
                           "requests in flight per connection", request_id)

    def _take_over(self, entry: Entry, conn: int) -> list[Action]:
        """``conn`` now delivers ``entry``; the previous connection gets its terminal frame."""
        actions: list[Action] = []
        if entry.conn is not None:
            actions.append(_send_error(entry.conn, ErrorCode.RESUMED_ELSEWHERE,
                                       f"{_request(entry.id)} was resumed on another connection", entry.id))
            _decrement(self.per_conn, entry.conn)
        entry.conn = conn
        self.per_conn[conn] += 1
        return actions

    def _deliver(self, entry: Entry, event: TokenEvent, now: float, fill: bool = True) -> list[Action]:
        entry.last_heard_at = now
        if entry.conn is None:  # in its disconnect grace: only the end matters
            return self._end(entry, event.finish, now) if event.finish is not None else []
        if entry.phase is not Phase.ACTIVE:
            if event.seq >= entry.next_seq or event.finish is not None:
                entry.buffered[event.seq] = event
            return []
        if event.seq < entry.next_seq:  # a duplicate, or the end of a request resumed past it
            return self._end(entry, event.finish, now) if event.finish is not None else []
        if event.seq > entry.next_seq:
            entry.buffered[event.seq] = event
            return self._fill(entry) if fill else []
        actions = self._emit(entry, event, now)
        return actions + self._drain(entry, now)

    def _drain(self, entry: Entry, now: float) -> list[Action]:
        """Emit buffered events that are next in line (and an early finish); ask for a fill if
        a gap remains."""
        if not entry.buffered:
            return []
        actions: list[Action] = []
        while entry.conn is not None and (event := entry.buffered.pop(entry.next_seq, None)) is not None:
            actions += self._emit(entry, event, now)
            if entry.id not in self.entries:
                return actions
        if entry.conn is None:
            return actions
        stale_end = next((e.finish for s, e in entry.buffered.items() if s < entry.next_seq and e.finish), None)
        if stale_end is not None:
            return actions + self._end(entry, stale_end, now)
        entry.buffered = {s: e for s, e in entry.buffered.items() if s >= entry.next_seq}
        return actions + (self._fill(entry) if entry.buffered else [])

    def _emit(self, entry: Entry, event: TokenEvent, now: float) -> list[Action]:
        assert entry.conn is not None
        entry.next_seq = event.seq + 1
        entry.num_tokens += len(event.token_ids)
        actions: list[Action] = []
        if event.text or event.finish is None:
            if entry.first_token_at is None:
                entry.first_token_at = now
                if entry.lane != "resumed":
                    actions.append(FirstToken(entry.lane, now - entry.received_at, entry.id))
            actions.append(Send(entry.conn, protocol.delta_frame(entry.id, event.seq, event.text)))
        if event.finish is not None:
            actions += self._end(entry, event.finish, now)
        return actions

    def _fill(self, entry: Entry) -> list[Action]:
        if entry.filling:
            return []
        entry.filling = True
        return [ReadStream(entry.id, entry.next_seq - 1)]

    def _end(self, entry: Entry, finish: Finish, now: float) -> list[Action]:
        """The terminal frame, once; then forget the request. Held while a takeover notice's
        check is out: the connection may have lost the request, and then its last frame is
        ``resumed_elsewhere``, not the new owner's end (``checked`` decides)."""
        if entry.takeover_pending and entry.conn is not None:
            entry.held_end = entry.held_end or finish
            return []
        self._remove(entry)
        ttft = None if entry.first_token_at is None else entry.first_token_at - entry.received_at
        outcome = finish.reason.value if finish.reason is not FinishReason.ERROR else (finish.error_code or "error")
        actions: list[Action] = [Finished(entry.id, entry.lane, outcome, now - entry.received_at, finish.queue_ms)]
        if entry.conn is None:
            return actions
        if finish.reason is FinishReason.ERROR:
            code = finish.error_code or ErrorCode.INTERNAL
            actions.append(_send_error(entry.conn, code, finish.error_message or code, entry.id))
            return actions
        if not entry.announced and (entry.phase is Phase.RESUMING or entry.resumed_after is not None):
            # It ends before Redis confirmed the resume (a cancel from the connection that lost
            # it came back first): a resume still opens with ``resumed``, then the ending.
            after = entry.resumed_after if entry.resumed_after is not None else entry.next_seq - 1
            actions.append(Send(entry.conn, protocol.resumed_frame(entry.id, after)))
        timing = protocol.Timing(queue_ms=round(finish.queue_ms, 3), ttft_ms=round((ttft or 0.0) * 1000, 3),
                                 total_ms=round((now - entry.received_at) * 1000, 3))
        actions.append(Send(entry.conn, protocol.done_frame(entry.id, finish.reason, finish.usage, timing)))
        return actions

    def _lost(self, entry: Entry, now: float) -> list[Action]:
        return self._end(entry, Finish(FinishReason.ERROR, Usage(0, entry.num_tokens),
                                       error_code=ErrorCode.REQUEST_LOST,
                                       error_message="the request's state was lost (queue restarted); resubmit it"), now)

    def _unreachable(self, entry: Entry, now: float) -> list[Action]:
        """Nothing heard of it for ``unreachable_s``: Redis is out of reach (tokens come through
        it, and each quiet check of it went unanswered). Its client gets ``unavailable`` now, not
        keep-alives for as long as the outage lasts; it is cancelled too, which reaches the
        worker only once Redis does (a takeover's held end goes with it: nobody can say now)."""
        entry.takeover_pending, entry.held_end = False, None
        seconds = f"{self.config.unreachable_s:g}"
        finish = Finish(FinishReason.ERROR, Usage(0, entry.num_tokens), error_code=ErrorCode.UNAVAILABLE,
                        error_message=f"nothing heard of the request for {seconds} s: the queue (Redis) is out of "
                                      "reach; it is cancelled, send it again")
        return [CancelRequest(entry.id), *self._end(entry, finish, now)]

    def _moved(self, entry: Entry) -> list[Action]:
        self._remove(entry)
        actions: list[Action] = [Finished(entry.id, entry.lane, ErrorCode.RESUMED_ELSEWHERE.value)]
        if entry.conn is not None:
            actions.append(_send_error(entry.conn, ErrorCode.RESUMED_ELSEWHERE,
                                       f"{_request(entry.id)} was resumed on another edge", entry.id))
        return actions

    def _expire(self, entry: Entry) -> list[Action]:
        """The grace ran out with nobody resuming: stop the request."""
        self._remove(entry)
        return [CancelRequest(entry.id), Finished(entry.id, entry.lane, DISCONNECTED)]


def _key_cap_message(key_max_in_flight: int) -> str:
    return f"this API key may have at most {key_max_in_flight} requests in flight"


def _decrement(counter: Counter[int] | Counter[str], key: object) -> None:
    counter[key] -= 1  # type: ignore[index]
    if counter[key] <= 0:  # type: ignore[index]
        del counter[key]  # type: ignore[arg-type]


def _send_error(conn: int, code: ErrorCode | str, message: str, request_id: str | None, **extra: object) -> Send:
    return Send(conn, protocol.error_frame(code, message, request_id, **extra), error_code=str(code))


def _unknown(conn: int, request_id: str) -> Send:
    return _send_error(conn, ErrorCode.UNKNOWN_ID, f"{_request(request_id)} is unknown or expired", request_id)


def _request(request_id: str) -> str:
    """How a message names a request: by the id its client sent (without its key's scope)."""
    return f"request {protocol.client_id(request_id)}"
