"""Edge memory per finished connection: RSS after many connections that each made one request.

Starts its own redis-server, a scheduler, one edge and one fast sim worker (real processes).
Connections arrive one wave at a time; each sends one chat, reads it to ``done`` and closes.
The edge's RSS is read from /proc after ``--warmup`` connections and after ``--connections``;
the difference divided by the connections in between is what each finished connection left
behind (goal: under 2 KB; the edge used to keep every finished route forever).

    python benchmarks/edge_memory.py --warmup 200 --connections 2000 [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import tempfile
import time
import uuid
from pathlib import Path

import websockets
from lanes.bench.common import rss_kib
from lanes.cli.cluster import Cluster


async def one_connection(url: str, rid: str) -> None:
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "chat", "id": rid, "max_tokens": 4,
                                  "messages": [{"role": "user", "content": "Say hi."}]}))
        async for raw in ws:
            if json.loads(raw)["type"] in ("done", "error"):
                return


async def churn(url: str, start: int, count: int, concurrency: int) -> None:
    for wave in range(start, start + count, concurrency):
        ids = range(wave, min(wave + concurrency, start + count))
        await asyncio.gather(*(one_connection(url, f"m{i}") for i in ids))


async def run(warmup: int, total: int, concurrency: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as logs:
        cluster = Cluster.embedded(f"mem{uuid.uuid4().hex[:6]}", Path(logs))
        try:
            cluster.start_scheduler()
            url = cluster.start_edge("edge")
            cluster.start_worker("w0", "", "--engine", "sim", "--sim-time-scale", "1000", "--max-slots", "32")
            cluster.wait_workers(1)
            pid = cluster.procs["edge"].pid
            started = time.monotonic()
            await churn(url, 0, warmup, concurrency)
            await asyncio.sleep(1.0)
            gc.collect()
            after_warmup = rss_kib(pid)
            await churn(url, warmup, total - warmup, concurrency)
            await asyncio.sleep(1.0)
            after_all = rss_kib(pid)
            elapsed = time.monotonic() - started
        finally:
            cluster.close()
    growth_b = (after_all - after_warmup) * 1024 / (total - warmup)
    return {"connections": total, "warmup": warmup, "rss_kib_after_warmup": after_warmup,
            "rss_kib_after_all": after_all, "growth_bytes_per_connection": round(growth_b, 1),
            "elapsed_s": round(elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(run(args.warmup, args.connections, args.concurrency))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"edge RSS after {args.warmup} connections: {result['rss_kib_after_warmup']} KiB; after "
              f"{args.connections}: {result['rss_kib_after_all']} KiB; growth per finished connection: "
              f"{result['growth_bytes_per_connection']} bytes ({result['elapsed_s']} s)")


if __name__ == "__main__":
    main()
