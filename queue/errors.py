"""Every machine-readable error code a client can see, in one ``StrEnum``, and the queue
plane's own exception (so no module outside ``queue/`` needs to import redis).

The ``error`` frame's ``code`` (WebSocket), the OpenAI-style ``error.code`` and the
``lanes_errors_total{code}`` metric all take their values from ``ErrorCode``. Codes that travel
through Redis (a worker's or the scheduler's ``Finish.error_code``) are plain strings of the same
values, so an older process never fails to decode a newer code.

Codes by where they arise::

    client input (ws_server/protocol.py)
    ├── binary_frame, frame_too_large, invalid_json, invalid_frame, unknown_type
    ├── missing_field, invalid_field
    └── too_many_messages, prompt_too_long, max_tokens_too_large
    request bookkeeping (ws_server/delivery.py)
    ├── duplicate_id        an id already in flight here, or still known to Redis
    ├── unknown_id          no such request for this key (another key's ids look the same)
    ├── too_many_in_flight  per connection or per API key
    ├── resumed_elsewhere   a resume on another connection took the request over
    └── model_not_found     ``model`` names no pool of this deployment (the message lists them)
    admission and limits
    ├── overloaded          (with retry_after_ms, reason)
    ├── rate_limited        (with retry_after_ms)
    └── unavailable         Redis unreachable, or no worker ready (with retry_after_ms)
    during the request (a worker, the scheduler or the edge ends it)
    ├── prompt_too_long, bad_max_tokens, invalid_request   the engine refused it
    ├── engine_error        the engine ended a request without finishing it, or failed on it
    ├── generation_failed   the engine failed generating its answer (TensorRT-LLM, hf)
    ├── oom                 the engine ran out of memory on it
    ├── worker_failed       its worker died max_attempts times
    ├── malformed_request   its record in Redis was not one this lanes wrote: failed unrun
    ├── request_lost        its state vanished from Redis (restart without persistence)
    └── internal            a bug; the request was not accepted
"""

from __future__ import annotations

from enum import StrEnum

from redis.exceptions import AuthenticationError, OutOfMemoryError, ReadOnlyError, RedisError


class ErrorCode(StrEnum):
    BINARY_FRAME = "binary_frame"
    FRAME_TOO_LARGE = "frame_too_large"
    INVALID_JSON = "invalid_json"
    INVALID_FRAME = "invalid_frame"
    UNKNOWN_TYPE = "unknown_type"
    MISSING_FIELD = "missing_field"
    INVALID_FIELD = "invalid_field"
    TOO_MANY_MESSAGES = "too_many_messages"
    PROMPT_TOO_LONG = "prompt_too_long"
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
    DUPLICATE_ID = "duplicate_id"
    UNKNOWN_ID = "unknown_id"
    TOO_MANY_IN_FLIGHT = "too_many_in_flight"
    RESUMED_ELSEWHERE = "resumed_elsewhere"
    MODEL_NOT_FOUND = "model_not_found"
    OVERLOADED = "overloaded"
    RATE_LIMITED = "rate_limited"
    UNAVAILABLE = "unavailable"
    BAD_MAX_TOKENS = "bad_max_tokens"
    INVALID_REQUEST = "invalid_request"
    ENGINE_ERROR = "engine_error"
    #: The engine ran out of memory on this request (not retried: the same request would again).
    OOM = "oom"
    #: The engine failed generating this request's answer (TensorRT-LLM, the ``hf`` engine).
    GENERATION_FAILED = "generation_failed"
    WORKER_FAILED = "worker_failed"
    #: The request's record in Redis was malformed (written by something other than this lanes
    #: version): it was failed without running; nothing else is affected.
    MALFORMED_REQUEST = "malformed_request"
    REQUEST_LOST = "request_lost"
    INTERNAL = "internal"


#: The client's own doing (bad input, or a request the engine refused as asked: what an HTTP
#: server answers with a 400): never the service's failure, in spans or error rates.
CLIENT_FAULTS = frozenset({
    ErrorCode.BINARY_FRAME, ErrorCode.FRAME_TOO_LARGE, ErrorCode.INVALID_JSON, ErrorCode.INVALID_FRAME,
    ErrorCode.UNKNOWN_TYPE, ErrorCode.MISSING_FIELD, ErrorCode.INVALID_FIELD, ErrorCode.TOO_MANY_MESSAGES,
    ErrorCode.PROMPT_TOO_LONG, ErrorCode.MAX_TOKENS_TOO_LARGE, ErrorCode.BAD_MAX_TOKENS, ErrorCode.INVALID_REQUEST,
    ErrorCode.DUPLICATE_ID,
})


#: Raised by every ``QueuePlane`` call when Redis is unreachable or refuses a command: callers
#: catch this, never a redis-py class (it *is* redis-py's base class, re-exported).
QueueUnavailable = RedisError


def refusal_cause(exc: BaseException) -> str | None:
    """Why Redis refuses writes while it still answers (what a client and an operator need to
    read; "queue unavailable" alone hid it, and ``/healthz``'s PING still passes), or None for
    an outage (unreachable, timed out) or any other error."""
    # Inside a Lua script (the plane's scripts) the refusal comes back as a plain ResponseError
    # "Error running script ... -OOM command not allowed ...": read by its text too.
    text = str(exc)
    if isinstance(exc, OutOfMemoryError) or "OOM command not allowed" in text:
        return "Redis is out of memory (maxmemory reached) and refuses writes"
    if isinstance(exc, ReadOnlyError) or "READONLY" in text:
        return "Redis is a read-only replica (LANES_REDIS_URL must name the primary)"
    if "MISCONF" in text:
        return "Redis cannot save to disk and refuses writes (see its log)"
    return None


#: Redis refused the login (a wrong or missing password): a configuration error, never retried.
QueueAuthError = AuthenticationError
