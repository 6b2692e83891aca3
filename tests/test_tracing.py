"""One OpenTelemetry trace follows a request across processes: the worker's span is a child
of the edge's, joined by the W3C traceparent carried in the request payload."""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path

import pytest
from e2e_support import Client, System

pytestmark = pytest.mark.e2e
#: A caller's W3C trace context (the example of the W3C Trace Context recommendation).
CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def spans(log: Path) -> list[dict]:
    """The spans the console exporter printed into a process log (its stdout and stderr): one
    JSON object per line, among the log lines."""
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"name": ')]


async def test_one_trace_from_edge_to_worker(redis_url: str, tiny_model, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANES_OTEL_EXPORTER", "console")  # spans as JSON on each process's stdout
    system = System(redis_url, f"o{uuid.uuid4().hex[:6]}", tmp_path)
    try:
        system.start("scheduler", ["scheduler"])
        url = system.start_edge()
        system.start_worker("worker", str(tiny_model.target))
        system.wait_workers(1)
        client = await Client.connect(url)
        await client.chat("traced", "Where does this trace go?", max_tokens=4)
        assert (await client.wait("traced"))["type"] == "done"
        await client.chat("too-long", "word " * 3000, max_tokens=4)  # over the tiny model's context
        assert (await client.wait("too-long"))["code"] == "prompt_too_long"
        await client.close()
        # An OpenAI client's own trace: the request joins it (W3C traceparent header).
        body = json.dumps({"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi?"}]})
        request = urllib.request.Request(url.replace("ws://", "http://").replace("/v1/chat", "/v1/chat/completions"),
                                         data=body.encode(), headers={"Content-Type": "application/json",
                                                                      "traceparent": CALLER})
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert json.loads(resp.read())["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        system.stop()  # flushes the exporters
    edge_spans = spans(tmp_path / "edge.log")
    edge = {s["attributes"]["lanes.request_id"]: s for s in edge_spans if s["name"] == "lanes.enqueue"}
    request = {s["attributes"]["lanes.request_id"]: s for s in edge_spans if s["name"] == "lanes.request"}
    worker = {s["attributes"]["lanes.request_id"]: s for s in spans(tmp_path / "worker.log")
              if s["name"] == "lanes.generate"}
    assert len(edge) == len(worker) == 3
    failed = worker["too-long"]
    # The client's mistake (a prompt over the model's context), not the service's failure: the
    # code is recorded, the status is not ERROR (error-rate views would count it as an outage).
    assert failed["status"]["status_code"] == "UNSET" and failed["attributes"]["lanes.error_code"] == "prompt_too_long"
    (joined,) = [s for rid, s in edge.items() if rid.startswith("chatcmpl-")]
    outer = request[joined["attributes"]["lanes.request_id"]]
    assert outer["context"]["trace_id"] == joined["context"]["trace_id"] == "0x" + CALLER.split("-")[1], \
        "the caller's trace"
    assert outer["parent_id"] == "0x" + CALLER.split("-")[2] and joined["parent_id"] == outer["context"]["span_id"]
    assert worker[joined["attributes"]["lanes.request_id"]]["context"]["trace_id"] == joined["context"]["trace_id"]
    enqueue, generate = edge["traced"], worker["traced"]
    assert enqueue["attributes"]["lanes.request_id"] == generate["attributes"]["lanes.request_id"] == "traced"
    assert generate["context"]["trace_id"] == enqueue["context"]["trace_id"], "one trace across processes"
    assert generate["parent_id"] == enqueue["context"]["span_id"], "the worker's span is the edge's child"
    assert enqueue["resource"]["attributes"]["service.name"] == "lanes-edge"
    assert generate["resource"]["attributes"]["service.name"] == "lanes-worker"
    assert generate["attributes"]["lanes.finish_reason"] in ("stop", "length")
    assert generate["attributes"]["lanes.pool"] == "default" and generate["attributes"]["lanes.prompt_tokens"] > 0
    (first,) = [e for e in generate["events"] if e["name"] == "lanes.first_token"]
    assert first["attributes"]["lanes.prefill_ms"] > 0 and first["attributes"]["lanes.prompt_tokens"] > 0
    # The edge's span of the whole request: the enqueue's parent, its first token and its end.
    assert len(request) == 3
    outer = request["traced"]
    assert enqueue["parent_id"] == outer["context"]["span_id"] and outer["kind"] == "SpanKind.SERVER"
    (ttft,) = [e for e in outer["events"] if e["name"] == "lanes.first_token"]
    assert 0 < ttft["attributes"]["lanes.ttft_ms"] <= outer["attributes"]["lanes.e2e_ms"]
    assert outer["attributes"]["lanes.outcome"] in ("stop", "length") and outer["attributes"]["lanes.pool"] == "default"
    assert outer["status"]["status_code"] == "UNSET"
    refused = request["too-long"]  # the client's error, not the service's: no error status
    assert refused["attributes"]["lanes.outcome"] == "prompt_too_long" and refused["status"]["status_code"] == "UNSET"
    assert not [e for e in refused["events"] if e["name"] == "lanes.first_token"]


def test_the_console_exporter_writes_one_json_object_per_line() -> None:
    """``LANES_OTEL_EXPORTER=console`` promised JSON lines; the SDK's default printed each span as
    indented JSON over some 40 lines, which no line-based log shipper can take."""
    import io

    from lanes.telemetry.tracing import console_exporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    out = io.StringIO()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(console_exporter(out)))
    for i in range(3):
        with provider.get_tracer("t").start_as_current_span(f"s{i}", attributes={"lanes.note": "two\nlines"}) as span:
            span.add_event("lanes.first_token", {"lanes.ttft_ms": 1.5})
    provider.shutdown()
    lines = out.getvalue().splitlines()
    assert [json.loads(line)["name"] for line in lines] == ["s0", "s1", "s2"]
    assert json.loads(lines[0])["attributes"]["lanes.note"] == "two\nlines"


def test_exit_does_not_wait_long_for_a_collector_that_never_answers() -> None:
    """At exit the SDK's own hook waited up to 30 s for the last export (a collector that refuses
    or never answers), so every SIGTERM under honcho or Kubernetes ended in SIGKILL. Ours gives
    up after ``EXIT_FLUSH_S``."""
    import threading
    import time

    from lanes.telemetry.tracing import shutdown_within
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    release = threading.Event()

    class Hung(SpanExporter):
        def export(self, spans):  # a collector that never answers
            release.wait(30)
            return SpanExportResult.FAILURE

    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(Hung()))
    provider.get_tracer("t").start_span("s").end()
    started = time.monotonic()
    assert shutdown_within(provider, 0.3) is False
    assert time.monotonic() - started < 2.0
    release.set()
    fine = TracerProvider(shutdown_on_exit=False)
    fine.get_tracer("t").start_span("s").end()
    assert shutdown_within(fine, 5.0) is True


async def test_a_collector_that_never_answers_costs_a_stop_no_time_beyond_the_drain(make_cluster) -> None:
    """Honcho SIGKILLs 5 s after its SIGTERM. The last export used to start at exit, after the
    worker's drain, and waited 2 s more for a collector that never answered: drain + 2 s +
    teardown, over 5 s. It starts at the signal now, so it runs while the process drains."""
    import asyncio
    import socket
    import time

    from conftest import scaled

    with socket.socket() as silent:  # the kernel accepts connections to it; nothing ever answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        env = {"LANES_OTEL_EXPORTER": "otlp", "LANES_DRAIN_TIMEOUT_S": "3",
               "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}"}
        system = make_cluster(workers=1, env=env, worker_args=["--engine", "sim"])
        client = await Client.connect(system.edge_urls["edge"])
        await client.chat("long", "Write a long essay", max_tokens=3000)
        while not client.deltas("long"):  # running on the worker: its stop drains it for 3 s
            await asyncio.sleep(0.05)
        started = time.monotonic()
        system.stop(timeout_s=scaled(10))
        elapsed_s = time.monotonic() - started
        await client.close()
    codes = {name: child.process.returncode for name, child in system.children.items()}
    assert codes == {"scheduler": 0, "edge": 0, "worker": 0}, codes
    assert elapsed_s < scaled(4.5), f"the stop took {elapsed_s:.1f} s"
    for name in codes:
        log = (system.log_dir / f"{name}.log").read_text()
        assert "Traceback" not in log, log[-3000:]


async def test_a_run_handed_back_at_a_workers_stop_says_so_on_its_span(make_cluster) -> None:
    """A stop past the drain cancels each run and hands it back to its lane: its ``lanes.generate``
    span ended with no outcome at all (a CancelledError records nothing), unlike a preempted one."""
    import asyncio

    from conftest import scaled

    env = {"LANES_OTEL_EXPORTER": "console", "LANES_DRAIN_TIMEOUT_S": "0"}
    system = make_cluster(workers=1, env=env, worker_args=["--engine", "sim"])
    client = await Client.connect(system.edge_urls["edge"])
    await client.chat("long", "Write a long essay", max_tokens=3000)
    async with asyncio.timeout(scaled(30)):
        while not client.deltas("long"):  # running on the worker
            await asyncio.sleep(0.05)
    system.stop(names=["worker"], timeout_s=scaled(10))
    await client.close()
    assert system.children["worker"].process.returncode == 0
    (generate,) = [s for s in spans(system.log_dir / "worker.log") if s["name"] == "lanes.generate"]
    assert generate["kind"] == "SpanKind.CONSUMER"
    assert generate["attributes"]["lanes.outcome"] == "handed_back"
    assert generate["attributes"]["lanes.handed_back_because"] == "worker_stopping"
    assert generate["status"]["status_code"] == "UNSET", "a stop is not the request's failure"
    (back,) = [e for e in generate["events"] if e["name"] == "lanes.handed_back"]
    assert back["attributes"]["lanes.completion_tokens"] > 0
