"""Pure tests of the output-length predictor: no Redis, no event loop, no timed asserts."""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lanes.cli.predictor import generalization_report, load_observations
from lanes.queue.messages import ChatMessage, Lane
from lanes.scheduler.policy import LaneThresholds
from lanes.scheduler.predictor import (
    DEFAULT_WEIGHTS_PATH,
    LengthPredictor,
    WeightsError,
    from_weights,
    load_default,
    prompt_text,
)
from lanes.scheduler.predictor.data import (
    DEFAULT_DATASET_PATH,
    DEFAULT_POOL_PATH,
    HELD_OUT_SOURCE,
    HELD_OUT_SOURCES,
    Example,
    median_tokens,
    read_examples,
    write_examples,
)
from lanes.scheduler.predictor.eval import evaluate, kendall_tau, misroute_rates, spearman
from lanes.scheduler.predictor.lexical import (
    CUE_PATTERNS,
    NUM_CUES,
    NUM_LENGTH_REQUEST_CUES,
    FeatureConfig,
    LexicalModel,
    cue_features,
    requested_tokens,
)
from lanes.scheduler.predictor.train import (
    MAX_REFIT_OBSERVATIONS,
    Observation,
    log_target,
    refit,
    refit_with_routing,
    source_balance,
    train,
    train_lexical,
)
POEM = "Write a long epic poem about the sea, with many stanzas."
CAPITAL = "What is the capital of France? Answer in one word."

TOY = [
    Observation("Write a detailed essay about the history of Rome.", 900),
    Observation("Write a long story about a dragon and a knight.", 800),
    Observation("Explain in detail how a compiler works.", 700),
    Observation("What is 2 + 2? One word.", 3),
    Observation("Answer yes or no: is the sky blue?", 2),
    Observation("Classify the sentiment: I love it.", 4),
] * 3


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=text)]


def test_default_predictions_are_deterministic_and_capped() -> None:
    predictor = load_default()
    first = predictor.predict(user(POEM), max_tokens=4096)
    assert first == predictor.predict(user(POEM), max_tokens=4096)
    assert first == from_weights(DEFAULT_WEIGHTS_PATH).predict(user(POEM), max_tokens=4096)
    assert 1 <= first <= 4096
    assert predictor.predict(user(POEM), max_tokens=7) == min(7, first)
    assert predictor.predict(user(""), max_tokens=1) == 1
    with pytest.raises(ValueError):
        predictor.predict(user(POEM), max_tokens=0)


def test_default_model_ranks_obvious_prompts() -> None:
    predictor = load_default()
    assert predictor.predict_text(POEM) > predictor.predict_text(CAPITAL)


def test_prompt_text_reads_last_user_message() -> None:
    messages = [
        ChatMessage("system", "You are terse."),
        ChatMessage("user", "first"),
        ChatMessage("assistant", "ok"),
        ChatMessage("user", "second"),
    ]
    assert prompt_text(messages) == "second"
    assert prompt_text([ChatMessage("system", "a"), ChatMessage("assistant", "b")]) == "a\nb"


def test_kendall_tau_and_spearman_on_hand_built_data() -> None:
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # tau-b with one tie in x: S = 2, pairs 3, ties_x 1 -> 2 / sqrt(2 * 3)
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / np.sqrt(6))
    assert kendall_tau([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(kendall_tau([1, 1, 1], [1, 2, 3]))
    assert spearman([10, 20, 30, 40], [1, 4, 9, 16]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks [1, 2.5, 2.5, 4] vs [1, 2, 3, 4]
    expected = np.corrcoef([1, 2.5, 2.5, 4], [1, 2, 3, 4])[0, 1]
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(expected)


def test_kendall_tau_matches_brute_force_on_random_data() -> None:
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 20, 60), rng.integers(0, 20, 60)
    pairs = list(itertools.combinations(range(60), 2))
    s = sum(np.sign(x[i] - x[j]) * np.sign(y[i] - y[j]) for i, j in pairs)
    tx = sum(x[i] == x[j] for i, j in pairs)
    ty = sum(y[i] == y[j] for i, j in pairs)
    expected = s / np.sqrt((len(pairs) - tx) * (len(pairs) - ty))
    assert kendall_tau(x, y) == pytest.approx(expected)


def test_misroute_rates_are_conditional_on_the_true_lane() -> None:
    rates = misroute_rates([100, 100, 600, 600, 300], [600, 100, 100, 600, 300], LaneThresholds(128, 512))
    assert rates["misroute_short_to_long"] == pytest.approx(0.5)
    assert rates["misroute_long_to_short"] == pytest.approx(0.5)
    assert rates["predicted_share_medium"] == pytest.approx(0.2)
    assert np.isnan(misroute_rates([300], [300], LaneThresholds())["misroute_short_to_long"])


def test_evaluate_with_an_injected_clock() -> None:
    ticks = itertools.count(0, 2_000_000)  # every clock read advances 2 ms
    prompts = [POEM, CAPITAL, "Tell me a joke."]
    report = evaluate(load_default(), prompts, [900, 3, 40], clock_ns=lambda: next(ticks))
    assert report.num_examples == 3
    assert report.latency_ms_p50 == pytest.approx(2.0)
    assert report.latency_ms_p99 == pytest.approx(2.0)
    assert -1.0 <= report.kendall_tau <= 1.0


def test_evaluate_times_each_distinct_prompt_once_and_cold() -> None:
    """A file with several answers per prompt timed its repeats, which the encoder's cache
    answers at once (the pool's p50 read 4x too low), and the warm-up was the first row's."""
    calls: list[str] = []

    class Counting:
        kind = "counting"

        def predict(self, messages, max_tokens):  # type: ignore[no-untyped-def]
            calls.append(messages[-1].content)
            return len(messages[-1].content)

    ticks = itertools.count(0, 1_000_000)
    prompts = ["a", "bb", "a", "ccc", "bb", "a"]
    report = evaluate(Counting(), prompts, [1, 2, 1, 3, 2, 1], clock_ns=lambda: next(ticks))  # type: ignore[arg-type]
    assert calls[1:] == ["a", "bb", "ccc"] and calls[0] not in prompts, calls
    assert report.num_examples == 6 and report.num_timed == 3 and report.kendall_tau == pytest.approx(1.0)


def test_kendall_tau_is_tau_b() -> None:
    """SciPy's O(n log n) tau-b (20,000 rows took 32 s and 426 MB with the O(n^2) one)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, 20_000)
    y = x + rng.integers(0, 30, 20_000)
    tau = kendall_tau(x, y)
    small_x, small_y = x[:300], y[:300]  # against the definition, pair by pair, ties corrected
    sx, sy = np.sign(small_x[:, None] - small_x[None, :]), np.sign(small_y[:, None] - small_y[None, :])
    n = len(small_x) * (len(small_x) - 1)
    expected = (sx * sy).sum() / np.sqrt((n - ((sx == 0).sum() - 300)) * (n - ((sy == 0).sum() - 300)))
    assert kendall_tau(small_x, small_y) == pytest.approx(expected)
    assert 0.5 < tau < 1.0 and np.isnan(kendall_tau([1, 1, 1], [1, 2, 3])) and np.isnan(kendall_tau([1], [2]))


def test_long_prompts_are_read_at_their_head_and_tail_with_the_same_words() -> None:
    """The word features read a long prompt's first 256 and last 128 words without scanning the
    whole text (a 1 MB prompt took 30-90 ms): exactly the words of the whole scan, clipped."""
    from lanes.scheduler.predictor.lexical import _WORD_RE, _clip, _head_and_tail_words

    rng = np.random.default_rng(1)
    words = ["alpha", "b", "ça", "日本語", "x1_y2", "!", "?!", "--", "emoji😀", "İstanbul", "ſ"]
    texts = ["", "one two", "word " * 383, "word " * 384, "word " * 385, "z" * 5000, "a " * 200 + "z" * 5000,
             "z" * 5000 + " a" * 200, ("y" * 3000 + " ") * 3]
    for _ in range(300):
        n = int(rng.integers(1, 3000))
        seps = rng.choice([" ", "", "\n", "  ", ".", "\t"], n)
        texts.append("".join(w + sep for w, sep in zip(rng.choice(words, n), seps)))
    for text in texts:
        lowered = text.lower()
        assert _head_and_tail_words(lowered, 256, 128) == list(_clip(_WORD_RE.findall(lowered), 256, 128))


def test_any_str_is_scored_a_lone_surrogate_too() -> None:
    """The Python API raised UnicodeEncodeError on a lone surrogate (an emoji cut in half)."""
    predictor = load_default()
    assert predictor.predict([ChatMessage("user", "Write an essay \ud83d about the sea")], 4096) == \
        predictor.predict([ChatMessage("user", "Write an essay ? about the sea")], 4096)


def test_eval_reads_the_files_people_have(tmp_path: Path) -> None:
    """JSON lines, gzip (of a list or of lines), a byte-order mark and chat rows (the prompt is
    the last user message, as at the edge) all read as the same rows; before, each was an
    error ("Extra data", "bad example: 'lengths'", "UnicodeDecodeError", "KeyError: 'prompt'")."""
    import gzip

    from lanes.cli.predictor import load_observations

    rows = [{"prompt": f"Write {i} lines about the sea.", "output_tokens": 10 + 7 * i} for i in range(12)]
    expected = [(r["prompt"], r["output_tokens"]) for r in rows]
    lines = "\n".join(json.dumps(r) for r in rows) + "\n"
    chat = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": r["prompt"]}],
             "output_tokens": r["output_tokens"]} for r in rows]
    files = {"list.json": json.dumps(rows).encode(), "rows.jsonl": lines.encode(),
             "rows.jsonl.gz": gzip.compress(lines.encode()), "list.json.gz": gzip.compress(json.dumps(rows).encode()),
             "bom.json": "\ufeff".encode() + json.dumps(rows).encode(), "chat.json": json.dumps(chat).encode()}
    for name, body in files.items():
        (tmp_path / name).write_bytes(body)
        assert [(o.prompt, o.output_tokens) for o in load_observations(tmp_path / name)] == expected, name
    # One row of JSON lines; AlpacaEval outputs and build-data rows read through the same parse
    # (each re-read its file, and failed on a BOM, gzip, JSON lines or an uncompressed data set).
    (tmp_path / "one.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert [(o.prompt, o.output_tokens) for o in load_observations(tmp_path / "one.jsonl")] == expected[:1]
    alpaca = [{"instruction": r["prompt"], "output": "x" * 46, "generator": "g", "dataset": "d"} for r in rows]
    (tmp_path / "alpaca.json").write_bytes("\ufeff".encode() + json.dumps(alpaca).encode())
    assert [(o.prompt, o.output_tokens) for o in load_observations(tmp_path / "alpaca.json")] == \
        [(r["prompt"], 7) for r in rows]  # "x" * 46: 7 Llama-3 tokens
    examples = [{"prompt": r["prompt"], "source": "s", "lengths": {"m": r["output_tokens"]}} for r in rows]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(e) for e in examples))
    assert [(o.prompt, o.output_tokens) for o in load_observations(tmp_path / "data.jsonl")] == expected


@pytest.mark.parametrize("body, says", [
    ('[{"prompt": "bad \\ud800 x", "output_tokens": 30}]', "row 0: 'prompt' is not valid Unicode at character 4"),
    ('[{"prompt": "a", "output_tokens": 1' + "0" * 400 + "}]", "row 0: 'output_tokens' must be a whole number"),
    ('[{"prompt": "a", "output_tokens": 3}, {"prompt": "b"}]', "row 1: no 'output_tokens'"),
    ('{"rows": []}', "holds a JSON dict, not a list of rows"),
    ('{"prompt": "a", "output_tokens": 3}\n{"prompt": "b", oops}', "line 2: not JSON"),
])
def test_eval_names_the_row_and_the_fault(tmp_path: Path, body: str, says: str) -> None:
    """A lone surrogate and a 400-digit length were tracebacks; a missing key was "KeyError"."""
    from typer.testing import CliRunner

    from lanes.cli.predictor import app

    data = tmp_path / "data.json"
    data.write_text(body)
    out = CliRunner().invoke(app, ["eval", "--data", str(data), "--json"])
    assert out.exit_code == 2 and out.exception is None or isinstance(out.exception, SystemExit), out.output
    assert says in " ".join(re.sub("[│╭╮╰╯─]", " ", out.output).split()), out.output  # rich's box, unwrapped


def test_training_learns_the_toy_split() -> None:
    predictor = train(TOY)
    assert predictor.predict_text("Write a detailed long essay about Greece.") > predictor.predict_text(
        "Answer yes or no: is grass green?"
    )


def test_refit_moves_predictions_towards_observations_and_is_pure() -> None:
    predictor = load_default()
    before = predictor.score_text(CAPITAL)
    target_tokens = 5_000
    refitted = refit(predictor, [Observation(CAPITAL, target_tokens)] * 8)
    after = refitted.score_text(CAPITAL)
    assert before < after <= float(log_target([target_tokens])[0]) + 1e-9
    assert predictor.score_text(CAPITAL) == before  # the input model is untouched
    assert refitted.info["refit_observations"] == 8
    assert refit(predictor, []) is predictor


def test_refit_rejects_unbounded_windows_and_bad_lengths() -> None:
    with pytest.raises(ValueError):
        refit(load_default(), [Observation(CAPITAL, 1)] * (MAX_REFIT_OBSERVATIONS + 1))
    with pytest.raises(ValueError):
        refit(load_default(), [Observation(CAPITAL, -1)])


def test_weights_load_without_pickle_and_round_trip(tmp_path: Path) -> None:
    with np.load(DEFAULT_WEIGHTS_PATH, allow_pickle=False) as data:
        assert all(data[key].dtype.kind != "O" for key in data.files)
    assert DEFAULT_WEIGHTS_PATH.stat().st_size < 3_000_000
    refitted = refit(load_default(), [Observation(POEM, 3)])
    out = tmp_path / "model.npz"
    refitted.save(out)
    loaded = from_weights(out)
    assert isinstance(loaded, LengthPredictor)
    assert loaded.score_text(POEM) == refitted.score_text(POEM)
    assert loaded.info["refit_observations"] == 1


def test_save_is_byte_reproducible(tmp_path: Path) -> None:
    predictor = train(TOY, {"note": "toy"})
    predictor.save(tmp_path / "a.npz")
    train(TOY, {"note": "toy"}).save(tmp_path / "b.npz")
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()


def test_cue_features_and_cue_free_models() -> None:
    cues = cue_features("What is the capital of France? Answer briefly.")
    assert cues.shape == (NUM_CUES,)
    names = [name for name, _ in CUE_PATTERNS]
    assert cues[7 + names.index("short")] == 1.0
    assert cues[7 + names.index("closed_question")] == 1.0
    assert cues[7 + names.index("longform")] == 0.0
    assert load_default().model.config.cue_weight > 0  # type: ignore[union-attr]
    # Weights written before cues existed (no cue_weight in the header) load as cue-free models.
    plain = train_lexical(TOY, FeatureConfig(cue_weight=0.0))
    header, arrays = plain.to_arrays()
    del header["config"]["cue_weight"]  # type: ignore[attr-defined]
    old = LexicalModel.from_arrays(header, arrays)
    assert old.config.cue_weight == 0.0 and len(old.cue_weights) == 0
    assert old.score_text(POEM) == plain.score_text(POEM)
    assert refit(LengthPredictor(old, {}), TOY[:2]).score_text(POEM) != old.score_text(POEM)


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        ("Write a 300-word essay about rain.", 300 * 1.35),
        ("Answer in at least 3 paragraphs.", 3 * 85 * 1.3),
        ("Summarise it in less than 50 words.", 50 * 1.35 * 0.7),
        ("List five tips for sleeping well.", 5 * 25),
        ("Write 1,000 words on trains, in 4 sections.", 1000 * 1.35),  # the larger of two requests
        ("Explain photosynthesis.", None),
        ("I have 2 dogs and 3 cats. What should I feed them?", None),
    ],
)
def test_requested_tokens_reads_explicit_length_requests(prompt: str, tokens: float | None) -> None:
    got = requested_tokens(prompt.lower())
    assert got == pytest.approx(tokens) if tokens is not None else got is None


def test_length_request_cues_and_models_written_before_them() -> None:
    plain = cue_features("Write a 300-word essay.")
    both = cue_features("Write a 300-word essay.", length_request=True)
    assert both.shape == (NUM_CUES + NUM_LENGTH_REQUEST_CUES,)
    assert list(both[:NUM_CUES]) == list(plain)
    assert both[NUM_CUES] == 1.0 and both[NUM_CUES + 1] == pytest.approx(math.log1p(300 * 1.35))
    assert list(cue_features("Explain it.", length_request=True)[NUM_CUES:]) == [0.0, 0.0]
    assert load_default().model.config.length_request_weight > 0  # type: ignore[union-attr]
    # Weights written before the length-request cues (no field in the header) score as they did.
    before = train_lexical(TOY, FeatureConfig(length_request_weight=0.0))
    header, arrays = before.to_arrays()
    del header["config"]["length_request_weight"]  # type: ignore[attr-defined]
    old = LexicalModel.from_arrays(header, arrays)
    assert old.config.length_request_weight == 0.0 and len(old.cue_weights) == NUM_CUES
    assert old.score_text("Write a 300-word essay.") == before.score_text("Write a 300-word essay.")


def test_bad_weights_raise_weights_error(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip")
    with pytest.raises(WeightsError):
        from_weights(garbage)
    np.savez(tmp_path / "old.npz", header_json=np.array(json.dumps({"feature_version": 0})))
    with pytest.raises(WeightsError):
        from_weights(tmp_path / "old.npz")


def test_inference_imports_no_torch_redis_or_sklearn() -> None:
    code = (
        "import sys, lanes.scheduler.predictor as p; p.load_default().predict_text('hi'); "
        "bad = {'torch', 'redis', 'sklearn', 'scipy', 'transformers'} & set(sys.modules); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_load_observations_formats(tmp_path: Path) -> None:
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps([{"prompt": "hi", "output_tokens": 7}]))
    assert load_observations(plain) == [Observation("hi", 7)]
    alpaca = tmp_path / "alpaca.json"  # no token-count CSV beside it: the answers counted (Llama-3 BPE)
    alpaca.write_text(json.dumps([{"instruction": "hi", "output": "x" * 46, "generator": "g", "dataset": "d"}]))
    assert load_observations(alpaca) == [Observation("hi", 7, "d")]


def test_source_balance_centres_each_source_and_weighs_by_root_size() -> None:
    observations = [Observation("a", 9, "big")] * 4 + [Observation("b", 99, "small"), Observation("c", 0, "small")]
    target, weights = source_balance(observations, level=1.0)
    assert target[:4] == pytest.approx([1.0] * 4), "a constant source sits at the common level"
    assert target[4] - target[5] == pytest.approx(np.log(100)), "differences within a source are kept"
    assert target[4:].mean() == pytest.approx(1.0)
    assert weights[0] / weights[4] == pytest.approx(np.sqrt(2 / 4)) and weights.mean() == pytest.approx(1.0)
    # Centring: a source answered at 10x the length teaches nothing about its prompts' words.
    mixed = [Observation(f"alpha {i}", 1000, "long") for i in range(6)] + [
        Observation(f"beta {i}", 10, "short") for i in range(6)
    ]
    centred = train_lexical(mixed)
    assert centred.score_text("alpha 0") == pytest.approx(centred.score_text("beta 0"), abs=0.05)


def test_examples_round_trip_byte_for_byte_and_name_bad_lines(tmp_path: Path) -> None:
    examples = [Example("hi", "s", {"m1": 10, "m2": 1000, "m3": 100}), Example("yo", "t", {"m": 0})]
    assert examples[0].output_tokens == 100 and examples[1].output_tokens == 0
    assert median_tokens([3, 1]) == round(np.expm1((np.log(4) + np.log(2)) / 2))
    write_examples(examples, tmp_path / "a.jsonl.gz")
    write_examples(examples, tmp_path / "b.jsonl.gz")
    assert (tmp_path / "a.jsonl.gz").read_bytes() == (tmp_path / "b.jsonl.gz").read_bytes()
    assert read_examples(tmp_path / "a.jsonl.gz") == examples
    assert load_observations(tmp_path / "a.jsonl.gz") == [Observation("hi", 100, "s"), Observation("yo", 0, "t")]
    write_examples([Example("x", "s", {"m": -1})], tmp_path / "bad.jsonl.gz")
    with pytest.raises(ValueError, match="bad.jsonl.gz:1"):
        read_examples(tmp_path / "bad.jsonl.gz")
    import gzip

    (tmp_path / "broken.jsonl.gz").write_bytes(gzip.compress(b'{"prompt": "a", "source": "s", "lengths": {"m": 3}}\n'
                                                             b'{"prompt": "b", "source": "s", "lengths": {"m": 3}\n'))
    with pytest.raises(ValueError, match="broken.jsonl.gz:2: bad example"):  # a line that is not JSON too
        read_examples(tmp_path / "broken.jsonl.gz")


def test_generalization_report_scores_every_source_on_a_model_that_never_saw_it() -> None:
    rng = np.random.default_rng(0)
    words = ["essay", "story", "poem", "word", "yes", "no"]
    observations = []
    for source, scale in (("x", 1), ("y", 10), ("z", 100)):
        for i in range(30):
            word = words[i % 6]
            base = 800 if word in ("essay", "story", "poem") else 4
            observations.append(Observation(f"{word} {rng.integers(1000)}", base * scale, source))
    report = generalization_report(observations, num_folds=3)
    assert set(report["loso_kendall_tau"]) == {"x", "y", "z"}  # type: ignore[arg-type]
    assert report["loso_kendall_tau_mean"] > 0.5, "the long-task words carry over to unseen sources"
    assert report["cv3_kendall_tau_mean"] > 0.5


def test_refresh_curve_learns_a_source_the_base_never_saw() -> None:
    """The base model cannot know that this source's "zork" prompts are long; refits on the
    source's finished requests teach it (the live refresh), the test split never refitted on."""
    from lanes.cli.predictor import refresh_curve

    rng = np.random.default_rng(0)
    observations = [Observation(f"{w} {rng.integers(1000)}", 800 if w == "essay" else 4, "base")
                    for w in ("essay", "yes") * 40]
    observations += [Observation(f"{w} {rng.integers(1000)}", 600 if w == "zork" else 5, "new")
                     for w in ("zork", "blip") * 60]
    report = refresh_curve(observations, "new", [20, 80, 500], test_size=40)
    taus = report["kendall_tau_by_refit_size"]
    assert list(taus) == ["0", "20", "80"], "500 is more than is left after the test split"  # type: ignore[arg-type]
    # 0.71 is the most tau-b can be between a 50/50 two-valued length and a score without ties.
    assert abs(taus["0"]) < 0.2 and taus["80"] > 0.65, taus  # type: ignore[index]


def test_sources_builder_dedups_first_source_wins(tmp_path: Path) -> None:
    from lanes.scheduler.predictor.sources import SOURCES, build_examples

    raw = tmp_path / "raw"
    shared = "Tell me a story."

    def put(repo: str, path: str, content: object) -> None:
        target = raw / repo / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content if isinstance(content, str) else json.dumps(content))

    for model, answer in (("m1", "one two three"), ("m2", "one"), ("NullModel", "")):
        put("tatsu-lab/alpaca_eval", f"results/{model}/model_outputs.json",
            [{"instruction": shared, "output": answer, "dataset": "koala"}])
    put("enricai/FastChat", "fastchat/llm_judge/data/mt_bench/question.jsonl",
        json.dumps({"question_id": 1, "turns": ["Plan a trip.", "Now shorter."]}) + "\n")
    put("enricai/FastChat", "fastchat/llm_judge/data/mt_bench/model_answer/g.jsonl",
        json.dumps({"question_id": 1, "choices": [{"turns": ["a b c d", "a"]}]}) + "\n")
    put("teknium1/GPTeacher", "Codegen/codegen-instruct.json",
        [{"instruction": "Write code", "input": "x = 1", "response": "print(x)"}])
    put("teknium1/GPTeacher", "Roleplay/roleplay-simple-deduped-roleplay-instruct.json",
        [{"instruction": shared, "input": "", "response": "dup"}])
    put("sahil280114/codealpaca", "data/code_alpaca_2k.json", [{"instruction": "Sort", "input": "", "output": ""}])
    put("stayanti/alpaca-gpt-4", "alpaca_data/file_0-24.json", [{"instruction": "Hi", "input": "", "output": "Hello"}])
    put("Podtech-AI/IFEval", "data/input_response_data_gpt4_20231107_145030.jsonl",
        json.dumps({"prompt": "Write a 50 word poem.", "response": "Roses are red"}) + "\n")
    assert {s.repo for s in SOURCES} == {p.relative_to(raw).parts[0] + "/" + p.relative_to(raw).parts[1]
                                         for p in raw.glob("*/*")}
    examples = build_examples(raw, lambda texts: [len(t.split()) for t in texts])
    by_source = {e.source: e for e in examples}
    assert by_source["alpaca_eval/koala"].lengths == {"m1": 3, "m2": 1}, "empty answers dropped"
    assert "gpteacher/roleplay" not in by_source, "the duplicate prompt stays with its first source"
    assert "code_alpaca" not in by_source, "an empty answer leaves no example"
    assert by_source["mt_bench"] == Example("Plan a trip.", "mt_bench", {"g": 4}), "first turn only"
    assert by_source["gpteacher/codegen"].prompt == "Write code\n\nx = 1"
    assert by_source["ifeval"] == Example("Write a 50 word poem.", "ifeval", {"gpt-4": 3})
    shutil.rmtree(raw / "stayanti")
    with pytest.raises(FileNotFoundError, match="stayanti/alpaca-gpt-4"):
        build_examples(raw, lambda texts: [1] * len(texts))


@pytest.mark.skipif(not DEFAULT_POOL_PATH.is_file(), reason="prompt pool absent")
def test_shipped_weights_never_saw_the_held_out_pool_and_rank_it() -> None:
    info = load_default().info
    assert info["held_out_source"] == HELD_OUT_SOURCE
    assert info["held_out_sources"] == list(HELD_OUT_SOURCES) and HELD_OUT_SOURCE in HELD_OUT_SOURCES
    assert not set(HELD_OUT_SOURCES) & set(info["sources"])  # type: ignore[arg-type]
    pool = json.loads(DEFAULT_POOL_PATH.read_text())
    assert {row["source"] for row in pool} == {HELD_OUT_SOURCE}
    pool_prompts = {" ".join(row["prompt"].lower().split()) for row in pool}
    trained = {" ".join(e.prompt.lower().split()) for e in read_examples(DEFAULT_DATASET_PATH)
               if e.source != HELD_OUT_SOURCE}
    assert not pool_prompts & trained, "no pool prompt is in the training sources"
    # Measured 0.382 (1,504 rows: 188 prompts x 8 answering models, none of them seen in training).
    predictor = load_default()
    tau = kendall_tau([predictor.score_text(row["prompt"]) for row in pool], [row["output_tokens"] for row in pool])
    assert tau > 0.35


@pytest.mark.skipif(not DEFAULT_DATASET_PATH.is_file(), reason="data set absent")
def test_eval_scores_one_held_out_source_of_the_data_set() -> None:
    """IFEval is kept out of the shipped weights: ``--source ifeval`` scores prompts of a source
    they never saw (explicit length requests carry over from the other sources' prompts)."""
    from typer.testing import CliRunner

    from lanes.cli.predictor import app

    out = CliRunner().invoke(app, ["eval", "--data", str(DEFAULT_DATASET_PATH), "--source", "ifeval", "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    assert report["num_examples"] == 540
    assert report["kendall_tau"] > 0.35


def test_refit_with_routing_fits_thresholds_on_prompts_the_probe_never_saw(tmp_path: Path) -> None:
    """The refresh ships lane thresholds for the refitted model's level: fitted on the newest
    fifth of the window, predicted by a probe refitted on the rest; saved with the weights."""
    from lanes.scheduler.policy import RoutingCalibration, choose_lane

    rng = np.random.default_rng(0)
    window = [Observation(f"Say yes or no, case {rng.integers(10**6)}.", 3) if i % 2 else
              Observation(f"Write a detailed essay about topic {rng.integers(10**6)}.", 900) for i in range(300)]
    calibration = RoutingCalibration(min_shorts=20)
    model = refit_with_routing(load_default(), window, calibration)
    routing = model.routing
    assert routing is not None and routing.short_max_tokens == routing.medium_max_tokens
    assert model.info["routing"]["fitted_on"] == 60  # type: ignore[index]
    assert choose_lane(model.predict(user("Say yes or no, case 7."), 4096), routing) is Lane.SHORT
    assert choose_lane(model.predict(user("Write a detailed essay about topic 7."), 4096), routing) is Lane.LONG
    model.save(tmp_path / "w.npz")
    assert from_weights(tmp_path / "w.npz").routing == routing, "the thresholds travel with the weights"
    # Too few short observations to measure the budget: no thresholds, and none left from before.
    again = refit_with_routing(model, window[:40], calibration)
    assert again.routing is None and "routing" not in again.info
    assert load_default().routing is None
    assert LengthPredictor(model.model, {"routing": {"short_max_tokens": "x"}}).routing is None
    assert LengthPredictor(model.model, {"routing": {"short_max_tokens": 9, "medium_max_tokens": 3}}).routing is None
    with pytest.raises(ValueError, match="held_out_share"):
        refit_with_routing(model, window, calibration, held_out_share=1.0)


def test_refit_thresholds_also_hold_answers_short_by_the_whole_window() -> None:
    """The newest fifth drifted to yes/no answers (its median is 3 tokens); the whole window's median
    is ~115. The first budget alone sends the 80-119-token summaries long; the window's budget keeps
    them short. The budgets travel in the weights' info."""
    from lanes.scheduler.policy import RoutingCalibration, choose_lane

    rng = np.random.default_rng(1)

    def summary() -> Observation:
        return Observation(f"Summarize this paragraph, case {rng.integers(10**6)}.", int(rng.integers(80, 120)))

    def essay() -> Observation:
        return Observation(f"Write a detailed essay about topic {rng.integers(10**6)}.", 900)

    older = [summary() if i % 2 else essay() for i in range(240)]
    newest = [Observation(f"Say yes or no, case {rng.integers(10**6)}.", 3) for _ in range(30)]
    newest += [summary() for _ in range(15)] + [essay() for _ in range(15)]
    window = older + [newest[i] for i in rng.permutation(60)]
    short_share = {}
    for budget in (0.025, 1.0):
        model = refit_with_routing(load_default(), window, RoutingCalibration(min_shorts=20,
                                                                              max_window_short_to_long=budget))
        assert model.info["routing"]["max_window_short_to_long"] == budget  # type: ignore[index]
        assert choose_lane(model.predict(user("Write a detailed essay about topic 7."), 4096), model.routing) \
            is Lane.LONG
        lanes = [choose_lane(model.predict(user(f"Summarize this paragraph, case {i}."), 4096), model.routing)
                 for i in range(50)]
        short_share[budget] = lanes.count(Lane.SHORT) / len(lanes)
    assert short_share[0.025] >= 0.8 and short_share[1.0] <= 0.2, short_share


def test_refit_thresholds_hold_the_budget_for_new_prompts_when_prompts_repeat() -> None:
    """60 nonsense prompts (nothing in their words tells a length), each always with one length,
    repeated over a 600-row window. A probe that had read the held-out rows' prompts would recall
    their lengths, put the long threshold just above the recalled short ones, and send new
    prompts (predicted without recall) long far beyond the budget. The probe reads no prompt it
    predicts, so the threshold is one for prompts the model has not seen."""
    from lanes.scheduler.policy import RoutingCalibration, choose_lane

    rng = np.random.default_rng(2)

    def words() -> str:
        return " ".join("".join(rng.choice(list("bcdfghjklmnpqrstvwxz"), 7)) for _ in range(4))

    pool = [(words(), int(t)) for t in rng.permutation(np.geomspace(3, 1500, 60).astype(int))]
    window = [Observation(*pool[j]) for j in rng.integers(0, 60, 600)]
    model = refit_with_routing(load_default(), window, RoutingCalibration(min_shorts=20))
    assert model.routing is not None
    new_prompts = [words() for _ in range(200)]
    went_long = [choose_lane(model.predict(user(p), 4096), model.routing) is Lane.LONG for p in new_prompts]
    assert sum(went_long) <= 10, f"{sum(went_long)} of 200 new prompts routed long"


def test_each_routing_probe_reads_every_row_but_those_of_the_prompts_it_predicts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The held-out prompts are dealt to the probes; a probe reads no row of its own prompts and
    every other row (the older ones and the other probes' held-out rows), so leaving out a
    repeated prompt costs it only that prompt's rows. One probe is the older window without the
    held-out prompts."""
    from lanes.scheduler.predictor import train as train_module

    rng = np.random.default_rng(3)
    pool = [(f"prompt {j} about {rng.integers(10**6)}", int(t)) for j, t in enumerate(rng.integers(3, 900, 40))]
    window = [Observation(*pool[j]) for j in rng.integers(0, 40, 400)]
    held_prompts = {o.prompt for o in window[-80:]}
    reads: list[list[Observation]] = []

    def recording_refit(predictor: LengthPredictor, observations: list[Observation], *args: object,
                        **kwargs: object) -> LengthPredictor:
        reads.append(list(observations))
        return refit(predictor, observations, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(train_module, "refit", recording_refit)
    # 40 prompts over 400 rows: the older rows outside the 80 held-out rows' prompts are fewer
    # than 80, so one probe falls back to two (``test_refit_ships_thresholds_when_every_...``).
    assert sum(o.prompt not in held_prompts for o in window) < 80
    for folds in (1, 2, 3):
        reads.clear()
        refit_with_routing(load_default(), window, probe_folds=folds)
        *probes, whole = reads
        assert whole == window and len(probes) == max(folds, 2)
        left_out = [held_prompts - {o.prompt for o in probe} for probe in probes]
        assert set().union(*left_out) == held_prompts and sum(map(len, left_out)) == len(held_prompts)
        for probe, own in zip(probes, left_out, strict=True):
            assert probe == [o for o in window if o.prompt not in own]
    # Where prompts rarely repeat, one probe is the older window without the held-out prompts.
    window = [Observation(f"prompt {j} about {rng.integers(10**6)}", int(t)) for j, t in
              enumerate(rng.integers(3, 900, 400))]
    reads.clear()
    refit_with_routing(load_default(), window, probe_folds=1)
    *probes, whole = reads
    assert len(probes) == 1 and probes[0] == window[:-80]
    with pytest.raises(ValueError, match="probe_folds"):
        refit_with_routing(load_default(), window, probe_folds=0)


def test_train_command_leaves_named_sources_out(tmp_path: Path) -> None:
    """`lanes predictor train --leave-out S`: a base that never saw S (for the refresh in the
    simulator's loop); an unknown source is a usage error naming the flag."""
    from lanes.cli.main import app
    from typer.testing import CliRunner

    examples = [Example(f"{word} {i}", source, {"m1": tokens, "m2": tokens + 1})
                for source in ("alpha", "beta", "gamma") for i in range(8)
                for word, tokens in (("Write an essay about", 700), ("Say yes", 3))]
    write_examples(examples, tmp_path / "d.jsonl.gz")
    run = CliRunner().invoke(app, ["predictor", "train", "--data", str(tmp_path / "d.jsonl.gz"), "--out",
                                   str(tmp_path / "w"), "--leave-out", "beta", "--lexical"])
    assert run.exit_code == 0, run.output
    info = from_weights(tmp_path / "w" / DEFAULT_WEIGHTS_PATH.name).info
    assert info["sources"] == ["alpha", "gamma"] and "beta" in info["held_out_sources"]  # type: ignore[operator]
    bad = CliRunner().invoke(app, ["predictor", "train", "--data", str(tmp_path / "d.jsonl.gz"), "--out",
                                   str(tmp_path / "w"), "--leave-out", "delta", "--lexical"])
    assert bad.exit_code == 2 and "--leave-out" in bad.output


@pytest.mark.parametrize("text", [
    "Write a haiku about autumn, then explain it.",
    "Übersetze: «naïve café» — 日本語で説明して",
    "x" * 5000 + " tail words here",
    "",
])
def test_gram_slots_are_crc32_of_the_prefixed_grams(text: str) -> None:
    """The shipped weights index slots by ``crc32(prefix + gram) & mask``; the fast path
    (running CRC from the prefix, ASCII words sliced as bytes) must give exactly those slots."""
    import zlib

    from lanes.scheduler.predictor import load_default
    from lanes.scheduler.predictor.lexical import _WORD_RE, _clip, raw_counts

    config = load_default().model.config
    mask = config.num_buckets - 1
    words = ["<s>", *_clip(_WORD_RE.findall(text.lower()), config.max_head_words, config.max_tail_words)]
    word_grams = [f"w:{w}" for w in words[1:]]
    for n in range(2, config.word_ngram_max + 1):
        word_grams += ["w:" + " ".join(words[i:i + n]) for i in range(len(words) - n + 1)]
    char_grams = []
    for word in str(_clip(text.lower(), config.max_head_chars, config.max_tail_chars)).split():
        padded = f" {word} "
        for n in range(config.char_ngram_min, config.char_ngram_max + 1):
            char_grams += ["c:" + padded[i:i + n] for i in range(len(padded) - n + 1)]
    for (slots, counts), grams in zip(raw_counts(text, config), (word_grams, char_grams), strict=True):
        expected = np.unique(np.array([zlib.crc32(g.encode()) & mask for g in grams], np.int64), return_counts=True)
        assert np.array_equal(slots, expected[0]) and np.array_equal(counts, expected[1])


def test_release_freed_memory_hands_the_heap_back() -> None:
    """After a predictor is replaced the edge and the scheduler call this: glibc keeps freed
    memory (a soak: ~15 MB per edge per predictor load, the scheduler at 370 MB against 211
    after one trim). Here: 100 MB freed behind a live block stays in RSS until the trim."""
    import platform

    from lanes.scheduler.predictor import release_freed_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")

    def rss_mb() -> float:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 1e6

    blocks = [bytes(2048) + bytes([i % 256]) for i in range(50_000)]  # ~100 MB of malloc'd blocks
    pinned = bytes(2048) + b"x"  # allocated last: the heap's top stays in use
    del blocks
    before = rss_mb()
    release_freed_memory()
    assert rss_mb() < before - 50, f"RSS {before:.0f} MB -> {rss_mb():.0f} MB"
    assert pinned


# --- Stop 43: the cost of a long prompt is bounded, its features unchanged -------------------------


def _long_texts() -> list[str]:
    """Long texts, unicode edge cases at their joins: Turkish dotted / dotless i, long s, sigma
    (lower-cased by context), combining marks, non-ASCII spaces, lone surrogates, one huge word."""
    rng = np.random.default_rng(43)
    pieces = ["word", "İ", "ı", "ſ", "Σ", "σ", "\u0301", " ", "\n", "\u2003", "\xa0", "\x1f", "?", ".", "5", "ten",
              "words", "at most", "😀", "K", "\u212a", "-", ",", "日本語", "x" * 120]
    texts = ["", " ", "\n\t \u3000\xa0", "İ" * 9000, "ΣΑΣ ΟΔΟΣ " * 2000, "e\u0301" * 9000, "a" * 100_000,
             "b " + "a" * 100_000, "a" * 100_000 + " b", "x" * 9000 + "\u03a3", " \u2003 ".join(["word"] * 5000),
             # Chunks the word count reads whole (most units from 0x85 up) next to ASCII ones,
             # across its 64 k-unit chunk edges.
             "привет мир\u3000" * 12_000, "日本語の文\u3000テキスト " * 8_000,
             ("ascii words here " * 4_000 + "жжж ж\u2003" * 14_000) * 2]
    texts += ["".join(rng.choice(pieces, int(n))) for n in rng.integers(10, 40_000, 60)]
    return texts


def test_long_prompt_features_are_those_of_the_whole_text_lower_cased_and_split() -> None:
    """The lexical features lower-case and read only a long prompt's head and tail, and count
    its words without splitting it: the same features as lower-casing and splitting it whole."""
    from lanes.scheduler.predictor.lexical import (
        _CUE_HEAD_CHARS,
        _CUE_TAIL_CHARS,
        _WORD_RE,
        _clip,
        _count_words,
        _head_and_tail_words,
        _lower_clip,
    )

    for text in _long_texts():
        lowered = text.lower()
        assert _count_words(text) == len(text.split())
        assert _lower_clip(text, _CUE_HEAD_CHARS, _CUE_TAIL_CHARS) == str(_clip(lowered, _CUE_HEAD_CHARS, _CUE_TAIL_CHARS))
        assert _lower_clip(text, 256, 128) == str(_clip(lowered, 256, 128))
        assert _head_and_tail_words(text, 256, 128, lower=True) == list(_clip(_WORD_RE.findall(lowered), 256, 128))


def test_the_word_count_knows_every_space_str_split_does() -> None:
    from lanes.scheduler.predictor.lexical import _NOT_SPACE

    spaces = [c for c in range(0x110000) if chr(c).isspace()]
    assert max(spaces) < len(_NOT_SPACE) and np.flatnonzero(_NOT_SPACE == 0).tolist() == spaces


def test_requested_tokens_reads_the_same_requests_as_the_whole_pattern() -> None:
    """``requested_tokens`` scans for the number and unit, then looks back for the relation: the
    same requests as ``_REQUEST_RE.finditer`` (relation, number, unit), which it replaced."""
    from lanes.scheduler.predictor.lexical import (
        _AT_LEAST,
        _AT_MOST,
        _NUMBER_WORDS,
        _RELATIONS,
        _REQUEST_RE,
        _REQUEST_UNITS,
    )

    def reference(text: str) -> float | None:
        best = None
        for match in _REQUEST_RE.finditer(text):
            relation, number, unit = match.group(1) or "", match.group(2), match.group(3)
            count = _NUMBER_WORDS.get(number) or int(number.replace(",", "") or 0)
            if 0 < count <= 100_000:
                tokens = count * _REQUEST_UNITS[unit] * (0.7 if relation in _AT_MOST else 1.3 if relation in _AT_LEAST
                                                         else 1.0)
                best = tokens if best is None else max(best, tokens)
        return best

    rng = np.random.default_rng(7)
    pieces = [*_RELATIONS, *_NUMBER_WORDS, *_REQUEST_UNITS, "5", "12", "1,000", ",", "+", "-", " ", "  ", "\n",
              "\u2003", "s", "x", "th", "teen", ".", "_", "\u0661", "a", "no", "un"]
    texts = ["thunder 5 words", "admin 5 words; no more than 3 paragraphs", "5 words over 3 lines", "max5 words",
             "exactly  \n  20 bullet points", "less than 50 words", "at least 3 paragraphs"]
    texts += ["".join(rng.choice(pieces, int(n))) for n in rng.integers(1, 14, 20_000)]
    for text in texts:
        assert requested_tokens(text) == reference(text), text


def test_a_long_prompt_is_never_copied_whole_to_be_scored() -> None:
    """The lexical model reads a long prompt's head and tail: lower-casing, splitting or
    otherwise copying a 1M-character prompt whole (~2-8 ms each, 2-4 MB) is work whose result
    depends on its ends only, or (the word count) needs no copy. (``strip`` copies it when it
    has whitespace to strip, a ~0.05 ms memcpy: not here.)"""
    import tracemalloc

    model = load_default().model
    text = ("Übersetze «naïve café» bitte. " + "Some pasted document text, line after line.\n" * 22_000)[:999_999] + "?"
    model.score_text(text)
    tracemalloc.start()
    try:
        model.score_text(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000



def test_refit_ships_thresholds_when_every_window_prompt_is_held_out() -> None:
    """A deployment whose few prompts repeat (a pool of 20 here; the default bench pool has 188):
    the newest fifth holds every prompt of the window, so one probe reading only the other
    prompts' rows had nothing to read and no thresholds were ever fitted: the edges kept their
    first ones for good (a random predictor's split then cost 3x FCFS's short P99, RESULTS "Stop
    43"). Two probes, each reading the other's prompts, fit them; lengths unrelated to the
    prompts (nothing to rank) get a threshold that sends almost nothing long."""
    from lanes.scheduler.policy import RoutingCalibration, choose_lane

    rng = np.random.default_rng(3)

    def words() -> str:
        return " ".join("".join(rng.choice(list("bcdfghjklmnpqrstvwxz"), 7)) for _ in range(4))

    prompts = [words() for _ in range(20)]
    window = [Observation(prompts[i % 20], int(rng.geometric(1 / 250))) for i in range(600)]
    model = refit_with_routing(load_default(), window, RoutingCalibration(min_shorts=20))
    assert model.routing is not None, "every prompt held out: the probe must still fit thresholds"
    went_long = [choose_lane(model.predict(user(p), 4096), model.routing) is Lane.LONG
                 for p in [words() for _ in range(100)] + prompts]
    assert sum(went_long) <= 10, f"{sum(went_long)} of 120 prompts routed long with nothing to rank"


# --- Stop 44: the predictor's cost, its features unchanged ------------------------------------------


def _cue_test_texts() -> list[str]:
    """Lower-cased cue windows of data-set prompts and long joins of them, and random texts made of
    every word and phrase the cue patterns name, cut and joined by spaces, newlines, signs, digits
    and non-ASCII word characters (each pattern's edge: a word glued to another, a sign without
    digits, a colon before a newline, a line-start word after punctuation)."""
    from lanes.scheduler.predictor.lexical import (
        _CUE_HEAD_CHARS,
        _CUE_TAIL_CHARS,
        _lower_clip,
    )

    rng = np.random.default_rng(44)
    prompts = [example.prompt for example in read_examples(DEFAULT_DATASET_PATH)]
    sample = [prompts[int(i)] for i in rng.choice(len(prompts), 1500, replace=False)]
    sample += ["\n\n".join(prompts[int(i)] for i in rng.choice(len(prompts), 60)) for _ in range(60)]
    texts = [_lower_clip(text.strip(), _CUE_HEAD_CHARS, _CUE_TAIL_CHARS) for text in sample]
    vocabulary = sorted({w for _, pattern in CUE_PATTERNS for w in re.findall(r"[a-z][a-z ;+-]*[a-z+]", pattern)})
    pieces = [*vocabulary, *[w[:-1] for w in vocabulary], *[w[1:] for w in vocabulary], " ", " ", " ", "  ", "\n",
              "\n\n", "\t", "\u2003", "-", "+", "*", "/", "^", "=", ":", ";", "{", "}", "```", "?", ".", ",", "(", "'",
              "_", "5", "12", "\u0663", "é", "ß", "日本", "please", "def", "c", "++", "tl", "dr", "x"]
    texts += ["".join(rng.choice(pieces, int(n))) for n in rng.integers(1, 40, 30_000)]
    return texts


def test_cue_scans_find_what_the_cue_patterns_find() -> None:
    """``_cue_hits`` (word runs, guards, a few searches) gives each cue the value searching its
    pattern gives (``CUE_PATTERNS`` is the definition the weights were trained with)."""
    from lanes.scheduler.predictor.lexical import _CUE_RES, _cue_hits

    hits = np.zeros(len(CUE_PATTERNS))
    for text in _cue_test_texts():
        expected = [float(regex.search(text) is not None) for regex in _CUE_RES]
        assert _cue_hits(text) == expected, text
        hits += expected
    assert hits.min() > 50, dict(zip([name for name, _ in CUE_PATTERNS], hits.tolist()))  # every cue is exercised


def _reference_gram_slots(text: str, config: FeatureConfig) -> tuple[list[int], list[int]]:
    """The word and character gram slots as the features define them: ``crc32(prefix + gram)``
    of the lower-cased text's clipped words and characters, each gram built as a string."""
    import zlib

    from lanes.scheduler.predictor.lexical import _WORD_RE, _clip

    mask = config.num_buckets - 1
    lowered = text.lower()
    words = list(_clip(_WORD_RE.findall(lowered), config.max_head_words, config.max_tail_words))
    grams = [f"w:{w}" for w in words]
    marked = ["<s>", *words]
    for n in range(2, config.word_ngram_max + 1):
        grams += ["w:" + " ".join(marked[i:i + n]) for i in range(len(marked) - n + 1)]
    chars = []
    for word in str(_clip(lowered, config.max_head_chars, config.max_tail_chars)).split():
        padded = f" {word} "
        for n in range(config.char_ngram_min, config.char_ngram_max + 1):
            chars += ["c:" + padded[i:i + n] for i in range(len(padded) - n + 1)]
    return [zlib.crc32(g.encode()) & mask for g in grams], [zlib.crc32(g.encode()) & mask for g in chars]


def test_word_and_char_slots_are_those_of_the_grams_built_as_strings() -> None:
    """The running word-gram CRCs and the character grams hashed together in numpy give the
    slots of each gram built and hashed alone: data-set prompts, long joins of them, the unicode
    edge cases of ``_long_texts``, and other n-gram ranges than the shipped one."""
    from lanes.scheduler.predictor.lexical import _char_slots, _word_slots

    rng = np.random.default_rng(45)
    prompts = [example.prompt for example in read_examples(DEFAULT_DATASET_PATH)]
    texts = [prompts[int(i)] for i in rng.choice(len(prompts), 400, replace=False)]
    texts += ["\n\n".join(prompts[int(i)] for i in rng.choice(len(prompts), int(k))) for k in rng.integers(2, 300, 40)]
    texts += _long_texts() + ["a", "ab", " x ", "İ", "naïve café", "a\u2003b", "x" * 500, "\U0001f600 ok"]
    configs = [load_default().model.config, FeatureConfig(word_ngram_max=3, char_ngram_min=2, char_ngram_max=5),
               FeatureConfig(word_ngram_max=1, char_ngram_min=4, char_ngram_max=4, max_head_chars=40,
                             max_tail_chars=9, max_head_words=7, max_tail_words=3)]
    for config in configs:
        mask = config.num_buckets - 1
        for text in texts:
            words, chars = _reference_gram_slots(text, config)
            assert sorted(_word_slots(text, config, mask)) == sorted(words), text[:80]
            assert sorted(np.asarray(_char_slots(text, config, mask)).tolist()) == sorted(chars), text[:80]


def test_a_feature_config_the_hashing_cannot_serve_is_refused() -> None:
    """Slots are 32-bit CRCs and a character gram has a character: a config outside that is
    refused when built (or loaded from weights), not mis-hashed at the first prompt."""
    with pytest.raises(ValueError, match="num_buckets_log2"):
        FeatureConfig(num_buckets_log2=33)
    with pytest.raises(ValueError, match="char_ngram_min"):
        FeatureConfig(char_ngram_min=0)
    assert FeatureConfig(num_buckets_log2=32).num_buckets == 1 << 32


def test_eval_counts_answer_text_and_says_how_lengths_were_had(tmp_path: Path) -> None:
    """Rows may give the answer's text (``output``) instead of ``output_tokens``: it is counted
    with the Llama-3 BPE the shipped labels were counted with, and the report says so in
    ``output_tokens_from`` (before, such rows were refused, and an AlpacaEval file without its
    count CSV was silently approximated by characters / 4.6: tau 0.4886 instead of 0.4956)."""
    from lanes.cli.predictor import FROM_FILE, FROM_LLAMA3, app
    from lanes.scheduler.predictor.sources import quicktok_counter
    from typer.testing import CliRunner

    answers = ["Yes.", "The sea is large and blue. " * 20, "A short poem:\nwaves, salt, wind.", "x" * 900]
    rows = [{"prompt": f"Write about the sea, part {i}.", "output": a} for i, a in enumerate(answers)]
    (tmp_path / "text.json").write_text(json.dumps(rows))
    counted = [{"prompt": r["prompt"], "output_tokens": n} for r, n in zip(rows, quicktok_counter()(answers))]
    (tmp_path / "counted.json").write_text(json.dumps(counted))
    assert [o.output_tokens for o in load_observations(tmp_path / "text.json")] == [c["output_tokens"] for c in counted]
    by_text = json.loads(CliRunner().invoke(app, ["eval", "--data", str(tmp_path / "text.json"), "--json"]).stdout)
    by_count = json.loads(CliRunner().invoke(app, ["eval", "--data", str(tmp_path / "counted.json"), "--json"]).stdout)
    assert by_text["output_tokens_from"] == FROM_LLAMA3 and by_count["output_tokens_from"] == FROM_FILE
    assert by_text["kendall_tau"] == by_count["kendall_tau"] is not None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"prompt": "a", "output": 12}]))
    out = CliRunner().invoke(app, ["eval", "--data", str(bad)])
    assert out.exit_code == 2 and "'output' (the answer's text" in " ".join(out.output.split())


def test_answer_text_without_quicktok_is_approximated_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    from lanes.cli import predictor as cli
    from lanes.scheduler.predictor import sources

    def missing() -> None:
        raise ImportError("No module named 'quicktok'")

    monkeypatch.setattr(sources, "quicktok_counter", missing)
    tokens, counted = cli.count_output_tokens(["x" * 46, ""])
    assert tokens == [10, 0] and counted == cli.FROM_CHARS and "install quicktok-v1" in counted


def test_cv_says_what_it_runs_before_it_starts_and_each_fit_as_it_ends(tmp_path: Path) -> None:
    """The default ``predictor cv`` runs 16 fits on 24,896 prompts (~9 minutes on a loaded
    two-core VM) and said nothing until its JSON: now one line before the first fit and one per
    fit with the time left, on stderr, the JSON alone on stdout (per source and mean, LOSO and
    in-source)."""
    from lanes.cli.predictor import app
    from typer.testing import CliRunner

    rng = np.random.default_rng(0)
    rows = [{"prompt": f"{w} {rng.integers(1000)}", "output_tokens": (800 if w == "essay" else 4) * scale, "source": s}
            for s, scale in (("x", 1), ("y", 10), ("z", 100)) for w in ("essay", "yes", "poem") * 10]
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    out = CliRunner().invoke(app, ["cv", "--data", str(tmp_path / "rows.json"), "--folds", "2"])
    assert out.exit_code == 0, out.output
    lines = out.stderr.splitlines()
    assert lines[0].startswith("lanes predictor cv: 90 prompts of 3 sources; 3 leave-one-source-out fits and 2 "
                               "in-source folds") and "on stdout at the end" in lines[0]
    assert [line.split(" (")[0] for line in lines[1:]] == [f"lexical fit {i}/5" for i in range(1, 6)]
    assert "source x left out" in lines[1] and "fold 2 of 2" in lines[5] and lines[5].endswith("about 0 s left")
    report = json.loads(out.stdout)
    assert set(report["loso_kendall_tau"]) == set(report["cv2_kendall_tau"]) == {"x", "y", "z"}
    assert report["loso_kendall_tau_mean"] is not None and report["cv2_kendall_tau_mean"] is not None
