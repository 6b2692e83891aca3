"""Run policies over a trace at an offered load: the simulator's front door (CLI, notebooks)."""

from __future__ import annotations

from typing import Any

from lanes.scheduler.costmodel import CostProfile
from lanes.scheduler.simmetrics import summarize
from lanes.scheduler.simpolicies import LanesTuning, SimPolicy, make_policy
from lanes.scheduler.simulator import EngineConfig, SimResult, simulate
from lanes.scheduler.trace import Trace


def run_policy(trace: Trace, policy: SimPolicy, engine: EngineConfig, num_workers: int) -> SimResult:
    return simulate(trace, policy.lane_of, policy.slot_config, engine, queue_key=policy.queue_key,
                    age_from_key=policy.age_from_key, num_workers=num_workers, predictor_ms=policy.predictor_ms)


def fcfs_capacity_rps(trace: Trace, engine: EngineConfig, num_workers: int = 1) -> float:
    """FCFS saturation throughput: every request arrives at once, requests per second."""
    burst = trace.all_at_once()
    result = run_policy(burst, make_policy("fcfs", burst, engine.max_num_seqs), engine, num_workers)
    return len(trace) / float(result.finish_s.max())


def compare(
    trace: Trace,
    profile: CostProfile,
    load: float,
    policy_names: list[str],
    *,
    seed: int = 0,
    num_workers: int = 1,
    capacity_rps: float | None = None,
    tuning: LanesTuning | None = None,
) -> dict[str, dict[str, Any]]:
    """Metrics per policy with arrivals scaled to ``load`` x FCFS capacity.

    FCFS always runs too, as the reference for starvation counts.
    """
    engine = EngineConfig(profile)
    capacity_rps = capacity_rps or fcfs_capacity_rps(trace, engine, num_workers)
    scaled = trace.time_scaled(load * capacity_rps / trace.rate_rps)
    fcfs = run_policy(scaled, make_policy("fcfs", scaled, engine.max_num_seqs), engine, num_workers)
    out: dict[str, dict[str, Any]] = {}
    for name in policy_names:
        policy = make_policy(name, scaled, engine.max_num_seqs, seed, tuning)
        result = fcfs if name == "fcfs" else run_policy(scaled, policy, engine, num_workers)
        summary = summarize(result, scaled.output_tokens, fcfs)
        summary.update(load=load, offered_rps=scaled.rate_rps, fcfs_capacity_rps=capacity_rps,
                       predictor=policy.info)
        out[name] = summary
    return out
