"""The edge's request bookkeeping with real processes (issue 8's six defects).

One scheduler, one edge with API keys on (two static keys, fleet-wide rate limits so a Redis
call sits between the duplicate check and the enqueue), and one sim worker whose answers take a
few seconds, so requests are still running when connections drop, resume and race.
"""

from __future__ import annotations

import asyncio
import signal
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis
import websockets

from conftest import scaled
from e2e_support import Client, System
from lanes.queue.keys import Keys
from lanes.ws_server.auth import generate_key, hash_key, key_id
from lanes.ws_server.protocol import scoped_id

pytestmark = pytest.mark.e2e

ALICE, BOB = generate_key(), generate_key()
GRACE_S = 3.0
#: The sim engine at real time: about 30 ms a token, so 120 tokens run ~4 s.
LONG_TOKENS = 120


@pytest.fixture(scope="module")
def system(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[System, str]]:
    sys_ = System(redis_url, f"bk{uuid.uuid4().hex[:6]}", tmp_path_factory.mktemp("bookkeeping-logs"))
    try:
        sys_.start("scheduler", ["scheduler"])
        edge_env = {"LANES_API_KEY_HASHES": f"{hash_key(ALICE)},{hash_key(BOB)}", "LANES_RATE_LIMIT_SCOPE": "fleet",
                    "LANES_KEY_RATE_PER_S": "1000", "LANES_KEY_BURST": "1000", "LANES_RESUME_GRACE_S": str(GRACE_S)}
        url = sys_.start_edge(**edge_env)
        sys_.start_edge("edge2", **edge_env)  # for clients that hop between edges
        # No orphan grace beyond the requests' own (their resume grace and two heartbeats): a
        # request whose edge died is cancelled within seconds.
        sys_.start("worker", ["worker", "--engine", "sim", "--max-slots", "16"], LANES_ORPHAN_GRACE_S="0")
        sys_.wait_workers(1)
        yield sys_, url
    finally:
        sys_.stop()


async def connect(url: str, key: str) -> Client:
    return Client(await websockets.connect(url, max_size=None, additional_headers={"Authorization": f"Bearer {key}"}))


async def first_frame(client: Client, rid: str, timeout_s: float = 10) -> dict:
    async def wait() -> dict:
        while not client.frames[rid]:
            await asyncio.sleep(0.005)
        return client.frames[rid][0]

    return await asyncio.wait_for(wait(), scaled(timeout_s))


async def streaming(client: Client, rid: str, num_deltas: int = 3) -> None:
    async def wait() -> None:
        while len(client.deltas(rid)) < num_deltas:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(wait(), scaled(30))


def contiguous(*clients_and_ids: tuple[Client, str]) -> list[int]:
    return [f["seq"] for client, rid in clients_and_ids for f in client.deltas(rid)]


def edge_metrics(sys_: System) -> dict[str, float]:
    """The edge's samples by series (``name{labels}``)."""
    request = urllib.request.Request(f"http://127.0.0.1:{sys_.edge_ports['edge']}/metrics",
                                     headers={"Authorization": f"Bearer {ALICE}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


def edge_in_flight(sys_: System) -> float:
    return edge_metrics(sys_)["lanes_edge_in_flight"]


def counted(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s series whose labels include ``labels``."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for series, v in samples.items()
               if series.split("{")[0] == name and all(w in series for w in wanted))


async def test_a_finished_request_leaves_nothing_behind(system: tuple[System, str]) -> None:
    """Defect 1: the id of a finished request is no longer 'in flight' on a new connection, and
    the edge's in-flight count returns to zero."""
    sys_, url = system
    rid = f"once-{uuid.uuid4().hex[:6]}"
    first = await connect(url, ALICE)
    await first.chat(rid, "Say hi.", max_tokens=5)
    assert (await first.wait(rid, scaled(30)))["type"] == "done"
    await first.close()
    second = await connect(url, ALICE)
    await second.chat(rid, "Say hi again.", max_tokens=5)
    refusal = await second.wait(rid, scaled(10))
    assert refusal["code"] == "duplicate_id" and "already exists (done)" in refusal["message"], refusal
    before = edge_metrics(sys_)
    await second.send({"type": "resume", "id": rid, "last_seq": -1})  # the way back to a finished answer

    async def replayed() -> None:
        while not any(f["type"] == "done" for f in second.frames[rid]):
            await asyncio.sleep(0.01)

    await asyncio.wait_for(replayed(), scaled(10))
    assert [f["type"] for f in second.frames[rid]][1] == "resumed"
    assert second.text(rid) == first.text(rid)
    await second.close()
    await asyncio.sleep(0.3)
    after = edge_metrics(sys_)
    assert after["lanes_edge_in_flight"] == 0
    # One request, counted once where its chat came: the replay is a resume (it was a second
    # request, lane "resumed", with an end-to-end time of the replay's few milliseconds).
    done = first.frames[rid][-1]["finish_reason"]
    assert counted(after, "lanes_resumes_total", outcome=done) == counted(before, "lanes_resumes_total", outcome=done) + 1
    assert counted(after, "lanes_requests_total", lane="resumed") == 0
    assert counted(after, "lanes_e2e_seconds_count", lane="resumed") == 0


async def test_another_keys_resume_disturbs_nothing(system: tuple[System, str]) -> None:
    """Defect 2: a resume with another key is answered unknown_id and the owner keeps its stream."""
    _, url = system
    rid = f"mine-{uuid.uuid4().hex[:6]}"
    owner, intruder = await connect(url, ALICE), await connect(url, BOB)
    await owner.chat(rid, "Tell me a long story.", max_tokens=LONG_TOKENS)
    await streaming(owner, rid)
    await intruder.send({"type": "resume", "id": rid, "last_seq": -1})
    assert (await intruder.wait(rid, scaled(10)))["code"] == "unknown_id"
    done = await owner.wait(rid, scaled(60))
    assert done["type"] == "done", done
    assert contiguous((owner, rid)) == list(range(done["usage"]["completion_tokens"]))
    assert [f["type"] for f in intruder.frames[rid]] == ["error"]
    # Ids are per key: the other key's chat with the same id is its own request, served to its
    # end, and the owner's answer is still the owner's (resumable, unchanged); the owner's own
    # chat with the id is refused as a duplicate that names its state.
    other = await connect(url, BOB)
    await other.chat(rid, "Mine now?", max_tokens=5)
    theirs = await other.wait(rid, scaled(30))
    assert theirs["type"] == "done" and theirs["usage"]["completion_tokens"] <= 5, theirs
    assert other.frames[rid][0]["type"] == "accepted"
    again = await connect(url, ALICE)
    await again.send({"type": "resume", "id": rid, "last_seq": -1})
    replayed = await again.wait(rid, scaled(10))
    assert replayed["usage"] == done["usage"] and again.text(rid) == owner.text(rid), replayed
    dup = await connect(url, ALICE)
    await dup.chat(rid, "Again?", max_tokens=5)
    refusal = await dup.wait(rid, scaled(10))
    assert (refusal["code"], refusal["message"]) == ("duplicate_id",
                                                     f"request {rid} already exists (done); use resume"), refusal
    for client in (other, again, dup, owner, intruder):
        await client.close()


async def test_two_connections_racing_on_one_id(system: tuple[System, str]) -> None:
    """Defect 3: the same id sent at once from two connections (a Redis call between the
    duplicate check and the enqueue): one is served to the end, the other refused; no stall."""
    _, url = system
    for _ in range(5):
        rid = f"race-{uuid.uuid4().hex[:6]}"
        a, b = await connect(url, ALICE), await connect(url, ALICE)
        await asyncio.gather(a.chat(rid, "Race.", max_tokens=8), b.chat(rid, "Race.", max_tokens=8))
        ends = await asyncio.gather(a.wait(rid, scaled(30)), b.wait(rid, scaled(30)))
        assert sorted(e["type"] for e in ends) == ["done", "error"], ends
        assert next(e for e in ends if e["type"] == "error")["code"] == "duplicate_id"
        winner = a if ends[0]["type"] == "done" else b
        assert winner.frames[rid][0]["type"] == "accepted"
        await a.close()
        await b.close()


async def test_resume_on_a_new_connection_while_the_old_one_lingers(system: tuple[System, str]) -> None:
    """Defect 4a: the new connection gets the answer; the old one is told resumed_elsewhere, and
    its late close takes nothing away."""
    _, url = system
    rid = f"move-{uuid.uuid4().hex[:6]}"
    old = await connect(url, ALICE)
    await old.chat(rid, "Tell me a long story.", max_tokens=LONG_TOKENS)
    await streaming(old, rid)
    new = await connect(url, ALICE)
    last = old.deltas(rid)[-1]["seq"]
    await new.send({"type": "resume", "id": rid, "last_seq": last})
    assert (await old.wait(rid, scaled(10)))["code"] == "resumed_elsewhere"
    await old.close()  # the half-dead connection finally goes
    done = await new.wait(rid, scaled(60))
    assert done["type"] == "done", done
    seqs = [f["seq"] for f in old.deltas(rid) if f["seq"] <= last] + contiguous((new, rid))
    assert seqs == list(range(done["usage"]["completion_tokens"]))
    await new.close()


async def test_a_resume_on_another_edge_tells_the_old_edge_at_once(system: tuple[System, str]) -> None:
    """The resuming edge publishes a takeover notice to the edge that delivered the request:
    the old connection gets resumed_elsewhere within moments, not at the old edge's next
    quiet check (3 s after the worker stopped publishing to it)."""
    sys_, url = system
    rid = f"hop-{uuid.uuid4().hex[:6]}"
    notices = aioredis.from_url(sys_.redis_url).pubsub()
    await notices.subscribe(Keys(sys_.prefix).takeover_channel(sys_.health("edge")["instance"]))
    old = await connect(url, ALICE)
    await old.chat(rid, "Tell me a long story.", max_tokens=LONG_TOKENS)
    await streaming(old, rid)
    new = await connect(sys_.edge_urls["edge2"], ALICE)
    sent_at = asyncio.get_running_loop().time()
    await new.send({"type": "resume", "id": rid, "last_seq": old.deltas(rid)[-1]["seq"]})
    assert (await old.wait(rid, scaled(10)))["code"] == "resumed_elsewhere"
    told_after_s = asyncio.get_running_loop().time() - sent_at
    messages = [await notices.get_message(timeout=scaled(2)) for _ in range(2)]  # subscribed, then the notice
    scoped = scoped_id(key_id(hash_key(ALICE)), rid).encode()  # what Redis and the edges know it as
    assert [m["data"] for m in messages if m and m["type"] == "message"] == [scoped], messages
    assert told_after_s < 2.5, f"the old connection learned of the takeover after {told_after_s:.2f} s"
    assert (await new.wait(rid, scaled(60)))["type"] == "done"
    await notices.aclose()
    await old.close()
    await new.close()


async def test_a_dropped_connection_can_resume_within_the_grace(system: tuple[System, str]) -> None:
    """Defect 4b: a phone that changes networks keeps its answers."""
    _, url = system
    rid = f"phone-{uuid.uuid4().hex[:6]}"
    first = await connect(url, ALICE)
    await first.chat(rid, "Tell me a long story.", max_tokens=LONG_TOKENS)
    await streaming(first, rid)
    first.ws.transport.abort()  # no close handshake: the network went away
    await asyncio.sleep(GRACE_S / 3)
    second = await connect(url, ALICE)
    last = first.deltas(rid)[-1]["seq"]
    await second.send({"type": "resume", "id": rid, "last_seq": last})
    done = await second.wait(rid, scaled(60))
    assert done["type"] == "done" and done["finish_reason"] in ("stop", "length"), done
    assert contiguous((first, rid), (second, rid)) == list(range(done["usage"]["completion_tokens"]))
    await second.close()


async def test_resume_past_the_end_of_a_running_request_ends_with_done(system: tuple[System, str]) -> None:
    """Defect 4c: ``last_seq`` past the current end waits for the end instead of hanging."""
    _, url = system
    rid = f"ahead-{uuid.uuid4().hex[:6]}"
    first = await connect(url, ALICE)
    await first.chat(rid, "Tell me a long story.", max_tokens=LONG_TOKENS)
    await streaming(first, rid)
    second = await connect(url, ALICE)
    await second.send({"type": "resume", "id": rid, "last_seq": 10_000})
    done = await second.wait(rid, scaled(60))
    assert done["type"] == "done" and second.deltas(rid) == [], second.frames[rid]
    await first.close()
    await second.close()


async def test_accepted_comes_first_under_a_burst(system: tuple[System, str]) -> None:
    """Defect 5: under load no delta (or done) overtakes its request's ``accepted``. A worker
    1000x faster than real time answers while the edge is still busy enqueueing the burst."""
    sys_, url = system
    sys_.start("fast-worker", ["worker", "--engine", "sim", "--sim-time-scale", "1000", "--max-slots", "64"])
    sys_.wait_workers(2)
    try:
        clients = [await connect(url, key) for key in (ALICE, BOB) for _ in range(8)]
        ids = [(c, f"burst{i}-{j}-{uuid.uuid4().hex[:4]}") for i, c in enumerate(clients) for j in range(20)]
        await asyncio.gather(*(c.chat(rid, "Quick one.", max_tokens=3) for c, rid in ids))
        ends = await asyncio.gather(*(c.wait(rid, scaled(60)) for c, rid in ids))
        for (client, rid), end in zip(ids, ends):
            kinds = [f["type"] for f in client.frames[rid]]
            if end["type"] == "done":
                assert kinds[0] == "accepted" and kinds[-1] == "done" and kinds.count("done") == 1, (rid, kinds)
            else:
                assert kinds == ["error"], (rid, kinds)
        for client in clients:
            await client.close()
    finally:
        sys_.kill("fast-worker", 15)


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
def test_http_paths_refuse_other_methods(system: tuple[System, str], method: str) -> None:
    """Defect 6: plain-HTTP paths answer 405 to methods they do not serve."""
    sys_, _ = system
    for path in ("/dashboard", "/healthz", "/metrics"):
        request = urllib.request.Request(f"http://127.0.0.1:{sys_.edge_ports['edge']}{path}", method=method,
                                         data=None if method == "DELETE" else b'{"a": 1}')
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5)
        assert refused.value.code == 405 and "GET" in refused.value.headers["Allow"]


async def test_a_client_hopping_to_another_edge_and_back_keeps_its_answer(system: tuple[System, str]) -> None:
    """A phone behind a load balancer: edge 1, then edge 2, then edge 1 again within a second.
    Edge 1 still held the request from the first connection; Redis pointed it at edge 2."""
    sys_, url = system
    url2 = url.replace(str(sys_.edge_ports["edge"]), str(sys_.edge_ports["edge2"]))
    rid = f"hop-{uuid.uuid4().hex[:6]}"
    hops = [await connect(url, ALICE)]
    await hops[0].chat(rid, "Tell me a long story.", max_tokens=LONG_TOKENS)
    await streaming(hops[0], rid, 5)
    for next_url in (url2, url):
        hops[-1].ws.transport.abort()  # the network changed
        client = await connect(next_url, ALICE)
        await client.send({"type": "resume", "id": rid, "last_seq": contiguous(*((c, rid) for c in hops))[-1]})
        hops.append(client)
        await streaming(client, rid, 2)
    done = await hops[-1].wait(rid, scaled(60))
    assert done["type"] == "done" and done["finish_reason"] in ("stop", "length"), done
    assert contiguous(*((c, rid) for c in hops)) == list(range(done["usage"]["completion_tokens"]))
    await hops[-1].close()


async def test_an_edge_restarted_under_its_name_does_not_keep_its_old_connections_requests(
        system: tuple[System, str]) -> None:
    """A client that dropped its connection and one still connected when its edge was stopped
    (close 1012), neither ever resuming: once the edge is back under the same LANES_EDGE_ID (as
    ``lanes up`` restarts it), both requests are cancelled when their resume
    grace runs out. The restarted edge used to listen on its predecessor's channel, so the
    worker saw a listener and ran them to the end for nobody (~60 s here); and a resume still
    finds them."""
    sys_, url = system
    url2 = url.replace(str(sys_.edge_ports["edge"]), str(sys_.edge_ports["edge2"]))
    before = sys_.health("edge2")["instance"]
    ids = {f"gone-{uuid.uuid4().hex[:6]}": 2000, f"kept-{uuid.uuid4().hex[:6]}": 2000,
           f"back-{uuid.uuid4().hex[:6]}": LONG_TOKENS * 3}
    client = await connect(url2, ALICE)
    dropped = await connect(url2, ALICE)
    for i, (rid, max_tokens) in enumerate(ids.items()):
        await (dropped if i == 0 else client).chat(rid, "Tell me a long story.", max_tokens=max_tokens)
    for i, rid in enumerate(ids):
        await streaming(dropped if i == 0 else client, rid)
    dropped.ws.transport.abort()
    await asyncio.sleep(0.2)
    await asyncio.to_thread(sys_.kill, "edge2", signal.SIGTERM)  # and waits for its exit
    await asyncio.wait_for(client._reader, scaled(20))  # closed by the stopping edge
    sys_.restart("edge2")
    await asyncio.to_thread(sys_.wait_edge, "edge2", scaled(60))
    assert sys_.health("edge2")["instance"] != before, "a new id in Redis at each start"
    gone, kept, back = ids
    resumer = await connect(url2, ALICE)  # the third comes back to the restarted edge
    await resumer.send({"type": "resume", "id": back, "last_seq": contiguous((client, back))[-1]})
    done = await resumer.wait(back, scaled(60))
    assert done["type"] == "done" and done["finish_reason"] in ("stop", "length"), done
    assert contiguous((client, back), (resumer, back)) == list(range(done["usage"]["completion_tokens"]))
    scoped = {rid: scoped_id(key_id(hash_key(ALICE)), rid) for rid in (gone, kept)}
    deadline = asyncio.get_running_loop().time() + scaled(30)
    while (states := {rid: (await asyncio.to_thread(sys_.query, lambda plane, r=r: plane.request_status(r)))[0]
                      for rid, r in scoped.items()}) != {gone: "cancelled", kept: "cancelled"}:
        assert asyncio.get_running_loop().time() < deadline, f"not cancelled after the grace: {states}"
        await asyncio.sleep(0.5)
    await resumer.close()
