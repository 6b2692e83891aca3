"""Complexity estimate of a prompt: how likely a small model's answer is judged worse than a large one's.

Model, for a prompt ``p``::

    z(p)       = w . words(p) + v . (cues(p) - cue_mean) / cue_scale + intercept
    p_ok(p)    = sigmoid(z(p))          judged P(small model's answer >= large model's), 0..1
    complexity = 1 - F(p_ok(p))         F: CDF of p_ok over the training prompts, 0..1

``complexity`` is a percentile: 0.25 means "harder than about a quarter of the training prompts",
so a small-pool threshold of 0.25 sends about a quarter of AlpacaEval-like traffic to the small
pool. Training data and results: docs/router-data.md, benchmarks/RESULTS.md "Routing (issue 13)".
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from lanes.scheduler.router.features import (
    FEATURE_VERSION,
    NUM_BUCKETS,
    NUM_CUES,
    cue_values,
    word_slots,
)

#: Points of the stored CDF of ``p_ok`` (quantiles at 0, 1/100, ..., 1).
NUM_QUANTILES = 101
#: The shipped weights (package data; written by ``lanes router train``).
DEFAULT_WEIGHTS_PATH = Path(__file__).resolve().parent / "weights" / "complexity.npz"


class ComplexityModelError(ValueError):
    """A weights file that is not a complexity model of this feature version."""


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


@dataclass(frozen=True, eq=False)
class ComplexityModel:
    """Linear model over hashed words and standardised cues. Immutable; scoring is pure.

    Invariants: ``word_weights`` has ``NUM_BUCKETS`` entries; ``cue_mean``, ``cue_scale`` and
    ``cue_weights`` have ``NUM_CUES``; ``quantiles`` is non-decreasing with ``NUM_QUANTILES``.
    """

    word_weights: np.ndarray
    cue_mean: np.ndarray
    cue_scale: np.ndarray
    cue_weights: np.ndarray
    intercept: float
    quantiles: np.ndarray
    #: Free-form provenance (training command, data, CV numbers), kept in the weights file.
    meta: dict[str, object]

    def p_ok(self, prompt: str) -> float:
        """Estimated probability that the small model's answer is judged at least as good."""
        slots = word_slots(prompt)
        z = self.intercept
        if len(slots):
            z += float(self.word_weights[slots].sum()) / math.sqrt(len(slots))
        z += float(((cue_values(prompt) - self.cue_mean) / self.cue_scale) @ self.cue_weights)
        return _sigmoid(z)

    def complexity_of_p_ok(self, p_ok: float) -> float:
        """Percentile of hardness for a ``p_ok`` value, 0 (easiest) .. 1 (hardest)."""
        grid = np.linspace(0.0, 1.0, NUM_QUANTILES)
        return float(1.0 - np.interp(p_ok, self.quantiles, grid))

    def complexity(self, prompt: str) -> float:
        """Hardness percentile of ``prompt`` among the training prompts, 0 .. 1."""
        return self.complexity_of_p_ok(self.p_ok(prompt))

    # -- storage (I/O shell; the model above is pure)

    def to_bytes(self) -> bytes:
        """``.npz`` bytes; only non-zero word weights are kept, as float32."""
        slots = np.flatnonzero(self.word_weights)
        buffer = io.BytesIO()
        np.savez_compressed(
            buffer,
            header=np.frombuffer(json.dumps({
                "kind": "router-complexity", "feature_version": FEATURE_VERSION,
                "intercept": self.intercept, "meta": self.meta,
            }).encode(), dtype=np.uint8),
            word_slots=slots.astype(np.int32), word_values=self.word_weights[slots].astype(np.float32),
            cue_mean=self.cue_mean.astype(np.float32), cue_scale=self.cue_scale.astype(np.float32),
            cue_weights=self.cue_weights.astype(np.float32), quantiles=self.quantiles.astype(np.float32),
        )
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, raw: bytes) -> ComplexityModel:
        """Inverse of ``to_bytes``. Raises ComplexityModelError naming what is wrong."""
        try:
            arrays = dict(np.load(io.BytesIO(raw), allow_pickle=False))
            header = json.loads(arrays.pop("header").tobytes())
        except (ValueError, KeyError, OSError) as err:
            raise ComplexityModelError(f"not a complexity weights file: {err}") from None
        if header.get("kind") != "router-complexity" or header.get("feature_version") != FEATURE_VERSION:
            raise ComplexityModelError(
                f"weights are {header.get('kind')} v{header.get('feature_version')}, "
                f"need router-complexity v{FEATURE_VERSION} (retrain: lanes router train)")
        weights = np.zeros(NUM_BUCKETS)
        weights[arrays["word_slots"]] = arrays["word_values"]
        cues = {key: arrays[key].astype(np.float64) for key in ("cue_mean", "cue_scale", "cue_weights")}
        if any(len(value) != NUM_CUES for value in cues.values()):
            raise ComplexityModelError(f"cue arrays must have {NUM_CUES} entries")
        quantiles = arrays["quantiles"].astype(np.float64)
        if len(quantiles) != NUM_QUANTILES or np.any(np.diff(quantiles) < 0):
            raise ComplexityModelError(f"quantiles must be {NUM_QUANTILES} non-decreasing values")
        return cls(weights, intercept=float(header["intercept"]), quantiles=quantiles,
                   meta=dict(header.get("meta", {})), **cues)

    def save(self, path: Path) -> None:
        path.write_bytes(self.to_bytes())

    @classmethod
    def load(cls, path: Path | None = None) -> ComplexityModel:
        """Load ``path``, or the shipped weights when None."""
        return cls.from_bytes(Path(path or DEFAULT_WEIGHTS_PATH).read_bytes())
