"""The delivery core under random interleavings (Hypothesis state machine).

A model of Redis and the workers answers the core's actions (stream reads, cancels, re-points,
checks) with random delays, publishes tokens with duplicates and gaps, and moves requests to
another edge. After every step the frames each connection received must obey the delivery
rules; at the end, once every request has ended and the clocks ran past every grace, every
connection that still listens has exactly one terminal frame per request and the core holds
nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lanes.queue.messages import Finish, FinishReason, TokenEvent, Usage
from lanes.ws_server.delivery import (
    CancelRequest,
    CheckRequests,
    Delivery,
    DeliveryConfig,
    Finished,
    FirstToken,
    ReadStream,
    Repoint,
    Send,
)

EDGE = "edge-a"
KEYS = ("alice", "bob")
IDS = ("r0", "r1", "r2")
GRACE_S = 5.0
TERMINAL = ("done", "error")


@dataclass
class World:
    """What Redis and the workers hold for one request."""

    key: str
    state: str = "queued"  # queued | running | done | cancelled
    edge: str = EDGE
    events: list[TokenEvent] = field(default_factory=list)
    cancel_asked: bool = False
    #: Cancelled while running: Redis says cancelled, but the worker has yet to write the end.
    ending: bool = False

    @property
    def live(self) -> bool:
        """A worker may still write tokens and the end."""
        return self.state in ("queued", "running") or self.ending


@dataclass
class Episode:
    """One chat or resume sent on one connection, and what came back."""

    kind: str  # chat | resume
    start_seq: int
    frames: list[dict[str, Any]] = field(default_factory=list)

    @property
    def closed(self) -> bool:
        return bool(self.frames) and self.frames[-1]["type"] in TERMINAL


class DeliveryMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.core = Delivery(EDGE, DeliveryConfig(resume_grace_s=GRACE_S, cancel_grace_s=3.0, refill_after_s=0.5,
                                                  quiet_s=2.0, max_in_flight_per_connection=8))
        self.now = 0.0
        self.world: dict[str, World] = {}
        self.conn_key: dict[int, str] = {}
        self.open_conns: set[int] = set()
        self.episodes: dict[tuple[int, str], list[Episode]] = {}
        self.io: list[Any] = []  # actions waiting for their answer
        self.next_conn = 1
        for key in KEYS:
            self._connect(key)

    # -- helpers -------------------------------------------------------------------------

    def _connect(self, key: str) -> int:
        conn = self.next_conn
        self.next_conn += 1
        self.conn_key[conn] = key
        self.open_conns.add(conn)
        return conn

    def _carry(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, Send):
                self._received(action.conn, json.loads(action.frame))
            elif isinstance(action, (Finished, FirstToken)):
                continue
            else:
                self.io.append(action)

    def _received(self, conn: int, frame: dict[str, Any]) -> None:
        assert conn in self.open_conns, f"frame sent to closed connection {conn}: {frame}"
        rid = frame.get("id")
        assert rid is not None, frame
        history = self.episodes.get((conn, rid))
        assert history and not history[-1].closed, f"frame outside any open request on {conn}: {frame}"
        episode = history[-1]
        world = self.world.get(rid)
        entry = self.core.entries.get(rid)
        if frame["type"] != "error":  # a resume may take over a chat whose enqueue is still in flight
            owner = world.key if world is not None else entry.key if entry is not None else None
            assert owner == self.conn_key[conn], f"{frame} reached another key"
        if not episode.frames:
            opening = "accepted" if episode.kind == "chat" else "resumed"
            assert frame["type"] in (opening, "error"), f"first frame of a {episode.kind} was {frame}"
        else:
            assert frame["type"] not in ("accepted", "resumed"), frame
        if frame.get("code") == "request_lost":  # only a request that Redis really lost
            assert world is None, f"{rid} reported lost while Redis holds it ({world.state})"
        if frame["type"] == "delta":
            seqs = [f["seq"] for f in episode.frames if f["type"] == "delta"]
            expected = seqs[-1] + 1 if seqs else episode.start_seq
            assert frame["seq"] == expected, f"seq {frame['seq']} after {seqs} (start {episode.start_seq})"
            assert frame["text"] == world.events[frame["seq"]].text
        episode.frames.append(frame)

    def _start(self, conn: int, rid: str, kind: str, start_seq: int) -> None:
        self.episodes.setdefault((conn, rid), []).append(Episode(kind, start_seq))

    def _idle(self, conn: int, rid: str) -> bool:
        history = self.episodes.get((conn, rid))
        return not history or history[-1].closed

    def _publish(self, rid: str, event: TokenEvent) -> None:
        w = self.world[rid]
        w.events.append(event)
        if w.edge == EDGE:
            self._carry(self.core.tokens([event], self.now))

    # -- client rules --------------------------------------------------------------------

    @rule(conn=st.integers(1, 6), rid=st.sampled_from(IDS))
    def chat(self, conn: int, rid: str) -> None:
        if conn not in self.open_conns or not self._idle(conn, rid):
            return
        self._start(conn, rid, "chat", 0)
        _, actions = self.core.open_chat(conn, rid, self.conn_key[conn], 0, self.now)
        self._carry(actions)

    @rule(rid=st.sampled_from(IDS), ok=st.booleans())
    def enqueue_returns(self, rid: str, ok: bool) -> None:
        """The edge's limits, prediction and enqueue for a registered chat come back."""
        entry = self.core.entries.get(rid)
        if entry is None or entry.phase.value != "opening":
            return
        if ok and rid not in self.world:
            self.world[rid] = World(key=entry.key)
            self._carry(self.core.accepted(rid, "short", 10, self.now))
        elif ok:
            self._carry(self.core.refuse(rid, "duplicate_id", "exists"))  # type: ignore[arg-type]
        else:
            self._carry(self.core.refuse(rid, "overloaded", "full", retry_after_ms=10))  # type: ignore[arg-type]

    @rule(conn=st.integers(1, 6), rid=st.sampled_from(IDS), back=st.integers(0, 4))
    def resume(self, conn: int, rid: str, back: int) -> None:
        if conn not in self.open_conns or not self._idle(conn, rid):
            return
        w = self.world.get(rid)
        last_seq = max(-1, (len(w.events) if w else 0) - 1 - back)
        self._start(conn, rid, "resume", last_seq + 1)
        self._carry(self.core.resume(conn, rid, last_seq, self.conn_key[conn], self.now))

    @rule(conn=st.integers(1, 6), rid=st.sampled_from(IDS))
    def cancel(self, conn: int, rid: str) -> None:
        history = self.episodes.get((conn, rid))
        if conn in self.open_conns and history and not history[-1].closed and history[-1].frames:
            self._carry(self.core.cancel(conn, rid, self.now))

    @rule(conn=st.integers(1, 6))
    def disconnect(self, conn: int) -> None:
        if conn in self.open_conns:
            self.open_conns.discard(conn)
            self._carry(self.core.disconnected(conn, self.now))

    @precondition(lambda self: self.next_conn <= 6)
    @rule(key=st.sampled_from(KEYS))
    def connect(self, key: str) -> None:
        self._connect(key)

    # -- world rules ---------------------------------------------------------------------

    @rule(rid=st.sampled_from(IDS), dup=st.booleans())
    def token(self, rid: str, dup: bool) -> None:
        w = self.world.get(rid)
        if w is None or not w.live:
            return
        if w.state == "queued":
            w.state = "running"
        seq = len(w.events)
        self._publish(rid, TokenEvent(rid, 1, seq, f"<{rid}:{seq}>", (seq,)))
        if dup and w.edge == EDGE:  # a retry or replay overlapping what was sent
            self._carry(self.core.tokens([w.events[seq // 2]], self.now))

    @rule(rid=st.sampled_from(IDS))
    def finish(self, rid: str) -> None:
        w = self.world.get(rid)
        if w is None or not w.live:
            return
        reason = FinishReason.CANCELLED if w.cancel_asked else FinishReason.STOP
        w.state, w.ending = ("cancelled" if w.cancel_asked else "done"), False
        seq = len(w.events)
        self._publish(rid, TokenEvent(rid, 1, seq, "", (), Finish(reason, Usage(1, seq))))

    @rule(rid=st.sampled_from(IDS))
    def resumed_on_another_edge(self, rid: str) -> None:
        if rid in self.world:
            self.world[rid].edge = "edge-b"

    @rule(rid=st.sampled_from(IDS), lag=st.booleans())
    def takeover_notice(self, rid: str, lag: bool) -> None:
        """Another edge's notice (stale when the request is back here or never left); with
        ``lag`` the request's worker has not heard of the move yet and still sends its next
        event here, the end included."""
        self._carry(self.core.takeover_notice(rid))
        w = self.world.get(rid)
        if lag and w is not None and w.events:
            self._carry(self.core.tokens([w.events[-1]], self.now))

    @rule(data=st.data())
    def answer_io(self, data: st.DataObject) -> None:
        if not self.io:
            return
        action = self.io.pop(data.draw(st.integers(0, len(self.io) - 1)))
        if isinstance(action, ReadStream):
            w = self.world.get(action.request_id)
            events = [e for e in (w.events if w else []) if e.seq > action.after_seq]
            last = w.events[-1] if (w and w.events and action.with_last) else None
            self._carry(self.core.stream_read(action.request_id, events, last, self.now))
        elif isinstance(action, CancelRequest):
            w = self.world.get(action.request_id)
            previous = "absent" if w is None else "moved" if w.edge != EDGE else w.state
            if w is not None and w.edge == EDGE and w.state in ("queued", "running"):
                w.cancel_asked = True
                w.ending = w.state == "running"  # its worker writes the end; a queued one has none
                w.state = "cancelled"
            if action.report:
                self._carry(self.core.cancel_result(action.request_id, previous, self.now))
        elif isinstance(action, Repoint):
            w = self.world.get(action.request_id)
            if w is None or w.key != action.key:
                self._carry(self.core.repointed(action.request_id, action.key, None, self.now))
            else:
                w.edge = EDGE
                self._carry(self.core.repointed(action.request_id, action.key, w.state, self.now))
        elif isinstance(action, CheckRequests):
            found = {rid: None if rid not in self.world else (self.world[rid].edge, self.world[rid].state)
                     for rid in action.request_ids}
            self._carry(self.core.checked(found, self.now, action.periodic, action.notices))

    @rule(dt=st.sampled_from([0.1, 0.6, 1.5, 3.0, 6.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self._carry(self.core.tick(self.now))

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def counts_match_entries(self) -> None:
        if not hasattr(self, "core"):
            return
        assert sum(self.core.per_key.values()) == len(self.core.entries)
        owned = sum(1 for e in self.core.entries.values() if e.conn is not None)
        assert sum(self.core.per_conn.values()) == owned

    def teardown(self) -> None:
        """End every request, answer every action, run the clock past every grace: then every
        listening connection has its terminal frame and the core holds nothing."""
        if not hasattr(self, "core"):
            return
        for _ in range(12):
            for rid, w in self.world.items():
                if w.live:
                    self.finish(rid)
            for rid in list(self.core.entries):
                if self.core.entries[rid].phase.value == "opening":
                    self.enqueue_returns(rid, True)
            while self.io:
                self.answer_io_first()
            self.now += GRACE_S + 1
            self._carry(self.core.tick(self.now))
        assert self.core.entries == {}, self.core.entries
        for (conn, rid), history in self.episodes.items():
            if conn in self.open_conns:
                assert history[-1].closed, f"{rid} on {conn} never ended: {history[-1]}"

    def answer_io_first(self) -> None:
        self.answer_io(_FirstChoice())


class _FirstChoice:
    """Stands in for ``st.data()`` in teardown: always the first pending action."""

    def draw(self, _strategy: Any) -> int:
        return 0


TestDeliveryMachine = DeliveryMachine.TestCase
TestDeliveryMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
