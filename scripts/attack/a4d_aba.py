"""Minimal repro: chat on e1, drop; resume on e2, drop; resume on e1 -> resumed + resumed_elsewhere."""
import asyncio
from common import *
TOK = 400
async def aba(c, key, stay_s):
    a = await Conn.open(c.edge_urls["e1"], key); rid = uid("aba")
    await a.chat(rid, max_tokens=TOK); await a.wait_deltas(rid, 10); await a.abort()
    b = await Conn.open(c.edge_urls["e2"], key)
    await b.send({"type": "resume", "id": rid, "last_seq": a.seqs(rid)[-1]})
    await b.wait_deltas(rid, 5, 10); await asyncio.sleep(stay_s); await b.abort()
    last = b.seqs(rid)[-1]
    d = await Conn.open(c.edge_urls["e1"], key)
    await d.send({"type": "resume", "id": rid, "last_seq": last})
    t = await d.wait_terminal(rid, 30)
    kinds = [f.get("code", f["type"]) for f in d.by_id[rid] if f["type"] != "delta"]
    gap = (d.raw[-1]["_t"] - d.raw[0]["_t"]) if d.raw else None
    print(f"stay on e2 {stay_s}s: third conn (e1) -> {kinds}, {len(d.deltas(rid))} deltas, terminal after {gap and round(gap,2)}s")
    await d.close()
    if t and t.get("code") == "resumed_elsewhere":
        await asyncio.sleep(4.5)  # past grace, the client gave up as told
        e = await Conn.open(c.edge_urls["e2"], key)
        await e.send({"type": "resume", "id": rid, "last_seq": last}); t2 = await e.wait_terminal(rid, 30)
        print(f"    client obeyed resumed_elsewhere; 4.5s later the request is: {t2 and strip(t2)} after {len(e.deltas(rid))} more deltas")
        await e.close()
async def main(c, key):
    for s in (0.0, 0.5, 1.0, 2.0, 3.5):
        await aba(c, key, s)
if __name__ == "__main__":
    c, tmp = start_cluster("a4d", workers=(("w0", "1"),), slots=16, grace_s=3.0)
    try: asyncio.run(main(c, create_key(c, "alice")))
    finally: c.close()
