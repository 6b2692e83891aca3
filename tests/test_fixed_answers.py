"""Fixed answers: normaliser, matcher, table validation and streaming deltas (pure)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lanes.queue.messages import ChatMessage
from lanes.scheduler.router.fixed_answers import (
    FixedAnswers,
    FixedAnswersError,
    answer_deltas,
    normalise,
    request_deltas,
    within_edits,
)

SAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "fixed_answers.toml"
TABLE = {
    "settings": {"max_edits": 1, "min_chars_for_edits": 8},
    "answers": [
        {"name": "greeting", "questions": ["hi", "hello"], "answer": "Hello!"},
        {"questions": ["who are you", "what are you"], "answer": "An assistant."},
        {"name": "bye", "questions": ["see you later"], "answer": "Bye."},
        {"name": "bye2", "questions": ["see you latex"], "answer": "Bye, LaTeX."},
    ],
}


def user(text: str) -> list[ChatMessage]:
    return [ChatMessage("user", text)]


@pytest.fixture
def table() -> FixedAnswers:
    return FixedAnswers.parse(TABLE)


@pytest.mark.parametrize(("raw", "expected"), [
    ("  Who ARE   you?! ", "who are you"),
    ("Ｈｅｌｌｏ", "hello"),                  # full-width, NFKC
    ("what's up", "whats up"),
    ("hi 👋\n\t", "hi"),                      # symbols dropped, whitespace collapsed
    ("Straße", "strasse"),                    # casefold, not lower
    ("…", ""),
])
def test_normalise(raw: str, expected: str) -> None:
    assert normalise(raw) == expected


def test_exact_match_after_normalisation(table: FixedAnswers) -> None:
    assert table.match(user("HELLO!!")) == "Hello!"
    assert table.match(user("Who are you?")) == "An assistant."
    found = table.lookup(user("who are you"))
    assert found is not None and found.name == "who are you"  # name defaults to the first question


def test_near_match_tolerates_one_typo_in_long_questions(table: FixedAnswers) -> None:
    assert table.match(user("who are yu")) == "An assistant."
    assert table.match(user("hellp")) is None          # shorter than min_chars_for_edits
    assert table.match(user("who are you two")) is None  # four edits
    # "see you latez" is one edit from two questions with different answers: ambiguous, no match.
    assert table.match(user("see you latez")) is None


def test_exact_only_table() -> None:
    strict = FixedAnswers.parse({**TABLE, "settings": {"max_edits": 0}})
    assert strict.match(user("who are yu")) is None
    assert strict.match(user("who are you")) == "An assistant."


def test_only_a_first_user_turn_without_system_prompt_matches(table: FixedAnswers) -> None:
    assert table.match([ChatMessage("system", "You are Bob the pirate."), ChatMessage("user", "who are you")]) is None
    later = [ChatMessage("user", "hi"), ChatMessage("assistant", "Hello!"), ChatMessage("user", "who are you")]
    assert table.match(later) is None
    assert table.match([ChatMessage("user", "hi"), ChatMessage("assistant", "Hello!")]) is None
    assert table.match([]) is None
    assert table.match(user("   ?! ")) is None


def test_settings_can_allow_system_prompts_and_later_turns() -> None:
    loose = FixedAnswers.parse({**TABLE, "settings": {"allow_system": True, "first_turn_only": False}})
    assert loose.match([ChatMessage("system", "Be nice."), ChatMessage("user", "hi")]) == "Hello!"
    later = [ChatMessage("user", "hi"), ChatMessage("assistant", "Hello!"), ChatMessage("user", "who are you")]
    assert loose.match(later) == "An assistant."


def test_sample_table_answers_each_of_its_questions() -> None:
    table = FixedAnswers.load(SAMPLE)
    raw = tomllib.loads(SAMPLE.read_text())
    for entry in raw["answers"]:
        for question in entry["questions"]:
            assert table.match(user(question.upper() + "?")) == entry["answer"], question
    # Ordinary prompts do not match.
    for prompt in ["Who are you going to vote for?", "hi, can you write me a poem about autumn",
                   "Explain the privacy policy of GDPR", "thanks to whom was the war won"]:
        assert table.match(user(prompt)) is None, prompt


@pytest.mark.parametrize(("table", "message"), [
    ({"answers": {"questions": ["hi"]}}, r"\[\[answers\]\]"),
    ({"answers": [{"questions": [], "answer": "x"}]}, r"answers\[0\].questions: a non-empty list"),
    ({"answers": [{"questions": ["hi"], "answer": " "}]}, r"answers\[0\].answer"),
    ({"answers": [{"questions": ["?!"], "answer": "x"}]}, "empty once normalised"),
    ({"answers": [{"questions": ["hi"], "answer": "x", "lang": "en"}]}, r"unknown fields \['lang'\]"),
    ({"answers": [{"questions": ["hi"], "answer": "x"}, {"questions": ["HI!"], "answer": "y"}]},
     r"answers\[1\]: question 'hi' already answered by 'hi'"),
    ({"settings": {"max_edits": True}}, "settings.max_edits: int required"),
    ({"settings": {"max_edits": -1}}, "settings.max_edits: must be >= 0"),
    ({"settings": {"fuzzy": 1}}, r"unknown fields \['fuzzy'\]"),
    # These loaded as a table of no answers, without a word.
    ({"answer": [{"questions": ["hi"], "answer": "x"}]},
     r"unknown top-level fields \['answer'\]: a fixed-answers table has only \[settings\] and \[\[answers\]\]"),
    ({"settings": {}, "answers": [TABLE["answers"][0]], "max_edits": 1}, r"unknown top-level fields \['max_edits'\]"),
    ({}, r"no answers: add at least one \[\[answers\]\] table"),
    ({"settings": {"max_edits": 0}, "answers": []}, "no answers"),
])
def test_bad_tables_name_the_entry(table: dict[str, object], message: str) -> None:
    with pytest.raises(FixedAnswersError, match=message):
        FixedAnswers.parse(table)


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "answers.toml"
    path.write_text("[[answers]\n")
    with pytest.raises(FixedAnswersError, match="answers.toml"):
        FixedAnswers.load(path)


def test_an_empty_file_or_the_routing_rules_are_refused_naming_the_file(tmp_path: Path) -> None:
    empty = tmp_path / "answers.toml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(FixedAnswersError, match=f"^{empty}: no answers"):
        FixedAnswers.load(empty)
    routing = SAMPLE.with_name("routing.toml")
    with pytest.raises(FixedAnswersError, match=rf"^{routing}: unknown top-level fields \['default_pool'"):
        FixedAnswers.load(routing)


def test_answer_deltas_are_token_like() -> None:
    assert answer_deltas("Hello! How can I help you today?") == [
        "Hello", "!", " How", " can", " I", " help", " you", " today", "?"]
    assert answer_deltas("Call 1234567.\n\nThanks") == ["Call", " 123", "456", "7", ".", "\n\nThanks"]
    assert answer_deltas("") == []


@given(st.text())
def test_answer_deltas_join_back_exactly(text: str) -> None:
    deltas = answer_deltas(text)
    assert "".join(deltas) == text
    assert all(deltas)
    assert all(len(d.lstrip()) <= 10 for d in deltas)


def _levenshtein(a: str, b: str) -> int:
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


@given(st.text("abc ", max_size=12), st.text("abc ", max_size=12), st.integers(0, 3))
def test_within_edits_agrees_with_levenshtein(a: str, b: str, k: int) -> None:
    assert within_edits(a, b, k) == (_levenshtein(a, b) <= k)


def test_request_deltas_cut_at_a_stop_then_at_max_tokens() -> None:
    answer = "Hello! How can I help you today?"
    assert request_deltas(answer, 64) == (answer_deltas(answer), False)
    assert request_deltas(answer, 3) == (["Hello", "!", " How"], True)
    assert request_deltas(answer, 64, ("help", "How")) == (["Hello", "!", " "], False)  # the first stop wins
    assert request_deltas(answer, 2, (" you",)) == (["Hello", "!"], True)  # max_tokens comes first
    assert request_deltas(answer, 64, ("Hello",)) == ([], False)
