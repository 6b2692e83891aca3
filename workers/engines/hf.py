"""transformers engine: continuous batching on CPU (or one GPU) for tests and the demo.

Uses transformers' ``ContinuousBatchingManager`` with an explicitly small paged cache (its
defaults size the cache from system RAM: ~7 GB even for a tiny model). Results arrive on
the manager's thread and are routed to per-request asyncio queues with
``register_result_handler`` (``call_soon_threadsafe``).

Sampling: the manager's generation config is global, so it is built with ``do_sample=True``
and per-request ``temperature`` / ``top_k`` / ``top_p`` processors (each exists only when the
global value is not neutral, hence the 0.7 and 0.99 placeholders; every request passes its own
values). A request with ``temperature == 0`` runs with ``top_k=1``, exact greedy decoding; a
sampled one with its ``top_p`` and this engine's ``top_k`` of 40. ``seed`` is not honoured: the
manager draws every request's token from one generator (OpenAI documents ``seed`` as best
effort; the ``vllm``, ``trtllm`` and speculative ``hf`` engines honour it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from lanes.queue.errors import ErrorCode
from lanes.queue.messages import FinishReason
from lanes.workers.detokenize import IncrementalDetokenizer, StopMatcher
from lanes.workers.engines.base import (
    EngineDead,
    EngineDelta,
    EngineRequest,
    RequestRejected,
    is_out_of_memory,
    load_failure,
    render_chat,
    warm_up,
)

log = logging.getLogger(__name__)

_DEFAULT_TOP_K = 40
_ABORTED = object()
#: How often a waiting request checks that the batching thread is still alive (s).
_LIVENESS_CHECK_S = 2.0


class HFEngine:
    """Engine protocol over transformers continuous batching."""

    name = "hf"

    def __init__(
        self,
        model_dir: str,
        *,
        max_slots: int = 8,
        device: str = "cpu",
        max_model_len: int = 0,
        kv_cache_tokens: int = 16384,
        page_size: int = 64,
        max_batch_tokens: int = 512,
    ) -> None:
        self.model_dir = model_dir
        self.max_concurrency = max_slots
        self._device = device
        self._max_model_len = max_model_len
        self._kv_cache_tokens = kv_cache_tokens
        self._page_size = page_size
        self._max_batch_tokens = max_batch_tokens
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._manager: Any = None
        self.tokenizer: Any = None
        self._eos_ids: set[int] = set()
        self._counters = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "aborted": 0, "errors": 0}

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        await warm_up(self)
        self._counters = dict.fromkeys(self._counters, 0)  # count served requests only

    def _load(self) -> None:
        import torch
        from transformers import (
            AutoModelForCausalLM,
            AutoTokenizer,
            ContinuousBatchingConfig,
            GenerationConfig,
        )

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=torch.float32, attn_implementation="sdpa"
            ).to(self._device)
        except Exception as exc:  # no config.json, unknown architecture, corrupt weights (SafetensorError)...
            raise load_failure(self.model_dir, exc) from exc
        model.eval()
        eos = model.generation_config.eos_token_id or self.tokenizer.eos_token_id
        self._eos_ids = set(eos if isinstance(eos, list) else [eos])
        if not self._max_model_len:
            self._max_model_len = int(getattr(model.config, "max_position_embeddings", 2048))
        gen_config = GenerationConfig(
            do_sample=True,
            temperature=0.7,  # != 1.0 so the per-request temperature processor exists
            top_k=_DEFAULT_TOP_K,
            top_p=0.99,  # < 1.0 so the per-request top-p processor exists
            max_new_tokens=256,
            eos_token_id=sorted(self._eos_ids),
            pad_token_id=self.tokenizer.pad_token_id,
        )
        cb_config = ContinuousBatchingConfig(
            page_size=self._page_size,
            num_blocks=max(8, self._kv_cache_tokens // self._page_size),
            max_batch_tokens=self._max_batch_tokens,
            max_requests_per_batch=self.max_concurrency,
            per_request_processors=True,
        )
        self._manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
        self._manager.start()

    def render_prompt(self, request: EngineRequest) -> list[int]:
        text = render_chat(self.tokenizer, request.messages)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        manager = self._manager
        if manager is None or not manager.is_running():
            raise EngineDead("continuous batching manager is not running")
        prompt_ids = self.render_prompt(request)
        if len(prompt_ids) >= self._max_model_len:
            raise RequestRejected(
                "prompt_too_long", f"prompt has {len(prompt_ids)} tokens; the model takes {self._max_model_len}"
            )
        resume = list(request.resume_token_ids)
        max_new = min(request.max_tokens - len(resume), self._max_model_len - len(prompt_ids) - len(resume))
        detok = IncrementalDetokenizer(self.tokenizer, resume)
        # The CB manager knows no stop strings: we cut the text. What an earlier attempt held back
        # as a possible stop string was never sent: the matcher holds it again.
        stops = StopMatcher.resumed(request.stop, resume, detok.emitted_text)
        if max_new <= 0:
            text = stops.push(detok.flush())
            reason = FinishReason.STOP if stops.stopped else FinishReason.LENGTH
            yield EngineDelta((), text + stops.flush(), reason, len(prompt_ids))
            return
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request.id] = queue
        manager.register_result_handler(request.id, queue.put_nowait)
        greedy = request.temperature <= 1e-5
        sampling = {"temperature": 1.0, "top_k": 1, "top_p": 1.0} if greedy else \
            {"temperature": float(request.temperature), "top_k": _DEFAULT_TOP_K, "top_p": float(request.top_p)}
        self._counters["requests"] += 1
        self._counters["prompt_tokens"] += len(prompt_ids)
        await asyncio.to_thread(
            manager.add_request, prompt_ids + resume, request_id=request.id, max_new_tokens=max_new,
            streaming=True, **sampling,
        )
        num_seen = 0  # generated_tokens counts only this run (resume ids are prompt to it)
        finished = False
        try:
            while True:
                try:
                    out = await asyncio.wait_for(queue.get(), _LIVENESS_CHECK_S)
                except asyncio.TimeoutError:
                    if self._manager is None or not self._manager.is_running():
                        raise EngineDead("continuous batching thread stopped") from None
                    continue
                if out is _ABORTED:
                    # An abort that came while ``add_request`` ran found nothing to cancel:
                    # cancel again now that the request exists (a second cancel is harmless).
                    self._release(request.id)
                    finished = True
                    yield EngineDelta((), detok.flush(), FinishReason.CANCELLED, len(prompt_ids))
                    return
                if out.error:
                    self._counters["errors"] += 1
                    if self._manager is None or not self._manager.is_running():
                        raise EngineDead(f"continuous batching stopped: {out.error}")
                    code = ErrorCode.OOM if is_out_of_memory(out.error) else ErrorCode.GENERATION_FAILED
                    raise RequestRejected(code, f"generation failed: {out.error}")
                new_ids = list(out.generated_tokens[num_seen:])
                num_seen = len(out.generated_tokens)
                finished = out.is_finished()
                reason = None
                if finished:
                    reason = FinishReason.STOP if new_ids and new_ids[-1] in self._eos_ids else FinishReason.LENGTH
                if reason is FinishReason.STOP:
                    new_ids_text = detok.push(new_ids[:-1]) + detok.flush()
                else:
                    new_ids_text = detok.push(new_ids) + (detok.flush() if finished else "")
                new_ids_text = stops.push(new_ids_text)
                if stops.stopped:  # a stop string: the answer ends before it; free the slot now
                    finished, reason = True, FinishReason.STOP
                    self._release(request.id)
                elif finished:
                    new_ids_text += stops.flush()
                self._counters["generated_tokens"] += len(new_ids)
                if new_ids or finished:
                    yield EngineDelta(tuple(new_ids), new_ids_text, reason, len(prompt_ids))
                if finished:
                    return
        finally:
            self._queues.pop(request.id, None)
            if not finished and self._manager is not None:
                self._release(request.id)

    async def abort(self, request_id: str) -> None:
        queue = self._queues.get(request_id)
        if queue is None or self._manager is None:
            return
        self._counters["aborted"] += 1
        self._release(request_id)
        queue.put_nowait(_ABORTED)

    def _release(self, request_id: str) -> None:
        # A cancelled CB request never gets a final output, so its result handler would
        # stay registered forever: drop it ourselves (no public API for this in 5.24).
        self._manager.cancel_request(request_id)
        router = self._manager.output_router
        with router._lock:
            router.result_handlers.pop(request_id, None)

    def stats(self) -> dict[str, Any]:
        return {"engine": self.name, "running": len(self._queues), "kv_cache_usage": self._kv_usage(),
                "at_ms": int(time.time() * 1000), **self._counters}

    def _kv_usage(self) -> float | None:
        """Share of the paged KV cache that running requests hold: 0 when idle. Not 1 - the
        cache's free capacity: a finished request's complete blocks stay cached for prefix reuse
        (evicted when memory is short) and do not count as free. Read from transformers'
        internals (5.x): each allocator's block table, one list of block ids per live request."""
        try:
            cache = self._manager.batch_processor.cache
            held_bytes = 0
            for allocator in cache.cache_allocators.values():
                # list(): one step under the GIL, as the batching thread adds and drops requests
                held = {block for blocks in list(allocator.block_table.values()) for block in blocks}
                held_bytes += len(held) * allocator.bytes_per_block
            return round(held_bytes / (cache.num_sectors * cache.bytes_per_sector), 4)
        except (AttributeError, TypeError, ValueError, ZeroDivisionError, RuntimeError):
            return None

    async def close(self) -> None:
        if self._manager is not None:
            manager, self._manager = self._manager, None
            await asyncio.to_thread(manager.stop, block=True, timeout=10)
