"""The predictor's data set: prompts with the answer lengths of one or more models, by source.

One derived file (``benchmarks/data/predictor/prompts.jsonl.gz``, built by ``lanes predictor
build-data`` from public files, see docs/predictor-data.md) holds one JSON object per line::

    {"prompt": str, "source": str, "lengths": {answering model: output tokens (Llama-3 BPE)}}

A prompt answered by several models is labelled with the median of their lengths (in
log(1 + tokens), the least noisy single label); ``Example.lengths`` keeps every model's length so
that evaluation can also score against one model's answers.

Pure apart from the explicit ``read_examples`` / ``write_examples``.
"""

from __future__ import annotations

import gzip
import io
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Where the builder writes the training set and the held-out prompt pool (repo-relative).
DATA_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "data"
DEFAULT_DATASET_PATH = DATA_DIR / "predictor" / "prompts.jsonl.gz"
DEFAULT_POOL_PATH = DATA_DIR / "prompt_pool.json"
#: The source kept out of the shipped weights: the simulator's default prompt pool.
HELD_OUT_SOURCE = "alpaca_eval/oasst"
#: Every source kept out of the shipped weights: the pool's, and IFEval (prompts with explicit
#: format and length constraints), each a check on prompts of a source the weights never saw.
HELD_OUT_SOURCES = (HELD_OUT_SOURCE, "ifeval")


@dataclass(frozen=True)
class Example:
    """One prompt and its answer lengths (output tokens) by answering model."""

    prompt: str
    source: str
    lengths: dict[str, int]

    @property
    def output_tokens(self) -> int:
        """The label: median over models in log(1 + tokens), rounded to tokens."""
        return median_tokens(list(self.lengths.values()))


def median_tokens(lengths: Sequence[int]) -> int:
    """round(expm1(median(log1p(lengths)))). Raises ValueError on an empty or negative list."""
    if not lengths or min(lengths) < 0:
        raise ValueError(f"need one or more non-negative lengths, got {list(lengths)!r}")
    return round(math.expm1(float(np.median(np.log1p(np.asarray(lengths, dtype=np.float64))))))


def _gzip_bytes(text: str) -> bytes:
    # mtime 0 and no file name: the same examples always give the same bytes.
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as out:
        out.write(text.encode())
    return buffer.getvalue()


def write_examples(examples: Iterable[Example], path: Path) -> None:
    """Write ``examples`` as gzipped JSON lines (byte-reproducible)."""
    lines = (
        json.dumps({"prompt": e.prompt, "source": e.source, "lengths": dict(sorted(e.lengths.items()))},
                   ensure_ascii=False)
        for e in examples
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_gzip_bytes("".join(line + "\n" for line in lines)))


def read_examples(path: Path) -> list[Example]:
    """Read a file written by ``write_examples``. Raises ValueError naming the bad line."""
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        return [example_from_record(line, f"{path}:{number}") for number, line in enumerate(lines, 1)]


def example_from_record(record: object, where: str) -> Example:
    """One line of a ``write_examples`` file, as text or parsed; ValueError naming ``where`` when
    malformed."""
    try:
        if isinstance(record, str):
            record = json.loads(record)
        lengths = {str(k): int(v) for k, v in record["lengths"].items()}  # type: ignore[index]
        example = Example(str(record["prompt"]), str(record["source"]), lengths)  # type: ignore[index]
        if not lengths or min(lengths.values()) < 0:
            raise ValueError("lengths must be a non-empty map of non-negative token counts")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{where}: bad example: {exc}") from exc
    return example


def sources(examples: Sequence[Example]) -> list[str]:
    """Distinct sources, sorted."""
    return sorted({e.source for e in examples})
