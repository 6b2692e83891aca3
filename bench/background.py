"""``lanes bench background``: short requests' time to first token while long answers hold the
worker, with one lane (``LANES_POLICY=fcfs``) and with lanes.

Per policy, a fresh set of real processes (embedded redis-server, scheduler, one edge, one sim
worker with the production slot defaults: 8 slots, at most 6 long and 7 medium + long). One
client sends ``--long`` long chats (a prompt the shipped predictor puts in the long lane, greedy,
``--long-tokens`` each); once the worker runs them, another sends ``--short`` short chats ("Say
hi."-like prompts), one every ``--interval-ms``, and records each one's send -> first delta. The
long chats are then cancelled. With one lane the short ones queue behind every long one still
waiting; with lanes the slots the long lane may not take serve them at once.

The sim engine runs ``--time-scale`` times faster than the L70-H100 cost model, so the long
answers' duration (and with it the one-lane wait) is divided by it; the figures are wall ms.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from lanes.bench.common import machine_load, sim_system
from lanes.bench.wsclient import LeanClient, Stream
from lanes.cli.cluster import Cluster
from lanes.workers.settings import WorkerSettings

LONG_PROMPT = ("Write a detailed, 3000-word essay on the history of the Roman Empire, with chapters on each "
               "dynasty.")
SHORT_PROMPTS = ("Say hi.", "Say hello.", "Say hi to Ana.", "Say hi, please.")
POLICIES = ("fcfs", "lanes")


@dataclass(frozen=True)
class Options:
    num_long: int = 24
    long_tokens: int = 1000
    num_short: int = 40
    short_tokens: int = 16
    interval_ms: float = 100.0
    time_scale: float = 10.0


async def _until(predicate: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def measure(cluster: Cluster, options: Options) -> dict[str, Any]:
    host, port = cluster.edge_hosts["edge"], cluster.edge_ports["edge"]
    tag = uuid.uuid4().hex[:6]
    longs_client = await LeanClient.connect(host, port)
    shorts_client = await LeanClient.connect(host, port)
    longs = [longs_client.chat(f"long{tag}-{i}", LONG_PROMPT, options.long_tokens, temperature=0.0)
             for i in range(options.num_long)]
    # The worker runs them all up to its long cap (the default, as the worker has no override).
    defaults = WorkerSettings()
    running = min(options.num_long, defaults.slots(defaults.max_slots).max_long)
    longs_started = await _until(lambda: sum(s.first_delta_at is not None for s in longs) >= running, 60.0)
    # The background the short chats meet: long chats streaming (not yet ended) as the first is sent.
    running_when_sent = sum(s.first_delta_at is not None and s.end is None for s in longs)
    shorts: list[Stream] = []
    for i in range(options.num_short):
        shorts.append(shorts_client.chat(f"short{tag}-{i}", SHORT_PROMPTS[i % len(SHORT_PROMPTS)],
                                         options.short_tokens, temperature=0.0))
        await asyncio.sleep(options.interval_ms / 1000.0)
    all_ended = await _until(lambda: all(s.end is not None for s in shorts), 600.0)
    for i, stream in enumerate(longs):
        if stream.end is None:
            longs_client.send_json(b'{"type":"cancel","id":"long%s-%d"}' % (tag.encode(), i))
    await _until(lambda: all(s.end is not None for s in longs), 30.0)
    longs_client.close()
    shorts_client.close()
    ttft = np.array([(s.first_delta_at - s.sent_at) * 1000.0 for s in shorts if s.first_delta_at is not None])
    return {
        "short_ttft_ms_p50": round(float(np.percentile(ttft, 50)), 2) if len(ttft) else None,
        "short_ttft_ms_p99": round(float(np.percentile(ttft, 99)), 2) if len(ttft) else None,
        "short_ttft_ms_max": round(float(ttft.max()), 2) if len(ttft) else None,
        "short_done": sum(s.end is not None and s.end.type == "done" for s in shorts),
        "short_gaps": sum(s.gaps for s in shorts),
        "short_lanes": _lanes(shorts),
        "long_lanes": _lanes(longs),
        #: Long chats still streaming when the first short chat was sent, of the ones the worker can run.
        "long_running_when_shorts_sent": running_when_sent,
        "long_running_expected": running,
        "long_started_in_time": longs_started,
        "all_short_ended": all_ended,
        "short_ttft_ms": [round(float(x), 2) for x in ttft],
    }


def verdict(result: dict[str, Any], options: Options, policies: tuple[str, ...] = POLICIES) -> list[str]:
    """Why the run is not valid (empty: valid): short chats lost, or no background for them to
    meet: long chats that had not all started, that ended before the short ones were sent, or
    (lanes) that the edge did not put in the long lane (too few --long-tokens: the prediction is
    capped by max_tokens)."""
    failed = []
    for policy in policies:
        r = result[policy]
        if r["short_done"] < options.num_short or r["short_gaps"]:
            failed.append(f"{policy}: {options.num_short - r['short_done']} short chats did not end with done, "
                          f"{r['short_gaps']} gaps")
        if r["long_running_when_shorts_sent"] < r["long_running_expected"]:
            failed.append(f"{policy}: {r['long_running_when_shorts_sent']} of {r['long_running_expected']} long chats "
                          "were running when the short ones were sent"
                          + ("" if r["long_started_in_time"] else " (they had not started after 60 s)"))
        if policy == "lanes" and r["long_lanes"] != {"long": options.num_long}:
            lanes = " ".join(f"{k}:{v}" for k, v in r["long_lanes"].items())
            failed.append(f"lanes: the long chats were not all in the long lane ({lanes}); raise --long-tokens")
    return failed


def _lanes(streams: list[Stream]) -> dict[str, int]:
    """How many of ``streams`` the edge put in each lane (from their ``accepted`` frames)."""
    counts: dict[str, int] = {}
    for stream in streams:
        lane = stream.accepted.lane if stream.accepted is not None else None
        counts[str(lane)] = counts.get(str(lane), 0) + 1
    return counts


def run(options: Options, policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    result: dict[str, Any] = {"options": options.__dict__, "machine": machine_load()}
    for policy in policies:
        with sim_system("bg", time_scale=options.time_scale, base_env={"LANES_POLICY": policy}) as cluster:
            result[policy] = asyncio.run(measure(cluster, options))
    if all(result.get(p, {}).get("short_ttft_ms_p99") for p in POLICIES):
        result["short_ttft_p99_ratio"] = round(result["fcfs"]["short_ttft_ms_p99"] / result["lanes"]["short_ttft_ms_p99"], 1)
    return result
