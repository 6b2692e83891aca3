"""``lanes up``: the whole system on one machine (embedded Redis, edge, workers, scheduler),
supervised on top of the process harness (``cli/cluster.py``).

- Ready means: *its own* edge answers ``/healthz`` (the edge id ``lanes up`` gave it, so another
  server on the port does not count) and at least one worker's engine is loaded and warm. While
  waiting it says every ``SLOW_NOTICE_S`` which child is slow and what it last printed.
- A child that exits with status 2 (configuration error: port taken, Redis at an unknown host,
  model not found) stops everything, with that child's message; nothing is restarted.
- A child that crashes (any other status) is restarted after a capped, growing pause.
- SIGINT / SIGTERM are honoured at once, also while waiting: children get SIGTERM (workers
  hand their leases back), then Redis stops. No traceback.
- Every process's Prometheus metrics are reachable: the edge serves its own on its port
  (``/metrics``), the scheduler and each worker get a metrics port of their own (``--metrics-port``
  as the first of consecutive ports, or free ones), and the URLs are printed with ``ready``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from lanes.cli.cluster import Child, Cluster
from lanes.cli.entrypoints import check_redis
from lanes.cli.failures import EXIT_CONFIG
from lanes.queue.embedded import EmbeddedRedis, free_port
from lanes.queue.plane import QueuePlane
from lanes.queue.settings import RedisSettings

console = Console(stderr=True, soft_wrap=True)

#: How often a slow start-up is explained.
SLOW_NOTICE_S = 15.0
_TICK_S = 0.2


@dataclass(frozen=True)
class Backoff:
    """Pause before restarting a crashed child: doubles per crash in a row, capped; a child
    that ran ``healthy_after_s`` before crashing starts over at ``first_s``."""

    first_s: float = 1.0
    cap_s: float = 30.0
    healthy_after_s: float = 60.0

    def num_crashes(self, previous: int, ran_for_s: float) -> int:
        """Crashes in a row, counting this one."""
        return 1 if ran_for_s >= self.healthy_after_s else previous + 1

    def delay_s(self, num_crashes: int) -> float:
        return min(self.cap_s, self.first_s * 2 ** max(0, num_crashes - 1))


@dataclass
class Supervisor:
    #: Set once Redis is known (signals are handled from the very start).
    cluster: Cluster = field(default_factory=lambda: Cluster("", ""))
    backoff: Backoff = field(default_factory=Backoff)
    stopping: bool = False
    #: Crashes in a row per child, and when each crashed child is due to start again.
    crashes: dict[str, int] = field(default_factory=dict)
    restart_at: dict[str, float] = field(default_factory=dict)
    #: Each crashed child's exits so far and the status of the last one.
    exits: dict[str, tuple[int, int]] = field(default_factory=dict)

    def on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True

    # -- one look at the children -----------------------------------------------------------

    def check_children(self) -> int | None:
        """Restart crashed children when due; returns EXIT_CONFIG if one exited with it."""
        now = time.monotonic()
        for name, child in self.cluster.children.items():
            code = child.process.poll()
            if code is None or child.expected_exit:
                continue
            if code == EXIT_CONFIG:
                self._explain_config_error(child)
                return EXIT_CONFIG
            if name not in self.restart_at:
                self.crashes[name] = self.backoff.num_crashes(self.crashes.get(name, 0), now - child.started_at)
                delay_s = self.backoff.delay_s(self.crashes[name])
                self.restart_at[name] = now + delay_s
                self.exits[name] = (self.exits.get(name, (0, 0))[0] + 1, code)
                console.print(f"[yellow]{name} exited with {code}; restarting in {delay_s:.0f} s[/]")
            elif now >= self.restart_at[name]:
                del self.restart_at[name]
                self.cluster.restart(name)
        return None

    def _explain_config_error(self, child: Child) -> None:
        lines = [line for line in child.tail(6) if "error" in line.lower()] or child.tail(2)
        console.print(f"[red]{child.name} stopped with a configuration error:[/]")
        for line in lines[-2:]:
            console.print(f"  {escape(line)}", highlight=False)

    # -- start-up -----------------------------------------------------------------------------

    def wait_ready(self, num_workers: int) -> int | None:
        """Until the edge is ours and answering and one worker is warm; an exit status if
        start-up ends otherwise (a configuration error, or a signal: 0)."""
        started = last_notice = time.monotonic()
        edge_ok, warm = False, []
        while not self.stopping:
            if (code := self.check_children()) is not None:
                return code
            edge_ok = edge_ok or self.cluster.health("edge") is not None
            warm = self.cluster.warm_workers() if edge_ok else []
            if edge_ok and warm:
                if len(warm) < num_workers:
                    console.print(f"{len(warm)} of {num_workers} workers warm; the others join when loaded")
                return None
            if time.monotonic() - last_notice >= SLOW_NOTICE_S:
                last_notice = time.monotonic()
                self._explain_slow(edge_ok, time.monotonic() - started)
            time.sleep(_TICK_S)
        return 0

    def _explain_slow(self, edge_ok: bool, waited_s: float) -> None:
        slow = [] if edge_ok else ["edge"]
        slow += [n for n in self.cluster.worker_names() if n not in self.cluster.warm_workers()]
        for name in slow:
            child = self.cluster.children[name]
            last = child.tail(1)
            said = f"; last said: {escape(last[0][-160:])}" if last else ""
            console.print(f"[yellow]still waiting after {waited_s:.0f} s: {self._doing(name)}{said}[/]",
                          highlight=False)

    def _doing(self, name: str) -> str:
        """What a child that is not ready yet is doing: a crash-looping one was said to be
        "loading and warming its model" between its exits."""
        child = self.cluster.children[name]
        num_exits, last_code = self.exits.get(name, (0, 0))
        exited = f"exited {num_exits} time{'s' if num_exits > 1 else ''} (last exit {last_code})"
        if name in self.restart_at:
            return f"{name} {exited}; restarting in {max(0.0, self.restart_at[name] - time.monotonic()):.0f} s"
        doing = "not answering /healthz yet" if name == "edge" else "loading and warming its model"
        again = f", restarted after it {exited}" if num_exits else ""
        return f"{name} (pid {child.process.pid}) is {doing}{again}"

    # -- running ------------------------------------------------------------------------------

    def supervise(self) -> int:
        while not self.stopping:
            if (code := self.check_children()) is not None:
                return code
            time.sleep(_TICK_S)
        return 0


def _redis_url(settings: RedisSettings) -> tuple[str, EmbeddedRedis | None]:
    """``LANES_REDIS_URL`` if set (checked now: its message and exit 1 if it refuses or does not
    answer, 2 for a configuration error such as an unknown host), else
    an embedded redis-server of our own."""
    if "redis_url" in settings.model_fields_set:

        async def check() -> None:
            plane = QueuePlane.from_settings(settings)
            try:
                await check_redis(plane)
            finally:
                await plane.close()

        asyncio.run(check())
        return settings.redis_url, None
    embedded = EmbeddedRedis(own_session=True).start()  # stopped last, after the children
    console.print(f"[green]redis[/] embedded redis-server on {embedded.url}")
    return embedded.url, embedded


def lanes_command(script: str | None = None, cwd: Path | None = None) -> str:
    """This ``lanes`` as the user can type it: ``lanes`` where that is what PATH finds, else its
    path, relative to here when under it (``.venv/bin/lanes`` after ``./scripts/up.sh``, which
    puts nothing on PATH: the ``lanes chat`` it advised was not found)."""
    path = Path(script if script is not None else sys.argv[0])
    if path.name != "lanes":  # ``python -m lanes.cli.main``: the venv's script next to python
        path = Path(sys.executable).parent / "lanes"
    if not path.is_file():
        return "lanes"
    path = path.absolute()
    found = shutil.which("lanes")
    if found is not None and os.path.samefile(found, path):
        return "lanes"
    with contextlib.suppress(ValueError):
        return shlex.quote(str(path.relative_to((cwd or Path.cwd()).absolute())))
    return shlex.quote(str(path))


def metrics_ports(first_port: int, num_workers: int) -> dict[str, int]:
    """The scheduler's and each worker's metrics port: consecutive from ``first_port``, or
    free ones when it is 0. (A worker restarted after a crash keeps its port.)"""
    names = ["scheduler", *(f"worker-{i}" for i in range(num_workers))]
    return {name: first_port + i if first_port else free_port() for i, name in enumerate(names)}


def up(port: int, num_workers: int, worker_args: list[str], host: str = "127.0.0.1", *,
       debug: bool = False, metrics_port: int = 0) -> int:
    """Run until a signal (exit 0) or a child's configuration error (exit 2)."""
    settings = RedisSettings()  # the LANES_* environment, parsed once
    supervisor = Supervisor()
    signal.signal(signal.SIGINT, supervisor.on_signal)
    signal.signal(signal.SIGTERM, supervisor.on_signal)
    # A closed terminal or SSH session: the children run in their own sessions and get no
    # SIGHUP of their own; before, they ran on under init, holding the ports. Under nohup
    # (SIGHUP ignored) a closed session must not stop anything.
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, supervisor.on_signal)
    redis_url, embedded = _redis_url(settings)
    env = {"LANES_DEBUG": "1"} if debug else {}
    cluster = supervisor.cluster = Cluster(redis_url, settings.key_prefix, None, base_env=env,
                                           id_prefix=f"up-{uuid.uuid4().hex[:6]}", redis=embedded)
    ports = metrics_ports(metrics_port, num_workers)
    try:
        cluster.start_scheduler(LANES_METRICS_PORT=str(ports["scheduler"]))
        cluster.start_edge("edge", port=port, host=host, wait=False)
        for i in range(num_workers):
            cluster.start_worker(f"worker-{i}", "", *worker_args, "--metrics-port", str(ports[f"worker-{i}"]))
        code = supervisor.wait_ready(num_workers)
        if code is not None:
            return code
        base = f"http://{host}:{port}"
        console.print(f"[green]ready[/]: chat at [bold]{base}/[/] (WebSocket ws://{host}:{port}/v1/chat) "
                      f"· dashboard {base}/dashboard")
        # Scheduler and workers listen on loopback only: reach them from this machine.
        scraped = [f"edge {base}/metrics"] + [f"{name} http://127.0.0.1:{p}/metrics" for name, p in ports.items()]
        console.print("metrics: " + " · ".join(scraped))
        # As the edge decides (``KeyGuard``): static key hashes turn keys on without the flag.
        keyed = (os.environ.get("LANES_AUTH_REQUIRED", "").lower() in ("1", "true", "yes", "on")
                 or bool(os.environ.get("LANES_API_KEY_HASHES", "").strip(" ,")))
        key = " --api-key KEY" if keyed else ""
        lanes = lanes_command()
        if keyed:
            # ``lanes keys`` must store the key where this edge looks: this Redis, not its 6379 default.
            kept = ("" if embedded is None else " (the embedded Redis keeps nothing across restarts: "
                    "for keys that outlive it, `lanes keys create NAME --static` and LANES_API_KEY_HASHES)")
            console.print(f"API keys: LANES_REDIS_URL={redis_url} {lanes} keys create NAME{kept}")
        console.print(f'try: {lanes} chat --url ws://{host}:{port}/v1/chat{key} "Explain what a class definition does"')
        return supervisor.supervise()
    finally:
        _say("stopping…")
        # Children run in their own session: stop every one of them ourselves. Workers not yet
        # warm hold no lease: they need not finish loading their model only to exit.
        warm = set(cluster.warm_workers()) if cluster.children else set()
        cluster.close(quick=[n for n in cluster.worker_names() if n not in warm])
        _say("stopped")


def _say(message: str) -> None:
    """A line on the terminal, if there still is one: after a hangup (a closed SSH session)
    writing to it fails (EIO), and the children must be stopped all the same."""
    with contextlib.suppress(OSError):
        console.print(message)
