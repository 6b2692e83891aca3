"""Public sources of (prompt, answer) pairs and the builder of the predictor's data set.

Reads local copies of public files laid out as ``RAW/<owner>/<repo>/<path in repo>`` (the
commits are in ``SOURCES`` and docs/predictor-data.md), counts every answer in Llama-3 BPE tokens
(``quicktok-v1``, exact: it matches the Llama-3 counts in shared/data/prompts on all 1,610
answers) and merges the answers of one prompt by several models into one ``Example``.

A prompt found in more than one source is kept only in the first (``SOURCES`` order), so
leave-one-source-out never tests on a prompt it trained on. Only the first turn of a multi-turn
item is used (``prompt_text`` reads the last user message; a second turn without its context
would be another task). Empty answers (failed generations) are dropped.

Builder-only: needs ``quicktok-v1`` (the ``dev`` extra), never imported by inference.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from lanes.scheduler.predictor.data import Example

#: AlpacaEval entries that are not one model's plain answer: a constant baseline, an adversarial
#: "gamed" entry, and runs with a hidden "be concise / verbose" system prompt.
_NOT_PLAIN_ANSWERS = re.compile(r"^(NullModel|gpt4_gamed)$|_(concise|verbose)$")
#: Examples kept from the one-model alpaca_cleaned source (a seeded sample): it has 51,923
#: prompts, which would make training 4x slower for no gain in leave-one-source-out tau.
MAX_ALPACA_CLEANED = 15_000

#: (source name, answering model, prompt, answer) as read from one public file.
Pair = tuple[str, str, str, str]


@dataclass(frozen=True)
class Source:
    """One public repository snapshot and how to read its pairs."""

    repo: str
    commit: str
    license: str
    read: Callable[[Path], Iterator[Pair]]


def _instruction(record: dict[str, str]) -> str:
    text, extra = record["instruction"].strip(), (record.get("input") or "").strip()
    return f"{text}\n\n{extra}" if extra else text


def _alpaca_eval(root: Path) -> Iterator[Pair]:
    # results/<model>/model_outputs.json: the same 805 prompts, one answer per model; the
    # record's ``dataset`` (helpful_base, koala, oasst, selfinstruct, vicuna) is the source. A few
    # files lack ``dataset``: their records take it from another file's record of the same prompt.
    files = [(path.parent.name, json.loads(path.read_text())) for path in sorted(root.glob("results/*/model_outputs.json"))]
    dataset = {_key(r["instruction"]): r["dataset"] for _, records in files for r in records if r.get("dataset")}
    for model, records in files:
        if _NOT_PLAIN_ANSWERS.search(model):
            continue
        for record in records:
            name = dataset.get(_key(record["instruction"]))
            if name is not None:
                yield f"alpaca_eval/{name}", model, record["instruction"], record.get("output") or ""


def _mt_bench(root: Path) -> Iterator[Pair]:
    base = root / "fastchat/llm_judge/data/mt_bench"
    questions = {}
    for line in (base / "question.jsonl").read_text().splitlines():
        item = json.loads(line)
        questions[item["question_id"]] = item["turns"][0]
    for path in sorted((base / "model_answer").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            item = json.loads(line)
            yield "mt_bench", path.stem, questions[item["question_id"]], item["choices"][0]["turns"][0]


def _json_list(pattern: str, source: str, model: str, answer_key: str) -> Callable[[Path], Iterator[Pair]]:
    def read(root: Path) -> Iterator[Pair]:
        for path in sorted(root.glob(pattern), key=lambda p: [int(n) for n in re.findall(r"\d+", p.name)] or [0]):
            for record in json.loads(path.read_text()):
                yield source, model, _instruction(record), record.get(answer_key) or ""

    return read


def _jsonl(path: str, source: str, model: str) -> Callable[[Path], Iterator[Pair]]:
    def read(root: Path) -> Iterator[Pair]:
        for line in (root / path).read_text().splitlines():
            record = json.loads(line)
            yield source, model, record["prompt"], record.get("response") or ""

    return read


#: In priority order (a duplicated prompt stays in the first source that has it).
SOURCES: tuple[Source, ...] = (
    Source("tatsu-lab/alpaca_eval", "cd543a149df89434d8a54582c0151c0b945c3d20", "Apache-2.0", _alpaca_eval),
    Source("enricai/FastChat", "edacaa5bd955893e72a7e6f0899d8301fd5ae492", "Apache-2.0 (lm-sys/FastChat fork)",
           _mt_bench),
    Source("teknium1/GPTeacher", "481075123c29854bddb82655badeef6a438f2436", "MIT",
           _json_list("Codegen/codegen-instruct.json", "gpteacher/codegen", "gpt-4", "response")),
    Source("teknium1/GPTeacher", "481075123c29854bddb82655badeef6a438f2436", "MIT",
           _json_list("Roleplay/roleplay-simple-deduped-roleplay-instruct.json", "gpteacher/roleplay", "gpt-4",
                      "response")),
    Source("sahil280114/codealpaca", "2f78ddc5c682ed6738ad092bbbfa59ba915afcb0", "Apache-2.0 code; data CC BY-NC 4.0",
           _json_list("data/code_alpaca_2k.json", "code_alpaca", "text-davinci-003", "output")),
    Source("stayanti/alpaca-gpt-4", "225be0464df531ad2e587b1594bff4bcf8890b19",
           "Apache-2.0 repo; Alpaca data CC BY-NC 4.0",
           _json_list("alpaca_data/file_*.json", "alpaca_cleaned", "text-davinci-003", "output")),
    # IFEval (google-research/google-research, instruction_following_eval/) with the paper's GPT-4
    # answers; that snapshot is too large to copy here, this verbatim copy has 540 of its 541 prompts.
    Source("Podtech-AI/IFEval", "76670a377db0f75ac8e808bbdaa8df5e6f185399",
           "Apache-2.0 (google-research/google-research)",
           _jsonl("data/input_response_data_gpt4_20231107_145030.jsonl", "ifeval", "gpt-4")),
)


def _key(prompt: str) -> str:
    return " ".join(prompt.lower().split())


def read_pairs(raw: Path) -> Iterator[Pair]:
    """Every (source, model, prompt, answer) of every ``SOURCES`` entry under ``raw``.

    Raises FileNotFoundError naming the repository when its copy is missing.
    """
    for source in SOURCES:
        root = raw / source.repo
        if not root.is_dir():
            raise FileNotFoundError(f"no copy of {source.repo} at {root} (see docs/predictor-data.md)")
        yield from source.read(root)


def build_examples(raw: Path, count_tokens: Callable[[list[str]], list[int]]) -> list[Example]:
    """Merge the pairs under ``raw`` into examples (first-source-wins dedup; empty answers dropped).

    ``count_tokens`` maps answers to token counts (a batch call: the builder's tokenizer).
    """
    owner: dict[str, str] = {}  # prompt key -> the source that keeps it
    merged: dict[tuple[str, str], dict[str, str]] = {}  # (source, key) -> model -> answer
    prompts: dict[tuple[str, str], str] = {}
    for source, model, prompt, answer in read_pairs(raw):
        key = _key(prompt)
        if not key or not answer.strip() or owner.setdefault(key, source) != source:
            continue
        prompts.setdefault((source, key), prompt.strip())
        merged.setdefault((source, key), {}).setdefault(model, answer)
    keys = list(merged)
    cleaned = [i for i, k in enumerate(keys) if k[0] == "alpaca_cleaned"]
    if len(cleaned) > MAX_ALPACA_CLEANED:
        dropped = set(np.random.default_rng(0).choice(cleaned, len(cleaned) - MAX_ALPACA_CLEANED, replace=False).tolist())
        keys = [k for i, k in enumerate(keys) if i not in dropped]
    answers = [answer for k in keys for answer in merged[k].values()]
    counts = iter(count_tokens(answers))
    return [Example(prompts[k], k[0], {model: next(counts) for model in merged[k]}) for k in keys]


#: Answering models whose lengths make up the held-out prompt pool (one pool row per prompt and
#: model): current open and closed chat models of several sizes and families.
POOL_MODELS = (
    "Meta-Llama-3-8B-Instruct", "Meta-Llama-3.1-70B-Instruct-Turbo", "Mistral-7B-Instruct-v0.2",
    "Mixtral-8x7B-Instruct-v0.1", "Qwen2-72B-Instruct", "gpt-4o-2024-05-13", "claude-3-5-sonnet-20240620",
    "llama-2-70b-chat-hf",
)


def prompt_pool(examples: list[Example], source: str) -> list[dict[str, object]]:
    """The simulator's pool: ``{"prompt", "output_tokens", "source", "model"}`` per prompt of
    ``source`` and ``POOL_MODELS`` model that answered it."""
    return [
        {"prompt": e.prompt, "output_tokens": e.lengths[model], "source": e.source, "model": model}
        for e in examples
        if e.source == source
        for model in POOL_MODELS
        if model in e.lengths
    ]


def quicktok_counter() -> Callable[[list[str]], list[int]]:
    """Exact Llama-3 BPE counts (raw text, no template). Raises ImportError without quicktok-v1."""
    import quicktok  # type: ignore[import-not-found]  # the dev extra: builder only

    encoding = quicktok.get_encoding("llama3")
    return lambda texts: [int(n) for n in quicktok.count_batch(encoding, texts)]
