"""The queue plane: every Redis operation of the request path, as one small async API.

Edges enqueue and cancel; workers pop, claim, heartbeat, append tokens and complete; the
scheduler reaps expired leases and reads depths. Each state change is one Lua script (see
``scripts.py``), so a crash between two calls never leaves a request half-moved.

The same calls run on one Redis or on a Redis Cluster (``cluster.py``; ``self.cluster``). Every
script's keys share one hash slot: a pool's queue plane (``{q}`` / ``{q:<pool>}``) or one
request's stream and fence (``{r:<id>}``). What differs on a cluster: the blocking pop uses a
connection to the slot's master (``SlotConnection``), a worker's flush is per-request appends
then one ``PUBLISH`` per edge instead of one script, and redis-py's cluster pipeline refuses
``EVALSHA`` and ``PUBLISH``, so those go as raw commands.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis
from lanes.queue import scripts
from lanes.queue.cluster import SlotConnection, SlotOwners
from lanes.queue.connection import connect, redis_db
from lanes.queue.fleet import Fleet
from lanes.queue.keys import (
    DEFAULT_POOL,
    FINISHED_TTL_S,
    LANE_ORDER,
    REQUEST_TTL_S,
    Keys,
)
from lanes.queue.errors import ErrorCode
from lanes.queue.messages import (
    Control,
    Finish,
    FinishReason,
    Lane,
    RequestPayload,
    TokenBatch,
    TokenEvent,
    Usage,
    encode,
)
from lanes.queue.records import record_fault
from lanes.queue.settings import RedisSettings
from lanes.queue.streams import TokenStreams
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisError, ResponseError

_payload_decoder = msgspec.json.Decoder(RequestPayload)


class _TraceOnly(msgspec.Struct):
    """The one field of a payload that a span needs (the rest is not decoded)."""

    trace: dict[str, str] = {}


_trace_decoder = msgspec.json.Decoder(_TraceOnly)
_carrier_decoder = msgspec.json.Decoder(dict[str, str])


def _trace_headers(raw: bytes | None) -> dict[str, str]:
    """The ``trace`` of a payload as stored (empty for none, or one that cannot be read)."""
    try:
        return _trace_decoder.decode(raw).trace if raw else {}
    except msgspec.DecodeError:
        return {}


def _carrier(raw: bytes) -> dict[str, str]:
    """A record's ``trace`` field (JSON ``{"traceparent": ...}``; empty for one that cannot be read)."""
    try:
        return _carrier_decoder.decode(raw)
    except msgspec.DecodeError:
        return {}

#: A script's reply that cannot be read: a field missing from a record comes back as a nil,
#: which cuts the reply short or puts None where bytes were due.
_REPLY_FAULTS = (ValueError, TypeError, AttributeError, msgspec.DecodeError)


@dataclass(frozen=True)
class Enqueued:
    created: bool
    #: Enqueue time (Redis clock, ms) when created; else 0.
    enqueued_at_ms: int = 0
    #: State of the existing request when not created.
    existing_state: str = ""


@dataclass(frozen=True)
class Claim:
    payload: RequestPayload
    attempt: int
    enqueued_at_ms: int
    claimed_at_ms: int
    edge: str
    #: Times this request was handed back by a preemption already.
    times_preempted: int = 0
    #: The API key's id that submitted it ("" without auth).
    owner: str = ""
    #: When this attempt's wait in a lane began: the enqueue, or the latest hand-back / requeue.
    ready_at_ms: int = 0
    #: When the request's first attempt was claimed (this one's claim for a first attempt).
    first_claimed_at_ms: int = 0

    @property
    def attempt_wait_ms(self) -> float:
        """This attempt's wait in its lane (since the enqueue, or since it was handed back)."""
        return float(self.claimed_at_ms - (self.ready_at_ms or self.enqueued_at_ms))

    @property
    def queue_ms(self) -> float:
        """The wait before the request first ran: what precedes its first token, and what the
        ``done`` frame and ``lanes_queue_seconds`` report. Time spent running an attempt that
        was handed back or lost is not queueing."""
        return float((self.first_claimed_at_ms or self.claimed_at_ms) - self.enqueued_at_ms)


@dataclass(frozen=True)
class Reaped:
    id: str
    action: str
    edge: str
    attempt: int
    #: Lease expiries so far (its workers' deaths; hand-backs are not counted).
    expired: int = 0
    #: What is wrong with its record, for action ``malformed`` (failed, ``quarantine``).
    reason: str = ""
    #: The worker whose lease expired, for actions ``requeued`` and ``failed``.
    worker: str = ""


class MalformedRequest(Exception):
    """A request's record in Redis cannot be run (``records.record_fault`` says why)."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id}'s record is malformed: {reason}")
        self.request_id, self.reason = request_id, reason


#: The window of ``grant_preemption``: about two depth snapshots, after which the snapshots show
#: the slots the granted hand-backs freed.
PREEMPT_WINDOW_MS = 1000


class QueuePlane(TokenStreams):
    """Redis I/O of the request path. Safe to share within one event loop."""

    def __init__(self, client: aioredis.Redis | RedisCluster, settings: RedisSettings, pool: str = DEFAULT_POOL) -> None:
        self.redis: Any = client
        self.settings = settings
        #: The model pool whose lanes and request hashes this plane reads and writes.
        self.pool = pool
        self.keys = Keys(settings.key_prefix, pool, redis_db(settings.redis_url))
        self._pools: dict[str, QueuePlane] = {pool: self}
        self.fleet = Fleet(client, self.keys)
        #: A Redis Cluster: keys of different hash slots cannot meet in one script.
        self.cluster = isinstance(client, RedisCluster)
        #: Cluster: the blocking connections handed out (``unblock`` finds the node by them).
        self._blockers: weakref.WeakSet[SlotConnection] = weakref.WeakSet()
        #: Cluster: where each edge channel's PUBLISH goes (its subscriber's node).
        self._slot_owners = SlotOwners(client)
        self._enqueue = client.register_script(scripts.ENQUEUE)
        self._claim = client.register_script(scripts.CLAIM)
        self._heartbeat = client.register_script(scripts.HEARTBEAT)
        self._complete = client.register_script(scripts.COMPLETE)
        self._cancel = client.register_script(scripts.CANCEL)
        self._requeue = client.register_script(scripts.REQUEUE)
        self._fail_queued = client.register_script(scripts.FAIL_QUEUED)
        self._append = client.register_script(scripts.APPEND)
        self._append_publish = client.register_script(scripts.APPEND_PUBLISH)
        self._fence = client.register_script(scripts.FENCE)
        self._repoint = client.register_script(scripts.REPOINT)
        self._release = client.register_script(scripts.RELEASE)
        self._take_token = client.register_script(scripts.TAKE_TOKEN)
        self._preempt_grant = client.register_script(scripts.PREEMPT_GRANT)
        self._quarantine = client.register_script(scripts.QUARANTINE)

    def for_pool(self, pool: str) -> QueuePlane:
        """The same connection, on ``pool``'s keys (one per pool, kept)."""
        plane = self._pools.get(pool)
        if plane is None:
            plane = self._pools[pool] = QueuePlane(self.redis, self.settings, pool)
            plane.fleet, plane._pools, plane._blockers = self.fleet, self._pools, self._blockers
            plane._slot_owners = self._slot_owners
        return plane

    @classmethod
    def from_settings(cls, settings: RedisSettings) -> QueuePlane:
        return cls(connect(settings.redis_url), settings)

    async def close(self) -> None:
        await self.redis.aclose()

    # -- edge -------------------------------------------------------------------------

    async def enqueue(self, payload: RequestPayload, edge_id: str, owner: str = "") -> Enqueued:
        """Put a request in its lane; a no-op (``created=False``) if the id exists.

        ``owner`` (the API key's id, "" without auth) is the only one allowed to resume it, and
        the only one told an existing id's state (``existing_state`` is "" for another owner).
        """
        k = self.keys
        # An id belongs to one pool (its stream is shared by every pool's request of that id).
        if not await self.redis.set(k.id_pool(payload.id), self.pool, nx=True, ex=REQUEST_TTL_S):
            first = await self.redis.get(k.id_pool(payload.id))
            if first is not None and first.decode() != self.pool:
                return Enqueued(False, existing_state="")  # another pool's: not even its state is told
        created, value = await self._enqueue(
            keys=[k.request(payload.id), k.pending(payload.lane), k.watch, k.arrivals],
            args=[payload.id, encode(payload), payload.lane.value, edge_id,
                  self.settings.start_timeout_ms, REQUEST_TTL_S, owner, ",".join(payload.fallback_pools),
                  msgspec.json.encode(payload.trace)],
        )
        if created:
            return Enqueued(True, enqueued_at_ms=int(value))
        return Enqueued(False, existing_state=value.decode() if isinstance(value, bytes) else str(value))

    async def existing_state(self, request_id: str, owner: str = "") -> str | None:
        """What ``enqueue`` would answer for an id it cannot create, without enqueuing: None when
        the id is free here, else the state its owner is told ("" for anyone else, or when
        another pool holds the id). Refusals that come before the enqueue ask it, so that a
        resubmitted id is told to resume rather than to retry."""
        first = await self.redis.get(self.keys.id_pool(request_id))
        if first is None:
            return None
        if first.decode() != self.pool:
            return ""
        state, who = await self.redis.hmget(self.keys.request(request_id), "state", "owner")
        if state is None:
            return None
        return state.decode() if (who or b"").decode() == owner else ""

    async def cancel(self, request_id: str, only_edge: str = "") -> tuple[str, str]:
        """Cancel a request: ``(previous_state, worker)``; tells the worker if it runs.

        With ``only_edge``, a request pointed at another edge is left alone (``"moved"``).
        """
        k = self.keys
        state, worker = await self._cancel(
            keys=[k.request(request_id), k.watch, *k.pending_all()], args=[request_id, FINISHED_TTL_S, only_edge]
        )
        state, worker = state.decode(), worker.decode()
        if state == "running" and worker:
            # A raw PUBLISH: redis-py's cluster client has no publish() (the same command on one Redis).
            await self.redis.execute_command("PUBLISH", k.control_channel(worker), encode(Control(request_id)))
        return state, worker

    async def cancel_many(self, request_ids: list[str], only_edge: str = "") -> dict[str, tuple[str, str] | RedisError]:
        """``cancel`` of each of ``request_ids``, in one pipeline: per request
        ``(previous_state, worker)``, or the ``RedisError`` its script met (a refused write).
        Raises ``QueueUnavailable`` when Redis does not answer.

        Workers running some are then told, in one more round trip; if that fails they still
        learn it within a heartbeat (HEARTBEAT answers ``cancelled``), so it raises nothing: a
        retry would find the requests cancelled and tell nobody."""
        k = self.keys
        calls = {rid: (k.request(rid), k.watch, *k.pending_all(), rid, FINISHED_TTL_S, only_edge) for rid in request_ids}
        replies = await self._cancel_pipeline(list(calls.values()))
        if any(isinstance(reply, NoScriptError) for reply in replies):  # Redis lost its script cache
            await self.redis.script_load(scripts.CANCEL)
            again = iter(await self._cancel_pipeline([c for c, r in zip(calls.values(), replies)
                                                      if isinstance(r, NoScriptError)]))
            replies = [next(again) if isinstance(r, NoScriptError) else r for r in replies]
        out: dict[str, tuple[str, str] | RedisError] = {}
        for request_id, reply in zip(calls, replies):
            out[request_id] = reply if isinstance(reply, RedisError) else (reply[0].decode(), reply[1].decode())
        running = [(rid, got[1]) for rid, got in out.items() if not isinstance(got, RedisError)
                   and got[0] == "running" and got[1]]
        with contextlib.suppress(RedisError):
            await self._tell_workers(running)
        return out

    async def _cancel_pipeline(self, calls: list[tuple[object, ...]]) -> list[Any]:
        """CANCEL per call (its 5 keys, then its arguments), one pipeline; replies or errors."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for call in calls:
                # The raw command: redis-py's cluster pipeline refuses evalsha() (a pool's keys
                # share one slot: one node).
                pipe.execute_command("EVALSHA", self._cancel.sha, 2 + len(LANE_ORDER), *call)
            return list(await pipe.execute(raise_on_error=False))

    async def _tell_workers(self, runs: list[tuple[str, str]]) -> None:
        """PUBLISH each ``(request, worker)``'s cancel on the worker's control channel."""
        if self.cluster:  # the cluster pipeline refuses PUBLISH; a classic one reaches every node
            for request_id, worker in runs:
                await self.redis.execute_command("PUBLISH", self.keys.control_channel(worker), encode(Control(request_id)))
            return
        if runs:
            async with self.redis.pipeline(transaction=False) as pipe:
                for request_id, worker in runs:
                    pipe.publish(self.keys.control_channel(worker), encode(Control(request_id)))
                await pipe.execute()

    async def repoint(self, request_id: str, edge_id: str, owner: str = "") -> str | None:
        """Send a request's future tokens to ``edge_id``; returns its state, None if gone,
        or "forbidden" when ``owner`` did not submit it.

        When another edge delivered it, that edge is told on its takeover channel, so its
        connection ends with ``resumed_elsewhere`` now rather than at its next quiet check.
        """
        reply = await self._repoint(keys=[self.keys.request(request_id)], args=[edge_id, owner])
        if not reply:
            return None
        state, previous = reply[0].decode(), reply[1].decode()
        if previous and previous != edge_id and state != "forbidden":
            await self.redis.execute_command("PUBLISH", self.keys.takeover_channel(previous), request_id)
        return state

    async def take_token(self, key_id: str, rate_per_s: float, burst: int) -> int:
        """Take one token from a key's fleet-wide bucket: 0, or the wait (ms) until one is back."""
        return int(await self._take_token(keys=[self.keys.rate_bucket(key_id)], args=[rate_per_s, burst]))

    async def request_records(self, request_ids: list[str]) -> dict[str, tuple[str, str] | None]:
        """Per request ``(edge, state)``, None when its record is gone (one pipeline)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.hmget(self.keys.request(request_id), "edge", "state")
            rows = await pipe.execute()
        return {rid: None if state is None else ((edge or b"").decode(), state.decode())
                for rid, (edge, state) in zip(request_ids, rows)}

    async def ping(self) -> None:
        await self.redis.ping()

    # -- worker -----------------------------------------------------------------------

    def blocking_client(self, block_s: float) -> aioredis.Redis | SlotConnection:
        """A dedicated connection for ``pop`` (a blocked connection serves nobody else), for pops
        of at most ``block_s``; on a cluster, one to the master of this pool's slot that follows
        failovers.

        Its read timeout is ``block_s`` plus ``redis_dead_after_s``, whatever the URL says: one
        under the pop's block failed every idle pop (a URL's ``?socket_timeout=1``) and the
        worker claimed nothing more; none at all left a pop on a connection whose Redis
        vanished without closing it (a partition, a failover's moved address) waiting for good,
        while the heartbeat reconnected and the worker looked healthy.
        """
        read_timeout_s = block_s + self.settings.redis_dead_after_s
        if self.cluster:
            blocker = SlotConnection(self.redis, self.keys.pending(LANE_ORDER[0]), read_timeout_s)
            self._blockers.add(blocker)
            return blocker
        # Set on the pool, since a URL's ``socket_timeout`` wins over keyword arguments.
        blocker = connect(self.settings.redis_url, single_connection_client=True)
        blocker.connection_pool.connection_kwargs["socket_timeout"] = read_timeout_s
        return blocker

    async def client_id(self, conn: aioredis.Redis | SlotConnection) -> int:
        """The id ``unblock`` takes for ``conn`` (connects it if need be)."""
        if isinstance(conn, SlotConnection):
            await conn.connection()
            assert conn.client_id is not None
            return conn.client_id
        return int(await conn.client_id())

    async def unblock(self, client_id: int) -> None:
        """Make a ``pop`` blocked on connection ``client_id`` return None now."""
        if not self.cluster:
            await self.redis.client_unblock(client_id)
            return
        for blocker in list(self._blockers):
            await blocker.unblock(client_id)

    async def pop(self, conn: aioredis.Redis | SlotConnection, lanes: tuple[Lane, ...],
                  timeout_s: float) -> tuple[str, Lane] | None:
        """Block until a request is in one of ``lanes`` (first non-empty wins) or timeout.

        ``conn`` must be a dedicated connection (it blocks); ``CLIENT UNBLOCK`` on its id
        makes it return None early. On a cluster any error (``UNBLOCKED`` by a failover,
        ``MOVED``, a dead master) drops the connection: the next ``client_id`` or ``pop``
        reconnects to the slot's master of the moment.
        """
        keys = [self.keys.pending(lane) for lane in lanes]
        try:
            if isinstance(conn, SlotConnection):
                try:
                    popped = await (await conn.connection()).bzpopmin(keys, timeout=timeout_s)
                except RedisError:
                    await conn.reset()
                    raise
            else:
                popped = await conn.bzpopmin(keys, timeout=timeout_s)
        except ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            raise ResponseError(f"{exc} ({await self._wrong_types(keys, 'zset')})") from None
        if popped is None:
            return None
        key, member, _score = popped
        lane = lanes[keys.index(key.decode())]
        return member.decode(), lane

    async def _wrong_types(self, keys: list[str], expected: str) -> str:
        """Which of ``keys`` hold another type than ``expected``: what a WRONGTYPE is about."""
        found = [(key, (await self.redis.type(key)).decode()) for key in keys]
        return "; ".join(f"{key} is a {kind}, not a {expected}" for key, kind in found if kind not in ("none", expected))

    async def claim(self, request_id: str, worker_id: str) -> Claim | None:
        """Claim a popped request: its payload and attempt, or None when it is no longer queued.
        Raises ``MalformedRequest`` when its record cannot be run (the caller quarantines it)."""
        k = self.keys
        try:
            got = await self._claim(
                keys=[k.request(request_id), k.watch, k.claims],
                args=[request_id, worker_id, self.settings.lease_ms, REQUEST_TTL_S],
            )
        except ResponseError as exc:
            raise await self._malformed_or(request_id, exc) from None
        if not got:
            return None
        try:
            attempt, payload, enq_ms, now_ms, edge, preempted, owner, ready_ms, first_ms = got
            claim = Claim(_payload_decoder.decode(payload), int(attempt), int(enq_ms), int(now_ms), edge.decode(),
                          int(preempted), owner.decode(), int(ready_ms), int(first_ms))
        except _REPLY_FAULTS as exc:
            raise await self._malformed_or(request_id, exc) from None
        if claim.payload.id != request_id:  # record_fault says so
            raise await self._malformed_or(request_id, ValueError("the payload names another request"))
        return claim

    async def record_fault(self, request_id: str) -> str | None:
        """What is wrong with ``request_id``'s record (``records.record_fault``), or None."""
        key = self.keys.request(request_id)
        kind = (await self.redis.type(key)).decode()
        if kind == "none":
            return None
        if kind != "hash":
            return f"its record {key} is a {kind}, not a hash"
        return record_fault(request_id, await self.redis.hgetall(key))

    async def _malformed_or(self, request_id: str, exc: Exception) -> Exception:
        """``MalformedRequest`` when ``request_id``'s own record is at fault for ``exc`` (a
        script's error, or a reply that cannot be read: ``_REPLY_FAULTS``), else ``exc``: a key
        the whole pool shares is at fault, and every request would fail alike."""
        if isinstance(exc, ResponseError) and "user_script" not in str(exc):
            return exc
        if (fault := await self.record_fault(request_id)) is not None:
            return MalformedRequest(request_id, fault)
        return exc if isinstance(exc, ResponseError) else MalformedRequest(request_id, str(exc))

    async def end_with_error(self, request_id: str, edge: str, attempt: int, code: ErrorCode, message: str,
                             sender: str = "scheduler") -> None:
        """End a request that no worker runs any more with an error: after the tokens its stream
        holds, under a fence that stale attempts cannot pass, on its edge's channel and in its
        stream (so a resume sees it too)."""
        prior = await self.read_stream(request_id)
        finish = Finish(FinishReason.ERROR, Usage(0, sum(len(e.token_ids) for e in prior)), error_code=code,
                        error_message=message)
        event = TokenEvent(request_id, attempt + 1, len(prior), "", (), finish)
        await self.fence(request_id, attempt + 1)
        await self.append({request_id: [event]})
        if edge:
            await self.publish({edge: TokenBatch(sender, (event,))})

    async def quarantine(self, request_id: str) -> tuple[str, int]:
        """Take a malformed request out of its lane and the reaper's watch, failed: ``(edge,
        attempt)`` as far as its record says."""
        k = self.keys
        edge, attempt = await self._quarantine(keys=[k.request(request_id), k.watch, *k.pending_all()],
                                               args=[request_id, FINISHED_TTL_S])
        return edge.decode("utf-8", "replace"), int(attempt)

    async def heartbeat(self, runs: list[tuple[str, int]]) -> list[tuple[str, str]]:
        """Renew leases of ``(id, attempt)`` runs; per run ``(status, edge)``."""
        if not runs:
            return []
        k = self.keys
        args: list[object] = [self.settings.lease_ms]
        for request_id, attempt in runs:
            args += [request_id, attempt]
        out = await self._heartbeat(keys=[k.watch, *(k.request(r) for r, _ in runs)], args=args)
        return [(status.decode(), edge.decode()) for status, edge in out]

    async def complete(self, request_id: str, attempt: int, final_state: str) -> bool:
        k = self.keys
        done = await self._complete(
            keys=[k.request(request_id), k.watch], args=[request_id, attempt, final_state, FINISHED_TTL_S]
        )
        if done:
            await self.redis.expire(k.stream(request_id), FINISHED_TTL_S)
        return bool(done)

    async def release(self, request_id: str, attempt: int, lane: Lane | None = None, preempted: bool = False) -> str:
        """Hand a held request back now, at its original place in ``lane`` (None: the lane it
        came from); ``preempted`` counts it as a preemption. See ``scripts.RELEASE``."""
        k = self.keys
        action = await self._release(
            keys=[k.request(request_id), k.watch, *k.pending_all()],
            args=[request_id, attempt, self.settings.start_timeout_ms, FINISHED_TTL_S,
                  lane.value if lane is not None else "", 1 if preempted else 0],
        )
        return action.decode()

    # -- scheduler --------------------------------------------------------------------

    async def reap(self, now_ms: int, limit: int = 100) -> list[Reaped]:
        """Handle watch entries whose deadline passed (expired leases, lost pops)."""
        k = self.keys
        due = await self.redis.zrangebyscore(k.watch, "-inf", now_ms, start=0, num=limit)
        reaped = []
        for raw in due:
            request_id = raw.decode("utf-8", "replace")
            try:
                action, edge, attempt, *lost = await self._requeue(
                    keys=[k.request(request_id), k.watch, *k.pending_all()],
                    args=[request_id, self.settings.start_timeout_ms, self.settings.max_attempts, FINISHED_TTL_S,
                          now_ms],
                )
                expired, worker = (int(lost[0]), lost[1].decode()) if lost else (0, "")
                reaped.append(Reaped(request_id, action.decode(), edge.decode(), int(attempt), expired,
                                     worker=worker))
            except (ResponseError, *_REPLY_FAULTS) as exc:
                # One malformed record must not stop the reaper for the whole pool: it is failed,
                # and the rest are reaped (before, every pass stopped at it, for good).
                fault = await self._malformed_or(request_id, exc)
                if not isinstance(fault, MalformedRequest):
                    raise fault from None
                edge_id, attempt_no = await self.quarantine(request_id)
                reaped.append(Reaped(request_id, "malformed", edge_id, attempt_no, reason=fault.reason))
        return reaped

    async def trace_of(self, request_id: str) -> dict[str, str]:
        """A request's W3C trace context (its record's ``trace`` field, a few hundred bytes at
        most; empty where it has none or its record is gone or unreadable). The payload, which
        holds the prompt, is read only for a record an older edge wrote, without that field."""
        trace_field, state = await self.redis.hmget(self.keys.request(request_id), "trace", "state")
        return await self._carrier_or_payloads(request_id, trace_field, state)

    async def trace_and_streamed(self, request_id: str) -> tuple[dict[str, str], int]:
        """``trace_of`` and how many deltas the request's stream holds (one round trip; two
        for a record an older edge wrote)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(self.keys.request(request_id), "trace", "state")
            pipe.xlen(self.keys.stream(request_id))
            (trace_field, state), num_deltas = await pipe.execute()
        return await self._carrier_or_payloads(request_id, trace_field, state), int(num_deltas)

    async def _carrier_or_payloads(self, request_id: str, trace_field: bytes | None,
                                   state: bytes | None) -> dict[str, str]:
        """The ``trace`` field read; where the record exists without one (enqueued by an edge
        from before the field, during a rolling upgrade: such records live ``REQUEST_TTL_S`` at
        most), the payload's ``trace``, as before, so that the link is not lost."""
        if trace_field is not None:
            return _carrier(trace_field)
        if state is None:
            return {}  # no record (gone, or never here)
        return _trace_headers(await self.redis.hget(self.keys.request(request_id), "p"))

    async def queued_ids(self, limit: int = 1000, enqueued_before_ms: int | None = None) -> list[str]:
        """Up to ``limit`` ids waiting in this pool's lanes, oldest first per lane; with
        ``enqueued_before_ms``, only those in line since before then (the Redis clock)."""
        k = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            for lane in LANE_ORDER:
                if enqueued_before_ms is None:
                    pipe.zrange(k.pending(lane), 0, limit - 1)
                else:
                    pipe.zrangebyscore(k.pending(lane), "-inf", enqueued_before_ms, start=0, num=limit)
            found = await pipe.execute()
        return [raw.decode() for ids in found for raw in ids][:limit]

    async def rerouteable(self, request_ids: list[str], live_pools: set[str]) -> list[str]:
        """Those of ``request_ids`` that no worker has claimed yet (attempt 0) and that ``auto``
        could have sent to one of ``live_pools`` (``RequestPayload.fallback_pools``)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.hmget(self.keys.request(request_id), "fallback", "attempt")
            records = await pipe.execute()
        return [request_id for request_id, (fallback, attempt) in zip(request_ids, records)
                if fallback and attempt == b"0" and live_pools & set(fallback.decode(errors="replace").split(","))]

    async def fail_queued(self, request_id: str) -> tuple[bool, str, int]:
        """Fail a request that is still queued: ``(failed, edge, attempt)`` (``FAIL_QUEUED``)."""
        k = self.keys
        done, edge, attempt = await self._fail_queued(keys=[k.request(request_id), k.watch, *k.pending_all()],
                                                      args=[request_id, FINISHED_TTL_S])
        return bool(done), edge.decode(), int(attempt)

    async def grant_preemption(self, limit: int, window_ms: int = PREEMPT_WINDOW_MS) -> bool:
        """Whether this worker may hand a run back now: at most ``limit`` hand-backs (the
        requests waiting past the bound) per ``window_ms`` over all of this pool's workers."""
        return bool(await self._preempt_grant(keys=[self.keys.preempt_grants], args=[max(1, limit), window_ms]))

    async def server_time_ms(self) -> int:
        seconds, micros = await self.redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def lane_depths(self, now_ms: int) -> tuple[dict[str, int], dict[str, int]]:
        """Per lane: number pending, and how long the oldest has waited (ms)."""
        k = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            for lane in LANE_ORDER:
                pipe.zcard(k.pending(lane))
                pipe.zrange(k.pending(lane), 0, 0, withscores=True)
            results = await pipe.execute()
        pending, oldest = {}, {}
        for i, lane in enumerate(LANE_ORDER):
            pending[lane.value] = int(results[2 * i])
            head = results[2 * i + 1]
            oldest[lane.value] = max(0, now_ms - int(head[0][1])) if head else 0
        return pending, oldest

    # -- supervisors (``lanes up``, the process harness, ``lanes chaos``): read-only ---------

    async def worker_heartbeats(self, worker_ids: list[str]) -> dict[str, int]:
        """Last heartbeat (ms, the Redis clock) of each of ``worker_ids`` that has one.

        A worker sends its first heartbeat only after its engine has started and warmed up.
        """
        if not worker_ids:
            return {}
        scores = await self.redis.zmscore(self.keys.workers, worker_ids)
        return {w: int(s) for w, s in zip(worker_ids, scores) if s is not None}

    async def request_status(self, request_id: str) -> tuple[str, str]:
        """``(state, worker)`` of a request ("" for each when unknown or expired)."""
        state, worker = await self.redis.hmget(self.keys.request(request_id), "state", "worker")
        return (state or b"").decode(), (worker or b"").decode()

