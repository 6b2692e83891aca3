"""The length predictor's encoder: the shipped blend, its files, the refit, and the fine-tune.

The shipped graph is run for real by ONNX Runtime. The fine-tune is run for real too, on a tiny
BERT made here (random weights, the shipped tokenizer), through the same export and int8
quantisation as the shipped encoder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from lanes.queue.messages import ChatMessage
from lanes.scheduler.predictor import (
    WEIGHTS_DIR,
    WeightsError,
    from_weights,
    load_default,
)
from lanes.scheduler.predictor.encoder import (
    CHARS_PER_TOKEN,
    ENCODER_FILE,
    TOKENIZER_FILE,
    load_encoder,
)
from lanes.scheduler.predictor.eval import kendall_tau
from lanes.scheduler.predictor.train import (
    ENCODER_REFIT_HALF_N,
    ENCODER_WEIGHT,
    Observation,
    refit,
    refit_encoder_weight,
    refit_with_routing,
)

PROMPTS = [
    "Name one colour.",
    "Write a 1,000-word essay on the history of the printing press, with sources.",
    "Is 7 a prime number? Answer yes or no.",
    "Explain, step by step with code, how to build a REST API in Flask with authentication.",
    "Translate 'cat' to French.",
]


def test_the_shipped_model_blends_the_encoder_into_the_lexical_score() -> None:
    model = load_default()
    assert model.kind == "lexical+encoder" and model.encoder_weight == ENCODER_WEIGHT
    for prompt in PROMPTS:
        blended = (1 - model.encoder_weight) * model.model.score_text(prompt) \
            + model.encoder_weight * model.encoder.score_text(prompt)
        assert model.score_text(prompt) == pytest.approx(blended, abs=1e-12)
    # It ranks these as anyone would: one word < yes/no < an essay and a tutorial.
    tokens = [model.predict([ChatMessage("user", p)], 4096) for p in PROMPTS]
    assert max(tokens[0], tokens[2], tokens[4]) < min(tokens[1], tokens[3])


def test_the_encoder_scores_a_prompt_alone_the_same_in_any_company() -> None:
    encoder = load_default().encoder
    alone = [encoder.score_text(p) for p in reversed(PROMPTS)][::-1]
    fresh = load_encoder(WEIGHTS_DIR / ENCODER_FILE)  # the same process-wide instance, cache and all
    assert fresh is encoder
    assert encoder.score_texts(PROMPTS).tolist() == alone
    # Only the first max_tokens word pieces are read, and a huge prompt is not tokenised whole.
    head = "Summarise the following report in three bullet points. " * 8  # ~90 word pieces
    assert encoder.score_text(head + "x" * 2_000_000) == encoder.score_text(head + "y " * 1000)
    assert len(head) < encoder.max_tokens * CHARS_PER_TOKEN


def test_weights_find_their_encoder_beside_them_or_in_the_package(tmp_path: Path) -> None:
    model = load_default()
    model.save(tmp_path / "w.npz")
    assert from_weights(tmp_path / "w.npz").score_text(PROMPTS[1]) == model.score_text(PROMPTS[1])
    header = json.loads(str(np.load(tmp_path / "w.npz")["header_json"]))
    assert header["encoder"]["file"] == ENCODER_FILE and len(header["encoder"]["sha256"]) == 64


def test_weights_naming_a_missing_or_different_encoder_do_not_load(tmp_path: Path) -> None:
    model = load_default()
    (tmp_path / "other").mkdir()
    shutil.copy(WEIGHTS_DIR / TOKENIZER_FILE, tmp_path / "other" / TOKENIZER_FILE)
    data = bytearray((WEIGHTS_DIR / ENCODER_FILE).read_bytes())
    (tmp_path / "other" / ENCODER_FILE).write_bytes(bytes(data))
    other = load_encoder(tmp_path / "other" / ENCODER_FILE)
    assert other.sha256 == model.encoder.sha256  # a copy is the same encoder
    # Weights fitted with another encoder: a clear error, never scores mixed from two models.
    model.save(tmp_path / "w.npz")
    with np.load(tmp_path / "w.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    header = json.loads(str(arrays["header_json"]))
    header["encoder"]["sha256"] = "0" * 64
    arrays["header_json"] = np.array(json.dumps(header))
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(WeightsError, match="SHA-256"):
        from_weights(tmp_path / "bad.npz")
    header["encoder"]["file"] = "missing.onnx"
    arrays["header_json"] = np.array(json.dumps(header))
    np.savez(tmp_path / "missing.npz", **arrays)
    with pytest.raises(WeightsError, match="missing.onnx"):
        from_weights(tmp_path / "missing.npz")
    header["encoder"]["file"] = "../escape.onnx"
    arrays["header_json"] = np.array(json.dumps(header))
    np.savez(tmp_path / "escape.npz", **arrays)
    with pytest.raises(WeightsError, match="plain file name"):
        from_weights(tmp_path / "escape.npz")


def test_a_refit_moves_the_lexical_part_towards_the_window_and_keeps_the_encoder(tmp_path: Path) -> None:
    model = load_default()
    # A deployment whose answers are all short: the refit must bring the blend down to them.
    window = [Observation(p, 12) for p in PROMPTS * 20]
    refitted = refit(model, window)
    # The encoder stays, with the share a refit on this many observations leaves it.
    assert refitted.encoder is model.encoder
    assert refitted.encoder_weight == pytest.approx(refit_encoder_weight(model.encoder_weight, len(window)))
    assert 0.0 < refitted.encoder_weight < model.encoder_weight
    assert refitted.model is not model.model
    before = np.mean([abs(model.score_text(p) - np.log1p(12)) for p in PROMPTS])
    after = np.mean([abs(refitted.score_text(p) - np.log1p(12)) for p in PROMPTS])
    assert after < 0.5 * before
    # What the refresh publishes loads back to the same predictions (the encoder by reference).
    refitted.save(tmp_path / "r.npz")
    assert (tmp_path / "r.npz").stat().st_size < 3_000_000
    loaded = from_weights(tmp_path / "r.npz")
    assert [loaded.score_text(p) for p in PROMPTS] == [refitted.score_text(p) for p in PROMPTS]


def test_the_encoder_counts_for_less_the_more_a_refit_has_seen() -> None:
    assert refit_encoder_weight(0.5, 0) == 0.5
    assert refit_encoder_weight(0.5, ENCODER_REFIT_HALF_N) == 0.25
    shares = [refit_encoder_weight(0.5, n) for n in (100, 1_000, 3_000, 10_000)]
    assert shares == sorted(shares, reverse=True) and shares[-1] < 0.05
    assert refit_encoder_weight(0.0, 5_000) == 0.0
    # The refresh's probe (the older 80 %) blends at the whole window's share, like the model it
    # stands in for, and the published model carries that share.
    model = load_default()
    window = [Observation(p, 12 + 40 * (i % 3)) for i, p in enumerate(PROMPTS * 30)]
    published = refit_with_routing(model, window)
    assert published.encoder_weight == pytest.approx(refit_encoder_weight(model.encoder_weight, len(window)))
    assert refit(model, window, encoder_weight=0.3).encoder_weight == 0.3


def _tiny_base(path: Path) -> Path:
    """A two-layer BERT with random weights and the shipped word-piece tokenizer."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=128)
    transformers.BertModel(config).save_pretrained(path)
    shutil.copy(WEIGHTS_DIR / TOKENIZER_FILE, path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizerFast",
                                                            "do_lower_case": True, "model_max_length": 128}))
    return path


def test_fine_tune_learns_lengths_and_exports_an_int8_graph(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    from lanes.scheduler.predictor.encoder_train import EncoderRecipe, fine_tune

    short = [f"Give me one word for {w}." for w in ("red", "big", "fast", "cold", "old", "new", "sad", "wet")]
    long = [f"Write a detailed multi-page report on {w}, with sections and examples." for w in
            ("rivers", "bridges", "trains", "markets", "forests", "engines", "cities", "oceans")]
    data = [Observation(p, 3, "a") for p in short[:6]] + [Observation(p, 900, "a") for p in long[:6]] \
        + [Observation(p, 5, "b") for p in short[6:]] + [Observation(p, 700, "b") for p in long[6:]]
    recipe = EncoderRecipe(num_layers=2, frozen_layers=1, max_tokens=24, epochs=30, batch_size=8, lr=1e-3, head_lr=1e-2,
                           warmup_steps=5)
    encoder = fine_tune(data, tmp_path / "out", level=4.0, recipe=recipe, base=str(_tiny_base(tmp_path / "base")))
    assert (tmp_path / "out" / ENCODER_FILE).exists() and (tmp_path / "out" / TOKENIZER_FILE).exists()
    assert encoder.max_tokens == 24 and encoder.describe()["num_layers"] == 2
    assert encoder.describe()["training"]["num_examples"] == len(data)
    scores = encoder.score_texts([o.prompt for o in data])
    assert np.isfinite(scores).all()
    assert kendall_tau(scores, [o.output_tokens for o in data]) > 0.5


def test_train_command_fine_tunes_the_encoder_and_names_it_in_the_weights(tmp_path: Path) -> None:
    pytest.importorskip("onnx")
    from lanes.cli.main import app
    from lanes.scheduler.predictor.data import Example, write_examples
    from typer.testing import CliRunner

    examples = [Example(f"{word} {i}", source, {"m1": tokens, "m2": tokens + 1})
                for source in ("alpha", "beta") for i in range(8)
                for word, tokens in (("Write an essay about", 700), ("Say yes", 3))]
    write_examples(examples, tmp_path / "d.jsonl.gz")
    base = _tiny_base(tmp_path / "base")
    run = CliRunner().invoke(app, ["predictor", "train", "--data", str(tmp_path / "d.jsonl.gz"), "--out",
                                   str(tmp_path / "w"), "--base", str(base)])
    assert run.exit_code == 0, run.output
    model = from_weights(tmp_path / "w" / "length_predictor_lexical.npz")
    assert model.kind == "lexical+encoder" and model.encoder.path == (tmp_path / "w" / ENCODER_FILE).resolve()
    assert np.isfinite(model.score_text("Say yes 99"))
    missing = CliRunner().invoke(app, ["predictor", "train", "--data", str(tmp_path / "d.jsonl.gz"), "--out",
                                       str(tmp_path / "w2"), "--base", str(tmp_path / "nope")])
    said = " ".join(missing.output.replace("│", " ").split())  # the error panel wraps its lines
    assert missing.exit_code == 2 and "--base" in said and "no such model directory" in said
    assert not (tmp_path / "w2").exists()  # refused before reading the data or writing anything


def test_the_encoder_tokenises_a_short_head_of_an_ordinary_long_prompt() -> None:
    """Its first try tokenises at most max_tokens * QUICK_CHARS_PER_TOKEN characters (cut before
    a space), and its word pieces are those of the longer cut whenever that try fills them."""
    from lanes.scheduler.predictor.encoder import CHARS_PER_TOKEN, QUICK_CHARS_PER_TOKEN

    encoder = load_default().encoder
    real = encoder._tokenizer
    seen: list[int] = []

    class Spy:
        def encode(self, text: str):  # noqa: ANN202
            seen.append(len(text))
            return real.encode(text)

    texts = [PROMPTS[1] * 40, "Summarise this report. " + "The quarterly numbers went up again. " * 200]
    rng = np.random.default_rng(3)
    pieces = ["word", "İ", "\u0301", " ", "\n", "\r\n", "\u2003", "?", "日本", "😀", "\x00", "e\u0301", "x" * 150, "\t"]
    others = ["".join(rng.choice(pieces, int(n))) for n in rng.integers(50, 1200, 300)]
    encoder._tokenizer = Spy()
    try:
        ids = [encoder.ids(text) for text in texts]
        assert max(seen) <= encoder.max_tokens * QUICK_CHARS_PER_TOKEN
        for text in texts + others:
            assert encoder.ids(text) == real.encode(text[:encoder.max_tokens * CHARS_PER_TOKEN]).ids
    finally:
        encoder._tokenizer = real
    assert all(len(i) == encoder.max_tokens for i in ids)
