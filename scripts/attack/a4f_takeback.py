"""Minimal repro 2: chat on e1 (conn A open), resume on e2 (conn B), then resume on e1 (new conn C)."""
import asyncio
from common import *
TOK = 400
async def main(c, key):
    for pause in (0.2, 2.0, 4.0):
        a = await Conn.open(c.edge_urls["e1"], key); rid = uid("back")
        await a.chat(rid, max_tokens=TOK); await a.wait_deltas(rid, 10)
        b = await Conn.open(c.edge_urls["e2"], key)
        await b.send({"type": "resume", "id": rid, "last_seq": a.seqs(rid)[-1]}); await b.wait_deltas(rid, 5)
        await asyncio.sleep(pause)
        cc = await Conn.open(c.edge_urls["e1"], key); last = b.seqs(rid)[-1]
        await cc.send({"type": "resume", "id": rid, "last_seq": last})
        await cc.wait_terminal(rid, 30); await b.wait_terminal(rid, 30)
        ft = lambda x: [(f.get("code", f.get("finish_reason", f["type"])), round(f["_t"] - cc.raw[0]["_t"], 2)) for f in x.by_id[rid] if f["type"] != "delta"]
        bd = [f for f in b.deltas(rid) if f["_t"] > cc.raw[0]["_t"]]
        print(f"pause {pause}s on e2 before resuming on e1: A {[k for k,_ in ft(a)]} | B after C's resume: {len(bd)} deltas, {ft(b)[-1]} | C {ft(cc)} {len(cc.deltas(rid))} deltas")
        for x in (a, b, cc): await x.close()
if __name__ == "__main__":
    c, tmp = start_cluster("a4f", workers=(("w0", "2"),), slots=16, grace_s=3.0)
    try: asyncio.run(main(c, create_key(c, "alice")))
    finally: c.close()
