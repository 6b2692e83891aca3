"""Smoke tests of the live-system benchmarks, run small as a user would run them: ``lanes bench
overhead | fanout | connections`` start real Redis, scheduler, edge and worker processes and
drive them over real WebSockets. They check the JSON each promises and that nothing was lost;
the numbers themselves are recorded by full runs in ``benchmarks/RESULTS.md``, not asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def lanes(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1", "COLUMNS": "200",
           "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "lanes.cli.main", "bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def test_overhead_pairs_each_request_with_the_engine_in_process(tmp_path: Path) -> None:
    out = lanes("overhead", "--requests", "4", "--warmup", "1", "--engines", "sim,hf", "--json",
                "--plot", str(tmp_path / "added.png"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    for key in ("added_ms_p50", "added_ms_p99", "hf_added_ms_p50", "hf_added_ms_p99"):
        assert finite(result[key]), key
    assert result["added_ms_p50"] <= result["added_ms_p99"]
    phases = {p["engine"]: p for p in result["phases"]}
    assert set(phases) == {"sim", "hf"}
    for phase in phases.values():
        assert phase["num_requests"] == 4 and len(phase["rounds"]) == 4
        for r in phase["rounds"]:
            # Through lanes the first token comes after the request was accepted, and took some time.
            assert 0 < r["client_accepted_ms"] < r["client_ttft_ms"]
            assert r["baseline_ttft_ms"] > 0
    assert result["machine"]["cores"] >= 1
    assert (tmp_path / "added.png").stat().st_size > 0


def test_overhead_refuses_an_unknown_engine() -> None:
    out = lanes("overhead", "--engines", "gpu", "--requests", "1")
    assert out.returncode == 2 and "--engines" in out.stderr


def test_fanout_delivers_every_token_in_order_and_meters_cpu(tmp_path: Path) -> None:
    out = lanes("fanout", "--concurrency", "4,16", "--seconds", "1", "--warmup-s", "0.5", "--workers", "1",
                "--json", "--plot", str(tmp_path / "fanout.png"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["tokens_per_s"] > 0 and result["server_cpu_ms_per_1k_tokens"] > 0
    assert [r["concurrency"] for r in result["runs"]] == [4, 16]
    for r in result["runs"]:
        assert r["gaps"] == 0 and r["not_done"] == 0 and r["completed"] > 0
        assert set(r["cpu_ms_per_1k_tokens"]) >= {"edge", "workers", "redis", "client"}
        assert r["cpu_ms_per_1k_tokens"]["edge"] > 0 and r["cpu_ms_per_1k_tokens"]["client"] > 0
    assert (tmp_path / "fanout.png").stat().st_size > 0


def test_connections_holds_idle_connections_that_still_serve(tmp_path: Path) -> None:
    plot = tmp_path / "rss.png"
    out = lanes("connections", "--connections", "150", "--batch", "50", "--probe-every", "10", "--churn", "60",
                "--churn-warmup", "20", "--json", "--plot", str(plot))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["connections"] == 150
    assert result["probes_done"] == 15 and result["probes_failed"] == 0
    assert result["rss_mb"] >= result["rss_mb_baseline"] > 0
    assert finite(result["kib_per_connection"])
    churn = result["churn"]
    assert churn["done"] == 60 and churn["failed"] == 0
    assert finite(churn["growth_bytes_per_connection"])
    assert [n for n, _ in result["rss_curve"]] == [50, 100, 150] and plot.stat().st_size > 0


def test_bad_concurrency_is_named() -> None:
    out = lanes("fanout", "--concurrency", "4,lots")
    assert out.returncode == 2 and "--concurrency" in out.stderr


def test_background_short_chats_skip_the_long_ones_only_with_lanes(tmp_path: Path) -> None:
    # 1,000 tokens: the prediction is capped by max_tokens, and the long lane starts above 750.
    out = lanes("background", "--long", "8", "--long-tokens", "1000", "--short", "5", "--interval-ms", "20",
                "--time-scale", "40", "--json", "--plot", str(tmp_path / "ttft.png"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    fcfs, lanes_ = result["fcfs"], result["lanes"]
    for r in (fcfs, lanes_):
        assert r["short_done"] == 5 and r["short_gaps"] == 0 and r["all_short_ended"]
    # One lane: everything in it. Lanes: the predictor splits the two kinds of prompt.
    assert len(fcfs["short_lanes"]) == 1 and fcfs["short_lanes"] == {k: 5 for k in fcfs["long_lanes"]}
    assert lanes_["short_lanes"] == {"short": 5} and lanes_["long_lanes"] == {"long": 8}
    # With one lane the 8 long answers hold all 8 slots and the short ones wait for a long one to
    # end; with lanes they get the slots the long lane may not take.
    assert fcfs["short_ttft_ms_p50"] > lanes_["short_ttft_ms_p99"]
    assert len(fcfs["short_ttft_ms"]) == 5 and (tmp_path / "ttft.png").stat().st_size > 0


def test_fanout_keeps_exactly_the_requests_in_flight_asked_for() -> None:
    from lanes.bench.fanout import split_in_flight

    assert split_in_flight(40) == [2] * 8 + [1] * 24, "40 in flight, not 32 (40 // 32 per client)"
    assert split_in_flight(16) == [1] * 16 and split_in_flight(256) == [8] * 32
    assert sum(split_in_flight(33)) == 33 and len(split_in_flight(33)) == 32


def test_fanout_verdict_fails_on_a_closed_client_or_a_crash() -> None:
    from lanes.bench.fanout import verdict

    ok = {"concurrency": 16, "gaps": 0, "not_done": 0, "lost": 0, "clients_closed": [], "crashed": []}
    assert verdict({"runs": [ok]}) == []
    slow = ok | {"clients_closed": [4008]}
    assert verdict({"runs": [slow]}) == ["at 16 in flight: the edge closed 1 load clients (codes 4008; 4008: the "
                                         "client read too slowly)"]
    gone = ok | {"not_done": 5, "lost": 5, "clients_closed": [None], "crashed": ["edge"]}
    failed = verdict({"runs": [ok, gone]})
    assert failed[0] == "at 16 in flight: crashed: edge" and "5 lost with their connection" in failed[1]


def _children(pid: int) -> dict[int, str]:
    """Child processes of ``pid`` and their command lines (Linux /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
    return out


def _stop(bench: subprocess.Popen[str]) -> None:
    """SIGTERM first: the command stops the processes it started (they run in their own sessions,
    so a SIGKILL of the command alone would leave them running)."""
    if bench.poll() is None:
        bench.terminate()
        try:
            bench.wait(timeout=30)
        except subprocess.TimeoutExpired:
            bench.kill()
            bench.wait()


def test_fanout_fails_when_the_edge_dies_mid_run() -> None:
    """SIGKILL the edge during the window: its streams are lost with their connections, which
    counts as not done, and the crash fails the run (it was rc 0, not_done 0)."""
    import signal
    import time

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    bench = subprocess.Popen([sys.executable, "-m", "lanes.cli.main", "bench", "fanout", "--concurrency", "4",
                              "--seconds", "8", "--warmup-s", "0.5", "--workers", "1", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            children = _children(bench.pid)
            edge = [pid for pid, cmd in children.items() if " edge" in cmd]
            if edge and any(" worker" in cmd for cmd in children.values()):
                break
            time.sleep(0.2)
        else:
            pytest.fail("no edge and worker started")
        time.sleep(4)  # the worker's engine ready, then the warm-up: the kill lands in the window
        os.kill(edge[0], signal.SIGKILL)
        stdout, stderr = bench.communicate(timeout=90)
    finally:
        _stop(bench)
    assert bench.returncode == 1, stderr[-3000:]
    assert "crashed: edge" in stderr.splitlines()[-1], stderr[-3000:]
    run = json.loads(stdout)["runs"][0]
    assert run["crashed"] == ["edge"] and run["clients_closed"] and run["not_done"] >= run["lost"] > 0, run


def test_overhead_reports_an_error_frame_in_one_line() -> None:
    out = lanes("overhead", "--engines", "sim", "--requests", "1", "--warmup", "0", "--max-tokens", "5000",
                timeout=60)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "got an error frame: max_tokens_too_large" in out.stderr.splitlines()[-1]


def test_overhead_refuses_a_deadline_below_one_second_and_fails_with_no_rounds() -> None:
    from lanes.bench.overhead import verdict

    for bad in ("0", "-1"):
        out = lanes("overhead", "--engines", "sim", "--deadline-s", bad, timeout=60)
        assert out.returncode == 2 and "--deadline-s" in out.stderr, out.stderr
    assert verdict({"phases": [{"engine": "sim", "num_requests": 0}, {"engine": "hf", "num_requests": 3}]}) == [
        "sim engine: no timed round finished before --deadline-s"]
    assert verdict({"phases": [{"engine": "sim", "num_requests": 3}]}) == []


def test_overhead_fails_at_once_when_the_worker_dies() -> None:
    """SIGKILL the worker between rounds: one line naming it, rc 1, within seconds (it was a 60 s
    wait and a bare TimeoutError traceback)."""
    import signal
    import time

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    bench = subprocess.Popen([sys.executable, "-m", "lanes.cli.main", "bench", "overhead", "--engines", "sim",
                              "--requests", "100000", "--warmup", "0", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            worker = [pid for pid, cmd in _children(bench.pid).items() if " worker" in cmd]
            if worker:
                break
            time.sleep(0.2)
        else:
            pytest.fail("no worker started")
        time.sleep(4)  # its engine ready, rounds under way
        os.kill(worker[0], signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = bench.communicate(timeout=60)
        took_s = time.monotonic() - killed_at
    finally:
        _stop(bench)
    assert bench.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr and "worker-sim exited" in stderr.splitlines()[-1], stderr[-3000:]
    assert took_s < 30, took_s


def test_background_fails_when_the_long_chats_are_no_background() -> None:
    """Five-token "long" chats end before the short ones are sent, and lanes puts them in the short
    lane: no background load, so no valid comparison (it printed a ratio, rc 0)."""
    out = lanes("background", "--long", "8", "--long-tokens", "5", "--short", "2", "--interval-ms", "10",
                "--time-scale", "40", "--json", timeout=120)
    assert out.returncode == 1, out.stderr[-3000:]
    last = out.stderr.splitlines()[-1]
    assert last.startswith("the run is not valid: ") and "long chats were running when the short ones" in last, last
    assert "not all in the long lane" in last, last
    result = json.loads(out.stdout)
    for policy in ("fcfs", "lanes"):
        assert result[policy]["long_running_when_shorts_sent"] < result[policy]["long_running_expected"] == 6
