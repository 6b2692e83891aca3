"""Promise 1, "nothing lost": a worker killed with SIGKILL in the middle of its answers.

Real processes (scheduler, one edge, two hf workers on the tiny model), a real WebSocket.
The dead worker's leases expire, the reaper puts its requests back in their lanes, the other
worker continues each one after the tokens already in its stream, and the client gets every
token exactly once, in order, with the same text as an uninterrupted greedy run.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis

from conftest import scaled
from e2e_support import Client, System

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 20
MAX_TOKENS = 160
#: Deltas every request must have streamed before the kill (so it is truly mid-answer).
MIN_DELTAS_BEFORE_KILL = 3
#: Promise: a recovered request streams again within this many seconds of the kill.
RECOVERY_LIMIT_S = 3.0
#: Any frame arriving later than this after the kill can only come from the new attempt
#: (the lease alone is 1.5 s), so it marks where the recovered part begins.
IN_FLIGHT_SETTLE_S = 0.3

PROMPTS = [f"Question {i}: explain topic number {i} of the library reference." for i in range(NUM_REQUESTS)]


@pytest.fixture(scope="module")
def system(make_cluster) -> tuple[System, str]:
    # Every slot may run any lane, so both workers have room for the other's requests.
    slots = {"LANES_MAX_LONG_SLOTS": str(NUM_REQUESTS), "LANES_MAX_MEDIUM_LONG_SLOTS": str(NUM_REQUESTS)}
    sys_ = make_cluster(workers=2, env=slots, worker_args=("--max-slots", str(NUM_REQUESTS)))
    return sys_, sys_.edge_urls["edge"]


def running_by_worker(sys_: System, ids: list[str]) -> dict[str, list[str]]:
    """Which worker holds each running request, read from the request hashes."""
    client = redis.Redis.from_url(sys_.redis_url)
    try:
        held: dict[str, list[str]] = {}
        for rid in ids:
            state, worker = client.hmget(f"{sys_.prefix}:{{q}}:req:{rid}", "state", "worker")
            if state == b"running" and worker:
                held.setdefault(worker.decode(), []).append(rid)
        return held
    finally:
        client.close()


async def wait_mid_stream(client: Client, ids: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(len(client.deltas(rid)) < MIN_DELTAS_BEFORE_KILL for rid in ids):
        assert time.monotonic() < deadline, "requests did not start streaming"
        await asyncio.sleep(0.01)


def recovery_s(client: Client, rid: str, killed_at: float, num_before: int) -> float | None:
    """Kill -> arrival of the first delta the new attempt produced (None: nothing new)."""
    times = [t for f, t in zip(client.frames[rid], client.arrivals[rid]) if f["type"] == "delta"]
    return times[num_before] - killed_at if len(times) > num_before else None


async def test_worker_killed_mid_answer_loses_nothing(system: tuple[System, str], greedy_reference) -> None:
    sys_, url = system
    ids = [f"k{i}-{uuid.uuid4().hex[:4]}" for i in range(NUM_REQUESTS)]
    expected = {rid: greedy_reference(prompt, MAX_TOKENS).text for rid, prompt in zip(ids, PROMPTS)}
    client = await Client.connect(url)
    for rid, prompt in zip(ids, PROMPTS):
        await client.chat(rid, prompt, max_tokens=MAX_TOKENS, temperature=0.0)
    await wait_mid_stream(client, ids, scaled(60))

    held = running_by_worker(sys_, ids)
    victim_id = max(held, key=lambda w: len(held[w]))
    victims = held[victim_id]
    killed_at = time.monotonic()
    sys_.kill(victim_id.removeprefix(f"{sys_.prefix}-"))
    await asyncio.sleep(IN_FLIGHT_SETTLE_S)
    num_before = {rid: len(client.deltas(rid)) for rid in victims}

    dones = {rid: await client.wait(rid, timeout_s=scaled(120)) for rid in ids}
    for rid in ids:
        assert dones[rid]["type"] == "done", dones[rid]
        seqs = [f["seq"] for f in client.deltas(rid)]
        assert seqs == list(range(len(seqs))), f"{rid}: seq must be contiguous from 0, exactly once"
        assert client.text(rid) == expected[rid], f"{rid}: text differs from the uninterrupted greedy run"
    unfinished = [rid for rid in victims if dones[rid]["usage"]["completion_tokens"] > num_before[rid]]
    times = sorted(t for rid in unfinished if (t := recovery_s(client, rid, killed_at, num_before[rid])) is not None)
    assert times, "the killed worker's requests were all finished already; nothing recovered"
    print(f"\nkilled {victim_id} holding {len(victims)} of {NUM_REQUESTS} requests; "
          f"kill -> first recovered token: first {times[0]:.2f} s, last {times[-1]:.2f} s")
    assert times[0] <= scaled(RECOVERY_LIMIT_S), f"first recovered token {times[0]:.2f} s after the kill"
    await client.close()
