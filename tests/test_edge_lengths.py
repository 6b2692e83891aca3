"""The edge's length predictions off the loop: a few at a time, tenants (pool, API key) in turn.

A predictor that blocks until the test lets it go, so the order in which predictions start is
observed exactly (no timing): a backlog one tenant made does not delay another's prediction by
more than the predictions already running.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest
from lanes.queue.messages import ChatMessage
from lanes.ws_server.lengths import PREDICT_THREADS, LengthEstimator


class Gated:
    """Each call records its prompt, then waits for the gate (the start-up probes pass)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gate = threading.Semaphore(0)
        self.probing = True

    def predict(self, messages: Sequence[ChatMessage], max_tokens: int) -> int:
        if self.probing:
            threading.Event().wait(0.002)  # slower than the inline limit: predictions go to threads
            return 1
        self.started.append(messages[-1].content)
        self.gate.acquire()
        if messages[-1].content == "boom":
            raise RuntimeError("predictor failed")
        return len(messages[-1].content)


def estimator() -> tuple[LengthEstimator, Gated]:
    gated = Gated()
    lengths = LengthEstimator(gated)
    gated.probing = False
    assert not lengths.inline
    return lengths, gated


async def until(condition, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def ask(lengths: LengthEstimator, text: str, tenant: object) -> asyncio.Task[int]:
    return asyncio.create_task(lengths.predict((ChatMessage("user", text),), 64, tenant))


async def test_a_flood_from_one_tenant_does_not_queue_in_front_of_another() -> None:
    lengths, gated = estimator()
    flood = [ask(lengths, f"a{i}", ("big", "key-a")) for i in range(10)]
    await until(lambda: len(gated.started) == PREDICT_THREADS)
    other = ask(lengths, "b", ("small", "key-b"))
    await until(lambda: lengths.waiting() == 10 - PREDICT_THREADS + 1)
    gated.gate.release()  # two of the running floods end: the other tenant's is one of the next
    gated.gate.release()  # two (its turn comes after a2's, which was due first), not the 11th
    await until(lambda: len(gated.started) == PREDICT_THREADS + 2)
    assert gated.started[PREDICT_THREADS:] == ["a2", "b"]
    for _ in range(9):
        gated.gate.release()
    assert await other == 1 and [await t for t in flood] == [len(f"a{i}") for i in range(10)]
    assert gated.started[:PREDICT_THREADS] == [f"a{i}" for i in range(PREDICT_THREADS)]
    assert sorted(gated.started) == sorted([f"a{i}" for i in range(10)] + ["b"]), "each predicted once"
    assert lengths.waiting() == 0


async def test_tenants_take_turns_and_each_keeps_its_order() -> None:
    lengths, gated = estimator()
    tasks = [ask(lengths, f"{t}{i}", t) for i in range(3) for t in ("x", "y")]  # x0 y0 x1 y1 x2 y2
    tasks += [ask(lengths, f"z{i}", "z") for i in range(3)]
    for _ in range(len(tasks)):
        gated.gate.release()
    await asyncio.gather(*tasks)
    after_running = gated.started[PREDICT_THREADS:]
    assert after_running[:3] == ["x1", "y1", "z0"] or after_running[:3] == ["y1", "z0", "x1"], gated.started
    for t in "xyz":
        assert [s for s in gated.started if s[0] == t] == [f"{t}{i}" for i in range(3)]


async def test_a_cancelled_wait_is_never_predicted_and_a_failure_reaches_its_caller() -> None:
    lengths, gated = estimator()
    running = [ask(lengths, f"r{i}", "t") for i in range(PREDICT_THREADS)]
    await until(lambda: len(gated.started) == PREDICT_THREADS)
    gone = ask(lengths, "gone", "t")  # its client leaves while it waits
    failing = ask(lengths, "boom", "u")
    await until(lambda: lengths.waiting() == 2)
    gone.cancel()
    for _ in range(PREDICT_THREADS + 1):
        gated.gate.release()
    with pytest.raises(RuntimeError, match="predictor failed"):
        await failing
    await asyncio.gather(*running)
    assert "gone" not in gated.started and gone.cancelled()
    later = ask(lengths, "later", "t")  # the runner goes on
    gated.gate.release()
    assert await later == 5
