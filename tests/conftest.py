"""Shared fixtures: a real redis-server on a random loopback port, the tiny model, a queue
plane under a key prefix of its own per test (so tests never see each other's keys), and
``make_cluster``: real lanes processes through the one process harness (``lanes.cli.cluster``).

Timing-sensitive waits scale by ``LANES_TEST_TIME_SCALE`` (default 1; raise it on slow CI).
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from lanes.queue.embedded import EmbeddedRedis
from lanes.queue.plane import QueuePlane
from lanes.queue.settings import RedisSettings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
TIME_SCALE = float(os.environ.get("LANES_TEST_TIME_SCALE", "1"))


def scaled(seconds: float) -> float:
    return seconds * TIME_SCALE


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture
def key_prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture
def redis_settings(redis_url: str, key_prefix: str) -> RedisSettings:
    return RedisSettings(redis_url=redis_url, key_prefix=key_prefix, lease_ms=1000, start_timeout_ms=1000)


@pytest.fixture
async def plane(redis_settings: RedisSettings) -> AsyncIterator[QueuePlane]:
    p = QueuePlane.from_settings(redis_settings)
    yield p
    await p.close()


#: ``await start_edge(**settings overrides)`` -> the in-process edge's ``host:port``.
StartEdge = Callable[..., Awaitable[str]]


@pytest.fixture
async def start_edge(redis_url: str, key_prefix: str) -> AsyncIterator[StartEdge]:
    """Start in-process edges with settings overrides; each returns its ``127.0.0.1:port``."""
    import asyncio

    from lanes.ws_server.edge import Edge
    from lanes.ws_server.settings import EdgeSettings

    running: list[tuple[asyncio.Task[None], QueuePlane]] = []

    async def start(**overrides: Any) -> str:
        settings = EdgeSettings(redis_url=redis_url, key_prefix=key_prefix, port=0, **overrides)
        plane = QueuePlane.from_settings(settings)
        edge = Edge(settings, plane)
        ready = asyncio.Event()
        running.append((asyncio.create_task(edge.serve(ready)), plane))
        await asyncio.wait_for(ready.wait(), 30)
        return f"127.0.0.1:{edge.port}"

    yield start
    for task, plane in running:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await plane.close()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory):  # -> Iterator[LocalCluster]
    """A local Redis Cluster (3 masters + 3 replicas) shared by one test module."""
    from cluster_support import LocalCluster

    with LocalCluster.start(tmp_path_factory.mktemp("redis-cluster")) as started:
        yield started


@pytest.fixture
def fresh_redis_cluster(tmp_path: Path):  # -> Iterator[LocalCluster]
    """A cluster of its own for a test that changes the topology."""
    from cluster_support import LocalCluster

    with LocalCluster.start(tmp_path) as started:
        yield started


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):  # -> TinyModelPaths
    from lanes.workers.models.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def make_cluster(redis_url: str, tmp_path_factory: pytest.TempPathFactory,
                 request: pytest.FixtureRequest) -> Iterator[Callable[..., object]]:
    """A factory of running clusters (``e2e_support.System``: the harness with fast fail-over),
    each under a key prefix of its own, all stopped when the module's tests are done.

    ``make_cluster(workers=1, edges=1, env={...})`` starts a scheduler, ``edges`` edges (named
    ``edge``, or ``edge_a``, ``edge_b``... when several) and ``workers`` workers (``worker``, or
    ``worker-0``...) on the tiny model unless ``worker_args`` say otherwise, and returns once
    every edge answers and every worker is warm. ``env`` (``LANES_*``) goes to every process.
    """
    from e2e_support import System

    made: list[System] = []

    def make(workers: int = 0, edges: int = 1, env: dict[str, str] | None = None, *,
             worker_args: Sequence[str] = (), scheduler: bool = True, redis: str | None = None) -> System:
        cluster = System(redis or redis_url, f"c{uuid.uuid4().hex[:6]}", tmp_path_factory.mktemp("cluster-logs"))
        cluster.base_env.update(env or {})
        made.append(cluster)
        if scheduler:
            cluster.start_scheduler()
        for i in range(edges):
            cluster.start_edge("edge" if edges == 1 else f"edge_{chr(ord('a') + i)}", timeout_s=scaled(60))
        given = "--model" in worker_args or "sim" in worker_args  # sim needs no model
        model = "" if given or not workers else str(request.getfixturevalue("tiny_model").target)
        for i in range(workers):
            cluster.start_worker("worker" if workers == 1 else f"worker-{i}", model, *worker_args)
        if workers:
            cluster.wait_workers(workers, timeout_s=scaled(120))
        return cluster

    yield make
    for cluster in made:
        cluster.stop()


@dataclass(frozen=True)
class Greedy:
    prompt_tokens: int
    ids: list[int]
    text: str


@pytest.fixture(scope="session")
def greedy_reference(tiny_model):  # -> Callable[[str, int], Greedy]
    """Greedy output of the tiny model called directly, no lanes code: the ground truth that
    every streamed answer must equal, token for token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model.target)
    model = AutoModelForCausalLM.from_pretrained(tiny_model.target, dtype=torch.float32)

    @functools.cache
    def greedy(content: str, max_tokens: int) -> Greedy:
        text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False).input_ids
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)[0, len(ids):].tolist()
        if tok.eos_token_id in out:
            out = out[: out.index(tok.eos_token_id) + 1]
        return Greedy(len(ids), out, tok.decode(out, skip_special_tokens=True))

    return greedy


def gpu_with(module: str) -> bool:
    """True where ``module`` (vllm, tensorrt_llm) is installed and CUDA is available."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return False
    import torch

    return torch.cuda.is_available()
