"""The edge's delivery core, event by event: no event loop, no Redis, no sockets."""

from __future__ import annotations

import json
from typing import Any

from lanes.queue.errors import ErrorCode
from lanes.queue.messages import Finish, FinishReason, TokenEvent, Usage
from lanes.ws_server.delivery import (
    CancelRequest,
    CheckRequests,
    Delivery,
    DeliveryConfig,
    Finished,
    ReadStream,
    Repoint,
    Send,
)
from lanes.ws_server.protocol import client_id, scoped_id

EDGE = "edge-a"
CONFIG = DeliveryConfig(resume_grace_s=15.0, cancel_grace_s=2.0, refill_after_s=0.7, quiet_s=3.0,
                        max_in_flight_per_connection=4)


def core() -> Delivery:
    return Delivery(EDGE, CONFIG)


def frames(actions: list[Any], conn: int | None = None) -> list[dict[str, Any]]:
    return [json.loads(a.frame) for a in actions if isinstance(a, Send) and (conn is None or a.conn == conn)]


def tok(rid: str, seq: int, text: str | None = None, finish: FinishReason | None = None) -> TokenEvent:
    """Event ``seq`` of ``rid``: a token by default, an end (no text unless given) with ``finish``."""
    end = None if finish is None else Finish(finish, Usage(3, seq + 1), queue_ms=1.0)
    if text is None:
        text = "" if finish is not None else f"t{seq}"
    return TokenEvent(rid, 1, seq, text, (seq,) if text else (), end)


def open_accepted(d: Delivery, conn: int, rid: str, key: str = "", now: float = 0.0) -> list[Any]:
    ok, actions = d.open_chat(conn, rid, key, 0, now)
    assert ok and actions == []
    return d.accepted(rid, "short", 42, now)


def test_chat_streams_in_order_and_is_forgotten_at_its_end() -> None:
    d = core()
    out = open_accepted(d, 1, "r")
    out += d.tokens([tok("r", 0), tok("r", 1)], 0.1)
    out += d.tokens([tok("r", 2, "", FinishReason.STOP)], 0.2)
    kinds = [(f["type"], f.get("seq")) for f in frames(out)]
    assert kinds == [("accepted", None), ("delta", 0), ("delta", 1), ("done", None)]
    assert d.entries == {} and not d.per_conn and not d.per_key
    assert any(isinstance(a, Finished) and a.outcome == "stop" for a in out)


def test_tokens_that_beat_accepted_wait_for_it() -> None:
    d = core()
    ok, _ = d.open_chat(1, "r", "", 0, 0.0)
    assert ok
    early = d.tokens([tok("r", 0), tok("r", 1)], 0.01)
    assert frames(early) == []
    out = d.accepted("r", "long", 900, 0.02)
    assert [f["type"] for f in frames(out)] == ["accepted", "delta", "delta"]


def test_duplicate_is_refused_atomically_and_a_finished_id_can_be_reused() -> None:
    d = core()
    assert d.open_chat(1, "r", "", 0, 0.0)[0]
    ok, out = d.open_chat(2, "r", "", 0, 0.0)
    assert not ok and frames(out)[0]["code"] == "duplicate_id"
    d.accepted("r", "short", 1, 0.0)
    d.tokens([tok("r", 0, "x", FinishReason.STOP)], 0.1)
    assert d.open_chat(3, "r", "", 0, 0.2)[0]  # Redis decides whether the id still exists


def test_gap_asks_the_stream_and_the_fill_delivers_in_order() -> None:
    d = core()
    open_accepted(d, 1, "r")
    out = d.tokens([tok("r", 0), tok("r", 3)], 0.1)
    assert ReadStream("r", 0) in out
    assert [f["seq"] for f in frames(out) if f["type"] == "delta"] == [0]
    out = d.stream_read("r", [tok("r", 1), tok("r", 2), tok("r", 3)], None, 0.2)
    assert [f["seq"] for f in frames(out)] == [1, 2, 3]


def test_resume_from_another_key_changes_nothing() -> None:
    d = core()
    open_accepted(d, 1, "r", key="alice")
    out = d.resume(9, "r", -1, "mallory", 0.1)
    assert [(a.conn, json.loads(a.frame)["code"]) for a in out] == [(9, "unknown_id")]
    out = d.tokens([tok("r", 0, "x", FinishReason.STOP)], 0.2)
    assert [(a.conn, json.loads(a.frame)["type"]) for a in out if isinstance(a, Send)] == [(1, "delta"), (1, "done")]


def test_resume_on_another_connection_takes_over_and_the_old_one_is_told() -> None:
    d = core()
    open_accepted(d, 1, "r", key="k")
    d.tokens([tok("r", 0), tok("r", 1)], 0.1)
    out = d.resume(2, "r", 0, "k", 0.2)
    assert frames(out, 1) == [{"type": "error", "code": "resumed_elsewhere", "id": "r",
                               "message": "request r was resumed on another connection"}]
    # Redis may point it elsewhere by now (the client hopped edges and came back): re-point first.
    assert Repoint("r", "k") in out and frames(out, 2) == []
    out = d.repointed("r", "k", "running", 0.25)
    assert frames(out, 2)[0] == {"type": "resumed", "id": "r", "last_seq": 0}
    assert ReadStream("r", 0) in out
    out = d.stream_read("r", [tok("r", 1)], None, 0.3)
    out += d.tokens([tok("r", 2, "", FinishReason.STOP)], 0.4)
    assert [(f["type"], f.get("seq")) for f in frames(out, 2)] == [("delta", 1), ("done", None)]
    assert d.disconnected(1, 0.5) == [] and d.entries == {}  # the old connection closing costs nothing


def test_disconnect_keeps_the_request_for_the_grace_then_cancels_it() -> None:
    d = core()
    open_accepted(d, 1, "r", key="k")
    assert d.disconnected(1, 1.0) == []
    assert d.tokens([tok("r", 0)], 2.0) == []  # nobody to send to
    assert not any(isinstance(a, CancelRequest) for a in d.tick(15.9))
    out = d.tick(16.1)
    assert CancelRequest("r") in out and any(isinstance(a, Finished) and a.outcome == "disconnected" for a in out)
    assert d.entries == {} and not d.per_key


def test_resume_within_the_grace_gets_the_rest_from_the_stream() -> None:
    d = core()
    open_accepted(d, 1, "r", key="k")
    d.tokens([tok("r", 0)], 0.1)
    d.disconnected(1, 0.2)
    d.tokens([tok("r", 1), tok("r", 2)], 0.3)
    assert d.resume(5, "r", 0, "k", 3.0) == [Repoint("r", "k")]
    out = d.repointed("r", "k", "running", 3.0)
    assert frames(out, 5)[0]["type"] == "resumed" and ReadStream("r", 0) in out
    out = d.stream_read("r", [tok("r", 1), tok("r", 2)], None, 3.1)
    assert [f["seq"] for f in frames(out, 5)] == [1, 2]
    assert d.tick(30.0) == [] or all(not isinstance(a, CancelRequest) for a in d.tick(30.0))


def test_resume_past_the_end_ends_with_done_instead_of_waiting() -> None:
    d = core()
    open_accepted(d, 1, "r", key="k")
    d.tokens([tok("r", 0), tok("r", 1)], 0.1)
    d.resume(2, "r", 50, "k", 0.2)
    d.repointed("r", "k", "running", 0.25)
    out = d.tokens([tok("r", 2, "", FinishReason.STOP)], 0.3)
    assert [f["type"] for f in frames(out, 2)] == ["done"]


def test_resume_of_a_request_this_edge_does_not_know() -> None:
    d = core()
    assert d.resume(1, "r", 3, "k", 0.0) == [Repoint("r", "k")]
    out = d.repointed("r", "k", "done", 0.1)
    assert frames(out)[0] == {"type": "resumed", "id": "r", "last_seq": 3}
    assert ReadStream("r", 3, with_last=True) in out
    out = d.stream_read("r", [], tok("r", 3, "", FinishReason.STOP), 0.2)
    assert [f["type"] for f in frames(out)] == ["done"] and d.entries == {}
    d.resume(1, "gone", -1, "k", 0.3)
    assert frames(d.repointed("gone", "k", None, 0.4))[0]["code"] == "unknown_id"


def test_a_late_repoint_answer_for_another_key_changes_nothing() -> None:
    """bob resumes his request and leaves; his grace runs out before Redis answers, and alice
    resumes the same id. bob's late answer must not open alice's resume (his answer on her
    screen), nor his late failure end it: only the answer to alice's own re-point counts.
    (Found by the state machine in test_delivery_state.py.)"""
    d = core()
    assert d.resume(1, "r", -1, "bob", 0.0) == [Repoint("r", "bob")]
    d.disconnected(1, 0.1)
    d.tick(20.0)  # past the resume grace: bob's resume is forgotten
    assert d.entries == {}
    assert d.resume(2, "r", -1, "alice", 20.1) == [Repoint("r", "alice")]
    assert d.repointed("r", "bob", "done", 20.2) == []
    assert d.refuse_resume("r", "bob", "queue unavailable; retry the resume shortly") == []
    assert "r" in d.entries
    out = d.repointed("r", "alice", None, 20.3)  # Redis: not alice's request
    assert [(f["type"], f["code"], f["id"]) for f in frames(out, 2)] == [("error", "unknown_id", "r")]
    assert d.entries == {}


def test_a_running_resume_rereads_the_stream_after_the_worker_repoints() -> None:
    d = core()
    d.resume(1, "r", -1, "k", 0.0)
    d.repointed("r", "k", "running", 0.0)
    d.stream_read("r", [tok("r", 0)], None, 0.1)
    assert ReadStream("r", 0) in d.tick(0.8)


def test_a_resume_that_overtook_a_resubmitted_chat_gets_the_answer_not_its_refusal() -> None:
    """A client resubmits a chat of an id Redis knows (on connection 1) and resumes the id (on
    connection 2) at once: the resume takes over the chat's registration while its enqueue is
    out. Redis then refuses the chat as a duplicate; that refusal is the chat's (which got
    ``resumed_elsewhere``), and the resume goes on to the answer. Before, the resume was answered
    ``duplicate_id`` and the answer never came (scripts/attack/a45_bookkeeping.py dupresume)."""
    d = core()
    assert d.open_chat(1, "r", "k", 0, 0.0) == (True, [])
    out = d.resume(2, "r", -1, "k", 0.1)
    assert [(f["type"], f.get("code")) for f in frames(out, 1)] == [("error", "resumed_elsewhere")]
    out = d.refuse("r", ErrorCode.DUPLICATE_ID, "request r already exists (done); use resume")
    assert frames(out) == [], "the chat already has its terminal frame; the resume waits for Redis"
    assert Repoint("r", "k") in out
    assert any(isinstance(a, Finished) and a.refused and a.outcome == "duplicate_id" for a in out)
    out = d.repointed("r", "k", "done", 0.2)
    assert frames(out, 2) == [{"type": "resumed", "id": "r", "last_seq": -1}]
    assert ReadStream("r", -1, with_last=True) in out
    out = d.stream_read("r", [tok("r", 0), tok("r", 1)], tok("r", 2, "", FinishReason.STOP), 0.3)
    assert [(f["type"], f.get("seq")) for f in frames(out, 2)] == [("delta", 0), ("delta", 1), ("done", None)]
    assert d.entries == {} and not d.per_conn and not d.per_key


def test_a_chat_refused_for_other_reasons_after_a_resume_took_it_over_answers_the_resume() -> None:
    """Any other refusal (the id is new: nothing to resume) ends the resume with it."""
    d = core()
    d.open_chat(1, "r", "k", 0, 0.0)
    d.resume(2, "r", -1, "k", 0.1)
    out = d.refuse("r", ErrorCode.OVERLOADED, "lane short cannot start this request in time")
    assert [(f["type"], f.get("code")) for f in frames(out, 2)] == [("error", "overloaded")]
    assert d.entries == {} and not d.per_conn


def test_cancel_before_accepted_waits_for_accepted() -> None:
    d = core()
    d.open_chat(1, "r", "", 0, 0.0)
    assert d.cancel(1, "r", 0.0) == []
    out = d.accepted("r", "short", 1, 0.1)
    assert [f["type"] for f in frames(out)] == ["accepted"] and CancelRequest("r", report=True) in out
    out = d.cancel_result("r", "queued", 0.2)
    assert frames(out)[0]["finish_reason"] == "cancelled"


def test_a_cancel_answered_after_a_resume_elsewhere_still_opens_with_resumed() -> None:
    """The owner cancels on one connection and resumes on another before Redis answers the
    cancel: the resume's connection gets ``resumed``, then ``done cancelled``, never a bare
    ``done`` (a Hypothesis state machine found this interleaving)."""
    d = core()
    open_accepted(d, 3, "r0", key="bob")
    assert d.cancel(3, "r0", 0.1) == [CancelRequest("r0", report=True)]
    out = d.resume(2, "r0", -1, "bob", 0.2)
    assert Repoint("r0", "bob") in out and frames(out, 3)[0]["code"] == "resumed_elsewhere"
    out = d.cancel_result("r0", "queued", 0.3)
    assert [(f["type"], f.get("last_seq"), f.get("finish_reason")) for f in frames(out, 2)] == \
        [("resumed", -1, None), ("done", None, "cancelled")]
    assert d.entries == {} and d.repointed("r0", "bob", "cancelled", 0.4) == [], "the late answer changes nothing"


def test_cancel_of_a_running_request_ends_locally_if_the_worker_is_silent() -> None:
    d = core()
    open_accepted(d, 1, "r")
    assert d.cancel(1, "r", 0.0) == [CancelRequest("r", report=True)]
    assert d.cancel_result("r", "running", 0.1) == []
    out = d.tick(2.2)
    assert frames(out)[0]["finish_reason"] == "cancelled"
    assert frames(d.cancel(2, "x", 3.0))[0]["code"] == "unknown_id"


def test_a_cancel_redis_did_not_take_stands_until_the_request_is_served_here_again() -> None:
    """The shell retries a cancel Redis did not answer while ``cancel_stands``: through the
    cancel grace and after the request ended here, not once its client resumed it here."""
    d = core()
    open_accepted(d, 1, "r")
    assert not d.cancel_stands("r"), "served here and nobody cancelled it"
    assert d.cancel(1, "r", 0.0) == [CancelRequest("r", report=True)]
    assert d.cancel_failed("r", 1.0) == []
    assert d.cancel_stands("r"), "ending cancelled"
    assert frames(d.tick(3.1))[0]["finish_reason"] == "cancelled"
    assert d.cancel_stands("r"), "ended here: Redis must still hear of it"
    out = d.resume(2, "r", 5, "", 4.0, 0)
    assert Repoint("r", "") in out
    assert not d.cancel_stands("r"), "its client resumed it here"


def test_quiet_requests_are_checked_lost_or_moved() -> None:
    d = core()
    open_accepted(d, 1, "a")
    open_accepted(d, 1, "b")
    open_accepted(d, 1, "c")
    out = d.tick(3.5)
    assert CheckRequests(("a", "b", "c")) in out
    assert not any(isinstance(a, CheckRequests) for a in d.tick(3.6))  # one check at a time
    out = d.checked({"a": None, "b": ("edge-z", "running"), "c": (EDGE, "running")}, 3.7)
    codes = {f["id"]: f.get("code") for f in frames(out)}
    assert codes == {"a": "request_lost", "b": "resumed_elsewhere"}
    assert ReadStream("c", -1) in out and set(d.entries) == {"c"}


def test_a_request_unheard_while_redis_is_out_of_reach_ends_unavailable() -> None:
    """Tokens come through Redis and each quiet check asks it: when it is out of reach nothing
    refreshes a request, which then waited for as long as the outage lasted (an HTTP stream got
    keep-alives for 100 s and more: audit). After ``unreachable_s`` of silence it ends
    ``unavailable`` and is cancelled; one whose checks are answered (queued, not lost) stays."""
    d = core()
    open_accepted(d, 1, "a")  # Redis went away: its checks fail
    open_accepted(d, 1, "b")  # queued behind a long backlog: its checks are answered
    open_accepted(d, 2, "c")  # a takeover notice whose check Redis never answers
    d.tokens([tok("a", 0), tok("c", 0)], 0.5)
    d.takeover_notice("c")
    assert frames(d.tokens([tok("c", 1, finish=FinishReason.STOP)], 0.6)) == []  # held for the check
    t = 0.5
    while t + 3.5 <= 0.5 + CONFIG.unreachable_s:
        t += 3.5
        for action in d.tick(t):
            if isinstance(action, CheckRequests):
                d.check_failed(periodic=action.periodic)
        d.checked({"b": (EDGE, "queued")}, t, periodic=False, notices=d.notices)
        assert set(d.entries) == {"a", "b", "c"}
    out = d.tick(0.6 + CONFIG.unreachable_s + 0.1)  # 30 s after the last token of each
    ended = {f["id"]: f.get("code") for f in frames(out)}
    assert ended == {"a": "unavailable", "c": "unavailable"}, out
    assert "out of reach" in frames(out)[0]["message"]
    assert CancelRequest("a") in out and CancelRequest("c") in out
    assert {a.request_id: a.outcome for a in out if isinstance(a, Finished)} == {"a": "unavailable",
                                                                                  "c": "unavailable"}
    assert set(d.entries) == {"b"} and d.per_conn[2] == 0


def test_a_takeover_notice_checks_at_once_and_a_stale_one_changes_nothing() -> None:
    d = core()
    open_accepted(d, 1, "a")
    open_accepted(d, 1, "b")
    assert d.takeover_notice("nobody") == []
    assert d.takeover_notice("a") == [CheckRequests(("a",), periodic=False, notices=1)]
    out = d.tick(3.5)  # the notice's check does not hold back the tick's own
    assert CheckRequests(("a", "b"), notices=1) in out
    out = d.checked({"a": ("edge-z", "running")}, 3.6, periodic=False)
    assert [(f["id"], f.get("code")) for f in frames(out)] == [("a", "resumed_elsewhere")]
    assert not any(isinstance(a, CheckRequests) for a in d.tick(3.7))  # the tick's check is still out
    # The request came back here before the notice was read: Redis says so, nothing ends.
    d.takeover_notice("b")
    assert frames(d.checked({"b": (EDGE, "running")}, 3.8, periodic=False)) == []
    assert set(d.entries) == {"b"}


def test_an_end_that_beats_the_takeover_check_waits_for_it() -> None:
    """The worker still sends to the old edge until its next heartbeat, and the new owner may
    cancel at once: an end that arrives between the takeover notice and its check must not
    reach the old connection as its own (audit: 1-2 % of resume-then-cancel races got
    ``done: cancelled`` instead of ``resumed_elsewhere``). A stale notice delivers it."""
    d = core()
    open_accepted(d, 1, "a")
    open_accepted(d, 1, "b")
    d.tokens([tok("a", 0), tok("b", 0)], 0.1)
    d.takeover_notice("a")
    d.takeover_notice("b")
    out = d.tokens([tok("a", 1), tok("a", 2, finish=FinishReason.CANCELLED),
                    tok("b", 1), tok("b", 2, finish=FinishReason.STOP)], 0.2)
    assert [f["type"] for f in frames(out)] == ["delta", "delta"], "deltas go on; the ends wait"
    assert not any(isinstance(a, Finished) for a in out) and set(d.entries) == {"a", "b"}
    out = d.checked({"a": ("edge-z", "cancelled"), "b": (EDGE, "done")}, 0.3, periodic=False)
    assert [(f["id"], f["type"], f.get("code") or f.get("finish_reason")) for f in frames(out)] == [
        ("a", "error", "resumed_elsewhere"), ("b", "done", "stop")]
    assert d.entries == {}
    # Without an answer to the notice's check, the tick's quiet check decides later.
    open_accepted(d, 2, "c", now=1.0)
    d.takeover_notice("c")
    assert frames(d.tokens([tok("c", 0, finish=FinishReason.STOP)], 1.1)) == []
    d.check_failed(periodic=False)
    retry = next(a for a in d.tick(4.2) if isinstance(a, CheckRequests))
    assert retry.request_ids == ("c",) and retry.notices == d.notices
    assert [f["type"] for f in frames(d.checked({"c": (EDGE, "done")}, 4.3, True, retry.notices))] == ["done"]


def test_a_check_read_before_the_notice_does_not_settle_it() -> None:
    """A quiet check's answer, read from Redis before the other edge's re-point, arrives after
    its notice (replies and notices come on different connections): it must not release an
    end the notice's own check has yet to judge (review)."""
    d = core()
    open_accepted(d, 1, "a")
    d.tokens([tok("a", 0)], 0.1)
    quiet = next(a for a in d.tick(3.5) if isinstance(a, CheckRequests))
    notice_check = d.takeover_notice("a")[0]
    assert frames(d.checked({"a": (EDGE, "running")}, 3.6, True, quiet.notices)) == []
    assert frames(d.tokens([tok("a", 1, finish=FinishReason.CANCELLED)], 3.7)) == [], "held"
    out = d.checked({"a": ("edge-z", "cancelled")}, 3.8, False, notice_check.notices)
    assert [(f["type"], f.get("code")) for f in frames(out)] == [("error", "resumed_elsewhere")]


def test_a_notice_during_a_resume_here_is_checked_once_re_pointed() -> None:
    """A client resumes on this edge and on another; the other's notice arrives while this
    edge's re-point is out. Which re-point was last only Redis can say: the end waits for the
    check issued once this one is answered (review)."""
    d = core()
    open_accepted(d, 1, "a")
    d.tokens([tok("a", 0)], 0.1)
    assert Repoint("a", "") in d.resume(2, "a", 0, "", 0.2)
    assert d.takeover_notice("a") == []  # nothing to check until the re-point is answered
    out = d.repointed("a", "", "running", 0.3)
    check = next(a for a in out if isinstance(a, CheckRequests))
    assert frames(d.tokens([tok("a", 1, finish=FinishReason.CANCELLED)], 0.4), conn=2) == []
    out = d.checked({"a": ("edge-z", "cancelled")}, 0.5, False, check.notices)
    assert [(f["type"], f.get("code")) for f in frames(out, conn=2)] == [("error", "resumed_elsewhere")]


def test_a_resume_here_settles_the_notices_heard_before_it() -> None:
    """A stale notice's check is still out when the client resumes here: the re-point is later
    than the notice's, so the request's end is delivered at once, not after a quiet check."""
    d = core()
    open_accepted(d, 1, "a")
    d.tokens([tok("a", 0)], 0.1)
    d.takeover_notice("a")
    d.resume(2, "a", 0, "", 0.2)
    d.checked({"a": (EDGE, "running")}, 0.25, periodic=False)  # answered while re-pointing: skipped
    out = d.repointed("a", "", "running", 0.3)
    assert not any(isinstance(a, CheckRequests) for a in out)
    assert [f["type"] for f in frames(d.tokens([tok("a", 1, finish=FinishReason.STOP)], 0.4), conn=2)] == ["done"]


def test_a_check_read_before_a_resume_here_does_not_move_the_new_owner() -> None:
    """(Re-review.) The client hops A -> B -> A. A's notice check reads Redis (edge B) before the resume here
    re-points it back; its answer arrives after ``repointed``. Redis now says edge A: the
    connection that resumed here last must not be told resumed_elsewhere (the request then runs
    on, its tokens published to A, with nobody listening)."""
    d = core()
    open_accepted(d, 1, "a")
    d.tokens([tok("a", 0)], 0.1)
    (check,) = d.takeover_notice("a")          # Redis read now: edge-b
    out = d.resume(2, "a", 0, "", 0.2)
    assert Repoint("a", "") in out            # Redis: edge-a again
    d.repointed("a", "", "running", 0.3)
    out = d.checked({"a": ("edge-b", "running")}, 0.4, check.periodic, check.notices)
    assert frames(out, conn=2) == [], frames(out, conn=2)
    assert "a" in d.entries


def test_a_periodic_check_read_before_a_resume_here_does_not_move_the_new_entry() -> None:
    """The same with a quiet check and no notice at all (a fresh entry created by the resume)."""
    d = core()
    open_accepted(d, 1, "a")
    d.tokens([tok("a", 0)], 0.1)
    quiet = next(a for a in d.tick(3.5) if isinstance(a, CheckRequests))  # read now: edge-b
    d.resume(2, "a", 0, "", 3.6)
    d.repointed("a", "", "running", 3.7)
    out = d.checked({"a": ("edge-b", "running")}, 3.8, quiet.periodic, quiet.notices)
    assert frames(out, conn=2) == [], frames(out, conn=2)


def test_a_notice_heard_while_the_enqueue_is_out_still_holds_the_end() -> None:
    """(Re-review.) The record exists in Redis once the enqueue's script ran; its reply reaches the edge
    later. A resume on edge B meanwhile re-points it and notifies A, whose entry is OPENING:
    the notice is dropped, nothing is pending, and the new owner's cancel, still published to
    A by the worker that popped it before the move, reaches the old connection as done."""
    d = core()
    ok, _ = d.open_chat(1, "a", "", 0, 0.0)
    assert ok
    assert d.takeover_notice("a") == []          # OPENING: remembered, checked once accepted
    out = d.accepted("a", "short", 42, 0.1)
    assert CheckRequests(("a",), periodic=False, notices=d.notices) in out
    out = d.tokens([tok("a", 0), tok("a", 1, finish=FinishReason.CANCELLED)], 0.2)
    assert [f["type"] for f in frames(out)] == ["delta"], [f["type"] for f in frames(out)]
    out = d.checked({"a": ("edge-b", "cancelled")}, 0.3, False, d.notices)
    assert [(f["type"], f.get("code")) for f in frames(out)] == [("error", "resumed_elsewhere")]


def test_caps_per_connection_and_per_key() -> None:
    d = core()
    for i in range(4):
        assert d.open_chat(1, f"r{i}", "", 0, 0.0)[0]
    ok, out = d.open_chat(1, "r4", "", 0, 0.0)
    assert not ok and frames(out)[0]["code"] == "too_many_in_flight"
    assert d.open_chat(2, "k0", "key", 2, 0.0)[0] and d.open_chat(3, "k1", "key", 2, 0.0)[0]
    ok, out = d.open_chat(4, "k2", "key", 2, 0.0)
    assert not ok and "API key" in frames(out)[0]["message"]
    # Counted with the other refusals (they reached no metric and no dashboard before).
    assert [(a.outcome, a.refused) for a in out if isinstance(a, Finished)] == [("too_many_in_flight", True)]
    ok, out = d.open_chat(5, "k0", "other-key", 0, 0.0)  # the id is in flight here: a duplicate
    assert not ok and [(a.request_id, a.outcome) for a in out if isinstance(a, Finished)] == [("k0", "duplicate_id")]
    assert "k0" in d.entries
    # Taking over a request another connection holds counts against the cap too (it did not:
    # a full connection could gather any number that way).
    open_accepted(d, 5, "other")
    out = d.resume(1, "other", -1, "", 1.0)
    assert [f["code"] for f in frames(out)] == ["too_many_in_flight"] and d.entries["other"].conn == 5
    # A request of the key new to this edge (submitted on another one) counts against the key's
    # cap here: else a chat there and a resume here ran any number of a key's requests at once.
    out = d.resume(6, "k-elsewhere", 3, "key", 1.0, key_max_in_flight=2)
    assert [f["code"] for f in frames(out)] == ["too_many_in_flight"] and "k-elsewhere" not in d.entries
    assert d.per_key["key"] == 2
    assert [type(a).__name__ for a in d.resume(6, "k-elsewhere", 3, "key", 1.0, key_max_in_flight=3)] == ["Repoint"]


def test_nothing_is_left_behind_after_many_requests() -> None:
    d = core()
    for i in range(2000):
        conn = i  # a new connection per request, as the memory benchmark does
        open_accepted(d, conn, f"r{i}", key="k")
        d.tokens([tok(f"r{i}", 0, "", FinishReason.STOP)], float(i))
        d.disconnected(conn, float(i))
    assert d.entries == {} and not d.per_conn and not d.per_key


def test_a_cancelled_request_whose_worker_has_not_ended_it_is_not_lost() -> None:
    """Redis says ``cancelled`` before the worker wrote the end: the answer ends as cancelled,
    never as ``request_lost``."""
    d = Delivery(EDGE, DeliveryConfig(cancel_grace_s=10.0, quiet_s=3.0))
    open_accepted(d, 1, "r")
    d.tokens([tok("r", 0)], 0.1)
    d.cancel(1, "r", 0.2)
    assert d.cancel_result("r", "running", 0.3) == []
    assert CheckRequests(("r",)) in d.tick(3.5)
    out = d.checked({"r": (EDGE, "cancelled")}, 3.6)
    assert ReadStream("r", 0, with_last=True) in out
    out = d.stream_read("r", [], tok("r", 0), 3.7)
    assert frames(out) == [frames(out)[0]] and frames(out)[0]["finish_reason"] == "cancelled"


def test_two_keys_may_use_the_same_id_and_frames_carry_the_clients_id() -> None:
    """Ids are per API key (``protocol.scoped_id``): the edge registers each key's ``q1`` as its
    own request, and every frame, error messages included, names ``q1`` as the client sent it."""
    d = core()
    alice, bob = scoped_id("k-alice", "q1"), scoped_id("k-bob", "q1")
    assert alice != bob and client_id(alice) == client_id(bob) == "q1"
    out = open_accepted(d, 1, alice, "k-alice") + open_accepted(d, 2, bob, "k-bob")
    out += d.tokens([tok(alice, 0, "a"), tok(bob, 0, "b")], 0.1)
    ok, refused = d.open_chat(1, alice, "k-alice", 0, 0.2)
    assert not ok
    out += refused + d.tokens([tok(alice, 1, "", FinishReason.STOP), tok(bob, 1, "", FinishReason.STOP)], 0.3)
    assert [(f["type"], f["id"], f.get("text")) for f in frames(out, 1)] == [
        ("accepted", "q1", None), ("delta", "q1", "a"), ("error", "q1", None), ("done", "q1", None)]
    assert [(f["type"], f.get("text")) for f in frames(out, 2)] == [("accepted", None), ("delta", "b"), ("done", None)]
    assert frames(refused)[0]["message"] == "request q1 is already in flight"
    assert d.entries == {} and not d.per_key
    # Without auth (key id "") the id is used as sent: one anonymous namespace.
    assert scoped_id("", "q1") == client_id("q1") == "q1"


def test_a_chat_whose_connection_leaves_without_grace_during_its_enqueue_is_cancelled_once_enqueued() -> None:
    """An HTTP client gone, or a revoked key's connection closed, while the chat is being
    admitted: forgotten at once, the request was enqueued all the same and ran with nobody
    listening (the cancel sent first found nothing in Redis). It is cancelled once accepted."""
    d = core()
    assert d.open_chat(1, "r", "k", 0, 0.0)[0]
    assert d.disconnected(1, 0.1, grace_s=0) == [] and "r" in d.entries
    assert d.tick(5.0) == [], "the enqueue settles it, not the timers"
    out = d.accepted("r", "short", 10, 0.2)
    assert out == [CancelRequest("r", report=True)], "cancelled, and nothing sent to nobody"
    ended = d.cancel_result("r", "queued", 0.3)
    assert [(a.request_id, a.outcome) for a in ended if isinstance(a, Finished)] == [("r", "cancelled")]
    assert not d.entries and not d.per_key
    # Refused instead: it just ends.
    assert d.open_chat(2, "q", "k", 0, 1.0)[0]
    d.disconnected(2, 1.1, grace_s=0)
    out = d.refuse("q", ErrorCode.OVERLOADED, "busy")
    assert [type(a).__name__ for a in out] == ["Finished"] and not d.entries
