"""``lanes chaos``: start a whole system on loopback, break it five ways under load, and
report per fault what was sent, completed, cancelled, rejected (with the reason), lost, and
any duplicate or missing token.

The workers run the ``sim`` engine: it paces tokens like a GPU (cost model, sped up by
``time_scale``) at almost no CPU, so two edges, three workers, a scheduler, Redis and a few
hundred client requests fit on a 2-core machine, and its token text (`` tok<position>``)
makes every answer's exact content known. The real-model path is covered by the
``tests/test_chaos_*.py`` end-to-end tests on the tiny transformers model.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

from lanes.cli.chaos.faults import FaultReport, run_all
from lanes.cli.chaos.load import Tally
from lanes.cli.chaos.rig import Rig
from rich.console import Console
from rich.table import Table


def totals(reports: list[FaultReport]) -> Tally:
    total = Tally()
    for report in reports:
        total.add(report.tally)
    return total


def to_json(reports: list[FaultReport], config: dict[str, object], elapsed_s: float) -> dict[str, object]:
    return {
        "totals": totals(reports).as_dict(),
        "faults": [{"fault": r.name, **r.tally.as_dict(), "exercised": r.exercised, "notes": r.notes}
                   for r in reports],
        "config": config,
        "elapsed_s": round(elapsed_s, 1),
    }


def print_table(reports: list[FaultReport], console: Console) -> None:
    """The counts as a table, then each fault's measurements on a line of its own."""
    idle = [r.name for r in reports if not r.exercised]
    table = Table(title="lanes chaos: nothing lost" if not idle else
                  f"lanes chaos: NOT EXERCISED: {', '.join(idle)} (the load never reached the state the fault needs)")
    for column in ("fault", "sent", "completed", "cancelled", "rejected (reason)", "lost", "dup", "gaps"):
        table.add_column(column, justify="left" if column in ("fault", "rejected (reason)") else "right")
    for name, t in [(r.name, r.tally) for r in reports] + [("total", totals(reports))]:
        reasons = ", ".join(f"{n} {code}" for code, n in sorted(t.rejected.items())) or "0"
        table.add_row(name, str(t.sent), str(t.completed), str(t.cancelled), reasons, str(t.lost),
                      str(t.duplicates), str(t.gaps))
    console.print(table)
    for report in reports:
        console.print(f"{report.name}: " + " ".join(f"{k}={v}" for k, v in report.notes.items()))


def run_chaos(*, as_json: bool, workers: int, slots: int, time_scale: float) -> int:
    """Run every fault; exit status 1 if any request was lost, duplicated or gapped, or a fault
    struck before its load was in place (not exercised: it proved nothing)."""
    console = Console(stderr=as_json, width=110)
    log_dir = Path(tempfile.mkdtemp(prefix="lanes-chaos-"))
    rig = Rig.create(log_dir, time_scale=time_scale, slots_per_worker=slots, max_depth=2 * workers * slots)
    config = {"workers": workers, "slots_per_worker": slots, "sim_time_scale": time_scale, "edges": 2,
              "lease_ms": 1500, "heartbeat_s": 0.3, "max_depth_per_lane": rig.max_depth}
    started = time.monotonic()
    try:
        reports = asyncio.run(run_all(rig, workers))
    finally:
        rig.close()
    elapsed_s = time.monotonic() - started
    if as_json:
        print(json.dumps(to_json(reports, config, elapsed_s)))
    else:
        print_table(reports, console)
        console.print(f"{elapsed_s:.0f} s; process logs in {log_dir}")
    t = totals(reports)
    return 1 if t.lost or t.duplicates or t.gaps or not all(r.exercised for r in reports) else 0
