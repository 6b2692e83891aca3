"""Memory per cycle kind: a6_memory's eight kinds one at a time (300 warm-up cycles each, then
two rounds of 1,500 per kind) against real processes; prints edge e1's RSS change per kind.

    .venv/bin/python scripts/attack/a6c_kinds.py
"""
import asyncio
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import a6_memory as a6
from common import create_key, rss_kb, start_cluster

KINDS = ["finish", "abort", "close", "cancel", "resume", "badframes", "resume_other", "http_drop"]

class Fixed:
    def __init__(self, kind): self.kind = kind
    def choice(self, seq): return self.kind

async def run_kind(c, key, kind, n, conc=12):
    sem = asyncio.Semaphore(conc); rng = Fixed(kind)
    async def one(i):
        async with sem:
            await asyncio.wait_for(a6.cycle(c, key, i, rng), 40)
    await asyncio.gather(*(one(i) for i in range(n)))

async def main(c, key):
    pid1 = c.procs["e1"].pid
    for kind in KINDS:
        await run_kind(c, key, kind, 300)
    await asyncio.sleep(5)
    for rnd in range(2):
        for kind in KINDS:
            r0 = rss_kb(pid1); await run_kind(c, key, kind, 1500); await asyncio.sleep(4); r1 = rss_kb(pid1)
            print(f"round {rnd} {kind:13s} e1 +{r1 - r0} KiB = {(r1 - r0) * 1024 / 1500:.0f} B/cycle", flush=True)

if __name__ == "__main__":
    c, tmp = start_cluster("a6k", workers=(("w0", "20"),), slots=16, grace_s=3.0)
    try: asyncio.run(main(c, create_key(c, "alice")))
    finally: c.close()
    print("PROBLEMS", len(a6.problems), a6.problems[:5])
