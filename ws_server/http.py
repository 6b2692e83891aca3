"""Plain HTTP on the edge's port: health, Prometheus metrics, lane depths and the dashboard."""

from __future__ import annotations

import json
from http import HTTPStatus
from importlib import resources
from typing import TYPE_CHECKING

import msgspec
from lanes.queue.errors import QueueUnavailable
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

if TYPE_CHECKING:
    from lanes.ws_server.edge import Edge


def _response(status: HTTPStatus, body: bytes, content_type: str) -> Response:
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))),
                       ("Cache-Control", "no-store")])
    return Response(status.value, status.phrase, headers, body)


async def http_response(edge: Edge, conn: ServerConnection, request: Request) -> Response:
    path = request.path.split("?", 1)[0]
    if path == "/healthz":
        # JSON naming this edge, so a supervisor can tell its own edge from another server
        # that answers on the same port.
        # ``workers``: warm workers per the scheduler's latest snapshot (None: no snapshot yet).
        health = {"status": "ok", "edge_id": edge.edge_id, "workers": edge.admission.num_workers()}
        try:
            await edge.plane.ping()
        except QueueUnavailable:
            health["status"] = "redis_unreachable"
            return _response(HTTPStatus.SERVICE_UNAVAILABLE, json.dumps(health).encode(), "application/json")
        return _response(HTTPStatus.OK, json.dumps(health).encode(), "application/json")
    if path == "/metrics":
        return _response(HTTPStatus.OK, generate_latest(), CONTENT_TYPE_LATEST)
    if path == "/v1/depths":
        try:
            snapshot = await edge.plane.fleet.depths_json()
        except QueueUnavailable:
            return _response(HTTPStatus.SERVICE_UNAVAILABLE, b'{"error":"redis unreachable"}', "application/json")
        return _response(HTTPStatus.OK, snapshot or b"{}", "application/json")
    if path == "/v1/workers":
        try:
            return _response(HTTPStatus.OK, msgspec.json.encode(await edge.plane.fleet.reports()), "application/json")
        except QueueUnavailable:
            return _response(HTTPStatus.SERVICE_UNAVAILABLE, b'{"error":"redis unreachable"}', "application/json")
    if path in ("/", "/dashboard"):
        page = resources.files("lanes.ws_server").joinpath("static/dashboard.html").read_bytes()
        return _response(HTTPStatus.OK, page, "text/html; charset=utf-8")
    return _response(HTTPStatus.NOT_FOUND, b"not found; the chat WebSocket is at /v1/chat\n", "text/plain")
