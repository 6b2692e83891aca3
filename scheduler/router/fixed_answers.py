"""Fixed answers: an operator-edited table of questions answered without a model (pure matching).

Table format (TOML; ``deploy/fixed_answers.toml`` is the sample)::

    [settings]
    max_edits = 1                # typos tolerated after normalisation (0: exact only)
    min_chars_for_edits = 8      # shorter questions must match exactly ("hi" is not "ho")
    first_turn_only = true       # only a conversation's first user message can match
    allow_system = false         # a system prompt (a persona, say) disables matching

    [[answers]]
    name = "greeting"            # metrics label; defaults to the first question
    questions = ["hi", "hello", "good morning"]
    answer = "Hello! How can I help you today?"

Matching compares ``normalise(last user message)`` with each normalised question: exact first,
then within ``max_edits`` single-character edits when exactly one question is that close. The
edge streams the answer with ``answer_deltas`` like a model's answer.
"""

from __future__ import annotations

import re
import tomllib
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


#: The top-level keys of a table, as the format above writes them.
TOP_LEVEL = {"settings": "[settings]", "answers": "[[answers]]"}


class FixedAnswersError(ValueError):
    """A table that cannot be used; the message names the entry and field."""


class Message(Protocol):
    role: str
    content: str


@dataclass(frozen=True)
class FixedAnswer:
    name: str
    answer: str


def normalise(text: str) -> str:
    """NFKC, case-folded, punctuation and symbols dropped, whitespace collapsed.

    "  Who ARE you?! " -> "who are you"; "Ｈｅｌｌｏ" -> "hello"; "what's up" -> "whats up".
    """
    folded = unicodedata.normalize("NFKC", text).casefold()
    kept = "".join(ch for ch in folded if unicodedata.category(ch)[0] not in "PSC" or ch.isspace())
    return " ".join(kept.split())


def within_edits(a: str, b: str, max_edits: int) -> bool:
    """Levenshtein distance(a, b) <= max_edits, in O(len * max_edits) (banded)."""
    if abs(len(a) - len(b)) > max_edits:
        return False
    if max_edits == 0:
        return a == b
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i] + [max_edits + 1] * len(b)
        for j in range(max(1, i - max_edits), min(len(b), i + max_edits) + 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != b[j - 1]))
        if min(current) > max_edits:
            return False
        previous = current
    return previous[-1] <= max_edits


_DELTA_RE = re.compile(r"\s*(?:[^\W\d_]{1,10}|\d{1,3}|[^\w\s]|_)|\s+")


def answer_deltas(answer: str) -> list[str]:
    """Split an answer into token-like pieces (a word with its leading space, a punctuation mark,
    up to three digits). ``"".join(answer_deltas(a)) == a`` for every string."""
    return _DELTA_RE.findall(answer)


def request_deltas(answer: str, max_tokens: int, stop: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    """A fixed answer as one request asked for it: cut before the first ``stop`` string, then
    at ``max_tokens`` pieces. Returns the pieces and whether ``max_tokens`` cut them (the
    finish is then ``length``, else ``stop``), as an engine would end the same text."""
    cut = min((i for i in (answer.find(s) for s in stop if s) if i >= 0), default=-1)
    pieces = answer_deltas(answer if cut < 0 else answer[:cut])
    return (pieces[:max_tokens], True) if len(pieces) > max_tokens else (pieces, False)


@dataclass(frozen=True)
class FixedAnswers:
    """The parsed table: normalised question -> answer. Immutable; matching is pure."""

    by_question: dict[str, FixedAnswer]
    max_edits: int = 1
    min_chars_for_edits: int = 8
    first_turn_only: bool = True
    allow_system: bool = False

    @classmethod
    def load(cls, path: Path | str) -> FixedAnswers:
        """Read and validate a table. Raises ``FixedAnswersError`` (also for TOML syntax and a
        file that cannot be read)."""
        try:
            raw = tomllib.loads(Path(path).read_text())
            return cls.parse(raw)
        except OSError as err:
            raise FixedAnswersError(f"{path}: {err.strerror or err}") from None
        except UnicodeDecodeError:
            raise FixedAnswersError(f"{path}: not UTF-8 text (saved as UTF-16 or another encoding?): save it as UTF-8") from None
        except (tomllib.TOMLDecodeError, FixedAnswersError) as err:
            raise FixedAnswersError(f"{path}: {err}") from None

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> FixedAnswers:
        """Validate a parsed TOML document (pure)."""
        # Unknown top-level keys were ignored, so an ``[[answer]]`` typo or the routing rules'
        # file given here by mistake loaded as a table of no answers, without a word.
        unknown = set(raw) - set(TOP_LEVEL)
        if unknown:
            raise FixedAnswersError(f"unknown top-level fields {sorted(unknown)}: a fixed-answers table has only "
                                    f"{' and '.join(TOP_LEVEL.values())}")
        settings = _settings(raw.get("settings", {}))
        entries = raw.get("answers", [])
        if not isinstance(entries, list):
            raise FixedAnswersError("answers: an array of tables ([[answers]]) is required")
        if not entries:
            raise FixedAnswersError('no answers: add at least one [[answers]] table (questions = ["hi"], '
                                    'answer = "Hello!")')
        by_question: dict[str, FixedAnswer] = {}
        for index, entry in enumerate(entries):
            for question, fixed in _entry(entry, index):
                other = by_question.get(question)
                if other is not None and other.answer != fixed.answer:
                    raise FixedAnswersError(
                        f"answers[{index}]: question {question!r} already answered by {other.name!r}")
                by_question[question] = fixed
        return cls(by_question, **settings)

    def lookup(self, messages: Sequence[Message]) -> FixedAnswer | None:
        """The entry answering this conversation, or None (then a model answers)."""
        if not messages or messages[-1].role != "user":
            return None
        if not self.allow_system and any(m.role == "system" for m in messages):
            return None
        if self.first_turn_only and sum(m.role == "user" for m in messages) > 1:
            return None
        question = normalise(messages[-1].content)
        if not question:
            return None
        exact = self.by_question.get(question)
        if exact is not None or self.max_edits == 0 or len(question) < self.min_chars_for_edits:
            return exact
        near = {fixed for known, fixed in self.by_question.items()
                if len(known) >= self.min_chars_for_edits and within_edits(question, known, self.max_edits)}
        # Two different answers this close: a typo could mean either, so let the model answer.
        return near.pop() if len(near) == 1 else None

    def match(self, messages: Sequence[Message]) -> str | None:
        """The fixed answer text for this conversation, or None."""
        found = self.lookup(messages)
        return found.answer if found is not None else None


def _settings(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise FixedAnswersError("settings: a table is required")
    types = {"max_edits": int, "min_chars_for_edits": int, "first_turn_only": bool, "allow_system": bool}
    unknown = set(raw) - set(types)
    if unknown:
        raise FixedAnswersError(f"settings: unknown fields {sorted(unknown)}")
    for key, value in raw.items():
        # type(), not isinstance(): TOML's true must not pass as the integer 1.
        if type(value) is not types[key]:
            raise FixedAnswersError(f"settings.{key}: {types[key].__name__} required, got {value!r}")
        if types[key] is int and value < 0:
            raise FixedAnswersError(f"settings.{key}: must be >= 0, got {value!r}")
    return dict(raw)


def _entry(raw: Any, index: int) -> list[tuple[str, FixedAnswer]]:
    where = f"answers[{index}]"
    if not isinstance(raw, dict):
        raise FixedAnswersError(f"{where}: a table is required")
    unknown = set(raw) - {"name", "questions", "answer"}
    if unknown:
        raise FixedAnswersError(f"{where}: unknown fields {sorted(unknown)}")
    questions, answer = raw.get("questions"), raw.get("answer")
    if not isinstance(questions, list) or not questions or not all(isinstance(q, str) for q in questions):
        raise FixedAnswersError(f"{where}.questions: a non-empty list of strings is required")
    if not isinstance(answer, str) or not answer.strip():
        raise FixedAnswersError(f"{where}.answer: a non-empty string is required")
    normalised = [normalise(q) for q in questions]
    if not all(normalised):
        raise FixedAnswersError(f"{where}.questions: {questions[normalised.index('')]!r} is empty once normalised")
    name = raw.get("name", normalised[0])
    if not isinstance(name, str) or not name:
        raise FixedAnswersError(f"{where}.name: a non-empty string is required")
    fixed = FixedAnswer(name, answer)
    return [(q, fixed) for q in normalised]
