"""The scheduler's predictor refresh in the simulator's loop.

Live, the scheduler refits the predictor every few minutes on the newest finished requests
and ships lane thresholds fitted for the new model with it (``scheduler/refresh.py``,
``train.refit_with_routing``); edges predict and route by the newest version. Here the same
function runs on the trace: at every ``every_s`` of (load-scaled) trace time, the rows that
arrived at least ``finish_delay_s`` earlier count as finished (a stand-in for their end; the
newest ``window`` of them, minus the ones cut by ``max_tokens``), each with its paired prompt and
its true length. Rows arriving after a refresh are predicted by that model and routed by its
thresholds; before the first refresh, the base model and the edges' fixed thresholds.

A prompt pool smaller than the trace is reused, and a refit memorises prompts it has seen:
``RefreshedPredictions.seen_share`` reports how many rows were predicted by a model that had
already observed their prompt, and ``tau_unseen`` the ranking on the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from lanes.queue.messages import REFRESH_WINDOW, ChatMessage
from lanes.scheduler.live_policy import DEFAULT_ROUTING
from lanes.scheduler.policy import LaneThresholds, RoutingCalibration
from lanes.scheduler.predictor import LengthPredictor
from lanes.scheduler.predictor.train import Observation, refit_with_routing
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


@dataclass(frozen=True)
class RefreshedPredictions:
    tokens: np.ndarray
    #: The thresholds each row was routed by.
    routing: list[LaneThresholds]
    #: Realised Kendall tau over all rows, and over the rows whose prompt the model had not seen.
    tau: float
    tau_unseen: float
    seen_share: float
    #: One entry per refresh: time, observations, thresholds (None: kept the previous ones).
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
    model, thresholds, known = base, config.initial_routing, frozenset[int]()
    prompt_id = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
    ids = np.array([prompt_id[p] for p in prompts])
    start = 0
    at = config.every_s
    while start < n:
        end = int(np.searchsorted(arrival_s, at, side="left")) if at <= arrival_s[-1] else n
        for i in range(start, end):
            tokens[i] = model.predict((ChatMessage("user", prompts[i]),), max_tokens)
            routing[i] = thresholds
            seen[i] = ids[i] in known
        start = end
        if start >= n:
            break
        finished = int(np.searchsorted(arrival_s, at - config.finish_delay_s, side="right"))
        rows = np.flatnonzero(true_tokens[:finished] < max_tokens)[-config.window:]
        if len(rows) >= config.min_observations:
            model = refit(base, [Observation(prompts[i], int(true_tokens[i])) for i in rows], config.calibration)
            thresholds = (model.routing or thresholds) if config.follow_routing else thresholds
            known = frozenset(int(ids[i]) for i in rows)
            refreshes.append({"at_s": at, "observations": len(rows),
                              "long_above_tokens": model.routing.medium_max_tokens if model.routing else None})
        at += config.every_s
    unseen = ~seen
    tau_unseen = kendall_tau(true_tokens[unseen], tokens[unseen]) if unseen.sum() > 1 else float("nan")
    return RefreshedPredictions(tokens, routing, kendall_tau(true_tokens, tokens), tau_unseen, float(seen.mean()),
                                refreshes)
