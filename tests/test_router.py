"""Routing policy, rules file, complexity model and its evaluation (pure: no loop, no Redis)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lanes.scheduler.router.complexity import ComplexityModel, ComplexityModelError
from lanes.scheduler.router.evaluate import auc, dataset_folds, held_out_complexity, prompt_folds, routing_point
from lanes.scheduler.router.features import FEATURE_VERSION, NUM_CUES, cue_values, word_slots
from lanes.scheduler.router.policy import RouteReason, UnknownPoolError, route
from lanes.scheduler.router.rules import RoutingRules, RulesError, Tier, load_rules, parse_rules

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_PROMPTS = REPO_ROOT.parent / "shared" / "data" / "prompts" / "alpaca_eval_Mistral-7B-Instruct-v0.2.json"
RULES = RoutingRules(
    default_pool="large", pools=frozenset({"small", "large"}),
    tiers=(Tier("small", 0.3, max_prompt_chars=100), Tier("large", 1.0)),
    key_pools={"k-batch": "small", "k-vip": "large"},
)


class Counting:
    """A complexity estimator that records whether it was asked."""

    def __init__(self, score: float) -> None:
        self.score = score
        self.calls: list[str] = []

    def __call__(self, prompt: str) -> float:
        self.calls.append(prompt)
        return self.score


# -- route()

def test_key_override_beats_the_requested_model() -> None:
    estimator = Counting(0.9)
    decision = route("why?", "k-batch", RULES, "large", estimator)
    assert (decision.pool, decision.reason, decision.score) == ("small", RouteReason.KEY_OVERRIDE, None)
    assert estimator.calls == []


def test_requested_pool_and_default() -> None:
    assert route("x", "other", RULES, "small").pool == "small"
    assert route("x", "other", RULES, "small").reason is RouteReason.REQUESTED
    assert route("x", None, RULES, None) == route("x", "", RULES, "")
    assert route("x", None, RULES, None).pool == "large"
    assert route("x", None, RULES, None).reason is RouteReason.DEFAULT


def test_unknown_pool_names_the_enabled_ones() -> None:
    with pytest.raises(UnknownPoolError, match=r"unknown model 'gpt-9'.*'auto'.*\['large', 'small'\]") as info:
        route("x", None, RULES, "gpt-9")
    assert info.value.reason == "unknown_model"


def test_auto_uses_the_first_tier_the_prompt_fits() -> None:
    easy, hard = Counting(0.1), Counting(0.7)
    assert route("classify this", None, RULES, "auto", easy) == route("classify this", None, RULES, "auto", 0.1)
    decision = route("classify this", None, RULES, "auto", easy)
    assert (decision.pool, decision.reason, decision.score) == ("small", RouteReason.COMPLEXITY, 0.1)
    assert route("prove it", None, RULES, "auto", hard).pool == "large"
    assert easy.calls == ["classify this", "classify this"]
    # At the threshold the small tier still applies (max is inclusive).
    assert route("x", None, RULES, "auto", 0.3).pool == "small"


def test_long_prompt_skips_a_tier_with_a_length_cap() -> None:
    assert route("a" * 101, None, RULES, "auto", 0.0).pool == "large"


def test_auto_without_a_fitting_tier_or_without_tiers_uses_the_default() -> None:
    rules = RoutingRules("large", frozenset({"small", "large"}), (Tier("small", 0.2),))
    decision = route("x", None, rules, "auto", 0.5)
    assert (decision.pool, decision.reason, decision.score) == ("large", RouteReason.NO_TIER, 0.5)
    bare = RoutingRules("small", frozenset({"small"}))
    assert route("x", None, bare, "auto").reason is RouteReason.NO_TIER


def test_auto_with_tiers_needs_an_estimator() -> None:
    with pytest.raises(ValueError, match="complexity"):
        route("x", None, RULES, "auto")


# -- rules file

def test_sample_rules_file_loads() -> None:
    rules = load_rules(REPO_ROOT / "deploy" / "routing.toml")
    assert rules.pools == {"small", "large"}
    assert [t.pool for t in rules.tiers] == ["small", "large"]
    assert rules.default_pool == "large"


def _doc(**overrides: object) -> dict[str, object]:
    doc: dict[str, object] = {"default_pool": "large", "pools": ["small", "large"],
                              "tiers": [{"pool": "small", "max_complexity": 0.25}], "keys": {"3f9a0c12d4e5": "large"}}
    doc.update(overrides)
    return {k: v for k, v in doc.items() if v is not None}


def test_a_key_rule_matches_the_id_lanes_keys_list_shows() -> None:
    """``lanes keys list`` shows 12 hex digits; the edge knows a key by 16. A rule written with
    the 12 (as deploy/routing.toml shows) never applied: only the undocumented 16 matched."""
    from lanes.ws_server.auth import hash_key, key_id

    full = hash_key("lanes_example_key")
    for written in (full[:12], full[:16], full):
        rules = parse_rules(_doc(keys={written: "large"}))
        decision = route("hello", key_id(full), rules, "small")
        assert (decision.pool, decision.reason) == ("large", RouteReason.KEY_OVERRIDE), written
    other = hash_key("lanes_other_key")
    assert route("hello", key_id(other), parse_rules(_doc(keys={full[:12]: "large"})), "small").pool == "small"


def test_parse_rules_round_trip() -> None:
    rules = parse_rules(_doc())
    assert rules.tiers == (Tier("small", 0.25),)
    assert dict(rules.key_pools) == {"3f9a0c12d4e5": "large"}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"pools": []}, "pools: a non-empty list"),
    ({"pools": ["auto", "large"]}, "reserved"),
    ({"default_pool": "medium"}, "default_pool: pool 'medium' is not in pools"),
    ({"default_pool": None}, "default_pool: a pool name"),
    ({"tiers": [{"pool": "huge", "max_complexity": 0.2}]}, r"tiers\[0\].pool: pool 'huge'"),
    ({"tiers": [{"pool": "small", "max_complexity": 1.5}]}, r"tiers\[0\].max_complexity: a number in \[0, 1\]"),
    ({"tiers": [{"pool": "small", "max_complexity": True}]}, r"tiers\[0\].max_complexity"),
    ({"tiers": [{"pool": "small", "max_complexity": 0.2, "max_prompt_chars": 0}]}, "max_prompt_chars"),
    ({"tiers": [{"pool": "small", "max_complexity": 0.2, "colour": "red"}]}, r"unknown fields \['colour'\]"),
    ({"tiers": [{"pool": "large", "max_complexity": 0.8}, {"pool": "small", "max_complexity": 0.2}]},
     "must not decrease"),
    ({"tiers": {"pool": "small"}}, r"\[\[tiers\]\]"),
    ({"keys": {"3f9a0c12d4e5": "nowhere"}}, "keys.3f9a0c12d4e5: pool 'nowhere'"),
    ({"keys": {"k1": "large"}}, "keys.k1: a key id is the start of the key's SHA-256"),
    ({"pools": ["small", "x/y"], "default_pool": "small", "tiers": []}, "'x/y' is not a name a worker can serve"),
    ({"keys": {"3f9a0c": "large"}}, "12 to 64 lowercase hex"),
    ({"thresholds": 1}, r"unknown top-level fields \['thresholds'\]"),
])
def test_bad_rules_name_the_field(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(RulesError, match=message):
        parse_rules(_doc(**overrides))


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "routing.toml"
    path.write_text("default_pool = \n")
    with pytest.raises(RulesError, match="routing.toml"):
        load_rules(path)


# -- features and the complexity model

def test_features_are_stable_and_bounded() -> None:
    prompt = "Classify the sentiment of this review: 'great phone, bad battery'."
    slots = word_slots(prompt)
    # crc32 of fixed strings: the same slots in every process, whatever PYTHONHASHSEED is.
    assert np.array_equal(slots, word_slots(prompt))
    assert np.all(np.diff(slots) > 0)
    assert len(cue_values(prompt)) == NUM_CUES
    assert len(word_slots("")) == 0 and np.all(np.isfinite(cue_values("")))
    assert len(word_slots("word " * 100_000)) == 3  # "<s> word", "word", "word word"
    assert len(word_slots("a b " * 100_000)) == 5   # "<s> a", "a", "b", "a b", "b a"


def test_shipped_model_scores_in_range_and_round_trips() -> None:
    model = ComplexityModel.load()
    prompts = ["hi", "", "Rewrite this sentence in the passive voice: the cat ate the mouse.",
               "Why do empires fall? Give a detailed historical analysis." * 50, "\u00e9\u00e8 \U0001f600 ?"]
    scores = [model.complexity(p) for p in prompts]
    assert all(0.0 <= s <= 1.0 for s in scores)
    again = ComplexityModel.from_bytes(model.to_bytes())
    assert [again.complexity(p) for p in prompts] == scores
    assert model.meta["target"] and model.meta["C"]


def test_complexity_is_the_percentile_of_p_ok() -> None:
    model = ComplexityModel.load()
    p_lo, p_hi = model.quantiles[10], model.quantiles[90]
    assert model.complexity_of_p_ok(p_lo) == pytest.approx(0.9, abs=0.011)
    assert model.complexity_of_p_ok(p_hi) == pytest.approx(0.1, abs=0.011)
    assert model.complexity_of_p_ok(-1.0) == 1.0 and model.complexity_of_p_ok(2.0) == 0.0


@pytest.mark.skipif(not SHARED_PROMPTS.is_file(), reason="needs ../shared/data/prompts (AlpacaEval)")
def test_thresholds_are_small_shares_on_the_training_prompts() -> None:
    model = ComplexityModel.load()
    prompts = [r["instruction"] for r in json.loads(SHARED_PROMPTS.read_text())]
    scores = np.array([model.complexity(p) for p in prompts])
    for threshold in (0.1, 0.25, 0.5):
        assert np.mean(scores <= threshold) == pytest.approx(threshold, abs=0.02)


def test_corrupt_or_foreign_weights_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ComplexityModelError, match="not a complexity weights file"):
        ComplexityModel.from_bytes(b"not an npz")
    foreign = tmp_path / "other.npz"
    header = json.dumps({"kind": "router-complexity", "feature_version": 999, "intercept": 0.0})
    np.savez(foreign, header=np.frombuffer(header.encode(), dtype=np.uint8))
    with pytest.raises(ComplexityModelError, match=f"v999, need router-complexity v{FEATURE_VERSION}"):
        ComplexityModel.load(foreign)


def test_training_learns_an_easy_and_a_hard_kind_of_prompt() -> None:
    from lanes.scheduler.router.train import fit

    rng = np.random.default_rng(0)
    nouns = ["cat", "river", "stock", "planet", "poem", "engine", "garden", "treaty", "virus", "bridge"]
    easy = [f"Classify the {a} and the {b} into categories." for a in nouns for b in nouns]
    hard = [f"Why does the {a} change the {b}? Explain in detail." for a in nouns for b in nouns]
    p = np.r_[rng.uniform(0.6, 0.9, len(easy)), rng.uniform(0.0, 0.1, len(hard))]
    model = fit(easy + hard, p, c=1.0)
    assert model.complexity("Classify the boat and the lake into categories.") < 0.5
    assert model.complexity("Why does the boat change the lake? Explain in detail.") > 0.5


# -- evaluation helpers

def test_routing_point_by_hand() -> None:
    complexity = np.array([0.1, 0.2, 0.6, 0.9])
    p_win = np.array([0.9, 0.0, 0.2, 0.1])
    point = routing_point(complexity, p_win, 0.25)
    assert point.small_share == 0.5
    assert point.worse_small == 0.25          # prompt 1 went small and lost clearly
    assert point.worse_rate == 0.5
    assert point.win_rate == pytest.approx((0.9 + 0.0 + 0.5 + 0.5) / 4)
    assert point.random_win_rate == pytest.approx(0.25 + 0.5 * p_win.mean())
    assert point.oracle_win_rate == pytest.approx((0.9 + 0.2 + 0.5 + 0.5) / 4)


def test_auc_by_hand() -> None:
    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75
    assert auc(np.array([1.0, 1.0]), np.array([0, 1])) == 0.5


def test_held_out_scores_never_see_their_fold() -> None:
    prompts = [f"p{i}" for i in range(10)]
    folds = prompt_folds(10, 5, seed=1)
    seen: list[set[str]] = []

    def fit(train: list[str], target: np.ndarray) -> object:
        seen.append(set(train))
        return lambda prompt: float(prompt in set(train))

    scores = held_out_complexity(prompts, np.zeros(10), folds, fit)  # type: ignore[arg-type]
    assert np.all(scores == 0.0) and len(seen) == 5
    assert list(dataset_folds(["b", "a", "b"])) == [1, 0, 1]


def test_an_unknown_model_under_rules_names_the_rules_pools() -> None:
    """Under rules only their pools (or auto) may be named: the refusal says so, instead of
    listing a live pool the rules do not serve as if it could be asked for."""
    from lanes.queue.messages import ChatMessage
    from lanes.ws_server.routing import PoolRouter, UnknownModel
    from lanes.ws_server.settings import EdgeSettings

    rules = Path(__file__).resolve().parents[1] / "deploy" / "routing.toml"
    router = PoolRouter(EdgeSettings(routing_file=str(rules)))
    with pytest.raises(UnknownModel) as unknown:
        router.pool_for("default", "", (ChatMessage("user", "Tell me about the sea."),), ["default", "small"])
    # A live pool the rules never name ("default" here, a worker's LANES_POOL typo) is no answer,
    # but it is named as live: "none yet" while two workers served it read as if nothing were up.
    head = ("model 'default' is not one of the pools the routing rules serve (large, small, or 'auto'; "
            "LANES_ROUTING_FILE); pools with live workers the rules serve: ")
    assert unknown.value.message(("default", "small")) == head + "small (live but not in the rules: default)"
    assert unknown.value.message(("default",)) == head + "none (live but not in the rules: default)"
    assert unknown.value.message(("small",)) == head + "small"
    assert unknown.value.message(()) == head + "none yet"


def test_models_lists_auto_only_where_it_can_be_served() -> None:
    """Without rules ``auto`` means the default pool: listed while that pool has workers (or no
    pool has any yet, a cold start); a deployment of named pools alone listed ``auto``, and a
    chat naming it could only get 503s (audit)."""
    from lanes.ws_server.routing import PoolRouter
    from lanes.ws_server.settings import EdgeSettings

    router = PoolRouter(EdgeSettings())
    assert router.model_names([]) == ["default", "auto"]
    assert router.model_names(["default", "small"]) == ["default", "small", "auto"]
    assert router.model_names(["small", "large", "small"]) == ["large", "small"]


def test_auto_passes_a_dead_tiers_prompt_up_to_the_next_tier_with_workers() -> None:
    """``serving`` (the pools with live workers): an easy prompt whose small pool is down goes
    to the large one (``FALLBACK``); never down from large to small, never for a named pool, a
    key override or the default; with no tier serving, or serving unknown, the tier's own pool."""
    decision = route("classify this", None, RULES, "auto", 0.1, serving=frozenset({"large"}))
    assert (decision.pool, decision.reason) == ("large", RouteReason.FALLBACK)
    assert route("classify this", None, RULES, "auto", 0.1, serving=frozenset({"small", "large"})).pool == "small"
    assert route("prove it", None, RULES, "auto", 0.7, serving=frozenset({"small"})).pool == "large"  # not down
    assert route("x", None, RULES, "auto", 0.1, serving=frozenset()).reason is RouteReason.COMPLEXITY
    assert route("x", None, RULES, "auto", 0.1).pool == "small"
    assert route("x", None, RULES, "small", 0.1, serving=frozenset({"large"})).pool == "small"
    assert route("x", "k-batch", RULES, "auto", 0.1, serving=frozenset({"large"})).pool == "small"
    # A later tier must fit the prompt too (its length cap).
    capped = RoutingRules("large", frozenset({"small", "mid", "large"}),
                          (Tier("small", 0.3), Tier("mid", 0.6, max_prompt_chars=10), Tier("large", 1.0)))
    assert route("a" * 50, None, capped, "auto", 0.1, serving=frozenset({"mid", "large"})).pool == "large"


def test_a_decision_names_the_other_pools_auto_could_have_chosen() -> None:
    """``later``: where a chat may go when its pool loses its last worker before the chat starts
    (the scheduler fails it for a retry only when one of these has workers). Nothing for a key
    override, a named pool, the default pool, or a prompt only one tier fits."""
    assert route("x", None, RULES, "auto", 0.1).later == ("large",)
    # Sent up while small was down: small again, should large lose its workers and small return.
    assert route("x", None, RULES, "auto", 0.1, serving=frozenset({"large"})).later == ("small",)
    assert route("x", None, RULES, "auto", 0.7).later == ()
    assert route("x", None, RULES, "small", 0.1).later == ()
    assert route("x", None, RULES, None, 0.1).later == ()
    assert route("x", "k-batch", RULES, "auto", 0.1).later == ()
    capped = RoutingRules("large", frozenset({"small", "mid", "large"}),
                          (Tier("small", 0.3), Tier("mid", 0.6, max_prompt_chars=10), Tier("large", 1.0)))
    assert route("a", None, capped, "auto", 0.1).later == ("mid", "large")
    assert route("a" * 50, None, capped, "auto", 0.1).later == ("large",)  # mid does not fit it
    assert route("a", None, capped, "auto", 0.1, serving=frozenset({"mid"})).later == ("small", "large")
