"""Small synthetic inputs for the benchmark commands' smoke tests: an Azure-format trace and a
prompt file with known answer lengths."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

PROMPTS = [
    {"prompt": "Say hi.", "output_tokens": 3},
    {"prompt": "Name a colour.", "output_tokens": 5},
    {"prompt": "Give me a one-line summary of photosynthesis.", "output_tokens": 30},
    {"prompt": "Write a short poem about the sea.", "output_tokens": 120},
    {"prompt": "Explain, step by step, how a compiler turns source code into machine code.", "output_tokens": 600},
    {"prompt": "Write a detailed essay on the causes of the First World War.", "output_tokens": 900},
]


def write_trace(path: Path, num_rows: int, spacing_s: float, min_context: int, log_mean_output: float) -> Path:
    """Rows ``spacing_s`` apart in the Azure 2023 CSV format, lognormal answer lengths (seed 0)."""
    rng = np.random.default_rng(0)
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(num_rows):
        seconds = spacing_s * i
        rows.append(f"2023-11-16 18:{int(seconds // 60):02d}:{seconds % 60:09.6f}0,{rng.integers(min_context, 1500)},"
                    f"{int(rng.lognormal(log_mean_output, 1.0)) + 1}")
    path.write_text("\n".join(rows) + "\n")
    return path


def write_prompts(path: Path) -> Path:
    path.write_text(json.dumps(PROMPTS))
    return path
