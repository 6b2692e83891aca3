"""A process that does not stop when asked still stops (``cli/entrypoints.run_until_signal``):
a second SIGTERM, or the watchdog after the first, exits at once. Seen once: an edge whose
token reader waited on in redis-py after its cancellation ignored every SIGTERM, with its port
bound, until SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from conftest import scaled

STUBBORN = """
import asyncio, logging, sys
from lanes.cli.entrypoints import run_until_signal
logging.basicConfig(level=logging.INFO, stream=sys.stderr)

async def deaf_reader():
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:  # swallowed, as the redis-py wait did
            pass

async def main():
    task = asyncio.create_task(deaf_reader())
    print("ready", flush=True)
    await task

run_until_signal(main(), watchdog_s=float(sys.argv[1]))
"""


def start(watchdog_s: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN, str(watchdog_s)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_second_signal_exits_a_process_that_ignores_the_first() -> None:
    proc = start(watchdog_s=600)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None, "the first SIGTERM only asks (the stub ignores it)"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(scaled(10)) == 1
    err = proc.stderr.read()  # type: ignore[union-attr]
    assert "SIGTERM again while stopping: exiting now; still running: deaf_reader" in err, err


def test_the_watchdog_exits_a_process_still_stopping() -> None:
    proc = start(watchdog_s=1.0)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(scaled(10)) == 1
    assert time.monotonic() - started >= 0.9
    err = proc.stderr.read()  # type: ignore[union-attr]
    assert "still stopping 1 s after SIGINT: exiting now; still running: deaf_reader" in err, err


async def stops_when_cancelled(settings: Any, serve: Callable[[Any], Awaitable[None]], after_s: float) -> bool:
    """Run ``serve(plane)`` as ``lanes edge|scheduler`` do (a first Redis round trip, then the
    process's body), cancel it ``after_s`` in (SIGTERM), and say whether it stopped within 5 s."""
    import asyncio

    from lanes.cli.entrypoints import check_redis
    from lanes.queue.plane import QueuePlane

    plane = QueuePlane.from_settings(settings)

    async def process() -> None:
        try:
            await check_redis(plane)
            await serve(plane)
        finally:
            await plane.close()

    serving = asyncio.create_task(process())
    await asyncio.sleep(after_s)
    serving.cancel()
    done, _ = await asyncio.wait([serving], timeout=scaled(5))
    return bool(done)


@pytest.mark.parametrize("after_s", [0.0, 0.01, 0.03, 0.1, 0.5])
async def test_an_edge_cancelled_in_its_first_second_stops(redis_url: str, key_prefix: str, after_s: float) -> None:
    """SIGTERM (a cancel) while the edge subscribes came out of redis-py's ``subscribe`` with the
    cancellation requested but never delivered: the token reader then waited for its next
    message forever (about one SIGTERM in two in an edge's first second). It stops now."""
    from lanes.queue.embedded import free_port
    from lanes.ws_server.edge import Edge
    from lanes.ws_server.settings import EdgeSettings

    settings = EdgeSettings(_env_file=None, redis_url=redis_url, key_prefix=key_prefix, port=free_port())
    assert await stops_when_cancelled(settings, lambda plane: Edge(settings, plane).serve(), after_s), \
        f"the edge did not stop within 5 s of a cancel {after_s} s after its start"


@pytest.mark.parametrize("after_s", [0.005, 0.01, 0.02, 0.1])
async def test_a_scheduler_cancelled_in_its_first_round_stops(redis_url: str, key_prefix: str,
                                                              after_s: float) -> None:
    """The same swallowed cancellation in the scheduler's first Redis round left its loop
    sleeping and calling again, forever (2 of 7 SIGTERMs a second after start)."""
    from lanes.scheduler.service import Scheduler
    from lanes.scheduler.settings import SchedulerSettings

    settings = SchedulerSettings(_env_file=None, redis_url=redis_url, key_prefix=key_prefix)
    assert await stops_when_cancelled(settings, lambda plane: Scheduler(settings, plane).serve(), after_s), \
        f"the scheduler did not stop within 5 s of a cancel {after_s} s after its start"


def test_ctrl_c_while_the_command_line_loads_exits_130_without_a_traceback() -> None:
    """The console script (``lanes.cli.entry``) guards the import: a Ctrl-C in the first half
    second printed a ``KeyboardInterrupt`` traceback from inside numpy or typer."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.argv = ['lanes', 'bench', '--help']; "
                             "from lanes.cli.entry import main; main()"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(0.15)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=scaled(30))
    assert proc.returncode in (130, 0), (proc.returncode, err[-2000:])  # 0: it had finished already
    assert "Traceback" not in err, err[-2000:]
