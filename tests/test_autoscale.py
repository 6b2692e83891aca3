"""desired_workers: Little's law with headroom, hysteresis, clamps and bad input (pure, no loop)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lanes.scheduler.autoscale import (
    capacity_per_worker,
    desired_workers,
    predicted_wait_s,
)

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


def test_an_idle_pool_with_nothing_measured_goes_to_the_minimum() -> None:
    """Nothing arrives, waits or runs, and nothing was claimed lately (a scheduler just
    restarted, or a long idle): the pool needs its minimum. Before, it kept its count (3) for
    good; a pool still running requests keeps it."""
    assert want(0.0, 0.0, current=3) == 0
    assert want(0.0, 0.0, current=3, min_workers=1) == 1
    assert want(0.0, 0.0, current=3, running=2) == 3


def test_an_idle_pools_rates_decay_to_zero() -> None:
    """Rounded at every step, an idle pool's smoothed rate stuck at a few thousandths; the
    running level decayed into denormals, which made the capacity overflow."""
    from lanes.scheduler.service import ServiceRates, Smoothed

    rates, level = ServiceRates(), Smoothed()
    rates.update({"short": 0}, 0)
    level.update(3.0, 0)
    rates.update({"short": 50}, 1000)
    for second in range(2, 3600):
        rps = rates.update({"short": 50}, second * 1000)
        busy = level.update(0.0, second * 1000)
    assert rps == {"short": 0.0} and busy == 0.0


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


def test_capacity_per_worker_scales_throughput_to_all_slots() -> None:
    # 2 workers x 8 slots complete 1 request/s with 2 running: a request holds a slot 2 s,
    # so a full worker completes 8 / 2 = 4 per second.
    assert capacity_per_worker(1.0, 2.0, 16, 2) == pytest.approx(4.0)
    # Unknown (keep the current count) when nothing runs, nothing completes or no worker reports.
    assert capacity_per_worker(1.0, 0.0, 16, 2) == 0.0
    assert capacity_per_worker(0.0, 3.0, 16, 2) == 0.0
    assert capacity_per_worker(1.0, 2.0, 0, 0) == 0.0
    with pytest.raises(ValueError, match="running"):
        capacity_per_worker(1.0, -1.0, 8, 1)


@pytest.mark.parametrize("workers", [1, 2, 5])
@pytest.mark.parametrize("occupancy", [0.05, 0.3, 0.6])
def test_a_pool_that_keeps_up_below_its_slots_is_not_grown(workers: int, occupancy: float) -> None:
    """The signal fed back to itself (KEDA adds what it asks for): a pool that serves its arrivals
    with slots to spare stays put or shrinks, however often it is asked. Throughput alone as the
    capacity (claims per second per worker) read every such pool as full and grew it by the
    headroom each round, up to the maximum."""
    slots_per_worker, hold_s = 8, 2.0
    arrival_rps = occupancy * workers * slots_per_worker / hold_s
    current = workers
    for _ in range(10):
        running = arrival_rps * hold_s                      # Little's law: the pool keeps up
        mu = capacity_per_worker(arrival_rps, running, slots_per_worker * current, current)
        settings = {**BASE, "headroom": 0.2, "current": current}
        current = desired_workers(arrival_rps, mu, 0, **settings)  # type: ignore[arg-type]
    assert 1 <= current <= workers
    # What the scheduler measured before: mu = throughput per worker, grown by the headroom each round.
    assert desired_workers(arrival_rps, arrival_rps / workers, 0,
                           **{**BASE, "headroom": 0.2, "current": workers}) > workers  # type: ignore[arg-type]


def test_a_full_pool_with_a_backlog_is_grown() -> None:
    # 4 workers x 8 slots all busy, requests held 2 s (16/s), 20/s arriving and 100 waiting.
    mu = capacity_per_worker(16.0, 32.0, 32, 4)
    assert mu == pytest.approx(4.0)
    assert desired_workers(20.0, mu, 100, **{**BASE, "current": 4}) > 4  # type: ignore[arg-type]


@pytest.mark.parametrize(("values", "named"), [
    ({"target_wait_s": 0}, "LANES_TARGET_WAIT_S=0: Input should be greater than 0"),
    ({"target_wait_s": -1}, "LANES_TARGET_WAIT_S=-1: Input should be greater than 0"),
    ({"target_wait_s": "inf"}, "LANES_TARGET_WAIT_S='inf': Input should be a finite number"),
    ({"autoscale_headroom": -1}, "LANES_AUTOSCALE_HEADROOM=-1: Input should be greater than or equal to 0"),
    ({"max_workers": -1}, "LANES_MAX_WORKERS=-1: Input should be greater than or equal to 1"),
    ({"max_workers": 0}, "LANES_MAX_WORKERS=0: Input should be greater than or equal to 1"),
    ({"min_workers": 100}, "LANES_MAX_WORKERS (64) is below LANES_MIN_WORKERS (100)"),
    ({"reap_interval_s": 0}, "LANES_REAP_INTERVAL_S=0: Input should be greater than 0"),
    ({"reap_interval_s": -1}, "LANES_REAP_INTERVAL_S=-1: Input should be greater than 0"),
    ({"depth_interval_s": 0}, "LANES_DEPTH_INTERVAL_S=0: Input should be greater than 0"),
    ({"depth_interval_s": "nan"}, "LANES_DEPTH_INTERVAL_S='nan': Input should be a finite number"),
    ({"no_worker_timeout_s": "nan"}, "LANES_NO_WORKER_TIMEOUT_S='nan': Input should be a finite number"),
])
def test_scheduler_settings_that_would_crash_or_spin_are_refused_at_start(values: dict[str, object],
                                                                         named: str) -> None:
    """Each was accepted: the autoscaling ones crashed the scheduler at its first snapshot (a
    traceback from ``desired_workers``, exit 1), the intervals made its loops spin."""
    from pydantic import ValidationError

    from lanes.cli.failures import settings_error
    from lanes.scheduler.settings import SchedulerSettings

    with pytest.raises(ValidationError) as refused:
        SchedulerSettings(_env_file=None, **values)  # type: ignore[arg-type]
    assert named in (settings_error(refused.value) or ""), settings_error(refused.value)


def test_scheduler_settings_at_their_edges_still_pass() -> None:
    from lanes.scheduler.settings import SchedulerSettings

    SchedulerSettings(_env_file=None)
    SchedulerSettings(_env_file=None, min_workers=0, max_workers=1, autoscale_headroom=0, no_worker_timeout_s=0)
    SchedulerSettings(_env_file=None, min_workers=5, max_workers=5, target_wait_s=0.01, reap_interval_s=0.01)
