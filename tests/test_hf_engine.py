"""The transformers continuous-batching engine (``workers/engines/hf.py``, what ``lanes up``
serves) honours each request's sampling fields."""

from __future__ import annotations

import pytest
from lanes.queue.messages import ChatMessage
from lanes.workers.engines.base import EngineRequest
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
