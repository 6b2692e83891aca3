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
otherwise switch a worker's lanes off for all its traffic. So while the other API keys hold at
least ``MIN_OTHERS_SHARE`` of the window's requests, the key with the most work counts for at most
``max_key_share`` of the window's work (prompt + ``decode_token_cost`` x output): it is scaled
down to that, the others count as they are (``capped_top_weight``), much as the predictor's
refresh caps a key's share of its window (``refresh.refresh_window``). A deployment whose traffic
is prompt-heavy across its keys still steps aside; one key flooding does not make it. One key, no
auth, or one key with a few stray requests of others beside it: nothing changes (a tiny second
key must not speak for the whole window).

Pure: no clock, no I/O; the same object runs in a worker and in the simulator.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

#: Finished requests the share is taken over, and how many it needs before it says anything.
WINDOW = 1000
MIN_REQUESTS = 100
#: Most of the window's work the key with the most work counts for, while the other keys hold
#: at least MIN_OTHERS_SHARE of the window's requests. A key sending only long prompts at this
#: share leaves the share under ``live_policy.PREFILL_HEAVY_SHARE`` (0.6) while the rest of the
#: traffic is chat below 0.47 (Azure conv's windows: 0.22-0.50).
MAX_KEY_SHARE = 0.25
MIN_OTHERS_SHARE = 0.1


@dataclass
class _KeyTokens:
    requests: int = 0
    prompt: int = 0
    output: int = 0


def capped_top_weight(top_work: float, others_work: float, max_share: float) -> float:
    """The weight in (0, 1] that brings the largest key's ``top_work`` to at most ``max_share``
    of the weighted total, the other keys' ``others_work`` counted as it is. Pure."""
    if max_share >= 1.0 or top_work <= 0:
        return 1.0
    allowed = max_share / (1.0 - max_share) * others_work  # top <= share x (top + others)
    return min(1.0, allowed / top_work) if allowed > 0 else 1.0


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
        """Estimated share of the engine's work spent on prefill, in [0, 1], the key with the
        most work counting for at most ``max_key_share`` of it while the others hold
        ``MIN_OTHERS_SHARE`` of the window's requests; 0 until ``min_requests`` requests were
        observed (lanes start by priority, as before). Kept until the next ``observe``: callers
        ask per pop decision, it changes only when a request finishes."""
        if len(self._requests) < self.min_requests:
            return 0.0
        if self._cached is not None and self._cached[0] == decode_token_cost:
            return self._cached[1]
        prompt, work = float(self._prompt), self._prompt + decode_token_cost * self._output
        if len(self._keys) > 1 and self.max_key_share < 1.0:
            top = max(self._keys.values(), key=lambda k: k.prompt + decode_token_cost * k.output)
            if len(self._requests) - top.requests >= MIN_OTHERS_SHARE * len(self._requests):
                top_work = top.prompt + decode_token_cost * top.output
                weight = capped_top_weight(top_work, work - top_work, self.max_key_share)
                prompt -= (1.0 - weight) * top.prompt
                work -= (1.0 - weight) * top_work
        share = prompt / work if work > 0 else 0.0
        self._cached = (decode_token_cost, share)
        return share
