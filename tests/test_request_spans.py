"""The edge's ``lanes.request`` spans (``ws_server/spans.py``): one per request, ended once,
with its first token and its outcome; never left open by a request the core forgot; naming the
request as the client sees it."""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import StartEdge
from lanes.ws_server import delivery
from lanes.ws_server.spans import (
    FORGOTTEN,
    MAX_CALLER_REQUEST_ID,
    RequestSpans,
    caller_request_id,
    server_fault,
    use,
)
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode


def spans_with_exporter() -> tuple[RequestSpans, InMemorySpanExporter, trace.Tracer]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    return RequestSpans("edge-1", tracer), exporter, tracer


def test_a_request_span_carries_its_first_token_and_outcome_and_parents_the_enqueue() -> None:
    spans, exporter, tracer = spans_with_exporter()
    span = spans.start("r1", **{"lanes.max_tokens": 64})
    with use(span):
        tracer.start_span("lanes.enqueue").end()
    spans.first_token(delivery.FirstToken("short", 0.0123, "r1"))
    spans.finished(delivery.Finished("r1", "short", "stop", 0.5, 4.0), "default")
    assert "r1" not in spans and len(spans) == 0
    enqueue, request = exporter.get_finished_spans()
    assert enqueue.parent is not None and enqueue.parent.span_id == request.context.span_id
    assert request.kind is trace.SpanKind.SERVER
    assert request.attributes["lanes.outcome"] == "stop" and request.attributes["lanes.pool"] == "default"
    assert request.attributes["lanes.e2e_ms"] == 500.0 and request.attributes["lanes.queue_ms"] == 4.0
    assert [(e.name, e.attributes["lanes.ttft_ms"]) for e in request.events] == [("lanes.first_token", 12.3)]
    assert request.status.status_code is StatusCode.UNSET


def test_service_failures_are_errors_and_client_mistakes_are_not() -> None:
    spans, exporter, _ = spans_with_exporter()
    for rid, outcome in [("a", "worker_failed"), ("b", "oom"), ("c", "unavailable"), ("d", "request_lost"),
                         ("e", "prompt_too_long"), ("f", "overloaded"), ("g", "cancelled"), ("h", "disconnected"),
                         ("i", "length")]:
        spans.start(rid)
        spans.finished(delivery.Finished(rid, "short", outcome, refused=outcome == "overloaded",
                                         reason="lane_full" if outcome == "overloaded" else ""), "default")
    status = {s.attributes["lanes.request_id"]: s.status.status_code for s in exporter.get_finished_spans()}
    assert {r for r, code in status.items() if code is StatusCode.ERROR} == {"a", "b", "c", "d"}
    (overloaded,) = [s for s in exporter.get_finished_spans() if s.attributes["lanes.request_id"] == "f"]
    assert overloaded.attributes["lanes.refused"] is True and overloaded.attributes["lanes.refusal_reason"] == "lane_full"
    assert server_fault("engine_error") and not server_fault("stop") and not server_fault("duplicate_id")


def test_a_request_the_core_forgot_ends_at_the_next_prune_and_none_stays_open() -> None:
    spans, exporter, _ = spans_with_exporter()
    spans.start("kept")
    spans.start("forgotten", "lanes.resume", **{"lanes.resumed_after": 3})
    spans.prune({"kept": object()})  # the core's entries: a resume of an unknown id is gone
    (ended,) = exporter.get_finished_spans()
    assert ended.name == "lanes.resume" and ended.attributes["lanes.outcome"] == FORGOTTEN
    spans.start("kept")  # the same id again: the older span ends, never two open for one id
    assert len(spans) == 1 and len(exporter.get_finished_spans()) == 2
    spans.end_all("edge_stopped")
    assert len(spans) == 0 and exporter.get_finished_spans()[-1].attributes["lanes.outcome"] == "edge_stopped"
    spans.finished(delivery.Finished("kept", "short", "stop"), "default")  # already ended: nothing happens
    assert len(exporter.get_finished_spans()) == 3


def test_a_callers_own_x_request_id_is_kept_when_short_and_printable() -> None:
    assert caller_request_id(" req-42 ") == "req-42"
    assert caller_request_id("x" * 500) == "x" * MAX_CALLER_REQUEST_ID
    assert caller_request_id(None) is None and caller_request_id("  ") is None
    assert caller_request_id("evil\x1b[31m") is None and caller_request_id("na\u00efve") is None


async def test_the_edges_spans_name_the_id_the_client_sees(start_edge: StartEdge,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """With API keys on, ``lanes.request_id`` is the id in Redis (``<key id>/chatcmpl-...``), which
    no client sees: the frames and ``x-request-id`` carry ``chatcmpl-...``, and a caller's own
    ``x-request-id`` was dropped. Both are on the spans now, each in its own attribute."""
    import urllib.error
    import urllib.request

    import websockets
    from e2e_support import Client
    from lanes.ws_server import intake
    from lanes.ws_server import spans as spans_module
    from lanes.ws_server.auth import generate_key, hash_key, key_id

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(spans_module, "tracer", lambda: provider.get_tracer("test"))
    monkeypatch.setattr(intake, "tracer", lambda: provider.get_tracer("test"))
    key = generate_key()
    base = await start_edge(api_key_hashes=hash_key(key))
    scope = key_id(hash_key(key))

    def post() -> str:  # a model nobody serves: refused at once, the answer naming the request
        body = json.dumps({"model": "nobody-serves-this", "messages": [{"role": "user", "content": "hi"}]})
        request = urllib.request.Request(f"http://{base}/v1/chat/completions", data=body.encode(), headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {key}", "x-request-id": "caller-7"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 404
        return refused.value.headers["x-request-id"]

    seen = await asyncio.to_thread(post)
    (http,) = [s for s in exporter.get_finished_spans() if s.name == "lanes.request"]
    assert seen.startswith("chatcmpl-") and http.attributes["lanes.request_id"] == f"{scope}/{seen}"
    assert http.attributes["lanes.client_request_id"] == seen
    assert http.attributes["lanes.client_x_request_id"] == "caller-7"

    ws = await websockets.connect(f"ws://{base}/v1/chat", additional_headers={"Authorization": f"Bearer {key}"})
    client = Client(ws)
    await client.chat("q1", "hello")  # no worker here: it is enqueued and waits
    async with asyncio.timeout(10):
        while not client.frames["q1"]:
            await asyncio.sleep(0.01)
    await client.close()
    (enqueue,) = [s for s in exporter.get_finished_spans() if s.name == "lanes.enqueue"]
    assert enqueue.attributes["lanes.request_id"] == f"{scope}/q1"
    assert enqueue.attributes["lanes.client_request_id"] == "q1"


async def test_a_resume_on_another_edge_links_to_the_requests_own_trace(start_edge: StartEdge,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``lanes.resume`` is a trace of its own (the resume frame carries no context), but the
    request's ``traceparent`` is stored with it in Redis: the resume's span links to it, so a
    trace viewer goes from the resume to the chat that started the request."""
    import websockets
    from e2e_support import Client
    from lanes.ws_server import intake
    from lanes.ws_server import spans as spans_module

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(spans_module, "tracer", lambda: provider.get_tracer("test"))
    monkeypatch.setattr(intake, "tracer", lambda: provider.get_tracer("test"))
    first, second = await start_edge(), await start_edge()

    client = Client(await websockets.connect(f"ws://{first}/v1/chat"))
    await client.chat("r1", "hello")  # no worker here: it is enqueued and waits
    async with asyncio.timeout(10):
        while not client.frames["r1"]:
            await asyncio.sleep(0.01)
    assert client.frames["r1"][0]["type"] == "accepted"
    await client.close()
    client = Client(await websockets.connect(f"ws://{second}/v1/chat"))
    await client.send({"type": "resume", "id": "r1", "last_seq": -1})
    async with asyncio.timeout(10):
        while not client.frames["r1"]:
            await asyncio.sleep(0.01)
    assert client.frames["r1"][0]["type"] == "resumed", client.frames["r1"]
    await client.send({"type": "cancel", "id": "r1"})  # ends it, and the resume's span with it
    async with asyncio.timeout(10):
        while not [s for s in exporter.get_finished_spans() if s.name == "lanes.resume"]:
            await asyncio.sleep(0.01)
    await client.close()
    (enqueue,) = [s for s in exporter.get_finished_spans() if s.name == "lanes.enqueue"]
    (resume,) = [s for s in exporter.get_finished_spans() if s.name == "lanes.resume"]
    assert enqueue.kind is trace.SpanKind.PRODUCER
    assert resume.context.trace_id != enqueue.context.trace_id, "a trace of its own"
    assert [(link.context.trace_id, link.context.span_id) for link in resume.links] == \
        [(enqueue.context.trace_id, enqueue.context.span_id)], "linked to where the request began"
    assert resume.links[0].attributes["lanes.link"] == "resumed_request"


def test_a_resume_wants_its_link_only_where_spans_are_recorded() -> None:
    """The link costs a Redis read (of the request's ``trace`` field): a no-op span (tracing off, the
    default) asks for none, a recorded one does until it has it."""
    from lanes.ws_server.spans import RESUME

    spans, _, _ = spans_with_exporter()
    spans.start("r1", RESUME)
    assert spans.wants_link("r1")
    spans.link_original("r1", {})
    assert not spans.wants_link("r1")
    off = RequestSpans("edge-1", trace.NoOpTracer())
    off.start("r2", RESUME)
    assert not off.wants_link("r2")
