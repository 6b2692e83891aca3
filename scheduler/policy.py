"""Pure scheduling policy: lane choice, slot reservation, engine priority.

No I/O, no clock, no environment: every input is an argument, so the same code runs in
the edge, the workers, the unit tests and the trace simulator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lanes.queue.messages import Lane

LANE_ORDER: tuple[Lane, ...] = (Lane.SHORT, Lane.MEDIUM, Lane.LONG)


@dataclass(frozen=True)
class LaneThresholds:
    """Predicted output tokens at or below ``short_max_tokens`` go short, above
    ``medium_max_tokens`` go long, the rest medium."""

    short_max_tokens: int = 128
    medium_max_tokens: int = 512


def choose_lane(predicted_tokens: int, thresholds: LaneThresholds) -> Lane:
    """Map a predicted output length (tokens) to a lane."""
    if predicted_tokens <= thresholds.short_max_tokens:
        return Lane.SHORT
    if predicted_tokens <= thresholds.medium_max_tokens:
        return Lane.MEDIUM
    return Lane.LONG


@dataclass(frozen=True)
class SlotConfig:
    """How a worker's ``max_slots`` concurrent requests are shared among lanes.

    ``max_long`` caps long-lane requests (the rest stay free for short/medium ones);
    ``max_medium_long`` caps medium + long together, so ``max_slots - max_medium_long``
    slots are reserved for the short lane.
    """

    max_slots: int = 8
    max_long: int = 4
    max_medium_long: int = 6


def eligible_lanes(running: Mapping[Lane, int], config: SlotConfig) -> tuple[Lane, ...]:
    """Lanes a worker may pop from now, in priority order (empty when full).

    ``running`` counts this worker's running requests per lane.
    """
    total = sum(running.get(lane, 0) for lane in LANE_ORDER)
    if total >= config.max_slots:
        return ()
    medium_long = running.get(Lane.MEDIUM, 0) + running.get(Lane.LONG, 0)
    lanes = [Lane.SHORT]
    if medium_long < config.max_medium_long:
        lanes.append(Lane.MEDIUM)
        if running.get(Lane.LONG, 0) < config.max_long:
            lanes.append(Lane.LONG)
    return tuple(lanes)


def vllm_priority(lane: Lane) -> int:
    """vLLM serves lower integers first (``scheduling_policy="priority"``)."""
    return LANE_ORDER.index(lane)


def trtllm_priority(lane: Lane) -> float:
    """TensorRT-LLM takes a float in [0, 1], higher first (default 0.5)."""
    return {Lane.SHORT: 1.0, Lane.MEDIUM: 0.5, Lane.LONG: 0.0}[lane]
