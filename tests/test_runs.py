"""The worker's run table, event by event: no event loop, no Redis, no engine."""

from __future__ import annotations

from lanes.queue.messages import Finish, FinishReason, Lane, RequestState, Usage
from lanes.workers.runs import AbortEngine, Complete, FlushResult, Release, RunTable

END = Finish(FinishReason.STOP, Usage(3, 2))


def started(table: RunTable, rid: str = "r", edge: str = "e1", attempt: int = 1) -> None:
    table.start(rid, edge, attempt, Lane.SHORT, max_tokens=100, predicted_tokens=20)


def flush_all(table: RunTable, appended: dict[str, int] | None = None, receivers: int = 1, now: float = 0.0):
    batch = table.take_outbox()
    counts = appended if appended is not None else {run.id: 1 for run, _ in batch}
    return batch, table.flushed(batch, FlushResult(counts, {run.edge: receivers for run, _ in batch}), now)


def test_a_run_completes_only_once_its_end_is_in_the_stream() -> None:
    table = RunTable()
    started(table)
    table.submit("r", "a", (1,), None)
    table.submit("r", "", (), END)
    assert [e.seq for _, e in table.outbox] == [0, 1]
    assert table.ended("r", RequestState.DONE) == [], "not flushed yet: the slot stays taken"
    assert "r" in table.runs
    _, actions = flush_all(table)
    assert actions == [Complete("r", 1, RequestState.DONE)] and table.runs == {}
    assert table.num_finished == {"done": 1}


def test_an_end_flushed_before_the_task_ends_completes_at_the_end() -> None:
    table = RunTable()
    started(table)
    table.submit("r", "", (), END)
    assert flush_all(table)[1] == []
    assert table.ended("r", RequestState.DONE) == [Complete("r", 1, RequestState.DONE)]


def test_a_refused_append_makes_the_run_stale_it_is_neither_completed_nor_released() -> None:
    table = RunTable()
    started(table)
    table.submit("r", "a", (1,), None)
    _, actions = flush_all(table, appended={"r": -1})
    assert actions == [AbortEngine("r")]
    table.submit("r", "b", (2,), None)
    assert table.take_outbox() == [], "nothing more is written for a stale attempt"
    assert table.ended("r", None) == [] and table.runs == {}


def test_events_queued_before_a_run_turned_stale_are_not_flushed() -> None:
    table = RunTable()
    started(table, "r")
    started(table, "s")
    table.submit("r", "a", (1,), None)
    table.submit("s", "x", (9,), None)
    table.retry(table.take_outbox())  # the flush failed: its events wait for the next one
    assert table.heartbeat({"s": ("lost", "")}) == [AbortEngine("s")]  # another attempt owns s now
    table.submit("s", "y", (10,), None)  # ignored: stale
    assert [(run.id, e.seq) for run, e in table.take_outbox()] == [("r", 0)], "s's queued event is left out"
    table.submit("r", "b", (2,), None)
    assert [(run.id, e.seq) for run, e in table.take_outbox()] == [("r", 1)]


def test_an_interrupted_run_is_released_and_a_preempted_one_goes_to_its_lane() -> None:
    table = RunTable()
    started(table, "a")
    started(table, "b")
    assert table.ended("a", None) == [Release("a", 1)]
    assert table.preempt("b", Lane.LONG) == [AbortEngine("b", cancel_task_after_s=1.0)]
    assert table.preempt("b", Lane.LONG) == [], "once"
    assert table.ended("b", None) == [Release("b", 1, Lane.LONG, preempted=True)]
    assert table.num_finished == {"interrupted": 1, "preempted": 1}


def test_cancel_heartbeat_and_repointing() -> None:
    table = RunTable()
    started(table, "a")
    started(table, "b")
    started(table, "c")
    actions = table.heartbeat({"a": ("cancelled", "e1"), "b": ("lost", "e1"), "c": ("ok", "e2")})
    assert AbortEngine("a", cancel_task_after_s=1.0) in actions and AbortEngine("b") in actions
    assert table.runs["c"].edge == "e2", "a resume on another edge re-points the run"
    assert table.cancel("a") == [], "a cancel is carried out once"
    assert table.leases() == [("a", 1), ("c", 1)]


def test_an_orphan_is_cancelled_after_its_grace() -> None:
    table = RunTable(orphan_grace_s=15.0)
    started(table)
    for now, expected in ((0.0, []), (10.0, []), (16.0, [AbortEngine("r", cancel_task_after_s=1.0)])):
        table.submit("r", "x", (1,), None)
        assert flush_all(table, receivers=0, now=now)[1] == expected


def test_an_orphan_whose_edge_lets_clients_resume_longer_is_kept_longer() -> None:
    """A client may resume on another edge for its edge's ``LANES_RESUME_GRACE_S`` (the payload
    carries it): with 30 s there, the worker cancelled the answer of a dead edge at 15 s."""
    table = RunTable(orphan_grace_s=15.0)
    table.start("r", "edge-1", 1, Lane.SHORT, orphan_grace_s=30.0 + 2 * 0.5 + 1.0)
    for now, expected in ((0.0, []), (16.0, []), (31.0, []), (33.0, [AbortEngine("r", cancel_task_after_s=1.0)])):
        table.submit("r", "x", (1,), None)
        assert flush_all(table, receivers=0, now=now)[1] == expected, now


def test_progress_counts_earlier_attempts() -> None:
    table = RunTable()
    started(table)
    table.runs["r"].prior_tokens = 250
    table.submit("r", "x", (1, 2), None)
    assert table.lanes_and_progress() == [(Lane.SHORT, 252)]


def test_a_stale_run_dropped_without_an_action_still_frees_its_slot() -> None:
    table = RunTable()
    started(table)
    table.submit("r", "", (), END)
    assert table.ended("r", RequestState.DONE) == [] and not table.take_slot_freed(), "waits for its flush"
    # The end's append is refused (another attempt owns it now): the run is dropped silently.
    _, actions = flush_all(table, appended={"r": -1})
    assert actions == [] and table.runs == {}
    assert table.take_slot_freed() and not table.take_slot_freed()
