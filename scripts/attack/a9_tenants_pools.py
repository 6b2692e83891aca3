"""Attack 9 (stop 36): per-key request ids and a pool whose last worker dies.

1. Two API keys send the same id at the same moment, on two edges: each runs its own request
   to its own length; one key's cancel and resume never touch the other's.
2. A pool with one worker (one slot): a running chat, two queued ones; one client disconnects
   mid-stream and resumes on the other edge; then the worker is killed with SIGKILL. Every
   request must end with exactly one terminal frame (``unavailable`` once the pool has had no
   worker for LANES_NO_WORKER_TIMEOUT_S), and a new chat for the pool is refused at once.
"""
import asyncio
import json
import time
from common import *

problems = []


def P(m):
    problems.append(m)
    print("DEFECT?", m, flush=True)


async def same_id_two_keys(c, alice, bob, n=20):
    for i in range(n):
        rid = uid(f"same{i}")
        a = await Conn.open(c.edge_urls["e1"], alice)
        b = await Conn.open(c.edge_urls["e2"], bob)
        frames = [json.dumps({"type": "chat", "id": rid, "max_tokens": k, "temperature": 0,
                              "messages": [{"role": "user", "content": "the same id"}]}) for k in (30, 50)]
        await asyncio.gather(a.ws.send(frames[0]), b.ws.send(frames[1]))
        if i % 4 == 1:  # bob cancels "his" id: alice's must run on
            await b.send({"type": "cancel", "id": rid})
        ta, tb = await asyncio.gather(a.wait_terminal(rid, 30), b.wait_terminal(rid, 30))
        problems.extend(check_one(a, rid, expect=("length",), label="alice"))
        problems.extend(check_one(b, rid, expect=("length", "cancelled") if i % 4 == 1 else ("length",), label="bob"))
        if len(a.deltas(rid)) != 30:
            P(f"{rid}: alice got {len(a.deltas(rid))} deltas, not her 30")
        if i % 4 != 1 and len(b.deltas(rid)) != 50:
            P(f"{rid}: bob got {len(b.deltas(rid))} deltas, not his 50")
        if i % 4 == 2:  # each key's resume replays its own answer
            r = await Conn.open(c.edge_urls["e2"], alice)
            await r.send({"type": "resume", "id": rid, "last_seq": -1})
            await r.wait_terminal(rid, 10)
            if len(r.deltas(rid)) != 30:
                P(f"{rid}: alice's resume replayed {len(r.deltas(rid))} deltas, not 30")
            await r.close()
        await a.close()
        await b.close()
    print(f"same id, two keys: {n} pairs done", flush=True)


async def pool_dies(c, alice):
    url1, url2 = c.edge_urls["e1"], c.edge_urls["e2"]
    conns, rids = [], []
    for i in range(3):
        conn = await Conn.open(url1, alice)
        rid = uid(f"solo{i}")
        await conn.chat(rid, "Write a very long story.", max_tokens=2000, model="solo")
        conns.append(conn)
        rids.append(rid)
    await conns[0].wait_deltas(rids[0], 5)
    # The running chat's client drops mid-stream and resumes on the other edge.
    last = conns[0].seqs(rids[0])[-1]
    await conns[0].abort()
    resumed = await Conn.open(url2, alice)
    await resumed.send({"type": "resume", "id": rids[0], "last_seq": last})
    await resumed.wait_deltas(rids[0], 3)
    killed_at = time.monotonic()
    c.kill("solo-w")
    ends = []
    for conn, rid, start in ((resumed, rids[0], last + 1), (conns[1], rids[1], 0), (conns[2], rids[2], 0)):
        t = await conn.wait_terminal(rid, 60)
        ends.append((t or {}).get("code"))
        problems.extend(check_one(conn, rid, start_seq=start, expect=("unavailable",), label="pool dies"))
    print(f"pool dies: ends {ends} within {time.monotonic() - killed_at:.1f} s of the kill", flush=True)
    new = await Conn.open(url2, alice)
    rid = uid("after")
    await new.chat(rid, "Anyone there?", max_tokens=5, model="solo")
    t = await new.wait_terminal(rid, 10)
    print(f"new chat for the dead pool: {t and strip(t)}", flush=True)
    if not t or t.get("code") != "unavailable":
        P(f"new chat for the dead pool ended {t}")
    for conn in (*conns[1:], resumed, new):
        await conn.close()


if __name__ == "__main__":
    c, tmp = start_cluster("a9", slots=8, extra_env={"LANES_NO_WORKER_TIMEOUT_S": "2"})
    try:
        alice, bob = create_key(c, "alice"), create_key(c, "bob")
        asyncio.run(same_id_two_keys(c, alice, bob))
        c.start_worker("solo-w", "", "--engine", "sim", "--sim-time-scale", "1", "--max-slots", "1", LANES_POOL="solo")
        c.wait_workers(2)
        time.sleep(1.5)  # the edges have a snapshot of the new pool
        asyncio.run(pool_dies(c, alice))
        print("crashed:", [n for n in c.crashed() if n != "solo-w"])
    finally:
        c.close()
    print("PROBLEMS", len(problems))
    [print(" -", p) for p in problems[:30]]
