"""What a worker's engine spends its time on: the prefill share of its recent requests' work.

Lanes order requests by predicted *output* length, which is most of what a request costs where
decoding dominates (chat: Azure conv, ~30 % of the work is prefill). Where prompts dominate (long
prompts, short answers: code completion, RAG, Kimi's Mooncake conversations, 75-88 % prefill),
bursts of prefill back every lane up at once, even at half load. Reordering by answer length then
costs the jumped requests 25-71 % on their TTFT P99 at half load (Azure code), while a predictor
of the shipped quality gains short requests 1.0-1.2x at high load (benchmarks/RESULTS.md, "Stop 25"; with
the true lengths the gain is 2.2-3.7x, at the same cost). So a worker whose recent work is mostly
prefill steps its lanes aside: FCFS, open slots, no hand-backs (``SlotConfig.fcfs_above_prefill_share``,
``policy.prefill_heavy``).

The share is estimated from token counts, which every engine reports alike, rather than from
engine timers, which they do not: a decoded token costs ``decode_token_cost`` prompt tokens'
worth of prefill (a decode step of a full batch, per request, over a prefill's time per prompt
token; ``costmodel.CostProfile.decode_token_cost``), so over the window

    share = prompt tokens / (prompt tokens + decode_token_cost x output tokens).

One client must not decide this for everyone: sending long prompts with ``max_tokens`` 1 would
otherwise switch a worker's lanes off for all its traffic. So while two or more API keys have
requests in the window, no key counts for more than ``max_key_share`` of the window's work
(prompt + ``decode_token_cost`` x output; with fewer than ``1 / max_key_share`` keys, for more
than an equal share): keys above it are scaled down to it, as the predictor's refresh caps a
key's share of its window (``refresh.refresh_window``). A deployment
whose traffic is prompt-heavy across its keys still steps aside; one key flooding does not make
it. With one key (or none: no auth) the weighting changes nothing.

Pure: no clock, no I/O; the same object runs in a worker and in the simulator.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

#: Finished requests the share is taken over, and how many it needs before it says anything.
WINDOW = 1000
MIN_REQUESTS = 100
#: Most of the window's work one API key counts for while other keys have requests in it (with
#: fewer than ``1 / MAX_KEY_SHARE`` keys, an equal share). A key sending only long prompts at
#: this share leaves the share under ``live_policy.PREFILL_HEAVY_SHARE`` (0.6) while the rest of
#: the traffic is chat below 0.47 (Azure conv's windows: 0.22-0.50).
MAX_KEY_SHARE = 0.25


@dataclass
class _KeyTokens:
    requests: int = 0
    prompt: int = 0
    output: int = 0


def capped_weights(work: list[float], max_share: float) -> list[float]:
    """Weights in (0, 1] for each key's ``work`` so that no weighted key holds more than
    ``max_share`` of the weighted total: the largest keys are scaled down to one common level
    (water-filling), the others keep weight 1. With fewer than ``1 / max_share`` keys that
    cannot hold; the cap is then ``1 / len(work)`` (every key brought to the smallest). Pure."""
    total = sum(work)
    if len(work) < 2 or total <= 0:
        return [1.0] * len(work)
    share = max(max_share, 1.0 / len(work))
    if share >= 1.0:
        return [1.0] * len(work)
    rest, level = total, math.inf
    for capped, w in enumerate(sorted(work, reverse=True)):
        # The ``capped`` largest keys at ``level``, the rest (``rest``, this one on) as they are:
        # level = share x (capped x level + rest). Ends by ``capped = ceil(1 / share) - 1``,
        # where ``capped x share < 1``.
        level = share * rest / (1.0 - capped * share)
        if w <= level:
            break
        rest -= w
    return [min(1.0, level / w) if w > 0 else 1.0 for w in work]


class WorkMix:
    """Prompt and output tokens of the last ``window`` finished requests, per API key."""

    def __init__(self, window: int = WINDOW, min_requests: int = MIN_REQUESTS,
                 max_key_share: float = MAX_KEY_SHARE) -> None:
        if window < 1 or not 0 < min_requests <= window:
            raise ValueError(f"need window >= 1 and 0 < min_requests <= window, got {window}, {min_requests}")
        if not 0.0 < max_key_share <= 1.0:
            raise ValueError(f"need 0 < max_key_share <= 1, got {max_key_share}")
        self.window, self.min_requests, self.max_key_share = window, min_requests, max_key_share
        self._requests: deque[tuple[int, int, str]] = deque()
        self._keys: dict[str, _KeyTokens] = {}
        self._prompt = self._output = 0
        #: ``prefill_share``'s last answer, kept until a request is observed or the cost changes.
        self._cached: tuple[float, float] | None = None

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def num_keys(self) -> int:
        """API keys with requests in the window."""
        return len(self._keys)

    def observe(self, prompt_tokens: int, output_tokens: int, key: str = "") -> None:
        """One finished request of API key ``key`` ("" without auth); negative counts, from a
        broken engine report, count as 0."""
        prompt, output = max(0, int(prompt_tokens)), max(0, int(output_tokens))
        self._requests.append((prompt, output, key))
        self._add(key, prompt, output, 1)
        if len(self._requests) > self.window:
            old_prompt, old_output, old_key = self._requests.popleft()
            self._add(old_key, old_prompt, old_output, -1)
        self._cached = None

    def _add(self, key: str, prompt: int, output: int, sign: int) -> None:
        tokens = self._keys.setdefault(key, _KeyTokens())
        tokens.requests += sign
        tokens.prompt += sign * prompt
        tokens.output += sign * output
        self._prompt += sign * prompt
        self._output += sign * output
        if tokens.requests == 0:
            del self._keys[key]

    def prefill_share(self, decode_token_cost: float) -> float:
        """Estimated share of the engine's work spent on prefill, in [0, 1], no key counting
        for more than ``max_key_share`` of the work while others have requests in the window;
        0 until ``min_requests`` requests were observed (lanes start by priority, as before)."""
        if len(self._requests) < self.min_requests:
            return 0.0
        if self._cached is not None and self._cached[0] == decode_token_cost:
            return self._cached[1]
        if len(self._keys) < 2:
            prompt, work = float(self._prompt), self._prompt + decode_token_cost * self._output
        else:
            keys = list(self._keys.values())
            works = [k.prompt + decode_token_cost * k.output for k in keys]
            weights = capped_weights(works, self.max_key_share)
            prompt = sum(w * k.prompt for w, k in zip(weights, keys, strict=True))
            work = sum(w * x for w, x in zip(weights, works, strict=True))
        share = prompt / work if work > 0 else 0.0
        self._cached = (decode_token_cost, share)
        return share
