"""The edge's one port: an ASGI app served by uvicorn (WebSockets on the ``websockets``
library's sans-I/O protocol, HTTP by httptools), so the chat WebSocket, the OpenAI-style HTTP
API, the pages and the metrics share one listener.

The chat WebSocket goes straight to the edge (no framework between a frame and the delivery
core); every HTTP path goes through Starlette's router. The listening socket is bound by the
caller, so a taken port fails with ``OSError`` at once instead of inside uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import uvicorn
from lanes.ws_server import completions, http
from lanes.ws_server.auth import origin_allowed
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

if TYPE_CHECKING:
    from lanes.ws_server.edge import Edge

log = logging.getLogger(__name__)


class EdgeApp:
    """ASGI: ``/v1/chat`` WebSockets to the edge, HTTP to Starlette's routes."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        routes = Starlette(routes=http.routes(edge) + completions.routes(edge),
                           exception_handlers={404: completions.not_routed, 405: completions.not_routed,
                                               Exception: completions.failed})
        allowed = edge.gate.allowed_origins
        self.http: Any = _AllowlistCORS(routes, allowed) if allowed else routes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            if scope["path"] == self.edge.chat_path:
                await self.edge.handle_ws(scope, receive, send)
            else:
                await receive()  # websocket.connect
                # 404, as for HTTP (a close before the accept would read as 403 Forbidden).
                body = f"no WebSocket at {scope['path']}; chats are at {self.edge.chat_path}\n".encode()
                await send({"type": "websocket.http.response.start", "status": 404, "headers": [
                    (b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "websocket.http.response.body", "body": body})
        elif scope["type"] == "http":
            await self.http(scope, receive, send)


class _AllowlistCORS(CORSMiddleware):
    """CORS for the origins of ``LANES_ALLOWED_ORIGINS`` (none when it is empty): a web app on
    one of them may call the OpenAI API (and get WebSocket tickets) with a key from a browser.

    Preflights from those origins are granted for GET and POST with any request headers
    (``Authorization``, ``Content-Type``, the OpenAI SDKs' ``x-stainless-*``), and answers carry
    ``Access-Control-Allow-Origin`` and expose the headers a client acts on (``x-request-id``,
    ``Retry-After``, ``retry-after-ms``). No cookies are read, so credentials mode stays off.
    Origins compare as the WebSocket allowlist compares them (case and a trailing slash aside);
    any other origin's preflight is refused (400), so its page cannot send a JSON body."""

    def __init__(self, app: Any, allowed: frozenset[str]) -> None:
        # No origins for Starlette itself (its "*" would mean any): ``is_allowed_origin`` decides.
        super().__init__(app, allow_origins=(), allow_methods=("GET", "POST"), allow_headers=("*",),
                         allow_private_network=True, max_age=600,
                         expose_headers=("x-request-id", "retry-after", "retry-after-ms"))
        self.allowed = allowed

    def is_allowed_origin(self, origin: str) -> bool:
        return origin_allowed(origin, self.allowed)


#: ``accept()`` errors that mean this process or machine is out of a resource (file descriptors
#: above all: every connection is one); asyncio stops accepting for a second on them.
_OUT_OF_RESOURCE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class _ListenSocket(socket.socket):
    """The edge's listening socket: once out of file descriptors, one warning and one recovery
    line, and one pause of accepting, instead of a traceback per pending connection.

    CPython's selector loop (3.11-3.14 before gh-151615) goes on calling ``accept()`` after
    EMFILE, up to the backlog (2,048) times per wake-up, logging a traceback and scheduling a
    retry each time; the retries then multiply. At ``ulimit -n 64`` and 120 clients the edge
    wrote 1 GB of tracebacks in 4 minutes and never recovered. Here the first such error of a
    wake-up goes to asyncio (which pauses accepting for a second), the rest of that wake-up
    read as "nothing to accept"; asyncio's own report of it is filtered (``_NoAcceptTraceback``)."""

    _paused_until = 0.0
    _exhausted_since: float | None = None

    def accept(self) -> tuple[socket.socket, Any]:
        if time.monotonic() < self._paused_until:
            raise BlockingIOError(errno.EAGAIN, "accepting paused: out of file descriptors")
        try:
            return super().accept()
        except BlockingIOError:
            # Every waiting connection taken: the shortage is over (not at the first accept
            # that works, which the next connection's EMFILE follows while at the limit).
            if self._exhausted_since is not None:
                log.info("accepting connections again after %.1f s", time.monotonic() - self._exhausted_since)
                self._exhausted_since = None
            raise
        except OSError as exc:
            if exc.errno not in _OUT_OF_RESOURCE:
                raise
            now = time.monotonic()
            self._paused_until = now + 0.5  # asyncio's retry comes after 1 s (ACCEPT_RETRY_DELAY)
            if self._exhausted_since is None:
                self._exhausted_since = now
                import resource

                limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
                log.warning("cannot accept new connections: %s (open files limit %d; each connection is one): "
                            "they wait until others close; raise the limit (`ulimit -n`, systemd LimitNOFILE, "
                            "docker --ulimit nofile)", exc.strerror or exc, limit)
            raise


class _NoAcceptTraceback(logging.Filter):
    """asyncio's "socket.accept() out of system resource" (with a traceback): ``_ListenSocket``
    has said it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("socket.accept() out of system resource")


logging.getLogger("asyncio").addFilter(_NoAcceptTraceback())


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind and listen now; raises ``OSError`` (e.g. EADDRINUSE) for the caller to report."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose ``proto`` says TCP,
    # and accepted sockets inherit the listener's. With proto 0, Nagle's algorithm and delayed
    # ACKs held each small frame ~40 ms on loopback.
    sock = _ListenSocket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class _DenialIsComplete(logging.Filter):
    """uvicorn (0.54, websockets-sansio) logs "ASGI callable returned without completing
    handshake." after a handshake refused with ``websocket.http.response.*`` (our 401/403/503),
    although the refusal was sent: it never marks that path complete. Our handler always accepts,
    refuses or closes, so that line can only be this false alarm."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing handshake."


class _NoQueryStrings(logging.Filter):
    """uvicorn logs each WebSocket handshake with its path *and query string* (INFO on
    ``uvicorn.error``, ``access_log`` or not): a refused ``?api_key=`` or a ``?ticket=`` would
    reach the log. Every path argument of a log line keeps its path and loses its query."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(_has_query(a) for a in record.args):
            record.args = tuple(a.split("?", 1)[0] + "?[query hidden]" if _has_query(a) else a for a in record.args)
        return True


def _has_query(arg: object) -> bool:
    return isinstance(arg, str) and arg.startswith("/") and "?" in arg


for _logger in ("uvicorn.error", "uvicorn.access"):
    logging.getLogger(_logger).addFilter(_NoQueryStrings())
logging.getLogger("uvicorn.error").addFilter(_DenialIsComplete())


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the process's runner owns SIGTERM/SIGINT and
    stops us by cancelling ``serve_app``."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _HeadersInTime(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's headers.

    uvicorn times a connection out only once it has answered a request (keep-alive), and any
    byte received cancels that timer: a connection that never completes its headers (slowloris,
    a half-open socket, a stalled WebSocket upgrade) was held forever, and anyone who reaches
    the port could use up the edge's file descriptors. The deadline runs from the connection (or
    the previous response) to the end of the headers; a WebSocket is past it once upgraded."""

    header_timeout_s = 10.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # waiting for the next request (none pipelined)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


class _ClosesInTime(WebSocketsSansIOProtocol):
    """uvicorn's sans-I/O WebSocket protocol, whose own closes let go of a client that reads
    nothing: after its close frame (an unanswered keepalive ping, a frame it cannot parse, a
    close the client began), the TCP connection is dropped ``close_timeout_s`` later if it has
    not gone by then.

    uvicorn closes the transport, and a transport first sends what it buffers: a client that
    reads nothing (a resume's replay written at once, then nothing read) never takes it, so the
    connection, its key's connection slot and the buffered frames were held for as long as the
    client's kernel acknowledged: for ever. The edge's own 4008 close has its timer in
    ``Session``."""

    close_timeout_s = 5.0

    def keepalive_timeout(self) -> None:
        super().keepalive_timeout()
        self._drop_if_still_here()

    def handle_close(self, event: Any) -> None:
        super().handle_close(event)
        self._drop_if_still_here()

    def handle_parser_exception(self) -> None:
        super().handle_parser_exception()
        self._drop_if_still_here()

    def _drop_if_still_here(self) -> None:
        if self.transport.is_closing() and not self.disconnected:
            self.loop.call_later(self.close_timeout_s, self._drop)

    def _drop(self) -> None:
        if not self.disconnected:
            self.transport.abort()


async def serve_app(app: EdgeApp, sock: socket.socket, *, max_frame_bytes: int, compression: bool,
                    graceful_s: float = 2.0, on_shutdown: Callable[[], None] | None = None,
                    header_timeout_s: float = 10.0, ping_interval_s: float = 20.0,
                    ping_timeout_s: float = 20.0, close_timeout_s: float = 5.0) -> None:
    """Serve ``app`` on ``sock`` until cancelled; then call ``on_shutdown`` and close connections
    within ``graceful_s``. A request whose headers take over ``header_timeout_s`` is dropped; a
    WebSocket that does not read up to uvicorn's close frame, ``close_timeout_s`` after it."""
    http = type("HeadersInTime", (_HeadersInTime,), {"header_timeout_s": header_timeout_s})
    ws = type("ClosesInTime", (_ClosesInTime,), {"close_timeout_s": close_timeout_s})
    config = uvicorn.Config(
        app, ws=ws, http=http, lifespan="off", log_config=None, access_log=False,
        ws_max_size=max_frame_bytes, ws_per_message_deflate=compression, ws_ping_interval=ping_interval_s,
        ws_ping_timeout=ping_timeout_s, timeout_graceful_shutdown=int(graceful_s), server_header=False,
    )
    server = _Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if on_shutdown is not None:
            on_shutdown()
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, graceful_s + 3)
        raise
