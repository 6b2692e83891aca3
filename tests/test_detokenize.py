"""The worker-side text pipeline (``workers/detokenize.py``): incremental detokenizing and stop
strings, across a hand-back (an answer continued by a second attempt after the tokens the first
one streamed). Pure: a real byte-level tokenizer, no engine."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st
from lanes.workers.detokenize import IncrementalDetokenizer, StopMatcher


@given(text=st.text("abx", max_size=40), stops=st.lists(st.text("abx", min_size=1, max_size=4), min_size=1,
                                                         max_size=3), cuts=st.lists(st.integers(0, 40), max_size=8))
def test_what_a_matcher_holds_is_what_resume_recomputes(text: str, stops: list[str], cuts: list[int]) -> None:
    """Pushed delta by delta, a matcher that has not stopped holds the longest end of the text
    that begins a stop string, which is what ``resume`` recomputes from the whole text."""
    matcher, sent, start = StopMatcher(stops), "", 0
    for cut in sorted({min(c, len(text)) for c in cuts} | {len(text)}):
        sent += matcher.push(text[start:cut])
        start = cut
    if matcher.stopped:
        return
    fresh = StopMatcher(stops)
    fresh.resume(text)
    assert fresh._held == matcher._held and sent + matcher._held == text


def attempt(tokenizer, ids: list[int], stop: list[str], resume: list[int]) -> tuple[str, bool]:
    """What one attempt sends for ``ids`` after ``resume`` (as the hf engine runs it), and
    whether it stopped."""
    detok, stops = IncrementalDetokenizer(tokenizer, resume), StopMatcher(stop)
    if resume and stop:
        stops.resume(detok.emitted_text())
    sent = ""
    for token in ids:
        sent += stops.push(detok.push([token]))
        if stops.stopped:
            return sent, True
    return sent + stops.push(detok.flush()) + stops.flush(), stops.stopped


def test_a_hand_back_neither_loses_held_text_nor_misses_a_stop_across_the_seam(tiny_model) -> None:
    """Before, the second attempt started an empty matcher: what the first held back as a
    possible stop string (its tokens streamed, their text not) was lost at the seam, and a stop
    string spanning the two attempts was not cut."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model.target)
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    checked = 0
    for _ in range(60):
        ids = [rng.randrange(3, vocab) for _ in range(40)]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if len(text) < 12:
            continue
        at = rng.randrange(4, len(text) - 4)
        # A stop string that never occurs but begins with the text around a seam, and one that occurs.
        for stop in ([text[at:at + 2] + "\u2603\u2603"], [text[at:at + 3]]):
            whole, whole_stopped = attempt(tokenizer, ids, stop, [])
            for seam in range(1, len(ids)):
                first, stopped = attempt(tokenizer, ids[:seam], stop, [])
                if stopped:
                    continue
                # The first attempt's text without the flush at the end: the seam is mid-answer.
                detok, stops = IncrementalDetokenizer(tokenizer), StopMatcher(stop)
                first = "".join(stops.push(detok.push([t])) for t in ids[:seam])
                rest, rest_stopped = attempt(tokenizer, ids[seam:], stop, ids[:seam])
                assert first + rest == whole, (stop, seam)
                assert rest_stopped == whole_stopped
                checked += 1
    assert checked > 500


def test_tokens_pushed_together_before_a_partial_character_are_not_held() -> None:
    """A speculative step pushes several tokens at once. When the last one starts a character,
    the text before it is sent now: before, the whole step was held, and a resumed attempt
    (which steps back over the partial character only) took it as sent and lost it."""
    pieces = {1: b"N", 2: b"9", 3: b"9", 4: b"\xc3", 5: b"\xa9", 6: b"!"}

    class Decoder:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    detok = IncrementalDetokenizer(Decoder())
    assert detok.push([1, 2, 3, 4]) == "N99", "the 9s are sent; the half of é waits"
    resumed = IncrementalDetokenizer(Decoder(), [1, 2, 3, 4])  # a hand-back here
    assert resumed.emitted_text() == "N99"
    assert resumed.push([5, 6]) == "é!" and detok.push([5, 6]) == "é!"
