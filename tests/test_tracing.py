"""One OpenTelemetry trace follows a request across processes: the worker's span is a child
of the edge's, joined by the W3C traceparent carried in the request payload."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from e2e_support import Client, System

pytestmark = pytest.mark.e2e


def spans(log: Path) -> list[dict]:
    """The JSON spans ConsoleSpanExporter printed into a process log."""
    text, decoder, found, at = log.read_text(), json.JSONDecoder(), [], 0
    while (at := text.find('{\n    "name": ', at)) >= 0:
        span, end = decoder.raw_decode(text, at)
        found.append(span)
        at = end
    return found


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
        await client.close()
    finally:
        system.stop()  # flushes the exporters
    edge = [s for s in spans(tmp_path / "edge.log") if s["name"] == "lanes.enqueue"]
    worker = [s for s in spans(tmp_path / "worker.log") if s["name"] == "lanes.generate"]
    assert len(edge) == 1 and len(worker) == 1
    enqueue, generate = edge[0], worker[0]
    assert enqueue["attributes"]["lanes.request_id"] == generate["attributes"]["lanes.request_id"] == "traced"
    assert generate["context"]["trace_id"] == enqueue["context"]["trace_id"], "one trace across processes"
    assert generate["parent_id"] == enqueue["context"]["span_id"], "the worker's span is the edge's child"
    assert enqueue["resource"]["attributes"]["service.name"] == "lanes-edge"
    assert generate["resource"]["attributes"]["service.name"] == "lanes-worker"
    assert generate["attributes"]["lanes.finish_reason"] in ("stop", "length")
