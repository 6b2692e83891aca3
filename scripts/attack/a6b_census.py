"""Memory under abuse, seen from inside: two edges run in this process (scheduler and a sim worker
as real processes); after 300 warm-up cycles of a6_memory's mix, 2,000 more; prints the growth of
Python object counts by type (over 50), the top tracemalloc differences, and the sizes of every
edge table (requests, sessions, pools, tasks, per-connection and per-key counts, rate buckets).

    .venv/bin/python scripts/attack/a6b_census.py
"""
import asyncio
import gc
import sys
import tempfile
import uuid
import collections
import tracemalloc
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import a6_memory as a6
from common import *
from lanes.cli.cluster import Cluster
from lanes.queue.plane import QueuePlane
from lanes.ws_server.edge import Edge
from lanes.ws_server.settings import EdgeSettings
from lanes.ws_server.auth import generate_key, hash_key

KEY = generate_key()

class Fake:
    pass

async def main():
    tmp = Path(tempfile.mkdtemp())
    c = Cluster.embedded(f"lk{uuid.uuid4().hex[:4]}", tmp, base_env={**FAST_FAILOVER_ENV})
    c.start_scheduler()
    c.start_worker("w0", "", "--engine", "sim", "--sim-time-scale", "20", "--max-slots", "8")
    c.wait_workers(1)
    edges = {}
    for name in ("e1", "e2"):
        s = EdgeSettings(redis_url=c.redis_url, key_prefix=c.prefix, port=0, api_key_hashes=hash_key(KEY),
                         resume_grace_s=3.0, key_rate_per_s=0, key_max_in_flight=0)
        plane = QueuePlane.from_settings(s); e = Edge(s, plane); ready = asyncio.Event()
        asyncio.create_task(e.serve(ready)); await ready.wait(); edges[name] = e
    f = Fake(); f.edge_ports = {n: e.port for n, e in edges.items()}; f.edge_urls = {n: f"ws://127.0.0.1:{e.port}/v1/chat" for n, e in edges.items()}
    await a6.run(f, KEY, 300, seed=1); await asyncio.sleep(5)
    gc.collect(); tracemalloc.start(25)
    before = collections.Counter(type(o).__name__ for o in gc.get_objects()); snap1 = tracemalloc.take_snapshot()
    await a6.run(f, KEY, 2000, seed=2); await asyncio.sleep(6)
    gc.collect()
    after = collections.Counter(type(o).__name__ for o in gc.get_objects()); snap2 = tracemalloc.take_snapshot()
    diff = {k: after[k] - before[k] for k in after if after[k] - before[k] > 50}
    print("object growth:", sorted(diff.items(), key=lambda kv: -kv[1])[:25])
    for stat in snap2.compare_to(snap1, "traceback")[:8]:
        print(stat); print("\n".join(stat.traceback.format()[-8:]))
    for n, e in edges.items():
        print(n, "entries", len(e.core.entries), "sessions", len(e.sessions), "pool_of", len(e._pool_of), "tasks", len(e._tasks),
              "per_conn", len(e.core.per_conn), "per_key", len(e.core.per_key), "limiter", len(getattr(e.keys.limiter, "_buckets", {})))
    print("problems", a6.problems[:5])
    c.close()
asyncio.run(main())
