"""The transformers continuous-batching engine (``workers/engines/hf.py``, what ``lanes up``
serves) honours each request's sampling fields."""

from __future__ import annotations

from pathlib import Path

import pytest
from lanes.queue.messages import ChatMessage
from lanes.workers.engines.base import EngineRequest, RequestRejected, load_failure, render_chat
from lanes.workers.engines.hf import HFEngine

PROMPT = (ChatMessage("user", "Tell me about lists and dictionaries."),)


async def _tokens(engine: HFEngine, rid: str, **sampling: float) -> list[int]:
    ids: list[int] = []
    async for delta in engine.generate(EngineRequest(rid, PROMPT, max_tokens=24, **sampling)):
        ids += delta.token_ids
    return ids


@pytest.fixture
async def engine(tiny_model):
    engine = HFEngine(str(tiny_model.target), max_slots=4)
    await engine.start()
    yield engine
    await engine.close()


async def test_top_p_is_applied_per_request(engine: HFEngine) -> None:
    """A nucleus of one token is greedy decoding at any temperature; ``top_p`` 1 samples freely.
    (Before, ``top_p`` never reached the engine: every sampled request drew from the top 40.)"""
    greedy = await _tokens(engine, "greedy", temperature=0.0)
    assert len(greedy) >= 4
    for i in range(3):
        assert await _tokens(engine, f"nucleus-{i}", temperature=1.5, top_p=1e-6) == greedy
    free = [await _tokens(engine, f"free-{i}", temperature=1.5, top_p=1.0) for i in range(3)]
    assert any(ids != greedy for ids in free), "temperature 1.5 over the whole vocabulary drew the greedy answer 3 times"


async def test_kv_cache_usage_counts_the_blocks_of_running_requests_only(engine: HFEngine) -> None:
    """``lanes_kv_cache_usage`` read 1 - the cache's free capacity, and transformers keeps a
    finished request's complete blocks for prefix reuse, not free: an idle worker showed 0.08 to
    0.28 for good. It is the share of blocks that running requests hold: 0 when idle."""
    assert engine.stats()["kv_cache_usage"] == 0.0
    seen: list[float] = []
    long_prompt = (ChatMessage("user", "Tell me about lists and dictionaries. " * 40),)
    async for _ in engine.generate(EngineRequest("long", long_prompt, max_tokens=48, temperature=0.0)):
        seen.append(engine.stats()["kv_cache_usage"])  # the last deltas may come after its blocks went
    assert max(seen) > 0, seen
    for i in range(3):
        await _tokens(engine, f"after-{i}", temperature=0.0)
    assert engine.stats()["kv_cache_usage"] == 0.0, "no request runs"


async def test_a_chat_template_that_refuses_the_messages_rejects_the_request(engine: HFEngine) -> None:
    """Many templates raise on roles they do not take ("System role not supported"). That is the
    request's fault: ``invalid_request`` with the template's words (a 400 at the OpenAI edge).
    Before, it was an engine failure: a 500 with a traceback in the worker log, which SDKs retry."""
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = ("{% if messages[0]['role'] == 'system' %}"
                                      "{{ raise_exception('System role not supported') }}{% endif %}" + template)
    try:
        with pytest.raises(RequestRejected) as rejected:
            async for _ in engine.generate(EngineRequest("sys", (ChatMessage("system", "Be brief."), *PROMPT),
                                                         max_tokens=4)):
                pass
        assert rejected.value.code == "invalid_request"
        assert "System role not supported" in str(rejected.value)
        assert await _tokens(engine, "user-only", temperature=0.0), "other requests run on"
    finally:
        engine.tokenizer.chat_template = template


def test_a_template_that_does_not_parse_is_the_deployments_error(tiny_model) -> None:
    from jinja2 import TemplateSyntaxError
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model.target)
    tokenizer.chat_template = "{% if %}"
    with pytest.raises(TemplateSyntaxError):
        render_chat(tokenizer, PROMPT)


def test_load_failure_takes_a_path_too(tmp_path) -> None:
    """The hf engines keep their model directory as a Path: ``"/" in model`` raised TypeError,
    and the one-line message became a crash with a traceback."""
    error = load_failure(tmp_path / "model", ValueError("bad\nweights"))
    assert str(error) == f"cannot load the model {tmp_path / 'model'} (--model / LANES_MODEL): ValueError: bad weights"
    assert "no local directory" in str(load_failure(Path("models/x"), OSError("gone")))
