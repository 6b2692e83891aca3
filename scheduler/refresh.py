"""The predictor keeps learning: an arq cron job in the scheduler process refits the length
predictor on the newest observed lengths and publishes the weights through Redis; edges
pick the new version up (``Edge.reload_predictor``).

A refit moves the predictions to the deployment's own length level, so the job also fits the
lane thresholds for the new model (``train.refit_with_routing``: on the window's newest fifth,
predicted by a probe refit that did not see them) and ships them in the weights' info; edges
route by them instead of their fixed ``LANES_SHORT_MAX_TOKENS`` / ``LANES_MEDIUM_MAX_TOKENS``
unless those were set explicitly (``LANES_FOLLOW_REFRESHED_ROUTING`` decides).

Each refit starts from the shipped weights plus the current window (bounded: the newest
``max_observations``, in which one API key's entries beyond ``max_key_share`` give way to
other keys' older ones: ``refresh_window``), so repeated refits never double-count an observation. Weights travel
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
    except that while two or more keys (``Observation.owner``) have entries, a key's entries
    beyond ``ceil(max_key_share * size)`` give way to older entries of the other keys. Places the
    other keys have no entries for are filled with the surplus, newest first, so the window is
    ``min(size, len(newest_first))`` long whatever the mix: one key cannot push the others out,
    and one dominant key among a few small ones does not halve the window. Pure."""
    owners = {o.owner for o in newest_first}
    if len(owners) < 2 or max_key_share >= 1.0:
        return list(newest_first[:size])[::-1]
    cap = math.ceil(max_key_share * size)
    taken: Counter[str] = Counter()
    chosen: list[int] = []
    surplus: list[int] = []
    for i, observation in enumerate(newest_first):
        if taken[observation.owner] < cap:
            taken[observation.owner] += 1
            chosen.append(i)
            if len(chosen) == size:
                break
        elif len(surplus) < size:
            surplus.append(i)
    chosen += surplus[:size - len(chosen)]
    return [newest_first[i] for i in sorted(chosen, reverse=True)]


def refit_bytes(observations: list[Observation], memory_weight: float | None = None) -> bytes:
    """Pure apart from a temp file: shipped model + observations (oldest first) -> new weights
    with their lane thresholds (npz bytes); ``memory_weight`` (default ``train.MEMORY_WEIGHT``):
    the neighbour memory's share."""
    from lanes.scheduler.predictor import load_default
    from lanes.scheduler.predictor.train import MEMORY_WEIGHT, refit_with_routing
    from lanes.scheduler.predictor.train import Observation as TrainObservation

    model = refit_with_routing(load_default(), [TrainObservation(o.prompt, o.output_tokens) for o in observations],
                               memory_weight=MEMORY_WEIGHT if memory_weight is None else memory_weight)
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
    # Newest first; with a share cap the whole list (which keys are in it, and their older entries
    # that take the places a key's surplus gives way).
    stored = await plane.fleet.observations(max_observations if max_key_share >= 1.0 else MAX_OBSERVATIONS)
    observations = refresh_window(stored, max_observations, max_key_share)
    held = Counter(o.owner for o in observations)
    if len(held) > 1:
        log.info("refresh window: %d observations from %d API keys, the most from one key %d "
                 "(LANES_PREDICTOR_MAX_KEY_SHARE %g of the window while others have entries)",
                 len(observations), len(held), max(held.values()), max_key_share)
    if len(observations) < min_observations:
        return {"observations": len(observations), "version": 0}
    weights = await asyncio.to_thread(refit_bytes, observations, ctx.get("memory_weight"))
    version = await plane.fleet.publish_predictor(weights, len(observations), added)
    from lanes.scheduler.predictor import release_freed_memory

    release_freed_memory()  # the refit freed what glibc would keep (RSS 370 -> 211 MB in a soak)
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
