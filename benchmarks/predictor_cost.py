"""CPU cost of the shipped length predictor's ``predict``, per prompt length (issue 9: p99 <= 5 ms).

Usage (one core, one BLAS / OpenMP thread, as benchmarks/RESULTS.md reports it)::

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/predictor_cost.py \\
        benchmarks/data/predictor/prompts.jsonl.gz [--old /path/to/checkout/of/the/base] [--json]

Prompts: for each length (300, 1k, 4k, 16k, 64k, 100k characters: 200 each; 1 M: 40), distinct
texts made of the data set's prompts (shuffled, joined by blank lines) and cut to the length;
each starts at another prompt, so no two share their head. Each call is timed with
``time.thread_time`` (CPU time of this thread) after the encoder's score cache is emptied, so
every call runs the graph (the cache would otherwise answer a repeated head).

``--old`` loads the predictor package of another checkout (``git worktree add /tmp/base <commit>``)
beside this one, and times both on the same prompts, interleaved (which one runs first alternates),
in one process: the fairest comparison on a machine shared with other jobs.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lanes.queue.messages import ChatMessage

PACKAGE = "lanes.scheduler.predictor"
LENGTHS = (300, 1_000, 4_000, 16_000, 64_000, 100_000, 1_000_000)


def read_prompts(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line)["prompt"] for line in handle]


def long_prompts(prompts: list[str], length: int, count: int, seed: int) -> list[str]:
    """``count`` distinct texts of exactly ``length`` characters: data-set prompts from a
    different start each, joined by blank lines."""
    rng = random.Random(seed * 1_000_003 + length)
    order = prompts[:]
    rng.shuffle(order)
    texts = []
    for i in range(count):
        parts, size, j = [], 0, i * 7  # a different first prompt each
        while size < length:
            part = order[j % len(order)]
            parts.append(part)
            size += len(part) + 2
            j += 1
        texts.append("\n\n".join(parts)[:length])
    return texts


def load_predictor_from(checkout: Path) -> Any:
    """``load_default()`` of the predictor package in ``checkout``, imported beside this one's:
    its modules stand in ``sys.modules`` while it loads (its imports are absolute), then this
    checkout's are put back."""
    saved = {name: module for name, module in sys.modules.items() if name == PACKAGE or name.startswith(PACKAGE + ".")}
    for name in saved:
        del sys.modules[name]
    root = checkout / "scheduler" / "predictor"
    try:
        spec = importlib.util.spec_from_file_location(PACKAGE, root / "__init__.py", submodule_search_locations=[str(root)])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = module
        spec.loader.exec_module(module)
        predictor = module.load_default()
        predictor.predict([ChatMessage(role="user", content="warm up")], 4096)
    finally:
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]
        sys.modules.update(saved)
    return predictor


def cost_ms(predictor: Any, text: str) -> float:
    """CPU milliseconds of one ``predict`` of ``text`` with an empty encoder cache."""
    encoder = predictor.encoder
    if encoder is not None:
        encoder._cache.clear()
        encoder._embeddings.clear()
    messages = [ChatMessage(role="user", content=text)]
    start = time.thread_time()
    predictor.predict(messages, 4096)
    return (time.thread_time() - start) * 1000.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("prompts", type=Path, help="prompts.jsonl.gz (benchmarks/data/predictor)")
    parser.add_argument("--old", type=Path, help="another checkout whose predictor to time beside this one")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--count", type=int, default=200, help="prompts per length (below 1 M)")
    parser.add_argument("--count-1m", type=int, default=40, help="prompts at 1 M characters and more")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from lanes.scheduler.predictor import load_default

    sides: dict[str, Any] = {}
    if args.old is not None:
        sides["old"] = load_predictor_from(args.old)
    sides["new"] = load_default()
    sides["new"].predict([ChatMessage(role="user", content="warm up")], 4096)
    prompts = read_prompts(args.prompts)
    results: dict[int, dict[str, list[float]]] = {}
    for length in map(int, args.lengths.split(",")):
        texts = long_prompts(prompts, length, args.count_1m if length >= 1_000_000 else args.count, args.seed)
        times: dict[str, list[float]] = {name: [] for name in sides}
        for i, text in enumerate(texts):
            names = list(sides) if i % 2 == 0 else list(reversed(sides))
            for name in names:
                times[name].append(cost_ms(sides[name], text))
        results[length] = times
        if not args.json:
            row = "  ".join(f"{name} p50/p99 {statistics.median(t):6.2f} / {percentile(t, 0.99):6.2f} ms"
                            for name, t in times.items())
            print(f"{length:>9,} chars x{len(texts)}: {row}", flush=True)
    if args.json:
        print(json.dumps({str(length): {name: {"p50_ms": statistics.median(t), "p99_ms": percentile(t, 0.99),
                                               "n": len(t)} for name, t in times.items()}
                          for length, times in results.items()}, indent=1))


if __name__ == "__main__":
    main()
