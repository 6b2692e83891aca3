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

The search runs in the window's own principal subspace: ``build`` centres the embeddings on
their mean and projects them onto their top ``MEMORY_DIMS`` principal axes, which a query is
projected onto too. That keeps a lookup inside the edge's latency budget (10,000 prompts: 3.8 MB
searched instead of 15 MB) and ranks as well as the full embedding (in-source 5-fold CV,
memory alone: alpaca_cleaned tau 0.569 at 384 dimensions, 0.566 at 96; gpteacher/codegen 0.463,
0.466; RESULTS "Stop 34").

Pure numpy; the projected embeddings are stored as float16 (192 bytes a prompt at 96 dimensions)
and searched as float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Neighbours averaged, and the power of their cosine similarity each is weighted by
#: (off-line in-source CV, RESULTS "Stop 31").
MEMORY_K = 10
MEMORY_POWER = 4.0
#: Principal axes the embeddings are projected onto (RESULTS "Stop 34"; None: the raw embedding).
MEMORY_DIMS = 96


@dataclass(frozen=True, eq=False)
class NeighbourMemory:
    """Unit-length prompt embeddings (projected when ``basis`` is set) and their prompts'
    log(1 + output tokens). Immutable."""

    embeddings: np.ndarray
    targets: np.ndarray
    k: int = MEMORY_K
    power: float = MEMORY_POWER
    #: The window's mean embedding, subtracted before projecting (None: no projection).
    mean: np.ndarray | None = None
    #: Its top principal axes as columns (embedding dimensions x ``embeddings``' columns), or None.
    basis: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.embeddings.ndim != 2 or self.targets.shape != (len(self.embeddings),) or not len(self.targets):
            raise ValueError(f"need one target per embedding row and at least one row, got embeddings "
                             f"{self.embeddings.shape} and targets {self.targets.shape}")
        if self.k < 1 or self.power < 0.0:
            raise ValueError(f"need k >= 1 and power >= 0, got k {self.k}, power {self.power}")
        if (self.basis is None) != (self.mean is None) or (self.basis is not None and (
                self.basis.shape != (len(self.mean), self.embeddings.shape[1]))):  # type: ignore[arg-type]
            raise ValueError(f"need a mean and a basis of (dimensions, {self.embeddings.shape[1]}) together, got mean "
                             f"{None if self.mean is None else self.mean.shape} and basis "
                             f"{None if self.basis is None else self.basis.shape}")
        for name in ("embeddings", "mean", "basis"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, np.ascontiguousarray(getattr(self, name), np.float32))
        object.__setattr__(self, "targets", np.asarray(self.targets, np.float64))

    @classmethod
    def build(cls, embeddings: Sequence[np.ndarray] | np.ndarray, targets: Sequence[float] | np.ndarray,
              k: int = MEMORY_K, power: float = MEMORY_POWER, dims: int | None = MEMORY_DIMS) -> NeighbourMemory:
        """A memory of prompts (their raw embeddings, projected onto their top ``dims`` principal
        axes when they have more dimensions and rows than that, then normalised) and their
        log(1 + tokens)."""
        matrix = np.asarray(embeddings, np.float32)
        mean = basis = None
        if dims is not None and matrix.ndim == 2 and dims < matrix.shape[1] and dims < len(matrix):
            mean = matrix.mean(axis=0)
            centred = matrix - mean
            wide = centred.astype(np.float64)
            _, axes = np.linalg.eigh(wide.T @ wide)  # ascending eigenvalues
            basis = np.ascontiguousarray(axes[:, ::-1][:, :dims], np.float32)
            matrix = centred @ basis
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        return cls(matrix / np.maximum(norms, 1e-12), np.asarray(targets, np.float64), k, power, mean, basis)

    @property
    def dimensions(self) -> int:
        """The dimensions of the embeddings it takes (before any projection)."""
        return int(self.embeddings.shape[1] if self.basis is None else self.basis.shape[0])

    def score(self, embedding: np.ndarray) -> float:
        """The similarity-weighted mean log(1 + tokens) of ``embedding``'s nearest neighbours."""
        query = np.asarray(embedding, np.float32).reshape(-1)
        if query.shape != (self.dimensions,):
            raise ValueError(f"embedding of {query.shape[0]} dimensions, the memory holds {self.dimensions}")
        if self.basis is not None:
            query = (query - self.mean) @ self.basis
        similarity = self.embeddings @ (query / max(float(np.linalg.norm(query)), 1e-12))
        k = min(self.k, len(similarity))
        nearest = np.argpartition(-similarity, k - 1)[:k] if k < len(similarity) else np.arange(k)
        weights = np.clip(similarity[nearest].astype(np.float64), 0.0, None) ** self.power
        if weights.sum() <= 0.0:
            return float(self.targets[nearest].mean())
        return float(weights @ self.targets[nearest] / weights.sum())

    def to_arrays(self) -> tuple[dict[str, object], dict[str, np.ndarray]]:
        """(JSON-able header, arrays) for ``.npz`` storage (embeddings as float16, the projection as
        float32)."""
        arrays = {"memory_embeddings": self.embeddings.astype(np.float16),
                  "memory_targets": self.targets.astype(np.float32)}
        if self.basis is not None and self.mean is not None:
            arrays |= {"memory_mean": self.mean, "memory_basis": self.basis}
        return ({"k": self.k, "power": self.power, "size": len(self.targets),
                 "projected_dims": None if self.basis is None else int(self.basis.shape[1])}, arrays)

    @classmethod
    def from_arrays(cls, header: dict[str, object], arrays: dict[str, np.ndarray]) -> NeighbourMemory:
        """Inverse of ``to_arrays`` (a memory saved before the projection loads unprojected).
        Raises KeyError / TypeError / ValueError on a malformed file."""
        projected = header.get("projected_dims") is not None
        return cls(arrays["memory_embeddings"], arrays["memory_targets"], int(header["k"]),  # type: ignore[call-overload]
                   float(header["power"]),  # type: ignore[arg-type]
                   arrays["memory_mean"] if projected else None, arrays["memory_basis"] if projected else None)
