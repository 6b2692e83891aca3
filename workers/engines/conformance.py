"""Does an installed engine (vLLM, TensorRT-LLM) behave as its adapter expects? Six checks on a
random-weight model, through the adapter, exactly as a worker drives it:

1. it starts with the adapter's arguments (only known-optional ones may be missing);
2. it streams through the chat template, with lane priorities, two requests at once;
3. an abort ends a running request with ``cancelled``;
4. n-gram speculation reports acceptance above zero;
5. an over-long prompt is rejected as ``prompt_too_long``;
6. after the engine shuts down, ``generate`` raises ``EngineDead``.

``scripts/gpu_check.sh`` runs it per engine on a GPU; the tests run the same checks on CPU
against stand-ins that copy upstream behaviour (``tests/fake_vllm.py``, ``tests/fake_trtllm.py``).

    python -m lanes.workers.engines.conformance --engine vllm --out-dir /tmp/lanes-gpu-check
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lanes.queue.messages import ChatMessage, FinishReason, Lane
from lanes.workers.engines.base import (
    EngineDead,
    EngineDelta,
    EngineRequest,
    RequestRejected,
)
from lanes.workers.settings import WorkerSettings

#: Arguments a release may lack without harm: the engine-side queue cap (vLLM >= 0.29) and
#: TensorRT-LLM's priority queue (newer releases); lanes orders requests in Redis anyway.
OPTIONAL_ARGS = {"vllm": {"max_num_queued_reqs"}, "trtllm": {"scheduler_config"}}
MAX_MODEL_LEN = 512
#: Repetitive text: greedy output of a random model soon loops, and the n-gram drafter then hits.
REPEAT = "one two three four five six seven eight nine ten " * 6
STEP_TIMEOUT_S = 120.0


@dataclass
class Check:
    name: str
    passed: bool
    detail: str
    seconds: float


def check_settings(engine: str, model_dir: Path, **overrides: Any) -> WorkerSettings:
    """Small and quick: eager mode, a third of the GPU, n-gram speculation, 512-token sequences."""
    return WorkerSettings(_env_file=None, engine=engine, model=str(model_dir), max_slots=4,
                          max_model_len=MAX_MODEL_LEN, spec_method="ngram", num_speculative_tokens=4,
                          enforce_eager=True, gpu_memory_fraction=0.3, **overrides)


def build_engine(settings: WorkerSettings) -> Any:
    if settings.engine == "vllm":
        from lanes.workers.engines.vllm import VllmEngine

        return VllmEngine(settings)
    from lanes.workers.engines.trtllm import TrtllmEngine

    return TrtllmEngine(settings)


def shut_down(engine: Any) -> None:
    """Stop the engine under the adapter, as a crash or an operator would."""
    if getattr(engine, "_engine", None) is not None:  # vLLM AsyncLLM
        engine._engine.shutdown()
    elif getattr(engine, "_llm", None) is not None:  # TensorRT-LLM LLM
        engine._llm.shutdown()


def _request(rid: str, content: str, max_tokens: int, lane: Lane = Lane.MEDIUM) -> EngineRequest:
    return EngineRequest(id=rid, messages=(ChatMessage("user", content),), max_tokens=max_tokens,
                         temperature=0.0, lane=lane)


async def _collect(engine: Any, request: EngineRequest) -> list[EngineDelta]:
    return [d async for d in engine.generate(request)]


class Checker:
    def __init__(self, engine: Any, settings: WorkerSettings, shut: Callable[[Any], None]) -> None:
        self.engine, self.settings, self.shut = engine, settings, shut
        self.checks: list[Check] = []

    async def run(self, name: str, body: Callable[[], Awaitable[tuple[bool, str]]]) -> bool:
        started = time.monotonic()
        try:
            passed, detail = await asyncio.wait_for(body(), STEP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a failed check is reported, the next one runs
            passed, detail = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self.checks.append(Check(name, passed, detail, time.monotonic() - started))
        return passed

    async def starts(self) -> tuple[bool, str]:
        await self.engine.start()
        dropped = set(getattr(self.engine, "dropped_args", []))
        unexpected = dropped - OPTIONAL_ARGS[self.settings.engine]
        return not unexpected, f"missing in this release: {sorted(dropped) or 'none'}"

    async def streams(self) -> tuple[bool, str]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.settings.model)
        content = "What does a class definition do?"
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        num_prompt = len(tokenizer.encode(text, add_special_tokens=False))
        short, long = await asyncio.gather(
            _collect(self.engine, _request("conf-short", content, 16, Lane.SHORT)),
            _collect(self.engine, _request("conf-long", content, 16, Lane.LONG)))
        ok = all(d and d[-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
                 and sum(len(x.token_ids) for x in d) > 0 and d[0].prompt_tokens == num_prompt for d in (short, long))
        return ok, (f"{sum(len(x.token_ids) for x in short)} + {sum(len(x.token_ids) for x in long)} tokens, "
                    f"prompt {short[0].prompt_tokens if short else '?'} tokens (chat template: {num_prompt})")

    async def aborts(self) -> tuple[bool, str]:
        got: list[EngineDelta] = []
        async for delta in self.engine.generate(_request("conf-abort", REPEAT, 400)):
            got.append(delta)
            if len(got) == 2:
                await self.engine.abort("conf-abort")
        num = sum(len(d.token_ids) for d in got)
        return got[-1].finish_reason is FinishReason.CANCELLED and num < 400, f"ended {got[-1].finish_reason} after {num} tokens"

    async def accepts(self) -> tuple[bool, str]:
        for i in range(3):
            await _collect(self.engine, _request(f"conf-spec-{i}", REPEAT, 128))
        stats = self.engine.stats()
        rate, length = stats.get("spec_acceptance_rate", 0.0), stats.get("spec_mean_acceptance_length", 0.0)
        return rate > 0, f"acceptance rate {rate:.3f}, mean acceptance length {length:.2f}"

    async def rejects_long(self) -> tuple[bool, str]:
        try:
            await _collect(self.engine, _request("conf-long-prompt", "word " * (2 * MAX_MODEL_LEN), 16))
        except RequestRejected as exc:
            return exc.code == "prompt_too_long", f"{exc.code}: {exc}"
        return False, "the over-long prompt was accepted"

    async def dies(self) -> tuple[bool, str]:
        await asyncio.to_thread(self.shut, self.engine)
        await asyncio.sleep(0.2)  # let the engine's own tasks notice (vLLM cancels its output handler)
        try:
            await _collect(self.engine, _request("conf-after", "Hello", 4))
        except EngineDead as exc:
            return True, f"EngineDead: {exc}"
        return False, "generate still ran after the shutdown"


async def run_checks(settings: WorkerSettings, *, make: Callable[[WorkerSettings], Any] = build_engine,
                     shut: Callable[[Any], None] = shut_down) -> list[Check]:
    """All six checks on one engine instance (later checks need it started)."""
    checker = Checker(make(settings), settings, shut)
    try:
        if await checker.run("starts with the adapter's arguments", checker.starts):
            await checker.run("streams through the chat template with priorities", checker.streams)
            await checker.run("aborts a running request", checker.aborts)
            await checker.run("n-gram speculation reports acceptance > 0", checker.accepts)
            await checker.run("rejects an over-long prompt", checker.rejects_long)
            await checker.run("engine shutdown becomes EngineDead", checker.dies)
    finally:
        try:
            await checker.engine.close()
        except Exception:  # noqa: BLE001 - already shut down by the last check
            pass
    return checker.checks


def report(engine: str, checks: list[Check]) -> str:
    lines = [f"{engine}: {sum(c.passed for c in checks)}/6 checks passed"]
    lines += [f"  {'PASS' if c.passed else 'FAIL'}  {c.name:52} {c.seconds:6.1f} s  {c.detail}" for c in checks]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("vllm", "trtllm"), required=True)
    parser.add_argument("--out-dir", default="/tmp/lanes-gpu-check")
    args = parser.parse_args()
    from lanes.workers.models.tiny import build_tiny

    # Head dim 64 (hidden 256, 4 heads) and bf16: what GPU attention kernels expect.
    paths = build_tiny(Path(args.out_dir) / "model", hidden_size=256, dtype="bfloat16")
    checks = asyncio.run(run_checks(check_settings(args.engine, paths.target)))
    print(report(args.engine, checks), flush=True)
    sys.exit(0 if len(checks) == 6 and all(c.passed for c in checks) else 1)


if __name__ == "__main__":
    main()
