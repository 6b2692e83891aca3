import asyncio
import json
import time
import urllib.request
import urllib.error
from common import *

problems = []
def P(msg):
    problems.append(msg); print("DEFECT?", msg, flush=True)

async def expect_err(conn, payload, code, rid=None, timeout=5, label=""):
    before = len(conn.raw)
    await conn.send(payload)
    end = time.monotonic() + timeout
    while len(conn.raw) == before and time.monotonic() < end and not conn.closed.is_set():
        await asyncio.sleep(0.01)
    new = conn.raw[before:]
    if not new:
        P(f"{label}: no answer within {timeout}s (closed={conn.closed.is_set()} code={conn.close_code})")
        return None
    f = new[0]
    ok = f.get("type") == "error" and (code is None or f.get("code") == code) and (rid is None or f.get("id") == rid)
    print(f"{'ok ' if ok else 'BAD'} {label}: {strip(f)}", flush=True)
    if not ok:
        P(f"{label}: expected error/{code} id={rid}, got {strip(f)}")
    return f

async def main(c, key):
    url = c.edge_urls["e1"]
    a = await Conn.open(url, key)
    msgs = [{"role": "user", "content": "hi"}]
    await expect_err(a, "{not json", "invalid_json", label="invalid json")
    await expect_err(a, '{"type":"chat","max_tokens":NaN,"messages":[]}', "invalid_json", label="NaN")
    await expect_err(a, '{"type":"chat","id":"\\ud800","messages":[]}', "invalid_json", label="lone surrogate")
    await expect_err(a, "[" * 40 + "]" * 40, "invalid_json", label="deep nesting")
    await expect_err(a, '{"a":' * 33 + '1' + '}' * 33, "invalid_json", label="deep object nesting 33")
    await expect_err(a, {"type": "chat", "id": "big", "max_tokens": 99999999999999999999999, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens_too_large", rid="big", label="num >64bit")
    await expect_err(a, "[1,2]", "invalid_frame", label="json array")
    await expect_err(a, "42", "invalid_frame", label="json number")
    await expect_err(a, "null", "invalid_frame", label="json null")
    await expect_err(a, '"chat"', "invalid_frame", label="json string")
    await expect_err(a, {"id": "t0"}, "unknown_type", label="missing type")
    await expect_err(a, {"type": "bogus", "id": "t1"}, "unknown_type", rid="t1", label="unknown type")
    await expect_err(a, {"type": 5, "id": "t1b"}, "unknown_type", label="type int")
    await expect_err(a, {"type": "chat", "id": "t2"}, "missing_field", rid="t2", label="missing messages")
    await expect_err(a, {"type": "chat", "id": "t3", "messages": "hello"}, "invalid_field", rid="t3", label="messages str")
    await expect_err(a, {"type": "chat", "id": "t3b", "messages": []}, "invalid_field", rid="t3b", label="messages empty")
    await expect_err(a, {"type": "chat", "id": "t4", "messages": [{"role": "robot", "content": "x"}]}, "invalid_field", rid="t4", label="bad role")
    await expect_err(a, {"type": "chat", "id": "t5", "messages": [{"role": "user", "content": 5}]}, "invalid_field", rid="t5", label="content int")
    await expect_err(a, {"type": "chat", "id": "t5b", "messages": [{"role": "user"}]}, None, rid="t5b", label="content missing")
    await expect_err(a, {"type": "chat", "id": "t6", "messages": msgs, "max_tokens": "10"}, "invalid_field", rid="t6", label="max_tokens str")
    await expect_err(a, {"type": "chat", "id": "t6b", "messages": msgs, "max_tokens": 1.5}, "invalid_field", rid="t6b", label="max_tokens float")
    await expect_err(a, {"type": "chat", "id": "t6c", "messages": msgs, "max_tokens": True}, "invalid_field", rid="t6c", label="max_tokens bool")
    await expect_err(a, {"type": "chat", "id": "t7", "messages": msgs, "max_tokens": 0}, None, rid="t7", label="max_tokens 0")
    await expect_err(a, {"type": "chat", "id": "t7b", "messages": msgs, "max_tokens": -1}, None, rid="t7b", label="max_tokens -1")
    await expect_err(a, {"type": "chat", "id": "t8", "messages": msgs, "max_tokens": 5000}, "max_tokens_too_large", rid="t8", label="max_tokens 5000")
    await expect_err(a, {"type": "chat", "id": "t9", "messages": msgs, "temperature": 3}, "invalid_field", rid="t9", label="temp 3")
    await expect_err(a, {"type": "chat", "id": "t9b", "messages": msgs, "temperature": "hot"}, "invalid_field", rid="t9b", label="temp str")
    await expect_err(a, {"type": "chat", "id": "t10", "messages": msgs, "top_p": -0.1}, "invalid_field", rid="t10", label="top_p -0.1")  # 0 is valid (OpenAI range 0..1)
    await expect_err(a, {"type": "chat", "id": "t11", "messages": msgs, "stop": ["a"] * 5}, "invalid_field", rid="t11", label="stop 5")
    await expect_err(a, {"type": "chat", "id": "t11b", "messages": msgs, "stop": ""}, "invalid_field", rid="t11b", label="stop empty")
    await expect_err(a, {"type": "chat", "id": "t11c", "messages": msgs, "stop": 5}, "invalid_field", rid="t11c", label="stop int")
    await expect_err(a, {"type": "chat", "id": "t12", "messages": msgs, "model": "nope"}, "model_not_found", rid="t12", label="model nope")
    await expect_err(a, {"type": "chat", "id": "t12b", "messages": msgs, "model": 7}, "invalid_field", rid="t12b", label="model int")
    await expect_err(a, {"type": "chat", "id": "t13", "messages": msgs, "seed": "x"}, "invalid_field", rid="t13", label="seed str")
    await expect_err(a, {"type": "chat", "id": "t13b", "messages": msgs, "seed": 2**70}, None, label="seed 2^70")
    await expect_err(a, {"type": "chat", "id": "t14", "messages": msgs, "deadline_ms": -5}, None, rid="t14", label="deadline -5")
    await expect_err(a, {"type": "chat", "id": "bad id!", "messages": msgs}, "invalid_field", label="id with space")
    await expect_err(a, {"type": "chat", "id": "x" * 129, "messages": msgs}, "invalid_field", label="id 129 chars")
    await expect_err(a, {"type": "chat", "id": "", "messages": msgs}, "invalid_field", label="id empty")
    await expect_err(a, {"type": "chat", "id": 123, "messages": msgs}, "invalid_field", label="id int")
    await expect_err(a, {"type": "chat", "id": ["a"], "messages": msgs}, "invalid_field", label="id list")
    await expect_err(a, {"type": "chat", "id": "t15", "messages": [{"role": "user", "content": "x"}] * 65}, "too_many_messages", rid="t15", label="65 messages")
    await expect_err(a, {"type": "chat", "id": "t16", "messages": [{"role": "user", "content": "x" * (64 * 1024 + 1)}]}, "prompt_too_long", rid="t16", label="prompt 64K+1")
    await expect_err(a, {"type": "cancel", "id": "never-existed"}, "unknown_id", rid="never-existed", label="cancel unknown")
    await expect_err(a, {"type": "cancel"}, "missing_field", label="cancel no id")
    await expect_err(a, {"type": "resume", "id": "never-existed2", "last_seq": -1}, "unknown_id", rid="never-existed2", label="resume unknown")
    await expect_err(a, {"type": "resume", "id": "never-existed3"}, None, label="resume no last_seq")
    await expect_err(a, {"type": "resume", "id": "never-existed4", "last_seq": "x"}, "invalid_field", label="resume last_seq str")
    await expect_err(a, {"type": "resume", "id": "never-existed5", "last_seq": -2}, None, label="resume last_seq -2")
    await expect_err(a, b"\x00\x01binary", "binary_frame", label="binary frame")
    await expect_err(a, "x" * (300 * 1024), "frame_too_large", label="300KiB text frame")
    await expect_err(a, json.dumps({"type": "chat", "id": "big", "messages": [{"role": "user", "content": "y" * (300 * 1024)}]}), "frame_too_large", label="300KiB chat")
    # huge >1MiB => close 1009
    if a.closed.is_set():
        P(f"connection closed during small-abuse phase: code {a.close_code}")
        a = await Conn.open(url, key)
    # still alive? run a real chat
    await a.chat("alive1", max_tokens=10)
    t = await a.wait_terminal("alive1", 10)
    print("after abuse chat:", t and strip(t))
    if not t or t["type"] != "done": P(f"chat after abuse did not finish: {t}")
    problems.extend(check_one(a, "alive1", label="alive1"))

    # missing id: edge assigns one
    await a.send({"type": "chat", "messages": msgs, "max_tokens": 5})
    await asyncio.sleep(1.0)
    assigned = [f for f in a.raw if f.get("type") == "accepted" and f["id"] not in ("alive1",)]
    print("no-id chat: accepted frames with assigned id:", [f["id"] for f in assigned])
    if not assigned: P("chat without id: no accepted frame with assigned id")
    else:
        problems.extend(check_one(a, assigned[0]["id"], expect=("length", "stop"), label="no-id"))

    # duplicate id on same connection while running
    await a.chat("dup1", max_tokens=200)
    await a.chat("dup1", max_tokens=200)
    await asyncio.sleep(0.5)
    t = await a.wait_terminal("dup1", 20)
    await asyncio.sleep(1.0)
    fr = [strip(f) for f in a.by_id["dup1"] if f["type"] != "delta"]
    print("dup on same conn (running):", fr, "deltas", len(a.deltas("dup1")))
    accepted = [f for f in fr if f["type"] == "accepted"]
    dups = [f for f in fr if f.get("code") == "duplicate_id"]
    dones = [f for f in fr if f["type"] == "done"]
    if len(accepted) != 1 or len(dups) != 1 or len(dones) != 1:
        P(f"dup id same conn: frames {fr}")
    s = a.seqs("dup1")
    if s != list(range(len(s))): P(f"dup1 seqs broken {s[:20]}")
    # duplicate after done, same conn
    await a.chat("dup1", max_tokens=5)
    await asyncio.sleep(0.5)
    fr2 = [strip(f) for f in a.by_id["dup1"] if f["type"] != "delta"][len(fr):]
    print("dup after done same conn:", fr2)
    if len(fr2) != 1 or fr2[0].get("code") != "duplicate_id": P(f"dup after done: {fr2}")

    # cancel then cancel again, cancel after done
    await a.chat("cc1", max_tokens=2000)
    await a.wait_deltas("cc1", 3)
    await a.send({"type": "cancel", "id": "cc1"})
    await a.send({"type": "cancel", "id": "cc1"})
    t = await a.wait_terminal("cc1", 10)
    await asyncio.sleep(0.5)
    fr = [strip(f) for f in a.by_id["cc1"] if f["type"] != "delta"]
    print("double cancel:", fr)
    terms = a.terminals("cc1")
    if len(terms) != 1 or terms[0].get("finish_reason") != "cancelled": P(f"double cancel terminal frames: {fr}")
    await a.send({"type": "cancel", "id": "alive1"})
    await asyncio.sleep(0.3)
    fr = [strip(f) for f in a.by_id["alive1"]][-2:]
    print("cancel after done:", fr)

    # flood 2000 chats on one connection
    b = await Conn.open(url, key)
    t0 = time.monotonic()
    ids = [f"fl{i}" for i in range(2000)]
    for rid in ids:
        await b.chat(rid, "hi", max_tokens=8)
    send_s = time.monotonic() - t0
    end = time.monotonic() + 90
    while time.monotonic() < end and sum(1 for r in ids if b.terminals(r)) < len(ids) and not b.closed.is_set():
        await asyncio.sleep(0.2)
    el = time.monotonic() - t0
    from collections import Counter
    outcome = Counter()
    for r in ids:
        ts = b.terminals(r)
        outcome[(ts[0].get("code") or ts[0].get("finish_reason")) if ts else "NONE"] += 1
        problems.extend(check_one(b, r, label="flood"))
    print(f"flood 2000: sent in {send_s:.1f}s, all-terminal after {el:.1f}s; outcomes {dict(outcome)}; conn closed={b.closed.is_set()} code={b.close_code}")
    if outcome.get("NONE"): P(f"flood: {outcome['NONE']} requests without terminal frame")
    await b.close()

    # huge frame > 4x limit -> close 1009
    h = await Conn.open(url, key)
    try:
        await h.send("z" * (1100 * 1024))
    except Exception as e:
        print("send huge raised", e)
    await asyncio.wait_for(h.closed.wait(), 10)
    print("1.1MiB frame: closed code", h.close_code, "frames", [strip(f) for f in h.raw])
    if h.close_code != 1009: P(f"1.1MiB frame close code {h.close_code}")
    # invalid utf-8 raw text frame -> 1007
    i8 = await Conn.open(url, key)
    try:
        await i8.ws.send(b"\xff\xfe{}", text=True)
    except Exception as e:
        print("utf8 send raised", e)
    try:
        await asyncio.wait_for(i8.closed.wait(), 5)
    except asyncio.TimeoutError:
        pass
    print("invalid utf-8 text frame: closed", i8.closed.is_set(), "code", i8.close_code)
    if i8.close_code != 1007: P(f"invalid utf8 close code {i8.close_code}")
    await a.close()

def http(c, path, body, key, ctype="application/json", method="POST", timeout=20):
    port = c.edge_ports["e1"]
    hdr = {"Content-Type": ctype}
    if key is not None: hdr["Authorization"] = key
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers=hdr, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()[:300]
    except urllib.error.HTTPError as e:
        return e.code, e.read()[:300]
    except Exception as e:
        return "EXC", repr(e)

def http_tests(c, key):
    B = f"Bearer {key}"
    good = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    cases = [
        ("good", json.dumps(good).encode(), B, 200),
        ("good stream", json.dumps({**good, "stream": True}).encode(), B, 200),
        ("bad json", b"{nope", B, 400),
        ("json array", b"[1]", B, 400),
        ("empty body", b"", B, 400),
        ("n=2", json.dumps({**good, "n": 2}).encode(), B, 400),
        ("n='2'", json.dumps({**good, "n": "2"}).encode(), B, 400),
        ("n=null", json.dumps({**good, "n": None}).encode(), B, None),
        ("messages missing", json.dumps({"model": "default"}).encode(), B, 400),
        ("max_tokens str", json.dumps({**good, "max_tokens": "8"}).encode(), B, 400),
        ("stream str", json.dumps({**good, "stream": "yes"}).encode(), B, 400),
        ("tools", json.dumps({**good, "tools": [{"type": "function"}]}).encode(), B, 400),
        ("content list", json.dumps({**good, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}).encode(), B, None),
        ("unknown model", json.dumps({**good, "model": "nope"}).encode(), B, 404),
        ("no auth", json.dumps(good).encode(), None, 401),
        ("bad auth", json.dumps(good).encode(), "Bearer lanes_nope", 401),
        ("basic auth", json.dumps(good).encode(), "Basic YWJjOmRlZg==", 401),
        ("bearer empty", json.dumps(good).encode(), "Bearer ", 401),
        ("oversized 300K", json.dumps({**good, "messages": [{"role": "user", "content": "x" * 300000}]}).encode(), B, 413),
        ("oversized 5MB", b'{"x":"' + b"a" * 5_000_000 + b'"}', B, 413),
        ("NaN", b'{"model":"default","messages":[{"role":"user","content":"hi"}],"temperature":NaN}', B, 400),
        ("text/plain", json.dumps(good).encode(), B, 415),  # a cross-site "simple" POST
    ]
    for label, body, auth, want in cases:
        t0 = time.monotonic()
        st, out = http(c, "/v1/chat/completions", body, auth, ctype="text/plain" if label == "text/plain" else "application/json")
        dt = time.monotonic() - t0
        ok = (want is None and st != "EXC" and st < 500) or st == want
        print(f"{'ok ' if ok else 'BAD'} HTTP {label}: {st} in {dt:.2f}s {out[:160]!r}", flush=True)
        if not ok: P(f"HTTP {label}: expected {want}, got {st} {out[:200]!r}")
    # chunked body without content-length that is oversized
    import socket
    s = socket.create_connection(("127.0.0.1", c.edge_ports["e1"]), timeout=20)
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: {B}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    chunk = b"a" * 65536
    try:
        for _ in range(80):  # 5 MiB
            s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        s.sendall(b"0\r\n\r\n")
    except OSError as e:
        print("chunked send stopped:", e)
    try:
        resp = s.recv(300)
    except OSError as e:
        resp = repr(e).encode()
    print("chunked 5MiB:", resp[:120])
    if b" 413 " not in resp[:20]: P(f"chunked oversized: {resp[:120]!r}")
    s.close()
    # lying content-length (smaller than body) & slow body: ensure it doesn't hang other clients
    st, out = http(c, "/v1/chat/completions", json.dumps(good).encode(), B)
    print("good after abuse:", st)

if __name__ == "__main__":
    c, tmp = start_cluster("a1", workers=(("w0", "20"),), slots=8)
    try:
        key = create_key(c, "alice")
        asyncio.run(main(c, key))
        http_tests(c, key)
        print("crashed:", c.crashed())
    finally:
        c.close()
    print("\nPROBLEMS:", len(problems))
    for p in problems: print(" -", p)
