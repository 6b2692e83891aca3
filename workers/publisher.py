"""One flush of a worker's submitted token events: a pipeline of fenced stream appends, then
one PUBLISH per edge with what the streams accepted. Redis messages therefore grow with
edges x engine steps, not with requests.

Stateless: the run table (``runs.py``) owns what is pending and what a result means.
"""

from __future__ import annotations

from collections import defaultdict

from lanes.queue.messages import TokenEvent
from lanes.queue.plane import QueuePlane
from lanes.workers.runs import FlushResult, Run


async def flush(plane: QueuePlane, worker_id: str, batch: list[tuple[Run, TokenEvent]]) -> FlushResult:
    """Append ``batch`` to the streams (fenced by attempt), then publish what was accepted: one
    round trip on a single Redis (``APPEND_PUBLISH``), two on a cluster (``QueuePlane.append_publish``).

    Raises ``QueueUnavailable``; nothing is published unless its append succeeded.
    """
    by_request: dict[str, list[TokenEvent]] = defaultdict(list)
    edge_of: dict[str, str] = {}
    for run, event in batch:
        by_request[run.id].append(event)
        edge_of[run.id] = run.edge
    appended, receivers = await plane.append_publish(worker_id, by_request, edge_of)
    return FlushResult(appended, receivers)
