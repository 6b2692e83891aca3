"""Plain HTTP on the edge's port (Starlette routes): health, Prometheus metrics, lane depths,
workers, the dashboard's statistics (history and a live server-sent event stream), WebSocket
tickets for browsers, and the two pages (chat at ``/``, dashboard at ``/dashboard``) with their
static files. A path answers the methods it serves and 405 (with ``Allow``) to the others."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import msgspec
from lanes.queue.errors import QueueUnavailable
from lanes.queue.keys import DEFAULT_POOL, STATS_HISTORY_LEN
from lanes.scheduler.router.rules import POOL_NAME
from lanes.telemetry import metrics
from lanes.ws_server import pages
from lanes.ws_server.auth import Refusal
from lanes.ws_server.stats import sse_stream
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

if TYPE_CHECKING:
    from lanes.ws_server.edge import Edge

_NO_STORE = {"Cache-Control": "no-store"}
#: How far back ``/v1/stats/history`` reaches (s): one sample a second, 900 kept.
STATS_WINDOW_S = STATS_HISTORY_LEN


def refusal_response(refusal: Refusal) -> Response:
    return PlainTextResponse(refusal.message + "\n", refusal.status.value, headers=refusal.headers())


def _json(body: bytes, status: int = 200) -> Response:
    return Response(body, status, media_type="application/json", headers=_NO_STORE)


def routes(edge: Edge) -> list[BaseRoute]:
    async def guarded(request: Request) -> Refusal | None:
        verdict = await edge.gate.check(request.url.path, request.headers)
        return verdict if isinstance(verdict, Refusal) else None

    async def healthz(request: Request) -> Response:
        # JSON naming this edge, so a supervisor can tell its own edge from another server on
        # the port; ``instance``: its id in Redis, new at each start; ``workers``: warm workers per
        # the scheduler's latest snapshot (None: none yet); ``pending_cancels``: cancels Redis has
        # not taken yet (``cancels.py``).
        health = {"status": "ok", "edge_id": edge.name, "instance": edge.edge_id,
                  "workers": edge.admission.num_workers(), "pending_cancels": len(edge.cancels)}
        try:
            await edge.plane.ping()
        except QueueUnavailable:
            health["status"] = "redis_unreachable"
            return _json(json.dumps(health).encode(), 503)
        return _json(json.dumps(health).encode())

    async def prometheus(request: Request) -> Response:
        if refusal := await guarded(request):
            return refusal_response(refusal)
        return Response(metrics.exposition(metrics.EDGE), media_type=CONTENT_TYPE_LATEST, headers=_NO_STORE)

    async def depths(request: Request) -> Response:
        if refusal := await guarded(request):
            return refusal_response(refusal)
        pool = request.query_params.get("pool", DEFAULT_POOL)
        if not POOL_NAME.fullmatch(pool):  # it becomes part of a Redis key (a hash tag's braces, newlines)
            return _json(msgspec.json.encode({"error": "pool must be 1 to 64 of letters, digits, '_', '.', '-'"}), 400)
        try:
            return _json(await edge.plane.fleet.depths_json(pool) or b"{}")
        except QueueUnavailable:
            return _json(b'{"error":"redis unreachable"}', 503)

    async def workers(request: Request) -> Response:
        if refusal := await guarded(request):
            return refusal_response(refusal)
        try:
            return _json(msgspec.json.encode(await edge.plane.fleet.reports()))
        except QueueUnavailable:
            return _json(b'{"error":"redis unreachable"}', 503)

    async def stats_history(request: Request) -> Response:
        if refusal := await guarded(request):
            return refusal_response(refusal)
        try:
            after_ms = int(request.query_params.get("after_ms", "0"))
        except ValueError:
            return PlainTextResponse("after_ms must be an integer (ms since the epoch)\n", 400)
        try:
            stored = await edge.plane.fleet.stats_history(after_ms)
        except QueueUnavailable:
            return _json(b'{"error":"redis unreachable"}', 503)
        head = b'{"interval_s":1.0,"window_s":%d,"samples":[' % STATS_WINDOW_S
        return _json(head + b",".join(data for _, data in stored) + b"]}")

    async def stats_stream(request: Request) -> Response:
        verdict = await edge.gate.check(request.url.path, request.headers)
        if isinstance(verdict, Refusal):
            return refusal_response(verdict)
        # A stream holds a connection as a WebSocket does: it counts against the same cap.
        if too_many := edge.keys.connection_refusal(verdict):
            return refusal_response(too_many)
        # ``Last-Event-ID``: the browser's own reconnection (or ours) says which sample it has.
        last = request.headers.get("last-event-id") or request.query_params.get("after_ms") or "0"
        try:
            after_ms = int(last)
        except ValueError:
            return PlainTextResponse("Last-Event-ID / after_ms must be an integer (ms since the epoch)\n", 400)
        return StreamingResponse(counted(verdict.key_id, sse_stream(edge.stats_relay, edge.plane, after_ms)),
                                 media_type="text/event-stream", headers={**_NO_STORE, "X-Accel-Buffering": "no"})

    async def counted(key_id: str, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        edge.keys.connections.opened(key_id)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            edge.keys.connections.closed(key_id)

    async def ws_ticket(request: Request) -> Response:
        issued = await edge.gate.issue_ticket(request.headers, admit=edge.keys.ticket_refusal)
        if isinstance(issued, Refusal):
            return refusal_response(issued)
        body = {"ticket": issued, "expires_in_s": edge.settings.ws_ticket_ttl_s, "auth_required": edge.gate.enabled}
        return _json(json.dumps(body).encode())

    async def chat_over_http(request: Request) -> Response:
        return PlainTextResponse("the chat endpoint is a WebSocket: connect with ws:// (Upgrade: websocket)\n",
                                 426, headers={"Upgrade": "websocket", **_NO_STORE})

    return [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/v1/depths", depths, methods=["GET"]),
        Route("/v1/workers", workers, methods=["GET"]),
        Route("/v1/chat", chat_over_http, methods=["GET"]),
        Route("/v1/stats/history", stats_history, methods=["GET"]),
        Route("/v1/stats/stream", stats_stream, methods=["GET"]),
        Route("/v1/ws-ticket", ws_ticket, methods=["POST"]),
        *pages.routes(),
    ]
