"""`lanes router ...`: train and evaluate the routing complexity model, try a routing decision.

Data: ``benchmarks/data/router/judgments.csv`` + ``../shared/data/prompts`` (docs/router-data.md).
``train`` and ``eval`` need scikit-learn (the ``dev`` extra); serving needs only numpy.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer

from lanes.scheduler.router.train import JudgedSet, fit, load_judged

app = typer.Typer(help="router commands", no_args_is_help=True)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JUDGMENTS = REPO_ROOT / "benchmarks" / "data" / "router" / "judgments.csv"
DEFAULT_SHARED = REPO_ROOT.parent / "shared" / "data"
DEFAULT_OUT = REPO_ROOT / "scheduler" / "router" / "weights" / "complexity.npz"
JudgmentsOpt = Annotated[Path, typer.Option(exists=True, dir_okay=False, help="judged comparisons (CSV)")]
SharedOpt = Annotated[Path, typer.Option(exists=True, file_okay=False, help="folder holding prompts/alpaca_eval_*.json")]
TargetOpt = Annotated[str, typer.Option(help="small model column(s) to learn from, comma-separated, or 'all'")]


def _target(judged: JudgedSet, target: str) -> tuple[list[str], np.ndarray]:
    """The named columns and their mean judged win probability per prompt (the training label)."""
    names = list(judged.p_win) if target == "all" else target.split(",")
    unknown = [n for n in names if n not in judged.p_win]
    if unknown:
        raise typer.BadParameter(f"unknown --target {unknown}; columns: {list(judged.p_win)}")
    return names, np.mean([judged.p_win[n] for n in names], axis=0)


def _judged(judgments: Path, shared_data: Path) -> JudgedSet:
    """``load_judged`` for the command line: a file that does not match is a usage error."""
    try:
        return load_judged(judgments, shared_data)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        flag = "--shared-data" if isinstance(exc, FileNotFoundError) and str(shared_data) in str(exc) else "--judgments"
        raise typer.BadParameter(f"{exc} ({type(exc).__name__}; expected docs/router-data.md's judgments CSV and "
                                 "the AlpacaEval prompts under --shared-data)", param_hint=flag) from exc


@app.command()
def train(
    judgments: JudgmentsOpt = DEFAULT_JUDGMENTS,
    shared_data: SharedOpt = DEFAULT_SHARED,
    target: TargetOpt = "all",
    out: Annotated[Path, typer.Option(help="weights file to write")] = DEFAULT_OUT,
    seed: int = 0,
) -> None:
    """Fit on every judged prompt (C by inner CV) and write the weights file."""
    judged = _judged(judgments, shared_data)
    names, p = _target(judged, target)
    model = fit(judged.prompts, p, seed=seed, meta={
        "data": "AlpacaEval 805 prompts, small models vs gpt4_1106_preview (docs/router-data.md)",
        "target": names, "command": f"lanes router train --target {target} --seed {seed}",
    })
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    typer.echo(f"wrote {out} ({out.stat().st_size} bytes, C={model.meta['C']}, "
               f"{int(np.count_nonzero(model.word_weights))} word weights)")


@app.command("eval")
def evaluate_cmd(
    judgments: JudgmentsOpt = DEFAULT_JUDGMENTS,
    shared_data: SharedOpt = DEFAULT_SHARED,
    target: TargetOpt = "all",
    thresholds: Annotated[str, typer.Option(help="small-pool max_complexity values")] = "0.1,0.25,0.5",
    num_folds: Annotated[int, typer.Option(help="folds of the by-prompt CV")] = 5,
    seed: int = 0,
) -> None:
    """Held-out routing quality: CV by prompt and leave-one-AlpacaEval-source-out."""
    from lanes.scheduler.router.evaluate import (
        CLEARLY_WORSE, auc, dataset_folds, held_out_complexity, prompt_folds, routing_point,
    )
    judged = _judged(judgments, shared_data)
    _, p = _target(judged, target)
    levels = [float(t) for t in thresholds.split(",")]
    schemes = {"by prompt": prompt_folds(len(p), num_folds, seed), "by source": dataset_folds(judged.datasets)}
    typer.echo(f"target: {target}; clearly worse: judged P(small better) < {CLEARLY_WORSE}\n")
    typer.echo("| folds | small model | AUC | max_complexity | small share | clearly worse & small | "
               "worse rate (base) | win rate vs large | random | oracle |")
    typer.echo("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for scheme, folds in schemes.items():
        complexity = held_out_complexity(judged.prompts, p, folds,
                                         lambda x, y: fit(x, y, seed=seed).complexity)
        for name, p_win in judged.p_win.items():
            area = auc(-complexity, p_win >= CLEARLY_WORSE)
            base = float((p_win < CLEARLY_WORSE).mean())
            for level in levels:
                pt = routing_point(complexity, p_win, level)
                typer.echo(f"| {scheme} | {name} | {area:.3f} | {level:.2f} | {pt.small_share:.1%} | "
                           f"{pt.worse_small:.1%} | {pt.worse_rate:.1%} ({base:.1%}) | {pt.win_rate:.3f} | "
                           f"{pt.random_win_rate:.3f} | {pt.oracle_win_rate:.3f} |")


@app.command()
def latency(
    shared_data: SharedOpt = DEFAULT_SHARED,
    weights: Annotated[Optional[Path], typer.Option(exists=True, dir_okay=False, help="weights file (default: shipped)")] = None,
    repeats: int = 5,
) -> None:
    """Time the shipped model's complexity() on the AlpacaEval prompts (one core, this process)."""
    import json

    from lanes.scheduler.router.complexity import ComplexityModel
    from lanes.scheduler.router.train import PROMPTS_FILE

    model = ComplexityModel.load(weights)
    try:
        prompts = [r["instruction"] for r in json.loads((shared_data / PROMPTS_FILE).read_text())]
    except FileNotFoundError:
        raise typer.BadParameter(f"no {PROMPTS_FILE} under {shared_data} (docs/router-data.md names its "
                                 "public source)", param_hint="--shared-data") from None
    wall, cpu = [], []
    for _ in range(repeats):
        for prompt in prompts:
            start, start_cpu = time.perf_counter(), time.thread_time()
            model.complexity(prompt)
            wall.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
    # CPU time is what one call costs; wall time adds whatever else ran on a shared machine.
    for name, samples in (("wall", wall), ("cpu", cpu)):
        ms = np.array(samples) * 1e3
        typer.echo(f"complexity() {name}: {len(ms)} calls, p50 {np.percentile(ms, 50):.3f} ms, "
                   f"p99 {np.percentile(ms, 99):.3f} ms, max {ms.max():.3f} ms")


@app.command("route")
def route_cmd(
    prompt: Annotated[str, typer.Argument(help="the user's message")],
    rules: Annotated[Path, typer.Option(exists=True, dir_okay=False, help="routing rules (TOML)")] = REPO_ROOT / "deploy" / "routing.toml",
    model: Annotated[str, typer.Option(help="the request's model field")] = "auto",
    key_id: Annotated[str, typer.Option(help="API key id")] = "",
) -> None:
    """Show which pool a prompt would go to, and why."""
    from lanes.scheduler.router.complexity import ComplexityModel
    from lanes.scheduler.router.policy import UnknownPoolError, route
    from lanes.scheduler.router.rules import RulesError, load_rules

    try:
        decision = route(prompt, key_id, load_rules(rules), model, ComplexityModel.load().complexity)
    except (RulesError, UnknownPoolError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    score = "" if decision.score is None else f" (complexity {decision.score:.3f})"
    typer.echo(f"{decision.pool}: {decision.reason.value}{score}")
