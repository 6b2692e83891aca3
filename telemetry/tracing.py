"""OpenTelemetry setup and W3C trace-context propagation across processes.

The edge starts a span per request and puts its context (``traceparent``) in the request
payload; the worker continues that trace, so one trace follows a request through Redis.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TextIO

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

log = logging.getLogger(__name__)

TRACER_NAME = "lanes"
#: How long a process's stop waits for its last spans to be exported, counted from the signal
#: that stops it (the export runs while the process drains) or, with no signal, from its exit.
EXIT_FLUSH_S = 2.0
#: The least an exit past that deadline still waits: a collector that answers (a local one, in
#: milliseconds) then takes the spans the drain ended; one that never answers costs only this.
EXIT_FLUSH_MIN_S = 0.2
#: This process's last export (``setup_tracing``), started by ``begin_stop``.
_exit_flush: ExitFlush | None = None


def setup_tracing(service_name: str, exporter: str = "none") -> None:
    """Install a tracer provider for this process.

    ``exporter``: ``none`` (spans are created, so context still propagates, but not
    exported), ``console`` (JSON lines on stdout) or ``otlp`` (OTLP/HTTP; configure with the
    standard ``OTEL_EXPORTER_OTLP_*`` variables; needs the ``[otlp]`` extra).
    """
    # Our own exit hook, not the SDK's: its flush at exit waits up to 30 s for a collector that
    # refuses or never answers (each export retries for OTEL_EXPORTER_OTLP_TIMEOUT, 10 s), which
    # made every SIGTERM under honcho or Kubernetes end in SIGKILL.
    global _exit_flush
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}), shutdown_on_exit=False)
    _exit_flush = ExitFlush(provider)
    atexit.register(_exit_flush.at_exit)
    if exporter == "console":
        # Batched: the write happens on the processor's thread, not on the event loop per span.
        # Line buffered: each span's line is one write, whole, where stdout shares a file or a
        # pipe with the logs on stderr (honcho, lanes up, the tests' logs).
        if hasattr(sys.stdout, "reconfigure"):
            sys.stdout.reconfigure(line_buffering=True)
        provider.add_span_processor(BatchSpanProcessor(console_exporter()))
    elif exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise SystemExit("otel_exporter=otlp needs: pip install -e '.[otlp]' in the lanes checkout") from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif exporter != "none":
        raise SystemExit(f"unknown otel_exporter {exporter!r}: use none, console or otlp")
    trace.set_tracer_provider(provider)


def console_exporter(out: TextIO | None = None) -> ConsoleSpanExporter:
    """Spans as JSON lines on ``out`` (stdout): one compact object per span and line (the SDK's
    default prints each span as indented JSON over many lines)."""
    return ConsoleSpanExporter(out=out or sys.stdout, formatter=lambda span: span.to_json(indent=None) + "\n")


class ExitFlush:
    """A process's last export, bounded by one deadline for its whole stop. A worker drains for
    up to ``LANES_DRAIN_TIMEOUT_S`` and then needs 1-3 s to exit; waiting ``EXIT_FLUSH_S`` more
    for a collector that never answers, after the drain, overran honcho's 5 s before SIGKILL."""

    def __init__(self, provider: TracerProvider, budget_s: float = EXIT_FLUSH_S) -> None:
        self.provider = provider
        self.budget_s = budget_s
        #: ``time.monotonic()`` by which the export must be done; None until the stop begins.
        self.deadline: float | None = None

    def begin(self) -> None:
        """The stop is asked (SIGTERM): export what has ended so far, on a thread, while the
        process drains; the deadline starts now. Idempotent."""
        if self.deadline is not None:
            return
        self.deadline = time.monotonic() + self.budget_s
        threading.Thread(target=self.provider.force_flush, name="lanes-trace-flush", daemon=True).start()

    def exit_wait_s(self) -> float:
        """How long the exit may wait: the whole budget without a signal, else what is left of
        it, at least ``EXIT_FLUSH_MIN_S``."""
        if self.deadline is None:
            return self.budget_s
        return max(self.deadline - time.monotonic(), EXIT_FLUSH_MIN_S)

    def at_exit(self) -> None:
        shutdown_within(self.provider, self.exit_wait_s())


def begin_stop() -> None:
    """Start this process's last export now (the signal that stops it has come)."""
    if _exit_flush is not None:
        _exit_flush.begin()


def shutdown_within(provider: TracerProvider, timeout_s: float) -> bool:
    """Flush and shut ``provider`` down, giving up after ``timeout_s`` (the exporter's threads
    are daemons: what is left unsent is dropped at exit). Whether it finished in time."""
    done = threading.Thread(target=provider.shutdown, name="lanes-trace-shutdown", daemon=True)
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.warning("traces not flushed within %.1f s at exit (is the OTLP collector reachable? "
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
