"""Scheduling policies the simulator compares, built by name (a small factory).

Each policy is data: the lane every request goes to, the order within a lane, and the
slot config the workers pass to ``policy.lanes_to_pop``. Predicted lengths come from the
noisy-rank stand-in (``noise.py``), since the traces carry no prompt text.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
from lanes.queue.messages import Lane
from lanes.scheduler.noise import kendall_tau, noisy_predictions, sigma_for_tau
from lanes.scheduler.policy import (
    LaneOrder,
    LaneThresholds,
    SlotConfig,
    choose_lane,
    lane_score_ms,
    thresholds_from_error,
)
from lanes.scheduler.trace import Trace

POLICY_NAMES = ("fcfs", "lanes", "lanes-score", "lanes-oracle", "lanes-naive", "oracle-2q", "oracle-sjf")


@dataclass(frozen=True)
class LanesTuning:
    """Knobs of the ``lanes`` policies (defaults are the ones in benchmarks/RESULTS.md)."""

    #: Kendall tau of the simulated predictor.
    target_tau: float = 0.52
    #: Short requests allowed into the long lane (sets the long threshold).
    max_short_to_long: float = 0.01
    #: Short requests allowed into the medium lane (sets the short threshold); at or below
    #: ``max_short_to_long`` the medium lane stays empty: a noisy predictor sends ~30 % of
    #: short requests to a medium lane split at the median, where overload would hit them.
    max_short_to_medium: float = 0.0
    #: Share of max_num_seqs the long lane may hold when shorter lanes wait.
    max_long_share: float = 1.0
    #: Share of max_num_seqs the long lane is guaranteed once it starves.
    min_long_share: float = 0.25
    starve_after_ms: float = 20_000.0
    protect_after_ms: float = 5_000.0
    #: Predictor latency charged to each request's queueing time.
    predictor_ms: float = 2.0
    #: ``lanes-score`` only: order within a lane by ``policy.lane_score_ms`` with this order.
    lane_order: LaneOrder = LaneOrder(weight=1.0)
    #: ``lanes-score`` only: lane ages from the head's score, as ``QueuePlane.lane_depths``
    #: reads a score-ordered ZSET; False measures them from the oldest request instead.
    age_from_score: bool = True


@dataclass(frozen=True)
class SimPolicy:
    name: str
    lane_of: list[Lane]
    slot_config: SlotConfig
    queue_key: np.ndarray | None = None
    #: Lane ages from the head's key (as Redis reports a score-ordered lane), see ``simulate``.
    age_from_key: bool = False
    predictor_ms: float = 0.0
    #: What the policy saw: predictor tau, thresholds, misroute rate.
    info: dict[str, float] = field(default_factory=dict)


def _open_slots(max_num_seqs: int) -> SlotConfig:
    return SlotConfig(max_slots=max_num_seqs, max_long=max_num_seqs, max_medium_long=max_num_seqs)


def _lanes_policy(name: str, trace: Trace, max_num_seqs: int, seed: int, tuning: LanesTuning,
                  log_sigma: float, reserve: bool) -> SimPolicy:
    true = trace.output_tokens
    predicted = noisy_predictions(true, log_sigma, seed) if log_sigma > 0 else true.astype(float)
    thresholds = thresholds_from_error(true.tolist(), log_sigma, tuning.max_short_to_long,
                                       tuning.max_short_to_medium)
    lane_of = [choose_lane(int(p), thresholds) for p in predicted]
    slots = _open_slots(max_num_seqs)
    if reserve:
        slots = replace(slots, max_long=round(tuning.max_long_share * max_num_seqs),
                        min_long=round(tuning.min_long_share * max_num_seqs),
                        starve_after_ms=tuning.starve_after_ms, protect_after_ms=tuning.protect_after_ms,
                        borrow_when_idle=True)
    queue_key = None
    if name == "lanes-score":  # the edge scores each request once, at enqueue
        enqueue_ms = trace.arrival_s * 1000.0 + tuning.predictor_ms
        scores_ms = [lane_score_ms(t, p, tuning.lane_order) for t, p in zip(enqueue_ms, predicted, strict=True)]
        queue_key = np.array(scores_ms) / 1000.0
    return SimPolicy(name, lane_of, slots, queue_key=queue_key,
                     age_from_key=queue_key is not None and tuning.age_from_score,
                     predictor_ms=tuning.predictor_ms, info=_lane_info(true, predicted, lane_of, thresholds))


def _lane_info(true: np.ndarray, predicted: np.ndarray, lane_of: list[Lane],
               thresholds: LaneThresholds) -> dict[str, float]:
    short = true <= np.percentile(true, 50)
    long = true > np.percentile(true, 90)
    in_long = np.array([lane is Lane.LONG for lane in lane_of])
    in_short = np.array([lane is Lane.SHORT for lane in lane_of])
    return {
        "kendall_tau": kendall_tau(true, predicted),
        "short_max_tokens": thresholds.short_max_tokens,
        "long_above_tokens": thresholds.medium_max_tokens,
        "share_long_lane": float(in_long.mean()),
        "short_to_long_rate": float(in_long[short].mean()),
        "long_to_short_rate": float(in_short[long].mean()),
    }


def make_policy(name: str, trace: Trace, max_num_seqs: int, seed: int = 0,
                tuning: LanesTuning | None = None) -> SimPolicy:
    """Build a policy by name (see ``POLICY_NAMES``); raises ``ValueError`` for others."""
    tuning = tuning or LanesTuning()
    true = trace.output_tokens
    if name == "fcfs":
        return SimPolicy(name, [Lane.MEDIUM] * len(trace), _open_slots(max_num_seqs))
    if name == "oracle-sjf":
        return SimPolicy(name, [Lane.MEDIUM] * len(trace), _open_slots(max_num_seqs), queue_key=true.astype(float))
    if name == "oracle-2q":
        split = np.percentile(true, 50)
        lane_of = [Lane.SHORT if t <= split else Lane.LONG for t in true]
        return SimPolicy(name, lane_of, _open_slots(max_num_seqs))
    if name in ("lanes", "lanes-score", "lanes-naive"):
        sigma = sigma_for_tau(true, tuning.target_tau, seed)
        return _lanes_policy(name, trace, max_num_seqs, seed, tuning, sigma, reserve=name != "lanes-naive")
    if name == "lanes-oracle":
        return _lanes_policy(name, trace, max_num_seqs, seed, tuning, 0.0, reserve=True)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
