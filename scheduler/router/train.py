"""Fit the complexity model on judged AlpacaEval comparisons (offline; needs scikit-learn).

Data: ``benchmarks/data/router/judgments.csv`` (one row per AlpacaEval prompt: for each small
model, the judged probability that its answer beats GPT-4 Turbo's) joined with the prompt texts
in ``../shared/data/prompts``. Provenance: docs/router-data.md.

Each prompt is two weighted rows of a logistic regression, ``y=1`` with weight ``p`` and ``y=0``
with weight ``1 - p``, where ``p`` is the mean judged win probability of the small models named
in ``target``: the fit estimates P(a small model's answer is judged at least as good).
"""

from __future__ import annotations

import csv
import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from lanes.scheduler.router.complexity import NUM_QUANTILES, ComplexityModel
from lanes.scheduler.router.features import (
    NUM_BUCKETS,
    NUM_CUES,
    cue_values,
    word_slots,
)

#: Regularisation strengths tried by the inner cross-validation (scikit-learn's C).
C_GRID = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
PROMPTS_FILE = "prompts/alpaca_eval_Mistral-7B-Instruct-v0.2.json"


@dataclass(frozen=True)
class JudgedSet:
    prompts: list[str]
    #: AlpacaEval source of each prompt (selfinstruct, oasst, koala, helpful_base, vicuna).
    datasets: list[str]
    #: small model name -> judged P(small answer better than the large one's), one per prompt.
    p_win: dict[str, np.ndarray]


def load_judged(judgments_csv: Path, shared_data: Path) -> JudgedSet:
    """Join the judgments with the prompt texts; raises ValueError when they do not line up."""
    records = json.loads((shared_data / PROMPTS_FILE).read_text())
    with judgments_csv.open() as handle:
        rows = list(csv.DictReader(handle))
    if len(rows) != len(records):
        raise ValueError(f"{judgments_csv}: {len(rows)} rows, {len(records)} prompts")
    models = [name for name in rows[0] if name not in ("idx", "dataset", "instruction_crc32")]
    for row, record in zip(rows, records, strict=True):
        if row["instruction_crc32"] != f"{zlib.crc32(record['instruction'].encode()):08x}":
            raise ValueError(f"{judgments_csv}: row {row['idx']} does not match its prompt")
    return JudgedSet(
        prompts=[r["instruction"] for r in records],
        datasets=[r["dataset"] for r in rows],
        p_win={m: np.array([float(r[m]) for r in rows]) for m in models},
    )


def design(prompts: Sequence[str]) -> tuple[object, np.ndarray]:
    """(sparse word block, raw cue matrix) in exactly the layout ``ComplexityModel.p_ok`` scores."""
    from scipy.sparse import csr_matrix

    indptr, indices, values = [0], [], []
    for prompt in prompts:
        slots = word_slots(prompt)
        indices.extend(slots.tolist())
        values.extend([1.0 / np.sqrt(len(slots))] * len(slots))
        indptr.append(len(indices))
    words = csr_matrix((values, indices, indptr), shape=(len(prompts), NUM_BUCKETS))
    return words, np.array([cue_values(p) for p in prompts]).reshape(len(prompts), NUM_CUES)


def _fit_raw(words: object, cues: np.ndarray, p: np.ndarray, c: float) -> tuple[np.ndarray, ...]:
    from scipy.sparse import hstack
    from sklearn.linear_model import LogisticRegression

    mean = cues.mean(axis=0)
    scale = cues.std(axis=0)
    scale[scale < 1e-6] = 1.0
    x = hstack([words, (cues - mean) / scale]).tocsr()
    n = x.shape[0]
    x2 = x[np.r_[np.arange(n), np.arange(n)]]
    y2 = np.r_[np.ones(n), np.zeros(n)]
    w2 = np.r_[p, 1.0 - p]
    keep = w2 > 0
    fit = LogisticRegression(C=c, max_iter=2000).fit(x2[keep], y2[keep], sample_weight=w2[keep])
    coef = fit.coef_[0]
    return coef[:NUM_BUCKETS], mean, scale, coef[NUM_BUCKETS:], np.array([fit.intercept_[0]])


def _log_loss(p_hat: np.ndarray, p: np.ndarray) -> float:
    p_hat = np.clip(p_hat, 1e-6, 1 - 1e-6)
    return float(-np.mean(p * np.log(p_hat) + (1 - p) * np.log(1 - p_hat)))


def fit(prompts: Sequence[str], p: np.ndarray, c: float | None = None, seed: int = 0,
        meta: dict[str, object] | None = None) -> ComplexityModel:
    """Fit on ``prompts`` with soft targets ``p``; ``c=None`` picks C by inner 4-fold CV."""
    words, cues = design(prompts)
    if c is None:
        c = select_c(words, cues, p, seed)
    word_w, mean, scale, cue_w, intercept = _fit_raw(words, cues, p, c)
    model = ComplexityModel(word_w, mean, scale, cue_w, float(intercept[0]), np.zeros(NUM_QUANTILES),
                            meta={**(meta or {}), "C": c})
    p_ok = np.array([model.p_ok(prompt) for prompt in prompts])
    quantiles = np.quantile(p_ok, np.linspace(0.0, 1.0, NUM_QUANTILES))
    # float32 storage must not break monotonicity, so round before the saved model is built.
    quantiles = np.maximum.accumulate(quantiles.astype(np.float32).astype(np.float64))
    return ComplexityModel(word_w, mean, scale, cue_w, float(intercept[0]), quantiles, model.meta)


def select_c(words: object, cues: np.ndarray, p: np.ndarray, seed: int, num_folds: int = 4) -> float:
    """The ``C_GRID`` value with the lowest inner-CV log loss (folds by prompt)."""
    folds = np.random.default_rng(seed).permutation(len(p)) % num_folds
    losses = []
    for c in C_GRID:
        loss = 0.0
        for k in range(num_folds):
            train, test = folds != k, folds == k
            word_w, mean, scale, cue_w, b = _fit_raw(words[train], cues[train], p[train], c)
            z = words[test] @ word_w + ((cues[test] - mean) / scale) @ cue_w + b[0]
            loss += _log_loss(1.0 / (1.0 + np.exp(-z)), p[test])
        losses.append(loss)
    return C_GRID[int(np.argmin(losses))]
