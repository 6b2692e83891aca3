"""`lanes model ...` commands."""

from __future__ import annotations

import typer

app = typer.Typer(help="model commands", no_args_is_help=True)
