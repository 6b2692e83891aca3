"""Per-API-key request limits, sans-I/O: a token bucket (requests/s with a burst) and an
in-flight cap. Time and the key's current in-flight count are arguments, so the same code
runs in the edge and in tests without a loop or a clock.

The edge keeps one ``KeyLimiter`` per process, so by default the limits hold per edge: N edges
behind a load balancer let a key through at up to N times its rate. With
``LANES_RATE_LIMIT_SCOPE=fleet`` the rate lives in one Redis bucket per key instead (the same
arithmetic as ``take_token``, in ``queue/scripts.py: TAKE_TOKEN``).

Refusals (the ``error`` frame's ``code``)::

    Refusal
    ├── rate_limited        the key's bucket is empty; ``retry_after_ms`` says when a token is back
    └── too_many_in_flight  the key already has ``max_in_flight`` requests running or queued
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True)
class KeyLimits:
    """One key's limits; 0 switches a limit off."""

    #: Sustained requests per second the bucket refills at.
    rate_per_s: float = 0.0
    #: Bucket size: requests a key may send at once after being idle.
    burst: int = 1
    #: Requests of this key in flight at once, over all its connections on this edge.
    max_in_flight: int = 0
    #: WebSocket connections of this key open at once on this edge.
    max_connections: int = 0


UNLIMITED = KeyLimits()


class RefusalCode(StrEnum):
    RATE_LIMITED = "rate_limited"
    TOO_MANY_IN_FLIGHT = "too_many_in_flight"


@dataclass(frozen=True)
class Refusal:
    code: RefusalCode
    message: str
    #: When a retry can succeed (ms); None when that depends on other requests finishing.
    retry_after_ms: int | None = None

    def extra(self) -> dict[str, int]:
        """The error frame's fields beyond code and message."""
        return {} if self.retry_after_ms is None else {"retry_after_ms": self.retry_after_ms}


@dataclass(frozen=True)
class TokenBucket:
    #: Tokens left (fractional while refilling), at most the burst.
    tokens: float
    #: When ``tokens`` was computed (seconds, any monotonic clock).
    updated_at_s: float


def rate_limited(limits: KeyLimits, retry_after_ms: int) -> Refusal:
    """The refusal of a request over its key's rate, naming the rate, the burst and the wait
    (the same words whether the bucket is this edge's or the fleet's)."""
    return Refusal(RefusalCode.RATE_LIMITED,
                   f"this API key is limited to {limits.rate_per_s:g} requests/s (burst {limits.burst}); "
                   f"retry in {retry_after_ms} ms", retry_after_ms)


def take_token(bucket: TokenBucket | None, rate_per_s: float, burst: int, now_s: float) -> tuple[TokenBucket, float]:
    """Refill ``bucket`` up to ``now_s`` and take one token.

    Returns the new bucket and the wait (s) until a token is available: 0.0 means the token
    was taken; > 0 means refused and nothing was taken. A missing bucket starts full. A clock
    that steps back refills nothing (never a negative refill, never a free burst).
    """
    capacity = max(1, burst)
    if bucket is None:
        tokens = float(capacity)
    else:
        elapsed_s = max(0.0, now_s - bucket.updated_at_s)
        tokens = min(float(capacity), bucket.tokens + elapsed_s * rate_per_s)
    if tokens >= 1.0:
        return TokenBucket(tokens - 1.0, now_s), 0.0
    return TokenBucket(tokens, now_s), (1.0 - tokens) / rate_per_s


class KeyLimiter:
    """The buckets of the keys this edge has seen recently.

    A bucket that has refilled to its burst is the same as none (a missing bucket starts
    full), so such buckets are dropped: the dict holds only keys that sent a request within
    their refill time, not every key ever seen (revoked ones included), which grew for the
    edge's whole life where keys are created and revoked often. The sweep runs when the dict
    has doubled since the last one, so it costs O(1) per request amortised.
    """

    #: No sweep below this many buckets.
    MIN_SWEEP = 64

    def __init__(self) -> None:
        #: Per key: its bucket and when it will be full again (then it may be dropped).
        self._buckets: dict[str, tuple[TokenBucket, float]] = {}
        self._sweep_at = self.MIN_SWEEP

    def __len__(self) -> int:
        return len(self._buckets)

    def check(self, key: str, limits: KeyLimits, num_in_flight: int, now_s: float) -> Refusal | None:
        """Admit one new request of ``key`` (consuming a token) or say why not.

        ``num_in_flight`` counts the key's requests already in flight on this edge. The
        in-flight cap is checked first so a refused request never spends a token.
        """
        if limits.max_in_flight and num_in_flight >= limits.max_in_flight:
            return Refusal(RefusalCode.TOO_MANY_IN_FLIGHT,
                           f"this API key may have at most {limits.max_in_flight} requests in flight")
        if limits.rate_per_s <= 0:
            return None
        held = self._buckets.get(key)
        bucket, wait_s = take_token(None if held is None else held[0], limits.rate_per_s, limits.burst, now_s)
        full_at = now_s + (max(1, limits.burst) - bucket.tokens) / limits.rate_per_s
        self._buckets[key] = (bucket, full_at)
        if len(self._buckets) >= self._sweep_at:
            self._sweep(now_s)
        if wait_s == 0.0:
            return None
        return rate_limited(limits, max(1, math.ceil(wait_s * 1000)))

    def _sweep(self, now_s: float) -> None:
        """Drop the buckets that are full again by now."""
        self._buckets = {key: held for key, held in self._buckets.items() if held[1] > now_s}
        self._sweep_at = max(self.MIN_SWEEP, 2 * len(self._buckets))
