"""A stand-in ``vllm`` package whose behaviour copies vLLM's own code, for the adapter tests on
machines without a GPU. Each piece names the upstream file (vllm-project/vllm) and version it
mirrors; the model itself is replaced by a ``Script`` of tokens per request.

Two releases are mirrored where they differ:

- ``V0_11`` (vLLM 0.11.x): ``vllm/v1/engine/exceptions.py`` has ``EngineGenerateError`` and
  ``EngineDeadError``; request validation raises ``ValueError``; ``AsyncLLM.generate`` re-raises
  ``EngineDeadError`` and ``ValueError`` and wraps anything else as ``EngineGenerateError() from
  e``; ``AsyncEngineArgs`` has no ``max_num_queued_reqs``; ``get_tokenizer`` is ``async``.
- ``MAIN`` (vLLM main, 2026, as in ``reference/engines.md``): ``vllm/exceptions.py`` adds
  ``VLLMError`` → ``VLLMClientError`` → ``VLLMValidationError``, and ``GracefulHTTPError(VLLMError)``
  → ``QueueOverflowError`` / ``MaxQueuedTokensError`` (the admission control behind
  ``max_num_queued_reqs``: HTTP 503, "try again later"). ``AsyncLLM.generate`` re-raises
  ``EngineDeadError`` and ``VLLMClientError`` and wraps the rest (a full queue included) as
  ``EngineGenerateError() from e``; ``get_tokenizer`` is a plain ``def``.

Common to both (``vllm/v1/engine/async_llm.py``, ``vllm/outputs.py``, ``vllm/sampling_params.py``):
DELTA outputs carry only new tokens/text, the last one ``finished`` with a ``finish_reason``;
cancelling the consumer aborts the request; ``abort()`` ends it with ``'abort'``; a prompt longer
than ``max_model_len`` is a validation error raised when the request is added; stat loggers
are factories ``(vllm_config, engine_index)`` whose ``record(scheduler_stats, iteration_stats,
mm_cache_stats=..., engine_idx=...)`` runs every engine step, with ``SchedulerStats.
spec_decoding_stats`` (``vllm/v1/spec_decode/metrics.py``: ``num_drafts``, ``num_draft_tokens``,
``num_accepted_tokens``).
"""

from __future__ import annotations

import asyncio
import enum
import importlib.machinery
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

V0_11 = "0.11.2"
MAIN = "main"


# -- vllm/v1/engine/exceptions.py (both releases) ------------------------------------------------

class EngineGenerateError(Exception):
    """Raised by AsyncLLM.generate() when a request fails unexpectedly (no message of its own)."""


class EngineDeadError(Exception):
    def __init__(self, *args: Any, suppress_context: bool = False) -> None:
        super().__init__("EngineCore encountered an issue. See stack trace (above) for the root cause.")


# -- vllm/exceptions.py (main) -------------------------------------------------------------------

class VLLMError(Exception):
    pass


class VLLMClientError(VLLMError):
    pass


class VLLMValidationError(VLLMClientError):
    pass


class GracefulHTTPError(VLLMError):
    def __init__(self, message: str, http_status: HTTPStatus) -> None:
        super().__init__(message)
        self.message, self.http_status = message, http_status


class QueueOverflowError(GracefulHTTPError):
    def __init__(self) -> None:
        super().__init__("The engine is currently busy and cannot accept new requests. "
                         "Please try again later or on a different instance.", HTTPStatus.SERVICE_UNAVAILABLE)


class MaxQueuedTokensError(GracefulHTTPError):
    def __init__(self) -> None:
        super().__init__("The engine has reached its prefill token backlog limit. "
                         "Please try again later or on a different instance.", HTTPStatus.SERVICE_UNAVAILABLE)


# -- vllm/sampling_params.py, vllm/inputs, vllm/outputs.py --------------------------------------

class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE


def TokensPrompt(prompt_token_ids: list[int]) -> dict[str, Any]:  # noqa: N802 - a TypedDict upstream
    return {"prompt_token_ids": prompt_token_ids}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool


# -- vllm/engine/arg_utils.py ---------------------------------------------------------------------

@dataclass
class AsyncEngineArgs:
    """The fields the adapter may pass (main has ``max_num_queued_reqs``; 0.11 does not)."""

    model: str = "facebook/opt-125m"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    scheduling_policy: str = "fcfs"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    disable_log_stats: bool = False
    enforce_eager: bool = False
    quantization: str | None = None
    speculative_config: dict[str, Any] | None = None
    max_num_queued_reqs: int | None = None


@dataclass
class AsyncEngineArgs011:
    model: str = "facebook/opt-125m"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    scheduling_policy: str = "fcfs"
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    disable_log_stats: bool = False
    enforce_eager: bool = False
    quantization: str | None = None
    speculative_config: dict[str, Any] | None = None


# -- vllm/v1/engine/detokenizer.py (FastIncrementalDetokenizer, main as of 2025-26) ---------------

class Detokenizer:
    """vLLM's streaming text for one request: a ``DecodeStream`` primed with the prompt's end,
    stop strings checked on the whole output (``StopChecker.check_stop_strings``) and, while
    running, the last ``max(len(stop)) - 1`` characters held back (``stop_buffer_length``)
    although their tokens are streamed."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], params: SamplingParams) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer._tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        suffix = prompt_ids
        if len(prompt_ids) > 4:
            for i in range(4, min(len(prompt_ids) + 1, 24)):
                if "\ufffd" not in self.tokenizer.decode(prompt_ids[-i:]):
                    suffix = prompt_ids[-i:]
                    break
        for tid in suffix:
            self.stream.step(self.tokenizer, tid)
        stop = params.stop
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        self.stop_buffer_length = max((len(s) for s in self.stop), default=1) - 1
        self.output_text, self._last_offset = "", 0

    def update(self, token: int) -> str | None:
        """Decode one token; the stop string it completes, if any (the text is cut before it)."""
        new = self.stream.step(self.tokenizer, token) or ""
        self.output_text += new
        for stop in self.stop:
            index = self.output_text.find(stop, 1 - len(new) - len(stop))
            if index != -1:
                self.output_text = self.output_text[:index]
                return stop
        return None

    def next_output_text(self, finished: bool) -> str:
        length = len(self.output_text) - (0 if finished else self.stop_buffer_length)
        if self._last_offset < length:
            text, self._last_offset = self.output_text[self._last_offset:length], length
            return text
        return ""


# -- the model and the engine ---------------------------------------------------------------------

@dataclass
class Script:
    """What the fake model answers: token ids (text is ``" t<id>"`` each), then a finish."""

    token_ids: list[int]
    finish: str = "stop"
    #: Raised when the request is added (validation, admission control).
    error_on_add: BaseException | None = None
    #: Accepted drafts per step reported to stat loggers (speculation).
    accepted_per_step: int = 0


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    spec_decoding_stats: SpecDecodingStats | None = None


@dataclass
class Added:
    prompt: dict[str, Any]
    params: SamplingParams
    request_id: str
    priority: int
    trace_headers: Any


class StatLoggerBase:
    """``vllm/v1/metrics/loggers.py``: the interface custom stat loggers implement."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None: ...

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None: ...

    def log_engine_initialized(self) -> None: ...


class AsyncLLM:
    """``vllm/v1/engine/async_llm.py`` ``AsyncLLM`` on a scripted model."""

    release = MAIN
    package: Package

    def __init__(self, engine_args: Any, stat_loggers: list[Any]) -> None:
        self.engine_args = engine_args
        self.loggers = [factory(None, 0) for factory in stat_loggers]
        for logger in self.loggers:
            logger.log_engine_initialized()
        self.added: list[Added] = []
        self.aborted: list[str] = []
        self.errored = False
        self._aborts: dict[str, asyncio.Event] = {}
        self.package.engines.append(self)

    @classmethod
    def from_engine_args(cls, engine_args: Any, start_engine_loop: bool = True, usage_context: Any = None,
                         stat_loggers: list[Any] | None = None) -> AsyncLLM:
        if engine_args.speculative_config and engine_args.speculative_config.get("method") == "draft_model" \
                and cls.release == V0_11:
            raise NotImplementedError("Speculative decoding with draft model is not supported yet.")
        return cls(engine_args, stat_loggers or [])

    def _tokenizer(self) -> Any:
        return self.package.tokenizer

    async def _add_request(self, prompt: dict[str, Any], params: SamplingParams, request_id: str,
                           priority: int, trace_headers: Any) -> Script:
        if self.errored:
            raise EngineDeadError()
        max_len = self.engine_args.max_model_len or 2048
        num = len(prompt["prompt_token_ids"])
        if num > max_len:
            message = (f"The decoder prompt (length {num}) is longer than the maximum model length "
                       f"of {max_len}. Make sure that `max_model_len` is no smaller than the number "
                       "of text tokens.")
            raise (ValueError if self.release == V0_11 else VLLMValidationError)(message)
        if priority != 0 and self.engine_args.scheduling_policy != "priority":
            raise (ValueError if self.release == V0_11 else VLLMValidationError)(
                f"Got priority {priority} but Priority scheduling is not enabled.")
        script = self.package.scripts.pop(0) if self.package.scripts else self.package.default_script
        if script.error_on_add is not None:
            raise script.error_on_add
        self.added.append(Added(prompt, params, request_id, priority, trace_headers))
        return script

    async def generate(self, prompt: dict[str, Any], sampling_params: SamplingParams, request_id: str, *,
                       prompt_text: str | None = None, lora_request: Any = None, tokenization_kwargs: Any = None,
                       trace_headers: Any = None, priority: int = 0,
                       data_parallel_rank: int | None = None) -> AsyncIterator[RequestOutput]:
        try:
            script = await self._add_request(prompt, sampling_params, request_id, priority, trace_headers)
            aborted = self._aborts[request_id] = asyncio.Event()
            limit = sampling_params.max_tokens or 16
            ids = script.token_ids[:limit]
            detok = Detokenizer(self.package.tokenizer, prompt["prompt_token_ids"], sampling_params) \
                if self.package.detokenize else None
            for i, token in enumerate(ids):
                await asyncio.sleep(0.001)
                self._step_stats(script)
                if aborted.is_set():
                    yield RequestOutput(request_id, None, None, None, [CompletionOutput(0, "", [], finish_reason="abort")], True)
                    return
                if self.errored:
                    raise EngineDeadError()
                last = i == len(ids) - 1
                finish = (script.finish if len(ids) == len(script.token_ids) else "length") if last else None
                text = f" t{token}"
                if detok is not None:
                    if detok.update(token):
                        last, finish = True, "stop"
                    text = detok.next_output_text(last)
                yield RequestOutput(request_id, None, None, None,
                                    [CompletionOutput(0, text, [token], finish_reason=finish)], last)
                if last:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(request_id)
            raise
        except EngineDeadError:
            raise
        except (ValueError if self.release == V0_11 else VLLMClientError):
            raise
        except Exception as e:
            await self.abort(request_id)
            raise EngineGenerateError() from e

    def _step_stats(self, script: Script) -> None:
        k = self.engine_args.speculative_config["num_speculative_tokens"] if self.engine_args.speculative_config else 0
        spec = SpecDecodingStats(k, 1, k, script.accepted_per_step) if k else None
        for logger in self.loggers:
            logger.record(SchedulerStats(1, 0, 0.1, spec), None, mm_cache_stats=None, engine_idx=0)

    async def abort(self, request_id: str | list[str], internal: bool = False) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.aborted.append(rid)
            if rid in self._aborts:
                self._aborts[rid].set()

    def shutdown(self) -> None:
        self.errored = True


class AsyncLLM011(AsyncLLM):
    release = V0_11

    async def get_tokenizer(self, lora_request: Any = None) -> Any:
        return self._tokenizer()


class AsyncLLMMain(AsyncLLM):
    release = MAIN

    def get_tokenizer(self) -> Any:
        return self._tokenizer()


@dataclass
class Package:
    """The fake package's state: the tokenizer, which scripts answer, the engines built."""

    tokenizer: Any
    release: str = MAIN
    scripts: list[Script] = field(default_factory=list)
    default_script: Script = field(default_factory=lambda: Script([5, 2]))
    #: Stream the tokenizer's text as vLLM does (``Detokenizer``), not ``" t<id>"`` per token.
    detokenize: bool = False
    engines: list[AsyncLLM] = field(default_factory=list)

    def modules(self) -> dict[str, types.ModuleType]:
        """``sys.modules`` entries for ``vllm`` and the submodules the adapter imports."""
        engine_cls = type("AsyncLLM", (AsyncLLM011 if self.release == V0_11 else AsyncLLMMain,), {"package": self})
        names = ("vllm", "vllm.engine", "vllm.engine.arg_utils", "vllm.v1", "vllm.v1.engine",
                 "vllm.v1.engine.async_llm", "vllm.v1.metrics", "vllm.v1.metrics.loggers", "vllm.sampling_params")
        mods = {name: types.ModuleType(name) for name in names}
        for name, mod in mods.items():
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        mods["vllm"].SamplingParams = SamplingParams
        mods["vllm"].TokensPrompt = TokensPrompt
        mods["vllm.engine.arg_utils"].AsyncEngineArgs = AsyncEngineArgs011 if self.release == V0_11 else AsyncEngineArgs
        mods["vllm.v1.engine.async_llm"].AsyncLLM = engine_cls
        mods["vllm.v1.metrics.loggers"].StatLoggerBase = StatLoggerBase
        mods["vllm.sampling_params"].RequestOutputKind = RequestOutputKind
        return mods
