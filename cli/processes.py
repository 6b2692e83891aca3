"""Entry points of the three process types (``lanes edge|worker|scheduler``).

Each parses its settings once, sets up logging and tracing, and runs until SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Coroutine
from typing import Any

from prometheus_client import start_http_server

from lanes.queue.plane import QueuePlane
from lanes.queue.settings import RedisSettings
from lanes.telemetry.logs import setup_logging
from lanes.telemetry.tracing import setup_tracing

log = logging.getLogger(__name__)


def run_until_signal(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main``; SIGTERM/SIGINT cancel it so ``finally`` blocks release leases and sockets."""

    async def runner() -> None:
        task = asyncio.ensure_future(main)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            log.info("stopped by signal")

    asyncio.run(runner())


def _setup(settings: RedisSettings, process: str) -> QueuePlane:
    setup_logging(settings.log_level, process)
    setup_tracing(f"lanes-{process}", settings.otel_exporter)
    return QueuePlane.from_settings(settings)


def run_edge(overrides: dict[str, Any]) -> None:
    from lanes.ws_server.edge import Edge
    from lanes.ws_server.settings import EdgeSettings

    settings = EdgeSettings(**overrides)
    plane = _setup(settings, "edge")

    async def main() -> None:
        try:
            await Edge(settings, plane).serve()
        finally:
            await plane.close()

    run_until_signal(main())


def run_worker(overrides: dict[str, Any], *, burst: bool = False, metrics_port: int = 0) -> None:
    from lanes.workers.factory import build_engine
    from lanes.workers.settings import WorkerSettings
    from lanes.workers.worker import Worker

    # torch runs on the batching thread, not the main one; with libgomp's default active
    # wait its idle OpenMP threads spin and starve prefill on small machines (p99 TTFT 910 ms
    # -> 32 ms with PASSIVE: benchmarks/RESULTS.md). Must be set before torch is imported.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    settings = WorkerSettings(**overrides)
    if settings.engine in ("vllm", "trtllm"):
        # Both engines take the GPU they can see; one worker process per GPU.
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", str(settings.gpu_index))
    plane = _setup(settings, "worker")
    engine = build_engine(settings)  # ConfigError (a ValueError) here: clear message, exit 2
    if metrics_port:
        start_http_server(metrics_port, addr="127.0.0.1")

    async def main() -> None:
        try:
            await Worker(settings, plane, engine).serve(burst=burst)
        finally:
            await plane.close()

    run_until_signal(main())


def run_scheduler(overrides: dict[str, Any]) -> None:
    from lanes.scheduler.service import Scheduler
    from lanes.scheduler.settings import SchedulerSettings

    settings = SchedulerSettings(**overrides)
    plane = _setup(settings, "scheduler")
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr="127.0.0.1")

    async def main() -> None:
        try:
            await Scheduler(settings, plane).serve()
        finally:
            await plane.close()

    run_until_signal(main())
