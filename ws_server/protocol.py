"""WebSocket protocol v1, sans-I/O: client frames in, typed frames or a ``ProtocolError`` out.

Errors (each carries a machine-readable ``code`` that the ``error`` frame repeats)::

    ProtocolError
    ├── binary_frame        a binary frame; the protocol is JSON text
    ├── frame_too_large     over ``max_frame_bytes``
    ├── invalid_json        not parseable JSON (or not UTF-8, or nested deeper than ``max_nesting``)
    ├── invalid_frame       JSON but not an object
    ├── unknown_type        ``type`` missing or not one we know
    ├── missing_field       a required field is absent
    ├── invalid_field       wrong type or out of range (the message names the field)
    ├── too_many_messages   more chat messages than ``max_messages``
    ├── prompt_too_long     the messages' total characters exceed ``max_prompt_chars``
    └── max_tokens_too_large  ``max_tokens`` above ``max_tokens_limit``

Refusals decided elsewhere use the same frame; every code is one ``ErrorCode`` (``queue/errors.py``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import msgspec
from lanes.queue.errors import ErrorCode
from lanes.queue.messages import ChatMessage, FinishReason, Usage

ROLES = frozenset({"system", "user", "assistant"})
#: Used with ``fullmatch``: ``$`` would let a trailing newline into Redis keys and logs.
_ID_RE = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
#: Joins an API key's id and its client's request id into the id the request has in Redis and
#: in the delivery core. Client ids cannot contain it, so two keys' namespaces never meet.
_SCOPE = "/"
_MODEL_RE = re.compile(r"[A-Za-z0-9_.:/@\-]{1,128}")
#: Stop sequences per request, and characters per sequence (OpenAI's API allows 4).
MAX_STOP = 4
MAX_STOP_CHARS = 64
#: Client text quoted back in an error message is cut to this many characters.
_MAX_ECHO_CHARS = 40


class ProtocolError(Exception):
    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id
        #: The refused frame said it was a ``cancel`` or a ``resume``: a control frame about a
        #: request, not a request of its own (``lanes_requests_total`` does not count it).
        self.control = False


@dataclass(frozen=True)
class Limits:
    max_frame_bytes: int = 256 * 1024
    max_messages: int = 64
    max_prompt_chars: int = 64 * 1024
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256
    #: Deepest JSON nesting accepted (a chat frame needs 3). Checked here so the answer never
    #: depends on the interpreter's recursion limit or on how deep the caller's stack is.
    max_nesting: int = 32


@dataclass(frozen=True)
class ChatFrame:
    id: str | None
    messages: tuple[ChatMessage, ...]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    #: How long the client will wait for the first token before the answer is useless (ms).
    deadline_ms: int | None
    #: Stop sequences: the answer ends (finish ``stop``) before the first one it would contain.
    stop: tuple[str, ...] = ()
    #: The model pool to serve it (``auto``: the router picks); None: the default pool.
    model: str | None = None


@dataclass(frozen=True)
class CancelFrame:
    id: str


@dataclass(frozen=True)
class ResumeFrame:
    id: str
    #: Last seq the client received (-1 for none).
    last_seq: int


ClientFrame = ChatFrame | CancelFrame | ResumeFrame


def parse_client_frame(data: str | bytes, limits: Limits) -> ClientFrame:
    """Parse and validate one client frame; raises ``ProtocolError``."""
    if not isinstance(data, str):
        raise ProtocolError(ErrorCode.BINARY_FRAME, "binary frames are not supported; send JSON text frames")
    # chars <= bytes, so this refuses the largest frames before paying for their encoding.
    if len(data) > limits.max_frame_bytes:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE, f"frame exceeds {limits.max_frame_bytes} bytes")
    # surrogatepass keeps lone surrogates as invalid UTF-8 for the decoder to refuse.
    raw = data.encode("utf-8", "surrogatepass")
    if len(raw) > limits.max_frame_bytes:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE, f"frame exceeds {limits.max_frame_bytes} bytes")
    try:
        obj = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeError) as exc:
        raise ProtocolError(ErrorCode.INVALID_JSON, f"frame is not valid JSON: {_why_not_json(raw, exc)}") from None
    except RecursionError:  # msgspec's own nesting limit is the interpreter's recursion limit
        raise _too_deep(limits) from None
    if nesting_exceeds(raw, obj, limits.max_nesting):
        raise _too_deep(limits)
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.INVALID_FRAME, "frame must be a JSON object")
    try:
        return _parse_object(obj, limits)
    except ProtocolError as err:
        err.control = obj.get("type") in ("cancel", "resume")
        raise


def _parse_object(obj: dict[str, Any], limits: Limits) -> ClientFrame:
    request_id = _optional_id(obj)
    kind = obj.get("type")
    if kind is None:  # the documented code for a missing type too; the message says which
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, "frame has no 'type'; expected chat, cancel or resume", request_id)
    if kind == "chat":
        return _parse_chat(obj, request_id, limits)
    if kind == "cancel":
        return CancelFrame(_required_id(obj, request_id))
    if kind == "resume":
        return ResumeFrame(_required_id(obj, request_id), _int(obj, "last_seq", request_id, -1, 2**31, None))
    raise ProtocolError(
        ErrorCode.UNKNOWN_TYPE, f"unknown frame type {_describe(kind)}; expected chat, cancel or resume", request_id
    )


#: A ``\\uXXXX`` escape of a UTF-16 surrogate (valid JSON only as half of a pair).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _why_not_json(raw: bytes, exc: Exception) -> str:
    """The decoder's reason, or the real one where it misleads: msgspec calls a string with a
    lone surrogate escape (``"\\ud800"``: no text) "truncated"."""
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.loads(raw)  # the standard library takes lone surrogates: then that is all it is
        except (ValueError, RecursionError):  # another fault, or nested past the interpreter's limit
            pass
        else:
            return "a \\u escape in D800-DFFF that is not half of a surrogate pair (not text)"
    return str(exc)


def _too_deep(limits: Limits) -> ProtocolError:
    return ProtocolError(ErrorCode.INVALID_JSON, f"frame is nested deeper than {limits.max_nesting} levels")


def nesting_exceeds(raw: bytes, obj: object, max_nesting: int) -> bool:
    """Whether ``obj`` (decoded from ``raw``) nests containers deeper than ``max_nesting``.

    Counting brackets in the raw bytes (C speed) settles ordinary frames at once; only a frame
    with many of them is walked, iteratively, in time linear in its size.
    """
    if raw.count(b"[") + raw.count(b"{") <= max_nesting:
        return False
    level: list[Any] = [obj] if isinstance(obj, (dict, list)) else []
    for _ in range(max_nesting):  # ``level`` holds the containers at depth 1, 2, ... in turn
        level = [child for value in level for child in (value.values() if isinstance(value, dict) else value)
                 if isinstance(child, (dict, list))]
        if not level:
            return False
    return True


def _describe(value: object) -> str:
    """Name a client value in an error message without echoing (or recursing into) all of it."""
    if isinstance(value, str):
        return repr(value[:_MAX_ECHO_CHARS] + ("..." if len(value) > _MAX_ECHO_CHARS else ""))
    if value is None or isinstance(value, bool):
        return repr(value)
    return "of JSON type " + ("object" if isinstance(value, dict) else "array" if isinstance(value, list) else "number")


def _optional_id(obj: dict[str, Any]) -> str | None:
    value = obj.get("id")
    if value is None:
        return None
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "id must be 1-128 characters of [A-Za-z0-9_.:-]")
    return value


def _required_id(obj: dict[str, Any], request_id: str | None) -> str:
    if request_id is None:
        raise ProtocolError(ErrorCode.MISSING_FIELD, "field 'id' is required")
    return request_id


def _int(obj: dict[str, Any], name: str, rid: str | None, lo: int, hi: int, default: int | None) -> int:
    value = obj.get(name)
    if value is None:  # absent or null: the default
        value = default
    if value is None:
        raise ProtocolError(ErrorCode.MISSING_FIELD, f"field '{name}' is required", rid)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"field '{name}' must be an integer in [{lo}, {hi}]", rid)
    return value


#: The smallest ``top_p`` sent to an engine (vLLM and TensorRT-LLM refuse 0): only the most
#: likely token is ever in the nucleus, as with 0.
MIN_TOP_P = 1e-6


def _float(obj: dict[str, Any], name: str, rid: str | None, lo: float, hi: float, default: float) -> float:
    value = obj.get(name)
    if value is None:  # absent or null: the default
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"field '{name}' must be a number in [{lo}, {hi}]", rid)
    return float(value)


def _parse_chat(obj: dict[str, Any], rid: str | None, limits: Limits) -> ChatFrame:
    raw = obj.get("messages")
    if raw is None:
        raise ProtocolError(ErrorCode.MISSING_FIELD, "field 'messages' is required", rid)
    if not isinstance(raw, list) or not raw:
        raise ProtocolError(ErrorCode.INVALID_FIELD, "field 'messages' must be a non-empty list", rid)
    if len(raw) > limits.max_messages:
        raise ProtocolError(ErrorCode.TOO_MANY_MESSAGES, f"at most {limits.max_messages} messages per request", rid)
    messages = []
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in ROLES or not isinstance(m.get("content"), str):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD, f"messages[{i}] must be {{'role': system|user|assistant, 'content': string}}", rid
            )
        messages.append(ChatMessage(role, m["content"]))
    return chat_frame(obj, rid, tuple(messages), limits)


def chat_frame(obj: dict[str, Any], rid: str | None, messages: tuple[ChatMessage, ...], limits: Limits, *,
               max_tokens_field: str = "max_tokens", default_temperature: float = 0.7) -> ChatFrame:
    """Validate a chat's fields other than its messages (shared with the OpenAI-style API)."""
    if sum(len(m.content) for m in messages) > limits.max_prompt_chars:
        raise ProtocolError(ErrorCode.PROMPT_TOO_LONG, f"messages exceed {limits.max_prompt_chars} characters", rid)
    max_tokens = obj.get(max_tokens_field)
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > limits.max_tokens_limit:
        raise ProtocolError(ErrorCode.MAX_TOKENS_TOO_LARGE,
                            f"{max_tokens_field} must be at most {limits.max_tokens_limit}", rid)
    seed = obj.get("seed")
    deadline = obj.get("deadline_ms")
    return ChatFrame(
        id=rid,
        messages=messages,
        max_tokens=_int(obj, max_tokens_field, rid, 1, limits.max_tokens_limit, limits.default_max_tokens),
        temperature=_float(obj, "temperature", rid, 0.0, 2.0, default_temperature),
        # OpenAI takes top_p 0 (a nucleus of one token); engines want it above 0: the same nucleus.
        top_p=max(_float(obj, "top_p", rid, 0.0, 1.0, 1.0), MIN_TOP_P),
        # OpenAI takes any signed 64-bit seed; engines want one >= 0: a negative one is folded
        # into [0, 2**63) (the same seed, the same answer).
        seed=None if seed is None else _int(obj, "seed", rid, -2**63, 2**63 - 1, None) % 2**63,
        deadline_ms=None if deadline is None else _int(obj, "deadline_ms", rid, 1, 3_600_000, None),
        stop=_stop(obj.get("stop"), rid),
        model=_model(obj.get("model"), rid),
    )


def _stop(value: object, rid: str | None) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP or \
            not all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in items):
        raise ProtocolError(ErrorCode.INVALID_FIELD, f"field 'stop' must be a string or a list of at most {MAX_STOP} "
                            f"strings of 1-{MAX_STOP_CHARS} characters", rid)
    return tuple(items)


def _model(value: object, rid: str | None) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _MODEL_RE.fullmatch(value):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "field 'model' must be 1-128 characters of [A-Za-z0-9_.:/@-]", rid)
    return value


# -- server frames -------------------------------------------------------------------


def scoped_id(key_id: str, client_id: str) -> str:
    """The id a client's request has in Redis and in the edge's bookkeeping: the client's id
    within its API key's namespace. Two keys may both number their requests ``q1``, ``q2`` ...;
    neither can refuse, resume, cancel or probe the other's. Without auth (one anonymous
    namespace) ids are used as sent."""
    return f"{key_id}{_SCOPE}{client_id}" if key_id else client_id


def client_id(request_id: str) -> str:
    """The id the client sent (what every frame carries): ``request_id`` without its key's scope."""
    return request_id.rpartition(_SCOPE)[2]


class Timing(msgspec.Struct):
    queue_ms: float
    ttft_ms: float
    total_ms: float


_enc = msgspec.json.Encoder()


def accepted_frame(request_id: str, lane: str, predicted_tokens: int, pool: str | None = None) -> bytes:
    """``pool``: the model pool the request was enqueued in (absent for a fixed answer)."""
    frame: dict[str, object] = {"type": "accepted", "id": client_id(request_id), "lane": lane,
                                "predicted_tokens": predicted_tokens}
    if pool is not None:
        frame["pool"] = pool
    return _enc.encode(frame)


def resumed_frame(request_id: str, last_seq: int) -> bytes:
    """A resume was taken: deltas after ``last_seq`` follow (then the terminal frame)."""
    return _enc.encode({"type": "resumed", "id": client_id(request_id), "last_seq": last_seq})


def delta_frame(request_id: str, seq: int, text: str) -> bytes:
    return _enc.encode({"type": "delta", "id": client_id(request_id), "seq": seq, "text": text})


def done_frame(request_id: str, reason: FinishReason, usage: Usage, timing: Timing) -> bytes:
    return _enc.encode(
        {"type": "done", "id": client_id(request_id), "finish_reason": reason.value, "usage": usage, "timing": timing}
    )


def error_frame(code: ErrorCode | str, message: str, request_id: str | None = None, **extra: Any) -> bytes:
    frame: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if request_id is not None:
        frame["id"] = client_id(request_id)
    frame.update(extra)
    return _enc.encode(frame)
