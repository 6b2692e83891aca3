"""Hostile inputs on the predictor refresh path, against a running system (`./scripts/up.sh`):
garbage weights, weights whose routing info is malformed or extreme, then a good version, each
written to `lanes:predictor` as the scheduler would; after each the edge's reload must
keep it serving, its gauges must show what it routes by, and every chat must end with one `done`.
(The edge polls every `LANES_PREDICTOR_POLL_S`, 5 s by default.)

    .venv/bin/python scripts/attack/a7_refresh.py redis://127.0.0.1:PORT/0 127.0.0.1:8000

(PORT: the embedded Redis `lanes up` prints.) About 1 minute.
"""
import asyncio
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
import redis.asyncio as aioredis
import websockets
from lanes.scheduler.predictor import load_default, LengthPredictor
from lanes.scheduler.policy import LaneThresholds

url, edge = sys.argv[1], sys.argv[2]
def gauges():
    t = urllib.request.urlopen(f"http://{edge}/metrics").read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'^(lanes_edge_(?:routing_max_tokens\{lane="\w+"\}|predictor_version)) (\S+)', t, re.M)}
def npz(p: LengthPredictor) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        p.save(Path(d) / "w.npz"); return (Path(d) / "w.npz").read_bytes()
async def chat(i):
    async with websockets.connect(f"ws://{edge}/v1/chat") as ws:
        await ws.send(json.dumps({"type": "chat", "id": f"hr{i}-{time.time_ns()}", "messages": [{"role": "user", "content": "Say yes or no."}], "max_tokens": 8}))
        frames = []
        while True:
            f = json.loads(await asyncio.wait_for(ws.recv(), 30)); frames.append(f)
            if f["type"] in ("done", "error"): break
        return [f["type"] for f in frames if f["type"] in ("accepted",)], frames[-1]["type"], next((f.get("lane") for f in frames if f["type"] == "accepted"), None)
async def main():
    r = aioredis.from_url(url); problems = 0
    base = load_default()
    cases = [
        ("garbage bytes", b"\x00not an npz"),
        ("routing not a dict", npz(LengthPredictor(base.model, {"routing": "all long"}))),
        ("routing negative", npz(LengthPredictor(base.model, {"routing": {"short_max_tokens": -5, "medium_max_tokens": -5}}))),
        ("routing short > medium", npz(LengthPredictor(base.model, {"routing": {"short_max_tokens": 900, "medium_max_tokens": 3}}))),
        ("routing huge", npz(base.with_routing(LaneThresholds(10**12, 10**12)))),
        ("good", npz(base.with_routing(LaneThresholds(40, 40)))),
    ]
    for name, blob in cases:
        version = await r.hincrby("lanes:predictor", "version", 1)
        await r.hset("lanes:predictor", "weights", blob)
        await asyncio.sleep(7)  # the edge polls every 5 s
        g = gauges(); res = await asyncio.gather(*(chat(i) for i in range(3)))
        ends = {x[1] for x in res}
        ok = ends == {"done"}
        problems += not ok
        print(f"{name:24s} v{version}: edge gauges {g}; chats end {ends}, lanes {[x[2] for x in res]}", "ok" if ok else "PROBLEM")
    print("PROBLEMS", problems)
asyncio.run(main())
