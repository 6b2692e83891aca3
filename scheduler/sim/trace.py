"""Request traces for the simulator: the Azure LLM inference CSVs and synthetic ones.

The Azure files (``TIMESTAMP,ContextTokens,GeneratedTokens``) carry arrival times and
token counts only, no prompt text. Files are read where they lie; nothing is copied.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order (parallel arrays)."""

    #: Arrival time relative to the first request, seconds.
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0

    @property
    def rate_rps(self) -> float:
        """Mean arrival rate (requests per second)."""
        return (len(self) - 1) / self.duration_s if self.duration_s > 0 else float("inf")

    def time_scaled(self, factor: float) -> Trace:
        """Arrivals ``factor`` times faster (``factor`` > 1 raises the load); tokens unchanged."""
        return Trace(self.arrival_s / factor, self.prompt_tokens, self.output_tokens)

    def all_at_once(self) -> Trace:
        """Every request arriving at 0, in trace order (measures saturation throughput)."""
        return Trace(np.zeros_like(self.arrival_s), self.prompt_tokens, self.output_tokens)


def _parse_time(text: str) -> float:
    # 7 fractional digits; datetime takes at most 6.
    head, _, frac = text.strip().partition(".")
    base = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


def load_azure_csv(path: str | Path) -> Trace:
    """Load an Azure LLM inference trace CSV; raises ``ValueError`` on a malformed file."""
    arrival, prompt, output = [], [], []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}")
        for line, row in enumerate(reader, start=2):
            try:
                arrival.append(_parse_time(row["TIMESTAMP"]))
                prompt.append(int(row["ContextTokens"]))
                output.append(int(row["GeneratedTokens"]))
            except (TypeError, ValueError) as exc:  # a short row gives None, a bad one text
                raise ValueError(f"{path}, line {line}: {exc}") from None
    if not arrival:
        raise ValueError(f"{path}: no requests")
    times = np.asarray(arrival, dtype=float)
    outputs = np.maximum(np.asarray(output, dtype=np.int64), 1)
    return Trace(times - times[0], np.asarray(prompt, dtype=np.int64), outputs)


def synthetic(arrival_s: list[float], prompt_tokens: list[int], output_tokens: list[int]) -> Trace:
    """A hand-built trace (tests, examples)."""
    return Trace(np.asarray(arrival_s, dtype=float), np.asarray(prompt_tokens, dtype=np.int64),
                 np.asarray(output_tokens, dtype=np.int64))
