"""TensorRT-LLM engine: ``tensorrt_llm.LLM`` (PyTorch backend) with speculative decoding.

``tensorrt_llm`` is imported only in ``start()``. ``generate_async(..., streaming=True)`` returns
one ``RequestOutput`` that is both the async iterator and the item it yields (mutated in place
each step), so the mapping reads the per-step ``text_diff`` / ``token_ids_diff`` of
``outputs[0]`` (``tensorrt_llm/executor/result.py``). ``delta_from_output`` and
``error_from_exception`` are pure and tested with objects of that shape.

The request must be created inside the running event loop: TRT-LLM creates its async queue
only when a loop exists at request creation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from lanes.queue.messages import FinishReason
from lanes.scheduler.policy import trtllm_priority
from lanes.workers.engines.base import (
    EngineDead, EngineDelta, EngineError, EngineRequest, RequestRejected,
)
from lanes.workers.engines.engine_config import (
    ClassSpec, filter_supported, map_finish_reason, remaining_tokens, supported_names,
    trtllm_llm_kwargs, trtllm_sampling_kwargs, validate,
)
from lanes.workers.settings import WorkerSettings

log = logging.getLogger(__name__)


def delta_from_output(output: Any, prompt_tokens: int) -> EngineDelta | None:
    """Map one streaming step of a TRT-LLM ``RequestOutput`` (None when it carries nothing).

    ``finish_reason`` is ``stop|length|timeout|cancelled``; ``output.finished`` ends the stream.
    """
    completion = output.outputs[0] if output.outputs else None
    token_ids = tuple(completion.token_ids_diff) if completion is not None else ()
    text = completion.text_diff if completion is not None else ""
    finish = map_finish_reason(completion.finish_reason) if completion is not None else None
    if output.finished and finish is None:
        finish = FinishReason.STOP
    if not output.finished:
        finish = None  # 'cancelled' is set before the final response: wait for it
    if not token_ids and not text and finish is None:
        return None
    return EngineDelta(token_ids, text, finish, prompt_tokens)


def error_from_exception(exc: BaseException) -> EngineError:
    """Map a TRT-LLM exception to our tree by class name (no tensorrt_llm import needed).

    Argument checks in ``generate_async`` raise ``ValueError`` (prompt longer than
    ``max_seq_len`` / ``max_num_tokens``) → rejected; a shut-down executor → EngineDead;
    per-request ``RequestError`` and the rest → EngineError.
    """
    if isinstance(exc, EngineError):
        return exc
    names = {cls.__name__ for cls in type(exc).__mro__}
    message = str(exc) or type(exc).__name__
    lowered = message.lower()
    if "shutdown" in lowered or "shut down" in lowered or "executor is dead" in lowered:
        return EngineDead(message)
    if names & {"ValueError", "TypeError"}:
        long_prompt = "prompt length" in lowered or "max_seq_len" in lowered \
            or "max_num_tokens" in lowered
        return RequestRejected("prompt_too_long" if long_prompt else "invalid_request", message)
    error = EngineError(message)
    error.__cause__ = exc
    return error


def build_class_spec(spec: ClassSpec, namespace: Any) -> Any | None:
    """Instantiate a ``ClassSpec`` from ``namespace`` (``tensorrt_llm.llmapi``).

    Tries ``fallbacks`` when the class is missing, renames ``speculative_model`` to the older
    ``speculative_model_dir`` where needed, and drops kwargs the class does not know.
    """
    for class_name in (spec.class_name, *spec.fallbacks):
        cls = getattr(namespace, class_name, None)
        if cls is not None:
            break
    else:
        if spec.optional:
            return None
        raise EngineError(f"this TensorRT-LLM release has no {spec.class_name}")
    names = supported_names(cls)
    kwargs = dict(spec.kwargs)
    if "speculative_model" in kwargs and "speculative_model" not in names:
        kwargs["speculative_model_dir"] = kwargs.pop("speculative_model")
    kept, dropped = filter_supported(kwargs, names)
    if dropped:
        log.warning("%s lacks %s in this TensorRT-LLM release", class_name, dropped)
        if spec.optional and not kept:
            return None
    return cls(**kept)


def build_llm_kwargs(kwargs: Mapping[str, Any], namespace: Any) -> dict[str, Any]:
    """Turn ``trtllm_llm_kwargs`` data into real objects (optional ones may vanish)."""
    built: dict[str, Any] = {}
    for key, value in kwargs.items():
        if isinstance(value, ClassSpec):
            value = build_class_spec(value, namespace)
            if value is None:
                continue
        built[key] = value
    return built


class TrtllmEngine:
    """The Engine protocol on ``tensorrt_llm.LLM``."""

    name = "trtllm"

    def __init__(self, settings: WorkerSettings) -> None:
        validate(settings)
        self.settings = settings
        self.max_concurrency = settings.max_slots
        self._llm: Any = None
        self._running: dict[str, Any] = {}
        self._generate_params: frozenset[str] = frozenset()
        self._sampling_names: frozenset[str] = frozenset()

    async def start(self) -> None:
        import tensorrt_llm
        from tensorrt_llm import llmapi

        kwargs = build_llm_kwargs(trtllm_llm_kwargs(self.settings), llmapi)
        try:
            # Loading builds CUDA graphs and warms up for tens of seconds: off the event loop.
            self._llm = await asyncio.to_thread(lambda: tensorrt_llm.LLM(**kwargs))
        except Exception as exc:
            raise EngineError(f"TensorRT-LLM failed to start: {exc}") from exc
        self._generate_params = supported_names(self._llm.generate_async)
        self._sampling_names = supported_names(tensorrt_llm.SamplingParams)
        if "priority" not in self._generate_params:
            log.warning("this TensorRT-LLM release has no per-request priority; lanes ordering "
                        "still holds in Redis")

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        tokenizer = self._llm.tokenizer
        hf = getattr(tokenizer, "tokenizer", tokenizer)  # TransformersTokenizer wraps the HF one
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(hf.encode(text, add_special_tokens=False))

    def _submit(self, request: EngineRequest, prompt_ids: list[int]) -> Any:
        import tensorrt_llm

        sampling, _ = filter_supported(trtllm_sampling_kwargs(request), self._sampling_names)
        extra: dict[str, Any] = {}
        if "priority" in self._generate_params:
            extra["priority"] = trtllm_priority(request.lane)
        if "trace_headers" in self._generate_params and request.trace_headers:
            extra["trace_headers"] = dict(request.trace_headers)
        return self._llm.generate_async(
            prompt_ids + list(request.resume_token_ids),
            sampling_params=tensorrt_llm.SamplingParams(**sampling), streaming=True, **extra)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        if self._llm is None:
            raise EngineDead("TensorRT-LLM engine is not started")
        prompt_ids = self._prompt_ids(request)
        if remaining_tokens(request) == 0:
            yield EngineDelta((), "", FinishReason.LENGTH, len(prompt_ids))
            return
        try:
            result = self._submit(request, prompt_ids)  # inside the loop (see module doc)
        except Exception as exc:
            raise error_from_exception(exc) from exc
        self._running[request.id] = result
        finished = False
        try:
            async for output in result:
                delta = delta_from_output(output, len(prompt_ids))
                if delta is not None:
                    finished = delta.finish_reason is not None
                    yield delta
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise error_from_exception(exc) from exc
        finally:
            self._running.pop(request.id, None)
            if not finished and not result.finished:
                result.abort()  # the consumer went away: free the slot and KV blocks

    async def abort(self, request_id: str) -> None:
        result = self._running.get(request_id)
        if result is not None and not result.finished:
            result.abort()  # synchronous; the stream then ends with finish_reason 'cancelled'

    def stats(self) -> dict[str, Any]:
        """Requests this adapter has in flight; engine iteration stats need
        ``return_perf_metrics`` / ``get_stats_async`` and are left to trtllm-serve's /metrics."""
        return {"engine": self.name, "active_requests": len(self._running),
                "spec_method": self.settings.spec_method}

    async def close(self) -> None:
        for result in list(self._running.values()):
            if not result.finished:
                result.abort()
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)


__all__ = ["TrtllmEngine", "build_class_spec", "build_llm_kwargs", "delta_from_output",
           "error_from_exception"]
