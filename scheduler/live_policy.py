"""The policy switch of the live system: ``LANES_POLICY=fcfs`` or ``lanes``, one enum and a factory.

``make_live_policy(name, ...)`` returns a ``LivePolicy`` with everything the edge and the
workers decide by policy (pure: settings are arguments):

- ``lane_for(predicted_tokens)``: the lane an edge enqueues into;
- ``slots``: the ``SlotConfig`` a worker passes to ``policy.lanes_to_pop``;
- ``running_by_lane(runs)``: a worker's running requests per lane, with demotion applied
  (``runs`` are ``(claimed lane, generated tokens)`` pairs);
- ``preemption``: the ``PreemptionConfig`` for ``preemption.choose_preemption``, or None.

``fcfs`` is a real baseline: one lane (medium), unrestricted slots, no demotion, no
preemption; every edge and worker of a deployment must run the same policy. ``lanes`` is
length-aware lanes with slot reservation, demotion by attained service and (if configured)
hand-back preemption; its defaults are the tuned ones of benchmarks/RESULTS.md (issue 9).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from lanes.queue.messages import Lane
from lanes.scheduler.policy import LaneThresholds, SlotConfig, choose_lane, running_by_lane
from lanes.scheduler.preemption import PreemptionConfig

#: The edges' lane thresholds until a refreshed predictor ships its own (``LANES_SHORT_MAX_TOKENS``,
#: ``LANES_MEDIUM_MAX_TOKENS``; chosen for the shipped predictor in benchmarks/RESULTS.md, "Length
#: predictor (issue 9)": ~12 % short, ~2 % long, 0.9 % of truly short answers routed long).
DEFAULT_ROUTING = LaneThresholds(short_max_tokens=150, medium_max_tokens=750)
#: Demotion bounds the simulator tuned (generated tokens; short goes straight to long).
DEFAULT_DEMOTION = LaneThresholds(short_max_tokens=200, medium_max_tokens=200)
#: Hand-back defaults the simulator tuned: a safety valve for long-lane runs only (see RESULTS.md).
DEFAULT_PREEMPTION = PreemptionConfig(demotion=DEFAULT_DEMOTION)
#: Slot sharing for ``lanes``, one set for the workers (``WorkerSettings.slots``) and the simulator
#: (``lanes_slot_config``; tuned there, RESULTS.md): long-lane runs hold at most MAX_LONG_SHARE
#: of the slots and medium + long at most MAX_MEDIUM_LONG_SHARE (the rest is kept for the short
#: lane: short requests arriving behind a burst of long ones start at once); the long lane is
#: guaranteed MIN_LONG_SHARE once its oldest request waited STARVE_AFTER_MS; FCFS across lanes
#: until the short lane's oldest waited FCFS_BELOW_MS, and while prompts are most of the engine's
#: work (PREFILL_HEAVY_SHARE); any lane first once its oldest waited
#: MAX_WAIT_MS (10 minutes: bounds what a weak predictor defers, costs nothing at tau >= 0.7).
MAX_LONG_SHARE = 0.75
#: 95 %: one slot kept for the short lane up to 20 slots, 4 of 64. It was 87.5 % (8 of 64) until
#: stop 26; that throttled the medium lane, which holds most requests, at moderate load and cost
#: long requests up to 5 % on their TTFT P99 at rho 0.73 (RESULTS.md, "Stop 26").
MAX_MEDIUM_LONG_SHARE = 0.95
MIN_LONG_SHARE = 0.1
STARVE_AFTER_MS = 20_000.0
FCFS_BELOW_MS = 8_000.0
#: The same bound for engines that chunk prefill (vLLM V1, TensorRT-LLM with
#: ``enable_chunked_prefill``, as the ``vllm`` and ``trtllm`` workers run them): there FCFS itself
#: is better at the peaks and 4 s held rho 0.73 (worst 1.027 over six runs) while raising the rho
#: 0.88 short gain by 1.2-1.3x at the median (RESULTS.md, "Stop 33"). 8 s stays for engines that alternate
#: prefill and decode iterations (``hf``, ``sim``), where 3-5 s broke rho 0.73 (RESULTS.md, "Stop 25").
FCFS_BELOW_MS_CHUNKED = 4_000.0
MAX_WAIT_MS = 600_000.0
#: Lanes pop oldest-first while the engine's prefill share of its work is at least this
#: (``SlotConfig.fcfs_above_prefill_share``, ``workmix``): over every 1,000 consecutive requests
#: Azure conv stays at 0.22-0.50, Azure code at 0.83-0.88, Mooncake at 0.72-0.78 (RESULTS.md, "Stop 25").
PREFILL_HEAVY_SHARE = 0.6
#: Prompt tokens' worth of prefill one decoded token costs, for the share's estimate when the
#: deployment does not say (``LANES_DECODE_TOKEN_COST``): Llama-70B on H100s at 64 requests
#: (``costmodel.get_profile("l70-h100").decode_token_cost(64)`` = 11.7).
DECODE_TOKEN_COST = 12.0
#: Tokens per engine step (``max_num_batched_tokens``): what the ``vllm`` and ``trtllm`` workers
#: pass with chunked prefill on (``LANES_MAX_NUM_BATCHED_TOKENS``), and the step budget the
#: simulator models by default (``lanes bench policy --chunked-prefill-tokens``).
MAX_NUM_BATCHED_TOKENS = 2048


class PolicyName(str, enum.Enum):
    """``LANES_POLICY`` values."""

    FCFS = "fcfs"
    LANES = "lanes"


@dataclass(frozen=True)
class LivePolicy:
    name: PolicyName
    #: Edge routing (predicted tokens -> lane); None: everything goes to ``Lane.MEDIUM``.
    routing: LaneThresholds | None
    slots: SlotConfig
    #: Demotion bounds (generated tokens); None: runs count against the lane they came from.
    demotion: LaneThresholds | None
    preemption: PreemptionConfig | None

    def lane_for(self, predicted_tokens: int) -> Lane:
        return Lane.MEDIUM if self.routing is None else choose_lane(predicted_tokens, self.routing)

    def running_by_lane(self, runs: Iterable[tuple[Lane, int]]) -> dict[Lane, int]:
        return running_by_lane(runs, self.demotion)


def make_live_policy(
    name: PolicyName | str,
    routing: LaneThresholds,
    slots: SlotConfig,
    *,
    demotion: LaneThresholds | None = DEFAULT_DEMOTION,
    preemption: PreemptionConfig | None = DEFAULT_PREEMPTION,
) -> LivePolicy:
    """The policy called ``name``; raises ``ValueError`` naming the known ones.

    ``routing`` and ``slots`` are the deployment's settings (edge thresholds, worker slots);
    ``fcfs`` ignores them except ``slots.max_slots``. The preemption config is given the
    demotion bounds, so both sides classify runs alike.
    """
    try:
        policy = PolicyName(name)
    except ValueError:
        known = ", ".join(p.value for p in PolicyName)
        raise ValueError(f"unknown policy {name!r}; known: {known}") from None
    if policy is PolicyName.FCFS:
        open_slots = SlotConfig(max_slots=slots.max_slots, max_long=slots.max_slots, max_medium_long=slots.max_slots)
        return LivePolicy(policy, None, open_slots, None, None)
    if preemption is not None and demotion is not None:
        preemption = replace(preemption, demotion=demotion)
    return LivePolicy(policy, routing, slots, demotion, preemption)


def fcfs_below_ms_for(chunked_prefill: bool) -> float:
    """The default ``fcfs_below_ms`` for an engine that chunks prefill or one that does not."""
    return FCFS_BELOW_MS_CHUNKED if chunked_prefill else FCFS_BELOW_MS


def share_of_slots(share: float, max_slots: int) -> int:
    """``share`` of ``max_slots`` as a slot count, rounded down but at least one slot for a
    share above 0 (so a one-slot engine still runs every lane and guarantees the long one)."""
    return 0 if share <= 0 else max(1, math.floor(share * max_slots + 1e-9))


def wait_bound_ms(setting_ms: float) -> float:
    """A wait bound as users set it (``LANES_MAX_WAIT_MS``, ``--max-wait-s``: 0 = no bound) as
    ``SlotConfig.max_wait_ms`` takes it (inf = no bound)."""
    return setting_ms if setting_ms > 0 else math.inf


def lanes_slot_config(max_slots: int, *, max_long_share: float = MAX_LONG_SHARE,
                      max_medium_long_share: float = MAX_MEDIUM_LONG_SHARE, min_long_share: float = MIN_LONG_SHARE,
                      starve_after_ms: float = STARVE_AFTER_MS, protect_after_ms: float = math.inf,
                      borrow_when_idle: bool = False, fcfs_below_ms: float = FCFS_BELOW_MS,
                      max_wait_ms: float = MAX_WAIT_MS,
                      fcfs_above_prefill_share: float = PREFILL_HEAVY_SHARE) -> SlotConfig:
    """The ``lanes`` slot config for a worker with ``max_slots`` slots (the workers' defaults and
    the simulator's, see the constants above): long requests capped at ``max_long_share`` of the
    slots and medium + long at ``max_medium_long_share`` (unless ``borrow_when_idle`` and no shorter
    request waits), the long lane guaranteed ``min_long_share`` of the slots once its oldest
    request waited ``starve_after_ms`` (unless the short lane's has waited ``protect_after_ms``),
    priority only while the short lane's oldest request has waited ``fcfs_below_ms`` and the
    engine's prefill share of its work is below ``fcfs_above_prefill_share``, and any lane
    first once its oldest request has waited ``max_wait_ms`` (inf: no bound)."""
    return SlotConfig(max_slots=max_slots, max_long=share_of_slots(max_long_share, max_slots),
                      max_medium_long=share_of_slots(max_medium_long_share, max_slots),
                      min_long=min(share_of_slots(min_long_share, max_slots), max_slots),
                      starve_after_ms=starve_after_ms, protect_after_ms=protect_after_ms,
                      borrow_when_idle=borrow_when_idle, fcfs_below_ms=fcfs_below_ms, max_wait_ms=max_wait_ms,
                      fcfs_above_prefill_share=fcfs_above_prefill_share)
