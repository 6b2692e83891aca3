"""A nearest-neighbour memory of the refresh window: the lengths this deployment's own similar
prompts were answered with.

A refit (``train.refit``) moves a linear model a little towards the window; the memory keeps the
window itself. For a new prompt it finds the ``k`` window prompts nearest by the encoder's
mean-pooled embedding (cosine) and averages their log(1 + tokens), each weighted by its
similarity to the power ``power``; ``LengthPredictor`` blends that into its score with the share
``LengthPredictor.memory_weight``. Deployments repeat themselves (templates, agents, one app's
system of prompts), and a neighbour's measured length carries what no model of prompts from
other sources can know. Off-line and simulator measurements: benchmarks/RESULTS.md, "Stop 31"
and "Stop 32".

Pure numpy; the embeddings are stored as float16 (768 bytes a prompt for 384 dimensions) and
searched as float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Neighbours averaged, and the power of their cosine similarity each is weighted by
#: (off-line in-source CV, RESULTS "Stop 31").
MEMORY_K = 10
MEMORY_POWER = 4.0


@dataclass(frozen=True, eq=False)
class NeighbourMemory:
    """Unit-length prompt embeddings and their prompts' log(1 + output tokens). Immutable."""

    embeddings: np.ndarray
    targets: np.ndarray
    k: int = MEMORY_K
    power: float = MEMORY_POWER

    def __post_init__(self) -> None:
        if self.embeddings.ndim != 2 or self.targets.shape != (len(self.embeddings),) or not len(self.targets):
            raise ValueError(f"need one target per embedding row and at least one row, got embeddings "
                             f"{self.embeddings.shape} and targets {self.targets.shape}")
        if self.k < 1 or self.power < 0.0:
            raise ValueError(f"need k >= 1 and power >= 0, got k {self.k}, power {self.power}")
        object.__setattr__(self, "embeddings", np.ascontiguousarray(self.embeddings, np.float32))
        object.__setattr__(self, "targets", np.asarray(self.targets, np.float64))

    @classmethod
    def build(cls, embeddings: Sequence[np.ndarray] | np.ndarray, targets: Sequence[float] | np.ndarray,
              k: int = MEMORY_K, power: float = MEMORY_POWER) -> NeighbourMemory:
        """A memory of prompts (their raw embeddings, normalised here) and their log(1 + tokens)."""
        matrix = np.asarray(embeddings, np.float32)
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        return cls(matrix / np.maximum(norms, 1e-12), np.asarray(targets, np.float64), k, power)

    @property
    def dimensions(self) -> int:
        return int(self.embeddings.shape[1])

    def score(self, embedding: np.ndarray) -> float:
        """The similarity-weighted mean log(1 + tokens) of ``embedding``'s nearest neighbours."""
        query = np.asarray(embedding, np.float32).reshape(-1)
        if query.shape != (self.dimensions,):
            raise ValueError(f"embedding of {query.shape[0]} dimensions, the memory holds {self.dimensions}")
        similarity = self.embeddings @ (query / max(float(np.linalg.norm(query)), 1e-12))
        k = min(self.k, len(similarity))
        nearest = np.argpartition(-similarity, k - 1)[:k] if k < len(similarity) else np.arange(k)
        weights = np.clip(similarity[nearest].astype(np.float64), 0.0, None) ** self.power
        if weights.sum() <= 0.0:
            return float(self.targets[nearest].mean())
        return float(weights @ self.targets[nearest] / weights.sum())

    def to_arrays(self) -> tuple[dict[str, object], dict[str, np.ndarray]]:
        """(JSON-able header, arrays) for ``.npz`` storage (embeddings as float16)."""
        return ({"k": self.k, "power": self.power, "size": len(self.targets)},
                {"memory_embeddings": self.embeddings.astype(np.float16),
                 "memory_targets": self.targets.astype(np.float32)})

    @classmethod
    def from_arrays(cls, header: dict[str, object], arrays: dict[str, np.ndarray]) -> NeighbourMemory:
        """Inverse of ``to_arrays``. Raises KeyError / TypeError / ValueError on a malformed file."""
        return cls(arrays["memory_embeddings"], arrays["memory_targets"], int(header["k"]),  # type: ignore[call-overload]
                   float(header["power"]))  # type: ignore[arg-type]
