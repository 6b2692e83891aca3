"""Queue plane against a real redis-server: enqueue, strict priority, claim, lease, reaper,
cancel and stream fencing."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from lanes.queue.messages import ChatMessage, Lane, RequestPayload, TokenEvent
from lanes.queue.plane import QueuePlane, connect

MSG = (ChatMessage("user", "hi"),)


def payload(request_id: str, lane: Lane = Lane.SHORT) -> RequestPayload:
    return RequestPayload(id=request_id, messages=MSG, max_tokens=8, lane=lane)


async def pop(plane: QueuePlane, lanes: tuple[Lane, ...] = (Lane.SHORT, Lane.MEDIUM, Lane.LONG)):
    conn = connect(plane.settings.redis_url)
    try:
        return await plane.pop(conn, lanes, timeout_s=0.2)
    finally:
        await conn.aclose()


async def test_enqueue_claim_heartbeat_complete(plane: QueuePlane) -> None:
    enq = await plane.enqueue(payload("a"), "edge-1")
    assert enq.created and enq.enqueued_at_ms > 0
    assert await pop(plane) == ("a", Lane.SHORT)
    claim = await plane.claim("a", "w1")
    assert claim is not None
    assert (claim.attempt, claim.edge, claim.payload) == (1, "edge-1", payload("a"))
    assert claim.claimed_at_ms >= claim.enqueued_at_ms
    assert await plane.claim("a", "w2") is None, "a running request cannot be claimed twice"
    assert await plane.heartbeat([("a", 1)]) == [("ok", "edge-1")]
    assert await plane.heartbeat([("a", 7)]) == [("lost", "edge-1")], "a stale attempt is told it lost"
    assert await plane.complete("a", 1, "done")
    assert await plane.redis.hget(plane.keys.request("a"), "state") == b"done"
    assert await plane.redis.zscore(plane.keys.watch, "a") is None


async def test_strict_lane_priority(plane: QueuePlane) -> None:
    for request_id, lane in [("l1", Lane.LONG), ("m1", Lane.MEDIUM), ("s1", Lane.SHORT), ("s2", Lane.SHORT)]:
        await plane.enqueue(payload(request_id, lane), "e")
        await asyncio.sleep(0.002)
    order = [await pop(plane) for _ in range(4)]
    assert order == [("s1", Lane.SHORT), ("s2", Lane.SHORT), ("m1", Lane.MEDIUM), ("l1", Lane.LONG)]
    assert await pop(plane) is None


async def test_pop_only_from_given_lanes(plane: QueuePlane) -> None:
    await plane.enqueue(payload("l", Lane.LONG), "e")
    assert await pop(plane, (Lane.SHORT, Lane.MEDIUM)) is None
    assert await pop(plane, (Lane.SHORT, Lane.MEDIUM, Lane.LONG)) == ("l", Lane.LONG)


async def test_blocking_pop_wakes_on_enqueue(plane: QueuePlane) -> None:
    conn = connect(plane.settings.redis_url)
    waiter = asyncio.create_task(plane.pop(conn, (Lane.SHORT,), timeout_s=5))
    await asyncio.sleep(0.1)
    await plane.enqueue(payload("w"), "e")
    assert await asyncio.wait_for(waiter, 2) == ("w", Lane.SHORT)
    await conn.aclose()


async def test_an_id_belongs_to_one_pool(plane: QueuePlane) -> None:
    """Request hashes are per pool, a request's token stream per id: the same id sent to a
    second pool was accepted there and streamed the first pool's answer (another client's,
    without API keys). Now the second pool refuses it, also when both arrive at once."""
    small, large = plane.for_pool("small"), plane.for_pool("large")
    assert (await small.enqueue(payload("x"), "e")).created
    second = await large.enqueue(payload("x"), "e")
    assert not second.created and second.existing_state == ""
    assert await large.redis.zcard(large.keys.pending(Lane.SHORT)) == 0
    assert not (await small.enqueue(payload("x"), "e")).created, "its own pool: a duplicate as before"
    both = await asyncio.gather(small.enqueue(payload("y"), "e1"), large.enqueue(payload("y"), "e2"))
    assert sorted(e.created for e in both) == [False, True]


async def test_enqueue_is_idempotent(plane: QueuePlane) -> None:
    assert (await plane.enqueue(payload("dup"), "e")).created
    again = await plane.enqueue(payload("dup", Lane.LONG), "e2")
    assert not again.created and again.existing_state == "queued"
    assert await plane.redis.zcard(plane.keys.pending(Lane.SHORT)) == 1
    assert await plane.redis.zcard(plane.keys.pending(Lane.LONG)) == 0
    # Another owner's id: taken, but its state is not told.
    assert (await plane.enqueue(payload("mine"), "e", owner="alice")).created
    assert (await plane.enqueue(payload("mine"), "e", owner="alice")).existing_state == "queued"
    theirs = await plane.enqueue(payload("mine"), "e", owner="bob")
    assert not theirs.created and theirs.existing_state == ""
    # The worker learns who sent it (its observation is counted against that key).
    claim = await plane.claim("mine", "w")
    assert claim is not None and claim.owner == "alice"


async def test_cancel_queued_leaves_lane(plane: QueuePlane) -> None:
    await plane.enqueue(payload("c"), "e")
    assert await plane.cancel("c") == ("queued", "")
    assert await pop(plane) is None
    assert await plane.claim("c", "w") is None
    assert await plane.cancel("nope") == ("absent", "")


async def test_cancel_running_tells_its_worker(plane: QueuePlane) -> None:
    await plane.enqueue(payload("r"), "e")
    await pop(plane)
    await plane.claim("r", "w9")
    pubsub = plane.redis.pubsub()
    await pubsub.subscribe(plane.keys.control_channel("w9"))
    await pubsub.get_message(timeout=1)
    assert await plane.cancel("r") == ("running", "w9")
    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
    assert msg is not None and b'"cancel"' in msg["data"] and b'"r"' in msg["data"]
    assert await plane.heartbeat([("r", 1)]) == [("cancelled", "e")]
    await pubsub.aclose()


async def test_cancel_many_cancels_each_in_one_pipeline_and_tells_running_ones_workers(plane: QueuePlane) -> None:
    """The edge's retried cancels (``Edge.send_cancels``): each request's outcome as ``cancel``
    gives it, the other edge's request left alone, the workers of running ones told; after a
    ``SCRIPT FLUSH`` (a Redis restart's empty script cache) the script is loaded again."""
    for rid, edge in (("q", "e"), ("r", "e"), ("theirs", "other")):
        await plane.enqueue(payload(rid), edge)
    assert await pop(plane) == ("q", Lane.SHORT)  # popped, not claimed: still queued
    assert await pop(plane) == ("r", Lane.SHORT)
    await plane.claim("r", "w9")
    pubsub = plane.redis.pubsub()
    await pubsub.subscribe(plane.keys.control_channel("w9"))
    await pubsub.get_message(timeout=1)
    await plane.redis.script_flush()
    got = await plane.cancel_many(["q", "r", "theirs", "nope"], only_edge="e")
    assert got == {"q": ("queued", ""), "r": ("running", "w9"), "theirs": ("moved", ""), "nope": ("absent", "")}
    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
    assert msg is not None and b'"r"' in msg["data"]
    assert [(await plane.request_status(rid))[0] for rid in ("q", "r", "theirs")] == ["cancelled", "cancelled", "queued"]
    assert await plane.cancel_many(["q", "r"], only_edge="e") == {"q": ("cancelled", ""), "r": ("cancelled", "w9")}
    await pubsub.aclose()


async def test_expired_lease_is_requeued_at_its_place(plane: QueuePlane) -> None:
    await plane.enqueue(payload("first"), "e")
    await asyncio.sleep(0.005)
    await plane.enqueue(payload("second"), "e")
    assert await pop(plane) == ("first", Lane.SHORT)
    await plane.claim("first", "dead-worker")
    now = await plane.server_time_ms()
    assert [r.action for r in await plane.reap(now)] == [], "lease still valid"
    reaped = await plane.reap(now + plane.settings.lease_ms + 10)
    assert {r.id: r.action for r in reaped} == {"first": "requeued", "second": "waiting"}
    assert await pop(plane) == ("first", Lane.SHORT), "back ahead of the later request"
    claim = await plane.claim("first", "w2")
    assert claim is not None and claim.attempt == 2


async def test_popped_but_unclaimed_is_restored(plane: QueuePlane) -> None:
    await plane.enqueue(payload("lost"), "e")
    assert await pop(plane) == ("lost", Lane.SHORT)  # the popping worker dies here
    now = await plane.server_time_ms()
    reaped = await plane.reap(now + plane.settings.start_timeout_ms + 10)
    assert [(r.id, r.action) for r in reaped] == [("lost", "restored")]
    assert await pop(plane) == ("lost", Lane.SHORT)


async def test_waiting_request_deadline_is_extended(plane: QueuePlane) -> None:
    await plane.enqueue(payload("slow"), "e")
    now = await plane.server_time_ms()
    reaped = await plane.reap(now + plane.settings.start_timeout_ms + 10)
    assert [r.action for r in reaped] == ["waiting"]
    assert await plane.redis.zscore(plane.keys.pending(Lane.SHORT), "slow") is not None


async def test_too_many_attempts_fail(plane: QueuePlane) -> None:
    await plane.enqueue(payload("x"), "e")
    for attempt in range(1, plane.settings.max_attempts + 1):
        assert await pop(plane) == ("x", Lane.SHORT)
        assert (await plane.claim("x", "w")).attempt == attempt
        now = await plane.server_time_ms()
        reaped = await plane.reap(now + plane.settings.lease_ms + 10)
        expected = "failed" if attempt == plane.settings.max_attempts else "requeued"
        assert [r.action for r in reaped] == [expected]
    assert await plane.redis.hget(plane.keys.request("x"), "state") == b"failed"
    assert reaped[0].expired == plane.settings.max_attempts


async def test_hand_backs_do_not_use_up_the_attempts(plane: QueuePlane) -> None:
    """Only lease expiries (a worker that died) count toward ``max_attempts``. A hand-back (a
    drain, a preemption, a busy engine) starts a new attempt too, and counted: two drains in a
    rolling deploy and one crash failed the request."""
    await plane.enqueue(payload("h"), "e")
    for attempt in range(1, 5):  # four hand-backs
        assert await pop(plane) == ("h", Lane.SHORT)
        assert (await plane.claim("h", "w")).attempt == attempt
        assert await plane.release("h", attempt) == "requeued"
    for expiry in range(1, plane.settings.max_attempts + 1):
        assert await pop(plane) == ("h", Lane.SHORT)
        await plane.claim("h", "w")
        reaped = await plane.reap(await plane.server_time_ms() + plane.settings.lease_ms + 10)
        assert [(r.action, r.expired) for r in reaped] == [
            ("failed" if expiry == plane.settings.max_attempts else "requeued", expiry)]


async def test_stream_append_is_fenced_and_ordered(plane: QueuePlane) -> None:
    events = [TokenEvent("s", 1, seq, f"t{seq}", (seq,)) for seq in range(3)]
    assert await plane.fence("s", 1) == 1
    assert await plane.append({"s": events}) == {"s": 3}
    assert [e.text for e in await plane.read_stream("s")] == ["t0", "t1", "t2"]
    assert [e.seq for e in await plane.read_stream("s", after_seq=0)] == [1, 2]
    assert await plane.append({"s": [TokenEvent("s", 1, 2, "again")]}) == {"s": -2}, "a seq is written once"
    assert await plane.fence("s", 2) == 2
    assert await plane.append({"s": [TokenEvent("s", 1, 3, "zombie")]}) == {"s": -1}, "old attempt fenced"
    assert await plane.fence("s", 1) == 2, "the fence never goes down"
    assert await plane.append({"s": [TokenEvent("s", 2, 3, "new")]}) == {"s": 1}


async def test_a_retried_step_is_appended_again_and_a_different_event_is_not(plane: QueuePlane) -> None:
    """APPEND_PUBLISH, as APPEND: a step re-sent after a lost answer (the connection's retry)
    counts as appended; another event at a taken seq is refused and not published."""
    step = {"p": [TokenEvent("p", 1, 0, "t0", (0,)), TokenEvent("p", 1, 1, "t1", (1,))]}
    assert await plane.append_publish("w1", step, {"p": "e1"}) == ({"p": 2}, {"e1": 0})
    assert await plane.append_publish("w1", step, {"p": "e1"}) == ({"p": 2}, {"e1": 0}), "the retry"
    clash = {"p": [TokenEvent("p", 1, 1, "other", (7,))]}
    assert await plane.append_publish("w1", clash, {"p": "e1"}) == ({"p": -2}, {"e1": 0})
    assert [e.text for e in await plane.read_stream("p")] == ["t0", "t1"]


@pytest.mark.parametrize("lane", list(Lane))
async def test_lane_depths(plane: QueuePlane, lane: Lane) -> None:
    await plane.enqueue(payload("d1", lane), "e")
    now = await plane.server_time_ms()
    pending, oldest = await plane.lane_depths(now + 50)
    assert pending[lane.value] == 1 and sum(pending.values()) == 1
    assert oldest[lane.value] >= 50


async def test_release_puts_a_held_request_back_at_its_place(plane: QueuePlane) -> None:
    await plane.enqueue(payload("held"), "e")
    await asyncio.sleep(0.005)
    await plane.enqueue(payload("later"), "e")
    await pop(plane)
    await plane.claim("held", "w")
    assert await plane.release("held", 7) == "not_owner"
    assert await plane.release("held", 1) == "requeued"
    assert await pop(plane) == ("held", Lane.SHORT), "ahead of the later request"
    assert (await plane.claim("held", "w2")).attempt == 2
    await plane.cancel("held")
    assert await plane.release("held", 2) == "dropped"


async def test_queue_wait_counts_the_wait_before_the_first_run_not_time_spent_running(plane: QueuePlane) -> None:
    """A request handed back (or requeued by the reaper) waited before its first run and again
    after: ``queue_ms`` (the done frame, ``lanes_queue_seconds``) is the first wait, the one its
    first token waited behind; ``attempt_wait_ms`` is each attempt's own. Before, both ran from
    the enqueue to the latest claim and counted the earlier attempts' running time as queueing."""
    await plane.enqueue(payload("held"), "e")
    await asyncio.sleep(0.05)
    first = await plane.claim("held", "w")
    assert first is not None and first.queue_ms == first.attempt_wait_ms >= 50
    await asyncio.sleep(0.2)  # it runs
    assert await plane.release("held", 1, preempted=True) == "requeued"
    await asyncio.sleep(0.05)
    second = await plane.claim("held", "w2")
    assert second is not None and second.attempt == 2
    assert second.queue_ms == first.queue_ms, "the first wait, not enqueue -> this claim"
    assert 50 <= second.attempt_wait_ms < 200, "this attempt waited since its hand-back"
    now = await plane.server_time_ms()
    await plane.reap(now + plane.settings.lease_ms + 10)  # its worker dies: requeued by the reaper
    third = await plane.claim("held", "w3")
    assert third is not None and third.queue_ms == first.queue_ms
    assert third.attempt_wait_ms <= third.claimed_at_ms - now


async def test_preemption_grants_are_shared_by_a_pools_workers(plane: QueuePlane) -> None:
    """At most ``limit`` hand-backs per window over every worker of a pool (each decides from the
    same snapshot); the next window grants again; another pool has its own."""
    grants = [await plane.grant_preemption(2, window_ms=300) for _ in range(4)]
    assert grants == [True, True, False, False]
    assert await plane.for_pool("other").grant_preemption(1, window_ms=300)
    await asyncio.sleep(0.35)
    assert await plane.grant_preemption(1, window_ms=300)


async def test_deployments_on_two_databases_of_one_redis_do_not_hear_each_other(redis_url: str,
                                                                                key_prefix: str) -> None:
    """Keys live in their database; pub/sub channels do not. Two deployments with the same key
    prefix on databases 0 and 1 of one Redis shared every channel: one's edge took the other's
    depth snapshots (and so its workers) and dashboard samples. Channels now name the database."""
    import logging

    from lanes.queue.backoff import Backoff
    from lanes.queue.pubsub import listen
    from lanes.queue.settings import RedisSettings

    zero = QueuePlane.from_settings(RedisSettings(redis_url=redis_url, key_prefix=key_prefix))
    one = QueuePlane.from_settings(RedisSettings(redis_url=redis_url.rsplit("/", 1)[0] + "/1", key_prefix=key_prefix))
    try:
        assert zero.keys.depth_channel == f"{key_prefix}:depths", "database 0 keeps the names it had"
        assert one.keys.depth_channel != zero.keys.depth_channel
        assert one.keys.edge_channel("e") != zero.keys.edge_channel("e")
        heard: list[bytes] = []
        subscribed = asyncio.Event()

        async def hear() -> None:
            async for _, data in listen(zero.redis, [zero.keys.depth_channel], Backoff("test", logging.getLogger("test")),
                                            subscribed.set):
                heard.append(data)

        task = asyncio.create_task(hear())
        await asyncio.wait_for(subscribed.wait(), 5)
        assert await one.redis.publish(one.keys.depth_channel, b"from db 1") == 0
        assert await zero.redis.publish(zero.keys.depth_channel, b"from db 0") == 1
        await asyncio.sleep(0.2)
        task.cancel()
        assert heard == [b"from db 0"]
    finally:
        await zero.close()
        await one.close()


async def test_a_subscription_gives_its_connection_back_with_the_command_timeout(redis_url: str,
                                                                                 key_prefix: str) -> None:
    """A subscriber waits for messages without the 5 s command timeout; when it ends, its
    connection returns to the client's pool for commands, and gets that timeout back."""
    import logging

    from lanes.queue.backoff import Backoff
    from lanes.queue.connection import COMMAND_TIMEOUT_S
    from lanes.queue.pubsub import listen
    from lanes.queue.settings import RedisSettings

    plane = QueuePlane.from_settings(RedisSettings(redis_url=redis_url, key_prefix=key_prefix))
    try:
        subscribed = asyncio.Event()

        async def hear() -> None:
            async for _ in listen(plane.redis, [plane.keys.depth_channel], Backoff("test", logging.getLogger("test")),
                                  subscribed.set):
                pass

        task = asyncio.create_task(hear())
        await asyncio.wait_for(subscribed.wait(), 5)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pool = plane.redis.connection_pool
        assert all(c.socket_timeout == COMMAND_TIMEOUT_S for c in [*pool._available_connections, *pool._in_use_connections])
    finally:
        await plane.close()


async def test_existing_state_is_what_enqueue_would_answer(plane: QueuePlane) -> None:
    assert await plane.existing_state("e1") is None
    await plane.enqueue(payload("e1"), "edge", owner="alice")
    assert await plane.existing_state("e1", "alice") == "queued"
    assert await plane.existing_state("e1", "bob") == ""  # another key is not told its state
    assert await plane.for_pool("other").existing_state("e1", "alice") == ""  # another pool's id
    assert (await plane.enqueue(payload("e1"), "edge", owner="alice")).existing_state == "queued"


async def corrupt(plane: QueuePlane, request_id: str, **fields: object) -> None:
    """Enqueue ``request_id`` as lanes does, then overwrite fields of its record by hand (None:
    delete the field)."""
    await plane.enqueue(payload(request_id), "edge-b")
    if gone := [name for name, value in fields.items() if value is None]:
        await plane.redis.hdel(plane.keys.request(request_id), *gone)
    if kept := {name: value for name, value in fields.items() if value is not None}:
        await plane.redis.hset(plane.keys.request(request_id), mapping=kept)


@pytest.mark.parametrize("fields,reason", [
    ({"p": "not json{"}, "its payload (field 'p') is not a request"),
    ({"p": '{"a": 1}'}, "its payload (field 'p') is not a request"),
    ({"p": '{"id": "other", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "lane": "short"}'},
     "its payload names another request"),
    ({"enq_ms": "notanumber"}, "field 'enq_ms' is 'notanumber', not a number"),
    ({"attempt": "x"}, "field 'attempt' is 'x', not an integer"),
    ({"edge": None}, "it has no field 'edge'"),  # found in review: an AttributeError killed the worker
    ({"lane": None}, "it has no field 'lane'"),  # found in review: the claim failed forever, as if Redis were down
])
async def test_a_malformed_record_is_refused_at_the_claim_and_quarantined(
        plane: QueuePlane, fields: dict[str, object], reason: str) -> None:
    """Before, each of these crashed the claiming worker with a traceback (and the reaper put the
    request back for the next one: a crash loop); now the claim names the fault, and the record
    leaves every lane and the watch, failed."""
    from lanes.queue.plane import MalformedRequest

    await corrupt(plane, "bad", **fields)
    await plane.enqueue(payload("good"), "edge-g")
    assert await pop(plane) == ("bad", Lane.SHORT)
    with pytest.raises(MalformedRequest) as refused:
        await plane.claim("bad", "w1")
    assert refused.value.request_id == "bad" and refused.value.reason.startswith(reason), refused.value.reason
    # The claim counted an attempt (a script's writes before its error stay), unless the attempt
    # field itself is what broke it.
    assert await plane.quarantine("bad") == ("" if "edge" in fields else "edge-b", 0 if "attempt" in fields else 1)
    assert await plane.redis.hget(plane.keys.request("bad"), "state") == b"failed"
    assert await plane.redis.zscore(plane.keys.watch, "bad") is None
    assert await pop(plane) == ("good", Lane.SHORT)
    assert (await plane.claim("good", "w1")) is not None


async def test_one_malformed_record_does_not_stop_the_reaper(plane: QueuePlane) -> None:
    """A watch entry whose record breaks the requeue script (a score that is not a number):
    every reaper pass stopped there, so no lease of the pool was recovered until someone
    deleted it. Now it is failed as malformed, and the pass goes on."""
    await corrupt(plane, "poison", enq_ms="xyz", state="running", attempt="1")
    await corrupt(plane, "edgeless", edge=None, state="running", attempt="1")  # AttributeError on the reply
    await plane.enqueue(payload("first"), "e")
    popped = {await pop(plane) for _ in range(3)}
    assert popped == {("poison", Lane.SHORT), ("edgeless", Lane.SHORT), ("first", Lane.SHORT)}
    await plane.claim("first", "dead-worker")
    now = await plane.server_time_ms()
    await plane.redis.zadd(plane.keys.watch, {"poison": 1, "edgeless": 1})  # due at once
    reaped = {r.id: r for r in await plane.reap(now + plane.settings.lease_ms + 10)}
    assert reaped["first"].action == "requeued"
    assert (reaped["edgeless"].action, reaped["edgeless"].reason) == ("malformed", "it has no field 'edge'")
    assert (reaped["poison"].action, reaped["poison"].edge) == ("malformed", "edge-b")
    assert "'enq_ms' is 'xyz'" in reaped["poison"].reason
    assert await plane.redis.zscore(plane.keys.watch, "poison") is None
    # A key every request shares, of the wrong type, is not one request's fault: it still raises.
    await plane.redis.delete(plane.keys.pending(Lane.MEDIUM))
    await plane.redis.set(plane.keys.pending(Lane.MEDIUM), "garbage")
    await corrupt(plane, "fine-but-stuck", lane="medium")
    await plane.redis.zadd(plane.keys.watch, {"fine-but-stuck": 1})
    from redis.exceptions import ResponseError
    with pytest.raises(ResponseError):
        await plane.reap(now)


async def test_the_scheduler_ends_a_malformed_request_at_its_edge(plane: QueuePlane) -> None:
    from lanes.queue.errors import ErrorCode
    from lanes.scheduler.service import Scheduler
    from lanes.scheduler.settings import SchedulerSettings

    await corrupt(plane, "poison", enq_ms="xyz", state="running", attempt="2")
    await plane.redis.zadd(plane.keys.watch, {"poison": 1})
    scheduler = Scheduler(SchedulerSettings(redis_url=plane.settings.redis_url, key_prefix=plane.settings.key_prefix,
                                            predictor_refresh_minutes=0), plane)
    scheduler._known_pools = ["default"]
    assert await scheduler.reap_once() == 1
    (end,) = await plane.read_stream("poison")
    assert (end.attempt, end.finish.error_code) == (3, ErrorCode.MALFORMED_REQUEST)
    assert "'enq_ms' is 'xyz'" in end.finish.error_message


async def test_a_lane_key_of_the_wrong_type_is_named(plane: QueuePlane) -> None:
    """The claim loop logged "WRONGTYPE Operation against a key holding the wrong kind of value"
    and nothing more: which key, an operator had to guess."""
    from redis.exceptions import ResponseError

    await plane.redis.set(plane.keys.pending(Lane.MEDIUM), "garbage")
    with pytest.raises(ResponseError) as wrong:
        await pop(plane, (Lane.MEDIUM, Lane.LONG))
    assert f"{plane.keys.pending(Lane.MEDIUM)} is a string, not a zset" in str(wrong.value)


# -- a request's trace context, without its payload ------------------------------------------

TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "k=v"}


async def test_the_trace_context_is_read_without_the_payload(plane: QueuePlane) -> None:
    """A resume's span link and a requeue's span need only the request's ``traceparent``; they
    read the whole payload for it (field ``p``, the prompt: a megabyte here). Now enqueue
    stores the context as a field of its own and they read that field only."""
    prompt = "x" * 1_000_000
    big = RequestPayload(id="big", messages=(ChatMessage("user", prompt),), max_tokens=8, trace=TRACE)
    assert (await plane.enqueue(big, "e")).created
    key = plane.keys.request("big")
    assert await plane.redis.hget(key, "trace") == msgspec.json.encode(TRACE)

    async def sent_bytes() -> int:
        return int((await plane.redis.info("stats"))["total_net_output_bytes"])

    before = await sent_bytes()
    assert await plane.trace_of("big") == TRACE
    assert await plane.trace_and_streamed("big") == (TRACE, 0)
    # Both INFO replies (a few kB) and the two reads: nowhere near the payload's megabyte.
    assert await sent_bytes() - before < 100_000
    # The field is what is read: a payload rewritten with another context does not change it.
    other = {"traceparent": "00-11111111111111111111111111111111-2222222222222222-01"}
    await plane.redis.hset(key, "p", msgspec.json.encode(msgspec.structs.replace(big, trace=other)))
    assert await plane.trace_of("big") == TRACE
    # No context (tracing off at the edge): an empty one, still without the payload.
    assert (await plane.enqueue(payload("plain"), "e")).created
    assert await plane.redis.hget(plane.keys.request("plain"), "trace") == b"{}"
    assert await plane.trace_of("plain") == {}


async def test_a_record_from_an_older_edge_links_through_its_payload(plane: QueuePlane) -> None:
    """During a rolling upgrade, requests an older edge enqueued have no ``trace`` field: their
    context is read from the payload, as before (one more round trip, only for them), so that
    their resumes still link. A record that is gone has none; nor has an unreadable field."""
    assert (await plane.enqueue(RequestPayload(id="old", messages=MSG, max_tokens=8, trace=TRACE), "e")).created
    await plane.redis.hdel(plane.keys.request("old"), "trace")  # as an older edge's ENQUEUE wrote it
    assert await plane.trace_of("old") == TRACE
    assert await plane.trace_and_streamed("old") == (TRACE, 0)
    assert await plane.trace_of("never-here") == {}
    assert await plane.trace_and_streamed("never-here") == ({}, 0)
    await plane.redis.hset(plane.keys.request("old"), "trace", b"not json")
    assert await plane.trace_of("old") == {}
