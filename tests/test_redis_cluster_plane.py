"""The queue plane on a real local Redis Cluster (3 masters + 3 replicas, redis-server 7+):
every operation a process performs, on pools whose keys live on different masters, and what
each of them does through a failover (``CLUSTER FAILOVER`` and ``kill -9``) of the master it uses.

Chosen by the URL: ``LANES_REDIS_URL=redis+cluster://host:port`` (docs/redis-cluster.md).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import suppress

import pytest
from cluster_support import LocalCluster, cluster_skip_reason
from conftest import scaled
from lanes.queue.backoff import Backoff
from lanes.queue.cluster import SlotConnection
from lanes.queue.connection import connect
from lanes.queue.errors import QueueUnavailable
from lanes.queue.keys import Keys
from lanes.queue.messages import (
    ChatMessage,
    Control,
    DepthSnapshot,
    Lane,
    Observation,
    RequestPayload,
    TokenBatch,
    TokenEvent,
    WorkerReport,
    decode,
)
from lanes.queue.plane import QueuePlane
from lanes.queue.pubsub import listen
from lanes.queue.settings import RedisSettings
from redis.asyncio.cluster import RedisCluster
from redis.cluster import key_slot

_SKIP = cluster_skip_reason()
pytestmark = [pytest.mark.skipif(bool(_SKIP), reason=_SKIP), pytest.mark.slow]

MSG = (ChatMessage("user", "hi"),)


def payload(request_id: str, lane: Lane = Lane.SHORT) -> RequestPayload:
    return RequestPayload(id=request_id, messages=MSG, max_tokens=8, lane=lane)


TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


def settings(url: str) -> RedisSettings:
    return RedisSettings(redis_url=url, key_prefix=f"t{uuid.uuid4().hex[:8]}", lease_ms=1000, start_timeout_ms=1000)


def pools_on_distinct_masters(redis_cluster: LocalCluster, prefix: str, num: int) -> list[str]:
    """``num`` pool names whose queue planes live on ``num`` different masters."""
    chosen: dict[int, str] = {}
    for name in ["default"] + [f"p{i}" for i in range(200)]:
        owner = redis_cluster.owner(Keys(prefix, name).watch).port
        chosen.setdefault(owner, name)
        if len(chosen) == num:
            return list(chosen.values())
    raise AssertionError("no pools found on distinct masters")


def ids_on(redis_cluster: LocalCluster, prefix: str, master_port: int, num: int, other: bool = False) -> list[str]:
    """Request ids whose token streams live on (or, ``other``, off) one master."""
    found = []
    for i in range(1000):
        rid = f"r{i}-{uuid.uuid4().hex[:4]}"
        if (redis_cluster.owner(Keys(prefix).stream(rid)).port == master_port) != other:
            found.append(rid)
        if len(found) == num:
            return found
    raise AssertionError("no ids found")


class Subscriber:
    """``listen`` in a task, collecting messages; counts (re)subscriptions."""

    def __init__(self, client: object, channels: list[str]) -> None:
        self.messages: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue()
        self.num_subscribed = 0
        self.subscribed = asyncio.Event()
        self._task = asyncio.create_task(self._run(client, channels))

    def _on_subscribed(self) -> None:
        self.num_subscribed += 1
        self.subscribed.set()

    async def _run(self, client: object, channels: list[str]) -> None:
        import logging

        async for item in listen(client, channels, Backoff("test", logging.getLogger("test")),  # type: ignore[arg-type]
                                 self._on_subscribed):
            await self.messages.put(item)

    async def next(self, timeout_s: float = 5) -> tuple[bytes, bytes]:
        return await asyncio.wait_for(self.messages.get(), scaled(timeout_s))

    async def stop(self) -> None:
        self._task.cancel()
        with suppress(asyncio.CancelledError):
            await self._task


@pytest.fixture
async def plane(redis_cluster: LocalCluster) -> AsyncIterator[QueuePlane]:
    p = QueuePlane.from_settings(settings(redis_cluster.url))
    yield p
    await p.close()


# -- choosing a cluster ----------------------------------------------------------------------

async def test_the_url_scheme_chooses_a_cluster(redis_cluster: LocalCluster, redis_url: str) -> None:
    plane = QueuePlane.from_settings(settings(redis_cluster.url))
    try:
        assert plane.cluster and isinstance(plane.redis, RedisCluster)
        assert plane.for_pool("small").cluster
        assert len(await plane.redis.cluster_slots()) == 3, "the seed node led to all three masters"
    finally:
        await plane.close()
    single = QueuePlane.from_settings(settings(redis_url))
    try:
        assert not single.cluster and not isinstance(single.redis, RedisCluster)
    finally:
        await single.close()
    with pytest.raises(ValueError, match="only database 0"):
        connect(redis_cluster.url + "/2")


def test_every_script_keeps_its_keys_in_one_slot() -> None:
    """The key groups each Lua script (and the multi-lane BZPOPMIN, and MGET of worker
    reports) touches, per pool: one slot each, and pools apart from each other."""
    for pool in ("default", "small", "large"):
        k = Keys("lanes", pool)
        queue_plane = [*k.pending_all(), k.request("x"), k.watch, k.claims, k.arrivals, k.depths]
        assert len({key_slot(key.encode()) for key in queue_plane}) == 1, pool
    stream = [Keys().stream("abc"), Keys().fence("abc")]
    assert len({key_slot(key.encode()) for key in stream}) == 1
    fleet = [Keys().workers, Keys().workers_lost, Keys().worker_info("w1"), Keys().worker_info("w2"),
             Keys().cron_tick("refresh", 7)]
    assert len({key_slot(key.encode()) for key in fleet}) == 1
    assert key_slot(Keys(pool="small").watch.encode()) != key_slot(Keys(pool="large").watch.encode())


# -- every operation, on pools served by three different masters ------------------------------

async def test_request_path_on_each_master(redis_cluster: LocalCluster, plane: QueuePlane) -> None:
    prefix = plane.settings.key_prefix
    edge_channel = plane.keys.edge_channel("e1")
    edge = Subscriber(plane.redis, [edge_channel, plane.keys.depth_channel])
    control = Subscriber(plane.redis, [plane.keys.control_channel("w1")])
    await asyncio.wait_for(asyncio.gather(edge.subscribed.wait(), control.subscribed.wait()), scaled(10))
    try:
        for pool in pools_on_distinct_masters(redis_cluster, prefix, 3):
            p = plane.for_pool(pool)
            rid, other = f"{pool}-a", f"{pool}-b"
            assert (await p.enqueue(payload(rid), "e1")).created
            assert not (await p.enqueue(payload(rid), "e1")).created
            await p.enqueue(payload(other, Lane.LONG), "e1")
            pending, _ = await p.lane_depths(await p.server_time_ms())
            assert pending == {"short": 1, "medium": 0, "long": 1}
            blocker = p.blocking_client(1)
            assert isinstance(blocker, SlotConnection)
            try:
                assert await p.pop(blocker, (Lane.SHORT, Lane.MEDIUM, Lane.LONG), 1) == (rid, Lane.SHORT)
                assert blocker.address == (("127.0.0.1", redis_cluster.owner(p.keys.watch).port))
                claim = await p.claim(rid, "w1")
                assert claim is not None and claim.attempt == 1 and claim.edge == "e1"
                assert await p.fence(rid, 1) == 1
                events = [TokenEvent(rid, 1, seq, f" tok{seq}", (seq,)) for seq in range(3)]
                appended, receivers = await p.append_publish("w1", {rid: events}, {rid: "e1"})
                assert appended == {rid: 3} and receivers == {"e1": 1}, "the edge subscribes where PUBLISH goes"
                channel, data = await edge.next()
                assert channel == edge_channel.encode() and decode(data, TokenBatch).events == tuple(events)
                assert await p.read_stream(rid, after_seq=0) == events[1:]
                assert await p.heartbeat([(rid, 1)]) == [("ok", "e1")]
                assert await p.repoint(rid, "e2") == "running"
                assert await p.request_records([rid, "nope"]) == {rid: ("e2", "running"), "nope": None}
                # The edge's retried cancels: one pipeline of raw EVALSHA (the cluster pipeline
                # refuses evalsha()), then the worker told by a raw PUBLISH.
                assert await p.cancel_many([rid, "nope"]) == {rid: ("running", "w1"), "nope": ("absent", "")}
                assert decode((await control.next())[1], Control).id == rid, "the worker is told"
                assert await p.cancel(rid) == ("cancelled", "w1")
                assert await p.release(rid, 1) == "dropped"
                assert await p.pop(blocker, (Lane.LONG,), 1) == (other, Lane.LONG)
                assert (await p.claim(other, "w1")) is not None
                assert await p.release(other, 1, Lane.MEDIUM, preempted=True) == "requeued"
                assert await p.pop(blocker, (Lane.MEDIUM,), 1) == (other, Lane.MEDIUM)
                assert (await p.claim(other, "w1")).times_preempted == 1  # type: ignore[union-attr]
                await p.fence(other, 2)
                await p.append({other: [TokenEvent(other, 2, 0, " end", (1,))]})
                assert await p.complete(other, 2, "done")
                assert (await p.last_event(other)).text == " end"  # type: ignore[union-attr]
                assert await p.request_status(other) == ("done", "w1")
                # A lease left to expire: the reaper hands it back, at its place in line.
                await p.enqueue(payload(f"{pool}-c"), "e1")
                assert await p.pop(blocker, (Lane.SHORT,), 1) == (f"{pool}-c", Lane.SHORT)
                await p.claim(f"{pool}-c", "w9")
                reaped = await p.reap(await p.server_time_ms() + 5000)
                assert [(r.id, r.action, r.worker) for r in reaped] == [(f"{pool}-c", "requeued", "w9")]
                assert await p.trace_and_streamed(rid) == ({}, 3), "its record and its stream: two slots"
                # The trace context is a field of the record (its pool's slot), read without the payload;
                # an older edge's record, without that field, is read through its payload.
                traced = RequestPayload(id=f"{pool}-t", messages=MSG, max_tokens=8, trace=TRACE)
                await p.enqueue(traced, "e1")
                assert await p.trace_and_streamed(traced.id) == (TRACE, 0)
                await p.redis.hdel(p.keys.request(traced.id), "trace")
                assert await p.trace_of(traced.id) == TRACE
            finally:
                await blocker.aclose()
        assert await plane.take_token("key1", rate_per_s=1.0, burst=1) == 0
        assert await plane.take_token("key1", rate_per_s=1.0, burst=1) > 0
    finally:
        await edge.stop()
        await control.stop()


async def test_fleet_state_on_a_cluster(plane: QueuePlane) -> None:
    fleet = plane.fleet
    now_ms = await plane.server_time_ms()
    for worker in ("w1", "w2"):
        await fleet.report(WorkerReport(worker=worker, running={}, slots=4, pool="small"), now_ms, ttl_ms=5000)
    assert sorted(await fleet.heard_from(now_ms, max_age_ms=1000)) == ["w1", "w2"]
    # A silent one dropped is recorded as lost by the same script (registry and record: one slot).
    await fleet.report(WorkerReport(worker="w9", running={}, slots=4), now_ms - 5000, ttl_ms=5000)
    assert sorted(await fleet.heard_from(now_ms, max_age_ms=1000)) == ["w1", "w2"]
    assert await fleet.recently_lost(now_ms, 10) == ([("w9", now_ms - 5000)], 1)
    assert sorted(r.worker for r in await fleet.reports()) == ["w1", "w2"], "MGET of reports: one slot"
    assert await fleet.num_workers("small") == 2
    assert await plane.worker_heartbeats(["w1", "w3"]) == {"w1": now_ms}
    await plane.for_pool("small").enqueue(payload("f1"), "e")
    assert await fleet.counters("small") == ({}, {"short": 1})
    snapshot = DepthSnapshot(at_ms=now_ms, pending={"short": 1}, running={}, oldest_wait_ms={}, workers=2, pool="small")
    await fleet.publish_depths(snapshot)
    assert decode(await fleet.depths_json("small"), DepthSnapshot) == snapshot  # type: ignore[arg-type]
    await fleet.add_observation(Observation("hello", 3))
    assert await fleet.observations(10) == [Observation("hello", 3)]
    assert await fleet.publish_predictor(b"weights", 1) == 1
    assert await fleet.published_predictor(0) == (1, b"weights")
    assert await fleet.claim_tick("refresh", 1, ttl_ms=5000)
    assert not await fleet.claim_tick("refresh", 1, ttl_ms=5000), "one scheduler per tick"
    assert await fleet.api_key("0" * 64) is None


async def test_refresh_runs_without_arq_once_per_tick(redis_cluster: LocalCluster) -> None:
    """On a cluster the scheduler refits the predictor from a plain periodic task; two
    schedulers publish one version per tick between them."""
    from lanes.scheduler.service import Scheduler
    from lanes.scheduler.settings import SchedulerSettings

    config = SchedulerSettings(redis_url=redis_cluster.url, key_prefix=f"t{uuid.uuid4().hex[:8]}",
                               predictor_min_observations=5)
    planes = [QueuePlane.from_settings(config) for _ in range(2)]
    for _ in range(8):
        await planes[0].fleet.add_observation(Observation("Write one word that rhymes with cat.", 2))
    loops = [asyncio.create_task(Scheduler(config, p)._refresh_loop(every_s=1.0)) for p in planes]
    try:
        async def published() -> int:
            while (found := await planes[0].fleet.published_predictor(0)) is None:
                await asyncio.sleep(0.1)
            return found[0]

        first = await asyncio.wait_for(published(), scaled(30))
        for i in range(12):  # 3 s, at most 4 tick boundaries: 4 refits, or ~8 without the lock
            await planes[0].fleet.add_observation(Observation(f"Write one word that rhymes with dog {i}.", 2))
            await asyncio.sleep(0.25)  # (something new at every tick: an unchanged window is not refitted)
        more = (await planes[0].fleet.published_predictor(0))[0] - first  # type: ignore[index]
        assert 1 <= more <= 4, f"{more} new versions in 3 ticks of 1 s with two schedulers"
    finally:
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        for p in planes:
            await p.close()


async def test_unblock_reaches_the_node_holding_the_pop(plane: QueuePlane) -> None:
    p = plane.for_pool("small")
    blocker = p.blocking_client(30)
    try:
        client_id = await p.client_id(blocker)
        pop = asyncio.create_task(p.pop(blocker, (Lane.SHORT,), timeout_s=30))
        await asyncio.sleep(0.2)
        await p.unblock(client_id)
        assert await asyncio.wait_for(pop, scaled(5)) is None
    finally:
        await blocker.aclose()


# -- failovers ------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", ["failover", "kill"])
async def test_queue_plane_through_a_failover(fresh_redis_cluster: LocalCluster, fault: str) -> None:
    """The master of a pool's queue plane, of a token stream and of an edge channel goes away
    (``CLUSTER FAILOVER`` on its replica, or ``kill -9``). The blocked pop ends in an error and
    re-blocks on the new master; scripts (whose cache did not come along) load themselves
    again; the subscriber follows its channel's slot to the new master."""
    cluster = fresh_redis_cluster
    plane = QueuePlane.from_settings(settings(cluster.url))
    prefix = plane.settings.key_prefix
    try:
        master = cluster.owner(plane.keys.watch)
        rid = ids_on(cluster, prefix, master.port, 1)[0]
        edge_id = next(e for e in (f"e{i}" for i in range(100))
                       if cluster.owner(plane.keys.edge_channel(e)).port == master.port)
        edge = Subscriber(plane.redis, [plane.keys.edge_channel(edge_id)])
        await asyncio.wait_for(edge.subscribed.wait(), scaled(10))
        await plane.enqueue(payload(rid), edge_id)
        blocker = plane.blocking_client(60)
        assert await plane.pop(blocker, (Lane.SHORT,), 1) == (rid, Lane.SHORT)
        await plane.claim(rid, "w1")
        await plane.fence(rid, 1)
        first = TokenEvent(rid, 1, 0, " tok0", (0,))
        assert await plane.append_publish("w1", {rid: [first]}, {rid: edge_id}) == ({rid: 1}, {edge_id: 1})
        await edge.next()

        blocked = asyncio.create_task(plane.pop(blocker, (Lane.SHORT,), timeout_s=60))
        await asyncio.sleep(0.3)
        new_master = await asyncio.to_thread(cluster.failover if fault == "failover" else cluster.kill, master)
        with pytest.raises(QueueUnavailable) as ended:
            await asyncio.wait_for(blocked, scaled(30))
        print(f"\n{fault}: the blocked pop ended with {type(ended.value).__name__}: {ended.value}")

        # Every call recovers on the new master (scripts reload themselves).
        async def retried(call):  # type: ignore[no-untyped-def]
            for _ in range(100):
                try:
                    return await call()
                except QueueUnavailable:
                    await asyncio.sleep(0.1)
            return await call()

        second = TokenEvent(rid, 1, 1, " tok1", (1,))
        assert await retried(lambda: plane.heartbeat([(rid, 1)])) == [("ok", edge_id)]
        # Sent twice (a flush retried after a lost answer) is still one event in the stream.
        assert (await retried(lambda: plane.append({rid: [first, second]}))) == {rid: 2}
        assert [e.seq for e in await plane.read_stream(rid)] == [0, 1]
        await plane.enqueue(payload("after"), edge_id)
        assert await retried(lambda: plane.pop(blocker, (Lane.SHORT,), 2)) == ("after", Lane.SHORT)
        assert blocker.address == ("127.0.0.1", new_master.port)  # type: ignore[union-attr]

        async def resubscribed() -> None:
            while edge.num_subscribed < 2:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(resubscribed(), scaled(15))  # the subscriber followed its channel's slot

        async def delivered_to_edge() -> int:
            while True:
                _, receivers = await retried(lambda: plane.append_publish("w1", {rid: [second]}, {rid: edge_id}))
                if receivers.get(edge_id):
                    return receivers[edge_id]
                await asyncio.sleep(0.1)

        assert await asyncio.wait_for(delivered_to_edge(), scaled(15)) == 1, "PUBLISH found it on the new master"
        await blocker.aclose()  # type: ignore[union-attr]
        await edge.stop()
    finally:
        await plane.close()


async def test_a_step_on_a_dead_master_still_delivers_the_rest(fresh_redis_cluster: LocalCluster) -> None:
    """A worker's flush for two requests, one whose stream lives on a master just killed: the
    other one is appended and published anyway, the flush raises, and its retry once the
    replica took over appends the rest without refusing what was already there."""
    cluster = fresh_redis_cluster
    plane = QueuePlane.from_settings(settings(cluster.url))
    prefix = plane.settings.key_prefix
    try:
        edge_master = cluster.owner(plane.keys.edge_channel("e1"))
        doomed = next(m for m in cluster.masters() if m.port != edge_master.port)
        lost = ids_on(cluster, prefix, doomed.port, 1)[0]
        kept = ids_on(cluster, prefix, doomed.port, 1, other=True)[0]
        edge = Subscriber(plane.redis, [plane.keys.edge_channel("e1")])
        await asyncio.wait_for(edge.subscribed.wait(), scaled(10))
        for rid in (lost, kept):
            await plane.fence(rid, 1)
        step = {rid: [TokenEvent(rid, 1, 0, " tok0", (0,))] for rid in (lost, kept)}
        edges = {lost: "e1", kept: "e1"}
        replica = cluster.replicas_of(doomed)[0]
        doomed.process.kill()
        doomed.process.wait()
        with pytest.raises(QueueUnavailable):
            await plane.append_publish("w1", step, edges)
        _, data = await edge.next()
        assert [e.id for e in decode(data, TokenBatch).events] == [kept], "the healthy request streamed on"
        await asyncio.to_thread(cluster._wait_promoted, replica, None, 30)
        for _ in range(100):
            try:
                appended, receivers = await plane.append_publish("w1", step, edges)
                break
            except QueueUnavailable:
                await asyncio.sleep(0.1)
        assert appended == {lost: 1, kept: 1} and receivers == {"e1": 1}
        await edge.stop()
    finally:
        await plane.close()
