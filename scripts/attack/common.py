"""Shared harness for the attack scripts: a hostile client against real processes (embedded
Redis, scheduler, two edges with API keys on, sim workers), each script one family of attacks.

    .venv/bin/python scripts/attack/a1_bad_input.py      # and a2_race, a34_resume, a4*_..., a5_kill, a6_memory
"""
from __future__ import annotations
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
import tempfile
from collections import defaultdict
from pathlib import Path
import websockets

from lanes.cli.cluster import Cluster, FAST_FAILOVER_ENV

LANES = str(Path(sys.executable).with_name("lanes"))
TERMINAL = ("done", "error")


def start_cluster(tag: str, *, grace_s: float = 3.0, edges=("e1", "e2"), workers=(("w0", "20"),),
                  slots: int = 8, extra_env: dict | None = None):
    tmp = Path(tempfile.mkdtemp(prefix=f"lanes-attack-{tag}-"))
    env = {**FAST_FAILOVER_ENV, "LANES_AUTH_REQUIRED": "true", "LANES_RESUME_GRACE_S": str(grace_s),
           "LANES_KEY_RATE_PER_S": "0", "LANES_KEY_MAX_IN_FLIGHT": "0", **(extra_env or {})}
    c = Cluster.embedded(f"atk{tag}", tmp, base_env=env)
    c.start_scheduler()
    for e in edges:
        c.start_edge(e)
    for name, scale in workers:
        c.start_worker(name, "", "--engine", "sim", "--sim-time-scale", scale, "--max-slots", str(slots))
    c.wait_workers(len(workers))
    return c, tmp


def create_key(c: Cluster, name: str, *opts: str) -> str:
    env = {**os.environ, "LANES_REDIS_URL": c.redis_url, "LANES_KEY_PREFIX": c.prefix}
    out = subprocess.run([LANES, "keys", "create", name, *opts], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def rss_kb(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


class Conn:
    """Records every frame (in order) by id; ``raw`` keeps everything."""

    def __init__(self, ws, name=""):
        self.ws, self.name = ws, name
        self.raw: list[dict] = []
        self.by_id: dict = defaultdict(list)
        self.events: dict = defaultdict(asyncio.Event)
        self.closed = asyncio.Event()
        self.close_code = None
        self.bad_json = []
        self._t = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url, key, name="", **kw):
        hdr = {"Authorization": f"Bearer {key}"} if key else {}
        ws = await websockets.connect(url, max_size=None, additional_headers=hdr, open_timeout=10, **kw)
        return cls(ws, name)

    async def _read(self):
        try:
            async for raw in self.ws:
                try:
                    f = json.loads(raw)
                except Exception:
                    self.bad_json.append(raw)
                    continue
                f["_t"] = time.monotonic()
                self.raw.append(f)
                self.by_id[f.get("id")].append(f)
                self.events[f.get("id")].set()
        except websockets.ConnectionClosed:
            pass
        finally:
            self.close_code = getattr(self.ws, "close_code", None)
            self.closed.set()
            for ev in self.events.values():
                ev.set()

    async def send(self, frame):
        await self.ws.send(frame if isinstance(frame, (str, bytes)) else json.dumps(frame))

    async def chat(self, rid, content="Tell me a story about a cat.", max_tokens=50, **kw):
        f = {"type": "chat", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **kw}
        if rid is not None:
            f["id"] = rid
        await self.send(f)

    def terminals(self, rid):
        """The frames that end ``rid`` on this connection (docs/protocol.md): ``done``, or an error,
        except the replies to a later frame that named the id: ``duplicate_id`` while a request
        runs under it (it is not affected), and ``unknown_id`` / ``duplicate_id`` after its end
        (a cancel or repeat that crossed the ``done``)."""
        ends, running = [], False
        for f in self.by_id[rid]:
            if f["type"] in ("accepted", "resumed"):
                running = True
            elif f["type"] in TERMINAL:
                reply = (running and f.get("code") == "duplicate_id") or \
                        (bool(ends) and f.get("code") in ("unknown_id", "duplicate_id"))
                if not reply:
                    ends.append(f)
                    running = False
        return ends

    def deltas(self, rid):
        return [f for f in self.by_id[rid] if f["type"] == "delta"]

    def seqs(self, rid):
        return [f["seq"] for f in self.deltas(rid)]

    async def wait_terminal(self, rid, timeout=30.0):
        end = time.monotonic() + timeout
        while not self.terminals(rid):
            if self.closed.is_set():
                return None
            rem = end - time.monotonic()
            if rem <= 0:
                return None
            self.events[rid].clear()
            try:
                await asyncio.wait_for(self.events[rid].wait(), min(rem, 0.5))
            except asyncio.TimeoutError:
                pass
        return self.terminals(rid)[0]

    async def wait_deltas(self, rid, n, timeout=30.0):
        end = time.monotonic() + timeout
        while len(self.deltas(rid)) < n and not self.terminals(rid) and time.monotonic() < end and not self.closed.is_set():
            await asyncio.sleep(0.005)
        return len(self.deltas(rid))

    async def wait_any(self, rid, timeout=10.0):
        end = time.monotonic() + timeout
        while not self.by_id[rid] and time.monotonic() < end and not self.closed.is_set():
            await asyncio.sleep(0.005)
        return self.by_id[rid][0] if self.by_id[rid] else None

    async def close(self):
        try:
            await asyncio.wait_for(self.ws.close(), 5)
        except Exception:
            pass
        self._t.cancel()

    async def abort(self):
        """Drop the TCP connection without a close handshake."""
        try:
            self.ws.transport.abort()
        except Exception:
            pass
        await asyncio.sleep(0)


def check_one(conn: Conn, rid, *, start_seq=0, expect=None, label=""):
    """Exactly one terminal (``Conn.terminals``: replies to frames that named the id are not
    terminals), contiguous seqs from start_seq, no delta after it. Returns list of problems."""
    probs = []
    ends = conn.terminals(rid)
    frames = [f for f in conn.by_id[rid] if f["type"] not in TERMINAL or any(f is e for e in ends)]
    terms = [i for i, f in enumerate(frames) if any(f is e for e in ends)]
    if len(terms) != 1:
        probs.append(f"{label} id={rid}: {len(terms)} terminal frames ({[frames[i] for i in terms][:3]})")
    elif terms[0] != len(frames) - 1:
        probs.append(f"{label} id={rid}: frames after terminal: {[f['type'] for f in frames[terms[0]:]]}")
    seqs = conn.seqs(rid)
    if seqs and seqs != list(range(start_seq, start_seq + len(seqs))):
        probs.append(f"{label} id={rid}: seqs not contiguous from {start_seq}: {seqs[:10]}...{seqs[-5:]} (n={len(seqs)})")
    if expect and terms and frames[terms[0]].get("code", frames[terms[0]].get("finish_reason")) not in expect:
        probs.append(f"{label} id={rid}: terminal {strip(frames[terms[0]])} not in {expect}")
    return probs


def strip(f):
    return {k: v for k, v in f.items() if k not in ("_t", "timing", "usage")}


def uid(p="r"):
    return f"{p}-{uuid.uuid4().hex[:10]}"
