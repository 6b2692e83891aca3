"""The policy in the live system (real Redis, the worker and scheduler in-process, the sim
engine): demotion by attained service, hand-back preemption, and the ``LANES_POLICY`` switch."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from lanes.queue.messages import ChatMessage, Lane, RequestPayload
from lanes.queue.plane import QueuePlane
from lanes.scheduler.costmodel import get_profile
from lanes.scheduler.service import Scheduler
from lanes.scheduler.settings import SchedulerSettings
from lanes.workers.engines.sim import SimEngine
from lanes.workers.settings import WorkerSettings
from lanes.workers.worker import Worker
from lanes.ws_server.edge import Edge
from lanes.ws_server.settings import EdgeSettings


async def enqueue(plane: QueuePlane, rid: str, lane: Lane, max_tokens: int) -> None:
    payload = RequestPayload(id=rid, messages=(ChatMessage("user", f"hi {rid}"),), max_tokens=max_tokens,
                             temperature=0.0, lane=lane)
    assert (await plane.enqueue(payload, "edge-x")).created


@contextlib.asynccontextmanager
async def running(plane: QueuePlane, slots: int, time_scale: float, **overrides: object) -> AsyncIterator[Worker]:
    """A worker (sim engine, ``slots`` slots) and a scheduler, both in this process."""
    common = {"redis_url": plane.settings.redis_url, "key_prefix": plane.settings.key_prefix, "lease_ms": 2000}
    settings = WorkerSettings(**common, heartbeat_s=0.1, max_slots=slots, **overrides)
    worker = Worker(settings, plane, SimEngine(get_profile("l70-h100"), max_num_seqs=slots, time_scale=time_scale))
    scheduler = Scheduler(SchedulerSettings(**common, depth_interval_s=0.1, predictor_refresh_minutes=0), plane)
    tasks = [asyncio.create_task(worker.serve()), asyncio.create_task(scheduler.serve())]
    try:
        yield worker
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def state(plane: QueuePlane, rid: str) -> str:
    return (await plane.request_status(rid))[0]


async def until(condition, timeout_s: float = 30) -> None:  # noqa: ANN001
    async def wait() -> None:
        while not await condition():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(wait(), timeout_s)


async def test_a_long_run_is_handed_back_when_a_short_request_waits_too_long(plane: QueuePlane) -> None:
    async with running(plane, slots=1, time_scale=1.0, preempt_after_ms=300, max_long_slots=1,
                       min_long_slots=0) as worker:
        await enqueue(plane, "long", Lane.LONG, 300)
        await until(lambda: _streamed(plane, "long", 3))
        await enqueue(plane, "short", Lane.SHORT, 5)
        await until(lambda: _is(plane, "short", "done"))  # served while "long" was handed back
        assert worker.table.num_finished["preempted"] == 1
        # The hand-back spent its re-prefill (prompt + streamed tokens) from the worker's budget.
        assert worker._reprefill_budget.tokens < worker.policy.preemption.reprefill_burst_tokens
        await until(lambda: _is(plane, "long", "done"), 60)
    await _resumed_whole(plane, "long", 300)


async def test_no_hand_back_without_a_reprefill_budget(plane: QueuePlane) -> None:
    """The same wait with no re-prefill budget (``LANES_PREEMPT_BUDGET_TOKENS=0``): the long run
    keeps its slot and the short request waits for it (under a backlog that never clears,
    hand-backs back to back would re-prefill work already done: the budget bounds that loss;
    the arithmetic of a partly spent one is ``test_preemption``'s)."""
    async with running(plane, slots=1, time_scale=1.0, preempt_after_ms=300, max_long_slots=1,
                       min_long_slots=0, preempt_budget_tokens=0, preempt_reprefill_share=0.0) as worker:
        await enqueue(plane, "long", Lane.LONG, 300)
        await until(lambda: _streamed(plane, "long", 3))
        await enqueue(plane, "short", Lane.SHORT, 5)
        await until(lambda: _is(plane, "long", "done"), 60)
        await until(lambda: _is(plane, "short", "done"))
        assert worker.table.num_finished["preempted"] == 0


async def test_a_short_run_past_its_bound_counts_against_the_long_lane(plane: QueuePlane) -> None:
    async with running(plane, slots=2, time_scale=4.0, preempt_after_ms=0, max_long_slots=1,
                       max_medium_long_slots=1, min_long_slots=0) as worker:
        await enqueue(plane, "chatty", Lane.SHORT, 600)  # predicted short, answers long
        await until(lambda: _streamed(plane, "chatty", 220))
        assert worker.running_by_lane() == {Lane.LONG: 1}, "demoted past the short bound"
        await enqueue(plane, "long", Lane.LONG, 5)
        await asyncio.sleep(0.5)
        assert await state(plane, "long") == "queued", "the long cap is held by the demoted run"
        await enqueue(plane, "short", Lane.SHORT, 5)
        await until(lambda: _is(plane, "short", "done"))  # the short slot is free again
        await until(lambda: _is(plane, "long", "done"), 60)


async def test_fcfs_is_one_lane_and_open_slots(plane: QueuePlane) -> None:
    edge = Edge(EdgeSettings(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix,
                             policy="fcfs"), plane)
    assert {edge.policy.lane_for(n) for n in (1, 300, 5000)} == {Lane.MEDIUM}
    async with running(plane, slots=4, time_scale=50.0, policy="fcfs", max_long_slots=1, min_long_slots=0) as worker:
        assert worker.slots.max_long == 4 and worker.policy.preemption is None
        for i in range(4):
            await enqueue(plane, f"m{i}", Lane.MEDIUM, 50)
        await until(lambda: _all_done(plane, [f"m{i}" for i in range(4)]))


async def test_lanes_step_aside_while_prompts_dominate_the_work(plane: QueuePlane) -> None:
    # No slot for the long lane at all; the worker's last finished requests decide whether that holds.
    async with running(plane, slots=2, time_scale=50.0, max_long_slots=0, max_medium_long_slots=0,
                       min_long_slots=0, fcfs_above_prefill_share=0.6) as worker:
        for _ in range(100):
            worker.work_mix.observe(1000, 200)  # chat-like: answers are most of the work
        assert worker.prefill_share() < 0.6
        await enqueue(plane, "long", Lane.LONG, 5)
        await asyncio.sleep(0.5)
        assert await state(plane, "long") == "queued", "capped out while answers dominate"
        for _ in range(1000):
            worker.work_mix.observe(4000, 10)  # prompt-heavy: code completion, RAG
        assert worker.prefill_share() > 0.9
        await until(lambda: _is(plane, "long", "done"))


async def test_one_keys_long_prompts_do_not_switch_the_lanes_off_for_everyone(plane: QueuePlane) -> None:
    """Real requests with their API keys feed the window: one key sending only long prompts with
    max_tokens 1 counts for a quarter of the work at most, so the lanes stay; the same traffic
    from several keys is a prompt-heavy deployment, and they step aside."""

    async def send(prefix: str, owners: list[str], n: int, content: str, max_tokens: int) -> list[str]:
        ids = [f"{prefix}{i}" for i in range(n)]
        for i, rid in enumerate(ids):
            payload = RequestPayload(id=rid, messages=(ChatMessage("user", f"{content} {rid}"),), max_tokens=max_tokens,
                                     temperature=0.0, lane=Lane.SHORT)
            assert (await plane.enqueue(payload, "edge-x", owner=owners[i % len(owners)])).created
        return ids

    async def finish(ids: list[str]) -> None:
        await until(lambda: _all_done(plane, ids), timeout_s=60.0)

    long_prompt = "def f(x):\n    return x\n" * 350  # ~2,000 prompt tokens
    async with running(plane, slots=8, time_scale=50.0, max_long_slots=0, max_medium_long_slots=0,
                       min_long_slots=0, fcfs_above_prefill_share=0.6) as worker:
        await finish(await send("chat", [f"chat-{k}" for k in range(4)], 120, "hi", 60))
        await finish(await send("flood", ["flood"], 300, long_prompt, 1))
        assert worker.work_mix.num_keys == 5 and len(worker.work_mix) == 420
        assert worker.prefill_share() < 0.3, "the flood counts for a quarter of the work at most"
        await enqueue(plane, "long", Lane.LONG, 5)
        await asyncio.sleep(0.5)
        assert await state(plane, "long") == "queued", "the lanes (here: no long slot) still hold"
        await finish(await send("rag", [f"rag-{k}" for k in range(3)], 300, long_prompt, 1))
        assert worker.work_mix.num_keys >= 8 and worker.prefill_share() > 0.6  # 9 once "long" (no key) ran
        await until(lambda: _is(plane, "long", "done"))


async def _resumed_whole(plane: QueuePlane, rid: str, num_tokens: int) -> None:
    """``rid`` was handed back once and resumed after its tokens: no gap, no repeat."""
    events = await plane.read_stream(rid)
    assert [e.seq for e in events] == list(range(len(events))), "resumed after its tokens: no gap, no repeat"
    assert events[-1].finish is not None and events[-1].finish.usage.completion_tokens == num_tokens
    assert await plane.redis.hget(plane.keys.request(rid), "preempted") == b"1"


async def _streamed(plane: QueuePlane, rid: str, num: int) -> bool:
    return len(await plane.read_stream(rid)) >= num


async def _is(plane: QueuePlane, rid: str, wanted: str) -> bool:
    return await state(plane, rid) == wanted


async def _all_done(plane: QueuePlane, ids: list[str]) -> bool:
    return all([await state(plane, rid) == "done" for rid in ids])


def test_worker_wait_bound_setting_reaches_the_slot_config() -> None:
    import math

    import pytest
    from pydantic import ValidationError

    assert WorkerSettings(max_slots=8).slots(8).max_wait_ms == 600_000.0
    assert WorkerSettings(max_slots=8, max_wait_ms=30_000).slots(8).max_wait_ms == 30_000.0
    assert WorkerSettings(max_slots=8, max_wait_ms=0).slots(8).max_wait_ms == math.inf
    with pytest.raises(ValidationError, match="max_wait_ms"):
        WorkerSettings(max_wait_ms=-1)


def test_worker_slot_defaults_are_the_simulators_and_scale_with_the_slots() -> None:
    """One slot config for the workers and the simulator (``lanes_slot_config``): unset counts are
    shares of the slots, so raising LANES_MAX_SLOTS raises the caps and the guarantee with it."""
    import pytest
    from lanes.scheduler.live_policy import lanes_slot_config
    from pydantic import ValidationError

    for n in (1, 2, 8, 64):
        assert WorkerSettings(max_slots=n).slots(n) == lanes_slot_config(n)
    eight = WorkerSettings().slots(8)
    assert (eight.max_long, eight.max_medium_long, eight.min_long, eight.fcfs_below_ms) == (6, 7, 1, 8000.0)
    # The FCFS-below bound follows the engine: 4 s where the engine chunks prefill, unless set.
    assert [WorkerSettings(engine=e).slots(8).fcfs_below_ms for e in ("hf", "sim", "vllm", "trtllm")] == [
        8000.0, 4000.0, 4000.0, 4000.0]
    assert WorkerSettings(engine="sim", sim_chunked_prefill=False).slots(8).fcfs_below_ms == 8000.0
    assert WorkerSettings(engine="vllm", fcfs_below_ms=8000).slots(8).fcfs_below_ms == 8000.0
    assert WorkerSettings(engine="hf", fcfs_below_ms=0).slots(8).fcfs_below_ms == 0.0
    wide = WorkerSettings(max_slots=64).slots(64)
    assert (wide.max_long, wide.max_medium_long, wide.min_long) == (48, 60, 6)
    # Two slots keep one for the short lane; one slot runs every lane and still guarantees long.
    assert (lanes_slot_config(2).max_long, lanes_slot_config(2).max_medium_long) == (1, 1)
    assert (lanes_slot_config(1).max_long, lanes_slot_config(1).min_long) == (1, 1)
    # A count set explicitly wins over the share; the engine's own limit still caps the guarantee.
    mine = WorkerSettings(max_slots=8, max_long_slots=2, max_medium_long_slots=3, min_long_slots=4).slots(8)
    assert (mine.max_long, mine.max_medium_long, mine.min_long) == (2, 3, 4)
    assert WorkerSettings(max_slots=8, min_long_slots=4).slots(1).min_long == 1
    with pytest.raises(ValidationError, match="max_long_slots"):
        WorkerSettings(max_long_slots=-1)


def test_slot_counts_that_do_not_fit_the_slots_or_each_other_are_refused_with_the_numbers() -> None:
    """These were accepted: a guarantee above the slots was cut down, a cap above them or a
    medium + long cap below the long one could never bind. Every count the defaults give, at
    any slot count, and the open-slots setting of the benchmarks (both caps = the slots) pass."""
    import pytest
    from lanes.cli.failures import settings_error
    from pydantic import ValidationError

    for values, named in (
        ({"min_long_slots": 9}, "LANES_MIN_LONG_SLOTS (9) is above LANES_MAX_SLOTS (8)"),
        ({"max_long_slots": 20}, "LANES_MAX_LONG_SLOTS (20) is above LANES_MAX_SLOTS (8): set at most 8"),
        ({"max_medium_long_slots": 9}, "LANES_MAX_MEDIUM_LONG_SLOTS (9) is above LANES_MAX_SLOTS (8)"),
        ({"max_long_slots": 5, "max_medium_long_slots": 3},
         "LANES_MAX_MEDIUM_LONG_SLOTS (3) is below LANES_MAX_LONG_SLOTS (5): long requests count toward the "
         "medium + long cap too, so at most 3 could run"),
        ({"max_long_slots": 8},
         "LANES_MAX_MEDIUM_LONG_SLOTS (7, its default at 8 slots) is below LANES_MAX_LONG_SLOTS (8)"),
        ({"min_medium_slots": 8}, "LANES_MIN_LONG_SLOTS (1, its default at 8 slots) + LANES_MIN_MEDIUM_SLOTS (8) is "
                                  "above LANES_MAX_SLOTS (8)"),
        ({"max_slots": 1, "min_long_slots": 2}, "LANES_MIN_LONG_SLOTS (2) is above LANES_MAX_SLOTS (1)"),
    ):
        with pytest.raises(ValidationError) as refused:
            WorkerSettings(_env_file=None, **{"max_slots": 8, **values})
        assert named in (settings_error(refused.value) or ""), settings_error(refused.value)
    for n in (*range(1, 70), 128, 256):
        shares = WorkerSettings(_env_file=None, max_slots=n).slots(n)
        WorkerSettings(_env_file=None, max_slots=n, max_long_slots=shares.max_long,
                       max_medium_long_slots=shares.max_medium_long, min_long_slots=shares.min_long)
        WorkerSettings(_env_file=None, max_slots=n, max_long_slots=n, max_medium_long_slots=n, min_long_slots=n)
    # A medium + long cap alone, below the default long cap, is that cap in effect.
    assert WorkerSettings(_env_file=None, max_slots=8, max_medium_long_slots=3).slots(8).max_medium_long == 3


async def test_a_demoted_run_is_handed_back_to_the_long_lane_when_a_short_request_waits(plane: QueuePlane) -> None:
    """Predicted short, answers long: past its bound it counts as long, and when a short request
    has waited past the bound with no free slot it is handed back into the long lane, then resumes
    after its streamed tokens."""
    async with running(plane, slots=1, time_scale=1.0, preempt_after_ms=300, min_long_slots=0,
                       preempt_demoted=True) as worker:
        assert worker.policy.preemption is not None and worker.policy.preemption.hand_back_demoted
        await enqueue(plane, "chatty", Lane.SHORT, 400)
        await until(lambda: _streamed(plane, "chatty", 220))  # demoted past the short bound (200)
        await enqueue(plane, "short", Lane.SHORT, 5)
        await until(lambda: _is(plane, "short", "done"))
        assert worker.table.num_finished["preempted"] == 1
        await until(lambda: _is(plane, "chatty", "done"), 60)
    await _resumed_whole(plane, "chatty", 400)


async def test_demoted_runs_are_kept_by_default(plane: QueuePlane) -> None:
    async with running(plane, slots=1, time_scale=1.0, preempt_after_ms=300, min_long_slots=0) as worker:
        assert worker.policy.preemption is not None and not worker.policy.preemption.hand_back_demoted
        await enqueue(plane, "chatty", Lane.SHORT, 300)
        await until(lambda: _streamed(plane, "chatty", 220))
        await enqueue(plane, "short", Lane.SHORT, 5)
        await until(lambda: _is(plane, "chatty", "done"), 60)
        assert worker.table.num_finished["preempted"] == 0
        await until(lambda: _is(plane, "short", "done"))
