"""A TCP proxy that can black-hole the connections it holds: what a network partition, or a
Redis address moved to a new primary on failover, does to a client's open connections.

``black_hole()`` stops forwarding both ways on every connection open at that moment, and keeps
their sockets open (no FIN, no RST): the client's writes succeed and its reads wait, as they
would for a host that vanished. Connections opened afterwards are forwarded as usual (the
failover case: the address answers again, on a new server). It runs its own event loop in a
thread, so a test's blocking calls (the process harness waits synchronously) never stall it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Pair:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter
    pumps: list[asyncio.Task[None]] = field(default_factory=list)
    #: Every byte the client sent so far (for ``black_hole(sent=...)``), up to 64 KiB.
    sent: bytearray = field(default_factory=bytearray)
    holed: bool = False


class BlackHoleProxy:
    """``127.0.0.1:<port>`` forwarding to ``upstream_host:upstream_port``."""

    def __init__(self, upstream_host: str, upstream_port: int, port: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._loop = asyncio.new_event_loop()
        self._pairs: set[_Pair] = set()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="blackhole-proxy", daemon=True)
        self._thread.start()
        self.port: int = self._call(self._start(port))

    def url(self, db: int = 0, query: str = "") -> str:
        return f"redis://127.0.0.1:{self.port}/{db}" + (f"?{query}" if query else "")

    def black_hole(self, sent: bytes | None = None) -> int:
        """Stop forwarding on the open connections (those whose client has sent ``sent``, a
        substring of its commands such as ``b"SUBSCRIBE"``, when given); returns how many."""
        return self._call(self._black_hole(sent))

    def open_connections(self) -> int:
        """Connections forwarded now (not black-holed)."""
        return self._call(self._count())

    def close(self) -> None:
        """Stop listening and close every socket, black-holed ones included."""
        with contextlib.suppress(RuntimeError):
            self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> BlackHoleProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the proxy's own loop ----------------------------------------------------------

    def _call(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self, port: int) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port)
        return int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        for writer in (client_writer, up_writer):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(client_writer, up_writer)
        self._pairs.add(pair)
        pair.pumps = [asyncio.create_task(self._pump(client_reader, up_writer, pair, record=True)),
                      asyncio.create_task(self._pump(up_reader, client_writer, pair, record=False))]

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pair: _Pair,
                    record: bool) -> None:
        try:
            while data := await reader.read(65536):
                if record and len(pair.sent) < 65536:
                    pair.sent += data[:65536 - len(pair.sent)]
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        # One side closed (not black-holed: those pumps were cancelled): close both, as a
        # plain forwarder would.
        if not pair.holed:
            self._drop(pair)

    def _drop(self, pair: _Pair) -> None:
        self._pairs.discard(pair)
        for task in pair.pumps:
            task.cancel()
        for writer in (pair.client, pair.upstream):
            writer.close()

    async def _black_hole(self, sent: bytes | None) -> int:
        count = 0
        for pair in list(self._pairs):
            if pair.holed or (sent is not None and sent.lower() not in bytes(pair.sent).lower()):
                continue
            pair.holed = True
            for task in pair.pumps:
                task.cancel()  # nothing read, nothing written: the sockets stay open, silent
            count += 1
        return count

    async def _count(self) -> int:
        return sum(not pair.holed for pair in self._pairs)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        for pair in list(self._pairs):
            self._drop(pair)
