"""``lanes bench live``: a slice of a trace replayed through the real system, once with one lane
(``LANES_POLICY=fcfs``) and once with lanes (``LANES_POLICY=lanes``), next to the simulator's
figures for the same slice and settings.

Method
------
1. **The slice.** ``--requests`` rows of the trace from row ``--start``. Each row is paired
   with a prompt of ``--prompts`` exactly as ``lanes bench policy`` does
   (``sim.predictions.pair_prompts``: the closest known answer length, each prompt used
   evenly; a slice shorter than the pool uses each prompt at most once), and the shipped
   predictor's output on that prompt (with ``max_tokens`` 4096, ``SIM_MAX_TOKENS``) is the
   prediction the simulator uses; the live edges run the same predictor on the same text.
2. **Prompt and answer lengths.** A request carries a system message of filler before the
   pool prompt, so that its characters are 4 x the row's ``ContextTokens``; the predictor
   reads only the last user message, so the filler changes no prediction, and the sim engine
   counts chars / 4 prompt tokens. The simulator is given exactly those counts (consistency
   over fidelity: they equal ``ContextTokens`` up to rounding, or the prompt's own length when
   that is longer). The answer is the row's ``GeneratedTokens``: requests carry
   ``max_tokens`` 4096 (as the simulator assumes, so the predictor is not capped by the true
   length) and the stop string ``" tok<N>"``, which ends the sim engine's filler after exactly
   N tokens.
3. **Load.** Arrivals are scaled so that the slice's mean rate is ``--load`` x the FCFS
   capacity of that slice on the same workers (``sim.run.fcfs_capacity_rps``), then run
   ``--time-scale`` times faster than real time: the sim engines divide every step by the
   same factor, and every time-based setting of the live policy (slot starvation bound,
   FCFS-below bound, hand-back wait bound and minimum run) is divided by it too.
   All times reported are in trace time (wall seconds x time scale).
4. **The live system.** Per policy a fresh cluster (``cli.cluster.Cluster``): an embedded
   redis-server, a scheduler, ``--edges`` edges and ``--workers`` sim workers with
   ``--slots`` slots running chunked prefill at 2,048 tokens a step (what the ``vllm`` and
   ``trtllm`` workers configure; the simulator's ``EngineConfig(chunked_prefill_tokens=2048)``,
   the default of ``lanes bench policy``). ``--chunked-prefill-tokens 0`` runs vLLM v0's
   iterations on both sides instead (8,192 prompt tokens a prefill, the 8 s FCFS-below bound),
   as every table before stop 35 did.
   ``lanes`` runs with the simulator's tuning (``sim.policies.LanesTuning``): a routing
   threshold fitted, as the scheduler's refresh fits it, on (prediction, length) pairs of
   prompts the requests do not use, the pool's unused ones (the slice's own first rows when
   fewer than ``MIN_CALIBRATION_PROMPTS``, 200, are unused), shared by both sides (``LANES_SHORT_MAX_TOKENS`` =
   ``LANES_MEDIUM_MAX_TOKENS``: two lanes), and the shipped defaults for the rest
   (``live_policy``: long / medium + long slot shares 75 % / 95 %, 10 % of slots guaranteed
   to the long lane after 20 s, FCFS across lanes while the short lane waited < 4 s (the bound
   for engines that chunk prefill), demotion
   at 200 tokens, hand-back after 20 s; ``live_env`` sets each explicitly). The predictor
   refresh and observation reports are off, so the thresholds cannot move during the run.
5. **Clients.** ``--clients`` lean WebSocket connections (``bench.wsclient``) spread over the
   edges send each request at its (scaled) arrival time, open loop. TTFT is measured from that
   scheduled time to the first delta, so a late client counts against the system; the send lag
   is reported. Every request must end with ``done`` with gap-free sequence numbers and the
   expected number of tokens.
   The command starts its own Redis and processes; it does not target an existing deployment
   (``--url`` / ``LANES_REDIS_URL``): the policy, slot and threshold settings must be the
   replay's, and a fresh, empty system per policy keeps the two runs comparable.
6. **Metrics**, for live and simulated runs alike (``np.percentile``): TTFT p50/p99 (ms) of
   short (answer <= the slice's p50) and long (> p90) requests and of all, and throughput
   (requests / (last finish - first arrival), trace time). ``sim_gap`` is the relative
   difference of the short TTFT p99 gain (fcfs p99 / lanes p99), live vs simulated:
   ``gain_live / gain_sim - 1`` (goal: within +-20 %). The simulator charges each request the
   predictor time measured while planning (as ``bench policy`` does), so its figures move by a
   few per cent from one invocation to the next; so do the live ones (p99 of ~200 short and
   ~40 long requests is their 2nd and 1st largest value).
"""

from __future__ import annotations

import asyncio
import math
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from lanes.bench.common import CpuMeter, machine_load, progress
from lanes.bench.wsclient import LeanClient, Stream
from lanes.cli.cluster import Cluster
from lanes.scheduler.costmodel import get_profile
from lanes.scheduler.live_policy import (
    MAX_NUM_BATCHED_TOKENS,
    fcfs_below_ms_for,
    share_of_slots,
)
from lanes.scheduler.policy import NO_BOUND_TOKENS, LaneThresholds, RoutingCalibration, routing_from_observations
from lanes.scheduler.sim.engine import EngineConfig
from lanes.scheduler.sim.metrics import class_masks
from lanes.scheduler.sim.noise import kendall_tau
from lanes.scheduler.sim.policies import SIM_MAX_TOKENS, LanesTuning, make_policy
from lanes.scheduler.sim.predictions import pair_prompts
from lanes.scheduler.sim.run import fcfs_capacity_rps, run_policy
from lanes.scheduler.sim.trace import Trace

POLICIES = ("fcfs", "lanes")
CLASSES = ("short", "long", "all")
#: Characters per prompt token in the sim engine (``workers.engines.sim.prompt_token_count``).
CHARS_PER_TOKEN = 4
SIM_GAP_GOAL = 0.2
#: Unused pool prompts the lanes' threshold is fitted on, at least; with fewer, the slice's own
#: first rows (``LanesTuning.calibration_share``).
MIN_CALIBRATION_PROMPTS = 200


@dataclass(frozen=True)
class Plan:
    """The slice, what each request sends, and what the simulator is given."""

    trace: Trace
    #: Per request: pool prompt text, filler chars, predicted tokens (predictor), its ms.
    prompts: list[str]
    pad_chars: list[int]
    predicted: np.ndarray
    predictor_ms: np.ndarray
    tau: float
    engine: EngineConfig
    workers: int
    load: float
    capacity_rps: float
    tuning: LanesTuning
    routing_max_tokens: int
    share_long_lane: float
    #: Where the lanes' threshold was fitted: the pool's prompts the slice does not use
    #: (``held-out``), or the slice's own first rows (``in-slice``: the pool is all used).
    calibrated_on: str = "in-slice"
    num_calibration: int = 0


def engine_config(profile: str, slots: int, chunked_prefill_tokens: int = MAX_NUM_BATCHED_TOKENS) -> EngineConfig:
    """The engine both sides run: chunked prefill at ``chunked_prefill_tokens`` a step, or (0)
    vLLM v0's prefill-or-decode iterations at 8,192 prompt tokens a prefill (the tables before
    stop 35). ``ValueError`` (from ``EngineConfig``) for a budget that cannot hold the slots."""
    return EngineConfig(get_profile(profile), max_num_seqs=slots, chunked_prefill_tokens=chunked_prefill_tokens)


def plan(trace: Trace, pool_prompts: list[str], pool_tokens: np.ndarray, predict: Any, *, engine: EngineConfig,
         workers: int, load: float, tuning: LanesTuning | None = None) -> Plan:
    """Pair, predict, size prompts and scale arrivals (see the module doc, steps 1-3)."""
    from lanes.scheduler.sim.predictions import predict_prompts

    tuning = tuning or LanesTuning(fcfs_below_ms=fcfs_below_ms_for(chunked_prefill=engine.chunked_prefill_tokens > 0))
    paired = pair_prompts(trace.output_tokens, pool_tokens)
    used = sorted(set(paired.tolist()))
    tokens, latency = predict_prompts(predict, [pool_prompts[i] for i in used], SIM_MAX_TOKENS)
    by_pool = {i: (t, ms) for i, t, ms in zip(used, tokens, latency, strict=True)}
    predicted = np.array([by_pool[i][0] for i in paired])
    predictor_ms = np.array([by_pool[i][1] for i in paired])
    prompts = [pool_prompts[i] for i in paired]
    pad = [max(0, CHARS_PER_TOKEN * int(ctx) - len(p)) for ctx, p in zip(trace.prompt_tokens, prompts, strict=True)]
    # What the sim engine will count: all message characters / 4.
    prompt_tokens = np.array([max(1, (n + len(p)) // CHARS_PER_TOKEN) for n, p in zip(pad, prompts, strict=True)])
    sliced = Trace(trace.arrival_s - trace.arrival_s[0], prompt_tokens, trace.output_tokens)
    capacity = fcfs_capacity_rps(sliced, engine, workers)
    scaled = sliced.time_scaled(load * capacity / sliced.rate_rps)
    # The threshold, as the scheduler's refresh fits it on finished requests it does not route:
    # on the pool's prompts the slice leaves unused, with their known lengths. Fitted on the
    # slice's own first 20 % (80 rows of 400: some 40 short answers for a 0.5 % budget), it sent
    # 11 of the slice's 208 short answers long, and those set the short P99 (stop 39).
    held_out = sorted(set(range(len(pool_prompts))) - set(used))
    routing = None
    if len(held_out) >= MIN_CALIBRATION_PROMPTS:
        held_tokens, _ = predict_prompts(predict, [pool_prompts[i] for i in held_out], SIM_MAX_TOKENS)
        fitted = routing_from_observations(np.rint(held_tokens).tolist(), pool_tokens[held_out].astype(int).tolist(),
                                           RoutingCalibration(tuning.max_short_to_long, tuning.short_quantile, 1))
        routing = [fitted or LaneThresholds(NO_BOUND_TOKENS, NO_BOUND_TOKENS)] * len(trace)
    lanes = make_policy("lanes", scaled, predicted, engine.max_num_seqs, predictor_ms=predictor_ms, tuning=tuning,
                        routing=routing)
    short_max = routing[0].short_max_tokens if routing else int(lanes.info["routing_short_max"])
    return Plan(scaled, prompts, pad, predicted, predictor_ms, kendall_tau(trace.output_tokens, predicted), engine,
                workers, load, capacity, tuning, int(short_max), lanes.info["share_long_lane"],
                "held-out" if routing else "in-slice", len(held_out) if routing else 0)


def routing_of(p: Plan) -> list[LaneThresholds]:
    """The lanes' thresholds of every request of the plan (what the live edges are given)."""
    return [LaneThresholds(p.routing_max_tokens, p.routing_max_tokens)] * len(p.trace)


# -- metrics ---------------------------------------------------------------------------------


def metrics(arrival_s: np.ndarray, first_s: np.ndarray, finish_s: np.ndarray,
            output_tokens: np.ndarray) -> dict[str, dict[str, Any]]:
    """TTFT p50/p99 (ms) and throughput per class (``sim.metrics.class_masks``); times in trace
    seconds. A class with no requests gets the same keys, ``None`` (as ``sim.metrics.summarize``)."""
    ttft_ms = (first_s - arrival_s) * 1000.0
    e2e_ms = (finish_s - arrival_s) * 1000.0
    throughput = len(arrival_s) / float(finish_s.max() - arrival_s.min())
    out: dict[str, dict[str, Any]] = {}
    for name, mask in class_masks(output_tokens).items():
        def pct(values: np.ndarray, q: int) -> float | None:
            return float(np.percentile(values[mask], q)) if mask.any() else None

        out[name] = {"num_requests": int(mask.sum()), "ttft_ms_p50": pct(ttft_ms, 50), "ttft_ms_p99": pct(ttft_ms, 99),
                     "throughput_rps": throughput, "e2e_ms_p99": pct(e2e_ms, 99)}
    return out


def simulate(p: Plan) -> dict[str, dict[str, Any]]:
    """The simulator's figures for the same slice, predictions and settings."""
    out = {}
    for name in POLICIES:
        policy = make_policy(name, p.trace, p.predicted, p.engine.max_num_seqs, predictor_ms=p.predictor_ms,
                             tuning=p.tuning, routing=routing_of(p) if name == "lanes" else None)
        result = run_policy(p.trace, policy, p.engine, p.workers)
        out[name] = metrics(result.arrival_s, result.first_token_s, result.finish_s, p.trace.output_tokens)
        out[name]["num_preemptions"] = int(result.num_preemptions.sum())
    return out


def short_p99_gain(results: dict[str, Any], cls: str = "short") -> float:
    """fcfs TTFT p99 / lanes TTFT p99 of a class (the short one by default); NaN for a class
    with no requests."""
    fcfs_p99, lanes_p99 = results["fcfs"][cls]["ttft_ms_p99"], results["lanes"][cls]["ttft_ms_p99"]
    return fcfs_p99 / lanes_p99 if fcfs_p99 is not None and lanes_p99 else math.nan


# -- the live run ----------------------------------------------------------------------------


def live_env(p: Plan, policy: str, time_scale: float) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """Environment of every child, of the edges and of the workers (module doc, step 4)."""
    t = p.tuning
    common = {"LANES_POLICY": policy, "LANES_REPORT_OBSERVATIONS": "false", "LANES_PREDICTOR_REFRESH_MINUTES": "0"}
    big = str(100_000)
    edge = {"LANES_SHORT_MAX_TOKENS": str(p.routing_max_tokens), "LANES_MEDIUM_MAX_TOKENS": str(p.routing_max_tokens),
            "LANES_MAX_DEPTH_SHORT": big, "LANES_MAX_DEPTH_MEDIUM": big, "LANES_MAX_DEPTH_LONG": big,
            "LANES_MAX_IN_FLIGHT_PER_CONNECTION": big, "LANES_MAX_TOKENS_LIMIT": str(SIM_MAX_TOKENS),
            "LANES_MAX_PROMPT_CHARS": str(1 << 20), "LANES_MAX_FRAME_BYTES": str(1 << 21),
            "LANES_KEY_RATE_PER_S": "0", "LANES_KEY_MAX_IN_FLIGHT": "0"}
    slots = p.engine.max_num_seqs
    pre = t.preemption
    chunked = p.engine.chunked_prefill_tokens > 0
    worker = {"LANES_SIM_CHUNKED_PREFILL": str(chunked).lower(),
              "LANES_MAX_NUM_BATCHED_TOKENS": str(p.engine.chunked_prefill_tokens if chunked else p.engine.max_prefill_tokens),
              # The long cap no higher than the medium + long one, which binds first anyway (a
              # worker refuses a long cap above it).
              "LANES_MAX_LONG_SLOTS": str(min(share_of_slots(t.max_long_share, slots),
                                              share_of_slots(t.max_medium_long_share, slots))),
              "LANES_MAX_MEDIUM_LONG_SLOTS": str(share_of_slots(t.max_medium_long_share, slots)),
              "LANES_MIN_LONG_SLOTS": str(share_of_slots(t.min_long_share, slots)), "LANES_MIN_MEDIUM_SLOTS": "0",
              "LANES_STARVE_AFTER_MS": str(t.starve_after_ms / time_scale),
              "LANES_PROTECT_AFTER_MS": str(t.protect_after_ms / time_scale),
              "LANES_BORROW_WHEN_IDLE": str(t.borrow_when_idle).lower(), "LANES_FCFS_BELOW_MS": str(t.fcfs_below_ms / time_scale),
              # The simulator's "never" is an infinite bound; the worker's is 0 (it refuses inf).
              "LANES_PREEMPT_AFTER_MS": "0" if math.isinf(pre.wait_bound_ms) else str(pre.wait_bound_ms / time_scale),
              "LANES_MAX_PREEMPTIONS": str(pre.max_preemptions),
              "LANES_PREEMPT_MIN_RUN_MS": str(pre.min_run_ms / time_scale)}
    return common, edge, worker


@dataclass
class Replay:
    """Sends each request at its scaled arrival time; collects what comes back."""

    p: Plan
    time_scale: float
    clients: list[LeanClient]
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    streams: list[Stream | None] = field(default_factory=list)
    #: Wall time (perf_counter) of the first scheduled arrival.
    t0: float = 0.0
    num_ended: int = 0
    send_lag_s: list[float] = field(default_factory=list)

    def _send(self, i: int) -> None:
        client = self.clients[i % len(self.clients)]
        n = int(self.p.trace.output_tokens[i])
        pad = self.p.pad_chars[i]
        messages = [{"role": "system", "content": "x" * pad}] if pad else None
        stream = client.chat(f"l{self.tag}-{i}", self.p.prompts[i], SIM_MAX_TOKENS, messages=messages,
                             temperature=0.0, stop=[f" tok{n}"])
        self.send_lag_s.append(stream.sent_at - self.scheduled(i))
        self.streams[i] = stream

    def scheduled(self, i: int) -> float:
        return self.t0 + float(self.p.trace.arrival_s[i]) / self.time_scale

    def _ended(self, rid: str, stream: Stream) -> None:
        self.num_ended += 1

    async def run(self, tick: Any, timeout_s: float, crashed: Callable[[], list[str]] = list) -> None:
        """Send every request on time; return once all ended, ``timeout_s`` after the last
        arrival, or as soon as a child process has crashed (the run is not valid then)."""
        loop = asyncio.get_running_loop()
        n = len(self.p.trace)
        self.streams = [None] * n
        for client in self.clients:
            client.on_end = self._ended
        self.t0 = time.perf_counter() + 0.2
        offset = loop.time() - time.perf_counter()
        for i in range(n):
            loop.call_at(self.scheduled(i) + offset, self._send, i)
        span_s = float(self.p.trace.arrival_s[-1]) / self.time_scale
        deadline = self.t0 + span_s + timeout_s
        last = time.perf_counter()
        while self.num_ended < n and time.perf_counter() < deadline and not crashed():
            await asyncio.sleep(0.2)
            now = time.perf_counter()
            tick((now - last) * self.time_scale)
            last = now


async def _replay(cluster: Cluster, edges: list[str], p: Plan, time_scale: float, num_clients: int, tick: Any,
                  timeout_s: float) -> Replay:
    clients = [await LeanClient.connect(cluster.edge_hosts[edges[i % len(edges)]],
                                        cluster.edge_ports[edges[i % len(edges)]]) for i in range(num_clients)]
    replay = Replay(p, time_scale, clients)
    try:
        await replay.run(tick, timeout_s, cluster.crashed)
    finally:
        for client in clients:
            client.close()
    return replay


def drain_wall_s(time_scale: float, drain_trace_s: float = 240.0, min_wall_s: float = 120.0) -> float:
    """Wall seconds the replay waits after the last arrival for the last answers: ``drain_trace_s``
    of trace time (the system runs ``time_scale`` times faster than the trace), at least
    ``min_wall_s`` (at a high time scale the CPU, not the cost model, sets the pace)."""
    return max(min_wall_s, drain_trace_s / time_scale)


def run_live(p: Plan, policy: str, *, time_scale: float, num_edges: int, num_clients: int, tick: Any,
             timeout_s: float | None = None) -> dict[str, Any]:
    """One policy on a fresh cluster; per-class metrics (trace time) and the checks. ``timeout_s``:
    wall seconds to wait after the last arrival (default ``drain_wall_s(time_scale)``)."""
    timeout_s = drain_wall_s(time_scale) if timeout_s is None else timeout_s
    common, edge_env, worker_env = live_env(p, policy, time_scale)
    with tempfile.TemporaryDirectory(prefix="lanes-live-") as logs, \
            Cluster.embedded(f"live{uuid.uuid4().hex[:6]}", Path(logs), base_env=common) as cluster:
        cluster.start_scheduler(LANES_DEPTH_INTERVAL_S="0.1")
        edges = [f"edge{i}" for i in range(num_edges)]
        for name in edges:
            cluster.start_edge(name, wait=False, **edge_env)
        for i in range(p.workers):
            cluster.start_worker(f"w{i}", "", "--engine", "sim", "--sim-time-scale", str(time_scale),
                                 "--sim-profile", p.engine.profile.name, "--max-slots", str(p.engine.max_num_seqs),
                                 **worker_env)
        for name in edges:
            cluster.wait_edge(name)
        cluster.wait_workers(p.workers)
        assert cluster.redis is not None and cluster.redis.process is not None
        pids = {name: cluster.procs[name].pid for name in cluster.procs} | {"redis": cluster.redis.process.pid}
        meter = CpuMeter(pids)
        meter.start()
        started = time.perf_counter()
        replay = asyncio.run(_replay(cluster, edges, p, time_scale, num_clients, tick, timeout_s))
        wall_s = time.perf_counter() - started
        used = meter.stop()
        crashed = cluster.crashed()
    return _live_result(p, replay, time_scale, used, wall_s, crashed)


def _live_result(p: Plan, replay: Replay, time_scale: float, cpu_s: dict[str, float], wall_s: float,
                 crashed: list[str]) -> dict[str, Any]:
    n = len(p.trace)
    streams = replay.streams
    ended = [s for s in streams if s is not None and s.end is not None]
    done = [s for s in ended if s.end is not None and s.end.type == "done"]
    errors: dict[str, int] = {}
    for s in ended:
        if s.end is not None and s.end.type != "done":
            errors[s.end.code or "?"] = errors.get(s.end.code or "?", 0) + 1
    wrong_length = sum(1 for i, s in enumerate(streams) if s is not None and s.end is not None and s.end.usage
                       and s.end.usage.get("completion_tokens") != int(p.trace.output_tokens[i]))
    lanes_seen: dict[str, int] = {}
    mismatched = 0
    for i, s in enumerate(streams):
        if s is not None and s.accepted is not None:
            lanes_seen[s.accepted.lane or "?"] = lanes_seen.get(s.accepted.lane or "?", 0) + 1
            mismatched += int(s.accepted.predicted_tokens != int(p.predicted[i]))
    checks = {"num_requests": n, "num_done": len(done), "not_done": n - len(done), "errors": errors,
              "gaps": sum(s.gaps for s in streams if s is not None), "wrong_length": wrong_length,
              "lanes": lanes_seen, "predictions_differing_from_sim": mismatched, "crashed": crashed}
    result: dict[str, Any] = {"checks": checks}
    if len(done) == n:
        arrival = np.array([replay.scheduled(i) for i in range(n)])
        first = np.array([s.first_delta_at if s.first_delta_at is not None else s.ended_at
                          for s in streams if s is not None], dtype=float)
        finish = np.array([s.ended_at for s in streams if s is not None], dtype=float)
        t0 = replay.t0
        result |= metrics((arrival - t0) * time_scale, (first - t0) * time_scale, (finish - t0) * time_scale,
                          p.trace.output_tokens)
    lag = np.array(replay.send_lag_s) * 1000.0
    result["send_lag_ms"] = {"p50": float(np.percentile(lag, 50)), "max": float(lag.max())} if len(lag) else {}
    result["wall_s"] = round(wall_s, 1)
    result["cpu_cores_used"] = {k: round(v / wall_s, 2) for k, v in cpu_s.items()}
    result["cpu_cores_used_total"] = round(sum(cpu_s.values()) / wall_s, 2)
    return result


def _relative(live: float, sim: float) -> float:
    """``live / sim - 1``; NaN where either is NaN or ``sim`` is 0."""
    return live / sim - 1.0 if sim > 0 else math.nan


def verdict(result: dict[str, Any], policies: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """What makes a run invalid, and what only needs a warning, one phrase per problem.

    Invalid (module doc, step 5): a request that did not end with ``done``, a gap in a stream,
    an answer of another length than the row's, a child process that crashed. Only warned: live
    predictions that differ from the simulator's (the run is valid, but its ``sim_gap`` then
    compares different inputs)."""
    failed, warned = [], []
    for name in policies:
        c = result[name]["checks"]
        problems = [f"{c['not_done']} of {c['num_requests']} requests did not end with done" if c["not_done"] else "",
                    f"{c['gaps']} gaps in the streams" if c["gaps"] else "",
                    f"{c['wrong_length']} answers of the wrong length" if c["wrong_length"] else "",
                    f"crashed: {', '.join(c['crashed'])}" if c["crashed"] else ""]
        failed += [f"{name}: {x}" for x in problems if x]
        if c["predictions_differing_from_sim"]:
            warned.append(f"{name}: {c['predictions_differing_from_sim']} live predictions differ from the simulator's")
    return failed, warned


def run(p: Plan, *, time_scale: float, num_edges: int = 2, num_clients: int = 32,
        policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    """Both policies live, the simulator beside them, ``sim_gap`` and the machine's load."""
    sim = simulate(p)
    span_s = float(p.trace.arrival_s[-1])
    load_before = machine_load()
    live: dict[str, Any] = {}
    with progress(f"live replay ({len(policies)} policies, {len(p.trace)} requests)", span_s * len(policies)) as tick:
        for policy in policies:
            live[policy] = run_live(p, policy, time_scale=time_scale, num_edges=num_edges, num_clients=num_clients,
                                    tick=tick)
    complete = all("short" in live.get(name, {}) for name in POLICIES)
    gain_live = short_p99_gain(live) if complete else math.nan
    gain_sim = short_p99_gain(sim)
    sim_gap = gain_live / gain_sim - 1.0 if complete and gain_sim > 0 else math.nan
    #: The same relative difference for each class's p99 gain (``sim_gap`` is the short one's).
    by_class = {cls: _relative(short_p99_gain(live, cls), short_p99_gain(sim, cls)) if complete else math.nan
                for cls in CLASSES}
    for name in policies:
        for cls in CLASSES:
            if cls in live[name] and cls in sim[name]:
                live[name][cls]["sim_ttft_ms_p99"] = sim[name][cls]["ttft_ms_p99"]
                live_p99, sim_p99 = live[name][cls]["ttft_ms_p99"], sim[name][cls]["ttft_ms_p99"]
                live[name][cls]["ttft_p99_vs_sim"] = live_p99 / sim_p99 - 1 if live_p99 is not None and sim_p99 else None
    return {**live, "sim": sim, "sim_gap": sim_gap, "sim_gap_by_class": by_class, "short_p99_gain": {"live": gain_live, "sim": gain_sim},
            "sim_gap_goal": SIM_GAP_GOAL, "machine": {"before": load_before, "after": machine_load()},
            "config": {"requests": len(p.trace), "workers": p.workers, "slots": p.engine.max_num_seqs,
                       "chunked_prefill_tokens": p.engine.chunked_prefill_tokens,
                       "max_prefill_tokens": None if p.engine.chunked_prefill_tokens else p.engine.max_prefill_tokens,
                       "profile": p.engine.profile.name,
                       "load": p.load, "fcfs_capacity_rps": p.capacity_rps, "offered_rps": p.trace.rate_rps,
                       "time_scale": time_scale, "edges": num_edges, "clients": num_clients,
                       "trace_span_s": span_s, "predictor_tau": p.tau, "routing_long_above_tokens":
                       p.routing_max_tokens, "share_long_lane": p.share_long_lane,
                       "routing_calibrated_on": p.calibrated_on, "routing_num_calibration": p.num_calibration,
                       "times": "trace time (wall x time_scale), ms"}}
