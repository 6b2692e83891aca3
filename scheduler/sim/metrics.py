"""Summaries of a simulation run: latency percentiles per request class, throughput, starvation."""

from __future__ import annotations

from typing import Any

import numpy as np

from lanes.scheduler.sim.simulator import SimResult

#: A request counts as starved when it waits more than this many times its FCFS wait...
STARVE_FACTOR = 5.0
#: ...and that FCFS wait is taken as at least this long (a 5x of 10 ms is no starvation).
STARVE_FLOOR_S = 1.0
#: TTFT bounds whose attainment is reported (share of a class's requests within each).
TTFT_WITHIN_S = (1, 5, 30)


def class_masks(output_tokens: np.ndarray) -> dict[str, np.ndarray]:
    """The request classes every report uses: short (answer <= the trace's p50), long (> its p90)
    and all. Long can be empty (the two largest answers tie, so none is above the p90): each
    report then gives that class its keys with ``None`` values, the tables "-"."""
    return {"short": output_tokens <= np.percentile(output_tokens, 50),
            "long": output_tokens > np.percentile(output_tokens, 90),
            "all": np.ones(len(output_tokens), dtype=bool)}


def _latency(result: SimResult, mask: np.ndarray) -> dict[str, Any]:
    ttft, e2e, wait = result.ttft_s[mask], result.e2e_s[mask], result.wait_s[mask]
    if not mask.any():  # a class with no requests (no answer above the trace's p90): the same keys, empty
        return {"num_requests": 0, "ttft_s_p50": None, "ttft_s_p99": None, "e2e_s_p50": None, "e2e_s_p99": None,
                "e2e_s_mean": None, **{f"ttft_within_{s}s": None for s in TTFT_WITHIN_S}, "max_wait_s": None,
                "num_wait_over_60s": 0, "num_preempted": 0}
    return {
        "num_requests": int(mask.sum()),
        "ttft_s_p50": float(np.percentile(ttft, 50)),
        "ttft_s_p99": float(np.percentile(ttft, 99)),
        "e2e_s_p50": float(np.percentile(e2e, 50)),
        "e2e_s_p99": float(np.percentile(e2e, 99)),
        "e2e_s_mean": float(e2e.mean()),
        **{f"ttft_within_{s}s": float((ttft <= s).mean()) for s in TTFT_WITHIN_S},
        "max_wait_s": float(wait.max()),
        "num_wait_over_60s": int((wait > 60.0).sum()),
        "num_preempted": int((result.num_preemptions[mask] > 0).sum()),
    }


def summarize(result: SimResult, output_tokens: np.ndarray, fcfs: SimResult | None = None) -> dict[str, Any]:
    """Metrics for all, short (output <= p50) and long (> p90) requests.

    With ``fcfs`` (the same trace under FCFS) also counts requests starved relative to it.
    """
    span_s = float(result.finish_s.max() - result.arrival_s.min())
    masks = class_masks(output_tokens)
    summary: dict[str, Any] = {
        "throughput_rps": len(output_tokens) / span_s,
        "output_tokens_per_s": float(output_tokens.sum()) / span_s,
        "all": _latency(result, masks["all"]),
        "short": _latency(result, masks["short"]),
        "long": _latency(result, masks["long"]),
        "num_preemptions": int(result.num_preemptions.sum()),
        "num_reprefill_tokens": result.num_reprefill_tokens,
    }
    if fcfs is not None:
        bound_s = STARVE_FACTOR * np.maximum(fcfs.wait_s, STARVE_FLOOR_S)
        summary["num_starved_vs_fcfs"] = int((result.wait_s > bound_s).sum())
    return summary
