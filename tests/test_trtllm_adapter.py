"""The TensorRT-LLM adapter against a stand-in ``tensorrt_llm`` that copies TensorRT-LLM 1.x's
behaviour (``fake_trtllm.py`` names each upstream file), and, on a GPU machine, the real one.

Covers the issue-10 findings: engine death read from the executor's state (not message text),
``RequestError`` as a per-request failure, the prompt-length check TensorRT-LLM skips with
chunked prefill, an optional ``SchedulerConfig`` that a release rejects, and multi-token stop
strings that must not leak their first tokens (the adapter cuts them and detokenizes itself).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import gpu_with
from fake_trtllm import (
    FcfsOnlySchedulerConfig, KvCacheConfig, NGramDecodingConfig, Package, PrioritySchedulerConfig, Script,
)

from lanes.queue.messages import ChatMessage, FinishReason, Lane
from lanes.scheduler.policy import trtllm_priority
from lanes.workers.engines.base import (
    ConfigError, EngineDead, EngineDelta, EngineError, EngineRequest, RequestRejected,
)
from lanes.workers.engines.engine_config import ClassSpec
from lanes.workers.engines.trtllm import (
    StreamCursor, TrtllmEngine, build_class_spec, build_llm_kwargs, engine_is_dead, error_from_exception,
)
from lanes.workers.settings import WorkerSettings

MESSAGES = (ChatMessage("user", "A class definition"),)


def request(rid: str, max_tokens: int = 32, **kw: Any) -> EngineRequest:
    return EngineRequest(id=rid, messages=kw.pop("messages", MESSAGES), max_tokens=max_tokens,
                         temperature=0.0, **kw)


@pytest.fixture
def tokenizer(tiny_model) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model.target)


def install(monkeypatch: pytest.MonkeyPatch, package: Package) -> None:
    module = package.module()
    monkeypatch.setitem(sys.modules, "tensorrt_llm", module)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", module.llmapi)


async def started(monkeypatch: pytest.MonkeyPatch, package: Package, tiny_model, **kw: Any) -> TrtllmEngine:
    install(monkeypatch, package)
    engine = TrtllmEngine(WorkerSettings(_env_file=None, engine="trtllm", model=str(tiny_model.target),
                                         max_slots=4, **kw))
    await engine.start()
    return engine


async def collect(engine: TrtllmEngine, req: EngineRequest) -> list[EngineDelta]:
    return [d async for d in engine.generate(req)]


# ---- the adapter on the stand-in package ------------------------------------------------------

async def test_start_passes_the_adapters_arguments_and_warms_up(monkeypatch, tiny_model, tokenizer) -> None:
    package = Package(tokenizer)
    engine = await started(monkeypatch, package, tiny_model, max_num_batched_tokens=1024)
    llm = package.llms[0]
    assert llm.model == str(tiny_model.target)
    assert {k: llm.kwargs[k] for k in ("max_batch_size", "max_num_tokens", "enable_chunked_prefill")} == {
        "max_batch_size": 4, "max_num_tokens": 1024, "enable_chunked_prefill": True}
    assert llm.kwargs["kv_cache_config"] == KvCacheConfig(free_gpu_memory_fraction=0.9, enable_block_reuse=True)
    assert llm.kwargs["scheduler_config"] == PrioritySchedulerConfig(waiting_queue_policy="priority")
    assert len(llm.submitted) == 1 and llm.submitted[0].sampling_params.max_tokens == 2, "one warm-up request"
    assert engine.max_seq_len == 2048, "from the model config when TensorRT-LLM leaves it unset"
    await engine.close()


async def test_a_checkpoint_with_a_quantized_kv_cache_is_refused_at_start(monkeypatch, tiny_model, tokenizer,
                                                                            tmp_path) -> None:
    import json
    import shutil

    model = tmp_path / "fp8kv"
    shutil.copytree(tiny_model.target, model)
    (model / "hf_quant_config.json").write_text(json.dumps({"quantization": {"kv_cache_quant_algo": "FP8"}}))
    package = Package(tokenizer)
    install(monkeypatch, package)
    engine = TrtllmEngine(WorkerSettings(_env_file=None, engine="trtllm", model=str(model), max_slots=4))
    with pytest.raises(ConfigError, match="kv_cache_quant_algo=FP8"):
        await engine.start()
    assert not package.llms, "refused before loading"


async def test_a_release_that_rejects_priority_queueing_runs_without_it(monkeypatch, tiny_model, tokenizer,
                                                                        caplog) -> None:
    package = Package(tokenizer, scheduler_config=FcfsOnlySchedulerConfig)
    engine = await started(monkeypatch, package, tiny_model)
    assert "scheduler_config" not in package.llms[0].kwargs
    assert "rejects" in caplog.text and "waiting_queue_policy" in caplog.text
    await engine.close()


async def test_streams_through_the_chat_template_with_lane_priority(monkeypatch, tiny_model, tokenizer) -> None:
    package = Package(tokenizer)
    engine = await started(monkeypatch, package, tiny_model)
    package.scripts.append(Script.spelled(tokenizer, ["Hello", " world"], finish="stop"))
    deltas = await collect(engine, request("t1", lane=Lane.SHORT))
    submitted = package.llms[0].submitted[-1]
    text = tokenizer.apply_chat_template([{"role": "user", "content": MESSAGES[0].content}], tokenize=False,
                                         add_generation_prompt=True)
    assert submitted.inputs == tokenizer.encode(text, add_special_tokens=False)
    assert submitted.priority == trtllm_priority(Lane.SHORT)
    assert submitted.sampling_params.top_k == 1, "greedy"
    assert "".join(d.text for d in deltas) == "Hello world"
    assert [t for d in deltas for t in d.token_ids] == tokenizer.encode("Hello world", add_special_tokens=False)
    assert submitted.sampling_params.detokenize is False and submitted.sampling_params.stop is None
    assert deltas[-1].finish_reason is FinishReason.STOP and deltas[-1].prompt_tokens == len(submitted.inputs)
    await engine.close()


async def test_a_multi_token_stop_string_never_streams_its_start(monkeypatch, tiny_model, tokenizer) -> None:
    package = Package(tokenizer)
    engine = await started(monkeypatch, package, tiny_model)
    # " </" is not how "</answer>" tokenizes alone: TensorRT-LLM, matching stop strings as token
    # ids, would run on past it (and where it does match, it leaves the first tokens' text).
    pieces = ["Hello", " wor", "ld", " </", "ans", "wer>", " more", " and", " more"]
    package.scripts.append(Script.spelled(tokenizer, pieces))
    deltas = await collect(engine, request("stop", stop=("</answer>",)))
    assert "".join(d.text for d in deltas) == "Hello world "
    assert all("<" not in d.text for d in deltas), [d.text for d in deltas]
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert package.llms[0]._executor.aborted, "the engine, still generating past the stop, was aborted"
    await engine.close()


async def test_a_resumed_attempt_continues_the_text_and_a_stop_across_the_seam(monkeypatch, tiny_model,
                                                                              tokenizer) -> None:
    """The first attempt streamed the tokens of "Hello world </" and sent "Hello world " (the
    "</" may start the stop string). The next attempt decodes after those tokens, holds that
    "</" again, and cuts the stop that spans the two attempts."""
    package = Package(tokenizer)
    engine = await started(monkeypatch, package, tiny_model)
    sent = tokenizer.encode("Hello world </", add_special_tokens=False)
    package.scripts.append(Script.spelled(tokenizer, ["ans", "wer>", " more"]))
    deltas = await collect(engine, request("seam", stop=("</answer>",), resume_token_ids=tuple(sent)))
    assert "".join(d.text for d in deltas) == "" and deltas[-1].finish_reason is FinishReason.STOP
    assert package.llms[0].submitted[-1].inputs[-len(sent):] == sent
    package.scripts.append(Script.spelled(tokenizer, [" you", " see"], finish="stop"))
    deltas = await collect(engine, request("no-stop", stop=("</answer>",), resume_token_ids=tuple(sent)))
    assert "".join(d.text for d in deltas) == "</ you see", "the held start goes out when it is no stop"
    # The first attempt spent the whole budget (handed back after its last token, before the end
    # was written): the held "</" goes out with the end (it was lost).
    spent = await collect(engine, request("spent", max_tokens=len(sent), stop=("</answer>",),
                                          resume_token_ids=tuple(sent)))
    assert [(d.text, d.finish_reason) for d in spent] == [("</", FinishReason.LENGTH)]
    await engine.close()


async def test_abort_ends_the_stream_cancelled(monkeypatch, tiny_model, tokenizer) -> None:
    package = Package(tokenizer)
    engine = await started(monkeypatch, package, tiny_model)
    package.scripts.append(Script([(30 + i, f" t{i}") for i in range(500)]))
    got: list[EngineDelta] = []
    async for delta in engine.generate(request("long", 900)):
        got.append(delta)
        if len(got) == 2:
            await engine.abort("long")
    assert got[-1].finish_reason is FinishReason.CANCELLED and len(got) < 10
    assert package.llms[0]._executor.aborted, "the request was aborted in the executor"
    await engine.close()


async def test_a_shut_down_executor_is_engine_death(monkeypatch, tiny_model, tokenizer) -> None:
    package = Package(tokenizer)
    engine = await started(monkeypatch, package, tiny_model)
    package.llms[0].shutdown()  # generate_async would now raise RuntimeError("LLM is shutting down")
    with pytest.raises(EngineDead):
        await collect(engine, request("after"))


async def test_a_fatal_background_error_mid_stream_is_engine_death(monkeypatch, tiny_model, tokenizer) -> None:
    package = Package(tokenizer)
    engine = await started(monkeypatch, package, tiny_model)
    fatal = RuntimeError("CUDA error: an illegal memory access was encountered")
    package.scripts.append(Script([(40 + i, f" t{i}") for i in range(50)], error=fatal, fail_after=3))
    got: list[EngineDelta] = []
    with pytest.raises(EngineDead, match="illegal memory access"):
        async for delta in engine.generate(request("dies")):
            got.append(delta)
    assert len(got) == 3, "tokens before the failure were delivered"


async def test_a_request_error_fails_that_request_only(monkeypatch, tiny_model, tokenizer) -> None:
    package = Package(tokenizer)
    engine = await started(monkeypatch, package, tiny_model)
    package.scripts.append(Script([(50, " a"), (51, " b")], error="Encountered an error in forward function",
                                  fail_after=1))
    with pytest.raises(RequestRejected) as failed:
        await collect(engine, request("bad"))
    assert failed.value.code == "generation_failed"
    assert (await collect(engine, request("good")))[-1].finish_reason is FinishReason.STOP, "the engine lives on"
    await engine.close()


async def test_an_over_long_prompt_is_rejected_before_submission(monkeypatch, tiny_model, tokenizer) -> None:
    package = Package(tokenizer)
    engine = await started(monkeypatch, package, tiny_model, max_model_len=64)
    llm = package.llms[0]
    num_submitted = len(llm.submitted)
    long = (ChatMessage("user", "the with statement " * 40),)
    with pytest.raises(RequestRejected) as rejected:
        await collect(engine, request("long", messages=long))
    assert rejected.value.code == "prompt_too_long" and len(llm.submitted) == num_submitted
    await collect(engine, request("fits", max_tokens=500))
    assert llm.submitted[-1].sampling_params.max_tokens == 64 - len(llm.submitted[-1].inputs)
    await engine.close()


async def test_ngram_speculation_reports_acceptance(monkeypatch, tiny_model, tokenizer) -> None:
    package = Package(tokenizer)
    engine = await started(monkeypatch, package, tiny_model, spec_method="ngram", num_speculative_tokens=4)
    assert package.llms[0].kwargs["speculative_config"] == NGramDecodingConfig(
        max_draft_len=4, max_matching_ngram_size=2, is_public_pool=False)
    assert engine.stats()["spec_num_drafts"] == 0, "the warm-up is not counted"
    package.scripts.append(Script([(60 + i, f" t{i}") for i in range(20)], iters_per_token=0.5))
    await collect(engine, request("spec"))
    stats = engine.stats()
    assert stats["spec_num_drafts"] == 10 and stats["spec_num_accepted_tokens"] == 10
    assert stats["spec_acceptance_rate"] > 0 and stats["spec_mean_acceptance_length"] == 2.0
    await engine.close()


# ---- pure parts -------------------------------------------------------------------------------

def test_stream_cursor_drops_what_tensorrt_llms_stop_words_cut(tokenizer) -> None:
    """Should a release be given stop strings after all: the final state of a stop matched as
    token ids has the ids cut (the stale text is not read). Nothing of the stop goes out."""
    ids = tokenizer.encode("Hi</answer>", add_special_tokens=False)
    hi = tokenizer.encode("Hi", add_special_tokens=False)
    cursor = StreamCursor(3, tokenizer, ["</answer>"])
    state = SimpleNamespace(outputs=[SimpleNamespace(text="stale", token_ids=[], finish_reason=None)], finished=False)
    out: list[EngineDelta] = []
    for n in range(1, len(ids)):
        state.outputs[0].token_ids = ids[:n]
        if (delta := cursor.step(state)) is not None:
            out.append(delta)
    state.outputs[0].token_ids, state.outputs[0].finish_reason, state.finished = hi, "stop", True
    state.outputs[0].stop_reason = "</answer>"
    out.append(cursor.step(state))
    assert "".join(d.text for d in out) == "Hi" and out[-1].finish_reason is FinishReason.STOP
    assert [t for d in out for t in d.token_ids] == ids[:-1], "each id once, none repeated after the cut"


def test_engine_death_is_read_from_the_executor() -> None:
    alive = SimpleNamespace(_executor=SimpleNamespace(is_shutdown=lambda: False))
    shutting = SimpleNamespace(_executor=SimpleNamespace(is_shutdown=lambda: True))
    assert not engine_is_dead(alive) and engine_is_dead(shutting)
    assert engine_is_dead(SimpleNamespace(_executor=None)) and engine_is_dead(None)


class EngineDeadError(RuntimeError):
    """Newer TensorRT-LLM (``tensorrt_llm/executor/utils.py``, 2026): a fatal cause, kept."""


@pytest.mark.parametrize("exc, dead, kind, code", [
    (RuntimeError("LLM is shutting down"), True, EngineDead, "engine_dead"),
    (RuntimeError("Encountered an error in forward function"), False, EngineError, "engine_error"),
    (EngineDeadError("model worker died"), False, EngineDead, "engine_dead"),
    (ValueError("The sum of prompt length (9000.0), query length (0) should not exceed max_num_tokens (8192)"),
     False, RequestRejected, "prompt_too_long"),
    (ValueError("SamplingParams.n (9) should not exceed max_batch_size (8)"), False, RequestRejected,
     "invalid_request"),
])
def test_error_mapping(exc: BaseException, dead: bool, kind: type, code: str) -> None:
    mapped = error_from_exception(exc, dead=dead)
    assert type(mapped) is kind and mapped.code == code


def test_class_specs_build_with_fallbacks_and_old_field_names() -> None:
    from dataclasses import dataclass

    @dataclass
    class EagleDecodingConfig:  # an older release: no Eagle3 class, *_dir field name
        max_draft_len: int = 0
        speculative_model_dir: str | None = None

    ns = SimpleNamespace(KvCacheConfig=KvCacheConfig, EagleDecodingConfig=EagleDecodingConfig,
                         SchedulerConfig=FcfsOnlySchedulerConfig)
    eagle3 = ClassSpec("Eagle3DecodingConfig", {"max_draft_len": 3, "speculative_model": "/e"},
                       fallbacks=("EagleDecodingConfig",))
    assert build_class_spec(eagle3, ns) == EagleDecodingConfig(3, "/e")
    built = build_llm_kwargs({
        "model": "/m", "kv_cache_config": ClassSpec("KvCacheConfig", {"dtype": "fp8"}),
        "scheduler_config": ClassSpec("SchedulerConfig", {"waiting_queue_policy": "priority"},
                                      optional=True)}, ns)
    assert built == {"model": "/m", "kv_cache_config": KvCacheConfig(dtype="fp8")}
    with pytest.raises(ConfigError, match="no MTPDecodingConfig"):
        build_class_spec(ClassSpec("MTPDecodingConfig", {}), ns)
    with pytest.raises(ConfigError, match="rejects KvCacheConfig"):
        build_class_spec(ClassSpec("KvCacheConfig", {"free_gpu_memory_fraction": "lots"}), ns)


# ---- the real engine, on a GPU machine -----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not gpu_with("tensorrt_llm"), reason="needs tensorrt_llm and an NVIDIA GPU")
async def test_real_trtllm_streams_and_aborts(tmp_path: Any) -> None:
    from lanes.workers.models.tiny import build_tiny

    paths = build_tiny(tmp_path / "tiny", hidden_size=256, dtype="bfloat16")
    engine = TrtllmEngine(WorkerSettings(_env_file=None, engine="trtllm", model=str(paths.target),
                                         max_slots=4, max_model_len=1024))
    await engine.start()
    try:
        deltas = await collect(engine, request("t1"))
        assert deltas[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        got: list[EngineDelta] = []
        async for delta in engine.generate(request("t2", 900)):
            got.append(delta)
            if len(got) == 2:
                await engine.abort("t2")
        assert got[-1].finish_reason == FinishReason.CANCELLED
    finally:
        await engine.close()
