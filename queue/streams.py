"""Token streams and their fan-out: the part of the queue plane a worker runs every engine
step (``QueuePlane`` inherits it).

Each request's events go to its own stream (``{r:<id>}``), fenced by attempt, with explicit ids
``<seq+1>-0``; each edge gets one ``TokenBatch`` per step on its channel. On one Redis a step
is one script (``APPEND_PUBLISH``). On a Redis Cluster its keys span hash slots, so a step is
APPEND per request (one pipeline per node) then one PUBLISH per edge, and a master that fails
mid-step fails only the requests and edges it serves; the rest is still appended and published
before the error is raised.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable
from typing import Any

import msgspec
from lanes.queue import scripts
from lanes.queue.cluster import SlotOwners
from lanes.queue.keys import REQUEST_TTL_S, STREAM_MAXLEN, Keys
from lanes.queue.messages import TokenBatch, TokenEvent, encode
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisError

_event_decoder = msgspec.json.Decoder(TokenEvent)
_json = msgspec.json.encode


class TokenStreams:
    """Stream and channel I/O; needs ``redis``, ``keys``, ``cluster`` and the registered scripts."""

    redis: Any
    keys: Keys
    cluster: bool
    _append: AsyncScript
    _append_publish: AsyncScript
    _fence: AsyncScript
    _slot_owners: SlotOwners

    async def read_stream(self, request_id: str, after_seq: int = -1) -> list[TokenEvent]:
        """Events with ``seq > after_seq``, in order."""
        entries = await self.redis.xrange(self.keys.stream(request_id), min=f"{after_seq + 2}-0")
        return [_event_decoder.decode(fields[b"e"]) for _, fields in entries]

    async def last_event(self, request_id: str) -> TokenEvent | None:
        """The newest event of a request's stream (its end, once it has ended)."""
        entries = await self.redis.xrevrange(self.keys.stream(request_id), count=1)
        return _event_decoder.decode(entries[0][1][b"e"]) if entries else None

    async def fence(self, request_id: str, attempt: int) -> int:
        """Make ``attempt`` the only writer of the request's stream; returns the fence."""
        k = self.keys
        return int(await self._fence(keys=[k.fence(request_id), k.stream(request_id)], args=[attempt, REQUEST_TTL_S]))

    async def append(self, events_by_request: dict[str, list[TokenEvent]]) -> dict[str, int]:
        """Append each request's events to its stream, fenced by attempt (one pipeline).

        Returns per request the number appended, or -1 (stale attempt) / -2 (seq taken).
        """
        calls = self._append_calls(events_by_request)
        if self.cluster:
            outcomes = await self._append_each(calls)
            _raise_first(outcomes)
            return dict(zip(events_by_request, (int(r) for r in outcomes)))
        try:
            results = await self._append_pipeline(calls)
        except NoScriptError:  # Redis restarted and lost its script cache
            await self.redis.script_load(scripts.APPEND)
            results = await self._append_pipeline(calls)
        return dict(zip(events_by_request, (int(r) for r in results)))

    def _append_calls(self, events_by_request: dict[str, list[TokenEvent]]) -> list[tuple[object, ...]]:
        """Per request: APPEND's keys then its arguments."""
        k = self.keys
        calls = []
        for request_id, events in events_by_request.items():
            args: list[object] = [events[0].attempt, STREAM_MAXLEN, REQUEST_TTL_S]
            for event in events:
                args += [event.seq, encode(event)]
            calls.append((k.stream(request_id), k.fence(request_id), *args))
        return calls

    async def _append_pipeline(self, calls: list[tuple[object, ...]]) -> list[object]:
        # Plain EVALSHA: a registered Script in a pipeline costs an extra SCRIPT EXISTS round
        # trip per flush (redis-py checks every script before each pipeline).
        async with self.redis.pipeline(transaction=False) as pipe:
            for call in calls:
                pipe.evalsha(self._append.sha, 2, *call)
            return await pipe.execute()

    async def append_publish(self, worker_id: str, events_by_request: dict[str, list[TokenEvent]],
                             edge_of: dict[str, str]) -> tuple[dict[str, int], dict[str, int]]:
        """``append`` then ``publish`` of one engine step. On one Redis: one round trip (one
        script), each event encoded once, for its stream and its batch. On a cluster (the keys
        span hash slots): appends per request, then one PUBLISH per edge of what was appended;
        if some failed (one master down), the rest is still published and the first error
        raised after: the caller retries the whole step, and its repeats are harmless (APPEND
        takes an event it holds already, edges drop seqs they have).

        Returns (per request: appended, -1 stale or -2 seq taken; per edge: subscribers).
        """
        if self.cluster:
            return await self._append_publish_cluster(worker_id, events_by_request, edge_of)
        k = self.keys
        edges = list(dict.fromkeys(edge_of[rid] for rid in events_by_request))
        edge_index = {edge: i + 1 for i, edge in enumerate(edges)}
        keys: list[str] = []
        args: list[object] = [STREAM_MAXLEN, REQUEST_TTL_S, _json(worker_id), len(edges),
                              *(k.edge_channel(e) for e in edges)]
        for request_id, events in events_by_request.items():
            keys += (k.stream(request_id), k.fence(request_id))
            args += (edge_index[edge_of[request_id]], events[0].attempt, len(events))
            for event in events:
                args += (event.seq, encode(event))
        out = await self._append_publish(keys=keys, args=args)  # loads itself after a Redis restart
        num = len(events_by_request)
        return (dict(zip(events_by_request, (int(n) for n in out[:num]))),
                dict(zip(edges, (int(n) for n in out[num:]))))

    async def publish(self, batches: dict[str, TokenBatch]) -> dict[str, int]:
        """One PUBLISH per edge, pipelined; returns how many subscribers each edge channel had.
        On a cluster: in parallel, the first error raised once all were tried."""
        if self.cluster:
            outcomes = await self._publish_each({edge: encode(batch) for edge, batch in batches.items()})
            _raise_first(outcomes)
            return dict(zip(batches, (int(n) for n in outcomes)))
        async with self.redis.pipeline(transaction=False) as pipe:
            for edge, batch in batches.items():
                pipe.publish(self.keys.edge_channel(edge), encode(batch))
            receivers = await pipe.execute()
        return dict(zip(batches, (int(n) for n in receivers)))

    # -- Redis Cluster ----------------------------------------------------------------------

    async def _append_publish_cluster(self, worker_id: str, events_by_request: dict[str, list[TokenEvent]],
                                      edge_of: dict[str, str]) -> tuple[dict[str, int], dict[str, int]]:
        appended: dict[str, int] = {}
        errors: list[RedisError] = []
        by_edge: dict[str, list[TokenEvent]] = defaultdict(list)
        outcomes = await self._append_each(self._append_calls(events_by_request))
        for (request_id, events), outcome in zip(events_by_request.items(), outcomes):
            if isinstance(outcome, RedisError):
                errors.append(outcome)
                continue
            appended[request_id] = int(outcome)
            if appended[request_id] > 0:
                by_edge[edge_of[request_id]].extend(events)
        receivers: dict[str, int] = {}
        if by_edge:
            messages = {edge: encode(TokenBatch(worker_id, tuple(events))) for edge, events in by_edge.items()}
            for edge, outcome in zip(messages, await self._publish_each(messages)):
                if isinstance(outcome, RedisError):
                    errors.append(outcome)
                else:
                    receivers[edge] = int(outcome)
        if errors:
            raise errors[0]
        return appended, receivers

    async def _append_each(self, calls: list[tuple[object, ...]]) -> list[Any]:
        """Cluster: APPEND per request, one pipeline per node (in parallel). If it fails (a node
        down mid-failover, ``NoScriptError`` on a new master), every call is sent again on its
        own: sending one twice is safe, APPEND accepts an event the stream holds already.
        Returns per call its result or its ``RedisError``."""
        outcomes: list[Any]
        try:
            async with self.redis.pipeline() as pipe:
                for call in calls:
                    # redis-py's cluster pipeline refuses evalsha(); the raw command is routed by its keys.
                    pipe.execute_command("EVALSHA", self._append.sha, 2, *call)
                outcomes = await pipe.execute()
        except RedisError as exc:  # the pipeline does not say which calls ran: each again, below
            outcomes = [exc] * len(calls)
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):
                # One at a time: redis-py drops every connection of the client when one node
                # fails, which would fail the calls in flight beside it. The registered script
                # reloads itself after NoScriptError (a failover loses the script cache).
                outcomes[i] = await _outcome(self._append(keys=calls[i][:2], args=calls[i][2:]))
        _raise_bugs(outcomes)
        return outcomes

    async def _publish_each(self, messages: dict[str, bytes]) -> list[Any]:
        """Cluster: one raw PUBLISH per edge channel (the client has no publish()), in
        parallel, each to its channel's slot master as the cluster says now (``SlotOwners``),
        where that edge subscribes (``pubsub.listen``), so the count it returns is the edge's.
        Per edge: its subscriber count or its ``RedisError``."""
        channels = [self.keys.edge_channel(edge) for edge in messages]
        nodes = [await self._slot_owners.node(channel) for channel in channels]
        sends = [lambda c=channel, d=data, n=node: self.redis.execute_command("PUBLISH", c, d, **({"target_nodes": n} if n else {}))
                 for channel, data, node in zip(channels, messages.values(), nodes)]
        outcomes = list(await asyncio.gather(*(send() for send in sends), return_exceptions=True))
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):  # perhaps only a neighbour's failure: again, alone
                outcomes[i] = await _outcome(sends[i]())
        _raise_bugs(outcomes)
        return outcomes


async def _outcome(call: Awaitable[Any]) -> Any:
    """The result of ``call``, or the ``RedisError`` it raised."""
    try:
        return await call
    except RedisError as exc:
        return exc


def _raise_bugs(outcomes: list[Any]) -> None:
    """An outcome that is an exception but not a ``RedisError`` is a bug, not an outage."""
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, RedisError):
            raise outcome


def _raise_first(outcomes: list[Any]) -> None:
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
