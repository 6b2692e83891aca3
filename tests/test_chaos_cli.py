"""``lanes chaos``: its scoring (pure: frames in, counts out) and one real run of the command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lanes.cli.chaos.load import Ledger, Tracked, sim_text


def feed(ledger: Ledger, rid: str, frames: list[dict]) -> None:
    ledger.requests.setdefault(rid, Tracked(rid, 4))
    for frame in frames:
        ledger.on_frame({"id": rid, **frame}, 0.0)


def deltas(seqs: list[int]) -> list[dict]:
    return [{"type": "delta", "seq": s, "text": f" tok{s}"} for s in seqs]


def done(n: int, reason: str = "length") -> dict:
    return {"type": "done", "finish_reason": reason, "usage": {"prompt_tokens": 3, "completion_tokens": n}}


def test_scoring_counts_each_outcome_and_every_token_fault() -> None:
    ledger = Ledger()
    feed(ledger, "ok", deltas([0, 1, 2, 3]) + [done(4)])
    feed(ledger, "dup", deltas([0, 1, 1, 2, 3]) + [done(4)])
    feed(ledger, "gap", deltas([0, 2, 3]) + [done(4)])
    feed(ledger, "short", deltas([0, 1]) + [done(4)])
    feed(ledger, "wrong", [{"type": "delta", "seq": 0, "text": " tok9"}] + [done(1)])
    feed(ledger, "cancelled", deltas([0]) + [done(1, "cancelled")])
    feed(ledger, "refused", [{"type": "error", "code": "overloaded"}])
    feed(ledger, "hung", deltas([0, 1]))
    tally = ledger.tally()
    assert (tally.sent, tally.completed, tally.cancelled, tally.lost) == (8, 5, 1, 1)
    assert tally.rejected == {"overloaded": 1}
    assert tally.duplicates == 1
    assert tally.gaps == 1 + 2 + 1  # a hole, a missing tail of two, a wrong text
    assert ledger["hung"].next_seq() == 2 and sim_text(2) == " tok0 tok1"


def test_departed_client_counts_as_cancelled_only_when_redis_says_so() -> None:
    ledger = Ledger()
    feed(ledger, "left", deltas([0]))
    ledger["left"].departed = True
    assert ledger.tally().lost == 1
    ledger["left"].departed_cancelled = True
    assert ledger.tally().cancelled == 1 and ledger.tally().lost == 0


@pytest.mark.e2e
def test_lanes_chaos_loses_nothing() -> None:
    out = subprocess.run([sys.executable, "-m", "lanes.cli.main", "chaos", "--json"], capture_output=True,
                         timeout=400, check=False)
    report = json.loads(out.stdout.decode().strip().splitlines()[-1])
    totals = report["totals"]
    assert out.returncode == 0, report
    assert totals["lost"] == totals["duplicates"] == totals["gaps"] == 0, report
    assert totals["sent"] == totals["completed"] + totals["cancelled"] + totals["rejected"]
    faults = {f["fault"]: f for f in report["faults"]}
    assert len(faults) == 5
    assert all(f["exercised"] for f in faults.values()), "every fault struck a loaded system"
    assert faults["overload burst 10x"]["rejected_by_reason"].get("overloaded", 0) > 0
    assert set(faults["redis restart"]["rejected_by_reason"]) <= {"unavailable", "request_lost"}
