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
    """The buckets of every key seen by this edge.

    Only authenticated keys get a bucket, and keys are created by operators, so the dict is
    bounded by the number of issued keys, not by what clients send.
    """

    def __init__(self) -> None:
        self._buckets: dict[str, TokenBucket] = {}

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
        bucket, wait_s = take_token(self._buckets.get(key), limits.rate_per_s, limits.burst, now_s)
        self._buckets[key] = bucket
        if wait_s == 0.0:
            return None
        retry_after_ms = max(1, math.ceil(wait_s * 1000))
        return Refusal(RefusalCode.RATE_LIMITED,
                       f"this API key is limited to {limits.rate_per_s:g} requests/s (burst {limits.burst}); "
                       f"retry in {retry_after_ms} ms", retry_after_ms)
