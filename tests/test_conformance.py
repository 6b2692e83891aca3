"""The GPU conformance checks (``workers/engines/conformance.py``, run by ``scripts/gpu_check.sh``)
run here on CPU against the stand-ins that copy vLLM's and TensorRT-LLM's behaviour: all six
pass on a faithful engine, and each check can fail."""

from __future__ import annotations

import sys
from typing import Any

import fake_trtllm
import fake_vllm
import pytest

from lanes.workers.engines.conformance import check_settings, report, run_checks


@pytest.fixture
def tokenizer(tiny_model) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model.target)


def install(monkeypatch: pytest.MonkeyPatch, engine: str, tokenizer: Any, **kw: Any) -> Any:
    if engine == "vllm":
        package = fake_vllm.Package(tokenizer, kw.pop("release", fake_vllm.MAIN))
        package.default_script = fake_vllm.Script(list(range(10, 500)), accepted_per_step=1)
        for name, module in package.modules().items():
            monkeypatch.setitem(sys.modules, name, module)
        return package
    package = fake_trtllm.Package(tokenizer, **kw)
    package.default_script = fake_trtllm.Script([(10 + i, f" t{i}") for i in range(500)], iters_per_token=0.5)
    module = package.module()
    monkeypatch.setitem(sys.modules, "tensorrt_llm", module)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", module.llmapi)
    return package


@pytest.mark.parametrize("engine, kw", [
    ("vllm", {"release": fake_vllm.MAIN}), ("vllm", {"release": fake_vllm.V0_11}),
    ("trtllm", {}), ("trtllm", {"scheduler_config": fake_trtllm.FcfsOnlySchedulerConfig}),
])
async def test_all_six_checks_pass_on_an_engine_that_behaves_like_upstream(
        monkeypatch, tiny_model, tokenizer, engine: str, kw: dict[str, Any]) -> None:
    install(monkeypatch, engine, tokenizer, **kw)
    checks = await run_checks(check_settings(engine, tiny_model.target))
    assert [c.passed for c in checks] == [True] * 6, report(engine, checks)


async def test_a_broken_engine_fails_the_checks_it_breaks(monkeypatch, tiny_model, tokenizer) -> None:
    package = install(monkeypatch, "vllm", tokenizer)
    package.default_script = fake_vllm.Script(list(range(10, 500)), accepted_per_step=0)  # drafts never accepted

    def shut_nothing(engine: Any) -> None:
        pass

    async def no_abort(request_id: str) -> None:
        pass

    from lanes.workers.engines.vllm import VllmEngine

    def make(settings: Any) -> VllmEngine:
        engine = VllmEngine(settings)
        engine.abort = no_abort  # type: ignore[method-assign]
        return engine

    checks = await run_checks(check_settings("vllm", tiny_model.target), make=make, shut=shut_nothing)
    failed = {c.name for c in checks if not c.passed}
    assert failed == {"aborts a running request", "n-gram speculation reports acceptance > 0",
                      "engine shutdown becomes EngineDead"}, report("vllm", checks)


def test_the_check_model_has_head_dim_64_in_bf16(tmp_path) -> None:
    import json

    from safetensors import safe_open

    from lanes.workers.models.tiny import build_tiny

    paths = build_tiny(tmp_path, hidden_size=256, dtype="bfloat16")
    config = json.loads((paths.target / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    with safe_open(paths.target / "model.safetensors", "pt") as weights:
        assert {str(weights.get_tensor(k).dtype) for k in weights.keys()} == {"torch.bfloat16"}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")
def test_the_tokens_per_second_table_without_cuda_says_so_in_one_line(tmp_path) -> None:
    """On a CPU-only machine each row failed with a TypeError and the check exited 0."""
    import os
    import subprocess

    out = subprocess.run([sys.executable, "-m", "lanes.workers.engines.gpu_check", "--out-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stdout == "" and out.stderr.startswith("torch sees no CUDA GPU (torch "), out.stderr
    assert out.stderr.strip().endswith("): nothing to check") and len(out.stderr.strip().splitlines()) == 1


def test_the_tokens_per_second_table_exits_1_when_a_row_fails(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from lanes.workers.engines import gpu_check

    async def broken(name: str, engine: Any, max_tokens: int, runs: int) -> dict[str, Any]:
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(gpu_check, "measure", broken)
    monkeypatch.setattr(sys, "argv", ["gpu_check", "--device", "cpu", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as exited:
        gpu_check.main()
    assert exited.value.code == 1
    assert capsys.readouterr().out.count("FAILED: RuntimeError: no kernel image") == 4
