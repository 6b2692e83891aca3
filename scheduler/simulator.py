"""Discrete-event simulation of the lanes over a trace, with the engine cost model.

Each worker is a continuous-batching engine (vLLM-v0 style): an iteration is either a
prefill of newly admitted requests (their first token comes out at its end) or one decode
step for every running request. The backlog lives in shared lanes, as it does in Redis, and
a worker with a free slot pops from the lanes in the order ``policy.lanes_to_pop`` gives:
the same pure function the real workers call.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from lanes.queue.messages import Lane
from lanes.scheduler.costmodel import CostProfile, SpecDecoding
from lanes.scheduler.policy import LANE_ORDER, SlotConfig, lanes_to_pop
from lanes.scheduler.trace import Trace


@dataclass(frozen=True)
class EngineConfig:
    """One simulated worker's engine."""

    profile: CostProfile
    max_num_seqs: int = 64
    #: Prompt tokens one prefill iteration may take (a longer prompt runs alone).
    max_prefill_tokens: int = 8192
    spec: SpecDecoding | None = None


@dataclass(frozen=True)
class SimResult:
    """Per-request times (seconds from trace start) and run counters."""

    arrival_s: np.ndarray
    #: When a worker popped the request (queueing ends).
    start_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    num_iterations: int

    @property
    def wait_s(self) -> np.ndarray:
        return self.start_s - self.arrival_s

    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> np.ndarray:
        return self.finish_s - self.arrival_s


class _Lanes:
    """The shared backlog: per lane a heap by queue key, plus arrival order for ages.

    With ``age_from_key`` a lane's age is ``now - head key`` (clamped at 0), which is what
    ``QueuePlane.lane_depths`` reports when the lane ZSETs are scored by ``lane_score_ms``.
    """

    def __init__(self, keys: Sequence[float], enqueue_s: Sequence[float], age_from_key: bool = False) -> None:
        self._keys, self._enqueue_s, self._age_from_key = keys, enqueue_s, age_from_key
        self._heaps: dict[Lane, list[tuple[float, int]]] = {lane: [] for lane in LANE_ORDER}
        self._fifo: dict[Lane, deque[int]] = {lane: deque() for lane in LANE_ORDER}
        self._popped: set[int] = set()
        self.num_waiting = 0

    def push(self, lane: Lane, idx: int) -> None:
        heapq.heappush(self._heaps[lane], (self._keys[idx], idx))
        self._fifo[lane].append(idx)
        self.num_waiting += 1

    def oldest_wait_ms(self, now_s: float) -> dict[Lane, float]:
        if self._age_from_key:
            return {lane: max(0.0, now_s - heap[0][0]) * 1000.0 for lane, heap in self._heaps.items() if heap}
        ages: dict[Lane, float] = {}
        for lane, fifo in self._fifo.items():
            while fifo and fifo[0] in self._popped:
                self._popped.discard(fifo.popleft())
            if fifo:
                ages[lane] = (now_s - self._enqueue_s[fifo[0]]) * 1000.0
        return ages

    def peek(self, lane: Lane) -> int:
        return self._heaps[lane][0][1]

    def pop(self, lane: Lane) -> int:
        idx = heapq.heappop(self._heaps[lane])[1]
        self._popped.add(idx)
        self.num_waiting -= 1
        return idx


class _Worker:
    def __init__(self) -> None:
        self.running: dict[Lane, int] = {lane: 0 for lane in LANE_ORDER}
        self.num_running = 0
        #: (decode step at which it finishes, request index)
        self.finishing: list[tuple[int, int]] = []
        self.num_steps = 0
        self.num_context_tokens = 0.0


def simulate(
    trace: Trace,
    lane_of: Sequence[Lane],
    slot_config: SlotConfig,
    engine: EngineConfig,
    *,
    queue_key: Sequence[float] | None = None,
    age_from_key: bool = False,
    num_workers: int = 1,
    predictor_ms: float = 0.0,
) -> SimResult:
    """Run the trace to completion. ``queue_key`` orders requests within a lane (default:
    enqueue time, i.e. FCFS as a Redis ZSET scored by time); with ``age_from_key`` (keys in
    seconds) lane ages for ``lanes_to_pop`` are measured from the head's key, as Redis
    reports them, instead of from the oldest request; ``predictor_ms`` is charged to
    each request's queueing time before it is enqueued."""
    n = len(trace)
    arrival = trace.arrival_s.tolist()
    enqueue = [a + predictor_ms / 1000.0 for a in arrival]
    prompt, output = trace.prompt_tokens.tolist(), trace.output_tokens.tolist()
    lanes = _Lanes(enqueue if queue_key is None else list(queue_key), enqueue, age_from_key)
    start, first, finish = [math.nan] * n, [math.nan] * n, [math.nan] * n
    tokens_per_step = engine.spec.tokens_per_step() if engine.spec else 1.0
    workers = [_Worker() for _ in range(num_workers)]
    events = [(0.0, w) for w in range(num_workers)]
    next_arrival, num_done, num_iterations, idle_polls = 0, 0, 0, 0
    while num_done < n:
        now, w = heapq.heappop(events)
        while next_arrival < n and enqueue[next_arrival] <= now:
            lanes.push(lane_of[next_arrival], next_arrival)
            next_arrival += 1
        worker = workers[w]
        batch = _admit(worker, lanes, now, slot_config, engine, prompt)
        if batch:
            end = now + engine.profile.prefill_step_ms(sum(prompt[i] for i in batch)) / 1000.0
            for i in batch:
                start[i], first[i] = now, end
                steps = math.ceil((output[i] - 1) / tokens_per_step)
                heapq.heappush(worker.finishing, (worker.num_steps + steps, i))
                worker.num_context_tokens += prompt[i] + 1
            num_done += _retire(worker, end, finish, prompt, output, lane_of)
        elif worker.num_running:
            step_ms = engine.profile.decode_step_ms(worker.num_running, max(0, int(worker.num_context_tokens)))
            end = now + (engine.spec.step_ms(step_ms) if engine.spec else step_ms) / 1000.0
            worker.num_steps += 1
            worker.num_context_tokens += worker.num_running * tokens_per_step
            num_done += _retire(worker, end, finish, prompt, output, lane_of)
        else:  # idle: sleep until the next arrival, or poll a blocked backlog
            idle_polls = idle_polls + 1 if next_arrival >= n else 0
            if idle_polls > 100_000:
                raise RuntimeError("backlog can never be popped: check the slot config")
            end = enqueue[next_arrival] if next_arrival < n else now + 1.0
        num_iterations += 1
        heapq.heappush(events, (end, w))
    return SimResult(trace.arrival_s, np.asarray(start), np.asarray(first), np.asarray(finish), num_iterations)


def _admit(worker: _Worker, lanes: _Lanes, now_s: float, config: SlotConfig, engine: EngineConfig,
           prompt: list[int]) -> list[int]:
    """Pop requests into free slots, in policy order, within the prefill token budget."""
    batch: list[int] = []
    num_tokens = 0
    while lanes.num_waiting and worker.num_running < engine.max_num_seqs:
        ages = lanes.oldest_wait_ms(now_s)
        lane = next((lane for lane in lanes_to_pop(worker.running, ages, config) if lane in ages), None)
        if lane is None:
            break
        idx = lanes.peek(lane)
        if batch and num_tokens + prompt[idx] > engine.max_prefill_tokens:
            break
        lanes.pop(lane)
        batch.append(idx)
        num_tokens += prompt[idx]
        worker.running[lane] += 1
        worker.num_running += 1
    return batch


def _retire(worker: _Worker, end_s: float, finish: list[float], prompt: list[int], output: list[int],
            lane_of: Sequence[Lane]) -> int:
    """Finish the requests whose last token comes out at the end of this iteration."""
    num = 0
    while worker.finishing and worker.finishing[0][0] <= worker.num_steps:
        i = heapq.heappop(worker.finishing)[1]
        finish[i] = end_s
        worker.running[lane_of[i]] -= 1
        worker.num_running -= 1
        worker.num_context_tokens -= prompt[i] + output[i]
        num += 1
    return num
