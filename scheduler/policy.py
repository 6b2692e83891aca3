"""Pure scheduling policy: lane choice and its thresholds, slot reservation, anti-starvation,
demotion by attained service, engine priority.

No I/O, no clock, no environment: every input is an argument, so the same code runs in
the edge, the workers, the unit tests and the trace simulator.

Demotion (the worker's contract). A running request counts against the slots of
``effective_lane(run.lane, run.generated_tokens, bounds)``, not of the lane it was claimed
from: once it has generated more tokens than its lane's bound (``lane_bound_tokens``) it
counts against the next lane, so a mispredicted long answer stops holding short-lane
capacity, and a worker over its long cap stops claiming long requests. The worker passes
``running_by_lane(((run.lane, run.generated_tokens) for run in runs), bounds)`` to
``lanes_to_pop`` instead of counting claimed lanes. ``generated_tokens`` counts every token
streamed for the request, earlier attempts included (a resumed request keeps its class).
Preemption is in ``preemption.py``, the policy switch (fcfs | lanes) in ``live_policy.py``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
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


#: A lane bound no prediction reaches (an empty lane).
NO_BOUND_TOKENS = 2**62


def thresholds_from_shares(predicted_tokens: Sequence[float], short_share: float, long_share: float) -> LaneThresholds:
    """Thresholds that route about ``short_share`` of these predictions to the short lane (the
    lowest) and ``long_share`` to the long lane (the highest); a share of 0 leaves that lane
    empty. Uses predictions only, never true lengths, so an edge can fit it on recent traffic.
    """
    if not 0.0 <= short_share <= 1.0 or not 0.0 <= long_share <= 1.0 - short_share:
        raise ValueError("shares must be in [0, 1] and add up to at most 1")
    ordered = sorted(predicted_tokens)
    assert ordered, "need predictions"

    def below(share: float) -> int:  # the value at or below which ``share`` of predictions lie
        return math.floor(ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))])

    short_max = below(short_share) if short_share > 0 else -1
    medium_max = below(1.0 - long_share) if long_share > 0 else NO_BOUND_TOKENS
    return LaneThresholds(short_max_tokens=short_max, medium_max_tokens=max(short_max, medium_max))


def long_threshold_from_observations(predicted_tokens: Sequence[float], observed_tokens: Sequence[int],
                                     short_max_tokens: int, max_short_to_long: float) -> int:
    """The lowest prediction threshold that sends at most ``max_short_to_long`` of the observed
    short requests (true length <= ``short_max_tokens``) above it, from pairs of (prediction,
    true length) of finished requests. A predictor without skill gets a threshold near its
    highest predictions, so the long lane stays nearly empty: lanes fall back towards one lane.
    ``NO_BOUND_TOKENS`` when there are no short observations.
    """
    if len(predicted_tokens) != len(observed_tokens):
        raise ValueError("need one prediction per observation")
    shorts = sorted(p for p, t in zip(predicted_tokens, observed_tokens, strict=True) if t <= short_max_tokens)
    if not shorts:
        return NO_BOUND_TOKENS
    allowed = math.floor(max_short_to_long * len(shorts))  # shorts that may lie above the threshold
    if allowed >= len(shorts):  # all of them (a budget of 1): below the lowest (the index wrapped to the highest)
        return math.floor(shorts[0]) - 1
    return math.floor(shorts[len(shorts) - 1 - allowed])


@dataclass(frozen=True)
class RoutingCalibration:
    """How routing thresholds are fitted on (prediction, true length) pairs of finished requests.

    "Short" is a true length at or below the observed ``short_quantile``; at most
    ``max_short_to_long`` of those may be routed to the long lane. Below ``min_shorts`` short
    observations the budget cannot be measured (one misroute in 200 is 0.5 %), and no
    thresholds are fitted.

    A second, looser budget looks further back: at most ``max_window_short_to_long`` of the
    answers shorter than the ``short_quantile`` of a longer window (the whole refit window, when
    the caller passes it) may go long. After traffic drifts to shorter answers the newest median
    has fallen below the window's, and the first budget no longer covers answers in between;
    the second keeps most of them out of the long lane, where they would wait minutes
    (benchmarks/RESULTS.md, "Stop 23"). 1.0 turns it off.
    """

    max_short_to_long: float = 0.005
    short_quantile: float = 0.5
    min_shorts: int = 200
    max_window_short_to_long: float = 0.025


def _lower_quantile(values: Sequence[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[math.floor(q * (len(ordered) - 1))]  # numpy's "lower" quantile


def routing_from_observations(predicted_tokens: Sequence[float], observed_tokens: Sequence[int],
                              calibration: RoutingCalibration = RoutingCalibration(),
                              window_tokens: Sequence[int] = ()) -> LaneThresholds | None:
    """Two-lane routing fitted on finished requests: predictions at or below the long threshold
    (``long_threshold_from_observations``) go short, the rest long; None when fewer than
    ``calibration.min_shorts`` observations are short. The predictions must come from the model
    the thresholds will route for, on prompts it was not fitted on (in-sample predictions of
    short answers sit lower than live ones, and the threshold would send more short requests long).

    ``window_tokens``: the true lengths of a longer window the observations end (the refit's
    whole window); the threshold then also sends at most ``calibration.max_window_short_to_long``
    of the answers shorter than that window's short quantile long (never lower than the first
    budget's threshold).
    """
    if len(predicted_tokens) != len(observed_tokens):
        raise ValueError("need one prediction per observation")
    if not observed_tokens:
        return None
    short_tokens = _lower_quantile(observed_tokens, calibration.short_quantile)
    if sum(t <= short_tokens for t in observed_tokens) < calibration.min_shorts:
        return None
    long_above = long_threshold_from_observations(predicted_tokens, observed_tokens, short_tokens,
                                                  calibration.max_short_to_long)
    if window_tokens and calibration.max_window_short_to_long < 1.0:
        # Strictly below the window's quantile: where many answers tie at it (a gap in the
        # lengths there), "at or below" would take in the whole upper mode.
        window_short = _lower_quantile(window_tokens, calibration.short_quantile) - 1
        if any(t <= window_short for t in observed_tokens):  # else nothing to hold
            long_above = max(long_above, long_threshold_from_observations(
                predicted_tokens, observed_tokens, window_short, calibration.max_window_short_to_long))
    return LaneThresholds(short_max_tokens=long_above, medium_max_tokens=long_above)


def lane_bound_tokens(lane: Lane, bounds: LaneThresholds) -> float:
    """Most tokens a request may generate and still count against ``lane`` (inf for LONG)."""
    if lane is Lane.SHORT:
        return bounds.short_max_tokens
    return bounds.medium_max_tokens if lane is Lane.MEDIUM else math.inf


def effective_lane(lane: Lane, generated_tokens: int, bounds: LaneThresholds) -> Lane:
    """The lane whose slots a running request claimed from ``lane`` counts against.

    Its own lane until it has generated more than that lane's bound, then the lane its
    attained service alone would choose (``choose_lane(generated_tokens, bounds)``); never an
    earlier lane than ``lane``: demotion only moves down.
    """
    attained = choose_lane(generated_tokens, bounds)
    return attained if LANE_ORDER.index(attained) > LANE_ORDER.index(lane) else lane


def running_by_lane(runs: Iterable[tuple[Lane, int]], bounds: LaneThresholds | None) -> dict[Lane, int]:
    """Running requests per effective lane, from ``(claimed lane, generated tokens)`` pairs.

    ``bounds`` None turns demotion off (requests count against the lane they came from).
    """
    if bounds is None:
        return dict(Counter(lane for lane, _ in runs))
    return dict(Counter(effective_lane(lane, generated, bounds) for lane, generated in runs))


def _normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def short_to_long_rate(short_tokens: Sequence[int], log_sigma: float, long_above_tokens: float) -> float:
    """Share of truly short requests a predictor ``pred = true * exp(N(0, log_sigma^2))``
    sends above ``long_above_tokens`` (the short->long misroute rate)."""
    if not short_tokens:
        return 0.0
    if log_sigma <= 0.0:
        return sum(t > long_above_tokens for t in short_tokens) / len(short_tokens)
    total = sum(_normal_sf(math.log(long_above_tokens / max(t, 1)) / log_sigma) for t in short_tokens)
    return total / len(short_tokens)


def _threshold_for_rate(shorts: Sequence[int], log_sigma: float, max_rate: float, floor_tokens: int) -> int:
    """Lowest threshold >= ``floor_tokens`` that at most ``max_rate`` of ``shorts`` exceed."""
    lo, hi = math.log(floor_tokens), math.log(floor_tokens) + 8.0 * max(log_sigma, 0.01)
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if short_to_long_rate(shorts, log_sigma, math.exp(mid)) > max_rate else (lo, mid)
    return math.ceil(math.exp(hi))


def thresholds_from_error(
    observed_tokens: Sequence[int],
    log_sigma: float,
    max_short_to_long: float = 0.005,
    max_short_to_medium: float = 1.0,
    short_quantile: float = 0.5,
) -> LaneThresholds:
    """Lane thresholds for a predictor whose log-space error has std ``log_sigma``.

    ``observed_tokens`` are recent true output lengths; "short" means at or below their
    ``short_quantile``. Each threshold is the lowest one (found by bisection in log space)
    that sends at most the given share of short requests past it: few short requests in
    the long lane is what keeps the short-request tail low, and fewer in the medium lane
    keeps them clear of the medium lane's backlog under overload. The default
    ``max_short_to_medium`` of 1.0 puts the short threshold at the short quantile itself;
    ``max_short_to_medium <= max_short_to_long`` leaves the medium lane empty (two lanes).
    """
    ordered = sorted(observed_tokens)
    assert ordered, "need observed lengths"
    short_max = ordered[min(len(ordered) - 1, int(short_quantile * len(ordered)))]
    shorts = [t for t in ordered if t <= short_max]
    long_above = _threshold_for_rate(shorts, log_sigma, max_short_to_long, short_max)
    short_lane_max = short_max
    if max_short_to_medium < 1.0:
        short_lane_max = _threshold_for_rate(shorts, log_sigma, max_short_to_medium, short_max)
    return LaneThresholds(short_max_tokens=min(short_lane_max, long_above), medium_max_tokens=long_above)


@dataclass(frozen=True)
class SlotConfig:
    """How a worker's ``max_slots`` concurrent requests are shared among lanes.

    ``max_long`` caps long-lane requests (the rest stay free for short/medium ones);
    ``max_medium_long`` caps medium + long together, so ``max_slots - max_medium_long``
    slots are reserved for the short lane. The guaranteed shares keep the lower lanes
    from starving: once a lane's oldest request has waited ``starve_after_ms``, that lane
    is popped first until it runs ``min_<lane>`` requests, caps notwithstanding.
    """

    max_slots: int = 8
    max_long: int = 4
    max_medium_long: int = 6
    #: Slots the medium lane may claim ahead of the short lane once it starves.
    min_medium: int = 0
    #: Slots the long lane may claim ahead of shorter lanes once it starves.
    min_long: int = 0
    #: How long a lane's oldest request waits before its guaranteed share applies.
    starve_after_ms: float = 60_000.0
    #: Load-aware bound: a starving lane does not jump a lane ahead of it whose oldest request
    #: has itself waited this long (under overload the shorter lanes keep a bounded wait).
    protect_after_ms: float = math.inf
    #: Let long requests use the reserved slots while the short and medium lanes are empty.
    borrow_when_idle: bool = False
    #: Priority only under load: while the short lane's oldest request has waited less than
    #: this, the lanes are popped oldest-first (FCFS across lanes: at light load reordering
    #: only costs the later lanes). 0 (the default): always by priority.
    fcfs_below_ms: float = 0.0
    #: Lanes only where output length is what requests cost: while the engine's prefill share
    #: of its work (``workmix.WorkMix``, passed to ``lanes_to_pop``) is at least this, the lanes
    #: step aside (FCFS, open slots, no hand-backs: prompt-heavy traffic gains nothing from
    #: jumping long answers). 1.0 or more (the default): never.
    fcfs_above_prefill_share: float = 1.0
    #: Wait bound: a lane whose oldest request has waited this long is popped first (the
    #: longest-waiting such lane first), caps, guarantees and priorities notwithstanding, so no
    #: request waits without bound behind a stream of shorter ones. inf (the default): no bound.
    max_wait_ms: float = math.inf

    def __post_init__(self) -> None:
        # Caps above max_slots are allowed (they just never bind): workers pass them as set.
        if min(self.max_slots, self.max_long, self.max_medium_long) < 0:
            raise ValueError("slot counts must be >= 0")
        if self.min_medium < 0 or self.min_long < 0 or self.min_medium + self.min_long > self.max_slots:
            raise ValueError("guaranteed shares must be >= 0 and fit in max_slots")
        if not self.fcfs_above_prefill_share >= 0.0:
            raise ValueError("fcfs_above_prefill_share must be >= 0 (1 or more: never)")


def lanes_never_served(config: SlotConfig) -> tuple[Lane, ...]:
    """Lanes a worker with ``config`` never pops on decode-heavy traffic: capped at 0 slots, with
    no guaranteed share, no wait bound and no borrowing of idle slots. Fine for a worker meant to
    leave them to others (short-only workers); a fleet where every worker is so never serves them
    (the simulator stopped with "backlog can never be popped")."""
    if config.max_wait_ms < math.inf or config.borrow_when_idle:
        return ()
    caps = ((Lane.MEDIUM, config.max_medium_long, config.min_medium),
            (Lane.LONG, min(config.max_long, config.max_medium_long), config.min_long))
    return tuple(lane for lane, cap, share in caps if cap == 0 and share == 0)


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


def lanes_to_pop(
    running: Mapping[Lane, int],
    oldest_wait_ms: Mapping[Lane, float],
    config: SlotConfig,
    prefill_share: float = 0.0,
) -> tuple[Lane, ...]:
    """Lanes to pop from now, in order: the worker takes the first non-empty one.

    ``running`` counts this worker's running requests per lane; ``oldest_wait_ms`` holds
    the age of each lane's oldest waiting request (a missing lane is empty). Lanes whose oldest
    request has waited ``max_wait_ms`` come first, longest-waiting first. Then starving lanes
    below their guaranteed share come first, longest-waiting first, unless a lane ahead has
    waited ``protect_after_ms`` itself; then the capped
    priority order of ``eligible_lanes`` (oldest lane first instead while the short lane's
    oldest request has waited less than ``fcfs_below_ms``); then, with ``borrow_when_idle``,
    lanes over their cap when every lane ahead of them is empty (so slots never idle needlessly).

    While ``prefill_heavy(prefill_share, config)`` (prompts are most of the engine's work, so an
    answer's length is not what a request costs) the lanes step aside: every lane, oldest first,
    no caps, no guarantees: FCFS. ``prefill_share`` comes from ``workmix.WorkMix``.
    """
    if sum(running.get(lane, 0) for lane in LANE_ORDER) >= config.max_slots:
        return ()
    if prefill_heavy(prefill_share, config):  # lanes step aside: oldest first, no caps
        return tuple(sorted(LANE_ORDER, key=lambda lane: -oldest_wait_ms.get(lane, -math.inf)))
    shares = {Lane.MEDIUM: config.min_medium, Lane.LONG: config.min_long}
    starving = [
        lane
        for lane, share in shares.items()
        if running.get(lane, 0) < share
        and oldest_wait_ms.get(lane, -1.0) >= config.starve_after_ms
        # An empty lane ahead has nobody to protect (at protect_after_ms 0 it blocked every guarantee).
        and all(oldest_wait_ms.get(a, -math.inf) < config.protect_after_ms for a in LANE_ORDER[: LANE_ORDER.index(lane)])
    ]
    starving.sort(key=lambda lane: -oldest_wait_ms[lane])
    eligible = [lane for lane in eligible_lanes(running, config) if lane not in starving]
    if oldest_wait_ms.get(Lane.SHORT, 0.0) < config.fcfs_below_ms:  # light load: oldest lane first
        eligible.sort(key=lambda lane: -oldest_wait_ms.get(lane, -math.inf))
    order = starving + eligible
    overdue = sorted((lane for lane in LANE_ORDER if oldest_wait_ms.get(lane, -1.0) >= config.max_wait_ms),
                     key=lambda lane: -oldest_wait_ms[lane])
    if overdue:
        order = overdue + [lane for lane in order if lane not in overdue]
    if config.borrow_when_idle:
        for lane in LANE_ORDER:
            ahead = LANE_ORDER[: LANE_ORDER.index(lane)]
            if lane not in order and not any(a in oldest_wait_ms for a in ahead):
                order.append(lane)
    return tuple(order)


def prefill_heavy(prefill_share: float, config: SlotConfig) -> bool:
    """Whether prompts are so much of the engine's work that the lanes step aside (FCFS, no
    hand-backs): ``prefill_share`` (``workmix``) at least ``config.fcfs_above_prefill_share``,
    when that is below 1 (1 or more: never)."""
    return config.fcfs_above_prefill_share < 1.0 and prefill_share >= config.fcfs_above_prefill_share


def vllm_priority(lane: Lane) -> int:
    """vLLM serves lower integers first (``scheduling_policy="priority"``)."""
    return LANE_ORDER.index(lane)


def trtllm_priority(lane: Lane) -> float:
    """TensorRT-LLM takes a float in [0, 1], higher first (default 0.5)."""
    return {Lane.SHORT: 1.0, Lane.MEDIUM: 0.5, Lane.LONG: 0.0}[lane]
