"""Run every query of deploy/grafana/lanes.json against a real Prometheus (needs `prometheus` on PATH,
e.g. Debian's package) scraping an edge, the scheduler and three sim workers in two pools (small,
large) after 60 chats, with $job and $pool as .* and $__rate_interval as 1m; prints the pools each
pool-aware query returns and the queries that returned nothing.

    .venv/bin/python scripts/grafana_check.py     # from the repository root, ~2 minutes
"""
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from e2e_support import Client
from lanes.cli.cluster import Cluster
from lanes.queue.embedded import free_port

tmp = Path(tempfile.mkdtemp(prefix="graf-"))
c = Cluster.embedded("graf", tmp)
sched_port, w_ports = free_port(), [free_port() for _ in range(3)]
c.start_scheduler(LANES_METRICS_PORT=str(sched_port), LANES_POOLS="small,large")
url = c.start_edge("edge", LANES_ROUTING_FILE=str(Path(__file__).resolve().parents[1] / "deploy" / "routing.toml"))
for i, pool in enumerate(("small", "large", "large")):
    c.start_worker(f"w{i}", "", "--engine", "sim", "--sim-time-scale", "20", "--max-slots", "4",
                   "--metrics-port", str(w_ports[i]), LANES_POOL=pool)
c.wait_workers(3)
edge_port = c.edge_ports["edge"]
targets = [f"127.0.0.1:{p}" for p in (edge_port, sched_port, *w_ports)]
cfg = tmp / "prom.yml"
cfg.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: lanes\n    static_configs:\n      - targets: {json.dumps(targets)}\n")
prom_port = free_port()
prom = subprocess.Popen(["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp}/tsdb",
                         f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    async def load():
        client = await Client.connect(url)
        ids = []
        for i in range(60):
            rid = f"g{i}-{uuid.uuid4().hex[:4]}"
            model = ("small", "large", "auto")[i % 3]
            await client.send({"type": "chat", "id": rid, "model": model, "max_tokens": 40 + 10 * (i % 7),
                               "messages": [{"role": "user", "content": f"Tell me about item {i}."}]})
            ids.append(rid)
            await asyncio.sleep(0.25)
        for rid in ids:
            await client.wait(rid, 60)
        await client.close()
    asyncio.run(load())
    time.sleep(70)
    dash = json.loads((Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "lanes.json").read_text())
    n = ok = 0
    empty = []
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            expr = t["expr"].replace("$__rate_interval", "1m").replace('"$job"', '".*"').replace('"$pool"', '".*"')
            q = urllib.parse.urlencode({"query": expr})
            body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/query?{q}", timeout=10).read())
            n += 1
            assert body["status"] == "success", (expr, body)
            series = body["data"]["result"]
            if series:
                ok += 1
            else:
                empty.append(panel["title"] + ": " + t["expr"][:90])
            if "pool" in expr:
                print(panel["title"], "->", sorted({s["metric"].get("pool", "-") for s in series}))
    print(f"{n} queries parsed; {ok} returned series; empty: {empty}")
    for v in dash["templating"]["list"][1:]:
        q = v["query"]["query"]
        metric = q[len("label_values("):-1].rsplit(",", 1)
        body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/series?" + urllib.parse.urlencode({"match[]": metric[0] if metric[0] else '{__name__=~"lanes_.+"}'}), timeout=10).read())
        print("variable", v["name"], sorted({s.get(metric[1].strip(), "-") for s in body["data"]}))
finally:
    prom.terminate()
    c.close()
