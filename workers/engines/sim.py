"""The ``sim`` engine: a cost model of a real GPU that emits filler tokens at its pace.

Continuous batching as in the trace simulator: each iteration is either a prefill of newly
admitted requests (up to ``max_num_seqs`` running and ``max_num_batched_tokens`` prompt
tokens) or one decode step for every running request, timed by the cost profile and divided
by ``time_scale``. With speculative decoding each step yields 1 + (accepted drafts) tokens.
No torch: it exists for capacity planning and fleet-scale queueing benchmarks.

The filler text is `` tok0 tok1 ...`` (numbered from the first token of the answer, resumed
attempts included). Stop strings end the answer as on a real engine, before the token whose
text would complete one (finish reason ``stop``); the filler being known in advance, the
answer ends with the step that emits the last token before it (no step is spent on a token
that is not sent). So ``stop=[" tok<N>"]`` gives exactly N tokens in the steps N tokens take
(``lanes bench live`` replays a trace's answer lengths this way, with a large ``max_tokens``).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from lanes.queue.messages import FinishReason
from lanes.scheduler.costmodel import CostProfile, SpecDecoding
from lanes.workers.engines.base import (
    EngineDelta,
    EngineRequest,
    RequestRejected,
    warm_up,
)

#: Filler tokens get ids from here up (a made-up vocabulary).
TOKEN_ID_BASE = 1000


@dataclass
class _Seq:
    request: EngineRequest
    prompt_tokens: int
    num_output_tokens: int
    queue: asyncio.Queue[EngineDelta] = field(default_factory=asyncio.Queue)
    num_done: int = 0
    #: The end of the text so far (as long as the longest stop string), for stop matching.
    tail: str = ""


def prompt_token_count(request: EngineRequest) -> int:
    """A tokenizer-free estimate (~4 characters per token) plus already streamed tokens."""
    num_chars = sum(len(m.content) for m in request.messages)
    return max(1, num_chars // 4) + len(request.resume_token_ids)


class SimEngine:
    name = "sim"

    def __init__(self, profile: CostProfile, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 8192,
                 time_scale: float = 1.0, spec: SpecDecoding | None = None, seed: int = 0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.profile, self.max_concurrency = profile, max_num_seqs
        self.max_num_batched_tokens, self.time_scale, self.spec = max_num_batched_tokens, time_scale, spec
        self._rng = random.Random(seed)
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._num_steps = self._num_prefills = self._num_drafted = self._num_accepted = 0
        self._batch_sizes: Counter[int] = Counter()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="sim-engine")
        # Exercises the same path as the real engines' warm-up; the counters then start at 0.
        await warm_up(self, max_tokens=1)
        self._num_steps = self._num_prefills = self._num_drafted = self._num_accepted = 0
        self._batch_sizes.clear()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        remaining = request.max_tokens - len(request.resume_token_ids)
        if remaining <= 0:
            raise RequestRejected("bad_max_tokens", "max_tokens must exceed the tokens already streamed")
        seq = _Seq(request, prompt_token_count(request), remaining)
        self._waiting.append(seq)
        self._wake.set()
        try:
            while True:
                delta = await seq.queue.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self._drop(seq, notify=False)

    async def abort(self, request_id: str) -> None:
        seq = self._running.get(request_id) or next((s for s in self._waiting if s.request.id == request_id), None)
        if seq is not None:
            self._drop(seq, notify=True)

    def stats(self) -> dict[str, Any]:
        return {
            "running": len(self._running),
            "waiting": len(self._waiting),
            "steps": self._num_steps,
            "prefills": self._num_prefills,
            "batch_size_hist": dict(sorted(self._batch_sizes.items())),
            "acceptance": self._num_accepted / self._num_drafted if self._num_drafted else None,
        }

    def _drop(self, seq: _Seq, *, notify: bool) -> None:
        was_live = self._running.pop(seq.request.id, None) is not None
        if seq in self._waiting:
            self._waiting.remove(seq)
            was_live = True
        if notify and was_live:
            seq.queue.put_nowait(EngineDelta((), "", FinishReason.CANCELLED, seq.prompt_tokens))

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
                next_at = loop.time()
            batch = self._admit()
            if batch:
                step_ms = self.profile.prefill_step_ms(sum(s.prompt_tokens for s in batch))
                self._num_prefills += 1
            else:
                step_ms = self.profile.decode_step_ms(len(self._running), self._num_context_tokens())
                step_ms = self.spec.step_ms(step_ms) if self.spec else step_ms
                self._num_steps += 1
                self._batch_sizes[len(self._running)] += 1
            # An absolute schedule: sleep overheads do not add up over many steps.
            next_at = max(next_at, loop.time() - 0.05) + step_ms / 1000.0 / self.time_scale
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            for seq in batch or list(self._running.values()):
                if seq.request.id in self._running:
                    self._emit(seq, 1 if batch else self._tokens_this_step())

    def _admit(self) -> list[_Seq]:
        batch: list[_Seq] = []
        num_tokens = 0
        while self._waiting and len(self._running) < self.max_concurrency:
            seq = self._waiting[0]
            if batch and num_tokens + seq.prompt_tokens > self.max_num_batched_tokens:
                break
            self._waiting.popleft()
            self._running[seq.request.id] = seq
            batch.append(seq)
            num_tokens += seq.prompt_tokens
        return batch

    def _num_context_tokens(self) -> int:
        return sum(s.prompt_tokens + s.num_done for s in self._running.values())

    def _tokens_this_step(self) -> int:
        if self.spec is None:
            return 1
        accepted = 0
        while accepted < self.spec.num_draft_tokens and self._rng.random() < self.spec.acceptance_rate:
            accepted += 1
        self._num_drafted += self.spec.num_draft_tokens
        self._num_accepted += accepted
        return accepted + 1

    def _emit(self, seq: _Seq, num_tokens: int) -> None:
        start = seq.num_done + len(seq.request.resume_token_ids)
        num_tokens = min(num_tokens, seq.num_output_tokens - seq.num_done)
        pieces = [f" tok{start + i}" for i in range(num_tokens)]
        stopped = False
        if seq.request.stop:  # one piece more: does the token after these complete a stop string?
            pieces, stopped = _until_stop(seq, [*pieces, f" tok{start + num_tokens}"])
            pieces = pieces[:num_tokens]
            num_tokens = len(pieces)
        ids = tuple(TOKEN_ID_BASE + start + i for i in range(num_tokens))
        seq.num_done += num_tokens
        done = stopped or seq.num_done >= seq.num_output_tokens
        if done:
            self._running.pop(seq.request.id, None)
        reason = FinishReason.STOP if stopped else FinishReason.LENGTH if done else None
        seq.queue.put_nowait(EngineDelta(ids, "".join(pieces), reason, seq.prompt_tokens))


def _until_stop(seq: _Seq, pieces: list[str]) -> tuple[list[str], bool]:
    """The pieces before the first one that completes a stop string, and whether one did
    (``seq.tail`` advances over the pieces returned, except a lookahead piece: the last one)."""
    keep = max(len(s) for s in seq.request.stop)
    tail = seq.tail
    for i, piece in enumerate(pieces):
        text = tail + piece
        if any(s and s in text for s in seq.request.stop):
            return pieces[:i], True
        tail = text[-keep:]
        if i < len(pieces) - 1:
            seq.tail = tail
    return pieces, False
