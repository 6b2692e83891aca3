"""The transformers speculative engine on a real (random) tiny Llama, fully offline.

Greedy speculative decoding must be *exactly* the target's greedy output, so every test here
compares against ``model.generate(do_sample=False)`` token for token.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

from lanes.queue.messages import ChatMessage, FinishReason  # noqa: E402
from lanes.workers.engines.base import Engine, EngineDelta, EngineRequest  # noqa: E402
from lanes.workers.engines.hf_spec import (  # noqa: E402
    HFSpeculativeEngine, prompt_lookup,
)
from lanes.workers.models.tiny import TinyModelPaths, build_tiny  # noqa: E402

MESSAGES = (ChatMessage("user", "A class definition is an executable statement."),)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModelPaths:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def greedy_ref(tiny: TinyModelPaths) -> tuple[list[int], list[int], str]:
    """(prompt ids, greedy output ids of up to 48 tokens, its text) from plain ``generate``.

    It stops at the first end-of-sequence token, as the engine does: the tiny model's random
    weights depend on the machine's torch build (the H200 host's torch 2.11 drew weights whose
    greedy answer ends after 39 tokens), so no test may assume the full 48.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.target)
    model = AutoModelForCausalLM.from_pretrained(tiny.target, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": MESSAGES[0].content}],
                                   tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=48,
                         pad_token_id=tok.pad_token_id)
    ids = out[0, len(prompt):].tolist()
    return prompt, ids, tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def request(max_tokens: int = 48, **kw: object) -> EngineRequest:
    return EngineRequest(id=str(kw.pop("id", "r1")), messages=MESSAGES, max_tokens=max_tokens,
                         temperature=0.0, **kw)  # type: ignore[arg-type]


async def collect(engine: HFSpeculativeEngine, req: EngineRequest) -> list[EngineDelta]:
    return [d async for d in engine.generate(req)]


async def started(model: Path, **kw: object) -> HFSpeculativeEngine:
    engine = HFSpeculativeEngine(model, **kw)  # type: ignore[arg-type]
    await engine.start()
    return engine


def joined(deltas: list[EngineDelta]) -> tuple[list[int], str]:
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)


@pytest.mark.parametrize("method", ["none", "draft_model", "prompt_lookup"])
async def test_greedy_matches_generate_token_for_token(tiny, greedy_ref, method) -> None:
    _, ref_ids, ref_text = greedy_ref
    engine = await started(tiny.target, draft_dir=tiny.draft, method=method)
    assert isinstance(engine, Engine)
    deltas = await collect(engine, request())
    ids, text = joined(deltas)
    eos = engine._eos_ids
    cut = next((i + 1 for i, t in enumerate(ref_ids) if t in eos), len(ref_ids))
    assert ids == ref_ids[:cut]
    assert deltas[-1].finish_reason == (FinishReason.STOP if ref_ids[cut - 1] in eos else FinishReason.LENGTH)
    assert all(d.finish_reason is None for d in deltas[:-1])
    assert all(d.prompt_tokens == len(greedy_ref[0]) for d in deltas)
    assert text == ref_text if cut == 48 else ref_text.startswith(text)
    stats = engine.stats()
    assert stats["tokens_generated"] == len(ids)
    if method == "draft_model":
        assert stats["spec_num_draft_tokens"] > 0 and stats["draft_forwards"] > 0
        assert stats["target_forwards"] <= len(ids)
    await engine.close()


def draft_equal_to_target_counts(answer: list[int], eos: frozenset[int], k: int, max_new: int) -> dict[str, int]:
    """What a draft equal to the target must give, worked out from the greedy answer alone:
    the prefill makes the first token; each verify step drafts min(k, max_new - produced - 1)
    tokens (the draft and a bonus token fit in max_new), cut after the first eos, accepts them
    all, and adds a bonus token unless the draft ended at an eos. A step that drafts nothing
    (one token left) is a plain forward and counts no draft."""
    produced, forwards, drafts, accepted = 1, 1, 0, 0
    while produced < max_new and answer[produced - 1] not in eos:
        draft = answer[produced:produced + min(k, max_new - produced - 1)]
        draft = draft[:next((i + 1 for i, t in enumerate(draft) if t in eos), len(draft))]
        forwards += 1
        drafts += bool(draft)
        accepted += len(draft)
        produced += len(draft) + (0 if draft and draft[-1] in eos else 1)
    return {"tokens": produced, "target_forwards": forwards, "spec_num_drafts": drafts,
            "spec_num_accepted_tokens": accepted}


def test_draft_equal_to_target_counts_by_hand() -> None:
    """The arithmetic above on made-up answers: 48 tokens without an eos (9 steps of k = 4 and
    one of k = 1: 46 tokens, then 1 accepted + 1 bonus), and an eos drafted in the third step."""
    assert draft_equal_to_target_counts(list(range(100, 148)), frozenset({2}), 4, 48) == {
        "tokens": 48, "target_forwards": 11, "spec_num_drafts": 10, "spec_num_accepted_tokens": 37}
    answer = [*range(100, 112), 2]  # step 1: 4 + 1 (6 tokens), step 2: 4 + 1 (11), step 3: [111, 2]
    assert draft_equal_to_target_counts(answer, frozenset({2}), 4, 48) == {
        "tokens": 13, "target_forwards": 4, "spec_num_drafts": 3, "spec_num_accepted_tokens": 10}


@pytest.mark.parametrize("eos_at", [None, 5, 18], ids=["model_eos", "eos_at_5", "eos_at_18"])
async def test_draft_equal_to_target_accepts_everything(tiny, greedy_ref, eos_at: int | None) -> None:
    """``eos_at``: the greedy answer's token there counts as an eos too, so the answer ends early
    on every machine (on some hosts the tiny model's own eos ends it; on this one it runs to 48)."""
    engine = await started(tiny.target, draft_dir=tiny.target, method="draft_model",
                           num_speculative_tokens=4)
    answer = greedy_ref[1]
    if eos_at is not None:
        engine._eos_ids = engine._eos_ids | {answer[eos_at]}
        answer = answer[:answer.index(answer[eos_at]) + 1]  # greedy until its first eos
    ids, _ = joined(await collect(engine, request()))
    stats = engine.stats()
    assert ids == answer[:len(ids)]
    assert stats["spec_acceptance_rate"] == 1.0
    expected = draft_equal_to_target_counts(answer, engine._eos_ids, 4, 48)
    assert len(ids) == expected.pop("tokens")
    assert {name: stats[name] for name in expected} == expected
    # Tokens per verify step (vLLM's mean acceptance length).
    assert stats["spec_mean_acceptance_length"] == pytest.approx(
        1 + stats["spec_num_accepted_tokens"] / stats["spec_num_drafts"])
    await engine.close()


async def test_streams_several_deltas(tiny) -> None:
    engine = await started(tiny.target, method="none")
    deltas = await collect(engine, request(max_tokens=20))
    assert len(deltas) >= 2 and deltas[0].token_ids
    await engine.close()


async def test_abort_mid_generation_ends_with_cancelled(tiny) -> None:
    engine = await started(tiny.target, draft_dir=tiny.draft, method="draft_model")
    req = request(max_tokens=1500, id="long")
    deltas: list[EngineDelta] = []
    async for delta in engine.generate(req):
        deltas.append(delta)
        if len(deltas) == 3:
            await engine.abort(req.id)
    assert deltas[-1].finish_reason == FinishReason.CANCELLED
    assert sum(len(d.token_ids) for d in deltas) < 100
    assert engine.stats()["running"] == 0 or await asyncio.sleep(0.2) is None
    await engine.close()


async def test_consumer_cancel_stops_the_thread(tiny) -> None:
    engine = await started(tiny.target, method="none")

    async def consume() -> None:
        async for _ in engine.generate(request(max_tokens=1500, id="gone")):
            await asyncio.sleep(0)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(50):
        if engine.stats()["running"] == 0:
            break
        await asyncio.sleep(0.02)
    assert engine.stats()["running"] == 0
    await engine.close()


@pytest.mark.parametrize("method", ["none", "draft_model"])
async def test_resume_continues_identically(tiny, greedy_ref, method) -> None:
    _, ref_ids, _ = greedy_ref
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.target)

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    engine = await started(tiny.target, draft_dir=tiny.draft, method=method)
    full_ids, _ = joined(await collect(engine, request(max_tokens=30)))
    m = 11
    resumed = await collect(engine, request(max_tokens=30, resume_token_ids=tuple(full_ids[:m])))
    ids, text = joined(resumed)
    assert full_ids[:m] + ids == full_ids
    assert decode(full_ids[:m]) + text == decode(full_ids)
    assert resumed[0].text == decode(full_ids)[len(decode(full_ids[:m])):][:len(resumed[0].text)]
    assert resumed[-1].finish_reason == FinishReason.LENGTH or full_ids[-1] in engine._eos_ids
    done = await collect(engine, request(max_tokens=5, resume_token_ids=tuple(full_ids[:5])))
    assert done == [EngineDelta((), "", FinishReason.LENGTH, done[0].prompt_tokens)]
    await engine.close()


@pytest.mark.parametrize("method", ["none", "draft_model", "prompt_lookup"])
async def test_a_hand_back_loses_no_text_and_misses_no_stop_at_the_seam(tiny, method) -> None:
    """What the client has after an attempt handed back mid-answer, plus what the next attempt
    sends, is the uninterrupted answer, with or without stop strings. Before, the next attempt
    took the text of every streamed token as sent, though the first held back a possible stop
    string's start (or a partial character): that text was lost, and a stop string spanning the
    seam was missed (the answer ran on to max_tokens)."""
    engine = await started(tiny.target, draft_dir=tiny.draft, method=method)
    whole_ids, plain = joined(await collect(engine, request(max_tokens=40)))
    assert len(plain) > 12
    checked = 0
    for at in (4, len(plain) // 2):
        # A stop string that never occurs but begins with the text there, and one that occurs.
        for stop in ((plain[at:at + 2] + "\u2603\u2603",), (plain[at:at + 3],)):
            whole = await collect(engine, request(max_tokens=40, stop=stop))
            for seam in range(1, len(whole_ids) - 1, 3):
                first_ids, first = [], ""
                async for delta in engine.generate(request(max_tokens=40, stop=stop, id=f"s{seam}")):
                    if delta.finish_reason is not None:
                        break  # stopped (or ended) before the seam: nothing to hand back
                    first_ids += delta.token_ids
                    first += delta.text
                    if len(first_ids) >= seam:
                        break  # the hand-back: the consumer goes away mid-answer
                else:
                    continue
                if len(first_ids) < seam:
                    continue
                rest = await collect(engine, request(max_tokens=40, stop=stop, id=f"s{seam}",
                                                     resume_token_ids=tuple(first_ids)))
                assert first + joined(rest)[1] == joined(whole)[1], (method, stop, seam)
                assert rest[-1].finish_reason == whole[-1].finish_reason, (method, stop, seam)
                checked += 1
    assert checked >= 10
    await engine.close()


async def test_sampling_runs_without_speculation(tiny) -> None:
    engine = await started(tiny.target, draft_dir=tiny.draft, method="draft_model")
    req = EngineRequest(id="s", messages=MESSAGES, max_tokens=16, temperature=0.8, seed=7)
    first = joined(await collect(engine, req))[0]
    again = joined(await collect(engine, req))[0]
    assert first == again and 0 < len(first) <= 16
    assert engine.stats()["spec_num_draft_tokens"] == 0
    await engine.close()


@pytest.mark.parametrize("method", ["none", "prompt_lookup"])
async def test_the_context_bounds_the_prompt_and_the_answer(tiny, greedy_ref, method) -> None:
    """As HFEngine and the vLLM / TensorRT-LLM adapters: a prompt that fills the context is
    refused ``prompt_too_long``, and an answer ends ``length`` where the context does (the
    engine took a 6,307-token prompt on a 2,048-token model and generated on)."""
    from lanes.workers.engines.base import RequestRejected

    prompt, _, _ = greedy_ref
    engine = await started(tiny.target, method=method, max_model_len=len(prompt) + 5)
    deltas = await collect(engine, request(max_tokens=48))
    assert len(joined(deltas)[0]) <= 5 and deltas[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    with pytest.raises(RequestRejected) as refused:
        await collect(engine, EngineRequest(id="long", messages=(ChatMessage("user", "word " * 4000),),
                                            max_tokens=8, temperature=0.0))
    assert refused.value.code == "prompt_too_long"
    await engine.close()
    default = await started(tiny.target, method=method)  # the model's own limit
    assert default._max_model_len == default._target.config.max_position_embeddings
    await default.close()


def test_speculative_hf_worker_runs_on_its_own_gpu(tiny) -> None:
    """``LANES_DEVICE=cuda`` means the worker's GPU (``gpu_index``, from honcho's worker.N)
    for the speculative engine too: every such worker ran on GPU 0."""
    from lanes.workers.settings import WorkerSettings

    settings = WorkerSettings(model=str(tiny.target), draft_model=str(tiny.draft), spec_method="draft_model",
                              device="cuda", gpu_index=2)
    assert HFSpeculativeEngine.from_settings(settings).device == torch.device("cuda:2")


def test_prompt_lookup_copies_what_followed_the_last_match() -> None:
    assert prompt_lookup([5, 6, 7, 8, 1, 5, 6], 3, 2) == [7, 8, 1]
    assert prompt_lookup([1, 2, 3], 3, 2) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_greedy_speculation_matches_cpu(tiny, greedy_ref) -> None:
    engine = await started(tiny.target, draft_dir=tiny.target, method="draft_model",
                           device="cuda")
    ids, _ = joined(await collect(engine, request()))
    assert ids == greedy_ref[1][:len(ids)]
    assert engine.stats()["spec_acceptance_rate"] == 1.0
    await engine.close()
