"""Messages that cross Redis between processes (msgspec, JSON on the wire; never pickle).

Naming: units live in field names (``_ms``, ``_s``); outcomes are enums.
"""

from __future__ import annotations

import enum
from typing import TypeVar

import msgspec

T = TypeVar("T")


class Lane(str, enum.Enum):
    """Priority lanes, highest priority first."""

    SHORT = "short"
    MEDIUM = "medium"
    LONG = "long"


class RequestState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


class RequestPayload(msgspec.Struct, frozen=True):
    """What the edge enqueues and the worker runs (stored as JSON in the request hash)."""

    id: str
    messages: tuple[ChatMessage, ...]
    max_tokens: int
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    lane: Lane = Lane.MEDIUM
    predicted_tokens: int = 0
    #: W3C trace context (``traceparent``/``tracestate``) of the edge's span.
    trace: dict[str, str] = {}
    #: The enqueueing edge's ``LANES_RESUME_GRACE_S``: a worker keeps running an answer whose
    #: edge has gone at least this long (a client may resume it on another edge until then).
    resume_grace_s: float = 0.0
    #: Routed by ``model: "auto"``: the other pools whose tiers also fit it (``RouteDecision.
    #: later``). While its pool has no live worker and one of these has, the scheduler fails it
    #: at once if it has not run (``unavailable``: retried, ``auto`` picks that pool), rather
    #: than after ``LANES_NO_WORKER_TIMEOUT_S``. Also in the request's hash (``fallback``).
    fallback_pools: tuple[str, ...] = ()


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int


class Finish(msgspec.Struct, frozen=True):
    """The end of a request, carried by its last stream entry."""

    reason: FinishReason
    usage: Usage
    queue_ms: float = 0.0
    #: Machine-readable error code when ``reason`` is ERROR (e.g. ``prompt_too_long``).
    error_code: str | None = None
    error_message: str | None = None


class TokenEvent(msgspec.Struct, frozen=True, array_like=True):
    """One delta of one request: what a stream entry holds and what an edge receives.

    ``seq`` counts deltas from 0; the stream entry id is ``<seq+1>-0``.
    """

    id: str
    attempt: int
    seq: int
    text: str
    token_ids: tuple[int, ...] = ()
    finish: Finish | None = None


class TokenBatch(msgspec.Struct, frozen=True, array_like=True):
    """One engine step's events for one edge (one PUBLISH)."""

    worker: str
    events: tuple[TokenEvent, ...]


class Control(msgspec.Struct, frozen=True, tag_field="op", tag="cancel"):
    """A message on a worker's control channel."""

    id: str


class DepthSnapshot(msgspec.Struct, frozen=True):
    """Lane depths published by the scheduler process."""

    at_ms: int
    pending: dict[str, int]
    running: dict[str, int]
    oldest_wait_ms: dict[str, int]
    workers: int = 0
    #: Claims per second per lane (EWMA): how fast each lane drains.
    service_rps: dict[str, float] = {}
    #: The model pool these lanes belong to.
    pool: str = "default"
    #: Enqueues per second per lane (EWMA).
    arrival_rps: dict[str, float] = {}
    #: Workers needed to keep the predicted wait under the target (the autoscaling signal).
    desired_workers: int = 0
    #: The pool may have no worker on purpose (the scheduler's ``LANES_MIN_WORKERS`` is 0: an
    #: autoscaler starts one on demand): edges queue its chats rather than refuse them.
    scales_from_zero: bool = False


class WorkerReport(msgspec.Struct, frozen=True):
    """What a worker publishes about itself each heartbeat (``lanes:{q}:worker:<id>``, TTL)."""

    worker: str
    #: Running requests per lane (by the lane each counts against now).
    running: dict[str, int]
    slots: int
    #: Finished requests by final state since the worker started.
    finished: dict[str, int] = {}
    tokens_per_s: float = 0.0
    #: Engine name and its own stats (KV-cache use, acceptance, ...): numbers or short strings.
    engine: dict[str, float | int | str | bool | None] = {}
    pool: str = "default"
    #: Stopping: it claims nothing more and finishes (or hands back) what it runs. The pool
    #: does not count it as a worker, so edges refuse the pool's chats once no other serves it.
    draining: bool = False


class Observation(msgspec.Struct, frozen=True, array_like=True):
    """A finished request's true output length, for the predictor's refresh."""

    prompt: str
    output_tokens: int
    #: The API key's id that submitted it ("" without auth, and in entries written before it
    #: was recorded): no one key may fill the refresh's window (``scheduler.refresh.refresh_window``).
    owner: str = ""


#: The predictor refresh's default window: the newest this many finished requests
#: (``LANES_PREDICTOR_MAX_OBSERVATIONS``; 5,000 before stop 22, benchmarks/RESULTS.md).
REFRESH_WINDOW = 10_000
#: An observed prompt keeps its first and last this many characters: what the length predictor
#: reads of it (n-grams of the first 256 / last 128 words and characters, cues of the first
#: 2,048 / last 512 characters) is inside, and the list's memory stays bounded (20,000 entries of
#: at most ~5 K characters, where a prompt may have 64 K). Only the prompt's size cues (its
#: characters, words, lines, question marks) read less of a longer one.
OBSERVED_PROMPT_HEAD_CHARS, OBSERVED_PROMPT_TAIL_CHARS = 4096, 1024


def clip_observed(prompt: str) -> str:
    """``prompt`` as an observation stores it (see ``OBSERVED_PROMPT_HEAD_CHARS``)."""
    if len(prompt) <= OBSERVED_PROMPT_HEAD_CHARS + OBSERVED_PROMPT_TAIL_CHARS:
        return prompt
    return prompt[:OBSERVED_PROMPT_HEAD_CHARS] + "\n" + prompt[-OBSERVED_PROMPT_TAIL_CHARS:]


json_encoder = msgspec.json.Encoder()


def encode(obj: msgspec.Struct) -> bytes:
    return json_encoder.encode(obj)


def decode(data: bytes | str, type_: type[T]) -> T:
    """Decode JSON into ``type_``; raises ``msgspec.DecodeError`` on bad input."""
    return msgspec.json.decode(data, type=type_)
