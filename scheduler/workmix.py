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

Pure: no clock, no I/O; the same object runs in a worker and in the simulator.
"""

from __future__ import annotations

from collections import deque

#: Finished requests the share is taken over, and how many it needs before it says anything.
WINDOW = 1000
MIN_REQUESTS = 100


class WorkMix:
    """Prompt and output tokens of the last ``window`` finished requests."""

    def __init__(self, window: int = WINDOW, min_requests: int = MIN_REQUESTS) -> None:
        if window < 1 or not 0 < min_requests <= window:
            raise ValueError(f"need window >= 1 and 0 < min_requests <= window, got {window}, {min_requests}")
        self.window, self.min_requests = window, min_requests
        self._requests: deque[tuple[int, int]] = deque()
        self._prompt = self._output = 0

    def __len__(self) -> int:
        return len(self._requests)

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        """One finished request (negative counts, from a broken engine report, count as 0)."""
        prompt, output = max(0, int(prompt_tokens)), max(0, int(output_tokens))
        self._requests.append((prompt, output))
        self._prompt += prompt
        self._output += output
        if len(self._requests) > self.window:
            old_prompt, old_output = self._requests.popleft()
            self._prompt -= old_prompt
            self._output -= old_output

    def prefill_share(self, decode_token_cost: float) -> float:
        """Estimated share of the engine's work spent on prefill, in [0, 1]; 0 until
        ``min_requests`` requests were observed (lanes start by priority, as before)."""
        if len(self._requests) < self.min_requests:
            return 0.0
        work = self._prompt + decode_token_cost * self._output
        return self._prompt / work if work > 0 else 0.0
