"""How a browser authenticates when API keys are on: single-use WebSocket tickets.

A real edge (in this process) on a real redis-server, keys made by the real ``lanes keys`` CLI,
real WebSocket handshakes. A ticket comes from ``POST /v1/ws-ticket`` with ``Authorization:
Bearer <key>``, works for exactly one handshake within its TTL, and stands for its key (same
limits, same requests to resume); expired, reused, forged and malformed tickets get 401.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import websockets
from conftest import StartEdge
from e2e_support import Client
from lanes.cli.main import app
from lanes.queue.plane import QueuePlane
from lanes.ws_server.auth import generate_key, hash_key, ticket_param
from typer.testing import CliRunner
from websockets.exceptions import InvalidStatus


def test_ticket_parameter_parsing() -> None:
    assert ticket_param(b"") is None and ticket_param(b"api_key=x") is None
    assert ticket_param(b"ticket=abc") == "abc" and ticket_param(b"a=1&ticket=abc%2D") == "abc-"
    assert ticket_param(b"ticket=a&ticket=b") == "", "two tickets: refused, not a pick"
    assert ticket_param(b"ticket=") == ""


@pytest.fixture
def cli(redis_url: str, key_prefix: str) -> Callable[..., str]:
    """``lanes ...`` in-process against the test Redis and key prefix; returns its stdout."""
    runner = CliRunner()

    def run(*args: str) -> str:
        result = runner.invoke(app, list(args), env={"LANES_REDIS_URL": redis_url, "LANES_KEY_PREFIX": key_prefix})
        assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
        return result.stdout.strip()

    return run


@pytest.fixture
def create_key(cli: Callable[..., str]) -> Callable[..., str]:
    return lambda name: cli("keys", "create", name)


async def post_ticket(host: str, key: str | None = None, origin: str | None = None) -> tuple[int, dict[str, Any]]:
    def post() -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(f"http://{host}/v1/ws-ticket", data=b"", method="POST")
        if key:
            request.add_header("Authorization", f"Bearer {key}")
        if origin:
            request.add_header("Origin", origin)
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, {"text": err.read().decode(), "www_authenticate": err.headers.get("WWW-Authenticate")}

    return await asyncio.to_thread(post)


async def open_chat(host: str, query: str = "", key: str | None = None, origin: str | None = None) -> Client | int:
    """A connected client, or the HTTP status the handshake was refused with."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        ws = await websockets.connect(f"ws://{host}/v1/chat{query}", additional_headers=headers,
                                      origin=origin)  # type: ignore[arg-type]
    except InvalidStatus as exc:
        return exc.response.status_code
    return Client(ws)


async def first_frame(client: Client, request_id: str, timeout_s: float = 10) -> dict[str, Any]:
    async def wait() -> dict[str, Any]:
        while not client.frames[request_id]:
            await asyncio.sleep(0.005)
        return client.frames[request_id][0]

    return await asyncio.wait_for(wait(), timeout_s)


async def test_a_ticket_opens_exactly_one_connection(start_edge: StartEdge, create_key: Callable[..., str]) -> None:
    key = create_key("browser")
    host = await start_edge(auth_required=True)
    status, body = await post_ticket(host, key)
    assert status == 200 and body["auth_required"] is True and body["expires_in_s"] == 10.0
    ticket = body["ticket"]
    assert len(ticket) == 43 and key not in ticket
    client = await open_chat(host, f"?ticket={ticket}")
    assert isinstance(client, Client), f"refused with {client}"
    await client.chat("via-ticket", "hello")  # no worker here: it stays queued
    assert (await first_frame(client, "via-ticket"))["type"] == "accepted"
    assert await open_chat(host, f"?ticket={ticket}") == 401, "a used ticket is spent"
    await client.close()


async def test_expired_forged_and_malformed_tickets_are_refused(start_edge: StartEdge,
                                                               create_key: Callable[..., str]) -> None:
    key = create_key("browser")
    host = await start_edge(auth_required=True, ws_ticket_ttl_s=0.3)
    _, body = await post_ticket(host, key)
    await asyncio.sleep(0.6)
    assert await open_chat(host, f"?ticket={body['ticket']}") == 401, "expired"
    _, fresh = await post_ticket(host, key)
    for query in (f"?ticket={generate_key()[6:]}", "?ticket=" + "A" * 500, "?ticket=",
                  f"?ticket={fresh['ticket']}&ticket={fresh['ticket']}", f"?api_key={key}", ""):
        assert await open_chat(host, query) == 401, query
    client = await open_chat(host, f"?ticket={fresh['ticket']}")
    assert isinstance(client, Client), "refused handshakes did not spend the good ticket"
    await client.close()


async def test_a_ticket_shown_to_a_refused_origin_is_spent(start_edge: StartEdge,
                                                          create_key: Callable[..., str]) -> None:
    """A handshake refused for its Origin used its ticket up: before, the ticket stayed live for
    a client that sends no Origin (anything that read it, from a log or a page, got in)."""
    key = create_key("browser")
    host = await start_edge(auth_required=True, allowed_origins="https://app.example.com")
    _, body = await post_ticket(host, key, origin="https://app.example.com")
    assert await open_chat(host, f"?ticket={body['ticket']}", origin="https://evil.example.net") == 403
    assert await open_chat(host, f"?ticket={body['ticket']}") == 401, "spent by the refused handshake"


async def test_only_a_valid_key_gets_a_ticket(start_edge: StartEdge, create_key: Callable[..., str],
                                             cli: Callable[..., str], plane: QueuePlane) -> None:
    key = create_key("browser")
    host = await start_edge(auth_required=True, allowed_origins="https://app.example.com")
    status, body = await post_ticket(host)
    assert status == 401 and body["www_authenticate"].startswith("Bearer") and "API key" in body["text"]
    assert (await post_ticket(host, generate_key()))[0] == 401
    assert (await post_ticket(host, key, origin="https://evil.example.net"))[0] == 403
    status, body = await post_ticket(host, key, origin="https://app.example.com")
    assert status == 200
    stored = await plane.redis.keys(f"{plane.keys.prefix}:ticket:*")
    assert stored == [plane.keys.ws_ticket(hash_key(body["ticket"])).encode()], "Redis holds the ticket's hash only"
    assert await plane.redis.get(stored[0]) == hash_key(key).encode()
    cli("keys", "revoke", "browser")
    assert await open_chat(host, f"?ticket={body['ticket']}") == 401, "a key revoked since the ticket: no entry"


async def test_a_ticket_stands_for_its_key(start_edge: StartEdge, create_key: Callable[..., str]) -> None:
    owner, stranger = create_key("owner"), create_key("stranger")
    host = await start_edge(auth_required=True)
    by_header = await open_chat(host, key=owner)
    assert isinstance(by_header, Client)
    await by_header.chat("owned", "hello")
    assert (await first_frame(by_header, "owned"))["type"] == "accepted"
    strangers = await open_chat(host, f"?ticket={(await post_ticket(host, stranger))[1]['ticket']}")
    owners = await open_chat(host, f"?ticket={(await post_ticket(host, owner))[1]['ticket']}")
    assert isinstance(strangers, Client) and isinstance(owners, Client)
    await strangers.send({"type": "resume", "id": "owned", "last_seq": -1})
    assert (await first_frame(strangers, "owned"))["code"] == "unknown_id"
    await owners.send({"type": "resume", "id": "owned", "last_seq": -1})
    assert (await first_frame(owners, "owned"))["type"] == "resumed", "the owner's ticket resumes the owner's request"
    for client in (by_header, strangers, owners):
        await client.close()


async def test_with_keys_off_no_ticket_is_needed(start_edge: StartEdge) -> None:
    host = await start_edge()
    status, body = await post_ticket(host)
    assert status == 200 and body == {"ticket": None, "expires_in_s": 10.0, "auth_required": False}
    client = await open_chat(host)
    assert isinstance(client, Client)
    await client.close()


async def test_statistics_need_a_key_like_the_depths(start_edge: StartEdge, create_key: Callable[..., str]) -> None:
    key = create_key("ops")
    host = await start_edge(auth_required=True)

    def get(path: str, with_key: bool) -> int:
        request = urllib.request.Request(f"http://{host}{path}")
        if with_key:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                if path.endswith("stream"):
                    assert resp.headers["Content-Type"].startswith("text/event-stream")
                    assert resp.readline() == b"retry: 1000\n"
                return resp.status
        except urllib.error.HTTPError as err:
            return err.code

    for path in ("/v1/stats/history", "/v1/stats/stream", "/v1/depths"):
        assert await asyncio.to_thread(get, path, False) == 401, path
        assert await asyncio.to_thread(get, path, True) == 200, path
    for path in ("/", "/dashboard", "/static/chat.js"):
        assert await asyncio.to_thread(get, path, False) == 200, "pages hold no data: " + path
    open_host = await start_edge(auth_required=True, protect_metrics=False)
    host = open_host
    assert await asyncio.to_thread(get, "/v1/stats/history", False) == 200
