"""Cheap lexical features of a prompt for the complexity estimate (pure, numpy only).

A prompt becomes two blocks::

    words(p) = hashed word unigrams and bigrams, 0/1 presence, L2 norm 1     NUM_BUCKETS slots
    cues(p)  = NUM_CUES hand-written values (size, punctuation, task type)   standardised by the model

The cue regexes follow the idea of the length predictor's cues (``predictor_lexical``) but are
this package's own: changing any of them changes the features, so it needs a retrain and a
``FEATURE_VERSION`` bump (the weights file records the version it was trained with).
"""

from __future__ import annotations

import math
import re
import zlib

import numpy as np

#: Bumped whenever ``word_slots`` or ``cue_values`` change meaning; stored with the weights.
FEATURE_VERSION = 2
NUM_BUCKETS_LOG2 = 14
NUM_BUCKETS = 1 << NUM_BUCKETS_LOG2
#: Words read from each end of a prompt: the instruction is almost always at one end, and the
#: cap bounds latency on pasted documents.
MAX_HEAD_WORDS, MAX_TAIL_WORDS = 160, 64
#: Characters read from each end before words are split (a bound on work for pasted documents).
MAX_WORD_HEAD_CHARS, MAX_WORD_TAIL_CHARS = 2048, 512
#: Characters the cue regexes read from each end: their cost grows with the text (~0.5 us/char).
MAX_HEAD_CHARS, MAX_TAIL_CHARS = 1024, 256

_WORD_RE = re.compile(r"[^\W_]+|[^\w\s]")
_SENTENCE_END_RE = re.compile(r"[.!?](\s|$)")

#: (name, regex): 0/1 features searched case-insensitively in the clipped, lower-cased prompt.
CUE_PATTERNS: tuple[tuple[str, str], ...] = (
    ("open_write", r"^\W*(please\s+)?(write|compose|draft|create|generate|design|develop|come up with|make up)\b"),
    ("creative", r"\b(story|poem|essay|song|lyrics|script|blog|article|speech|letter|haiku|joke|novel|fiction)\b"),
    ("explain", r"^\W*(please\s+)?(explain|describe|discuss|compare|analy[sz]e|elaborate|summari[sz]e)\b"),
    ("closed", r"\b(classify|categori[sz]e|identify|extract|which of|true or false|yes or no|choose|pick the"
     r"|correct the|fix the|rewrite|rephrase|paraphrase|translate|convert|spell|synonym|antonym)\b"),
    ("wh_start", r"^\W*(what|who|when|where|which|how many|how much|is|are|does|do|can|did|was|were)\b"),
    ("how_why", r"^\W*(how|why)\b"),
    ("advice", r"\b(should i|how (do|can) i|help me|advice|recommend|suggest|tips|best way)\b"),
    ("list", r"\b(list|ideas|examples|steps|ways|reasons|options|names)\b"),
    ("code", r"```|\b(?:def |function\b|code\b|python\b|javascript\b|sql\b|java\b|c\+\+|regex|program\b)"
     r"|[{};][^\S\n]*$"),
    ("math", r"\d\s*[-+*/^=x×]\s*\d|\b(?:solve|calculate|equation|probability|proof|prove)\b"),
    ("reasoning", r"\b(step[- ]by[- ]step|reason|logic|puzzle|riddle|trick|why does|what if)\b"),
    ("brief", r"\b(brief|briefly|short|concise|one sentence|one word|in a few words|summary)\b"),
    ("detail", r"\b(in detail|detailed|comprehensive|thorough|in depth|in-depth|complete guide)\b"),
    ("has_input", r"\b(?:input|text|sentence)\b\s*:|:\s*\n|\"[^\"]{40,}\""),
    ("opinion", r"\b(you think|your opinion|do you|are you|would you|feel about)\b"),
)
_CUE_RES = tuple(re.compile(pattern, re.IGNORECASE | re.MULTILINE) for _, pattern in CUE_PATTERNS)
#: Size and punctuation values first, then one 0/1 value per ``CUE_PATTERNS`` entry.
CUE_NAMES: tuple[str, ...] = (
    "log_chars", "log_words", "log_lines", "ends_question", "log_sentences", "digit_share", "non_ascii",
    *(name for name, _ in CUE_PATTERNS),
)
NUM_CUES = len(CUE_NAMES)


def _clip(text: str, head: int, tail: int) -> str:
    if len(text) <= head + tail:
        return text
    return text[:head] + "\n" + text[-tail:]


def word_slots(text: str) -> np.ndarray:
    """Sorted unique hash slots of the prompt's word unigrams and bigrams (int64).

    crc32, not ``hash()``: slots must be the same in every process (PYTHONHASHSEED).
    """
    words = _WORD_RE.findall(_clip(text, MAX_WORD_HEAD_CHARS, MAX_WORD_TAIL_CHARS).lower())
    if len(words) > MAX_HEAD_WORDS + MAX_TAIL_WORDS:
        words = words[:MAX_HEAD_WORDS] + words[-MAX_TAIL_WORDS:]
    grams = ["<s> " + words[0]] if words else []
    grams += words
    grams += [f"{a} {b}" for a, b in zip(words, words[1:])]
    mask = NUM_BUCKETS - 1
    return np.unique(np.fromiter((zlib.crc32(g.encode()) & mask for g in grams), np.int64, len(grams)))


def cue_values(text: str) -> np.ndarray:
    """The ``NUM_CUES`` raw cue values of a prompt (float64), before standardisation."""
    stripped = text.strip()
    clipped = _clip(stripped, MAX_HEAD_CHARS, MAX_TAIL_CHARS).lower()
    num_chars = max(len(stripped), 1)
    # Words of the clipped text, scaled up to the whole: split() of a pasted book costs ms.
    num_words = len(clipped.split()) * len(stripped) / max(len(clipped), 1)
    values = [
        math.log1p(len(stripped)),
        math.log1p(num_words),
        math.log1p(stripped.count("\n")),
        float(stripped.endswith("?")),
        math.log1p(len(_SENTENCE_END_RE.findall(clipped))),
        sum(ch.isdigit() for ch in clipped) / min(num_chars, len(clipped) or 1),
        float(not stripped.isascii()),
    ]
    values += [float(regex.search(clipped) is not None) for regex in _CUE_RES]
    return np.array(values)
