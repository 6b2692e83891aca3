"""A cancel the edge could not get into Redis (hung: SIGSTOP, nothing closes the connections)
is retried until Redis answers (``Edge.send_cancels``: one queue of pending cancels per edge,
``ws_server/cancels.py``), so a request nobody listens to any more does not run on for nobody
once Redis is back; and a worker reports again within a heartbeat of Redis answering.

Real processes (scheduler, edge, one sim worker), a real redis-server of this module's own that
the tests stop and continue, and a real WebSocket. Redis' command timeout is 1 s here (the URL's
``socket_timeout``), so a cancel fails within a second of the hang instead of five.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import scaled
from e2e_support import Client
from lanes.queue.embedded import EmbeddedRedis

pytestmark = pytest.mark.e2e

#: Redis' command timeout for every process (s).
COMMAND_TIMEOUT_S = 1
#: How long Redis hangs once the cancel has failed (s): past the retry's first pause (1 s).
HANG_AFTER_FAILURE_S = 2.0


@pytest.fixture(scope="module")
def own_redis() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.process.send_signal(signal.SIGCONT)  # a test that failed mid-hang must not hang the stop
        server.stop()


@pytest.fixture(scope="module")
def system(make_cluster: Any, own_redis: EmbeddedRedis) -> Any:
    return make_cluster(workers=1, worker_args=("--engine", "sim", "--sim-time-scale", "1"),
                        redis=f"{own_redis.url}?socket_timeout={COMMAND_TIMEOUT_S}",
                        env={"LANES_RESUME_GRACE_S": "1"})


@contextlib.contextmanager
def hung(server: EmbeddedRedis) -> Iterator[None]:
    server.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.process.send_signal(signal.SIGCONT)


def edge_log(system: Any, name: str = "edge") -> str:
    return (system.log_dir / f"{name}.log").read_text(errors="replace")


async def wait_for_log(system: Any, text: str, timeout_s: float, name: str = "edge", times: int = 1) -> None:
    """Until process ``name`` has logged ``text`` ``times`` times."""
    deadline = time.monotonic() + timeout_s
    while edge_log(system, name).count(text) < times:
        assert time.monotonic() < deadline, f"the {name} never logged {text!r} ({times} times)"
        await asyncio.sleep(0.05)


async def state_in_redis(system: Any, rid: str, want: str, timeout_s: float) -> str:
    """The request's state in Redis, polled until it is ``want`` or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        state, _ = await asyncio.to_thread(system.query, lambda plane: plane.request_status(rid))
        if state == want or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.2)


async def streaming(system: Any, prefix: str) -> tuple[Client, str]:
    """A connection with one long answer streaming on it (thousands of tokens: minutes).

    A chat refused ``no_workers`` is sent again after its ``retry_after_ms``, as a client is
    told to: a hang of an earlier test outlasts the worker's registration (5 s), and the edge
    refuses until the worker has reported again (within a heartbeat of Redis answering:
    ``test_a_worker_reports_again_within_a_heartbeat_once_redis_answers``)."""
    client = await Client.connect(system.edge_urls["edge"])
    deadline = time.monotonic() + scaled(30)
    while True:
        rid = f"{prefix}-{uuid.uuid4().hex[:6]}"
        await client.chat(rid, f"Talk at length about {rid}.", max_tokens=4000)
        while len(client.deltas(rid)) < 3:
            assert time.monotonic() < deadline, f"the answer did not start streaming: {client.frames[rid]}"
            if (refused := client.frames[rid][-1:]) and refused[0].get("reason") == "no_workers":
                await asyncio.sleep(refused[0]["retry_after_ms"] / 1000)
                break
            await asyncio.sleep(0.02)
        else:
            return client, rid


async def test_a_cancel_sent_while_redis_hangs_reaches_redis_once_it_answers(system: Any,
                                                                            own_redis: EmbeddedRedis) -> None:
    """The client cancels during the hang: it is told ``cancelled`` after the cancel grace, and
    the request is cancelled in Redis once Redis answers (before, the edge tried once and gave
    up: the worker ran the answer to its end for nobody)."""
    client, rid = await streaming(system, "cancelled")
    with hung(own_redis):
        await client.send({"type": "cancel", "id": rid})
        ended = await client.wait(rid, timeout_s=scaled(15))
        assert ended["type"] == "done" and ended["finish_reason"] == "cancelled", ended
        await wait_for_log(system, f"pending ({rid}", scaled(10))  # the retry's warning: it retries
        await asyncio.sleep(HANG_AFTER_FAILURE_S)
    assert await state_in_redis(system, rid, "cancelled", scaled(15)) == "cancelled"
    await client.close()


async def test_a_request_whose_client_left_while_redis_hangs_is_cancelled_once_it_answers(
        system: Any, own_redis: EmbeddedRedis) -> None:
    """The client goes away during the hang and its resume grace (1 s here) runs out: the
    edge's cancel cannot reach Redis, and lands once Redis answers."""
    client, rid = await streaming(system, "left")
    with hung(own_redis):
        await client.close()
        await wait_for_log(system, f"pending ({rid}", scaled(20))
        await asyncio.sleep(HANG_AFTER_FAILURE_S)
    assert await state_in_redis(system, rid, "cancelled", scaled(15)) == "cancelled"


def pending_metric(system: Any) -> float:
    """The edge's ``lanes_edge_cancels_pending`` (``/metrics`` asks Redis nothing)."""
    url = f"http://127.0.0.1:{system.edge_ports['edge']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return float(re.search(r"^lanes_edge_cancels_pending (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


async def test_several_cancels_pending_at_once_are_retried_together_and_all_land(system: Any,
                                                                                own_redis: EmbeddedRedis) -> None:
    """One client cancels, two leave (past their 1 s resume grace) while Redis hangs: three
    cancels wait in the edge's one queue (its metric says 3), retried by one loop, which logs one
    warning for the outage and one recovery line once Redis answers, and all three land. The
    client that cancelled is answered at once (its answer ends after the cancel grace)."""
    streams = [await streaming(system, f"many{i}") for i in range(3)]
    (canceller, cancelled), *leavers = streams
    warned = edge_log(system).count("cancel retry: TimeoutError")
    recovered = edge_log(system).count("cancel retry: recovered")
    with hung(own_redis):
        await canceller.send({"type": "cancel", "id": cancelled})
        for client, _ in leavers:
            await client.close()
        ended = await canceller.wait(cancelled, timeout_s=scaled(15))
        assert ended["type"] == "done" and ended["finish_reason"] == "cancelled", ended
        deadline = time.monotonic() + scaled(15)
        while (pending := await asyncio.to_thread(pending_metric, system)) < 3:
            assert time.monotonic() < deadline, f"{pending:g} cancels pending, not 3"
            await asyncio.sleep(0.1)
        await asyncio.sleep(HANG_AFTER_FAILURE_S)
    for _, rid in streams:
        assert await state_in_redis(system, rid, "cancelled", scaled(15)) == "cancelled", rid
    await wait_for_log(system, "cancel retry: recovered", scaled(10), times=recovered + 1)
    log = edge_log(system)
    assert log.count("cancel retry: TimeoutError") == warned + 1, "one warning for the outage"
    assert log.count("cancel retry: recovered") == recovered + 1, "one recovery line"
    assert re.search(r"cancel retry: recovered after .*: 3 sent", log), "the three in one attempt"
    assert await asyncio.to_thread(pending_metric, system) == 0
    await canceller.close()


#: How long a worker's registration outlives its last report (``Reporter.report``: 5 s here).
REGISTRATION_S = 5.0
#: The harness's heartbeat (``FAST_FAILOVER_ENV``).
HEARTBEAT_S = 0.3


async def test_a_worker_reports_again_within_a_heartbeat_once_redis_answers(system: Any,
                                                                           own_redis: EmbeddedRedis) -> None:
    """A hang longer than a worker's registration empties the registry, and every edge refuses
    every chat (``no_workers``) until the worker reports again: it must, within about a heartbeat
    of Redis answering. Its heartbeat backed off like a retry loop (up to 2 s more between
    tries), so that took up to 2.3 s; the second test here then had its chat refused now and
    then. Redis answers 6.5 s after the worker's first failed heartbeat: a backed-off heartbeat
    is then in its 2 s pause (its tries failed about 1.6, 3.5 and 6 s after the first one; the
    next comes at about 8.3 s)."""
    warned = edge_log(system, "worker").count("heartbeat: TimeoutError")
    # The earlier tests' hangs are over for the heartbeat (else this hang would be the same outage).
    await wait_for_log(system, "heartbeat: recovered", scaled(15), name="worker", times=warned)
    plane = system.plane()
    try:
        with hung(own_redis):
            await wait_for_log(system, "heartbeat: TimeoutError", scaled(10), name="worker", times=warned + 1)
            await asyncio.sleep(REGISTRATION_S + 1.5)
        answered = time.monotonic()
        while not await plane.fleet.num_workers():
            waited = time.monotonic() - answered
            assert waited < scaled(2 * HEARTBEAT_S + 0.4), f"the worker had not reported {waited:.1f} s after Redis answered"
            await asyncio.sleep(0.02)
    finally:
        await plane.close()
