"""``lanes bench connections``: what connections cost one edge.

Real processes: an embedded redis-server, a scheduler, one edge and one fast sim worker.

- **idle** (the default): ``--connections`` WebSocket connections are opened (``--batch`` at a
  time, each a completed handshake on ``/v1/chat``) and held open, idle. The edge's RSS is read
  from ``/proc`` before the first and after the last; then one connection in every
  ``--probe-every`` sends a short chat, which must end with ``done`` (the connections are
  served, not merely accepted by the kernel).
- **churn** (``--churn N``, measured first): N connections, one wave of ``--batch`` at a time, each sends
  one chat, reads it to ``done`` and closes; the RSS growth divided by N is what each finished
  connection leaves behind (the edge used to keep every finished route forever: ~56 KB each).

The load client is ``wsclient.LeanClient`` (one small ``asyncio.Protocol`` per connection).

    lanes bench connections [--connections 10000] [--churn 2000] [--json]
"""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from dataclasses import dataclass
from typing import Any

from lanes.bench.common import CpuMeter, machine_load, progress, rss_kib, sim_system
from lanes.bench.wsclient import LeanClient, Stream
from lanes.cli.cluster import Cluster


@dataclass(frozen=True)
class Options:
    connections: int = 10_000
    batch: int = 200
    probe_every: int = 100
    churn: int = 0
    #: Finished connections before the churn's first RSS reading (the allocator's pools grow once).
    churn_warmup: int = 200
    settle_s: float = 2.0


async def _open(host: str, port: int, count: int, batch: int, tick: Any, pid: int
                ) -> tuple[list[LeanClient], list[tuple[int, float]]]:
    """Open ``count`` connections ``batch`` at a time; the edge's RSS (MB) after each batch."""
    clients: list[LeanClient] = []
    curve: list[tuple[int, float]] = []
    for start in range(0, count, batch):
        clients += await asyncio.gather(*(LeanClient.connect(host, port) for _ in range(min(batch, count - start))))
        curve.append((len(clients), round(rss_kib(pid) / 1024, 1)))
        tick(min(batch, count - start))
    return clients, curve


async def _chat_all(clients: list[LeanClient], tag: str, timeout_s: float = 60.0) -> tuple[int, int]:
    """One short chat on each client; (ended with done, did not)."""
    ended: asyncio.Queue[Stream] = asyncio.Queue()
    for i, client in enumerate(clients):
        client.on_end = lambda rid, stream: ended.put_nowait(stream)
        client.chat(f"{tag}-{i}", "Say hi.", 4, temperature=0.0)
    done = bad = 0
    deadline = time.monotonic() + timeout_s
    while done + bad < len(clients) and time.monotonic() < deadline:
        try:
            stream = await asyncio.wait_for(ended.get(), max(0.01, deadline - time.monotonic()))
        except TimeoutError:
            break
        if stream.end is not None and stream.end.type == "done" and not stream.gaps:
            done += 1
        else:
            bad += 1
    return done, len(clients) - done


async def measure(cluster: Cluster, options: Options) -> dict[str, Any]:
    host, port = cluster.edge_hosts["edge"], cluster.edge_ports["edge"]
    pid = cluster.procs["edge"].pid
    tag = uuid.uuid4().hex[:6]
    # One request first, so that lazily built state (the predictor, Redis scripts) is in the baseline.
    warm = await LeanClient.connect(host, port)
    await _chat_all([warm], f"warm{tag}")
    warm.close()
    result: dict[str, Any] = {}
    if options.churn:  # first: closing thousands of held connections would shrink the RSS under it
        result["churn"] = await _churn(cluster, options, tag)
    await asyncio.sleep(options.settle_s)
    baseline_kib = rss_kib(pid)
    result["rss_mb_baseline"] = round(baseline_kib / 1024, 1)
    meter = CpuMeter({"edge": pid})
    meter.start()
    started = time.monotonic()
    with progress("connections", options.connections) as tick:
        clients, curve = await _open(host, port, options.connections, options.batch, tick, pid)
    open_s = time.monotonic() - started
    await asyncio.sleep(options.settle_s)
    held_kib = rss_kib(pid)
    alive = sum(not c.closed for c in clients)
    probes = clients[:: max(1, options.probe_every)]
    probes_done, probes_failed = await _chat_all(probes, f"probe{tag}")
    used = meter.stop()
    result |= {
        "connections": alive, "connections_asked": options.connections, "rss_mb": round(held_kib / 1024, 1),
        "kib_per_connection": round((held_kib - baseline_kib) / max(alive, 1), 2),
        "open_s": round(open_s, 1), "probes_done": probes_done, "probes_failed": probes_failed,
        "cpu_s": {k: round(v, 2) for k, v in used.items()},
        #: (connections open, edge RSS MB) after each batch: ``--plot``.
        "rss_curve": curve,
    }
    for client in clients:
        client.close()
    return result


async def _waves(host: str, port: int, count: int, batch: int, tag: str, tick: Any = None) -> tuple[int, int]:
    """``count`` connections, ``batch`` at a time: each connects, sends one chat, reads it to
    its end and closes. Returns (done, failed)."""
    done = failed = 0
    for start in range(0, count, batch):
        num = min(batch, count - start)
        clients = await asyncio.gather(*(LeanClient.connect(host, port) for _ in range(num)))
        ok, bad = await _chat_all(list(clients), f"{tag}-{start}")
        done, failed = done + ok, failed + bad
        for client in clients:
            client.close()
        if tick is not None:
            tick(num)
    return done, failed


async def _churn(cluster: Cluster, options: Options, tag: str) -> dict[str, Any]:
    """RSS after ``churn_warmup`` finished connections vs after ``churn`` more (issue 8's
    measure: 200 then 2,000)."""
    host, port = cluster.edge_hosts["edge"], cluster.edge_ports["edge"]
    pid = cluster.procs["edge"].pid
    await _waves(host, port, options.churn_warmup, options.batch, f"churnwarm{tag}")
    await asyncio.sleep(options.settle_s)
    gc.collect()
    before = rss_kib(pid)
    with progress("churn", options.churn) as tick:
        done, failed = await _waves(host, port, options.churn, options.batch, f"churn{tag}", tick)
    await asyncio.sleep(options.settle_s)
    after = rss_kib(pid)
    return {"connections": options.churn, "warmup": options.churn_warmup, "done": done, "failed": failed,
            "rss_kib_before": before, "rss_kib_after": after,
            "growth_bytes_per_connection": round((after - before) * 1024 / options.churn, 1)}


def run(options: Options) -> dict[str, Any]:
    from lanes.cli.entrypoints import raise_open_files_limit
    from lanes.cli.failures import ConfigFailure

    # The client side holds every connection too, and the edge (a child) inherits the limit.
    limit = raise_open_files_limit()
    needed = options.connections + options.batch + 256
    if limit < needed:
        raise ConfigFailure(f"holding {options.connections} connections needs about {needed} open files, but this "
                            f"system allows {limit}: raise it (`ulimit -Hn`, or LimitNOFILE= in systemd) or hold "
                            "fewer (--connections)")
    with sim_system("conn", slots=64) as cluster:
        result = asyncio.run(measure(cluster, options))
    return {**result, "machine": machine_load()}
