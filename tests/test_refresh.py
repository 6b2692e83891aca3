"""The predictor keeps learning: observations in Redis -> arq job refit -> edges load it."""

from __future__ import annotations

import logging
import math

import pytest
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


async def test_a_refresh_with_a_memory_publishes_it_and_edges_load_it(plane: QueuePlane) -> None:
    ctx = {"plane": plane, "min_observations": 10, "memory_weight": 0.5}
    for i in range(30):
        await plane.redis.lpush(plane.keys.observations, encode(Observation(f"{PROMPT} Case {i}.", 2)))
    assert (await refresh_predictor(ctx))["version"] == 1
    published = await load_published(plane, 0)
    assert published is not None
    predictor = published[1]
    assert predictor.kind == "lexical+encoder+memory" and predictor.memory_weight == 0.5
    assert len(predictor.memory.targets) == 30  # one entry per distinct prompt
    # A prompt like those the window holds is pulled towards their 2-token answers by the memory.
    asked = f"{PROMPT} Case 99."
    assert predictor.memory.score(predictor.encoder.embed_text(asked)) == pytest.approx(math.log1p(2), abs=0.01)


def test_service_rates_smooth_claim_counts() -> None:
    rates = ServiceRates(half_life_s=1.0)
    assert rates.update({"short": 0}, 0) == {}
    assert rates.update({"short": 10}, 1000) == {"short": 10.0}
    assert rates.update({"short": 10}, 2000) == {"short": 5.0}, "one half-life of no claims halves it"


async def test_edges_route_by_the_thresholds_the_refresh_fitted(plane: QueuePlane) -> None:
    """A refit moves the prediction level; the refresh ships thresholds fitted for it, and an
    edge's reload loop routes by them (unless pinned). Real Redis, the real reload task."""
    import asyncio

    from lanes.queue.messages import Lane
    from lanes.scheduler.policy import LaneThresholds
    from lanes.telemetry import metrics
    from lanes.ws_server.edge import Edge
    from lanes.ws_server.settings import EdgeSettings

    short, long = "Say yes or no, case {}.", "Write a detailed essay about topic {}."
    async with plane.redis.pipeline(transaction=False) as pipe:
        for i in range(2000):  # LPUSH: the newest ends up first, as the workers leave them
            pipe.lpush(plane.keys.observations, encode(Observation((short if i % 2 else long).format(i),
                                                                   3 if i % 2 else 900)))
        await pipe.execute()
    assert (await refresh_predictor({"plane": plane}))["version"] == 1
    settings = dict(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix)
    following, pinned = Edge(EdgeSettings(**settings), plane), \
        Edge(EdgeSettings(**settings, follow_refreshed_routing=False), plane)
    # A threshold set explicitly is not overridden, unless following is asked for too.
    chosen = Edge(EdgeSettings(**settings, medium_max_tokens=600), plane)
    told = Edge(EdgeSettings(**settings, medium_max_tokens=600, follow_refreshed_routing=True), plane)
    edges = (following, pinned, chosen, told)
    assert following.thresholds == LaneThresholds(150, 750)
    tasks = [asyncio.create_task(edge.reload_predictor(interval_s=0.05)) for edge in edges]
    try:
        async with asyncio.timeout(30):
            while min(edge.predictor_version for edge in edges) < 1:
                await asyncio.sleep(0.05)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    fitted = following.lengths.predictor.routing
    assert fitted is not None and following.thresholds == fitted and pinned.thresholds == LaneThresholds(150, 750)
    assert chosen.thresholds == LaneThresholds(150, 600) and told.thresholds == fitted
    assert metrics.ROUTING_THRESHOLD.labels("short")._value.get() == fitted.short_max_tokens

    def lane(edge: Edge, text: str) -> Lane:
        return edge.policy.lane_for(edge.lengths.predictor.predict((ChatMessage("user", text),), 4096))

    assert lane(following, short.format("new")) is Lane.SHORT and lane(following, long.format("new")) is Lane.LONG


async def test_an_edge_skips_a_published_version_that_does_not_load(plane: QueuePlane, caplog) -> None:
    """Garbage under the predictor key: one warning naming the version, the shipped model kept,
    the version not fetched again; the next good version is loaded."""
    import asyncio
    import logging

    import pytest
    from lanes.scheduler.refresh import UnusableWeights
    from lanes.ws_server.edge import Edge
    from lanes.ws_server.settings import EdgeSettings

    assert await plane.fleet.publish_predictor(b"not an npz", 0) == 1
    with pytest.raises(UnusableWeights) as raised:
        await load_published(plane, 0)
    assert raised.value.version == 1 and "version 1 does not load" in str(raised.value)
    fetched: list[int] = []
    fetch = plane.fleet.published_predictor

    async def counted(known_version: int):  # what came back over the network, per call
        found = await fetch(known_version)
        fetched.append(0 if found is None else len(found[1]))
        return found

    plane.fleet.published_predictor = counted  # type: ignore[method-assign]
    edge = Edge(EdgeSettings(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix), plane)
    shipped = edge.lengths.predictor
    task = asyncio.create_task(edge.reload_predictor(interval_s=0.02))
    try:
        with caplog.at_level(logging.WARNING, logger="lanes.ws_server.edge"):
            async with asyncio.timeout(10):
                while len(fetched) < 20:
                    await asyncio.sleep(0.02)
            unusable = [r for r in caplog.records if "does not load" in r.getMessage()]
            assert len(unusable) == 1, "warned once, not at every reload"
            assert fetched[0] > 0 and not any(fetched[1:]), "the bad version's bytes were fetched once"
            assert edge.lengths.predictor is shipped and edge.predictor_version == 0
            for i in range(60):
                await plane.redis.lpush(plane.keys.observations, encode(Observation(f"{PROMPT} {i}", 2)))
            assert (await refresh_predictor({"plane": plane, "min_observations": 10}))["version"] == 2
            async with asyncio.timeout(10):
                while edge.predictor_version < 2:
                    await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert edge.lengths.predictor is not shipped


def test_the_refresh_window_caps_each_keys_share() -> None:
    from lanes.scheduler.refresh import refresh_window

    def obs(owner: str, n: int) -> list[Observation]:
        return [Observation(f"{owner} {i}", 1, owner) for i in range(n)]

    def prompts(window: list[Observation]) -> list[str]:
        return [o.prompt for o in window]

    alone = obs("a", 30)  # newest first
    assert refresh_window(alone, 10, 0.5) == alone[:10][::-1], "one key alone fills the window"
    assert refresh_window(alone, 50, 0.5) == alone[::-1]
    flood, few, many = obs("flood", 100), obs("few", 3), obs("many", 20)
    newest_first = flood[:40] + many[:10] + flood[40:] + many[10:]
    assert prompts(refresh_window(newest_first, 10, 0.5)) == \
        [f"many {i}" for i in range(4, -1, -1)] + [f"flood {i}" for i in range(4, -1, -1)], \
        "the flood's newest five give way to the other key's five newest, though older"
    newest_first = flood[:40] + few[:1] + flood[40:] + few[1:]
    assert prompts(refresh_window(newest_first, 10, 0.5)) == \
        [f"few {i}" for i in (2, 1, 0)] + [f"flood {i}" for i in range(6, -1, -1)], \
        "every entry of the small key, and the flood's newest fill the places it has no entries for"
    assert prompts(refresh_window(newest_first, 200, 0.5)) == prompts(newest_first[::-1]), "short list: all of it"
    assert len(refresh_window(newest_first, 10, 1.0)) == 10, "share 1: no limit"
    assert refresh_window([], 10, 0.5) == []


async def test_refresh_fits_on_the_capped_window_of_real_observations(plane: QueuePlane, caplog) -> None:
    """Workers' observations through the real fleet calls: one key's flood takes more than its
    share of the refit's window only where the other keys have no entries to fill it; stored
    prompts are clipped to what the predictor reads."""
    from lanes.queue.messages import (
        OBSERVED_PROMPT_HEAD_CHARS,
        OBSERVED_PROMPT_TAIL_CHARS,
    )

    for i in range(60):
        await plane.fleet.add_observation(Observation(f"{PROMPT} {i}", 2, "tenant"))
    for i in range(400):
        await plane.fleet.add_observation(Observation(f"Write an essay, take {i}.", 900, "flooder"))
    ctx = {"plane": plane, "min_observations": 10, "max_observations": 200, "max_key_share": 0.5}
    assert await refresh_predictor(ctx) == {"observations": 200, "version": 1}, \
        "the tenant's 60 are all in; the flood's newest 140 fill the places the tenant has no entries for"
    for i in range(90):
        await plane.fleet.add_observation(Observation(f"{PROMPT} {60 + i}", 2, "tenant"))
    for i in range(100):
        await plane.fleet.add_observation(Observation(f"Write an essay, take {400 + i}.", 900, "flooder"))
    with caplog.at_level(logging.INFO, logger="lanes.scheduler.refresh"):
        assert await refresh_predictor(ctx) == {"observations": 200, "version": 2}
    assert "200 observations from 2 API keys, the most from one key 100" in caplog.text, \
        "the tenant has 150 entries (all older than the flood's newest 100): the flood holds its half, no more"
    await plane.fleet.add_observation(Observation(PROMPT, 2, "tenant"))  # (an unchanged list is not refitted)
    assert await refresh_predictor({**ctx, "max_key_share": 1.0}) == {"observations": 200, "version": 3}
    long_prompt = "word " * 20_000
    await plane.fleet.add_observation(Observation(long_prompt, 9, "tenant"))
    stored = (await plane.fleet.observations(1))[0]
    assert len(stored.prompt) == OBSERVED_PROMPT_HEAD_CHARS + 1 + OBSERVED_PROMPT_TAIL_CHARS
    assert stored.prompt.startswith(long_prompt[:OBSERVED_PROMPT_HEAD_CHARS])
    assert stored.prompt.endswith(long_prompt[-OBSERVED_PROMPT_TAIL_CHARS:])
    assert (stored.output_tokens, stored.owner) == (9, "tenant")


async def test_a_refresh_with_nothing_new_publishes_nothing(plane: QueuePlane) -> None:
    """The same window gives the same model: no new version (edges would fetch ~1 MB for it)
    until an observation is added."""
    ctx = {"plane": plane, "min_observations": 10}
    for i in range(20):
        await plane.fleet.add_observation(Observation(f"{PROMPT} {i}", 2, "k"))
    assert await refresh_predictor(ctx) == {"observations": 20, "version": 1}
    assert await plane.fleet.published_added() == 20
    assert (await refresh_predictor(ctx))["version"] == 0, "nothing new: skipped"
    await plane.fleet.add_observation(Observation(PROMPT, 3, "k"))
    assert await refresh_predictor(ctx) == {"observations": 21, "version": 2}


async def test_observations_are_read_in_pages(plane: QueuePlane) -> None:
    from lanes.queue import fleet

    for i in range(2500):
        await plane.fleet.add_observation(Observation(f"p {i}", i))
    newest = await plane.fleet.observations(fleet.MAX_OBSERVATIONS)
    assert [o.output_tokens for o in newest] == list(range(2499, -1, -1)), "every entry once, newest first"
    assert [o.output_tokens for o in await plane.fleet.observations(1500)] == list(range(2499, 999, -1))


async def test_two_deployments_on_one_redis_each_take_their_refresh_tick(redis_url: str) -> None:
    """arq's job keys are not under LANES_KEY_PREFIX and a unique cron job's id is its name and
    tick: with one name for every deployment, the second to enqueue a tick found the first's job
    and skipped it, so one of two deployments sharing a Redis never refreshed."""
    import datetime
    import uuid

    from arq.connections import RedisSettings as ArqRedisSettings
    from arq.connections import create_pool
    from arq.cron import cron
    from arq.worker import Worker as ArqWorker
    from lanes.scheduler.service import refresh_cron

    tick = datetime.datetime(2030, 1, 1, 0, 5, tzinfo=datetime.UTC)  # the same tick for both
    pool = await create_pool(ArqRedisSettings.from_dsn(redis_url))
    queues = []
    try:
        for prefix in (f"alpha{uuid.uuid4().hex[:6]}", f"beta{uuid.uuid4().hex[:6]}"):
            queue = f"{prefix}:arq"
            worker = ArqWorker(functions=[], cron_jobs=[refresh_cron(prefix, 5, cron)], redis_pool=pool,
                               queue_name=queue, handle_signals=False)
            worker.cron_jobs[0].next_run = tick
            await worker.run_cron(tick, delay=0.5)
            queues.append(queue)
        assert [await pool.zcard(q) for q in queues] == [1, 1], "each deployment queued its own refresh"
    finally:
        for queue in queues:
            for job in await pool.zrange(queue, 0, -1):
                await pool.delete(b"arq:job:" + job)
            await pool.delete(queue)
        await pool.aclose()


def test_lane_thresholds_below_one_token_or_out_of_order_are_refused_at_start() -> None:
    """``LANES_SHORT_MAX_TOKENS=-5`` was accepted: the short lane then stayed empty without a
    word. Equal thresholds still pass: two lanes, short and long."""
    from pydantic import ValidationError

    from lanes.cli.failures import settings_error
    from lanes.ws_server.settings import EdgeSettings

    for values, named in (
        ({"short_max_tokens": -5}, "LANES_SHORT_MAX_TOKENS=-5: Input should be greater than or equal to 1"),
        ({"short_max_tokens": 0}, "LANES_SHORT_MAX_TOKENS=0"),
        ({"medium_max_tokens": 100}, "LANES_MEDIUM_MAX_TOKENS (100) is below LANES_SHORT_MAX_TOKENS (150)"),
    ):
        with pytest.raises(ValidationError) as refused:
            EdgeSettings(_env_file=None, **values)
        assert named in (settings_error(refused.value) or ""), settings_error(refused.value)
    assert EdgeSettings(_env_file=None, short_max_tokens=1, medium_max_tokens=1).medium_max_tokens == 1
