"""OpenTelemetry setup and W3C trace-context propagation across processes.

The edge starts a span per request and puts its context (``traceparent``) in the request
payload; the worker continues that trace, so one trace follows a request through Redis.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

log = logging.getLogger(__name__)

TRACER_NAME = "lanes"
#: How long a process's exit waits for its last spans to be exported.
EXIT_FLUSH_S = 2.0


def setup_tracing(service_name: str, exporter: str = "none") -> None:
    """Install a tracer provider for this process.

    ``exporter``: ``none`` (spans are created, so context still propagates, but not
    exported), ``console`` (JSON lines on stdout) or ``otlp`` (OTLP/HTTP; configure with the
    standard ``OTEL_EXPORTER_OTLP_*`` variables; needs the ``[otlp]`` extra).
    """
    # Our own exit hook, not the SDK's: its flush at exit waits up to 30 s for a collector that
    # refuses or never answers (each export retries for OTEL_EXPORTER_OTLP_TIMEOUT, 10 s), which
    # made every SIGTERM under honcho or Kubernetes end in SIGKILL.
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), shutdown_on_exit=False)
    atexit.register(shutdown_within, provider, EXIT_FLUSH_S)
    if exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise SystemExit("otel_exporter=otlp needs: pip install -e '.[otlp]' in the lanes checkout") from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif exporter != "none":
        raise SystemExit(f"unknown otel_exporter {exporter!r}: use none, console or otlp")
    trace.set_tracer_provider(provider)


def shutdown_within(provider: TracerProvider, timeout_s: float) -> bool:
    """Flush and shut ``provider`` down, giving up after ``timeout_s`` (the exporter's threads
    are daemons: what is left unsent is dropped at exit). Whether it finished in time."""
    done = threading.Thread(target=provider.shutdown, name="lanes-trace-shutdown", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.warning("traces not flushed within %.0f s at exit (is the OTLP collector reachable? "
                    "OTEL_EXPORTER_OTLP_ENDPOINT); the last spans are dropped", timeout_s)
        return False
    return True


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
