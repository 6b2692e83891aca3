"""Mergeable latency histograms with log-spaced buckets (pure).

Percentiles cannot be averaged, so edges do not ship their own p99s: each ships a histogram
whose bucket ``i`` counts samples in ``(MIN_MS * GROWTH**(i-1), MIN_MS * GROWTH**i]``, and
histograms from any number of edges and seconds merge by adding counts. A percentile read back
is the bucket's geometric middle, within ``GROWTH ** 0.5 - 1`` (2 %) of a sample in it, at
any scale from 0.1 ms to hours, in at most ~470 buckets (a few dozen in practice).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

#: Upper bound of bucket 0 (ms): anything at or below it counts there.
MIN_MS = 0.1
#: Ratio between consecutive bucket bounds.
GROWTH = 1.04
#: Samples above this (ms) count in the last bucket.
MAX_MS = 1e7
_LOG_GROWTH = math.log(GROWTH)
MAX_BUCKET = math.ceil(math.log(MAX_MS / MIN_MS) / _LOG_GROWTH)


def bucket_of(value_ms: float) -> int:
    """The bucket a sample (ms) falls in; NaN and negatives count as 0 ms."""
    if not value_ms > MIN_MS:  # also NaN
        return 0
    if value_ms >= MAX_MS:
        return MAX_BUCKET
    return min(MAX_BUCKET, math.ceil(math.log(value_ms / MIN_MS) / _LOG_GROWTH - 1e-12))


def bucket_value(bucket: int) -> float:
    """The value (ms) a bucket stands for: the geometric middle of its bounds."""
    if bucket <= 0:
        return MIN_MS
    return MIN_MS * GROWTH ** (bucket - 0.5)


def merge(histograms: Iterable[Mapping[int, int]]) -> dict[int, int]:
    """One histogram counting every sample of ``histograms``."""
    merged: dict[int, int] = {}
    for histogram in histograms:
        for bucket, count in histogram.items():
            merged[bucket] = merged.get(bucket, 0) + count
    return merged


def percentile(histogram: Mapping[int, int], q: float) -> float | None:
    """The ``q`` quantile (0 < q <= 1) by nearest rank, None for an empty histogram."""
    if not 0 < q <= 1:
        raise ValueError(f"quantile must be in (0, 1], got {q!r}")
    total = sum(count for count in histogram.values() if count > 0)
    if total == 0:
        return None
    rank = math.ceil(q * total)
    seen = 0
    for bucket in sorted(histogram):
        seen += max(0, histogram[bucket])
        if seen >= rank:
            return round(bucket_value(bucket), 3)
    raise AssertionError("unreachable: rank <= total")
