"""Promise 3, "nothing lost": an edge killed with SIGKILL while it streams answers.

Real processes (scheduler, two edges, one hf worker on the tiny model). The client loses its
socket, reconnects to the other edge and sends ``resume`` with the last seq it got; it then
receives the rest of each answer (replayed from the token stream, then live after the worker
re-points at its next heartbeat) with no duplicate and no gap, and a ``done`` frame with
usage and timing (measured from the resume).
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import pytest

from conftest import scaled
from e2e_support import Client, System

pytestmark = pytest.mark.e2e

#: Different lengths, so some answers end while no edge listens, some right after the
#: resume (the re-pointing window) and some long after it.
MAX_TOKENS = [24, 48, 96, 160, 240, 400, 600, 800]


@pytest.fixture(scope="module")
def system(make_cluster, tiny_model) -> tuple[System, str, str]:
    sys_ = make_cluster(edges=2)
    # A slow heartbeat widens the window in which the worker still sends to the dead
    # edge after the resume re-pointed the request: answers ending inside it must still end.
    sys_.start_worker("worker", str(tiny_model.target), "--max-slots", str(len(MAX_TOKENS)),
                      LANES_HEARTBEAT_S="5.0", LANES_LEASE_MS="15000")
    sys_.wait_workers(1, timeout_s=scaled(120))
    return sys_, sys_.edge_urls["edge_a"], sys_.edge_urls["edge_b"]


async def kill_and_resume(sys_: System, edge: str, url_to: str, sig: int, greedy_reference) -> None:
    """Stream answers through ``edge``, stop it with ``sig``, resume them all at ``url_to``."""
    ids = [f"r{n}-{uuid.uuid4().hex[:4]}" for n in MAX_TOKENS]
    prompts = {rid: f"Resume me: what does section {i} say?" for i, rid in enumerate(ids)}
    max_tokens = dict(zip(ids, MAX_TOKENS))
    expected = {rid: greedy_reference(prompts[rid], max_tokens[rid]).text for rid in ids}

    first = await Client.connect(f"ws://127.0.0.1:{sys_.edge_ports[edge]}/v1/chat")
    for rid in ids:
        await first.chat(rid, prompts[rid], max_tokens=max_tokens[rid])
    deadline = time.monotonic() + scaled(60)
    while not all(first.deltas(rid) for rid in ids):
        assert time.monotonic() < deadline, "requests did not start streaming"
        await asyncio.sleep(0.01)
    sys_.kill(edge, sig)
    await asyncio.wait_for(first._reader, scaled(10))  # the socket is gone
    await asyncio.sleep(0.3)  # some answers go on (and some end) while no edge listens

    second = await Client.connect(url_to)
    resumed_at = time.monotonic()
    for rid in ids:
        await second.send({"type": "resume", "id": rid, "last_seq": len(first.deltas(rid)) - 1})
    for rid in ids:
        done = await second.wait(rid, timeout_s=scaled(60))
        assert done["type"] == "done" and done["finish_reason"] in ("stop", "length"), done
        seqs = [f["seq"] for f in first.deltas(rid) + second.deltas(rid)]
        assert seqs == list(range(len(seqs))), f"{rid}: no duplicate, no gap across the reconnect"
        assert first.text(rid) + second.text(rid) == expected[rid], f"{rid}: text differs from greedy"
        assert done["usage"]["completion_tokens"] >= len(seqs) - 1
        assert set(done["timing"]) == {"queue_ms", "ttft_ms", "total_ms"}
        assert 0 <= done["timing"]["total_ms"] <= (time.monotonic() - resumed_at) * 1000 + 50, "from the resume"
    ended = ", ".join(f"{second.arrivals[rid][-1] - resumed_at:.2f}" for rid in ids)
    print(f"\nsignal {sig}: done frames after the resume at (s): {ended}")
    await second.close()


async def test_edge_killed_client_resumes_on_another_edge(system: tuple[System, str, str], greedy_reference) -> None:
    sys_, _, url_b = system
    await kill_and_resume(sys_, "edge_a", url_b, signal.SIGKILL, greedy_reference)


async def test_edge_stopped_gracefully_does_not_cancel_its_requests(system: tuple[System, str, str],
                                                                     greedy_reference) -> None:
    """A rolling restart (SIGTERM) closes the sockets, but the clients will resume elsewhere."""
    sys_, _, url_b = system
    sys_.start_edge("edge_c")
    await kill_and_resume(sys_, "edge_c", url_b, signal.SIGTERM, greedy_reference)


async def test_sigterm_ends_openai_streams_clearly_and_keeps_websocket_requests(
        system: tuple[System, str, str], greedy_reference) -> None:
    """SIGTERM with OpenAI requests and a WebSocket chat in flight: the stream ends at once
    with an ``unavailable`` error event and ``[DONE]`` (HTTP has no resume; before, it was cut
    mid-answer when the graceful shutdown ran out, with an ASGI traceback in the log), a
    whole-answer request gets a 503 with ``Retry-After``, and the
    WebSocket's request keeps running to be resumed elsewhere even with a resume grace shorter
    than the shutdown (before, the shutdown counted as the client leaving and cancelled it).
    The worker is paused around the SIGTERM, so both answers are surely mid-stream then."""
    import http.client
    import json
    import threading

    sys_, _, url_b = system
    prompts = [f"Resume me: what does section {i} say?" for i in range(len(MAX_TOKENS))]
    long_ones = [p for p in prompts if len(greedy_reference(p, 200).ids) == 200]
    assert len(long_ones) >= 2, "prompts whose greedy answers run past 200 tokens"
    sys_.start_edge("edge_d", LANES_RESUME_GRACE_S="0.3")
    port = sys_.edge_ports["edge_d"]
    ws = await Client.connect(f"ws://127.0.0.1:{port}/v1/chat")
    rid = f"term-{uuid.uuid4().hex[:4]}"
    await ws.chat(rid, long_ones[0], max_tokens=400)
    lines: list[str] = []

    def stream() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=scaled(60))
        conn.request("POST", "/v1/chat/completions", json.dumps({
            "model": "default", "stream": True, "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user", "content": long_ones[1]}]}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        lines.extend(line.decode().strip() for line in response if line.strip())

    whole: list[tuple[int, str | None, dict]] = []

    def complete() -> None:  # not streaming: the whole answer, or one error with its status
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=scaled(60))
        conn.request("POST", "/v1/chat/completions", json.dumps({
            "model": "default", "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user", "content": long_ones[0]}]}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        whole.append((response.status, response.getheader("Retry-After"), json.loads(response.read())))

    dashboard: list[bytes] = []

    def stats_stream() -> None:  # the dashboard's stream must end too (it held the shutdown 2 s, then an ERROR)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=scaled(60))
        conn.request("GET", "/v1/stats/stream")
        response = conn.getresponse()
        dashboard.extend(response)

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    completer = threading.Thread(target=complete, daemon=True)
    completer.start()
    watcher = threading.Thread(target=stats_stream, daemon=True)
    watcher.start()
    deadline = time.monotonic() + scaled(60)
    while len(ws.deltas(rid)) < 3 or sum('"content":"' in line for line in lines) < 3:
        assert time.monotonic() < deadline, "the answers did not start streaming"
        await asyncio.sleep(0.01)
    worker = sys_.procs["worker"]
    worker.send_signal(signal.SIGSTOP)
    try:
        assert "data: [DONE]" not in lines
        stopped_at = time.monotonic()
        sys_.kill("edge_d", signal.SIGTERM)
        await asyncio.to_thread(reader.join, scaled(30))
        ended_s = time.monotonic() - stopped_at
        await asyncio.to_thread(completer.join, scaled(30))
        await asyncio.to_thread(watcher.join, scaled(5))
        await asyncio.wait_for(ws._reader, scaled(10))
        await asyncio.sleep(1.0)  # past the 0.3 s grace
    finally:
        worker.send_signal(signal.SIGCONT)
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "unavailable" and "shutting down" in error["message"], error
    assert ended_s < scaled(1.5), ended_s
    assert not watcher.is_alive() and dashboard and dashboard[0].startswith(b"retry:"), "the stats stream ended"
    assert sys_.log_dir is not None
    edge_log = (sys_.log_dir / "edge_d.log").read_text()
    assert "ERROR" not in edge_log and "Traceback" not in edge_log, edge_log[-2000:]
    # The whole-answer request gets a 503 that says when to retry (before: no Retry-After).
    assert whole and whole[0][0] == 503 and whole[0][2]["error"]["code"] == "unavailable", whole
    assert whole[0][1] is not None and int(whole[0][1]) >= 1, whole
    second = await Client.connect(url_b)
    await second.send({"type": "resume", "id": rid, "last_seq": len(ws.deltas(rid)) - 1})
    done = await second.wait(rid, timeout_s=scaled(60))
    assert done["type"] == "done" and done["finish_reason"] in ("stop", "length"), done
    seqs = [f["seq"] for f in ws.deltas(rid) + second.deltas(rid)]
    assert seqs == list(range(len(seqs)))
    await second.close()
