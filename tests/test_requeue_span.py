"""A worker's death leaves a span in the request's trace, in a real Redis: the reaper's requeue
is ``lanes.requeue``, a child of the edge's ``lanes.enqueue`` (the span the request's payload
carries), naming the lost attempt, the dead worker and the deltas it had streamed."""

from __future__ import annotations

import asyncio

from lanes.queue.messages import ChatMessage, Lane, RequestPayload, TokenEvent
from lanes.queue.plane import QueuePlane, connect
from lanes.queue.settings import RedisSettings
from lanes.scheduler.service import Scheduler
from lanes.scheduler.settings import SchedulerSettings
from lanes.telemetry.tracing import inject_context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import scaled


async def test_a_requeue_after_a_workers_death_is_a_span_in_the_requests_trace(
        redis_settings: RedisSettings, plane: QueuePlane) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("lanes.enqueue") as enqueue:  # the edge's span
        payload = RequestPayload(id="r", messages=(ChatMessage("user", "hi"),), max_tokens=64, lane=Lane.SHORT,
                                 trace=inject_context())
    assert (await plane.enqueue(payload, "edge-1")).created
    conn = connect(plane.settings.redis_url)
    try:
        assert await plane.pop(conn, (Lane.SHORT,), timeout_s=0.2) == ("r", Lane.SHORT)
    finally:
        await conn.aclose()
    assert (await plane.claim("r", "w-dead")).attempt == 1
    await plane.append({"r": [TokenEvent("r", 1, seq, "x", (seq,)) for seq in range(3)]})  # then kill -9

    scheduler = Scheduler(SchedulerSettings(**redis_settings.model_dump()), plane)
    scheduler.tracer = tracer
    async with asyncio.timeout(scaled(10)):
        while not await scheduler.reap_once():  # until the lease (1 s) expires
            await asyncio.sleep(0.1)

    (requeue,) = [s for s in exporter.get_finished_spans() if s.name == "lanes.requeue"]
    assert requeue.context.trace_id == enqueue.get_span_context().trace_id, "the request's trace"
    assert requeue.parent is not None and requeue.parent.span_id == enqueue.get_span_context().span_id
    assert dict(requeue.attributes) == {"lanes.request_id": "r", "lanes.attempt": 1, "lanes.worker": "w-dead",
                                        "lanes.lease_expiries": 1, "lanes.streamed_deltas": 3}
    assert (await plane.claim("r", "w-next")).attempt == 2, "and it runs again"
