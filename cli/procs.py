"""Small helpers for commands (and tests) that run lanes processes as children."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Iterable


def wait_http(url: str, timeout_s: float, procs: Iterable[subprocess.Popen[bytes]] = ()) -> None:
    """Wait until ``url`` answers 200. Raises RuntimeError as soon as one of ``procs`` exits,
    TimeoutError after ``timeout_s``."""
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


def stop_all(procs: Iterable[subprocess.Popen[bytes]], timeout_s: float = 20) -> None:
    """SIGTERM every process still running, then wait; kill what does not exit in time."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
