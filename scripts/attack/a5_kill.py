import asyncio
import json
import time
import signal
import urllib.request
from collections import Counter
from common import *
problems = []
def P(m): problems.append(m); print("DEFECT?", m, flush=True)
TOK = 400
PROMPT = "Describe the history of the bicycle in detail."

def workers_running(c, key):
    req = urllib.request.Request(f"http://127.0.0.1:{c.edge_ports['e2']}/v1/workers", headers={"Authorization": f"Bearer {key}"})
    return {w.get("worker"): w.get("running") for w in json.loads(urllib.request.urlopen(req, timeout=5).read())}

async def reference(c, key):
    a = await Conn.open(c.edge_urls["e2"], key); rid = uid("ref")
    await a.chat(rid, PROMPT, max_tokens=TOK, temperature=0, seed=7); await a.wait_terminal(rid, 60)
    txt = "".join(f["text"] for f in a.deltas(rid)); await a.close(); return txt

async def kill_worker(c, key, sig, ref, label, n=6):
    print(f"== {label}")
    a = await Conn.open(c.edge_urls["e1"], key)
    ids = [uid("k") for _ in range(n)]
    for r in ids: await a.chat(r, PROMPT, max_tokens=TOK, temperature=0, seed=7)
    for r in ids: await a.wait_deltas(r, 20, 20)
    before = workers_running(c, key)
    print("  running per worker before:", before)
    victim = max(("w0", "w1"), key=lambda n: sum((before.get(c.child_id(n)) or {}).values()) if c.procs[n].poll() is None else -1)
    t0 = time.monotonic()
    await asyncio.to_thread(c.kill, victim, sig)
    texit = time.monotonic() - t0
    print(f"  {sig.name} {victim} (pid {c.procs[victim].pid}) exit {c.procs[victim].returncode}")
    for r in ids: await a.wait_terminal(r, 60)
    el = time.monotonic() - t0
    oc = Counter()
    for r in ids:
        t = a.terminals(r)
        oc[(t[0].get("code") or t[0].get("finish_reason")) if t else "NONE"] += 1
        for p in check_one(a, r, expect=("length",), label=label): P(p)
        txt = "".join(f["text"] for f in a.deltas(r))
        if len(a.deltas(r)) != TOK: P(f"{label} {r}: {len(a.deltas(r))} deltas")
        if txt != ref: P(f"{label} {r}: text differs from reference (len {len(txt)} vs {len(ref)})")
        # stall: biggest gap between deltas
    gaps = [max(b["_t"] - x["_t"] for x, b in zip(a.deltas(r), a.deltas(r)[1:])) for r in ids if len(a.deltas(r)) > 1]
    print(f"  outcomes {dict(oc)} all ended {el:.1f}s after the signal; victim exited after {texit:.1f}s; max stall per request {[round(g,2) for g in gaps]}")
    await a.close()
    c.restart(victim); c.wait_workers(2)

async def kill_edge(c, key, ref):
    print("== kill -9 edge e1 mid-stream, resume on e2")
    conns, ids = [], []
    for i in range(4):
        a = await Conn.open(c.edge_urls["e1"], key); conns.append(a)
        for j in range(2):
            r = uid("ke"); ids.append((a, r)); await a.chat(r, PROMPT, max_tokens=TOK, temperature=0, seed=7)
    for a, r in ids: await a.wait_deltas(r, 20, 20)
    c.kill("e1", signal.SIGKILL); t0 = time.monotonic()
    for a in conns: await asyncio.wait_for(a.closed.wait(), 10)
    print("  client close codes:", [a.close_code for a in conns], "terminals before resume:", sum(bool(a.terminals(r)) for a, r in ids))
    b = await Conn.open(c.edge_urls["e2"], key)
    for a, r in ids:
        await b.send({"type": "resume", "id": r, "last_seq": a.seqs(r)[-1]})
    for a, r in ids: await b.wait_terminal(r, 60)
    print(f"  all resumed answers ended {time.monotonic()-t0:.1f}s after the kill")
    oc = Counter()
    for a, r in ids:
        last = a.seqs(r)[-1]
        t = b.terminals(r); oc[(t[0].get("code") or t[0].get("finish_reason")) if t else "NONE"] += 1
        for p in check_one(b, r, start_seq=last + 1, expect=("length",), label="edge-kill"): P(p)
        txt = "".join(f["text"] for f in a.deltas(r) + b.deltas(r))
        if txt != ref: P(f"edge-kill {r}: text differs (len {len(txt)})")
    print("  outcomes", dict(oc))
    await b.close()
    # restart e1 on same port
    c.restart("e1"); c.wait_edge("e1")
    # edge SIGTERM: docs/protocol.md says close 1012 (service restart) and nothing cancelled
    a = await Conn.open(c.edge_urls["e1"], key); r = uid("st")
    await a.chat(r, PROMPT, max_tokens=TOK, temperature=0, seed=7); await a.wait_deltas(r, 20)
    c.kill("e1", signal.SIGTERM)
    await asyncio.wait_for(a.closed.wait(), 15)
    print("  SIGTERM edge: client close code", a.close_code, "terminal frames:", [strip(f) for f in a.terminals(r)])
    if a.close_code != 1012: P(f"edge SIGTERM close code {a.close_code}")
    b = await Conn.open(c.edge_urls["e2"], key)
    last = a.seqs(r)[-1]
    await b.send({"type": "resume", "id": r, "last_seq": last}); await b.wait_terminal(r, 60)
    for p in check_one(b, r, start_seq=last + 1, expect=("length",), label="edge-sigterm"): P(p)
    print("  resumed on e2 after SIGTERM:", [strip(f) for f in b.terminals(r)], len(b.deltas(r)), "deltas after", last)
    await b.close()
    c.restart("e1"); c.wait_edge("e1")

async def main(c, key):
    ref = await reference(c, key)
    print("reference len", len(ref))
    await kill_worker(c, key, signal.SIGKILL, ref, "kill -9 worker")
    await kill_worker(c, key, signal.SIGTERM, ref, "SIGTERM worker")
    await kill_edge(c, key, ref)

if __name__ == "__main__":
    c, tmp = start_cluster("a5", workers=(("w0", "1"), ("w1", "1")), slots=8, grace_s=5.0)
    try:
        asyncio.run(main(c, create_key(c, "alice"))); print("crashed:", c.crashed())
    finally: c.close()
    print("PROBLEMS", len(problems)); [print(" -", p) for p in problems]
