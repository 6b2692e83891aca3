"""The one engine protocol every backend implements (vllm, trtllm, hf, sim).

Heavy imports (torch, vllm, tensorrt_llm) live only inside each engine's module; this
module imports none of them.

Exception tree::

    EngineError                 base; ``code`` is machine-readable
    ├── ConfigError             settings that cannot work (also a ValueError); the worker exits 2
    ├── RequestRejected         this request cannot run (prompt too long, bad params); others can
    ├── EngineBusy              the engine's own queue is full (transient): the request goes
    │                           back to its lane instead of failing
    └── EngineDead              the engine is gone; the worker stops claiming and exits non-zero
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lanes.queue.messages import ChatMessage, FinishReason, Lane


class EngineError(Exception):
    code = "engine_error"


class ConfigError(EngineError, ValueError):
    """Settings that cannot work together, or a model that cannot be found; raised before
    (or while) the model loads. The message names the setting or flag to change."""

    code = "bad_config"


class RequestRejected(EngineError):
    """The request is invalid for this engine; ``code`` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def render_chat(tokenizer: Any, messages: tuple[ChatMessage, ...] | list[ChatMessage]) -> str:
    """``messages`` through the model's chat template. A template that refuses them (its
    ``raise_exception``: "System role not supported", "roles must alternate") is this request's
    fault: ``invalid_request`` with the template's words, not an engine failure (a 500 that
    clients retry). A template that cannot be parsed is the deployment's and propagates."""
    try:
        return tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                             tokenize=False, add_generation_prompt=True)
    except Exception as exc:
        if type(exc).__name__ != "TemplateError":  # jinja2.exceptions.TemplateError itself
            raise
        raise RequestRejected("invalid_request", f"the model's chat template refused these messages: "
                                                 f"{str(exc).strip() or type(exc).__name__}") from exc


def load_failure(model: str | Path, exc: BaseException, setting: str = "--model / LANES_MODEL") -> ConfigError:
    """A model that did not load, as one message: its cause's words (all of them, up to ~300
    characters: some put what is missing on the second line) and, for a hub id that looks like
    a mistyped relative path (``models/x``), that no such directory exists either. Restarting
    never helps (a corrupt or truncated weights file, a missing tokenizer, no GPU memory), so it
    is a configuration error: one line and exit 2, which ``lanes up`` does not restart. ``model``
    may be a Path (the hf engines keep one): a TypeError here once hid the cause behind a crash."""
    model = str(model)
    words = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    if len(words) > 300:
        words = words[:297] + "..."
    hint = ""
    if "/" in model and not model.startswith(("/", ".", "~")) and not Path(model).expanduser().exists():
        hint = f" (no local directory {model} either: a path relative to here starts with ./)"
    return ConfigError(f"cannot load the model {model} ({setting}): {type(exc).__name__}: {words}{hint}")


def is_out_of_memory(error: object) -> bool:
    """Whether an engine's error is an out-of-memory one (torch's and CUDA's messages say so)."""
    return "out of memory" in str(error).lower()


class EngineBusy(EngineError):
    """The engine refused the request because its own queue is full (vLLM
    ``QueueOverflowError`` / ``MaxQueuedTokensError``); it may run a moment later."""

    code = "engine_busy"


class EngineDead(EngineError):
    code = "engine_dead"


@dataclass(frozen=True)
class EngineRequest:
    """One generation, as a worker hands it to an engine."""

    id: str
    messages: tuple[ChatMessage, ...]
    max_tokens: int
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    lane: Lane = Lane.MEDIUM
    #: Tokens an earlier attempt already streamed: continue after them (prompt + these).
    resume_token_ids: tuple[int, ...] = ()
    #: W3C trace context for engines that join our trace (vLLM ``trace_headers``).
    trace_headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineDelta:
    """New output of one request since the previous delta.

    ``text`` is the exact decoded text of ``token_ids`` given everything before them
    (incremental detokenization), so concatenating deltas gives the full answer.
    """

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    #: Prompt length in tokens; engines set it on every delta (cheap) so the first one carries it.
    prompt_tokens: int = 0


@runtime_checkable
class Engine(Protocol):
    """What a worker needs from an inference engine."""

    name: str
    #: How many requests the engine runs at once (the worker's total slots).
    max_concurrency: int

    async def start(self) -> None:
        """Load the model; raises ``EngineError`` with a clear message on bad config."""

    def generate(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        """Stream deltas until one carries ``finish_reason``.

        Raises ``RequestRejected`` for a request it cannot run and ``EngineDead`` when the
        engine is gone. Cancelling the consuming task aborts the request.
        """

    async def abort(self, request_id: str) -> None:
        """Stop a running request soon; its ``generate`` then ends with CANCELLED."""

    def stats(self) -> dict[str, Any]:
        """Engine-level gauges and counters (running, waiting, kv use, acceptance...)."""

    async def close(self) -> None:
        """Release the model and background threads/processes."""


#: Asked once at start-up so that the first real request does not pay for lazy set-up
#: (CUDA graphs, kernels, allocator pools, the first batch of the batching thread).
WARMUP_MESSAGES = (ChatMessage("user", "Hello"),)


async def warm_up(engine: Engine, *, max_tokens: int = 2) -> None:
    """Run one short greedy generation to the end; raises what the engine raises.

    Engines call it at the end of ``start()``, so a worker registers (first heartbeat) and
    claims only once its engine has really produced tokens.
    """
    request = EngineRequest(id=f"warmup-{uuid.uuid4().hex[:8]}", messages=WARMUP_MESSAGES,
                            max_tokens=max_tokens, temperature=0.0)
    async for delta in engine.generate(request):
        if delta.finish_reason is not None:
            return
