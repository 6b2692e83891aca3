"""What every live benchmark shares: CPU time of processes, a progress bar, the
table, JSON and PNG outputs, and the machine's load (recorded beside every result)."""

from __future__ import annotations

import math
import os
import tempfile
import time
import uuid
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from lanes.cli import jsonout
from lanes.cli.cluster import Cluster
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

console = Console(stderr=True)
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process (all its threads) has used (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def _cpu_s_or_nan(pid: int) -> float:
    try:
        return cpu_s(pid)
    except FileNotFoundError:
        return math.nan


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def machine_load() -> dict[str, float]:
    """The 1-minute load average and core count, recorded beside each result (this machine is shared)."""
    return {"loadavg_1m": round(os.getloadavg()[0], 2), "cores": os.cpu_count() or 0}


@dataclass
class CpuMeter:
    """CPU seconds of named processes between ``start`` and ``stop``."""

    pids: dict[str, int]

    def start(self) -> None:
        self._start = {name: cpu_s(pid) for name, pid in self.pids.items()}
        self._own = time.process_time()

    def stop(self) -> dict[str, float]:
        """CPU seconds since ``start``; NaN for a process gone meanwhile (it crashed and was reaped:
        its time is unknown, and the run is not valid anyway)."""
        used = {name: _cpu_s_or_nan(pid) - self._start[name] for name, pid in self.pids.items()}
        used["client"] = time.process_time() - self._own
        return used


@contextmanager
def progress(description: str, total: float) -> Iterator[Any]:
    """A progress bar (stderr) for anything that takes more than a few seconds."""
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda advance=1.0: bar.update(task, advance=advance)


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[object]],
                out: Console | None = None) -> None:
    """A table of ``rows`` under ``columns``, headers wrapped where the terminal is narrow (80
    columns when stdout is a pipe or a file). Where even the figures do not fit side by side it
    is printed turned, one line per column, so that no figure is cut short: a 12-column table
    printed "844…" for 84,452 tokens/s before, and `bench background` "medium:…"."""
    out = out or Console()
    cells = [[f"{v:.1f}" if isinstance(v, float) else str(v) for v in row] for row in rows]

    def table(widths: Sequence[int | None]) -> Table:
        made = Table(title=title)
        for column, width in zip(columns, widths, strict=True):
            made.add_column(column, justify="right", width=width)
        for row in cells:
            made.add_row(*row)
        return made

    natural = table([None] * len(columns))
    if out.measure(natural, options=out.options.update(width=10_000)).maximum <= out.width:
        out.print(natural)
        return
    # Each column at least as wide as its longest word (a figure is one), 3 more for its border
    # and padding; the room left goes to the columns whose text would rather not wrap.
    texts = [[row[j] for row in cells] + [column] for j, column in enumerate(columns)]
    needed = [max(len(word) for text in column for word in text.split() or [""]) for column in texts]
    wanted = [max(len(text) for text in column) - need for column, need in zip(texts, needed, strict=True)]
    room = out.width - (sum(needed) + 3 * len(columns) + 1)
    if room >= 0 or len(cells) >= len(columns):
        share = max(room, 0) / max(sum(wanted), 1)
        out.print(table([need + min(want, int(want * share)) for need, want in zip(needed, wanted, strict=True)]))
        return
    turned = Table(title=title)  # each row's first cell (what it varies) heads its column
    turned.add_column(columns[0], justify="left")
    for row in cells:
        turned.add_column(row[0], justify="right")
    for j, column in enumerate(columns[1:], start=1):
        turned.add_row(column, *(row[j] for row in cells))
    out.print(turned)


def write_json(path: Path | None, result: dict[str, Any]) -> None:
    """``--json``: print to stdout (path None) or write to a file; NaN and infinities become
    ``null`` (``cli.jsonout``), as in every other JSON the tools print."""
    text = jsonout.dumps(result, indent=2)
    if path is None:
        print(text)
    else:
        path.write_text(text + "\n")


@contextmanager
def figure(path: Path, ncols: int = 1, *, width: float = 7.0, sharey: bool = False) -> Iterator[tuple[Any, Any]]:
    """``(fig, axes)`` for a ``--plot`` PNG written to ``path`` on leaving the block (``axes`` is one
    axis when ``ncols`` is 1). Needs matplotlib (the ``dev`` extra): without it, one line saying so."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib: pip install -e '.[dev]' ({exc})") from None
    fig, axes = plt.subplots(1, ncols, figsize=(width, 4), sharey=sharey)
    try:
        yield fig, axes
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def plot_lines(path: Path, title: str, xlabel: str, ylabel: str, series: dict[str, tuple[list[float], list[float]]],
               logy: bool = False) -> None:
    """One PNG with a line per series (``--plot``)."""
    with figure(path) as (_, ax):
        for name, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=name)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()


@contextmanager
def sim_system(tag: str, *, workers: int = 1, time_scale: float = 1000.0, slots: int | None = None,
               open_slots: bool = False, base_env: dict[str, str] | None = None,
               edge_env: dict[str, str] | None = None, worker_env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """Real processes for one benchmark run: an embedded redis-server, a scheduler, one edge
    ("edge") and ``workers`` sim-engine workers ("w0", "w1", ...), logs in a temporary folder.
    ``open_slots``: every slot may run any lane (no reservation), as for raw throughput."""
    worker_args = ["--engine", "sim", "--sim-time-scale", str(time_scale)]
    env = dict(worker_env or {})
    if slots is not None:
        worker_args += ["--max-slots", str(slots)]
        if open_slots:
            env |= {"LANES_MAX_LONG_SLOTS": str(slots), "LANES_MAX_MEDIUM_LONG_SLOTS": str(slots)}
    with tempfile.TemporaryDirectory(prefix=f"lanes-{tag}-") as logs, \
            Cluster.embedded(f"{tag}{uuid.uuid4().hex[:6]}", Path(logs), base_env=base_env or {}) as cluster:
        cluster.start_scheduler()
        cluster.start_edge("edge", **(edge_env or {}))
        for i in range(workers):
            cluster.start_worker(f"w{i}", "", *worker_args, **env)
        cluster.wait_workers(workers)
        yield cluster
