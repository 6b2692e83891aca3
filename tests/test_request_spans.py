"""The edge's ``lanes.request`` spans (``ws_server/spans.py``): one per request, ended once,
with its first token and its outcome; never left open by a request the core forgot."""

from __future__ import annotations

from lanes.ws_server import delivery
from lanes.ws_server.spans import FORGOTTEN, RequestSpans, server_fault, use
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
