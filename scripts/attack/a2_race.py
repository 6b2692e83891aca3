import asyncio
import json
from collections import Counter
from common import *
problems = []
async def race(c, key, mode, n=50):
    outcomes = Counter()
    for i in range(n):
        e2 = "e1" if mode == "same-edge" else "e2"
        a = await Conn.open(c.edge_urls["e1"], key); b = await Conn.open(c.edge_urls[e2], key)
        rid = uid(f"race{i}")
        frame = json.dumps({"type": "chat", "id": rid, "messages": [{"role": "user", "content": "race me"}], "max_tokens": 40, "temperature": 0})
        await asyncio.gather(a.ws.send(frame), b.ws.send(frame))
        ta, tb = await asyncio.gather(a.wait_terminal(rid, 20), b.wait_terminal(rid, 20))
        await asyncio.sleep(0.2)
        res = []
        for conn in (a, b):
            fr = conn.by_id[rid]
            kinds = [f["type"] for f in fr if f["type"] != "delta"]
            if kinds == ["accepted", "done"]:
                res.append("full")
                if conn.seqs(rid) != list(range(40)): problems.append(f"{mode} {rid}: winner seqs {conn.seqs(rid)[:5]}.. n={len(conn.seqs(rid))}")
            elif len(fr) == 1 and fr[0].get("code") == "duplicate_id":
                res.append("dup")
            else:
                res.append("OTHER:" + str([strip(f) for f in fr if f["type"] != "delta"]))
        key_ = tuple(sorted(res)); outcomes[key_] += 1
        if key_ != ("dup", "full"):
            problems.append(f"{mode} {rid}: {res}")
        await a.close(); await b.close()
    print(mode, dict(outcomes), flush=True)
async def race_http_ws(c, key, n=20):
    # HTTP completions can't pick an id; instead race ws chat vs ws resume on the same id
    outcomes = Counter()
    for i in range(n):
        a = await Conn.open(c.edge_urls["e1"], key); b = await Conn.open(c.edge_urls["e2"], key)
        rid = uid(f"cr{i}")
        chat = json.dumps({"type": "chat", "id": rid, "messages": [{"role": "user", "content": "x"}], "max_tokens": 40})
        res = json.dumps({"type": "resume", "id": rid, "last_seq": -1})
        await asyncio.gather(a.ws.send(chat), b.ws.send(res))
        await asyncio.gather(a.wait_terminal(rid, 20), b.wait_terminal(rid, 20))
        await asyncio.sleep(0.3)
        fa = [f["type"] if f["type"] != "error" else f["code"] for f in a.by_id[rid] if f["type"] != "delta"]
        fb = [f["type"] if f["type"] != "error" else f["code"] for f in b.by_id[rid] if f["type"] != "delta"]
        outcomes[(tuple(fa), tuple(fb))] += 1
        for conn in (a, b):
            problems.extend(check_one(conn, rid, label="chat-vs-resume") if conn.by_id[rid] else [])
            if conn.deltas(rid):
                s = conn.seqs(rid)
                if s != list(range(s[0], s[0] + len(s))): problems.append(f"chat-vs-resume gap {s}")
        got = set(x["seq"] for conn in (a, b) for x in conn.deltas(rid))
        # whoever ended with done must have delivered seqs so that union covers 0..39
        await a.close(); await b.close()
    for k, v in outcomes.items(): print("chat-vs-resume", k, v)
if __name__ == "__main__":
    c, tmp = start_cluster("a2", slots=16)
    try:
        key = create_key(c, "alice")
        asyncio.run(race(c, key, "same-edge")); asyncio.run(race(c, key, "cross-edge"))
        asyncio.run(race_http_ws(c, key))
        print("crashed:", c.crashed())
    finally: c.close()
    print("PROBLEMS", len(problems)); [print(" -", p) for p in problems[:30]]
