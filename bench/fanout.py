"""``lanes bench fanout``: tokens per second one edge and one Redis deliver, and the server CPU
each 1,000 tokens costs (edge, workers, Redis), at a few concurrencies.

Real processes: an embedded redis-server, a scheduler, one edge and ``--workers`` sim workers
(a cost model far faster than real time, so tokens come as fast as the CPU allows). Lean
clients (``wsclient.py``) keep ``concurrency`` long answers in flight, starting a new one as
each ends; after a warm-up, a window of ``--seconds`` counts the deltas received and the CPU
every process used. Every stream is checked gap-free (seqs contiguous), every request must
end with ``done``, no load client may be closed by the edge (4008: it read too slowly, and the
edge cancelled its requests) and no process may crash; otherwise the run is not valid.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from lanes.bench.common import CpuMeter, machine_load, progress, sim_system
from lanes.bench.wsclient import LeanClient, Stream
from lanes.cli.failures import Failure

MAX_TOKENS = 4000
#: Load clients (WebSocket connections) at most; the requests in flight are spread over them.
MAX_CLIENTS = 32
PROMPT = "Write a very long story about the sea."


@dataclass
class Load:
    """Keeps ``concurrency`` requests in flight over ``clients``; counts what arrives."""

    clients: list[LeanClient]
    #: Requests kept in flight on each client (``split_in_flight``).
    per_client: list[int]
    max_tokens: int
    ids: itertools.count = field(default_factory=itertools.count)
    #: Ids are unique per run: reusing one would be (rightly) refused as a duplicate.
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    running: bool = True
    num_done: int = 0
    num_bad: int = 0
    num_gaps: int = 0

    def start(self) -> None:
        for client, num in zip(self.clients, self.per_client, strict=True):
            for _ in range(num):
                self._send(client)

    def _send(self, client: LeanClient) -> None:
        client.chat(f"f{self.tag}-{next(self.ids)}", PROMPT, self.max_tokens, temperature=0.0)

    def ended(self, client: LeanClient, rid: str, stream: Stream) -> None:
        self.num_gaps += stream.gaps
        if stream.end is not None and stream.end.type == "done":
            self.num_done += 1
        else:
            self.num_bad += 1
        del client.streams[rid]
        if self.running and not client.closed:
            self._send(client)

    def in_flight(self) -> int:
        return sum(len(c.streams) for c in self.clients if not c.closed)

    def deltas(self) -> int:
        return sum(c.num_deltas for c in self.clients)


def split_in_flight(concurrency: int, max_clients: int = MAX_CLIENTS) -> list[int]:
    """Requests in flight per client: ``concurrency`` in all over ``min(concurrency, max_clients)``
    clients, the remainder one each on the first ones (40 over 32: eight clients keep 2, the rest 1)."""
    num_clients = min(concurrency, max_clients)
    base, extra = divmod(concurrency, num_clients)
    return [base + (i < extra) for i in range(num_clients)]


async def _connect(host: str, port: int, num: int) -> list[LeanClient]:
    clients: list[LeanClient] = []
    for _ in range(num):
        client = await LeanClient.connect(host, port)
        clients.append(client)
    return clients


async def measure(host: str, port: int, pids: dict[str, int], concurrency: int, seconds: float,
                  warmup_s: float, tick: Any) -> dict[str, Any]:
    per_client = split_in_flight(concurrency)
    clients = await _connect(host, port, len(per_client))
    load = Load(clients, per_client, MAX_TOKENS)
    for client in clients:
        client.on_end = lambda rid, stream, c=client: load.ended(c, rid, stream)
    load.start()
    await asyncio.sleep(warmup_s)
    meter = CpuMeter(pids)
    frames_before, started = load.deltas(), time.perf_counter()
    meter.start()
    for _ in range(int(seconds * 10)):
        await asyncio.sleep(0.1)
        tick(0.1)
    used = meter.stop()
    elapsed = time.perf_counter() - started
    frames = load.deltas() - frames_before
    load.running = False
    for client in clients:  # end the rest quickly: cancel, then wait for their last frames
        for rid in list(client.streams):
            client.send_json(b'{"type":"cancel","id":"%s"}' % rid.encode())
    deadline = time.monotonic() + 30
    while load.in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    stuck = [s for c in clients if not c.closed for s in c.streams.values()]
    # Requests on a client the edge closed (or that lost its edge) never got done: lost.
    lost = [s for c in clients if c.closed for s in c.streams.values()]
    closed = [c.close_code for c in clients if c.closed]
    for client in clients:
        client.close()
    tokens_per_s = frames / elapsed
    per_1k = {name: 1000 * cpu / max(frames, 1) * 1000 for name, cpu in used.items()}
    server = sum(v for k, v in per_1k.items() if k != "client")
    per_1k["workers"] = sum(v for k, v in per_1k.items() if k.startswith("worker"))
    return {
        "concurrency": concurrency, "tokens_per_s": round(tokens_per_s), "window_s": round(elapsed, 2),
        "server_cpu_ms_per_1k_tokens": round(server, 2),
        "cpu_ms_per_1k_tokens": {k: round(v, 2) for k, v in per_1k.items()},
        "cpu_cores_used": {k: round(v / elapsed, 2) for k, v in used.items()},
        "gaps": load.num_gaps, "completed": load.num_done, "not_done": load.num_bad + len(stuck) + len(lost),
        "stuck": {"accepted": sum(s.accepted_at is not None for s in stuck),
                  "streaming": sum(s.num_deltas > 0 for s in stuck)},
        #: Requests (counted in not_done) on clients closed before they ended.
        "lost": len(lost),
        #: Load clients the edge closed (4008: the client read too slowly, its requests cancelled;
        #: None: the connection dropped without a close frame, the edge gone). Any makes the run invalid.
        "clients_closed": closed,
    }


def run(concurrencies: list[int], seconds: float = 8.0, warmup_s: float = 2.0, workers: int = 2,
        slots: int = 128, time_scale: float = 200.0) -> dict[str, Any]:
    big = str(100_000)
    edge_env = {"LANES_MAX_DEPTH_SHORT": big, "LANES_MAX_DEPTH_MEDIUM": big, "LANES_MAX_DEPTH_LONG": big,
                "LANES_MAX_IN_FLIGHT_PER_CONNECTION": "1000"}
    with sim_system("fan", workers=workers, time_scale=time_scale, slots=slots, open_slots=True, edge_env=edge_env,
                    worker_env={"LANES_REPORT_OBSERVATIONS": "false"}) as cluster:
        assert cluster.redis is not None and cluster.redis.process is not None
        pids = {"edge": cluster.procs["edge"].pid, "redis": cluster.redis.process.pid,
                **{f"worker{i}": cluster.procs[f"w{i}"].pid for i in range(workers)}}
        results = []
        with progress("fanout", len(concurrencies) * seconds) as tick:
            for concurrency in concurrencies:
                try:
                    results.append(asyncio.run(measure(cluster.edge_hosts["edge"], cluster.edge_ports["edge"], pids,
                                                       concurrency, seconds, warmup_s, tick)))
                except OSError as exc:  # the load clients could not connect: the edge is gone
                    raise Failure(f"fanout at {concurrency} in flight: cannot connect to the edge ({exc}); "
                                  f"crashed: {', '.join(cluster.crashed()) or 'nothing'}") from None
                results[-1]["crashed"] = cluster.crashed()
                if results[-1]["crashed"]:  # the next concurrency would measure a broken system
                    break
    return {"workers": workers, "slots_per_worker": slots, "sim_time_scale": time_scale, "runs": results,
            "machine": machine_load(), **_best(results)}


def verdict(result: dict[str, Any]) -> list[str]:
    """Why the run is not valid, one phrase per problem (empty: valid)."""
    failed = []
    for r in result["runs"]:
        at = f"at {r['concurrency']} in flight"
        if r["crashed"]:
            failed.append(f"{at}: crashed: {', '.join(r['crashed'])}")
        if r["gaps"] or r["not_done"]:
            failed.append(f"{at}: {r['not_done']} requests did not end with done ({r['lost']} lost with their "
                          f"connection), {r['gaps']} gaps")
        if r["clients_closed"]:
            failed.append(f"{at}: the edge closed {len(r['clients_closed'])} load clients (codes "
                          f"{', '.join(str(c) for c in r['clients_closed'])}; 4008: the client read too slowly)")
    return failed


def _best(results: list[dict[str, Any]]) -> dict[str, Any]:
    best = max(results, key=lambda r: r["tokens_per_s"])
    return {"tokens_per_s": best["tokens_per_s"], "server_cpu_ms_per_1k_tokens": best["server_cpu_ms_per_1k_tokens"]}
