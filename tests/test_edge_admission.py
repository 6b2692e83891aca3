"""The edge's admission: latest snapshot + its own enqueues since, through the pure policy."""

from __future__ import annotations

from lanes.queue.messages import DepthSnapshot, Lane, encode
from lanes.scheduler.admission import RejectReason
from lanes.ws_server.admission import EdgeAdmission
from lanes.ws_server.settings import EdgeSettings


def snapshot(short: int, rps: float, pool: str = "default", workers: int = 1) -> bytes:
    return encode(DepthSnapshot(at_ms=1, pending={"short": short, "medium": 0, "long": 0}, running={},
                                oldest_wait_ms={}, service_rps={"short": rps}, pool=pool, workers=workers))


def test_admits_without_a_snapshot() -> None:
    assert EdgeAdmission(EdgeSettings(max_depth_short=1)).decide("default", Lane.SHORT, 1).admitted


def test_lane_depth_limit_counts_own_enqueues_between_snapshots() -> None:
    adm = EdgeAdmission(EdgeSettings(max_depth_short=3))
    adm.observe(snapshot(short=1, rps=10.0))
    assert adm.decide("default", Lane.SHORT, None).admitted
    adm.enqueued("default", Lane.SHORT)
    adm.enqueued("default", Lane.SHORT)
    refused = adm.decide("default", Lane.SHORT, None)
    assert not refused.admitted and refused.reason is RejectReason.LANE_FULL and refused.retry_after_ms >= 100
    adm.observe(snapshot(short=0, rps=10.0))
    assert adm.decide("default", Lane.SHORT, None).admitted, "a new snapshot replaces the local count"


def test_deadline_from_request_or_default() -> None:
    adm = EdgeAdmission(EdgeSettings(default_deadline_ms=1000))
    adm.observe(snapshot(short=50, rps=10.0))  # 5 s of backlog ahead
    assert not adm.decide("default", Lane.SHORT, None).admitted
    assert adm.decide("default", Lane.SHORT, 10_000).admitted
    decision = adm.decide("default", Lane.SHORT, 2000)
    assert decision.reason is RejectReason.DEADLINE and 2500 <= decision.retry_after_ms <= 3500


def test_malformed_snapshot_is_ignored() -> None:
    adm = EdgeAdmission(EdgeSettings(max_depth_short=1))
    adm.observe(b"{garbage")
    assert adm.decide("default", Lane.SHORT, None).admitted


def test_pools_are_admitted_on_their_own_snapshots() -> None:
    adm = EdgeAdmission(EdgeSettings(max_depth_short=2))
    adm.observe(snapshot(short=5, rps=1.0, pool="large"))
    adm.observe(snapshot(short=0, rps=1.0, pool="small", workers=0))
    assert not adm.decide("large", Lane.SHORT, None).admitted
    assert adm.decide("small", Lane.SHORT, None).admitted
    assert adm.decide("other", Lane.SHORT, None).admitted, "no snapshot: admit"
    assert adm.live_pools() == ["large"] and adm.pools() == ["large", "small"]
    assert adm.num_workers("small") == 0 and adm.num_workers() == 1 and adm.num_workers("other") is None


async def test_a_connection_that_never_finishes_its_headers_is_closed(start_edge) -> None:
    """Slowloris: connections that send nothing, half a request line, or half a WebSocket
    upgrade are closed once ``LANES_HEADER_TIMEOUT_S`` passes (before, held until the client
    left, each an fd of the edge's); a client that sends its request in time is served."""
    import asyncio
    import time as clock

    address = await start_edge(header_timeout_s=0.5)
    host, port = address.split(":")
    partial = [b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n",
               b"GET /v1/chat HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"]
    streams = []
    for head in partial:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head)
        await writer.drain()
        streams.append((reader, writer))
    started = clock.monotonic()
    for reader, writer in streams:
        assert await asyncio.wait_for(reader.read(), 5) == b"", "closed without an answer"
        writer.close()
    assert clock.monotonic() - started < 3
    # A kept-alive connection gets the same deadline for its next request, and is served in time.
    reader, writer = await asyncio.open_connection(host, int(port))
    for _ in range(2):
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
        await asyncio.wait_for(reader.readuntil(b"}"), 5)
        await asyncio.sleep(0.2)
    writer.write(b"GET /healthz HTTP/1.1\r\n")
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


async def test_a_resubmitted_id_is_told_to_resume_not_to_retry_an_overload(start_edge, plane) -> None:
    """An id that exists (here queued by another edge) gets ``duplicate_id`` naming its state
    when its chat would be refused as ``overloaded``: retrying later could never succeed, and
    the answer is there to resume. A new id still gets ``overloaded``."""
    import asyncio
    import json

    import websockets
    from lanes.queue.messages import ChatMessage, RequestPayload

    address = await start_edge(max_depth_short=0, max_depth_medium=0, max_depth_long=0)
    await plane.enqueue(RequestPayload(id="dup-1", messages=(ChatMessage("user", "hi"),), max_tokens=4,
                                       lane=Lane.SHORT), "another-edge")
    async with websockets.connect(f"ws://{address}/v1/chat") as ws:
        async def refusal(rid: str) -> dict:
            await ws.send(json.dumps({"type": "chat", "id": rid, "messages": [{"role": "user", "content": "hi"}]}))
            while (frame := json.loads(await asyncio.wait_for(ws.recv(), 10)))["id"] != rid:
                pass
            return frame

        for attempt in range(100):  # until the edge has read the snapshot (pub/sub)
            await plane.redis.publish(plane.keys.depth_channel, snapshot(short=0, rps=1.0))
            if (await refusal(f"probe-{attempt}")).get("code") == "overloaded":
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the edge never refused on the snapshot")
        dup = await refusal("dup-1")
        assert (dup["code"], dup["message"]) == ("duplicate_id", "request dup-1 already exists (queued); use resume")
        assert (await refusal("new-1"))["code"] == "overloaded"


def test_own_enqueues_stop_counting_once_the_edge_sees_them_start_or_end() -> None:
    """One client's requests in a row, each done in 30 ms: the edge counted each as waiting
    until the next snapshot (0.5 s), so the fourth of four in that half second found a lane of
    three "full" on an idle server, with the 60 s retry hint of a rate that idling had decayed
    to zero (found by the OpenAI audit)."""
    adm = EdgeAdmission(EdgeSettings(max_depth_short=3))
    adm.observe(snapshot(short=0, rps=0.0))
    for rid in ("a", "b", "c"):
        assert adm.decide("default", Lane.SHORT, None).admitted
        adm.enqueued("default", Lane.SHORT, rid)
        adm.left_lane(rid)  # its first token, or its end
        adm.left_lane(rid)  # both: counted off once
    assert adm.decide("default", Lane.SHORT, None).admitted
    for rid in ("d", "e", "f"):
        adm.enqueued("default", Lane.SHORT, rid)
    refused = adm.decide("default", Lane.SHORT, None)
    assert not refused.admitted and refused.reason is RejectReason.LANE_FULL
    assert refused.retry_after_ms == 2_000, "no drain measured: a short hint, not a minute"
    adm.left_lane("e")
    assert adm.decide("default", Lane.SHORT, None).admitted


async def test_live_workers_of_a_pool_the_rules_never_name_are_warned_about(start_edge, plane, caplog) -> None:
    """A typo in a worker's LANES_POOL ran silently: an idle GPU that no chat could reach."""
    import asyncio
    import logging
    from pathlib import Path

    rules = Path(__file__).resolve().parents[1] / "deploy" / "routing.toml"
    await start_edge(routing_file=str(rules))
    caplog.set_level(logging.WARNING, logger="lanes.ws_server.edge")
    for _ in range(100):
        await plane.redis.publish(plane.keys.depth_channel, snapshot(short=0, rps=1.0, pool="rogue"))
        await plane.redis.publish(plane.keys.depth_channel, snapshot(short=0, rps=1.0, pool="small"))
        if "'rogue'" in caplog.text:
            break
        await asyncio.sleep(0.05)
    warnings = [r.getMessage() for r in caplog.records if "never send a chat there" in r.getMessage()]
    assert len(warnings) == 1 and "'rogue'" in warnings[0] and "LANES_POOL" in warnings[0], warnings
