"""lanes' Redis patterns on a real local Redis Cluster (3 masters + 3 replicas, redis-server 7+).

What holds, what redis-py 5.x (held there by arq's ``redis<6`` pin) lacks, and what a failover
does to scripts, blocking pops and subscriptions, as measured: docs/redis-cluster.md. Outcomes
of a fault are printed (``pytest -s``) and asserted where the server guarantees them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import redis
import redis.asyncio as aredis
from cluster_support import LocalCluster, cluster_skip_reason
from conftest import scaled
from redis.asyncio.client import PubSub as AsyncPubSub
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.cluster import key_slot
from redis.exceptions import NoScriptError, RedisClusterException, ResponseError

_SKIP = cluster_skip_reason()
pytestmark = [pytest.mark.skipif(bool(_SKIP), reason=_SKIP), pytest.mark.slow]

# One pool's queue-plane keys share the hash tag {q:<pool>} (DESIGN.md's {q}, per pool).
LANE = "lanes:{q:small}:pending:short"
SEQ = "lanes:{q:small}:seq"
#: Enqueue-like script: two keys of one pool, one atomic step.
ENQUEUE = "redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2]); return redis.call('INCR', KEYS[2])"
PROBE = "return redis.call('GET', KEYS[1])"


@pytest.fixture
async def client(redis_cluster: LocalCluster) -> AsyncIterator[AsyncRedisCluster]:
    c = redis_cluster.async_client()
    yield c
    await c.aclose()


async def next_message(pubsub: AsyncPubSub, timeout_s: float = 5.0) -> dict[str, object] | None:
    """The next non-None message within a (scaled) deadline, else None."""
    deadline = asyncio.get_running_loop().time() + scaled(timeout_s)
    while asyncio.get_running_loop().time() < deadline:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
        if message is not None:
            return message
    return None


# -- what works across slots and nodes

async def test_multi_key_lua_within_one_pool_tag(client: AsyncRedisCluster) -> None:
    assert key_slot(LANE.encode()) == key_slot(SEQ.encode())
    first = await client.eval(ENQUEUE, 2, LANE, SEQ, 1, "r1")
    second = await client.eval(ENQUEUE, 2, LANE, SEQ, 2, "r2")
    assert second == first + 1
    assert await client.zrange(LANE, 0, -1) == ["r1", "r2"]
    # A multi-lane blocking pop (BZPOPMIN over a pool's lanes) is one slot too.
    assert await client.bzpopmin([LANE, "lanes:{q:small}:pending:long"], timeout=1) == (LANE, "r1", 1.0)


async def test_keys_of_two_pools_cannot_share_a_script(client: AsyncRedisCluster, redis_cluster: LocalCluster) -> None:
    other = "lanes:{q:large}:seq"
    assert key_slot(other.encode()) != key_slot(SEQ.encode())
    # redis-py refuses before sending: it cannot pick one node for keys of two slots.
    with pytest.raises(RedisClusterException, match="same key slot|same slot|all keys"):
        await client.eval(ENQUEUE, 2, LANE, other, 1, "r1")
    # Sent to a node anyway, the server refuses it too (CROSSSLOT), even when it owns one key.
    owner = redis_cluster.owner(SEQ)
    with owner.client() as direct, pytest.raises(ResponseError, match="CROSSSLOT"):
        direct.eval(ENQUEUE, 2, LANE, other, 1, "r1")


async def test_classic_publish_reaches_subscribers_on_every_node(
    client: AsyncRedisCluster, redis_cluster: LocalCluster
) -> None:
    # Classic pub/sub is broadcast over the cluster bus: a subscriber on any node (replicas
    # included) gets what was published on any other.
    channel = "lanes:edge:e1"
    subscribers = []
    for node in redis_cluster.live_nodes():
        conn = aredis.Redis(port=node.port, decode_responses=True)
        pubsub = conn.pubsub()
        await pubsub.subscribe(channel)
        subscribers.append((conn, pubsub))
    try:
        # Through the cluster client (no publish() method in redis-py 5.x asyncio: a raw command),
        # and straight to one node: both fan out everywhere.
        assert not hasattr(AsyncRedisCluster, "publish")
        await client.execute_command("PUBLISH", channel, "via-cluster-client")
        with redis_cluster.masters()[-1].client() as direct:
            direct.publish(channel, "via-one-node")
        for _, pubsub in subscribers:
            got = [(await next_message(pubsub) or {}).get("data") for _ in range(2)]
            assert sorted(got) == ["via-cluster-client", "via-one-node"]  # type: ignore[type-var]
    finally:
        for conn, pubsub in subscribers:
            await pubsub.aclose()
            await conn.aclose()


async def test_what_redis_py_5_lacks_for_sharded_pubsub(client: AsyncRedisCluster, redis_cluster: LocalCluster) -> None:
    assert redis.VERSION[0] == 5, "this test documents redis-py 5.x (arq pins redis<6); re-measure on upgrade"
    channel = "lanes:{q:small}:edge:e1"
    # The asyncio cluster client has no pubsub() and no spublish(); the asyncio PubSub does not
    # know shard messages ("smessage" is treated as a subscribe-type reply).
    assert not hasattr(AsyncRedisCluster, "pubsub")
    assert not hasattr(AsyncRedisCluster, "spublish")
    assert "smessage" not in AsyncPubSub.PUBLISH_MESSAGE_TYPES
    assert not hasattr(AsyncPubSub, "ssubscribe")
    # What works: SPUBLISH as a raw command (the cluster client routes it by the channel's slot),
    # and a raw SSUBSCRIBE on a plain asyncio connection to the slot's owner.
    owner = redis_cluster.owner(channel)
    conn = aredis.Redis(port=owner.port, decode_responses=True)
    pubsub = conn.pubsub()
    try:
        await pubsub.execute_command("SSUBSCRIBE", channel)
        assert (await pubsub.get_message(timeout=scaled(5)) or {}).get("type") == "ssubscribe"
        assert await client.execute_command("SPUBLISH", channel, "tok") == 1
        message = await pubsub.get_message(timeout=scaled(5))
        assert message is not None and (message["type"], message["data"]) == ("smessage", "tok")
    finally:
        await pubsub.aclose()
        await conn.aclose()
    # On any other node the subscription is refused with a redirect.
    other = next(m for m in redis_cluster.masters() if m.node_id != owner.node_id)
    with other.client() as direct, pytest.raises(ResponseError, match="MOVED"):
        direct.execute_command("SSUBSCRIBE", channel)
    # The sync cluster client does have sharded pub/sub in redis-py 5.x.
    sync = SyncRedisCluster(host="127.0.0.1", port=owner.port, decode_responses=True)
    try:
        sharded = sync.pubsub()
        sharded.ssubscribe(channel)
        # Without target_node, get_sharded_message ignores its timeout (one non-blocking poll).
        node = sync.get_node_from_key(channel)
        assert (sharded.get_sharded_message(timeout=scaled(5), target_node=node) or {}).get("type") == "ssubscribe"
        sync.spublish(channel, "tok2")
        assert (sharded.get_sharded_message(timeout=scaled(5), target_node=node) or {}).get("data") == "tok2"
        sharded.close()
    finally:
        sync.close()


async def test_cluster_pipeline_blocks_publish_and_evalsha(client: AsyncRedisCluster) -> None:
    # lanes pipelines EVALSHA (token appends) and PUBLISH (edge batches); redis-py 5.x's cluster
    # pipeline refuses both by name but routes the same commands sent with execute_command.
    sha = await client.script_load(ENQUEUE)  # SCRIPT LOAD goes to every master
    async with client.pipeline(transaction=False) as pipe:
        for name, call in (("evalsha", lambda: pipe.evalsha(sha, 2, LANE, SEQ, 1, "x")),
                           ("publish", lambda: pipe.publish("lanes:edge:e1", "x"))):
            with pytest.raises(RedisClusterException, match=f"pipelined function {name} is blocked"):
                call()
    async with client.pipeline(transaction=False) as pipe:
        for i in range(6):  # six requests, six token-stream slots, spread over the masters
            pipe.execute_command("EVALSHA", sha, 2, f"lanes:{{r:{i}}}:tok", f"lanes:{{r:{i}}}:seq", 1, "x")
        pipe.execute_command("PUBLISH", "lanes:edge:e1", "batch")
        assert await pipe.execute() == [1, 1, 1, 1, 1, 1, 0]


# -- failover: what clients see

@dataclass
class ScriptLoop:
    """Runs ENQUEUE back to back, recording acknowledged sequence numbers and errors."""

    client: AsyncRedisCluster
    acked: list[int] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    acked_after_error: int = 0
    #: Loop time of each acknowledgement (for the longest pause, printed, never asserted).
    acked_at_s: list[float] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def longest_pause_s(self) -> float:
        return max((b - a for a, b in zip(self.acked_at_s, self.acked_at_s[1:])), default=0.0)

    async def run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                self.acked.append(await self.client.eval(ENQUEUE, 2, LANE, SEQ, n, f"r{n}"))
                self.acked_at_s.append(asyncio.get_running_loop().time())
                if self.errors:
                    self.acked_after_error += 1
            except (redis.RedisError, OSError) as err:
                self.errors[type(err).__name__] += 1
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.002)

    async def run_until(self, enough: int, timeout_s: float) -> None:
        """Keep running until ``enough`` more acknowledgements (or the deadline), then stop."""
        target = len(self.acked) + enough
        deadline = asyncio.get_running_loop().time() + scaled(timeout_s)
        while len(self.acked) < target and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        self.stop.set()


async def _subscribe(port: int, channel: str) -> tuple[aredis.Redis, AsyncPubSub]:
    conn = aredis.Redis(port=port, decode_responses=True)
    pubsub = conn.pubsub()
    await pubsub.subscribe(channel)
    return conn, pubsub


async def _outcome(task: asyncio.Task[object]) -> str:
    try:
        return f"result {await asyncio.wait_for(task, scaled(30))!r}"
    except (redis.RedisError, OSError) as err:
        return f"{type(err).__name__}: {err}"


async def test_manual_failover_loses_nothing_and_clients_follow(fresh_redis_cluster: LocalCluster) -> None:
    cluster = fresh_redis_cluster
    master = cluster.owner(SEQ)
    other = next(m for m in cluster.masters() if m.node_id != master.node_id)
    client, blocker = cluster.async_client(), cluster.async_client()
    sub_old = await _subscribe(master.port, "lanes:edge:e1")
    sub_other = await _subscribe(other.port, "lanes:edge:e1")
    shard_conn = aredis.Redis(port=master.port, decode_responses=True)
    shard = shard_conn.pubsub()
    await shard.execute_command("SSUBSCRIBE", "lanes:{q:small}:edge:e1")
    await shard.get_message(timeout=scaled(5))
    probe_sha = await client.script_load(PROBE)  # cached on every master, not on replicas
    loop = ScriptLoop(client)
    runner = asyncio.create_task(loop.run())
    blocked = asyncio.create_task(blocker.bzpopmin(["lanes:{q:small}:pending:urgent"], timeout=scaled(20)))
    try:
        await loop.run_until(20, 30)  # traffic before the switch
        await runner
        loop.stop.clear()
        runner = asyncio.create_task(loop.run())
        new_master = await asyncio.to_thread(cluster.failover, master)
        await loop.run_until(20, 30)  # and after it
        await runner
        await client.zadd("lanes:{q:small}:pending:urgent", {"u1": 1})
        blocked_outcome = await _outcome(blocked)
        final = int(await client.get(SEQ))
        await client.execute_command("PUBLISH", "lanes:edge:e1", "after-failover")
        old_got = await next_message(sub_old[1])
        other_got = await next_message(sub_other[1])
        shard_got = await shard.get_message(timeout=scaled(5))
        # The script cache is per node and a failover does not carry it: a raw EVALSHA now fails,
        # a registered Script (and lanes' "except NoScriptError: SCRIPT LOAD") recovers.
        with pytest.raises(NoScriptError):
            await client.evalsha(probe_sha, 1, SEQ)
        assert await client.register_script(PROBE)(keys=[SEQ]) == str(final)
        print(f"\nmanual failover {master.port} -> {new_master.port}: acked {len(loop.acked)}, final {final}, "
              f"errors {dict(loop.errors)}, longest pause {loop.longest_pause_s * 1e3:.0f} ms; blocked BZPOPMIN on the old master: {blocked_outcome}; "
              f"classic subscriber on old master got {old_got and old_got['data']!r}, elsewhere "
              f"{other_got and other_got['data']!r}; sharded subscriber got {shard_got}")
        # Coordinated: the replica caught up before the switch, so no acknowledged write is lost
        # and none repeats; the cluster client followed the MOVED redirect to the new master.
        assert loop.acked == list(range(1, final + 1))
        assert cluster.owner(SEQ).node_id == new_master.node_id
        # A pop blocked on the demoted master is not moved by redis-py: the caller gets the
        # server's UNBLOCKED error and must retry (the retry is redirected to the new master).
        assert blocked_outcome.startswith("ResponseError: UNBLOCKED")
        # The demoted master stays up as a replica: classic subscriptions on it keep working.
        assert old_got is not None and other_got is not None
        # Sharded subscriptions on the demoted node are dropped by the server (sunsubscribe).
        assert shard_got is not None and shard_got["type"] == "sunsubscribe"
    finally:
        loop.stop.set()
        blocked.cancel()
        for conn, pubsub in (sub_old, sub_other, (shard_conn, shard)):
            await pubsub.aclose()
            await conn.aclose()
        await client.aclose()
        await blocker.aclose()


async def test_master_kill_what_clients_see(fresh_redis_cluster: LocalCluster) -> None:
    cluster = fresh_redis_cluster
    master = cluster.owner(SEQ)
    other = next(m for m in cluster.masters() if m.node_id != master.node_id)
    client = cluster.async_client()
    sub_dead = await _subscribe(master.port, "lanes:edge:e1")
    sub_other = await _subscribe(other.port, "lanes:edge:e1")
    loop = ScriptLoop(client)
    runner = asyncio.create_task(loop.run())
    try:
        await loop.run_until(20, 30)
        await runner
        loop.stop.clear()
        runner = asyncio.create_task(loop.run())
        new_master = await asyncio.to_thread(cluster.kill, master)
        await loop.run_until(20, 60)
        await runner
        final = int(await client.get(SEQ))
        repeated = len(loop.acked) - len(set(loop.acked))
        lost = sum(1 for v in set(loop.acked) if v > final)
        await client.execute_command("PUBLISH", "lanes:edge:e1", "after-kill")
        try:
            dead_got: object = await next_message(sub_dead[1], 2)
        except (redis.ConnectionError, OSError) as err:
            dead_got = f"{type(err).__name__}"
        other_got = await next_message(sub_other[1])
        print(f"\nkill -9 master {master.port} -> {new_master.port}: acked {len(loop.acked)}, final {final}, "
              f"acked-then-lost {lost}, repeated values {repeated}, errors {dict(loop.errors)}, "
              f"longest pause {loop.longest_pause_s:.1f} s, "
              f"acked after the first error {loop.acked_after_error}; subscriber on the dead node: {dead_got!r}; "
              f"elsewhere {other_got and other_got['data']!r}")
        # The script keeps working once the replica is promoted (the client re-reads the slots).
        assert loop.acked_after_error >= 20 or not loop.errors
        assert cluster.owner(SEQ).node_id == new_master.node_id
        # A subscriber on the dead node hears nothing more; one on a live node still does.
        assert not isinstance(dead_got, dict)
        assert other_got is not None and other_got["data"] == "after-kill"
    finally:
        loop.stop.set()
        for conn, pubsub in (sub_dead, sub_other):
            try:
                await pubsub.aclose()
                await conn.aclose()
            except (redis.RedisError, OSError):
                pass
        await client.aclose()
