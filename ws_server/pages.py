"""The two pages the edge serves (chat at ``/``, dashboard at ``/dashboard``) and their static
files (``ws_server/static/``), with headers that keep them self-contained.

The Content-Security-Policy allows scripts, styles and connections to this origin only: no
asset or request can go to the internet even if a later edit tries (the browser refuses it),
and inline script is refused too, so injected markup cannot run. ``Referrer-Policy:
no-referrer`` keeps a page's URL out of other sites' logs.
"""

from __future__ import annotations

import functools
from importlib import resources

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
#: ``'self'`` in ``connect-src`` covers ``ws:``/``wss:`` to the same host (CSP Level 3).
_HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@functools.cache
def _assets() -> dict[str, bytes]:
    """Every servable file of ``ws_server/static/`` by name, read once (a request can only
    pick one of these: no path is ever built from a URL)."""
    folder = resources.files("lanes.ws_server").joinpath("static")
    return {item.name: item.read_bytes() for item in folder.iterdir()
            if item.is_file() and any(item.name.endswith(suffix) for suffix in _TYPES)}


def asset(name: str) -> bytes | None:
    """A file of ``ws_server/static/`` by plain name, None when there is none."""
    return _assets().get(name)


def _serve(name: str) -> Response:
    body = asset(name)
    if body is None:
        return PlainTextResponse("not found\n", 404)
    media_type = next(t for suffix, t in _TYPES.items() if name.endswith(suffix))
    return Response(body, media_type=media_type, headers=_HEADERS)


def routes() -> list[BaseRoute]:
    async def chat_page(request: Request) -> Response:
        return _serve("chat.html")

    async def dashboard_page(request: Request) -> Response:
        return _serve("dashboard.html")

    async def static_file(request: Request) -> Response:
        return _serve(request.path_params["name"])

    return [
        Route("/", chat_page, methods=["GET"]),
        Route("/dashboard", dashboard_page, methods=["GET"]),
        Route("/static/{name}", static_file, methods=["GET"]),
    ]
