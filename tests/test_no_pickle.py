"""Nothing crosses or rests in Redis as pickle, and no secret or chat text reaches the logs.

The end-to-end part runs the real processes against a password-protected redis-server, with
API keys required and a key made by the real ``lanes keys create``; then it reads back every
key in that Redis (all types) and every process log.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import websockets

from e2e_support import Client, System, wait_http
from lanes.queue.embedded import EmbeddedRedis, free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
PICKLE_MAGIC = b"\x80"  # every pickle of protocol 2 and newer starts with PROTO (0x80)
PROMPTS = ("Describe the ownership rules of a borrowed reference.", "Summarise what a generator expression is.")


def test_package_source_never_unpickles() -> None:
    """No module imports pickle (or its wrappers) or opts into pickled numpy/torch loads."""
    banned = re.compile(r"^\s*(import|from)\s+(c?pickle|_pickle|dill|cloudpickle|joblib|shelve)\b"
                        r"|allow_pickle\s*=\s*True|weights_only\s*=\s*False|pickle\.loads?\(", re.MULTILINE)
    this_file = Path(__file__).resolve()
    sources = [p for p in REPO_ROOT.rglob("*.py") if ".venv" not in p.parts and p.resolve() != this_file]
    assert len(sources) > 30, "the scan must see the package"
    offenders = [f"{p.relative_to(REPO_ROOT)}: {m.group(0).strip()}"
                 for p in sources for m in banned.finditer(p.read_text(encoding="utf-8", errors="replace"))]
    assert offenders == []


def redis_values(client: redis.Redis) -> Iterator[tuple[bytes, str, bytes]]:
    """Every stored value as (key, type, bytes): strings, hash fields and values, list items,
    set and zset members, stream entry fields and values."""
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        if kind == "none":  # gone between SCAN and TYPE (the system is still running: a watch entry ended)
            continue
        if kind == "string":
            parts = [client.get(key)]
        elif kind == "hash":
            parts = [part for field, value in client.hgetall(key).items() for part in (field, value)]
        elif kind == "list":
            parts = client.lrange(key, 0, -1)
        elif kind == "set":
            parts = list(client.smembers(key))
        elif kind == "zset":
            parts = [member for member, _ in client.zrange(key, 0, -1, withscores=True)]
        elif kind == "stream":
            parts = [part for _, fields in client.xrange(key) for kv in fields.items() for part in kv]
        else:
            raise AssertionError(f"unexpected Redis type {kind} at {key!r}")
        for part in parts:
            if part is not None:
                yield key, kind, part


@pytest.fixture(scope="module")
def secured(tiny_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[System, str, str, str]]:
    """(system, ws url, API key, Redis password): auth on, Redis behind a password."""
    password = f"pw-{secrets.token_hex(16)}"
    with EmbeddedRedis(password=password) as server:
        sys_ = System(server.url, f"np{uuid.uuid4().hex[:6]}", tmp_path_factory.mktemp("logs"))
        try:
            made = subprocess.run([sys.executable, "-m", "lanes.cli.main", "keys", "create", "e2e", "--rate-per-s", "0"],
                                  env=sys_.env(), capture_output=True, text=True, timeout=60, check=True)
            key = made.stdout.strip()
            sys_.start("scheduler", ["scheduler"])
            port = free_port()
            sys_.start("edge", ["edge"], LANES_PORT=str(port), LANES_EDGE_ID=f"{sys_.prefix}-edge",
                       LANES_AUTH_REQUIRED="true")
            wait_http(f"http://127.0.0.1:{port}/healthz", 60, [sys_.procs["edge"]])
            sys_.start_worker("worker", str(tiny_model.target), "--max-slots", "2")
            sys_.wait_workers(1)
            yield sys_, f"ws://127.0.0.1:{port}/v1/chat", key, password
        finally:
            sys_.stop()


@pytest.mark.e2e
async def test_real_traffic_leaves_no_pickle_no_key_and_no_chat_text_behind(
        secured: tuple[System, str, str, str]) -> None:
    sys_, url, key, password = secured
    client = Client(await websockets.connect(url, additional_headers={"Authorization": f"Bearer {key}"}))
    await client.chat("np-done", PROMPTS[0], max_tokens=24)
    await client.chat("np-cancel", PROMPTS[1], max_tokens=2000)
    assert (await client.wait("np-done"))["type"] == "done"
    while len(client.deltas("np-cancel")) < 3:
        await asyncio.sleep(0.01)
    await client.send({"type": "cancel", "id": "np-cancel"})
    assert (await client.wait("np-cancel"))["finish_reason"] == "cancelled"
    answers = [client.text("np-done"), client.text("np-cancel")]
    await client.close()
    assert all(len(a.strip()) >= 8 for a in answers), answers

    store = redis.Redis.from_url(sys_.redis_url)
    try:
        values = list(redis_values(store))
    finally:
        store.close()
    kinds = {kind for _, kind, _ in values}
    assert {"string", "hash", "zset", "stream"} <= kinds, f"traffic must have written every kind; saw {kinds}"
    pickled = [(k, kind) for k, kind, v in values if v.startswith(PICKLE_MAGIC)]
    assert pickled == [], f"pickled values in Redis: {pickled}"
    secret = key.encode()
    assert not any(secret in k or secret in v for k, _, v in values), "an API key is stored in clear"

    sys_.stop()  # flush every log
    logs = {p.name: p.read_text(errors="replace") for p in sys_.log_dir.glob("*.log")}
    assert set(logs) >= {"edge.log", "worker.log", "scheduler.log"}
    for name, text in logs.items():
        assert password not in text, f"{name} leaked the Redis password"
        assert key not in text, f"{name} leaked the API key"
        for prompt in PROMPTS:
            assert prompt not in text and prompt[:24] not in text, f"{name} leaked a prompt"
        for answer in answers:
            assert not _shares_a_chunk(answer, text), f"{name} leaked answer text"


def _shares_a_chunk(answer: str, text: str, size: int = 24) -> bool:
    """Whether any ``size``-character window of ``answer`` (not mostly blank) occurs in ``text``."""
    windows = (answer[i:i + size] for i in range(max(1, len(answer) - size + 1)))
    return any(len(w.strip()) >= size // 2 and w in text for w in windows)
