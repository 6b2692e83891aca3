import asyncio
import json
import random
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from common import Conn, check_one, create_key, rss_kb, start_cluster, uid
problems = []
stats = Counter()

def metric(c, edge, key, name="lanes_edge_in_flight"):
    req = urllib.request.Request(f"http://127.0.0.1:{c.edge_ports[edge]}/metrics", headers={"Authorization": f"Bearer {key}"})
    for line in urllib.request.urlopen(req, timeout=5).read().decode().splitlines():
        if line.startswith(name + " "): return float(line.split()[1])

async def cycle(c, key, i, rng):
    kind = rng.choice(["finish", "abort", "close", "cancel", "resume", "badframes", "resume_other", "http_drop"])
    url = c.edge_urls["e1"]
    stats[kind] += 1
    if kind == "http_drop":
        # start a streaming HTTP request and drop it mid-stream
        r, w = await asyncio.open_connection("127.0.0.1", c.edge_ports["e1"])
        body = json.dumps({"model": "default", "stream": True, "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}).encode()
        w.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        await w.drain(); await asyncio.wait_for(r.read(600), 10); w.transport.abort(); return
    a = await Conn.open(url, key); rid = uid(f"m{i}")
    try:
        if kind == "badframes":
            await a.send("{bad"); await a.send(b"\x00"); await a.send({"type": "nope"}); await a.send({"type": "cancel", "id": "zz"})
            await a.chat(rid, max_tokens=20); await a.wait_terminal(rid, 20)
            problems.extend(check_one(a, rid, label=kind)); await a.close(); return
        await a.chat(rid, max_tokens=100)
        await a.wait_deltas(rid, 5, 20)
        if kind == "finish":
            await a.wait_terminal(rid, 20); problems.extend(check_one(a, rid, expect=("length",), label=kind)); await a.close()
        elif kind == "abort":
            await a.abort()
        elif kind == "close":
            await a.close()
        elif kind == "cancel":
            await a.send({"type": "cancel", "id": rid}); await a.wait_terminal(rid, 20)
            problems.extend(check_one(a, rid, expect=("cancelled", "length"), label=kind)); await a.close()
        elif kind in ("resume", "resume_other"):
            last = a.seqs(rid)[-1]; await a.abort()
            b = await Conn.open(c.edge_urls["e1" if kind == "resume" else "e2"], key)
            await b.send({"type": "resume", "id": rid, "last_seq": last}); await b.wait_terminal(rid, 20)
            problems.extend(check_one(b, rid, start_seq=last + 1, expect=("length",), label=kind)); await b.close()
    except Exception as e:
        problems.append(f"cycle {i} {kind}: {e!r}"); await a.abort()

async def run(c, key, n, conc=12, seed=0):
    rng = random.Random(seed); sem = asyncio.Semaphore(conc)
    async def one(i):
        async with sem:
            try:
                await asyncio.wait_for(cycle(c, key, i, rng), 40)
            except asyncio.TimeoutError:
                problems.append(f"cycle {i}: HANG (>40s)")
    t = time.monotonic(); await asyncio.gather(*(one(i) for i in range(n))); return time.monotonic() - t

async def main(c, key):
    pid1, pid2 = c.procs["e1"].pid, c.procs["e2"].pid
    await run(c, key, 200, seed=99)  # warm-up
    await asyncio.sleep(6)
    r0 = (rss_kb(pid1), rss_kb(pid2)); print("after 200 warm-up cycles + settle: RSS e1/e2 KiB", r0, flush=True)
    rows = []
    for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
        el = await run(c, key, 2000, seed=rnd)
        r_imm = (rss_kb(pid1), rss_kb(pid2))
        await asyncio.sleep(6)  # grace 3s expires for aborted ones
        r = (rss_kb(pid1), rss_kb(pid2))
        infl = (metric(c, "e1", key), metric(c, "e2", key))
        rows.append(r)
        print(f"round {rnd+1}: 2000 cycles in {el:.0f}s; RSS right after {r_imm}, settled {r}; in-flight {infl}; "
              f"e1 growth {(r[0]-r0[0])*1024/(2000*(rnd+1)):.0f} B/cycle since warm-up", flush=True)
    print("cycle kinds:", dict(stats))
    for name, pid in (("e1", pid1), ("e2", pid2)) if shutil.which("gdb") else ():
        # How much of the RSS is memory malloc holds free (fragmentation), not live objects.
        before = rss_kb(pid)
        out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "call (int)malloc_trim(0)"], capture_output=True, text=True)
        print(f"{name}: RSS {before} KiB, after malloc_trim(0) {rss_kb(pid)} KiB", [l for l in out.stdout.splitlines() if l.startswith("$")], flush=True)
    if len(rows) >= 2:
        print(f"e1 growth round2 vs round1: {(rows[1][0]-rows[0][0])*1024/2000:.0f} B/cycle; e2: {(rows[1][1]-rows[0][1])*1024/2000:.0f} B/cycle")

if __name__ == "__main__":
    # a6_memory.py [rounds] [allocator]: glibc (default), jemalloc (LD_PRELOAD, Debian's libjemalloc2),
    # nopymalloc (PYTHONMALLOC=malloc: every Python object straight from glibc), jemalloc-nopymalloc.
    mode = sys.argv[2] if len(sys.argv) > 2 else "glibc"
    extra = {"jemalloc": {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
             "jemalloc-nopymalloc": {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "PYTHONMALLOC": "malloc"},
             "nopymalloc": {"PYTHONMALLOC": "malloc"}, "glibc": {}}[mode]
    print("mode", mode, extra, flush=True)
    c, tmp = start_cluster("a6", workers=(("w0", "20"),), slots=16, grace_s=3.0, extra_env=extra)
    try:
        asyncio.run(main(c, create_key(c, "alice"))); print("crashed:", c.crashed())
    finally: c.close()
    print("PROBLEMS", len(problems)); [print(" -", p) for p in problems[:30]]
