"""Incremental detokenization: turn a growing list of token ids into exact text deltas.

Decoding each new token alone is wrong for byte-level BPE (a character can span tokens,
and some tokenizers change leading spaces in context), so we decode a short window and
emit the suffix that is new, holding back a trailing partial character (U+FFFD).
"""

from __future__ import annotations

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
        """Add tokens; return the text they complete ("" while a character is partial)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end: whatever is still held back, replacement characters included."""
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix)
        self._prefix = self._read = len(self.ids)
        return full_text[len(prefix_text) :]
