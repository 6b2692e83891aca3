"""The per-key token bucket and in-flight cap, pure: time is an argument, no loop, no Redis."""

from __future__ import annotations

import pytest

from lanes.ws_server.ratelimit import UNLIMITED, KeyLimiter, KeyLimits, RefusalCode, take_token


def test_a_fresh_bucket_allows_the_burst_then_refuses() -> None:
    limiter, limits = KeyLimiter(), KeyLimits(rate_per_s=2.0, burst=3)
    assert [limiter.check("k", limits, 0, now_s=100.0) for _ in range(3)] == [None, None, None]
    refusal = limiter.check("k", limits, 0, now_s=100.0)
    assert refusal is not None and refusal.code is RefusalCode.RATE_LIMITED
    assert refusal.retry_after_ms == 500, "one token back after 1/rate = 0.5 s"


def test_retry_after_is_exact_and_a_retry_at_that_time_succeeds() -> None:
    limiter, limits = KeyLimiter(), KeyLimits(rate_per_s=4.0, burst=1)
    assert limiter.check("k", limits, 0, now_s=0.0) is None
    refusal = limiter.check("k", limits, 0, now_s=0.1)  # 0.4 tokens refilled: 0.15 s to go
    assert refusal is not None and refusal.retry_after_ms == 150
    assert limiter.check("k", limits, 0, now_s=0.1 + 0.150) is None
    assert limiter.check("k", limits, 0, now_s=0.25) is not None


def test_sustained_rate_equals_rate_per_s() -> None:
    limiter, limits = KeyLimiter(), KeyLimits(rate_per_s=5.0, burst=5)
    admitted = sum(limiter.check("k", limits, 0, now_s=i * 0.01) is None for i in range(1000))  # 10 s, 100/s
    assert admitted == 5 + 5 * 10 - 1 or admitted == 5 + 5 * 10, admitted  # burst + rate x 10 s (edge rounding)


def test_refill_is_capped_at_the_burst() -> None:
    limiter, limits = KeyLimiter(), KeyLimits(rate_per_s=10.0, burst=2)
    assert limiter.check("k", limits, 0, now_s=0.0) is None
    # an hour idle earns at most `burst` tokens
    results = [limiter.check("k", limits, 0, now_s=3600.0) for _ in range(3)]
    assert results[:2] == [None, None] and results[2] is not None


def test_keys_have_separate_buckets() -> None:
    limiter, limits = KeyLimiter(), KeyLimits(rate_per_s=1.0, burst=1)
    assert limiter.check("a", limits, 0, now_s=0.0) is None
    assert limiter.check("a", limits, 0, now_s=0.0) is not None
    assert limiter.check("b", limits, 0, now_s=0.0) is None


def test_a_clock_stepping_back_refills_nothing() -> None:
    bucket, wait_s = take_token(None, rate_per_s=1.0, burst=1, now_s=50.0)
    assert wait_s == 0.0 and bucket.tokens == 0.0
    bucket, wait_s = take_token(bucket, rate_per_s=1.0, burst=1, now_s=10.0)
    assert wait_s == pytest.approx(1.0) and bucket.tokens == 0.0


def test_in_flight_cap_refuses_without_spending_a_token() -> None:
    limiter, limits = KeyLimiter(), KeyLimits(rate_per_s=1.0, burst=1, max_in_flight=2)
    refusal = limiter.check("k", limits, num_in_flight=2, now_s=0.0)
    assert refusal is not None and refusal.code is RefusalCode.TOO_MANY_IN_FLIGHT
    assert refusal.retry_after_ms is None, "depends on other requests finishing, not on time"
    assert limiter.check("k", limits, num_in_flight=1, now_s=0.0) is None, "the token was still there"


def test_zero_switches_limits_off() -> None:
    limiter = KeyLimiter()
    assert all(limiter.check("k", UNLIMITED, num_in_flight=10_000, now_s=0.0) is None for _ in range(10_000))
    only_cap = KeyLimits(rate_per_s=0.0, max_in_flight=1)
    assert limiter.check("k", only_cap, 0, now_s=0.0) is None
    assert limiter.check("k", only_cap, 1, now_s=0.0) is not None


def test_fractional_rates_below_one_per_second() -> None:
    limiter, limits = KeyLimiter(), KeyLimits(rate_per_s=0.1, burst=1)
    assert limiter.check("k", limits, 0, now_s=0.0) is None
    refusal = limiter.check("k", limits, 0, now_s=1.0)
    assert refusal is not None and refusal.retry_after_ms == 9000


def test_a_key_whose_bucket_is_full_again_is_forgotten() -> None:
    """Buckets of keys seen once (keys created and revoked all day) do not pile up: a bucket
    refilled to its burst is dropped, which changes no decision (a missing bucket is full)."""
    limiter = KeyLimiter()
    limits = KeyLimits(rate_per_s=2.0, burst=3)
    for i in range(1000):  # one request per key, a millisecond apart
        assert limiter.check(f"once-{i}", limits, 0, now_s=i / 1000) is None
    assert len(limiter) < 1000, "keys whose buckets refilled (1 s after their request) are gone"
    assert limiter.check("late", limits, 0, now_s=10.0) is None
    for i in range(200):  # the next sweep, once they are all full again
        limiter.check(f"later-{i}", limits, 0, now_s=10.0)
    assert len(limiter) <= 202
    # A busy key keeps its bucket and its refusals, sweep or not.
    for _ in range(3):
        assert limiter.check("busy", limits, 0, now_s=20.0) is None
    for i in range(KeyLimiter.MIN_SWEEP * 4):
        limiter.check(f"crowd-{i}", limits, 0, now_s=20.0)
    refused = limiter.check("busy", limits, 0, now_s=20.1)
    assert refused is not None and refused.code == RefusalCode.RATE_LIMITED and refused.retry_after_ms == 400
    assert limiter.check("busy", limits, 0, now_s=20.5) is None, "the refill it had"


def test_fifty_concurrent_requests_of_one_key_get_the_burst_and_the_refill_of_their_spread() -> None:
    """Investigated: 21 of 50 concurrent streams of one key got 429 under the defaults (10/s,
    burst 20). That is the bucket as documented: 20 at once, then one per 100 ms. Live, 50
    streams sent within 15 ms got 20 through; sent over 0.88 s, 28 (this arithmetic, to a
    token). Every request spends one token, whatever connection it comes on."""
    defaults = KeyLimits(rate_per_s=10, burst=20, max_in_flight=32)
    at_once = KeyLimiter()
    refused = [at_once.check("k", defaults, 0, 0.0) for _ in range(50)]
    assert sum(r is None for r in refused) == 20
    spread = KeyLimiter()
    over_900_ms = [spread.check("k", defaults, 0, 0.9 * i / 49) for i in range(50)]
    assert sum(r is None for r in over_900_ms) == 29, "20 + 10/s x 0.9 s: 21 of 50 refused"
    first = next(r for r in over_900_ms if r is not None)
    assert first.code is RefusalCode.RATE_LIMITED and 0 < first.retry_after_ms <= 100
    assert first.message == (f"this API key is limited to 10 requests/s (burst 20); retry in {first.retry_after_ms} ms")
