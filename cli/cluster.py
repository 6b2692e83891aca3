"""The one process harness: ``lanes up``, ``lanes chaos``, the end-to-end tests and the
benchmarks all start lanes through it.

A ``Cluster`` is a set of real child processes (``python -m lanes.cli.main scheduler|edge|worker``,
exactly as in production) sharing one Redis and one key prefix: an embedded redis-server it
starts (and can stop and restart on the same port, for chaos) or an external one. Each child's
output goes to ``log_dir/<name>.log`` or, for ``lanes up``, to our stderr prefixed with its
name; either way its last lines are kept for error messages.

Readiness is checked the way a user would see it: an edge is up when ``/healthz`` answers with
*its own* ``edge_id`` (another server on the port does not count), a worker when it has sent a
heartbeat since it started (workers warm their engine before the first one).

Children start in their own session, so a Ctrl-C in the terminal reaches only the supervisor,
which then stops them in order (SIGTERM: workers hand their leases back).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from lanes.queue.embedded import EmbeddedRedis, free_port
from lanes.queue.errors import QueueUnavailable
from lanes.queue.plane import QueuePlane
from lanes.queue.settings import RedisSettings

T = TypeVar("T")

#: Short leases and heartbeats, so that a killed worker's requests come back within ~2 s.
#: The tests and ``lanes chaos`` use them; ``lanes up`` keeps the production defaults.
FAST_FAILOVER_ENV = {"LANES_LEASE_MS": "1500", "LANES_HEARTBEAT_S": "0.3", "LANES_START_TIMEOUT_MS": "1500"}
#: Lines of each child's output kept for messages.
TAIL_LINES = 40


class ChildExited(RuntimeError):
    """A child exited while the harness waited for it; the message carries its last lines."""

    def __init__(self, name: str, returncode: int | None, tail: list[str]) -> None:
        self.name, self.returncode, self.tail = name, returncode, tail
        lines = "\n".join(f"  {line}" for line in tail[-12:])
        super().__init__(f"{name} exited with {returncode}:\n{lines}")



def stop_like_ctrl_c() -> None:
    """SIGTERM and SIGHUP (``timeout``, a cancelled CI job, a closed SSH session) stop this
    command as Ctrl-C does, so its clean-up stops the processes it started: they run in their
    own sessions and get no signal of their own. Before, they were left running under init."""

    def as_sigint(signum: int, frame: object) -> None:
        os.kill(os.getpid(), signal.SIGINT)

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background (`cmd &`, nohup)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, as_sigint)

@dataclass
class Child:
    """One child process and what it takes to start it again."""

    name: str
    args: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    #: Wall clock (ms) at start: a worker is up once its heartbeat is newer than this.
    started_at_ms: int
    started_at: float
    log_path: Path | None
    tail_lines: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    #: Stopped or killed on purpose (not a crash).
    expected_exit: bool = False
    num_starts: int = 1

    @property
    def role(self) -> str:
        return self.args[0] if self.args else ""

    def tail(self, num_lines: int = 12) -> list[str]:
        """The child's last output lines (from its log file, or what the reader kept)."""
        if self.log_path is not None and self.log_path.exists():
            with self.log_path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 16384))
                lines = log.read().decode(errors="replace").splitlines()
        else:
            lines = list(self.tail_lines)
        return [line for line in lines if line.strip()][-num_lines:]


@dataclass
class Cluster:
    """Real lanes processes under one key prefix on one Redis (see the module doc)."""

    redis_url: str
    prefix: str
    #: Each child's output goes to ``<log_dir>/<name>.log``; None: echoed on our stderr.
    log_dir: Path | None = None
    #: Environment for every child, over ``os.environ`` (e.g. ``FAST_FAILOVER_ENV``).
    base_env: dict[str, str] = field(default_factory=dict)
    #: Edge and worker ids are ``<id_prefix>-<name>`` (default: the key prefix).
    id_prefix: str = ""
    #: The embedded redis-server this cluster owns (``Cluster.embedded``), if any.
    redis: EmbeddedRedis | None = None
    children: dict[str, Child] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    edge_ports: dict[str, int] = field(default_factory=dict)
    edge_urls: dict[str, str] = field(default_factory=dict)
    edge_hosts: dict[str, str] = field(default_factory=dict)

    @classmethod
    def embedded(cls, prefix: str, log_dir: Path | None = None, *, port: int = 0, **kwargs: Any) -> Cluster:
        """A cluster with its own redis-server on a loopback port (``port`` 0: a free one)."""
        server = EmbeddedRedis(port=port or free_port()).start()
        return cls(server.url, prefix, log_dir, redis=server, **kwargs)

    # -- environment and ids --------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "LANES_REDIS_URL": self.redis_url, "LANES_KEY_PREFIX": self.prefix,
                "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "TOKENIZERS_PARALLELISM": "false",
                **self.base_env, **extra}

    def child_id(self, name: str) -> str:
        """The edge or worker id a child of this name runs with."""
        return f"{self.id_prefix or self.prefix}-{name}"

    def settings(self) -> RedisSettings:
        return RedisSettings(redis_url=self.redis_url, key_prefix=self.prefix)

    def plane(self) -> QueuePlane:
        """A queue plane on this cluster's Redis and prefix (async; the caller closes it)."""
        return QueuePlane.from_settings(self.settings())

    # -- starting -------------------------------------------------------------------------

    def start(self, name: str, args: list[str], **env: str) -> subprocess.Popen[bytes]:
        """Start ``lanes <args>`` as child ``name``; edges and workers get ``child_id(name)``."""
        if args and args[0] == "edge":
            env.setdefault("LANES_EDGE_ID", self.child_id(name))
        if args and args[0] == "worker":
            env.setdefault("LANES_WORKER_ID", self.child_id(name))
        previous = self.children.get(name)
        child = self._spawn(name, list(args), self.env(**env))
        if previous is not None:
            child.num_starts = previous.num_starts + 1
        return child.process

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> Child:
        log_path = self.log_dir / f"{name}.log" if self.log_dir is not None else None
        command = [sys.executable, "-m", "lanes.cli.main", *args]
        if log_path is not None:
            with log_path.open("ab") as log:
                process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, start_new_session=True)
        else:
            process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        child = Child(name, args, env, process, self._redis_now_ms(), time.monotonic(), log_path)
        if log_path is None:
            threading.Thread(target=_echo, args=(child,), name=f"out-{name}", daemon=True).start()
        self.children[name] = child
        self.procs[name] = process
        return child

    def restart(self, name: str) -> subprocess.Popen[bytes]:
        """Start child ``name`` again with the same arguments and environment."""
        old = self.children[name]
        child = self._spawn(name, old.args, old.env)
        child.num_starts = old.num_starts + 1
        return child.process

    def start_scheduler(self, name: str = "scheduler", **env: str) -> subprocess.Popen[bytes]:
        return self.start(name, ["scheduler"], **env)

    def start_edge(self, name: str = "edge", *, port: int = 0, host: str = "127.0.0.1", wait: bool = True,
                   timeout_s: float = 60, **env: str) -> str:
        """Start an edge (``LANES_*`` settings in ``env``); returns its chat URL, after it
        answers ``/healthz`` with its own id unless ``wait`` is false."""
        port = port or free_port()
        self.start(name, ["edge"], LANES_PORT=str(port), LANES_HOST=host, **env)
        self.edge_ports[name], self.edge_hosts[name] = port, host
        self.edge_urls[name] = f"ws://{host}:{port}/v1/chat"
        if wait:
            self.wait_edge(name, timeout_s)
        return self.edge_urls[name]

    def start_worker(self, name: str, model: str = "", *extra: str, **env: str) -> str:
        """Start a worker (``--model`` unless ``model`` is empty, then ``extra`` flags);
        returns its worker id. Does not wait: see ``wait_workers``."""
        self.start(name, ["worker", *(["--model", model] if model else []), *extra], **env)
        return self.child_id(name)

    # -- readiness ------------------------------------------------------------------------

    def health(self, name: str) -> dict[str, Any] | None:
        """Edge ``name``'s ``/healthz`` answer if it is its own and says ok, else None."""
        url = f"http://{self.edge_hosts.get(name, '127.0.0.1')}:{self.edge_ports[name]}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                body = json.loads(resp.read())
        except (OSError, ValueError):
            return None
        own = isinstance(body, dict) and body.get("edge_id") == self.child_env_id(name, "LANES_EDGE_ID")
        return body if own and body.get("status") == "ok" else None

    def child_env_id(self, name: str, variable: str) -> str:
        return self.children[name].env.get(variable, "")

    def wait_edge(self, name: str, timeout_s: float = 60) -> None:
        """Until edge ``name`` answers ``/healthz`` with its own id; ``ChildExited`` if it
        exits first (e.g. its port is taken), TimeoutError after ``timeout_s``."""
        self._wait(lambda: self.health(name) is not None, [name], timeout_s, f"edge {name} answering")

    def worker_names(self) -> list[str]:
        return [n for n, c in self.children.items() if c.role == "worker"]

    def warm_workers(self, names: Iterable[str] | None = None) -> list[str]:
        """Workers (names) running now that sent a heartbeat since they (re)started, i.e.
        whose engine is loaded and warm."""
        names = [n for n in (names or self.worker_names()) if self.children[n].process.poll() is None]
        ids = {n: self.child_env_id(n, "LANES_WORKER_ID") for n in names}
        try:
            beats = self.query(lambda plane: plane.worker_heartbeats(list(ids.values())))
        except (QueueUnavailable, OSError, asyncio.TimeoutError):
            return []
        return [n for n in names if beats.get(ids[n], 0) >= self.children[n].started_at_ms]

    def wait_workers(self, count: int, timeout_s: float = 120) -> None:
        """Until ``count`` of our workers are warm (``warm_workers``); ``ChildExited`` if a
        worker exits unexpectedly meanwhile, TimeoutError after ``timeout_s``."""
        self._wait(lambda: len(self.warm_workers()) >= count, self.worker_names(), timeout_s,
                   f"{count} workers registering")

    def _wait(self, ready: Callable[[], bool], watched: list[str], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name in watched:
                child = self.children[name]
                if child.process.poll() is not None and not child.expected_exit:
                    raise ChildExited(name, child.process.returncode, child.tail())
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s:.0f} s (logs: {self.log_dir or 'above'})")
            time.sleep(0.1)

    def _redis_now_ms(self) -> int:
        """Now on the Redis clock, which workers register their heartbeats on (``warm_workers``
        compares the two); this machine's clock while Redis cannot be asked."""
        if self.redis_url:
            try:
                return self.query(lambda plane: plane.server_time_ms(), timeout_s=2)
            except (QueueUnavailable, OSError, asyncio.TimeoutError):
                pass
        return int(time.time() * 1000)

    def query(self, ask: Callable[[QueuePlane], Awaitable[T]], timeout_s: float = 5) -> T:
        """Run one ``QueuePlane`` read from synchronous code (even inside a running event
        loop: it runs on a thread with a loop of its own)."""

        async def once() -> T:
            plane = self.plane()
            try:
                return await asyncio.wait_for(ask(plane), timeout_s)
            finally:
                await plane.close()

        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, once()).result()

    # -- faults and stopping --------------------------------------------------------------

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL: no ``finally`` runs) and wait for the exit."""
        child = self.children[name]
        child.expected_exit = True
        child.process.send_signal(sig)
        child.process.wait(timeout=30)

    def crashed(self) -> list[str]:
        """Children that exited although nobody stopped or killed them."""
        return [n for n, c in self.children.items() if c.process.poll() is not None and not c.expected_exit]

    def num_workers(self) -> int:
        """Worker processes running now."""
        return sum(1 for n in self.worker_names() if self.children[n].process.poll() is None)

    def start_redis(self) -> None:
        """Start the embedded redis-server again (empty) on the same port."""
        port = self.redis.port if self.redis is not None else int(self.redis_url.rsplit(":", 1)[1].split("/")[0])
        self.redis = EmbeddedRedis(port=port).start()

    def stop_redis(self) -> None:
        if self.redis is not None and self.redis.process is not None:
            self.redis.stop()

    def stop(self, timeout_s: float = 20, names: Iterable[str] | None = None,
             quick: Iterable[str] = (), quick_timeout_s: float = 3) -> None:
        """SIGTERM every running child (or ``names``), then wait; kill what outlives
        ``timeout_s`` (``quick_timeout_s`` for the children in ``quick``: ones still loading,
        which hold no lease, need not finish loading a model only to exit)."""
        children = [self.children[n] for n in (names or list(self.children))]
        quick = set(quick)
        for child in children:
            child.expected_exit = True
            if child.process.poll() is None:
                child.process.terminate()
        started = time.monotonic()
        for child in sorted(children, key=lambda c: c.name not in quick):
            limit_s = min(timeout_s, quick_timeout_s) if child.name in quick else timeout_s
            try:
                child.process.wait(timeout=max(0.1, started + limit_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()

    def close(self, quick: Iterable[str] = ()) -> None:
        """Stop every child, then the embedded Redis (if this cluster owns one)."""
        self.stop(quick=quick)
        if self.redis is not None:
            self.redis.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _echo(child: Child) -> None:
    """Copy a child's output to our stderr, prefixed with its name, keeping the last lines."""
    stream = child.process.stdout
    assert stream is not None
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace").rstrip()
        child.tail_lines.append(line)
        sys.stderr.write(f"{child.name:<10}| {line}\n")
        sys.stderr.flush()
    stream.close()


def wait_http(url: str, timeout_s: float, procs: Iterable[subprocess.Popen[bytes]] = ()) -> None:
    """Wait until ``url`` answers 200 (any body). Raises RuntimeError as soon as one of
    ``procs`` exits, TimeoutError after ``timeout_s``. For processes outside a ``Cluster``."""
    procs = list(procs)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s} s")
