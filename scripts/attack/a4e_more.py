import asyncio
import time
from common import *
TOK = 400
def kinds(conn, rid): return [f.get("code", f.get("finish_reason", f["type"])) for f in conn.by_id[rid] if f["type"] != "delta"]
async def main(c, key):
    # 1) open on e1, takeover from e2 (e1 conn open), take back with the old e1 connection
    a = await Conn.open(c.edge_urls["e1"], key); rid = uid("back")
    await a.chat(rid, max_tokens=TOK); await a.wait_deltas(rid, 10)
    b = await Conn.open(c.edge_urls["e2"], key)
    await b.send({"type": "resume", "id": rid, "last_seq": a.seqs(rid)[-1]}); await b.wait_deltas(rid, 10)
    await asyncio.sleep(0.2)
    last = b.seqs(rid)[-1]
    a2 = await Conn.open(c.edge_urls["e1"], key)
    await a2.send({"type": "resume", "id": rid, "last_seq": last})
    await a2.wait_terminal(rid, 30); await b.wait_terminal(rid, 5); await asyncio.sleep(0.3)
    print(f"takeback e1->e2(open)->e1(new conn): a {kinds(a, rid)}, b {kinds(b, rid)} ({len(b.deltas(rid))}d), a2 {kinds(a2, rid)} ({len(a2.deltas(rid))}d, expected {TOK-last-1})")
    for x in (a, b, a2): await x.close()
    # 2) cancel on the new connection after a cross-edge resume
    a = await Conn.open(c.edge_urls["e1"], key); rid = uid("cx")
    await a.chat(rid, max_tokens=TOK); await a.wait_deltas(rid, 10); await a.abort()
    b = await Conn.open(c.edge_urls["e2"], key)
    await b.send({"type": "resume", "id": rid, "last_seq": a.seqs(rid)[-1]}); await b.wait_deltas(rid, 5)
    t0 = time.monotonic(); await b.send({"type": "cancel", "id": rid}); t = await b.wait_terminal(rid, 10)
    print(f"cancel after cross-edge resume: {kinds(b, rid)} in {time.monotonic()-t0:.2f}s; problems {check_one(b, rid, start_seq=a.seqs(rid)[-1]+1)}")
    await b.close()
    # 3) cancel immediately after resume (while RESUMING)
    a = await Conn.open(c.edge_urls["e1"], key); rid = uid("cr")
    await a.chat(rid, max_tokens=TOK); await a.wait_deltas(rid, 10); await a.abort()
    b = await Conn.open(c.edge_urls["e2"], key)
    await b.send({"type": "resume", "id": rid, "last_seq": a.seqs(rid)[-1]}); await b.send({"type": "cancel", "id": rid})
    t = await b.wait_terminal(rid, 15); await asyncio.sleep(0.5)
    print(f"cancel right after resume (same tick): {kinds(b, rid)} {len(b.deltas(rid))}d; problems {check_one(b, rid, start_seq=a.seqs(rid)[-1]+1)}")
    await b.close()
    # 4) resume on same connection twice
    a = await Conn.open(c.edge_urls["e1"], key); rid = uid("rr")
    await a.chat(rid, max_tokens=TOK); await a.wait_deltas(rid, 10); await a.abort()
    b = await Conn.open(c.edge_urls["e2"], key)
    await b.send({"type": "resume", "id": rid, "last_seq": a.seqs(rid)[-1]}); await b.send({"type": "resume", "id": rid, "last_seq": -1})
    await b.wait_terminal(rid, 30); await asyncio.sleep(0.5)
    print(f"two resumes on one connection: {kinds(b, rid)} {len(b.deltas(rid))}d; problems {check_one(b, rid, start_seq=a.seqs(rid)[-1]+1)}")
    await b.close()
    # 5) chat on e1, abort, resume on e1 right away (A->A) while worker attached: ok; then A->B within 50ms
    # 6) 64 in-flight per connection via resumes
if __name__ == "__main__":
    c, tmp = start_cluster("a4e", workers=(("w0", "2"),), slots=16, grace_s=3.0)
    try: asyncio.run(main(c, create_key(c, "alice"))); print("crashed", c.crashed())
    finally: c.close()
