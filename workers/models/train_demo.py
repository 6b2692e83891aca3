"""Train the shipped "demo" model: a 2 M-parameter Llama that writes Python-doc-flavoured English.

Demos and streaming tests want a model whose output reads like text rather than random tokens,
yet loads in a second with no network. This trains one on CPython's own documentation
(``corpus.demo_corpus``) in about ten minutes on one CPU thread. It produces grammatical-looking
but meaningless doc prose; it does not answer questions.

The first layer is also trained as an early exit (an auxiliary cross-entropy on
``lm_head(norm(layer 1 output))``), so the draft, the target truncated to that layer, is a
real draft model for speculative decoding rather than noise.

Determinism: the run is a fixed function of ``seed`` and the number of steps. With ``seconds``
only, the step count comes from timing the first steps, so it varies with machine load; the
report and README record it, and ``num_steps`` repeats a run exactly (with the same thread count).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from lanes.workers.models.corpus import demo_corpus
from lanes.workers.models.tiny import (
    TinyModelPaths,
    llama_config,
    save_pair,
    train_tokenizer,
    truncated_copy,
)
from transformers import GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast

#: Prompt used for the sample shown in the log and the README.
SAMPLE_PROMPT = "A class definition"


@dataclass(frozen=True)
class DemoRecipe:
    """Model shape and optimiser settings (measured in cpu-engine.md section 6)."""

    vocab_size: int = 2048
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 6
    num_kv_heads: int = 3
    intermediate_size: int = 512
    num_draft_layers: int = 1
    seq_len: int = 128
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    #: Also the steps timed to turn ``seconds`` into a step count: the warmup rate does not
    #: depend on the total, so fixing the total only after warmup changes nothing before it.
    num_warmup_steps: int = 30
    aux_loss_weight: float = 0.5
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclass(frozen=True)
class TrainReport:
    """What a run produced, for the CLI and the README."""

    paths: TinyModelPaths
    num_params: int
    num_draft_params: int
    num_corpus_tokens: int
    num_steps: int
    num_tokens_seen: int
    threads: int
    seed: int
    prep_s: float
    train_s: float
    #: Mean training loss over the last steps: full model, then the layer-1 exit (the draft).
    final_loss: float
    final_exit_loss: float
    sample: str


def train_demo(
    out_dir: str | Path,
    *,
    seconds: float,
    threads: int,
    seed: int = 0,
    num_steps: int | None = None,
    recipe: DemoRecipe = DemoRecipe(),
    log: Callable[[str], None] = print,
) -> TrainReport:
    """Train for about ``seconds`` (or exactly ``num_steps``) and save bf16 ``target/`` and ``draft/``.

    ``threads`` caps torch's intra-op threads (one leaves a core free on a shared machine).
    """
    torch.set_num_threads(threads)
    started = time.perf_counter()
    texts = list(demo_corpus())
    tokenizer = train_tokenizer(texts, vocab_size=recipe.vocab_size)
    ids = _token_stream(tokenizer, texts)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(
        tokenizer, hidden_size=recipe.hidden_size, num_layers=recipe.num_layers,
        num_heads=recipe.num_heads, num_kv_heads=recipe.num_kv_heads,
        intermediate_size=recipe.intermediate_size,
    ))
    prep_s = time.perf_counter() - started
    log(f"corpus {len(texts)} texts, {len(ids)} tokens; {model.num_parameters() / 1e6:.2f} M params; "
        f"prep {prep_s:.1f} s")

    steps_done, losses, train_s = _train(model, ids, seconds, num_steps, seed, recipe, log)
    draft = truncated_copy(model, recipe.num_draft_layers)
    sample = _sample(model, tokenizer, seed)
    log(f"sample: {sample}")
    paths = _save(Path(out_dir), tokenizer, model, draft)
    tail = losses[-20:]
    report = TrainReport(
        paths=paths, num_params=model.num_parameters(), num_draft_params=draft.num_parameters(),
        num_corpus_tokens=len(ids), num_steps=steps_done,
        num_tokens_seen=steps_done * recipe.batch_size * recipe.seq_len, threads=threads,
        seed=seed, prep_s=prep_s, train_s=train_s,
        final_loss=sum(full for full, _ in tail) / len(tail),
        final_exit_loss=sum(exit_loss for _, exit_loss in tail) / len(tail), sample=sample,
    )
    budget = f"--steps {num_steps}" if num_steps is not None else f"--seconds {seconds:g}"
    (Path(out_dir) / "README.md").write_text(_readme(report, recipe, budget))
    return report


def lr_at(step: int, num_steps: int, recipe: DemoRecipe) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr`` at ``num_steps``."""
    if step < recipe.num_warmup_steps:
        return recipe.lr * (step + 1) / recipe.num_warmup_steps
    progress = min(1.0, (step - recipe.num_warmup_steps) / max(1, num_steps - recipe.num_warmup_steps))
    floor = recipe.min_lr_ratio
    return recipe.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _token_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All texts as one id stream, each followed by ``<|eos|>`` so the model learns to stop."""
    stream: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(texts):
        stream.extend(encoding.ids)
        stream.append(tokenizer.eos_token_id)
    return torch.tensor(stream, dtype=torch.long)


def _train(
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    seconds: float,
    num_steps: int | None,
    seed: int,
    recipe: DemoRecipe,
    log: Callable[[str], None],
) -> tuple[int, list[tuple[float, float]], float]:
    """The training loop; returns (steps run, per-step (loss, exit loss), seconds spent)."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=recipe.weight_decay)
    batches = torch.Generator().manual_seed(seed)
    losses: list[tuple[float, float]] = []
    total = num_steps if num_steps is not None else recipe.num_warmup_steps
    started = time.perf_counter()
    timed_from = started
    model.train()
    step = 0
    while step < total:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total, recipe)
        losses.append(_step(model, optimizer, _batch(ids, batches, recipe), recipe))
        step += 1
        if step == 1:
            timed_from = time.perf_counter()  # the first step pays one-off allocation costs
        if num_steps is None and step == recipe.num_warmup_steps:
            step_s = (time.perf_counter() - timed_from) / (step - 1)
            total = max(total, int(seconds / step_s))
            log(f"calibrated: {step_s:.3f} s/step -> {total} steps")
        if step % 50 == 0 or step == total:
            full, exit_ = (sum(v) / len(losses[-50:]) for v in zip(*losses[-50:]))
            elapsed = time.perf_counter() - started
            log(f"step {step}/{total}  loss {full:.3f}  exit-1 loss {exit_:.3f}  "
                f"{step * recipe.batch_size * recipe.seq_len / elapsed:,.0f} tok/s  {elapsed:.0f} s")
    model.eval()
    return step, losses, time.perf_counter() - started


def _batch(ids: torch.Tensor, generator: torch.Generator, recipe: DemoRecipe) -> torch.Tensor:
    """``batch_size`` random windows of ``seq_len + 1`` tokens (inputs plus shifted targets)."""
    starts = torch.randint(0, len(ids) - recipe.seq_len - 1, (recipe.batch_size,), generator=generator)
    return torch.stack([ids[s : s + recipe.seq_len + 1] for s in starts.tolist()])


def _step(
    model: LlamaForCausalLM,
    optimizer: torch.optim.Optimizer,
    window: torch.Tensor,
    recipe: DemoRecipe,
) -> tuple[float, float]:
    x, y = window[:, :-1], window[:, 1:].flatten()
    out = model(input_ids=x, output_hidden_states=True)
    loss = F.cross_entropy(out.logits.flatten(0, 1), y)
    # hidden_states[k] is the output of layer k (index 0 is the embeddings), so this is exactly
    # what the truncated draft computes.
    exit_hidden = out.hidden_states[recipe.num_draft_layers]
    exit_logits = model.lm_head(model.model.norm(exit_hidden))
    exit_loss = F.cross_entropy(exit_logits.flatten(0, 1), y)
    optimizer.zero_grad(set_to_none=True)
    (loss + recipe.aux_loss_weight * exit_loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
    optimizer.step()
    return loss.item(), exit_loss.item()


def _generation_config(tokenizer: PreTrainedTokenizerFast, max_new_tokens: int = 128) -> GenerationConfig:
    """Sampling defaults: greedy output from a model this small soon loops."""
    return GenerationConfig(
        do_sample=True, temperature=0.7, top_k=40, max_new_tokens=max_new_tokens,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _sample(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, seed: int) -> str:
    """A seeded sample with the bf16-rounded weights, i.e. what a loaded copy produces."""
    # A full-depth "truncated" copy is a clone; rounding it leaves the fp32 model untouched.
    rounded = truncated_copy(model, model.config.num_hidden_layers).to(torch.bfloat16).float()
    torch.manual_seed(seed)
    prompt = tokenizer(SAMPLE_PROMPT, return_tensors="pt")
    out = rounded.generate(**prompt, generation_config=_generation_config(tokenizer, max_new_tokens=60))
    return tokenizer.decode(out[0], skip_special_tokens=True)


def _save(
    out_dir: Path,
    tokenizer: PreTrainedTokenizerFast,
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
) -> TinyModelPaths:
    """Save both in bf16 (half the size; loading with ``dtype=torch.float32`` is exact)."""
    for model in (target, draft):
        model.generation_config = _generation_config(tokenizer)
        model.to(torch.bfloat16)
    return save_pair(out_dir, tokenizer, target, draft)


def _readme(report: TrainReport, recipe: DemoRecipe, budget: str) -> str:
    """The model card: what the model is (and is not), how it was made, and a sample."""
    r = recipe
    quoted_sample = report.sample.strip().replace("\n", "\n> ")
    command = f"lanes model train-demo {budget} --threads {report.threads} --seed {report.seed}"
    repeat = ("" if budget.startswith("--steps") else " The step count came from timing the warmup "
              f"steps; to repeat this run exactly, use `--steps {report.num_steps}` (same thread count).")
    return f"""# The demo model

A **{report.num_params / 1e6:.2f} M-parameter** Llama (hidden {r.hidden_size}, {r.num_layers} layers,
{r.num_heads} heads, {r.num_kv_heads} KV heads, FFN {r.intermediate_size}, tied embeddings,
{r.vocab_size}-token byte-level BPE) trained from scratch on CPython's own
documentation: the `pydoc_data.topics` help texts and the standard library's docstrings
({report.num_corpus_tokens:,} tokens, PSF licence). It exists so that demos and streaming tests
have a model that loads offline in about a second and prints English-looking text.

**It writes doc-flavoured English, not meaningful answers.** Its sentences look grammatical and
mention Python terms, but they do not say anything true or relevant, and it was never trained on
chat turns: the ChatML-like chat template works, but replies are doc prose or code-like fragments.
Use it to exercise the serving path, never to judge output quality.

- `target/`: the full model (bf16 safetensors, tokenizer, chat template, generation config with
  sampling defaults: temperature 0.7, top_k 40).
- `draft/`: the target truncated to its first {r.num_draft_layers} layer(s)
  ({report.num_draft_params / 1e6:.2f} M params). That exit was trained too (auxiliary
  {r.aux_loss_weight} x cross-entropy), so it is a real draft model for speculative decoding.

Load it with `AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)` on CPU: the
weights are stored in bf16 to halve the size, and float32 reproduces them exactly. In lanes an
empty `LANES_MODEL` (and `LANES_DRAFT_MODEL`) selects it.

## How it was made

```
{command}
```

{report.num_steps} steps of {r.batch_size} x {r.seq_len} tokens ({report.num_tokens_seen / 1e6:.1f} M tokens seen,
{report.num_tokens_seen / report.num_corpus_tokens:.1f} epochs) on {report.threads} CPU thread(s) in
{report.train_s:.0f} s, after {report.prep_s:.0f} s of corpus and tokenizer preparation. AdamW,
lr {r.lr:g} with {r.num_warmup_steps} warmup steps and cosine decay. Final training loss
{report.final_loss:.2f} (full model) and {report.final_exit_loss:.2f} (the draft's exit).{repeat}

## Sample

Prompt `{SAMPLE_PROMPT}`, temperature 0.7, top_k 40, 60 new tokens:

> {quoted_sample}
"""
