"""Edge overhead: what lanes adds to time-to-first-token (TTFT), enqueue to first token.

One run measures, with the same tiny model (``build_tiny``) and the same engine settings:

- **baseline**: ``HFEngine.generate`` called in this process; TTFT is the call to the first
  delta that carries tokens.
- **lanes**: real ``lanes scheduler``, ``lanes edge`` and ``lanes worker`` processes on an
  embedded redis-server, started by the process harness (``lanes.cli.cluster``); one WebSocket
  client sends chat requests. Per request it records the
  client's send -> first ``delta`` frame and send -> ``accepted`` frame, and from the ``done``
  frame the edge's own ``timing.ttft_ms`` (route created -> delta queued for the socket; the
  length prediction before it is not included) and ``timing.queue_ms`` (enqueue -> claim,
  Redis clock, whole ms).
- with ``--sim`` (the default), the same pair with the ``sim`` engine at time scale 1000
  (no model cost), so the queue plane's overhead shows alone.

Requests run one at a time (greedy, ``--max-tokens`` 8). Baseline and lanes alternate request
by request with the same prompt, after ``--warmup`` untimed rounds, so that noise from other
work on the machine hits both alike. Overhead = lanes - baseline TTFT, reported as the
difference of each side's p50/p99, as p50/p99 of the per-round paired difference, and as the
ratio of the p50s. Loopback only; ``--deadline-s`` bounds the run and every child process
is stopped at the end.

    .venv/bin/python benchmarks/edge_overhead.py [--requests 100] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection

from lanes.cli.cluster import Cluster
from lanes.queue.messages import ChatMessage
from lanes.workers.engines.base import Engine, EngineRequest

PROMPTS = (
    "What does a class definition do?",
    "Explain the with statement.",
    "How do I read a file line by line?",
    "What is a generator expression?",
    "Describe how exceptions propagate.",
)
SIM_TIME_SCALE = 1000.0
#: Same defaults as ``WorkerSettings`` so the in-process engine matches the worker's.
MAX_SLOTS = 8
MAX_NUM_BATCHED_TOKENS = 2048
SIM_PROFILE = "l70-h100"


@dataclass
class Round:
    """One alternating pair: the in-process call and the same request through lanes (ms)."""

    baseline_ttft_ms: float
    client_ttft_ms: float
    client_accepted_ms: float
    edge_ttft_ms: float
    queue_ms: float


@dataclass
class Phase:
    engine: str
    rounds: list[Round] = field(default_factory=list)


# -- one request each way -----------------------------------------------------------------


def engine_request(request_id: str, content: str, max_tokens: int) -> EngineRequest:
    return EngineRequest(id=request_id, messages=(ChatMessage("user", content),), max_tokens=max_tokens,
                         temperature=0.0)


async def baseline_ttft_ms(engine: Engine, request: EngineRequest) -> float:
    """Call -> first delta with tokens, in process; the rest of the answer is drained untimed."""
    started = time.perf_counter()
    first_ms = -1.0
    deltas: AsyncIterator[Any] = engine.generate(request)
    async for delta in deltas:
        if first_ms < 0 and delta.token_ids:
            first_ms = (time.perf_counter() - started) * 1000
    if first_ms < 0:
        raise RuntimeError(f"baseline request {request.id} produced no tokens")
    return first_ms


async def lanes_request(ws: ClientConnection, request_id: str, content: str, max_tokens: int
                        ) -> tuple[float, float, dict[str, float]]:
    """Send one chat; returns (send -> accepted ms, send -> first delta ms, the done frame's timing)."""
    frame = json.dumps({"type": "chat", "id": request_id, "messages": [{"role": "user", "content": content}],
                        "max_tokens": max_tokens, "temperature": 0.0})
    started = time.perf_counter()
    await ws.send(frame)
    accepted_ms = first_ms = -1.0
    while True:
        msg = json.loads(await ws.recv())
        now_ms = (time.perf_counter() - started) * 1000
        if msg["type"] == "accepted":
            accepted_ms = now_ms
        elif msg["type"] == "delta" and first_ms < 0:
            first_ms = now_ms
        elif msg["type"] == "done":
            return accepted_ms, first_ms, msg["timing"]
        elif msg["type"] == "error":
            raise RuntimeError(f"request {request_id} failed: {msg}")


async def one_round(engine: Engine, ws: ClientConnection, i: int, max_tokens: int) -> Round:
    content = PROMPTS[i % len(PROMPTS)]
    base = await baseline_ttft_ms(engine, engine_request(f"base-{i}", content, max_tokens))
    accepted_ms, client_ms, timing = await lanes_request(ws, f"lanes-{i}-{uuid.uuid4().hex[:6]}", content, max_tokens)
    return Round(base, client_ms, accepted_ms, float(timing["ttft_ms"]), float(timing["queue_ms"]))


async def run_phase(name: str, engine: Engine, url: str, args: argparse.Namespace, deadline: float) -> Phase:
    """Warm up, then ``args.requests`` alternating rounds (stops early at the deadline)."""
    phase = Phase(name)
    await engine.start()
    try:
        async with websockets.connect(url, max_size=None) as ws:
            for i in range(args.warmup + args.requests):
                if time.monotonic() > deadline:
                    print(f"deadline reached: {name} stopped after {len(phase.rounds)} rounds", file=sys.stderr)
                    break
                result = await asyncio.wait_for(one_round(engine, ws, i, args.max_tokens), 60)
                if i >= args.warmup:
                    phase.rounds.append(result)
    finally:
        await engine.close()
    return phase


# -- engines --------------------------------------------------------------------------------


def hf_engine(model_dir: Path) -> Engine:
    from lanes.workers.engines.hf import HFEngine

    return HFEngine(str(model_dir), max_slots=MAX_SLOTS)


def sim_engine() -> Engine:
    from lanes.scheduler.costmodel import get_profile
    from lanes.workers.engines.sim import SimEngine

    return SimEngine(get_profile(SIM_PROFILE), max_num_seqs=MAX_SLOTS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                     time_scale=SIM_TIME_SCALE)


def hf_worker_args(model_dir: Path) -> list[str]:
    return ["--engine", "hf", "--model", str(model_dir), "--max-slots", str(MAX_SLOTS)]


def sim_worker_args() -> list[str]:
    return ["--engine", "sim", "--sim-time-scale", str(SIM_TIME_SCALE), "--sim-profile", SIM_PROFILE,
            "--max-slots", str(MAX_SLOTS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)]


# -- statistics and output --------------------------------------------------------------------


def pct(values: list[float], q: int) -> float:
    """Percentile ``q`` (1..99), linear interpolation between order statistics."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def p50_p99(values: list[float]) -> dict[str, float]:
    return {"p50": round(pct(values, 50), 3), "p99": round(pct(values, 99), 3)}


def summarize(phase: Phase) -> dict[str, Any]:
    rounds = phase.rounds
    base = [r.baseline_ttft_ms for r in rounds]
    client = [r.client_ttft_ms for r in rounds]
    edge = [r.edge_ttft_ms for r in rounds]
    base_stats, client_stats = p50_p99(base), p50_p99(client)
    return {
        "engine": phase.engine,
        "num_requests": len(rounds),
        "baseline_ttft_ms": base_stats,
        "lanes_client_ttft_ms": client_stats,
        "lanes_edge_ttft_ms": p50_p99(edge),
        "lanes_client_accepted_ms": p50_p99([r.client_accepted_ms for r in rounds]),
        "queue_ms": p50_p99([r.queue_ms for r in rounds]),
        "overhead_ms": {k: round(client_stats[k] - base_stats[k], 3) for k in ("p50", "p99")},
        "overhead_paired_ms": p50_p99([c - b for c, b in zip(client, base)]),
        "overhead_edge_paired_ms": p50_p99([e - b for e, b in zip(edge, base)]),
        "ratio_p50": round(client_stats["p50"] / base_stats["p50"], 2) if base_stats["p50"] > 0 else None,
        "rounds": [asdict(r) for r in rounds],
    }


ROWS = (
    ("baseline TTFT (engine in-process)", "baseline_ttft_ms"),
    ("lanes TTFT, client send -> first delta", "lanes_client_ttft_ms"),
    ("lanes TTFT, edge timing.ttft_ms", "lanes_edge_ttft_ms"),
    ("lanes send -> accepted", "lanes_client_accepted_ms"),
    ("queue_ms (enqueue -> claim)", "queue_ms"),
    ("overhead = lanes - baseline (of p50s / p99s)", "overhead_ms"),
    ("overhead, per-round paired (client - baseline)", "overhead_paired_ms"),
    ("overhead, per-round paired (edge - baseline)", "overhead_edge_paired_ms"),
)


def markdown_table(summaries: list[dict[str, Any]]) -> str:
    head = "| metric (ms) | " + " | ".join(f"{s['engine']} p50 | {s['engine']} p99" for s in summaries) + " |"
    sep = "| --- |" + " ---: | ---: |" * len(summaries)
    lines = [head, sep]
    for label, key in ROWS:
        cells = " | ".join(f"{s[key]['p50']:.2f} | {s[key]['p99']:.2f}" for s in summaries)
        lines.append(f"| {label} | {cells} |")
    ratios = " | ".join(f"{s['ratio_p50']:.2f}x | " for s in summaries)
    lines.append(f"| ratio lanes/baseline TTFT (p50s) | {ratios}|")
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


async def measure(args: argparse.Namespace, work_dir: Path) -> list[Phase]:
    from lanes.workers.models.tiny import build_tiny

    deadline = time.monotonic() + args.deadline_s
    model_dir = build_tiny(work_dir / "tiny").target
    phases = []
    with Cluster.embedded(f"bench{uuid.uuid4().hex[:6]}", work_dir) as cluster:
        cluster.start_scheduler()
        url = cluster.start_edge("edge")
        cluster.start_worker("worker-hf", "", *hf_worker_args(model_dir))
        cluster.wait_workers(1, timeout_s=180)
        print(f"edge pid {cluster.procs['edge'].pid}, hf worker pid {cluster.procs['worker-hf'].pid}, "
              f"logs {work_dir}", file=sys.stderr)
        phases.append(await run_phase("hf", hf_engine(model_dir), url, args, deadline))
        cluster.stop(names=["worker-hf"])
        if args.sim:
            cluster.start_worker("worker-sim", "", *sim_worker_args())
            cluster.wait_workers(1, timeout_s=180)
            phases.append(await run_phase("sim", sim_engine(), url, args, deadline))
    return phases


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100, help="timed rounds per engine")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--sim", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure with the sim engine (default on)")
    parser.add_argument("--deadline-s", type=float, default=600, help="stop measuring after this long")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temp dir (process logs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work_dir = Path(tempfile.mkdtemp(prefix="lanes-edge-bench-"))
    phases = asyncio.run(measure(args, work_dir))
    summaries = [summarize(p) for p in phases]
    if args.json:
        print(json.dumps({"max_tokens": args.max_tokens, "warmup": args.warmup, "cpus": os.cpu_count(),
                          "phases": summaries}))
    else:
        print(markdown_table(summaries))
    if not args.keep_logs:
        import shutil

        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
