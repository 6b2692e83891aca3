"""`lanes bench ...` commands."""

from __future__ import annotations

import typer

app = typer.Typer(help="bench commands", no_args_is_help=True)
