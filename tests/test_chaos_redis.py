"""Promise 4, "nothing lost" without Redis: the redis-server is stopped under load and
started again on the same port (empty: persistence is off, as in the embedded default).

Real processes (scheduler, edge, one sim worker) and a real redis-server of its own. While
Redis is down no process crashes or spins, and a new chat gets ``unavailable`` at once.
Every request in flight ends with a frame, ``done`` or an ``error`` whose code says why
(``request_lost``: its state went with the restart), never a hang. Afterwards the same
processes, reconnected with backoff, serve new requests normally.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Iterator

import pytest
from conftest import scaled
from e2e_support import Client, System
from lanes.bench.common import cpu_s
from lanes.queue.embedded import EmbeddedRedis, free_port

pytestmark = pytest.mark.e2e

NUM_IN_FLIGHT = 10
OUTAGE_S = 3.0
#: A process using more of a core than this while Redis is down is spinning.
MAX_IDLE_CPU_SHARE = 0.5
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def system(port: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[System, str]]:
    # Its own redis-server on a known port: the test stops it and starts it again there.
    sys_ = System.embedded(f"cr{uuid.uuid4().hex[:6]}", tmp_path_factory.mktemp("logs"), port=port)
    try:
        sys_.start_scheduler()
        url = sys_.start_edge()
        sys_.start_worker("worker", "", "--engine", "sim", "--sim-time-scale", "1", "--max-slots", "6")
        sys_.wait_workers(1)
        yield sys_, url
    finally:
        sys_.close()


def assert_contiguous(client: Client, rid: str) -> None:
    seqs = [f["seq"] for f in client.deltas(rid)]
    assert seqs == list(range(len(seqs))), f"{rid}: no duplicate, no gap"
    assert client.text(rid) == "".join(f" tok{i}" for i in range(len(seqs)))[: len(client.text(rid))]


async def test_redis_restart_under_load(system: tuple[System, str], port: int) -> None:
    sys_, url = system
    client = await Client.connect(url)
    await client.chat("warm", "Hello there.", max_tokens=8)
    assert (await client.wait("warm", timeout_s=scaled(20)))["type"] == "done"

    ids = [f"load{i}-{uuid.uuid4().hex[:4]}" for i in range(NUM_IN_FLIGHT)]
    for rid in ids:
        await client.chat(rid, f"Talk at length about {rid}.", max_tokens=400)
    await asyncio.sleep(1.0)  # six run, four wait in their lanes

    sys_.redis.stop()
    cpu_before = {name: cpu_s(p.pid) for name, p in sys_.procs.items()}
    await client.chat("during", "Anyone there?", max_tokens=8)
    during = await client.wait("during", timeout_s=scaled(15))
    assert during["type"] == "error" and during["code"] == "unavailable", during
    await asyncio.sleep(OUTAGE_S)
    for name, proc in sys_.procs.items():
        assert proc.poll() is None, f"{name} crashed while Redis was down"
        share = (cpu_s(proc.pid) - cpu_before[name]) / (OUTAGE_S + 0.1)
        print(f"\n{name}: {share:.0%} of a core while Redis was down")
        assert share < MAX_IDLE_CPU_SHARE, f"{name} spins while Redis is down"

    sys_.redis = EmbeddedRedis(port=port).start()  # empty, same port
    restarted_at = time.monotonic()
    endings = {rid: await client.wait(rid, timeout_s=scaled(30)) for rid in ids}
    for rid, end in endings.items():
        assert end["type"] == "done" or end.get("code") == "request_lost", end
        assert_contiguous(client, rid)
    print(f"in-flight requests ended after the restart in {time.monotonic() - restarted_at:.1f} s: "
          f"{sum(e['type'] == 'done' for e in endings.values())} done, "
          f"{sum(e.get('code') == 'request_lost' for e in endings.values())} request_lost")

    sys_.wait_workers(1, timeout_s=scaled(20))  # the worker re-registered with its heartbeat
    # With nothing queued, the claim loop's first (empty) answer from Redis ends its outage: it
    # logged "recovered" only at the next claim, so a quiet restart read as a minutes-long outage.
    deadline = time.monotonic() + scaled(10)
    while "claim loop: recovered after" not in (log := (sys_.log_dir / "worker.log").read_text()):
        assert time.monotonic() < deadline, log[-3000:]
        await asyncio.sleep(0.2)
    took = float(log.split("claim loop: recovered after ")[-1].split(" s")[0])
    assert took < time.monotonic() - restarted_at + OUTAGE_S + scaled(5), log[-3000:]
    for i in range(3):
        await client.chat(f"after{i}", "Back again?", max_tokens=16)
    for i in range(3):
        done = await client.wait(f"after{i}", timeout_s=scaled(20))
        assert done["type"] == "done" and done["usage"]["completion_tokens"] == 16, done
        assert_contiguous(client, f"after{i}")
    await client.close()


async def test_redis_paused_longer_than_a_lease_loses_nothing(system: tuple[System, str]) -> None:
    """SIGSTOP/SIGCONT: Redis keeps its state but answers nothing for longer than a lease.

    Leases run out meanwhile, so the reaper may hand running requests to a new attempt; the
    fenced stream still lets each token through exactly once, and every request ends ``done``.
    """
    sys_, url = system
    client = await Client.connect(url)
    ids = [f"pause{i}-{uuid.uuid4().hex[:4]}" for i in range(NUM_IN_FLIGHT)]
    for rid in ids:
        await client.chat(rid, f"Talk at length about {rid}.", max_tokens=120)
    await asyncio.sleep(1.0)
    server = sys_.redis.process
    server.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(OUTAGE_S)
    finally:
        server.send_signal(signal.SIGCONT)
    for rid in ids:
        done = await client.wait(rid, timeout_s=scaled(60))
        assert done["type"] == "done" and done["usage"]["completion_tokens"] == 120, done
        assert_contiguous(client, rid)
        assert len(client.deltas(rid)) == 120
    await client.close()


async def test_a_redis_that_stops_answering_gets_a_clear_answer_not_a_hang(system: tuple[System, str]) -> None:
    """SIGSTOP for longer than the command timeout (a hung Redis, a network partition: nothing
    closes the connections): a chat sent meanwhile gets ``unavailable`` and ``/healthz`` a 503
    within one or two ``COMMAND_TIMEOUT_S`` (two where the connection was idle long enough for a
    health-check PING first), not when Redis answers again (before: both waited out the whole
    outage); the requests already running still end ``done``, every token once."""
    import json
    import urllib.error
    import urllib.request

    from lanes.queue.connection import COMMAND_TIMEOUT_S

    sys_, url = system
    client = await Client.connect(url)
    ids = [f"hang{i}-{uuid.uuid4().hex[:4]}" for i in range(4)]
    for rid in ids:
        await client.chat(rid, f"Talk at length about {rid}.", max_tokens=60)
    await asyncio.sleep(1.0)

    def healthz() -> tuple[int, float]:
        started = time.monotonic()
        try:
            with urllib.request.urlopen(url.replace("ws://", "http://").replace("/v1/chat", "/healthz"),
                                        timeout=60) as resp:
                return resp.status, time.monotonic() - started
        except urllib.error.HTTPError as err:
            assert json.loads(err.read())["status"] == "redis_unreachable"
            return err.code, time.monotonic() - started

    server = sys_.redis.process
    server.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(0.5)
        health = asyncio.create_task(asyncio.to_thread(healthz))
        started = time.monotonic()
        rid = f"during-{uuid.uuid4().hex[:4]}"
        await client.chat(rid, "Hello?", max_tokens=5)
        refused = await client.wait(rid, timeout_s=2 * COMMAND_TIMEOUT_S + scaled(10))
        waited_s = time.monotonic() - started
        status, health_s = await health
    finally:
        server.send_signal(signal.SIGCONT)
    assert refused["type"] == "error" and refused["code"] == "unavailable", refused
    assert waited_s < 2 * COMMAND_TIMEOUT_S + scaled(2.5), waited_s
    assert status == 503 and health_s < 2 * COMMAND_TIMEOUT_S + scaled(2.5), (status, health_s)
    for rid in ids:
        done = await client.wait(rid, timeout_s=scaled(60))
        assert done["type"] == "done" and done["usage"]["completion_tokens"] == 60, done
        assert_contiguous(client, rid)
    await client.close()
