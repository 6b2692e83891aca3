"""A stand-in ``tensorrt_llm`` package whose behaviour copies TensorRT-LLM's own code, for the
adapter tests on machines without a GPU. Each class names the upstream file (NVIDIA/TensorRT-LLM)
and version it mirrors; what it leaves out is the model itself: a ``Script`` says which tokens
(and text pieces) a request produces.

Mirrored behaviour (1.x unless noted):

- ``LLM.generate_async`` (``tensorrt_llm/llmapi/llm.py``, 1.x): raises
  ``RuntimeError("LLM is shutting down")`` once the executor is gone or shutting down; the
  PyTorch backend with chunked prefill checks no prompt length (``_check_arguments``).
- ``GenerationExecutor`` (``tensorrt_llm/executor/executor.py``, 1.x): ``is_shutdown()`` is
  ``doing_shutdown``; ``_handle_background_error`` raises a per-request ``RequestError`` for a
  string error, and for a fatal one calls ``shutdown()`` first and re-raises the original.
- ``GenerationResult`` (``tensorrt_llm/executor/result.py`` at a678b91, 1.x): one object, mutated
  in place and yielded again per streaming step; ``CompletionOutput.text`` / ``token_ids``
  cumulative with ``*_diff`` views; ``abort()`` ends it with ``'cancelled'``; ``decoding_iter``.
  Stop strings are matched as token ids (``SamplingParams._setup`` tokenizes each one alone; the
  executor ends the request with ``FinishReason.STOP_WORDS`` when the answer's ids end with
  them): ``_handle_sequence`` then cuts those ids from ``token_ids``, and the detokenizer, fed
  ``token_ids_diff`` (now short of them), leaves ``text`` with the stop string's first tokens,
  streamed in earlier steps. A stop string the model spells with other tokens is not matched.
  With ``detokenize=False`` the text stays empty.
- ``SchedulerConfig`` (``tensorrt_llm/llmapi/llm_args.py``): pydantic; releases whose
  ``WaitingQueuePolicy`` knows only ``fcfs`` reject ``waiting_queue_policy="priority"`` with a
  ``ValidationError`` (``priority`` exists since PR #12362).
- ``generate_async(..., priority: float = 0.5)``: the newest signature (``reference/engines.md``).
"""

from __future__ import annotations

import asyncio
import enum
import importlib.machinery
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


class RequestError(RuntimeError):
    """``tensorrt_llm/executor/utils.py``: a per-request failure."""


class CompletionOutput:
    """``tensorrt_llm/executor/result.py`` ``CompletionOutput`` (the fields the adapter reads)."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.text = ""
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._last_text_len = 0
        self._last_token_ids_len = 0

    @property
    def text_diff(self) -> str:
        return self.text[self._last_text_len:]

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len:]


@dataclass
class Script:
    """What the fake model answers: ``(token id, text piece)`` per step, then a finish."""

    steps: list[tuple[int, str]]
    finish: str = "length"
    #: Raise this from the request's stream after ``fail_after`` steps.
    error: BaseException | str | None = None
    fail_after: int = 0
    #: Decoding iterations per token (speculation makes it < 1).
    iters_per_token: float = 1.0

    @classmethod
    def spelled(cls, tokenizer: Any, pieces: list[str], **kwargs: Any) -> Script:
        """The tokens of each piece, encoded alone, one per step (their text decodes to the
        pieces: the adapter decodes ids itself)."""
        steps = [(i, tokenizer.decode([i])) for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False)]
        return cls(steps, **kwargs)


class GenerationExecutor:
    """``tensorrt_llm/executor/executor.py`` 1.x: the shutdown state and error routing."""

    def __init__(self) -> None:
        self.doing_shutdown = False
        self.aborted: list[int] = []

    def is_shutdown(self) -> bool:
        return self.doing_shutdown

    def shutdown(self) -> None:
        self.doing_shutdown = True

    def abort_request(self, request_id: int) -> None:
        self.aborted.append(request_id)

    def _handle_background_error(self, error: BaseException | str | None = None) -> None:
        if error is None:
            return
        if isinstance(error, RequestError):
            raise error
        if isinstance(error, str):
            raise RequestError(error)
        self.shutdown()  # a serious error from a background thread or process
        raise error


class RequestOutput:
    """``GenerationResult`` / ``llmapi.RequestOutput`` 1.x in streaming mode."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], script: Script,
                 stop_words: list[tuple[str, list[int]]], executor: GenerationExecutor, max_tokens: int,
                 detokenize: bool = True) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.outputs = [CompletionOutput(0)]
        self._done = False
        self._aborted = False
        self._script, self._stop_words, self._executor = script, stop_words, executor
        self._max_tokens = max_tokens
        self._detokenize = detokenize
        self._pieces = dict(script.steps)
        self.decoding_iter = 0

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self._executor.abort_request(self.request_id)
        self._aborted = True

    def _apply(self, step: int) -> None:
        """One response: ``_handle_sequence``, then the detokenizer on ``token_ids_diff``."""
        out = self.outputs[0]
        out._last_token_ids_len = len(out.token_ids)
        if self._aborted:
            out.finish_reason, self._done = "cancelled", True
            return
        out.token_ids.append(self._script.steps[step][0])
        self.decoding_iter = max(1, round((step + 1) * self._script.iters_per_token))
        stopped = next(((s, ids) for s, ids in self._stop_words if ids and out.token_ids[-len(ids):] == ids), None)
        if stopped is not None:  # FinishReason.STOP_WORDS
            out.finish_reason, out.stop_reason, self._done = "stop", stopped[0], True
            out.token_ids = out.token_ids[: -len(stopped[1])]
        elif step + 1 >= min(len(self._script.steps), self._max_tokens):
            out.finish_reason = self._script.finish if step + 1 >= len(self._script.steps) else "length"
            self._done = True
        out._last_text_len = len(out.text)
        if self._detokenize:
            out.text += "".join(self._pieces[i] for i in out.token_ids_diff)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        step = 0
        while not self._done:
            await asyncio.sleep(0.001)
            if self._script.error is not None and step >= self._script.fail_after:
                self._executor._handle_background_error(self._script.error)
            self._apply(step)
            step += 1
            yield self


class TokenizerWrapper:
    """``tensorrt_llm/llmapi/tokenizer.py`` ``TransformersTokenizer``: ``.tokenizer`` is HF's."""

    def __init__(self, hf: Any) -> None:
        self.tokenizer = hf


@dataclass
class SamplingParams:
    """``tensorrt_llm/sampling_params.py`` (the fields the adapter may pass, and ``n``)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    n: int = 1


class WaitingQueuePolicy(str, enum.Enum):
    FCFS = "fcfs"


class WaitingQueuePolicyWithPriority(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class KvCacheConfig(BaseModel):
    """``llm_args.py`` ``KvCacheConfig`` (subset)."""

    free_gpu_memory_fraction: float = 0.9
    enable_block_reuse: bool = True
    dtype: str = "auto"


class FcfsOnlySchedulerConfig(BaseModel):
    """``llm_args.py`` ``SchedulerConfig`` of a release whose queue policy is FCFS only."""

    waiting_queue_policy: WaitingQueuePolicy = WaitingQueuePolicy.FCFS


class PrioritySchedulerConfig(BaseModel):
    """``llm_args.py`` ``SchedulerConfig`` after PR #12362 (priority queueing)."""

    waiting_queue_policy: WaitingQueuePolicyWithPriority = WaitingQueuePolicyWithPriority.FCFS


class NGramDecodingConfig(BaseModel):
    """``llm_args.py`` ``NGramDecodingConfig`` (subset)."""

    max_draft_len: int
    max_matching_ngram_size: int = 2
    is_public_pool: bool = True


@dataclass
class Submitted:
    inputs: list[int]
    sampling_params: SamplingParams
    priority: float
    output: RequestOutput


@dataclass
class LLMArgs:
    """``TorchLlmArgs`` (subset): the PyTorch backend leaves ``max_seq_len`` unset unless given."""

    max_seq_len: int | None = None
    enable_chunked_prefill: bool = False


class Package:
    """The fake package's state: which scripts answer, what was built and submitted."""

    def __init__(self, tokenizer: Any, *, scheduler_config: type = PrioritySchedulerConfig) -> None:
        self.tokenizer = tokenizer
        self.scheduler_config = scheduler_config
        self.scripts: list[Script] = []
        self.default_script = Script.spelled(tokenizer, [" hi"], finish="stop")
        self.llms: list[LLM] = []

    def module(self) -> types.ModuleType:
        package = self
        module = types.ModuleType("tensorrt_llm")
        module.__spec__ = importlib.machinery.ModuleSpec("tensorrt_llm", None)
        llmapi = types.ModuleType("tensorrt_llm.llmapi")
        llmapi.KvCacheConfig = KvCacheConfig
        llmapi.SchedulerConfig = self.scheduler_config
        llmapi.NGramDecodingConfig = NGramDecodingConfig

        class BoundLLM(LLM):
            def __init__(self, model: str, **kwargs: Any) -> None:
                super().__init__(package, model, **kwargs)

        module.LLM = BoundLLM
        module.SamplingParams = SamplingParams
        module.llmapi = llmapi
        return module


class LLM:
    """``tensorrt_llm.LLM`` (PyTorch backend, ``tensorrt_llm/llmapi/llm.py``)."""

    def __init__(self, package: Package, model: str, **kwargs: Any) -> None:
        self.package, self.model, self.kwargs = package, model, kwargs
        self.args = LLMArgs(max_seq_len=kwargs.get("max_seq_len"),
                            enable_chunked_prefill=kwargs.get("enable_chunked_prefill", False))
        self._executor: GenerationExecutor | None = GenerationExecutor()
        self.tokenizer = TokenizerWrapper(package.tokenizer)
        self.submitted: list[Submitted] = []
        self._next_id = 0
        package.llms.append(self)

    def generate_async(self, inputs: list[int], sampling_params: SamplingParams | None = None,
                       lora_request: Any = None, prompt_adapter_request: Any = None, streaming: bool = False,
                       kv_cache_retention_config: Any = None, disaggregated_params: Any = None,
                       trace_headers: Any = None, _postproc_params: Any = None, scheduling_params: Any = None,
                       cache_salt: str | None = None, priority: float = 0.5) -> RequestOutput:
        if self._executor is None or self._executor.is_shutdown():
            raise RuntimeError("LLM is shutting down")
        params = sampling_params or SamplingParams()
        if params.n > self.kwargs.get("max_batch_size", 8):
            raise ValueError(f"SamplingParams.n ({params.n}) should not exceed max_batch_size")
        script = self.package.scripts.pop(0) if self.package.scripts else self.package.default_script
        stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        stop_words = [(s, list(self.package.tokenizer.encode(s, add_special_tokens=False))) for s in stop]
        self._next_id += 1
        output = RequestOutput(self._next_id, list(inputs), script, stop_words, self._executor,
                               params.max_tokens or 1 << 30, params.detokenize)
        self.submitted.append(Submitted(list(inputs), params, priority, output))
        return output

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
