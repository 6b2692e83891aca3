"""The edge's queue of cancels Redis has not taken (``ws_server/cancels.py``): pure, no loop, no Redis.
The loop that sends them runs against a real Redis in ``test_cancel_retry.py``."""

from __future__ import annotations

from lanes.ws_server.cancels import PendingCancels


def always(_: str) -> bool:
    return True


def test_pending_cancels_are_sent_per_pool_oldest_first_and_forgotten_once_taken() -> None:
    q = PendingCancels()
    assert q.add("a", "default", report=False, now_s=0.0)
    assert q.add("b", "large", report=True, now_s=1.0)
    assert q.add("c", "default", report=False, now_s=2.0)
    assert q.batch(3.0, always) == ({"default": ["a", "c"], "large": ["b"]}, [])
    assert q.sent("b") is True, "a client's own cancel wants its result"
    assert q.sent("a") is False
    assert len(q) == 1 and "c" in q and q.first() == ["c"]


def test_a_cancel_asked_for_twice_is_pending_once_and_keeps_its_place() -> None:
    q = PendingCancels()
    q.add("a", "default", report=False, now_s=0.0)
    q.add("b", "default", report=False, now_s=1.0)
    assert q.add("a", "default", report=True, now_s=2.0)
    assert len(q) == 2 and q.first() == ["a", "b"]
    assert q.unanswered() == ["a"], "the second asking wanted an answer"


def test_unanswered_client_cancels_are_answered_once() -> None:
    q = PendingCancels()
    q.add("mine", "default", report=True, now_s=0.0)
    q.add("left", "default", report=False, now_s=0.0)
    assert q.unanswered() == ["mine"]
    assert q.unanswered() == [], "told cancel_failed once; the cancel itself stays pending"
    assert len(q) == 2 and q.sent("mine") is False, "answered already: no cancel_result after it lands"


def test_one_cancel_is_answered_once_without_a_scan() -> None:
    q = PendingCancels()
    q.add("mine", "default", report=True, now_s=0.0)
    q.add("left", "default", report=False, now_s=0.0)
    assert q.answered("mine") is True and q.answered("mine") is False
    assert q.answered("left") is False and q.answered("unknown") is False
    assert q.unanswered() == [] and len(q) == 2


def test_at_the_cap_a_new_cancel_is_refused_and_those_pending_keep_their_place() -> None:
    q = PendingCancels(max_pending=2)
    assert q.add("a", "default", report=False, now_s=0.0)
    assert q.add("b", "default", report=False, now_s=0.0)
    assert not q.add("c", "default", report=True, now_s=1.0)
    assert q.add("a", "default", report=True, now_s=1.0), "one pending already is no new one"
    assert q.batch(2.0, always) == ({"default": ["a", "b"]}, [])
    q.sent("a")
    assert q.add("c", "default", report=False, now_s=3.0), "room again once one was taken"


def test_a_cancel_is_given_up_after_the_retry_window() -> None:
    q = PendingCancels(retry_s=600.0)
    q.add("old", "default", report=False, now_s=0.0)
    q.add("new", "default", report=False, now_s=100.0)
    assert q.batch(599.9, always) == ({"default": ["old", "new"]}, [])
    assert q.batch(600.0, always) == ({"default": ["new"]}, ["old"])
    assert "old" not in q


def test_the_retry_stops_for_a_request_its_client_resumed() -> None:
    """``stands`` (``Delivery.cancel_stands``) is False once the client resumed the request here;
    a client's cancel not yet answered is sent whatever it says (its entry is still live)."""
    q = PendingCancels()
    q.add("resumed", "default", report=False, now_s=0.0)
    q.add("asked", "default", report=True, now_s=0.0)
    q.add("gone", "default", report=False, now_s=0.0)
    by_pool, given_up = q.batch(1.0, lambda rid: rid == "gone")
    assert by_pool == {"default": ["asked", "gone"]} and given_up == []
    assert "resumed" not in q
