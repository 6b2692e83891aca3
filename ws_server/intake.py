"""What happens to a chat between its registration and ``accepted``: the key's rate, a fixed
answer, the pool, the length prediction and lane, admission, and the enqueue. Each outcome is
the delivery core's actions (``accepted``, or a refusal with its reason)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from lanes.queue.errors import ErrorCode
from lanes.queue.keys import DEFAULT_POOL
from lanes.queue.messages import Finish, FinishReason, RequestPayload, TokenEvent, Usage
from lanes.queue.stats import FIXED_LANE, NO_LANE
from lanes.scheduler.router.fixed_answers import FixedAnswer, request_deltas
from lanes.scheduler.router.rules import AUTO
from lanes.telemetry import metrics
from lanes.telemetry.tracing import inject_context, tracer
from lanes.ws_server import delivery, protocol
from lanes.ws_server.auth import Identity
from lanes.ws_server.routing import UnknownModel
from opentelemetry.trace import SpanKind

if TYPE_CHECKING:
    from lanes.scheduler.admission import AdmissionDecision
    from lanes.ws_server.edge import Edge

#: What a client is told to wait when no worker is ready yet (ms).
NO_WORKER_RETRY_MS = 1000


async def admit_and_enqueue(edge: Edge, request_id: str, identity: Identity,
                             frame: protocol.ChatFrame) -> list[delivery.Action]:
    refusal = await edge.keys.rate_refusal(identity)
    if refusal is not None:
        return edge.core.refuse(request_id, ErrorCode(refusal.code.value), refusal.message, **refusal.extra())
    try:
        # The snapshots say which pools have live workers (without a scheduler nobody knows).
        serving = edge.admission.live_pools() if edge.admission.pools() else None
        pool, later = edge.router.pool_for(frame.model, identity.key_id, frame.messages, known_pools(edge), serving)
    except UnknownModel as unknown:  # before a fixed answer: "hi" to a model nobody serves is no answer
        live = tuple(await edge.live_pools())
        if unknown.rules_pools is not None or unknown.model not in live:
            return edge.core.refuse(request_id, ErrorCode.MODEL_NOT_FOUND, unknown.message(live))
        pool, later = unknown.model, ()  # a worker serves it since the last snapshot (a pool that just started)
    edge._pool_of[request_id] = pool  # its metrics carry the pool, refused or not; a cancel goes there
    if (fixed := edge.router.fixed_answer(frame.messages)) is not None:
        return _fixed(edge, request_id, fixed, frame, pool)
    plane = edge.plane.for_pool(pool)

    async def refuse_unless_duplicate(refuse: Callable[[], list[delivery.Action]]) -> list[delivery.Action]:
        """A resubmitted id is told ``duplicate_id`` (resume it), not to retry a refusal."""
        state = await plane.existing_state(request_id, identity.key_id)
        return refuse() if state is None else _duplicate(edge, request_id, state)

    known = edge.admission.num_workers(pool)
    if not known and (known is not None or edge.admission.pools()) and not edge.admission.scales_from_zero(pool) \
            and await edge.plane.fleet.num_workers(pool) == 0:
        # The snapshot may be half a second old, or absent while the scheduler snapshots other
        # pools (this one is not in LANES_POOLS, or its last worker is gone): only a registry
        # with nobody in it refuses. Without any scheduler the edge cannot tell, and enqueues.
        message = f"no worker of pool {pool!r} is ready yet (starting or all down); retry shortly"
        if edge.router.rules is None and frame.model in (None, "", AUTO, DEFAULT_POOL) and \
                (others := await edge.live_pools()):
            # Pools named small / large and no rules: a chat without a model goes to "default"
            # (as one that names it does, copied from the README: told which pools to name).
            message += (f"; or name a pool with live workers in 'model' ({', '.join(others)}), or set "
                        "LANES_ROUTING_FILE so that 'auto' and chats without a model go to one")
        return await refuse_unless_duplicate(lambda: edge.core.refuse(
            request_id, ErrorCode.UNAVAILABLE, message, retry_after_ms=NO_WORKER_RETRY_MS, reason="no_workers"))
    if (everywhere := edge.admission.refusal_in_every_lane(pool, frame.deadline_ms)) is not None:
        # No lane could take it: refused before the length prediction (~2 ms), so a burst's
        # refusals come back at once.
        return await refuse_unless_duplicate(lambda: _overloaded(edge, request_id, everywhere, "no lane can"))
    with edge.admission.predicting(pool):
        predicted = await edge.lengths.predict(frame.messages, frame.max_tokens, (pool, identity.key_id))
    lane = edge.policy.lane_for(predicted)
    decision = edge.admission.decide(pool, lane, frame.deadline_ms)
    if not decision.admitted:
        return await refuse_unless_duplicate(
            lambda: _overloaded(edge, request_id, decision, f"lane {lane.value} cannot", lane.value))
    with tracer().start_as_current_span("lanes.enqueue", kind=SpanKind.PRODUCER, attributes={
        "lanes.request_id": request_id, "lanes.client_request_id": protocol.client_id(request_id),
        "lanes.lane": lane.value, "lanes.predicted_tokens": predicted,
        "lanes.pool": pool,
    }):
        payload = RequestPayload(
            id=request_id, messages=frame.messages, max_tokens=frame.max_tokens, temperature=frame.temperature,
            top_p=frame.top_p, seed=frame.seed, stop=frame.stop, lane=lane, predicted_tokens=predicted,
            trace=inject_context(), resume_grace_s=edge.settings.resume_grace_s,
            fallback_pools=later,
        )
        with edge.admission.enqueueing(pool, lane):
            enqueued = await plane.enqueue(payload, edge.edge_id, owner=identity.key_id)
    if not enqueued.created:
        return _duplicate(edge, request_id, enqueued.existing_state)
    edge.admission.enqueued(pool, lane, request_id)
    return edge.core.accepted(request_id, lane.value, predicted, time.monotonic(), pool)


def _duplicate(edge: Edge, request_id: str, existing_state: str) -> list[delivery.Action]:
    """The ``duplicate_id`` refusal. Ids are scoped by API key (``protocol.scoped_id``), so the
    request is this key's own, or (without auth) an anonymous one; a state the owner check
    withholds ("") is not told."""
    owned = f" ({existing_state}); use resume" if existing_state else ""
    return edge.core.refuse(request_id, ErrorCode.DUPLICATE_ID,
                            f"request {protocol.client_id(request_id)} already exists{owned}")

def _overloaded(edge: Edge, request_id: str, decision: AdmissionDecision, subject: str,
                lane: str = NO_LANE) -> list[delivery.Action]:
    """The ``overloaded`` refusal of an admission decision ("<subject> start this request ...")."""
    reason = decision.reason.value if decision.reason else "overloaded"
    return edge.core.refuse(request_id, ErrorCode.OVERLOADED,
                            f"{subject} start this request in time ({reason}); retry later",
                            lane=lane, retry_after_ms=decision.retry_after_ms, reason=reason)


def _fixed(edge: Edge, request_id: str, fixed: FixedAnswer, frame: protocol.ChatFrame,
           pool: str) -> list[delivery.Action]:
    """A fixed answer, streamed by the edge itself like any answer (no Redis, no model), within
    the request's ``max_tokens`` and ``stop``, in the name of the pool the chat resolved to (what
    ``model: "auto"`` answers with)."""
    metrics.FIXED_ANSWERS.labels(fixed.name).inc()
    deltas, cut = request_deltas(fixed.answer, frame.max_tokens, frame.stop)
    finish = Finish(FinishReason.LENGTH if cut else FinishReason.STOP, Usage(0, len(deltas)))
    events = [TokenEvent(request_id, 0, seq, text) for seq, text in enumerate(deltas)]
    events.append(TokenEvent(request_id, 0, len(deltas), "", (), finish))
    now = time.monotonic()
    return edge.core.accepted(request_id, FIXED_LANE, 0, now, pool) + edge.core.tokens(events, now)

def known_pools(edge: Edge) -> list[str]:
    """Pools the fleet knows: the scheduler snapshots each (configured or with workers)."""
    pools = set(edge.admission.pools()) | {DEFAULT_POOL}
    if edge.router.rules is not None:
        pools |= edge.router.rules.pools
    return sorted(pools)

