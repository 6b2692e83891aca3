"""Run policies over a trace at an offered load: the simulator's front door (CLI, notebooks)."""

from __future__ import annotations

from typing import Any

from lanes.scheduler.sim.metrics import summarize
from lanes.scheduler.sim.mlfq import MlfqConfig
from lanes.scheduler.sim.policies import LanesTuning, SimPolicy, make_policy
from lanes.scheduler.sim.predictions import Predictions
from lanes.scheduler.sim.simulator import EngineConfig, SimResult, simulate
from lanes.scheduler.sim.trace import Trace

#: Policies that read the predictions (the others ignore them and pay no predictor time).
USES_PREDICTOR = ("lanes", "lanes-static", "priority")


def run_policy(trace: Trace, policy: SimPolicy, engine: EngineConfig, num_workers: int = 1) -> SimResult:
    return simulate(trace, policy, engine, num_workers)


def fcfs_capacity_rps(trace: Trace, engine: EngineConfig, num_workers: int = 1) -> float:
    """FCFS saturation throughput: every request arrives at once, requests per second."""
    burst = trace.all_at_once()
    policy = make_policy("fcfs", burst, burst.output_tokens, engine.max_num_seqs)
    return len(trace) / float(run_policy(burst, policy, engine, num_workers).finish_s.max())


def compare(
    trace: Trace,
    engine: EngineConfig,
    load: float,
    policy_names: list[str],
    predictions: Predictions,
    *,
    num_workers: int = 1,
    capacity_rps: float | None = None,
    tuning: LanesTuning | None = None,
    mlfq: MlfqConfig | None = None,
) -> dict[str, dict[str, Any]]:
    """Metrics per policy with arrivals scaled to ``load`` x FCFS capacity.

    ``predictions`` hold one prediction per trace row (scaling time keeps the rows). FCFS
    always runs too, as the reference for starvation counts.
    """
    capacity_rps = capacity_rps or fcfs_capacity_rps(trace, engine, num_workers)
    scaled = trace.time_scaled(load * capacity_rps / trace.rate_rps)
    n = engine.max_num_seqs

    def build(name: str, rows: Trace = scaled) -> SimPolicy:
        return make_policy(name, rows, predictions.tokens, n, predictor_ms=predictions.latency_ms,
                           tuning=tuning, mlfq=mlfq, routing=predictions.routing)

    burst = scaled.all_at_once()

    def saturation_rps(name: str) -> float:
        """The policy's own capacity: every request queued at once, requests per second. On the
        open-loop trace ``throughput_rps`` is the arrival rate unless a policy leaves a backlog
        at the end, so it cannot show capacity a policy wastes (re-prefills, swaps, the batches
        its order makes); this can."""
        return len(burst) / float(run_policy(burst, build(name, burst), engine, num_workers).finish_s.max())

    fcfs = run_policy(scaled, build("fcfs"), engine, num_workers)
    out: dict[str, dict[str, Any]] = {}
    for name in policy_names:
        policy = build(name)
        result = fcfs if name == "fcfs" else run_policy(scaled, policy, engine, num_workers)
        summary = summarize(result, scaled.output_tokens, fcfs)
        summary["capacity_rps"] = capacity_rps if name == "fcfs" else saturation_rps(name)
        uses = name in USES_PREDICTOR
        summary.update(load=load, offered_rps=scaled.rate_rps, fcfs_capacity_rps=capacity_rps,
                       predictor_tau=predictions.tau if uses else None,
                       predictor=({"source": predictions.source, **predictions.info, **policy.info} if uses else {}))
        if name.startswith("lanes"):  # the engine's prefill share, and how often it made lanes FCFS
            summary.update(result.info)
        out[name] = summary
    return out
