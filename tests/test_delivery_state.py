"""The delivery core under random interleavings (Hypothesis state machine).

A model of Redis, the workers and another edge: (a) Redis work is executed at any time between
its issue and its answer (a check's answer may be stale when it arrives), (b) workers keep
publishing to the edge they last heard of until a heartbeat, (c) takeover notices arrive late,
in any order, and stale ones too. After every step the frames each connection received must
obey the delivery rules, and (d): a connection that held the request when it was moved to another
edge before its end was published must not get ``done`` once this edge heard that move's notice.
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
OTHER = "edge-b"
KEYS = ("alice", "bob")
IDS = ("r0", "r1", "r2")
GRACE_S = 5.0
TERMINAL = ("done", "error")


@dataclass
class World:
    key: str
    state: str = "queued"
    edge: str = EDGE
    worker_edge: str = EDGE  # where the worker publishes (it learns ``edge`` at its heartbeat)
    events: list[TokenEvent] = field(default_factory=list)
    cancel_asked: bool = False
    ending: bool = False
    moves: list[int] = field(default_factory=list)  # clock of each re-point from EDGE to OTHER
    notice_at: dict[int, int] = field(default_factory=dict)  # move clock -> clock delivered
    end_at: int | None = None  # clock the end was published (or a queued request cancelled)

    @property
    def live(self) -> bool:
        return self.state in ("queued", "running") or self.ending


@dataclass
class Episode:
    kind: str
    start_seq: int
    frames: list[dict[str, Any]] = field(default_factory=list)
    anchor: int | None = None  # clock since which the request is this episode's (enqueue or re-point here)

    @property
    def closed(self) -> bool:
        return bool(self.frames) and self.frames[-1]["type"] in TERMINAL


@dataclass
class Io:
    action: Any
    executed: bool = False
    result: Any = None


class DeliveryMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.core = Delivery(EDGE, DeliveryConfig(resume_grace_s=GRACE_S, cancel_grace_s=3.0, refill_after_s=0.5,
                                                  quiet_s=2.0, unreachable_s=5.0,
                                                  max_in_flight_per_connection=8))
        self.now = 0.0
        self.clock = 0
        self.world: dict[str, World] = {}
        self.conn_key: dict[int, str] = {}
        self.open_conns: set[int] = set()
        self.episodes: dict[tuple[int, str], list[Episode]] = {}
        self.io: list[Io] = []
        self.pending_notices: list[tuple[str, int | None]] = []
        self.enqueued: dict[str, Any] = {}  # rid -> the core's entry whose enqueue ran in Redis
        self.next_conn = 1
        for key in KEYS:
            self._connect(key)

    def _tick_clock(self) -> int:
        self.clock += 1
        return self.clock

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
                self.io.append(Io(action))

    def _open_episodes(self, rid: str) -> list[Episode]:
        return [h[-1] for (c, r), h in self.episodes.items() if r == rid and h and not h[-1].closed]

    def _received(self, conn: int, frame: dict[str, Any]) -> None:
        self._tick_clock()
        assert conn in self.open_conns, f"frame sent to closed connection {conn}: {frame}"
        rid = frame.get("id")
        assert rid is not None, frame
        history = self.episodes.get((conn, rid))
        assert history and not history[-1].closed, f"frame outside any open request on {conn}: {frame}"
        episode = history[-1]
        world = self.world.get(rid)
        entry = self.core.entries.get(rid)
        if frame["type"] != "error":
            owner = world.key if world is not None else entry.key if entry is not None else None
            assert owner == self.conn_key[conn], f"{frame} reached another key"
        if not episode.frames:
            opening = "accepted" if episode.kind == "chat" else "resumed"
            assert frame["type"] in (opening, "error"), f"first frame of a {episode.kind} was {frame}"
        else:
            assert frame["type"] not in ("accepted", "resumed"), frame
        if frame.get("code") == "request_lost":
            assert world is None, f"{rid} reported lost while Redis holds it ({world.state})"
        if frame["type"] == "delta":
            seqs = [f["seq"] for f in episode.frames if f["type"] == "delta"]
            expected = seqs[-1] + 1 if seqs else episode.start_seq
            assert frame["seq"] == expected, f"seq {frame['seq']} after {seqs} (start {episode.start_seq})"
            assert frame["text"] == world.events[frame["seq"]].text
        if frame["type"] == "done" and world is not None and episode.anchor is not None:
            end = world.end_at if world.end_at is not None else float("inf")
            for m in world.moves:
                if episode.anchor < m < end and m in world.notice_at:
                    raise AssertionError(
                        f"(d) {rid} on conn {conn} got done {frame.get('finish_reason')}: moved at {m} "
                        f"(episode anchored {episode.anchor}), notice heard at {world.notice_at[m]}, "
                        f"end published at {world.end_at}")
        if frame.get("code") == "resumed_elsewhere" and "another edge" in frame.get("message", ""):
            assert world is not None
            anchor = episode.anchor if episode.anchor is not None else -1
            assert any(m > anchor for m in world.moves), (
                f"{rid} on conn {conn}: resumed_elsewhere (another edge) but no move since its anchor {anchor}; "
                f"moves {world.moves}, Redis edge now {world.edge}")
        episode.frames.append(frame)

    def _start(self, conn: int, rid: str, kind: str, start_seq: int) -> None:
        self.episodes.setdefault((conn, rid), []).append(Episode(kind, start_seq))

    def _idle(self, conn: int, rid: str) -> bool:
        history = self.episodes.get((conn, rid))
        return not history or history[-1].closed

    def _publish(self, rid: str, event: TokenEvent) -> None:
        w = self.world[rid]
        w.events.append(event)
        if event.finish is not None:
            w.end_at = self._tick_clock()
        if w.worker_edge == EDGE:
            self._carry(self.core.tokens([event], self.now))

    # -- client rules --------------------------------------------------------------------

    @rule(conn=st.integers(1, 6), rid=st.sampled_from(IDS))
    def chat(self, conn: int, rid: str) -> None:
        if conn not in self.open_conns or not self._idle(conn, rid):
            return
        self._start(conn, rid, "chat", 0)
        _, actions = self.core.open_chat(conn, rid, self.conn_key[conn], 0, self.now)
        self._carry(actions)

    @rule(rid=st.sampled_from(IDS))
    def enqueue_executes(self, rid: str) -> None:
        """Redis has the record (a worker may run it, another edge re-point it); the enqueue's
        reply has yet to reach the edge."""
        entry = self.core.entries.get(rid)
        if entry is None or entry.phase.value != "opening" or rid in self.world:
            return
        self.world[rid] = World(key=entry.key)
        self.enqueued[rid] = entry
        c = self._tick_clock()
        for ep in self._open_episodes(rid):
            ep.anchor = c

    @rule(rid=st.sampled_from(IDS), ok=st.booleans())
    def enqueue_returns(self, rid: str, ok: bool) -> None:
        entry = self.core.entries.get(rid)
        if entry is None or entry.phase.value != "opening":
            return
        if self.enqueued.get(rid) is entry:
            del self.enqueued[rid]
            self._carry(self.core.accepted(rid, "short", 10, self.now))
            return
        self.enqueued.pop(rid, None)  # that entry is gone: its reply finds nothing (not modelled)
        if ok and rid not in self.world:
            self.enqueue_executes(rid)
            del self.enqueued[rid]
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
        if dup and w.worker_edge == EDGE:
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
    def heartbeat(self, rid: str) -> None:
        """The worker learns where the request's tokens go now."""
        w = self.world.get(rid)
        if w is not None:
            w.worker_edge = w.edge

    @rule(rid=st.sampled_from(IDS))
    def resumed_on_another_edge(self, rid: str) -> None:
        """Edge B re-points the request; if it was ours, B publishes a notice to us (delivered later)."""
        w = self.world.get(rid)
        if w is None:
            return
        previous, w.edge = w.edge, OTHER
        if previous == EDGE:
            c = self._tick_clock()
            w.moves.append(c)
            self.pending_notices.append((rid, c))

    @rule(rid=st.sampled_from(IDS))
    def other_edge_cancels(self, rid: str) -> None:
        """The new owner's client cancels at once (the case the fix is about)."""
        w = self.world.get(rid)
        if w is None or w.edge != OTHER or w.state not in ("queued", "running"):
            return
        w.cancel_asked = True
        w.ending = w.state == "running"
        if w.state == "queued":
            w.end_at = self._tick_clock()
        w.state = "cancelled"

    @rule(rid=st.sampled_from(IDS), lag=st.booleans())
    def stale_notice(self, rid: str, lag: bool) -> None:
        """A notice that no move of ours caused (stale), as in the original machine."""
        self._carry(self.core.takeover_notice(rid))
        w = self.world.get(rid)
        if lag and w is not None and w.events:
            self._carry(self.core.tokens([w.events[-1]], self.now))

    @rule(data=st.data())
    def deliver_notice(self, data: st.DataObject) -> None:
        if not self.pending_notices:
            return
        i = data.draw(st.integers(0, len(self.pending_notices) - 1))
        rid, move = self.pending_notices.pop(i)
        c = self._tick_clock()
        w = self.world[rid]
        if move is not None:
            w.notice_at[move] = c
        self._carry(self.core.takeover_notice(rid))

    def _execute(self, io: Io) -> None:
        if io.executed:
            return
        io.executed = True
        action = io.action
        if isinstance(action, ReadStream):
            w = self.world.get(action.request_id)
            events = [e for e in (w.events if w else []) if e.seq > action.after_seq]
            last = w.events[-1] if (w and w.events and action.with_last) else None
            io.result = (events, last)
        elif isinstance(action, CancelRequest):
            w = self.world.get(action.request_id)
            previous = "absent" if w is None else "moved" if w.edge != EDGE else w.state
            if w is not None and w.edge == EDGE and w.state in ("queued", "running"):
                w.cancel_asked = True
                w.ending = w.state == "running"
                if w.state == "queued":
                    w.end_at = self._tick_clock()
                w.state = "cancelled"
            io.result = previous
        elif isinstance(action, Repoint):
            w = self.world.get(action.request_id)
            if w is None or w.key != action.key:
                io.result = None
            else:
                w.edge = EDGE
                c = self._tick_clock()
                for ep in self._open_episodes(action.request_id):
                    ep.anchor = c
                io.result = w.state
        elif isinstance(action, CheckRequests):
            io.result = {rid: None if rid not in self.world else (self.world[rid].edge, self.world[rid].state)
                         for rid in action.request_ids}

    @rule(data=st.data())
    def execute_io(self, data: st.DataObject) -> None:
        """Redis runs an action's command now; its answer comes later (``answer_io``)."""
        todo = [io for io in self.io if not io.executed]
        if todo:
            self._execute(todo[data.draw(st.integers(0, len(todo) - 1))])

    @rule(data=st.data())
    def answer_io(self, data: st.DataObject) -> None:
        if not self.io:
            return
        io = self.io.pop(data.draw(st.integers(0, len(self.io) - 1)))
        self._answer(io)

    def _answer(self, io: Io) -> None:
        self._execute(io)
        action = io.action
        if isinstance(action, ReadStream):
            events, last = io.result
            self._carry(self.core.stream_read(action.request_id, events, last, self.now))
        elif isinstance(action, CancelRequest):
            if action.report:
                self._carry(self.core.cancel_result(action.request_id, io.result, self.now))
        elif isinstance(action, Repoint):
            self._carry(self.core.repointed(action.request_id, action.key, io.result, self.now))
        elif isinstance(action, CheckRequests):
            self._carry(self.core.checked(io.result, self.now, action.periodic, action.notices))

    @rule(dt=st.sampled_from([0.1, 0.6, 1.5, 3.0, 6.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        self._carry(self.core.tick(self.now))

    @invariant()
    def counts_match_entries(self) -> None:
        if not hasattr(self, "core"):
            return
        assert sum(self.core.per_key.values()) == len(self.core.entries)
        owned = sum(1 for e in self.core.entries.values() if e.conn is not None)
        assert sum(self.core.per_conn.values()) == owned
        for e in self.core.entries.values():
            assert e.conn is None or e.conn in self.open_conns

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        for _ in range(12):
            for rid, w in self.world.items():
                w.worker_edge = w.edge
                if w.live:
                    self.finish(rid)
            for rid in list(self.core.entries):
                if self.core.entries[rid].phase.value == "opening":
                    self.enqueue_returns(rid, True)
            while self.pending_notices:
                rid, move = self.pending_notices.pop(0)
                if move is not None:
                    self.world[rid].notice_at[move] = self._tick_clock()
                self._carry(self.core.takeover_notice(rid))
            while self.io:
                self._answer(self.io.pop(0))
            self.now += GRACE_S + 1
            self._carry(self.core.tick(self.now))
        assert self.core.entries == {}, self.core.entries
        for (conn, rid), history in self.episodes.items():
            if conn in self.open_conns:
                assert history[-1].closed, f"{rid} on {conn} never ended: {history[-1]}"


class _FirstChoice:
    def draw(self, _strategy: Any) -> int:
        return 0


TestDeliveryMachine = DeliveryMachine.TestCase
TestDeliveryMachine.settings = settings(max_examples=300, stateful_step_count=60,
                                   deadline=None, suppress_health_check=[HealthCheck.too_slow])
