"""Redis's host vanishes without resetting the connections (a partition; a Redis address moved
to a new primary on failover, the old connections black-holed): every connection that waits on
Redis, the worker's blocking pop and each pub/sub subscription, must find out within
``LANES_REDIS_DEAD_AFTER_S`` and connect again. Before, they waited for good: the worker never
claimed again while its heartbeat (a connection with a command timeout) reconnected and looked
healthy, and an edge heard of its tokens only through its quiet-request checks.

Real processes and a real redis-server behind ``BlackHoleProxy``, which stops forwarding on the
connections it has (sockets kept open, no RST) and forwards new ones as usual.
"""

from __future__ import annotations

import asyncio
import http.client
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from blackhole import BlackHoleProxy
from conftest import scaled
from e2e_support import Client, System
from lanes.cli.cluster import FAST_FAILOVER_ENV
from lanes.queue.embedded import EmbeddedRedis, free_port
from lanes.queue.keys import Keys

pytestmark = pytest.mark.e2e

#: The bound the processes run with (the default is 15 s).
DEAD_AFTER_S = 2.0
#: What a recovery may take on top of it: the worker's 2 s pop, a command's 5 s timeout on each
#: pooled connection that was black-holed, backoff, a reaper round.
SLACK_S = 12.0


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[System, BlackHoleProxy, Path]]:
    server = EmbeddedRedis(port=free_port()).start()
    proxy = BlackHoleProxy("127.0.0.1", server.port)
    log_dir = tmp_path_factory.mktemp("logs")
    sys_ = System(proxy.url(), f"bh{uuid.uuid4().hex[:6]}", log_dir, redis=server,
                  base_env={**FAST_FAILOVER_ENV, "LANES_REDIS_DEAD_AFTER_S": str(DEAD_AFTER_S)})
    try:
        sys_.start_scheduler()
        sys_.start_edge()
        sys_.start_worker("worker", "", "--engine", "sim", "--sim-time-scale", "1", "--max-slots", "4")
        sys_.wait_workers(1)
        yield sys_, proxy, log_dir
    finally:
        sys_.close()
        proxy.close()


def seqs(client: Client, rid: str) -> list[int]:
    return [f["seq"] for f in client.deltas(rid)]


async def chat_until_accepted(client: Client, stem: str, max_tokens: int, timeout_s: float) -> str:
    """Send a chat, again under a new id while the edge answers ``unavailable`` (its own
    black-holed pooled connections fail one command each, after their 5 s timeout)."""
    deadline = time.monotonic() + timeout_s
    for attempt in range(100):
        rid = f"{stem}{attempt}-{uuid.uuid4().hex[:4]}"
        await client.chat(rid, f"Count for {rid}.", max_tokens=max_tokens)
        while time.monotonic() < deadline:
            frames = client.frames[rid]
            if any(f["type"] == "delta" for f in frames) or any(f["type"] == "done" for f in frames):
                return rid
            error = next((f for f in frames if f["type"] == "error"), None)
            if error is not None:
                assert error["code"] == "unavailable", error
                break
            await asyncio.sleep(0.05)
        else:
            return rid
    raise AssertionError("never accepted")


class StatsWatcher:
    """The dashboard's sample stream (``/v1/stats/stream``): the edge's stats subscription
    relays one sample a second. Arrival times of the samples, read in a thread."""

    def __init__(self, port: int) -> None:
        self.samples: list[float] = []
        threading.Thread(target=self._read, args=(port,), daemon=True).start()

    def _read(self, port: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=scaled(120))
        conn.request("GET", f"/v1/stats/stream?after_ms={int(time.time() * 1000)}")
        for line in conn.getresponse():
            if line.startswith(b"data:"):
                self.samples.append(time.monotonic())

    def since(self, at: float) -> int:
        return sum(t > at for t in self.samples)


async def start_long(client: Client, stats: StatsWatcher, max_tokens: int = 600) -> str:
    """A stream that will be in flight across the black hole (its tokens come through the
    edge's subscription), once it and the stats stream are under way."""
    rid = f"long-{uuid.uuid4().hex[:4]}"
    await client.chat(rid, "Talk at length.", max_tokens=max_tokens)
    deadline = time.monotonic() + scaled(20)
    while len(client.deltas(rid)) < 5 or not stats.samples:
        assert time.monotonic() < deadline, "the answer or the stats stream did not start"
        await asyncio.sleep(0.02)
    return rid


async def assert_whole(client: Client, rid: str, timeout_s: float) -> None:
    """``rid`` ends done with every token exactly once, in order."""
    end = await client.wait(rid, timeout_s=timeout_s)
    assert end["type"] == "done", end
    got = seqs(client, rid)
    assert got == list(range(len(got))) and len(got) == end["usage"]["completion_tokens"], "no token lost or repeated"
    assert client.text(rid) == "".join(f" tok{i}" for i in range(len(got)))


async def assert_streams_live(client: Client, stem: str) -> None:
    """Tokens flow through the edge's subscription, not only through its 3 s quiet-request
    checks (which read the stream of a request silent that long): a fresh answer streams its
    deltas in one go, no pause of 1.5 s or more."""
    rid = f"{stem}-{uuid.uuid4().hex[:4]}"
    await client.chat(rid, "Talk a while.", max_tokens=120)
    end = await client.wait(rid, timeout_s=scaled(30))
    assert end["type"] == "done" and seqs(client, rid) == list(range(120)), end
    arrivals = client.arrivals[rid]
    bursts = 1 + sum(b - a > scaled(1.5) for a, b in zip(arrivals, arrivals[1:]))
    span = arrivals[-1] - arrivals[0]
    print(f"{rid}: 120 tokens over {span:.1f} s in {bursts} bursts")
    assert bursts == 1, f"deltas came in {bursts} bursts over {span:.1f} s: the edge's subscription delivers nothing"


async def assert_samples_flow(stats: StatsWatcher, holed_at: float) -> None:
    seen = len(stats.samples)
    deadline = time.monotonic() + scaled(5)
    while len(stats.samples) < seen + 2:
        assert time.monotonic() < deadline, (f"no stats sample for the dashboard {time.monotonic() - holed_at:.0f} s "
                                             f"after the black hole ({stats.since(holed_at)} since)")
        await asyncio.sleep(0.1)


async def test_black_holed_subscriptions_recover(system: tuple[System, BlackHoleProxy, Path]) -> None:
    """Only the subscriptions (the edge's token and stats channels, the worker's control
    channel) are black-holed: the edge resubscribes within the bound and catches up."""
    sys_, proxy, _ = system
    client = await Client.connect(sys_.edge_urls["edge"])
    stats = StatsWatcher(sys_.edge_ports["edge"])
    long_id = await start_long(client, stats)
    holed = proxy.black_hole(sent=b"SUBSCRIBE")
    holed_at = time.monotonic()
    print(f"\nblack-holed {holed} subscriptions")
    assert holed == 3
    # The edge subscribes again: Redis counts its new subscriber beside the black-holed one.
    assert sys_.redis is not None
    direct = aioredis.Redis.from_url(sys_.redis.url)
    try:
        # The edge's token channel (its id carries a suffix of its own, per start).
        channel, = [c for c in await direct.pubsub_channels(Keys(sys_.prefix).edge_channel(sys_.child_id("edge")) + "*")
                    if not c.endswith(b":takeover")]
        deadline = holed_at + scaled(DEAD_AFTER_S + 5)
        while (numsub := (await direct.pubsub_numsub(channel))[0][1]) < 2:
            assert time.monotonic() < deadline, (f"the edge has not subscribed again {time.monotonic() - holed_at:.1f} s "
                                                 f"after the black hole ({numsub} subscriber to {channel}; channels: "
                                                 f"{await direct.pubsub_channels()})")
            await asyncio.sleep(0.05)
        print(f"the edge subscribed again {time.monotonic() - holed_at:.1f} s after the black hole")
    finally:
        await direct.aclose()
    await assert_whole(client, long_id, scaled(60))
    await assert_streams_live(client, "fresh")
    await assert_samples_flow(stats, holed_at)
    await client.close()


async def test_black_holed_connections_recover(system: tuple[System, BlackHoleProxy, Path]) -> None:
    sys_, proxy, log_dir = system
    client = await Client.connect(sys_.edge_urls["edge"])
    await client.chat("warm", "Hello there.", max_tokens=8)
    assert (await client.wait("warm", timeout_s=scaled(20)))["type"] == "done"

    stats = StatsWatcher(sys_.edge_ports["edge"])
    long_id = await start_long(client, stats)

    holed = proxy.black_hole()
    holed_at = time.monotonic()
    print(f"\nblack-holed {holed} connections")
    assert holed >= 6  # edge, worker, scheduler: pools, subscriptions, the blocking pop

    # A request sent after the black hole: a worker must claim it and its tokens reach us.
    bound_s = scaled(DEAD_AFTER_S + SLACK_S)
    after_id = await chat_until_accepted(client, "after", 16, bound_s)
    try:
        done = await client.wait(after_id, timeout_s=max(bound_s - (time.monotonic() - holed_at), 1.0))
    except TimeoutError:
        raise AssertionError(
            f"a chat sent after the black hole has not ended {time.monotonic() - holed_at:.1f} s later: "
            f"{client.frames[after_id]}; the stream in flight got {len(client.deltas(long_id))} deltas, the "
            f"dashboard {stats.since(holed_at)} samples since; queue: "
            f"{sys_.query(lambda p: p.lane_depths(0))}") from None
    after_s = time.monotonic() - holed_at
    print(f"a chat sent after the black hole ended {done['type']} after {after_s:.1f} s")
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == 16, done
    assert seqs(client, after_id) == list(range(16))

    await assert_whole(client, long_id, scaled(60))
    await assert_streams_live(client, "fresh")
    await assert_samples_flow(stats, holed_at)
    await client.close()
    for name, proc in sys_.procs.items():
        assert proc.poll() is None, f"{name} exited"
    worker_log = (log_dir / "worker.log").read_text()
    print("\n".join(line for line in worker_log.splitlines() if "claim loop" in line or "control channel" in line))
