"""The predictor keeps learning: an arq cron job in the scheduler process refits the length
predictor on the newest observed lengths and publishes the weights through Redis; edges
pick the new version up (``Edge.reload_predictor``).

A refit moves the predictions to the deployment's own length level, so the job also fits the
lane thresholds for the new model (``train.refit_with_routing``: on the window's newest fifth,
predicted by a probe refit that did not see them) and ships them in the weights' info; edges
route by them instead of their fixed ``LANES_SHORT_MAX_TOKENS`` / ``LANES_MEDIUM_MAX_TOKENS``
unless those were set explicitly (``LANES_FOLLOW_REFRESHED_ROUTING`` decides).

Each refit starts from the shipped weights plus the current window (bounded: the newest
``max_observations``, in which one API key holds at most ``max_key_share`` while others have
requests in the list: ``refresh_window``), so repeated refits never double-count an observation. Weights travel
as ``.npz`` bytes (JSON header + numeric arrays, loaded with ``allow_pickle=False``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lanes.queue.fleet import MAX_OBSERVATIONS
from lanes.queue.messages import REFRESH_WINDOW, Observation
from lanes.queue.plane import QueuePlane

log = logging.getLogger(__name__)


def refresh_window(newest_first: Sequence[Observation], size: int, max_key_share: float) -> list[Observation]:
    """The observations a refresh fits on, oldest first: the newest ``size`` of ``newest_first``,
    except that while two or more keys (``Observation.owner``) have entries, none takes more
    than ``ceil(max_key_share * size)`` places (its older surplus is left out, and the window
    may stay short of ``size``). Pure."""
    owners = {o.owner for o in newest_first}
    if len(owners) < 2 or max_key_share >= 1.0:
        return list(newest_first[:size])[::-1]
    cap = math.ceil(max_key_share * size)
    taken: Counter[str] = Counter()
    window = []
    for observation in newest_first:
        if taken[observation.owner] < cap:
            taken[observation.owner] += 1
            window.append(observation)
            if len(window) == size:
                break
    return window[::-1]


def refit_bytes(observations: list[Observation]) -> bytes:
    """Pure apart from a temp file: shipped model + observations (oldest first) -> new weights
    with their lane thresholds (npz bytes)."""
    from lanes.scheduler.predictor import load_default
    from lanes.scheduler.predictor.train import Observation as TrainObservation
    from lanes.scheduler.predictor.train import refit_with_routing

    model = refit_with_routing(load_default(), [TrainObservation(o.prompt, o.output_tokens) for o in observations])
    routing = model.routing
    log.info("refitted on %d observations; lanes: %s", len(observations),
             f"short <= {routing.short_max_tokens} < long predicted tokens" if routing is not None
             else "too few short answers held out to fit thresholds, the edges keep theirs")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.npz"
        model.save(path)
        return path.read_bytes()


async def refresh_predictor(ctx: dict[str, Any]) -> dict[str, int]:
    """arq cron job: refit on the newest observations and publish a new version (none when no
    observation was added since the published one was fitted: the same window, the same model)."""
    plane: QueuePlane = ctx["plane"]
    min_observations: int = ctx.get("min_observations", 50)
    max_observations: int = ctx.get("max_observations", REFRESH_WINDOW)
    added = await plane.fleet.observations_added()
    if added and added == await plane.fleet.published_added():
        return {"observations": 0, "version": 0}
    max_key_share: float = ctx.get("max_key_share", 1.0)
    # Newest first; with a share cap the whole list (which keys are in it, and older entries to
    # fill the places a key's surplus leaves).
    stored = await plane.fleet.observations(max_observations if max_key_share >= 1.0 else MAX_OBSERVATIONS)
    observations = refresh_window(stored, max_observations, max_key_share)
    if len(observations) < min(max_observations, len(stored)):
        log.info("refresh window: %d of the %d newest observations; the rest are API keys' surplus beyond "
                 "their share (LANES_PREDICTOR_MAX_KEY_SHARE)", len(observations), len(stored))
    if len(observations) < min_observations:
        return {"observations": len(observations), "version": 0}
    weights = await asyncio.to_thread(refit_bytes, observations)
    version = await plane.fleet.publish_predictor(weights, len(observations), added)
    log.info("predictor refreshed from %d observations: version %d", len(observations), version)
    return {"observations": len(observations), "version": version}


class UnusableWeights(ValueError):
    """The published version's weights do not load (raised with the version, so a reader can
    skip it instead of fetching it again)."""

    def __init__(self, version: int, cause: Exception) -> None:
        super().__init__(f"published predictor version {version} does not load ({cause}); edges keep the model "
                         "they have and skip this version until a newer one is published (see the scheduler's "
                         "log of the refresh that published it)")
        self.version = version


async def load_published(plane: QueuePlane, known_version: int) -> tuple[int, Any] | None:
    """The published predictor if newer than ``known_version``: ``(version, LengthPredictor)``;
    raises ``UnusableWeights`` when its weights do not load."""
    from lanes.scheduler.predictor import from_weights

    published = await plane.fleet.published_predictor(known_version)
    if published is None:
        return None
    version, weights = published

    def load() -> Any:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "weights.npz"
            path.write_bytes(weights)
            return from_weights(path)

    try:
        return version, await asyncio.to_thread(load)
    except ValueError as exc:
        raise UnusableWeights(version, exc) from exc
