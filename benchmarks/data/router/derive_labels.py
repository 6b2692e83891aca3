"""Derive ``judgments.csv`` from AlpacaEval annotation files (provenance: docs/router-data.md).

Usage (from the repo root, with a checkout or ``git`` mirror of tatsu-lab/alpaca_eval)::

    python benchmarks/data/router/derive_labels.py ALPACA_EVAL_GIT_DIR [COMMIT]

Reads, with ``git show COMMIT:PATH``, one annotation file per small model. In every file the
judge compared the small model's answer (``output_2``) with gpt4_1106_preview's (``output_1``,
GPT-4 Turbo: our "large" model) on the same 805 prompts; ``preference - 1`` is the judged
probability that the small model's answer is better. Writes one row per prompt, in the order of
``../shared/data/prompts/alpaca_eval_*.json`` (checked through a crc32 of the instruction).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import zlib
from pathlib import Path

#: column name -> (path in alpaca_eval, judge)
SOURCES = {
    "mistral_7b_v02": "results/Mistral-7B-Instruct-v0.2/alpaca_eval_cot_gpt4_turbo_fn/annotations.json",
    "openhermes_25_mistral_7b": "results/OpenHermes-2.5-Mistral-7B/weighted_alpaca_eval_gpt4_turbo/annotations.json",
    "gemma_7b_it": "results/gemma-7b-it/weighted_alpaca_eval_gpt4_turbo/annotations.json",
}
LARGE = "gpt4_1106_preview"
ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ROOT.parent / "shared/data/prompts/alpaca_eval_Mistral-7B-Instruct-v0.2.json"


def crc(text: str) -> str:
    return f"{zlib.crc32(text.encode()):08x}"


def main(git_dir: str, commit: str = "cd543a149df89434d8a54582c0151c0b945c3d20") -> None:
    prompts = json.loads(PROMPTS.read_text())
    columns: dict[str, list[str]] = {}
    for name, path in SOURCES.items():
        raw = subprocess.run(["git", "--git-dir", git_dir, "show", f"{commit}:{path}"],
                             check=True, capture_output=True).stdout
        rows = json.loads(raw)
        assert len(rows) == len(prompts), (name, len(rows))
        for row, prompt in zip(rows, prompts, strict=True):
            assert row["instruction"] == prompt["instruction"], name
            assert row["generator_1"] == LARGE, row["generator_1"]
        columns[name] = [f"{float(row['preference']) - 1.0:.4f}" for row in rows]
    out = Path(__file__).with_name("judgments.csv")
    with out.open("w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(["idx", "dataset", "instruction_crc32", *SOURCES])
        for idx, prompt in enumerate(prompts):
            writer.writerow([idx, prompt["dataset"], crc(prompt["instruction"]),
                             *(columns[name][idx] for name in SOURCES)])
    print(f"wrote {out} ({len(prompts)} rows)")


if __name__ == "__main__":
    main(*sys.argv[1:])
