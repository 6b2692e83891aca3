"""Speculative decoding on transformers (CPU or CUDA) with exact acceptance accounting.

Why our own loop rather than ``generate(assistant_model=...)``: ``generate`` reports no
acceptance, ignores ``num_assistant_tokens`` passed to it, and has no cancel hook. The loop
here is the greedy draft-verify loop of ``reference/cpu-engine.md``: the target's KV cache
always covers ``seq[:-1]``; each step drafts up to k tokens (draft model, or an n-gram found
earlier in the prompt + output: "prompt lookup"), verifies them in ONE target forward, keeps
the longest agreeing prefix plus the target's own next token, and crops both caches back.
Greedy output is therefore token-for-token the target's plain greedy output.

Sampling (``temperature > 0``) runs plain one-token-per-forward sampling without speculation:
exact speculative *sampling* needs the rejection-sampling correction, which this CPU/demo engine
does not implement.

Requests run at batch size 1 (assisted decoding is batch-1 only), each in a worker thread of a
small pool (``max_concurrency``, default 1: torch already uses every core). Cancel is a
``threading.Event`` checked between forwards, so an abort lands within one forward.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch
from lanes.queue.messages import FinishReason
from lanes.workers.detokenize import IncrementalDetokenizer, StopMatcher, end_without_tokens
from lanes.workers.engines.base import (
    EngineDead,
    EngineDelta,
    EngineError,
    EngineRequest,
    RequestRejected,
    load_failure,
    render_chat,
    warm_up,
)
from lanes.workers.engines.engine_config import SpecCounters, remaining_tokens
from lanes.workers.settings import WorkerSettings

HFSpecMethod = Literal["none", "draft_model", "prompt_lookup"]
def prompt_lookup(seq: Sequence[int], num_tokens: int, max_ngram: int) -> list[int]:
    """Draft by copying what followed the latest earlier occurrence of the trailing n-gram
    (longest n first), as transformers' ``prompt_lookup_num_tokens`` and vLLM's ``ngram`` do."""
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        tail = list(seq[-n:])
        for start in range(len(seq) - n - 1, -1, -1):
            if list(seq[start:start + n]) == tail:
                return list(seq[start + n:start + n + num_tokens])
    return []


class HFSpeculativeEngine:
    """The Engine protocol on transformers, greedy speculative decoding at batch size 1."""

    name = "hf_spec"

    def __init__(self, model_dir: str | Path, *, draft_dir: str | Path | None = None,
                 method: HFSpecMethod = "draft_model", num_speculative_tokens: int = 4,
                 device: str = "cpu", max_concurrency: int = 1, prompt_lookup_max: int = 3,
                 max_model_len: int = 0) -> None:
        if method == "draft_model" and draft_dir is None:
            raise EngineError("method=draft_model needs draft_dir")
        self.model_dir, self.draft_dir = Path(model_dir), draft_dir and Path(draft_dir)
        self.method, self.k = method, num_speculative_tokens
        self.device, self.max_concurrency = torch.device(device), max_concurrency
        self.prompt_lookup_max = prompt_lookup_max
        #: Prompt + answer tokens the model takes (0: the model's ``max_position_embeddings``).
        self._max_model_len = max_model_len
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="hf-spec")
        self._cancels: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._spec = SpecCounters()
        self._counts = {"target_forwards": 0, "draft_forwards": 0, "tokens_generated": 0,
                        "running": 0, "waiting": 0}
        self._target: Any = None
        self._draft: Any = None
        self._tokenizer: Any = None
        self._eos_ids: frozenset[int] = frozenset()

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> HFSpeculativeEngine:
        method: HFSpecMethod = {"ngram": "prompt_lookup", "prompt_lookup": "prompt_lookup",
                                "draft_model": "draft_model"}.get(settings.spec_method, "none")
        return cls(settings.model, draft_dir=settings.draft_model or None, method=method,
                   num_speculative_tokens=settings.num_speculative_tokens, device=settings.torch_device,
                   max_model_len=settings.max_model_len)

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        await warm_up(self)
        with self._lock:  # count served requests only
            self._spec = SpecCounters()
            self._counts.update(target_forwards=0, draft_forwards=0, tokens_generated=0)

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        def load(path: Path) -> Any:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            return model.to(self.device).eval()

        try:
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            self._target = load(self.model_dir)
        except Exception as exc:  # no config.json, unknown architecture, corrupt weights (SafetensorError)...
            raise load_failure(self.model_dir, exc) from exc
        if self.method == "draft_model":
            try:
                self._draft = load(self.draft_dir)
            except Exception as exc:  # the draft's own directory is the one to fix, not the target's
                raise load_failure(self.draft_dir, exc, "--draft-model / LANES_DRAFT_MODEL") from exc
        eos = self._target.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self._tokenizer.eos_token_id is not None:
            eos_ids.add(self._tokenizer.eos_token_id)
        self._eos_ids = frozenset(eos_ids)
        if not self._max_model_len:
            self._max_model_len = int(getattr(self._target.config, "max_position_embeddings", 2048))

    def prompt_ids(self, request: EngineRequest) -> list[int]:
        return list(self._tokenizer.encode(render_chat(self._tokenizer, request.messages),
                                           add_special_tokens=False))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        if self._target is None:
            raise EngineDead("hf_spec engine is not started")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[EngineDelta | BaseException] = asyncio.Queue()
        cancel = self._cancels[request.id] = threading.Event()

        def emit(item: EngineDelta | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop closed under us: nobody is listening
                cancel.set()

        with self._lock:
            self._counts["waiting"] += 1
        loop.run_in_executor(self._pool, self._run, request, cancel, emit)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            cancel.set()  # consumer gone or done: stop the thread at its next step
            self._cancels.pop(request.id, None)

    def _run(self, request: EngineRequest, cancel: threading.Event,
             emit: Callable[[EngineDelta | BaseException], None]) -> None:
        with self._lock:
            self._counts["waiting"] -= 1
            self._counts["running"] += 1
        try:
            self._decode_request(request, cancel, emit)
        except RequestRejected as exc:  # this request's fault (its chat template): as it is
            emit(exc)
        except Exception as exc:  # noqa: BLE001 - delivered to the consumer
            emit(EngineError(f"hf_spec generation failed: {exc}"))
        finally:
            with self._lock:
                self._counts["running"] -= 1

    def _decode_request(self, request: EngineRequest, cancel: threading.Event,
                        emit: Callable[[EngineDelta | BaseException], None]) -> None:
        prompt = self.prompt_ids(request)
        n_prompt = len(prompt)
        if n_prompt >= self._max_model_len:  # as HFEngine and the vLLM / TensorRT-LLM adapters
            raise RequestRejected("prompt_too_long",
                                  f"prompt has {n_prompt} tokens; the model takes {self._max_model_len}")
        # The answer ends where the context does (finish "length"), as on the other engines.
        max_new = max(0, min(remaining_tokens(request),
                             self._max_model_len - n_prompt - len(request.resume_token_ids)))
        # As the hf engine: the text of the tokens an earlier attempt streamed is the base (less
        # a partial character it held), and what it held back as a possible stop string is held
        # again, so it is sent (or the stop spanning the seam is cut). Before, the base counted
        # that held text as sent: it was lost at every hand-back.
        detok = IncrementalDetokenizer(self._tokenizer, request.resume_token_ids)
        stops = StopMatcher.resumed(request.stop, request.resume_token_ids, detok.emitted_text)
        if max_new == 0:
            text, stopped = end_without_tokens(detok, stops)
            emit(EngineDelta((), text, FinishReason.STOP if stopped else FinishReason.LENGTH, n_prompt))
            return
        ids = prompt + list(request.resume_token_ids)
        steps = (self._greedy_steps(ids, max_new, cancel) if request.temperature <= 0
                 else self._sampled_steps(ids, max_new, cancel, request))
        produced = 0
        for new in steps:
            produced += len(new)
            eos = bool(self._eos_ids.intersection(new))
            ends = eos or produced >= max_new
            chunk = stops.push(detok.push(new) + (detok.flush() if ends else ""))
            finish = None
            if stops.stopped or eos:
                finish = FinishReason.STOP
            elif ends:
                finish = FinishReason.LENGTH
            if finish is not None and not stops.stopped:
                chunk += stops.flush()
            with self._lock:
                self._counts["tokens_generated"] += len(new)
            emit(EngineDelta(tuple(new), chunk, finish, n_prompt))
            if finish is not None:
                return
        emit(EngineDelta((), "", FinishReason.CANCELLED, n_prompt))

    def _forward(self, model: Any, ids: Sequence[int], cache: Any, counter: str) -> torch.Tensor:
        with self._lock:
            self._counts[counter] += 1
        tensor = torch.tensor([list(ids)], device=self.device)
        return model(input_ids=tensor, cache=cache).logits[0]

    @torch.inference_mode()
    def _greedy_steps(self, ids: list[int], max_new: int,
                      cancel: threading.Event) -> Iterator[list[int]]:
        """Yield each step's accepted tokens; with no drafter this is plain greedy decoding."""
        from transformers import DynamicCache

        target_cache = DynamicCache(config=self._target.config)
        draft_cache = DynamicCache(config=self._draft.config) if self._draft else None
        seq = list(ids)
        seq.append(int(self._forward(self._target, seq, target_cache, "target_forwards")[-1]
                       .argmax()))  # the target cache now covers seq[:-1]
        produced = 1
        yield [seq[-1]]
        while produced < max_new and seq[-1] not in self._eos_ids and not cancel.is_set():
            k = min(self.k, max_new - produced - 1)  # drafts + the bonus token fit max_new
            draft = self._draft_tokens(seq, k, draft_cache) if k > 0 else []
            k = len(draft)
            logits = self._forward(self._target, [seq[-1], *draft], target_cache,
                                   "target_forwards")
            verified = logits.argmax(-1).tolist()
            n = 0
            while n < k and draft[n] == verified[n]:
                n += 1
            # A draft ends at its first eos (``_draft_tokens``); accepted, that eos ends the answer
            # and no bonus token follows it.
            ended = n > 0 and draft[n - 1] in self._eos_ids
            if k > n:
                target_cache.crop(-(k - n))
            if draft_cache is not None and draft_cache.get_seq_length() > len(seq) + n:
                draft_cache.crop(-(draft_cache.get_seq_length() - len(seq) - n))
            new = draft[:n] if ended else draft[:n] + [verified[n]]
            if k:
                with self._lock:
                    self._spec.observe(1, k, n)
            seq.extend(new)
            produced += len(new)
            yield new

    def _draft_tokens(self, seq: list[int], k: int, draft_cache: Any) -> list[int]:
        """Up to ``k`` proposed tokens, ending at the first eos: nothing after it can be used."""
        if self.method == "prompt_lookup":
            proposed = prompt_lookup(seq, k, self.prompt_lookup_max)
            return proposed[:next((i + 1 for i, t in enumerate(proposed) if t in self._eos_ids), len(proposed))]
        if draft_cache is None:
            return []
        drafted: list[int] = []
        feed = seq[draft_cache.get_seq_length():]
        for _ in range(k):
            token = int(self._forward(self._draft, feed, draft_cache, "draft_forwards")[-1]
                        .argmax())
            drafted.append(token)
            if token in self._eos_ids:
                break
            feed = [token]
        return drafted

    @torch.inference_mode()
    def _sampled_steps(self, ids: list[int], max_new: int, cancel: threading.Event,
                       request: EngineRequest) -> Iterator[list[int]]:
        """Plain temperature / top-p sampling, one token per target forward (no speculation)."""
        from transformers import DynamicCache

        generator = torch.Generator(device=self.device)
        generator.manual_seed(request.seed if request.seed is not None else
                              int(torch.randint(0, 2**31 - 1, ()).item()))
        cache, feed = DynamicCache(config=self._target.config), list(ids)
        for _ in range(max_new):
            if cancel.is_set():
                return
            logits = self._forward(self._target, feed, cache, "target_forwards")[-1]
            probs = torch.softmax(logits.float() / request.temperature, dim=-1)
            if request.top_p < 1.0:
                sorted_probs, order = probs.sort(descending=True)
                drop = sorted_probs.cumsum(-1) - sorted_probs > request.top_p
                probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
            token = int(torch.multinomial(probs, 1, generator=generator).item())
            yield [token]
            if token in self._eos_ids:
                return
            feed = [token]

    async def abort(self, request_id: str) -> None:
        cancel = self._cancels.get(request_id)
        if cancel is not None:
            cancel.set()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self._counts)
            spec = self._spec.as_dict()
        return {"engine": self.name, "spec_method": self.method, **counts, **spec}

    async def close(self) -> None:
        for cancel in list(self._cancels.values()):
            cancel.set()
        await asyncio.to_thread(self._pool.shutdown, wait=True)
        self._target = self._draft = None
