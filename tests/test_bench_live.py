"""`lanes bench live` as a user runs it, small: both policies through real processes, JSON out."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_support import write_prompts, write_trace

pytestmark = [pytest.mark.e2e, pytest.mark.slow]



def test_bench_live_small(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "trace.csv", 60, 0.3, 50, 4.0)
    prompts = write_prompts(tmp_path / "prompts.json")
    out, plot = tmp_path / "live.json", tmp_path / "live.png"
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "COLUMNS": "200",
           **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})}
    done = subprocess.run([sys.executable, "-m", "lanes.cli.main", "bench", "live", "--trace", str(trace),
                           "--prompts", str(prompts), "--requests", "40", "--workers", "2", "--slots", "4",
                           "--time-scale", "10", "--clients", "4", "--json-file", str(out), "--plot", str(plot)],
                          capture_output=True, text=True, timeout=150, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sim_gap" in done.stdout and plot.stat().st_size > 0
    result = json.loads(out.read_text())
    for policy in ("fcfs", "lanes"):
        checks = result[policy]["checks"]
        assert checks["num_done"] == 40 and checks["not_done"] == 0 and checks["gaps"] == 0, checks
        assert checks["wrong_length"] == 0 and checks["crashed"] == [] and not checks["errors"], checks
        # The edges predicted what the simulator was given, and routed by policy.
        assert checks["predictions_differing_from_sim"] == 0, checks
        assert set(checks["lanes"]) <= ({"medium"} if policy == "fcfs" else {"short", "long"}), checks
        for source in (result[policy], result["sim"][policy]):
            for cls in ("short", "long", "all"):
                for key in ("ttft_ms_p50", "ttft_ms_p99", "throughput_rps"):
                    assert math.isfinite(source[cls][key]) and source[cls][key] > 0, (policy, cls, key)
                assert source[cls]["ttft_ms_p50"] <= source[cls]["ttft_ms_p99"]
    assert math.isfinite(result["sim_gap"]) and result["sim_gap_by_class"]["short"] == pytest.approx(result["sim_gap"])
    assert result["machine"]["after"]["cores"] >= 1 and "loadavg_1m" in result["machine"]["after"]
    # Same slice, same arrivals: live throughput is the simulator's within a few per cent.
    for policy in ("fcfs", "lanes"):
        assert result[policy]["all"]["throughput_rps"] == pytest.approx(result["sim"][policy]["all"]["throughput_rps"],
                                                                        rel=0.15)


def test_bench_live_with_an_empty_long_class(tmp_path: Path) -> None:
    """Ten rows whose two largest answers tie: no answer is above the p90, the long class is empty.
    The run ends with "-" in the table and null in the JSON (it raised IndexError)."""
    trace = tmp_path / "trace.csv"
    outputs = [3, 5, 8, 12, 20, 30, 40, 60, 90, 90]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:00:{0.7 * i:09.6f}0,{200 + 10 * i},{n}\n" for i, n in enumerate(outputs)))
    out = tmp_path / "live.json"
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "COLUMNS": "200",
           **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})}
    done = subprocess.run([sys.executable, "-m", "lanes.cli.main", "bench", "live", "--trace", str(trace),
                           "--prompts", str(write_prompts(tmp_path / "prompts.json")), "--requests", "10",
                           "--workers", "1", "--slots", "4", "--time-scale", "8", "--clients", "2",
                           "--json-file", str(out)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    result = json.loads(out.read_text())
    for source in (result["fcfs"], result["sim"]["fcfs"]):
        assert source["long"]["num_requests"] == 0 and source["long"]["ttft_ms_p99"] is None
    assert result["sim_gap_by_class"]["long"] is None and "long" in done.stdout


def test_bench_live_fails_at_once_when_a_worker_crashes(tmp_path: Path) -> None:
    """SIGKILL the worker during the replay: the replay stops at once, the run exits 1 naming the
    crash, and the table says NOT VALID (it exited 0, the crash only in the JSON)."""
    import signal
    import time

    trace = write_trace(tmp_path / "trace.csv", 60, 0.3, 50, 4.0)
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "COLUMNS": "200",
           **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})}
    bench = subprocess.Popen([sys.executable, "-m", "lanes.cli.main", "bench", "live", "--trace", str(trace),
                              "--prompts", str(write_prompts(tmp_path / "prompts.json")), "--requests", "60",
                              "--workers", "1", "--slots", "2", "--time-scale", "1", "--clients", "2",
                              "--policy", "fcfs", "--json-file", str(tmp_path / "live.json")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        worker: list[int] = []
        while not worker and time.monotonic() < deadline:
            time.sleep(0.2)
            for entry in Path("/proc").iterdir():
                try:
                    if (entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                            == bench.pid and b" worker" in (entry / "cmdline").read_bytes().replace(b"\0", b" ")):
                        worker.append(int(entry.name))
                except (OSError, ValueError):
                    continue
        assert worker, "no worker started"
        time.sleep(5)  # ready, and the replay under way
        os.kill(worker[0], signal.SIGKILL)
        killed_at = time.monotonic()
        stdout, stderr = bench.communicate(timeout=60)
        took_s = time.monotonic() - killed_at
    finally:
        if bench.poll() is None:
            bench.terminate()  # the command stops the processes it started
            bench.wait(timeout=30)
    assert bench.returncode == 1, stderr[-3000:]
    assert "fcfs: crashed: w0" in stderr.splitlines()[-1] and "NOT VALID: fcfs: crashed: w0" in stdout, stderr[-3000:]
    assert took_s < 20, took_s
