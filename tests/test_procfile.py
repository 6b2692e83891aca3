"""The README's Procfile instructions, run as written: ``.venv/bin/honcho start`` from the
repository root against a real Redis, with a second worker (``-c worker=2``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from conftest import REPO_ROOT, scaled

from lanes.queue.embedded import free_port

pytestmark = pytest.mark.e2e
HONCHO = Path(sys.executable).parent / "honcho"


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return json.loads(resp.read())


@pytest.mark.skipif(not HONCHO.exists(), reason="honcho is a dev dependency of the venv")
def test_honcho_starts_every_process_type_and_scales_workers(redis_url: str, tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "LANES_REDIS_URL": redis_url, "LANES_KEY_PREFIX": f"p{uuid.uuid4().hex[:6]}",
           "LANES_ENGINE": "sim", "LANES_SIM_TIME_SCALE": "20", "HF_HUB_OFFLINE": "1"}
    if Path(sys.executable).parent != REPO_ROOT / ".venv" / "bin":
        env["LANES_BIN"] = str(Path(sys.executable).parent / "lanes")  # not the bootstrap venv
    log = (tmp_path / "honcho.log").open("wb")
    honcho = subprocess.Popen([str(HONCHO), "start", "-p", str(port), "-c", "worker=2"], cwd=REPO_ROOT, env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + scaled(90)
        workers: list = []
        while len(workers) < 2:
            assert honcho.poll() is None, (tmp_path / "honcho.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "honcho.log").read_text()[-3000:]
            try:
                workers = get_json(f"http://127.0.0.1:{port}/v1/workers")  # type: ignore[assignment]
            except OSError:
                pass
            time.sleep(0.5)
        chat = subprocess.run([str(Path(sys.executable).parent / "lanes"), "chat", "--url",
                               f"ws://127.0.0.1:{port}/v1/chat", "--max-tokens", "5", "Hello?"],
                              capture_output=True, text=True, timeout=60, env=env)
        assert chat.returncode == 0, chat.stderr
        assert chat.stdout.strip() == "tok0 tok1 tok2 tok3 tok4"
        # Each worker and the scheduler serve Prometheus on their honcho PORT (base + 100 per type).
        for metrics_port, name in ((port + 100, "lanes_engine_errors_total"), (port + 101, "lanes_engine_errors_total"),
                                   (port + 200, "lanes_lane_depth")):
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
                assert name in resp.read().decode(), metrics_port
    finally:
        os.killpg(honcho.pid, signal.SIGINT)
        honcho.wait(timeout=60)
        log.close()
    output = (tmp_path / "honcho.log").read_text()
    assert "not found" not in output and "Traceback" not in output, output[-3000:]
    for name in ("edge.1", "worker.1", "worker.2", "scheduler.1"):
        assert f"{name} started" in output
