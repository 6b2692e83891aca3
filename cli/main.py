"""The ``lanes`` command line: one entry point for every process and tool."""

from __future__ import annotations

import typer

from lanes.cli import bench, model, predictor

app = typer.Typer(help="lanes: LLM chat serving with length-aware priority lanes", no_args_is_help=True)
app.add_typer(model.app, name="model", help="Build or train the small offline models.")
app.add_typer(predictor.app, name="predictor", help="Train and evaluate the length predictor.")
app.add_typer(bench.app, name="bench", help="Benchmarks and the policy simulator.")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
