"""The worker's run table, sans-I/O: one object owns every claimed request's state.

The claim loop, each request's engine task, the publish loop and the heartbeat feed it events
(claimed, a delta produced, a flush's result, a heartbeat's answer, a cancel, the engine task
ended); it answers with actions (abort on the engine, complete or release in Redis). The
``Worker`` (``worker.py``) carries them out. Nothing here awaits, reads the clock or talks to
Redis, so the rules below are tested without a loop.

Per run: the attempt (its fence on the token stream), the next seq, whether its last event is
flushed, and three ways it may stop early:

- ``cancelled``: the client cancelled (control channel or heartbeat); the engine is aborted and
  the run ends with ``cancelled``;
- ``stale``: the stream refused our append or the heartbeat says another attempt owns the
  request (our lease expired): abort, and neither complete nor release;
- orphaned: nobody has been subscribed to its edge's channel for ``orphan_grace_s`` (the edge
  died and the client never resumed): cancelled as above.

A run ends in exactly one of: ``Complete`` (its final event is in the stream), ``Release``
(interrupted: back to its lane now), or nothing (stale: the newer attempt owns it).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from lanes.queue.messages import Finish, FinishReason, Lane, RequestState, TokenEvent

# -- actions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class AbortEngine:
    """Abort the engine request now; with ``cancel_task_after_s``, cancel its task if it has not
    ended by then (an engine that ignores aborts)."""

    request_id: str
    cancel_task_after_s: float | None = None


@dataclass(frozen=True)
class Complete:
    request_id: str
    attempt: int
    state: RequestState


@dataclass(frozen=True)
class Release:
    request_id: str
    attempt: int
    #: Back into this lane (None: the one it came from); a preemption counts as one.
    lane: Lane | None = None
    preempted: bool = False


RunAction = AbortEngine | Complete | Release


# -- state -------------------------------------------------------------------------------


@dataclass
class Run:
    """One claimed request on this worker."""

    id: str
    edge: str
    attempt: int
    lane: Lane
    #: Seq of the next event (continues after an earlier attempt's events).
    seq: int = 0
    prompt_tokens: int = 0
    #: Tokens streamed by earlier attempts (this one continues after them).
    prior_tokens: int = 0
    completion_tokens: int = 0
    #: Demotion: past this many generated tokens the run counts against a later lane (the
    #: worker sets it from the policy; inf: never).
    demote_above: float = math.inf
    max_tokens: int = 0
    predicted_tokens: int = 0
    times_preempted: int = 0
    #: When this attempt started (monotonic ms), for the preemption's minimum run time.
    started_at_ms: float = 0.0
    #: Being handed back into this lane (a preemption): its end is a release, not a finish.
    preempt_to: Lane | None = None
    cancelled: bool = False
    stale: bool = False
    #: The engine task has ended; ``final`` is the state it ended in (None: interrupted).
    ended: bool = False
    final: RequestState | None = None
    #: The event carrying ``finish`` is in the stream.
    finish_flushed: bool = False
    #: Since when (monotonic s) nobody has been subscribed to this run's edge channel.
    orphan_since: float | None = None
    #: How long it may stay so before it is cancelled (None: the table's ``orphan_grace_s``).
    orphan_grace_s: float | None = None


@dataclass(frozen=True)
class FlushResult:
    """What one flush did: per request, events appended (< 0: refused, the attempt is stale),
    and per edge channel, how many subscribers got the batch."""

    appended: dict[str, int]
    receivers: dict[str, int]


@dataclass
class RunTable:
    #: After a cancel, how long the engine gets to end the request before its task is cancelled.
    abort_grace_s: float = 1.0
    #: A run whose edge has had no subscriber this long is cancelled (s).
    orphan_grace_s: float = 15.0
    runs: dict[str, Run] = field(default_factory=dict)
    #: Events waiting for the next flush, in submission order.
    outbox: list[tuple[Run, TokenEvent]] = field(default_factory=list)
    num_finished: Counter[str] = field(default_factory=Counter)
    #: A run turned stale since the last ``take_outbox``: its events (if any) must be left out.
    _stale_since_take: bool = field(default=False, init=False, repr=False)
    _slot_freed: bool = field(default=False, init=False, repr=False)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, request_id: str, edge: str, attempt: int, lane: Lane, *, max_tokens: int = 0,
              predicted_tokens: int = 0, times_preempted: int = 0, now_ms: float = 0.0,
              orphan_grace_s: float | None = None) -> Run:
        run = Run(request_id, edge, attempt, lane, max_tokens=max_tokens, predicted_tokens=predicted_tokens,
                  times_preempted=times_preempted, started_at_ms=now_ms, orphan_grace_s=orphan_grace_s)
        self.runs[request_id] = run
        return run

    def submit(self, request_id: str, text: str, token_ids: tuple[int, ...], finish: Finish | None) -> None:
        """A delta (or the end) of a run, for the next flush."""
        run = self.runs[request_id]
        if run.stale:
            return
        run.completion_tokens += len(token_ids)
        self.outbox.append((run, TokenEvent(run.id, run.attempt, run.seq, text, token_ids, finish)))
        run.seq += 1

    def end_already_streamed(self, request_id: str) -> None:
        """An earlier attempt put the end in the stream but died before completing."""
        run = self.runs[request_id]
        run.finish_flushed = True

    def ended(self, request_id: str, final: RequestState | None) -> list[RunAction]:
        """The run's engine task is over: ``final`` when its end was submitted, None when it
        was interrupted (shutdown, engine death)."""
        run = self.runs.get(request_id)
        if run is None:
            return []
        run.ended, run.final = True, final
        if run.stale:
            return self._drop(run, "stale")
        if final is None and run.preempt_to is not None:
            return self._drop(run, "preempted", [Release(run.id, run.attempt, run.preempt_to, preempted=True)])
        if final is None:
            return self._drop(run, "interrupted", [Release(run.id, run.attempt)])
        if run.finish_flushed:
            return self._drop(run, final.value, [Complete(run.id, run.attempt, final)])
        return []  # completes once the publish loop has flushed its end

    # -- flushing --------------------------------------------------------------------------

    def retry(self, batch: list[tuple[Run, TokenEvent]]) -> None:
        """A flush failed: its events go first in the next one (order kept)."""
        self.outbox[:0] = batch

    def take_outbox(self) -> list[tuple[Run, TokenEvent]]:
        """Everything submitted since the last call, stale runs' events left out."""
        batch, self.outbox = self.outbox, []
        if not self._stale_since_take:  # a stale run submits nothing, so the batch is clean
            return batch
        self._stale_since_take = False
        return [(run, event) for run, event in batch if not run.stale]

    def flushed(self, batch: Iterable[tuple[Run, TokenEvent]], result: FlushResult, now: float) -> list[RunAction]:
        actions: list[RunAction] = []
        for run, event in batch:
            if event.finish is not None and result.appended.get(run.id, 0) > 0:
                run.finish_flushed = True
        for request_id, appended in result.appended.items():
            run = self.runs.get(request_id)
            if run is None:
                continue
            if appended < 0:
                actions += self._make_stale(run)
            elif run.ended and run.finish_flushed and run.final is not None:
                actions += self._drop(run, run.final.value, [Complete(run.id, run.attempt, run.final)])
            else:
                actions += self._track_orphan(run, result.receivers.get(run.edge, 1), now)
        return actions

    # -- heartbeat, cancels ----------------------------------------------------------------

    def leases(self) -> list[tuple[str, int]]:
        """``(id, attempt)`` of every run whose lease we hold."""
        return [(r.id, r.attempt) for r in self.runs.values() if not r.stale]

    def heartbeat(self, answers: dict[str, tuple[str, str]]) -> list[RunAction]:
        """The heartbeat's answer per request: ``(status, edge)`` with status ok, cancelled or lost."""
        actions: list[RunAction] = []
        for request_id, (status, edge) in answers.items():
            run = self.runs.get(request_id)
            if run is None:
                continue
            if edge:
                run.edge = edge  # re-pointed by a resume on another edge
            if status == "cancelled":
                actions += self.cancel(request_id)
            elif status == "lost":
                actions += self._make_stale(run)
        return actions

    def preempt(self, request_id: str, lane: Lane) -> list[RunAction]:
        """Hand a running request back into ``lane``: abort it on the engine; its task ends
        without a finish and the table releases it (it resumes later after its tokens)."""
        run = self.runs.get(request_id)
        if run is None or run.cancelled or run.stale or run.ended or run.preempt_to is not None:
            return []
        run.preempt_to = lane
        return [AbortEngine(request_id, cancel_task_after_s=self.abort_grace_s)]

    def cancel(self, request_id: str) -> list[RunAction]:
        run = self.runs.get(request_id)
        if run is None or run.cancelled or run.stale or run.ended:
            return []
        run.cancelled = True
        return [AbortEngine(request_id, cancel_task_after_s=self.abort_grace_s)]

    def finish_reason_if_stopped(self, request_id: str) -> FinishReason:
        """How a generation that ended without a finish ends: cancelled when we stopped it."""
        run = self.runs.get(request_id)
        return FinishReason.CANCELLED if run is not None and (run.cancelled or run.stale) else FinishReason.ERROR

    def lanes_and_progress(self) -> list[tuple[Lane, int]]:
        """``(claimed lane, generated tokens including earlier attempts)`` per run, for demotion."""
        return [(run.lane, run.prior_tokens + run.completion_tokens) for run in self.runs.values()]

    # -- internals -------------------------------------------------------------------------

    def _make_stale(self, run: Run) -> list[RunAction]:
        if run.stale:
            return []
        run.stale = True
        self._stale_since_take = True
        if run.ended:
            return self._drop(run, "stale")
        return [AbortEngine(run.id)]

    def _track_orphan(self, run: Run, receivers: int, now: float) -> list[RunAction]:
        if receivers > 0:
            run.orphan_since = None
        elif run.orphan_since is None:
            run.orphan_since = now
        elif now - run.orphan_since > (self.orphan_grace_s if run.orphan_grace_s is None else run.orphan_grace_s):
            run.orphan_since = None
            return self.cancel(run.id)
        return []

    def _drop(self, run: Run, outcome: str, actions: list[RunAction] | None = None) -> list[RunAction]:
        self.runs.pop(run.id, None)
        self.num_finished[outcome] += 1
        self._slot_freed = True
        return actions or []

    def take_slot_freed(self) -> bool:
        """Whether a run left the table (its slot is free) since the last call."""
        freed, self._slot_freed = self._slot_freed, False
        return freed
