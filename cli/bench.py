"""`lanes bench ...` commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(help="bench commands", no_args_is_help=True)

DEFAULT_PLOT_LOADS = "0.5,0.73,0.88,0.95,1.1"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


@app.command("policy")
def policy(
    trace: Annotated[Path, typer.Option(help="Azure LLM inference trace CSV (read in place).")],
    profile: Annotated[str, typer.Option(help="Cost profile: l70-h100, l70-a100, l7-a100.")] = "l70-h100",
    load: Annotated[float, typer.Option(help="Offered load as a fraction of FCFS capacity.")] = 0.88,
    policy: Annotated[str, typer.Option(help="Comma-separated policies (fcfs, lanes, lanes-score, "
                                             "lanes-oracle, lanes-naive, oracle-2q, oracle-sjf).")] = "fcfs,lanes",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object keyed by policy.")] = False,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of P99 TTFT vs load here.")] = None,
    plot_loads: Annotated[str, typer.Option(help="Loads swept for --plot.")] = DEFAULT_PLOT_LOADS,
    seed: Annotated[int, typer.Option(help="Seed of the simulated predictor's noise.")] = 0,
    workers: Annotated[int, typer.Option(help="Simulated worker instances.")] = 1,
    tau: Annotated[float, typer.Option(help="Kendall tau of the simulated predictor.")] = 0.52,
    order_weight: Annotated[float, typer.Option(help="lanes-score: weight of predicted service time "
                                                     "in the in-lane score (0 = FCFS in a lane).")] = 1.0,
    head_age: Annotated[bool, typer.Option("--head-age/--oldest-age", help="lanes-score: lane ages for "
                                           "anti-starvation from the head's score (as Redis reports "
                                           "them) or from the oldest request.")] = True,
) -> None:
    """Simulate scheduling policies over a trace with a GPU cost model."""
    from lanes.scheduler.costmodel import get_profile
    from lanes.scheduler.policy import LaneOrder
    from lanes.scheduler.simpolicies import POLICY_NAMES, LanesTuning
    from lanes.scheduler.simrun import compare, fcfs_capacity_rps
    from lanes.scheduler.simulator import EngineConfig
    from lanes.scheduler.trace import load_azure_csv

    names = [n.strip() for n in policy.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICY_NAMES]
    if unknown:
        raise typer.BadParameter(f"unknown policies {unknown}; known: {', '.join(POLICY_NAMES)}")
    cost = get_profile(profile)
    requests = load_azure_csv(trace)
    tuning = LanesTuning(target_tau=tau, lane_order=LaneOrder(weight=order_weight),
                         age_from_score=head_age)
    capacity_rps = fcfs_capacity_rps(requests, EngineConfig(cost), workers)
    kwargs: dict[str, Any] = dict(seed=seed, num_workers=workers, capacity_rps=capacity_rps, tuning=tuning)
    results = compare(requests, cost, load, names, **kwargs)
    if as_json:
        typer.echo(json.dumps(results, indent=2))
    else:
        typer.echo(f"FCFS capacity {capacity_rps:.3f} req/s; offered {load:.2f} x = "
                   f"{load * capacity_rps:.3f} req/s")
        typer.echo(format_table(results))
    if plot is not None:
        sweep = {x: results if x == load else compare(requests, cost, x, names, **kwargs)
                 for x in sorted(set(_floats(plot_loads)) | {load})}
        write_plot(sweep, plot, f"{trace.name}, {profile}")


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """A fixed-width table of the headline metrics, one row per policy."""
    head = (f"{'policy':<13} {'short TTFT p50/p99 s':>21} {'short E2E p99':>13} {'long E2E p99':>12} "
            f"{'mean E2E':>8} {'req/s':>6} {'max wait':>8} {'starved':>7}")
    rows = [head]
    for name, r in results.items():
        s, lg, al = r["short"], r["long"], r["all"]
        rows.append(f"{name:<13} {s['ttft_s_p50']:>10.2f} / {s['ttft_s_p99']:<8.1f} {s['e2e_s_p99']:>13.1f} "
                    f"{lg['e2e_s_p99']:>12.1f} {al['e2e_s_mean']:>8.1f} {r['throughput_rps']:>6.3f} "
                    f"{al['max_wait_s']:>8.0f} {r.get('num_starved_vs_fcfs', 0):>7}")
    return "\n".join(rows)


def write_plot(sweep: dict[float, dict[str, dict[str, Any]]], path: Path, title: str) -> None:
    """P99 TTFT (short and long requests) vs offered load, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = sorted(sweep)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, group in zip(axes, ("short", "long"), strict=True):
        for name in sweep[loads[0]]:
            ax.plot(loads, [sweep[x][name][group]["ttft_s_p99"] for x in loads], marker="o", label=name)
        ax.set(title=f"{group} requests", xlabel="offered load (x FCFS capacity)", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("P99 TTFT (s)")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
