"""The edge's span of each request: from its chat (or resume) frame to its end on this edge.

``lanes.request`` is the parent of ``lanes.enqueue`` (admission and enqueue), whose context the
worker's ``lanes.generate`` continues; it carries the time to first token (a ``lanes.first_token``
event) and the end as the client saw it (``lanes.outcome``, end to end, queue wait). A resume on
this edge of a request another edge (or connection) started opens ``lanes.resume`` instead: its
own trace, since the resume frame carries no trace context, with a span link to the request's
original trace (the ``lanes.enqueue`` context stored with the request in Redis, its ``trace``
field: ``QueuePlane.trace_of``) once the re-point has found it.

Spans end with the core's ``Finished``; a request the core forgets without one (a resume of an
unknown id, a re-point Redis refused) ends at the next ``prune`` as ``forgotten``.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from contextlib import AbstractContextManager

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from lanes.queue.errors import ErrorCode
from lanes.telemetry.tracing import extract_context, tracer
from lanes.ws_server import delivery, protocol
from lanes.ws_server.openai_compat import error_from_frame

_CODES = frozenset(code.value for code in ErrorCode)
#: The span of a request resumed here that this edge did not start.
RESUME = "lanes.resume"
#: An end no-one had to be told about: ``forgotten`` is a resume that never got going.
FORGOTTEN = "forgotten"
#: The longest client ``x-request-id`` kept on a span (longer ones are cut to this).
MAX_CALLER_REQUEST_ID = 128


def caller_request_id(header: str | None) -> str | None:
    """A client's own ``x-request-id`` fit for a span attribute: cut to ``MAX_CALLER_REQUEST_ID``
    characters; None when absent, empty, or holding anything but printable ASCII (the header
    is the client's to fill: no control characters in our traces)."""
    value = (header or "").strip()[:MAX_CALLER_REQUEST_ID]
    if not value or not all(" " <= char <= "~" for char in value):
        return None
    return value


def server_fault(outcome: str) -> bool:
    """An outcome that is the service's failure, not the client's doing or choice (what an
    HTTP server would answer with a 5xx): an engine error, a lost request, no worker..."""
    if outcome in _CODES or outcome in ("oom", "error"):
        return error_from_frame({"code": outcome}).status >= 500
    return False  # stop, length, cancelled, disconnected


class RequestSpans:
    """Open spans by request id (one edge's)."""

    def __init__(self, edge_id: str, tracer_: trace.Tracer | None = None) -> None:
        self.edge_id = edge_id
        self._tracer = tracer_
        self._open: dict[str, Span] = {}
        #: Open ``lanes.resume`` spans not linked to their request's trace yet.
        self._unlinked: set[str] = set()

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._open

    def start(self, request_id: str, name: str = "lanes.request", **attributes: str | float) -> Span:
        """A span for the request, a child of the current context (an OpenAI caller's trace).
        ``lanes.request_id`` is the id in Redis (scoped by API key), ``lanes.client_request_id``
        the one the client sees (frames, ``x-request-id``)."""
        self.end(request_id, FORGOTTEN)  # never two for one id: the older one ends here
        span = (self._tracer or tracer()).start_span(name, kind=SpanKind.SERVER, attributes={
            "lanes.request_id": request_id, "lanes.client_request_id": protocol.client_id(request_id),
            "lanes.edge": self.edge_id, **attributes})
        self._open[request_id] = span
        if name == RESUME and span.is_recording():  # the link costs a Redis read: not for a no-op span
            self._unlinked.add(request_id)
        return span

    def wants_link(self, request_id: str) -> bool:
        """Whether the request's span is a ``lanes.resume`` still without its link."""
        return request_id in self._unlinked and request_id in self._open

    def link_original(self, request_id: str, carrier: Mapping[str, str]) -> None:
        """Link the request's ``lanes.resume`` span to the trace its chat began (``carrier``: the
        W3C context stored with the request); nothing when there is none."""
        self._unlinked.discard(request_id)
        original = trace.get_current_span(extract_context(carrier)).get_span_context()
        if (span := self._open.get(request_id)) is not None and original.is_valid:
            span.add_link(original, {"lanes.link": "resumed_request"})

    def first_token(self, action: delivery.FirstToken) -> None:
        if (span := self._open.get(action.request_id)) is not None:
            span.add_event("lanes.first_token", {"lanes.ttft_ms": round(action.ttft_s * 1000, 3)})

    def finished(self, action: delivery.Finished, pool: str) -> None:
        self._unlinked.discard(action.request_id)
        span = self._open.pop(action.request_id, None)
        if span is None:
            return
        span.set_attribute("lanes.lane", action.lane)
        span.set_attribute("lanes.pool", pool)
        if action.e2e_s is not None:
            span.set_attribute("lanes.e2e_ms", round(action.e2e_s * 1000, 3))
        if action.queue_ms is not None:
            span.set_attribute("lanes.queue_ms", round(action.queue_ms, 3))
        if action.refused:
            span.set_attribute("lanes.refused", True)
            if action.reason:
                span.set_attribute("lanes.refusal_reason", action.reason)
        _close(span, action.outcome)

    def end(self, request_id: str, outcome: str) -> None:
        self._unlinked.discard(request_id)
        if (span := self._open.pop(request_id, None)) is not None:
            _close(span, outcome)

    def prune(self, live: Container[str]) -> None:
        """End the spans of requests the core no longer holds (it forgot them without an end)."""
        for request_id in [r for r in self._open if r not in live]:
            self.end(request_id, FORGOTTEN)

    def end_all(self, outcome: str) -> None:
        for request_id in list(self._open):
            self.end(request_id, outcome)


def _close(span: Span, outcome: str) -> None:
    span.set_attribute("lanes.outcome", outcome)
    if server_fault(outcome):
        span.set_status(Status(StatusCode.ERROR, outcome))
    span.end()


def use(span: Span) -> AbstractContextManager[Span]:
    """Make ``span`` the current one (``lanes.enqueue`` becomes its child); it stays open."""
    return trace.use_span(span, end_on_exit=False)
