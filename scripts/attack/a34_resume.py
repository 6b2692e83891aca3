import asyncio
import json
import time
import urllib.request
from common import *
problems = []
def P(m): problems.append(m); print("DEFECT?", m, flush=True)
TOK = 300

def metric(c, edge, key, name="lanes_edge_in_flight"):
    req = urllib.request.Request(f"http://127.0.0.1:{c.edge_ports[edge]}/metrics", headers={"Authorization": f"Bearer {key}"})
    for line in urllib.request.urlopen(req, timeout=5).read().decode().splitlines():
        if line.startswith(name + " "): return float(line.split()[1])

async def a3(c, alice, bob):
    print("== attack 3: another key")
    for bob_edge in ("e1", "e2"):
        a = await Conn.open(c.edge_urls["e1"], alice); b = await Conn.open(c.edge_urls[bob_edge], bob)
        rid = uid("own")
        await a.chat(rid, max_tokens=TOK); await a.wait_deltas(rid, 5)
        for fr in ({"type": "resume", "id": rid, "last_seq": -1}, {"type": "resume", "id": rid, "last_seq": 5},
                   {"type": "cancel", "id": rid}):
            n = len(b.raw); await b.send(fr); await asyncio.sleep(0.3)
            got = [strip(f) for f in b.raw[n:]]
            print(f"  bob@{bob_edge} {fr['type']}{fr.get('last_seq','')}: {got}")
            if len(got) != 1 or got[0].get("code") != "unknown_id": P(f"bob {fr} -> {got}")
        t = await a.wait_terminal(rid, 30)
        print(f"  alice: terminal {t and strip(t)}, deltas {len(a.deltas(rid))}")
        problems.extend(check_one(a, rid, expect=("length",), label="a3 owner"))
        if len(a.deltas(rid)) != TOK: P(f"a3 owner got {len(a.deltas(rid))} deltas")
        # finished: bob resume must not replay
        n = len(b.raw); await b.send({"type": "resume", "id": rid, "last_seq": -1}); await asyncio.sleep(0.3)
        got = [strip(f) for f in b.raw[n:]]
        print(f"  bob resume of finished: {got[:2]} ({len(got)} frames)")
        if any(f["type"] == "delta" for f in got): P("bob replayed alice's finished answer")
        # ids are per key: bob's chat with alice's id is bob's own request, alice's stays hers
        b2 = await Conn.open(c.edge_urls[bob_edge], bob)
        await b2.chat(rid, max_tokens=5); t = await b2.wait_terminal(rid, 30)
        print(f"  bob chat with alice's id: {[x['type'] for x in b2.by_id[rid]][:1]} ... {t and strip(t)}")
        if not t or t.get("type") != "done" or len(b2.deltas(rid)) > 5: P(f"bob's own chat with alice's id -> {t}")
        await b2.close()
        await a.close(); await b.close()
    # alice disconnects; bob tries to grab during grace; alice resumes
    a = await Conn.open(c.edge_urls["e1"], alice); rid = uid("own2")
    await a.chat(rid, max_tokens=TOK); await a.wait_deltas(rid, 5); await a.abort()
    last = a.seqs(rid)[-1]
    b = await Conn.open(c.edge_urls["e2"], bob)
    await b.send({"type": "resume", "id": rid, "last_seq": -1}); await asyncio.sleep(0.3)
    print("  bob resume during alice's grace:", [strip(f) for f in b.by_id[rid]][:2], "deltas", len(b.deltas(rid)))
    if b.deltas(rid): P("bob resumed alice's request during grace")
    a2 = await Conn.open(c.edge_urls["e1"], alice)
    await a2.send({"type": "resume", "id": rid, "last_seq": last})
    t = await a2.wait_terminal(rid, 30)
    print("  alice resume after bob's attempt:", t and strip(t), "deltas", len(a2.deltas(rid)), "first seq", a2.seqs(rid)[:1], "last was", last)
    problems.extend(check_one(a2, rid, start_seq=last + 1, expect=("length",), label="a3 alice resume"))
    if last + 1 + len(a2.deltas(rid)) != TOK: P(f"a3 alice resume coverage {last}+{len(a2.deltas(rid))}")
    await a2.close(); await b.close()

async def resume_case(c, key, label, *, new_edge, how="abort", resume_at=None, after_done=False, wait_n=20):
    a = await Conn.open(c.edge_urls["e1"], key); rid = uid("rs")
    await a.chat(rid, max_tokens=TOK); await a.wait_deltas(rid, wait_n)
    if after_done:
        await a.wait_terminal(rid, 30)
    if how == "abort": await a.abort()
    elif how == "close": await a.close()
    got = a.seqs(rid); last = got[-1] if got else -1
    ls = last if resume_at is None else resume_at
    await asyncio.sleep(0.05)
    b = await Conn.open(c.edge_urls[new_edge], key)
    t0 = time.monotonic()
    await b.send({"type": "resume", "id": rid, "last_seq": ls})
    t = await b.wait_terminal(rid, 30)
    dt = time.monotonic() - t0
    fr = b.by_id[rid]
    s = b.seqs(rid)
    kinds = [f["type"] for f in fr if f["type"] != "delta"]
    exp_start = max(ls + 1, 0)
    exp_n = max(TOK - exp_start, 0)
    print(f"  {label}: a got {len(got)} (last {last}, a-terminal={bool(a.terminals(rid))}); resume last_seq={ls} -> {kinds}, "
          f"{len(s)} deltas seq {s[:1]}..{s[-1:]}, {t and strip(t)} in {dt:.2f}s")
    pr = check_one(b, rid, start_seq=exp_start, expect=("length",), label=label)
    if kinds[:1] != ["resumed"]: pr.append(f"{label}: first frame {kinds[:1]}")
    if len(s) != exp_n: pr.append(f"{label}: expected {exp_n} deltas, got {len(s)}")
    if how == "none":
        # original conn still open -> should get resumed_elsewhere exactly once as terminal
        await asyncio.sleep(0.3)
        pr += check_one(a, rid, expect=("resumed_elsewhere",), label=label + " original")
        # original conn sends cancel: must not disturb
        n = len(a.raw); await a.send({"type": "cancel", "id": rid}); await asyncio.sleep(0.2)
        print(f"    original conn cancel after takeover -> {[strip(f) for f in a.raw[n:]]}")
        await a.close()
    for p in pr: P(p)
    await b.close()

async def a4(c, key):
    print("== attack 4: disconnect / resume")
    await resume_case(c, key, "abort->same edge", new_edge="e1")
    await resume_case(c, key, "abort->other edge", new_edge="e2")
    await resume_case(c, key, "close->other edge", new_edge="e2", how="close")
    await resume_case(c, key, "abort->resume -1", new_edge="e2", resume_at=-1)
    await resume_case(c, key, "abort->resume past end(100000)", new_edge="e2", resume_at=100000)
    await resume_case(c, key, "abort->resume at TOK-1", new_edge="e1", resume_at=TOK - 1)
    await resume_case(c, key, "abort->resume at TOK-2", new_edge="e1", resume_at=TOK - 2)
    await resume_case(c, key, "takeover while original open", new_edge="e2", how="none")
    await resume_case(c, key, "takeover same edge while open", new_edge="e1", how="none")
    await resume_case(c, key, "finished, resume -1", new_edge="e2", resume_at=-1, after_done=True)
    await resume_case(c, key, "finished, resume past end", new_edge="e2", resume_at=5000, after_done=True)
    await resume_case(c, key, "finished, resume at 150", new_edge="e1", resume_at=150, after_done=True)
    # double simultaneous resume from two connections
    a = await Conn.open(c.edge_urls["e1"], key); rid = uid("dbl")
    await a.chat(rid, max_tokens=TOK); await a.wait_deltas(rid, 10); await a.abort()
    last = a.seqs(rid)[-1]
    b1 = await Conn.open(c.edge_urls["e1"], key); b2 = await Conn.open(c.edge_urls["e2"], key)
    fr = json.dumps({"type": "resume", "id": rid, "last_seq": last})
    await asyncio.gather(b1.ws.send(fr), b2.ws.send(fr))
    await asyncio.gather(b1.wait_terminal(rid, 30), b2.wait_terminal(rid, 30)); await asyncio.sleep(0.3)
    k1 = [f.get("code", f["type"]) for f in b1.by_id[rid] if f["type"] != "delta"]
    k2 = [f.get("code", f["type"]) for f in b2.by_id[rid] if f["type"] != "delta"]
    print(f"  double resume: b1 {k1} ({len(b1.deltas(rid))} d), b2 {k2} ({len(b2.deltas(rid))} d)")
    for conn in (b1, b2):
        problems.extend(check_one(conn, rid, start_seq=last + 1, label="double resume"))
    winners = [conn for conn in (b1, b2) if conn.terminals(rid) and conn.terminals(rid)[0]["type"] == "done"]
    if len(winners) != 1: P(f"double resume: {len(winners)} winners {k1} {k2}")
    elif last + 1 + len(winners[0].deltas(rid)) != TOK:
        # the winner may have been the second; loser's deltas + winner's should cover
        P(f"double resume: winner got {len(winners[0].deltas(rid))} deltas after {last}")
    await b1.close(); await b2.close()
    # chain: resume, drop, resume again elsewhere, drop, resume...
    a = await Conn.open(c.edge_urls["e1"], key); rid = uid("chain")
    await a.chat(rid, max_tokens=TOK); await a.wait_deltas(rid, 10); await a.abort()
    allseq = list(a.seqs(rid)); hops = 0
    for hop in range(6):
        e = ("e1", "e2")[hop % 2]
        b = await Conn.open(c.edge_urls[e], key)
        await b.send({"type": "resume", "id": rid, "last_seq": allseq[-1]})
        if hop < 5:
            await b.wait_deltas(rid, 15, 10); await b.abort()
        else:
            await b.wait_terminal(rid, 30)
            problems.extend(check_one(b, rid, start_seq=allseq[-1] + 1, expect=("length",), label="chain final"))
        allseq += b.seqs(rid)
    print(f"  chain of 6 resumes: {len(allseq)} seqs, contiguous={allseq == list(range(TOK))}")
    if allseq != list(range(TOK)): P(f"chain: seqs {len(allseq)} dupes {len(allseq)-len(set(allseq))}")
    await b.close()

async def grace_cancel(c, key, grace):
    print("== attack 4b: disconnect without resume -> cancelled after grace; slots free")
    def running():
        req = urllib.request.Request(f"http://127.0.0.1:{c.edge_ports['e2']}/v1/workers", headers={"Authorization": f"Bearer {key}"})
        ws = json.loads(urllib.request.urlopen(req, timeout=5).read())
        return sum(sum((w.get("running") or {}).values()) for w in ws)
    a = await Conn.open(c.edge_urls["e1"], key)
    ids = [uid("g") for _ in range(8)]
    for r in ids: await a.chat(r, max_tokens=4000)
    for r in ids: await a.wait_deltas(r, 2, 10)
    await asyncio.sleep(0.5)
    print("  running before drop:", running())
    t_drop = time.monotonic(); await a.abort()
    timeline = []
    while time.monotonic() - t_drop < grace + 4:
        timeline.append((round(time.monotonic() - t_drop, 1), running())); await asyncio.sleep(0.25)
    print("  (t since drop, running slots):", timeline[::2])
    freed = next((t for t, n in timeline if n == 0), None)
    print(f"  all slots free at {freed}s after drop (grace {grace}s)")
    if freed is None: P("slots not freed after grace")
    elif freed < grace - 0.3: P(f"slots freed before grace: {freed}")
    p = await Conn.open(c.edge_urls["e2"], key)
    await p.send({"type": "resume", "id": ids[0], "last_seq": 0}); t = await p.wait_terminal(ids[0], 10)
    print(f"  resume after grace -> {[strip(f) for f in p.by_id[ids[0]] if f['type'] != 'delta'][:3]} ({len(p.deltas(ids[0]))} deltas)")
    q = uid("after"); t0 = time.monotonic(); await p.chat(q, max_tokens=5); t = await p.wait_terminal(q, 10)
    print(f"  new request after: {t and strip(t)} in {time.monotonic()-t0:.2f}s")
    await asyncio.sleep(1)
    print("  edge in-flight metrics: e1", metric(c, "e1", key), "e2", metric(c, "e2", key))
    await p.close()

if __name__ == "__main__":
    import sys
    which = sys.argv[1]
    if which == "a34":
        c, tmp = start_cluster("a34", workers=(("w0", "2"),), slots=16, grace_s=3.0)
        try:
            alice, bob = create_key(c, "alice"), create_key(c, "bob")
            asyncio.run(a3(c, alice, bob)); asyncio.run(a4(c, alice))
            print("in-flight e1/e2:", metric(c, "e1", alice), metric(c, "e2", alice), "crashed", c.crashed())
        finally: c.close()
    else:
        c, tmp = start_cluster("a4b", workers=(("w0", "1"),), slots=8, grace_s=4.0)
        try:
            alice = create_key(c, "alice")
            asyncio.run(grace_cancel(c, alice, 4.0)); print("crashed", c.crashed())
        finally: c.close()
    print("PROBLEMS", len(problems)); [print(" -", p) for p in problems]
