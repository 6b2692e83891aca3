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
is stopped at the end. The headline, ``added_ms_p50`` / ``added_ms_p99``, is the per-round
paired difference (client send -> first delta, minus the in-process call -> first token) with
the sim engine; ``hf_added_ms_p50`` / ``hf_added_ms_p99`` the same with the tiny model.

    lanes bench overhead [--requests 100] [--engines sim,hf] [--json] [--plot FILE]
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import websockets
from lanes.bench.common import console, machine_load, progress
from lanes.cli.cluster import Cluster
from lanes.cli.failures import Failure
from lanes.queue.messages import ChatMessage
from lanes.scheduler.live_policy import MAX_NUM_BATCHED_TOKENS
from lanes.workers.engines.base import Engine, EngineRequest
from websockets.asyncio.client import ClientConnection

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
            raise Failure(f"request {request_id} got an error frame: {msg.get('code')}: {msg.get('message')}")


async def one_round(engine: Engine, ws: ClientConnection, i: int, max_tokens: int) -> Round:
    content = PROMPTS[i % len(PROMPTS)]
    base = await baseline_ttft_ms(engine, engine_request(f"base-{i}", content, max_tokens))
    accepted_ms, client_ms, timing = await lanes_request(ws, f"lanes-{i}-{uuid.uuid4().hex[:6]}", content, max_tokens)
    return Round(base, client_ms, accepted_ms, float(timing["ttft_ms"]), float(timing["queue_ms"]))


@dataclass(frozen=True)
class Options:
    requests: int = 100
    warmup: int = 5
    max_tokens: int = 8
    engines: tuple[str, ...] = ("sim", "hf")
    deadline_s: float = 600.0


#: A round with no answer after this long has lost it.
ROUND_TIMEOUT_S = 60.0
#: How often a waiting round checks that no child process has died.
CRASH_POLL_S = 0.2


async def watched(work: Awaitable[Round], crashed: Callable[[], list[str]], what: str) -> Round:
    """``work``'s result; ``Failure`` at once when a child process dies (``Cluster.crashed``), the
    edge closes the connection, or no answer comes within ``ROUND_TIMEOUT_S``.

    Polled with ``asyncio.wait``, not ``asyncio.wait_for``: Python 3.11's ``wait_for`` returns
    the result instead of raising when the cancellation (SIGTERM, Ctrl-C) arrives as the inner
    work finishes, so the run would go on."""
    task = asyncio.ensure_future(work)
    deadline = time.monotonic() + ROUND_TIMEOUT_S
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=CRASH_POLL_S)
            if not task.done() and (dead := crashed()):
                raise Failure(f"{what}: {', '.join(dead)} exited while it waited for its answer; the run is not valid")
            if not task.done() and time.monotonic() > deadline:
                raise Failure(f"{what}: no answer in {ROUND_TIMEOUT_S:.0f} s; the run is not valid")
        try:
            return task.result()
        except websockets.ConnectionClosed as exc:
            raise Failure(f"{what}: the edge closed the connection ({exc}); crashed: "
                          f"{', '.join(crashed()) or 'nothing'}") from None
    finally:
        task.cancel()


async def run_phase(name: str, engine: Engine, url: str, options: Options, deadline: float,
                    tick: Callable[..., Any], crashed: Callable[[], list[str]] = list) -> Phase:
    """Warm up, then ``options.requests`` alternating rounds (stops early at the deadline);
    ``Failure`` when a round fails (``watched``)."""
    phase = Phase(name)
    await engine.start()
    try:
        async with websockets.connect(url, max_size=None) as ws:
            for i in range(options.warmup + options.requests):
                if time.monotonic() > deadline:
                    console.print(f"deadline reached: {name} stopped after {len(phase.rounds)} rounds")
                    break
                result = await watched(one_round(engine, ws, i, options.max_tokens), crashed,
                                       f"{name} engine, round {i + 1}")
                if i >= options.warmup:
                    phase.rounds.append(result)
                tick()
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


# -- main -------------------------------------------------------------------------------------


async def measure(options: Options, work_dir: Path) -> list[Phase]:
    deadline = time.monotonic() + options.deadline_s
    phases = []
    with Cluster.embedded(f"bench{uuid.uuid4().hex[:6]}", work_dir) as cluster, \
            progress("overhead", len(options.engines) * (options.warmup + options.requests)) as tick:
        cluster.start_scheduler()
        url = cluster.start_edge("edge")
        for name in options.engines:
            if name == "hf":
                from lanes.workers.models.tiny import build_tiny

                model_dir = build_tiny(work_dir / "tiny").target
                worker_args, engine = hf_worker_args(model_dir), hf_engine(model_dir)
            else:
                worker_args, engine = sim_worker_args(), sim_engine()
            cluster.start_worker(f"worker-{name}", "", *worker_args)
            cluster.wait_workers(1, timeout_s=180)
            phases.append(await run_phase(name, engine, url, options, deadline, tick, cluster.crashed))
            cluster.stop(names=[f"worker-{name}"])
    return phases


def run(options: Options, keep_logs: bool = False) -> dict[str, Any]:
    """Measure every engine in ``options.engines``; one JSON-ready dict."""
    unknown = set(options.engines) - {"sim", "hf"}
    if unknown or not options.engines:
        raise ValueError(f"engines must be sim and/or hf, not {sorted(unknown) or 'none'}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work_dir = Path(tempfile.mkdtemp(prefix="lanes-overhead-"))
    try:
        phases = asyncio.run(measure(options, work_dir))
    finally:
        if keep_logs:
            console.print(f"process logs kept in {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    summaries = {p.engine: summarize(p) for p in phases}
    result: dict[str, Any] = {"max_tokens": options.max_tokens, "warmup": options.warmup,
                              "machine": machine_load(), "phases": list(summaries.values())}
    for name, summary in summaries.items():
        prefix = "" if name == "sim" else f"{name}_"
        result[f"{prefix}added_ms_p50"] = summary["overhead_paired_ms"]["p50"]
        result[f"{prefix}added_ms_p99"] = summary["overhead_paired_ms"]["p99"]
    return result


def verdict(result: dict[str, Any]) -> list[str]:
    """Why the run is not valid (empty: valid): an engine that finished no timed round."""
    return [f"{p['engine']} engine: no timed round finished before --deadline-s" for p in result["phases"]
            if not p["num_requests"]]


def write_plot(result: dict[str, Any], path: Path) -> None:
    """Per engine, the sorted per-round added latency (a CDF read sideways)."""
    from lanes.bench.common import plot_lines

    series = {}
    for phase in result["phases"]:
        added = sorted(r["client_ttft_ms"] - r["baseline_ttft_ms"] for r in phase["rounds"])
        series[f"{phase['engine']} engine"] = ([100 * (i + 0.5) / len(added) for i in range(len(added))], added)
    plot_lines(path, "Added latency (client send -> first delta, minus in-process TTFT)", "percentile",
               "added ms", series)
