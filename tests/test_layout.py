"""The repository root is the package ``lanes``; the required folders are PEP 420 portions.

A regular ``queue/__init__.py`` would shadow the standard library's ``queue`` whenever the
root is first on sys.path, breaking ``import redis`` and ``asyncio.to_thread``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("workers", "queue", "scheduler", "ws_server", "telemetry", "tests")


def test_required_layout_exists() -> None:
    for name in REQUIRED:
        assert (REPO_ROOT / name).is_dir(), name
    for name in ("pyproject.toml", "Procfile", "README.md", "__init__.py"):
        assert (REPO_ROOT / name).is_file(), name


def test_required_folders_have_no_init() -> None:
    # Only the top-level folders can shadow the standard library; a subpackage listed in
    # pyproject (scheduler/predictor) may be a regular package.
    offenders = [f"{name}/__init__.py" for name in ("workers", "queue", "scheduler", "ws_server", "telemetry")
                 if (REPO_ROOT / name / "__init__.py").exists()]
    assert offenders == [], f"these shadow PEP 420 portions (and may shadow stdlib): {offenders}"


def test_only_init_py_at_root() -> None:
    assert sorted(p.name for p in REPO_ROOT.glob("*.py")) == ["__init__.py"]


def test_stdlib_queue_and_redis_import_from_repo_root() -> None:
    code = "import queue, redis, asyncio; assert hasattr(queue, 'Queue'); import lanes.queue.keys; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
