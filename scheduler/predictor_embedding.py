"""Embedding length model: truncated MiniLM sentence vector + RBF kernel ridge on log tokens.

    x(p)     = MiniLMEncoder(num_layers, max_tokens).encode(p)      unit norm, 384 floats
    score(p) = sum_i c_i exp(-gamma |x(p) - s_i|^2) + intercept      = predicted log(1 + tokens)

The support vectors ``s_i`` are the embeddings of the training prompts (kept, with their targets,
so that ``refit`` can re-solve on old and new examples together). Pure numpy; the encoder is
passed in, already loaded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from lanes.scheduler.predictor_encoder import MiniLMEncoder


@dataclass(frozen=True)
class EncoderConfig:
    """Which part of MiniLM to run. Stored with the weights; changing it needs a retrain."""

    #: BERT layers run (1..6); each costs about 2-3 ms at 24 tokens on one (slow, shared) core,
    #: and each adds rank signal (5-fold CV tau 0.42 / 0.45 / 0.49 for 1 / 2 / 4 layers).
    num_layers: int = 1
    #: Word pieces read, [CLS] and [SEP] included; the rest of the prompt is cut.
    max_tokens: int = 24


@dataclass(frozen=True)
class KernelConfig:
    """Kernel ridge hyper-parameters (chosen by 5-fold CV on AlpacaEval)."""

    #: RBF width on unit vectors: k = exp(-gamma * |a - b|^2), |a - b|^2 in [0, 4].
    gamma: float = 4.0
    #: Ridge strength added to the kernel diagonal.
    alpha: float = 0.3
    #: At most this many examples are kept as support vectors (memory: 768 bytes each in float16).
    max_examples: int = 2048


def rbf_kernel(a: np.ndarray, b: np.ndarray, gamma: float) -> np.ndarray:
    """exp(-gamma |a_i - b_j|^2) for unit-norm rows of ``a`` (m, d) and ``b`` (n, d)."""
    return np.exp(-gamma * np.maximum(2.0 - 2.0 * (a @ b.T), 0.0))


def fit_kernel_ridge(
    support: np.ndarray, targets: np.ndarray, kernel: KernelConfig
) -> tuple[np.ndarray, float]:
    """Dual coefficients and intercept (the target mean). O(n^3) in the number of examples."""
    intercept = float(targets.mean())
    gram = rbf_kernel(support, support, kernel.gamma).astype(np.float64)
    gram[np.diag_indices_from(gram)] += kernel.alpha
    return np.linalg.solve(gram, targets - intercept), intercept


@dataclass(frozen=True, eq=False)
class EmbeddingModel:
    """Kernel ridge over MiniLM embeddings. Immutable.

    Invariants: ``support`` is (n, 384) float32 with unit rows (float16-exact, as stored);
    ``targets`` and ``coefs`` have n entries; ``encoder`` matches ``encoder_config``.
    """

    encoder_config: EncoderConfig
    kernel: KernelConfig
    encoder: MiniLMEncoder
    support: np.ndarray
    #: log(1 + output tokens) of each support example, kept for refits.
    targets: np.ndarray
    coefs: np.ndarray
    intercept: float

    kind = "minilm"

    @classmethod
    def fit(
        cls,
        encoder_config: EncoderConfig,
        kernel: KernelConfig,
        encoder: MiniLMEncoder,
        embeddings: np.ndarray,
        targets: np.ndarray,
    ) -> EmbeddingModel:
        """Solve the kernel ridge on the last ``kernel.max_examples`` (embedding, target) pairs."""
        keep = slice(max(0, len(targets) - kernel.max_examples), None)
        support = embeddings[keep].astype(np.float16).astype(np.float32)
        targets = np.asarray(targets[keep], dtype=np.float32).astype(np.float64)
        coefs, intercept = fit_kernel_ridge(support, targets, kernel)
        coefs = coefs.astype(np.float32).astype(np.float64)
        return cls(encoder_config, kernel, encoder, support, targets, coefs, float(np.float32(intercept)))

    def score_embedding(self, embedding: np.ndarray) -> float:
        """Predicted log(1 + output tokens) for one unit-norm embedding."""
        similarity = self.support @ embedding
        weights = np.exp(-self.kernel.gamma * np.maximum(2.0 - 2.0 * similarity, 0.0))
        return float(weights @ self.coefs) + self.intercept

    def score_text(self, prompt: str) -> float:
        """Predicted log(1 + output tokens) for a prompt."""
        return self.score_embedding(self.encoder.encode(prompt))

    def to_arrays(self) -> tuple[dict[str, object], dict[str, np.ndarray]]:
        """(JSON-able header, arrays) for ``.npz`` storage."""
        header = {
            "encoder": asdict(self.encoder_config),
            "kernel": asdict(self.kernel),
            "intercept": self.intercept,
        }
        arrays = {
            "support": self.support.astype(np.float16),
            "targets": self.targets.astype(np.float32),
            "coefs": self.coefs.astype(np.float32),
        }
        return header, arrays

    @classmethod
    def from_arrays(
        cls, header: dict[str, object], arrays: dict[str, np.ndarray], encoder: MiniLMEncoder
    ) -> EmbeddingModel:
        """Inverse of ``to_arrays``; ``encoder`` must be built from ``header["encoder"]``."""
        return cls(
            EncoderConfig(**header["encoder"]),  # type: ignore[arg-type]
            KernelConfig(**header["kernel"]),  # type: ignore[arg-type]
            encoder,
            arrays["support"].astype(np.float32),
            arrays["targets"].astype(np.float64),
            arrays["coefs"].astype(np.float64),
            float(header["intercept"]),  # type: ignore[arg-type]
        )
