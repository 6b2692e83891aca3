"""The WebSocket edge: the shell around the delivery core (``delivery.py``).

It reads sockets and Redis and carries the core's actions out: frames go to per-connection
bounded queues (``session.py``), stream reads, cancels, re-points and checks go to Redis. It
also runs what happens before a chat is registered with the core: limits, the length
prediction, the lane and admission, then the enqueue.

The edge subscribes to ``lanes:edge:<edge_id>`` before it accepts connections, so no first
token can race a late subscription.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import msgspec
from lanes.queue.backoff import Backoff
from lanes.queue.connection import raise_if_cancelled
from lanes.queue.errors import ErrorCode, QueueUnavailable, refusal_cause
from lanes.queue.keys import DEFAULT_POOL
from lanes.queue.messages import (
    TokenBatch,
)
from lanes.queue.plane import QueuePlane
from lanes.queue.pubsub import listen
from lanes.scheduler.live_policy import make_live_policy
from lanes.scheduler.policy import LaneThresholds, SlotConfig
from lanes.scheduler.predictor import LengthPredictor, release_freed_memory
from lanes.scheduler.refresh import UnusableWeights, load_published
from lanes.telemetry import metrics
from lanes.ws_server import delivery, protocol
from lanes.ws_server.admission import EdgeAdmission
from lanes.ws_server.asgi import EdgeApp, listen_socket, serve_app
from lanes.ws_server.auth import Gate, Identity, Refusal, ticket_param
from lanes.ws_server.cancels import PendingCancels
from lanes.ws_server.completions import COMPLETIONS_PATH, MODELS_PATH
from lanes.ws_server.delivery import Delivery
from lanes.ws_server.intake import NO_WORKER_RETRY_MS, admit_and_enqueue, known_pools
from lanes.ws_server.keyguard import KeyGuard
from lanes.ws_server.lengths import LengthEstimator
from lanes.ws_server.routing import PoolRouter
from lanes.ws_server.session import KEY_REVOKED_CLOSE_CODE, Session
from lanes.ws_server.settings import EdgeSettings
from lanes.ws_server.spans import RESUME, RequestSpans, use
from lanes.ws_server.stats import EdgeStats, StatsRelay, ship_windows
from starlette.datastructures import Headers

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat"
_batch_decoder = msgspec.json.Decoder(TokenBatch)
#: How often the delivery core's timers are checked (s).
_TICK_S = 0.25


class Edge:
    def __init__(self, settings: EdgeSettings, plane: QueuePlane, lengths: LengthEstimator | None = None) -> None:
        self.settings = settings
        self.plane = plane
        #: The edge's name: ``LANES_EDGE_ID``, kept across restarts (``/healthz``, its statistics).
        self.name = settings.edge_id or f"edge-{uuid.uuid4().hex[:10]}"
        #: Its id in Redis (where its requests' tokens go), new at every start. A request of a
        #: previous run's connection, whose grace timer died with that run, then has nobody on
        #: its channel, and its worker cancels it when its resume grace runs out; under the name
        #: alone the restarted edge listened on that channel, so the worker ran it to the end for
        #: nobody. A resume re-points it here as from any other edge.
        self.edge_id = f"{self.name}.{uuid.uuid4().hex[:6]}" if settings.edge_id else self.name
        self.limits = settings.limits()
        #: ``LANES_POLICY``: ``lanes`` routes by predicted length, ``fcfs`` puts everything in one lane.
        self.route_by(LaneThresholds(settings.short_max_tokens, settings.medium_max_tokens))
        self.lengths = lengths or LengthEstimator()
        self.predictor_version = 0
        self.admission = EdgeAdmission(settings)
        self.router = PoolRouter(settings)
        #: The pool of each request this edge enqueued or resumed (forgotten with its end).
        self._pool_of: dict[str, str] = {}
        self.core = Delivery(self.edge_id, settings.delivery())
        #: Each request's ``lanes.request`` span, from its frame to its end on this edge.
        self.spans = RequestSpans(self.edge_id)
        metrics.IN_FLIGHT.set_function(lambda: len(self.core.entries))  # read at each scrape
        self.sessions: dict[int, Session] = {}
        #: The identity each open WebSocket and HTTP exchange authenticated as (checked again:
        #: ``recheck_keys``).
        self._identity: dict[int, Identity] = {}
        self.shutting_down = False
        self.chat_path = CHAT_PATH
        self.gate = Gate(settings, plane, frozenset({CHAT_PATH, COMPLETIONS_PATH, MODELS_PATH}))
        self.keys = KeyGuard(plane, fleet_rate=settings.rate_limit_scope == "fleet")
        self.port = settings.port
        #: The dashboard's view from this edge (TTFT, refusals) and its relay of the samples.
        self.stats = EdgeStats(self.name, int(time.time() * 1000))
        self.stats_relay = StatsRelay(plane)
        self._conn_ids = itertools.count(1)
        self._ready = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned_unrouted: set[str] = set()
        #: Cancels Redis has not taken yet, and the one loop that sends them (``send_cancels``).
        self.cancels = PendingCancels()
        self._cancels_wanted = asyncio.Event()
        self._cancel_backoff = Backoff("cancel retry", log, min_s=1.0, max_s=5.0)
        self._warned_cancels_full = False
        metrics.CANCELS_PENDING.set_function(lambda: len(self.cancels))

    # -- carrying out the core's actions -------------------------------------------------

    def carry(self, actions: list[delivery.Action]) -> None:
        for action in actions:
            if isinstance(action, delivery.Send):
                session = self.sessions.get(action.conn)
                if session is not None:
                    session.send(action.frame)
                if action.error_code is not None:
                    metrics.ERRORS.labels(action.error_code).inc()
            elif isinstance(action, delivery.FirstToken):
                self.admission.left_lane(action.request_id)
                pool = self._pool_of.get(action.request_id, metrics.NO_POOL)
                metrics.TTFT.labels(pool, action.lane).observe(action.ttft_s)
                self.stats.first_token(action.lane, action.ttft_s, pool)
                self.spans.first_token(action)
            elif isinstance(action, delivery.Finished):
                # A chat refused as a duplicate of a request still in flight here: that one's
                # pool and span are not this refusal's.
                live = action.refused and action.request_id in self.core.entries
                pool = metrics.NO_POOL if live else self._pool_of.pop(action.request_id, metrics.NO_POOL)
                _record(action, pool)
                self.stats.finished(action, pool)
                if not live:
                    self.admission.left_lane(action.request_id)
                    self.spans.finished(action, pool)
            elif isinstance(action, delivery.ReadStream):
                self._spawn(self._read_stream(action))
            elif isinstance(action, delivery.CancelRequest):
                self._queue_cancel(action)
            elif isinstance(action, delivery.Repoint):
                self._spawn(self._repoint(action))
            elif isinstance(action, delivery.CheckRequests):
                self._spawn(self._check(action))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read_stream(self, action: delivery.ReadStream) -> None:
        try:
            events = await self.plane.read_stream(action.request_id, action.after_seq)
            # The read runs to the stream's end: its last event is the newest one, if any.
            last = (events[-1] if events else await self.plane.last_event(action.request_id)) \
                if action.with_last else None
        except QueueUnavailable as exc:
            log.warning("stream read for %s failed: %s", action.request_id, exc)
            self.core.stream_failed(action.request_id)
            return
        self.carry(self.core.stream_read(action.request_id, events, last, time.monotonic()))

    def _queue_cancel(self, action: delivery.CancelRequest) -> None:
        """Hand a cancel to ``send_cancels``: sent at once, unless Redis is not answering (then
        at the loop's next attempt, and a client's own cancel is answered now)."""
        rid = action.request_id
        # The pool now: a Finished later in this same batch forgets it.
        if not self.cancels.add(rid, self._pool_of.get(rid, DEFAULT_POOL), action.report, time.monotonic()):
            metrics.CANCELS_DROPPED.labels("full").inc()
            if not self._warned_cancels_full:  # once until Redis takes cancels again; the metric counts each
                self._warned_cancels_full = True
                log.warning("cancel of %s not kept: %d cancels wait for Redis already, the most kept; it and any "
                            "more until Redis answers run on for nobody until they end (lanes_edge_cancels_dropped"
                            "_total{reason=\"full\"})", rid, len(self.cancels))
            if action.report:
                self.carry(self.core.cancel_failed(rid, time.monotonic()))
            return
        if self._cancel_backoff.failing and self.cancels.answered(rid):
            # Redis is failing: answered now (every cancel before it was, when it was queued or
            # when the attempt failed; a scan of all of them per cancel was quadratic in a mass
            # disconnect during an outage).
            self.carry(self.core.cancel_failed(rid, time.monotonic()))
        self._cancels_wanted.set()  # the loop sends it now, or after its pause while Redis fails

    def _answer_failed_cancels(self) -> None:
        """Clients whose cancel Redis has not taken are answered all the same: their answers end
        after the cancel grace (``cancel_failed``); the cancels stay pending."""
        now = time.monotonic()
        for rid in self.cancels.unanswered():
            self.carry(self.core.cancel_failed(rid, now))

    async def send_cancels(self) -> None:
        """Send the pending cancels (``cancels.py``): each pool's in one pipeline per attempt,
        again every 1-5 s while Redis does not answer (one warning, one recovery line)."""
        backoff = self._cancel_backoff
        while True:
            raise_if_cancelled()
            await self._cancels_wanted.wait()
            self._cancels_wanted.clear()
            by_pool, given_up = self.cancels.batch(time.monotonic(), self.core.cancel_stands)
            if given_up:
                metrics.CANCELS_DROPPED.labels("expired").inc(len(given_up))
                log.warning("%d cancels given up after %g s without Redis (the requests run on for nobody until "
                            "they end): %s", len(given_up), self.cancels.retry_s, ", ".join(given_up[:5]))
            failure: QueueUnavailable | None = None
            sent = 0
            for pool, ids in by_pool.items():
                try:
                    outcomes = await self.plane.for_pool(pool).cancel_many(ids, only_edge=self.edge_id)
                except QueueUnavailable as exc:
                    failure = exc
                    continue
                for rid, outcome in outcomes.items():
                    if isinstance(outcome, QueueUnavailable):  # a refused write (OOM, READONLY): kept
                        failure = outcome
                        continue
                    sent += 1
                    if self.cancels.sent(rid):
                        self.carry(self.core.cancel_result(rid, outcome[0], time.monotonic()))
            if failure is None:
                backoff.succeeded(f"{sent} sent")
                self._warned_cancels_full = False
                continue
            self._answer_failed_cancels()
            delay = backoff.failed(failure, f"{len(self.cancels)} pending ({', '.join(self.cancels.first())}"
                                            f"{', ...' if len(self.cancels) > 5 else ''})")
            await asyncio.sleep(delay)
            self._cancels_wanted.set()

    async def _repoint(self, action: delivery.Repoint) -> None:
        """Re-point a resumed request at this edge, in whichever pool holds it."""
        state, pool = None, None
        try:
            # This edge's own record first (it took the chat), then the pools the snapshots name,
            # then (only if still not found) every pool a worker ever served: snapshots stop
            # when the scheduler is down.
            mine = self._pool_of.get(action.request_id)
            tried = list(dict.fromkeys([*([mine] if mine else []), *known_pools(self)]))
            state, pool = await self._repoint_in(action, tried)
            if state is None:
                others = sorted(await self.plane.fleet.served_pools() - set(tried))
                state, pool = await self._repoint_in(action, others)
            if state is not None and state != "forbidden":  # refused: the core forgets it, so must we
                self._pool_of[action.request_id] = pool or DEFAULT_POOL
                if self.spans.wants_link(action.request_id):  # before its end can close the span
                    await self._link_original(action.request_id, pool or DEFAULT_POOL)
        except QueueUnavailable:
            self.carry(self.core.refuse_resume(action.request_id, action.key,
                                               "queue unavailable; retry the resume shortly"))
            return
        # Another key's request must look exactly like an unknown one.
        state = None if state == "forbidden" else state
        self.carry(self.core.repointed(action.request_id, action.key, state, time.monotonic()))
        if action.request_id not in self.core.entries:  # refused, or ended while Redis answered
            self._pool_of.pop(action.request_id, None)

    async def _link_original(self, request_id: str, pool: str) -> None:
        """Link a ``lanes.resume`` span to the request's own trace (best effort: one read of its
        ``trace`` field, not of its payload)."""
        try:
            carrier = await self.plane.for_pool(pool).trace_of(request_id)
        except QueueUnavailable:
            carrier = {}
        self.spans.link_original(request_id, carrier)

    async def _repoint_in(self, action: delivery.Repoint, pools: list[str]) -> tuple[str | None, str | None]:
        """The state of the first of ``pools`` that holds the request, re-pointed at this edge."""
        for pool in pools:
            state = await self.plane.for_pool(pool).repoint(action.request_id, self.edge_id, owner=action.key)
            if state is not None:
                return state, pool
        return None, None

    async def _check(self, action: delivery.CheckRequests) -> None:
        by_pool: dict[str, list[str]] = {}
        for request_id in action.request_ids:
            by_pool.setdefault(self._pool_of.get(request_id, DEFAULT_POOL), []).append(request_id)
        found: dict[str, tuple[str, str] | None] = {}
        try:
            for pool, ids in by_pool.items():
                found |= await self.plane.for_pool(pool).request_records(ids)
        except QueueUnavailable:
            self.core.check_failed(action.periodic)  # Redis down: the tick checks again once it is back
            return
        self.carry(self.core.checked(found, time.monotonic(), action.periodic, action.notices))

    # -- Redis side ----------------------------------------------------------------------

    async def read_tokens(self) -> None:
        """Feed token batches from our channel to the core; never awaits a socket.

        The same subscription carries the scheduler's depth snapshots (for admission) and
        other edges' takeover notices (a request of ours was resumed there).
        """
        keys = self.plane.keys
        depth_channel = keys.depth_channel.encode()
        takeover_channel = keys.takeover_channel(self.edge_id).encode()
        backoff = Backoff("token channel", log)

        def subscribed() -> None:
            # A (re)subscription may have missed messages: fill every request from its stream.
            self.carry(self.core.resubscribed())
            self._ready.set()

        channels = [keys.edge_channel(self.edge_id), keys.depth_channel, keys.takeover_channel(self.edge_id)]
        async for channel, data in listen(self.plane.redis, channels, backoff, subscribed,
                                          dead_after_s=self.plane.settings.redis_dead_after_s):
            if channel == depth_channel:
                self.admission.observe(data)
                self._warn_unrouted()
                continue
            if channel == takeover_channel:
                self.carry(self.core.takeover_notice(data.decode(errors="replace")))
                continue
            try:
                batch = _batch_decoder.decode(data)
            except msgspec.DecodeError:
                log.warning("dropping undecodable token batch on %s", self.edge_id)
                continue
            self.carry(self.core.tokens(batch.events, time.monotonic()))

    async def tick(self) -> None:
        while True:
            await asyncio.sleep(_TICK_S)
            self.carry(self.core.tick(time.monotonic()))
            self.spans.prune(self.core.entries)

    async def recheck_keys(self) -> None:
        """Every ``LANES_KEY_RECHECK_S``, look up the keys of the open WebSockets and HTTP
        exchanges again; close those of a revoked key (4003; an OpenAI request ends with a 401
        error) and cancel their requests. Before, a connection kept the identity of its handshake
        for as long as the client held it open, and an OpenAI stream ran to its end."""
        if not self.gate.enabled or self.settings.key_recheck_s <= 0:
            return
        while True:
            await asyncio.sleep(self.settings.key_recheck_s)
            for key_hash in {i.key_hash for i in self._identity.values() if i.key_hash}:
                try:
                    live = await self.gate.lookup(key_hash)
                except QueueUnavailable:
                    break  # the key store is down: the next round asks again
                raise_if_cancelled()
                if live is None:
                    self.close_revoked(key_hash)

    def close_revoked(self, key_hash: str) -> None:
        now = time.monotonic()
        for conn in [c for c, i in self._identity.items() if i.key_hash == key_hash]:
            del self._identity[conn]
            log.info("closing connection %d: its API key (%s…) was revoked", conn, key_hash[:8])
            self.carry(self.core.disconnected(conn, now, grace_s=0))  # nobody may resume them
            if (session := self.sessions.get(conn)) is not None:
                session.close(KEY_REVOKED_CLOSE_CODE, "API key revoked")

    # -- socket side ---------------------------------------------------------------------

    async def handle_ws(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """One chat WebSocket (ASGI): the handshake's checks, then frames until it closes."""
        verdict = await self.gate.check(scope["path"], Headers(scope=scope), ticket_param(scope["query_string"]))
        if (await receive())["type"] != "websocket.connect":
            return
        if isinstance(verdict, Identity):
            verdict = self.keys.connection_refusal(verdict) or verdict
        if isinstance(verdict, Refusal):  # an HTTP answer instead of 101 (401, 403, 429, 503)
            await _deny(send, verdict)
            return
        await send({"type": "websocket.accept"})
        conn = next(self._conn_ids)
        self.keys.connections.opened(verdict.key_id)
        session = Session(send, self.settings.max_client_queue_frames, self.settings.slow_client_close_timeout_s,
                          self.settings.client_send_buffer_bytes)
        self.sessions[conn] = session
        self._identity[conn] = verdict
        writer = asyncio.create_task(session.writer())
        metrics.CONNECTIONS.inc()
        try:
            while True:
                message = await receive()
                if message["type"] != "websocket.receive":
                    break  # websocket.disconnect
                if session.closed:
                    continue  # closed by us (a revoked key, a slow client): read to the client's close
                text = message.get("text")
                await self.on_frame(conn, verdict, text if text is not None else message.get("bytes") or b"")
        finally:
            metrics.CONNECTIONS.dec()
            session.closed = True
            if not self.shutting_down:  # an edge restart keeps requests resumable elsewhere
                self.carry(self.core.disconnected(conn, time.monotonic()))
            del self.sessions[conn]
            self._identity.pop(conn, None)
            self.keys.connections.closed(verdict.key_id)
            writer.cancel()

    async def on_frame(self, conn: int, identity: Identity, data: str | bytes) -> None:
        try:
            frame = protocol.parse_client_frame(data, self.limits)
        except protocol.ProtocolError as err:
            # A refused chat (or a frame too broken to say what it was) is an answered request,
            # counted by its code as any other outcome; a bad cancel or resume only as an error.
            if not err.control:
                metrics.count_refused_request(err.code.value)
            self._send_error(conn, err.code, err.message, err.request_id)
            return
        now = time.monotonic()
        if isinstance(frame, protocol.ChatFrame):
            await self.on_chat(conn, identity, frame)
        elif isinstance(frame, protocol.CancelFrame):
            self.carry(self.core.cancel(conn, protocol.scoped_id(identity.key_id, frame.id), now))
        else:
            # The re-point is awaited here, like a chat's enqueue: a connection's answers to its
            # control frames come back in the order it sent them.
            request_id = protocol.scoped_id(identity.key_id, frame.id)
            # A resume reads a whole stream back (a finished answer, again and again): it costs
            # the key's rate as a chat does.
            try:
                refusal = await self.keys.rate_refusal(identity)
            except QueueUnavailable as exc:  # the fleet-wide bucket lives in Redis
                log.warning("redis unavailable: %s", exc)
                self._send_error(conn, ErrorCode.UNAVAILABLE, "queue unavailable; retry the resume shortly",
                                 frame.id, retry_after_ms=NO_WORKER_RETRY_MS)
                return
            if refusal is not None:
                self._send_error(conn, ErrorCode(refusal.code.value), refusal.message, frame.id, **refusal.extra())
                return
            if (session := self.sessions.get(conn)) is None or session.closed:
                return  # closed meanwhile (its key revoked): nothing to resume onto
            actions = self.core.resume(conn, request_id, frame.last_seq, identity.key_id, now,
                                       identity.limits.max_in_flight)
            if request_id not in self.spans and any(isinstance(a, delivery.Repoint) for a in actions):
                self.spans.start(request_id, RESUME, **{"lanes.resumed_after": frame.last_seq})
            self.carry([a for a in actions if not isinstance(a, delivery.Repoint)])
            for action in actions:
                if isinstance(action, delivery.Repoint):
                    await self._repoint(action)

    async def on_chat(self, conn: int, identity: Identity, frame: protocol.ChatFrame,
                      caller_request_id: str | None = None) -> None:
        """``caller_request_id``: an HTTP client's own ``x-request-id`` (``spans.caller_request_id``),
        kept on the request's span."""
        request_id = protocol.scoped_id(identity.key_id, frame.id or uuid.uuid4().hex)
        registered, actions = self.core.open_chat(conn, request_id, identity.key_id, identity.limits.max_in_flight,
                                                  time.monotonic())
        self.carry(actions)
        if not registered:
            return
        caller = {"lanes.client_x_request_id": caller_request_id} if caller_request_id else {}
        span = self.spans.start(request_id, **{"lanes.max_tokens": frame.max_tokens,
                                              "lanes.model": frame.model or "", **caller})
        try:
            with use(span):  # lanes.enqueue, and through it the worker's span, are its children
                actions = await admit_and_enqueue(self, request_id, identity, frame)
            self.carry(actions)
        except QueueUnavailable as exc:
            cause = refusal_cause(exc)
            if cause is None:
                log.warning("redis unavailable: %s", exc)
            else:
                log.error("%s: %s", cause, exc)
            self.carry(self.core.refuse(request_id, ErrorCode.UNAVAILABLE,
                                        f"queue unavailable{f': {cause}' if cause else ''}; retry shortly",
                                        retry_after_ms=NO_WORKER_RETRY_MS))
        except Exception:  # noqa: BLE001 - a bug must cost one request, not the connection
            log.exception("internal error handling a chat frame")
            self.carry(self.core.refuse(request_id, ErrorCode.INTERNAL, "internal error; the request was not accepted"))

    # -- connections that are not WebSockets (one HTTP request each) -----------------------

    def open_session(self, session: Any, identity: Identity | None = None) -> int:
        """Register a non-WebSocket connection (``completions.HttpSession``); returns its id.
        ``identity``: the key it came with, looked up again while it runs (``recheck_keys``)."""
        conn = next(self._conn_ids)
        self.sessions[conn] = session
        if identity is not None:
            self._identity[conn] = identity
        return conn

    def close_session(self, conn: int, *, abandoned: bool) -> None:
        """The HTTP exchange is over; ``abandoned``: its client left first, so its request is
        cancelled now (there is no resume over HTTP)."""
        session = self.sessions.pop(conn, None)
        self._identity.pop(conn, None)
        if session is not None:
            session.closed = True
        cancel = abandoned or self.shutting_down  # interrupted by a shutdown: nobody can resume it
        self.carry(self.core.disconnected(conn, time.monotonic(), grace_s=0.0 if cancel else None))

    def begin_shutdown(self) -> None:
        """The edge is stopping (SIGTERM). From now on a WebSocket that closes is a restart, not
        a client leaving: its requests run on, to be resumed on another edge. An HTTP exchange has
        no resume: each ends now with ``unavailable`` (a stream: an error event and ``[DONE]``;
        before, it was cut mid-answer when the graceful shutdown ran out), its request cancelled."""
        self.shutting_down = True
        self.stats_relay.close()  # the dashboard's streams end (it reconnects to another edge)
        for session in list(self.sessions.values()):
            if (interrupt := getattr(session, "interrupt", None)) is not None:
                interrupt("the edge is shutting down; retry (another edge will take it)")

    def _warn_unrouted(self) -> None:
        """Once per pool: workers serve a pool that the routing rules never send a chat to (a
        typo in a worker's ``LANES_POOL``): an idle GPU, and the pool it was meant for down."""
        if self.router.rules is None:
            return
        for pool in set(self.admission.live_pools()) - self.router.rules.pools - self._warned_unrouted:
            self._warned_unrouted.add(pool)
            log.warning("workers of pool %r are live, but the routing rules (LANES_ROUTING_FILE) never send a "
                        "chat there: check those workers' LANES_POOL, or add the pool to the rules", pool)

    async def live_pools(self) -> list[str]:
        """Pools with live workers, per the latest snapshots and the worker registry (asked on
        the rare paths that list them: an unknown model, ``GET /v1/models``)."""
        reports = await self.plane.fleet.reports()
        return sorted(set(self.admission.live_pools()) | {r.pool for r in reports if not r.draining})

    async def model_names(self) -> list[str]:
        """What ``GET /v1/models`` lists: the pools with live workers or that scale from zero
        (and ``auto`` with rules)."""
        waking = [p for p in self.admission.pools() if self.admission.scales_from_zero(p)]
        return self.router.model_names([*await self.live_pools(), *waking])

    def _send_error(self, conn: int, code: ErrorCode, message: str, request_id: str | None,
                    **extra: object) -> None:
        metrics.ERRORS.labels(code.value).inc()
        session = self.sessions.get(conn)
        if session is not None:
            session.send(protocol.error_frame(code, message, request_id, **extra))

    # -- predictor refresh ---------------------------------------------------------------

    def route_by(self, thresholds: LaneThresholds) -> None:
        """Route new requests by these lane thresholds (predicted tokens)."""
        self.thresholds = thresholds
        self.policy = make_live_policy(self.settings.policy, thresholds, SlotConfig())
        metrics.ROUTING_THRESHOLD.labels("short").set(thresholds.short_max_tokens)
        metrics.ROUTING_THRESHOLD.labels("medium").set(thresholds.medium_max_tokens)

    def use_predictor(self, version: int, predictor: LengthPredictor) -> None:
        """Predict with a refreshed model and, unless the thresholds are pinned
        (``LANES_FOLLOW_REFRESHED_ROUTING=false``, or unset with ``LANES_SHORT_MAX_TOKENS`` or
        ``LANES_MEDIUM_MAX_TOKENS`` set), route by the thresholds fitted for it: a refit moves
        the prediction level, and fixed thresholds would stop routing as measured."""
        self.lengths.predictor = predictor
        self.predictor_version = version
        metrics.PREDICTOR_VERSION.set(version)
        release_freed_memory()  # the loading freed ~15 MB glibc would keep
        routing = predictor.routing
        if routing is None:
            kept = " (the model carries none: unchanged)"
        elif self.settings.follows_refreshed_routing:
            self.route_by(routing)
            kept = ""
        else:
            kept = " (pinned)"
        log.info("length predictor version %d loaded; lanes: short <= %d, long > %d predicted tokens%s", version,
                 self.thresholds.short_max_tokens, self.thresholds.medium_max_tokens, kept)

    async def reload_predictor(self, interval_s: float | None = None) -> None:
        """Pick up predictor versions the scheduler's refresh job publishes (every
        ``interval_s``, default ``LANES_PREDICTOR_POLL_S``)."""
        if interval_s is None:
            interval_s = self.settings.predictor_poll_s
        skipped = 0  # the newest version whose weights did not load: not fetched again
        # One line per outage, naming the key (a malformed one logged the same line every 5 s).
        backoff = Backoff(f"predictor reload ({self.plane.keys.predictor})", log, min_s=interval_s, max_s=interval_s)
        while True:
            raise_if_cancelled()
            try:
                published = await load_published(self.plane, max(self.predictor_version, skipped))
                if published is not None:
                    self.use_predictor(*published)
            except UnusableWeights as exc:
                skipped = exc.version
                log.warning("%s", exc)
            except (QueueUnavailable, ValueError) as exc:
                await asyncio.sleep(backoff.failed(exc))
                continue
            backoff.succeeded()
            await asyncio.sleep(interval_s)

    # -- lifecycle -----------------------------------------------------------------------

    async def serve(self, ready: asyncio.Event | None = None) -> None:
        """Serve until cancelled; raises what stopped it (``OSError`` when the port is taken)."""
        sock = listen_socket(self.settings.host, self.settings.port)  # fail now, not after the subscription
        self.port = sock.getsockname()[1]
        try:
            async with asyncio.TaskGroup() as group:
                for loop in (self.read_tokens(), self.tick(), self.reload_predictor(), self.send_cancels(),
                             ship_windows(self.stats, self.plane), self.stats_relay.run(),
                             self.recheck_keys()):
                    group.create_task(loop)
                await self._ready.wait()  # subscribed before the first connection is accepted
                log.info("edge %s listening on ws://%s:%d%s", self.edge_id, self.settings.host, self.port,
                         self.chat_path)
                log.info("API keys %s", "required" if self.gate.enabled else "OFF (LANES_AUTH_REQUIRED=false): "
                         "anyone who reaches this port can chat")
                if ready is not None:
                    ready.set()
                try:
                    await serve_app(EdgeApp(self), sock, max_frame_bytes=self.limits.max_frame_bytes * 4,
                                    compression=self.settings.ws_compression, on_shutdown=self.begin_shutdown,
                                    header_timeout_s=self.settings.header_timeout_s,
                                    ping_interval_s=self.settings.ws_ping_interval_s,
                                    ping_timeout_s=self.settings.ws_ping_timeout_s,
                                    close_timeout_s=self.settings.slow_client_close_timeout_s)
                finally:
                    # Closing connections now is a restart, not a client leaving: keep their
                    # requests running so the clients can resume on another edge.
                    self.shutting_down = True
                    self.spans.end_all("edge_stopped")
        except BaseExceptionGroup as failed:
            if len(failed.exceptions) == 1:
                raise failed.exceptions[0] from None
            raise
        finally:
            sock.close()


async def _deny(send: Any, refusal: Refusal) -> None:
    """Refuse a WebSocket handshake with an HTTP status and a one-line reason."""
    body = (refusal.message + "\n").encode()
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in refusal.headers().items())]
    await send({"type": "websocket.http.response.start", "status": refusal.status.value, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": body})


def _record(finished: delivery.Finished, pool: str) -> None:
    if finished.outcome == ErrorCode.REQUEST_LOST:
        log.warning("request %s vanished from Redis (restarted without persistence, or flushed)", finished.request_id)
    if finished.lane == delivery.Entry.lane:  # a resume of a request counted where its chat came
        metrics.RESUMES.labels(pool, finished.outcome).inc()  # (its e2e here would time the replay)
        return
    metrics.REQUESTS.labels(pool, finished.lane, finished.outcome).inc()
    if finished.e2e_s is not None:
        metrics.E2E.labels(pool, finished.lane).observe(finished.e2e_s)
    if finished.queue_ms is not None:
        metrics.QUEUE_WAIT.labels(pool, finished.lane).observe(finished.queue_ms / 1000)
