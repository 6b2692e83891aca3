"""Discrete-event simulation of a scheduling policy over a trace, with the engine cost model.

Each worker is a continuous-batching engine (``engine.py``). The backlog is shared, as it is
in Redis. Per iteration a worker (1) re-classes runs that crossed a bound (demotion), (2) lets
its discipline preempt, (3) pops into free slots in the discipline's order within the prefill
token budget, then (4) runs a prefill of what it popped, or else one decode step (vLLM v0). With
``EngineConfig.chunked_prefill_tokens`` (vLLM V1's chunked prefill) every iteration decodes all
running requests and spends the rest of its token budget on prompt chunks instead
(``_chunked_iteration``); a request holds its slot from the first chunk. The lanes
discipline calls the production functions: ``policy.lanes_to_pop``, ``policy.effective_lane``,
``preemption.choose_preemption`` (see ``disciplines.py``).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from lanes.scheduler.preemption import reprefill_tokens
from lanes.scheduler.sim.backlog import Backlog
from lanes.scheduler.sim.disciplines import LanesDiscipline, MlfqDiscipline, make_discipline
from lanes.scheduler.sim.engine import EngineConfig, Worker
from lanes.scheduler.sim.policies import SimPolicy
from lanes.scheduler.sim.trace import Trace

#: Idle polls of a backlog no worker can pop before the run is declared stuck.
_MAX_IDLE_POLLS = 100_000


@dataclass(frozen=True)
class SimResult:
    """Per-request times (seconds from trace start) and run counters."""

    arrival_s: np.ndarray
    #: When a worker first popped the request (its first queueing ends).
    start_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    num_iterations: int
    #: Times each request was preempted (handed back or swapped out).
    num_preemptions: np.ndarray
    #: Tokens prefilled again to resume preempted requests (recompute), summed.
    num_reprefill_tokens: int = 0
    #: What the discipline reports at the end (the lanes': ``prefill_share``, ``prefill_heavy_pop_share``).
    info: dict[str, float] = field(default_factory=dict)

    @property
    def wait_s(self) -> np.ndarray:
        return self.start_s - self.arrival_s

    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> np.ndarray:
        return self.finish_s - self.arrival_s


def simulate(trace: Trace, policy: SimPolicy, engine: EngineConfig, num_workers: int = 1) -> SimResult:
    """Run the trace to completion under ``policy``; raises ``RuntimeError`` if the backlog
    can never be popped (a slot config that blocks a lane forever)."""
    n = len(trace)
    arrival = trace.arrival_s.tolist()
    enqueue = (trace.arrival_s + np.broadcast_to(policy.predictor_ms, (n,)) / 1000.0).tolist()
    prompt, output = trace.prompt_tokens.tolist(), trace.output_tokens.tolist()
    discipline = make_discipline(policy, trace, engine)
    if discipline.resume_by_swap:  # MLFQ: FCFS by arrival within a queue; ages since the last wait
        backlog = Backlog(discipline.num_levels, arrival, discipline.wait_since_s)
    else:
        keys = enqueue if policy.queue_key is None else policy.queue_key.tolist()
        backlog = Backlog(discipline.num_levels, keys, enqueue)
    start, first, finish = [math.nan] * n, [math.nan] * n, [math.nan] * n
    generated, num_preemptions = [0] * n, [0] * n
    workers = [Worker(engine) for _ in range(num_workers)]
    events = [(0.0, w) for w in range(num_workers)]
    next_arrival, num_done, num_iterations, idle_polls, num_reprefill = 0, 0, 0, 0, 0
    while num_done < n:
        now, w = heapq.heappop(events)
        while next_arrival < n and enqueue[next_arrival] <= now:
            backlog.push(discipline.arrival_level(next_arrival), next_arrival)
            next_arrival += 1
        worker = workers[w]
        for idx in worker.due_rechecks():
            cls = discipline.classify(idx, worker.generated(idx))
            worker.set_class(idx, cls)
            worker.recheck_at_tokens(idx, discipline.class_bound(idx, cls))
        discipline.promote(backlog, now, generated)
        for idx, level in discipline.preempt(worker, backlog, now, generated, num_preemptions):
            generated[idx] = worker.generated(idx)
            worker.remove(idx)
            worker.last_preemption_s = now
            num_preemptions[idx] += 1
            if discipline.resume_by_swap:
                worker.pending_ms += (prompt[idx] + generated[idx]) * engine.swap_ms_per_token
            backlog.push(level, idx)
        iteration = _chunked_iteration if engine.chunked_prefill_tokens else _v0_iteration
        end = iteration(worker, backlog, discipline, now, prompt, output, generated, start, first)
        if end is None:  # idle: sleep until the next arrival, or poll a blocked backlog
            idle_polls = idle_polls + 1 if next_arrival >= n else 0
            if idle_polls > _MAX_IDLE_POLLS:
                raise RuntimeError("backlog can never be popped: check the slot config")
            end = enqueue[next_arrival] if next_arrival < n else now + 1.0
        num_reprefill += worker.take_reprefill_tokens()
        for idx in worker.retire():
            finish[idx] = end
            discipline.finished(idx, output[idx])
            num_done += 1
        num_iterations += 1
        heapq.heappush(events, (end, w))
    return SimResult(trace.arrival_s, np.asarray(start), np.asarray(first), np.asarray(finish), num_iterations,
                     np.asarray(num_preemptions), num_reprefill, discipline.info())


def _admitted(worker: Worker, discipline: LanesDiscipline | MlfqDiscipline, idx: int, tokens: int,
              generated: list[int], prompt: list[int]) -> bool:
    """Bookkeeping of a request a worker just popped: a swap-in's transfer time, a resume's
    re-prefill. Returns whether it resumes by swapping its KV back in (no prefill, no new token)."""
    swapped_in = discipline.resume_by_swap and generated[idx] > 0
    if swapped_in:
        worker.pending_ms += (prompt[idx] + generated[idx]) * worker.engine.swap_ms_per_token
    elif generated[idx] > 0:
        worker.num_reprefill_tokens += tokens
    return swapped_in


def _v0_iteration(worker: Worker, backlog: Backlog, discipline: LanesDiscipline | MlfqDiscipline, now: float,
                  prompt: list[int], output: list[int], generated: list[int], start: list[float],
                  first: list[float]) -> float | None:
    """One vLLM-v0 iteration: a prefill of what fits the prefill token budget (a longer prompt
    runs alone; each popped request's first token comes at its end), or else one decode step of
    every running request. Returns the iteration's end, or None when there is nothing to run."""
    engine = worker.engine
    batch, num_tokens = [], 0
    while backlog.num_waiting:
        level = discipline.next_level(worker, backlog, now)
        if level is None:
            break
        idx = backlog.peek(level)
        assert idx is not None
        tokens = _prefill_tokens(idx, prompt, generated, engine, discipline.resume_by_swap)
        if batch and num_tokens + tokens > engine.max_prefill_tokens:
            break
        backlog.pop(level)
        batch.append(idx)
        num_tokens += tokens
        swapped_in = _admitted(worker, discipline, idx, tokens, generated, prompt)
        cls = discipline.classify(idx, generated[idx] + (0 if swapped_in else 1))
        worker.add(idx, generated[idx], 0 if swapped_in else 1, cls, now, prompt[idx], output[idx])
        worker.recheck_at_tokens(idx, discipline.class_bound(idx, cls))
    if not batch:
        return now + worker.decode_step() / 1000.0 if worker.num_running else None
    end = now + (engine.profile.prefill_step_ms(num_tokens) if num_tokens else 0.0) / 1000.0
    end += worker.take_pending_ms() / 1000.0
    for idx in batch:
        if math.isnan(start[idx]):
            start[idx] = now
        if math.isnan(first[idx]) and (not discipline.resume_by_swap or generated[idx] == 0):
            first[idx] = end
    return end


def _chunked_iteration(worker: Worker, backlog: Backlog, discipline: LanesDiscipline | MlfqDiscipline, now: float,
                       prompt: list[int], output: list[int], generated: list[int], start: list[float],
                       first: list[float]) -> float | None:
    """One iteration with chunked prefill (vLLM V1): every running request decodes one step and
    the rest of the token budget (``chunked_prefill_tokens`` minus one per decode) goes to prompt
    chunks, first of the requests already prefilling (in admission order), then of requests
    popped now. A request whose prompt is done gets its first token at the iteration's end and
    decodes from the next. Returns the iteration's end, or None when there is nothing to run."""
    engine = worker.engine
    budget = engine.chunked_prefill_tokens - worker.num_running
    chunks: list[tuple[int, int]] = []  # (tokens already prefilled, tokens in this chunk)
    done: list[int] = []
    for idx, pf in worker.prefilling.items():
        if budget <= 0:
            break
        take = min(pf.remaining, budget)
        chunks.append((pf.total - pf.remaining, take))
        pf.remaining -= take
        budget -= take
        if pf.remaining == 0:
            done.append(idx)
    while budget > 0 and backlog.num_waiting:
        level = discipline.next_level(worker, backlog, now)
        if level is None:
            break
        idx = backlog.pop(level)
        tokens = _prefill_tokens(idx, prompt, generated, engine, discipline.resume_by_swap)
        swapped_in = _admitted(worker, discipline, idx, tokens, generated, prompt)
        cls = discipline.classify(idx, generated[idx] + (0 if swapped_in else 1))
        pf = worker.start_prefill(idx, tokens, cls, generated[idx], swapped_in, now)
        if math.isnan(start[idx]):
            start[idx] = now
        take = min(tokens, budget)
        chunks.append((0, take))
        pf.remaining -= take
        budget -= take
        if pf.remaining == 0:
            done.append(idx)
    if not chunks and not done and not worker.num_running:
        return None
    if worker.num_running:
        step_ms = engine.profile.chunked_step_ms(chunks, worker.decode_step())
    else:  # a prefill-only iteration pays the fixed per-iteration cost once
        step_ms = engine.profile.chunked_step_ms(chunks, None) + worker.take_pending_ms()
    end = now + step_ms / 1000.0
    for idx in done:
        pf = worker.finish_prefill(idx)
        worker.add(idx, pf.base_tokens, 0 if pf.swapped_in else 1, pf.cls, pf.started_s, prompt[idx], output[idx])
        worker.recheck_at_tokens(idx, discipline.class_bound(idx, pf.cls))
        if math.isnan(first[idx]) and (not discipline.resume_by_swap or generated[idx] == 0):
            first[idx] = end
    return end


def _prefill_tokens(idx: int, prompt: list[int], generated: list[int], engine: EngineConfig, by_swap: bool) -> int:
    if generated[idx] == 0:
        return prompt[idx]
    return 0 if by_swap else reprefill_tokens(prompt[idx], generated[idx], engine.prompt_cached_share)
