import asyncio
from common import *
TOK = 300
async def chain(c, key, pattern, per_hop=15, label=""):
    a = await Conn.open(c.edge_urls["e1"], key); rid = uid("chain")
    await a.chat(rid, max_tokens=TOK); await a.wait_deltas(rid, 10); await a.abort()
    allseq = list(a.seqs(rid)); log = [f"chat@e1 got {allseq[0]}..{allseq[-1]}"]
    final = None
    for hop, e in enumerate(pattern):
        b = await Conn.open(c.edge_urls[e], key)
        ls = allseq[-1]
        await b.send({"type": "resume", "id": rid, "last_seq": ls})
        if hop < len(pattern) - 1:
            await b.wait_deltas(rid, per_hop, 10)
            await b.abort()
        else:
            await b.wait_terminal(rid, 30); final = b
        s = b.seqs(rid)
        kinds = [f.get("code", f["type"]) for f in b.by_id[rid] if f["type"] != "delta"]
        log.append(f"hop{hop}@{e} last_seq={ls} -> {kinds} seqs {s[:1]}..{s[-1:]} n={len(s)}")
        allseq += s
        await asyncio.sleep(0)
    ok = allseq == list(range(TOK)) and final.terminals(rid) and final.terminals(rid)[0]["type"] == "done"
    print(f"{label} pattern {''.join(p[-1] for p in pattern)}: ok={bool(ok)} total={len(allseq)}")
    if not ok:
        for l in log: print("    ", l)
    await final.close()
    return bool(ok)
async def main(c, key):
    res = {}
    for name, pat in [("alt", ["e1", "e2"] * 3), ("same-e1", ["e1"] * 6), ("same-e2", ["e2"] * 6)]:
        r = [await chain(c, key, pat, label=name) for _ in range(4)]
        res[name] = f"{sum(r)}/{len(r)} ok"
    print(res)
if __name__ == "__main__":
    c, tmp = start_cluster("a4c", workers=(("w0", "2"),), slots=16, grace_s=3.0)
    try:
        asyncio.run(main(c, create_key(c, "alice")))
    finally: c.close()
    print(tmp)
