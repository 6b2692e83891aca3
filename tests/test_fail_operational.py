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
from test_up import up_runs  # noqa: F401 - the fixture


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


def test_a_worker_stopped_while_its_model_loads_exits(redis_url: str, tiny_model) -> None:
    """SIGTERM (or Ctrl-C) while the hf engine loaded its model: the worker logged "stopped by
    signal" and then never exited. The load runs in a thread a cancel cannot stop; it went on
    to start transformers' batching thread, which nobody stopped, and the interpreter waited for
    it at exit, for good (``lanes up``'s stop, systemd's, hung on it). The marker below is
    printed as the load begins, so the signal lands inside it every time."""
    script = ("import sys, time\nimport lanes.workers.engines.hf as hf\nload = hf.HFEngine._load\n"
              "def slow_load(self):\n    print('LOADING', file=sys.stderr, flush=True)\n    time.sleep(1.0)\n"
              "    load(self)\nhf.HFEngine._load = slow_load\nfrom lanes.cli.main import main\n"
              f"sys.argv = ['lanes', 'worker', '--model', {str(tiny_model.target)!r}]\nmain()\n")
    env = {**os.environ, "LANES_REDIS_URL": redis_url, "LANES_KEY_PREFIX": f"ld{uuid.uuid4().hex[:6]}"}
    worker = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    assert worker.stdout is not None
    seen = []
    for line in worker.stdout:
        seen.append(line)
        if line.strip() == "LOADING":
            break
    worker.send_signal(signal.SIGTERM)
    try:
        out = "".join(seen) + worker.communicate(timeout=scaled(40))[0]
    except subprocess.TimeoutExpired:
        worker.kill()
        raise AssertionError("the worker did not exit after SIGTERM: " + "".join(seen)[-2000:]) from None
    assert worker.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "letting the engine finish starting, then closing it" in out and "stopped by signal" in out


def test_a_worker_restarted_during_a_redis_outage_waits_for_redis(tmp_path, up_runs) -> None:  # noqa: F811
    """Redis went away under ``lanes up`` and a worker crashed meanwhile: the restarted worker
    could not reach Redis and exited 2, a configuration error, so ``lanes up`` stopped every
    process for good. It exits 1 now, is restarted with backoff, and serves once Redis is back."""
    import psutil
    from test_up import Up, wait_for

    from lanes.queue.embedded import EmbeddedRedis

    server = EmbeddedRedis().start()
    try:
        up = Up(tmp_path, "--port", str(free_port()), "--engine", "sim", LANES_REDIS_URL=server.url)
        up_runs.append(up)
        wait_for(lambda: "ready: chat at" in up.output, scaled(60), "ready")
        worker = next(p for p in up.children() if "worker" in p.cmdline())
        server.stop()
        worker.kill()
        wait_for(lambda: "worker-0 exited with 1; restarting in" in up.output, scaled(60), "the restart notice")
        assert up.proc.poll() is None, up.output[-3000:]
        assert "configuration error" not in up.output, up.output[-3000:]
        assert "error: cannot reach Redis at" in up.output
        server = EmbeddedRedis(port=server.port).start()  # the same address again
        wait_for(lambda: up.output.count(" ready: pool=default") >= 2,
                 scaled(90), "the restarted worker ready")
        children = up.children()
        up.proc.send_signal(signal.SIGINT)
        assert up.wait(scaled(60)) == 0, up.output[-3000:]
        psutil.wait_procs(children, timeout=scaled(10))
        assert "Traceback" not in up.output, up.output[-3000:]
    finally:
        server.stop()


def test_the_scheduler_logs_one_line_per_redis_outage_and_recovery(tmp_path) -> None:
    """arq's own connection retries logged a warning a second ("redis connection error ... 4
    retries remaining...") all through a Redis outage, and the arq cron loop never said it had
    recovered, so its next outage went unlogged. Now each loop logs its outage once and its
    recovery once."""
    from lanes.queue.embedded import EmbeddedRedis

    server = EmbeddedRedis().start()
    log_path = tmp_path / "scheduler.log"
    with log_path.open("wb") as log_file:
        scheduler = subprocess.Popen([sys.executable, "-m", "lanes.cli.main", "scheduler"], stdout=log_file,
                                     stderr=subprocess.STDOUT, env={**os.environ, "LANES_REDIS_URL": server.url})
    try:
        deadline = time.monotonic() + scaled(60)
        while "Starting worker for 1 functions" not in log_path.read_text():
            assert time.monotonic() < deadline and scheduler.poll() is None, log_path.read_text()[-2000:]
            time.sleep(0.2)
        server.stop()
        time.sleep(4)
        server = EmbeddedRedis(port=server.port).start()
        deadline = time.monotonic() + scaled(60)
        while not all(f"{loop}: recovered after" in log_path.read_text()
                      for loop in ("arq cron", "reaper", "depth snapshots")):
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        scheduler.send_signal(signal.SIGINT)
        scheduler.wait(timeout=scaled(30))
        server.stop()
    out = log_path.read_text()
    assert "retries remaining" not in out, out[-3000:]
    assert out.count("arq cron: ConnectionError") == 1, out[-3000:]
    for loop in ("reaper", "depth snapshots"):
        assert out.count(f"{loop}: ConnectionError") == 1 and out.count(f"{loop}: recovered after") == 1, out
    assert "Traceback" not in out


def test_ctrl_c_of_lanes_chat_cancels_its_request(tmp_path, up_runs) -> None:  # noqa: F811
    """Ctrl-C of ``lanes chat`` closed the connection without a word: the edge took it for a
    client that may resume, and the answer went on being generated for LANES_RESUME_GRACE_S
    (15 s). It sends ``cancel`` first now: the worker stops within a moment, exit 130, no
    traceback."""
    import re
    import urllib.request

    from test_up import Up, wait_for

    port = free_port()
    up = Up(tmp_path, "--port", str(port), "--engine", "sim")
    up_runs.append(up)
    wait_for(lambda: "ready: chat at" in up.output, scaled(60), "ready")
    worker_metrics = re.search(r"worker-0 (http://127\.0\.0\.1:\d+/metrics)", up.output).group(1)

    def running() -> float:
        text = urllib.request.urlopen(worker_metrics, timeout=5).read().decode()
        return sum(float(v) for v in re.findall(r"^lanes_worker_running\{[^}]*\} (\S+)", text, re.M))

    chat = subprocess.Popen([sys.executable, "-m", "lanes.cli.main", "chat", "--url", f"ws://127.0.0.1:{port}/v1/chat",
                             "--max-tokens", "4000", "write a long essay about everything"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert chat.stdout is not None
    chat.stdout.read(20)  # streaming
    assert running() == 1
    chat.send_signal(signal.SIGINT)
    err = chat.communicate(timeout=scaled(30))[1]
    wait_for(lambda: running() == 0, scaled(5), "the worker to stop generating (15 s on the old code)")
    assert chat.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted: request cancelled", err
