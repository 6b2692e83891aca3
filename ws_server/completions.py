"""``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /v1/models/{name}``: the OpenAI
chat API on the edge's port.

A completion takes the same path as a WebSocket chat: the delivery core registers it on a
connection of its own (one request), then limits, prediction, lane, admission and the enqueue
run as for any chat. The core's frames for that connection go to an ``HttpSession``, which the
response reads: server-sent ``chat.completion.chunk`` events (``stream: true``), or one
``chat.completion`` at the end. The lane is in the ``x-lanes-lane`` header, the pool that serves
it in ``x-lanes-pool`` and in ``model`` (for ``auto``, the pool it chose). A client that goes
away cancels its request at once (there is no resume over HTTP).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from lanes.queue.errors import ErrorCode, QueueUnavailable
from lanes.telemetry import metrics
from lanes.telemetry.tracing import caller_context
from lanes.ws_server import openai_compat as oai
from lanes.ws_server.protocol import nesting_exceeds
from lanes.ws_server.spans import caller_request_id
from lanes.ws_server.auth import Identity, Refusal
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

if TYPE_CHECKING:
    from lanes.ws_server.edge import Edge

COMPLETIONS_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"
_decode_frame = msgspec.json.Decoder(dict[str, Any]).decode
#: A stream with nothing to send for this long gets an SSE comment (clients skip it), so that
#: proxies and load balancers with idle timeouts (nginx 60 s, AWS ALB 60 s) keep it open.
KEEPALIVE_S = 15.0
T = TypeVar("T")
#: What ``/v1/models`` answers while Redis (where workers register) cannot be read.
REDIS_DOWN = oai.APIError(503, "the queue is unavailable; retry shortly", "server_error", "unavailable",
                          retry_after_ms=1000)
#: nginx buffers proxied responses unless told not to: tokens would arrive in bursts.
SSE_HEADERS = {"X-Accel-Buffering": "no"}
#: The access log's status for a client that left before its request was read (nginx's 499).
CLIENT_CLOSED_REQUEST = 499


class HttpSession:
    """The frames of one HTTP request's connection, decoded, for its response to read."""

    def __init__(self) -> None:
        self.closed = False
        self.frames: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def send(self, frame: bytes) -> None:
        if not self.closed:
            self.frames.put_nowait(_decode_frame(frame))

    def close(self, _code: int, reason: str) -> None:
        """Its API key was revoked (``Edge.close_revoked``, which cancels its request): end the
        exchange with a 401 (a stream: an error event and ``[DONE]``) instead of keeping it open
        with nothing more to come."""
        if not self.closed:
            self.frames.put_nowait({"type": "error", "code": oai.KEY_REVOKED,
                                    "message": f"{reason} while this request ran: it was cancelled"})

    def interrupt(self, message: str) -> None:
        """End the exchange now with ``unavailable`` (the edge is stopping; HTTP has no resume):
        a stream gets an error event and ``[DONE]``, a request waiting for its answer a 503."""
        if not self.closed:
            self.frames.put_nowait({"type": "error", "code": "unavailable", "message": message,
                                    "retry_after_ms": 1000})


def _error(error: oai.APIError, request_id: str | None = None) -> Response:
    headers = error.headers() if request_id is None else {**error.headers(), "x-request-id": request_id}
    return Response(error.body(), error.status, media_type="application/json", headers=headers)


def _refused_request(error: oai.APIError, request_id: str) -> Response:
    """A body refused before it became a chat: counted in ``lanes_requests_total`` (by its code)
    and ``lanes_errors_total`` as the WebSocket's refused chat frames are (the codes are a
    fixed set)."""
    # The series keep our name where OpenAI's differs, as a WebSocket chat's refusal counts it
    # (one refusal, one outcome name, whichever API it came by).
    code = error.counted_as or error.code or "invalid_request"
    metrics.count_refused_request(code)
    metrics.ERRORS.labels(code).inc()
    return _error(error, request_id)


def _content_type_refusal(content_type: str | None, encoding: str | None = None) -> oai.APIError | None:
    """Anything but JSON is refused: the types a browser may POST cross-site without asking first
    (CORS "simple requests": text/plain, forms) and a body with no Content-Type at all (a page's
    ``fetch`` of a Blob, ``sendBeacon``), so that no web page can make a visitor's browser spend
    this server's GPUs blind. So is a compressed body (``Content-Encoding: gzip``): it was read
    as it came and refused as "not valid JSON ... (byte 0)", which named nothing the client did."""
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        return oai.APIError(415, f"the body is sent with Content-Encoding: {encoding.strip()[:32]}; this server "
                            "reads request bodies uncompressed only (leave the header out and send plain JSON)",
                            code="unsupported_media_type")
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return None
    return oai.APIError(415, f"the body must be JSON sent as Content-Type: application/json (got "
                        f"{media or 'no Content-Type'}; with curl: -H 'Content-Type: application/json')",
                        code="unsupported_media_type")


async def not_routed(request: Request, exc: Exception) -> Response:
    """Starlette's 404 / 405: in OpenAI's error shape under ``/v1/`` (SDKs read ``error.message``),
    plain text elsewhere."""
    assert isinstance(exc, HTTPException)
    path = request.url.path
    named = {"x-request-id": _other_request_id()}
    if path.startswith(("/chat/completions", "/models")):  # an SDK whose base_url lacks /v1
        error = oai.APIError(404, f"no such endpoint: {request.method} {path}; the OpenAI API is under /v1 "
                             f"(an OpenAI client's base_url ends in /v1: http://{request.url.netloc}/v1)")
        return Response(error.body(), 404, media_type="application/json", headers=named)
    if not path.startswith("/v1/"):
        return PlainTextResponse(exc.detail, exc.status_code, headers=exc.headers)
    what = "no such endpoint" if exc.status_code == 404 else f"method {request.method} is not allowed here"
    error = oai.APIError(exc.status_code, f"{what}: {request.method} {path} (the OpenAI API here: "
                         f"POST {COMPLETIONS_PATH}, GET {MODELS_PATH}, GET {MODELS_PATH}/{{model}})")
    return Response(error.body(), exc.status_code, media_type="application/json", headers={**(exc.headers or {}),
                                                                                            **named})


async def failed(request: Request, exc: Exception) -> Response:
    """A fault of ours (an exception no route caught): under ``/v1/`` a 500 in OpenAI's shape, so
    that an SDK reads a message and retries as it does any 500, instead of Starlette's plain
    "Internal Server Error"; elsewhere that plain text. The server logs the traceback still."""
    if not request.url.path.startswith("/v1/"):
        return PlainTextResponse("Internal Server Error", 500)
    error = oai.APIError(500, f"the server failed on this request ({type(exc).__name__}); retry it, and report it "
                         "if it persists", "server_error", ErrorCode.INTERNAL.value)
    return Response(error.body(), 500, media_type="application/json", headers={"x-request-id": _other_request_id()})


def _other_request_id() -> str:
    """``x-request-id`` of an answer that is not a chat's (whose id is its ``chatcmpl-`` id)."""
    return f"req_{uuid.uuid4().hex}"


def _refused(refusal: Refusal, request_id: str | None = None) -> Response:
    code = {401: "invalid_api_key", 403: "forbidden_origin"}.get(refusal.status.value, refusal.code)
    kind = "invalid_request_error" if refusal.status.value < 500 else "server_error"
    error = oai.APIError(refusal.status.value, refusal.message, kind, code,
                         retry_after_ms=1000 if refusal.status.value == 503 else None)
    headers = {**refusal.headers(), **error.headers(), **({"x-request-id": request_id} if request_id else {})}
    return Response(error.body(), error.status, media_type="application/json", headers=headers)


def routes(edge: Edge) -> list[BaseRoute]:
    #: A model's ``created`` (OpenAI's is when the model was made): when this edge started, not
    #: each call's time.
    started = int(time.time())

    async def chat_completions(request: Request) -> Response:
        # Every answer names the request (``x-request-id``), refusals too: the SDKs show it
        # (``APIStatusError.request_id``), and it is what an operator greps the logs for.
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        verdict = await edge.gate.check(COMPLETIONS_PATH, request.headers)
        if isinstance(verdict, Refusal):
            return _refused(verdict, request_id)
        try:
            raw = await _body(request, edge.limits.max_frame_bytes)
        except ClientDisconnect:  # it left while sending its body: nobody to answer, nothing to log
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BodyTooSlow as slow:
            response = _refused_request(oai.APIError(408, str(slow), code="request_timeout"), request_id)
            response.headers["Connection"] = "close"  # the rest may still be on the wire
            return response
        if raw is None:
            response = _refused_request(oai.APIError(413, f"the body exceeds {edge.limits.max_frame_bytes} bytes",
                                                     code="frame_too_large"), request_id)
            # Past the drain bounds (``_body``) the rest of the body is still on the wire: close
            # the connection after the answer, or the server would parse it as the next request.
            response.headers["Connection"] = "close"
            return response
        if (wrong_type := _content_type_refusal(request.headers.get("content-type"),
                                                request.headers.get("content-encoding"))) is not None:
            return _refused_request(wrong_type, request_id)
        too_deep = oai.APIError(400, f"the body is nested deeper than {edge.limits.max_nesting} levels",
                                code="invalid_json")
        try:
            body = msgspec.json.decode(raw)
            if nesting_exceeds(raw, body, edge.limits.max_nesting):  # as for a WebSocket frame
                return _refused_request(too_deep, request_id)
            parsed = oai.parse_request(body, edge.limits)
        except RecursionError:  # deeper than the interpreter's recursion limit: valid JSON still
            return _refused_request(too_deep, request_id)
        except (msgspec.DecodeError, UnicodeError) as exc:
            return _refused_request(oai.APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json"),
                                    request_id)
        except oai.APIError as error:
            return _refused_request(error, request_id)
        return await _complete(edge, request, verdict, parsed, request_id)

    async def models(request: Request) -> Response:
        """``GET /v1/models`` (the list), ``GET /v1/models/{name}`` (one, or 404)."""
        request_id = _other_request_id()
        verdict = await edge.gate.check(MODELS_PATH, request.headers)
        if isinstance(verdict, Refusal):
            return _refused(verdict, request_id)
        try:
            names = await edge.model_names()
            name = request.path_params.get("name")
            body = oai.models(names, started) if name is None else oai.model(name, names, started)
        except QueueUnavailable:
            return _error(REDIS_DOWN, request_id)
        except oai.APIError as error:
            return _error(error, request_id)
        return Response(body, media_type="application/json", headers={"x-request-id": request_id})

    return [Route(COMPLETIONS_PATH, chat_completions, methods=["POST"]),
            Route(MODELS_PATH, models, methods=["GET"]),
            Route(MODELS_PATH + "/{name:path}", models, methods=["GET"])]


#: A body over the limit is still read, and dropped, up to this many bytes and for at most
#: DISCARD_S seconds before the 413 goes out: a client still sending then reads the answer
#: instead of a connection reset. Past either bound the edge answers and closes at once.
DISCARD_MAX_BYTES = 16 << 20
DISCARD_S = 2.0
#: The whole body must arrive within this long: the server's header timeout ends at the headers,
#: and a body sent a byte a second held its connection (and a slot of the server's) with no end.
#: Longer for a larger ``LANES_MAX_FRAME_BYTES``: at least ``MIN_BODY_BYTES_PER_S`` of it.
BODY_S = 30.0
MIN_BODY_BYTES_PER_S = 64 << 10


def body_deadline_s(max_bytes: int, declared: int = 0) -> float:
    """How long a body may take to arrive: by its declared length when it has one, else by the
    limit, never past what ``DISCARD_MAX_BYTES`` needs (a huge limit must not reopen the hold)."""
    return max(BODY_S, min(declared or max_bytes, max_bytes, DISCARD_MAX_BYTES) / MIN_BODY_BYTES_PER_S)


class BodyTooSlow(Exception):
    """The body did not arrive within ``deadline_s`` (``body_deadline_s``)."""

    def __init__(self, deadline_s: float) -> None:
        super().__init__(f"the body did not arrive within {deadline_s:g} s")
        self.deadline_s = deadline_s


async def _body(request: Request, max_bytes: int) -> bytes | None:
    """The request body, or None when it passes ``max_bytes`` (declared or, for a chunked body,
    as it arrives); the rest of such a body is drained within the bounds above."""
    try:
        declared = int(request.headers.get("content-length") or 0)
    except ValueError:
        return None
    if declared > DISCARD_MAX_BYTES:
        return None
    loop = asyncio.get_running_loop()
    chunks, size, over = [], 0, declared > max_bytes
    deadline_s = body_deadline_s(max_bytes, declared)
    try:
        async with asyncio.timeout(DISCARD_S if over else deadline_s) as budget:
            async for chunk in request.stream():
                size += len(chunk)
                if size > DISCARD_MAX_BYTES:
                    break
                if not over and size > max_bytes:
                    over = True
                    chunks.clear()
                    budget.reschedule(loop.time() + DISCARD_S)
                if not over:
                    chunks.append(chunk)
    except TimeoutError:
        if not over:
            raise BodyTooSlow(deadline_s) from None
    return None if over else b"".join(chunks)


async def _complete(edge: Edge, request: Request, identity: Identity, parsed: oai.CompletionRequest,
                    request_id: str) -> Response:
    created, model = int(time.time()), parsed.frame.model or "default"
    session = HttpSession()
    conn = edge.open_session(session, identity)
    finished = False  # the answer (or the refusal) was delivered
    handed_to_stream = False  # the streaming response's own ``finally`` closes the session
    try:
        with caller_context(request.headers):
            await edge.on_chat(conn, identity, dataclasses.replace(parsed.frame, id=request_id),
                               caller_request_id(request.headers.get("x-request-id")))
        first = await session.frames.get()  # accepted, or the error that refused it (already queued)
        if (refused := oai.ending_error(first)) is not None:
            finished = True
            return _error(refused, request_id)
        headers = {"x-lanes-lane": str(first.get("lane", "")), "x-request-id": request_id,
                   "Cache-Control": "no-cache"}
        if pool := first.get("pool"):  # "auto" answers with the pool it chose, as OpenAI names the model served
            model = headers["x-lanes-pool"] = str(pool)
        if parsed.stream:
            # The status waits for the answer's first frame (up to one keep-alive period): a
            # refusal by the worker (the prompt is too long for the model, its chat template
            # refuses the messages) is then a 4xx, as OpenAI answers, not an error event after a
            # 200 that SDKs cannot tell from a failure mid-answer.
            held = await _until_frame_or_gone(request, session.frames.get(), KEEPALIVE_S)
            if held is _GONE:
                return Response(status_code=499)
            if held is not None and (error := oai.ending_error(held)) is not None:
                finished = True
                return Response(error.body(), error.status, media_type="application/json",
                                headers={**headers, **error.headers()})
            handed_to_stream = True
            return StreamingResponse(_events(edge, conn, session, request_id, created, model, parsed.include_usage,
                                             held), media_type="text/event-stream", headers={**headers, **SSE_HEADERS})
        body = await _until_frame_or_gone(request, _collect(session, request_id, created, model))
        finished = body is not _GONE
        if body is _GONE:
            return Response(status_code=499)  # nobody is listening any more
        status, payload, error_headers = body
        return Response(payload, status, media_type="application/json", headers={**headers, **error_headers})
    finally:
        if not handed_to_stream:
            edge.close_session(conn, abandoned=not finished)


async def _events(edge: Edge, conn: int, session: HttpSession, request_id: str, created: int, model: str,
                  include_usage: bool, first: dict[str, Any] | None) -> AsyncIterator[bytes]:
    """The SSE stream; ``first`` is the answer's first frame if it came before the headers."""
    ended = False
    try:
        yield oai.chunk(request_id, created, model, {"role": "assistant", "content": ""}, with_usage=include_usage)
        while True:
            if first is not None:
                frame, first = first, None
            else:
                try:
                    frame = await asyncio.wait_for(session.frames.get(), KEEPALIVE_S)
                except TimeoutError:  # queued, or a long prefill: keep proxies from closing an idle stream
                    yield oai.KEEPALIVE
                    continue
            kind = frame["type"]
            if kind == "delta":
                yield oai.chunk(request_id, created, model, {"content": frame["text"]}, with_usage=include_usage)
            elif (failed := oai.ending_error(frame)) is not None:
                ended = True
                yield oai.error_event(failed)
                yield oai.DONE
                return
            elif kind == "done":
                ended = True
                yield oai.chunk(request_id, created, model, {}, oai.finish_reason(frame), with_usage=include_usage)
                if include_usage:
                    yield oai.usage_chunk(request_id, created, model, oai.usage(frame))
                yield oai.DONE
                return
    finally:  # also when the client went away (Starlette cancels the stream)
        edge.close_session(conn, abandoned=not ended)


async def _collect(session: HttpSession, request_id: str, created: int,
                   model: str) -> tuple[int, bytes, dict[str, str]]:
    """The whole answer as one ``chat.completion``, or the error it ended with (status, body,
    the error's headers: ``Retry-After``)."""
    parts: list[str] = []
    while True:
        frame = await session.frames.get()
        if frame["type"] == "delta":
            parts.append(frame["text"])
        elif (error := oai.ending_error(frame)) is not None:
            return error.status, error.body(), error.headers()
        elif frame["type"] == "done":
            return 200, oai.completion(request_id, created, model, "".join(parts), oai.finish_reason(frame),
                                       oai.usage(frame)), {}


#: What ``_until_frame_or_gone`` returns when the client disconnected first.
_GONE: Any = object()


async def _until_frame_or_gone(request: Request, awaitable: Awaitable[T], timeout_s: float | None = None) -> T | None:
    """``awaitable``'s result; ``_GONE`` if the client disconnected first, None after ``timeout_s``."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    answer, watcher = asyncio.ensure_future(awaitable), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({answer, watcher}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not answer.done():
            answer.cancel()
    if answer.done() and not answer.cancelled():
        return answer.result()
    return _GONE if watcher.done() and not watcher.cancelled() else None
