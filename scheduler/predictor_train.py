"""Training, refreshing and cross-validating the length predictor (numpy only, pure).

``minilm`` models are RBF kernel ridge over MiniLM embeddings (``predictor_embedding``): ``train``
solves it on the training set, ``refit`` re-solves it on the kept examples plus the new window,
keeping the newest ``KernelConfig.max_examples`` (bounded memory and an O(n^3) bounded job).

``lexical`` models (``train`` and ``refit``) solve one anchored ridge regression on
log(1 + output tokens), over the n-gram slots and the standardised cue block together
(``w`` below holds both; cue standardisation and IDF are fixed by ``train``)::

    minimise  sum_i (x_i . w + b - y_i)^2 + alpha * (|w - w0|^2 + (b - b0)^2)

``train`` anchors at zero (``b0`` = mean target); ``refit`` anchors at the current model, so a
window of fresh observations moves the model towards them without forgetting what was learnt.
It is solved in the dual, ``(X X^T + 1 1^T + alpha I) a = y - X w0 - b0``, ``w = w0 + X^T a``, by
conjugate gradients over the sparse rows: memory and time are O(number of observations x
features per prompt), never O(hash space^2), so a bounded window gives a bounded job.

Metrics (Kendall tau-b, Spearman, lane misroutes, latency) live in ``predictor_eval``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from lanes.scheduler.predictor import LengthPredictor, load_minilm_encoder
from lanes.scheduler.predictor_embedding import EmbeddingModel, EncoderConfig, KernelConfig
from lanes.scheduler.predictor_encoder import MiniLMEncoder
from lanes.scheduler.predictor_lexical import NUM_CUES, FeatureConfig, LexicalModel, cue_features, raw_counts

#: Lexical ridge strength when training from scratch (chosen by 5-fold CV on AlpacaEval).
LEXICAL_ALPHA = 1.0
#: Lexical anchoring strength for ``refit``: larger keeps the model closer to the current one.
LEXICAL_REFIT_ALPHA = 4.0
#: Refuse windows larger than this: the cron job must bound its memory (observations).
MAX_REFIT_OBSERVATIONS = 50_000


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


def _solve_dual(rows: _Rows, residual: np.ndarray, alpha: float, num_slots: int) -> np.ndarray:
    """Conjugate gradients for (X X^T + 1 1^T + alpha I) a = residual. Returns a."""

    def apply(v: np.ndarray) -> np.ndarray:
        return rows.matvec(rows.rmatvec(v, num_slots)) + v.sum() + alpha * v

    a = np.zeros_like(residual)
    r = residual.copy()
    p = r.copy()
    rs = float(r @ r)
    tol = 1e-12 * max(rs, 1e-30)
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


def _anchored_ridge(model: LexicalModel, observations: Sequence[Observation], alpha: float) -> LexicalModel:
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if not observations:
        return model
    num_buckets = model.config.num_buckets
    anchor = np.concatenate([model.weights, model.cue_weights])  # n-gram slots, then cue slots
    rows = _design([o.prompt for o in observations], model)
    target = log_target([o.output_tokens for o in observations])
    residual = target - rows.matvec(anchor) - model.intercept
    dual = _solve_dual(rows, residual, alpha, len(anchor))
    # Round to float32 now so that a saved and reloaded model predicts exactly the same.
    weights = (anchor + rows.rmatvec(dual, len(anchor))).astype(np.float32).astype(np.float64)
    return replace(
        model,
        weights=weights[:num_buckets],
        cue_weights=weights[num_buckets:],
        intercept=float(np.float32(model.intercept + dual.sum())),
    )


def train_lexical(
    observations: Sequence[Observation], config: FeatureConfig = FeatureConfig(), alpha: float = LEXICAL_ALPHA
) -> LexicalModel:
    """Fit IDF and weights from scratch. Raises ValueError on an empty training set."""
    if not observations:
        raise ValueError("cannot train on zero observations")
    idf = fit_idf([o.prompt for o in observations], config).astype(np.float32).astype(np.float64)
    mean_target = float(log_target([o.output_tokens for o in observations]).mean())
    cue_stats: dict[str, np.ndarray] = {}
    if config.cue_weight > 0.0:
        cues = np.stack([cue_features(o.prompt) for o in observations])
        std = cues.std(axis=0)
        cue_stats = {
            "cue_mean": cues.mean(axis=0).astype(np.float32).astype(np.float64),
            "cue_scale": np.where(std > 0.0, std, 1.0).astype(np.float32).astype(np.float64),
            "cue_weights": np.zeros(NUM_CUES),
        }
    start = LexicalModel(config, idf, np.zeros(config.num_buckets), mean_target, **cue_stats)
    return _anchored_ridge(start, observations, alpha)


def embed(encoder: MiniLMEncoder, prompts: Sequence[str]) -> np.ndarray:
    """(n, 384) float32 unit-norm embeddings, one row per prompt (about 3 ms each)."""
    return np.stack([encoder.encode(p) for p in prompts]) if prompts else np.zeros((0, 384), np.float32)


def train_minilm(
    observations: Sequence[Observation],
    encoder_config: EncoderConfig = EncoderConfig(),
    kernel: KernelConfig = KernelConfig(),
    embeddings: np.ndarray | None = None,
) -> EmbeddingModel:
    """Kernel ridge on MiniLM embeddings (``embeddings`` may pass them precomputed, row-aligned).

    Raises ValueError on an empty training set and EncoderUnavailable without the MiniLM wheel.
    """
    if not observations:
        raise ValueError("cannot train on zero observations")
    encoder = load_minilm_encoder(encoder_config)
    if embeddings is None:
        embeddings = embed(encoder, [o.prompt for o in observations])
    targets = log_target([o.output_tokens for o in observations])
    return EmbeddingModel.fit(encoder_config, kernel, encoder, embeddings, targets)


def train(
    observations: Sequence[Observation],
    kind: str = "minilm",
    info: dict[str, object] | None = None,
    encoder_config: EncoderConfig = EncoderConfig(),
) -> LengthPredictor:
    """A predictor of ``kind`` ("minilm" or "lexical"); default hyper-parameters otherwise."""
    if kind == "minilm":
        return LengthPredictor(train_minilm(observations, encoder_config), dict(info or {}))
    if kind == "lexical":
        return LengthPredictor(train_lexical(observations), dict(info or {}))
    raise ValueError(f"unknown predictor kind {kind!r}")


def refit(predictor: LengthPredictor, observations: Sequence[Observation]) -> LengthPredictor:
    """A new predictor moved towards recent observations; ``predictor`` is unchanged.

    ``minilm``: kernel ridge re-solved on the kept examples followed by ``observations`` (newest
    ``max_examples`` kept). ``lexical``: ridge anchored at the current weights (IDF fixed; n-grams
    never seen in training still get weight). Windows over ``MAX_REFIT_OBSERVATIONS`` raise
    ValueError: the caller owns the window (e.g. a capped deque of recent finished requests).
    """
    if len(observations) > MAX_REFIT_OBSERVATIONS:
        raise ValueError(f"refit window of {len(observations)} > {MAX_REFIT_OBSERVATIONS} observations")
    if not observations:
        return predictor
    model = predictor.model
    if isinstance(model, LexicalModel):
        new_model: LexicalModel | EmbeddingModel = _anchored_ridge(model, observations, LEXICAL_REFIT_ALPHA)
    else:
        fresh = embed(model.encoder, [o.prompt for o in observations])
        targets = np.concatenate([model.targets, log_target([o.output_tokens for o in observations])])
        embeddings = np.concatenate([model.support, fresh])
        new_model = EmbeddingModel.fit(model.encoder_config, model.kernel, model.encoder, embeddings, targets)
    count = int(str(predictor.info.get("refit_observations", 0))) + len(observations)
    return LengthPredictor(new_model, {**predictor.info, "refit_observations": count})


def fold_ids(num_items: int, num_folds: int, seed: int) -> np.ndarray:
    """A shuffled fold id in [0, num_folds) per item, folds differing in size by at most one."""
    order = np.random.default_rng(seed).permutation(num_items)
    ids = np.empty(num_items, np.int64)
    ids[order] = np.arange(num_items) % num_folds
    return ids


def out_of_fold_scores(
    observations: Sequence[Observation],
    groups: np.ndarray,
    kind: str = "minilm",
    encoder_config: EncoderConfig = EncoderConfig(),
) -> np.ndarray:
    """Predicted log(1 + tokens) for every item, each by a model trained without its group.

    ``groups`` holds one id per observation: fold ids for k-fold CV, source ids for
    leave-one-source-out. Lexical IDF is refitted per fold, so no test text leaks into training.
    """
    scores = np.zeros(len(observations))
    embeddings = None
    if kind == "minilm":
        embeddings = embed(load_minilm_encoder(encoder_config), [o.prompt for o in observations])
    for group in np.unique(groups):
        test, fit = np.flatnonzero(groups == group), np.flatnonzero(groups != group)
        train_obs = [observations[i] for i in fit]
        if embeddings is not None:
            model = train_minilm(train_obs, encoder_config, embeddings=embeddings[fit])
            scores[test] = [model.score_embedding(embeddings[i]) for i in test]
        else:
            lexical = train_lexical(train_obs)
            scores[test] = [lexical.score_text(observations[i].prompt) for i in test]
    return scores
