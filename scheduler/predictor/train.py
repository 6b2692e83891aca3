"""Training, refreshing and cross-validating the lexical length predictor (numpy only, pure).

``train_lexical`` and ``refit`` solve one weighted, anchored ridge regression on
log(1 + output tokens), over the n-gram slots and the standardised cue block together (``w``
below holds both; cue standardisation and IDF are fixed by ``train_lexical``)::

    minimise  sum_i c_i (x_i . w + b - y_i)^2 + alpha * (|w - w0|^2 + (b - b0)^2)

``train_lexical`` learns from many sources at once, each answered by other models at its own
length level (text-davinci-003's answers are a fifth of GPT-4's): it centres the targets per
source (``y_i`` minus its source's mean, plus one common ``level``) and weights each source by
1/sqrt(its size) (``c_i``), so the weights learn what makes one prompt's answer longer than
another's *within* a source rather than which source a prompt looks like, and no one large source
outweighs the rest. Measured: leave-one-source-out tau 0.315 -> 0.338 (benchmarks/RESULTS.md).

``refit`` anchors at the current model with every observation weighted alike and not centred, so
a window of fresh observations moves the model towards the deployment's own lengths (level
included) without forgetting what was learnt. Both are solved in the dual,
``(S (X X^T + 1 1^T) S + alpha I) a = S y - S (X w0 + b0)`` with ``S = diag(sqrt(c))``,
``w = w0 + X^T S a``, by conjugate gradients over the sparse rows: memory and time are
O(number of observations x features per prompt), never O(hash space^2), so a bounded window
gives a bounded job.

Metrics (Kendall tau-b, Spearman, lane misroutes, latency) live in ``eval``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from lanes.scheduler.policy import RoutingCalibration, routing_from_observations
from lanes.scheduler.predictor import LengthPredictor
from lanes.scheduler.predictor.lexical import (
    FeatureConfig,
    LexicalModel,
    cue_features,
    raw_counts,
)
from lanes.scheduler.predictor.memory import NeighbourMemory

#: Lexical ridge strength when training from scratch: chosen by leave-one-source-out tau over the
#: nine training sources (the held-out pool's source excluded) among 0.5 / 1 / 2 / 4 / 8 / 16
#: (benchmarks/RESULTS.md, "Length predictor (issue 9)": 0.332 at 1, 0.338 at 4, 0.337 at 8).
LEXICAL_ALPHA = 4.0
#: The encoder's share of a blended score (``LengthPredictor.encoder_weight``). Leave-one-source-out
#: tau mean over the nine training sources: 0.343 / 0.374 / 0.386 / 0.389 / 0.388 at 0 / 0.3 / 0.5 /
#: 0.6 / 0.7; 0.5 because the refresh ranks better with smaller shares (benchmarks/RESULTS.md, "Stop 27").
ENCODER_WEIGHT = 0.5
#: A refit on n observations gives the encoder ``ENCODER_WEIGHT * N / (N + n)`` of the score, N
#: this: the encoder is fixed while the lexical part learns the deployment's own traffic, so the
#: more of it the refit has seen, the less the encoder counts (refit from the shipped weights on
#: 1,000 / 3,000 / 10,000 requests: 0.25 / 0.125 / 0.045). Refitted on a source neither part saw,
#: the best fixed share was 0.5 cold, 0.25-0.5 at 1,000, 0.25 at 3,000-10,000 (within 0.003 of 0
#: there) by tau; held at 0.5, the ρ 0.88 lanes lost up to 1.1x on a pairing against the lexical
#: model alone, and with this schedule they match it (benchmarks/RESULTS.md, "Stop 28").
ENCODER_REFIT_HALF_N = 1_000
#: Lexical anchoring strength for ``refit``: larger keeps the model closer to the current one.
LEXICAL_REFIT_ALPHA = 4.0
#: Refuse windows larger than this: the cron job must bound its memory (observations).
MAX_REFIT_OBSERVATIONS = 50_000
#: Share of a refresh window, its newest observations, that a probe refit leaves out so that the
#: lane thresholds are fitted on predictions of prompts the model was not fitted on.
ROUTING_HELD_OUT_SHARE = 0.2
#: Probes per refit (``refit_with_routing``). 1: one probe reads the older rows without the
#: held-out prompts. 2 (each probe reads every row but those of its share of the held-out prompts)
#: set lower thresholds: +0.2x / +0.6x on two pairings, -0.3x / -2.3x on two others, one of them
#: near the cliff where misrouted short answers set the short P99 (benchmarks/RESULTS.md, "Stop 30").
ROUTING_PROBE_FOLDS = 1
#: The neighbour memory's share of a refitted score (``memory.NeighbourMemory``; 0: no memory).
#: Needs an encoder graph with an ``embedding`` output. Measured: benchmarks/RESULTS.md, "Stop 32".
MEMORY_WEIGHT = 0.0


@dataclass(frozen=True)
class Observation:
    """One finished request: the prompt text the predictor saw and the true output length.

    ``output_tokens`` must be >= 0. Requests cut by ``max_tokens`` (finish reason LENGTH) only
    bound the true length from below; callers should leave them out of a refit window.
    ``source`` is an optional group tag (dataset, tenant) used by cross-source evaluation.
    """

    prompt: str
    output_tokens: int
    source: str = ""


@dataclass(frozen=True)
class _Rows:
    """A sparse design matrix in coordinate form (row ids, slot ids, values)."""

    num_rows: int
    row_ids: np.ndarray
    slots: np.ndarray
    values: np.ndarray

    def matvec(self, w: np.ndarray) -> np.ndarray:
        """X w, one entry per row."""
        return np.bincount(self.row_ids, self.values * w[self.slots], minlength=self.num_rows)

    def rmatvec(self, a: np.ndarray, num_slots: int) -> np.ndarray:
        """X^T a, one entry per slot."""
        return np.bincount(self.slots, self.values * a[self.row_ids], minlength=num_slots)


def _design(prompts: Sequence[str], model: LexicalModel) -> _Rows:
    """Rows over the n-gram slots followed by one slot per cue (``LexicalModel.features``)."""
    feats = [model.features(p) for p in prompts]
    empty = [np.zeros(0, np.int64)]
    row_ids = np.concatenate([np.full(len(s), i, np.int64) for i, (s, _) in enumerate(feats)] or empty)
    slots = np.concatenate([s for s, _ in feats] or empty)
    values = np.concatenate([v for _, v in feats] or [np.zeros(0)])
    return _Rows(len(prompts), row_ids, slots, values)


def log_target(output_tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """The regression target, log(1 + tokens). Raises ValueError on negative lengths."""
    tokens = np.asarray(output_tokens, dtype=np.float64)
    if tokens.size and tokens.min() < 0:
        raise ValueError("output_tokens must be >= 0")
    return np.log1p(tokens)


def fit_idf(prompts: Sequence[str], config: FeatureConfig) -> np.ndarray:
    """Smoothed IDF per slot, ln((1 + n) / (1 + df)) + 1; unseen slots get the maximum."""
    doc_freq = np.zeros(config.num_buckets)
    for prompt in prompts:
        for slots, _ in raw_counts(prompt, config):
            doc_freq[slots] += 1.0
    return np.log((1.0 + len(prompts)) / (1.0 + doc_freq)) + 1.0


def _solve_dual(rows: _Rows, residual: np.ndarray, alpha: float, num_slots: int, scale: np.ndarray) -> np.ndarray:
    """Conjugate gradients for (S (X X^T + 1 1^T) S + alpha I) a = residual, S = diag(scale)."""

    def apply(v: np.ndarray) -> np.ndarray:
        sv = scale * v
        return scale * (rows.matvec(rows.rmatvec(sv, num_slots)) + sv.sum()) + alpha * v

    a = np.zeros_like(residual)
    r = residual.copy()
    p = r.copy()
    rs = float(r @ r)
    tol = 1e-10 * max(rs, 1e-30)
    for _ in range(1000):
        if rs <= tol:
            break
        kp = apply(p)
        step = rs / float(p @ kp)
        a += step * p
        r -= step * kp
        rs_next = float(r @ r)
        p = r + (rs_next / rs) * p
        rs = rs_next
    return a


def _anchored_ridge(
    model: LexicalModel,
    observations: Sequence[Observation],
    alpha: float,
    target: np.ndarray | None = None,
    row_weights: np.ndarray | None = None,
) -> LexicalModel:
    """Solve the ridge above; ``target`` defaults to log(1 + tokens), ``row_weights`` to ones."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if not observations:
        return model
    num_buckets = model.config.num_buckets
    anchor = np.concatenate([model.weights, model.cue_weights])  # n-gram slots, then cue slots
    rows = _design([o.prompt for o in observations], model)
    if target is None:
        target = log_target([o.output_tokens for o in observations])
    scale = np.ones(len(observations)) if row_weights is None else np.sqrt(row_weights)
    residual = scale * (target - rows.matvec(anchor) - model.intercept)
    dual = scale * _solve_dual(rows, residual, alpha, len(anchor), scale)
    # Round to float32 now so that a saved and reloaded model predicts exactly the same.
    weights = (anchor + rows.rmatvec(dual, len(anchor))).astype(np.float32).astype(np.float64)
    return replace(
        model,
        weights=weights[:num_buckets],
        cue_weights=weights[num_buckets:],
        intercept=float(np.float32(model.intercept + dual.sum())),
    )


def source_balance(observations: Sequence[Observation], level: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(per-source centred targets, row weights) as described in the module docstring.

    Each source's rows weigh 1/sqrt(its size), normalised to mean 1. Targets are log(1 + tokens)
    minus the source's mean plus ``level`` (default: the mean of the source means, the common
    level every source is moved to).
    """
    target = log_target([o.output_tokens for o in observations])
    names, source_ids = np.unique([o.source for o in observations], return_inverse=True)
    sizes = np.bincount(source_ids, minlength=len(names)).astype(np.float64)
    means = np.bincount(source_ids, target, minlength=len(names)) / sizes
    weights = 1.0 / np.sqrt(sizes[source_ids])
    common = float(means.mean()) if level is None else level
    return target - means[source_ids] + common, weights / weights.mean()


def train_lexical(
    observations: Sequence[Observation],
    config: FeatureConfig = FeatureConfig(),
    alpha: float = LEXICAL_ALPHA,
    level: float | None = None,
) -> LexicalModel:
    """Fit IDF and weights from scratch, sources balanced and centred (``source_balance``).

    ``level`` is the log(1 + tokens) level all sources are moved to (the intercept; default the
    mean of the source means). Raises ValueError on an empty training set.
    """
    if not observations:
        raise ValueError("cannot train on zero observations")
    idf = fit_idf([o.prompt for o in observations], config).astype(np.float32).astype(np.float64)
    target, row_weights = source_balance(observations, level)
    mean_target = float(np.average(target, weights=row_weights))
    cue_stats: dict[str, np.ndarray] = {}
    if config.cue_weight > 0.0:
        cues = np.stack([cue_features(o.prompt, config.length_request_weight > 0.0) for o in observations])
        std = cues.std(axis=0)
        cue_stats = {
            "cue_mean": cues.mean(axis=0).astype(np.float32).astype(np.float64),
            "cue_scale": np.where(std > 0.0, std, 1.0).astype(np.float32).astype(np.float64),
            "cue_weights": np.zeros(config.num_cues),
        }
    start = LexicalModel(config, idf, np.zeros(config.num_buckets), mean_target, **cue_stats)
    return _anchored_ridge(start, observations, alpha, target, row_weights)


def train(
    observations: Sequence[Observation], info: dict[str, object] | None = None, level: float | None = None,
    encoder: object | None = None, encoder_weight: float = ENCODER_WEIGHT,
) -> LengthPredictor:
    """A lexical predictor with default hyper-parameters (see ``train_lexical``), blended with
    ``encoder`` (an ``encoder.Encoder`` fine-tuned on the same observations) when one is given."""
    return LengthPredictor(train_lexical(observations, level=level), dict(info or {}), encoder,
                           encoder_weight if encoder is not None else 0.0)


def refit_encoder_weight(weight: float, num_observations: int) -> float:
    """The encoder's share after a refit of a model whose share is ``weight`` on
    ``num_observations`` (``ENCODER_REFIT_HALF_N``). Pure."""
    return weight * ENCODER_REFIT_HALF_N / (ENCODER_REFIT_HALF_N + num_observations)


def lexical_target(predictor: LengthPredictor, observations: Sequence[Observation],
                   encoder_weight: float | None = None) -> np.ndarray:
    """What the lexical part must score so that the blend with the encoder's share
    ``encoder_weight`` (default: the predictor's) scores log(1 + tokens): the target itself
    without an encoder, else ``(y - w * encoder) / (1 - w)``."""
    target = log_target([o.output_tokens for o in observations])
    encoded = predictor.encoder_scores([o.prompt for o in observations])
    if encoded is None:
        return target
    weight = predictor.encoder_weight if encoder_weight is None else encoder_weight
    return (target - weight * encoded) / (1.0 - weight)


def refit(predictor: LengthPredictor, observations: Sequence[Observation],
          encoder_weight: float | None = None, memory_weight: float = MEMORY_WEIGHT) -> LengthPredictor:
    """A new predictor moved towards recent observations; ``predictor`` is unchanged.

    Ridge anchored at the current weights, every observation weighted alike and not centred
    (IDF fixed; n-grams never seen in training still get weight; the intercept moves to the
    deployment's own length level). With an encoder blended in, only the lexical part moves: it
    is fitted to what the blend still misses (``lexical_target``), and the encoder's share falls
    to ``encoder_weight`` (default ``refit_encoder_weight(predictor.encoder_weight, n)``). With
    ``memory_weight`` > 0 the new model also keeps a neighbour memory of the window (the
    predictor's own memory, if any, is replaced; one entry per distinct prompt), blended in with
    that share; that needs an
    encoder with an ``embedding`` output (``encoder.EncoderError`` otherwise). Windows over
    ``MAX_REFIT_OBSERVATIONS`` raise ValueError: the caller owns the window (e.g. a capped deque
    of recent finished requests).
    """
    if len(observations) > MAX_REFIT_OBSERVATIONS:
        raise ValueError(f"refit window of {len(observations)} > {MAX_REFIT_OBSERVATIONS} observations")
    if not 0.0 <= memory_weight <= 1.0:
        raise ValueError(f"memory_weight must be in [0, 1], got {memory_weight}")
    if not observations:
        return predictor
    memory = None
    if memory_weight > 0.0:
        if predictor.encoder is None:
            raise ValueError("a neighbour memory (memory_weight > 0) needs the encoder's embeddings; this predictor "
                             "has no encoder")
        # One entry per distinct prompt, at its rows' mean log length: a prompt asked again and
        # again would otherwise fill all k places and turn the mean of k into one row's length.
        lengths: dict[str, list[int]] = {}
        for o in observations:
            lengths.setdefault(o.prompt, []).append(o.output_tokens)
        memory = NeighbourMemory.build([predictor.encoder.embed_text(p) for p in lengths],
                                       [float(log_target(t).mean()) for t in lengths.values()])
    weight = 0.0 if predictor.encoder is None else (
        refit_encoder_weight(predictor.encoder_weight, len(observations)) if encoder_weight is None else encoder_weight)
    target = lexical_target(predictor, observations, weight)
    # Weighted by (1 - w)^2, the lexical part's share of the blend's squared error.
    row_weights = np.full(len(observations), (1.0 - weight) ** 2)
    new_model = _anchored_ridge(predictor.model, observations, LEXICAL_REFIT_ALPHA, target, row_weights)
    count = int(str(predictor.info.get("refit_observations", 0))) + len(observations)
    return replace(predictor, model=new_model, encoder_weight=weight, memory=memory,
                   memory_weight=memory_weight if memory is not None else 0.0,
                   info={**predictor.info, "refit_observations": count})


def refit_with_routing(predictor: LengthPredictor, observations: Sequence[Observation],
                       calibration: RoutingCalibration = RoutingCalibration(),
                       held_out_share: float = ROUTING_HELD_OUT_SHARE,
                       probe_folds: int = ROUTING_PROBE_FOLDS,
                       memory_weight: float = MEMORY_WEIGHT) -> LengthPredictor:
    """``refit`` on every observation (oldest first), with lane thresholds for the new model's
    prediction level saved in its info (``LengthPredictor.routing``).

    A refit moves the predictions to the deployment's own length level, so thresholds fixed in
    advance stop routing as measured (benchmarks/RESULTS.md, "Stop 20: the scheduler's refresh in
    the loop"). The newest ``held_out_share`` of the window is predicted as the edges will predict
    prompts the model never saw: its distinct prompts are dealt to ``probe_folds`` probes, and each
    probe ``refit`` reads every row whose prompt is not among its own (``probe_folds`` 1: the older
    rows without the held-out prompts). ``policy.routing_from_observations`` fits the thresholds
    on those predictions and their true lengths (the whole window's lengths set the second,
    longer-horizon budget). Probes keep a neighbour memory of what they read when the model does
    (``memory_weight``). The model returned is refitted on the whole window; with too few
    short observations in the held-out part it carries no thresholds (the edges keep theirs).
    """
    if not 0.0 < held_out_share < 1.0:
        raise ValueError(f"held_out_share must be in (0, 1), got {held_out_share}")
    if probe_folds < 1:
        raise ValueError(f"probe_folds must be at least 1, got {probe_folds}")
    num_held = round(held_out_share * len(observations))
    routing = None
    # The probe blends as the model it stands in for will (the whole window's share).
    weight = refit_encoder_weight(predictor.encoder_weight, len(observations))
    if 0 < num_held < len(observations):
        held = observations[-num_held:]
        # A probe never reads a prompt it then predicts: a repeated prompt would be recalled, its
        # short answers predicted shorter than a new prompt's, and the threshold set too low for
        # the prompts the edges have not seen. With ``probe_folds`` > 1 the held-out prompts are
        # dealt to that many probes; each reads every row whose prompt is not among its own
        # (older rows and the other probes' held-out rows).
        distinct = list(dict.fromkeys(o.prompt for o in held))
        if probe_folds == 1 and len(distinct) > 1:
            held_prompts = set(distinct)
            if sum(o.prompt not in held_prompts for o in observations) < num_held:
                # Prompts repeat so much that the older rows hold almost none but the held-out
                # prompts (a pool of a few hundred prompts, a templated client): one probe would
                # read next to nothing, and the edges would keep their first thresholds for good
                # (a random predictor's split then cost 3x FCFS's short P99, RESULTS "Stop 43").
                # Two probes, each reading the other's prompts, still predict unseen prompts.
                probe_folds = 2
        prompt_fold = {p: i % probe_folds for i, p in enumerate(distinct)}
        predicted = [0] * num_held
        for k in range(probe_folds):
            rows = [i for i, o in enumerate(held) if prompt_fold[o.prompt] == k]
            if not rows:
                continue
            fit_on = [o for o in observations if prompt_fold.get(o.prompt) != k]
            if not fit_on:
                break
            probe = refit(predictor, fit_on, weight, memory_weight)
            for i in rows:
                predicted[i] = max(1, round(probe.predict_text(held[i].prompt)))
        else:
            routing = routing_from_observations(predicted, [o.output_tokens for o in held], calibration,
                                                [o.output_tokens for o in observations])
    return refit(predictor, observations, weight, memory_weight).with_routing(
        routing, fitted_on=num_held, max_short_to_long=calibration.max_short_to_long,
        max_window_short_to_long=calibration.max_window_short_to_long)


def fold_ids(num_items: int, num_folds: int, seed: int) -> np.ndarray:
    """A shuffled fold id in [0, num_folds) per item, folds differing in size by at most one."""
    order = np.random.default_rng(seed).permutation(num_items)
    ids = np.empty(num_items, np.int64)
    ids[order] = np.arange(num_items) % num_folds
    return ids


def out_of_fold_scores(observations: Sequence[Observation], groups: np.ndarray,
                       on_fit: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Predicted log(1 + tokens) for every item, each by a model trained without its group.

    ``groups`` holds one id per observation: fold ids for k-fold CV, source ids for
    leave-one-source-out. IDF, cue statistics and source levels are refitted per fold, so no
    test text leaks into training. ``on_fit(group, items scored)`` is called after each fit
    (the command line's progress).
    """
    scores = np.zeros(len(observations))
    for group in np.unique(groups):
        test, fit = np.flatnonzero(groups == group), np.flatnonzero(groups != group)
        model = train_lexical([observations[i] for i in fit])
        scores[test] = [model.score_text(observations[i].prompt) for i in test]
        if on_fit is not None:
            on_fit(int(group), len(test))
    return scores
