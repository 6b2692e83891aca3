"""How many workers a pool needs to keep its lane wait under a target (pure; the autoscaling signal).

Units: rates in requests per second, waits in seconds, counts in requests / workers.

    lambda = arrival_rps                   requests/s entering the pool's lanes
    mu     = service_rps_per_worker        requests/s one fully busy worker completes (measured)
    L      = depth                         requests waiting now
    T      = target_wait_s

By Little's law a request that arrives now waits about ``L / (n * mu)`` behind the ``L`` ahead of
it; keeping that under ``T`` while new arrivals keep coming needs a throughput of
``lambda + L / T`` (serve the arrivals and drain the backlog within ``T``)::

    need(n) = (1 + headroom) * (lambda + L / T) / mu        workers, a real number
    up      = ceil(need)                                     scale up to this at once
    down    = ceil(need * (1 + down_band))                   scale down only to this

Hysteresis: with ``current`` workers the answer is ``up`` when ``up > current``, ``down`` when
``down < current``, else ``current``. Between the two (a band of ``down_band`` of the load) the
answer does not move, so demand hovering near a boundary does not flap; KEDA / the HPA add a
time window on top (``deploy/keda/``). The result is clamped to ``[min_workers, max_workers]``,
and is at least 1 when anything waits or arrives. With no measured service rate yet
(``mu == 0``) it keeps ``current`` (or 1 from 0) rather than guess while anything arrives,
waits or runs; a pool where nothing does goes to ``min_workers``.

The answer is never 0 while requests wait, but a deployment cannot scale a pool from zero on it:
edges refuse a pool's chats while it has no live worker (``unavailable``), so nothing arrives to
scale on. Keep ``min_workers`` (and KEDA's ``minReplicaCount``) at 1 or more (``deploy/keda/``).
"""

from __future__ import annotations

import math


def _check(name: str, value: float, *, positive: bool = False) -> None:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


def capacity_per_worker(throughput_rps: float, running: float, slots: int, workers: int) -> float:
    """``mu``: requests/s one worker completes with all its slots busy, by Little's law on its slots.

    ``throughput_rps`` is what the pool's ``workers`` complete now (claims per second), with
    ``running`` requests in their ``slots`` on average. A request holds a slot for
    ``running / throughput`` seconds, so ``slots`` busy slots complete ``slots * throughput /
    running`` per second, spread over ``workers``. Measuring throughput alone would read a pool
    that keeps up at a fifth of its slots as full, and ask for more workers forever. 0 (unknown)
    when nothing runs or no worker reports.
    """
    for name, value in (("throughput_rps", throughput_rps), ("running", running), ("slots", slots),
                        ("workers", workers)):
        _check(name, value)
    if running <= 0 or workers == 0 or throughput_rps == 0:
        return 0.0
    capacity = throughput_rps * slots / running / workers
    return capacity if math.isfinite(capacity) else 0.0  # a level smoothed to a denormal


def predicted_wait_s(depth: int, service_rps_per_worker: float, workers: int) -> float:
    """Little's-law wait (s) of a request arriving behind ``depth`` others; inf with no capacity."""
    capacity_rps = service_rps_per_worker * workers
    if depth == 0:
        return 0.0
    return depth / capacity_rps if capacity_rps > 0 else math.inf


def desired_workers(
    arrival_rps: float,
    service_rps_per_worker: float,
    depth: int,
    target_wait_s: float,
    headroom: float,
    min_workers: int,
    max_workers: int,
    current: int,
    down_band: float = 0.25,
    running: float = 0.0,
) -> int:
    """Workers the pool should have (see the module docstring for the formula and hysteresis).
    ``running``: requests the pool runs now. With no capacity measured (nothing claimed lately),
    a pool where nothing arrives, waits or runs goes to ``min_workers``; one that is busy keeps
    its count. Before, an idle pool kept whatever it had (after a scheduler restart, for good).

    Raises ValueError for negative or non-finite inputs, ``target_wait_s <= 0``, or
    ``min_workers > max_workers``.
    """
    for name, value in (("arrival_rps", arrival_rps), ("service_rps_per_worker", service_rps_per_worker),
                        ("depth", depth), ("headroom", headroom), ("down_band", down_band),
                        ("min_workers", min_workers), ("current", current)):
        _check(name, value)
    _check("target_wait_s", target_wait_s, positive=True)
    if max_workers < min_workers:
        raise ValueError(f"max_workers ({max_workers}) < min_workers ({min_workers})")
    _check("running", running)
    busy = arrival_rps > 0 or depth > 0
    floor = max(min_workers, 1 if busy else 0)
    if service_rps_per_worker == 0:
        return min(max(current, floor) if busy or running > 0 else floor, max_workers)
    need = (1.0 + headroom) * (arrival_rps + depth / target_wait_s) / service_rps_per_worker
    # A hair of tolerance so that need == 3.0000000001 from float noise does not ask for 4.
    up = math.ceil(need - 1e-9)
    down = math.ceil(need * (1.0 + down_band) - 1e-9)
    if up > current:
        wanted = up
    elif down < current:
        wanted = down
    else:
        wanted = current
    return min(max(wanted, floor), max_workers)
