"""The prefill-share gate (stops 25, 26) under a hostile client, real processes.

One API key floods prompt-heavy requests (long prompts, max_tokens 1) to push a worker's lanes
aside (FCFS) while four other keys chat: since stop 26 the key with the most work counts for a
quarter of it at most while the others send 10 % of the requests, so the lanes must hold. Then
the same kind of traffic from three keys (a prompt-heavy deployment: RAG, code completion) must
make them step aside, while clients chat, disconnect mid-stream and resume, cancel, and a
worker is killed and replaced. Then answer-heavy traffic must bring the lanes back. Checks: every request ends with exactly one terminal frame and
contiguous seqs, the worker's ``lanes_worker_prefill_share`` follows the traffic, and the
worker's memory stays flat over repeated floods (the window is 1,000 requests).

    .venv/bin/python scripts/attack/a8_prefill_gate.py
"""
import asyncio
import socket
import sys
import time
import urllib.request

from common import Conn, check_one, create_key, rss_kb, start_cluster, uid

problems = []
LONG_PROMPT = "def f(x):\n    return x * 2  # a line of code a completion request would carry\n" * 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def share(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("lanes_worker_prefill_share "))


async def flood(url, key, n, content, max_tokens, label, conc=48):
    """n requests over one connection, at most ``conc`` in flight; each must end exactly once."""
    a = await Conn.open(url, key, label)
    sem = asyncio.Semaphore(conc)

    async def one(i):
        async with sem:
            rid = uid(f"{label}{i}")
            await a.chat(rid, content=content, max_tokens=max_tokens)
            if await a.wait_terminal(rid, 120) is None:
                problems.append(f"{label} {rid}: no terminal frame within 120 s")
            problems.extend(check_one(a, rid, label=label))
    await asyncio.gather(*(one(i) for i in range(n)))
    await a.close()


async def chatter(c, key, label):
    """Chats beside the flood: one finishes, one is cut mid-stream and resumed on the other edge,
    one is cancelled."""
    a = await Conn.open(c.edge_urls["e1"], key, label)
    done, cut, cancel = uid("done"), uid("cut"), uid("cancel")
    await a.chat(done, max_tokens=40)
    await a.chat(cut, max_tokens=200)
    await a.chat(cancel, max_tokens=200)
    await a.wait_deltas(cut, 5, 60)
    last = a.seqs(cut)[-1] if a.seqs(cut) else -1
    await a.send({"type": "cancel", "id": cancel})
    await a.wait_terminal(done, 120)
    await a.wait_terminal(cancel, 120)
    problems.extend(check_one(a, done, expect=("length",), label=f"{label} done"))
    problems.extend(check_one(a, cancel, expect=("cancelled", "length"), label=f"{label} cancel"))
    await a.abort()
    b = await Conn.open(c.edge_urls["e2"], key, label + "-resume")
    await b.send({"type": "resume", "id": cut, "last_seq": last})
    if await b.wait_terminal(cut, 120) is None:
        problems.append(f"{label} {cut}: resumed request never ended")
    problems.extend(check_one(b, cut, start_seq=last + 1, expect=("length",), label=f"{label} resume"))
    await b.close()


async def chats(url, keys, n, label):
    """Answer-heavy traffic, ``n`` requests spread over ``keys``."""
    await asyncio.gather(*(flood(url, k, n // len(keys), "hi", 120, f"{label}{i}-") for i, k in enumerate(keys)))


async def main(c, keys, port):
    url = c.edge_urls["e1"]
    chat, hostile, rag = keys["chat"], keys["flood"], keys["rag"]
    print(f"start: prefill share {share(port):.3f}", flush=True)
    await chats(url, chat, 160, "chat")  # answer-heavy: the lanes stay on
    s = share(port)
    print(f"after 160 chats from 4 keys (short prompt, 120 tokens): share {s:.3f}", flush=True)
    if s >= 0.6:
        problems.append(f"answer-heavy traffic pushed the share to {s:.3f}")
    pid = c.procs["w0"].pid
    rss = []
    for rnd in range(3):
        # Round 0: one key alone (hostile); rounds 1-2: three keys (a prompt-heavy deployment).
        senders = [hostile] if rnd == 0 else rag
        await asyncio.gather(*(flood(url, k, 400 // len(senders), LONG_PROMPT, 1, f"heavy{rnd}.{i}-")
                               for i, k in enumerate(senders)), chatter(c, chat[rnd], f"side{rnd}"))
        s = share(port)
        rss.append(rss_kb(pid))
        print(f"flood {rnd}: 400 prompt-heavy requests from {len(senders)} key(s) + side chats: share {s:.3f}, "
              f"worker RSS {rss[-1]} KiB", flush=True)
        if rnd == 0 and s >= 0.6:
            problems.append(f"one key's flood switched the lanes off for everyone: share {s:.3f}")
        if rnd > 0 and s < 0.6:
            problems.append(f"flood {rnd}: prompt-heavy traffic from three keys left the share at {s:.3f}")
    if rss[-1] - rss[0] > 20_000:
        problems.append(f"worker RSS grew {rss[0]} -> {rss[-1]} KiB over floods 1-3")
    # A second worker killed mid-flood: its requests are requeued and still end exactly once.
    c.start_worker("w1", "", "--engine", "sim", "--sim-time-scale", "20", "--max-slots", "8")
    c.wait_workers(2)
    task = asyncio.create_task(flood(url, rag[0], 200, LONG_PROMPT, 30, "kill-"))
    await asyncio.sleep(1.5)
    c.kill("w1")
    await task
    await chats(url, chat, 1000, "back")  # answer-heavy again: the window turns over
    s = share(port)
    print(f"after 1,000 chats: share {s:.3f}", flush=True)
    if s >= 0.6:
        problems.append(f"the lanes did not come back: share {s:.3f}")


if __name__ == "__main__":
    port = free_port()
    c, tmp = start_cluster("gate", workers=())
    try:
        keys = {"chat": [create_key(c, f"chat{i}") for i in range(4)], "flood": create_key(c, "flood"),
                "rag": [create_key(c, f"rag{i}") for i in range(3)]}
        c.start_worker("w0", "", "--engine", "sim", "--sim-time-scale", "20", "--max-slots", "8",
                       "--metrics-port", str(port))
        c.wait_workers(1)
        t = time.monotonic()
        asyncio.run(main(c, keys, port))
        crashed = [n for n, p in c.procs.items() if p.poll() not in (None, 0) and n != "w1"]
        if crashed:
            problems.append(f"crashed: {crashed}")
        print(f"{time.monotonic() - t:.0f} s")
    finally:
        c.stop()
    print("PROBLEMS", len(problems))
    for p in problems[:20]:
        print("  ", p)
    sys.exit(1 if problems else 0)
