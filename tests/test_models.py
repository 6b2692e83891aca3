"""The offline models: the random tiny Llama for tests, the shipped demo model, and path resolution.

Every load here is from a local directory with ``local_files_only=True``: none may need the hub.
"""

from __future__ import annotations

import os
import string
from itertools import islice
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase,
)

from lanes.workers.models.corpus import MIN_DOCSTRING_CHARS, pydoc_topics, stdlib_docstrings  # noqa: E402
from lanes.workers.models.paths import (  # noqa: E402
    DEMO_DRAFT_DIR, DEMO_TARGET_DIR, resolve_draft, resolve_model,
)
from lanes.workers.models.tiny import TinyModelPaths, build_tiny  # noqa: E402
from lanes.workers.models.train_demo import DemoRecipe, lr_at  # noqa: E402

needs_demo = pytest.mark.skipif(
    not (DEMO_TARGET_DIR / "model.safetensors").exists(), reason="demo model not trained")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModelPaths:
    return build_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_twin(tmp_path_factory: pytest.TempPathFactory) -> TinyModelPaths:
    return build_tiny(tmp_path_factory.mktemp("twin"), draft_equals_target=True)


def _load(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)


def _new_tokens(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt: str, **generate: object
) -> list[int]:
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, pad_token_id=tokenizer.pad_token_id, **generate)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_tiny_reloads_and_renders_the_chat_template(tiny: TinyModelPaths) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny.target, local_files_only=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    # The markers are single special tokens, not spelled out in BPE pieces.
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert tokenizer.decode(tokenizer("naïve café ✓")["input_ids"]) == "naïve café ✓"  # byte-level


def test_tiny_greedy_output_is_varied(tiny: TinyModelPaths) -> None:
    """At the Llama default init the output would be one repeated token; 0.1 prevents that."""
    tokenizer = AutoTokenizer.from_pretrained(tiny.target, local_files_only=True)
    tokens = _new_tokens(_load(tiny.target), tokenizer, "The with statement", max_new_tokens=40,
                         do_sample=False)
    assert len(tokens) == 40
    assert len(set(tokens)) > 10


def test_tiny_draft_is_the_targets_first_layer(tiny: TinyModelPaths) -> None:
    target, draft = _load(tiny.target).state_dict(), _load(tiny.draft).state_dict()
    assert {k.split(".")[2] for k in draft if k.startswith("model.layers.")} == {"0"}
    assert all(torch.equal(tensor, target[name]) for name, tensor in draft.items())
    assert AutoTokenizer.from_pretrained(tiny.draft, local_files_only=True).get_vocab() == \
        AutoTokenizer.from_pretrained(tiny.target, local_files_only=True).get_vocab()


def test_draft_equals_target_copies_every_weight(tiny_twin: TinyModelPaths) -> None:
    target, draft = _load(tiny_twin.target).state_dict(), _load(tiny_twin.draft).state_dict()
    assert draft.keys() == target.keys()
    assert all(torch.equal(draft[name], target[name]) for name in target)


def test_build_tiny_is_deterministic(tiny: TinyModelPaths, tmp_path: Path) -> None:
    again = build_tiny(tmp_path)
    assert (again.target / "tokenizer.json").read_bytes() == (tiny.target / "tokenizer.json").read_bytes()
    first, second = _load(tiny.target).state_dict(), _load(again.target).state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)


@needs_demo
def test_demo_model_writes_english_looking_text() -> None:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET_DIR, local_files_only=True)
    model = _load(DEMO_TARGET_DIR)
    assert 1.5e6 < model.num_parameters() < 2.5e6
    torch.manual_seed(0)
    tokens = _new_tokens(model, tokenizer, "A class definition", max_new_tokens=60)  # its sampling defaults
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    letters = sum(c in string.ascii_letters or c.isspace() for c in text)
    assert letters / len(text) > 0.8, text
    assert len(text.split()) > 10, text


@needs_demo
def test_demo_draft_loads_and_generates() -> None:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DRAFT_DIR, local_files_only=True)
    draft = _load(DEMO_DRAFT_DIR)
    assert draft.config.num_hidden_layers == 1
    target_tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET_DIR, local_files_only=True)
    assert tokenizer.get_vocab() == target_tokenizer.get_vocab()
    tokens = _new_tokens(draft, tokenizer, "The module", max_new_tokens=20, do_sample=False)
    assert len(tokens) == 20


def test_resolve_model_and_draft(tmp_path: Path) -> None:
    assert resolve_model("") == str(DEMO_TARGET_DIR)
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert resolve_model("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert resolve_draft("", "") == str(DEMO_DRAFT_DIR)
    assert resolve_draft("", str(DEMO_TARGET_DIR)) == str(DEMO_DRAFT_DIR)
    assert resolve_draft("", "Qwen/Qwen3-0.6B") == ""  # no silent mismatched-tokenizer draft
    assert resolve_draft(str(tmp_path), "Qwen/Qwen3-0.6B") == str(tmp_path)


def test_corpus_is_deterministic_and_skips_short_docstrings() -> None:
    assert list(islice(pydoc_topics(), 3)) == list(islice(pydoc_topics(), 3))
    docs = list(islice(stdlib_docstrings(), 30))
    assert docs == list(islice(stdlib_docstrings(), 30))
    assert all(len(doc) > MIN_DOCSTRING_CHARS for doc in docs)


def test_learning_rate_warms_up_then_decays_to_the_floor() -> None:
    recipe = DemoRecipe()
    rates = [lr_at(step, 400, recipe) for step in range(400)]
    assert rates[0] < rates[recipe.num_warmup_steps - 1] == pytest.approx(recipe.lr)
    assert all(a >= b for a, b in zip(rates[recipe.num_warmup_steps:], rates[recipe.num_warmup_steps + 1:]))
    assert lr_at(400, 400, recipe) == pytest.approx(recipe.lr * recipe.min_lr_ratio)
