"""How a simulated worker picks, classes and preempts requests: the part that differs by policy.

``LanesDiscipline`` is the production path: Redis-like lanes popped in ``policy.lanes_to_pop``
order, running requests counted per ``policy.effective_lane`` (demotion), hand-backs chosen by
``preemption.choose_preemption``; a handed-back request resumes by re-prefilling. FCFS, the
oracle policies and engine priority are this discipline with one lane and open slots.
``MlfqDiscipline`` is FastServe's skip-join MLFQ (``mlfq.py``): token-level preemption, KV
swapped to host memory and back.
"""

from __future__ import annotations

import math

import numpy as np

from lanes.queue.messages import Lane
from lanes.scheduler.policy import LANE_ORDER, effective_lane, lane_bound_tokens, lanes_to_pop, prefill_heavy
from lanes.scheduler.preemption import ReprefillBudget, RunView, choose_preemption, requeue_lane
from lanes.scheduler.sim import mlfq
from lanes.scheduler.sim.backlog import Backlog
from lanes.scheduler.sim.engine import EngineConfig, Worker
from lanes.scheduler.sim.policies import SimPolicy
from lanes.scheduler.sim.trace import Trace
from lanes.scheduler.workmix import WorkMix


class LanesDiscipline:
    resume_by_swap = False
    num_levels = len(LANE_ORDER)

    def __init__(self, policy: SimPolicy, trace: Trace, engine: EngineConfig) -> None:
        self.policy, self.engine = policy, engine
        #: The lane each request was last queued in (a hand-back moves it).
        self.lane = list(policy.lane_of)
        self.prompt = trace.prompt_tokens.tolist()
        predicted = policy.predicted_tokens if policy.predicted_tokens is not None else trace.output_tokens
        self.predicted = [int(p) for p in np.rint(predicted)]
        #: The finished requests' prompt and output tokens, as a worker keeps them (``workmix``).
        self.mix = WorkMix()
        #: Each worker's re-prefill budget (``preemption.ReprefillBudget``), made at its first decision.
        self.budgets: dict[Worker, ReprefillBudget] = {}
        self.decode_token_cost = engine.profile.decode_token_cost(engine.max_num_seqs)
        self.num_decisions = self.num_prefill_heavy = 0

    def arrival_level(self, idx: int) -> int:
        return LANE_ORDER.index(self.lane[idx])

    def classify(self, idx: int, generated: int) -> int:
        bounds = self.policy.demotion
        lane = self.lane[idx] if bounds is None else effective_lane(self.lane[idx], generated, bounds)
        return LANE_ORDER.index(lane)

    def class_bound(self, idx: int, cls: int) -> float:
        bounds = self.policy.demotion
        return math.inf if bounds is None else lane_bound_tokens(LANE_ORDER[cls], bounds)

    def _lane_ages(self, backlog: Backlog, now_s: float) -> dict[Lane, float]:
        return {LANE_ORDER[level]: age for level, age in backlog.oldest_wait_ms(now_s).items()}

    def _running(self, worker: Worker) -> dict[Lane, int]:
        return {LANE_ORDER[cls]: num for cls, num in worker.counts.items()}

    def _pick(self, worker: Worker, backlog: Backlog, now_s: float) -> Lane | None:
        if worker.num_slots_used >= self.engine.max_num_seqs:
            return None
        ages = self._lane_ages(backlog, now_s)
        lanes = lanes_to_pop(self._running(worker), ages, self.policy.slot_config, self._prefill_share())
        return next((x for x in lanes if x in ages), None)

    def next_level(self, worker: Worker, backlog: Backlog, now_s: float) -> int | None:
        lane = self._pick(worker, backlog, now_s)
        if lane is None:
            return None
        self.num_decisions += 1
        self.num_prefill_heavy += self._prefill_heavy()
        return LANE_ORDER.index(lane)

    def finished(self, idx: int, output_tokens: int) -> None:
        self.mix.observe(self.prompt[idx], output_tokens)

    def _prefill_share(self) -> float:
        """The finished requests' prefill share (``WorkMix`` keeps it until the next one finishes)."""
        return self.mix.prefill_share(self.decode_token_cost)

    def _prefill_heavy(self) -> bool:
        return prefill_heavy(self._prefill_share(), self.policy.slot_config)

    def info(self) -> dict[str, float]:
        """The engine's prefill share at the end and the share of pops made oldest-first for it."""
        return {"prefill_share": self._prefill_share(),
                "prefill_heavy_pop_share": self.num_prefill_heavy / max(1, self.num_decisions)}

    def preempt(self, worker: Worker, backlog: Backlog, now_s: float, generated: list[int],
                num_preemptions: list[int]) -> list[tuple[int, int]]:
        """At most one hand-back per iteration, when the worker can pop nothing that waits."""
        config = self.policy.preemption
        if config is None or not worker.runs or not backlog.num_waiting:
            return []
        if self._prefill_heavy():
            return []
        ages = self._lane_ages(backlog, now_s)
        if max(ages.values()) < config.wait_bound_ms or self._pick(worker, backlog, now_s) is not None:
            return []
        views = [RunView(str(idx), self.lane[idx], self.prompt[idx], worker.generated(idx), self.policy.max_tokens,
                         self.predicted[idx], num_preemptions[idx], run.started_s * 1000.0)
                 for idx, run in worker.runs.items()]
        budget = self.budgets.setdefault(worker, ReprefillBudget.full(config))
        chosen = choose_preemption(views, ages, now_s * 1000.0, worker.last_preemption_s * 1000.0, config,
                                   budget.earn(worker.num_generated, config))
        if chosen is None:
            return []
        view = next(v for v in views if v.id == chosen)
        budget.spend(view, config)
        self.lane[int(chosen)] = requeue_lane(view, config)
        return [(int(chosen), LANE_ORDER.index(self.lane[int(chosen)]))]

    def promote(self, backlog: Backlog, now_s: float, generated: list[int]) -> None:
        return None


class MlfqDiscipline:
    resume_by_swap = True

    def __init__(self, policy: SimPolicy, trace: Trace, engine: EngineConfig) -> None:
        assert policy.mlfq is not None
        self.config, self.engine = policy.mlfq, engine
        self.num_levels = self.config.num_levels
        self.prompt = trace.prompt_tokens.tolist()
        self.prefill_ms = [engine.profile.prefill_step_ms(p) for p in self.prompt]
        self.first = [mlfq.first_level(ms, self.config) for ms in self.prefill_ms]
        #: Attained service (ms) when the job (re)joined ``first`` (a promotion resets it).
        self.base_ms = [0.0] * len(self.prompt)
        #: When each job last started waiting: ages for starvation, FCFS keys within a queue.
        self.wait_since_s = trace.arrival_s.tolist()
        self.arrival_s = trace.arrival_s.tolist()
        self.level = list(self.first)

    def _attained_ms(self, idx: int, generated: int) -> float:
        return self.prefill_ms[idx] + max(0, generated - 1) * self.config.decode_ms - self.base_ms[idx]

    def arrival_level(self, idx: int) -> int:
        return self.level[idx]

    def classify(self, idx: int, generated: int) -> int:
        self.level[idx] = mlfq.level(self.first[idx], self._attained_ms(idx, generated), self.config)
        return self.level[idx]

    def class_bound(self, idx: int, cls: int) -> float:
        end_ms = mlfq.level_end_ms(self.first[idx], cls, self.config)
        if math.isinf(end_ms):
            return math.inf
        # generated tokens g with attained(g) >= end_ms, minus one: "more than" this bound.
        needed = end_ms + self.base_ms[idx] - self.prefill_ms[idx]
        return max(0, math.ceil(needed / self.config.decode_ms))

    def finished(self, idx: int, output_tokens: int) -> None:
        return None

    def info(self) -> dict[str, float]:
        return {}

    def next_level(self, worker: Worker, backlog: Backlog, now_s: float) -> int | None:
        return backlog.best_level() if worker.num_slots_used < self.engine.max_num_seqs else None

    def promote(self, backlog: Backlog, now_s: float, generated: list[int]) -> None:
        """Starvation guard: jobs waiting ``starve_after_s`` move to the top queue."""
        if math.isinf(self.config.starve_after_s):
            return
        limit_s = self.config.starve_after_s
        for lvl in range(1, self.num_levels):
            while (idx := backlog.oldest(lvl)) is not None and now_s - self.wait_since_s[idx] >= limit_s:
                backlog.remove(idx)
                self.first[idx], self.level[idx] = 0, 0
                self.base_ms[idx] = self.prefill_ms[idx] + max(0, generated[idx] - 1) * self.config.decode_ms
                backlog.push(0, idx)

    def preempt(self, worker: Worker, backlog: Backlog, now_s: float, generated: list[int],
                num_preemptions: list[int]) -> list[tuple[int, int]]:
        """Swap out the lowest-priority runs that waiting jobs of a higher queue outrank."""
        best = backlog.best_level()
        worst = max((cls for cls, num in worker.counts.items() if num > 0), default=-1)
        if best is None or best >= worst:
            return []
        free = self.engine.max_num_seqs - worker.num_slots_used
        waiting = backlog.level_sizes()
        victims = sorted(worker.runs, key=lambda i: (worker.runs[i].cls, self.arrival_s[i]), reverse=True)
        out: list[tuple[int, int]] = []
        for idx in victims:
            cls = worker.runs[idx].cls
            if sum(waiting[:cls]) <= len(out) + free:
                break
            self.wait_since_s[idx] = now_s
            out.append((idx, cls))
        return out


def make_discipline(policy: SimPolicy, trace: Trace, engine: EngineConfig) -> LanesDiscipline | MlfqDiscipline:
    return MlfqDiscipline(policy, trace, engine) if policy.mlfq is not None else LanesDiscipline(policy, trace, engine)
