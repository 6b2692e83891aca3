"""The vLLM adapter's output handling, driven by objects shaped exactly like vLLM's.

``CompletionOutput`` / ``RequestOutput`` below copy the fields of ``vllm/outputs.py``
(vllm-project/vllm, main): in DELTA mode ``outputs[0].text`` / ``token_ids`` hold only the new
part and ``finish_reason`` is one of ``FINISH_REASON_STRINGS`` (``vllm/v1/engine/__init__.py``:
stop, length, abort, error, repetition). Exceptions mirror ``vllm/v1/engine/exceptions.py`` and
``vllm/exceptions.py`` by name, which is all the adapter looks at.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import gpu_with

from lanes.queue.messages import ChatMessage, FinishReason
from lanes.workers.engines.base import EngineDead, EngineDelta, EngineError, RequestRejected
from lanes.workers.engines.vllm import (
    DeltaRelay, delta_from_output, error_from_exception, merge_deltas,
)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None
    logprobs: Any
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Any = None
    num_cached_tokens: int | None = None


def out(text: str, ids: Sequence[int], finish: str | None = None) -> RequestOutput:
    completion = CompletionOutput(0, text, list(ids), None, None, finish_reason=finish)
    return RequestOutput("r1", None, [1, 2, 3], None, [completion], finished=finish is not None)


class EngineDeadError(Exception):
    pass


class VLLMClientError(Exception):
    pass


class VLLMValidationError(VLLMClientError):
    pass


class GracefulHTTPError(ValueError):
    pass


class QueueOverflowError(GracefulHTTPError):
    pass


def test_delta_carries_new_tokens_and_text() -> None:
    assert delta_from_output(out(" hello", [11, 12]), 3) == EngineDelta((11, 12), " hello", None, 3)


@pytest.mark.parametrize("raw, ours", [
    ("stop", FinishReason.STOP), ("length", FinishReason.LENGTH),
    ("abort", FinishReason.CANCELLED), ("error", FinishReason.ERROR),
    ("repetition", FinishReason.STOP),
])
def test_final_output_maps_finish_reason(raw: str, ours: FinishReason) -> None:
    delta = delta_from_output(out("", [2], raw), 3)
    assert delta is not None and delta.finish_reason == ours and delta.token_ids == (2,)


def test_empty_running_output_is_skipped_and_bare_finish_is_kept() -> None:
    assert delta_from_output(out("", []), 3) is None
    bare = RequestOutput("r1", None, None, None, [], finished=True)  # STREAM_FINISHED's shape
    assert delta_from_output(bare, 3) == EngineDelta((), "", FinishReason.STOP, 3)


@pytest.mark.parametrize("exc, kind, code", [
    (EngineDeadError("EngineCore encountered an issue."), EngineDead, "engine_dead"),
    (VLLMValidationError("The decoder prompt (length 9000) is longer than the maximum model "
                         "length of 4096."), RequestRejected, "prompt_too_long"),
    (VLLMValidationError("temperature must be non-negative"), RequestRejected, "invalid_request"),
    (ValueError("top_p must be in (0, 1]"), RequestRejected, "invalid_request"),
    (QueueOverflowError(), RequestRejected, "overloaded"),
    (RuntimeError("boom"), EngineError, "engine_error"),
])
def test_error_mapping(exc: BaseException, kind: type, code: str) -> None:
    mapped = error_from_exception(exc)
    assert type(mapped) is kind and mapped.code == code


def test_merge_deltas_concatenates_in_order() -> None:
    merged = merge_deltas([EngineDelta((1,), "a", None, 3), EngineDelta((2, 3), "bc", None, 3),
                           EngineDelta((4,), "", FinishReason.LENGTH, 3)])
    assert merged == EngineDelta((1, 2, 3, 4), "abc", FinishReason.LENGTH, 3)


async def source(deltas: list[EngineDelta], *, fail: BaseException | None = None,
                 hang: bool = False) -> AsyncIterator[EngineDelta]:
    for delta in deltas:
        yield delta
        await asyncio.sleep(0)
    if fail is not None:
        raise fail
    if hang:
        await asyncio.Event().wait()


async def test_relay_streams_until_finish() -> None:
    deltas = [EngineDelta((1,), "a", None, 3), EngineDelta((2,), "b", FinishReason.STOP, 3)]
    got = [d async for d in DeltaRelay(source(deltas), 3)]
    assert merge_deltas(got) == merge_deltas(deltas) and got[-1].finish_reason == FinishReason.STOP


async def test_relay_merges_a_backlog_for_a_slow_consumer() -> None:
    deltas = [EngineDelta((i,), str(i), None, 3) for i in range(5)]
    deltas.append(EngineDelta((), "", FinishReason.LENGTH, 3))
    relay = DeltaRelay(source(deltas), 3)
    await asyncio.sleep(0.05)  # the pump runs ahead while nobody reads
    got = [d async for d in relay]
    assert got == [EngineDelta((0, 1, 2, 3, 4), "01234", FinishReason.LENGTH, 3)]


async def test_relay_cancel_ends_with_cancelled_and_stops_the_source() -> None:
    relay = DeltaRelay(source([EngineDelta((1,), "a", None, 3)], hang=True), 3)
    got: list[EngineDelta] = []
    async for delta in relay:
        got.append(delta)
        relay.cancel()
    assert got[-1].finish_reason == FinishReason.CANCELLED
    await relay.aclose()
    assert relay._task.cancelled()


async def test_relay_delivers_tokens_before_an_error() -> None:
    relay = DeltaRelay(source([EngineDelta((1,), "a", None, 3)],
                              fail=error_from_exception(EngineDeadError())), 3)
    got: list[EngineDelta] = []
    with pytest.raises(EngineDead):
        async for delta in relay:
            got.append(delta)
    assert got == [EngineDelta((1,), "a", None, 3)]


# ---- the real engine, on a GPU machine -----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not gpu_with("vllm"), reason="needs vllm and an NVIDIA GPU")
@pytest.mark.parametrize("spec", ["none", "ngram"])
async def test_real_vllm_streams_and_aborts(tmp_path, spec: str) -> None:
    from lanes.workers.engines.base import EngineRequest
    from lanes.workers.engines.vllm import VllmEngine
    from lanes.workers.models.tiny import build_tiny
    from lanes.workers.settings import WorkerSettings

    paths = build_tiny(tmp_path / "tiny")
    engine = VllmEngine(WorkerSettings(_env_file=None, engine="vllm", model=str(paths.target),
                                       spec_method=spec, max_slots=4, max_model_len=1024))
    await engine.start()
    try:
        msgs = (ChatMessage("user", "A class definition"),)
        req = EngineRequest(id="g1", messages=msgs, max_tokens=32, temperature=0.0)
        deltas = [d async for d in engine.generate(req)]
        assert deltas[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert 0 < sum(len(d.token_ids) for d in deltas) <= 32
        long = EngineRequest(id="g2", messages=msgs, max_tokens=900, temperature=0.0)
        got: list[EngineDelta] = []
        async for delta in engine.generate(long):
            got.append(delta)
            if len(got) == 2:
                await engine.abort("g2")
        assert got[-1].finish_reason == FinishReason.CANCELLED
        assert "num_running" in engine.stats() or engine.stats()["active_requests"] == 0
    finally:
        await engine.close()
