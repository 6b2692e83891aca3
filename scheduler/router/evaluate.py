"""Held-out evaluation of routing on judged data: share sent small and the quality it costs.

For a threshold ``t`` a prompt goes to the small pool when its held-out complexity <= t. Against a
system that always uses the large model, on one small model's judged comparisons:

    small_share    share of prompts routed small
    worse_small    share of ALL prompts routed small where the small answer was judged clearly
                   worse (P(small better) < CLEARLY_WORSE): the quality cost, counted in prompts
    worse_rate     worse_small / small_share: how often a small-routed answer is clearly worse
                   (random routing at the same share has the base rate)
    win_rate       judged win rate of the routed system vs always-large (0.5 = no loss): a
                   small-routed prompt scores P(small better), a large-routed one 0.5
    random / oracle  the same win rate for random routing and for perfect routing at that share
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

#: A small answer is "clearly worse" when the judged P(it is better than the large one's) is below this.
CLEARLY_WORSE = 0.25


@dataclass(frozen=True)
class RoutingPoint:
    threshold: float
    small_share: float
    worse_small: float
    worse_rate: float
    win_rate: float
    random_win_rate: float
    oracle_win_rate: float


def prompt_folds(num_prompts: int, num_folds: int, seed: int) -> np.ndarray:
    """Fold id per prompt, shuffled (each prompt is one row, so folds are by prompt)."""
    return np.random.default_rng(seed).permutation(num_prompts) % num_folds


def dataset_folds(datasets: Sequence[str]) -> np.ndarray:
    """Fold id per prompt: one fold per AlpacaEval source, held out whole."""
    names = sorted(set(datasets))
    return np.array([names.index(d) for d in datasets])


def held_out_complexity(
    prompts: Sequence[str], target: np.ndarray, folds: np.ndarray,
    fit: Callable[[list[str], np.ndarray], Callable[[str], float]],
) -> np.ndarray:
    """Complexity of every prompt from a model that never saw it (or anything of its fold)."""
    out = np.empty(len(prompts))
    for k in np.unique(folds):
        train = np.flatnonzero(folds != k)
        scorer = fit([prompts[i] for i in train], target[train])
        for i in np.flatnonzero(folds == k):
            out[i] = scorer(prompts[i])
    return out


def routing_point(complexity: np.ndarray, p_win: np.ndarray, threshold: float) -> RoutingPoint:
    """Metrics of routing small when ``complexity <= threshold`` (module docstring)."""
    small = complexity <= threshold
    share = float(small.mean())
    worse = p_win < CLEARLY_WORSE
    num_small = int(small.sum())
    oracle = np.sort(p_win)[::-1][:num_small]
    return RoutingPoint(
        threshold=threshold,
        small_share=share,
        worse_small=float((small & worse).mean()),
        worse_rate=float((small & worse).sum() / num_small) if num_small else 0.0,
        win_rate=float(np.where(small, p_win, 0.5).mean()),
        random_win_rate=0.5 * (1 - share) + share * float(p_win.mean()),
        oracle_win_rate=float((oracle.sum() + 0.5 * (len(p_win) - num_small)) / len(p_win)),
    )


def auc(score: np.ndarray, positive: np.ndarray) -> float:
    """ROC AUC of ``score`` for the 0/1 labels ``positive`` (ties count half)."""
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    sorted_scores = score[order]
    # Average ranks over ties.
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    for start, count in zip(first, counts):
        ranks[order[start:start + count]] = start + (count + 1) / 2.0
    num_pos = int(positive.sum())
    num_neg = len(positive) - num_pos
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    return float((ranks[positive.astype(bool)].sum() - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))
