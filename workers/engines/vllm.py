"""vLLM engine: ``AsyncLLM`` with priority scheduling, chunked prefill and speculative decoding.

``vllm`` is imported only in ``start()``, so CPU installs never need it. The output mapping
(``delta_from_output``, ``error_from_exception``) is pure and tested with objects shaped like
``vllm.outputs.RequestOutput`` / ``CompletionOutput``.

Each request's vLLM generator is drained by a small pump task into our own queue (``DeltaRelay``).
That buys two things: ``abort()`` ends our stream at once with CANCELLED even on releases whose
``AsyncLLM.abort`` emits no final output, and a consumer that falls behind gets one merged delta
instead of a backlog (vLLM merges DELTA outputs the same way on its side).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from lanes.queue.messages import FinishReason
from lanes.scheduler.policy import vllm_priority
from lanes.workers.detokenize import StopMatcher, answer_text
from lanes.workers.engines.base import (
    ConfigError,
    EngineBusy,
    EngineDead,
    EngineDelta,
    EngineError,
    EngineRequest,
    RequestRejected,
    render_chat,
    warm_up,
)
from lanes.workers.engines.engine_config import (
    SpecCounters,
    check_checkpoint_quant,
    filter_supported,
    map_finish_reason,
    remaining_tokens,
    supported_names,
    validate,
    vllm_engine_kwargs,
    vllm_sampling_kwargs,
)
from lanes.workers.settings import WorkerSettings

log = logging.getLogger(__name__)

_PROMPT_TOO_LONG_HINTS = ("maximum model length", "max_model_len", "too long", "longer than")


def delta_from_output(output: Any, prompt_tokens: int) -> EngineDelta | None:
    """Map one DELTA-mode ``RequestOutput`` to our delta (None when it carries nothing).

    ``output.outputs[0]`` holds only the new ``token_ids`` / ``text``; ``finish_reason`` is set
    on the last one (``stop|length|abort|error|repetition``).
    """
    completion = output.outputs[0] if output.outputs else None
    token_ids = tuple(completion.token_ids) if completion is not None else ()
    text = completion.text if completion is not None else ""
    finish = map_finish_reason(completion.finish_reason) if completion is not None else None
    if output.finished and finish is None:
        finish = FinishReason.STOP  # finished without a reason: vLLM's stream end sentinel
    if not token_ids and not text and finish is None:
        return None
    return EngineDelta(token_ids, text, finish, prompt_tokens)


#: Admission-control rejections of a full engine queue (``vllm/exceptions.py``): HTTP 503,
#: "try again later". Only these names exist upstream; there is no ``MaxPendingTokensError``.
_BUSY_ERRORS = frozenset({"QueueOverflowError", "MaxQueuedTokensError"})
_CLIENT_ERRORS = frozenset({"VLLMValidationError", "VLLMClientError", "ValueError", "TypeError"})


def _cause_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes: ``AsyncLLM.generate`` wraps unexpected errors as
    ``raise EngineGenerateError() from e`` (no message of its own)."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__  # type: ignore[assignment]
    return chain


def error_from_exception(exc: BaseException) -> EngineError:
    """Map a vLLM exception to our tree by class name (so no vllm import is needed).

    Matches ``vllm/v1/engine/exceptions.py`` and ``vllm/exceptions.py`` from 0.11 to today:
    ``EngineDeadError`` → EngineDead; a full engine queue (``QueueOverflowError``,
    ``MaxQueuedTokensError``: ``GracefulHTTPError`` subclasses, which derive from ``VLLMError``
    today and from ``ValueError`` in older releases, and may arrive as the cause of an
    ``EngineGenerateError``) → EngineBusy, so the worker hands the request back to its lane;
    request validation (``VLLMClientError``/``VLLMValidationError`` today, ``ValueError`` in
    0.11) → ``prompt_too_long`` or ``invalid_request``; anything else → EngineError.
    """
    if isinstance(exc, EngineError):
        return exc
    chain = _cause_chain(exc)
    names = {cls.__name__ for err in chain for cls in type(err).__mro__}
    message = next((str(err) for err in chain if str(err)), type(exc).__name__)
    if "EngineDeadError" in names:
        return EngineDead(message)
    if names & _BUSY_ERRORS:
        return EngineBusy(message)
    if {cls.__name__ for cls in type(exc).__mro__} & _CLIENT_ERRORS:
        lowered = message.lower()
        if any(hint in lowered for hint in _PROMPT_TOO_LONG_HINTS):
            return RequestRejected("prompt_too_long", message)
        return RequestRejected("invalid_request", message)
    error = EngineError(message)
    error.__cause__ = exc
    return error


def cut_at_stop(delta: EngineDelta, stops: StopMatcher) -> EngineDelta:
    """``delta`` with its text passed through ``stops``: cut (and finished) at a stop string, the
    held-back text released when the answer ends by itself. A cancelled or failed attempt keeps
    it held: a resumed attempt recomputes and sends it (``StopMatcher.resume``)."""
    text = stops.push(delta.text)
    if stops.stopped:
        return EngineDelta(delta.token_ids, text, FinishReason.STOP, delta.prompt_tokens)
    if delta.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        text += stops.flush()
    return EngineDelta(delta.token_ids, text, delta.finish_reason, delta.prompt_tokens)


def merge_deltas(deltas: Sequence[EngineDelta]) -> EngineDelta:
    """Concatenate consecutive deltas of one request (the last one's finish wins)."""
    if len(deltas) == 1:
        return deltas[0]
    return EngineDelta(
        tuple(t for d in deltas for t in d.token_ids), "".join(d.text for d in deltas),
        deltas[-1].finish_reason, deltas[-1].prompt_tokens,
    )


class DeltaRelay:
    """Drains an async source of deltas in a task; ``cancel()`` ends the stream with CANCELLED."""

    def __init__(self, source: AsyncIterator[EngineDelta], prompt_tokens: int) -> None:
        self._queue: asyncio.Queue[EngineDelta | BaseException] = asyncio.Queue()
        self._prompt_tokens = prompt_tokens
        self._task = asyncio.create_task(self._pump(source))

    async def _pump(self, source: AsyncIterator[EngineDelta]) -> None:
        try:
            async for delta in source:
                self._queue.put_nowait(delta)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, not swallowed
            self._queue.put_nowait(exc)

    def cancel(self) -> None:
        """Stop the source (vLLM aborts on cancellation) and end the stream now."""
        self._task.cancel()
        self._queue.put_nowait(EngineDelta((), "", FinishReason.CANCELLED, self._prompt_tokens))

    async def __aiter__(self) -> AsyncIterator[EngineDelta]:
        while True:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            deltas: list[EngineDelta] = []
            for item in items:
                if isinstance(item, BaseException):
                    if deltas:
                        yield merge_deltas(deltas)
                    raise item
                deltas.append(item)
                if item.finish_reason is not None:
                    yield merge_deltas(deltas)
                    return
            yield merge_deltas(deltas)

    async def aclose(self) -> None:
        if not self._task.done():
            self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


class VllmEngine:
    """The Engine protocol on ``vllm.v1.engine.async_llm.AsyncLLM``."""

    name = "vllm"

    def __init__(self, settings: WorkerSettings) -> None:
        validate(settings)
        self.settings = settings
        self.max_concurrency = settings.max_slots
        self._engine: Any = None
        self._tokenizer: Any = None
        self._relays: dict[str, DeltaRelay] = {}
        self._scheduler_stats: Any = None
        self._spec = SpecCounters()
        #: Engine arguments the installed vLLM lacks (dropped at start, with a warning).
        self.dropped_args: list[str] = []

    async def start(self) -> None:
        from vllm import SamplingParams, TokensPrompt  # noqa: F401 - fail early if missing
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        found = await asyncio.to_thread(check_checkpoint_quant, self.settings, engine="vllm")
        kwargs, dropped = filter_supported(vllm_engine_kwargs(self.settings, found),
                                           supported_names(AsyncEngineArgs))
        self.dropped_args = dropped
        if dropped:
            log.warning("this vLLM release lacks engine args %s; running without them", dropped)
        try:
            self._engine = AsyncLLM.from_engine_args(
                AsyncEngineArgs(**kwargs), stat_loggers=[self._stat_logger_factory()])
        except (ValueError, TypeError, NotImplementedError) as exc:  # a config vLLM rejects
            raise ConfigError(f"vLLM rejected the settings: {str(exc).splitlines()[0]}") from exc
        except Exception as exc:  # out of GPU memory, CUDA errors...
            raise EngineError(f"vLLM failed to start: {exc}") from exc
        tokenizer = self._engine.get_tokenizer()
        self._tokenizer = await tokenizer if inspect.isawaitable(tokenizer) else tokenizer
        await warm_up(self)
        self._spec = SpecCounters()  # count served requests only

    def _stat_logger_factory(self) -> Any:
        """A ``StatLoggerFactory`` whose logger keeps the latest scheduler stats for ``stats()``."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class _Recorder(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any,
                       **kwargs: Any) -> None:
                if scheduler_stats is None:
                    return
                engine._scheduler_stats = scheduler_stats
                spec = getattr(scheduler_stats, "spec_decoding_stats", None)
                if spec is not None:
                    engine._spec.observe(spec.num_drafts, spec.num_draft_tokens,
                                         spec.num_accepted_tokens)

            def log_engine_initialized(self) -> None:
                pass

        return _Recorder

    def _prompt_ids(self, request: EngineRequest) -> list[int]:
        return list(self._tokenizer.encode(render_chat(self._tokenizer, request.messages),
                                           add_special_tokens=False))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        # ``AsyncLLM.errored``: the engine core died or the output handler stopped (shutdown).
        if self._engine is None or getattr(self._engine, "errored", False):
            raise EngineDead("vLLM engine is not running")
        prompt_ids = self._prompt_ids(request)
        if remaining_tokens(request) == 0:  # a resumed request that had already finished
            stops = self._stop_matcher(request, prompt_ids)
            yield EngineDelta((), stops.flush() if stops else "", FinishReason.LENGTH, len(prompt_ids))
            return
        relay = DeltaRelay(self._source(request, prompt_ids), len(prompt_ids))
        self._relays[request.id] = relay
        try:
            async for delta in relay:
                yield delta
        finally:
            self._relays.pop(request.id, None)
            await relay.aclose()  # on consumer cancel: vLLM's generate() aborts internally

    async def _source(self, request: EngineRequest,
                      prompt_ids: list[int]) -> AsyncIterator[EngineDelta]:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(output_kind=RequestOutputKind.DELTA,
                                **vllm_sampling_kwargs(request))
        prompt = TokensPrompt(prompt_token_ids=prompt_ids + list(request.resume_token_ids))
        stops = self._stop_matcher(request, prompt_ids)
        outputs = self._engine.generate(prompt, params, request.id, priority=vllm_priority(request.lane),
                                        trace_headers=request.trace_headers or None)
        try:
            # Closing the generator early (a stop string) aborts the request inside vLLM.
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    delta = delta_from_output(output, len(prompt_ids))
                    if delta is None:
                        continue
                    if stops is not None:
                        delta = cut_at_stop(delta, stops)
                    yield delta
                    if delta.finish_reason is not None:
                        return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._engine is None or getattr(self._engine, "errored", False):
                raise EngineDead(f"vLLM engine is not running ({type(exc).__name__})") from exc
            raise error_from_exception(exc) from exc

    def _stop_matcher(self, request: EngineRequest, prompt_ids: list[int]) -> StopMatcher | None:
        """Our own stop strings (``vllm_sampling_kwargs``); a resumed attempt first holds what the
        earlier one held (its tokens were streamed, their text was not)."""
        if not request.stop:
            return None
        return StopMatcher.resumed(request.stop, request.resume_token_ids,
                                   lambda: answer_text(self._tokenizer, prompt_ids, request.resume_token_ids))

    async def abort(self, request_id: str) -> None:
        relay = self._relays.get(request_id)
        if relay is not None:
            relay.cancel()
        if self._engine is not None:
            await self._engine.abort(request_id)

    def stats(self) -> dict[str, Any]:
        s = self._scheduler_stats
        out: dict[str, Any] = {"engine": self.name, "active_requests": len(self._relays)}
        if s is not None:
            out.update(num_running=s.num_running_reqs, num_waiting=s.num_waiting_reqs,
                       kv_cache_usage=getattr(s, "kv_cache_usage",
                                              getattr(s, "gpu_cache_usage", 0.0)))
        if self.settings.spec_method != "none":
            out.update(self._spec.as_dict())
        return out

    async def close(self) -> None:
        for relay in list(self._relays.values()):
            relay.cancel()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
