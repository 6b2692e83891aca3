"""``lanes up`` as a user runs it: ready only once its own edge answers and a worker is warm, a
crashed child is restarted, a configuration error stops everything with the child's message,
SIGTERM and Ctrl-C stop every process at once and print no traceback."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
from conftest import REPO_ROOT, scaled
from e2e_support import fixed_http_server

from lanes.cli.up import Backoff, Supervisor, lanes_command
from lanes.queue.embedded import free_port

pytestmark = pytest.mark.e2e


def wait_for(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


class Up:
    """A ``lanes up`` process with its output in a file."""

    def __init__(self, tmp_path: Path, *args: str, command: tuple[str, ...] = (), cwd: Path | None = None,
                 **env: str) -> None:
        self.log_path = tmp_path / f"up-{uuid.uuid4().hex[:4]}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen([*(command or (sys.executable, "-m", "lanes.cli.main", "up")), *args],
                                     env={**os.environ, "HF_HUB_OFFLINE": "1", **env}, cwd=cwd,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self._log.close()

    def kill(self) -> None:
        children = self.children()  # before the parent goes: orphans have no parent to ask
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for child in children:
            if child.is_running():
                child.kill()


@pytest.fixture
def up_runs(tmp_path: Path) -> Iterator[list[Up]]:
    runs: list[Up] = []
    yield runs
    for run in runs:
        run.kill()


def gone(children: list[psutil.Process]) -> bool:
    return all(not psutil.pid_exists(c.pid) or c.status() == psutil.STATUS_ZOMBIE for c in children)


def test_up_waits_for_a_warm_worker_restarts_a_crash_and_stops_on_ctrl_c(
        redis_url: str, tiny_model, tmp_path: Path, up_runs: list[Up]) -> None:
    prefix = f"u{uuid.uuid4().hex[:6]}"
    up = Up(tmp_path, "--port", str(free_port()), "--model", str(tiny_model.target),
            LANES_REDIS_URL=redis_url, LANES_KEY_PREFIX=prefix)
    up_runs.append(up)
    client = redis.Redis.from_url(redis_url)
    workers_key = f"{prefix}:{{q}}:workers"
    try:
        wait_for(lambda: "ready: chat at" in up.output, scaled(120), "ready")
        registered = client.zrange(workers_key, 0, -1, withscores=True)
        assert registered, "ready was printed before any worker was warm"
        worker_id, first_beat = registered[0][0], registered[0][1]
        children = up.children()
        worker = next(p for p in children if "worker" in p.cmdline())
        killed_at_ms = time.time() * 1000
        worker.send_signal(signal.SIGKILL)
        wait_for(lambda: "worker-0 exited with -9; restarting in 1 s" in up.output, scaled(30), "the restart notice")
        wait_for(lambda: (client.zscore(workers_key, worker_id) or 0) > max(first_beat, killed_at_ms),
                 scaled(120), "the restarted worker's heartbeat")
        assert any("worker" in p.cmdline() and p.pid != worker.pid for p in up.children())
        children = up.children()
        up.proc.send_signal(signal.SIGINT)
        assert up.wait(scaled(60)) == 0
        assert gone(children), "a child of lanes up outlived it"
        assert "stopped" in up.output and "Traceback" not in up.output, up.output[-3000:]
    finally:
        client.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_during_start_up_stops_everything_at_once(tiny_model, tmp_path: Path, up_runs: list[Up],
                                                         signum: int) -> None:
    """SIGHUP too (a closed terminal or SSH session): before, lanes up died of it at once and its
    children, in sessions of their own, ran on under init with the ports."""
    up = Up(tmp_path, "--port", str(free_port()), "--model", str(tiny_model.target))
    up_runs.append(up)
    wait_for(lambda: len(up.children()) >= 3, scaled(30), "the children")
    children = up.children()
    sent = time.monotonic()
    up.proc.send_signal(signum)
    assert up.wait(scaled(15)) == 0
    assert time.monotonic() - sent < scaled(8), "the signal waited for the start-up to finish"
    assert gone(children)
    assert "ready: chat at" not in up.output and "Traceback" not in up.output, up.output[-3000:]


def test_a_taken_port_stops_up_with_the_edges_message(tmp_path: Path, up_runs: list[Up]) -> None:
    # Something else on the port: it answers /healthz with 200 and another edge's id.
    with fixed_http_server(json.dumps({"status": "ok", "edge_id": "someone-else"}).encode(),
                           "application/json") as port:
        up = Up(tmp_path, "--port", str(port), "--engine", "sim")
        up_runs.append(up)
        assert up.wait(scaled(60)) == 2
    output = up.output
    assert "ready: chat at" not in output, "another server's health answer was taken for our edge"
    assert "edge stopped with a configuration error" in output
    assert f"port {port} on 127.0.0.1 is already in use (--port / LANES_PORT)" in output
    assert "Traceback" not in output and "restarting" not in output


def test_a_missing_model_stops_up_with_the_workers_message(tmp_path: Path, up_runs: list[Up]) -> None:
    up = Up(tmp_path, "--port", str(free_port()), "--model", "/nonexistent/model")
    up_runs.append(up)
    assert up.wait(scaled(60)) == 2
    output = up.output
    assert "worker-0 stopped with a configuration error" in output
    assert "model directory /nonexistent/model does not exist (--model / LANES_MODEL)" in output
    assert "Traceback" not in output and "restarting" not in output and "ready: chat at" not in output


def test_an_unreachable_redis_stops_up_before_any_child(tmp_path: Path, up_runs: list[Up]) -> None:
    up = Up(tmp_path, "--port", str(free_port()), LANES_REDIS_URL="redis://:hunter2@127.0.0.1:1/0")
    up_runs.append(up)
    assert up.wait(scaled(30)) == 1  # it may come back: a supervisor of lanes up restarts it
    assert up.output.strip().splitlines() == [
        "error: cannot reach Redis at redis://:***@127.0.0.1:1/0 (LANES_REDIS_URL): connection "
        "refused. Start Redis there or point LANES_REDIS_URL at yours (`lanes up` without LANES_REDIS_URL "
        "starts its own)"]


def test_crash_backoff_doubles_and_is_capped() -> None:
    backoff = Backoff(first_s=1, cap_s=30, healthy_after_s=60)
    crashes, delays = 0, []
    for _ in range(7):
        crashes = backoff.num_crashes(crashes, ran_for_s=2)
        delays.append(backoff.delay_s(crashes))
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    assert backoff.num_crashes(5, ran_for_s=120) == 1, "a child that ran a while starts over"


def test_a_closed_terminal_stops_everything(tiny_model, tmp_path: Path) -> None:
    """SIGHUP after the terminal is gone (a closed SSH session): writing "stopping…" to it failed
    (EIO) before the children were stopped, and they ran on under init (found in review)."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "lanes.cli.main", "up", "--port", str(free_port()),
                             "--model", str(tiny_model.target)], stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    os.close(slave)
    children: list[psutil.Process] = []
    try:
        wait_for(lambda: len(psutil.Process(proc.pid).children()) >= 3, scaled(30), "the children")
        children = psutil.Process(proc.pid).children()
        os.close(master)  # the terminal goes away
        proc.send_signal(signal.SIGHUP)
        proc.wait(timeout=scaled(30))
        wait_for(lambda: gone(children), scaled(15), "the children to stop")
    finally:
        if proc.poll() is None:
            proc.kill()
        for child in children:  # orphans (under init) when the test fails
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def test_the_advice_names_the_lanes_this_is_as_the_user_can_type_it(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """After ``./scripts/up.sh`` only ``.venv/bin/lanes`` exists: ``try: lanes chat ...`` was
    not found. On PATH it stays ``lanes``."""
    script = tmp_path / "my venv" / "bin" / "lanes"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert lanes_command(str(script), cwd=tmp_path) == "'my venv/bin/lanes'"
    assert lanes_command(str(script), cwd=tmp_path / "my venv") == "bin/lanes"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert lanes_command(str(script), cwd=elsewhere) == f"'{script}'"
    monkeypatch.setenv("PATH", str(script.parent))
    assert lanes_command(str(script), cwd=elsewhere) == "lanes"
    # ``python -m lanes.cli.main``: the script next to this python, or plain ``lanes``.
    assert lanes_command("/x/main.py", cwd=elsewhere) in ("lanes", str(Path(sys.executable).parent / "lanes"))


def test_up_sh_run_from_another_directory_advises_a_lanes_that_runs_there(tiny_model, tmp_path: Path,
                                                                         up_runs: list[Up]) -> None:
    """``cd /tmp && ~/lanes/scripts/up.sh`` advised ``try: .venv/bin/lanes chat ...``, which is
    not found in /tmp: up.sh changed into the checkout, so the path was relative to it, not to
    the directory the user typed in."""
    venv = REPO_ROOT / ".venv"
    if not (venv / "bin" / "lanes").is_file() or Path(sys.prefix).resolve() != venv.resolve():
        pytest.skip("up.sh runs the checkout's .venv; this test runs in another environment (it would install one)")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    up = Up(tmp_path, "--port", str(free_port()), "--model", str(tiny_model.target),
            command=(str(REPO_ROOT / "scripts" / "up.sh"),), cwd=elsewhere)
    up_runs.append(up)
    wait_for(lambda: "try: " in up.output, scaled(120), "the advice")
    advice = next(line for line in up.output.splitlines() if line.startswith("try: "))
    lanes = shlex.split(advice.removeprefix("try: "))[0]
    typed = subprocess.run(f"{shlex.quote(lanes)} chat --help", shell=True, cwd=elsewhere, capture_output=True,
                           text=True, timeout=scaled(60), check=False)
    assert typed.returncode == 0, (advice, typed.stderr[-2000:])
    up.proc.send_signal(signal.SIGINT)
    assert up.wait(scaled(60)) == 0


def test_a_crash_looping_child_is_said_to_have_exited_not_to_be_loading() -> None:
    """While worker-0 exited and waited for its restart, ``lanes up`` said it "is loading and
    warming its model". A child that exits 2 stops everything and is not restarted."""
    from lanes.cli.cluster import Child, Cluster

    def child(code: int) -> Child:
        process = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
        process.wait()
        return Child("worker-0", ["worker"], {}, process, 0, time.monotonic(), None)

    supervisor = Supervisor(cluster=Cluster("", ""))
    supervisor.cluster.children["worker-0"] = child(1)
    for _ in range(3):
        assert supervisor.check_children() is None
        assert supervisor._doing("worker-0").startswith("worker-0 exited 1 time (last exit 1); restarting in ")
    supervisor.exits["worker-0"] = (3, 1)
    assert supervisor._doing("worker-0").startswith("worker-0 exited 3 times (last exit 1); restarting in ")
    supervisor.restart_at.clear()
    assert supervisor._doing("worker-0").endswith("is loading and warming its model, restarted after it exited 3 "
                                                  "times (last exit 1)")
    supervisor.cluster.children["worker-0"] = child(2)
    assert supervisor.check_children() == 2
