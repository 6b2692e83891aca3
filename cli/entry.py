"""The ``lanes`` console script: imports the command line inside a guard, so a Ctrl-C in its
first half second (numpy, typer, rich, pydantic loading) exits 130 quietly instead of printing a
``KeyboardInterrupt`` traceback. Nothing but the standard library is imported before it."""

from __future__ import annotations


def main() -> None:
    try:
        from lanes.cli.main import main as run
    except KeyboardInterrupt:
        raise SystemExit(130) from None  # EXIT_INTERRUPTED (cli/failures.py)
    run()
