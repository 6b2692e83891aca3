"""The TensorRT-LLM adapter's output handling, driven by objects shaped like TRT-LLM's.

``CompletionOutput`` copies ``tensorrt_llm/executor/result.py`` (NVIDIA/TensorRT-LLM, main):
``text`` / ``token_ids`` are cumulative and ``text_diff`` / ``token_ids_diff`` slice from the
lengths recorded before the latest response. In streaming mode the same ``RequestOutput`` is
mutated and re-yielded every step, so ``Stream`` below mutates one object in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import gpu_with

from lanes.queue.messages import ChatMessage, FinishReason
from lanes.workers.engines.base import EngineDead, EngineDelta, EngineError, RequestRejected
from lanes.workers.engines.engine_config import ClassSpec
from lanes.workers.engines.trtllm import (
    build_class_spec, build_llm_kwargs, delta_from_output, error_from_exception,
)


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    _last_text_len: int = 0
    _last_token_ids_len: int = 0

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len:]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len:]


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False


class Stream:
    """Applies responses to one output the way ``_handle_sequence`` does."""

    def __init__(self) -> None:
        self.output = RequestOutput(7, [1, 2, 3], [CompletionOutput(0)])

    def step(self, ids: list[int], text: str, finish: str | None = None) -> RequestOutput:
        c = self.output.outputs[0]
        c._last_token_ids_len, c._last_text_len = len(c.token_ids), len(c.text)
        c.token_ids.extend(ids)
        c.text += text
        c.finish_reason = finish
        self.output.finished = finish is not None
        return self.output


def test_streaming_steps_map_to_diffs() -> None:
    s = Stream()
    assert delta_from_output(s.step([10, 11], "Hello"), 3) == EngineDelta((10, 11), "Hello",
                                                                          None, 3)
    assert delta_from_output(s.step([12], " world"), 3) == EngineDelta((12,), " world", None, 3)
    last = delta_from_output(s.step([2], "", "stop"), 3)
    assert last == EngineDelta((2,), "", FinishReason.STOP, 3)


@pytest.mark.parametrize("raw, ours", [
    ("stop", FinishReason.STOP), ("length", FinishReason.LENGTH),
    ("cancelled", FinishReason.CANCELLED), ("timeout", FinishReason.ERROR),
])
def test_finish_reasons(raw: str, ours: FinishReason) -> None:
    delta = delta_from_output(Stream().step([], "", raw), 3)
    assert delta is not None and delta.finish_reason == ours


def test_empty_step_is_skipped_and_unfinished_reason_is_ignored() -> None:
    s = Stream()
    assert delta_from_output(s.step([], ""), 3) is None
    s.output.outputs[0].finish_reason = "cancelled"  # set before the final response lands
    s.output.finished = False
    assert delta_from_output(s.output, 3) is None


@pytest.mark.parametrize("exc, kind, code", [
    (ValueError("The sum of prompt length (9000) and query length (0) should not exceed "
                "max_num_tokens (8192)"), RequestRejected, "prompt_too_long"),
    (ValueError("SamplingParams.n (9) should not exceed max_batch_size (8)"), RequestRejected,
     "invalid_request"),
    (RuntimeError("Executor is shutdown"), EngineDead, "engine_dead"),
    (RuntimeError("Encountered an error in forward function"), EngineError, "engine_error"),
])
def test_error_mapping(exc: BaseException, kind: type, code: str) -> None:
    mapped = error_from_exception(exc)
    assert type(mapped) is kind and mapped.code == code


@dataclass
class KvCacheConfig:
    dtype: str = "auto"
    enable_block_reuse: bool = True


@dataclass
class EagleDecodingConfig:  # an older release: no Eagle3 class, *_dir field name
    max_draft_len: int = 0
    speculative_model_dir: str | None = None


def test_class_specs_build_with_fallbacks_and_old_field_names() -> None:
    ns = SimpleNamespace(KvCacheConfig=KvCacheConfig, EagleDecodingConfig=EagleDecodingConfig)
    eagle3 = ClassSpec("Eagle3DecodingConfig", {"max_draft_len": 3, "speculative_model": "/e"},
                       fallbacks=("EagleDecodingConfig",))
    assert build_class_spec(eagle3, ns) == EagleDecodingConfig(3, "/e")
    built = build_llm_kwargs({
        "model": "/m", "kv_cache_config": ClassSpec("KvCacheConfig", {"dtype": "fp8"}),
        "scheduler_config": ClassSpec("SchedulerConfig", {"waiting_queue_policy": "priority"},
                                      optional=True)}, ns)
    assert built == {"model": "/m", "kv_cache_config": KvCacheConfig("fp8")}
    with pytest.raises(EngineError, match="no MTPDecodingConfig"):
        build_class_spec(ClassSpec("MTPDecodingConfig", {}), ns)


# ---- the real engine, on a GPU machine -----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not gpu_with("tensorrt_llm"), reason="needs tensorrt_llm and an NVIDIA GPU")
async def test_real_trtllm_streams_and_aborts(tmp_path: Any) -> None:
    from lanes.workers.engines.base import EngineRequest
    from lanes.workers.engines.trtllm import TrtllmEngine
    from lanes.workers.models.tiny import build_tiny
    from lanes.workers.settings import WorkerSettings

    paths = build_tiny(tmp_path / "tiny")
    engine = TrtllmEngine(WorkerSettings(_env_file=None, engine="trtllm", model=str(paths.target),
                                         max_slots=4, max_model_len=1024))
    await engine.start()
    try:
        msgs = (ChatMessage("user", "A class definition"),)
        req = EngineRequest(id="t1", messages=msgs, max_tokens=32, temperature=0.0)
        deltas = [d async for d in engine.generate(req)]
        assert deltas[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        long = EngineRequest(id="t2", messages=msgs, max_tokens=900, temperature=0.0)
        got: list[EngineDelta] = []
        async for delta in engine.generate(long):
            got.append(delta)
            if len(got) == 2:
                await engine.abort("t2")
        assert got[-1].finish_reason == FinishReason.CANCELLED
    finally:
        await engine.close()
