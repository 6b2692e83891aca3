"""Entry points of the three process types (``lanes edge|worker|scheduler``).

Each parses its settings once, checks what it depends on before anything slow (Redis at
``LANES_REDIS_URL``; for a worker its settings and model; for an edge its port), sets up
logging and tracing, and runs until SIGINT/SIGTERM. What it cannot fix is raised as a
``ConfigFailure`` / ``ConfigError``: the command line prints one line and exits 2. A Redis that
refuses or does not answer is one line and exit 1 (it may come back: restart). A write the
disk refuses (full, read-only, a quota) is one line too, but exits 1 here: these processes run
until stopped, and such a disk is usually freed again, so their supervisor should restart them
(``cli/failures.py: exit_code_for``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from lanes.cli.failures import ConfigFailure, Failure, load_settings, safe_url, unknown_variables
from lanes.queue.errors import QueueAuthError, QueueUnavailable
from lanes.queue.plane import QueuePlane
from lanes.queue.settings import RedisSettings
from lanes.telemetry import metrics
from lanes.telemetry.logs import setup_logging
from lanes.telemetry.tracing import begin_stop, setup_tracing

log = logging.getLogger(__name__)

#: How long a process waits for Redis to answer at start-up before it gives up (exit 2).
REDIS_CHECK_TIMEOUT_S = 5.0


#: After SIGTERM/SIGINT a process that has not exited within this long exits anyway (a task
#: that never ends its cancellation would otherwise keep it, and its port, forever).
STOP_WATCHDOG_S = 60.0


def run_until_signal(main: Coroutine[Any, Any, None], watchdog_s: float = STOP_WATCHDOG_S) -> None:
    """Run ``main``; SIGTERM/SIGINT cancel it so ``finally`` blocks release leases and sockets.
    A second signal, or ``watchdog_s`` after the first, exits at once (code 1), naming the
    tasks still running: a redis-py wait has been seen to swallow its cancellation, which left
    an edge ignoring every SIGTERM with its port bound."""

    async def runner() -> None:
        task = asyncio.ensure_future(main)
        loop = asyncio.get_running_loop()

        def force_exit(why: str) -> None:
            pending = sorted({t.get_coro().__qualname__ for t in asyncio.all_tasks(loop)
                              if not t.done() and t is not asyncio.current_task(loop)})
            log.error("%s: exiting now; still running: %s", why, ", ".join(pending) or "nothing")
            logging.shutdown()
            os._exit(1)

        def on_signal(sig: signal.Signals) -> None:
            if stopping:
                force_exit(f"{sig.name} again while stopping")
            stopping.append(sig)
            begin_stop()  # the last spans go out while the process drains, not after
            task.cancel()
            loop.call_later(watchdog_s, force_exit, f"still stopping {watchdog_s:.0f} s after {sig.name}")

        stopping: list[signal.Signals] = []

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            await task
        except asyncio.CancelledError:
            log.info("stopped by signal")

    asyncio.run(runner())


async def check_redis(plane: QueuePlane, timeout_s: float = REDIS_CHECK_TIMEOUT_S, *, writes: bool = True) -> None:
    """One round trip to Redis; a ``Failure`` naming ``LANES_REDIS_URL`` and the address tried
    (never the password) if it refuses or does not answer (exit 1: it may come back), a
    ``ConfigFailure`` (exit 2) for an unknown host, a refused login, no such database, or a
    replica where the caller ``writes`` (a command that only reads, such as ``lanes keys
    list``, may use a replica)."""
    url = safe_url(plane.settings.redis_url)
    try:
        await asyncio.wait_for(plane.server_time_ms(), timeout_s)
    except QueueAuthError as exc:
        raise ConfigFailure(f"Redis at {url} refused the login ({exc}): fix the password in "
                            "LANES_REDIS_URL (redis://:PASSWORD@host:port/db)") from None
    except (QueueUnavailable, OSError, asyncio.TimeoutError) as exc:
        if "db index is out of range" in str(exc).lower():
            raise ConfigFailure(f"Redis at {url} has no such database (LANES_REDIS_URL): use a number below its "
                                "`databases` setting (16 by default: /0 to /15)") from None
        reason = _unreachable_reason(exc, timeout_s)
        if url.startswith("rediss") and "no answer" in reason:
            if await _answers_without_tls(plane.settings.redis_url):
                raise ConfigFailure(f"Redis at {url} does not speak TLS: it answered a plain PING (LANES_REDIS_URL): "
                                    "use redis://, or turn TLS on in that Redis (tls-port)") from None
            reason += " (a rediss:// URL waits like this on a Redis without TLS: check the scheme and port)"
        # A host that does not exist is a mistake to fix (2); a Redis that refuses or does not
        # answer may be down for a while (1): a supervisor restarts the process until it is
        # back. With 2, a Redis outage plus one worker crash under ``lanes up`` stopped the
        # whole system for good (the restarted worker exited 2, which stops everything).
        failure = ConfigFailure if reason == "unknown host" else Failure
        raise failure(
            f"cannot reach Redis at {url} (LANES_REDIS_URL): {reason}. Start Redis there or "
            "point LANES_REDIS_URL at yours (`lanes up` without LANES_REDIS_URL starts its own)"
        ) from None
    if writes and await _is_replica(plane):
        # Every process writes (enqueues, leases, heartbeats): on a replica each write fails,
        # which the edge would report to clients as "unavailable; retry shortly" for good.
        raise ConfigFailure(f"Redis at {url} is a read-only replica (LANES_REDIS_URL): point it at the primary")


async def _answers_without_tls(url: str, timeout_s: float = 2.0) -> bool:
    """Whether a plain Redis listens at ``url``'s address (a ``rediss://`` URL whose TLS
    handshake got no answer): ``PING`` without TLS, answered ``+PONG`` or with an error that
    only Redis sends (``-NOAUTH``). Such a URL waited 5 s and, as an outage, exited 1 to be
    restarted for good; a TLS-only server does not answer plain text this way."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if not parts.hostname:
        return False
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, parts.port or 6379), timeout_s)
        writer.write(b"PING\r\n")
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except (OSError, asyncio.TimeoutError, ValueError):
        return False
    finally:
        if writer is not None:
            writer.close()
    return line.startswith((b"+PONG", b"-NOAUTH", b"-ERR"))


async def _is_replica(plane: QueuePlane) -> bool:
    """Whether one Redis (not a cluster: its client writes to the masters) is a replica, by
    ``ROLE``; False where it cannot tell (a managed Redis that renames or forbids ``ROLE``)."""
    if plane.cluster:
        return False
    try:
        role = await asyncio.wait_for(plane.redis.execute_command("ROLE"), REDIS_CHECK_TIMEOUT_S)
    except (QueueUnavailable, OSError, asyncio.TimeoutError):
        return False
    first = role[0] if isinstance(role, (list, tuple)) and role else b""
    return (first.decode() if isinstance(first, bytes) else str(first)) == "slave"


def _unreachable_reason(exc: BaseException, timeout_s: float) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    lowered = text.lower()
    if not text or isinstance(exc, asyncio.TimeoutError):
        return f"no answer within {timeout_s:.0f} s"
    if "connection refused" in lowered or "connect call failed" in lowered:
        return "connection refused"
    if "temporary failure in name resolution" in lowered:
        return "the name lookup (DNS) failed for now"
    if "name or service not known" in lowered or "name resolution" in lowered or "nodename" in lowered:
        return "unknown host"
    return text.rstrip(".")


def _serve_metrics(role: Any, port: int, option: str, host: str = "127.0.0.1") -> None:
    """Prometheus on ``host:port``; a taken port or a foreign address is a configuration error (exit 2)."""
    try:
        metrics.serve(role, port, host)
    except OSError as exc:
        raise ConfigFailure(f"metrics port {port} on {host} is not available ({option}, LANES_METRICS_HOST): "
                            f"{exc.strerror or exc}") from None


def _setup(settings: RedisSettings, process: str) -> QueuePlane:
    setup_logging(settings.log_level, process)
    for warning in unknown_variables(os.environ):
        log.warning(warning)
    setup_tracing(f"lanes-{process}", settings.otel_exporter)
    return QueuePlane.from_settings(settings)


def _serve(plane: QueuePlane, body: Callable[[], Awaitable[None]], stop_s: float = 0.0) -> None:
    """Check Redis, then run ``body`` until a signal; the plane is closed either way. ``stop_s``:
    how long a graceful stop may take beyond the watchdog's margin (a worker's drain)."""

    async def main() -> None:
        try:
            await check_redis(plane)
            await body()
        finally:
            await plane.close()

    run_until_signal(main(), STOP_WATCHDOG_S + stop_s)


def raise_open_files_limit() -> int:
    """Lift this process's soft limit on open files to its hard limit (every connection is a
    file descriptor; many systems start processes at 1,024, which an edge passes at ~1,000
    clients) and return it. Child processes inherit it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


def run_edge(overrides: dict[str, Any]) -> None:
    from lanes.ws_server.edge import Edge
    from lanes.ws_server.settings import EdgeSettings

    settings = load_settings(EdgeSettings, overrides)
    plane = _setup(settings, "edge")
    limit = raise_open_files_limit()
    log.info("open files limit %d (about as many connections; `ulimit -Hn` raises it)", limit)

    async def body() -> None:
        try:
            await Edge(settings, plane).serve()
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigFailure(
                    f"port {settings.port} on {settings.host} is already in use (--port / LANES_PORT): "
                    "stop what listens there or choose another port") from None
            if isinstance(exc, socket.gaierror) or exc.errno in (errno.EADDRNOTAVAIL, errno.EACCES):
                raise ConfigFailure(
                    f"cannot listen on {settings.host}:{settings.port} (--host / LANES_HOST, --port / LANES_PORT): "
                    f"{exc.strerror or exc}; give an address of this machine (0.0.0.0: all of them, 127.0.0.1: "
                    "this machine only) and a port it may open (1024 or above without privileges)") from None
            raise

    _serve(plane, body)


def run_worker(overrides: dict[str, Any], *, burst: bool = False, metrics_port: int = 0) -> None:
    from lanes.workers.factory import build_engine
    from lanes.workers.settings import WorkerSettings
    from lanes.workers.worker import Worker

    # torch runs on the batching thread, not the main one; with libgomp's default active
    # wait its idle OpenMP threads spin and starve prefill on small machines (p99 TTFT 910 ms
    # -> 32 ms with PASSIVE: benchmarks/RESULTS.md). Must be set before torch is imported.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    settings = load_settings(WorkerSettings, overrides)
    if settings.engine in ("vllm", "trtllm"):
        # Both engines take the GPU they can see; one worker process per GPU.
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", str(settings.gpu_index))
    plane = _setup(settings, "worker")
    # ConfigError here (bad combination, missing model): one line, exit 2, before Redis is
    # even asked. The model loads (and warms up) in ``Worker.serve``, after the Redis check.
    engine = build_engine(settings)
    if metrics_port:
        _serve_metrics(metrics.WORKER, metrics_port, "--metrics-port", settings.metrics_host)

    async def body() -> None:
        await Worker(settings, plane, engine).serve(burst=burst)

    _serve(plane, body, settings.drain_timeout_s)


def _check_memory_encoder(weight: float) -> None:
    """``ConfigFailure`` when the refresh is asked for a neighbour memory the shipped encoder
    cannot give (a graph without its ``embedding`` output), instead of a failed refit every tick."""
    from lanes.scheduler.predictor import WeightsError, load_default

    try:
        encoder = load_default().encoder
    except WeightsError as exc:
        raise ConfigFailure(f"the shipped length predictor does not load ({exc}): reinstall lanes") from None
    if not getattr(encoder, "has_embedding", False):
        raise ConfigFailure(f"LANES_PREDICTOR_MEMORY_WEIGHT={weight:g} needs a length encoder with an embedding "
                            "output, and the shipped one has none: set LANES_PREDICTOR_MEMORY_WEIGHT=0, or retrain "
                            "the weights with lanes predictor train")


def run_scheduler(overrides: dict[str, Any]) -> None:
    from lanes.scheduler.service import Scheduler
    from lanes.scheduler.settings import SchedulerSettings

    settings = load_settings(SchedulerSettings, overrides)
    if settings.predictor_refresh_minutes > 0 and settings.predictor_memory_weight > 0:
        _check_memory_encoder(settings.predictor_memory_weight)
    plane = _setup(settings, "scheduler")
    if settings.metrics_port:
        _serve_metrics(metrics.SCHEDULER, settings.metrics_port, "LANES_METRICS_PORT (lanes up: --metrics-port)",
                       settings.metrics_host)

    async def body() -> None:
        await Scheduler(settings, plane).serve()

    _serve(plane, body)
