"""Which pool serves a request: a pure decision from the request's ``model``, key and prompt.

Order (first that applies wins)::

    1. the API key has an override in rules.keys       -> that pool            KEY_OVERRIDE
    2. model names a pool                              -> that pool            REQUESTED
    3. model is absent ("" / None)                     -> rules.default_pool   DEFAULT
    4. model == "auto": first tier the prompt fits     -> the tier's pool      COMPLEXITY
       (complexity <= max_complexity, length <= max_prompt_chars)
       ... whose pool has no live worker (``serving``
       says which have): the next tier after it that  -> that tier's pool     FALLBACK
       fits and has one (a larger model, by the rules'
       order: never a smaller one)
    5. "auto" and no tier fits                         -> rules.default_pool   NO_TIER

The complexity estimate (~0.1-0.3 ms) is computed only in case 4. Which pools have live workers
is the edge's to say (``serving``); without it, or when no later tier has one, the tier's own
pool is chosen (and the edge answers ``unavailable``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from lanes.scheduler.router.rules import AUTO, RoutingRules


class RouteReason(StrEnum):
    KEY_OVERRIDE = "key_override"
    REQUESTED = "requested"
    DEFAULT = "default"
    COMPLEXITY = "complexity"
    FALLBACK = "fallback"
    NO_TIER = "no_tier"


class UnknownPoolError(ValueError):
    """``model`` names a pool the rules do not enable. ``reason`` goes in the error frame."""

    reason = "unknown_model"

    def __init__(self, model: str, pools: frozenset[str]) -> None:
        self.model = model
        self.pools = pools
        super().__init__(f"unknown model {model!r}: use {AUTO!r} or one of {sorted(pools)}")


@dataclass(frozen=True)
class RouteDecision:
    pool: str
    reason: RouteReason
    #: The prompt's complexity (0 easiest .. 1 hardest) when it was estimated, else None.
    score: float | None = None
    #: For ``auto`` by complexity: the other tiers' pools that also fit the prompt (where a retry
    #: may go when the chosen pool loses its workers: a smaller one back, or a larger one).
    later: tuple[str, ...] = ()


def key_override(key_id: str | None, rules: RoutingRules) -> str | None:
    """The pool the rules give this key, if any. A rule names a key by the start of its SHA-256
    (12 to 64 hex digits: ``lanes keys list`` shows 12); the edge knows a key by its first 16
    (``auth.key_id``). A rule matches when one begins with the other: before, only 16 digits
    matched, and a rule written as ``lanes keys list`` shows it never applied."""
    if not key_id:
        return None
    for rule_id, pool in rules.key_pools.items():
        if rule_id.startswith(key_id) or key_id.startswith(rule_id):
            return pool
    return None


def route(
    prompt: str,
    key_id: str | None,
    rules: RoutingRules,
    model: str | None,
    complexity: Callable[[str], float] | float | None = None,
    serving: frozenset[str] | None = None,
) -> RouteDecision:
    """Pick the pool for one request.

    ``complexity`` is the estimator (``ComplexityModel.complexity``) or an already computed score;
    it is needed only for ``model == "auto"`` with tiers (ValueError when missing then).
    Raises ``UnknownPoolError`` when ``model`` names a pool that ``rules.pools`` does not enable.
    """
    override = key_override(key_id, rules)
    if override is not None:
        return RouteDecision(override, RouteReason.KEY_OVERRIDE)
    if not model:
        return RouteDecision(rules.default_pool, RouteReason.DEFAULT)
    if model != AUTO:
        if model not in rules.pools:
            raise UnknownPoolError(model, rules.pools)
        return RouteDecision(model, RouteReason.REQUESTED)
    if not rules.tiers:
        return RouteDecision(rules.default_pool, RouteReason.NO_TIER)
    if complexity is None:
        raise ValueError("model 'auto' with tiers needs a complexity estimator or score")
    score = complexity if isinstance(complexity, float | int) else complexity(prompt)
    fitting = [t for t in rules.tiers
               if score <= t.max_complexity and (t.max_prompt_chars is None or len(prompt) <= t.max_prompt_chars)]
    if not fitting:
        return RouteDecision(rules.default_pool, RouteReason.NO_TIER, float(score))
    def after(index: int) -> tuple[str, ...]:
        chosen = fitting[index].pool
        return tuple(dict.fromkeys(t.pool for t in fitting if t.pool != chosen))

    if serving is not None and fitting[0].pool not in serving:
        # Tiers are ordered by max_complexity (never decreasing): a later one is a larger model.
        index = next((i for i, t in enumerate(fitting) if i and t.pool in serving), None)
        if index is not None:
            return RouteDecision(fitting[index].pool, RouteReason.FALLBACK, float(score), after(index))
    return RouteDecision(fitting[0].pool, RouteReason.COMPLEXITY, float(score), after(0))
