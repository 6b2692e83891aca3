"""The worker process: claim requests short-first within its free slots, run them on the
engine, stream tokens back, renew leases, honour cancels.

Every claimed request's state lives in the run table (``runs.py``, sans-I/O); this module is
the shell that feeds it and carries out its actions. Loops: claim, publish, heartbeat, control.
An engine that dies stops the worker: it stops claiming, hands its requests back to their
lanes and exits non-zero so the process manager restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Coroutine, Mapping
from typing import Any

import msgspec
from lanes.queue.backoff import Backoff
from lanes.queue.connection import raise_if_cancelled
from lanes.queue.errors import CLIENT_FAULTS, ErrorCode, QueueUnavailable
from lanes.queue.messages import (
    Control,
    DepthSnapshot,
    Finish,
    FinishReason,
    Lane,
    RequestPayload,
    RequestState,
    TokenBatch,
    TokenEvent,
    Usage,
    decode,
)
from lanes.queue.plane import Claim, MalformedRequest, QueuePlane
from lanes.queue.pubsub import listen
from lanes.scheduler.live_policy import DEFAULT_PREEMPTION, make_live_policy
from lanes.scheduler.policy import (
    LaneThresholds,
    effective_lane,
    lane_bound_tokens,
    lanes_never_served,
    lanes_to_pop,
    prefill_heavy,
)
from lanes.scheduler.preemption import (
    NEVER_MS,
    ReprefillBudget,
    RunView,
    choose_preemption,
    requeue_lane,
)
from lanes.scheduler.workmix import WorkMix
from lanes.telemetry import metrics
from lanes.telemetry.tracing import extract_context, inject_context, tracer
from lanes.workers.engines.base import (
    Engine,
    EngineBusy,
    EngineDead,
    EngineRequest,
    RequestRejected,
    is_out_of_memory,
)
from lanes.workers.publisher import flush
from lanes.workers.reporting import Reporter, observe_decode
from lanes.workers.runs import AbortEngine, Complete, Release, Run, RunAction, RunTable
from lanes.workers.settings import WorkerSettings
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

log = logging.getLogger(__name__)

#: At a stop, how long ended runs may wait for their last events to be flushed (s).
_FLUSH_AT_STOP_S = 5.0
#: After the engine said it is busy, how long this slot waits before claiming again (s).
_BUSY_PAUSE_S = 0.2
#: How long one blocking pop waits for a request (s); a burst worker's shorter one lets it
#: see sooner that the lanes are empty.
_POP_S = 2.0
_BURST_POP_S = 0.5


class Worker:
    def __init__(self, settings: WorkerSettings, plane: QueuePlane, engine: Engine) -> None:
        self.settings = settings
        self.plane = plane.for_pool(settings.pool)  # this worker's lanes and requests
        self.engine = engine
        self.worker_id = settings.worker_id or f"worker-{uuid.uuid4().hex[:10]}"
        #: ``LANES_POLICY``: which lanes to pop (slots), demotion and preemption.
        self.policy = make_live_policy(settings.policy, LaneThresholds(), settings.slots(engine.max_concurrency),
                                       preemption=settings.preemption())
        self.slots = self.policy.slots
        if never := lanes_never_served(self.slots):  # a short-only worker, or a mistake: say which
            log.warning("this worker does not serve the %s lane on decode-heavy traffic (a cap of 0 slots, no "
                        "LANES_MIN_*_SLOTS share, LANES_MAX_WAIT_MS=0; it serves every lane while prompts are "
                        "LANES_FCFS_ABOVE_PREFILL_SHARE of its work): such requests wait for another worker of the "
                        "pool", " and ".join(lane.value for lane in never))
        self._last_preemption_ms = NEVER_MS
        #: Hand-backs' re-prefill budget, earned from ``reporter.num_tokens``.
        self._reprefill_budget = ReprefillBudget.full(self.policy.preemption or DEFAULT_PREEMPTION)
        self.table = RunTable(orphan_grace_s=settings.orphan_grace_s)
        #: Age of each non-empty lane's oldest request, from the scheduler's snapshots.
        self.oldest_wait_ms: dict[Lane, float] = {}
        #: Requests waiting per lane (non-empty lanes), from the same snapshot.
        self.waiting: dict[Lane, int] = {}
        #: Prompt and output tokens of the last finished requests: their prefill share of the
        #: engine's work decides whether lanes reorder at all (``lanes_now``).
        self.work_mix = WorkMix(max_key_share=settings.prefill_share_max_key_share)
        self.reporter = Reporter(plane, self.worker_id, settings.heartbeat_s, settings.pool)
        #: Per-lane token counters, looked up once (a ``labels()`` call per token costs ~1.5 us).
        self._token_counters = {lane: metrics.TOKENS.labels(lane.value) for lane in Lane}
        #: ``lanes_worker_running`` per lane, every lane exported from the start (0, not "no data").
        self._running_gauges = {lane: metrics.RUNNING.labels(lane.value) for lane in Lane}
        self._export_running()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._pending: set[asyncio.Task[None]] = set()
        self._flush_wanted = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._blocked_on: tuple[Lane, ...] | None = None
        self._blocker_id: int | None = None
        #: Fails with EngineDead when a run finds the engine gone: ``serve`` then stops.
        self._fatal: asyncio.Future[None] = asyncio.get_event_loop().create_future()
        #: The worker stops: a run cancelled now is handed back by the stop (its span says so).
        self._stopping = False

    # -- lifecycle ----------------------------------------------------------------------

    async def serve(self, *, burst: bool = False) -> None:
        """Run until cancelled (or, with ``burst``, until the lanes are empty and idle)."""
        try:
            await self._start_engine()
            metrics.WORKER_INFO.info({"worker": self.worker_id, "pool": self.settings.pool,
                                      "engine": self.engine.name})
            await self._report()  # registered only now: a worker is listed once its engine is warm
            log.info("worker %s ready: pool=%s engine=%s slots=%s", self.worker_id, self.settings.pool,
                     self.engine.name, self.slots)
            async with asyncio.TaskGroup() as group:
                background = [group.create_task(loop) for loop in
                              (self._publish_loop(), self._heartbeat_loop(), self._control_loop())]
                claim = group.create_task(self._claim_loop(burst))
                try:
                    await asyncio.wait([claim, self._fatal], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    # Close the blocking pop first: a BZPOPMIN still parked in Redis would pop a
                    # request we hand back below and drop it with the closing connection.
                    claim.cancel()
                    await asyncio.gather(claim, return_exceptions=True)
                    await self._report_draining()
                    await self._stop_runs()
                    for task in background:
                        task.cancel()
            if self._fatal.done():
                self._fatal.result()  # re-raise EngineDead
        finally:
            await self._deregister()
            await self.engine.close()

    async def _start_engine(self) -> None:
        """``engine.start()``, which a stop does not cut short. Engines load their model in a
        thread, which a cancel cannot stop: a SIGTERM or Ctrl-C while the model loaded left
        that thread to start the engine's batching thread after the process had stopped, and
        the process never exited (it waited for that thread at interpreter exit). A stop now
        waits for the start to end (the stop watchdog bounds the wait; a second signal exits at
        once), and ``serve`` closes the engine."""
        starting = asyncio.ensure_future(self.engine.start())
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            if not starting.done():
                log.info("stopping: letting the engine finish starting, then closing it")
                with contextlib.suppress(Exception):  # its failure no longer matters
                    await starting
            raise

    async def _report_draining(self) -> None:
        """Say at once that this worker claims nothing more: the pool stops counting it, so once
        no other worker serves the pool, edges refuse its chats instead of queueing them."""
        self.reporter.draining = True
        with contextlib.suppress(QueueUnavailable):  # the registry then forgets it when its reports stop
            await self._report()

    async def _deregister(self) -> None:
        with contextlib.suppress(QueueUnavailable):
            await self.plane.fleet.deregister(self.worker_id)

    async def _stop_runs(self) -> None:
        """Drain (a stop lets running answers finish for a while), then hand back the rest."""
        self._stopping = True
        tasks = list(self._tasks.values())
        if tasks and not self._fatal.done() and self.settings.drain_timeout_s > 0:
            log.info("draining %d running requests (up to %.0f s)", len(tasks), self.settings.drain_timeout_s)
            await asyncio.wait(tasks, timeout=self.settings.drain_timeout_s)
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Ended runs complete once the publish loop has flushed their end (still running now).
        deadline = time.monotonic() + _FLUSH_AT_STOP_S
        while self.table.runs and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.gather(*self._pending, return_exceptions=True)  # completes and releases in flight
        if tasks:
            log.info("released %d requests back to their lanes", len(tasks))
            with contextlib.suppress(QueueUnavailable):
                if await self.plane.fleet.num_workers(self.settings.pool) == 0:
                    # They continue only once a worker of this pool starts (the scheduler fails
                    # them after LANES_NO_WORKER_TIMEOUT_S otherwise): say so where it is decided.
                    log.warning("this was the last worker of pool %r: the %d requests handed back wait for a "
                                "new one (LANES_NO_WORKER_TIMEOUT_S; a longer LANES_DRAIN_TIMEOUT_S lets them "
                                "finish here)", self.settings.pool, len(tasks))

    # -- carrying out the run table's actions --------------------------------------------

    def carry(self, actions: list[RunAction]) -> None:
        loop = asyncio.get_running_loop()
        for action in actions:
            if isinstance(action, AbortEngine):
                self._spawn(self.engine.abort(action.request_id))
                if action.cancel_task_after_s is not None:
                    # Backstop: an engine that does not end the request soon gets its task cancelled.
                    task = self._tasks.get(action.request_id)
                    if task is not None:
                        loop.call_later(action.cancel_task_after_s, task.cancel)
            else:
                self._spawn(self._finish_in_redis(action))
        # A run that left the table freed its slot, whether or not it left an action (a stale
        # run is dropped silently): the claim loop may pop again.
        if self.table.take_slot_freed() or actions:
            self._lanes_changed()

    async def _finish_in_redis(self, action: Complete | Release) -> None:
        try:
            if isinstance(action, Complete):
                await self.plane.complete(action.request_id, action.attempt, action.state.value)
            else:
                await self.plane.release(action.request_id, action.attempt, action.lane, action.preempted)
        except QueueUnavailable as exc:
            # The lease then runs out and the reaper requeues it; a retry re-sends a finished end.
            log.warning("could not %s %s: %s", type(action).__name__.lower(), action.request_id, exc)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    # -- claiming -----------------------------------------------------------------------

    def running_by_lane(self) -> dict[Lane, int]:
        """Running requests per lane they count against (demoted ones against a later lane)."""
        return self.policy.running_by_lane(self.table.lanes_and_progress())

    def _export_running(self, running: Mapping[Lane, int] | None = None) -> None:
        """``lanes_worker_running{lane}``: running requests per lane they count against, as the
        heartbeat reports them (the dashboard's slots per worker, the scheduler's
        ``lanes_lane_running``). It counted each run under its claimed lane for good, so a
        demoted run showed as short in Grafana and as long on the dashboard. ``running``: those
        counts where the caller has them already."""
        running = self.running_by_lane() if running is None else running
        for lane, gauge in self._running_gauges.items():
            gauge.set(running.get(lane, 0))

    def lanes_now(self) -> tuple[Lane, ...]:
        return lanes_to_pop(self.running_by_lane(), self.oldest_wait_ms, self.slots, self.prefill_share())

    def prefill_share(self) -> float:
        """Estimated share of this worker's engine time spent on prefill (``workmix``)."""
        return self.work_mix.prefill_share(self.settings.decode_token_cost)

    async def _claim_loop(self, burst: bool) -> None:
        block_s = _BURST_POP_S if burst else _POP_S
        blocker = self.plane.blocking_client(block_s)
        backoff = Backoff("claim loop", log)
        try:
            while True:
                raise_if_cancelled()  # after a claim has started (a stop then drains it)
                lanes = self.lanes_now()
                if not lanes:
                    self._slot_freed.clear()
                    await self._slot_freed.wait()
                    continue
                self._blocked_on = lanes
                try:
                    if self._blocker_id is None:
                        self._blocker_id = await self.plane.client_id(blocker)
                    popped = await self.plane.pop(blocker, lanes, timeout_s=block_s)
                    # Redis answered, empty-handed or not: an outage ends here. (Counted from the
                    # next claim only, a restart with no traffic after it was logged as an
                    # outage lasting until the next request: "recovered after 149.3 s".)
                    backoff.succeeded()
                    if popped is None:
                        if burst and not self.table.runs and await self._lanes_empty():
                            return
                        continue
                    claim = await self.plane.claim(popped[0], self.worker_id)
                except MalformedRequest as bad:
                    # One bad record fails one request: before, it killed this worker, and each
                    # worker that claimed it after the reaper put it back (a crash loop).
                    self._spawn(self._quarantine(bad))
                    continue
                except QueueUnavailable as exc:
                    # Redis restarting or unreachable: back off, keep running requests going.
                    self._blocker_id = None
                    await asyncio.sleep(backoff.failed(exc))
                    continue
                finally:
                    self._blocked_on = None
                backoff.succeeded()
                if claim is not None:
                    self._start(claim, popped[1])
        finally:
            await blocker.aclose()

    async def _quarantine(self, bad: MalformedRequest) -> None:
        log.error("request %s failed without running: its record in Redis is malformed (%s); written by "
                  "something other than this lanes version?", bad.request_id, bad.reason)
        # Until Redis answers (about 90 s of tries): once out of the lanes and the watch, nothing
        # else would end it at its edge. Not quarantined yet, it stays in the watch, and the next
        # claim after the reaper's requeue finds it malformed again.
        backoff = Backoff(f"failing malformed request {bad.request_id}", log, min_s=0.5, max_s=5.0)
        quarantined: tuple[str, int] | None = None
        for _ in range(20):
            try:
                if quarantined is None:
                    quarantined = await self.plane.quarantine(bad.request_id)
                await self.plane.end_with_error(bad.request_id, *quarantined, ErrorCode.MALFORMED_REQUEST,
                                                f"the request's record in Redis is malformed ({bad.reason}); it was "
                                                "not run", sender=self.worker_id)
                backoff.succeeded()
                return
            except QueueUnavailable as exc:
                await asyncio.sleep(backoff.failed(exc))
        log.error("gave up failing malformed request %s: Redis did not answer; its client gets no end frame "
                  "(it may resume to find the request failed)", bad.request_id)

    async def _lanes_empty(self) -> bool:
        pending, _ = await self.plane.lane_depths(0)
        return not any(pending.values())

    def _orphan_grace_s(self, payload: RequestPayload) -> float:
        """How long a run may go without a listening edge: ``LANES_ORPHAN_GRACE_S``, or longer
        when its edge lets clients resume longer (they resume on another edge, which this worker
        learns at its next heartbeat). Before, a resume grace above 15 s did not hold once the
        client's edge had died: the worker cancelled the answer at 15 s."""
        return max(self.settings.orphan_grace_s, payload.resume_grace_s + 2 * self.settings.heartbeat_s + 1.0)

    def _start(self, claim: Claim, lane: Lane) -> None:
        payload = claim.payload
        if payload.id in self.table.runs:
            # Our own earlier attempt lost its lease (Redis answered nobody for longer than a
            # lease: a cluster failover, a paused server) and the reaper handed the request back,
            # to us: that attempt must end before this one starts (one engine request per id).
            self._spawn(self._restart(claim, lane))
            return
        run = self.table.start(payload.id, claim.edge, claim.attempt, lane, max_tokens=payload.max_tokens,
                               predicted_tokens=payload.predicted_tokens, times_preempted=claim.times_preempted,
                               now_ms=time.monotonic() * 1000, orphan_grace_s=self._orphan_grace_s(payload))
        self._tasks[run.id] = asyncio.create_task(self._execute(run, claim), name=f"run-{run.id}")
        self._export_running()

    async def _restart(self, claim: Claim, lane: Lane) -> None:
        request_id = claim.payload.id
        previous = self._tasks.get(request_id)
        self.carry(self.table.heartbeat({request_id: ("lost", "")}))  # stale: aborted, dropped when its task ends
        if previous is not None:
            await asyncio.wait({previous})
        self._start(claim, lane)

    def _lanes_changed(self) -> None:
        """A slot freed or a run was demoted: the lanes this worker may pop may differ now."""
        self._slot_freed.set()
        blocked = self._blocked_on
        if blocked is not None and blocked != self.lanes_now() and self._blocker_id is not None:
            # The blocking pop waits on too few lanes now: wake it to re-block on the new set.
            self._spawn(self._unblock(self._blocker_id))

    async def _unblock(self, client_id: int) -> None:
        with contextlib.suppress(QueueUnavailable):
            await self.plane.unblock(client_id)

    # -- one request --------------------------------------------------------------------

    async def _execute(self, run: Run, claim: Claim) -> None:
        payload = claim.payload
        queue_ms = claim.queue_ms
        attrs = {"lanes.request_id": run.id, "lanes.lane": run.lane.value, "lanes.attempt": run.attempt,
                 "lanes.worker": self.worker_id, "lanes.queue_ms": claim.attempt_wait_ms,
                 "lanes.pool": self.settings.pool}
        # Set once the request's end is submitted; a request interrupted by engine death,
        # Redis or shutdown is handed back to its lane instead.
        final: RequestState | None = None
        #: Why a run that ends without an end goes back to its lane (said on its span).
        handed_back_because = "unexpected_error"
        # Ended in ``finally``, not by the ``with``: a run handed back (a stop cancels its task)
        # gets its outcome there; the span ended with none.
        span = tracer().start_span("lanes.generate", context=extract_context(payload.trace), attributes=attrs,
                                   kind=SpanKind.CONSUMER)
        try:
            with trace.use_span(span, end_on_exit=False):
                prior: list[TokenEvent] = []
                if run.attempt > 1:
                    # An earlier attempt may still be writing (fence it off) and may have streamed
                    # tokens (resume after them). A first attempt has neither: two round trips
                    # fewer before the first token.
                    await self.plane.fence(run.id, run.attempt)
                    prior = await self.plane.read_stream(run.id)
                if prior and prior[-1].finish is not None:
                    # An earlier attempt finished but died before completing: re-send the end.
                    await self.plane.publish({run.edge: TokenBatch(self.worker_id, (prior[-1],))})
                    self.table.end_already_streamed(run.id)
                    span.set_attribute("lanes.outcome", _outcome(prior[-1].finish))
                    final = RequestState.DONE
                    return
                run.seq = len(prior)
                resume_ids = tuple(i for e in prior for i in e.token_ids)
                run.prior_tokens = len(resume_ids)
                self._set_demotion_bound(run)
                request = EngineRequest(
                    id=run.id, messages=payload.messages, max_tokens=payload.max_tokens,
                    temperature=payload.temperature, top_p=payload.top_p, seed=payload.seed, stop=payload.stop,
                    lane=run.lane, resume_token_ids=resume_ids, trace_headers=inject_context(),
                )
                finish = await self._stream(run, request, queue_ms)
                if finish is None:  # preempted: handed back, resumes later after its tokens
                    handed_back_because = "preempted"
                    return
                outcome = _outcome(finish)
                if finish.reason is FinishReason.ERROR:
                    code = outcome  # the error code
                    span.set_attribute("lanes.error_code", code)
                    if code not in CLIENT_FAULTS:  # a prompt too long for the model is the client's doing
                        span.set_status(Status(StatusCode.ERROR, code))
                if finish.reason in (FinishReason.STOP, FinishReason.LENGTH):
                    self.work_mix.observe(finish.usage.prompt_tokens, finish.usage.completion_tokens, claim.owner)
                if finish.reason is FinishReason.STOP and self.settings.report_observations:
                    await self.reporter.observation(payload.messages, finish.usage.completion_tokens, claim.owner)
                span.set_attribute("lanes.outcome", outcome)
                span.set_attribute("lanes.finish_reason", finish.reason.value)
                span.set_attribute("lanes.completion_tokens", finish.usage.completion_tokens)
                span.set_attribute("lanes.prompt_tokens", finish.usage.prompt_tokens)
                final = RequestState.CANCELLED if finish.reason is FinishReason.CANCELLED else RequestState.DONE
        except EngineDead as exc:
            handed_back_because = "engine_dead"
            if not self._fatal.done():
                self._fatal.set_exception(exc)
        except EngineBusy as exc:
            # The engine's own queue is full: transient, so no final error. ``finally`` hands
            # the request back to its lane; the pause keeps this slot from re-claiming it at once.
            handed_back_because = "engine_busy"
            log.info("engine busy (%s); handing %s back to its lane", exc, run.id)
            await asyncio.sleep(_BUSY_PAUSE_S)
        except QueueUnavailable as exc:
            handed_back_because = "redis_unavailable"
            log.warning("request %s: Redis unavailable before it started (%s); handing it back", run.id, exc)
        except asyncio.CancelledError:  # the worker's stop (past its drain), or a cancel's backstop
            handed_back_because = "worker_stopping" if self._stopping else "task_cancelled"
            raise
        finally:
            if final is None:
                span.add_event("lanes.handed_back", {"lanes.completion_tokens": run.completion_tokens})
                span.set_attribute("lanes.outcome", "superseded" if run.stale else "handed_back")
                span.set_attribute("lanes.handed_back_because", handed_back_because)
            span.end()
            self._tasks.pop(run.id, None)
            # The request must end up either completed or back in its lane; shutdown waits for
            # these (``_stop_runs``) even though it is cancelling this task.
            self.carry(self.table.ended(run.id, final))
            self._export_running()

    async def _stream(self, run: Run, request: EngineRequest, queue_ms: float) -> Finish | None:
        """Run the engine and submit each delta; returns the final event's Finish (None when
        the run is being handed back: nothing more is submitted for this attempt)."""
        started_at = time.perf_counter()
        first_at: float | None = None

        def usage() -> Usage:
            return Usage(run.prompt_tokens, run.prior_tokens + run.completion_tokens)

        try:
            async for delta in self.engine.generate(request):
                if run.preempt_to is not None:
                    return None
                if run.stale:
                    break
                run.prompt_tokens = delta.prompt_tokens or run.prompt_tokens
                if first_at is None and delta.token_ids:
                    first_at = time.perf_counter()
                    metrics.PREFILL.labels(run.lane.value).observe(first_at - started_at)
                    trace.get_current_span().add_event("lanes.first_token", {
                        "lanes.prefill_ms": round((first_at - started_at) * 1000, 3),
                        "lanes.prompt_tokens": delta.prompt_tokens})
                if delta.finish_reason is not None:
                    total = Usage(run.prompt_tokens, run.prior_tokens + run.completion_tokens + len(delta.token_ids))
                    finish = Finish(delta.finish_reason, total, queue_ms=queue_ms)
                    self._submit(run, delta.text, delta.token_ids, finish)
                    observe_decode(run.lane.value, first_at, run.completion_tokens)
                    return finish
                self._submit(run, delta.text, delta.token_ids, None)
            reason = self.table.finish_reason_if_stopped(run.id)
            finish = Finish(reason, usage(), queue_ms=queue_ms,
                            error_code=None if reason is FinishReason.CANCELLED else ErrorCode.ENGINE_ERROR,
                            error_message=None if reason is FinishReason.CANCELLED else "engine ended without finishing")
        except RequestRejected as err:
            metrics.ENGINE_ERRORS.labels(err.code).inc()
            finish = Finish(FinishReason.ERROR, usage(), queue_ms=queue_ms, error_code=err.code, error_message=str(err))
        except EngineDead:
            metrics.ENGINE_ERRORS.labels("dead").inc()
            raise
        except EngineBusy:
            raise  # transient: ``_execute`` hands the request back
        except asyncio.CancelledError:
            if not run.cancelled or run.preempt_to is not None:
                raise  # worker shutdown or a preemption: the request goes back to a lane
            finish = Finish(FinishReason.CANCELLED, usage(), queue_ms=queue_ms)
        except Exception as exc:  # any other engine failure ends this request, once
            # Handed back instead, it would be claimed again at once and fail again: a hot loop
            # that no attempt cap stops (only lease expiries count attempts).
            kind = "oom" if is_out_of_memory(exc) else getattr(exc, "code", "engine_error")
            metrics.ENGINE_ERRORS.labels(kind).inc()
            log.exception("engine failed on %s (attempt %d)", run.id, run.attempt)
            finish = Finish(FinishReason.ERROR, usage(), queue_ms=queue_ms,
                            error_code=ErrorCode.OOM if kind == "oom" else ErrorCode.ENGINE_ERROR,  # hf's RequestRejected too
                            error_message=f"the engine failed on this request ({type(exc).__name__})")
        self._submit(run, "", (), finish)
        return finish

    def _submit(self, run: Run, text: str, token_ids: tuple[int, ...], finish: Finish | None) -> None:
        self.table.submit(run.id, text, token_ids, finish)
        self._flush_wanted.set()
        if token_ids:
            self.reporter.num_tokens += len(token_ids)
            self._token_counters[run.lane].inc(len(token_ids))
            if run.prior_tokens + run.completion_tokens > run.demote_above:
                self._set_demotion_bound(run)
                self._lanes_changed()  # demoted: it now counts against a later lane

    def _set_demotion_bound(self, run: Run) -> None:
        """The most tokens ``run`` may generate and still count against its current lane."""
        demotion = self.policy.demotion
        if demotion is not None:
            lane = effective_lane(run.lane, run.prior_tokens + run.completion_tokens, demotion)
            run.demote_above = lane_bound_tokens(lane, demotion)

    # -- loops ----------------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        """One flush per wake-up: events submitted while a flush is in flight wait for the next
        one, so batching adds no delay when Redis is idle and grows when it is busy."""
        backoff = Backoff("publish", log)
        while True:
            raise_if_cancelled()
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            batch = self.table.take_outbox()
            if not batch:
                continue
            # Every request on the engine, not those with output in this flush: a flush can
            # catch one step half-submitted (1 request, then the other 7 in the next). A run
            # whose task has just ended is still in this step's batch (its final events are
            # here): counted by id, so a last step is not sampled as a batch of 0.
            metrics.BATCH_SIZE.observe(len(self._tasks.keys() | {run.id for run, _ in batch}))
            try:
                result = await flush(self.plane, self.worker_id, batch)
            except QueueUnavailable as exc:
                self.table.retry(batch)
                self._flush_wanted.set()
                await asyncio.sleep(backoff.failed(exc))
                continue
            backoff.succeeded()
            self.carry(self.table.flushed(batch, result, time.monotonic()))

    async def _heartbeat_loop(self) -> None:
        # Through an outage it tries at its own pace, one heartbeat apart, without backing off:
        # once Redis answers again, the leases and this worker's registration must be renewed
        # within a heartbeat. A hang longer than the registration (5 s) empties the registry, and
        # every edge refuses every chat (``no_workers``) until the worker reports again; backed off
        # like a retry loop (up to 2 s more), that went on for up to 2.3 s after Redis was back,
        # and leases that could have been renewed ran out. One command per heartbeat is this
        # loop's load anyway.
        heartbeat_s = self.settings.heartbeat_s
        backoff = Backoff("heartbeat", log, min_s=heartbeat_s, max_s=heartbeat_s)
        while True:
            raise_if_cancelled()
            await asyncio.sleep(heartbeat_s)
            leases = self.table.leases()
            try:
                answers = await self.plane.heartbeat(leases)
                self.carry(self.table.heartbeat({rid: answer for (rid, _), answer in zip(leases, answers)}))
                await self._maybe_preempt(time.monotonic() * 1000)
                await self._report()
            except QueueUnavailable as exc:
                backoff.failed(exc)  # one warning per outage; the sleep above paces the retries
                continue
            backoff.succeeded()

    async def _maybe_preempt(self, now_ms: float) -> None:
        """Hand one request back when a lane has waited past the bound and no free slot may pop
        it (``scheduler/preemption.py``: bounded per request, never near its end). Never while
        prompts dominate the engine's work (``policy.prefill_heavy``: the lanes step aside)."""
        config = self.policy.preemption
        if config is None or prefill_heavy(self.prefill_share(), self.slots):
            return
        if any(lane in self.oldest_wait_ms for lane in self.lanes_now()):
            return
        views = {r.id: RunView(r.id, r.lane, r.prompt_tokens, r.prior_tokens + r.completion_tokens, r.max_tokens,
                               r.predicted_tokens, r.times_preempted, r.started_at_ms)
                 for r in self.table.runs.values() if not (r.ended or r.cancelled or r.stale)}
        victim = choose_preemption(list(views.values()), self.oldest_wait_ms, now_ms, self._last_preemption_ms, config,
                                   self._reprefill_budget.earn(self.reporter.num_tokens, config))
        if victim is None:
            return
        # Every worker of the pool decides from the same snapshot: one waiting request must not
        # make each of them hand a run back. At most as many hand-backs as requests wait past the
        # bound, per window, fleet-wide.
        starving = sum(self.waiting.get(lane, 0) for lane, waited in self.oldest_wait_ms.items()
                       if waited >= config.wait_bound_ms)
        if not await self.plane.grant_preemption(starving):
            return
        lane = requeue_lane(views[victim], config)
        log.info("handing %s back to the %s lane: a lane waited past %g s", victim, lane.value,
                 config.wait_bound_ms / 1000)
        self._last_preemption_ms = now_ms
        self._reprefill_budget.spend(views[victim], config)
        metrics.PREEMPTIONS.labels(views[victim].lane.value).inc()
        self.carry(self.table.preempt(victim, lane))

    async def _report(self) -> None:
        by_lane = self.running_by_lane()
        running = {lane.value: n for lane, n in by_lane.items()}
        self._export_running(by_lane)  # a demotion moves a run to a later lane between starts and ends
        metrics.PREFILL_SHARE.set(self.prefill_share())
        await self.reporter.report(running, self.slots.max_slots, dict(self.table.num_finished), self.engine.stats())

    async def _control_loop(self) -> None:
        """Cancels on our control channel; depth snapshots (for anti-starvation) beside them."""
        keys = self.plane.keys
        depth_channel = keys.depth_channel.encode()
        backoff = Backoff("control channel", log)
        async for channel, data in listen(self.plane.redis, [keys.control_channel(self.worker_id), keys.depth_channel],
                                          backoff, dead_after_s=self.plane.settings.redis_dead_after_s):
            try:
                if channel == depth_channel:
                    snapshot = decode(data, DepthSnapshot)
                    if snapshot.pool != self.settings.pool:
                        continue
                    self.oldest_wait_ms = {Lane(lane): float(snapshot.oldest_wait_ms.get(lane, 0))
                                           for lane, n in snapshot.pending.items() if n > 0}
                    self.waiting = {Lane(lane): n for lane, n in snapshot.pending.items() if n > 0}
                else:
                    self.carry(self.table.cancel(decode(data, Control).id))
            except (msgspec.DecodeError, ValueError):
                log.warning("ignoring a malformed message on %s", channel.decode(errors="replace"))


def _outcome(finish: Finish) -> str:
    """A ``lanes.generate`` span's outcome: the finish reason, or the error code of an error."""
    if finish.reason is FinishReason.ERROR:
        return str(finish.error_code or ErrorCode.ENGINE_ERROR)
    return finish.reason.value
