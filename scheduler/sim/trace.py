"""Request traces for the simulator: public production traces and synthetic ones.

Three public formats are read, each carrying arrival times and token counts only, no text
(``load_trace`` tells them apart by their content):

- Azure LLM inference traces 2023/2024 (CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``);
- BurstGPT (CSV ``Timestamp,...,Request tokens,Response tokens,...``, seconds; rows whose
  ``Response tokens`` is 0 are failed requests without an answer and are left out);
- Mooncake / Kimi FAST'25 (JSONL ``{"timestamp": ms, "input_length", "output_length", ...}``).

Token counts must be whole numbers (``812`` or ``812.0``): a row with ``812.9`` is refused,
naming the file, line and column, rather than rounded or cut to 812. A fraction says the file is
not a trace of token counts (averaged, rescaled, the wrong column) and the simulation would
quietly run another workload.

Files are read where they lie; nothing is copied. Requests logged at the same instant (coarse
timestamps: Mooncake's are mostly whole seconds, BurstGPT's are seconds) are spread over the gap
to the next timestamp (``spread_ties``).
"""

from __future__ import annotations

import csv
import gzip
import json
import zlib
from collections.abc import Callable, Iterable
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
        if not 0 < factor < float("inf"):  # a trace without a rate: every arrival would be NaN
            raise ValueError(f"cannot scale a trace's time by {factor} (it needs two distinct arrival times)")
        return Trace(self.arrival_s / factor, self.prompt_tokens, self.output_tokens)

    def all_at_once(self) -> Trace:
        """Every request arriving at 0, in trace order (measures saturation throughput)."""
        return Trace(np.zeros_like(self.arrival_s), self.prompt_tokens, self.output_tokens)


def _parse_time(text: str) -> float:
    # 7 fractional digits; datetime takes at most 6.
    head, _, frac = text.strip().partition(".")
    base = datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()
    return base + (float("0." + frac) if frac else 0.0)


#: What each format's file must hold (named in errors).
TRACE_FORMATS = {
    "azure": "an Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)",
    "burstgpt": "a BurstGPT CSV (Timestamp, Request tokens, Response tokens)",
    "mooncake": 'a Mooncake JSONL trace ({"timestamp": ms, "input_length", "output_length"} per line)',
}
_AZURE_COLUMNS = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
_BURSTGPT_COLUMNS = {"Timestamp", "Request tokens", "Response tokens"}


@dataclass(frozen=True)
class LoadedTrace:
    trace: Trace
    #: A key of ``TRACE_FORMATS``.
    format: str
    #: Rows left out: BurstGPT's failed requests (0 response tokens).
    skipped: int = 0
    #: Requests that shared their timestamp with an earlier one and were spread (``spread_ties``).
    spread: int = 0


def load_trace(path: str | Path) -> LoadedTrace:
    """Load a trace in any of ``TRACE_FORMATS``, told apart by content (a JSON object on the
    first line, else the CSV header). Requests are put in arrival order (stable) and their
    times made relative to the first. A gzipped file is read as it is (the public traces ship
    as ``.csv.gz``). Raises ``ValueError`` naming the file, line and problem, also for text
    that is not UTF-8 or a gzip stream that is cut short (a traceback before, or a bare
    "'utf-8' codec can't decode byte 0x8b" that named neither the file nor gzip)."""
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == b"\x1f\x8b"  # whatever the name says
    try:
        with (gzip.open(path, "rt", newline="", encoding="utf-8") if gzipped
              else open(path, newline="", encoding="utf-8")) as f:
            first = f.readline()
            f.seek(0)
            if first.lstrip().startswith("{"):
                return _finish(path, "mooncake", *_read_mooncake(path, f))
            reader = csv.DictReader(f)
            columns = set(reader.fieldnames or ())
            if _AZURE_COLUMNS <= columns:
                return _finish(path, "azure", *_read_rows(path, reader, "TIMESTAMP", _parse_time, "ContextTokens",
                                                          "GeneratedTokens", skip_zero=False))
            if _BURSTGPT_COLUMNS <= columns:
                return _finish(path, "burstgpt", *_read_rows(path, reader, "Timestamp", float, "Request tokens",
                                                             "Response tokens", skip_zero=True))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x}: {exc.reason}): a trace is "
                         "a CSV or JSON lines file, gzipped or not") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"{path}: the gzip data is damaged or cut short ({exc}): copy or download it "
                         "again") from None
    raise ValueError(f"{path}: not a trace format lanes reads (its first line: {first.strip()[:80]!r}); expected "
                     + "; or ".join(TRACE_FORMATS.values()))


class BadTokenCount(ValueError):
    """A token count that is not a whole number (``str()`` is the whole message)."""


def token_count(value: object, field: str) -> int:
    """``value`` as a whole number of tokens: an integer, or a number or numeric text with no
    fraction (``"812"``, ``812.0``). Raises ``BadTokenCount`` naming ``field`` otherwise (a
    fraction, a boolean, text that is no number); a negative count passes (``_finish`` refuses
    it with the request's number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise BadTokenCount(f"{field} {value!r} is not a number of tokens")
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except ValueError:
        raise BadTokenCount(f"{field} {value!r} is not a number of tokens") from None
    if not number.is_integer():  # also inf and NaN
        raise BadTokenCount(f"{field} {value!r} is not a whole number of tokens")
    return int(number)


def _read_rows(path: str | Path, reader: csv.DictReader, time_col: str, parse_time: Callable[[str], float],
               prompt_col: str, output_col: str, skip_zero: bool) -> tuple[list[float], list[int], list[int], int]:
    arrival, prompt, output, skipped = [], [], [], 0
    for line, row in enumerate(reader, start=2):
        try:
            tokens = token_count(row[output_col], output_col)
            if skip_zero and tokens == 0:
                skipped += 1
                continue
            arrival.append(float(parse_time(row[time_col])))
            prompt.append(token_count(row[prompt_col], prompt_col))
            output.append(tokens)
        except (TypeError, ValueError, OverflowError) as exc:  # a short row gives None, a bad one text, 1e400 inf
            raise ValueError(f"{path}, line {line}: {exc}") from None
    return arrival, prompt, output, skipped


def _read_mooncake(path: str | Path, lines: Iterable[str]) -> tuple[list[float], list[int], list[int], int]:
    arrival, prompt, output = [], [], []
    for line, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
            arrival.append(float(row["timestamp"]) / 1000.0)
            prompt.append(token_count(row["input_length"], "input_length"))
            output.append(token_count(row["output_length"], "output_length"))
        except BadTokenCount as exc:
            raise ValueError(f"{path}, line {line}: {exc}") from None
        except (TypeError, ValueError, KeyError, OverflowError) as exc:
            raise ValueError(f"{path}, line {line}: {exc!r}") from None
    return arrival, prompt, output, 0


def _finish(path: str | Path, fmt: str, arrival: list[float], prompt: list[int], output: list[int],
            skipped: int) -> LoadedTrace:
    if not arrival:
        raise ValueError(f"{path}: no requests" + (f" ({skipped} failed rows without an answer)" if skipped else ""))
    times = np.asarray(arrival, dtype=float)
    bad = np.flatnonzero(~np.isfinite(times) | (np.asarray(prompt) < 0) | (np.asarray(output) < 0))
    if len(bad):
        raise ValueError(f"{path}: request {bad[0] + 1} has a time that is not a number or a negative token count")
    if len(np.unique(times)) < 2:
        raise ValueError(f"{path}: all {len(times)} request(s) arrive at one time: a trace needs two arrival times "
                         "at least, for a rate to scale to --load")
    order = np.argsort(times, kind="stable")
    times = times[order]
    num_tied = int(np.count_nonzero(np.diff(times) == 0))
    times = spread_ties(times)
    outputs = np.maximum(np.asarray(output, dtype=np.int64)[order], 1)
    return LoadedTrace(Trace(times - times[0], np.asarray(prompt, dtype=np.int64)[order], outputs), fmt, skipped,
                       num_tied)


def spread_ties(times: np.ndarray) -> np.ndarray:
    """Sorted arrival times with each run of equal ones spread evenly over the gap to the next
    distinct time (the last run over the median gap between distinct times), in file order.

    A trace logged at coarse resolution puts several requests at the same instant, a burst the
    real traffic did not have: on Mooncake's conversation trace (90 % of rows share their
    timestamp) FCFS's short TTFT P99 at rho 0.5 is 28.9 s as logged and 13.4 s spread, and any
    policy that reorders simultaneous arrivals (lanes pop the short lane first on a tie) gains
    or loses on an artifact. Times without ties come back unchanged.
    """
    distinct, first, counts = np.unique(times, return_index=True, return_counts=True)
    if len(distinct) == len(times):
        return times
    gaps = np.diff(distinct)
    last_gap = float(np.median(gaps)) if len(gaps) else 0.0
    span = np.append(gaps, last_gap)
    within = np.arange(len(times)) - np.repeat(first, counts)  # position inside its run
    return times + (within / np.repeat(counts, counts)) * np.repeat(span, counts)


def synthetic(arrival_s: list[float], prompt_tokens: list[int], output_tokens: list[int]) -> Trace:
    """A hand-built trace (tests, examples)."""
    return Trace(np.asarray(arrival_s, dtype=float), np.asarray(prompt_tokens, dtype=np.int64),
                 np.asarray(output_tokens, dtype=np.int64))
