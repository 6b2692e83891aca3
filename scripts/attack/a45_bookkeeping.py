"""Attack 45: the edge's request bookkeeping, re-run as an outside checker would (real processes:
embedded Redis, scheduler, two edges with API keys on, one or two sim workers).

What the earlier attacks (a2, a34, a4*, a5, a6) leave out, one section each:

    seqs      resume's last_seq at the edges: -1, -2, 2**31, 2**31+1, a string, a float, true,
              absent; equal to the last seq of a finished answer
    ended     resume of a cancelled, a grace-expired, an unknown and another key's request
    many      20 resumes of one id at once over both edges (the original aborted, or still open)
    race      cancel (owner, e1) racing a resume (same key, e2 or e1) on one id
    dup       chat with an id that is in flight here / on the other edge / in grace / done / cancelled
    dupresume a resubmitted chat and a resume of its id sent at once on one edge (done, or still
              running on the other edge, or a new id): the resume must get the answer, not the
              chat's refusal
    mux       32 requests interleaved on one socket: per-request seq order; then all 32 resumed
              at once on one socket of the other edge from different seqs (replays interleaved)
    foreign   resume on e2 while the chat's socket on e1 is open and streaming, at the start (queued
              or before the first delta), mid-stream and near the end: the union of both sockets
              covers every seq once, the old one ends resumed_elsewhere, never silence
    slow      a client that stops reading with 16 long answers in flight: closed 4008 / dropped,
              its requests resumable, the edge's RSS bounded, a reading client on the edge unstalled
    burst     a client that stops reading, then resumes finished 4,000-token answers (one 20
              times, 20 different ones): each replay is written at once, nothing more comes to
              trigger 4008; the edge must still let go of the socket and its buffer
    ping      a client that neither reads nor answers pings, holding nothing: closed by the
              keepalive (20 s + 20 s)
    edgekill  edge e1 SIGKILLed and SIGTERMed (close 1012) mid-stream: resume on e2 and on the
              restarted e1; the text equals an uninterrupted answer's
    workerkill a resumed (e1 -> e2) request's worker SIGKILLed mid-stream: retried on the other
              worker, the resumed client gets every seq once, text equal to the reference
    orphan    e1 SIGTERMed / SIGKILLed with 4 long answers streaming and nobody resuming: they stop
              running once the resume grace has passed, and a late resume says cancelled
    census N  mem's mix (N, default 3000) against two in-process edges: every edge table's size
              once the grace has run out (entries, sessions, pools, tasks, spans, key counts)
    mem N     N (default 10000) chats abandoned at random points (before any frame, after
              accepted, mid-stream, after done without a close): e1's RSS, in-flight and
              connection gauges, and the workers' running slots once the grace has run out

    .venv/bin/python scripts/attack/a45_bookkeeping.py [section ...]     # default: all but mem
    A45_REDIS_PORT / A45_EDGE_PORT pick the ports (default 16800 and 7500, 7501).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from common import Conn, check_one, create_key, rss_kb, strip, uid
from lanes.cli.cluster import Cluster, FAST_FAILOVER_ENV

problems: list[str] = []
TOK = 300
PROMPT = "Describe the history of the bicycle in detail."
REDIS_PORT = int(os.environ.get("A45_REDIS_PORT", "16800"))
EDGE_PORT = int(os.environ.get("A45_EDGE_PORT", "7500"))


def P(message: str) -> None:
    problems.append(message)
    print("DEFECT?", message, flush=True)


def start(tag: str, *, grace_s: float = 3.0, workers=(("w0", "2"),), slots: int = 16, extra_env=None):
    tmp = Path(tempfile.mkdtemp(prefix=f"lanes-a45-{tag}-"))
    env = {**FAST_FAILOVER_ENV, "LANES_AUTH_REQUIRED": "true", "LANES_RESUME_GRACE_S": str(grace_s),
           "LANES_KEY_RATE_PER_S": "0", "LANES_KEY_MAX_IN_FLIGHT": "0", **(extra_env or {})}
    c = Cluster.embedded(f"a45{tag}", tmp, port=REDIS_PORT, base_env=env)
    c.start_scheduler()
    for i, e in enumerate(("e1", "e2")):
        c.start_edge(e, port=EDGE_PORT + i)
    for name, scale in workers:
        c.start_worker(name, "", "--engine", "sim", "--sim-time-scale", scale, "--max-slots", str(slots))
    c.wait_workers(len(workers))
    return c


def http_json(c, edge, path, key):
    req = urllib.request.Request(f"http://127.0.0.1:{c.edge_ports[edge]}{path}", headers={"Authorization": f"Bearer {key}"})
    return urllib.request.urlopen(req, timeout=5).read().decode()


def gauge(c, edge, key, name):
    for line in http_json(c, edge, "/metrics", key).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])


def running(c, key):
    return sum(sum((w.get("running") or {}).values()) for w in json.loads(http_json(c, "e2", "/v1/workers", key)))


def ends(conn, rid):
    return [f.get("code") or f.get("finish_reason") or f["type"] for f in conn.by_id[rid] if f["type"] != "delta"]


async def started(c, key, edge="e1", n=10, tok=TOK, **kw):
    a = await Conn.open(c.edge_urls[edge], key)
    rid = uid("s")
    await a.chat(rid, PROMPT, max_tokens=tok, **kw)
    await a.wait_deltas(rid, n, 30)
    return a, rid


# -- seqs -----------------------------------------------------------------------------------

async def seqs(c, key):
    print("== seqs: resume's last_seq at the edges")
    a, rid = await started(c, key, tok=40)
    await a.wait_terminal(rid, 30)
    b = await Conn.open(c.edge_urls["e2"], key)
    for bad in (-2, 2**31 + 1, "5", 1.5, True, None):
        frame = {"type": "resume", "id": rid, "last_seq": bad}
        if bad is None:
            del frame["last_seq"]
        n = len(b.raw)
        await b.send(frame)
        await asyncio.sleep(0.4)
        got = [strip(f) for f in b.raw[n:]]
        print(f"  last_seq={bad!r}: {got}")
        want = "missing_field" if bad is None else "invalid_field"
        if len(got) != 1 or got[0].get("code") != want or "last_seq" not in got[0].get("message", ""):
            P(f"seqs: last_seq={bad!r} -> {got}, expected one {want} naming last_seq")
    await b.close()
    for ls, n_exp in ((39, 0), (2**31, 0), (-1, 40), (20, 19)):
        b = await Conn.open(c.edge_urls["e2"], key)
        await b.send({"type": "resume", "id": rid, "last_seq": ls})
        t = await b.wait_terminal(rid, 10)
        print(f"  finished, last_seq={ls}: {ends(b, rid)}, {len(b.deltas(rid))} deltas")
        pr = check_one(b, rid, start_seq=ls + 1, expect=("length",), label=f"seqs finished last_seq={ls}")
        if ends(b, rid)[:1] != ["resumed"] or len(b.deltas(rid)) != n_exp or t is None:
            pr.append(f"seqs finished last_seq={ls}: {ends(b, rid)} {len(b.deltas(rid))} deltas (want {n_exp})")
        for p in pr:
            P(p)
        await b.close()
    # running request, resumed at its current last seq (nothing to replay, live continues)
    a, rid = await started(c, key)
    last = a.seqs(rid)[-1]
    await a.abort()
    b = await Conn.open(c.edge_urls["e2"], key)
    await b.send({"type": "resume", "id": rid, "last_seq": 2**31})
    t = await b.wait_terminal(rid, 30)
    print(f"  running, last_seq=2**31: {ends(b, rid)}, {len(b.deltas(rid))} deltas (last was {last})")
    if ends(b, rid) != ["resumed", "length"] or b.deltas(rid):
        P(f"seqs running last_seq=2**31 -> {ends(b, rid)} {len(b.deltas(rid))} deltas")
    await b.close()
    await a.close()


# -- ended ----------------------------------------------------------------------------------

async def ended(c, key, bob):
    print("== ended: resume of cancelled / expired / unknown / another key's")
    a, rid = await started(c, key, n=10)
    await a.send({"type": "cancel", "id": rid})
    await a.wait_terminal(rid, 10)
    got = len(a.deltas(rid))
    await a.close()
    await asyncio.sleep(0.5)
    b = await Conn.open(c.edge_urls["e2"], key)
    await b.send({"type": "resume", "id": rid, "last_seq": -1})
    await b.wait_terminal(rid, 10)
    await asyncio.sleep(0.3)
    print(f"  cancelled after {got} deltas, resume -1: {ends(b, rid)} {len(b.deltas(rid))} deltas")
    for p in check_one(b, rid, expect=("cancelled",), label="ended cancelled"):
        P(p)
    if len(b.deltas(rid)) < got:
        P(f"ended cancelled: replay gave {len(b.deltas(rid))} deltas, the client had seen {got}")
    await b.close()
    # grace expired (3 s)
    a, rid = await started(c, key, n=5, tok=3000)
    last = a.seqs(rid)[-1]
    await a.abort()
    await asyncio.sleep(5)
    b = await Conn.open(c.edge_urls["e2"], key)
    await b.send({"type": "resume", "id": rid, "last_seq": last})
    await b.wait_terminal(rid, 10)
    await asyncio.sleep(0.3)
    print(f"  expired (grace 3 s, resumed at 5 s): {ends(b, rid)} {len(b.deltas(rid))} deltas after {last}")
    for p in check_one(b, rid, start_seq=last + 1, expect=("cancelled",), label="ended expired"):
        P(p)
    # unknown, another key's (a live one)
    a, rid = await started(c, key, n=5)
    for who, k, r in (("unknown", key, uid("nope")), ("other key", bob, rid)):
        x = await Conn.open(c.edge_urls["e2"], k)
        await x.send({"type": "resume", "id": r, "last_seq": -1})
        await asyncio.sleep(0.5)
        print(f"  {who}: {[strip(f) for f in x.raw]}")
        if [f.get("code") for f in x.raw] != ["unknown_id"]:
            P(f"ended {who}: {[strip(f) for f in x.raw]}")
        await x.close()
    await a.wait_terminal(rid, 30)
    for p in check_one(a, rid, expect=("length",), label="ended owner"):
        P(p)
    await a.close()
    await b.close()


# -- many -----------------------------------------------------------------------------------

async def many(c, key, keep_open: bool, n=20):
    print(f"== many: {n} resumes of one id at once (original {'open' if keep_open else 'aborted'})")
    a, rid = await started(c, key, n=10)
    if not keep_open:
        await a.abort()
    last = a.seqs(rid)[-1]
    conns = [await Conn.open(c.edge_urls[("e1", "e2")[i % 2]], key) for i in range(n)]
    frame = json.dumps({"type": "resume", "id": rid, "last_seq": last})
    await asyncio.gather(*(x.ws.send(frame) for x in conns))
    await asyncio.gather(*(x.wait_terminal(rid, 40) for x in conns))
    await asyncio.sleep(1)
    outcome = Counter(tuple(ends(x, rid)) for x in conns)
    print(f"  outcomes: {dict(outcome)}")
    winners = [x for x in conns if x.terminals(rid) and x.terminals(rid)[0]["type"] == "done"]
    for x in conns:
        for p in check_one(x, rid, start_seq=last + 1, label="many"):
            P(p)
    if len(winners) != 1:
        P(f"many: {len(winners)} connections ended with done")
    else:
        w = winners[0]
        if w.seqs(rid) and w.seqs(rid)[-1] != TOK - 1:
            P(f"many: winner's last seq {w.seqs(rid)[-1]}")
        if ends(w, rid)[:1] != ["resumed"]:
            P(f"many: winner's frames {ends(w, rid)}")
    silent = [x for x in conns if not x.by_id[rid]]
    if silent:
        P(f"many: {len(silent)} resumes got no frame at all")
    if keep_open:
        for p in check_one(a, rid, expect=("resumed_elsewhere",), label="many original"):
            P(p)
    for x in (a, *conns):
        await x.close()


# -- race -----------------------------------------------------------------------------------

async def race(c, key, n=12):
    print("== race: cancel (owner, e1) against resume (e2, or another socket on e1) on one id")
    out = Counter()
    for i in range(n):
        a, rid = await started(c, key, n=5 + i)
        b = await Conn.open(c.edge_urls["e2" if i % 2 == 0 else "e1"], key)
        last = a.seqs(rid)[-1]
        cancel = json.dumps({"type": "cancel", "id": rid})
        resume = json.dumps({"type": "resume", "id": rid, "last_seq": last})
        await asyncio.gather(a.ws.send(cancel), b.ws.send(resume))
        await asyncio.gather(a.wait_terminal(rid, 20), b.wait_terminal(rid, 30))
        await asyncio.sleep(0.5)
        ka, kb = ends(a, rid), ends(b, rid)
        out[("e2" if i % 2 == 0 else "e1", tuple(ka), tuple(kb))] += 1
        for conn, lab in ((a, "race owner"), (b, "race resumer")):
            if not conn.terminals(rid):
                P(f"{lab} {rid}: no terminal frame: {ka} / {kb}")
        for p in check_one(b, rid, start_seq=last + 1, label="race resumer"):
            P(p)
        # the owner's terminal is done(cancelled) or resumed_elsewhere, and exactly one
        ta = a.terminals(rid)
        if len(ta) != 1:
            P(f"race owner {rid}: terminals {[strip(f) for f in ta]}")
        # In Redis the request must not run on for nobody: b's end says what happened
        tb = b.terminals(rid)
        if tb and tb[0].get("finish_reason") == "length" and len(b.deltas(rid)) != TOK - last - 1:
            P(f"race resumer {rid}: {len(b.deltas(rid))} deltas after {last}")
        await a.close()
        await b.close()
    for k, v in out.items():
        print(f"  resume on {k[0]}: owner {list(k[1])} | resumer {list(k[2])}: {v}")
    await asyncio.sleep(2)
    r = running(c, key)
    print(f"  slots running afterwards: {r}")
    if r:
        P(f"race: {r} slots still running after every race ended")


# -- dup ------------------------------------------------------------------------------------

async def dup(c, key):
    print("== dup: chat with an id that exists")
    a, rid = await started(c, key, n=5)
    cases = []
    for edge in ("e1", "e2"):
        x = await Conn.open(c.edge_urls[edge], key)
        await x.chat(rid, max_tokens=5)
        await asyncio.sleep(0.5)
        cases.append((f"in flight, chat on {edge}", x, rid))
    # same connection as the owner
    await a.chat(rid, max_tokens=5)
    await asyncio.sleep(0.3)
    g, grid = await started(c, key, n=3, tok=3000)
    await g.abort()
    x = await Conn.open(c.edge_urls["e2"], key)
    await x.chat(grid, max_tokens=5)
    await asyncio.sleep(0.5)
    cases.append(("in grace", x, grid))
    d, did = await started(c, key, n=3, tok=20)
    await d.wait_terminal(did)
    x = await Conn.open(c.edge_urls["e2"], key)
    await x.chat(did, max_tokens=5)
    await asyncio.sleep(0.5)
    cases.append(("done", x, did))
    k, kid = await started(c, key, n=3)
    await k.send({"type": "cancel", "id": kid})
    await k.wait_terminal(kid)
    x = await Conn.open(c.edge_urls["e1"], key)
    await x.chat(kid, max_tokens=5)
    await asyncio.sleep(0.5)
    cases.append(("cancelled", x, kid))
    for label, x, r in cases:
        got = [strip(f) for f in x.by_id[r]]
        print(f"  {label}: {got}")
        if len(got) != 1 or got[0].get("code") != "duplicate_id":
            P(f"dup {label}: {got}")
    await a.wait_terminal(rid, 30)
    print(f"  owner: {ends(a, rid)} {len(a.deltas(rid))} deltas")
    for p in check_one(a, rid, expect=("length",), label="dup owner"):
        P(p)
    if len(a.deltas(rid)) != TOK:
        P(f"dup owner: {len(a.deltas(rid))} deltas")
    for _, x, _ in cases:
        await x.close()
    for x in (a, g, d, k):
        await x.close()


async def dupresume(c, key, n=15):
    """A resubmitted chat and a resume of the same id sent at once, on one edge (the client
    retries both ways after a reconnect): the resume took over the chat's registration while
    its enqueue was out, and when Redis said the id exists the refusal went to the resume."""
    print("== dupresume: chat (resubmitted id) and resume of it at once on one edge")
    out = Counter()
    for i in range(n):
        running_elsewhere, new_id = i % 3 == 1, i % 3 == 2
        o = await Conn.open(c.edge_urls["e2"], key)
        rid = uid("dr")
        if not new_id:
            await o.chat(rid, PROMPT, max_tokens=60 if not running_elsewhere else TOK)
        if running_elsewhere:
            await o.wait_deltas(rid, 5, 30)
        elif not new_id:
            await o.wait_terminal(rid, 30)
        a = await Conn.open(c.edge_urls["e1"], key)
        b = await Conn.open(c.edge_urls["e1"], key)
        chat = json.dumps({"type": "chat", "id": rid, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 60})
        resume = json.dumps({"type": "resume", "id": rid, "last_seq": -1})
        await a.ws.send(chat)
        await b.ws.send(resume)
        await b.wait_terminal(rid, 40)
        await asyncio.sleep(0.5)
        ka, kb = ends(a, rid), ends(b, rid)
        out[("running elsewhere" if running_elsewhere else "new id" if new_id else "done", tuple(ka), tuple(kb))] += 1
        if new_id and kb == ["unknown_id"]:
            # a new id: the resume overtook the chat (nothing to resume yet), which runs on
            await a.wait_terminal(rid, 30)
            for p in check_one(a, rid, expect=("length",), label="dupresume new chat"):
                P(p)
            for x in (o, a, b):
                await x.close()
            continue
        want = TOK if running_elsewhere else 60
        if kb[:1] != ["resumed"] or len(b.deltas(rid)) != want:
            P(f"dupresume {rid}: the resume got {kb} with {len(b.deltas(rid))}/{want} deltas (the chat: {ka})")
        for p in check_one(b, rid, expect=("length",), label="dupresume resume"):
            P(p)
        for p in check_one(a, rid, expect=("resumed_elsewhere", "duplicate_id"), label="dupresume chat"):
            P(p)
        if running_elsewhere:  # the original socket on e2 loses it to the resume on e1
            await o.wait_terminal(rid, 10)
            for p in check_one(o, rid, expect=("resumed_elsewhere",), label="dupresume original"):
                P(p)
        for x in (o, a, b):
            await x.close()
    for k, v in out.items():
        print(f"  original {k[0]}: chat {list(k[1])} | resume {list(k[2])}: {v}")


# -- mux ------------------------------------------------------------------------------------

async def mux(c, key, n=32):
    print(f"== mux: {n} requests interleaved on one socket")
    a = await Conn.open(c.edge_urls["e1"], key)
    rids = [uid("mx") for _ in range(n)]
    toks = [random.Random(i).randint(1, 200) for i in range(n)]
    for r, t in zip(rids, toks):
        await a.chat(r, max_tokens=t)
    for r in rids:
        await a.wait_terminal(r, 60)
    bad = 0
    for r, t in zip(rids, toks):
        pr = check_one(a, r, expect=("length", "stop"), label="mux")
        if ends(a, r)[:1] != ["accepted"] or len(a.deltas(r)) != t:
            pr.append(f"mux {r}: {ends(a, r)} {len(a.deltas(r))}/{t} deltas")
        bad += bool(pr)
        for p in pr:
            P(p)
    # the same requests again, replayed at once on one socket of the other edge from different seqs
    b = await Conn.open(c.edge_urls["e2"], key)
    starts = {}
    for i, (r, t) in enumerate(zip(rids, toks)):
        starts[r] = (i * 7) % (t + 1) - 1
        await b.send({"type": "resume", "id": r, "last_seq": starts[r]})
    for r in rids:
        await b.wait_terminal(r, 30)
    for r, t in zip(rids, toks):
        pr = check_one(b, r, start_seq=starts[r] + 1, expect=("length", "stop"), label="mux replay")
        if len(b.deltas(r)) != t - starts[r] - 1:
            pr.append(f"mux replay {r}: {len(b.deltas(r))} deltas after {starts[r]} of {t}")
        bad += bool(pr)
        for p in pr:
            P(p)
    await b.close()
    order = [f["id"] for f in a.raw if f["type"] == "delta"]
    switches = sum(1 for x, y in zip(order, order[1:]) if x != y)
    print(f"  {2 * n - bad}/{2 * n} clean (live, then replayed on e2); {len(order)} deltas, id switches between consecutive deltas: {switches}")
    await a.close()


# -- foreign --------------------------------------------------------------------------------

async def foreign(c, key):
    print("== foreign: resume on e2 while the chat's socket on e1 is open and streaming")
    for when in ("before first delta", 1, 50, TOK - 20, TOK - 3):
        a = await Conn.open(c.edge_urls["e1"], key)
        rid = uid("fr")
        await a.chat(rid, PROMPT, max_tokens=TOK)
        if when == "before first delta":
            await a.wait_any(rid)
        else:
            await a.wait_deltas(rid, when, 30)
        b = await Conn.open(c.edge_urls["e2"], key)
        last = a.seqs(rid)[-1] if a.seqs(rid) else -1
        await b.send({"type": "resume", "id": rid, "last_seq": last})
        await asyncio.gather(a.wait_terminal(rid, 30), b.wait_terminal(rid, 30))
        await asyncio.sleep(0.3)
        sa, sb = a.seqs(rid), b.seqs(rid)
        print(f"  at {when}: old {ends(a, rid)} seqs ..{sa[-1:]} ({len(sa)}), new {ends(b, rid)} seqs {sb[:1]}..{sb[-1:]} ({len(sb)})")
        for p in check_one(a, rid, expect=("resumed_elsewhere", "length"), label=f"foreign@{when} old"):
            P(p)
        for p in check_one(b, rid, start_seq=last + 1, expect=("length",), label=f"foreign@{when} new"):
            P(p)
        if ends(b, rid)[:1] != ["resumed"] or (sb and sb[-1] != TOK - 1) or last + 1 + len(sb) != TOK:
            P(f"foreign@{when}: new conn {ends(b, rid)}, {len(sb)} deltas after {last}")
        if ends(a, rid)[-1:] == ["length"] and ends(b, rid)[-1:] == ["length"]:
            pass  # both ended done: fine only if the old one saw the end before the resume
        await a.close()
        await b.close()
    # queued: the worker is full, the chat waits in its lane when the resume comes
    fill = await Conn.open(c.edge_urls["e1"], key)
    fillers = [uid("fill") for _ in range(16)]
    for r in fillers:
        await fill.chat(r, max_tokens=4000)
    for r in fillers:
        await fill.wait_deltas(r, 1, 30)
    a = await Conn.open(c.edge_urls["e1"], key)
    rid = uid("q")
    await a.chat(rid, PROMPT, max_tokens=40)
    await a.wait_any(rid)
    b = await Conn.open(c.edge_urls["e2"], key)
    await b.send({"type": "resume", "id": rid, "last_seq": -1})
    await a.wait_terminal(rid, 10)
    for r in fillers:
        await fill.send({"type": "cancel", "id": r})
    await b.wait_terminal(rid, 40)
    await asyncio.sleep(0.3)
    print(f"  queued: old {ends(a, rid)}, new {ends(b, rid)} {len(b.deltas(rid))} deltas")
    for p in check_one(a, rid, expect=("resumed_elsewhere",), label="foreign queued old"):
        P(p)
    for p in check_one(b, rid, expect=("length",), label="foreign queued new"):
        P(p)
    if len(b.deltas(rid)) != 40:
        P(f"foreign queued: new conn got {len(b.deltas(rid))}/40 deltas")
    for x in (fill, a, b):
        await x.close()


# -- slow -----------------------------------------------------------------------------------

async def slow(c, key):
    print("== slow: a client that stops reading, 16 answers of 4000 tokens in flight")
    pid = c.procs["e1"].pid
    r0 = rss_kb(pid)
    a = await Conn.open(c.edge_urls["e1"], key)
    rids = [uid("sl") for _ in range(16)]
    for r in rids:
        await a.chat(r, "x " * 2000, max_tokens=4000)
    await a.wait_deltas(rids[0], 1, 30)
    a.ws.transport.pause_reading()
    watch = await Conn.open(c.edge_urls["e1"], key)
    wid = uid("watch")
    await watch.chat(wid, max_tokens=600)
    t0 = time.monotonic()
    peak, closed_at = r0, None
    while time.monotonic() - t0 < 40:
        peak = max(peak, rss_kb(pid))
        if closed_at is None and gauge(c, "e1", key, "lanes_edge_connections") <= 1:
            closed_at = time.monotonic() - t0
        if closed_at is not None and watch.terminals(wid):
            break
        await asyncio.sleep(0.25)
    await watch.wait_terminal(wid, 30)
    d = watch.deltas(wid)
    gap = max((y["_t"] - x["_t"] for x, y in zip(d, d[1:])), default=0)
    print(f"  e1 RSS {r0} -> peak {peak} KiB (+{peak - r0}); the edge let go of the socket {closed_at and round(closed_at, 1)} s "
          f"after reading stopped; the reading client's biggest gap {gap:.2f}s, {ends(watch, wid)}")
    if closed_at is None:
        P("slow: the edge still holds the non-reading socket after 40 s")
    if peak - r0 > 60_000:
        P(f"slow: e1 RSS grew {peak - r0} KiB for one non-reading client")
    if gap > 2.0:
        P(f"slow: a reading client on the same edge stalled {gap:.2f}s")
    for p in check_one(watch, wid, expect=("length",), label="slow watcher"):
        P(p)
    # the non-reader's requests are resumable (grace 15 s in this section)
    a.ws.transport.resume_reading()
    await asyncio.sleep(1)
    print(f"  the non-reader's socket: close code {a.close_code}, frames read {len(a.raw)}")
    b = await Conn.open(c.edge_urls["e2"], key)
    for r in rids[:4]:
        s = a.seqs(r)
        await b.send({"type": "resume", "id": r, "last_seq": s[-1] if s else -1})
    for r in rids[:4]:
        await b.wait_terminal(r, 60)
        s = a.seqs(r)
        start = s[-1] + 1 if s else 0
        for p in check_one(b, r, start_seq=start, expect=("length",), label="slow resumed"):
            P(p)
        if start + len(b.deltas(r)) != 4000:
            P(f"slow resumed {r}: {start}+{len(b.deltas(r))} != 4000")
    print(f"  4 of its requests resumed on e2: {[ends(b, r) for r in rids[:4]]}")
    for r in rids[4:]:
        s = a.seqs(r)
        await b.send({"type": "resume", "id": r, "last_seq": s[-1] if s else -1})
        await b.send({"type": "cancel", "id": r})
    for r in rids[4:]:
        await b.wait_terminal(r, 30)
    await b.close()
    await a.close()
    await watch.close()


async def burst(c, key, n_resumes=20, watch_s=75):
    """A client that stops reading, then resumes finished 4,000-token answers: each replay is one
    burst, written to the socket at once (a burst never counts against the 4,096-frame queue), so
    once the replays are sent nothing further comes to trigger the 4008 close. The edge must
    still let go of it and of what it buffered (the keepalive gives up at ~40 s). Once with the
    same answer resumed again and again (each resume after the previous replay ended), once with
    ``n_resumes`` different answers at once."""
    pid = c.procs["e1"].pid
    a = await Conn.open(c.edge_urls["e1"], key)
    rids = [uid("bu") for _ in range(n_resumes)]
    for r in rids:
        await a.chat(r, PROMPT, max_tokens=4000)
    for r in rids:
        await a.wait_terminal(r, 120)
    await a.close()
    for label, ids in (("one answer, resumed again and again", [rids[0]] * n_resumes),
                       (f"{n_resumes} different answers", rids)):
        print(f"== burst: a non-reading client resumes {label}")
        await asyncio.sleep(1)
        r0, conns0 = rss_kb(pid), gauge(c, "e1", key, "lanes_edge_connections")
        x = await Conn.open(c.edge_urls["e1"], key, ping_interval=None)
        x.ws.transport.pause_reading()
        for r in ids:
            await x.send({"type": "resume", "id": r, "last_seq": -1})
        t0 = time.monotonic()
        peak, gone, row = r0, None, []
        while time.monotonic() - t0 < watch_s:
            await asyncio.sleep(1)
            r = rss_kb(pid)
            peak = max(peak, r)
            n = gauge(c, "e1", key, "lanes_edge_connections")
            row.append((round(time.monotonic() - t0), r - r0, int(n)))
            if gone is None and n <= conns0:
                gone = time.monotonic() - t0
                break
        print(f"  (s, e1 RSS growth KiB, connections): {row[::5]} ... {row[-1:]}")
        print(f"  e1 RSS {r0} -> peak {peak} KiB (+{peak - r0}); the edge let go of the socket "
              f"{f'after {gone:.0f} s' if gone is not None else f'NOT within {watch_s} s'}; now {rss_kb(pid)} KiB")
        if gone is None:
            P(f"burst ({label}): the edge still holds a non-reading client (and its buffered replays, "
              f"+{rss_kb(pid) - r0} KiB) {watch_s} s after it stopped reading")
        await x.abort()
        await asyncio.sleep(1)


async def ping(c, key):
    print("== ping: a client holding nothing that neither reads nor answers pings")
    a = await Conn.open(c.edge_urls["e1"], key, ping_interval=None)
    before = gauge(c, "e1", key, "lanes_edge_connections")
    a.ws.transport.pause_reading()
    t0 = time.monotonic()
    gone = None
    while time.monotonic() - t0 < 60:
        await asyncio.sleep(1)
        if gauge(c, "e1", key, "lanes_edge_connections") < before:
            gone = time.monotonic() - t0
            break
    print(f"  the edge dropped it after {gone and round(gone)} s (ping interval 20 s, timeout 20 s)")
    if gone is None:
        P("ping: a dead client is still held after 60 s")
    await a.abort()


# -- edgekill ---------------------------------------------------------------------------------

async def reference(c, key, tok=TOK):
    a = await Conn.open(c.edge_urls["e2"], key)
    rid = uid("ref")
    await a.chat(rid, PROMPT, max_tokens=tok, temperature=0, seed=7)
    await a.wait_terminal(rid, 60)
    txt = "".join(f["text"] for f in a.deltas(rid))
    await a.close()
    return txt


async def edgekill(c, key):
    ref = await reference(c, key)
    for sig, want_code in ((signal.SIGKILL, 1006), (signal.SIGTERM, 1012)):
        print(f"== edgekill: {sig.name} e1 with 6 answers streaming on 3 sockets")
        conns, ids = [], []
        for _ in range(3):
            a = await Conn.open(c.edge_urls["e1"], key)
            conns.append(a)
            for _ in range(2):
                r = uid("ek")
                ids.append((a, r))
                await a.chat(r, PROMPT, max_tokens=TOK, temperature=0, seed=7)
        for a, r in ids:
            await a.wait_deltas(r, 20, 30)
        t0 = time.monotonic()
        await asyncio.to_thread(c.kill, "e1", sig)
        for a in conns:
            await asyncio.wait_for(a.closed.wait(), 15)
        codes = [a.close_code for a in conns]
        print(f"  close codes {codes} after {time.monotonic() - t0:.1f}s; terminal frames before the resume: "
              f"{sum(bool(a.terminals(r)) for a, r in ids)}")
        if any(code != want_code for code in codes):
            P(f"edgekill {sig.name}: close codes {codes}, expected {want_code}")
        # half resume on e2 at once, half on the restarted e1
        b = await Conn.open(c.edge_urls["e2"], key)
        for a, r in ids[:3]:
            await b.send({"type": "resume", "id": r, "last_seq": a.seqs(r)[-1]})
        c.restart("e1")
        c.wait_edge("e1")
        e = await Conn.open(c.edge_urls["e1"], key)
        for a, r in ids[3:]:
            await e.send({"type": "resume", "id": r, "last_seq": a.seqs(r)[-1]})
        for (a, r), x in zip(ids, [b] * 3 + [e] * 3):
            await x.wait_terminal(r, 60)
            last = a.seqs(r)[-1]
            for p in check_one(x, r, start_seq=last + 1, expect=("length",), label=f"edgekill {sig.name}"):
                P(p)
            txt = "".join(f["text"] for f in a.deltas(r) + x.deltas(r))
            if txt != ref:
                P(f"edgekill {sig.name} {r}: text differs from the reference (len {len(txt)} vs {len(ref)})")
        print(f"  resumed: {[ends(x, r) for (a, r), x in zip(ids, [b] * 3 + [e] * 3)]} in {time.monotonic() - t0:.1f}s")
        await b.close()
        await e.close()


async def orphan(c, key):
    """An edge that stops (SIGTERM or SIGKILL) with answers streaming, and nobody resumes them:
    each must stop running once the resume grace (10 s here) has passed, not run to its end for
    nobody (the worker's orphan check: nobody listens on that edge's channel)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        print(f"== orphan: {sig.name} e1 with 4 long answers streaming, nobody resumes")
        a = await Conn.open(c.edge_urls["e1"], key)
        rids = [uid("or") for _ in range(4)]
        for r in rids:
            await a.chat(r, PROMPT, max_tokens=4000)
        for r in rids:
            await a.wait_deltas(r, 5, 30)
        await asyncio.sleep(1)  # a heartbeat reports them
        before = running(c, key)
        await asyncio.to_thread(c.kill, "e1", sig)
        t0 = time.monotonic()
        freed = None
        while time.monotonic() - t0 < 40:
            if running(c, key) == 0:
                freed = time.monotonic() - t0
                break
            await asyncio.sleep(0.5)
        print(f"  slots running {before} before; all free {freed and round(freed, 1)} s after the {sig.name} (grace 10 s)")
        if freed is None:
            P(f"orphan {sig.name}: requests still running 40 s after their edge stopped")
        elif freed < 9:
            P(f"orphan {sig.name}: cancelled {freed:.1f} s after the stop, before the resume grace")
        b = await Conn.open(c.edge_urls["e2"], key)
        await b.send({"type": "resume", "id": rids[0], "last_seq": a.seqs(rids[0])[-1]})
        await b.wait_terminal(rids[0], 10)
        print(f"  a resume afterwards: {ends(b, rids[0])}")
        for p in check_one(b, rids[0], start_seq=a.seqs(rids[0])[-1] + 1, expect=("cancelled",), label="orphan"):
            P(p)
        await b.close()
        await a.close()
        c.restart("e1")
        c.wait_edge("e1")


async def workerkill(c, key):
    print("== workerkill: a request resumed e1 -> e2, its worker SIGKILLed mid-stream")
    ref = await reference(c, key, 400)
    ids = []
    for _ in range(4):
        a = await Conn.open(c.edge_urls["e1"], key)
        r = uid("wk")
        await a.chat(r, PROMPT, max_tokens=400, temperature=0, seed=7)
        ids.append([a, r, None])
    for a, r, _ in ids:
        await a.wait_deltas(r, 10, 30)
        await a.abort()
    b = await Conn.open(c.edge_urls["e2"], key)
    for a, r, _ in ids:
        await b.send({"type": "resume", "id": r, "last_seq": a.seqs(r)[-1]})
    for a, r, _ in ids:
        await b.wait_deltas(r, 20, 30)
    per = {w.get("worker"): sum((w.get("running") or {}).values()) for w in json.loads(http_json(c, "e2", "/v1/workers", key))}
    victim = max(("w0", "w1"), key=lambda n: per.get(c.child_id(n), 0))
    print(f"  running per worker {per}; SIGKILL {victim}")
    t0 = time.monotonic()
    await asyncio.to_thread(c.kill, victim, signal.SIGKILL)
    for a, r, _ in ids:
        await b.wait_terminal(r, 90)
    for a, r, _ in ids:
        last = a.seqs(r)[-1]
        for p in check_one(b, r, start_seq=last + 1, expect=("length",), label="workerkill"):
            P(p)
        txt = "".join(f["text"] for f in a.deltas(r) + b.deltas(r))
        if txt != ref:
            P(f"workerkill {r}: text differs from the reference (len {len(txt)} vs {len(ref)})")
    d = [b.deltas(r) for _, r, _ in ids]
    gaps = [round(max((y["_t"] - x["_t"] for x, y in zip(s, s[1:])), default=0), 2) for s in d]
    print(f"  ends {[ends(b, r) for _, r, _ in ids]} {time.monotonic() - t0:.1f}s after the kill; biggest gaps {gaps}")
    await b.close()


# -- mem ------------------------------------------------------------------------------------

KINDS = ("no_frame", "before_first", "after_accepted", "mid_stream", "done_no_close", "done_close")


async def mem_cycle(c, key, i, rng, stats):
    kind = rng.choice(KINDS)
    stats[kind] += 1
    a = await Conn.open(c.edge_urls["e1"], key)
    rid = f"mem{i}"
    try:
        if kind == "no_frame":
            return
        await a.chat(rid, max_tokens=rng.randint(20, 80))
        if kind == "before_first":
            return
        if kind == "after_accepted":
            await a.wait_any(rid, 20)
            return
        if kind == "mid_stream":
            await a.wait_deltas(rid, rng.randint(1, 15), 20)
            return
        await a.wait_terminal(rid, 30)
        problems.extend(check_one(a, rid, expect=("length",), label="mem " + kind))
        if kind == "done_close":
            await a.close()
    finally:
        await a.abort()


async def mem(c, key, n):
    print(f"== mem: {n} chats abandoned at random points")
    pid = c.procs["e1"].pid
    stats = Counter()
    rng = random.Random(45)
    sem = asyncio.Semaphore(24)

    async def batch(lo, hi):
        async def one(i):
            async with sem:
                try:
                    await asyncio.wait_for(mem_cycle(c, key, i, rng, stats), 60)
                except Exception as exc:  # noqa: BLE001
                    P(f"mem cycle {i}: {exc!r}")
        await asyncio.gather(*(one(i) for i in range(lo, hi)))

    def reading(label, t0=None):
        row = (rss_kb(pid), gauge(c, "e1", key, "lanes_edge_in_flight"), gauge(c, "e1", key, "lanes_edge_connections"),
               running(c, key))
        took = f" ({time.monotonic() - t0:.0f}s)" if t0 else ""
        print(f"  {label}{took}: e1 RSS {row[0]} KiB, in flight {row[1]:g}, connections {row[2]:g}, slots running {row[3]}", flush=True)
        return row

    await batch(0, 500)
    await asyncio.sleep(6)
    base = reading("after 500 warm-up cycles, settled")
    rows, done = [], 500
    step = max(1, (n - 500 + 3) // 4) if n > 500 else 0
    while done < n:
        t0 = time.monotonic()
        hi = min(n, done + step)
        await batch(done, hi)
        done = hi
        reading(f"after {done} cycles, at once", t0)
        await asyncio.sleep(6)  # the 3 s grace of the abandoned ones runs out
        rows.append(reading(f"after {done} cycles, settled"))
    print(f"  kinds {dict(stats)}")
    last = rows[-1]
    per = (last[0] - base[0]) * 1024 / max(1, done - 500)
    print(f"  e1 RSS {base[0]} -> {last[0]} KiB over {done - 500} cycles: {per:.0f} B/cycle")
    if last[1] or last[2] or last[3]:
        P(f"mem: left behind in flight {last[1]}, connections {last[2]}, slots {last[3]}")
    if len(rows) >= 2 and rows[-1][0] - rows[1][0] > 8_000:
        P(f"mem: e1 RSS kept growing {rows[1][0]} -> {rows[-1][0]} KiB")


async def census(n):
    """``mem``'s mix against two edges run in this process (Redis, scheduler and a sim worker as
    real processes), so every table of the edge can be counted after the grace has run out."""
    from lanes.queue.plane import QueuePlane
    from lanes.ws_server.auth import generate_key, hash_key
    from lanes.ws_server.edge import Edge
    from lanes.ws_server.settings import EdgeSettings
    print(f"== census: {n} abandoned chats against in-process edges; every edge table afterwards")
    key = generate_key()
    tmp = Path(tempfile.mkdtemp(prefix="lanes-a45-census-"))
    c = Cluster.embedded("a45census", tmp, port=REDIS_PORT, base_env={**FAST_FAILOVER_ENV})
    try:
        c.start_scheduler()
        c.start_worker("w0", "", "--engine", "sim", "--sim-time-scale", "20", "--max-slots", "16")
        c.wait_workers(1)
        edges = {}
        for i, name in enumerate(("e1", "e2")):
            st = EdgeSettings(redis_url=c.redis_url, key_prefix=c.prefix, port=EDGE_PORT + 2 + i,
                              api_key_hashes=hash_key(key), resume_grace_s=3.0, key_rate_per_s=0, key_max_in_flight=0)
            e = Edge(st, QueuePlane.from_settings(st))
            ready = asyncio.Event()
            asyncio.create_task(e.serve(ready))
            await ready.wait()
            edges[name] = e
            c.edge_ports[name], c.edge_urls[name] = e.port, f"ws://127.0.0.1:{e.port}/v1/chat"

        def tables(e):
            return {"entries": len(e.core.entries), "per_conn": len(e.core.per_conn), "per_key": len(e.core.per_key),
                    "sessions": len(e.sessions), "ws_identity": len(e._ws_identity), "pool_of": len(e._pool_of),
                    "tasks": len(e._tasks), "spans": len(e.spans), "key_conns": len(e.keys.connections.open),
                    "admission_counted": len(e.admission._counted),
                    "admission_since": sum(len(q) for q in e.admission._since.values())}

        stats = Counter()
        rng = random.Random(7)
        sem = asyncio.Semaphore(24)

        async def one(i):
            async with sem:
                try:
                    await asyncio.wait_for(mem_cycle(c, key, i, rng, stats), 60)
                except Exception as exc:  # noqa: BLE001
                    P(f"census cycle {i}: {exc!r}")
        await asyncio.gather(*(one(i) for i in range(n)))
        print(f"  right after: e1 {tables(edges['e1'])}")
        await asyncio.sleep(8)  # the 3 s grace, the cancels, the admission's stale window
        after = tables(edges["e1"])
        print(f"  settled:     e1 {after}")
        print(f"  kinds {dict(stats)}")
        left = {k: v for k, v in after.items() if v and k not in ("tasks",)}
        if left or after["tasks"] > 2:
            P(f"census: left behind on e1: {after}")
    finally:
        c.close()


SECTIONS = ("seqs", "ended", "many", "race", "dup", "dupresume", "mux", "foreign", "slow", "burst", "ping", "edgekill", "workerkill", "orphan")


def main(argv):
    which = argv or list(SECTIONS)
    if any(s in which for s in ("seqs", "ended", "many", "race", "dup", "dupresume", "mux", "foreign")):
        c = start("a")
        try:
            key, bob = create_key(c, "alice"), create_key(c, "bob")

            async def go():
                if "seqs" in which:
                    await seqs(c, key)
                if "ended" in which:
                    await ended(c, key, bob)
                if "many" in which:
                    await many(c, key, False)
                    await many(c, key, True)
                if "race" in which:
                    await race(c, key)
                if "dup" in which:
                    await dup(c, key)
                if "dupresume" in which:
                    await dupresume(c, key)
                if "mux" in which:
                    await mux(c, key)
                if "foreign" in which:
                    await foreign(c, key)
            asyncio.run(go())
            print("crashed:", c.crashed())
        finally:
            c.close()
    if "slow" in which or "ping" in which or "burst" in which:
        c = start("s", grace_s=15.0, workers=(("w0", "20"),))
        try:
            key = create_key(c, "alice")
            if "slow" in which:
                asyncio.run(slow(c, key))
            if "ping" in which:
                asyncio.run(ping(c, key))
            if "burst" in which:
                asyncio.run(burst(c, key))
        finally:
            c.close()
    if "edgekill" in which or "workerkill" in which or "orphan" in which:
        c = start("k", grace_s=10.0, workers=(("w0", "1"), ("w1", "1")), slots=8)
        try:
            key = create_key(c, "alice")
            if "edgekill" in which:
                asyncio.run(edgekill(c, key))
            if "workerkill" in which:
                asyncio.run(workerkill(c, key))
            if "orphan" in which:
                asyncio.run(orphan(c, key))
        finally:
            c.close()
    if "census" in which:
        n = int(argv[argv.index("census") + 1]) if argv.index("census") + 1 < len(argv) else 3000
        asyncio.run(census(n))
    if "mem" in which:
        n = int(argv[argv.index("mem") + 1]) if argv.index("mem") + 1 < len(argv) else 10_000
        c = start("m", workers=(("w0", "20"),))
        try:
            asyncio.run(mem(c, create_key(c, "alice"), n))
        finally:
            c.close()
    print("PROBLEMS", len(problems))
    for p in problems[:40]:
        print(" -", p)


if __name__ == "__main__":
    main(sys.argv[1:])
