"""lanes end to end on a real local Redis Cluster: three redis-server masters with a replica
each, a scheduler, two edges and three sim workers (real processes, all with
``LANES_REDIS_URL=redis+cluster://...``), real WebSocket clients.

Chats on both edges complete with contiguous seqs, a request resumes on the other edge, and the
master serving the queue plane (``{q}``: lanes, leases, worker registry) goes away while answers
stream: first a ``CLUSTER FAILOVER`` on its replica, then a ``kill -9`` of the master that took
over. What the clients see is printed (``pytest -s``: the longest pause per answer, errors) and
docs/redis-cluster.md records it; what is asserted: every request ends with exactly one
terminal frame, ``done`` with every token once and in order, and no process crashes.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections import Counter

import pytest
from cluster_support import LocalCluster, cluster_skip_reason
from conftest import scaled
from e2e_support import Client, System
from lanes.queue.keys import Keys
from lanes.queue.plane import QueuePlane

_SKIP = cluster_skip_reason()
pytestmark = [pytest.mark.skipif(bool(_SKIP), reason=_SKIP), pytest.mark.e2e, pytest.mark.slow]

NUM_WORKERS = 3
MAX_SLOTS = 8
#: Answers streaming when the fault hits, half on each edge.
NUM_IN_FLIGHT = 16
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def system(redis_cluster: LocalCluster, make_cluster) -> System:  # type: ignore[no-untyped-def]
    return make_cluster(workers=NUM_WORKERS, edges=2, redis=redis_cluster.url,
                        worker_args=("--engine", "sim", "--sim-time-scale", "1", "--max-slots", str(MAX_SLOTS)))


def check_answer(client: Client, rid: str, max_tokens: int) -> None:
    """One terminal frame, ``done``, and deltas seq 0..n-1 with the sim engine's text."""
    frames = client.frames[rid]
    ends = [f for f in frames if f["type"] in ("done", "error")]
    assert len(ends) == 1, f"{rid}: {len(ends)} terminal frames: {ends}"
    assert ends[0]["type"] == "done", f"{rid}: {ends[0]}"
    seqs = [f["seq"] for f in client.deltas(rid)]
    assert ends[0]["usage"]["completion_tokens"] == max_tokens, (ends[0], client.text(rid)[-200:])
    assert seqs == list(range(max_tokens)), f"{rid}: every token once, in order"
    assert client.text(rid) == "".join(f" tok{i}" for i in range(max_tokens))


async def attempts_of(plane: QueuePlane, ids: list[str]) -> list[int]:
    """How many workers claimed each request (a lease that ran out means one more)."""
    return [int(await plane.redis.hget(plane.keys.request(rid), "attempt") or 0) for rid in ids]


def longest_pause_s(client: Client, rid: str) -> float:
    times = [t for f, t in zip(client.frames[rid], client.arrivals[rid]) if f["type"] in ("delta", "done")]
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


async def wait_streaming(clients: list[tuple[Client, str]], min_deltas: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(len(c.deltas(rid)) < min_deltas for c, rid in clients):
        assert time.monotonic() < deadline, "answers did not start streaming"
        await asyncio.sleep(0.02)


async def test_chats_on_both_edges_complete(system: System) -> None:
    clients = [await Client.connect(system.edge_urls[name]) for name in ("edge_a", "edge_b")]
    asked = []
    for i in range(12):
        client, rid, num = clients[i % 2], f"c{i}-{uuid.uuid4().hex[:4]}", 16 + 8 * (i % 4)
        await client.chat(rid, f"Question {i} about the cluster.", max_tokens=num)
        asked.append((client, rid, num))
    for client, rid, num in asked:
        await client.wait(rid, timeout_s=scaled(60))
        check_answer(client, rid, num)
    for client in clients:
        await client.close()


async def test_resume_on_the_other_edge(system: System) -> None:
    first = await Client.connect(system.edge_urls["edge_a"])
    rid = f"resume-{uuid.uuid4().hex[:4]}"
    await first.chat(rid, "Tell me a long story.", max_tokens=MAX_TOKENS)
    await wait_streaming([(first, rid)], 10, scaled(30))
    await first.close()
    last_seq = first.deltas(rid)[-1]["seq"]
    second = await Client.connect(system.edge_urls["edge_b"])
    await second.send({"type": "resume", "id": rid, "last_seq": last_seq})
    done = await second.wait(rid, timeout_s=scaled(60))
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == MAX_TOKENS, done
    seqs = [f["seq"] for f in second.deltas(rid)]
    assert seqs == list(range(last_seq + 1, MAX_TOKENS)), "the rest, once, in order"
    await second.close()


@pytest.mark.parametrize("fault", ["failover", "kill"])
async def test_master_of_the_queue_plane_fails_over_mid_stream(system: System, redis_cluster: LocalCluster,
                                                                fault: str) -> None:
    """``failover`` runs first (manual, lossless), then ``kill`` (the master that took over gets
    SIGKILL; its replica, the first master, takes over again after the node timeout)."""
    master = redis_cluster.owner(Keys(system.prefix).watch)
    clients = [await Client.connect(system.edge_urls[name]) for name in ("edge_a", "edge_b")]
    asked = [(clients[i % 2], f"{fault}{i}-{uuid.uuid4().hex[:4]}") for i in range(NUM_IN_FLIGHT)]
    for i, (client, rid) in enumerate(asked):
        await client.chat(rid, f"Talk at length about topic {i}.", max_tokens=MAX_TOKENS)
    await wait_streaming(asked, 20, scaled(60))

    hit_at = time.monotonic()
    fault_task = asyncio.create_task(asyncio.to_thread(
        redis_cluster.failover if fault == "failover" else redis_cluster.kill, master))
    ok_at: list[float] = []
    fault_task.add_done_callback(lambda _: ok_at.append(time.monotonic()))
    # Chats sent while the fault plays out: they may be refused (``unavailable``) while the
    # queue plane's master is gone; each must still end with one frame.
    during = []
    for i in range(6):
        await asyncio.sleep(0.5)
        client, rid = clients[i % 2], f"{fault}-during{i}-{uuid.uuid4().hex[:4]}"
        await client.chat(rid, "A short one during the fault.", max_tokens=16)
        during.append((client, rid))
    new_master = await fault_task

    for client, rid in asked:
        await client.wait(rid, timeout_s=scaled(90))
    for client, rid in during:
        await client.wait(rid, timeout_s=scaled(60))
    await asyncio.sleep(0.5)  # a second terminal frame, if any, would show up now
    for client, rid in asked:
        check_answer(client, rid, MAX_TOKENS)
    outcomes = {}
    for client, rid in during:
        end = next(f for f in client.frames[rid] if f["type"] in ("done", "error"))
        outcomes[rid] = end["type"] if end["type"] == "done" else end["code"]
        assert end["type"] == "done" or end["code"] == "unavailable", end
        assert sum(f["type"] in ("done", "error") for f in client.frames[rid]) == 1
        if end["type"] == "done":
            check_answer(client, rid, 16)
    assert system.crashed() == [], f"crashed: {system.crashed()}"

    pauses = sorted(longest_pause_s(client, rid) for client, rid in asked)
    attempts = Counter(system.query(lambda plane: attempts_of(plane, [rid for _, rid in asked])))
    print(f"\n{fault} of the {{q}} master :{master.port} -> :{new_master.port}, cluster ok again after "
          f"{ok_at[0] - hit_at:.1f} s; {NUM_IN_FLIGHT} answers streaming: all done, every token once; "
          f"longest pause per answer: median {statistics.median(pauses):.2f} s, max {pauses[-1]:.2f} s; "
          f"attempts per answer: {dict(sorted(attempts.items()))}; chats sent during it: {dict(Counter(outcomes.values()))}")

    # Both edges serve new chats afterwards.
    for client, name in zip(clients, ("a", "b")):
        rid = f"{fault}-after-{name}-{uuid.uuid4().hex[:4]}"
        await client.chat(rid, "After the fault.", max_tokens=16)
        await client.wait(rid, timeout_s=scaled(30))
        check_answer(client, rid, 16)
    for client in clients:
        await client.close()
