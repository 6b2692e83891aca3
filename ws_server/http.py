"""Plain HTTP on the edge's port (Starlette routes): health, Prometheus metrics, lane depths,
workers and the dashboard. A path answers the methods it serves and 405 (with ``Allow``) to
the others."""

from __future__ import annotations

import json
from importlib import resources
from typing import TYPE_CHECKING

import msgspec
from lanes.queue.errors import QueueUnavailable
from lanes.queue.keys import DEFAULT_POOL
from lanes.ws_server.auth import Refusal
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

if TYPE_CHECKING:
    from lanes.ws_server.edge import Edge

_NO_STORE = {"Cache-Control": "no-store"}


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
        # the port; ``workers``: warm workers per the scheduler's latest snapshot (None: none yet).
        health = {"status": "ok", "edge_id": edge.edge_id, "workers": edge.admission.num_workers()}
        try:
            await edge.plane.ping()
        except QueueUnavailable:
            health["status"] = "redis_unreachable"
            return _json(json.dumps(health).encode(), 503)
        return _json(json.dumps(health).encode())

    async def prometheus(request: Request) -> Response:
        if refusal := await guarded(request):
            return refusal_response(refusal)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST, headers=_NO_STORE)

    async def depths(request: Request) -> Response:
        if refusal := await guarded(request):
            return refusal_response(refusal)
        try:
            return _json(await edge.plane.fleet.depths_json(request.query_params.get("pool", DEFAULT_POOL)) or b"{}")
        except QueueUnavailable:
            return _json(b'{"error":"redis unreachable"}', 503)

    async def workers(request: Request) -> Response:
        if refusal := await guarded(request):
            return refusal_response(refusal)
        try:
            return _json(msgspec.json.encode(await edge.plane.fleet.reports()))
        except QueueUnavailable:
            return _json(b'{"error":"redis unreachable"}', 503)

    async def dashboard(request: Request) -> Response:
        page = resources.files("lanes.ws_server").joinpath("static/dashboard.html").read_bytes()
        return Response(page, media_type="text/html; charset=utf-8", headers=_NO_STORE)

    async def chat_over_http(request: Request) -> Response:
        return PlainTextResponse("the chat endpoint is a WebSocket: connect with ws:// (Upgrade: websocket)\n",
                                 426, headers={"Upgrade": "websocket", **_NO_STORE})

    return [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/v1/depths", depths, methods=["GET"]),
        Route("/v1/workers", workers, methods=["GET"]),
        Route("/v1/chat", chat_over_http, methods=["GET"]),
        Route("/dashboard", dashboard, methods=["GET"]),
        Route("/", dashboard, methods=["GET"]),
    ]
