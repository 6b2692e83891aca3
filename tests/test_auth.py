"""API keys, Origin allowlist and per-key limits, through real WebSocket handshakes to a real
edge (in this process) on a real redis-server; keys made by the real ``lanes keys`` CLI.

No worker runs here, so accepted requests stay queued: that is what keeps them in flight
for the in-flight cap tests.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import redis
import websockets
from conftest import StartEdge
from e2e_support import Client
from lanes.cli.main import app
from lanes.ws_server.auth import (
    bearer_token,
    generate_key,
    hash_key,
    key_id,
    origin_allowed,
    parse_csv,
)
from lanes.ws_server.protocol import scoped_id
from starlette.datastructures import Headers
from typer.testing import CliRunner
from websockets.exceptions import InvalidStatus

# -- pure parts ----------------------------------------------------------------------


def test_keys_are_random_prefixed_and_hashed_with_sha256() -> None:
    keys = {generate_key() for _ in range(1000)}
    assert len(keys) == 1000 and all(k.startswith("lanes_") and len(k) == 49 for k in keys)
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # FIPS 180-2 vector


def headers(*pairs: tuple[str, str]) -> Headers:
    return Headers(raw=[(k.lower().encode(), v.encode()) for k, v in pairs])


def test_bearer_parsing() -> None:
    assert bearer_token(headers(("Authorization", "Bearer k1"))) == "k1"
    assert bearer_token(headers(("authorization", "bearer   k1 "))) == "k1"
    for bad in ("k1", "Basic k1", "Bearer", "Bearer a b", "Bearer " + "x" * 300):
        assert bearer_token(headers(("Authorization", bad))) is None, bad
    assert bearer_token(headers(("Authorization", "Bearer a"), ("Authorization", "Bearer b"))) is None
    assert bearer_token(headers()) is None


def test_origin_matching() -> None:
    allowed = parse_csv("https://App.example.com/, http://localhost:3000", lower=True)
    assert origin_allowed("https://app.example.com", allowed)
    assert origin_allowed("http://localhost:3000", allowed)
    assert not origin_allowed("https://app.example.com.evil.net", allowed)
    assert not origin_allowed("null", allowed)
    assert origin_allowed(None, allowed), "non-browser clients send no Origin"
    assert origin_allowed("https://anything", frozenset()), "empty allowlist allows all"


# -- fixtures ------------------------------------------------------------------------


@pytest.fixture
def cli(redis_url: str, key_prefix: str) -> Callable[..., Any]:
    """Run ``lanes ...`` in-process against the test Redis and key prefix."""
    runner = CliRunner()

    def run(*args: str, expect: int = 0) -> Any:
        result = runner.invoke(app, list(args), env={"LANES_REDIS_URL": redis_url, "LANES_KEY_PREFIX": key_prefix})
        assert result.exit_code == expect, (result.stdout, result.stderr, result.exception)
        return result

    return run


@pytest.fixture
def create_key(cli: Callable[..., Any]) -> Callable[..., str]:
    def create(name: str, *options: str) -> str:
        return cli("keys", "create", name, *options).stdout.strip()

    return create


@pytest.fixture
def start_edge(start_edge: StartEdge) -> StartEdge:
    """conftest's in-process edge, returning its ``ws://`` base URL."""
    async def start(**overrides: Any) -> str:
        return f"ws://{await start_edge(**overrides)}"

    return start


async def connect(base: str, key: str | None = None, *, origin: str | None = None, query: str = "") -> Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    ws = await websockets.connect(f"{base}/v1/chat{query}", additional_headers=headers, origin=origin)  # type: ignore[arg-type]
    return Client(ws)


async def handshake_status(base: str, key: str | None = None, **kwargs: Any) -> int:
    """101 if the handshake succeeds, else the HTTP status the edge refused it with."""
    try:
        client = await connect(base, key, **kwargs)
    except InvalidStatus as exc:
        return exc.response.status_code
    await client.close()
    return 101


async def first_answer(client: Client, request_id: str, timeout_s: float = 10) -> dict[str, Any]:
    """The first accepted/error frame of a request."""
    async def wait() -> dict[str, Any]:
        while not client.frames[request_id]:
            await asyncio.sleep(0.005)
        return client.frames[request_id][0]

    return await asyncio.wait_for(wait(), timeout_s)


def http_get(base: str, path: str, key: str | None = None) -> int:
    request = urllib.request.Request(base.replace("ws://", "http://") + path)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


# -- the CLI -------------------------------------------------------------------------


def test_keys_cli_prints_the_key_once_and_stores_only_its_hash(
        cli: Callable[..., Any], create_key: Callable[..., str], redis_url: str, key_prefix: str) -> None:
    key = create_key("team-a", "--rate-per-s", "5", "--burst", "7", "--max-in-flight", "3")
    assert key.startswith("lanes_") and len(key) == 49
    client = redis.Redis.from_url(redis_url)
    try:
        names = list(client.scan_iter(match=f"{key_prefix}:*"))
        assert names == [f"{key_prefix}:keys:{hash_key(key)}".encode()]
        record = json.loads(client.get(names[0]))
        assert record["name"] == "team-a" and record["created_at_s"] > 0
        assert (record["rate_per_s"], record["burst"], record["max_in_flight"]) == (5.0, 7, 3)
        secret_part = key[len("lanes_") + 4:]  # what the hint does not show
        assert all(secret_part.encode() not in name + client.get(name) for name in names), "key stored in clear"
        listing = cli("keys", "list").stdout
        assert "team-a" in listing and hash_key(key)[:12] in listing and secret_part not in listing
        cli("keys", "create", "team-a", expect=1)  # names are unique
        assert "revoked 1 key" in cli("keys", "revoke", "team-a").stdout
        assert list(client.scan_iter(match=f"{key_prefix}:*")) == []
        cli("keys", "revoke", "team-a", expect=1)
    finally:
        client.close()


# -- handshakes ----------------------------------------------------------------------


async def test_auth_is_off_by_default(start_edge: StartEdge) -> None:
    base = await start_edge()
    client = await connect(base)
    await client.chat("open-1", "hello")
    assert (await first_answer(client, "open-1"))["type"] == "accepted"
    await client.close()


async def test_a_websocket_at_another_path_is_not_found(start_edge: StartEdge) -> None:
    """404 as for HTTP, and the body names the chat path (a close before the accept reads 403)."""
    base = await start_edge()
    with pytest.raises(InvalidStatus) as refused:
        await websockets.connect(f"{base}/v1/chats")
    assert refused.value.response.status_code == 404
    assert refused.value.response.body == b"no WebSocket at /v1/chats; chats are at /v1/chat\n"


async def test_handshake_needs_a_valid_bearer_key(
        start_edge: StartEdge, create_key: Callable[..., str], cli: Callable[..., Any],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO")
    key = create_key("svc")
    base = await start_edge(auth_required=True)
    assert await handshake_status(base) == 401
    assert await handshake_status(base, generate_key()) == 401, "unknown key"
    assert await handshake_status(base, key[:-1]) == 401, "truncated key"
    assert await handshake_status(base, query=f"?api_key={key}") == 401, "keys in query strings are refused"
    assert '"WebSocket /v1/chat?[query hidden]" 401' in caplog.text and key not in caplog.text, \
        "uvicorn logs a handshake's query string: never the key"
    with pytest.raises(InvalidStatus) as refused:
        await connect(base)
    assert refused.value.response.headers["WWW-Authenticate"].startswith("Bearer")
    client = await connect(base, key)
    await client.chat("authed-1", "hello")
    assert (await first_answer(client, "authed-1"))["type"] == "accepted"
    cli("keys", "revoke", "svc")
    assert await handshake_status(base, key) == 401, "a revoked key is refused at the next handshake"
    await client.close()


async def test_revoking_a_key_closes_its_open_connections_and_cancels_their_requests(
        start_edge: StartEdge, create_key: Callable[..., str], cli: Callable[..., Any], plane: Any) -> None:
    """Before, a connection kept its handshake's identity for as long as the client held it open."""
    leaked, other = create_key("leaked"), create_key("other")
    base = await start_edge(auth_required=True, key_recheck_s=0.2)
    client, bystander = await connect(base, leaked), await connect(base, other)
    await client.chat("queued-1", "hello")  # no worker here: it stays queued
    assert (await first_answer(client, "queued-1"))["type"] == "accepted"
    cli("keys", "revoke", "leaked")
    await asyncio.wait_for(client.ws.wait_closed(), 5)
    assert (client.ws.close_code, client.ws.close_reason) == (4003, "API key revoked")
    request_id = plane.keys.request(scoped_id(key_id(hash_key(leaked)), "queued-1"))
    for _ in range(50):  # the edge cancels it at once: nobody may resume it
        if await plane.redis.hget(request_id, "state") == b"cancelled":
            break
        await asyncio.sleep(0.1)
    assert await plane.redis.hget(request_id, "state") == b"cancelled"
    await bystander.chat("still-fine", "hello")
    assert (await first_answer(bystander, "still-fine"))["type"] == "accepted", "other keys' connections stay"
    await bystander.close()


async def test_revoking_a_key_ends_its_openai_requests_with_401(
        start_edge: StartEdge, create_key: Callable[..., str], cli: Callable[..., Any], plane: Any) -> None:
    """An OpenAI request's key was checked only when it arrived: revoked meanwhile, a stream ran
    to its end (seen: 338 tokens after the revoke, with the official client) and a queued request
    waited on. Now the key is looked up again like a WebSocket's: the request is cancelled and the
    answer is a 401 in OpenAI's shape. (A stream whose 200 is already out ends with the same
    error as an event, which the SDK raises: the same frame, shown by hand on a live system.)"""
    import openai

    key = create_key("leaked-http")
    base = (await start_edge(auth_required=True, key_recheck_s=0.2)).replace("ws://", "http://")
    sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
    ask = {"model": "default", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    # No worker here: both stay queued, and a stream's status waits for its first frame.
    waiting = [asyncio.create_task(sdk.chat.completions.create(**ask)),
               asyncio.create_task(sdk.chat.completions.create(**ask, stream=True))]
    pattern = plane.keys.request("*chatcmpl-*")  # scoped by the key: <key id>...chatcmpl-...
    for _ in range(100):
        if len(queued := await plane.redis.keys(pattern)) == 2:
            break
        await asyncio.sleep(0.1)
    assert len(queued) == 2, queued
    cli("keys", "revoke", "leaked-http")
    for task in waiting:
        with pytest.raises(openai.AuthenticationError) as revoked:
            await asyncio.wait_for(task, 10)
        assert (revoked.value.status_code, revoked.value.body["code"]) == (401, "invalid_api_key")
        assert "revoked while this request ran" in revoked.value.body["message"]
    for request_key in queued:
        for _ in range(50):
            if await plane.redis.hget(request_key, "state") == b"cancelled":
                break
            await asyncio.sleep(0.1)
        assert await plane.redis.hget(request_key, "state") == b"cancelled", request_key
    await sdk.close()


async def test_lanes_chat_sends_its_api_key_and_model(start_edge: StartEdge, create_key: Callable[..., str]) -> None:
    """``lanes chat --api-key`` (or ``LANES_API_KEY``) and ``--model``: before, the CLI could not
    reach an edge that requires keys at all, and its 401 message asked whether a key was set."""
    import io

    from lanes.cli.chat import _connect_failure, chat

    key = create_key("terminal")
    url = f"{await start_edge(auth_required=True)}/v1/chat"
    with pytest.raises(InvalidStatus) as refused:
        await chat(url, "hello", 8, 0.7, out=io.StringIO())
    assert "--api-key or LANES_API_KEY" in str(_connect_failure(url, refused.value))
    # No worker runs here: a model nobody serves is answered at once, through the authed handshake.
    result = await chat(url, "hello", 8, 0.7, out=io.StringIO(), api_key=key, model="gigantic")
    assert result["type"] == "error" and result["code"] == "model_not_found", result


async def test_static_hashes_from_settings_turn_auth_on(start_edge: StartEdge) -> None:
    key = generate_key()
    base = await start_edge(api_key_hashes=f" {hash_key(key).upper()} ,")  # auth_required left False
    assert await handshake_status(base) == 401, "hashes configured: never fail open"
    assert await handshake_status(base, key) == 101


async def test_http_paths_healthz_open_metrics_protected(start_edge: StartEdge, create_key: Callable[..., str]) -> None:
    key = create_key("prom")
    base = await start_edge(auth_required=True)
    statuses = await asyncio.to_thread(lambda: {
        "healthz": http_get(base, "/healthz"), "dashboard": http_get(base, "/dashboard"),
        "metrics": http_get(base, "/metrics"), "depths": http_get(base, "/v1/depths"),
        "metrics+key": http_get(base, "/metrics", key), "depths+key": http_get(base, "/v1/depths", key),
        "metrics+bad": http_get(base, "/metrics", generate_key()),
        # A pool name becomes part of a Redis key: braces (a cluster hash tag), newlines refused.
        "depths+bad-pool": http_get(base, "/v1/depths?pool=evil%7D%0A:x", key),
    })
    assert statuses == {"healthz": 200, "dashboard": 200, "metrics": 401, "depths": 401,
                        "metrics+key": 200, "depths+key": 200, "metrics+bad": 401, "depths+bad-pool": 400}
    open_metrics = await start_edge(auth_required=True, protect_metrics=False)
    assert await asyncio.to_thread(http_get, open_metrics, "/metrics") == 200


async def test_origin_allowlist(start_edge: StartEdge, create_key: Callable[..., str]) -> None:
    base = await start_edge(allowed_origins="https://app.example.com, http://localhost:3000")
    assert await handshake_status(base, origin="https://evil.example.net") == 403
    assert await handshake_status(base, origin="https://app.example.com") == 101
    assert await handshake_status(base, origin="http://localhost:3000") == 101
    assert await handshake_status(base) == 101, "no Origin: not a browser"
    key = create_key("web")
    authed = await start_edge(auth_required=True, allowed_origins="https://app.example.com")
    assert await handshake_status(authed, key, origin="https://evil.example.net") == 403, "a valid key does not help"
    assert await handshake_status(authed, origin="https://app.example.com") == 401, "an allowed origin needs a key"


# -- per-key limits ------------------------------------------------------------------


async def test_a_key_may_hold_only_so_many_websockets_open(start_edge: StartEdge,
                                                          create_key: Callable[..., str]) -> None:
    """One tenant could open connections until the edge ran out of file descriptors."""
    key = create_key("pool", "--max-connections", "2")
    base = await start_edge(auth_required=True)
    first, second = await connect(base, key), await connect(base, key)
    with pytest.raises(InvalidStatus) as refused:
        await connect(base, key)
    assert refused.value.response.status_code == 429 and refused.value.response.headers["Retry-After"] == "1"
    assert b"at most 2 WebSockets" in refused.value.response.body
    other = await connect(base, create_key("other"))  # another key is not counted with it
    await first.close()
    for _ in range(50):  # the edge sees the close
        try:
            third = await connect(base, key)
            break
        except InvalidStatus:
            await asyncio.sleep(0.05)
    await third.chat("after", "hello")
    assert (await first_answer(third, "after"))["type"] == "accepted"
    # A dashboard stream holds a connection too: it counts against the same cap.
    status = await asyncio.to_thread(http_get, base, "/v1/stats/stream", key)
    assert status == 429
    for client in (second, third, other):
        await client.close()


async def test_rate_limited_frame_carries_retry_after(start_edge: StartEdge, create_key: Callable[..., str]) -> None:
    key = create_key("bursty", "--rate-per-s", "1", "--burst", "2", "--max-in-flight", "0")
    base = await start_edge(auth_required=True)
    client = await connect(base, key)
    for i in range(3):
        await client.chat(f"rl-{i}", "hello")
    answers = [await first_answer(client, f"rl-{i}") for i in range(3)]
    assert [a["type"] for a in answers] == ["accepted", "accepted", "error"]
    assert answers[2]["code"] == "rate_limited" and 0 < answers[2]["retry_after_ms"] <= 1000
    await asyncio.sleep(answers[2]["retry_after_ms"] / 1000 + 0.05)
    await client.chat("rl-after-wait", "hello")
    assert (await first_answer(client, "rl-after-wait"))["type"] == "accepted"
    await client.close()
    # A resume reads a stream back (a finished answer could be replayed without end): it costs
    # the key's rate too.
    again = await connect(base, key)
    ids = ["rl-0", "rl-1", "rl-after-wait"]
    for request_id in ids:  # three at once: the bucket holds two at most
        await again.send({"type": "resume", "id": request_id, "last_seq": -1})
    answers = [await first_answer(again, request_id) for request_id in ids]
    refused = [a for a in answers if a.get("code") == "rate_limited"]
    assert refused and all(a["retry_after_ms"] > 0 for a in refused), answers
    await asyncio.sleep(max(a["retry_after_ms"] for a in refused) / 1000 + 0.05)
    retried = refused[0]["id"]
    await again.send({"type": "resume", "id": retried, "last_seq": -1})
    for _ in range(200):
        if len(again.frames[retried]) > 1:
            break
        await asyncio.sleep(0.01)
    assert again.frames[retried][1]["type"] == "resumed", "after the wait it goes through"
    await again.close()
    # A WebSocket ticket (one Redis key each) costs a token too.
    codes = [await asyncio.to_thread(post_status, base, "/v1/ws-ticket", key) for _ in range(4)]
    assert 429 in codes and codes[0] in (200, 429), codes


def post_status(base: str, path: str, key: str) -> int:
    request = urllib.request.Request(base.replace("ws://", "http://") + path, data=b"", method="POST",
                                     headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


async def test_in_flight_cap_spans_the_keys_connections(start_edge: StartEdge, create_key: Callable[..., str]) -> None:
    capped = create_key("capped", "--rate-per-s", "0", "--max-in-flight", "2")
    other = create_key("other", "--rate-per-s", "0", "--max-in-flight", "2")
    base = await start_edge(auth_required=True)
    a, b, c = await connect(base, capped), await connect(base, capped), await connect(base, other)
    await a.chat("cap-a1", "hello")
    assert (await first_answer(a, "cap-a1"))["type"] == "accepted"
    await b.chat("cap-b1", "hello")
    assert (await first_answer(b, "cap-b1"))["type"] == "accepted"
    await b.chat("cap-b2", "hello")
    refused = await first_answer(b, "cap-b2")
    assert refused["type"] == "error" and refused["code"] == "too_many_in_flight" and "retry_after_ms" not in refused
    await c.chat("cap-c1", "hello")
    assert (await first_answer(c, "cap-c1"))["type"] == "accepted", "another key has its own cap"
    await a.send({"type": "cancel", "id": "cap-a1"})
    assert (await a.wait("cap-a1"))["finish_reason"] == "cancelled"
    await b.chat("cap-b3", "hello")
    assert (await first_answer(b, "cap-b3"))["type"] == "accepted", "a finished request frees its slot"
    await a.close()
    await asyncio.sleep(0.2)  # the edge cancels a closed connection's requests (none left on a)
    await b.chat("cap-b4", "hello")
    assert (await first_answer(b, "cap-b4"))["code"] == "too_many_in_flight"
    for client in (b, c):
        await client.close()


async def test_only_the_submitting_key_can_resume(start_edge: StartEdge, create_key: Callable[..., str]) -> None:
    owner, stranger = create_key("owner"), create_key("stranger")
    base = await start_edge(auth_required=True)
    a = await connect(base, owner)
    await a.chat("mine", "hello")  # no worker runs here: it stays queued
    assert (await first_answer(a, "mine"))["type"] == "accepted"
    b = await connect(base, stranger)
    await b.send({"type": "resume", "id": "mine", "last_seq": -1})
    refused = await first_answer(b, "mine")
    assert refused["type"] == "error" and refused["code"] == "unknown_id", "not probeable by another key"
    c = await connect(base, owner)
    await c.send({"type": "resume", "id": "mine", "last_seq": -1})
    await asyncio.sleep(0.3)
    assert not [f for f in c.frames["mine"] if f["type"] == "error"], "the owner may resume it"
    for client in (a, b, c):
        await client.close()


async def test_fleet_rate_limit_is_shared_by_every_edge(start_edge: StartEdge, create_key: Callable[..., str]) -> None:
    """Two edges, one key, rate 1/s burst 2: the third request is refused on either edge."""
    key = create_key("fleet", "--rate-per-s", "1", "--burst", "2", "--max-in-flight", "0")
    edge_a = await start_edge(auth_required=True, rate_limit_scope="fleet")
    edge_b = await start_edge(auth_required=True, rate_limit_scope="fleet")
    a, b = await connect(edge_a, key), await connect(edge_b, key)
    await a.chat("f-1", "hello")
    await b.chat("f-2", "hello")
    assert (await first_answer(a, "f-1"))["type"] == "accepted"
    assert (await first_answer(b, "f-2"))["type"] == "accepted"
    await a.chat("f-3", "hello")
    refused = await first_answer(a, "f-3")
    assert refused["code"] == "rate_limited" and 0 < refused["retry_after_ms"] <= 1000
    # The same words as an edge's own bucket (was "over 1 requests/s for this key": no burst, no wait).
    assert refused["message"] == f"this API key is limited to 1 requests/s (burst 2); retry in {refused['retry_after_ms']} ms"
    await asyncio.sleep(refused["retry_after_ms"] / 1000 + 0.05)
    await b.chat("f-4", "hello")
    assert (await first_answer(b, "f-4"))["type"] == "accepted"
    for client in (a, b):
        await client.close()


async def test_a_resume_whose_fleet_rate_check_finds_redis_down_is_refused_not_a_dead_socket() -> None:
    """With the rate in Redis (LANES_RATE_LIMIT_SCOPE=fleet), the resume's new rate check raised
    out of the frame handler: the WebSocket died (1011) with a traceback, every request on it with
    it. Now the resume gets ``unavailable``, as a chat does. (Nothing listens at the Redis port.)"""
    from lanes.queue.plane import QueuePlane
    from lanes.ws_server.auth import Identity
    from lanes.ws_server.edge import Edge
    from lanes.ws_server.ratelimit import KeyLimits
    from lanes.ws_server.settings import EdgeSettings

    class Recorder:
        closed = False

        def __init__(self) -> None:
            self.frames: list[dict[str, Any]] = []

        def send(self, frame: bytes) -> None:
            self.frames.append(json.loads(frame))

    settings = EdgeSettings(redis_url="redis://127.0.0.1:1/0", auth_required=True, rate_limit_scope="fleet", port=0)
    edge = Edge(settings, QueuePlane.from_settings(settings))
    identity = Identity(key_id("cd" * 32), "k", KeyLimits(rate_per_s=10, burst=20, max_in_flight=8), "cd" * 32)
    edge.sessions[1] = session = Recorder()  # type: ignore[assignment]
    await edge.on_frame(1, identity, '{"type":"chat","id":"c1","messages":[{"role":"user","content":"hi"}]}')
    await edge.on_frame(1, identity, '{"type":"resume","id":"c1","last_seq":3}')
    assert [(f["code"], f["id"]) for f in session.frames] == [("unavailable", "c1"), ("unavailable", "c1")]
    assert "retry the resume" in session.frames[1]["message"] and session.frames[1]["retry_after_ms"] > 0
    await edge.plane.close()


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_ticket_ttl_or_any_edge_period_that_is_not_finite_is_refused_at_start(value: str) -> None:
    """``LANES_WS_TICKET_TTL_S=inf`` started an edge whose every ``POST /v1/ws-ticket`` was a 500
    (``int(inf * 1000)``); no float setting of the edge means anything at inf or NaN."""
    from lanes.cli.failures import settings_error
    from lanes.ws_server.settings import EdgeSettings
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as refused:
        EdgeSettings(_env_file=None, ws_ticket_ttl_s=value)
    assert f"LANES_WS_TICKET_TTL_S='{value}': Input should be a finite number" in (settings_error(refused.value) or "")
    floats = [name for name, field in EdgeSettings.model_fields.items() if field.annotation is float]
    assert {"ws_ticket_ttl_s", "heartbeat_s", "resume_grace_s", "key_rate_per_s", "header_timeout_s"} <= set(floats)
    for name in floats:
        with pytest.raises(ValidationError, match=name):
            EdgeSettings(_env_file=None, **{name: value})
