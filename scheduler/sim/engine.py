"""One simulated engine: its config and its run table (what runs, how far each run got).

Continuous batching, vLLM-v0 style: an iteration is either a prefill of newly admitted
requests (each produces its next token at the end) or one decode step for every running
request. A run admitted at decode step ``start_step`` with ``base_tokens`` already generated
has generated ``base_tokens + produced + floor((num_steps - start_step) * tokens_per_step)``
tokens, where ``produced`` is 1 when its admission was a prefill (a new request, or a resume
that recomputes its KV) and 0 when it was a KV swap-in.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass

from lanes.scheduler.costmodel import CostProfile, SpecDecoding


@dataclass(frozen=True)
class EngineConfig:
    """One simulated worker's engine."""

    profile: CostProfile
    max_num_seqs: int = 64
    #: Prompt tokens one prefill iteration may take (a longer prompt runs alone).
    max_prefill_tokens: int = 8192
    spec: SpecDecoding | None = None
    #: Share of a resumed request's prompt that prefix caching still holds (0: no prefix caching).
    prompt_cached_share: float = 0.0
    #: Chunked prefill (vLLM V1, TensorRT-LLM's ``enable_chunked_prefill``): tokens per iteration
    #: (``max_num_batched_tokens``), one per running request's decode and the rest for prompt
    #: chunks. 0: the vLLM-v0 model above (an iteration prefills or decodes, never both).
    chunked_prefill_tokens: int = 0
    #: KV swap to or from host memory, ms per token of context (FastServe's preemption).
    #: Llama-2-70B keeps 0.3125 MiB of KV per token (80 layers x 8 KV heads x 128 x 2 x fp16),
    #: split over 8 GPUs that each move theirs at ~25 GB/s over PCIe: ~1.6 us per token.
    swap_ms_per_token: float = 0.0016

    def __post_init__(self) -> None:
        if self.chunked_prefill_tokens and self.chunked_prefill_tokens <= self.max_num_seqs:
            raise ValueError(f"chunked_prefill_tokens must be 0 (off) or more than max_num_seqs ({self.max_num_seqs}): "
                             "a full batch of decodes would leave no budget for prompts")

    @property
    def tokens_per_step(self) -> float:
        return self.spec.tokens_per_step() if self.spec else 1.0

    def decode_ms(self, batch_size: int, num_context_tokens: int) -> float:
        step_ms = self.profile.decode_step_ms(batch_size, max(0, num_context_tokens))
        return self.spec.step_ms(step_ms) if self.spec else step_ms


@dataclass
class Prefill:
    """A request holding a slot while its prompt is prefilled in chunks (chunked prefill)."""

    total: int
    remaining: int
    cls: int
    #: Tokens it had generated before (a resume), and whether its KV is swapped back in.
    base_tokens: int
    swapped_in: bool
    started_s: float


@dataclass
class Run:
    start_step: int
    base_tokens: int
    produced: int
    #: The class it counts against: a lane index or an MLFQ level.
    cls: int
    started_s: float
    #: Context tokens it added to the worker (subtracted when it leaves).
    context_tokens: int


class Worker:
    """A worker's run table. Finish and re-classification events are heaps keyed by decode
    step; a run that leaves early (hand-back) leaves stale entries that are skipped."""

    def __init__(self, engine: EngineConfig) -> None:
        self.engine = engine
        self.runs: dict[int, Run] = {}
        self.counts: Counter[int] = Counter()
        self.num_steps = 0
        self.num_context_tokens = 0.0
        #: Extra time (ms) the next iteration pays, e.g. swapping KV out.
        self.pending_ms = 0.0
        self.last_preemption_s = -math.inf
        #: Tokens its decode steps generated, all runs together (``preemption``'s budget earns by it).
        self.num_generated = 0.0
        self._finishing: list[tuple[int, int, int]] = []
        self._rechecks: list[tuple[int, int, int]] = []
        #: Admission serial number of each run (stale heap entries carry an older one).
        self._serials: dict[int, int] = {}
        self._serial = 0
        #: Requests whose prompt is still being prefilled in chunks, in admission order.
        self.prefilling: dict[int, Prefill] = {}
        #: Prompt and generated tokens prefilled again to resume preempted requests, not yet taken.
        self.num_reprefill_tokens = 0

    @property
    def num_running(self) -> int:
        """Requests decoding (the batch of a decode step)."""
        return len(self.runs)

    @property
    def num_slots_used(self) -> int:
        """Requests holding a slot: decoding, or prefilling in chunks."""
        return len(self.runs) + len(self.prefilling)

    def start_prefill(self, idx: int, tokens: int, cls: int, base_tokens: int, swapped_in: bool,
                      now_s: float) -> Prefill:
        assert idx not in self.runs and idx not in self.prefilling
        self.prefilling[idx] = pf = Prefill(tokens, tokens, cls, base_tokens, swapped_in, now_s)
        self.counts[cls] += 1
        return pf

    def finish_prefill(self, idx: int) -> Prefill:
        """The prompt is done: the request leaves the prefill list (``add`` it to decode)."""
        pf = self.prefilling.pop(idx)
        self.counts[pf.cls] -= 1
        return pf

    def take_reprefill_tokens(self) -> int:
        num, self.num_reprefill_tokens = self.num_reprefill_tokens, 0
        return num

    def generated(self, idx: int) -> int:
        run = self.runs[idx]
        decoded = math.floor((self.num_steps - run.start_step) * self.engine.tokens_per_step)
        return run.base_tokens + run.produced + decoded

    def add(self, idx: int, base_tokens: int, produced: int, cls: int, now_s: float, prompt_tokens: int,
            output_tokens: int) -> None:
        assert idx not in self.runs
        self._serial += 1
        context = prompt_tokens + base_tokens + produced
        self.runs[idx] = Run(self.num_steps, base_tokens, produced, cls, now_s, context)
        self.counts[cls] += 1
        self.num_context_tokens += context
        steps = math.ceil(max(0, output_tokens - base_tokens - produced) / self.engine.tokens_per_step)
        heapq.heappush(self._finishing, (self.num_steps + steps, idx, self._serial))
        self._serials[idx] = self._serial

    def remove(self, idx: int) -> Run:
        """Take a run out before it finishes (hand-back, swap-out)."""
        run = self.runs.pop(idx)
        self.counts[run.cls] -= 1
        self.num_context_tokens -= run.context_tokens + (self.num_steps - run.start_step) * self.engine.tokens_per_step
        self._serials.pop(idx)
        return run

    def set_class(self, idx: int, cls: int) -> None:
        run = self.runs[idx]
        if cls != run.cls:
            self.counts[run.cls] -= 1
            self.counts[cls] += 1
            run.cls = cls

    def recheck_at_tokens(self, idx: int, tokens: float) -> None:
        """Re-classify ``idx`` at the first decode step where it has generated more than ``tokens``."""
        if math.isinf(tokens):
            return
        run = self.runs[idx]
        needed = tokens + 1 - run.base_tokens - run.produced
        step = run.start_step + max(1, math.ceil(needed / self.engine.tokens_per_step))
        heapq.heappush(self._rechecks, (step, idx, self._serials[idx]))

    def due_rechecks(self) -> list[int]:
        due = []
        while self._rechecks and self._rechecks[0][0] <= self.num_steps:
            _, idx, serial = heapq.heappop(self._rechecks)
            if self._serials.get(idx) == serial:
                due.append(idx)
        return due

    def decode_step(self) -> float:
        """Advance one decode step; its duration in ms (plus any pending extra time)."""
        ms = self.engine.decode_ms(self.num_running, int(self.num_context_tokens)) + self.take_pending_ms()
        self.num_steps += 1
        self.num_context_tokens += self.num_running * self.engine.tokens_per_step
        self.num_generated += self.num_running * self.engine.tokens_per_step
        return ms

    def take_pending_ms(self) -> float:
        ms, self.pending_ms = self.pending_ms, 0.0
        return ms

    def retire(self) -> list[int]:
        """Runs whose last token came out by the current step (they leave the table)."""
        done = []
        while self._finishing and self._finishing[0][0] <= self.num_steps:
            _, idx, serial = heapq.heappop(self._finishing)
            if self._serials.get(idx) == serial:
                self.remove(idx)
                done.append(idx)
        return done
