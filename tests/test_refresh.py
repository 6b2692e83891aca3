"""The predictor keeps learning: observations in Redis -> arq job refit -> edges load it."""

from __future__ import annotations

from lanes.queue.messages import ChatMessage, Observation, encode
from lanes.queue.plane import QueuePlane
from lanes.scheduler.predictor import load_default
from lanes.scheduler.refresh import load_published, refresh_predictor
from lanes.scheduler.service import ServiceRates

PROMPT = "Write one word that rhymes with cat."


async def test_refresh_publishes_a_refit_model(plane: QueuePlane) -> None:
    ctx = {"plane": plane, "min_observations": 10}
    assert (await refresh_predictor(ctx))["version"] == 0, "too few observations: nothing published"
    for _ in range(40):
        await plane.redis.lpush(plane.keys.observations, encode(Observation(PROMPT, 2)))
    await plane.redis.lpush(plane.keys.observations, b"not json")
    result = await refresh_predictor(ctx)
    assert result == {"observations": 40, "version": 1}
    published = await load_published(plane, 0)
    assert published is not None
    version, predictor = published
    msgs = (ChatMessage("user", PROMPT),)
    before, after = load_default().predict(msgs, 4096), predictor.predict(msgs, 4096)
    assert version == 1 and after < before, "the refit moved toward the observed 2-token answers"
    assert await load_published(plane, 1) is None, "no newer version"


def test_service_rates_smooth_claim_counts() -> None:
    rates = ServiceRates(half_life_s=1.0)
    assert rates.update({"short": 0}, 0) == {}
    assert rates.update({"short": 10}, 1000) == {"short": 10.0}
    assert rates.update({"short": 10}, 2000) == {"short": 5.0}, "one half-life of no claims halves it"
