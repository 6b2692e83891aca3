"""TensorRT-LLM engine: ``tensorrt_llm.LLM`` (PyTorch backend) with speculative decoding.

``tensorrt_llm`` is imported only in ``start()``. ``generate_async(..., streaming=True)`` returns
one ``RequestOutput`` that is both the async iterator and the item it yields (mutated in place
each step; ``tensorrt_llm/executor/result.py``). ``StreamCursor`` reads its cumulative
``token_ids``, detokenizes them itself and cuts stop strings itself (see there why).

Checked against TensorRT-LLM 1.x (``tensorrt_llm/llmapi/llm.py``, ``executor/executor.py``):

- A shut-down executor makes ``generate_async`` raise ``RuntimeError("LLM is shutting down")``,
  and a fatal background error is re-raised as the original exception after ``shutdown()``.
  Neither message says "dead", so death is read from the executor's state
  (``llm._executor`` gone or ``is_shutdown()``), never from message text.
- Per-request failures arrive as ``RequestError`` (``executor/utils.py``): that request fails,
  the engine lives on.
- With chunked prefill on, the PyTorch backend checks no prompt length, so the adapter checks
  prompt + ``max_tokens`` against ``max_seq_len`` before submitting (``fit_max_tokens``).

The request must be created inside the running event loop: TRT-LLM creates its async queue
only when a loop exists at request creation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from lanes.queue.errors import ErrorCode
from lanes.queue.messages import FinishReason
from lanes.scheduler.policy import trtllm_priority
from lanes.workers.detokenize import (
    Decoder,
    IncrementalDetokenizer,
    StopMatcher,
    end_without_tokens,
)
from lanes.workers.engines.base import (
    ConfigError,
    EngineDead,
    EngineDelta,
    EngineError,
    EngineRequest,
    RequestRejected,
    render_chat,
    warm_up,
)
from lanes.workers.engines.engine_config import (
    ClassSpec,
    SpecCounters,
    check_checkpoint_quant,
    filter_supported,
    fit_max_tokens,
    map_finish_reason,
    max_sequence_tokens,
    remaining_tokens,
    supported_names,
    trtllm_llm_kwargs,
    trtllm_sampling_kwargs,
    validate,
)
from lanes.workers.settings import WorkerSettings

log = logging.getLogger(__name__)


class StreamCursor:
    """Turns the successive states of one streaming ``RequestOutput`` into our deltas.

    Reads the cumulative ``outputs[0].token_ids`` and hands out the ids past the last delta with
    their text from our own detokenizer: TensorRT-LLM is asked for none (``detokenize=False``).
    Its own starts each request from the answer's first token, so a resumed attempt's text lost
    the space at the join with SentencePiece tokenizers; ours is primed with the tokens earlier
    attempts streamed (``IncrementalDetokenizer``).

    Stop strings are cut here too (``StopMatcher``; TensorRT-LLM is given none): it matches them
    as token ids, so it misses one the model spells with other tokens, and where it does match,
    it drops the last tokens from ``token_ids`` after their first ones' text has gone out. Text
    that may start a stop string is held back while its tokens stream, and recomputed by a
    resumed attempt (``StopMatcher.resumed``), as for vLLM. At our own stop, TensorRT-LLM is still
    generating past it: the caller aborts it.
    """

    def __init__(self, prompt_tokens: int, decoder: Decoder, stop: Sequence[str] = (),
                 resume_ids: Sequence[int] = ()) -> None:
        self.prompt_tokens = prompt_tokens
        self._detok = IncrementalDetokenizer(decoder, tuple(resume_ids))
        self._stops = StopMatcher.resumed(tuple(stop), tuple(resume_ids), self._detok.emitted_text)
        self._num_ids = 0

    def out_of_tokens(self) -> EngineDelta:
        """The end of an answer whose earlier attempts spent its whole budget (as the hf engines
        end one: ``end_without_tokens``)."""
        text, stopped = end_without_tokens(self._detok, self._stops)
        return EngineDelta((), text, FinishReason.STOP if stopped else FinishReason.LENGTH, self.prompt_tokens)

    def step(self, output: Any) -> EngineDelta | None:
        if self._stops.stopped:
            return None
        completion = output.outputs[0] if output.outputs else None
        ids = list(completion.token_ids) if completion is not None else []
        new_ids = ids[self._num_ids:]
        self._num_ids = max(self._num_ids, len(ids))
        finish = None
        if output.finished:  # 'cancelled' is set before the final response: wait for it
            raw = completion.finish_reason if completion is not None else None
            finish = map_finish_reason(raw) or FinishReason.STOP
        ends = finish in (FinishReason.STOP, FinishReason.LENGTH)
        text = self._stops.push(self._detok.push(new_ids) + (self._detok.flush() if ends else ""))
        if self._stops.stopped:
            finish = FinishReason.STOP
        elif ends and not isinstance(getattr(completion, "stop_reason", None), str):
            # Held text goes out at the answer's own end; not at a stop string TensorRT-LLM
            # matched (were it given any: its ids are cut, their start is what is held), nor
            # when an attempt was cancelled or failed (a resumed one recomputes it).
            text += self._stops.flush()
        if not new_ids and not text and finish is None:
            return None
        return EngineDelta(tuple(new_ids), text, finish, self.prompt_tokens)


def engine_is_dead(llm: Any) -> bool:
    """The LLM's executor is gone or shutting down (``GenerationExecutor.is_shutdown``)."""
    executor = getattr(llm, "_executor", None) if llm is not None else None
    if executor is None:
        return True
    is_shutdown = getattr(executor, "is_shutdown", None)
    return bool(is_shutdown()) if callable(is_shutdown) else False


def error_from_exception(exc: BaseException, *, dead: bool) -> EngineError:
    """Map a TRT-LLM exception to our tree; ``dead`` is ``engine_is_dead`` read after it.

    Dead executor (or a newer release's ``EngineDeadError``) → EngineDead; ``RequestError`` →
    this request failed (``generation_failed``); argument checks (``ValueError``/``TypeError``)
    → ``prompt_too_long`` or ``invalid_request``; anything else → EngineError.
    """
    if isinstance(exc, EngineError):
        return exc
    names = {cls.__name__ for cls in type(exc).__mro__}
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if dead or "EngineDeadError" in names:
        return EngineDead(message)
    if "RequestError" in names:
        return RequestRejected(ErrorCode.GENERATION_FAILED, message)
    if names & {"ValueError", "TypeError"}:
        lowered = message.lower()
        long_prompt = "prompt length" in lowered or "max_seq_len" in lowered or "max_num_tokens" in lowered
        return RequestRejected("prompt_too_long" if long_prompt else "invalid_request", message)
    error = EngineError(message)
    error.__cause__ = exc
    return error


def build_class_spec(spec: ClassSpec, namespace: Any) -> Any | None:
    """Instantiate a ``ClassSpec`` from ``namespace`` (``tensorrt_llm.llmapi``).

    Tries ``fallbacks`` when the class is missing, renames ``speculative_model`` to the older
    ``speculative_model_dir`` where needed, and drops kwargs the class does not know. An
    optional spec the release lacks or rejects (e.g. ``waiting_queue_policy="priority"`` on a
    ``SchedulerConfig`` that knows only FCFS: a pydantic ``ValidationError``) builds nothing,
    with a warning; a required one raises ``ConfigError``.
    """
    for class_name in (spec.class_name, *spec.fallbacks):
        cls = getattr(namespace, class_name, None)
        if cls is not None:
            break
    else:
        if spec.optional:
            log.warning("this TensorRT-LLM release has no %s; running without it", spec.class_name)
            return None
        raise ConfigError(f"this TensorRT-LLM release has no {spec.class_name}")
    names = supported_names(cls)
    kwargs = dict(spec.kwargs)
    if "speculative_model" in kwargs and "speculative_model" not in names:
        kwargs["speculative_model_dir"] = kwargs.pop("speculative_model")
    kept, dropped = filter_supported(kwargs, names)
    if dropped:
        log.warning("%s lacks %s in this TensorRT-LLM release", class_name, dropped)
        if spec.optional and not kept:
            return None
    try:
        return cls(**kept)
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        reason = str(exc).splitlines()[0]
        if spec.optional:
            log.warning("this TensorRT-LLM release rejects %s(%s): %s; running without it",
                        class_name, kept, reason)
            return None
        raise ConfigError(f"this TensorRT-LLM release rejects {class_name}({kept}): {reason}") from exc


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


def _model_max_positions(llm: Any, model: str) -> int | None:
    config = getattr(llm, "_hf_model_config", None)
    if config is None:
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model)
        except (OSError, ValueError):
            return None
    return getattr(config, "max_position_embeddings", None)


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
        self.max_seq_len: int | None = None
        self._spec = SpecCounters()
        #: Optional config objects the installed release lacks or rejects (left out at start).
        self.dropped_args: list[str] = []

    async def start(self) -> None:
        import tensorrt_llm
        from tensorrt_llm import llmapi

        await asyncio.to_thread(check_checkpoint_quant, self.settings, engine="trtllm")
        try:
            # Inside the try: a release may reject one of the config objects.
            wanted = trtllm_llm_kwargs(self.settings)
            kwargs = build_llm_kwargs(wanted, llmapi)
            self.dropped_args = sorted(set(wanted) - set(kwargs))
            # Loading builds CUDA graphs and warms up for tens of seconds: off the event loop.
            self._llm = await asyncio.to_thread(lambda: tensorrt_llm.LLM(**kwargs))
        except ConfigError:
            raise
        except (ValueError, TypeError) as exc:  # LLM() validates its kwargs (pydantic)
            raise ConfigError(f"TensorRT-LLM rejected the settings: {str(exc).splitlines()[0]}") from exc
        except Exception as exc:
            raise EngineError(f"TensorRT-LLM failed to start: {exc}") from exc
        self._generate_params = supported_names(self._llm.generate_async)
        self._sampling_names = supported_names(tensorrt_llm.SamplingParams)
        self.max_seq_len = max_sequence_tokens(
            self.settings.max_model_len, getattr(getattr(self._llm, "args", None), "max_seq_len", None),
            _model_max_positions(self._llm, self.settings.model))
        if "priority" not in self._generate_params:
            log.warning("this TensorRT-LLM release has no per-request priority; lanes ordering "
                        "still holds in Redis")
        await warm_up(self)
        self._spec = SpecCounters()  # count served requests only

    def _hf_tokenizer(self) -> Any:
        tokenizer = self._llm.tokenizer
        return getattr(tokenizer, "tokenizer", tokenizer)  # TransformersTokenizer wraps the HF one

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        hf = self._hf_tokenizer()
        return list(hf.encode(render_chat(hf, request.messages), add_special_tokens=False))

    def _submit(self, request: EngineRequest, prompt_ids: list[int]) -> Any:
        import tensorrt_llm

        inputs = prompt_ids + list(request.resume_token_ids)
        max_tokens = fit_max_tokens(len(inputs), remaining_tokens(request), self.max_seq_len)
        sampling, _ = filter_supported(trtllm_sampling_kwargs(request, max_tokens), self._sampling_names)
        extra: dict[str, Any] = {}
        if "priority" in self._generate_params:
            extra["priority"] = trtllm_priority(request.lane)
        if "trace_headers" in self._generate_params and request.trace_headers:
            extra["trace_headers"] = dict(request.trace_headers)
        return self._llm.generate_async(
            inputs, sampling_params=tensorrt_llm.SamplingParams(**sampling), streaming=True, **extra)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        if engine_is_dead(self._llm):
            raise EngineDead("TensorRT-LLM engine is not running")
        prompt_ids = self._prompt_ids(request)
        if remaining_tokens(request) == 0:  # a resumed request that had already used its budget
            cursor = StreamCursor(len(prompt_ids), self._hf_tokenizer(), request.stop, request.resume_token_ids)
            yield cursor.out_of_tokens()
            return
        try:
            result = self._submit(request, prompt_ids)  # inside the loop (see module doc)
        except RequestRejected:
            raise
        except Exception as exc:
            raise error_from_exception(exc, dead=engine_is_dead(self._llm)) from exc
        self._running[request.id] = result
        cursor = StreamCursor(len(prompt_ids), self._hf_tokenizer(), request.stop, request.resume_token_ids)
        try:
            async for output in result:
                delta = cursor.step(output)
                if delta is None:
                    continue
                if delta.finish_reason is not None:
                    self._observe_spec(output)
                yield delta
                if delta.finish_reason is not None:
                    return  # at a stop string of ours the engine is still generating: aborted below
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise error_from_exception(exc, dead=engine_is_dead(self._llm)) from exc
        finally:
            self._running.pop(request.id, None)
            if not result.finished and not engine_is_dead(self._llm):
                result.abort()  # a stop string, or the consumer went away: free the slot and KV blocks

    def _observe_spec(self, output: Any) -> None:
        """Acceptance from a finished request: TRT-LLM reports its decoding iterations
        (``RequestOutput.decoding_iter``), and each iteration yields one token plus the drafts it
        accepted. Drafted tokens are counted as ``max_draft_len`` per iteration, so the rate is
        a lower bound when the n-gram drafter finds no match; the mean length is exact."""
        num_iters = int(getattr(output, "decoding_iter", 0) or 0)
        if self.settings.spec_method == "none" or num_iters <= 0 or not output.outputs:
            return
        num_tokens = len(output.outputs[0].token_ids)
        k = self.settings.num_speculative_tokens
        self._spec.observe(num_iters, num_iters * k, max(0, num_tokens - num_iters))

    async def abort(self, request_id: str) -> None:
        result = self._running.get(request_id)
        if result is not None and not result.finished:
            result.abort()  # synchronous; the stream then ends with finish_reason 'cancelled'

    def stats(self) -> dict[str, Any]:
        """Requests this adapter has in flight; engine iteration stats need
        ``return_perf_metrics`` / ``get_stats_async`` and are left to trtllm-serve's /metrics."""
        out: dict[str, Any] = {"engine": self.name, "active_requests": len(self._running),
                               "spec_method": self.settings.spec_method}
        if self.settings.spec_method != "none":
            out.update(self._spec.as_dict())
        return out

    async def close(self) -> None:
        for result in list(self._running.values()):
            if not result.finished:
                result.abort()
        if self._llm is not None:
            llm, self._llm = self._llm, None
            await asyncio.to_thread(llm.shutdown)


__all__ = ["StreamCursor", "TrtllmEngine", "build_class_spec", "build_llm_kwargs", "engine_is_dead",
           "error_from_exception"]
