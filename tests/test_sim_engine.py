"""The sim engine runs at the cost profile's pace (scaled) and honours the engine protocol."""

from __future__ import annotations

import asyncio
import time

import pytest
from lanes.queue.messages import ChatMessage, FinishReason
from lanes.scheduler.costmodel import SpecDecoding, get_profile
from lanes.workers.engines.base import Engine, EngineRequest, RequestRejected
from lanes.workers.engines.sim import SimEngine

PROFILE = get_profile("l70-h100")
PROMPT = (ChatMessage("user", "x" * 4096),)  # ~1024 tokens


def request(rid: str, max_tokens: int) -> EngineRequest:
    return EngineRequest(id=rid, messages=PROMPT, max_tokens=max_tokens)


async def collect(engine: SimEngine, req: EngineRequest) -> tuple[list, float]:
    started = time.perf_counter()
    deltas = [d async for d in engine.generate(req)]
    return deltas, time.perf_counter() - started


async def test_decode_pace_matches_profile() -> None:
    engine = SimEngine(PROFILE, time_scale=2.0)
    assert isinstance(engine, Engine)
    await engine.start()
    try:
        deltas, elapsed_s = await collect(engine, request("a", 41))
    finally:
        await engine.close()
    expected_s = (PROFILE.prefill_step_ms(1024) + 40 * PROFILE.decode_step_ms(1)) / 1000.0 / 2.0
    assert elapsed_s == pytest.approx(expected_s, rel=0.15)
    assert len(deltas) == 41 and deltas[-1].finish_reason is FinishReason.LENGTH
    assert "".join(d.text for d in deltas).split() == [f"tok{i}" for i in range(41)]
    assert deltas[0].prompt_tokens == 1024
    stats = engine.stats()
    assert stats["steps"] == 40 and stats["batch_size_hist"] == {1: 40} and stats["running"] == 0


async def test_batching_steps_all_running_together() -> None:
    engine = SimEngine(PROFILE, time_scale=4.0, max_num_seqs=4)
    await engine.start()
    try:
        results = await asyncio.gather(*(collect(engine, request(str(i), 30)) for i in range(6)))
    finally:
        await engine.close()
    assert all(len(deltas) == 30 for deltas, _ in results)
    hist = engine.stats()["batch_size_hist"]
    assert max(hist) == 4  # never more than max_num_seqs at once
    # 6 requests of 29 decode steps in batches of <= 4 take far fewer than 6 * 29 steps.
    assert engine.stats()["steps"] < 3 * 29


async def test_abort_ends_generation_with_cancelled() -> None:
    engine = SimEngine(PROFILE, time_scale=10.0)
    await engine.start()
    try:
        seen = []
        async for delta in engine.generate(request("c", 10_000)):
            seen.append(delta)
            if len(seen) == 3:
                await engine.abort("c")
        assert seen[-1].finish_reason is FinishReason.CANCELLED
        assert engine.stats()["running"] == 0
    finally:
        await engine.close()


async def test_speculative_decoding_reports_acceptance() -> None:
    spec = SpecDecoding(acceptance_rate=0.7, num_draft_tokens=4, draft_cost_ratio=0.0)
    engine = SimEngine(PROFILE, time_scale=10.0, spec=spec, seed=1)
    await engine.start()
    try:
        deltas, _ = await collect(engine, request("s", 301))
    finally:
        await engine.close()
    assert sum(len(d.token_ids) for d in deltas) == 301
    assert engine.stats()["steps"] < 300 / 1.8
    assert engine.stats()["acceptance"] == pytest.approx(0.7 * (1 - 0.7**4) / (1 - 0.7) / 4, abs=0.12)


async def test_rejects_nothing_left_to_generate() -> None:
    engine = SimEngine(PROFILE)
    with pytest.raises(RequestRejected):
        await anext(engine.generate(EngineRequest(id="r", messages=PROMPT, max_tokens=2, resume_token_ids=(1, 2))))


async def test_stop_string_ends_the_answer_before_it() -> None:
    """``stop=[" tok<N>"]``: exactly N tokens, finish ``stop``, in the time N tokens take."""
    engine = SimEngine(PROFILE, time_scale=4.0)
    await engine.start()
    try:
        stopped, stop_s = await collect(engine, EngineRequest(id="s", messages=PROMPT, max_tokens=4096,
                                                              stop=(" tok12",)))
        length, length_s = await collect(engine, request("l", 12))
        one, _ = await collect(engine, EngineRequest(id="o", messages=PROMPT, max_tokens=4096, stop=(" tok1",)))
    finally:
        await engine.close()
    assert "".join(d.text for d in stopped).split() == [f"tok{i}" for i in range(12)]
    assert stopped[-1].finish_reason is FinishReason.STOP and sum(len(d.token_ids) for d in stopped) == 12
    assert stop_s == pytest.approx(length_s, rel=0.2)
    assert "".join(d.text for d in one).split() == ["tok0"] and one[-1].finish_reason is FinishReason.STOP


def long_prompt(rid: str, num_tokens: int, max_tokens: int) -> EngineRequest:
    return EngineRequest(id=rid, messages=(ChatMessage("user", "x" * (4 * num_tokens)),), max_tokens=max_tokens)


async def test_chunked_prefill_splits_a_long_prompt_at_the_token_budget() -> None:
    """A 5,000-token prompt alone, 2,048 tokens a step: three prefill iterations (2,048 +
    2,048 + 904) costing prefill(5000) plus the fixed cost prefill(0) of the two later ones,
    as the trace simulator's ``_chunked_iteration`` charges them; then it decodes."""
    engine = SimEngine(PROFILE, time_scale=2.0, max_num_batched_tokens=2048)
    await engine.start()
    try:
        deltas, elapsed_s = await collect(engine, long_prompt("p", 5000, 11))
    finally:
        await engine.close()
    stats = engine.stats()
    assert stats["prefills"] == 3 and stats["mixed"] == 0 and stats["steps"] == 10
    expected_ms = PROFILE.prefill_step_ms(5000) + 2 * PROFILE.prefill_step_ms(0) + 10 * PROFILE.decode_step_ms(1)
    assert elapsed_s == pytest.approx(expected_ms / 1000.0 / 2.0, rel=0.15)
    assert "".join(d.text for d in deltas).split() == [f"tok{i}" for i in range(11)]


async def test_chunked_prefill_keeps_decoding_while_a_prompt_is_prefilled() -> None:
    """With chunked prefill a running answer decodes in every iteration that prefills a new
    prompt (mixed iterations), and the new request gets no token before its whole prompt is in;
    v0 (``chunked_prefill=False``) stops decoding for the prefill instead."""
    for chunked in (True, False):
        engine = SimEngine(PROFILE, time_scale=20.0, max_num_batched_tokens=2048 if chunked else 8192,
                           chunked_prefill=chunked)
        await engine.start()
        try:
            running = engine.generate(request("a", 200))
            first = await anext(running)  # "a" is decoding now
            late = asyncio.create_task(collect(engine, long_prompt("b", 6000, 5)))
            rest = [d async for d in running]
            deltas, _ = await late
        finally:
            await engine.close()
        assert len([first, *rest]) == 200 and sum(len(d.token_ids) for d in deltas) == 5
        stats = engine.stats()
        # "b": 6,000 tokens in chunks of at most 2,047 (one token goes to "a"'s decode): 3 mixed steps.
        assert stats["mixed"] == (3 if chunked else 0)
        assert stats["prefills"] == (3 if chunked else 1) + 1  # + "a"'s own prefill
        assert stats["running"] == stats["prefilling"] == stats["waiting"] == 0


async def test_chunked_prefill_holds_slots_while_prefilling() -> None:
    """A request prefilling in chunks holds its slot: with 2 slots and 3 long prompts the third
    waits, and the batch never holds more than 2."""
    engine = SimEngine(PROFILE, time_scale=20.0, max_num_seqs=2, max_num_batched_tokens=2048)
    await engine.start()
    try:
        results = await asyncio.gather(*(collect(engine, long_prompt(str(i), 3000, 20)) for i in range(3)))
    finally:
        await engine.close()
    assert all(sum(len(d.token_ids) for d in deltas) == 20 for deltas, _ in results)
    assert max(engine.stats()["batch_size_hist"]) == 2


async def test_abort_while_prefilling_in_chunks() -> None:
    engine = SimEngine(PROFILE, time_scale=20.0, max_num_batched_tokens=2048)
    await engine.start()
    try:
        stream = engine.generate(long_prompt("x", 8000, 10))
        waiter = asyncio.create_task(anext(stream))
        while not engine.stats()["prefilling"]:
            await asyncio.sleep(0.001)
        await engine.abort("x")
        delta = await waiter
        assert delta.finish_reason is FinishReason.CANCELLED and delta.token_ids == ()
        assert engine.stats()["prefilling"] == engine.stats()["running"] == 0
    finally:
        await engine.close()


def test_chunked_prefill_needs_a_token_per_slot() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SimEngine(PROFILE, max_num_seqs=64, max_num_batched_tokens=32)
    SimEngine(PROFILE, max_num_seqs=64, max_num_batched_tokens=32, chunked_prefill=False)


async def test_a_dead_engine_loop_fails_every_stream() -> None:
    """A fault in the engine loop must not leave streams waiting forever: each raises
    ``EngineDead`` (the worker then stops and its requests go back to their lanes)."""
    from lanes.workers.engines.base import EngineDead

    engine = SimEngine(PROFILE, time_scale=20.0)
    await engine.start()
    try:
        stream = engine.generate(request("a", 1000))
        await anext(stream)

        class Faulty:  # the cost model fails on the next decode step
            def __getattr__(self, name: str) -> object:
                return getattr(PROFILE, name)

            def decode_step_ms(self, *_: object) -> float:
                raise RuntimeError("model fault")

        engine.profile = Faulty()
        with pytest.raises(EngineDead, match="model fault"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDead):
            await anext(engine.generate(request("b", 10)))
    finally:
        await engine.close()
