"""Model pools end to end: workers declare a pool, a chat's ``model`` names one (or ``auto``
under routing rules), fixed answers need no model, the scheduler publishes each pool's
autoscaling signal, and a worker scaled down under load loses nothing."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
import uuid
from pathlib import Path

import openai
import pytest
from conftest import REPO_ROOT, scaled
from e2e_support import Client, System
from lanes.queue.plane import QueuePlane
from lanes.scheduler.router.complexity import ComplexityModel
from lanes.scheduler.router.policy import route
from lanes.scheduler.router.rules import load_rules

pytestmark = pytest.mark.e2e

RULES = REPO_ROOT / "deploy" / "routing.toml"
FIXED = REPO_ROOT / "deploy" / "fixed_answers.toml"
SIM = ("--engine", "sim", "--sim-time-scale", "20", "--max-slots", "8")
MAX_TOKENS = 1500


@pytest.fixture(scope="module")
def system(make_cluster) -> System:
    sys_ = make_cluster(workers=0, env={"LANES_ROUTING_FILE": str(RULES), "LANES_FIXED_ANSWERS_FILE": str(FIXED),
                                        "LANES_POOLS": "small,large"})
    for name, pool in (("small-1", "small"), ("large-1", "large"), ("large-2", "large")):
        # large-2 is scaled down under load below: a short drain, so it also hands requests back.
        sys_.start_worker(name, "", *SIM, LANES_POOL=pool, LANES_DRAIN_TIMEOUT_S="0.5")
    sys_.wait_workers(3)
    # ``auto`` sends a prompt up the tiers while its tier has no live worker in the edge's view
    # (the scheduler's snapshots): wait until the snapshots count both pools' workers.
    deadline = time.monotonic() + scaled(30)
    for pool, workers in (("small", 1), ("large", 2)):
        url = f"http://127.0.0.1:{sys_.edge_ports['edge']}/v1/depths?pool={pool}"
        while json.loads(urllib.request.urlopen(url, timeout=5).read() or b"{}").get("workers", 0) < workers:
            assert time.monotonic() < deadline, f"no snapshot of pool {pool} with its workers"
            time.sleep(0.1)
    time.sleep(1.5)  # the next snapshot (one a second) has reached the edge by pub/sub
    return sys_


def served_by(sys_: System, pool: str, rid: str) -> str:
    async def worker(plane: QueuePlane) -> str:
        return (await plane.for_pool(pool).request_status(rid))[1]

    return sys_.query(worker)


async def chat(url: str, rid: str, content: str, **fields: object) -> list[dict[str, object]]:
    client = await Client.connect(url)
    await client.send({"type": "chat", "id": rid, "messages": [{"role": "user", "content": content}],
                       "max_tokens": 8, **fields})
    await client.wait(rid, scaled(30))
    await client.close()
    return client.frames[rid]


async def test_model_names_the_pool_that_serves_it(system: System) -> None:
    url = system.edge_urls["edge"]
    for pool in ("small", "large"):
        rid = f"{pool}-{uuid.uuid4().hex[:6]}"
        frames = await chat(url, rid, "Tell me about the sea.", model=pool)
        assert frames[-1]["type"] == "done", frames
        assert served_by(system, pool, rid).endswith(f"{pool}-1") or served_by(system, pool, rid).endswith("-2")


async def test_the_edges_latency_and_outcome_series_are_per_pool(system: System) -> None:
    """TTFT, queue wait, E2E, outcomes and refusals carry the pool: with two models side by side
    an operator sees each one's latency (they were added up, lane by lane)."""
    url = system.edge_urls["edge"]
    for pool in ("small", "large"):
        frames = await chat(url, f"m-{pool}-{uuid.uuid4().hex[:6]}", "Tell me about the sea.", model=pool)
        assert frames[-1]["type"] == "done", frames
    refused = await chat(url, f"m-none-{uuid.uuid4().hex[:6]}", "Tell me about the sea.", model="gigantic")
    assert refused[0]["code"] == "model_not_found"
    url = f"http://127.0.0.1:{system.edge_ports['edge']}/metrics"
    lines = (await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())).decode().splitlines()
    for pool in ("small", "large"):
        for family in ("lanes_ttft_seconds_count", "lanes_queue_seconds_count", "lanes_e2e_seconds_count",
                       "lanes_requests_total"):
            assert any(line.startswith(family + "{") and f'pool="{pool}"' in line for line in lines), (family, pool)
    assert any(line.startswith("lanes_rejections_total{") and 'pool="none"' in line
               and 'reason="model_not_found"' in line for line in lines), "refused before a pool was chosen"


async def test_unknown_model_lists_the_live_pools(system: System) -> None:
    frames = await chat(system.edge_urls["edge"], "nope-1", "Hi there, how are things?", model="gigantic")
    url = f"http://127.0.0.1:{system.edge_ports['edge']}/v1/depths?pool=small"
    with urllib.request.urlopen(url, timeout=5) as resp:
        small = resp.read()
    assert frames[0]["code"] == "model_not_found" and "large, small" in frames[0]["message"], (frames, small)


async def test_auto_follows_the_rules(system: System) -> None:
    rules, complexity = load_rules(RULES), ComplexityModel.load().complexity
    prompts = ["Translate 'good morning' into French.", "Prove that there are infinitely many primes, in detail."]
    for i, prompt in enumerate(prompts):
        rid = f"auto{i}-{uuid.uuid4().hex[:6]}"
        expected = route(prompt, None, rules, "auto", complexity).pool
        frames = await chat(system.edge_urls["edge"], rid, prompt, model="auto")
        assert frames[-1]["type"] == "done", frames
        assert served_by(system, expected, rid), f"{prompt!r} should go to {expected}"
        assert frames[0]["pool"] == expected, "accepted names the pool auto chose"
    rid = f"nomodel-{uuid.uuid4().hex[:6]}"
    assert (await chat(system.edge_urls["edge"], rid, "Tell me about the sea."))[-1]["type"] == "done"
    assert served_by(system, rules.default_pool, rid)


async def test_fixed_answers_need_no_model(system: System) -> None:
    frames = await chat(system.edge_urls["edge"], "hello-1", "Hello!", max_tokens=64)
    kinds = [f["type"] for f in frames]
    assert kinds[0] == "accepted" and frames[0]["lane"] == "fixed" and kinds[-1] == "done", frames
    # No pool serves it; ``pool`` names the one the chat resolved to (what ``auto`` answers with).
    assert frames[0]["pool"] == load_rules(RULES).default_pool, frames[0]
    text = "".join(f["text"] for f in frames if f["type"] == "delta")
    assert text.startswith("Hello!") and frames[-1]["finish_reason"] == "stop"
    for pool in ("small", "large"):
        assert served_by(system, pool, "hello-1") == "", "no worker ever saw it"


async def test_fixed_answers_keep_the_requests_model_max_tokens_and_stop(system: System) -> None:
    """A fixed answer is what an engine would have sent: none for a model nobody serves, cut at
    ``max_tokens`` (finish ``length``) and before a ``stop`` string."""
    url = system.edge_urls["edge"]
    whole = await chat(url, f"hi-{uuid.uuid4().hex[:6]}", "Hello!", max_tokens=64)
    text = "".join(f["text"] for f in whole if f["type"] == "delta")
    unknown = await chat(url, f"hi-{uuid.uuid4().hex[:6]}", "Hello!", model="gigantic")
    assert [f["type"] for f in unknown] == ["error"] and unknown[0]["code"] == "model_not_found", unknown
    short = await chat(url, f"hi-{uuid.uuid4().hex[:6]}", "Hello!", max_tokens=2)
    deltas = [f["text"] for f in short if f["type"] == "delta"]
    assert len(deltas) == 2 and text.startswith("".join(deltas)), short
    assert short[-1]["finish_reason"] == "length" and short[-1]["usage"]["completion_tokens"] == 2
    stop = text.split()[1]  # the answer's second word
    stopped = await chat(url, f"hi-{uuid.uuid4().hex[:6]}", "Hello!", max_tokens=64, stop=[stop])
    assert "".join(f["text"] for f in stopped if f["type"] == "delta") == text[:text.index(stop)]
    assert stopped[-1]["finish_reason"] == "stop", stopped


def test_openai_models_and_unknown_model(system: System) -> None:
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{system.edge_ports['edge']}/v1", api_key="none", max_retries=0)
    assert [m.id for m in api.models.list().data] == ["large", "small", "auto"]
    assert api.models.retrieve("small").id == "small"  # GET /v1/models/{model}, as SDKs and tools check one
    with pytest.raises(openai.NotFoundError) as missing:
        api.models.retrieve("gigantic")
    assert missing.value.body["code"] == "model_not_found" and "large, small, auto" in missing.value.body["message"]
    with pytest.raises(openai.NotFoundError) as refused:
        api.chat.completions.create(model="gigantic", messages=[{"role": "user", "content": "Why is the sky blue?"}])
    assert refused.value.body["code"] == "model_not_found"
    answer = api.chat.completions.create(model="small", messages=[{"role": "user", "content": "Why?"}], max_tokens=4)
    assert answer.choices[0].message.content and answer.model == "small"
    prompt = "Prove that there are infinitely many primes, in detail."
    expected = route(prompt, None, load_rules(RULES), "auto", ComplexityModel.load().complexity).pool
    routed = api.chat.completions.with_raw_response.create(model="auto", messages=[{"role": "user", "content": prompt}],
                                                           max_tokens=4)
    assert routed.parse().model == expected, "the answer names the pool auto chose, as OpenAI names the model"
    assert routed.headers["x-lanes-pool"] == expected
    # A fixed answer to "auto" names the pool too (it echoed "auto" and sent no x-lanes-pool).
    greeted = api.chat.completions.with_raw_response.create(model="auto", messages=[{"role": "user", "content": "Hello!"}])
    assert greeted.headers["x-lanes-lane"] == "fixed" and greeted.parse().model in ("small", "large")
    assert greeted.headers["x-lanes-pool"] == greeted.parse().model
    assert [m.id for m in api.models.list().data] == ["large", "small", "auto"]


async def test_each_pool_gets_its_autoscaling_signal(system: System) -> None:
    """A light, steady load (a short chat every 0.3 s, far below two workers' 16 slots) keeps the
    pool at its size: the signal asks for more only when the slots fill. Before, a worker's
    capacity was read as its throughput, so any pool that kept up asked for 1.2x its workers."""
    url = system.edge_urls["edge"]
    load = []
    for i in range(20):
        load.append(asyncio.create_task(chat(url, f"as{i}-{uuid.uuid4().hex[:4]}", "Say hi.", model="large")))
        await asyncio.sleep(0.3)
    assert all(frames[-1]["type"] == "done" for frames in await asyncio.gather(*load))
    await asyncio.sleep(1.0)
    for pool, workers in (("small", 1), ("large", 2)):
        depths = f"http://127.0.0.1:{system.edge_ports['edge']}/v1/depths?pool={pool}"
        snapshot = await asyncio.to_thread(lambda u=depths: json.loads(urllib.request.urlopen(u, timeout=5).read()))
        assert snapshot["pool"] == pool and snapshot["workers"] == workers
        assert "arrival_rps" in snapshot
        if pool == "large":
            assert sum(snapshot["arrival_rps"].values()) > 0.5, snapshot
            assert 1 <= snapshot["desired_workers"] <= workers, snapshot


async def test_scale_down_under_load_loses_nothing(system: System) -> None:
    """SIGTERM to a worker mid-load: it stops claiming, drains, hands the rest back, exits 0;
    every request ends done with contiguous seqs."""
    client = await Client.connect(system.edge_urls["edge"])
    ids = [f"drain{i}-{uuid.uuid4().hex[:4]}" for i in range(16)]
    for rid in ids:  # ~1,500 tokens each at 20x real time: several seconds, longer than the drain
        await client.send({"type": "chat", "id": rid, "model": "large", "max_tokens": MAX_TOKENS,
                           "messages": [{"role": "user", "content": f"Story {rid}"}]})
    await asyncio.sleep(1.0)
    proc = system.procs["large-2"]
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 30) == 0, "a scale-down is a clean exit"
    for rid in ids:
        done = await client.wait(rid, scaled(120))
        assert done["type"] == "done", done
        seqs = [f["seq"] for f in client.deltas(rid)]
        assert seqs == list(range(MAX_TOKENS)) and done["usage"]["completion_tokens"] == MAX_TOKENS
    await client.close()
    log = Path(system.log_dir / "large-2.log").read_text()
    assert "draining" in log and "released" in log, "it drained, then handed the rest back"


def test_a_client_that_leaves_cancels_its_request_in_its_own_pool(system: System) -> None:
    """An HTTP client that disconnects mid-stream cancels at once (no resume over HTTP): the
    cancel must reach the pool the request went to, not the default one."""
    import http.client

    rid_holder: list[str] = []
    conn = http.client.HTTPConnection("127.0.0.1", system.edge_ports["edge"], timeout=30)
    body = json.dumps({"model": "small", "stream": True, "max_tokens": 4000,
                       "messages": [{"role": "user", "content": "Write a very long story about the sea."}]})
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    for line in response:
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                rid_holder.append(chunk["id"])
                break
    conn.sock.close()  # gone mid-stream
    conn.close()
    rid = rid_holder[0]  # the completion id is the request id

    async def state(plane: QueuePlane) -> str:
        return (await plane.for_pool("small").request_status(rid))[0]

    deadline = time.monotonic() + scaled(20)
    while (now := system.query(state)) not in ("cancelled", "done") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert now == "cancelled", f"request {rid} in pool small ended {now!r}: the cancel went elsewhere"


async def test_a_pool_nobody_serves_or_snapshots_is_refused_at_once(system: System, tmp_path: Path) -> None:
    """A pool the rules name but no worker serves and the scheduler does not snapshot (not in
    ``LANES_POOLS``; or its last worker is gone) is refused ``unavailable``: before, the edge
    skipped the registry check without a snapshot and the chat waited in a lane nobody pulls.
    (An edge with no scheduler at all still enqueues: it cannot tell.)"""
    rules = tmp_path / "routing.toml"
    rules.write_text(RULES.read_text().replace('pools = ["small", "large"]', 'pools = ["small", "large", "spare"]'))
    system.start_edge("spare", LANES_ROUTING_FILE=str(rules))
    await asyncio.sleep(1.0)  # the edge has the scheduler's snapshots of the other pools
    started = time.monotonic()
    frames = await chat(system.edge_urls["spare"], f"spare-{uuid.uuid4().hex[:6]}", "Tell me about the sea.",
                        model="spare")
    assert [f["type"] for f in frames] == ["error"] and frames[0]["code"] == "unavailable", frames
    assert "no worker of pool 'spare'" in frames[0]["message"] and frames[0]["retry_after_ms"] > 0
    assert time.monotonic() - started < scaled(10)
    frames = await chat(system.edge_urls["spare"], f"ok-{uuid.uuid4().hex[:6]}", "Tell me about the sea.", model="small")
    assert frames[-1]["type"] == "done", frames
    # /v1/models lists the names a chat may give here: the rules' pools (spare too: it answers
    # 503, not 404) and auto. Before, it listed the pools with live workers, rules or not.
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{system.edge_ports['spare']}/v1", api_key="none", max_retries=0)
    assert [m.id for m in api.models.list().data] == ["large", "small", "spare", "auto"]


async def start_solo(sys_: System, slots: int, **env: str) -> None:
    """A sim worker (real time) serving pool ``solo``, once the edge knows the pool (the
    scheduler's snapshot of it has arrived)."""
    sys_.start_worker("solo-1", "", "--engine", "sim", "--sim-time-scale", "1", "--max-slots", str(slots),
                      LANES_POOL="solo", **env)
    sys_.wait_workers(1)
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{sys_.edge_ports['edge']}/v1", api_key="none", max_retries=0)
    for _ in range(int(scaled(100))):
        if "solo" in [m.id for m in (await asyncio.to_thread(api.models.list)).data]:
            return
        await asyncio.sleep(0.1)


async def solo_chats(client: Client, ids: tuple[str, ...], max_tokens: int,
                     streaming: tuple[str, ...] | None = None) -> None:
    """Chats for pool ``solo``, sent in order; returns once each of ``streaming`` (default: all)
    has a delta or an error."""
    for rid in ids:
        await client.send({"type": "chat", "id": rid, "model": "solo", "max_tokens": max_tokens,
                           "messages": [{"role": "user", "content": "Write a very long story."}]})
    for _ in range(int(scaled(600))):
        if all(any(f["type"] in ("delta", "error") for f in client.frames[rid]) for rid in streaming or ids):
            return
        await asyncio.sleep(0.05)


async def test_requests_of_a_pool_whose_last_worker_died_end_with_unavailable(make_cluster) -> None:
    """kill -9 of a pool's only worker: the request it ran and the one waiting behind it both
    end with ``unavailable`` once the pool has had no worker for ``LANES_NO_WORKER_TIMEOUT_S``
    (before, both waited forever: the pool left the scheduler's watch with its last worker),
    and a new chat for the pool is refused at once."""
    sys_ = make_cluster(workers=0, env={"LANES_NO_WORKER_TIMEOUT_S": "1"})
    await start_solo(sys_, 1)
    client = await Client.connect(sys_.edge_urls["edge"])
    running, waiting = f"run-{uuid.uuid4().hex[:6]}", f"wait-{uuid.uuid4().hex[:6]}"
    await solo_chats(client, (running, waiting), 2000, streaming=(running,))
    assert client.frames[running][-1]["type"] == "delta", client.frames[running]
    sys_.kill("solo-1")
    ends = [await client.wait(rid, scaled(40)) for rid in (running, waiting)]
    assert [(e["type"], e.get("code")) for e in ends] == [("error", "unavailable")] * 2, ends
    assert "no worker of pool 'solo'" in ends[1]["message"]
    assert client.frames[waiting][0]["type"] == "accepted"
    refused = await chat(sys_.edge_urls["edge"], f"new-{uuid.uuid4().hex[:6]}", "Hello there, story?", model="solo")
    assert [(f["type"], f.get("code")) for f in refused] == [("error", "unavailable")], refused
    await client.close()


async def test_a_pool_whose_last_worker_stops_is_refused_while_it_drains(make_cluster) -> None:
    """SIGTERM to a pool's only worker: from its first draining report its pool counts no
    worker, so a chat sent while it still drains its running answer is refused ``unavailable``
    at once (before, for ~10 s edges accepted such chats, which then waited a minute in a lane
    nobody would pull), and the running answer still finishes."""
    sys_ = make_cluster(workers=0)
    await start_solo(sys_, 1, LANES_DRAIN_TIMEOUT_S="30")
    # Without routing rules a chat without a model goes to "default", which nobody serves here:
    # the refusal says which pools do (it only said "retry shortly", for a pool that never comes).
    nameless = await chat(sys_.edge_urls["edge"], f"nameless-{uuid.uuid4().hex[:6]}", "Hello there, story?")
    assert nameless[0]["code"] == "unavailable" and "in 'model' (solo)" in nameless[0]["message"], nameless
    client = await Client.connect(sys_.edge_urls["edge"])
    running = f"run-{uuid.uuid4().hex[:6]}"
    await solo_chats(client, (running,), 150)
    sys_.procs["solo-1"].send_signal(signal.SIGTERM)
    await asyncio.sleep(1.5)  # the draining report, then the scheduler's next snapshot (0.5 s)
    started = time.monotonic()
    refused = await chat(sys_.edge_urls["edge"], f"new-{uuid.uuid4().hex[:6]}", "Hello there, story?", model="solo")
    assert [(f["type"], f.get("code")) for f in refused] == [("error", "unavailable")], refused
    assert time.monotonic() - started < scaled(2)
    assert client.frames[running][-1]["type"] == "delta", "the answer is still being drained"
    end = await client.wait(running, scaled(30))
    assert end["type"] == "done", end
    await client.close()


async def test_a_chat_in_a_named_pool_resumes_while_the_scheduler_is_down(make_cluster) -> None:
    """Resume looks for the request in this edge's own record of its pool, the snapshots' pools
    and every pool a worker served: with the scheduler down (no snapshots for 5 s), a chat in a
    named pool resumed as ``unknown_id``, even on the edge that took it."""
    sys_ = make_cluster(workers=0)
    sys_.start_edge("other")
    await start_solo(sys_, 2)
    first = await Client.connect(sys_.edge_urls["edge"])
    mine, theirs = f"mine-{uuid.uuid4().hex[:6]}", f"theirs-{uuid.uuid4().hex[:6]}"
    await solo_chats(first, (mine, theirs), 400)
    sys_.kill("scheduler")
    await asyncio.sleep(6.0)  # every snapshot is stale now
    await first.close()  # the requests run on for the resume grace (15 s)
    for url, rid in ((sys_.edge_urls["edge"], mine), (sys_.edge_urls["other"], theirs)):
        client = await Client.connect(url)
        await client.send({"type": "resume", "id": rid, "last_seq": 0})
        end = await client.wait(rid, scaled(60))
        assert client.frames[rid][0]["type"] == "resumed", client.frames[rid][:2]
        assert end["type"] == "done", end
        seqs = [f["seq"] for f in client.frames[rid] if f["type"] == "delta"]
        assert seqs == list(range(1, 400)), (rid, seqs[:3], seqs[-3:])
        await client.close()


async def test_auto_falls_back_to_a_larger_pool_while_the_small_one_has_no_worker(make_cluster) -> None:
    """Routing rules whose small pool has no live worker (down, or not started yet): an easy
    prompt under ``auto`` goes to the large pool instead of failing with ``unavailable``; a chat
    that names the small pool still gets ``unavailable``."""
    sys_ = make_cluster(workers=0, env={"LANES_ROUTING_FILE": str(RULES), "LANES_POOLS": "small,large"})
    sys_.start_worker("large-1", "", *SIM, LANES_POOL="large")
    sys_.wait_workers(1)
    prompt = "Translate 'good morning' into French."
    assert route(prompt, None, load_rules(RULES), "auto", ComplexityModel.load().complexity).pool == "small"
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{sys_.edge_ports['edge']}/v1", api_key="none", max_retries=0)
    await asyncio.sleep(1.0)  # the scheduler's snapshots of both pools
    answer = await asyncio.to_thread(api.chat.completions.with_raw_response.create, model="auto", max_tokens=4,
                                     messages=[{"role": "user", "content": prompt}])
    assert answer.headers["x-lanes-pool"] == "large" and answer.parse().model == "large"
    with pytest.raises(openai.APIStatusError) as named:
        await asyncio.to_thread(api.chat.completions.create, model="small", max_tokens=4,
                                messages=[{"role": "user", "content": prompt}])
    assert named.value.status_code == 503 and named.value.body["code"] == "unavailable"


async def test_a_pool_that_scales_from_zero_queues_its_chats_until_a_worker_starts(make_cluster) -> None:
    """``LANES_MIN_WORKERS=0`` (an autoscaler may take a pool to zero): a chat for the pool while
    it has no worker is accepted and waits in its lane rather than being refused, the scheduler
    asks for a worker (``desired_workers`` 1), ``/v1/models`` lists the pool, and the worker that
    starts serves the chat. Before, edges refused such chats, so a pool at zero never saw the
    arrivals that would scale it up."""
    sys_ = make_cluster(workers=0, env={"LANES_MIN_WORKERS": "0", "LANES_POOLS": "solo",
                                        "LANES_NO_WORKER_TIMEOUT_S": "300"})
    edge = f"http://127.0.0.1:{sys_.edge_ports['edge']}"
    depths = f"{edge}/v1/depths?pool=solo"
    api = openai.OpenAI(base_url=f"{edge}/v1", api_key="none", max_retries=0)
    for _ in range(int(scaled(100))):  # the scheduler's first snapshot of the pool
        if "solo" in [m.id for m in (await asyncio.to_thread(api.models.list)).data]:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the pool at zero is not listed")
    client = await Client.connect(sys_.edge_urls["edge"])
    rid = f"cold-{uuid.uuid4().hex[:6]}"
    await client.send({"type": "chat", "id": rid, "model": "solo", "max_tokens": 20,
                       "messages": [{"role": "user", "content": "Hello there."}]})
    for _ in range(int(scaled(100))):
        if client.frames[rid]:
            break
        await asyncio.sleep(0.05)
    assert client.frames[rid][0]["type"] == "accepted", client.frames[rid]
    for _ in range(int(scaled(100))):
        snapshot = await asyncio.to_thread(lambda: json.loads(urllib.request.urlopen(depths, timeout=5).read()))
        if snapshot.get("desired_workers") == 1:
            break
        await asyncio.sleep(0.1)
    assert (snapshot["workers"], sum(snapshot["pending"].values()), snapshot["desired_workers"]) == (0, 1, 1), snapshot
    await start_solo(sys_, 2)
    end = await client.wait(rid, scaled(60))
    assert end["type"] == "done", end
    assert [f["seq"] for f in client.frames[rid] if f["type"] == "delta"] == list(range(end["usage"]["completion_tokens"]))
    await client.close()


async def test_auto_chats_waiting_in_a_pool_that_died_fail_at_once_to_be_retried(make_cluster) -> None:
    """kill -9 of the small pool's only worker with chats waiting there: those that ``auto`` sent
    and that have not started end ``unavailable`` as soon as the scheduler sees the pool empty
    (a retry goes to the large pool, which has workers); before, they waited 60-76 s for the
    no-worker timeout while the large pool idled. A chat that named the pool keeps waiting for a
    worker of its own pool."""
    sys_ = make_cluster(workers=0, env={"LANES_ROUTING_FILE": str(RULES), "LANES_POOLS": "small,large"})
    sys_.start_worker("small-1", "", "--engine", "sim", "--sim-time-scale", "1", "--max-slots", "1",
                      LANES_POOL="small")
    sys_.start_worker("large-1", "", *SIM, LANES_POOL="large")
    sys_.wait_workers(2)
    prompt = "Translate 'good morning' into French."
    assert route(prompt, None, load_rules(RULES), "auto", ComplexityModel.load().complexity).pool == "small"
    await asyncio.sleep(1.5)  # the edge has the snapshots of both pools
    client = await Client.connect(sys_.edge_urls["edge"])
    running, routed, named = (f"{what}-{uuid.uuid4().hex[:6]}" for what in ("run", "auto", "named"))
    for rid, model in ((running, "auto"), (routed, "auto"), (named, "small")):
        await client.send({"type": "chat", "id": rid, "model": model, "max_tokens": 1500,
                           "messages": [{"role": "user", "content": prompt}]})
    for _ in range(int(scaled(200))):
        if client.deltas(running):
            break
        await asyncio.sleep(0.05)
    assert [client.frames[rid][0]["pool"] for rid in (running, routed, named)] == ["small"] * 3
    sys_.kill("small-1")
    killed = time.monotonic()
    end = await client.wait(routed, scaled(40))
    assert (end["type"], end["code"]) == ("error", "unavailable") and "'auto'" in end["message"], end
    assert time.monotonic() - killed < scaled(20), "failed at once, not after the 60 s timeout"
    assert not client.finished[named].is_set(), "a chat that named the pool waits for its pool"
    retry = await chat(sys_.edge_urls["edge"], f"again-{uuid.uuid4().hex[:6]}", prompt, model="auto")
    assert retry[0]["pool"] == "large" and retry[-1]["type"] == "done", retry
    await client.close()
