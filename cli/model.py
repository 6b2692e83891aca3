"""`lanes model ...` commands: build the random test model or train the shipped demo model.

torch and transformers are imported inside the commands so that ``lanes --help`` stays fast.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from lanes.cli.failures import writable_dir
from lanes.workers.models.paths import DEMO_MODEL_DIR

app = typer.Typer(help="model commands", no_args_is_help=True)


@app.command()
def tiny(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write target/ and draft/ into.", callback=writable_dir)],
    draft_equals_target: Annotated[
        bool, typer.Option(help="Make the draft an exact copy (speculative acceptance is then 1.0).")
    ] = False,
    seed: Annotated[int, typer.Option(help="Weight initialisation seed.")] = 0,
) -> None:
    """Build a random tiny Llama, its draft and a real tokenizer (for tests; output is noise)."""
    started = time.perf_counter()
    from lanes.workers.models.tiny import build_tiny

    imported = time.perf_counter()
    paths = build_tiny(out_dir, seed=seed, draft_equals_target=draft_equals_target)
    built = time.perf_counter()
    typer.echo(f"target: {paths.target}\ndraft:  {paths.draft}")
    typer.echo(f"imports {imported - started:.1f} s, build {built - imported:.2f} s")


@app.command("train-demo")
def train_demo(
    out: Annotated[
        Path, typer.Option(help="Output directory (default: the shipped demo model).", callback=writable_dir)
    ] = DEMO_MODEL_DIR,
    seconds: Annotated[float, typer.Option(help="Training time budget, turned into a step count.")] = 540.0,
    threads: Annotated[int, typer.Option(help="torch CPU threads.", min=1)] = 1,
    seed: Annotated[int, typer.Option(help="Seed for weights and batch order.")] = 0,
    steps: Annotated[
        int | None, typer.Option(help="Exact step count (overrides --seconds; repeats a run exactly).")
    ] = None,
) -> None:
    """Train the ~2 M-parameter demo model on CPython's docs and save it in bf16 (about 10 min)."""
    started = time.perf_counter()
    from lanes.workers.models.train_demo import train_demo as run

    report = run(out, seconds=seconds, threads=threads, seed=seed, num_steps=steps, log=typer.echo)
    typer.echo(f"target: {report.paths.target} ({_size_mb(report.paths.target):.1f} MB)")
    typer.echo(f"draft:  {report.paths.draft} ({_size_mb(report.paths.draft):.1f} MB)")
    typer.echo(f"README: {out / 'README.md'}")
    typer.echo(f"{report.num_steps} steps, prep {report.prep_s:.0f} s, train {report.train_s:.0f} s, "
               f"total {time.perf_counter() - started:.0f} s; final loss {report.final_loss:.2f} "
               f"(draft exit {report.final_exit_loss:.2f})")


def _size_mb(directory: Path) -> float:
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file()) / 1e6
