"""How fast does the old connection learn of a cross-edge / same-edge takeover, and does it get
anything after it is told? A delta already in flight when the resume was sent may still arrive
before the ``resumed_elsewhere`` frame (it carries its seq, and the new stream starts after the
``last_seq`` the resume named); nothing may arrive after that frame, and the new connection's
seqs must run on from ``last_seq`` without a gap."""
import asyncio
import time
from common import *
async def main(c, key):
    problems = []
    for e in ("e2", "e1", "e2", "e1"):
        a = await Conn.open(c.edge_urls["e1"], key); rid = uid("nt")
        await a.chat(rid, max_tokens=400); await a.wait_deltas(rid, 10)
        b = await Conn.open(c.edge_urls[e], key); t0 = time.monotonic()
        last = a.seqs(rid)[-1]
        await b.send({"type": "resume", "id": rid, "last_seq": last})
        await a.wait_terminal(rid, 10)
        await b.wait_deltas(rid, 5)
        frames = a.by_id[rid]; t = a.terminals(rid)[0]; end = frames.index(t)
        in_flight = [f["seq"] for f in frames[:end] if f["type"] == "delta" and f["_t"] > t0]
        after = [f for f in frames[end + 1:] if f["type"] != "error" or f.get("code") not in ("unknown_id",)]
        new = b.seqs(rid)
        print(f"takeover from {e}: old conn got {strip(t)} after {t['_t']-t0:.3f}s; in flight before it: "
              f"seqs {in_flight} (resume named last_seq {last}); frames after it: {len(after)}; "
              f"new conn's first seqs {new[:3]}")
        if t.get("code") != "resumed_elsewhere":
            problems.append(f"{e}: old conn ended with {strip(t)}")
        if after:
            problems.append(f"{e}: old conn got {[strip(f) for f in after]} after its resumed_elsewhere")
        if not new or new[0] != last + 1 or new != list(range(last + 1, last + 1 + len(new))):
            problems.append(f"{e}: new conn's seqs {new[:10]} do not run on from {last}")
        await b.send({"type": "cancel", "id": rid}); await b.wait_terminal(rid, 10)
        await a.close(); await b.close()
    print("PROBLEMS", len(problems)); [print(" -", p) for p in problems]
if __name__ == "__main__":
    c, tmp = start_cluster("a4g", workers=(("w0", "2"),), slots=16, grace_s=3.0)
    try: asyncio.run(main(c, create_key(c, "alice")))
    finally: c.close()
