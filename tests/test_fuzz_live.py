"""Live fuzzing: hostile frames over a real WebSocket against real edge, worker (tiny model)
and scheduler processes.

Every frame must be answered: an ``error`` with the code the pure parser gives for it (the
edge runs with the limits below, set through ``LANES_*`` env, so each limit is checked end to
end), ``accepted`` for a valid chat, or the documented close code when the transport itself
refuses the frame (1007 invalid UTF-8 in a text frame, 1009 beyond 4x the frame limit). The
edge must survive: a bystander client streams greedy answers on its own connection throughout
and they must all come back complete and identical to a fresh connection's answer afterwards.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from websockets.sync.client import ClientConnection

from e2e_support import System
from live_support import (
    bystander, chat_once, close_code_after, edge_rss_kib, open_client, recv_json, start_edge,
)
from test_fuzz_protocol import CODES, deep_json, hostile_text, valid_chats
from lanes.ws_server.protocol import ChatFrame, Limits, ProtocolError, ResumeFrame, parse_client_frame

pytestmark = pytest.mark.e2e

LIMITS = Limits(max_frame_bytes=16 * 1024, max_messages=8, max_prompt_chars=4096, max_tokens_limit=32,
                default_max_tokens=4)
MAX_IN_FLIGHT = 8
EDGE_ENV = {
    "LANES_MAX_FRAME_BYTES": str(LIMITS.max_frame_bytes), "LANES_MAX_MESSAGES": str(LIMITS.max_messages),
    "LANES_MAX_PROMPT_CHARS": str(LIMITS.max_prompt_chars), "LANES_MAX_TOKENS_LIMIT": str(LIMITS.max_tokens_limit),
    "LANES_DEFAULT_MAX_TOKENS": str(LIMITS.default_max_tokens),
    "LANES_MAX_IN_FLIGHT_PER_CONNECTION": str(MAX_IN_FLIGHT),
}
#: Beyond this the transport closes the connection (1009) instead of the parser answering.
TRANSPORT_MAX_BYTES = 4 * LIMITS.max_frame_bytes
BYSTANDER_PROMPT = "Explain what a class definition does."
#: Refusals the edge may give a chat frame the parser accepts.
CHAT_REFUSALS = frozenset({"duplicate_id", "too_many_in_flight", "overloaded"})


@pytest.fixture(scope="module")
def system(make_cluster) -> tuple[System, str]:
    sys_ = make_cluster(workers=1, edges=0, worker_args=("--max-slots", "4"))
    return sys_, start_edge(sys_, "edge", **EDGE_ENV)


def assert_edge_alive(sys_: System, url: str) -> str:
    """The edge process still runs and serves a normal chat on a NEW connection; returns the text."""
    assert sys_.procs["edge"].poll() is None, "the edge process died"
    with open_client(url) as ws:
        answer = chat_once(ws, f"after-{uuid.uuid4().hex[:8]}", BYSTANDER_PROMPT, 24)
    answer.check_complete()
    return answer.text


# -- one connection, many hostile frames ------------------------------------------------------


@dataclass
class FuzzConnection:
    """The fuzzing connection: sends a frame, then a barrier (a cancel of an unknown id, which
    the edge answers after everything the frame caused), and files what came back."""

    ws: ClientConnection
    #: Requests the edge accepted on this connection: their later frames are not answers.
    accepted: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: Accepted requests the fuzzer also resumed (their stream may be replayed: two terminals).
    resumed: set[str] = field(default_factory=set)
    codes: Counter[str] = field(default_factory=Counter)
    num_barriers: int = 0

    def exchange(self, payload: str | bytes) -> list[dict[str, Any]]:
        """Send ``payload``; return what came back before the barrier's answer, less the
        deltas and ``done`` frames of accepted requests (those are filed with them)."""
        self.ws.send(payload, text=isinstance(payload, str))
        self.num_barriers += 1
        barrier = f"zz-barrier-{self.num_barriers}"
        self.ws.send(json.dumps({"type": "cancel", "id": barrier}))
        window: list[dict[str, Any]] = []
        while (frame := recv_json(self.ws, 30)).get("id") != barrier:
            if frame.get("id") in self.accepted and frame["type"] in ("delta", "done"):
                self.accepted[frame["id"]].append(frame)
            else:
                window.append(frame)
        assert frame["type"] == "error" and frame["code"] == "unknown_id", frame
        return window

    def _pending(self, rid: str) -> bool:
        return not any(f["type"] in ("done", "error") for f in self.accepted[rid])

    def check(self, payload: str | bytes) -> None:
        """Send one frame; its answer must be what the pure parser (same limits) says: exactly
        one matching frame, and nothing else but accepted requests' terminal errors."""
        try:
            expected: Any = parse_client_frame(payload, LIMITS)
        except ProtocolError as err:
            expected = err
        window = self.exchange(payload)
        matches, required = self._expectation(expected)
        answer = next((f for f in window if matches(f)), None)
        assert answer is not None or not required, (payload[:200], window)
        for frame in window:  # in arrival order: a request accepted here may stream and end in the window
            if frame is answer:
                if answer["type"] == "accepted":
                    self.accepted[answer["id"]] = [answer]
                continue
            assert self.file_if_ours(frame), (payload[:200], window)  # else only an accepted request's frame
        if answer is None:
            return
        if answer["type"] != "accepted":
            assert answer["code"] in CODES, answer
            self.codes[answer["code"]] += 1
        if isinstance(expected, ResumeFrame) and expected.id in self.accepted:
            self.resumed.add(expected.id)

    def _expectation(self, expected: Any) -> tuple[Callable[[dict[str, Any]], bool], bool]:
        """What may answer ``expected`` (a parsed frame or the parser's error), and whether an
        answer is required."""
        def error(codes: Collection[str], rid: str | None, any_id: bool = False) -> Callable[[dict[str, Any]], bool]:
            return lambda f: f["type"] == "error" and f["code"] in codes and (any_id or f.get("id") == rid)

        if isinstance(expected, ProtocolError):
            return error({expected.code}, expected.request_id), True
        if isinstance(expected, ChatFrame):
            refused = error(CHAT_REFUSALS, expected.id, any_id=expected.id is None)

            def accepted(f: dict[str, Any]) -> bool:
                return f["type"] == "accepted" and f["id"] not in self.accepted and expected.id in (None, f["id"])

            return (lambda f: accepted(f) or refused(f)), True
        if expected.id in self.accepted:  # cancel or resume of a request of ours: may end it, no reply
            return error({"unknown_id", "duplicate_id"}, expected.id), False
        return error({"unknown_id"}, expected.id), True

    def file_if_ours(self, frame: dict[str, Any]) -> bool:
        """File ``frame`` with its request when it is an accepted request's later frame (a delta,
        done or its terminal error); False when it is not, i.e. an answer."""
        rid = frame.get("id")
        if rid in self.accepted and (frame["type"] in ("delta", "done") or self.is_terminal_of_ours(frame)):
            self.accepted[rid].append(frame)
            return True
        return False

    def is_terminal_of_ours(self, frame: dict[str, Any]) -> bool:
        rid = frame.get("id")
        return frame["type"] == "error" and rid in self.accepted and (self._pending(rid) or rid in self.resumed)

    def wait_accepted_done(self, timeout_s: float = 60) -> None:
        """Every accepted request ends with exactly one terminal frame."""
        while any(self._pending(rid) for rid in self.accepted):
            frame = recv_json(self.ws, timeout_s)
            assert frame.get("id") in self.accepted, frame
            self.accepted[frame["id"]].append(frame)
        for rid, frames in self.accepted.items():
            if rid not in self.resumed:
                assert sum(f["type"] in ("done", "error") for f in frames) == 1, (rid, frames)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _wire_bytes(text: str) -> bytes:
    """The bytes a broken client would put on the wire for ``text`` (invalid UTF-8 if it had
    surrogates: escaped raw bytes come back as themselves, lone surrogates as CESU-style bytes)."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass")


oversized = st.integers(LIMITS.max_frame_bytes - 64, 5 * LIMITS.max_frame_bytes).map(
    lambda n: json.dumps({"type": "chat", "id": "big", "pad": "x" * n}))
live_frames = st.one_of(
    hostile_text, valid_chats().map(json.dumps), oversized, st.binary(max_size=300),
    st.integers(1, 3).map(lambda n: b"\x00" * (TRANSPORT_MAX_BYTES + n)),
)


def test_hostile_frames_each_get_an_answer_and_bystanders_are_unaffected(system: tuple[System, str]) -> None:
    sys_, url = system
    closes: Counter[int | None] = Counter()
    rss_before_kib = edge_rss_kib(sys_, "edge")
    with bystander(url, BYSTANDER_PROMPT, 24) as by, open_client(url) as ws:
        conn = FuzzConnection(ws)

        @settings(max_examples=150, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate],  # no shrinking against live processes
                  suppress_health_check=list(HealthCheck))
        @given(live_frames)
        @example('{"type":"chat","id":"deep","messages":%s}' % deep_json(1500))  # RecursionError in the parser
        @example('{"type":"chat","id":"role","messages":[{"role":["user"],"content":"x"}]}')  # unhashable role
        @example('{"type":"cancel","id":"nl\\n"}')  # "$" let a trailing newline into ids
        @example('{"type":"chat","id":"nan","messages":[{"role":"user","content":"x"}],"temperature":NaN}')
        @example('{"type":"chat","id":"big","messages":[{"role":"user","content":"x"}],"seed":%s}' % ("9" * 5000))
        @example('{"type":"chat","type":"cancel","id":"dup","id":"dup2"}')
        @example('{"type":"chat","id":"sur","messages":[{"role":"user","content":"\\ud800"}]}')
        @example('{"type":"chat","id":"raw","messages":[{"role":"user","content":"\udcff"}]}')  # raw 0xff
        def fuzz(payload: str | bytes) -> None:
            size = len(payload) if isinstance(payload, bytes) else len(_wire_bytes(payload))
            if size > TRANSPORT_MAX_BYTES:  # the transport refuses it: message too big
                code = close_code_after(url, payload if isinstance(payload, bytes) else _wire_bytes(payload),
                                        text=isinstance(payload, str))
                assert code == 1009, code
                closes[code] += 1
            elif isinstance(payload, str) and not _encodable(payload):  # invalid UTF-8 in a text frame
                code = close_code_after(url, _wire_bytes(payload), text=True)
                assert code == 1007, code
                closes[code] += 1
            else:
                conn.check(payload)

        fuzz()
        conn.wait_accepted_done()
    assert by.answers, "the bystander completed no answer during the fuzzing"
    assert assert_edge_alive(sys_, url) == by.answers[0].text
    print(f"\nfuzz: {sum(conn.codes.values())} errors {dict(conn.codes)}, {len(conn.accepted)} accepted, "
          f"closes {dict(closes)}, bystander answers {len(by.answers)}, "
          f"edge RSS {rss_before_kib} -> {edge_rss_kib(sys_, 'edge')} KiB")
    assert conn.codes["invalid_json"] and conn.codes["binary_frame"] and conn.codes["frame_too_large"]
    assert closes[1007] and closes[1009]


# -- limits, each at its boundary -------------------------------------------------------------


def _chat(request_id: str, **fields: Any) -> str:
    return json.dumps({"type": "chat", "id": request_id, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 1, **fields})


def test_each_limit_is_enforced_at_its_boundary(system: tuple[System, str]) -> None:
    sys_, url = system
    msg = {"role": "user", "content": "x"}
    cases = [  # (frame, the code it must get, or None when it must be accepted)
        (_chat("msgs-ok", messages=[msg] * LIMITS.max_messages), None),
        (_chat("msgs-over", messages=[msg] * (LIMITS.max_messages + 1)), "too_many_messages"),
        (_chat("chars-ok", messages=[{"role": "user", "content": "y" * LIMITS.max_prompt_chars}]), None),
        (_chat("chars-over", messages=[{"role": "user", "content": "y" * (LIMITS.max_prompt_chars + 1)}]),
         "prompt_too_long"),
        (_chat("tokens-ok", max_tokens=LIMITS.max_tokens_limit), None),
        (_chat("tokens-over", max_tokens=LIMITS.max_tokens_limit + 1), "max_tokens_too_large"),
    ]
    pad = LIMITS.max_frame_bytes - len(_chat("bytes-ok", pad=""))
    cases += [(_chat("bytes-ok", pad="z" * pad), None), (_chat("bytes-over", pad="z" * (pad + 1)), "frame_too_large"),
              # 2-byte characters: the limit counts bytes, not characters
              (_chat("utf8-over", pad="é" * (pad // 2 + 1)), "frame_too_large")]
    with open_client(url) as ws:
        conn = FuzzConnection(ws)
        for frame, code in cases:
            rid = json.loads(frame)["id"]
            answers = []
            # In arrival order: on a loaded machine an accepted request can stream and finish inside
            # its own exchange window, so its delta, done or the worker's own terminal error (e.g.
            # prompt_too_long for "chars-ok") follow its "accepted" there and are not answers.
            for a in conn.exchange(frame):
                if conn.file_if_ours(a):
                    continue
                answers.append(a)
                if code is None and a["type"] == "accepted" and a.get("id") == rid:
                    conn.accepted[rid] = [a]
            want = ("accepted", None, rid) if code is None else ("error", code, rid)
            if code == "frame_too_large":
                want = ("error", code, None)  # refused before the frame is parsed: no id to name
            assert [(a["type"], a.get("code"), a.get("id")) for a in answers] == [want], (rid, answers)
        conn.wait_accepted_done()
    assert close_code_after(url, "a" * (TRANSPORT_MAX_BYTES + 1), text=True) == 1009
    assert_edge_alive(sys_, url)


def test_thousands_of_ids_on_one_connection_hit_the_in_flight_cap(system: tuple[System, str]) -> None:
    sys_, url = system
    num_requests = 2000
    ids = [f"many-{i}" for i in range(num_requests)]
    frames: dict[str, list[dict[str, Any]]] = defaultdict(list)
    with bystander(url, BYSTANDER_PROMPT, 24), open_client(url) as ws:
        for rid in ids:
            ws.send(_chat(rid))
        while sum(1 for rid in ids if any(f["type"] in ("done", "error") for f in frames[rid])) < num_requests:
            frame = recv_json(ws, 60)
            frames[frame["id"]].append(frame)
    terminal = Counter()
    for rid in ids:
        kinds = [f["type"] for f in frames[rid]]
        ends = [f for f in frames[rid] if f["type"] in ("done", "error")]
        assert len(ends) == 1, (rid, kinds)
        if ends[0]["type"] == "error":
            assert kinds == ["error"], (rid, kinds)
        else:
            assert kinds[0] == "accepted", (rid, kinds)
        terminal[ends[0].get("code", "done")] += 1
    print(f"\n{num_requests} ids on one connection: {dict(terminal)}")
    assert terminal["too_many_in_flight"] > 0 and terminal["done"] >= MAX_IN_FLIGHT
    assert set(terminal) <= {"done", "too_many_in_flight"}, terminal
    assert_edge_alive(sys_, url)
