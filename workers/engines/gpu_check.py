"""Smoke-benchmark the engines on one machine: tokens/s, TTFT and acceptance per config.

On CPU (``--device cpu``) or CUDA. Exit status 1 if any configuration fails, 2 for CUDA on a
machine where torch sees no CUDA GPU. It measures, it does
not assert speed: the tiny random model is overhead-bound, so speculation exercises code paths
and acceptance accounting here, not a speed-up. vLLM and TensorRT-LLM run only when installed
and a GPU is present.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from lanes.queue.messages import ChatMessage
from lanes.workers.engines.base import EngineDelta, EngineRequest

PROMPT = (ChatMessage("user", "A class definition is an executable statement. The with "
                      "statement is used to wrap the execution of a block."),)


async def measure(name: str, engine: Any, max_tokens: int, runs: int) -> dict[str, Any]:
    """Start ``engine``, warm it up, then time ``runs`` greedy requests one after another."""
    await engine.start()
    try:
        await _drain(engine.generate(_request("warmup", 8)))
        ttfts_ms, tokens, t0 = [], 0, time.perf_counter()
        for i in range(runs):
            start = time.perf_counter()
            first: float | None = None
            async for delta in engine.generate(_request(f"{name}-{i}", max_tokens)):
                if first is None and delta.token_ids:
                    first = time.perf_counter()
                tokens += len(delta.token_ids)
            ttfts_ms.append(((first or time.perf_counter()) - start) * 1e3)
        elapsed_s = time.perf_counter() - t0
        stats = engine.stats()
    finally:
        await engine.close()
    row = {"config": name, "tokens": tokens, "tok_per_s": tokens / elapsed_s,
           "ttft_ms_p50": sorted(ttfts_ms)[len(ttfts_ms) // 2]}
    for key in ("spec_acceptance_rate", "spec_mean_acceptance_length", "target_forwards"):
        if key in stats:
            row[key] = stats[key]
    return row


def _request(request_id: str, max_tokens: int) -> EngineRequest:
    return EngineRequest(id=request_id, messages=PROMPT, max_tokens=max_tokens, temperature=0.0)


async def _drain(stream: AsyncIterator[EngineDelta]) -> None:
    async for _ in stream:
        pass


def _configs(target: Path, draft: Path, device: str) -> list[tuple[str, Any]]:
    import torch
    from lanes.workers.engines.hf_spec import HFSpeculativeEngine

    configs: list[tuple[str, Any]] = [
        (f"hf {device} greedy", HFSpeculativeEngine(target, method="none", device=device)),
        (f"hf {device} draft k=4", HFSpeculativeEngine(target, draft_dir=draft, device=device)),
        (f"hf {device} draft=target k=4",
         HFSpeculativeEngine(target, draft_dir=target, device=device)),
        (f"hf {device} prompt lookup k=4",
         HFSpeculativeEngine(target, method="prompt_lookup", device=device)),
    ]
    if not torch.cuda.is_available():
        return configs
    from lanes.workers.settings import WorkerSettings

    base = {"_env_file": None, "model": str(target), "max_slots": 8, "max_model_len": 1024}
    if importlib.util.find_spec("vllm") is not None:
        from lanes.workers.engines.vllm import VllmEngine

        for spec in ("none", "ngram"):
            settings = WorkerSettings(engine="vllm", spec_method=spec, **base)
            configs.append((f"vllm spec={spec}", VllmEngine(settings)))
    if importlib.util.find_spec("tensorrt_llm") is not None:
        from lanes.workers.engines.trtllm import TrtllmEngine

        for spec in ("none", "ngram"):
            settings = WorkerSettings(engine="trtllm", spec_method=spec, **base)
            configs.append((f"trtllm spec={spec}", TrtllmEngine(settings)))
    return configs


async def main_async(args: argparse.Namespace) -> int:
    """Print the table; returns how many configurations failed."""
    from lanes.workers.models.tiny import build_tiny

    paths = build_tiny(Path(args.out_dir))
    failed = 0
    print(f"{'config':34} {'tok/s':>8} {'ttft ms':>8} {'accept':>7} {'mean len':>8} {'fwd':>5}")
    for name, engine in _configs(paths.target, paths.draft, args.device):
        try:
            row = await measure(name, engine, args.max_tokens, args.runs)
        except Exception as exc:  # report and go on: one engine failing must not hide the rest
            print(f"{name:34} FAILED: {type(exc).__name__}: {exc}")
            failed += 1
            continue
        print(f"{name:34} {row['tok_per_s']:8.1f} {row['ttft_ms_p50']:8.2f} "
              f"{row.get('spec_acceptance_rate', float('nan')):7.3f} "
              f"{row.get('spec_mean_acceptance_length', float('nan')):8.2f} "
              f"{row.get('target_forwards', '-')!s:>5}")
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", default="/tmp/lanes-gpu-check")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    import torch

    # Without a GPU every row failed (and the script still exited 0): say so once instead.
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"torch sees no CUDA GPU (torch {torch.__version__}): nothing to check", file=sys.stderr)
        sys.exit(2)
    sys.exit(1 if asyncio.run(main_async(args)) else 0)


if __name__ == "__main__":
    main()
