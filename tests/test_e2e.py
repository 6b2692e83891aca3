"""End to end: real redis-server, real edge/worker/scheduler processes, real WebSockets,
real (tiny) transformers model."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from e2e_support import Client, System

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def system(make_cluster) -> tuple[System, str]:
    sys_ = make_cluster(workers=1, worker_args=("--max-slots", "4"))
    return sys_, sys_.edge_urls["edge"]


async def test_two_concurrent_chats_on_one_connection(system: tuple[System, str], greedy_reference) -> None:
    _, url = system
    client = await Client.connect(url)
    await client.chat("one", "What does a class definition do?", max_tokens=24)
    await client.chat("two", "Explain the with statement.", max_tokens=12)
    done_one, done_two = await client.wait("one"), await client.wait("two")
    for rid, done, content, max_tokens in [("one", done_one, "What does a class definition do?", 24),
                                           ("two", done_two, "Explain the with statement.", 12)]:
        frames = client.frames[rid]
        assert frames[0]["type"] == "accepted" and frames[0]["lane"] in ("short", "medium", "long")
        assert done["type"] == "done", done
        seqs = [f["seq"] for f in client.deltas(rid)]
        assert seqs == list(range(len(seqs))) and seqs, "contiguous seq from 0"
        ref = greedy_reference(content, max_tokens)
        prompt_tokens, ids, text = ref.prompt_tokens, ref.ids, ref.text
        assert done["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids)}
        assert client.text(rid) == text, "exactly the model's greedy answer: nothing lost or repeated"
        assert done["finish_reason"] == ("stop" if len(ids) < max_tokens else "length")
        assert set(done["timing"]) == {"queue_ms", "ttft_ms", "total_ms"}
        assert 0 <= done["timing"]["ttft_ms"] <= done["timing"]["total_ms"]
    await client.close()


async def test_malformed_frames_get_errors_and_the_connection_stays_usable(system: tuple[System, str]) -> None:
    _, url = system
    client = await Client.connect(url)
    await client.send("{definitely not json")
    await client.send(json.dumps({"type": "chat", "id": "bad", "messages": "hi"}))
    await client.send(json.dumps({"type": "teleport"}))
    await client.send(json.dumps({"type": "cancel", "id": "never-sent"}))
    await client.ws.send(b"\x00\x01binary")
    await client.chat("ok", "Still there?", max_tokens=4)
    assert (await client.wait("ok"))["type"] == "done"
    codes = [f["code"] for f in client.frames[None] if f["type"] == "error"]
    assert codes == ["invalid_json", "unknown_type", "binary_frame"]
    assert client.frames["bad"][0]["code"] == "invalid_field" and "messages" in client.frames["bad"][0]["message"]
    assert client.frames["never-sent"][0]["code"] == "unknown_id"
    await client.close()


async def test_duplicate_id_is_refused(system: tuple[System, str]) -> None:
    _, url = system
    client = await Client.connect(url)
    rid = f"dup-{uuid.uuid4().hex[:6]}"
    await client.chat(rid, "first", max_tokens=64)
    await client.chat(rid, "second", max_tokens=64)
    done = await client.wait_done(rid)
    types = [f["type"] for f in client.frames[rid]]
    assert "error" in types and [f for f in client.frames[rid] if f["type"] == "error"][0]["code"] == "duplicate_id"
    assert done["type"] == "done" and types.count("accepted") == 1
    await client.close()


async def test_cancel_running_request(system: tuple[System, str]) -> None:
    _, url = system
    client = await Client.connect(url)
    await client.chat("long", "Tell me everything.", max_tokens=2000)
    while len(client.deltas("long")) < 3:
        await asyncio.sleep(0.01)
    await client.send({"type": "cancel", "id": "long"})
    done = await client.wait("long", timeout_s=10)
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    assert done["usage"]["completion_tokens"] < 2000
    seqs = [f["seq"] for f in client.deltas("long")]
    assert seqs == list(range(len(seqs)))
    await client.close()


async def test_http_endpoints(system: tuple[System, str]) -> None:
    sys_, _ = system
    base = f"http://127.0.0.1:{sys_.edge_ports['edge']}"

    def get(path: str) -> tuple[int, str]:
        with urllib.request.urlopen(base + path, timeout=5) as resp:
            return resp.status, resp.read().decode()

    # The worker count comes from the scheduler's depth snapshot (every 0.5 s): the first one the
    # edge sees may predate the worker's registration, so wait for the next.
    deadline = time.monotonic() + 5.0
    while True:
        status, body = await asyncio.to_thread(get, "/healthz")
        if json.loads(body).get("workers") == 1 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    health = json.loads(body)
    assert status == 200 and health == {"status": "ok", "edge_id": f"{sys_.prefix}-edge", "workers": 1,
                                        "instance": health["instance"], "pending_cancels": 0}
    assert health["instance"].startswith(f"{sys_.prefix}-edge."), "its id in Redis: the name and this start's"
    status, body = await asyncio.to_thread(get, "/metrics")
    assert status == 200 and "lanes_requests_total" in body
    assert "queue depth" in (await asyncio.to_thread(get, "/dashboard"))[1]
    await asyncio.sleep(1.0)  # the scheduler snapshots every 0.5 s
    depths = json.loads((await asyncio.to_thread(get, "/v1/depths"))[1])
    assert set(depths["pending"]) == {"short", "medium", "long"} and depths["workers"] == 1
    workers = json.loads((await asyncio.to_thread(get, "/v1/workers"))[1])
    assert len(workers) == 1 and workers[0]["engine"]["engine"] == "hf"
    assert {"running", "slots", "tokens_per_s", "finished"} <= set(workers[0])


def test_logs_hold_no_prompt_text(system: tuple[System, str], greedy_reference) -> None:
    sys_, _ = system
    answer = greedy_reference("What does a class definition do?", 24).text  # streamed by the first test above
    assert len(answer.strip()) >= 8
    for log in Path(sys_.log_dir).glob("*.log"):
        text = log.read_text()
        assert "class definition" not in text, f"{log.name} leaked a prompt"
        assert answer not in text and answer.strip()[:16] not in text, f"{log.name} leaked an answer"


async def test_resume_after_the_end_still_gets_done(system: tuple[System, str]) -> None:
    _, url = system
    first = await Client.connect(url)
    await first.chat("finished", "Short one.", max_tokens=4)
    done = await first.wait("finished")
    last_seq = first.deltas("finished")[-1]["seq"]
    await first.close()
    again = await Client.connect(url)
    await again.send({"type": "resume", "id": "finished", "last_seq": last_seq})
    replayed = await again.wait("finished", timeout_s=10)
    assert replayed["type"] == "done" and replayed["usage"] == done["usage"]
    assert again.deltas("finished") == [], "nothing the client already had is sent again"
    await again.close()


async def test_same_id_from_another_connection_does_not_steal_the_stream(system: tuple[System, str]) -> None:
    _, url = system
    owner, intruder = await Client.connect(url), await Client.connect(url)
    await owner.chat("shared-id", "Mine, all mine.", max_tokens=24)
    await intruder.chat("shared-id", "Give it to me.", max_tokens=24)
    refused = await intruder.wait("shared-id")
    assert refused["type"] == "error" and refused["code"] == "duplicate_id"
    done = await owner.wait("shared-id")
    assert done["type"] == "done" and owner.deltas("shared-id"), "the first submitter still gets its answer"
    assert not intruder.deltas("shared-id")
    for client in (owner, intruder):
        await client.close()
