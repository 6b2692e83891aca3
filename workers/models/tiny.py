"""A random tiny Llama with a real tokenizer and a draft model, built offline in well under a second.

Tests and smoke runs need a model that loads through the ordinary ``AutoTokenizer`` /
``AutoModelForCausalLM`` path, has a chat template, and emits varied tokens, but need not say
anything meaningful. Its weights are random; its byte-level BPE is trained on the pydoc topics.

Two details matter for tests that use it:

- ``initializer_range=0.1``: at the Llama default of 0.02 the greedy output repeats one token,
  so every draft would look "100 % accepted" and acceptance tests would prove nothing.
- ``draft_equals_target=True`` makes the draft an exact copy of the target, so speculative
  decoding must accept every proposed token (acceptance exactly 1.0).

The tokenizer, chat template and config helpers here are shared with ``train_demo``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from lanes.workers.models.corpus import pydoc_topics
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)

#: ChatML-like: every message is ``<|im_start|>role\ncontent<|im_end|>\n``.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyModelPaths:
    """Where a target model and its draft were saved (each directory has its own tokenizer)."""

    target: Path
    draft: Path


def build_tiny(
    out_dir: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_draft_layers: int = 1,
    seed: int = 0,
    draft_equals_target: bool = False,
    dtype: str = "float32",
) -> TinyModelPaths:
    """Build and save a random target Llama and its draft under ``out_dir/{target,draft}``.

    The draft is the target truncated to its first ``num_draft_layers`` layers (sharing the
    embeddings, final norm and tied head), or an exact copy when ``draft_equals_target``.
    ``hidden_size`` must be a multiple of 4 (4 attention heads, 2 KV heads): the head dim is
    ``hidden_size / 4``. GPU engines want a head dim of 64 or more and bf16 weights
    (``hidden_size=256, dtype="bfloat16"``).
    """
    tokenizer = train_tokenizer(pydoc_topics(), vocab_size=vocab_size)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(llama_config(
        tokenizer, hidden_size=hidden_size, num_layers=num_layers, num_heads=4,
        num_kv_heads=2, intermediate_size=3 * hidden_size, initializer_range=0.1,
    ))
    draft = truncated_copy(target, num_layers if draft_equals_target else num_draft_layers)
    torch_dtype = getattr(torch, dtype)
    return save_pair(Path(out_dir), tokenizer, target.to(torch_dtype), draft.to(torch_dtype))


def train_tokenizer(texts: Iterable[str], *, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (any text round-trips) with our special tokens and chat template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def llama_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    initializer_range: float = 0.02,
) -> LlamaConfig:
    """A Llama config with tied embeddings whose special-token ids match ``tokenizer``."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def truncated_copy(model: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """A new model holding ``model``'s embeddings, first ``num_layers`` layers, norm and head."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.num_hidden_layers = num_layers
    config.layer_types = None  # recomputed for the new depth
    draft = LlamaForCausalLM(config).to(model.dtype)
    kept = {
        name: tensor
        for name, tensor in model.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    draft.load_state_dict(kept)
    return draft


def save_pair(
    out_dir: Path,
    tokenizer: PreTrainedTokenizerFast,
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
) -> TinyModelPaths:
    """Save both models, each with a copy of the tokenizer, so each directory loads alone."""
    paths = TinyModelPaths(target=out_dir / "target", draft=out_dir / "draft")
    for path, model in ((paths.target, target), (paths.draft, draft)):
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return paths
