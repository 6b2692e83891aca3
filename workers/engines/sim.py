"""The ``sim`` engine: a cost model of a real GPU that emits filler tokens at its pace.

Continuous batching as in the trace simulator, timed by the cost profile and divided by
``time_scale``:

- **Chunked prefill** (the default; what vLLM V1 and TensorRT-LLM with
  ``enable_chunked_prefill`` run, and what the ``vllm`` and ``trtllm`` workers configure):
  every iteration decodes every running request and spends the rest of its
  ``max_num_batched_tokens`` budget on prompt chunks, first of requests already prefilling
  (in admission order), then of newly admitted ones (up to ``max_num_seqs`` holding a slot).
  It costs the decode step plus each chunk's share of the prefill curve
  (``prefill(done + chunk) - prefill(done)``); an iteration with no decode pays
  ``prefill(0)`` once (``CostProfile.chunked_step_ms``, which the trace simulator's
  ``_chunked_iteration`` calls too).
  A request's first token comes at the end of the iteration that finishes its prompt.
- ``chunked_prefill=False``: vLLM v0's model, where an iteration either prefills newly
  admitted requests (up to ``max_num_batched_tokens`` prompt tokens; a longer prompt runs
  alone) or decodes every running request, never both (``_v0_iteration`` there).

With speculative decoding each decode yields 1 + (accepted drafts) tokens. No torch: it
exists for capacity planning and fleet-scale queueing benchmarks.

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
from lanes.scheduler.live_policy import MAX_NUM_BATCHED_TOKENS
from lanes.workers.engines.base import (
    EngineDead,
    EngineDelta,
    EngineRequest,
    RequestRejected,
    warm_up,
)

#: Filler tokens get ids from here up (a made-up vocabulary).
TOKEN_ID_BASE = 1000
#: Put in every waiting stream when the engine loop has died: ``generate`` raises ``EngineDead``.
_DEAD = EngineDelta((), "", None, 0)


@dataclass
class _Seq:
    request: EngineRequest
    prompt_tokens: int
    num_output_tokens: int
    queue: asyncio.Queue[EngineDelta] = field(default_factory=asyncio.Queue)
    num_done: int = 0
    #: Prompt tokens not yet prefilled (chunked prefill).
    prefill_left: int = 0
    #: The end of the text so far (as long as the longest stop string), for stop matching.
    tail: str = ""


def prompt_token_count(request: EngineRequest) -> int:
    """A tokenizer-free estimate (~4 characters per token) plus already streamed tokens."""
    num_chars = sum(len(m.content) for m in request.messages)
    return max(1, num_chars // 4) + len(request.resume_token_ids)


class SimEngine:
    name = "sim"

    def __init__(self, profile: CostProfile, *, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS, chunked_prefill: bool = True,
                 time_scale: float = 1.0, spec: SpecDecoding | None = None, seed: int = 0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if chunked_prefill and max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"with chunked prefill max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({max_num_seqs}): one token per decoding request")
        self.profile, self.max_concurrency = profile, max_num_seqs
        self.max_num_batched_tokens, self.time_scale, self.spec = max_num_batched_tokens, time_scale, spec
        self.chunked_prefill = chunked_prefill
        self._rng = random.Random(seed)
        self._waiting: deque[_Seq] = deque()
        #: Decoding; with chunked prefill, requests whose prompt is still being prefilled hold a
        #: slot in ``_prefilling`` (admission order) until their first token.
        self._running: dict[str, _Seq] = {}
        self._prefilling: dict[str, _Seq] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: Why the engine loop stopped, once it has (a bug: the worker then stops, as for a real engine).
        self._failure: BaseException | None = None
        self._num_steps = self._num_prefills = self._num_mixed = self._num_drafted = self._num_accepted = 0
        self._batch_sizes: Counter[int] = Counter()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="sim-engine")
        # Exercises the same path as the real engines' warm-up; the counters then start at 0.
        await warm_up(self, max_tokens=1)
        self._num_steps = self._num_prefills = self._num_mixed = self._num_drafted = self._num_accepted = 0
        self._batch_sizes.clear()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        if self._failure is not None:
            raise EngineDead(f"sim engine loop stopped: {self._failure!r}")
        remaining = request.max_tokens - len(request.resume_token_ids)
        if remaining <= 0:
            raise RequestRejected("bad_max_tokens", "max_tokens must exceed the tokens already streamed")
        seq = _Seq(request, prompt_token_count(request), remaining)
        self._waiting.append(seq)
        self._wake.set()
        try:
            while True:
                delta = await seq.queue.get()
                if delta is _DEAD:
                    raise EngineDead(f"sim engine loop stopped: {self._failure!r}")
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self._drop(seq, notify=False)

    async def abort(self, request_id: str) -> None:
        seq = (self._running.get(request_id) or self._prefilling.get(request_id)
               or next((s for s in self._waiting if s.request.id == request_id), None))
        if seq is not None:
            self._drop(seq, notify=True)

    def stats(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "running": len(self._running),
            "prefilling": len(self._prefilling),
            "waiting": len(self._waiting),
            #: Iterations that decoded; that prefilled (prompts or chunks of them); that did both.
            "steps": self._num_steps,
            "prefills": self._num_prefills,
            "mixed": self._num_mixed,
            "batch_size_hist": dict(sorted(self._batch_sizes.items())),
            "acceptance": self._num_accepted / self._num_drafted if self._num_drafted else None,
        }

    def _drop(self, seq: _Seq, *, notify: bool) -> None:
        was_live = self._running.pop(seq.request.id, None) is not None
        was_live = self._prefilling.pop(seq.request.id, None) is not None or was_live
        if seq in self._waiting:
            self._waiting.remove(seq)
            was_live = True
        if notify and was_live:
            seq.queue.put_nowait(EngineDelta((), "", FinishReason.CANCELLED, seq.prompt_tokens))

    async def _loop(self) -> None:
        try:
            await self._iterate()
        except Exception as exc:  # a bug in the model: fail every stream rather than hang them
            self._failure = exc
            for seq in [*self._waiting, *self._prefilling.values(), *self._running.values()]:
                seq.queue.put_nowait(_DEAD)
            raise

    async def _iterate(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        iteration = self._chunked_iteration if self.chunked_prefill else self._v0_iteration
        while True:
            if not self._waiting and not self._running and not self._prefilling:
                self._wake.clear()
                await self._wake.wait()
                next_at = loop.time()
            step_ms, decoding, prefilled = iteration()
            # An absolute schedule: sleep overheads do not add up over many steps.
            next_at = max(next_at, loop.time() - 0.05) + step_ms / 1000.0 / self.time_scale
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            for seq in decoding:  # (a request aborted during the sleep has left the table)
                if seq.request.id in self._running:
                    self._emit(seq, self._tokens_this_step())
            for seq in prefilled:
                if self.chunked_prefill:
                    if self._prefilling.pop(seq.request.id, None) is None:
                        continue
                    self._running[seq.request.id] = seq
                if seq.request.id in self._running:
                    self._emit(seq, 1)

    def _v0_iteration(self) -> tuple[float, list[_Seq], list[_Seq]]:
        """A prefill of newly admitted requests, or else a decode step of every running one:
        (its ms, the requests decoding, the requests whose prompt it prefills)."""
        batch = self._admit()
        if batch:
            self._num_prefills += 1
            return self.profile.prefill_step_ms(sum(s.prompt_tokens for s in batch)), [], batch
        return self._decode_step_ms(), list(self._running.values()), []

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

    def _chunked_iteration(self) -> tuple[float, list[_Seq], list[_Seq]]:
        """Every running request decodes; the rest of the token budget goes to prompt chunks.
        Returns (its ms, the requests decoding, the requests whose prompt it finishes)."""
        decoding = list(self._running.values())
        budget = self.max_num_batched_tokens - len(decoding)
        chunks: list[tuple[int, int]] = []  # (tokens already prefilled, tokens in this chunk)
        finished: list[_Seq] = []
        for seq in self._prefilling.values():
            if budget <= 0:
                break
            budget -= self._take_chunk(seq, budget, chunks, finished)
        while budget > 0 and self._waiting and len(self._running) + len(self._prefilling) < self.max_concurrency:
            seq = self._waiting.popleft()
            seq.prefill_left = seq.prompt_tokens
            self._prefilling[seq.request.id] = seq
            budget -= self._take_chunk(seq, budget, chunks, finished)
        self._num_prefills += bool(chunks)
        self._num_mixed += bool(chunks and decoding)
        step_ms = self.profile.chunked_step_ms(chunks, self._decode_step_ms() if decoding else None)
        return step_ms, decoding, finished

    @staticmethod
    def _take_chunk(seq: _Seq, budget: int, chunks: list[tuple[int, int]], finished: list[_Seq]) -> int:
        take = min(seq.prefill_left, budget)
        chunks.append((seq.prompt_tokens - seq.prefill_left, take))
        seq.prefill_left -= take
        if seq.prefill_left == 0:
            finished.append(seq)
        return take

    def _decode_step_ms(self) -> float:
        step_ms = self.profile.decode_step_ms(len(self._running), self._num_context_tokens())
        self._num_steps += 1
        self._batch_sizes[len(self._running)] += 1
        return self.spec.step_ms(step_ms) if self.spec else step_ms

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
