"""``lanes up`` as a user runs it: everything starts, a crashed child is restarted, Ctrl-C
stops every process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest
import redis

from lanes.queue.embedded import free_port

pytestmark = pytest.mark.e2e


def wait_for(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_up_restarts_a_crashed_worker_and_stops_everything(redis_url: str, tiny_model, tmp_path) -> None:
    prefix = f"u{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "LANES_REDIS_URL": redis_url, "LANES_KEY_PREFIX": prefix, "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen([sys.executable, "-m", "lanes.cli.main", "up", "--port", str(free_port()),
                           "--model", str(tiny_model.target)], env=env, stdout=log, stderr=subprocess.STDOUT)
    client = redis.Redis.from_url(redis_url)
    workers_key = f"{prefix}:{{q}}:workers"
    try:
        wait_for(lambda: client.zcard(workers_key) >= 1, 120, "the first worker")
        children = psutil.Process(up.pid).children()
        worker = next(p for p in children if "worker" in p.cmdline())
        worker.send_signal(signal.SIGKILL)
        wait_for(lambda: client.zcard(workers_key) >= 2, 120, "a restarted worker (a new worker id)")
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        assert all(not psutil.pid_exists(c.pid) or psutil.Process(c.pid).status() == psutil.STATUS_ZOMBIE
                   for c in children), "a child of lanes up outlived it"
    finally:
        if up.poll() is None:
            up.kill()
        client.close()
        log.close()
