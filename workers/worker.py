"""The worker process: claim requests short-first within its free slots, run them on the
engine, stream tokens back, renew leases, honour cancels.

Loops (one task each): claim, heartbeat, control (cancels), publisher. An engine that dies
stops the worker: it stops claiming, hands its leases back to the reaper and exits non-zero
so the process manager restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import msgspec
from redis.exceptions import RedisError

from lanes.queue.messages import (
    Control, DepthSnapshot, Finish, FinishReason, Lane, RequestState, TokenBatch, TokenEvent, Usage, decode,
)
from lanes.queue.plane import Claim, QueuePlane, connect
from lanes.scheduler.policy import SlotConfig, lanes_to_pop
from lanes.telemetry import metrics
from lanes.telemetry.tracing import extract_context, inject_context, tracer
from lanes.workers.engines.base import Engine, EngineBusy, EngineDead, EngineRequest, RequestRejected
from lanes.workers.publisher import Outgoing, Publisher
from lanes.workers.reporting import Reporter, observe_decode
from lanes.workers.settings import WorkerSettings

log = logging.getLogger(__name__)

_ABORT_GRACE_S = 1.0
_BUSY_PAUSE_S = 0.2
_MIN_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0


@dataclass
class Run(Outgoing):
    attempt: int = 0
    lane: Lane = Lane.MEDIUM
    seq: int = 0
    cancelled: bool = False
    task: asyncio.Task[None] | None = None
    completion_tokens: int = 0
    started_at: float = field(default_factory=time.perf_counter)


class Worker:
    def __init__(self, settings: WorkerSettings, plane: QueuePlane, engine: Engine) -> None:
        self.settings = settings
        self.plane = plane
        self.engine = engine
        self.worker_id = settings.worker_id or f"worker-{uuid.uuid4().hex[:10]}"
        self.slots = SlotConfig(
            max_slots=min(settings.max_slots, engine.max_concurrency),
            max_long=settings.max_long_slots, max_medium_long=settings.max_medium_long_slots,
            min_medium=settings.min_medium_slots, min_long=settings.min_long_slots,
            starve_after_ms=settings.starve_after_ms, protect_after_ms=settings.protect_after_ms,
            borrow_when_idle=settings.borrow_when_idle,
        )
        #: Age of each non-empty lane's oldest request, from the scheduler's snapshots.
        self.oldest_wait_ms: dict[Lane, float] = {}
        self.runs: dict[str, Run] = {}
        self.publisher = Publisher(plane, self.worker_id, self._on_stale, on_orphan=self.cancel,
                                   orphan_grace_s=settings.orphan_grace_s)
        self._slot_freed = asyncio.Event()
        self._blocked_on: tuple[Lane, ...] | None = None
        self._blocker_id: int | None = None
        self._stopping = False
        #: Fails with EngineDead when a run finds the engine gone: ``serve`` then stops.
        self._fatal: asyncio.Future[None] = asyncio.get_event_loop().create_future()
        self.num_finished: Counter[str] = Counter()
        self.reporter = Reporter(plane, self.worker_id, settings.heartbeat_s)

    # -- lifecycle ----------------------------------------------------------------------

    async def serve(self, *, burst: bool = False) -> None:
        """Run until cancelled (or, with ``burst``, until the lanes are empty and idle)."""
        await self.engine.start()
        log.info("worker %s ready: engine=%s slots=%s", self.worker_id, self.engine.name, self.slots)
        loops = [
            asyncio.create_task(self.publisher.run(), name="publisher"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._control_loop(), name="control"),
        ]
        claim = asyncio.create_task(self._claim_loop(burst), name="claim")
        try:
            done, _ = await asyncio.wait([claim, self._fatal, *loops], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # re-raise EngineDead and friends
        finally:
            self._stopping = True
            # Close the blocking pop first: a BZPOPMIN still parked in Redis would pop a
            # request we hand back below and drop it with the closing connection.
            claim.cancel()
            await asyncio.gather(claim, return_exceptions=True)
            if not self._fatal.done() and self.runs and self.settings.drain_timeout_s > 0:
                # A stop (deploy, scale-in) lets running answers finish for a while; what is
                # still running then goes back to its lane and continues elsewhere.
                log.info("draining %d running requests (up to %.0f s)", len(self.runs), self.settings.drain_timeout_s)
                await asyncio.wait([r.task for r in self.runs.values() if r.task], timeout=self.settings.drain_timeout_s)
            await self._release_all()
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await self.engine.close()

    async def _release_all(self) -> None:
        """Stop every run; each hands its lease back (``_release``) so the reaper requeues it."""
        runs = list(self.runs.values())
        for run in runs:
            if run.task is not None:
                run.task.cancel()
        await asyncio.gather(*(r.task for r in runs if r.task), return_exceptions=True)
        if runs:
            log.info("released %d leases", len(runs))

    async def _release(self, run: Run) -> None:
        """Put a request we will not finish back in its lane now (else its lease expires)."""
        with contextlib.suppress(RedisError):
            await self.plane.release(run.id, run.attempt)

    # -- claiming -----------------------------------------------------------------------

    def running_by_lane(self) -> dict[Lane, int]:
        return dict(Counter(run.lane for run in self.runs.values()))

    def lanes_now(self) -> tuple[Lane, ...]:
        return lanes_to_pop(self.running_by_lane(), self.oldest_wait_ms, self.slots)

    async def _claim_loop(self, burst: bool) -> None:
        blocker = connect(self.settings.redis_url, single_connection_client=True)
        backoff_s = _MIN_BACKOFF_S
        try:
            self._blocker_id = await self._reconnect_blocker(blocker)
            while not self._stopping:
                lanes = self.lanes_now()
                if not lanes:
                    self._slot_freed.clear()
                    await self._slot_freed.wait()
                    continue
                self._blocked_on = lanes
                try:
                    popped = await self.plane.pop(blocker, lanes, timeout_s=0.5 if burst else 2.0)
                    if popped is None:
                        if burst and not self.runs and await self._lanes_empty():
                            return
                        continue
                    request_id, lane = popped
                    claim = await self.plane.claim(request_id, self.worker_id)
                except RedisError as exc:
                    # Redis restarting or unreachable: back off, keep running requests going.
                    log.warning("claim loop: %s; retrying in %.1f s", exc, backoff_s)
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(backoff_s * 2, _MAX_BACKOFF_S)
                    self._blocker_id = await self._reconnect_blocker(blocker)
                    continue
                finally:
                    self._blocked_on = None
                backoff_s = _MIN_BACKOFF_S
                if claim is not None:
                    self._start(claim, lane)
        finally:
            await blocker.aclose()

    @staticmethod
    async def _reconnect_blocker(blocker: object) -> int | None:
        """The blocking connection's client id (for CLIENT UNBLOCK), or None if Redis is down."""
        try:
            return int(await blocker.client_id())  # type: ignore[attr-defined]
        except RedisError:
            return None

    async def _lanes_empty(self) -> bool:
        pending, _ = await self.plane.lane_depths(0)
        return not any(pending.values())

    def _start(self, claim: Claim, lane: Lane) -> None:
        run = Run(id=claim.payload.id, edge=claim.edge, attempt=claim.attempt, lane=lane)
        self.runs[run.id] = run
        metrics.RUNNING.labels(lane.value).inc()
        run.task = asyncio.create_task(self._execute(run, claim), name=f"run-{run.id}")

    def _slot_released(self) -> None:
        self._slot_freed.set()
        blocked = self._blocked_on
        if blocked is not None and blocked != self.lanes_now():
            # The blocking pop waits on too few lanes now: wake it to re-block on the new set.
            asyncio.get_running_loop().create_task(self._unblock())

    async def _unblock(self) -> None:
        if self._blocker_id is None:
            return
        with contextlib.suppress(RedisError):
            await self.plane.redis.client_unblock(self._blocker_id)

    # -- one request --------------------------------------------------------------------

    async def _execute(self, run: Run, claim: Claim) -> None:
        payload = claim.payload
        parent = extract_context(payload.trace)
        queue_ms = float(claim.claimed_at_ms - claim.enqueued_at_ms)
        attrs = {"lanes.request_id": run.id, "lanes.lane": run.lane.value, "lanes.attempt": run.attempt,
                 "lanes.worker": self.worker_id, "lanes.queue_ms": queue_ms}
        # Set once the request's end is in the stream; only then is it completed. A request
        # interrupted by engine death or shutdown is left to its lease (handed back at exit).
        final_state: RequestState | None = None
        try:
            with tracer().start_as_current_span("lanes.generate", context=parent, attributes=attrs) as span:
                await self.plane.fence(run.id, run.attempt)
                prior = await self.plane.read_stream(run.id)
                if prior and prior[-1].finish is not None:
                    # An earlier attempt finished but died before completing: re-send the end.
                    await self.plane.publish({run.edge: TokenBatch(self.worker_id, (prior[-1],))})
                    final_state = RequestState.DONE
                    return
                run.seq = len(prior)
                resume_ids = tuple(i for e in prior for i in e.token_ids)
                request = EngineRequest(
                    id=run.id, messages=payload.messages, max_tokens=payload.max_tokens,
                    temperature=payload.temperature, top_p=payload.top_p, seed=payload.seed, stop=payload.stop,
                    lane=run.lane, resume_token_ids=resume_ids, trace_headers=inject_context(),
                )
                finish = await self._stream(run, request, queue_ms, len(resume_ids))
                if finish.reason is FinishReason.STOP and self.settings.report_observations:
                    await self.reporter.observation(payload.messages, finish.usage.completion_tokens)
                span.set_attribute("lanes.finish_reason", finish.reason.value)
                span.set_attribute("lanes.completion_tokens", finish.usage.completion_tokens)
                await run.flushed.wait()
                final_state = RequestState.CANCELLED if finish.reason is FinishReason.CANCELLED else RequestState.DONE
        except EngineDead as exc:
            if not self._fatal.done():
                self._fatal.set_exception(exc)
        except EngineBusy as exc:
            # The engine's own queue is full: transient, so no final error. ``finally`` hands
            # the request back to its lane; the pause keeps this slot from re-claiming it at once.
            log.info("engine busy (%s); handing %s back to its lane", exc, run.id)
            await asyncio.sleep(_BUSY_PAUSE_S)
        finally:
            self.runs.pop(run.id, None)
            metrics.RUNNING.labels(run.lane.value).dec()
            self.num_finished[final_state.value if final_state else "interrupted"] += 1
            # Shielded: shutdown may be cancelling this task, and the request must end up
            # either completed or back in its lane.
            if final_state is not None and not run.stale:
                await asyncio.shield(self._complete(run, final_state))
            elif not run.stale:
                await asyncio.shield(self._release(run))
            self._slot_released()

    async def _complete(self, run: Run, state: RequestState) -> None:
        with contextlib.suppress(RedisError):
            await self.plane.complete(run.id, run.attempt, state.value)

    async def _stream(self, run: Run, request: EngineRequest, queue_ms: float, num_prior: int) -> Finish:
        """Run the engine and submit each delta; returns the final event's Finish."""
        prompt_tokens = 0
        first_at: float | None = None
        try:
            async for delta in self.engine.generate(request):
                if run.stale:
                    break
                prompt_tokens = delta.prompt_tokens or prompt_tokens
                run.completion_tokens += len(delta.token_ids)
                if first_at is None and delta.token_ids:
                    first_at = time.perf_counter()
                    metrics.PREFILL.labels(run.lane.value).observe(first_at - run.started_at)
                finish = None
                if delta.finish_reason is not None:
                    finish = Finish(delta.finish_reason,
                                    Usage(prompt_tokens, num_prior + run.completion_tokens), queue_ms=queue_ms)
                self._submit(run, delta.text, delta.token_ids, finish)
                if finish is not None:
                    observe_decode(run.lane.value, first_at, run.completion_tokens)
                    return finish
            reason = FinishReason.CANCELLED if run.cancelled or run.stale else FinishReason.ERROR
            finish = Finish(reason, Usage(prompt_tokens, num_prior + run.completion_tokens), queue_ms=queue_ms,
                            error_code=None if reason is FinishReason.CANCELLED else "engine_error",
                            error_message=None if reason is FinishReason.CANCELLED else "engine ended without finishing")
        except RequestRejected as err:
            metrics.ENGINE_ERRORS.labels(err.code).inc()
            finish = Finish(FinishReason.ERROR, Usage(prompt_tokens, num_prior + run.completion_tokens),
                            queue_ms=queue_ms, error_code=err.code, error_message=str(err))
        except EngineDead:
            metrics.ENGINE_ERRORS.labels("dead").inc()
            raise
        except asyncio.CancelledError:
            if not run.cancelled:
                raise  # worker shutdown: the lease goes back to the reaper
            finish = Finish(FinishReason.CANCELLED, Usage(prompt_tokens, num_prior + run.completion_tokens),
                            queue_ms=queue_ms)
        self._submit(run, "", (), finish)
        return finish

    def _submit(self, run: Run, text: str, token_ids: tuple[int, ...], finish: Finish | None) -> None:
        self.publisher.submit(run, TokenEvent(run.id, run.attempt, run.seq, text, token_ids, finish))
        run.seq += 1
        self.reporter.num_tokens += len(token_ids)
        metrics.TOKENS.labels(run.lane.value).inc(len(token_ids))

    # -- cancels, fencing, leases -------------------------------------------------------

    def cancel(self, request_id: str) -> None:
        run = self.runs.get(request_id)
        if run is None or run.cancelled:
            return
        run.cancelled = True
        loop = asyncio.get_running_loop()
        loop.create_task(self.engine.abort(request_id))
        # Backstop: an engine that does not end the request soon gets its task cancelled.
        loop.call_later(_ABORT_GRACE_S, lambda: run.task and not run.task.done() and run.task.cancel())

    def _observe_depths(self, snapshot: DepthSnapshot) -> None:
        self.oldest_wait_ms = {Lane(lane): float(snapshot.oldest_wait_ms.get(lane, 0))
                               for lane, n in snapshot.pending.items() if n > 0}

    def _on_stale(self, request_id: str) -> None:
        """A newer attempt owns this request (our lease expired): stop without completing."""
        run = self.runs.get(request_id)
        if run is not None:
            run.stale = True
            run.flushed.set()
            log.warning("request %s attempt %d is stale; aborting", request_id, run.attempt)
            asyncio.get_running_loop().create_task(self.engine.abort(request_id))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            runs = [(r.id, r.attempt) for r in self.runs.values() if not r.stale]
            try:
                statuses = await self.plane.heartbeat(runs)
                for (request_id, _), (status, edge) in zip(runs, statuses):
                    run = self.runs.get(request_id)
                    if run is None:
                        continue
                    if edge:
                        run.edge = edge  # re-pointed by a resume on another edge
                    if status == "cancelled":
                        self.cancel(request_id)
                    elif status == "lost":
                        self._on_stale(request_id)
                await self.reporter.report({k.value: v for k, v in self.running_by_lane().items()},
                                           self.slots.max_slots, dict(self.num_finished), self.engine.stats())
            except RedisError as exc:
                log.warning("heartbeat failed: %s", exc)

    async def _control_loop(self) -> None:
        """Cancels on our control channel; depth snapshots (for anti-starvation) beside them."""
        channel = self.plane.keys.control_channel(self.worker_id)
        depth_channel = self.plane.keys.depth_channel
        while True:
            pubsub = self.plane.redis.pubsub()
            try:
                await pubsub.subscribe(channel, depth_channel)
                async for message in pubsub.listen():
                    if message["type"] != "message":
                        continue
                    try:
                        if message["channel"].decode() == depth_channel:
                            self._observe_depths(decode(message["data"], DepthSnapshot))
                        else:
                            self.cancel(decode(message["data"], Control).id)
                    except msgspec.DecodeError:
                        log.warning("ignoring malformed message on %s", message["channel"])
            except RedisError as exc:
                log.warning("control channel lost (%s); resubscribing", exc)
                await asyncio.sleep(0.2)
            finally:
                await pubsub.aclose()
