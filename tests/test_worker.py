"""The worker in-process against a real redis-server and the real tiny model: it drains the
lanes, and when its engine dies it stops claiming, hands its leases back and raises."""

from __future__ import annotations

import asyncio
import time

import pytest

from lanes.queue.messages import ChatMessage, Lane, RequestPayload
from lanes.queue.plane import QueuePlane
from lanes.workers.engines.base import EngineDead
from lanes.workers.engines.hf import HFEngine
from lanes.workers.settings import WorkerSettings
from lanes.workers.worker import Worker


def worker_for(plane: QueuePlane, model_dir: str, **overrides: object) -> Worker:
    settings = WorkerSettings(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix,
                              lease_ms=plane.settings.lease_ms, heartbeat_s=0.2, max_slots=4, **overrides)
    return Worker(settings, plane, HFEngine(model_dir, max_slots=4))


async def enqueue(plane: QueuePlane, request_id: str, max_tokens: int, lane: Lane = Lane.SHORT,
                  owner: str = "") -> None:
    payload = RequestPayload(id=request_id, messages=(ChatMessage("user", f"hi {request_id}"),),
                             max_tokens=max_tokens, temperature=0.0, lane=lane)
    assert (await plane.enqueue(payload, "edge-x", owner=owner)).created


async def test_burst_worker_drains_every_lane(plane: QueuePlane, tiny_model) -> None:
    for i, lane in enumerate([Lane.LONG, Lane.MEDIUM, Lane.SHORT, Lane.SHORT, Lane.LONG]):
        await enqueue(plane, f"r{i}", 6 if i else 400, lane, owner="key-7")
    worker = worker_for(plane, str(tiny_model.target))
    await asyncio.wait_for(worker.serve(burst=True), 120)
    for i in range(5):
        assert await plane.redis.hget(plane.keys.request(f"r{i}"), "state") == b"done"
        events = await plane.read_stream(f"r{i}")
        assert [e.seq for e in events] == list(range(len(events)))
        assert events[-1].finish is not None and events[-1].finish.usage.completion_tokens <= (6 if i else 400)
    assert worker.table.num_finished["done"] == 5
    # Requests that ended on their own (stop) report their true length for the predictor.
    stops = [i for i in range(5) if (await plane.read_stream(f"r{i}"))[-1].finish.reason.value == "stop"]
    assert stops, "r0 (400 tokens allowed) ends on its own"
    observed = await plane.fleet.observations(10)
    assert sorted(o.prompt for o in observed) == sorted(f"hi r{i}" for i in stops)
    assert {o.owner for o in observed} == {"key-7"}, "counted against the key that sent it"


async def test_engine_death_releases_leases_and_raises(plane: QueuePlane, tiny_model) -> None:
    await enqueue(plane, "first", 2000)
    worker = worker_for(plane, str(tiny_model.target))
    serving = asyncio.create_task(worker.serve())
    while not await plane.read_stream("first"):
        await asyncio.sleep(0.02)
    engine = worker.engine
    assert isinstance(engine, HFEngine)
    await asyncio.to_thread(engine._manager.stop, block=True, timeout=10)  # the engine dies under the worker
    await enqueue(plane, "next", 50)
    with pytest.raises(EngineDead):
        await asyncio.wait_for(serving, 30)
    # Whatever the worker held went straight back to its lane (no lease wait).
    assert await plane.redis.hget(plane.keys.request("next"), "state") == b"queued"
    if await plane.redis.zscore(plane.keys.pending(Lane.SHORT), "next") is None:
        # The worker's last blocking pop, cancelled at exit, took it again: the reaper's
        # start deadline covers exactly that window.
        now = await plane.server_time_ms()
        reaped = {r.id: r.action for r in await plane.reap(now + plane.settings.start_timeout_ms + 10)}
        assert reaped.get("next") == "restored", reaped
    assert await plane.redis.zscore(plane.keys.pending(Lane.SHORT), "next") is not None
    first_state = await plane.redis.hget(plane.keys.request("first"), "state")
    assert first_state in (b"done", b"queued"), "an interrupted request is never lost"


async def test_request_nobody_listens_to_is_cancelled(plane: QueuePlane) -> None:
    """Its edge died and the client never resumed: the worker stops spending the engine on it."""
    from lanes.scheduler.costmodel import get_profile
    from lanes.workers.engines.sim import SimEngine

    await enqueue(plane, "orphan", 2000)  # ~60 s of decoding on the l70-h100 profile
    settings = WorkerSettings(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix,
                              engine="sim", heartbeat_s=0.2, orphan_grace_s=0.5)
    worker = Worker(settings, plane, SimEngine(get_profile("l70-h100"), max_num_seqs=4))
    serving = asyncio.create_task(worker.serve())
    try:
        for _ in range(100):
            if await plane.redis.hget(plane.keys.request("orphan"), "state") == b"cancelled":
                break
            await asyncio.sleep(0.05)
        assert await plane.redis.hget(plane.keys.request("orphan"), "state") == b"cancelled"
        events = await plane.read_stream("orphan")
        assert events[-1].finish is not None and events[-1].finish.reason.value == "cancelled"
        assert events[-1].finish.usage.completion_tokens < 200
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


@pytest.mark.parametrize(("max_tokens", "drain_s", "final"), [(30, 5.0, b"done"), (2000, 0.3, b"queued")])
async def test_stop_drains_then_hands_back(plane: QueuePlane, max_tokens: int, drain_s: float, final: bytes) -> None:
    """SIGTERM (a cancelled serve): running answers may finish within the drain timeout; the
    rest go back to their lane to continue on another worker."""
    from lanes.scheduler.costmodel import get_profile
    from lanes.workers.engines.sim import SimEngine

    await enqueue(plane, "draining", max_tokens)  # ~30 ms per token on the l70-h100 profile
    settings = WorkerSettings(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix,
                              engine="sim", heartbeat_s=0.2, drain_timeout_s=drain_s)
    worker = Worker(settings, plane, SimEngine(get_profile("l70-h100"), max_num_seqs=4))
    serving = asyncio.create_task(worker.serve())
    while not await plane.read_stream("draining"):
        await asyncio.sleep(0.02)
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)
    assert await plane.redis.hget(plane.keys.request("draining"), "state") == final


async def test_a_stopping_worker_stops_counting_at_once_and_leaves_the_registry(plane: QueuePlane) -> None:
    """While it drains, a worker reports itself draining, so its pool counts no worker (edges
    refuse the pool's chats once no other serves it); once stopped, it is out of the registry at
    once. Before, both waited for its report to expire: for ~10 s after the last worker of a pool
    stopped, edges accepted its chats, which then waited a minute for nothing."""
    from lanes.scheduler.costmodel import get_profile
    from lanes.workers.engines.sim import SimEngine

    await enqueue(plane, "long-one", 2000)
    settings = WorkerSettings(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix,
                              engine="sim", heartbeat_s=0.2, drain_timeout_s=1.0)
    worker = Worker(settings, plane, SimEngine(get_profile("l70-h100"), max_num_seqs=4))
    serving = asyncio.create_task(worker.serve())
    while not await plane.read_stream("long-one"):
        await asyncio.sleep(0.02)
    assert await plane.fleet.num_workers("default") == 1
    serving.cancel()
    deadline = time.monotonic() + 0.8  # inside the 1 s drain
    while not any(r.draining for r in await plane.fleet.reports()) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert [r.draining for r in await plane.fleet.reports()] == [True]
    assert await plane.fleet.num_workers("default") == 0 and await plane.fleet.num_workers() == 0
    assert not serving.done(), "still draining"
    await asyncio.gather(serving, return_exceptions=True)
    assert await plane.fleet.reports() == []
    assert await plane.redis.zcard(plane.keys.workers) == 0
    assert await plane.redis.hget(plane.keys.request("long-one"), "state") == b"queued"


async def test_a_busy_engine_hands_the_request_back_to_its_lane(plane: QueuePlane) -> None:
    """``EngineBusy`` (the engine's own queue is full) is transient: the request goes back to
    its lane and runs later, with no error in its stream."""
    from lanes.scheduler.costmodel import get_profile
    from lanes.workers.engines.base import EngineBusy
    from lanes.workers.engines.sim import SimEngine

    class BusyOnce(SimEngine):
        refused: list[str] = []

        async def generate(self, request):  # type: ignore[no-untyped-def]
            if request.id == "busy" and not self.refused:
                self.refused.append(request.id)
                raise EngineBusy("The engine is currently busy and cannot accept new requests.")
            async for delta in super().generate(request):
                yield delta

    await enqueue(plane, "busy", 8)
    settings = WorkerSettings(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix,
                              engine="sim", heartbeat_s=0.2, max_slots=2)
    engine = BusyOnce(get_profile("l70-h100"), max_num_seqs=2, time_scale=100)
    worker = Worker(settings, plane, engine)
    await asyncio.wait_for(worker.serve(burst=True), 60)
    assert engine.refused == ["busy"]
    assert await plane.redis.hget(plane.keys.request("busy"), "state") == b"done"
    assert int(await plane.redis.hget(plane.keys.request("busy"), "attempt")) == 2, "claimed again after the hand-back"
    events = await plane.read_stream("busy")
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[-1].finish is not None and events[-1].finish.reason.value == "length"
    assert all(e.finish is None or e.finish.error_code is None for e in events)


@pytest.mark.parametrize("error, code", [("EngineError('upstream: bad request state')", "engine_error"),
                                         ("KeyError('slot')", "engine_error"),
                                         ("RuntimeError('CUDA out of memory. Tried to allocate 2 GiB')", "oom")])
async def test_an_engine_failure_on_one_request_ends_it_once(plane: QueuePlane, error: str, code: str) -> None:
    """Any other failure of the engine on a request (vLLM and TensorRT-LLM adapters raise a plain
    ``EngineError``; a bug raises anything) ends that request with an error frame, is counted,
    and the worker goes on serving. Before, it went back to its lane, was claimed again at once
    and failed again: 11,634 attempts in 25 s, and the client never got an answer."""
    from lanes.scheduler.costmodel import get_profile
    from lanes.telemetry import metrics
    from lanes.workers.engines.base import EngineError  # noqa: F401 - named in ``error``
    from lanes.workers.engines.sim import SimEngine

    class FailsOn(SimEngine):
        async def generate(self, request):  # type: ignore[no-untyped-def]
            if request.id == "bad":
                raise eval(error)  # the parametrized exception
            async for delta in super().generate(request):
                yield delta

    before = metrics.ENGINE_ERRORS.labels(code)._value.get()
    await enqueue(plane, "bad", 8)
    await enqueue(plane, "good", 8)
    settings = WorkerSettings(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix,
                              engine="sim", heartbeat_s=0.2, max_slots=2)
    worker = Worker(settings, plane, FailsOn(get_profile("l70-h100"), max_num_seqs=2, time_scale=100))
    await asyncio.wait_for(worker.serve(burst=True), 60)
    assert (await plane.request_status("bad"))[0] == "done", "ended (its error frame is its end), not queued again"
    assert int(await plane.redis.hget(plane.keys.request("bad"), "attempt")) == 1, "claimed once"
    (event,) = await plane.read_stream("bad")
    assert event.finish is not None and event.finish.reason.value == "error" and event.finish.error_code == code
    assert (await plane.read_stream("good"))[-1].finish.reason.value == "length", "the worker went on serving"
    assert metrics.ENGINE_ERRORS.labels(code)._value.get() == before + 1
    exported = metrics.generate_latest(metrics.WORKER).decode()
    assert f'lanes_worker_info{{engine="sim",pool="default",worker="{worker.worker_id}"}} 1.0' in exported


async def test_a_fault_in_the_sim_engine_stops_the_worker_and_hands_the_request_back(plane: QueuePlane) -> None:
    """The sim engine's loop fails (a bug in the cost model): the running stream raises
    ``EngineDead`` instead of waiting forever, the worker stops, and the request goes back to
    its lane to continue after its streamed tokens on another worker."""
    from lanes.scheduler.costmodel import get_profile
    from lanes.workers.engines.sim import SimEngine

    profile = get_profile("l70-h100")

    class Faulty:
        def __getattr__(self, name: str) -> object:
            return getattr(profile, name)

        def decode_step_ms(self, *_: object) -> float:
            raise RuntimeError("cost model fault")

    await enqueue(plane, "faulted", 2000)
    settings = WorkerSettings(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix,
                              engine="sim", heartbeat_s=0.2)
    engine = SimEngine(profile, max_num_seqs=4)
    worker = Worker(settings, plane, engine)
    serving = asyncio.create_task(worker.serve())
    while not await plane.read_stream("faulted"):
        await asyncio.sleep(0.02)
    engine.profile = Faulty()
    with pytest.raises(EngineDead, match="cost model fault"):
        await asyncio.wait_for(serving, 30)
    assert await plane.redis.hget(plane.keys.request("faulted"), "state") == b"queued"
    events = await plane.read_stream("faulted")
    assert events and all(e.finish is None for e in events), "streamed tokens kept, no final frame"


async def test_the_batch_size_metric_counts_every_request_on_the_engine(plane: QueuePlane, tiny_model,
                                                                       greedy_reference) -> None:
    """``lanes_batch_size`` is the engine's batch: 8 answers that all run to ``max_tokens``,
    decoding together, make nearly every sample 8. Before, it counted the requests with output in
    each flush, and the transformers engine's steps reach the worker request by request, so a
    flush often caught one step half-submitted (1, then 7)."""
    from lanes.telemetry import metrics

    def samples() -> dict[str, float]:
        return {s.labels["le"]: s.value for m in metrics.BATCH_SIZE.collect() for s in m.samples
                if s.name.endswith("_bucket")}

    prompts = [p for p in (f"Tell me about part {i} of the plan." for i in range(80))
               if len(greedy_reference(p, 60).ids) == 60][:8]
    assert len(prompts) == 8, "prompts whose greedy answers run to 60 tokens"
    before = samples()
    for i, prompt in enumerate(prompts):
        payload = RequestPayload(id=f"b{i}", messages=(ChatMessage("user", prompt),), max_tokens=60,
                                 temperature=0.0, lane=Lane.SHORT)
        assert (await plane.enqueue(payload, "edge-x")).created
    settings = WorkerSettings(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix,
                              heartbeat_s=0.2, max_slots=8)
    worker = Worker(settings, plane, HFEngine(str(tiny_model.target), max_slots=8))
    await asyncio.wait_for(worker.serve(burst=True), 120)
    after = samples()
    added = {le: after[le] - before.get(le, 0.0) for le in after}
    total = added["+Inf"]
    assert total >= 20, added
    # Cumulative buckets: samples of 5 to 8 are those above le=4.
    assert (total - added["4.0"]) / total >= 0.9, added


async def test_a_request_alone_on_the_engine_is_a_batch_of_one_to_its_last_step(plane: QueuePlane) -> None:
    """The flush of a run's last step came after its task had ended, so that step was sampled
    as a batch of 0 (a worker that ran 4 requests: 1,322 samples summing to 1,319)."""
    from lanes.scheduler.costmodel import get_profile
    from lanes.telemetry import metrics
    from lanes.workers.engines.sim import SimEngine

    def count_and_sum() -> tuple[float, float]:
        found = {s.name: s.value for m in metrics.BATCH_SIZE.collect() for s in m.samples}
        return found["lanes_batch_size_count"], found["lanes_batch_size_sum"]

    before = count_and_sum()
    settings = WorkerSettings(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix,
                              engine="sim", sim_time_scale=20, heartbeat_s=0.2)
    worker = Worker(settings, plane, SimEngine(get_profile("l70-h100"), max_num_seqs=4))
    for i in range(3):  # one at a time: each alone on the engine
        await enqueue(plane, f"alone-{i}", 20)
        await asyncio.wait_for(worker.serve(burst=True), 60)
    after = count_and_sum()
    count, total = after[0] - before[0], after[1] - before[1]
    assert count >= 3 and total == count, f"{count} samples summing to {total}: every one should be 1"


async def test_a_malformed_request_fails_alone_and_the_worker_serves_on(plane: QueuePlane) -> None:
    """A job whose record is not lanes' (a payload that is not JSON, written by hand or by another
    program on the prefix) killed the worker that claimed it with a traceback, and the next ones
    after the reaper put it back. Now it ends at its edge with ``malformed_request`` and the
    worker goes on to the next request."""
    from lanes.queue.errors import ErrorCode
    from lanes.scheduler.costmodel import get_profile
    from lanes.workers.engines.sim import SimEngine

    await enqueue(plane, "broken", 5)
    await plane.redis.hset(plane.keys.request("broken"), "p", "not json{")
    await asyncio.sleep(0.005)
    await enqueue(plane, "after", 5)
    settings = WorkerSettings(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix,
                              engine="sim", sim_time_scale=20, heartbeat_s=0.2)
    worker = Worker(settings, plane, SimEngine(get_profile("l70-h100"), max_num_seqs=4))
    await asyncio.wait_for(worker.serve(burst=True), 60)
    assert await plane.redis.hget(plane.keys.request("broken"), "state") == b"failed"
    (end,) = await plane.read_stream("broken")
    assert end.finish is not None and end.finish.error_code == ErrorCode.MALFORMED_REQUEST
    assert "field 'p'" in end.finish.error_message
    assert await plane.redis.hget(plane.keys.request("after"), "state") == b"done"


#: Waits where inf means "never" on purpose (``protect_after_ms`` defaults to it).
INF_MEANS_NEVER = {"protect_after_ms", "starve_after_ms", "fcfs_below_ms", "max_wait_ms"}


def test_worker_float_settings_refuse_nan_and_inf_where_it_breaks_arithmetic() -> None:
    """NaN passed every float setting without a bound (``LANES_PREEMPT_AFTER_MS=nan`` made a
    preemption config that never compares true) and inf passed the timeouts and scales."""
    from pydantic import ValidationError

    floats = {name for name, field in WorkerSettings.model_fields.items() if field.annotation in (float, float | None)}
    assert INF_MEANS_NEVER | {"orphan_grace_s", "drain_timeout_s", "gpu_memory_fraction", "heartbeat_s"} <= floats
    for name in sorted(floats):
        with pytest.raises(ValidationError, match=name):
            WorkerSettings(_env_file=None, **{name: "nan"})
        if name in INF_MEANS_NEVER:
            assert getattr(WorkerSettings(_env_file=None, **{name: "inf"}), name) == float("inf")
        else:
            with pytest.raises(ValidationError, match=name):
                WorkerSettings(_env_file=None, **{name: "inf"})
    with pytest.raises(ValidationError, match="gpu_memory_fraction"):
        WorkerSettings(_env_file=None, gpu_memory_fraction=1.5)
    WorkerSettings(_env_file=None, gpu_memory_fraction=1.0, preempt_after_ms=0, drain_timeout_s=0, orphan_grace_s=0)


async def test_the_running_gauge_counts_a_demoted_run_against_its_later_lane(plane: QueuePlane) -> None:
    """``lanes_worker_running{lane}`` follows the lane a run counts against, as the heartbeat
    reports it (the dashboard's slots per worker, the scheduler's ``lanes_lane_running``). It
    counted each run under its claimed lane for good: a short-lane answer past the short bound
    showed as short in Grafana's "slots in use per worker and lane" and as medium or long on the
    dashboard and in ``lanes_lane_running``, live."""
    from lanes.scheduler.costmodel import get_profile
    from lanes.telemetry import metrics
    from lanes.workers.engines.sim import SimEngine

    def gauges() -> dict[str, float]:
        return {s.labels["lane"]: s.value for m in metrics.RUNNING.collect() for s in m.samples}

    await enqueue(plane, "demoted", 1500, Lane.SHORT)  # short bound: 150 tokens
    settings = WorkerSettings(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix,
                              engine="sim", sim_time_scale=20, heartbeat_s=0.2)
    worker = Worker(settings, plane, SimEngine(get_profile("l70-h100"), max_num_seqs=4))
    assert gauges() == {"short": 0, "medium": 0, "long": 0}, "every lane exported from the start"
    serving = asyncio.create_task(worker.serve(burst=True))
    seen: list[dict[str, float]] = []
    deadline = time.monotonic() + 20
    while not serving.done() and time.monotonic() < deadline:
        seen.append(gauges())
        reported = {lane.value: float(n) for lane, n in worker.running_by_lane().items()}
        if seen[-1]["short"] == 0 and sum(seen[-1].values()) == 1:
            assert {lane: n for lane, n in seen[-1].items() if n} == {k: v for k, v in reported.items() if v}
            break
        await asyncio.sleep(0.05)
    assert seen and seen[-1]["short"] == 0 and sum(seen[-1].values()) == 1, f"never counted past short: {seen[-5:]}"
    assert any(g["short"] == 1 for g in seen), f"counted as short before its demotion: {seen[:5]}"
    await asyncio.wait_for(serving, 60)
    assert gauges() == {"short": 0, "medium": 0, "long": 0}
