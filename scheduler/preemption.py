"""Limited preemption by hand-back: which running request a worker gives back to the lanes.

When a lane's oldest request has waited ``wait_bound_ms`` and the worker can pop nothing that
waits (no free slot, or the waiting lanes are capped), the worker may hand one running request
back: it goes to the queue again and resumes later, on any worker, after the tokens it has
already streamed (the stream fence guarantees no duplicate and no gap). The resumed attempt
re-prefills the prompt plus the generated tokens (``reprefill_tokens``), minus what prefix
caching saves on engines that have it. Pure: the worker's runs and the time are arguments.

The worker's contract:

- At most once per engine step, and only when ``lanes_to_pop(...)`` offers no lane that has
  waiting requests, call ``choose_preemption(runs, oldest_wait_ms, now_ms,
  last_preemption_ms, config, budget_tokens)`` with one ``RunView`` per running request, the
  lane ages of the latest depth snapshot (the ``oldest_wait_ms`` it passes to ``lanes_to_pop``)
  and its re-prefill budget (below).
- ``None``: nothing to do. An id: hand that request back (``QueuePlane.release``) into
  ``requeue_lane(run, config)`` at its original score, count one more ``num_preemptions`` for
  it (the count travels with the request), remember ``last_preemption_ms = now_ms`` and
  ``spend`` the run's re-prefill from its ``ReprefillBudget``.
  ``requeue_lane`` is the run's effective lane, so a demoted request goes back behind the
  lane it outgrew, not to the head of the short lane (``RELEASE`` must accept that lane).
- Candidates: runs whose lane is later than a lane that has waited ``wait_bound_ms`` — runs
  claimed from a later lane and, with ``hand_back_demoted``, demoted runs
  (``policy.effective_lane``). Never one handed back ``max_preemptions`` times already, one
  that (re)started less than ``min_run_ms`` ago, one within ``min_remaining_tokens`` of its
  ``max_tokens`` or of its predicted end (``max_tokens`` alone rarely bound: clients set them
  high, the simulator at 4,096), or one whose re-prefill costs more than ``max_cost_ratio``
  tokens per token of slot time it frees. A run that has outlived its prediction may be near
  its end with nothing to tell so.
- Among candidates: the lowest ``reprefill_tokens / expected_remaining_tokens``.
- A re-prefill budget (a token bucket, ``budget_tokens``): the worker earns
  ``max_reprefill_share`` re-prefill tokens per token it generates, kept up to
  ``reprefill_burst_tokens`` (``earn_reprefill_budget``), and a hand-back spends its
  ``hand_back_cost``; a candidate that costs more than the budget holds is no candidate, unless
  the budget is full (it then pays for any one hand-back, into debt; a burst of 0: none). Under a
  backlog that lasts (every short request waits past the bound) hand-backs would otherwise run
  back to back, each re-prefilling work already done: 2,993 of them cost lanes 3 % of its
  saturation capacity (benchmarks/RESULTS.md, "Stop 43"). The budget bounds that loss by
  construction, and a peak's few hand-backs still find it full.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lanes.queue.messages import Lane
from lanes.scheduler.policy import LANE_ORDER, LaneThresholds, effective_lane

#: ``last_preemption_ms`` for a worker that has never handed a request back.
NEVER_MS = -math.inf


@dataclass(frozen=True)
class RunView:
    """A worker's snapshot of one running request."""

    id: str
    #: The lane it was claimed from.
    lane: Lane
    prompt_tokens: int
    #: Tokens streamed so far, earlier attempts included.
    generated_tokens: int
    max_tokens: int
    #: The edge's prediction (the request payload carries it).
    predicted_tokens: int
    #: Times it was handed back already.
    num_preemptions: int
    #: When this attempt started generating (ms, the caller's clock).
    started_at_ms: float


@dataclass(frozen=True)
class PreemptionConfig:
    """When a worker hands a running request back, and which one. The defaults are the
    simulator's tuned ones (benchmarks/RESULTS.md, issue 9): a safety valve for long-lane
    runs under severe overload, since re-prefilling costs more than it saves otherwise."""

    #: Demotion bounds: a run counts against ``effective_lane(lane, generated, demotion)``.
    demotion: LaneThresholds = LaneThresholds(short_max_tokens=200, medium_max_tokens=200)
    #: A lane whose oldest request has waited this long may take a later lane's slot.
    wait_bound_ms: float = 20_000.0
    #: A request is handed back at most this many times.
    max_preemptions: int = 1
    #: Never hand back a request this close to its ``max_tokens``.
    min_remaining_tokens: int = 32
    #: A run that (re)started less than this long ago is not handed back.
    min_run_ms: float = 1_000.0
    #: At most one hand-back per worker per this interval.
    min_interval_ms: float = 0.0
    #: Hand back only if ``reprefill_tokens / expected_remaining_tokens`` is at most this. A
    #: prefill token costs the whole batch ~0.1 ms and a decode step of ~50 ms is shared by
    #: ~64 runs, so below ~8 the slot time freed outweighs the batch time lost.
    max_cost_ratio: float = 4.0
    #: Share of the prompt an engine with prefix caching still holds when the request resumes.
    prompt_cached_share: float = 0.0
    #: Re-prefill tokens a worker earns per token it generates (the budget's rate). At 0.05 on
    #: the L70-H100 profile, where a prefill token costs ~1/8 of a decode token's engine time,
    #: hand-backs take at most ~0.6 % of the worker's time in a backlog that never clears.
    max_reprefill_share: float = 0.05
    #: The most re-prefill tokens the budget keeps (a full one when the worker starts).
    reprefill_burst_tokens: int = 8_192
    #: Also hand back demoted runs (claimed from the waiting lane but past its bound), not
    #: only runs claimed from a later lane, so a mispredicted long answer stops holding a slot
    #: the short lane needs during a peak. Off by default: with a predictor that ranks well it
    #: lifts the short-request tail, but without one it is least-attained-service scheduling,
    #: and it multiplies the long tail (benchmarks/RESULTS.md, "Stop 22").
    hand_back_demoted: bool = False

    def __post_init__(self) -> None:
        if self.max_preemptions < 0 or self.min_remaining_tokens < 0:
            raise ValueError("max_preemptions and min_remaining_tokens must be >= 0")
        if not 0.0 <= self.prompt_cached_share <= 1.0:
            raise ValueError("prompt_cached_share must be in [0, 1]")
        if not (self.max_reprefill_share >= 0.0 and self.reprefill_burst_tokens >= 0):  # also refuses NaN
            raise ValueError("max_reprefill_share and reprefill_burst_tokens must be >= 0")


def reprefill_tokens(prompt_tokens: int, generated_tokens: int, prompt_cached_share: float = 0.0) -> int:
    """Tokens the resumed attempt prefills: the prompt (less its cached share) plus the answer so far."""
    return round(prompt_tokens * (1.0 - prompt_cached_share)) + generated_tokens


def hand_back_cost(run: RunView, config: PreemptionConfig) -> int:
    """What handing ``run`` back spends of the re-prefill budget: its resume's re-prefill."""
    return reprefill_tokens(run.prompt_tokens, run.generated_tokens, config.prompt_cached_share)


def earn_reprefill_budget(budget_tokens: float, generated_tokens: float, config: PreemptionConfig) -> float:
    """The budget after the worker generated ``generated_tokens`` more tokens (capped)."""
    return min(float(config.reprefill_burst_tokens), budget_tokens + config.max_reprefill_share * generated_tokens)


@dataclass
class ReprefillBudget:
    """One worker's re-prefill budget (the token bucket of the module docstring), full at start;
    it earns from the worker's running count of generated tokens."""

    tokens: float
    #: The worker's generated-token count when it last earned.
    earned_at: float = 0.0

    @classmethod
    def full(cls, config: PreemptionConfig) -> ReprefillBudget:
        return cls(float(config.reprefill_burst_tokens))

    def earn(self, generated_total: float, config: PreemptionConfig) -> float:
        """Earn for the tokens generated since the last call; returns the budget now."""
        self.tokens = earn_reprefill_budget(self.tokens, generated_total - self.earned_at, config)
        self.earned_at = generated_total
        return self.tokens

    def spend(self, run: RunView, config: PreemptionConfig) -> None:
        """A hand-back of ``run``: its re-prefill leaves the budget (into debt, when it was full)."""
        self.tokens -= hand_back_cost(run, config)


def expected_remaining_tokens(run: RunView) -> int:
    """Tokens the run will still generate, as far as the worker can tell (>= 1).

    What the prediction leaves, or as many as it has generated once it has outlived the
    prediction (heavy-tailed lengths: the longer an answer has run, the longer it is likely
    to run), capped by ``max_tokens``.
    """
    guess = max(run.predicted_tokens, 2 * run.generated_tokens) - run.generated_tokens
    return max(1, min(guess, run.max_tokens - run.generated_tokens))


def requeue_lane(run: RunView, config: PreemptionConfig) -> Lane:
    """The lane a handed-back request goes to: its effective lane."""
    return effective_lane(run.lane, run.generated_tokens, config.demotion)


def _near_its_end(run: RunView, min_remaining_tokens: int) -> bool:
    """Within ``min_remaining_tokens`` of its ``max_tokens``, or of the end its prediction
    gives (clients' ``max_tokens`` are rarely near an answer's end; the simulator's are 4,096)."""
    return (run.max_tokens - run.generated_tokens <= min_remaining_tokens
            or 0 < run.predicted_tokens - run.generated_tokens <= min_remaining_tokens)


def _cost_ratio(run: RunView, waiting_before: int, now_ms: float, budget_tokens: float,
                config: PreemptionConfig) -> float | None:
    """Re-prefill tokens per token of slot time freed, or None when the run is no candidate."""
    lane = requeue_lane(run, config) if config.hand_back_demoted else run.lane
    if (LANE_ORDER.index(lane) <= waiting_before
            or run.num_preemptions >= config.max_preemptions
            or now_ms - run.started_at_ms < config.min_run_ms
            or _near_its_end(run, config.min_remaining_tokens)):
        return None
    cost = hand_back_cost(run, config)
    # A full budget pays for any one hand-back, into debt: a run dearer than the burst (a prompt
    # of 9 k tokens) could otherwise never be handed back, however long the short lane waits.
    if cost > budget_tokens and not budget_tokens >= config.reprefill_burst_tokens > 0:
        return None
    ratio = cost / expected_remaining_tokens(run)
    return ratio if ratio <= config.max_cost_ratio else None


def choose_preemption(
    runs: Sequence[RunView],
    oldest_wait_ms: Mapping[Lane, float],
    now_ms: float,
    last_preemption_ms: float,
    config: PreemptionConfig,
    budget_tokens: float,
) -> str | None:
    """The id of the run to hand back now, or None (the contract is in the module docstring).

    ``oldest_wait_ms`` holds the age of each non-empty lane's oldest request;
    ``last_preemption_ms`` is when this worker last handed one back (``NEVER_MS`` if never);
    ``budget_tokens`` is the worker's re-prefill budget (``earn_reprefill_budget``).
    Deterministic: ties go to the smallest id.
    """
    if now_ms - last_preemption_ms < config.min_interval_ms:
        return None
    overdue = [LANE_ORDER.index(lane) for lane, age in oldest_wait_ms.items() if age >= config.wait_bound_ms]
    if not overdue:
        return None
    first = min(overdue)
    best: tuple[float, str] | None = None
    for run in runs:
        ratio = _cost_ratio(run, first, now_ms, budget_tokens, config)
        if ratio is not None and (best is None or (ratio, run.id) < best):
            best = (ratio, run.id)
    return None if best is None else best[1]
