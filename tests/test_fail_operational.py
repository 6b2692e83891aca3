"""Operational failures of running processes (an adversarial audit's findings): each ends in one
line per state change and the process recovers or stops cleanly. Real processes, real Redis,
real sockets, the real tiny model."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

from lanes.queue.embedded import free_port

from conftest import scaled


def test_an_edge_out_of_file_descriptors_says_so_once_and_recovers(redis_url: str) -> None:
    """At ``ulimit -n 48`` and 80 clients at once, CPython's accept loop (before gh-151615)
    logged a traceback for every waiting connection and multiplied its retries: 13.6 million
    log lines (1 GB) in 4 minutes, and the edge never accepted again. Now: one warning naming
    the limit, one line when the queue is drained, and new clients are served afterwards."""
    import resource

    import websockets

    port = free_port()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    env = {**os.environ, "LANES_REDIS_URL": redis_url, "LANES_KEY_PREFIX": f"fd{uuid.uuid4().hex[:6]}"}
    edge = subprocess.Popen([sys.executable, "-m", "lanes.cli.main", "edge", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=limit)
    url = f"ws://127.0.0.1:{port}/v1/chat"

    async def connect() -> object | None:
        try:
            return await websockets.connect(url, open_timeout=scaled(3))
        except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake):
            return None

    async def flood() -> tuple[int, bool]:
        deadline = time.monotonic() + scaled(60)
        while await connect() is None:  # the edge is up
            assert time.monotonic() < deadline and edge.poll() is None
            await asyncio.sleep(0.2)
        opened = [c for c in await asyncio.gather(*(connect() for _ in range(80))) if c is not None]
        await asyncio.sleep(1.5)
        for conn in opened:
            await conn.close()
        await asyncio.sleep(1.5)  # the pause asyncio takes after EMFILE is 1 s
        after = await connect()
        if after is not None:
            await after.close()
        return len(opened), after is not None

    try:
        num_open, served_after = asyncio.run(flood())
    finally:
        edge.send_signal(signal.SIGTERM)
        out = edge.communicate(timeout=scaled(60))[0]
    assert num_open < 80, "the limit was not reached: nothing was tested"
    assert served_after, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    warnings = [line for line in out.splitlines() if "cannot accept new connections" in line]
    assert 1 <= len(warnings) <= 3, out[-3000:]
    assert "Too many open files (open files limit 48; each connection is one)" in warnings[0]
    assert "accepting connections again after" in out
    assert len(out.splitlines()) < 20 + 4 * 80, out[-3000:]  # uvicorn's open/closed lines, not millions
