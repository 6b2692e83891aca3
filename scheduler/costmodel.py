"""GPU cost profiles: prefill ms by prompt tokens, decode ms per step by batch size.

Numbers are published medians (see ``reference/scheduling.md``); between table points we
interpolate linearly and beyond the ends we extrapolate the nearest segment. Shared by the
trace simulator and the ``sim`` engine, so both run at the same pace. Pure: no I/O.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Points = tuple[tuple[float, float], ...]


def interpolate(points: Points, x: float) -> float:
    """Piecewise-linear ``y(x)`` through ``points`` (sorted by x, at least two), never < 0."""
    xs = [p[0] for p in points]
    i = min(max(bisect_right(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class CostProfile:
    """One model on one GPU setup."""

    name: str
    #: (prompt tokens in the iteration, ms) for a prefill iteration.
    prefill_ms: Points
    #: (batch size, ms) for one decode step of every running request.
    decode_ms: Points
    #: Attention cost per context token in the batch per decode step, when the table omits it.
    attention_ms_per_context_token: float = 0.0

    def prefill_step_ms(self, num_prompt_tokens: int) -> float:
        """Duration of a prefill iteration over ``num_prompt_tokens`` tokens in total."""
        return interpolate(self.prefill_ms, num_prompt_tokens)

    def chunked_step_ms(self, chunks: Iterable[tuple[int, int]], decode_ms: float | None) -> float:
        """One chunked-prefill iteration (vLLM V1, TensorRT-LLM): the decode step of the running
        requests (``decode_ms``; None when nothing decodes, and then the fixed cost
        ``prefill(0)`` is paid once) plus each prompt chunk's share of the prefill curve,
        ``prefill(done + chunk) - prefill(done)`` for ``chunks`` of (tokens done, chunk tokens)."""
        prefill_ms = sum(self.prefill_step_ms(done + take) - self.prefill_step_ms(done) for done, take in chunks)
        return decode_ms + prefill_ms if decode_ms is not None else self.prefill_step_ms(0) + prefill_ms

    def decode_step_ms(self, batch_size: int, num_context_tokens: int = 0) -> float:
        """Duration of one decode step for ``batch_size`` requests holding ``num_context_tokens``."""
        if batch_size <= 0:
            return 0.0
        attention_ms = self.attention_ms_per_context_token * num_context_tokens
        return interpolate(self.decode_ms, batch_size) + attention_ms

    def decode_token_cost(self, batch_size: int, prompt_tokens: int = 2048) -> float:
        """What one decoded token costs in prompt tokens' worth of prefill: a decode step of
        ``batch_size`` requests, per request, over a ``prompt_tokens`` prefill's time per token
        (``workmix.WorkMix``). L70-H100 at 64 requests: 11.7."""
        per_decode = self.decode_step_ms(batch_size) / max(1, batch_size)
        return per_decode / (self.prefill_step_ms(prompt_tokens) / prompt_tokens)


def _points(xs: Sequence[float], ys: Sequence[float]) -> Points:
    return tuple(zip(xs, ys, strict=True))


_L70_PREFILL_TOKENS = (512, 1024, 2048, 4096, 8192)
_L70_DECODE_BATCH = (1, 8, 16, 32, 64)
# Llama-2-7B on one A100: non-attention op time per iteration by tokens in the iteration.
_L7_A100_TOKENS_MS = _points((1, 64, 128, 512, 1024, 2048, 4096), (9.1, 9.8, 12.3, 33.6, 68.3, 134.0, 260.0))

PROFILES: dict[str, CostProfile] = {
    "l70-h100": CostProfile(
        name="l70-h100",
        prefill_ms=_points(_L70_PREFILL_TOKENS, (53.4, 77.9, 136.8, 390.3, 844.9)),
        decode_ms=_points(_L70_DECODE_BATCH, (29.8, 32.5, 34.2, 38.6, 50.2)),
    ),
    "l70-a100": CostProfile(
        name="l70-a100",
        prefill_ms=_points(_L70_PREFILL_TOKENS, (127.0, 227.0, 403.0, 965.0, 2279.0)),
        decode_ms=_points(_L70_DECODE_BATCH, (45.0, 45.8, 48.5, 52.4, 73.0)),
    ),
    "l7-a100": CostProfile(
        name="l7-a100",
        prefill_ms=_L7_A100_TOKENS_MS,
        decode_ms=_L7_A100_TOKENS_MS,
        # 0.5 MiB of KV per token read at ~2 TB/s.
        attention_ms_per_context_token=0.26e-3,
    ),
}


def get_profile(name: str) -> CostProfile:
    """The named profile; raises ``KeyError`` listing the known names."""
    try:
        return PROFILES[name.lower()]
    except KeyError:
        raise KeyError(f"unknown cost profile {name!r}; known: {', '.join(PROFILES)}") from None


@dataclass(frozen=True)
class SpecDecoding:
    """Speculative decoding: ``num_draft_tokens`` proposed per step, each accepted with
    probability ``acceptance_rate`` (independently, stopping at the first rejection)."""

    acceptance_rate: float
    num_draft_tokens: int
    #: Cost of drafting one token, as a fraction of the target's decode step at the same batch.
    draft_cost_ratio: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance_rate < 1.0:
            raise ValueError("acceptance_rate must be in [0, 1)")
        if self.num_draft_tokens < 0:
            raise ValueError("num_draft_tokens must be >= 0")

    def tokens_per_step(self) -> float:
        """Expected tokens per step: (1 - a^(k+1)) / (1 - a), i.e. accepted drafts + 1."""
        a, k = self.acceptance_rate, self.num_draft_tokens
        return (1.0 - a ** (k + 1)) / (1.0 - a)

    def step_ms(self, target_step_ms: float) -> float:
        """A speculative step: k draft passes, then one target pass verifying them."""
        return target_step_ms * (1.0 + self.draft_cost_ratio * self.num_draft_tokens)
