"""A cancel the edge could not get into Redis (hung: SIGSTOP, nothing closes the connections)
is retried until Redis answers (``Edge._cancel``, up to ``CANCEL_RETRY_S``), so a request nobody
listens to any more does not run on for nobody once Redis is back.

Real processes (scheduler, edge, one sim worker), a real redis-server of this module's own that
the tests stop and continue, and a real WebSocket. Redis' command timeout is 1 s here (the URL's
``socket_timeout``), so a cancel fails within a second of the hang instead of five.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
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


def edge_log(system: Any) -> str:
    return (system.log_dir / "edge.log").read_text(errors="replace")


async def wait_for_log(system: Any, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in edge_log(system):
        assert time.monotonic() < deadline, f"the edge never logged {text!r}"
        await asyncio.sleep(0.1)


async def state_in_redis(system: Any, rid: str, want: str, timeout_s: float) -> str:
    """The request's state in Redis, polled until it is ``want`` or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        state, _ = await asyncio.to_thread(system.query, lambda plane: plane.request_status(rid))
        if state == want or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.2)


async def streaming(system: Any, prefix: str) -> tuple[Client, str]:
    """A connection with one long answer streaming on it (thousands of tokens: minutes)."""
    client = await Client.connect(system.edge_urls["edge"])
    rid = f"{prefix}-{uuid.uuid4().hex[:6]}"
    await client.chat(rid, f"Talk at length about {rid}.", max_tokens=4000)
    deadline = time.monotonic() + scaled(30)
    while len(client.deltas(rid)) < 3:
        assert time.monotonic() < deadline, f"the answer did not start streaming: {client.frames[rid]}"
        await asyncio.sleep(0.02)
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
        await wait_for_log(system, f"cancel of {rid}: ", scaled(10))  # the Backoff's warning: it retries
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
        await wait_for_log(system, f"cancel of {rid}: ", scaled(20))
        await asyncio.sleep(HANG_AFTER_FAILURE_S)
    assert await state_in_redis(system, rid, "cancelled", scaled(15)) == "cancelled"
