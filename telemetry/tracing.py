"""OpenTelemetry setup and W3C trace-context propagation across processes.

The edge starts a span per request and puts its context (``traceparent``) in the request
payload; the worker continues that trace, so one trace follows a request through Redis.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

log = logging.getLogger(__name__)

TRACER_NAME = "lanes"


def setup_tracing(service_name: str, exporter: str = "none") -> None:
    """Install a tracer provider for this process.

    ``exporter``: ``none`` (spans are created, so context still propagates, but not
    exported), ``console`` (JSON lines on stdout) or ``otlp`` (OTLP/HTTP; configure with the
    standard ``OTEL_EXPORTER_OTLP_*`` variables; needs the ``[otlp]`` extra).
    """
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise SystemExit("otel_exporter=otlp needs: pip install 'lanes[otlp]'") from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif exporter != "none":
        raise SystemExit(f"unknown otel_exporter {exporter!r}: use none, console or otlp")
    trace.set_tracer_provider(provider)


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject_context(span_context: context.Context | None = None) -> dict[str, str]:
    """The current (or given) trace context as W3C headers, for a message payload."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=span_context)
    return carrier


def extract_context(carrier: Mapping[str, str]) -> context.Context:
    """A context to start child spans from, out of W3C headers in a payload."""
    return propagate.extract(dict(carrier))


@contextlib.contextmanager
def caller_context(headers: Mapping[str, str]) -> Iterator[None]:
    """Spans started inside are children of the caller's trace when its request carries a W3C
    ``traceparent`` header (an OpenAI client instrumented with OpenTelemetry); else as before."""
    if "traceparent" not in headers:
        yield
        return
    token = context.attach(propagate.extract({k: v for k, v in headers.items() if k in ("traceparent", "tracestate")}))
    try:
        yield
    finally:
        context.detach(token)
