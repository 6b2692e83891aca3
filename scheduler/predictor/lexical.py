"""Lexical length model: hashed word and character n-grams, TF-IDF, length cues, a linear model.

Pure and numpy-only: the shipped model (benchmarks/RESULTS.md, "Length predictor (issue 9)").

Model, for a prompt ``p``::

    x(p) = [ word block (L2 = 1) | char block (L2 = 1) ]    hashed into 2**num_buckets_log2 slots
    z(p) = cue_weight * (cues(p) - cue_mean) / cue_scale     config.num_cues dense features
    score(p) = w . x(p) + v . z(p) + intercept               = predicted log(1 + output tokens)

Each block holds sublinear term frequencies (1 + ln tf) times a per-slot IDF learnt at training
time; slots never seen in training get the largest IDF. ``cues`` are hand-written, source-agnostic
features (prompt size, question marks, instruction type, requested-length words such as "briefly"
or "in detail"; ``CUE_PATTERNS``), standardised with training-set statistics. They are what lifts
CV tau from 0.38 to 0.41 on AlpacaEval alone. Two more read an explicit length request ("a
300-word essay", "in at least 3 paragraphs"; ``requested_tokens``): whether there is one, and how
many tokens it asks for; they lift the tau on IFEval, a source the weights never saw, from 0.38 to
0.42. ``train`` fits ``w`` and ``v`` and refreshes them from observed lengths. A model with
``cue_weight == 0`` (weights written before cues existed) has no cue block, one with
``length_request_weight == 0`` no request cues, and each scores exactly as it did.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

_WORD_RE = re.compile(r"\w+|[^\w\s]")

#: (name, regex) of the 0/1 cue features, searched (case-insensitive, multi-line) in the lower-cased
#: prompt. Part of the feature definition: changing one needs a retrain and a FEATURE_VERSION bump.
CUE_PATTERNS: tuple[tuple[str, str], ...] = (
    ("short", r"\b(briefly|brief|short|shortly|concise|concisely|succinct|one sentence|a sentence|single sentence"
     r"|one word|single word|a word|one-word|yes or no|true or false|in a few words|tl;?dr|one line|a phrase)\b"),
    ("long", r"\b(in detail|detailed|details|comprehensive|thorough|elaborate|in depth|in-depth"
     r"|step[- ]by[- ]step|complete guide|long|extensive)\b"),
    ("longform", r"\b(essay|story|poem|blog|article|letter|email|e-mail|speech|script|song|lyrics|report|proposal"
     r"|guide|tutorial|plan|itinerary|recipe|cover letter|review|outline|dialogue|conversation)\b"),
    ("list", r"\b(list|steps|ways|tips|ideas|examples|reasons|suggestions|options|recommendations|things)\b"),
    ("count", r"\b(\d+|two|three|four|five|six|seven|eight|nine|ten|twenty)\s+(\w+\s)?(examples|ideas|sentences|words"
     r"|paragraphs|ways|tips|steps|things|questions|names|reasons|items|points|bullet|lines|facts|books|movies"
     r"|places|options|suggestions)\b"),
    ("write", r"^\W*(please\s+)?(write|compose|draft|create|generate|make|design|develop|produce|come up with)\b"),
    ("explain", r"^\W*(please\s+)?(explain|describe|discuss|tell me about|elaborate|compare|analy[sz]e|outline"
     r"|summari[sz]e)\b"),
    ("transform", r"\b(classify|categori[sz]e|identify|choose|select|pick|which of|determine whether|is it"
     r"|true or false|yes or no|detect|label|rate|extract|find the|correct the|fix the|rewrite|rephrase|paraphrase|translate"
     r"|convert|edit|proofread)\b"),
    ("closed_question", r"^\W*(what|who|when|where|which|how many|how much|is|are|does|do|can|was|were|did)\b"),
    ("how_why", r"^\W*(how|why)\b"),
    ("code", r"(```|\bdef |\bfunction\b|\bcode\b|\bpython\b|\bjavascript\b|\bsql\b|\bjava\b|\bc\+\+|\bprogram\b"
     r"|\bscript\b|[{};]\s*$)"),
    ("math", r"(\d+\s*[-+*/^=]\s*\d+|\bsolve\b|\bcalculate\b|\bequation\b|\bcompute\b)"),
    ("has_input", r"(\binput\b\s*:|\btext\b\s*:|\bsentence\b\s*:|:\s*\n)"),
    ("tiny_form", r"\b(joke|pun|riddle|haiku|slogan|tagline|title|name for|headline|tweet|caption)\b"),
    ("how_to", r"\b(how (do|can|to|should) i|how to|what are (some|the))\b"),
)
# Searched in lower-cased text, so without re.IGNORECASE (which made every search several times
# slower): the two lower-case letters IGNORECASE would also have taken for an ASCII one are
# folded first (``_fold``), so the matches are the same.
_CUE_RES = tuple(re.compile(pattern, re.MULTILINE) for _, pattern in CUE_PATTERNS)
#: Lower-case letters ``re.IGNORECASE`` matches to an ASCII letter ("ı" to "i", "ſ" to "s"; the
#: other two, "İ" and the Kelvin sign, lower-case to "i̇" and "k").
_IGNORECASE_FOLD = str.maketrans({"\u0131": "i", "\u017f": "s"})
_SENTENCE_END_RE = re.compile(r"[.!?](\s|$)")

#: The runs of word characters, as ``\b`` sees them: where ``\bword\b`` matches, "word" is one.
_RUN_RE = re.compile(r"\w+")


@dataclass(frozen=True)
class _CueScan:
    """How ``_cue_hits`` decides one part of a ``CUE_PATTERNS`` entry: the same answer as
    searching the pattern, mostly without searching it (the fifteen searches took ~0.6 ms of a
    2,560-character window; ``test_cue_scans_find_what_the_cue_patterns_find``).

    A hit when the window has one of ``words`` as a whole run of word characters (the pattern's
    alternatives ``\bword\b``: exactly those runs). Otherwise ``regex`` is searched, only when
    the window holds one of ``guards`` (substrings) or ``guard_words`` (whole runs): every match
    of the pattern that is not one of ``words`` holds one of them, so without them there is none.
    """

    words: frozenset[str] = frozenset()
    guards: tuple[str, ...] = ()
    guard_words: frozenset[str] = frozenset()
    regex: re.Pattern[str] | None = None

    def hit(self, text: str, runs: set[str]) -> bool:
        if not self.words.isdisjoint(runs):
            return True
        if self.regex is None or not (any(g in text for g in self.guards) or not self.guard_words.isdisjoint(runs)):
            return False
        return self.regex.search(text) is not None


def _scan(words: str = "", guards: tuple[str, ...] = (), guard_words: str = "", cue: str | None = None,
          regex: str | None = None) -> _CueScan:
    """A ``_CueScan`` whose regex is ``cue``'s whole pattern, or ``regex`` (a part of one)."""
    compiled = _CUE_RES[[name for name, _ in CUE_PATTERNS].index(cue)] if cue else None
    if regex is not None:
        compiled = re.compile(regex, re.MULTILINE)
    return _CueScan(frozenset(words.split()), guards, frozenset(guard_words.split()), compiled)


#: Per ``CUE_PATTERNS`` entry, the scans it is a hit of (any of them). ``cue=``: the scan searches
#: that cue's whole pattern; ``regex=``: a part of it, found where the rest is not:
#: - math: ``\d+\s*[-+*/^=]\s*\d+`` is found where ``\d\s*[-+*/^=]\s*\d`` is (a match of
#:   either holds one of the other: its last digit before the sign and first after);
#: - has_input: its alternatives in two (a pattern ``A|B`` is found where ``A`` or ``B`` is).
#: Guards: each many-word alternative itself (each spelling of ``tl;?dr``, ``step[- ]by[- ]step``;
#: "cover letter" holds the word "letter"), a sign, or a word that is a whole run in every match:
#: a count's noun (after whitespace, before ``\b``), a line-start pattern's first word (after
#: ``^\W*`` or ``please\s+``, before ``\b`` or a space), has_input's words (between ``\b``).
_CUE_SCANS: dict[str, tuple[_CueScan, ...]] = {
    "short": (_scan("briefly brief short shortly concise concisely succinct",
                    ("one sentence", "a sentence", "single sentence", "one word", "single word", "a word", "one-word",
                     "yes or no", "true or false", "in a few words", "tldr", "tl;dr", "one line", "a phrase"),
                    cue="short"),),
    "long": (_scan("detailed details comprehensive thorough elaborate long extensive",
                   ("in detail", "in depth", "in-depth", "step-by-step", "step by step", "step-by step", "step by-step",
                    "complete guide"), cue="long"),),
    "longform": (_scan("essay story poem blog article letter email speech script song lyrics report proposal guide "
                       "tutorial plan itinerary recipe review outline dialogue conversation", ("e-mail",),
                       cue="longform"),),
    "list": (_scan("list steps ways tips ideas examples reasons suggestions options recommendations things"),),
    "count": (_scan(guard_words="examples ideas sentences words paragraphs ways tips steps things questions names "
                                "reasons items points bullet lines facts books movies places options suggestions",
                    cue="count"),),
    "write": (_scan(guard_words="write compose draft create generate make design develop produce come", cue="write"),),
    "explain": (_scan(guard_words="explain describe discuss tell elaborate compare analyse analyze outline summarise "
                                  "summarize", cue="explain"),),
    "transform": (_scan("classify categorize categorise identify choose select pick detect label rate extract rewrite "
                        "rephrase paraphrase translate convert edit proofread",
                        ("which of", "determine whether", "is it", "true or false", "yes or no", "find the",
                         "correct the", "fix the"), cue="transform"),),
    "closed_question": (_scan(guard_words="what who when where which how is are does do can was were did",
                              cue="closed_question"),),
    "how_why": (_scan(guard_words="how why", cue="how_why"),),
    "code": (_scan("function code python javascript sql java program script", ("```", "def ", "c++", "{", "}", ";"),
                   cue="code"),),
    "math": (_scan("solve calculate equation compute", tuple("-+*/^="), regex=r"\d\s*[-+*/^=]\s*\d"),),
    "has_input": (_scan(guards=(":",), regex=r":\s*\n"),
                  _scan(guard_words="input text sentence", regex=r"\b(input|text|sentence)\b\s*:")),
    "tiny_form": (_scan("joke pun riddle haiku slogan tagline title headline tweet caption", ("name for",),
                        cue="tiny_form"),),
    "how_to": (_scan(guards=("how do i", "how can i", "how should i", "how to", "what are some", "what are the"),
                     cue="how_to"),),
}
assert list(_CUE_SCANS) == [name for name, _ in CUE_PATTERNS]
assert all(_RUN_RE.fullmatch(w) for scans in _CUE_SCANS.values() for s in scans for w in s.words | s.guard_words)


def _cue_hits(text: str) -> list[float]:
    """``[float(regex.search(text) is not None) for regex in _CUE_RES]``, from one scan of
    ``text``'s word runs and a few guarded searches."""
    runs = set(_RUN_RE.findall(text))
    return [float(any(scan.hit(text, runs) for scan in scans)) for scans in _CUE_SCANS.values()]

#: Dense cue features: 7 size / punctuation counts, then one 0/1 feature per ``CUE_PATTERNS`` entry.
NUM_CUES = 7 + len(CUE_PATTERNS)
#: Two more when the config has ``length_request_weight > 0``: whether the prompt asks for a length,
#: and log(1 + the tokens it asks for) (0 without a request; ``requested_tokens``).
NUM_LENGTH_REQUEST_CUES = 2

#: Rough Llama-3 tokens per unit of an explicit length request ("a 300-word essay", "in 5
#: sentences", "at least 3 paragraphs"). Priors, not fitted: the model learns one slope for all.
_REQUEST_UNITS = {
    "word": 1.35, "sentence": 22.0, "paragraph": 85.0, "line": 12.0, "bullet point": 18.0, "bullet": 18.0,
    "character": 0.3, "token": 1.0, "page": 600.0, "section": 120.0, "item": 15.0, "point": 18.0,
    "step": 25.0, "example": 25.0, "question": 20.0, "tip": 25.0, "idea": 20.0, "reason": 25.0,
    "stanza": 40.0, "verse": 40.0,
}
_NUMBER_WORDS = {
    "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
    "ten": 10, "eleven": 11, "twelve": 12, "fifteen": 15, "twenty": 20, "thirty": 30, "fifty": 50, "hundred": 100,
}
_AT_MOST = ("at most", "less than", "fewer than", "no more than", "not exceed", "under", "up to", "maximum of",
            "max", "maximum", "within")
_AT_LEAST = ("at least", "more than", "no less than", "no fewer than", "over", "minimum of", "min", "minimum")
_RELATIONS = tuple(sorted(_AT_MOST + _AT_LEAST + ("exactly", "about", "around", "approximately", "roughly"),
                          key=len, reverse=True))
_NUMBER = r"\b(\d[\d,]*|" + "|".join(_NUMBER_WORDS) + r")\+?\s*-?\s*(" + "|".join(
    sorted(_REQUEST_UNITS, key=len, reverse=True)) + r")s?\b"
#: The definition of a length request: an optional relation, then a number and a unit.
_REQUEST_RE = re.compile(r"(" + "|".join(_RELATIONS) + r")?\s*" + _NUMBER)
#: What ``requested_tokens`` scans for: ``_REQUEST_RE`` without its leading relation, which made
#: the scan try ~25 relations at every character (0.35 ms of a 2,560-character window, now ~0.1).
_NUMBER_RE = re.compile(_NUMBER)


def requested_tokens(text: str) -> float | None:
    """Tokens an explicit length request in lower-cased ``text`` asks for (largest if several),
    else None.

    "a 300-word essay" -> 405, "at least 3 paragraphs" -> 331 (x1.3 for a lower bound), "less than
    50 words" -> 47 (x0.7 for an upper bound). A rough prior the linear model rescales.

    The matches of ``_REQUEST_RE.finditer(text)``, found from its number-and-unit part: each match
    of that part is one of the whole's (no relation holds a word that starts a number, so the
    leftmost whole match's number is the leftmost number match; both end at the unit), and its
    relation is the longest one that ends right before the number, past whitespace (``\\s`` is
    ``str.isspace``), and starts after the previous match (the leftmost start wins;
    ``test_requested_tokens_reads_the_same_requests_as_the_whole_pattern``).
    """
    best: float | None = None
    end = 0
    for match in _NUMBER_RE.finditer(text):
        before = text[end:match.start()]
        stop = len(before.rstrip())
        relation = next((r for r in _RELATIONS if before.endswith(r, 0, stop)), "")
        end = match.end()
        number, unit = match.group(1), match.group(2)
        count = _NUMBER_WORDS.get(number) or int(number.replace(",", "") or 0)
        if not 0 < count <= 100_000:
            continue
        tokens = count * _REQUEST_UNITS[unit] * (0.7 if relation in _AT_MOST else 1.3 if relation in _AT_LEAST else 1.0)
        best = tokens if best is None else max(best, tokens)
    return best


#: Regexes read at most this many leading and trailing characters (bounds latency on long prompts).
_CUE_HEAD_CHARS, _CUE_TAIL_CHARS = 2048, 512


@dataclass(frozen=True)
class FeatureConfig:
    """How a prompt becomes a sparse vector. Stored with the weights; changing it needs a retrain."""

    #: Hash space size is ``2**num_buckets_log2`` slots (one weight and one IDF per slot).
    num_buckets_log2: int = 18
    #: Word n-grams of length 1..word_ngram_max, with a ``<s>`` start marker.
    word_ngram_max: int = 2
    #: Character n-grams inside `` word `` boundaries, lengths char_ngram_min..char_ngram_max.
    char_ngram_min: int = 3
    char_ngram_max: int = 6
    #: Character n-grams come from at most this many leading and trailing characters, which bounds
    #: latency on pasted documents; the instruction is almost always at one end.
    max_head_chars: int = 256
    max_tail_chars: int = 128
    #: Word n-grams come from at most this many leading and trailing words.
    max_head_words: int = 256
    max_tail_words: int = 128
    #: Scale of the standardised cue block relative to the unit-norm n-gram blocks (0: no cues).
    #: 0.2: picked with the ridge strength (``train.LEXICAL_ALPHA`` 4) by leave-one-source-out tau
    #: among 0.05 / 0.1 / 0.2 / 0.3 (a stronger ridge shrinks the cue block too).
    cue_weight: float = 0.2
    #: Scale of the two explicit-length-request cues (``requested_tokens``; 0: none), like
    #: ``cue_weight`` for the others. Weights written before they existed load with 0 and score
    #: exactly as they did.
    length_request_weight: float = 0.2

    def __post_init__(self) -> None:
        # The slot hashing is 32-bit CRC (``num_buckets_log2`` <= 32) and a character gram has
        # at least one character.
        if not 1 <= self.num_buckets_log2 <= 32:
            raise ValueError(f"num_buckets_log2 must be 1..32, not {self.num_buckets_log2}")
        if self.char_ngram_min < 1:
            raise ValueError(f"char_ngram_min must be at least 1, not {self.char_ngram_min}")

    @property
    def num_cues(self) -> int:
        """Entries of the cue block (0 when ``cue_weight`` is 0)."""
        if self.cue_weight <= 0.0:
            return 0
        return NUM_CUES + (NUM_LENGTH_REQUEST_CUES if self.length_request_weight > 0.0 else 0)

    @property
    def num_buckets(self) -> int:
        """Size of the hash space (slots)."""
        return 1 << self.num_buckets_log2


def _clip(items: Sequence[str] | str, head: int, tail: int) -> Sequence[str] | str:
    if len(items) <= head + tail:
        return items
    return items[:head] + items[len(items) - tail :]


#: A gram's slot is ``crc32(prefix + gram) & mask``, computed as ``crc32(gram, crc32(prefix))``
#: (zlib continues a running CRC), so no prefixed string is built per gram.
_WORD_SEED = zlib.crc32(b"w:")
_CHAR_SEED = zlib.crc32(b"c:")


#: Where a scan for ``_WORD_RE``'s matches may start and find exactly the full scan's: not
#: inside a run of word characters.
_NOT_WORD_RE = re.compile(r"\W")


def _head_and_tail_words(text: str, head: int, tail: int, lower: bool = False) -> list[str]:
    """``_clip(_WORD_RE.findall(text), head, tail)``, reading a long text's first ``head`` and
    last ``tail`` words only (a whole scan of a 1 MB prompt took 30-90 ms). With ``lower``, the
    words of ``text.lower()``, lower-casing only the parts read (``_lower_parts``)."""
    if lower and not _lowers_per_char(text):
        text, lower = text.lower(), False
    if lower:
        found = _head_words(text, head + tail + 1)
    else:
        found = [m.group() for m in itertools.islice(_WORD_RE.finditer(text), head + tail + 1)]
    if len(found) <= head + tail:
        return found
    window = _TAIL_CHARS_PER_WORD * tail
    while window < len(text):
        part = text[len(text) - window:]
        part = part.lower() if lower else part
        start = _NOT_WORD_RE.search(part)  # not inside a word: same matches
        if start is None:
            break  # the text ends in one run of word characters longer than the window
        last = _WORD_RE.findall(part, start.start())
        if len(last) >= tail:
            return found[:head] + last[len(last) - tail:]
        window *= 4
    return found[:head] + _WORD_RE.findall(text.lower() if lower else text)[-tail:]


def _lowers_per_char(text: str) -> bool:
    """Whether ``text.lower()`` lower-cases each character on its own, so that the lower-case of
    a slice is that slice of the lower-case (of the same characters: "İ" becomes two): true
    unless ``text`` holds a capital sigma, the one character CPython lower-cases by its context
    (a final sigma). A fast scan (~0.03 ms a megabyte), where ``lower`` takes ~2.5 ms."""
    return "\u03a3" not in text


#: Characters per word of the first prefix (suffix) a long text's head (tail) words are read from,
#: 4x longer until it holds enough. Any size reads the same words; these hold enough for the data
#: set's prompts (4.5 characters a word at the median, 6.1 at the 99th percentile) and are short
#: enough to ``findall`` whole (read 16 a word: ~0.1 ms more a long prompt).
_HEAD_CHARS_PER_WORD, _TAIL_CHARS_PER_WORD = 6, 8


def _head_words(text: str, count: int) -> list[str]:
    """The first ``count`` words of ``text.lower()`` (``_WORD_RE``; fewer if it has fewer), from
    lower-cased prefixes ``_HEAD_CHARS_PER_WORD`` characters a word long, then 4x longer: a
    prefix's words are the whole's but for one touching its end (cut in two), so ``count + 1``
    are read. Needs ``_lowers_per_char(text)``."""
    size = _HEAD_CHARS_PER_WORD * count
    while size < len(text):
        found = _WORD_RE.findall(text[:size].lower())
        if len(found) > count:
            return found[:count]
        size *= 4
    return [m.group() for m in itertools.islice(_WORD_RE.finditer(text.lower()), count)]


def _lower_clip(text: str, head: int, tail: int) -> str:
    """``str(_clip(text.lower(), head, tail))``, lower-casing only a long text's head and tail."""
    if len(text) <= head + tail or not _lowers_per_char(text):
        return str(_clip(text.lower(), head, tail))
    last = text[len(text) - tail:].lower()  # lower-casing never shortens: len(text.lower()) > head + tail
    return text[:head].lower()[:head] + last[len(last) - tail:]


#: Texts up to this long are ``split`` for their word count; longer ones are counted with numpy
#: (``_count_words``: a 1 MB prompt 8 ms -> 1.2 ms, no list of its words).
_SPLIT_CHARS = 8192
#: Per UTF-16 code unit: 1 unless ``str.isspace`` (ASCII's and 19 other BMP characters; none
#: beyond the BMP, and a surrogate code unit is not one; a test checks all 1,114,112).
_NOT_SPACE = np.ones(1 << 16, np.uint8)
_NOT_SPACE[[*range(9, 14), *range(28, 33), 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F,
            0x205F, 0x3000]] = 0
_COUNT_CHUNK = 1 << 16


def _count_words(text: str) -> int:
    """``len(text.split())``: the runs of non-whitespace characters, counted in 64k-character
    chunks of UTF-16 code units (a character beyond the BMP is two units, both not space).
    A unit above 32 is not space but for a few from 0x85 up, and one of 28-32 is: in a chunk
    that is mostly ASCII the table is read for the others only (a lookup a unit took ~1.5 ms a
    megabyte); a chunk with many units from 0x85 up (Cyrillic, CJK) reads it for all, which is
    cheaper there than picking them out (~5 ms a megabyte)."""
    if len(text) <= _SPLIT_CHARS:
        return len(text.split())
    count, after_space = 0, True
    for start in range(0, len(text), _COUNT_CHUNK):
        units = np.frombuffer(text[start:start + _COUNT_CHUNK].encode("utf-16-le", "surrogatepass"), np.uint16)
        odd = (units < 28) | (units >= 0x85)
        if np.count_nonzero(odd) > len(units) >> 4:
            not_space = _NOT_SPACE[units].view(np.bool_)
        else:
            not_space = units > 32
            looked_up = np.flatnonzero(odd)
            not_space[looked_up] = _NOT_SPACE[units[looked_up]]
        count += int(np.count_nonzero(not_space[1:] > not_space[:-1])) + int(after_space and not_space[0])
        after_space = not not_space[-1]
    return count


#: The running CRC of the word n-grams' start marker, ``"w:<s>"``.
_START_CRC = zlib.crc32(b"<s>", _WORD_SEED)


def _word_slots(text: str, config: FeatureConfig, mask: int) -> list[int]:
    """Slots of the word 1..``word_ngram_max``-grams (``"w:" + words joined by a space``; the
    n-grams also start at a ``<s>`` before the first word). An n-gram's CRC continues the
    (n-1)-gram's with a space and its last word: no gram is joined."""
    crc = zlib.crc32
    words = [w.encode() for w in _head_and_tail_words(text, config.max_head_words, config.max_tail_words, lower=True)]
    grams = [crc(w, _WORD_SEED) for w in words]
    slots = [g & mask for g in grams]
    spaced = [b" " + w for w in words]
    grams = [_START_CRC, *grams]  # the 1-grams of <s> and the words
    for n in range(2, config.word_ngram_max + 1):
        grams = [crc(last, gram) for gram, last in zip(grams, spaced[n - 2:])]  # the n-grams from each start
        slots += [g & mask for g in grams]
    return slots


def _crc_table() -> np.ndarray:
    """zlib's CRC-32 table (reflected polynomial 0xEDB88320), one entry a byte value."""
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0xEDB88320), table >> 1).astype(np.uint32)
    return table


_CRC_TABLE = _crc_table()


def _ascii_gram_slots(words: list[str], seed: int, low: int, high: int, mask: int) -> np.ndarray:
    """``crc32(gram, seed) & mask`` of every ``low..high``-byte gram of each ASCII word padded with
    a space on each side, all at once: zlib's table-driven CRC run from every start in step (one
    numpy pass a byte, not one ``crc32`` call a gram: ~900 grams of a prompt's 384 characters
    0.2 -> 0.05 ms). Grams of a word only: a start's gram ends by its word's end."""
    if not words:
        return np.zeros(0, np.int64)
    data = (" " + "  ".join(words) + " ").encode()  # the padded words back to back
    size = len(data)
    padded = np.zeros(size + high, np.uint8)
    padded[:size] = np.frombuffer(data, np.uint8)
    lengths = np.array([len(w) + 2 for w in words])
    room = np.repeat(np.cumsum(lengths), lengths) - np.arange(size)  # bytes from each start to its word's end
    crc = np.full(size, seed ^ 0xFFFFFFFF, np.uint32)
    found = []
    for n in range(1, high + 1):
        crc = _CRC_TABLE[(crc ^ padded[n - 1 : n - 1 + size]) & 0xFF] ^ (crc >> 8)
        if n >= low:
            found.append(crc[room >= n])
    if not found:
        return np.zeros(0, np.int64)
    return ((np.concatenate(found) ^ 0xFFFFFFFF) & mask).astype(np.int64)


def _char_slots(text: str, config: FeatureConfig, mask: int) -> np.ndarray:
    """Slots of each word's character ``char_ngram_min..max``-grams, the word padded with a
    space on each side (``"c:" + gram``), in no particular order. ASCII words' grams are bytes,
    hashed together (``_ascii_gram_slots``)."""
    crc = zlib.crc32
    clipped = _lower_clip(text, config.max_head_chars, config.max_tail_chars)
    words = clipped.split()
    if clipped.isascii():
        return _ascii_gram_slots(words, _CHAR_SEED, config.char_ngram_min, config.char_ngram_max, mask)
    slots: list[int] = []
    for word in (w for w in words if not w.isascii()):
        padded = f" {word} "
        for n in range(config.char_ngram_min, config.char_ngram_max + 1):
            slots += [crc(padded[i : i + n].encode(), _CHAR_SEED) & mask for i in range(len(padded) - n + 1)]
    ascii_words = [w for w in words if w.isascii()]
    return np.concatenate([np.array(slots, np.int64),
                           _ascii_gram_slots(ascii_words, _CHAR_SEED, config.char_ngram_min, config.char_ngram_max, mask)])


def cue_features(text: str, length_request: bool = False) -> np.ndarray:
    """The ``NUM_CUES`` raw cue values of a prompt (float64), before standardisation, then the
    ``NUM_LENGTH_REQUEST_CUES`` length-request values when ``length_request``."""
    stripped = text.strip()
    clipped = _lower_clip(stripped, _CUE_HEAD_CHARS, _CUE_TAIL_CHARS)
    if "\u0131" in clipped or "\u017f" in clipped:  # translate reads a non-ASCII text slowly (~50 us)
        clipped = clipped.translate(_IGNORECASE_FOLD)
    questions = stripped.count("?")
    values = [
        math.log1p(len(stripped)),
        math.log1p(_count_words(stripped)),
        math.log1p(stripped.count("\n")),
        float(questions > 0),
        float(stripped.endswith("?")),
        math.log1p(questions),
        math.log1p(len(_SENTENCE_END_RE.findall(clipped))),
    ]
    values += _cue_hits(clipped)
    if length_request:
        requested = requested_tokens(clipped)
        values += [0.0, 0.0] if requested is None else [1.0, math.log1p(requested)]
    return np.array(values)


def _counts(slots: list[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Slot ids (sorted, unique) and raw counts. crc32 is stable across processes, unlike hash()."""
    if len(slots) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    return np.unique(np.array(slots, np.int64), return_counts=True)


def raw_counts(text: str, config: FeatureConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per block (word, char): unique slot ids and their counts in ``text``. IDF-free."""
    mask = config.num_buckets - 1
    return [_counts(_word_slots(text, config, mask)), _counts(_char_slots(text, config, mask))]


def sparse_features(
    text: str, config: FeatureConfig, idf: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The model's input for ``text``: (slot ids int64, values float64), each block of unit L2 norm.

    Slot ids may repeat across blocks (rare hash collisions); consumers must sum, not assign.
    """
    all_slots: list[np.ndarray] = []
    all_values: list[np.ndarray] = []
    for slots, counts in raw_counts(text, config):
        values = (1.0 + np.log(counts)) * idf[slots]
        norm = float(np.sqrt(values @ values))
        if norm > 0.0:
            all_slots.append(slots)
            all_values.append(values / norm)
    if not all_slots:
        return np.zeros(0, np.int64), np.zeros(0, np.float64)
    return np.concatenate(all_slots), np.concatenate(all_values)


@dataclass(frozen=True, eq=False)
class LexicalModel:
    """Linear model over hashed TF-IDF n-grams. Immutable.

    Invariants: ``idf`` and ``weights`` are float64 arrays of ``config.num_buckets`` entries;
    ``cue_mean``, ``cue_scale`` and ``cue_weights`` have ``config.num_cues`` entries; all are
    already rounded to float32 values so that a saved and reloaded model scores identically.
    """

    config: FeatureConfig
    idf: np.ndarray
    weights: np.ndarray
    #: Score of a prompt with no features, in log(1 + tokens).
    intercept: float
    #: Training-set mean and standard deviation of each cue (standardisation).
    cue_mean: np.ndarray = field(default_factory=lambda: np.zeros(0))
    cue_scale: np.ndarray = field(default_factory=lambda: np.zeros(0))
    cue_weights: np.ndarray = field(default_factory=lambda: np.zeros(0))

    kind = "lexical"

    @functools.cached_property
    def _cue_multiplier(self) -> np.ndarray:
        """Per cue: its block's weight over its training-set scale (computed once per model)."""
        scale = np.full(self.config.num_cues, self.config.cue_weight)
        scale[NUM_CUES:] = self.config.length_request_weight
        return scale / self.cue_scale

    def cue_vector(self, prompt: str) -> np.ndarray:
        """The standardised, scaled cue block z(p) (empty when the model has no cues)."""
        if self.config.cue_weight <= 0.0:
            return np.zeros(0)
        raw = cue_features(prompt, self.config.length_request_weight > 0.0)
        return (raw - self.cue_mean) * self._cue_multiplier

    def features(self, prompt: str) -> tuple[np.ndarray, np.ndarray]:
        """(slot ids, values) over ``num_buckets`` n-gram slots then one slot per cue (training)."""
        slots, values = sparse_features(prompt, self.config, self.idf)
        cues = self.cue_vector(prompt)
        cue_slots = self.config.num_buckets + np.arange(len(cues), dtype=np.int64)
        return np.concatenate([slots, cue_slots]), np.concatenate([values, cues])

    def score_text(self, prompt: str) -> float:
        """Predicted log(1 + output tokens) for a prompt."""
        slots, values = sparse_features(prompt, self.config, self.idf)
        score = float(values @ self.weights[slots]) + self.intercept
        if self.config.cue_weight > 0.0:
            score += float(self.cue_vector(prompt) @ self.cue_weights)
        return score

    def to_arrays(self) -> tuple[dict[str, object], dict[str, np.ndarray]]:
        """(JSON-able header, arrays) for ``.npz`` storage; only non-default slots are kept."""
        idf_unseen = float(self.idf.max())
        w_slots = np.flatnonzero(self.weights)
        idf_slots = np.flatnonzero(self.idf != idf_unseen)
        header = {"config": asdict(self.config), "intercept": self.intercept, "idf_unseen": idf_unseen}
        arrays = {
            "weight_slots": w_slots.astype(np.int32),
            "weight_values": self.weights[w_slots].astype(np.float32),
            "idf_slots": idf_slots.astype(np.int32),
            "idf_values": self.idf[idf_slots].astype(np.float32),
        }
        if self.config.cue_weight > 0.0:
            arrays["cue_mean"] = self.cue_mean.astype(np.float32)
            arrays["cue_scale"] = self.cue_scale.astype(np.float32)
            arrays["cue_weights"] = self.cue_weights.astype(np.float32)
        return header, arrays

    @classmethod
    def from_arrays(cls, header: dict[str, object], arrays: dict[str, np.ndarray]) -> LexicalModel:
        """Inverse of ``to_arrays``. Raises KeyError / TypeError on a malformed header."""
        # Weights written before cues (or length-request cues) existed lack the field: they keep
        # scoring as they did.
        before = {"cue_weight": 0.0, "length_request_weight": 0.0}
        config = FeatureConfig(**{**before, **header["config"]})  # type: ignore[dict-item]
        idf = np.full(config.num_buckets, float(header["idf_unseen"]))  # type: ignore[arg-type]
        idf[arrays["idf_slots"]] = arrays["idf_values"]
        weights = np.zeros(config.num_buckets)
        weights[arrays["weight_slots"]] = arrays["weight_values"]
        cues = {}
        if config.cue_weight > 0.0:
            cues = {key: arrays[key].astype(np.float64) for key in ("cue_mean", "cue_scale", "cue_weights")}
            if not all(len(value) == config.num_cues for value in cues.values()):
                raise ValueError(f"cue arrays must have {config.num_cues} entries")
        return cls(config, idf, weights, float(header["intercept"]), **cues)  # type: ignore[arg-type]
