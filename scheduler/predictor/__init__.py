"""Output-length predictor: what the edge asks before it picks a lane.

Two models, blended: ``lexical`` (``lexical.py``): hashed TF-IDF word and character n-grams plus
hand-written length cues, and a linear model on log(1 + output tokens); and a small fine-tuned
transformer (``encoder.py``: three MiniLM layers run by ONNX Runtime with int8 weights). Both
are trained on ~24,000 prompts from eleven public sources answered by ~230 models (``data.py``,
docs/predictor-data.md), each source centred and balanced (``train.py``) so that they rank
prompts of sources they never saw; the score is ``(1 - w) * lexical + w * encoder``.
Leave-one-source-out Kendall tau, in-source CV tau and latency: benchmarks/RESULTS.md, "Length
predictor (issue 9)" and "Stop 27". Predictions are in Llama-3 tokens at the level of current
chat models. The refresh (``train.refit``) moves the lexical part only; the encoder is fixed.
A refit may also keep a nearest-neighbour memory of its window (``memory.py``, off by default),
blended in with its own share: ``(1 - m) * blend + m * memory``.

Public interface: ``load_default()`` / ``from_weights(path)`` -> ``LengthPredictor`` with
``predict(messages, max_tokens) -> int``, ``predict_text``, ``score_text`` and ``routing`` (lane
thresholds a refresh fitted for the model's level); ``prompt_text``; ``WeightsError``. Training:
``train.train`` / ``train.refit`` / ``train.refit_with_routing`` / ``train.Observation``; metrics:
``eval.evaluate`` / ``eval.kendall_tau``; data: ``data.read_examples`` / ``data.Example``.

Pure and importable without torch, redis or sklearn: no clock, no environment, and no I/O except
the explicit ``from_weights`` / ``save`` / ``load_default`` (``.npz`` with a JSON header, read with
``allow_pickle=False``; a header that names an encoder loads its ONNX graph, found beside the
weights file or in ``WEIGHTS_DIR`` and checked by SHA-256). Training and refits live in ``train``, metrics in ``eval``, the data set
in ``data`` (and its builder in ``sources``).

Errors::

    ValueError
     └── WeightsError          a weights file is unreadable, malformed or of another version
"""

from __future__ import annotations

import functools
import json
import math
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from lanes.queue.messages import ChatMessage
from lanes.scheduler.policy import LaneThresholds
from lanes.scheduler.predictor.lexical import LexicalModel
from lanes.scheduler.predictor.memory import NeighbourMemory

#: Bumped whenever a feature function changes meaning; weights carry it and are checked on load.
FEATURE_VERSION = 1
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEFAULT_WEIGHTS_PATH = WEIGHTS_DIR / "length_predictor_lexical.npz"
#: The ``info`` entry holding lane thresholds fitted for a refreshed model (``LengthPredictor.routing``).
ROUTING_INFO_KEY = "routing"

__all__ = [
    "LengthPredictor",
    "WeightsError",
    "from_weights",
    "load_default",
    "prompt_text",
    "release_freed_memory",
]


def release_freed_memory() -> None:
    """Hand the heap glibc keeps after ``free`` back to the system (``malloc_trim``; a no-op
    elsewhere). Called after a predictor is replaced: loading or refitting one frees ~15 MB
    that glibc held for good (a 90-minute soak: an edge's RSS 160.9 MB after one trim against
    175.8 before, live memory flat; the scheduler 369.9 -> 211.4 MB). Takes ~1 ms."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``); None elsewhere."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to hand back this way
        return None


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
    """A trained length model. Immutable; ``train.refit`` returns a new one."""

    model: LexicalModel
    #: Provenance (training data, metrics, refit count); saved with the weights, never read by predict.
    info: dict[str, object]
    #: The fine-tuned encoder (``encoder.Encoder``) blended in, or None for the lexical model alone.
    encoder: Any = None
    #: Its share of the score, in [0, 1).
    encoder_weight: float = 0.0
    #: Lengths of a refresh window's prompts, found by the encoder's embedding (``memory``), or None.
    memory: NeighbourMemory | None = None
    #: The memory's share of the score, in [0, 1].
    memory_weight: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.encoder_weight < 1.0 or (self.encoder is None and self.encoder_weight):
            raise ValueError(f"encoder_weight must be in [0, 1) and 0 without an encoder, got {self.encoder_weight}")
        if not 0.0 <= self.memory_weight <= 1.0 or (self.memory is None and self.memory_weight):
            raise ValueError(f"memory_weight must be in [0, 1] and 0 without a memory, got {self.memory_weight}")
        if self.memory is not None and not getattr(self.encoder, "has_embedding", False):
            raise ValueError("a neighbour memory needs an encoder that outputs its embedding")

    @property
    def kind(self) -> str:
        """The model family: ``"lexical"``, ``"lexical+encoder"`` when an encoder is blended in, and
        ``+memory`` after them when a neighbour memory is."""
        kind = self.model.kind if self.encoder is None else f"{self.model.kind}+encoder"
        return kind if self.memory is None else f"{kind}+memory"

    def score_text(self, prompt: str) -> float:
        """Predicted log(1 + output tokens) for a prompt (the ranking score). Any ``str`` is
        scored: a lone surrogate (no UTF-8 for it; the edge refuses such text, callers of this
        API may not) reads as "?"."""
        try:
            return self._score(prompt)
        except UnicodeEncodeError:
            return self._score(prompt.encode("utf-8", "replace").decode("utf-8"))

    def _score(self, prompt: str) -> float:
        lexical = self.model.score_text(prompt)
        if self.encoder is None:
            return lexical
        if self.memory is None:
            return (1.0 - self.encoder_weight) * lexical + self.encoder_weight * self.encoder.score_text(prompt)
        encoded, embedding = self.encoder.score_and_embed(prompt)
        score = (1.0 - self.encoder_weight) * lexical + self.encoder_weight * encoded
        return (1.0 - self.memory_weight) * score + self.memory_weight * self.memory.score(embedding)

    def encoder_scores(self, prompts: Sequence[str]) -> np.ndarray | None:
        """The encoder's scores of ``prompts`` (batched), or None without an encoder."""
        return None if self.encoder is None else self.encoder.score_texts(prompts)

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

    @property
    def routing(self) -> LaneThresholds | None:
        """Lane thresholds fitted for this model's prediction level by the refresh
        (``train.refit_with_routing``); None when it carries none or they are malformed."""
        routing = self.info.get(ROUTING_INFO_KEY)
        try:
            short_max, medium_max = int(routing["short_max_tokens"]), int(routing["medium_max_tokens"])  # type: ignore[index]
        except (TypeError, KeyError, ValueError):
            return None
        return LaneThresholds(short_max, medium_max) if 0 <= short_max <= medium_max else None

    def with_routing(self, routing: LaneThresholds | None, **provenance: object) -> LengthPredictor:
        """The same model carrying ``routing`` (None: no thresholds) and ``provenance`` in its info."""
        info = {k: v for k, v in self.info.items() if k != ROUTING_INFO_KEY}
        if routing is not None:
            info[ROUTING_INFO_KEY] = {"short_max_tokens": routing.short_max_tokens,
                                      "medium_max_tokens": routing.medium_max_tokens, **provenance}
        return replace(self, info=info)

    def save(self, path: Path) -> None:
        """Write one compressed ``.npz``: a JSON header plus plain numeric arrays (no pickle).

        Byte-for-byte reproducible (fixed zip timestamps, unlike ``np.savez_compressed``): the same
        model writes the same file. ``lanes predictor train`` rebuilds the committed weights
        closely, not bit for bit: the encoder's fine-tune on another machine or thread count
        differs in float rounding (an audit's rebuild: scores within 0.008 in log(1 + tokens),
        tau 0.998 between the two models' predictions, the same taus to 1e-4).
        """
        header, arrays = self.model.to_arrays()
        meta: dict[str, object] = {"feature_version": FEATURE_VERSION, "kind": self.model.kind, "model": header,
                                   "info": self.info}
        if self.encoder is not None:
            meta["encoder"] = {"file": self.encoder.path.name, "sha256": self.encoder.sha256,
                               "weight": self.encoder_weight}
        if self.memory is not None:
            memory_header, memory_arrays = self.memory.to_arrays()
            meta["memory"] = {**memory_header, "weight": self.memory_weight}
            arrays = {**arrays, **memory_arrays}
        members = {"header_json": np.array(json.dumps(meta, sort_keys=True)), **arrays}
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            for key, value in members.items():
                entry = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                entry.compress_type = zipfile.ZIP_DEFLATED
                with archive.open(entry, "w", force_zip64=True) as out:
                    np.lib.format.write_array(out, np.asanyarray(value), allow_pickle=False)


def from_weights(path: Path) -> LengthPredictor:
    """Load a model written by ``LengthPredictor.save``.

    Raises ``WeightsError`` on a bad file.
    """
    try:
        with open(path, "rb") as head:
            if head.read(4) != b"PK\x03\x04":  # not a zip: numpy would call it pickled data
                raise WeightsError(f"cannot read predictor weights {path}: not an .npz archive (not a predictor "
                                   "weights file: give one `lanes predictor train` wrote, or leave it out for "
                                   "the shipped weights)")
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["header_json"]))
            arrays = {key: data[key] for key in data.files if key != "header_json"}
        if meta.get("feature_version") != FEATURE_VERSION:
            raise WeightsError(f"{path}: feature_version {meta.get('feature_version')} != {FEATURE_VERSION}")
        header, info = meta["model"], dict(meta["info"])
        if meta["kind"] != LexicalModel.kind:
            raise WeightsError(f"{path}: unknown model kind {meta['kind']!r}")
        model = LexicalModel.from_arrays(header, arrays)
        if "encoder" not in meta:
            return LengthPredictor(model, info)
        named = meta["encoder"]
        encoder = _load_encoder(path, str(named["file"]), str(named["sha256"]))
        memory = NeighbourMemory.from_arrays(meta["memory"], arrays) if "memory" in meta else None
        return LengthPredictor(model, info, encoder, float(named["weight"]), memory,
                               float(meta["memory"]["weight"]) if memory is not None else 0.0)
    except (KeyError, TypeError, ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:  # a truncated archive
        if isinstance(exc, WeightsError):
            raise
        words = str(exc).split(". ")[0] if "allow_pickle" in str(exc) else str(exc)  # numpy's advice is not ours
        raise WeightsError(f"cannot read predictor weights {path}: {words} (not a predictor weights file: "
                           "give one `lanes predictor train` wrote, or leave it out for the shipped weights)") from exc


def _load_encoder(weights: Path, name: str, sha256: str) -> Any:
    """The encoder a weights file names: beside it, else in ``WEIGHTS_DIR``. Raises ``WeightsError``."""
    from lanes.scheduler.predictor.encoder import EncoderError, load_encoder

    if Path(name).name != name:
        raise WeightsError(f"{weights}: encoder file name {name!r} is not a plain file name")
    graph = weights.parent / name
    if not graph.exists():
        graph = WEIGHTS_DIR / name
    try:
        return load_encoder(graph, sha256)
    except EncoderError as exc:
        raise WeightsError(f"{weights}: {exc}") from exc


@functools.cache
def load_default() -> LengthPredictor:
    """The committed default model (lexical + encoder), loaded once per process. Raises ``WeightsError``."""
    return from_weights(DEFAULT_WEIGHTS_PATH)
