"""Predicted lengths for a trace: the shipped predictor on real prompts, the noise model, or random.

The traces carry no prompt text. ``pair_prompts`` gives each trace row a real prompt whose
known answer length is closest to the row's, reusing every prompt evenly: sorting both sides
by length and matching ranks is that pairing (in one dimension the monotone matching minimises
the total length gap under equal reuse). The predictor then runs on the paired prompt, and
the realised Kendall tau against the trace's lengths is what the policies actually saw.

Only ``predict_prompts`` touches a clock (an argument): it times each prediction so the
simulation can charge it to the request's queueing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lanes.queue.messages import ChatMessage
from lanes.scheduler.policy import LaneThresholds
from lanes.scheduler.sim.noise import kendall_tau, noisy_predictions, sigma_for_tau

#: Predictor time charged per request by the noise model (the shipped predictor: ~1-2 ms p99).
NOISE_PREDICTOR_MS = 2.0


@dataclass(frozen=True)
class Predictions:
    """One prediction per trace row and what it cost."""

    tokens: np.ndarray
    latency_ms: np.ndarray
    #: Where they came from ("shipped", "noise", "random", "oracle").
    source: str
    #: Realised Kendall tau against the trace's true output lengths.
    tau: float
    #: Lane thresholds per row when the predictor shipped its own (the refresh in the loop,
    #: ``refresh.py``); None: the ``lanes`` policies fit them on the trace's first rows.
    routing: list[LaneThresholds] | None = None
    #: What else the source reports (the refresh's seen share, tau on unseen prompts).
    info: dict[str, object] = field(default_factory=dict)


def pair_prompts(trace_tokens: np.ndarray, pool_tokens: np.ndarray, seed: int | None = None) -> np.ndarray:
    """Index into the pool for each trace row: the prompt whose known length is closest, each
    prompt used evenly (``floor`` or ``ceil`` of rows / prompts times). Raises ``ValueError`` on
    an empty pool.

    With at least as many rows as prompts, rank matching is the closest even pairing. With fewer
    (a ``--requests`` slice, the live benchmark's 400 rows) each prompt is used at most once, and
    rank matching would spread the rows over the pool's quantiles (three rows of 300-320 tokens
    got prompts of 7, 261 and 460 where prompts of 300, 310 and 320 exist): the rows then take the
    order-preserving choice of distinct prompts with the least total length difference
    (``_closest_distinct``).

    Rows and prompts of equal length keep their order; with ``seed``, ties on both sides are
    broken at random instead (another pairing just as close, to measure what the choice among
    equal-length prompts does to a result).
    """
    if len(pool_tokens) == 0:
        raise ValueError("the prompt pool is empty")
    n, m = len(trace_tokens), len(pool_tokens)
    if seed is None:
        rows = np.argsort(trace_tokens, kind="stable")
        pool_order = np.argsort(pool_tokens, kind="stable")
    else:
        rng = np.random.default_rng(seed)
        rows, pool_order = (np.lexsort((rng.random(len(x)), x)) for x in (trace_tokens, pool_tokens))
    paired = np.empty(n, dtype=np.int64)
    if n >= m:
        paired[rows] = pool_order[(np.arange(n) * m) // n]
    else:
        chosen = _closest_distinct(np.asarray(trace_tokens, float)[rows], np.asarray(pool_tokens, float)[pool_order])
        paired[rows] = pool_order[chosen]
    return paired


def _closest_distinct(rows: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """For sorted ``rows`` (n) and sorted ``pool`` (m > n): increasing pool positions, one per
    row, minimizing the sum of ``|row - prompt|`` (for sorted sequences an order-preserving
    matching is optimal). Dynamic programme over each row's m - n + 1 feasible positions."""
    n, width = len(rows), len(pool) - len(rows) + 1
    offsets = np.arange(width)
    best = np.abs(rows[0] - pool[offsets])  # row 0 at position k
    came_from = np.zeros((n, width), dtype=np.int32)
    for i in range(1, n):
        # Row i at position i + k: row i - 1 at some i - 1 + k' with k' <= k.
        prefix_min = np.minimum.accumulate(best)
        came_from[i] = _running_argmin(best, prefix_min)
        best = prefix_min + np.abs(rows[i] - pool[i + offsets])
    chosen = np.empty(n, dtype=np.int64)
    k = int(np.argmin(best))
    for i in range(n - 1, -1, -1):
        chosen[i] = i + k
        k = int(came_from[i][k]) if i else k
    return chosen


def _running_argmin(values: np.ndarray, prefix_min: np.ndarray) -> np.ndarray:
    """Index of the minimum of ``values[:k + 1]`` for each k (the first, on ties), given
    ``prefix_min = np.minimum.accumulate(values)``."""
    is_new = np.concatenate(([True], values[1:] < prefix_min[:-1]))
    return np.maximum.accumulate(np.where(is_new, np.arange(len(values)), 0))


def predict_prompts(predict: Callable[[Sequence[ChatMessage], int], int], prompts: Sequence[str], max_tokens: int,
                    clock: Callable[[], float] = time.perf_counter) -> tuple[np.ndarray, np.ndarray]:
    """Predicted tokens and latency (ms) per prompt, calling ``predict(messages, max_tokens)``
    as the edge does (one warm-up call first, so lazy loading is not charged to one prompt)."""
    if prompts:
        predict([ChatMessage("user", prompts[0])], max_tokens)
    tokens, latency_ms = np.empty(len(prompts)), np.empty(len(prompts))
    for i, prompt in enumerate(prompts):
        began = clock()
        tokens[i] = predict([ChatMessage("user", prompt)], max_tokens)
        latency_ms[i] = (clock() - began) * 1000.0
    return tokens, latency_ms


def from_pool(true_tokens: np.ndarray, paired: np.ndarray, pool_predicted: np.ndarray,
              pool_latency_ms: np.ndarray) -> Predictions:
    """The predictor's outputs on each row's paired prompt (``paired``, from ``pair_prompts``),
    with their measured latency."""
    tokens = pool_predicted[paired]
    return Predictions(tokens, pool_latency_ms[paired], "shipped", kendall_tau(true_tokens, tokens))


def shuffled(predictions: Predictions, true_tokens: np.ndarray, seed: int) -> Predictions:
    """A predictor that outputs random lengths: the same outputs (and latencies) as
    ``predictions``, dealt to the rows at random, so lane shares stay the same and tau is ~0."""
    order = np.random.default_rng(seed).permutation(len(predictions.tokens))
    tokens = predictions.tokens[order]
    return Predictions(tokens, predictions.latency_ms[order], "random", kendall_tau(true_tokens, tokens))


def noisy(true_tokens: np.ndarray, target_tau: float, seed: int) -> Predictions:
    """``pred = true * exp(N(0, sigma^2))`` with sigma calibrated to ``target_tau``."""
    tokens = noisy_predictions(true_tokens, sigma_for_tau(true_tokens, target_tau, seed), seed)
    latency = np.full(len(true_tokens), NOISE_PREDICTOR_MS)
    return Predictions(tokens, latency, "noise", kendall_tau(true_tokens, tokens))


def oracle(true_tokens: np.ndarray) -> Predictions:
    """The true lengths, free (an upper bound)."""
    return Predictions(true_tokens.astype(float), np.zeros(len(true_tokens)), "oracle", 1.0)
