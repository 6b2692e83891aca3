"""Incremental detokenization: turn a growing list of token ids into exact text deltas.

Decoding each new token alone is wrong for byte-level BPE (a character can span tokens,
and some tokenizers change leading spaces in context), so we decode a short window and
emit the suffix that is new, holding back a trailing partial character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

_WINDOW_TOKENS = 6


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Feeds token ids, returns text deltas whose concatenation is the decoded answer.

    ``already_emitted`` are tokens whose text an earlier attempt already sent (resume):
    their text is not repeated.
    """

    def __init__(self, decoder: Decoder, already_emitted: list[int] | tuple[int, ...] = ()) -> None:
        self._decoder = decoder
        self.ids: list[int] = list(already_emitted)
        self._read = len(self.ids)
        # If the earlier attempt held back a partial character, step back to before it.
        while self._read > 0 and self._decode(max(0, self._read - _WINDOW_TOKENS), self._read).endswith("\ufffd"):
            self._read -= 1
        self._prefix = max(0, self._read - _WINDOW_TOKENS)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._decoder.decode(self.ids[start:end], skip_special_tokens=True)

    def push(self, new_ids: list[int] | tuple[int, ...]) -> str:
        """Add tokens; return the text they complete: all of it up to a trailing partial
        character, whose tokens wait for the rest of it.

        Several tokens can come at once (a speculative step, a busy engine). If the last of
        them starts a character, the ones before it are still emitted: holding them all would
        hold text a resumed attempt takes as sent (it steps back over the partial character's
        tokens only), and lose it at a hand-back."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self._prefix, self._read)
        end = len(self.ids)
        full_text = self._decode(self._prefix, end)
        while end > self._read and full_text.endswith("\ufffd"):
            end -= 1
            full_text = self._decode(self._prefix, end)
        if end <= self._read or len(full_text) <= len(prefix_text):
            return ""
        self._prefix, self._read = self._read, end
        return full_text[len(prefix_text) :]

    def emitted_text(self) -> str:
        """The text of the tokens already emitted (``already_emitted`` up to any partial
        character it steps back over): what a resumed attempt's client has, held-back stop
        prefixes aside (``StopMatcher.resume``)."""
        return self._decode(0, self._read)

    def flush(self) -> str:
        """At the end: whatever is still held back, replacement characters included."""
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix)
        self._prefix = self._read = len(self.ids)
        return full_text[len(prefix_text) :]


def answer_text(decoder: Decoder, prompt_ids: list[int] | tuple[int, ...],
                answer_ids: list[int] | tuple[int, ...], context: int = _WINDOW_TOKENS) -> str:
    """The text of ``answer_ids`` as an engine that decodes them after the prompt streams it
    (vLLM primes its detokenizer with the prompt's end, so a first token's leading space is
    kept), less a trailing partial character, which such an engine holds back."""
    ctx = list(prompt_ids[-context:])
    base = decoder.decode(ctx, skip_special_tokens=True)
    full = decoder.decode(ctx + list(answer_ids), skip_special_tokens=True)
    text = full[len(base):] if full.startswith(base) else decoder.decode(list(answer_ids), skip_special_tokens=True)
    return text.rstrip("\ufffd")


class StopMatcher:
    """Cuts a stream of text deltas at the first stop string. The transformers continuous-batching
    manager knows no stop strings; vLLM's hold back text whose tokens it has streamed, which a
    hand-back would lose (``vllm_sampling_kwargs``). Text that could be the start of a stop string
    is held back until the next delta settles it, so no part of a stop string is ever sent."""

    def __init__(self, stop: tuple[str, ...] | list[str]) -> None:
        self._stop = tuple(s for s in stop if s)
        self._held = ""
        self.stopped = False

    @classmethod
    def resumed(cls, stop: tuple[str, ...] | list[str], resume_ids: tuple[int, ...] | list[int],
                sent_text: Callable[[], str]) -> StopMatcher:
        """The matcher of an attempt that continues after ``resume_ids`` (tokens an earlier attempt
        streamed): it holds what that attempt held (``resume``). ``sent_text`` gives their text,
        decoded only when there are both stop strings and tokens to continue after."""
        matcher = cls(stop)
        if resume_ids and matcher._stop:
            matcher.resume(sent_text())
        return matcher

    def resume(self, decoded: str) -> None:
        """Continue after an earlier attempt whose answer so far decodes to ``decoded``: hold
        back what it held (the longest end of ``decoded`` that begins a stop string: its tokens
        were streamed, their text was not), so the next delta sends it or cuts a stop string
        that spans the two attempts. Pushing delta by delta always leaves that same end held."""
        self._held = ""
        if self._stop and decoded:
            keep = max((k for s in self._stop for k in range(1, len(s)) if decoded.endswith(s[:k])), default=0)
            self._held = decoded[len(decoded) - keep:] if keep else ""

    def push(self, text: str) -> str:
        """Add a delta; return the text that is now safe to send (sets ``stopped`` at a stop)."""
        if self.stopped or not self._stop:
            return "" if self.stopped else text
        text = self._held + text
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, self._held = True, ""
            return text[:cut]
        keep = max((k for s in self._stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end, held-back text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


def end_without_tokens(detok: IncrementalDetokenizer, stops: StopMatcher) -> tuple[str, bool]:
    """The last text of an answer that ends with no new token (its earlier attempts spent the
    budget): what they held back (a partial character, a possible stop string's start), cut at
    a stop string in it; and whether one was there."""
    text = stops.push(detok.flush())
    return (text, True) if stops.stopped else (text + stops.flush(), False)
