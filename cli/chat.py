"""``lanes chat``: a terminal client that streams one answer and prints its timing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import time
import uuid

import websockets

from lanes.cli.failures import ConfigFailure, Failure


async def chat(url: str, prompt: str, max_tokens: int, temperature: float, out: object = sys.stdout,
               api_key: str = "", model: str | None = None) -> dict:
    """Send one chat request; stream text to ``out``; return the ``done`` (or ``error``) frame."""
    request_id = uuid.uuid4().hex[:12]
    frame = {"type": "chat", "id": request_id, "messages": [{"role": "user", "content": prompt}],
             "max_tokens": max_tokens, "temperature": temperature}
    if model:
        frame["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with websockets.connect(url, max_size=None, additional_headers=headers) as ws:
        sent = time.perf_counter()
        await ws.send(json.dumps(frame))
        try:
            async for raw in ws:
                msg = json.loads(raw)
                if msg["type"] == "accepted":
                    pool = f"pool {msg['pool']}, " if msg.get("pool") else ""
                    print(f"[{pool}{msg['lane']} lane, ~{msg['predicted_tokens']} tokens predicted]", file=sys.stderr)
                elif msg["type"] == "delta":
                    out.write(msg["text"])  # type: ignore[attr-defined]
                    out.flush()  # type: ignore[attr-defined]
                elif msg["type"] in ("done", "error"):
                    msg["client_total_ms"] = (time.perf_counter() - sent) * 1000
                    return msg
        except asyncio.CancelledError:
            # Ctrl-C (asyncio.run cancels us): cancel the request, or the edge takes the closed
            # connection for a client that may resume, and the answer went on being generated
            # for LANES_RESUME_GRACE_S (15 s) after the user stopped it.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.send(json.dumps({"type": "cancel", "id": request_id})), 1.0)
            out.write("\n")  # type: ignore[attr-defined]
            print("interrupted: request cancelled", file=sys.stderr)
            raise
    raise Failure(f"the edge at {url} closed the connection before the answer finished")


def _connect_failure(url: str, exc: BaseException) -> Failure:
    """What the user must change (a URL, a key: ``ConfigFailure``, exit 2), or what may pass (an
    edge not up yet: exit 1)."""
    if isinstance(exc, websockets.InvalidURI):
        return ConfigFailure(f"{url} is not a WebSocket URL (--url): use ws://HOST:PORT/v1/chat")
    if isinstance(exc, websockets.InvalidStatus):
        if exc.response.status_code == 401:
            return ConfigFailure(f"{url} refused the API key (HTTP 401): pass one with --api-key or LANES_API_KEY "
                                 "(`lanes keys create NAME` makes one)")
        return ConfigFailure(f"{url} answered HTTP {exc.response.status_code} instead of a WebSocket "
                             "(--url): is the path /v1/chat?")
    if isinstance(exc, socket.gaierror) and exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)):
        return ConfigFailure(f"cannot connect to {url}: unknown host (--url)")
    reason = "connection refused" if isinstance(exc, ConnectionRefusedError) else (str(exc) or type(exc).__name__)
    return Failure(f"cannot connect to {url}: {reason}; is `lanes up` (or `lanes edge`) running "
                   "there? (--url)")


def run_chat(url: str, prompt: str, max_tokens: int, temperature: float, api_key: str = "",
             model: str | None = None) -> int:
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        # Bytes that are not UTF-8 reach Python as lone surrogates; sent on, the edge refused the
        # frame as "not valid JSON", as if the client were broken.
        byte = prompt[exc.start].encode("utf-8", "surrogateescape")[0]
        raise ConfigFailure(f"the prompt is not UTF-8 text (byte 0x{byte:02x} at character {exc.start}): pass "
                            "UTF-8 text (a terminal in a UTF-8 locale, such as LANG=C.UTF-8, sends it)") from None
    try:
        result = asyncio.run(chat(url, prompt, max_tokens, temperature, api_key=api_key, model=model))
    except (OSError, asyncio.TimeoutError, websockets.InvalidURI, websockets.InvalidHandshake) as exc:
        raise _connect_failure(url, exc) from None
    except websockets.ConnectionClosed as exc:
        raise Failure(f"the edge at {url} closed the connection ({exc})") from None
    print()
    if result["type"] == "error":
        print(f"error: {result['code']}: {result['message']}", file=sys.stderr)
        return 1
    timing, usage = result["timing"], result["usage"]
    decode_s = (timing["total_ms"] - timing["ttft_ms"]) / 1000
    # A fixed answer arrives at once (no decode time): a rate would be meaningless.
    speed = f" · {(usage['completion_tokens'] - 1) / decode_s:.0f} tokens/s" \
        if usage["completion_tokens"] > 1 and decode_s >= 0.001 else ""
    print(f"-- {result['finish_reason']} · {usage['prompt_tokens']} prompt + {usage['completion_tokens']} "
          f"completion tokens · queue {timing['queue_ms']:.1f} ms · TTFT {timing['ttft_ms']:.1f} ms · "
          f"total {timing['total_ms']:.1f} ms{speed}", file=sys.stderr)
    return 0
