"""Which model pool serves a chat, and which chats need no model at all (fixed answers).

The decision itself is pure (``scheduler/router``): the request's ``model`` (a pool name,
``auto``, or none), the API key's override and, for ``auto``, the prompt's estimated complexity,
under the operator's rules (``LANES_ROUTING_FILE``, TOML). Without rules, ``auto`` and no model
mean the default pool and any other name must be a pool the fleet knows. Fixed answers
(``LANES_FIXED_ANSWERS_FILE``) are matched first and served by the edge itself.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lanes.queue.keys import DEFAULT_POOL
from lanes.queue.messages import ChatMessage
from lanes.scheduler.predictor import prompt_text
from lanes.scheduler.router.fixed_answers import FixedAnswer, FixedAnswers, FixedAnswersError
from lanes.scheduler.router.policy import UnknownPoolError, route
from lanes.scheduler.router.rules import AUTO, RoutingRules, RulesError, load_rules
from lanes.ws_server.settings import EdgeSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnknownModel(Exception):
    model: str
    #: The pools the routing rules serve, when there are rules (only those may be named).
    rules_pools: tuple[str, ...] | None = None

    def message(self, live_pools: tuple[str, ...]) -> str:
        if self.rules_pools is not None:
            # A pool the rules never name is no answer to give, but its workers are no secret:
            # "none yet" while two workers served one read as if nothing were up.
            served = tuple(p for p in live_pools if p in self.rules_pools)
            outside = tuple(p for p in live_pools if p not in self.rules_pools)
            live = (", ".join(served) or ("none" if outside else "none yet")) + (
                f" (live but not in the rules: {', '.join(outside)})" if outside else "")
            return (f"model {self.model!r} is not one of the pools the routing rules serve "
                    f"({', '.join(self.rules_pools)}, or 'auto'; LANES_ROUTING_FILE); "
                    f"pools with live workers the rules serve: {live}")
        live = ", ".join(live_pools) or "none yet"
        # ``auto`` without rules is the default pool: offered only where it could answer (as
        # ``GET /v1/models`` lists it), not to a deployment of named pools alone, where it is a 503.
        auto = " (or 'auto')" if not live_pools or DEFAULT_POOL in live_pools else ""
        return f"model {self.model!r} is not served here; pools with live workers: {live}{auto}"


class PoolRouter:
    def __init__(self, settings: EdgeSettings) -> None:
        try:
            self.rules: RoutingRules | None = load_rules(Path(settings.routing_file)) if settings.routing_file else None
        except RulesError as err:
            raise RulesError(f"routing rules unusable (LANES_ROUTING_FILE): {err}; fix the file or unset "
                             "the setting (deploy/routing.toml is an example)") from None
        try:
            self.fixed = FixedAnswers.load(settings.fixed_answers_file) if settings.fixed_answers_file else None
        except FixedAnswersError as err:
            raise FixedAnswersError(f"fixed answers unusable (LANES_FIXED_ANSWERS_FILE): {err}; fix the file or "
                                    "unset the setting (deploy/fixed_answers.toml is an example)") from None
        self._complexity = None
        if self.rules is not None and self.rules.tiers:
            from lanes.scheduler.router.complexity import ComplexityModel

            self._complexity = ComplexityModel.load().complexity
        log.info("routing: %s; fixed answers: %s", settings.routing_file or "none (model names a pool)",
                 settings.fixed_answers_file or "none")

    def fixed_answer(self, messages: Sequence[ChatMessage]) -> FixedAnswer | None:
        return None if self.fixed is None else self.fixed.lookup(messages)

    def pool_for(self, model: str | None, key_id: str, messages: Sequence[ChatMessage],
                 known_pools: Iterable[str], serving: Iterable[str] | None = None) -> tuple[str, tuple[str, ...]]:
        """The pool to enqueue into, and the larger pools ``auto`` could also have chosen (none
        unless ``auto`` routed by complexity); raises ``UnknownModel`` for a name nobody serves.
        ``serving``: the pools with live workers, when known (``auto`` then passes a dead tier's
        prompts up to the next tier with workers)."""
        if self.rules is not None:
            live = None if serving is None else frozenset(serving)
            try:
                decision = route(prompt_text(messages), key_id or None, self.rules, model, self._complexity, live)
            except UnknownPoolError:
                raise UnknownModel(model or "", tuple(sorted(self.rules.pools))) from None
            return decision.pool, decision.later
        if model is None or model in (AUTO, DEFAULT_POOL):
            return DEFAULT_POOL, ()
        if model not in set(known_pools):
            raise UnknownModel(model)
        return model, ()

    def model_names(self, live_pools: Iterable[str]) -> list[str]:
        """``GET /v1/models``: the names a chat may give. Under routing rules, the rules' pools
        (only those are served, live or not: a pool that is down answers 503) and ``auto``;
        without, the pools with live workers and ``auto`` (the default pool then), which every
        chat may name: before, a chat could name it but ``GET /v1/models/auto`` was a 404. Only
        while the default pool has workers (or no pool has any yet): ``auto`` means it, and a
        deployment of named pools alone listed a name that could only answer 503."""
        if self.rules is not None:
            return sorted(self.rules.pools) + [AUTO]
        live = sorted(set(live_pools))
        return (live or [DEFAULT_POOL]) + [AUTO] if not live or DEFAULT_POOL in live else live
