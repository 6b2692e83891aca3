"""desired_workers: Little's law with headroom, hysteresis, clamps and bad input (pure, no loop)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lanes.scheduler.autoscale import desired_workers, predicted_wait_s

BASE = dict(target_wait_s=1.0, headroom=0.0, min_workers=0, max_workers=100, current=0)


def want(arrival_rps: float, mu: float, depth: int = 0, **overrides: float) -> int:
    return desired_workers(arrival_rps, mu, depth, **{**BASE, **overrides})  # type: ignore[arg-type]


def test_steady_load_needs_arrivals_over_service_rate() -> None:
    # 10 req/s, one worker completes 2 req/s: 5 workers keep up, none waiting.
    assert want(10.0, 2.0) == 5
    assert want(10.5, 2.0) == 6  # 5.25 workers of load rounds up


def test_backlog_is_drained_within_the_target_wait() -> None:
    # 30 waiting, 3 s target: 10 req/s extra throughput on top of the 10 req/s arriving.
    assert want(10.0, 2.0, depth=30, target_wait_s=3.0) == 10
    # The result keeps the predicted wait of a newcomer under the target.
    assert predicted_wait_s(30, 2.0, 10) <= 3.0


def test_headroom_scales_the_need() -> None:
    assert want(10.0, 2.0, headroom=0.2) == 6  # 5 * 1.2


def test_scale_up_is_immediate_scale_down_waits_for_the_band() -> None:
    # need 5.0: at 8 workers, down = ceil(5 * 1.25) = 7 < 8 -> scale down to 7, not to 5.
    assert want(10.0, 2.0, current=8) == 7
    # At 6 workers the band holds: down = 7 >= 6, up = 5 <= 6 -> stay.
    assert want(10.0, 2.0, current=6) == 6
    # Load rising to need 6.5 moves up at once.
    assert want(13.0, 2.0, current=6) == 7


def test_demand_oscillating_inside_the_band_does_not_flap() -> None:
    current = 5
    history = []
    for arrival_rps in [9.0, 10.0, 8.5, 9.8, 8.2, 10.0, 9.1] * 3:  # need between 4.1 and 5.0
        current = want(arrival_rps, 2.0, current=current)
        history.append(current)
    assert set(history) == {5}


def test_clamps_to_min_and_max() -> None:
    assert want(0.0, 2.0, min_workers=2) == 2
    assert want(1000.0, 2.0, max_workers=8) == 8
    assert want(20.0, 2.0, current=20, max_workers=8) == 8  # down to 13, clamped


def test_scale_to_zero_and_back_from_zero() -> None:
    assert want(0.0, 2.0, current=3) == 0
    assert want(0.0, 2.0, depth=1, current=0) == 1
    assert want(0.1, 2.0, current=0) == 1


def test_unmeasured_service_rate_keeps_current_or_starts_one() -> None:
    assert want(5.0, 0.0, current=4) == 4
    assert want(5.0, 0.0, current=0) == 1
    assert want(0.0, 0.0, current=0) == 0


@pytest.mark.parametrize("bad", [
    dict(arrival_rps=-1.0), dict(service_rps_per_worker=math.nan), dict(depth=-1),
    dict(target_wait_s=0.0), dict(headroom=-0.1), dict(min_workers=5, max_workers=2),
    dict(arrival_rps=math.inf),
])
def test_bad_input_is_a_clear_error(bad: dict[str, float]) -> None:
    args = dict(arrival_rps=1.0, service_rps_per_worker=1.0, depth=0, **BASE) | bad
    with pytest.raises(ValueError, match=next(iter(bad)) if "max_workers" not in bad else "max_workers"):
        desired_workers(**args)  # type: ignore[arg-type]


def test_predicted_wait() -> None:
    assert predicted_wait_s(0, 0.0, 0) == 0.0
    assert predicted_wait_s(10, 2.0, 5) == 1.0
    assert predicted_wait_s(10, 2.0, 0) == math.inf


@given(
    arrival_rps=st.floats(0, 500), mu=st.floats(0.01, 50), depth=st.integers(0, 10_000),
    target_wait_s=st.floats(0.05, 60), headroom=st.floats(0, 1), current=st.integers(0, 200),
)
def test_bounds_and_no_overshoot(arrival_rps: float, mu: float, depth: int, target_wait_s: float,
                                 headroom: float, current: int) -> None:
    n = desired_workers(arrival_rps, mu, depth, target_wait_s, headroom, 1, 150, current)
    assert 1 <= n <= 150
    need = (1 + headroom) * (arrival_rps + depth / target_wait_s) / mu
    if n < 150:
        # Enough capacity whenever the clamp allows it: the wait target holds.
        assert n >= need - 1e-6
        assert predicted_wait_s(depth, mu, n) <= target_wait_s * (1 + 1e-9)
    # Never more than the band above the need (or the current count, or the floor).
    assert n <= max(math.ceil(need * 1.25), current, 1)
