"""A worker that stops answering (``kill -9``, SIGSTOP, cut off from Redis) stays live for the
scheduler's 10 s; the dashboard's samples say how long it has been silent, so its last slots and
tokens/s do not read as now. Real processes, real Redis: the worker is SIGSTOPped."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections.abc import Callable

import pytest
from conftest import scaled
from e2e_support import Client, System
from lanes.queue.stats import SILENT_AFTER_MS

pytestmark = pytest.mark.e2e


def newest_sample(system: System) -> dict:
    url = f"http://127.0.0.1:{system.edge_ports['edge']}/v1/stats/history?after_ms={int(time.time() * 1000) - 3000}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        samples = json.loads(resp.read())["samples"]
    return samples[-1] if samples else {}


def wait_for_sample(system: System, ok: Callable[[dict], bool], timeout_s: float, what: str) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sample = newest_sample(system)
        if sample.get("workers") and ok(sample):
            return sample
        time.sleep(0.2)
    raise AssertionError(f"no sample with {what} within {timeout_s:.0f} s: {newest_sample(system)}")


async def test_a_stopped_workers_samples_say_how_long_it_has_been_silent(make_cluster) -> None:  # noqa: ANN001
    system = make_cluster(workers=1, worker_args=("--engine", "sim", "--sim-time-scale", "1"))
    client = await Client.connect(system.edge_urls["edge"])
    await client.chat("busy", "Write a long essay", max_tokens=2000)  # ~60 s at the sim's pace
    busy = await asyncio.to_thread(wait_for_sample, system, lambda s: s["workers"][0]["tokens_per_s"] > 0,
                                   scaled(15), "the worker generating")
    (worker,) = busy["workers"]
    assert worker["silent_ms"] < SILENT_AFTER_MS, worker  # heartbeats every ~0.5 s
    process = system.children["worker"].process
    process.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        silent = await asyncio.to_thread(wait_for_sample, system,
                                         lambda s: s["workers"][0]["silent_ms"] > SILENT_AFTER_MS, scaled(8),
                                         "the worker silent")
        waited_ms = (time.monotonic() - stopped_at) * 1000
        (worker,) = silent["workers"]
        # Its age is its heartbeat's: about the time since SIGSTOP, never more than that and a beat.
        assert SILENT_AFTER_MS < worker["silent_ms"] <= waited_ms + 1500, (worker, waited_ms)
        assert worker["tokens_per_s"] > 0 and sum(worker["running"].values()) == 1, "its last report, kept"
        assert silent["tokens_per_s"] == 0.0, "a silent worker's last tokens/s is not the fleet's now"
    finally:
        process.send_signal(signal.SIGCONT)
    back = await asyncio.to_thread(wait_for_sample, system, lambda s: s["workers"][0]["silent_ms"] < SILENT_AFTER_MS,
                                   scaled(8), "the worker heard again")
    assert back["workers"][0]["worker"] == worker["worker"]
    await client.send({"type": "cancel", "id": "busy"})
    await client.close()
