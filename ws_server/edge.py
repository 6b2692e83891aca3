"""The WebSocket edge: validates chat frames, predicts length, enqueues into a lane, and
forwards the workers' token batches from its own Redis channel to the right sockets.

The edge subscribes to ``lanes:edge:<edge_id>`` before it accepts connections, so no first
token can race a late subscription.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid

import msgspec
import websockets
from redis.exceptions import RedisError
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from lanes.queue.messages import RequestPayload, TokenBatch
from lanes.queue.plane import QueuePlane
from lanes.scheduler.policy import LaneThresholds, choose_lane
from lanes.scheduler.refresh import load_published
from lanes.telemetry import metrics
from lanes.telemetry.tracing import inject_context, tracer
from lanes.ws_server import protocol
from lanes.ws_server.admission import EdgeAdmission
from lanes.ws_server.auth import Gate
from lanes.ws_server.http import http_response
from lanes.ws_server.lengths import LengthEstimator
from lanes.ws_server.keyguard import KeyGuard
from lanes.ws_server.session import Route, Session
from lanes.ws_server.settings import EdgeSettings

log = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat"
_batch_decoder = msgspec.json.Decoder(TokenBatch)


class Edge:
    def __init__(self, settings: EdgeSettings, plane: QueuePlane, lengths: LengthEstimator | None = None) -> None:
        self.settings = settings
        self.plane = plane
        self.edge_id = settings.edge_id or f"edge-{uuid.uuid4().hex[:10]}"
        self.limits = protocol.Limits(
            max_frame_bytes=settings.max_frame_bytes, max_messages=settings.max_messages,
            max_prompt_chars=settings.max_prompt_chars, max_tokens_limit=settings.max_tokens_limit,
            default_max_tokens=settings.default_max_tokens,
        )
        self.thresholds = LaneThresholds(settings.short_max_tokens, settings.medium_max_tokens)
        self.lengths = lengths or LengthEstimator()
        self.admission = EdgeAdmission(settings)
        self.shutting_down = False
        self.routes: dict[str, Route] = {}
        self.gate = Gate(settings, plane.redis, plane.keys, CHAT_PATH)
        self.keys = KeyGuard(plane, fleet_rate=settings.rate_limit_scope == "fleet")
        self._ready = asyncio.Event()
        self.port = settings.port

    # -- Redis side ---------------------------------------------------------------------

    async def read_tokens(self) -> None:
        """Forward token batches from our channel to sessions; never awaits a socket.

        The same subscription carries the scheduler's depth snapshots (for admission).
        """
        depth_channel = self.plane.keys.depth_channel.encode()
        while True:
            pubsub = self.plane.redis.pubsub()
            try:
                await pubsub.subscribe(self.plane.keys.edge_channel(self.edge_id), self.plane.keys.depth_channel)
                # A (re)subscription may have missed messages: fill every active route from its stream.
                for route in list(self.routes.values()):
                    await self.fill_gap(route, route.next_seq - 1)
                self._ready.set()
                async for message in pubsub.listen():
                    if message["type"] != "message":
                        continue
                    if message["channel"] == depth_channel:
                        self.admission.observe(message["data"])
                        continue
                    try:
                        batch = _batch_decoder.decode(message["data"])
                    except msgspec.DecodeError:
                        log.warning("dropping undecodable token batch on %s", self.edge_id)
                        continue
                    for event in batch.events:
                        route = self.routes.get(event.id)
                        if route is not None:
                            route.deliver(event)
            except (RedisError, OSError) as exc:
                log.warning("token channel lost (%s); resubscribing", exc)
                await asyncio.sleep(0.2)
            finally:
                await pubsub.aclose()

    async def fill_gap(self, route: Route, after_seq: int) -> None:
        try:
            for event in await self.plane.read_stream(route.id, after_seq):
                route.deliver(event)
        except RedisError as exc:
            log.warning("gap fill for %s failed: %s", route.id, exc)
        finally:
            route.filling = False

    # -- socket side --------------------------------------------------------------------

    async def handle(self, ws: ServerConnection) -> None:
        session = Session(ws, self.settings.max_client_queue_frames, self.settings.slow_client_close_timeout_s)
        _limit_send_buffer(ws, self.settings.client_send_buffer_bytes)
        writer = asyncio.create_task(session.writer())
        metrics.CONNECTIONS.inc()
        try:
            async for data in ws:
                await self.on_frame(session, data)
        except websockets.ConnectionClosed:
            pass
        finally:
            metrics.CONNECTIONS.dec()
            session.closed = True
            if not self.shutting_down:
                await self.on_disconnect(session)
            writer.cancel()

    async def on_frame(self, session: Session, data: str | bytes) -> None:
        try:
            frame = protocol.parse_client_frame(data, self.limits)
            if isinstance(frame, protocol.ChatFrame):
                await self.on_chat(session, frame)
            elif isinstance(frame, protocol.CancelFrame):
                await self.on_cancel(session, frame.id)
            else:
                await self.on_resume(session, frame)
        except protocol.ProtocolError as err:
            metrics.ERRORS.labels(err.code).inc()
            session.send(protocol.error_frame(err.code, err.message, err.request_id))
        except RedisError as exc:
            log.warning("redis unavailable: %s", exc)
            metrics.ERRORS.labels("unavailable").inc()
            session.send(protocol.error_frame("unavailable", "queue unavailable; retry shortly", _frame_id(data)))
        except Exception:  # noqa: BLE001 - a bug must cost one frame, not the connection
            log.exception("internal error handling a frame")
            metrics.ERRORS.labels("internal").inc()
            session.send(protocol.error_frame("internal", "internal error; the request was not accepted",
                                              _frame_id(data)))

    async def on_chat(self, session: Session, frame: protocol.ChatFrame) -> None:
        request_id = frame.id or uuid.uuid4().hex
        if request_id in self.routes:  # on this connection or another one of this edge
            raise protocol.ProtocolError("duplicate_id", f"request {request_id} is already in flight", request_id)
        if len(session.routes) >= self.settings.max_in_flight_per_connection:
            raise protocol.ProtocolError(
                "too_many_in_flight", f"at most {self.settings.max_in_flight_per_connection} requests in flight",
                request_id,
            )
        refusal = await self.keys.refusal(session)
        if refusal is not None:
            metrics.ERRORS.labels(refusal.code.value).inc()
            extra = {} if refusal.retry_after_ms is None else {"retry_after_ms": refusal.retry_after_ms}
            session.send(protocol.error_frame(refusal.code.value, refusal.message, request_id, **extra))
            return
        predicted = await self.lengths.predict(frame.messages, frame.max_tokens)
        lane = choose_lane(predicted, self.thresholds)
        decision = self.admission.decide(lane, frame.deadline_ms)
        if not decision.admitted:
            metrics.REQUESTS.labels(lane.value, "overloaded").inc()
            metrics.ERRORS.labels("overloaded").inc()
            reason = decision.reason.value if decision.reason else "overloaded"
            session.send(protocol.error_frame(
                "overloaded", f"lane {lane.value} cannot start this request in time ({reason}); retry later",
                request_id, retry_after_ms=decision.retry_after_ms, reason=reason))
            return
        with tracer().start_as_current_span("lanes.enqueue", attributes={
            "lanes.request_id": request_id, "lanes.lane": lane.value, "lanes.predicted_tokens": predicted,
        }):
            payload = RequestPayload(
                id=request_id, messages=frame.messages, max_tokens=frame.max_tokens, temperature=frame.temperature,
                top_p=frame.top_p, seed=frame.seed, lane=lane, predicted_tokens=predicted, trace=inject_context(),
            )
            route = Route(request_id, session, lane.value, fill_gap=self.fill_gap)
            # Register before enqueueing: the first token may arrive before ENQUEUE returns.
            session.routes[request_id] = route
            self.routes[request_id] = route
            try:
                enqueued = await self.plane.enqueue(payload, self.edge_id, owner=self.keys.owner(session))
            except BaseException:
                self._forget(route)
                raise
        if not enqueued.created:
            self._forget(route)
            raise protocol.ProtocolError(
                "duplicate_id", f"request {request_id} already exists ({enqueued.existing_state}); use resume",
                request_id,
            )
        self.admission.enqueued(lane)
        metrics.IN_FLIGHT.inc()
        session.send(protocol.accepted_frame(request_id, lane.value, predicted))

    async def on_cancel(self, session: Session, request_id: str) -> None:
        route = session.routes.get(request_id)
        if route is None:
            raise protocol.ProtocolError("unknown_id", f"no request {request_id} in flight here", request_id)
        state, _worker = await self.plane.cancel(request_id)
        if state in ("queued", "absent"):
            route.cancelled_locally()
        elif state == "running":
            asyncio.get_running_loop().call_later(self.settings.cancel_grace_s, route.cancelled_locally)

    async def on_resume(self, session: Session, frame: protocol.ResumeFrame) -> None:
        if frame.id in session.routes:
            raise protocol.ProtocolError("duplicate_id", f"request {frame.id} is already in flight here", frame.id)
        route = Route(frame.id, session, lane="resumed", next_seq=frame.last_seq + 1, fill_gap=self.fill_gap)
        session.routes[frame.id] = route
        self.routes[frame.id] = route
        state = await self.plane.repoint(frame.id, self.edge_id, owner=self.keys.owner(session))
        if state is None or state == "forbidden":
            # The same answer for both: another key's request ids must not be probeable.
            self._forget(route)
            raise protocol.ProtocolError("unknown_id", f"request {frame.id} is unknown or expired", frame.id)
        metrics.IN_FLIGHT.inc()
        await self.fill_gap(route, frame.last_seq)
        if not route.done and state in ("done", "cancelled", "failed"):
            # The client already had every delta (last_seq at or past the end): still end it.
            events = await self.plane.read_stream(frame.id)
            if events and events[-1].finish is not None:
                route.finish(events[-1].finish)
            else:
                route.lost()
            return
        # The worker re-points at its next heartbeat; until then it publishes to the old edge,
        # and an answer that ends in that window would never reach us: read the stream again.
        asyncio.get_running_loop().call_later(2 * self.settings.heartbeat_s + 0.1, self._refill, route)

    def _refill(self, route: Route) -> None:
        """Deliver from the stream whatever this route missed (it may have gone elsewhere)."""
        if not route.done and not route.filling:
            route.filling = True
            asyncio.get_running_loop().create_task(self.fill_gap(route, route.next_seq - 1))

    async def on_disconnect(self, session: Session) -> None:
        """A client that left stops its requests: queued ones leave the lane, running ones abort."""
        for route in list(session.routes.values()):
            self._forget(route)
            if not route.done:
                route.done = True
                metrics.IN_FLIGHT.dec()
                metrics.REQUESTS.labels(route.lane, "disconnected").inc()
                try:
                    await self.plane.cancel(route.id)
                except RedisError as exc:
                    log.warning("cancel of %s after disconnect failed: %s", route.id, exc)

    def _forget(self, route: Route) -> None:
        route.session.routes.pop(route.id, None)
        if self.routes.get(route.id) is route:
            del self.routes[route.id]

    # -- lifecycle ----------------------------------------------------------------------

    async def process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        verdict = await self.gate.check(request)  # origin allowlist, API key (ws_server/auth.py)
        if isinstance(verdict, Response):
            return verdict
        if request.path.split("?", 1)[0] == CHAT_PATH:
            self.keys.identities[conn] = verdict
            return None
        return await http_response(self, conn, request)

    async def check_routes(self, interval_s: float = 2.0, quiet_s: float = 3.0) -> None:
        """End routes whose request vanished from Redis with ``request_lost``; fill quiet ones
        from their stream (never hang)."""
        while True:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            quiet = [r for r in self.routes.values() if not r.done and now - r.last_heard_at > quiet_s]
            if not quiet:
                continue
            try:
                async with self.plane.redis.pipeline(transaction=False) as pipe:
                    for route in quiet:
                        pipe.exists(self.plane.keys.request(route.id))
                    exists = await pipe.execute()
            except RedisError:
                continue  # Redis down: check again once it is back
            for route, found in zip(quiet, exists):
                if found:
                    route.last_heard_at = now
                    self._refill(route)  # its tokens may have been published to another edge
                else:
                    log.warning("request %s vanished from Redis", route.id)
                    self._forget(route)
                    route.lost()

    async def reload_predictor(self, interval_s: float = 30.0) -> None:
        """Pick up predictor versions the scheduler's refresh job publishes."""
        version = 0
        while True:
            try:
                published = await load_published(self.plane, version)
                if published is not None:
                    version, predictor = published
                    self.lengths.predictor = predictor
                    log.info("length predictor version %d loaded", version)
            except (RedisError, ValueError) as exc:
                log.warning("predictor reload failed: %s", exc)
            await asyncio.sleep(interval_s)

    async def serve(self, ready: asyncio.Event | None = None) -> None:
        reader = asyncio.create_task(self.read_tokens())
        reloader = asyncio.create_task(self.reload_predictor())
        checker = asyncio.create_task(self.check_routes())
        await self._ready.wait()
        async with serve(
            self.handle, self.settings.host, self.settings.port,
            max_size=self.limits.max_frame_bytes * 4,  # beyond this, close 1009; below, an error frame
            process_request=self.process_request, ping_interval=20, ping_timeout=20,
            close_timeout=2,  # at shutdown, do not wait 10 s per client for the close handshake
        ) as server:
            self.port = server.sockets[0].getsockname()[1] if server.sockets else self.settings.port
            log.info("edge %s listening on ws://%s:%d%s", self.edge_id, self.settings.host, self.port, CHAT_PATH)
            log.info("API keys %s", "required" if self.gate.enabled else "OFF (LANES_AUTH_REQUIRED=false): anyone "
                     "who reaches this port can chat")
            if ready is not None:
                ready.set()
            try:
                await asyncio.Future()
            finally:
                # Closing connections now is a restart, not a client leaving: keep their
                # requests running so the clients can resume on another edge (close 1001).
                self.shutting_down = True
                for task in (reader, reloader, checker):
                    task.cancel()


def _frame_id(data: str | bytes) -> str | None:
    try:
        obj = msgspec.json.decode(data)
        return obj.get("id") if isinstance(obj, dict) and isinstance(obj.get("id"), str) else None
    except (msgspec.DecodeError, RecursionError, UnicodeError):
        return None


def _limit_send_buffer(ws: ServerConnection, num_bytes: int) -> None:
    """Cap the kernel's send buffer for one client: with Linux autotuning (up to 4 MiB) a client
    that stops reading would park that much in the kernel before the edge's bounded queue
    filled and the 4008 close could happen."""
    sock = ws.transport.get_extra_info("socket")
    if num_bytes > 0 and sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, num_bytes)
