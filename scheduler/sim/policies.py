"""The scheduling policies the simulator compares, built by name (one small factory).

A policy is data: the lane each request is routed to, the order within a lane, the slot
config, the demotion bounds and preemption config of the lanes path, or the MLFQ config.
Predicted lengths come from outside (``predictions.py``: the shipped predictor on paired
prompts, the noise model, or random), so every policy sees the same predictions.

- ``fcfs``: one lane, unrestricted slots (vLLM's default order).
- ``lanes``: what ``LANES_POLICY=lanes`` runs: lanes by predicted length, slot reservation,
  demotion by attained service and limited hand-back preemption.
- ``lanes-static``: the same lanes without demotion and preemption (before issue 9).
- ``priority``: vLLM's ``--scheduling-policy priority`` with ``priority = predicted tokens``
  (shortest predicted first, ties FCFS). vLLM V1 preempts only when KV blocks run out, which
  the cost model does not limit, so nothing is preempted.
- ``mlfq``: FastServe's skip-join MLFQ (no predictor; ``mlfq.py``).
- ``lanes-oracle``, ``oracle-2q``, ``oracle-sjf``: true lengths instead of predictions (bounds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from lanes.queue.messages import Lane
from lanes.scheduler.live_policy import (DEFAULT_DEMOTION, DEFAULT_PREEMPTION, FCFS_BELOW_MS, MAX_LONG_SHARE,
                                         MAX_MEDIUM_LONG_SHARE, MAX_WAIT_MS, MIN_LONG_SHARE, PREFILL_HEAVY_SHARE,
                                         STARVE_AFTER_MS, lanes_slot_config)
from lanes.scheduler.policy import (NO_BOUND_TOKENS, LaneThresholds, RoutingCalibration, SlotConfig, choose_lane,
                                    routing_from_observations)
from lanes.scheduler.preemption import PreemptionConfig
from lanes.scheduler.sim.mlfq import MlfqConfig
from lanes.scheduler.sim.trace import Trace

POLICY_NAMES = ("fcfs", "lanes", "lanes-static", "priority", "mlfq", "lanes-oracle", "oracle-2q", "oracle-sjf")
#: max_tokens the simulated requests carry (the traces do not record it).
SIM_MAX_TOKENS = 4096


@dataclass(frozen=True)
class LanesTuning:
    """Knobs of the ``lanes`` policies; the defaults are the ones tuned in benchmarks/RESULTS.md
    (issue 9: Azure conv, L70-H100, noise-model predictors and a random one; 3 seeds)."""

    #: Routing: a request goes to the long lane when its prediction is above the threshold that
    #: sends at most this share of short requests (true length <= the observed
    #: ``short_quantile``) there (``policy.long_threshold_from_observations``)...
    max_short_to_long: float = 0.005
    short_quantile: float = 0.5
    #: ...fitted on the (prediction, true length) pairs of this first share of the trace: the
    #: finished requests a live scheduler would have observed.
    calibration_share: float = 0.2
    #: Demotion bounds in generated tokens (equal bounds: short goes straight to long).
    demotion: LaneThresholds = DEFAULT_DEMOTION
    #: Shares of max_num_seqs that requests counted as long (medium + long) may hold; the rest
    #: is kept for shorter lanes (lent to long requests only with ``borrow_when_idle``).
    max_long_share: float = MAX_LONG_SHARE
    max_medium_long_share: float = MAX_MEDIUM_LONG_SHARE
    borrow_when_idle: bool = False
    #: Share of max_num_seqs the long lane is guaranteed once it starves.
    min_long_share: float = MIN_LONG_SHARE
    starve_after_ms: float = STARVE_AFTER_MS
    protect_after_ms: float = math.inf
    #: ``SlotConfig.fcfs_below_ms``: lanes are popped oldest-first while the short lane waits less
    #: (the v0 engine's default; ``lanes bench policy`` takes ``live_policy.fcfs_below_ms_for`` its engine).
    fcfs_below_ms: float = FCFS_BELOW_MS
    #: ``SlotConfig.max_wait_ms``: a lane whose oldest request has waited this long goes first.
    max_wait_ms: float = MAX_WAIT_MS
    #: ``SlotConfig.fcfs_above_prefill_share``: lanes are popped oldest-first while the
    #: estimated prefill share of the finished requests' work is at least this (1: never).
    fcfs_above_prefill_share: float = PREFILL_HEAVY_SHARE
    preemption: PreemptionConfig = DEFAULT_PREEMPTION
    max_tokens: int = SIM_MAX_TOKENS


@dataclass(frozen=True)
class SimPolicy:
    name: str
    lane_of: list[Lane]
    slot_config: SlotConfig
    queue_key: np.ndarray | None = None
    #: Demotion bounds (None: runs count against the lane they were popped from).
    demotion: LaneThresholds | None = None
    preemption: PreemptionConfig | None = None
    mlfq: MlfqConfig | None = None
    #: What the lanes path tells ``choose_preemption`` (None: the true lengths).
    predicted_tokens: np.ndarray | None = None
    #: Predictor time charged to each request's queueing (ms; one value or one per request).
    predictor_ms: np.ndarray | float = 0.0
    max_tokens: int = SIM_MAX_TOKENS
    #: What the policy saw: lane shares, thresholds.
    info: dict[str, float] = field(default_factory=dict)


def open_slots(max_num_seqs: int) -> SlotConfig:
    return SlotConfig(max_slots=max_num_seqs, max_long=max_num_seqs, max_medium_long=max_num_seqs)


def lanes_slots(max_num_seqs: int, tuning: LanesTuning) -> SlotConfig:
    return lanes_slot_config(max_num_seqs, max_long_share=tuning.max_long_share,
                             max_medium_long_share=tuning.max_medium_long_share, min_long_share=tuning.min_long_share,
                             starve_after_ms=tuning.starve_after_ms, protect_after_ms=tuning.protect_after_ms,
                             borrow_when_idle=tuning.borrow_when_idle, fcfs_below_ms=tuning.fcfs_below_ms,
                             max_wait_ms=tuning.max_wait_ms, fcfs_above_prefill_share=tuning.fcfs_above_prefill_share)


def _lanes(name: str, trace: Trace, predicted: np.ndarray, predictor_ms: np.ndarray | float,
           max_num_seqs: int, tuning: LanesTuning, routing: Sequence[LaneThresholds] | None = None) -> SimPolicy:
    rounded = np.rint(predicted)
    info: dict[str, float] = {}
    if routing is None:
        num_seen = max(1, round(tuning.calibration_share * len(trace))) if tuning.calibration_share > 0 else len(trace)
        fitted = routing_from_observations(rounded[:num_seen].tolist(), trace.output_tokens[:num_seen].tolist(),
                                           RoutingCalibration(tuning.max_short_to_long, tuning.short_quantile, 1))
        fitted = fitted or LaneThresholds(NO_BOUND_TOKENS, NO_BOUND_TOKENS)
        info = {"routing_short_max": fitted.short_max_tokens, "routing_medium_max": fitted.medium_max_tokens}
        routing = [fitted] * len(trace)
    lane_of = [choose_lane(int(p), r) for p, r in zip(rounded, routing, strict=True)]
    corrects = name != "lanes-static"
    info.update({f"share_{lane.value}_lane": float(np.mean([x is lane for x in lane_of])) for lane in Lane})
    return SimPolicy(name, lane_of, lanes_slots(max_num_seqs, tuning), demotion=tuning.demotion if corrects else None,
                     preemption=replace(tuning.preemption, demotion=tuning.demotion) if corrects else None,
                     predicted_tokens=predicted, predictor_ms=predictor_ms, max_tokens=tuning.max_tokens, info=info)


def make_policy(name: str, trace: Trace, predicted: np.ndarray, max_num_seqs: int, *,
                predictor_ms: np.ndarray | float = 0.0, tuning: LanesTuning | None = None,
                mlfq: MlfqConfig | None = None,
                routing: Sequence[LaneThresholds] | None = None) -> SimPolicy:
    """Build a policy by name (see ``POLICY_NAMES``); raises ``ValueError`` for others.

    ``predicted`` holds one predicted output length per request (policies that use none
    ignore it); ``predictor_ms`` is charged only to the policies that call the predictor.
    ``routing`` gives the lane thresholds per request when the predictor ships them (the
    refresh in the loop); otherwise ``lanes`` fits them on the trace's first rows.
    """
    tuning = tuning or LanesTuning()
    true = trace.output_tokens.astype(float)
    one_lane = [Lane.MEDIUM] * len(trace)
    if name == "fcfs":
        return SimPolicy(name, one_lane, open_slots(max_num_seqs))
    if name == "priority":
        return SimPolicy(name, one_lane, open_slots(max_num_seqs), queue_key=np.rint(predicted),
                         predictor_ms=predictor_ms)
    if name == "mlfq":
        return SimPolicy(name, one_lane, open_slots(max_num_seqs), mlfq=mlfq or MlfqConfig())
    if name == "oracle-sjf":
        return SimPolicy(name, one_lane, open_slots(max_num_seqs), queue_key=true)
    if name == "oracle-2q":
        split = np.percentile(true, 50)
        return SimPolicy(name, [Lane.SHORT if t <= split else Lane.LONG for t in true], open_slots(max_num_seqs))
    if name in ("lanes", "lanes-static"):
        return _lanes(name, trace, np.asarray(predicted, dtype=float), predictor_ms, max_num_seqs, tuning, routing)
    if name == "lanes-oracle":
        return _lanes(name, trace, true, 0.0, max_num_seqs, tuning)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
