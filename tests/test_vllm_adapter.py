"""The vLLM adapter: its output handling on objects shaped exactly like vLLM's, the whole
engine on a stand-in ``vllm`` that copies vLLM 0.11 and vLLM main (``fake_vllm.py`` names each
upstream file), and, on a GPU machine, the real one.

``CompletionOutput`` / ``RequestOutput`` copy the fields of ``vllm/outputs.py`` (vllm-project/vllm,
main): in DELTA mode ``outputs[0].text`` / ``token_ids`` hold only the new part and
``finish_reason`` is one of ``FINISH_REASON_STRINGS`` (``vllm/v1/engine/__init__.py``: stop,
length, abort, error, repetition). The exceptions are ``fake_vllm``'s copies of
``vllm/v1/engine/exceptions.py`` and ``vllm/exceptions.py``.
"""

from __future__ import annotations

import asyncio
import random
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import gpu_with
from fake_vllm import (
    MAIN, V0_11, EngineDeadError, EngineGenerateError, MaxQueuedTokensError, Package, QueueOverflowError, Script,
    VLLMClientError, VLLMValidationError,
)

from lanes.queue.messages import ChatMessage, FinishReason, Lane
from lanes.scheduler.policy import vllm_priority
from lanes.workers.engines.base import (
    ConfigError, EngineBusy, EngineDead, EngineDelta, EngineError, EngineRequest, RequestRejected,
)
from lanes.workers.engines.engine_config import VLLM_DRAFT_MODEL_MODULE, validate
from lanes.workers.engines.vllm import (
    DeltaRelay, VllmEngine, delta_from_output, error_from_exception, merge_deltas,
)
from lanes.workers.settings import WorkerSettings


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


def wrapped(exc: BaseException) -> BaseException:
    """What ``AsyncLLM.generate`` raises for an error it does not re-raise as it is."""
    try:
        raise EngineGenerateError() from exc
    except EngineGenerateError as outer:
        return outer


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
    (EngineDeadError(), EngineDead, "engine_dead"),
    (VLLMValidationError("The decoder prompt (length 9000) is longer than the maximum model "
                         "length of 4096."), RequestRejected, "prompt_too_long"),
    (VLLMValidationError("temperature must be non-negative"), RequestRejected, "invalid_request"),
    (VLLMClientError("unknown LoRA"), RequestRejected, "invalid_request"),
    (ValueError("top_p must be in (0, 1]"), RequestRejected, "invalid_request"),  # 0.11
    (wrapped(QueueOverflowError()), EngineBusy, "engine_busy"),
    (wrapped(MaxQueuedTokensError()), EngineBusy, "engine_busy"),
    (QueueOverflowError(), EngineBusy, "engine_busy"),
    (wrapped(RuntimeError("boom")), EngineError, "engine_error"),
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


# ---- the adapter on the stand-in package (vLLM 0.11 and main) ------------------------------

MESSAGES = (ChatMessage("user", "A class definition"),)


def request(rid: str, max_tokens: int = 32, **kw: Any) -> EngineRequest:
    return EngineRequest(id=rid, messages=kw.pop("messages", MESSAGES), max_tokens=max_tokens,
                         temperature=0.0, **kw)


@pytest.fixture
def tokenizer(tiny_model) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model.target)


async def started(monkeypatch: pytest.MonkeyPatch, package: Package, tiny_model, **kw: Any) -> VllmEngine:
    for name, module in package.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    engine = VllmEngine(WorkerSettings(_env_file=None, engine="vllm", **{"model": str(tiny_model.target),
                                                                         "max_slots": 4, **kw}))
    await engine.start()
    return engine


def awq_checkpoint(tiny_model, folder) -> str:
    """The tiny model's files, declaring AutoAWQ weights (``quantization_config``) as an AWQ
    checkpoint does (the fake engine loads it as it is)."""
    import json
    import shutil

    model = folder / "awq"
    shutil.copytree(tiny_model.target, model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    (model / "config.json").write_text(json.dumps(config))
    return str(model)


async def collect(engine: VllmEngine, req: EngineRequest) -> list[EngineDelta]:
    return [d async for d in engine.generate(req)]


async def test_awq_asked_of_an_unquantized_checkpoint_is_refused_at_start(monkeypatch, tiny_model, tokenizer) -> None:
    """LANES_QUANTIZATION=awq on a 16-bit checkpoint ran it unquantized with no word (the
    adapter leaves AWQ to the checkpoint); fp8 on one is quantized by vLLM as it loads."""
    package = Package(tokenizer, MAIN)
    with pytest.raises(ConfigError, match="LANES_QUANTIZATION=awq, but the checkpoint .* holds unquantized weights"):
        await started(monkeypatch, package, tiny_model, quantization="awq")
    assert not package.engines, "refused before loading"
    engine = await started(monkeypatch, package, tiny_model, quantization="fp8")
    assert package.engines[0].engine_args.quantization == "fp8"
    await engine.close()


@pytest.mark.parametrize("release", [V0_11, MAIN])
async def test_start_passes_the_adapters_arguments_and_warms_up(monkeypatch, tiny_model, tokenizer, release,
                                                                caplog, tmp_path) -> None:
    package = Package(tokenizer, release)
    model = awq_checkpoint(tiny_model, tmp_path)
    engine = await started(monkeypatch, package, tiny_model, model=model, enforce_eager=True, quantization="awq")
    args = package.engines[0].engine_args
    assert (args.model, args.max_num_seqs, args.max_num_batched_tokens) == (model, 4, 2048)
    assert args.scheduling_policy == "priority" and args.enable_chunked_prefill is True
    assert args.enforce_eager is True
    assert args.quantization is None, "awq comes from the checkpoint (awq_marlin), never forced"
    if release == MAIN:
        assert args.max_num_queued_reqs == 6
    else:
        assert "max_num_queued_reqs" in caplog.text, "0.11 lacks it: dropped with a warning"
    assert [a.params.max_tokens for a in package.engines[0].added] == [2], "one warm-up request"
    await engine.close()


@pytest.mark.parametrize("release", [V0_11, MAIN])
async def test_streams_through_the_chat_template_with_lane_priority(monkeypatch, tiny_model, tokenizer,
                                                                    release) -> None:
    package = Package(tokenizer, release)
    engine = await started(monkeypatch, package, tiny_model)
    package.scripts.append(Script([11, 12, 13, 2]))
    deltas = await collect(engine, request("v1", lane=Lane.LONG, trace_headers={"traceparent": "00-ab-cd-01"}))
    added = package.engines[0].added[-1]
    text = tokenizer.apply_chat_template([{"role": "user", "content": MESSAGES[0].content}], tokenize=False,
                                         add_generation_prompt=True)
    assert added.prompt["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)
    assert added.priority == vllm_priority(Lane.LONG) and added.trace_headers == {"traceparent": "00-ab-cd-01"}
    assert added.params.output_kind.name == "DELTA" and added.params.temperature == 0.0
    assert [t for d in deltas for t in d.token_ids] == [11, 12, 13, 2]
    assert "".join(d.text for d in deltas) == " t11 t12 t13 t2"
    assert deltas[-1].finish_reason is FinishReason.STOP
    await engine.close()


async def test_abort_ends_the_stream_cancelled(monkeypatch, tiny_model, tokenizer) -> None:
    package = Package(tokenizer)
    engine = await started(monkeypatch, package, tiny_model)
    package.scripts.append(Script(list(range(100, 600))))
    got: list[EngineDelta] = []
    async for delta in engine.generate(request("long", 900)):
        got.append(delta)
        if len(got) == 2:
            await engine.abort("long")
    assert got[-1].finish_reason is FinishReason.CANCELLED and len(got) < 10
    assert "long" in package.engines[0].aborted
    await engine.close()


@pytest.mark.parametrize("release", [V0_11, MAIN])
async def test_an_over_long_prompt_is_rejected(monkeypatch, tiny_model, tokenizer, release) -> None:
    package = Package(tokenizer, release)
    engine = await started(monkeypatch, package, tiny_model, max_model_len=64)
    long = (ChatMessage("user", "the with statement " * 40),)
    with pytest.raises(RequestRejected) as rejected:
        await collect(engine, request("long", messages=long))
    assert rejected.value.code == "prompt_too_long"
    await engine.close()


@pytest.mark.parametrize("error", [QueueOverflowError, MaxQueuedTokensError])
async def test_a_full_engine_queue_is_busy_not_a_failure(monkeypatch, tiny_model, tokenizer, error) -> None:
    package = Package(tokenizer, MAIN)
    engine = await started(monkeypatch, package, tiny_model)
    package.scripts.append(Script([1], error_on_add=error()))
    with pytest.raises(EngineBusy):
        await collect(engine, request("busy"))
    await engine.close()


async def test_engine_shutdown_is_engine_death(monkeypatch, tiny_model, tokenizer) -> None:
    package = Package(tokenizer)
    engine = await started(monkeypatch, package, tiny_model)
    package.engines[0].shutdown()
    with pytest.raises(EngineDead):
        await collect(engine, request("after"))


async def test_ngram_speculation_reports_acceptance(monkeypatch, tiny_model, tokenizer) -> None:
    package = Package(tokenizer)
    engine = await started(monkeypatch, package, tiny_model, spec_method="ngram", num_speculative_tokens=4)
    assert package.engines[0].engine_args.speculative_config == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    assert engine.stats()["spec_num_drafts"] == 0, "the warm-up is not counted"
    package.scripts.append(Script(list(range(10, 30)), accepted_per_step=2))
    await collect(engine, request("spec"))
    stats = engine.stats()
    assert stats["spec_num_drafts"] == 20 and stats["spec_acceptance_rate"] == 0.5
    assert stats["spec_mean_acceptance_length"] == 3.0 and stats["num_running"] == 1
    await engine.close()


async def hand_back_after(engine: VllmEngine, req: EngineRequest,
                          tokens: int) -> tuple[list[int], str, FinishReason | None]:
    """Stream until ``tokens`` tokens have come, then abort (a hand-back): the tokens and text
    got, and how the attempt ended (CANCELLED unless it finished first)."""
    ids: list[int] = []
    text, finish = "", None
    async for delta in engine.generate(req):
        ids += delta.token_ids
        text += delta.text
        finish = delta.finish_reason
        if len(ids) >= tokens and finish is None:
            await engine.abort(req.id)
    return ids, text, finish


async def test_a_hand_back_keeps_the_text_held_for_a_stop_string(monkeypatch, tiny_model, tokenizer) -> None:
    """vLLM holds back the last ``len(stop) - 1`` characters of text while it streams their tokens;
    an attempt handed back mid-answer lost that text (the next one starts after the tokens).
    The adapter cuts stop strings itself, and a resumed attempt sends what the earlier one held,
    or cuts a stop string that spans the two. The stand-in detokenizes as vLLM does."""
    package = Package(tokenizer, detokenize=True)
    engine = await started(monkeypatch, package, tiny_model)
    rng = random.Random(3)
    checked = 0
    for trial in range(4):
        ids = [rng.randrange(3, tokenizer.vocab_size) for _ in range(16)]
        package.scripts.append(Script(ids, finish="length"))
        plain = "".join(d.text for d in await collect(engine, request(f"plain{trial}", 16)))
        at = rng.randrange(4, len(plain) - 4)
        # One stop string that never occurs but begins with the text at a seam, one that occurs.
        for k, stop in enumerate(((plain[at:at + 2] + "\u2603\u2603",), (plain[at:at + 3],))):
            package.scripts.append(Script(ids, finish="length"))
            whole = await collect(engine, request(f"whole{trial}{k}", 16, stop=stop))
            assert package.engines[0].added[-1].params.stop is None, "vLLM gets no stop strings"
            for seam in range(2, 14, 3):
                rid = f"r{trial}{k}{seam}"
                package.scripts.append(Script(ids, finish="length"))
                first_ids, first, finish = await hand_back_after(engine, request(rid, 16, stop=stop), seam)
                if finish is not FinishReason.CANCELLED:
                    continue  # stopped before the hand-back
                package.scripts.append(Script(ids[len(first_ids):], finish="length"))
                rest = await collect(engine, request(rid, 16, stop=stop, resume_token_ids=tuple(first_ids)))
                assert first + "".join(d.text for d in rest) == "".join(d.text for d in whole), (stop, seam)
                assert rest[-1].finish_reason is whole[-1].finish_reason
                checked += 1
    assert checked >= 20
    await engine.close()


def test_draft_model_is_refused_where_vllm_cannot_run_it() -> None:
    settings = WorkerSettings(_env_file=None, engine="vllm", model="/m", spec_method="draft_model",
                              draft_model="/d")
    with pytest.raises(ConfigError, match=r"vLLM 0\.11\.2 cannot run spec_method=draft_model"):
        validate(settings, is_installed=lambda module: module != VLLM_DRAFT_MODEL_MODULE,
                 package_version=lambda name: "0.11.2")
    validate(settings, is_installed=lambda module: True, package_version=lambda name: "0.99.0")


# ---- the real engine, on a GPU machine -----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not gpu_with("vllm"), reason="needs vllm and an NVIDIA GPU")
@pytest.mark.parametrize("spec", ["none", "ngram"])
async def test_real_vllm_streams_and_aborts(tmp_path, spec: str) -> None:
    from lanes.workers.models.tiny import build_tiny

    paths = build_tiny(tmp_path / "tiny", hidden_size=256, dtype="bfloat16")
    engine = VllmEngine(WorkerSettings(_env_file=None, engine="vllm", model=str(paths.target),
                                       spec_method=spec, max_slots=4, max_model_len=1024, enforce_eager=True))
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
