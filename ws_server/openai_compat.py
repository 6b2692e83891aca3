"""The OpenAI chat API's wire format, sans-I/O: a ``/v1/chat/completions`` body in, a
``ChatFrame`` (or an ``APIError`` in OpenAI's shape) out; our frames in, OpenAI chunks and
responses out.

Accepted: ``messages`` (string content, or a list of ``{"type": "text"}`` parts, joined by
newlines; roles system, developer (as system), user, assistant; a message's ``name`` is not put
in the prompt), ``model``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``,
``top_p``, ``seed``, ``stop``, ``stream``, ``stream_options.include_usage``, ``user``. Refused
with 400 (code ``unsupported_parameter``, ``param`` naming it): ``n`` other than 1, and any
field asking for what this server does not do: ``tools`` / ``functions`` (and their choice
fields), ``logprobs`` / ``top_logprobs``, ``response_format`` other than text, ``logit_bias``,
non-zero ``frequency_penalty`` / ``presence_penalty``, ``audio``, ``modalities`` other than
text, ``prediction``; also non-text content parts, ``tool`` messages and an assistant message's
``tool_calls`` / ``function_call`` / ``refusal`` / ``audio``. A field at its "nothing asked" value (``logprobs: false``, ``presence_penalty: 0``...) is accepted, so
clients that send every default work, and any field sent as ``null`` takes its default.
OpenAI's bookkeeping fields that do not change the answer (``store``, ``metadata``,
``service_tier``, ``prompt_cache_key``, ``safety_identifier``) are accepted and ignored; any
other field is refused, as OpenAI refuses it ("Unrecognized request argument supplied"): an
engine's extension (``top_k``, ``min_tokens``, ``guided_json``...) or a misspelt name
(``max_token``) would otherwise be dropped in silence, and the answer would not be what was
asked for; so is an unknown key of a message or of ``stream_options`` (whose values must be
booleans). ``deadline_ms`` is lanes' own (refuse at once if the predicted queueing is longer).

Errors (``{"error": {"message", "type", "code", "param"}}``)::

    400 invalid_request_error   the body, a field (``param`` names it), unsupported features
    401 invalid_request_error   missing or invalid API key (code invalid_api_key)
    404 invalid_request_error   an unknown model (code model_not_found)
    429 rate_limit_error        rate_limited, too_many_in_flight, overloaded (+ Retry-After)
    500 server_error            the request failed while running (worker_failed, engine_error...)
    503 server_error            Redis or workers unavailable (+ Retry-After)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec
from lanes.queue.errors import CLIENT_FAULTS, ErrorCode
from lanes.queue.messages import ChatMessage
from lanes.ws_server.protocol import ChatFrame, Limits, ProtocolError, chat_frame

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
#: Fields a client sets to ask for something this server does not do, each with the values that
#: ask for nothing (OpenAI's defaults; clients often send them all). Any other value is refused:
#: ignoring it would hand the client less than it asked for, silently.
_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False), "logprobs": (None, False), "top_logprobs": (None, 0),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0), "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "web_search_options": (None,), "reasoning_effort": (None,), "verbosity": (None,),
}
#: OpenAI's fields that ask nothing of the answer: accepted, and ignored.
_IGNORED = frozenset({"user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"})
#: Every field a body may have.
_KNOWN = frozenset({"messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
                    "stop", "stream", "stream_options", "n", "deadline_ms"}) | _IGNORED | frozenset(_UNSUPPORTED)
#: ``stream_options``' keys.
_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})
#: A message's keys besides ``role``, ``content`` and ``name`` (a participant's name: accepted and
#: not put in the prompt, as most open models' chat templates leave it out): those that the SDK's
#: own assistant message carries back into a conversation, accepted where they ask nothing
#: (null, or no tool call). Any other key is refused as OpenAI refuses it: dropped, an assistant
#: turn's ``tool_calls`` would vanish from the prompt without a word.
_MESSAGE_FIELDS: dict[str, tuple[object, ...]] = {
    "tool_calls": ([],), "function_call": (), "refusal": (), "audio": (), "annotations": ([],),
}
_enc = msgspec.json.Encoder()


@dataclass(frozen=True)
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    retry_after_ms: int | None = None
    #: The code lanes' own series count it under, where OpenAI names it otherwise (``OPENAI_CODES``).
    counted_as: str | None = None

    def body(self) -> bytes:
        return _enc.encode({"error": {"message": self.message, "type": self.type, "code": self.code,
                                      "param": self.param}})

    def headers(self) -> dict[str, str]:
        """``Retry-After`` in whole seconds, and ``retry-after-ms`` (the OpenAI SDKs read it
        first) so that a hint under a second is not rounded up to one."""
        if self.retry_after_ms is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_ms / 1000))),
                "retry-after-ms": str(self.retry_after_ms)}


@dataclass(frozen=True)
class CompletionRequest:
    frame: ChatFrame
    stream: bool
    include_usage: bool


def parse_request(body: object, limits: Limits) -> CompletionRequest:
    """Validate a ``/v1/chat/completions`` body; raises ``APIError`` (400) naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    # ``null`` asks for the default, as OpenAI's API and SDKs read it (the SDK sends it for
    # every argument a caller passes as None).
    body = {name: value for name, value in body.items() if value is not None}
    if unknown := sorted(name for name in body if name not in _KNOWN):
        name = unknown[0][:64]
        raise APIError(400, f"Unrecognized request argument supplied: {name} (this server's fields: POST "
                       "/v1/chat/completions in the lanes README; leave it out)", param=name,
                       code="unknown_parameter")
    for name, nothing_asked in _UNSUPPORTED.items():
        if not any(_same(body.get(name), value) for value in nothing_asked):
            allowed = " or send " + " or ".join(_enc.encode(v).decode() for v in nothing_asked[1:]) if nothing_asked[1:] else ""
            raise APIError(400, f"'{name}' is not supported: this server serves plain text chat completions; "
                           f"leave it out{allowed}", param=name, code="unsupported_parameter")
    if (n := body.get("n", 1)) != 1 or isinstance(n, bool):  # true == 1 in Python
        raise APIError(400, "only n=1 is supported", param="n", code="unsupported_parameter")
    if "max_completion_tokens" in body and "max_tokens" in body:
        raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
    max_tokens_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    options = _stream_options(body.get("stream_options"))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", param="stream")
    if options is not None and not stream:  # as OpenAI answers
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(body.get("model"), str):
        problem = "is required" if body.get("model") is None else "must be a string"
        raise APIError(400, f"'model' {problem}: a pool name (GET /v1/models lists them), or 'auto'", param="model")
    try:
        frame = chat_frame(body, None, _messages(body.get("messages"), limits), limits,
                           max_tokens_field=max_tokens_field, default_temperature=1.0)
    except ProtocolError as err:
        raise APIError(400, err.message, code=OPENAI_CODES.get(err.code, err.code.value),
                       param=_param(err, max_tokens_field), counted_as=err.code.value) from None
    return CompletionRequest(frame, stream, bool(options and options.get("include_usage")))


def _stream_options(options: object) -> dict[str, bool] | None:
    """``stream_options``: booleans only (``"include_usage": "no"`` was read as true), and no
    other key than OpenAI's two (``include_obfuscation`` is accepted and ignored: this server pads
    no chunk, which changes no answer)."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    for name, value in options.items():
        param = f"stream_options.{str(name)[:64]}"
        if name not in _STREAM_OPTIONS:
            raise APIError(400, f"Unrecognized request argument supplied: {param} (stream_options takes "
                           "include_usage and include_obfuscation)", param=param, code="unknown_parameter")
        if value is not None and not isinstance(value, bool):
            raise APIError(400, f"'{param}' must be a boolean", param=param, code="invalid_field")
    return options


def _same(given: object, value: object) -> bool:
    """JSON equality: 0 and 0.0 are the same, false and 0 are not."""
    return given == value and isinstance(given, bool) == isinstance(value, bool)


def _messages(raw: object, limits: Limits) -> tuple[ChatMessage, ...]:
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    if len(raw) > limits.max_messages:
        raise APIError(400, f"at most {limits.max_messages} messages per request", param="messages",
                       code=ErrorCode.TOO_MANY_MESSAGES.value)
    messages = []
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in _ROLES:  # a list or object: unhashable, a 500 before
            raise APIError(400, f"messages[{i}].role must be system, developer, user or assistant",
                           param=f"messages[{i}].role")
        _message_fields(m, i)
        messages.append(ChatMessage(_ROLES[role], _content(m.get("content"), i, role)))
    return tuple(messages)


def _message_fields(message: dict[str, Any], i: int) -> None:
    """Refuse a key of ``messages[i]`` that would otherwise be dropped (see ``_MESSAGE_FIELDS``)."""
    for name, value in message.items():
        if name in ("role", "content") or value is None:
            continue
        param = f"messages[{i}].{str(name)[:64]}"
        if name == "name":
            if not isinstance(value, str):
                raise APIError(400, f"'{param}' must be a string", param=param, code="invalid_field")
            continue
        if name not in _MESSAGE_FIELDS:
            raise APIError(400, f"Unrecognized request argument supplied: {param} (a message has role, "
                           "content and name)", param=param, code="unknown_parameter")
        if not any(_same(value, asks_nothing) for asks_nothing in _MESSAGE_FIELDS[name]):
            raise APIError(400, f"'{param}' is not supported: this server serves plain text chat completions "
                           "(no tool calls, refusals or audio in a message); leave it out", param=param,
                           code="unsupported_parameter")


def _content(content: object, i: int, role: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:  # OpenAI's null content is an assistant turn's (one that called tools)
        if role == "assistant":
            return ""
        raise APIError(400, f"messages[{i}].content is required for role {role!r}", param=f"messages[{i}].content")
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise APIError(400, f"messages[{i}].content: only text parts are supported",
                           param=f"messages[{i}].content", code="unsupported_content")
        return "\n".join(p["text"] for p in content)  # as vLLM and TensorRT-LLM's servers join them
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content")


def _param(err: ProtocolError, max_tokens_field: str) -> str | None:
    """The field a protocol error is about, for OpenAI's ``param``."""
    if err.code is ErrorCode.MAX_TOKENS_TOO_LARGE:
        return max_tokens_field
    if err.code is ErrorCode.PROMPT_TOO_LONG:
        return "messages"
    if "'" in err.message:  # ``field 'x' ...``
        return err.message.split("'")[1]
    return None


# -- our error codes in OpenAI's shape ---------------------------------------------------

#: Our codes that OpenAI names otherwise, as its clients key their handling on its names.
OPENAI_CODES = {ErrorCode.PROMPT_TOO_LONG: "context_length_exceeded"}
_TOO_MANY = {ErrorCode.RATE_LIMITED, ErrorCode.TOO_MANY_IN_FLIGHT, ErrorCode.OVERLOADED}
#: The code an answer ends with when its API key is revoked while it runs (OpenAI's for a bad key).
KEY_REVOKED = "invalid_api_key"


def error_from_frame(frame: dict[str, Any]) -> APIError:
    """An ``error`` frame of ours as an OpenAI error with the right status."""
    code, message = str(frame.get("code", "internal")), str(frame.get("message", "error"))
    retry_ms = frame.get("retry_after_ms")
    retry = None if not isinstance(retry_ms, (int, float)) else max(1, math.ceil(retry_ms))
    if code == KEY_REVOKED:
        return APIError(401, message, code=code)
    if code == "model_not_found":
        return APIError(404, message, code=code, param="model")
    if code == ErrorCode.PROMPT_TOO_LONG:
        return APIError(400, message, code=OPENAI_CODES[ErrorCode.PROMPT_TOO_LONG], param="messages", counted_as=code)
    if code in _TOO_MANY:
        return APIError(429, message, "rate_limit_error", code, retry_after_ms=retry or 1000)
    if code == ErrorCode.UNAVAILABLE:
        return APIError(503, message, "server_error", code, retry_after_ms=retry or 1000)
    if code in CLIENT_FAULTS:
        return APIError(400, message, code=code)
    return APIError(500, message, "server_error", code)


# -- responses ---------------------------------------------------------------------------


def usage(frame: dict[str, Any]) -> dict[str, int]:
    u = frame.get("usage") or {}
    prompt, completion = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish_reason(frame: dict[str, Any]) -> str:
    """``length`` stays ``length``; a stop is ``stop``. (A ``cancelled`` end is an error:
    ``ending_error``.)"""
    return "length" if frame.get("finish_reason") == "length" else "stop"


def ending_error(frame: dict[str, Any]) -> APIError | None:
    """The error a frame ends the answer with, or None: an ``error`` frame; also a ``done``
    that says ``cancelled``. An HTTP client cannot cancel, so the server cut that answer short
    (the key was revoked, the request was lost track of...), and a ``finish_reason`` of
    ``stop`` would pass the cut answer off as complete."""
    if frame.get("type") == "error":
        return error_from_frame(frame)
    if frame.get("type") == "done" and frame.get("finish_reason") == "cancelled":
        return APIError(500, "the request was cancelled by the server before its answer ended; retry it",
                        "server_error", "cancelled")
    return None


def chunk(request_id: str, created: int, model: str, delta: dict[str, str], finish: str | None = None,
          usage_: dict[str, int] | None = None, with_usage: bool = False) -> bytes:
    """One ``chat.completion.chunk`` as a server-sent event."""
    body: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                            "system_fingerprint": None,
                            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if with_usage:
        body["usage"] = usage_
    return b"data: " + _enc.encode(body) + b"\n\n"


def usage_chunk(request_id: str, created: int, model: str, usage_: dict[str, int]) -> bytes:
    """The last chunk with ``stream_options.include_usage``: no choices, the whole usage."""
    body = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None, "choices": [], "usage": usage_}
    return b"data: " + _enc.encode(body) + b"\n\n"


def error_event(error: APIError) -> bytes:
    """A mid-stream failure: the SDKs raise ``APIError`` on a chunk carrying ``error``."""
    return b"data: " + error.body() + b"\n\n"


DONE = b"data: [DONE]\n\n"
#: An SSE comment: keeps an idle stream open; every SSE client (the OpenAI SDKs) skips it.
KEEPALIVE = b": keep-alive\n\n"


def completion(request_id: str, created: int, model: str, text: str, finish: str,
               usage_: dict[str, int]) -> bytes:
    return _enc.encode({
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                     "logprobs": None, "finish_reason": finish}],
        "usage": usage_,
    })


def _model(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "lanes"}


def models(names: list[str], created: int) -> bytes:
    return _enc.encode({"object": "list", "data": [_model(n, created) for n in names]})


def model(name: str, names: list[str], created: int) -> bytes:
    """``GET /v1/models/{name}``: the model object, or ``APIError`` 404 as OpenAI answers."""
    if name not in names:
        raise APIError(404, f"the model '{name}' does not exist; serving: {', '.join(names) or 'none'}",
                       code="model_not_found", param="model")
    return _enc.encode(_model(name, created))
