"""How fast does the old connection learn of a cross-edge / same-edge takeover?"""
import asyncio, time
from common import *
async def main(c, key):
    for e in ("e2", "e1", "e2", "e1"):
        a = await Conn.open(c.edge_urls["e1"], key); rid = uid("nt")
        await a.chat(rid, max_tokens=400); await a.wait_deltas(rid, 10)
        b = await Conn.open(c.edge_urls[e], key); t0 = time.monotonic()
        await b.send({"type": "resume", "id": rid, "last_seq": a.seqs(rid)[-1]})
        await a.wait_terminal(rid, 10)
        t = a.terminals(rid)[0]
        late = [f for f in a.deltas(rid) if f["_t"] > t0]
        print(f"takeover from {e}: old conn got {strip(t)} after {t['_t']-t0:.2f}s; it received {len(late)} deltas after the resume was sent")
        await b.send({"type": "cancel", "id": rid}); await b.wait_terminal(rid, 10)
        await a.close(); await b.close()
if __name__ == "__main__":
    c, tmp = start_cluster("a4g", workers=(("w0", "2"),), slots=16, grace_s=3.0)
    try: asyncio.run(main(c, create_key(c, "alice")))
    finally: c.close()
