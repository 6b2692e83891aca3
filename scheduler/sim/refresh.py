"""The scheduler's predictor refresh in the simulator's loop.

Live, the scheduler refits the predictor every few minutes on the newest finished requests
and ships lane thresholds fitted for the new model with it (``scheduler/refresh.py``,
``train.refit_with_routing``); edges predict and route by the newest version. Here the same
function runs on the trace: at every ``every_s`` of (load-scaled) trace time, the rows that
arrived at least ``finish_delay_s`` earlier count as finished (a stand-in for their end; the
newest ``window`` of them, minus the ones cut by ``max_tokens``), each with its paired prompt and
its true length. Rows arriving after a refresh are predicted by that model and routed by its
thresholds; before the first refresh, the base model and the edges' fixed thresholds.

A prompt pool smaller than the trace is reused, and a refit memorises prompts it has seen: a
row whose prompt was in the window gets its earlier rows' length back, which is recall of the
pairing, not prediction (with 500 prompts over 19,000 rows nearly every row would be "seen").
So the refresh is cross-fitted by prompt (``RefreshConfig.folds``, 2): the distinct prompts are
dealt to folds, each refresh refits one model per fold on the newest ``window`` finished rows
of the *other* folds, and a row is predicted and routed by its own fold's model, which never
saw its prompt. Each model reads as many rows as a live refit, from a span about twice as long.
``folds=1`` is the single refit of the live scheduler, memorisation included (before stop 29);
``RefreshedPredictions.seen_share`` reports how many rows were predicted by a model that had
already observed their prompt (0 when cross-fitted), and ``tau_unseen`` the ranking on the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from lanes.queue.messages import REFRESH_WINDOW, ChatMessage
from lanes.scheduler.live_policy import DEFAULT_ROUTING
from lanes.scheduler.policy import LaneThresholds, RoutingCalibration
from lanes.scheduler.predictor import LengthPredictor
from lanes.scheduler.predictor.train import MEMORY_WEIGHT, Observation, refit_with_routing
from lanes.scheduler.sim.noise import kendall_tau


@dataclass(frozen=True)
class RefreshConfig:
    """The live refresh's settings (``scheduler/service.py``, ``queue/fleet.py``)."""

    every_s: float = 300.0
    #: Newest finished requests a refit reads (``LANES_PREDICTOR_MAX_OBSERVATIONS``).
    window: int = REFRESH_WINDOW
    #: Fewer observations than this: no refit (``refresh_predictor``'s ``min_observations``).
    min_observations: int = 50
    #: A row counts as finished this long after its arrival.
    finish_delay_s: float = 60.0
    calibration: RoutingCalibration = RoutingCalibration()
    #: The edges' thresholds until a refresh ships some.
    initial_routing: LaneThresholds = DEFAULT_ROUTING
    #: False: the edges keep ``initial_routing`` (``LANES_FOLLOW_REFRESHED_ROUTING=false``).
    follow_routing: bool = True
    #: Cross-fitting by prompt: a row is predicted by a model refitted without its prompt's rows
    #: (1: one model refitted on the whole window, which recalls reused prompts).
    folds: int = 2
    #: The refits' neighbour-memory share (``LANES_PREDICTOR_MEMORY_WEIGHT``; 0: none).
    memory_weight: float = MEMORY_WEIGHT

    def __post_init__(self) -> None:
        if self.folds < 1:
            raise ValueError(f"folds must be at least 1, got {self.folds}")


@dataclass(frozen=True)
class RefreshedPredictions:
    tokens: np.ndarray
    #: The thresholds each row was routed by.
    routing: list[LaneThresholds]
    #: Realised Kendall tau over all rows, and over the rows whose prompt the model had not seen.
    tau: float
    tau_unseen: float
    seen_share: float
    #: One entry per refresh that refitted: time, most observations a model read, models refitted,
    #: their median long threshold (None: they kept the previous ones).
    refreshes: list[dict[str, float | int | None]]


def refreshed_predictions(arrival_s: np.ndarray, true_tokens: np.ndarray, prompts: Sequence[str],
                          base: LengthPredictor, config: RefreshConfig, max_tokens: int,
                          refit: Callable[..., LengthPredictor] = refit_with_routing) -> RefreshedPredictions:
    """Predictions and routing per row (``prompts[i]`` is row i's paired prompt) with the
    refresh in the loop; rows must be in arrival order."""
    n = len(arrival_s)
    if len(true_tokens) != n or len(prompts) != n:
        raise ValueError("need one length and one prompt per row")
    tokens = np.empty(n)
    routing: list[LaneThresholds] = [config.initial_routing] * n
    seen = np.zeros(n, dtype=bool)
    refreshes: list[dict[str, float | int | None]] = []
    prompt_id = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
    ids = np.array([prompt_id[p] for p in prompts])
    fold = ids % config.folds  # distinct prompts dealt to folds in order of first appearance
    models: list[LengthPredictor] = [base] * config.folds
    thresholds = [config.initial_routing] * config.folds
    known = [frozenset[int]()] * config.folds
    start = 0
    at = config.every_s
    while start < n:
        end = int(np.searchsorted(arrival_s, at, side="left")) if at <= arrival_s[-1] else n
        for i in range(start, end):
            k = fold[i]
            tokens[i] = models[k].predict((ChatMessage("user", prompts[i]),), max_tokens)
            routing[i] = thresholds[k]
            seen[i] = ids[i] in known[k]
        start = end
        if start >= n:
            break
        finished = int(np.searchsorted(arrival_s, at - config.finish_delay_s, side="right"))
        usable = true_tokens[:finished] < max_tokens
        fitted: list[int | None] = []
        most = 0
        for k in range(config.folds):
            # The newest ``window`` finished rows the model may read: as many as a live refit
            # reads, from a span about folds / (folds - 1) times as long.
            train = np.flatnonzero(usable if config.folds == 1 else usable & (fold[:finished] != k))[-config.window:]
            if len(train) < config.min_observations:
                continue
            models[k] = refit(base, [Observation(prompts[i], int(true_tokens[i])) for i in train], config.calibration,
                              memory_weight=config.memory_weight)
            routed = models[k].routing
            thresholds[k] = (routed or thresholds[k]) if config.follow_routing else thresholds[k]
            known[k] = frozenset(int(ids[i]) for i in train)
            most = max(most, len(train))
            fitted.append(routed.medium_max_tokens if routed else None)
        if fitted:
            long_above = [t for t in fitted if t is not None]
            refreshes.append({"at_s": at, "observations": most, "models": len(fitted),
                              "long_above_tokens": int(np.median(long_above)) if long_above else None})
        at += config.every_s
    unseen = ~seen
    tau_unseen = kendall_tau(true_tokens[unseen], tokens[unseen]) if unseen.sum() > 1 else float("nan")
    return RefreshedPredictions(tokens, routing, kendall_tau(true_tokens, tokens), tau_unseen, float(seen.mean()),
                                refreshes)
