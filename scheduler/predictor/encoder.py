"""The length predictor's sentence encoder: a small transformer fine-tuned on answer length.

The first ``num_layers`` BERT layers of all-MiniLM-L6-v2 (Apache-2.0), fine-tuned with a linear
head on the same source-centred, source-balanced log(1 + output tokens) targets as the lexical
model (``train.source_balance``), read the first ``max_tokens`` word pieces of a prompt and
mean-pool them into one score: predicted log(1 + output tokens). ``LengthPredictor`` blends it
with the lexical score. Fine-tuning (``encoder_train``, torch + transformers) happens once, off
line; serving runs the exported graph with int8 weights in ONNX Runtime, one thread, about 2 ms a
prompt (benchmarks/RESULTS.md, "Stop 27"). Importing this module needs neither: ``onnxruntime``
and ``tokenizers`` are imported when an ``Encoder`` is built.

Files (``WEIGHTS_DIR``): ``length_encoder.onnx`` (the graph: inputs ``ids`` / ``mask``, int64
[batch, tokens]; output ``score``, float32 [batch], and, exported since stop 32, ``embedding``, the
mean-pooled float32 [batch, 384] the score's head reads (``embed_text``, for ``memory``); its metadata carries ``max_tokens`` and the
training provenance) and ``length_encoder_tokenizer.json`` (the base model's word-piece
tokenizer). A lexical weights file names the graph by file name and SHA-256, so a refreshed
model published by a scheduler with another encoder fails to load instead of mixing scores.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ENCODER_FILE = "length_encoder.onnx"
TOKENIZER_FILE = "length_encoder_tokenizer.json"
#: Scores kept per encoder (by a 16-byte hash of the word pieces read): the refresh scores its
#: whole window again on every refit, and most of a window's prompts were scored at the previous
#: one. About 100 bytes an entry.
CACHE_ENTRIES = 65_536
#: Embeddings kept per encoder (graphs with an ``embedding`` output): a refresh window's worth
#: (``queue.messages.REFRESH_WINDOW``) and some, 1.5 KB an entry.
EMBEDDING_CACHE_ENTRIES = 12_288
#: Characters of a prompt tokenised: enough for ``max_tokens`` word pieces of any ordinary text
#: (a word piece is 1-20 characters), so a megabyte prompt is not tokenised whole to read 48.
CHARS_PER_TOKEN = 32
#: Characters per word piece of a first, shorter try (``Encoder.ids``): ordinary text fills
#: ``max_tokens`` word pieces well within it, and tokenising it costs ~0.25 ms, not ~0.7.
QUICK_CHARS_PER_TOKEN = 8


class EncoderError(ValueError):
    """The encoder's files are missing, unreadable, or not the ones the weights were trained with."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Encoder:
    """One loaded encoder (ONNX Runtime session + tokenizer). Thread-safe; scores are cached."""

    def __init__(self, graph: Path, tokenizer: Path | None = None, threads: int = 1, sha256: str | None = None) -> None:
        try:
            import onnxruntime as ort
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise EncoderError(f"the length encoder needs onnxruntime and tokenizers ({exc}); "
                               "pip install onnxruntime tokenizers") from exc
        tokenizer = tokenizer or graph.with_name(TOKENIZER_FILE)
        try:
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
            self._session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
            self._tokenizer = Tokenizer.from_file(str(tokenizer))
            self.meta: dict[str, str] = dict(self._session.get_modelmeta().custom_metadata_map)
            self.max_tokens = int(self.meta["max_tokens"])
        except EncoderError:
            raise
        except Exception as exc:  # onnxruntime raises its own types (Fail, InvalidGraph, ...)
            raise EncoderError(f"cannot load the length encoder {graph} / {tokenizer}: {exc}") from exc
        self._tokenizer.enable_truncation(max_length=self.max_tokens)
        self._tokenizer.no_padding()
        self.path = graph
        self.sha256 = sha256 or file_sha256(graph)
        outputs = [o.name for o in self._session.get_outputs()]
        #: Whether the graph also outputs its mean-pooled sentence embedding (``embed_text``;
        #: graphs exported before stop 32 output the score alone).
        self.has_embedding = "embedding" in outputs
        self._cache: OrderedDict[bytes, float] = OrderedDict()
        self._embeddings: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def _encode(self, prompt: str, embed: bool) -> tuple[float, np.ndarray | None]:
        """(score, embedding if ``embed`` else None), from the caches when there; a run fetches the
        embedding only when asked for it (``embed`` needs ``has_embedding``)."""
        ids = np.asarray([self.ids(prompt)], np.int64)
        key = hashlib.blake2b(ids.tobytes(), digest_size=16).digest()
        with self._lock:
            score, embedding = self._cache.get(key), self._embeddings.get(key) if embed else None
            if score is not None and (embedding is not None or not embed):
                self._cache.move_to_end(key)
                if embedding is not None:
                    self._embeddings.move_to_end(key)
                return score, embedding
        # One prompt per run, never a padded batch: int8 activations are quantised per run, so a
        # prompt scored beside others would score slightly differently from the same prompt alone,
        # and the edge (one at a time) and a refit (a whole window) must agree.
        found = self._session.run(["score", "embedding"] if embed else ["score"], {"ids": ids, "mask": np.ones_like(ids)})
        score = float(found[0][0])
        embedding = np.asarray(found[1][0], np.float32) if embed else None
        with self._lock:
            self._cache[key] = score
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            if embedding is not None:
                self._embeddings[key] = embedding
                if len(self._embeddings) > EMBEDDING_CACHE_ENTRIES:
                    self._embeddings.popitem(last=False)
        return score, embedding

    def ids(self, prompt: str) -> list[int]:
        """The word pieces read: those of ``prompt[:max_tokens * CHARS_PER_TOKEN]``, truncated to
        ``max_tokens`` ([CLS] and [SEP] included).

        Tried first on a shorter head cut before an ASCII space or newline: the tokenizer splits
        words there (whitespace, a starter for the accent stripping's NFD), so that head's word
        pieces begin the longer cut's, and when they fill ``max_tokens`` they are its.
        """
        limit = self.max_tokens * CHARS_PER_TOKEN
        quick = self.max_tokens * QUICK_CHARS_PER_TOKEN
        if len(prompt) > quick:
            cut = max(prompt.rfind(" ", 0, quick), prompt.rfind("\n", 0, quick))
            if cut > 0:
                ids = self._tokenizer.encode(prompt[:cut]).ids
                if len(ids) >= self.max_tokens:
                    return ids
        return self._tokenizer.encode(prompt[:limit]).ids

    def score_text(self, prompt: str) -> float:
        """Predicted log(1 + output tokens) for one prompt."""
        return self._encode(prompt, embed=False)[0]

    def score_texts(self, prompts: Sequence[str]) -> np.ndarray:
        """``score_text`` of each prompt."""
        return np.array([self.score_text(p) for p in prompts], np.float64)

    def embed_text(self, prompt: str) -> np.ndarray:
        """The prompt's mean-pooled sentence embedding (float32, not normalised), the input of the
        score's linear head. Raises ``EncoderError`` when the graph has no ``embedding`` output."""
        return self.score_and_embed(prompt)[1]

    def score_and_embed(self, prompt: str) -> tuple[float, np.ndarray]:
        """``score_text`` and ``embed_text`` of one prompt, from one run of the graph."""
        if not self.has_embedding:
            raise EncoderError(f"the length encoder {self.path} has no embedding output (exported before stop 32): "
                               "retrain it with lanes predictor train, or turn the neighbour memory off "
                               "(LANES_PREDICTOR_MEMORY_WEIGHT=0)")
        score, embedding = self._encode(prompt, embed=True)
        assert embedding is not None
        return score, embedding

    def describe(self) -> dict[str, Any]:
        """What a weights file records about this encoder."""
        return {"file": self.path.name, "sha256": self.sha256, "max_tokens": self.max_tokens,
                "num_layers": int(self.meta.get("num_layers", 0)),
                "training": json.loads(self.meta.get("training", "{}"))}


_LOADED: dict[tuple[str, str], Encoder] = {}
_LOADED_LOCK = threading.Lock()


def load_encoder(graph: Path, sha256: str | None = None) -> Encoder:
    """The encoder at ``graph``, loaded once per process and file content; ``sha256`` (when
    given) must match the file's. Raises ``EncoderError``."""
    try:
        resolved = graph.resolve(strict=True)
        actual = file_sha256(resolved)
    except OSError as exc:
        raise EncoderError(f"length encoder {graph} not found: {exc}") from exc
    if sha256 is not None and actual != sha256:
        raise EncoderError(f"length encoder {graph} has SHA-256 {actual[:12]}..., the weights were trained with "
                           f"{sha256[:12]}...: retrain them (lanes predictor train) or restore that encoder file")
    key = (str(resolved), actual)
    with _LOADED_LOCK:
        if key not in _LOADED:
            _LOADED[key] = Encoder(resolved, sha256=actual)
        return _LOADED[key]
