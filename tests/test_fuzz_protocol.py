"""Property-based fuzzing of the sans-I/O protocol parser (pure: no loop, no sockets).

Hostile input must never escape as anything but a ``ProtocolError`` whose code is one of the
codes documented in ``docs/protocol.md``: any other exception would end the connection
handler on the edge with no ``error`` frame for the client. Each property runs a bounded
number of examples (``_FUZZ``) so the whole file stays within a few seconds on a slow VM;
``LANES_FUZZ_EXAMPLES=20000`` runs a long search.
"""

from __future__ import annotations

import json
import os
import re
import string
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lanes.ws_server.protocol import (
    CancelFrame, ChatFrame, ClientFrame, Limits, ProtocolError, ResumeFrame, error_frame, parse_client_frame,
)

LIMITS = Limits(max_frame_bytes=16 * 1024, max_messages=8, max_prompt_chars=4096, max_tokens_limit=1024)
DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
_ID_CHARS = string.ascii_letters + string.digits + "_.:-"
_FUZZ = settings(max_examples=int(os.environ.get("LANES_FUZZ_EXAMPLES", "150")), deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                          HealthCheck.data_too_large])


def documented_codes() -> frozenset[str]:
    """Every error code named in the first column of the doc's error-code table."""
    table = DOC.read_text().split("### Error codes", 1)[1].split("\n## ", 1)[0]
    codes: set[str] = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            codes.update(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    return frozenset(codes)


CODES = documented_codes()


# -- strategies ------------------------------------------------------------------------

def deep_json(depth: int, leaf: str = "1") -> str:
    """JSON text nested ``depth`` levels, alternating arrays and objects."""
    opens = "".join("[" if i % 2 else '{"k":' for i in range(depth))
    closes = "".join("]" if i % 2 else "}" for i in reversed(range(depth)))
    return opens + leaf + closes


def _json_values(*, finite: bool) -> st.SearchStrategy[Any]:
    """Any JSON shape; ``finite=False`` adds NaN and infinities (json.dumps writes them as literals)."""
    return st.recursive(
        st.none() | st.booleans() | st.floats(allow_nan=not finite, allow_infinity=not finite)
        | st.integers(min_value=-(2**200), max_value=2**200) | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=12,
    )


json_values = _json_values(finite=False)
# Raw JSON fragments no json.dumps would write: deep nesting, huge numbers, non-standard literals.
raw_fragments = st.one_of(
    st.integers(1, 6000).map(deep_json),
    st.integers(1, 6000).map(lambda n: "9" * n),
    st.integers(1, 6000).map(lambda n: "-0." + "1" * n + "e999999"),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-400", "0x10", "01", "+1", "'x'",
                     '"\\ud800"', '"\\udfff\\ud800"', '"\\u0000"', '"\\x"', "true", "null", "[]", "{}"]),
    st.integers(0, 40_000).map(lambda n: json.dumps("x" * n)),
)
fields = st.sampled_from(["type", "id", "messages", "max_tokens", "temperature", "top_p", "seed",
                          "deadline_ms", "last_seq", "role", "content"])
valid_ids = st.text(alphabet=_ID_CHARS, min_size=1, max_size=128)


@st.composite
def mutated_frames(draw: st.DrawFn) -> str:
    """A plausible frame with one or more fields replaced by any JSON value or raw fragment."""
    kind = draw(st.sampled_from(["chat", "cancel", "resume"]))
    base: dict[str, str] = {"type": json.dumps(kind), "id": json.dumps(draw(valid_ids)),
                            "messages": '[{"role":"user","content":"hi"}]', "last_seq": "3"}
    for name in draw(st.lists(fields, min_size=1, max_size=4)):
        fragment = draw(st.one_of(json_values.map(json.dumps), raw_fragments))
        if name in ("role", "content"):
            other = '"user"' if name == "content" else '"hi"'
            pair = {"role": fragment, "content": other} if name == "role" else {"role": other, "content": fragment}
            base["messages"] = '[{"role":%s,"content":%s}]' % (pair["role"], pair["content"])
        else:
            base[name] = fragment
    items = [f"{json.dumps(k)}:{v}" for k, v in base.items()]
    if draw(st.booleans()):  # duplicate keys: the last one wins in msgspec, never a crash
        items.append(f"{json.dumps(draw(fields))}:{draw(json_values.map(json.dumps))}")
    return "{" + ",".join(draw(st.permutations(items))) + "}"


surrogates = st.integers(0xD800, 0xDFFF).map(chr)
hostile_text = st.one_of(
    json_values.map(json.dumps),
    raw_fragments,
    mutated_frames(),
    st.text(max_size=200),
    st.binary(max_size=200).map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.tuples(mutated_frames(), st.integers(0, 50), st.lists(surrogates, min_size=1, max_size=3)).map(
        lambda t: t[0][: t[1]] + "".join(t[2]) + t[0][t[1]:]),
    st.tuples(mutated_frames(), st.integers(0, 50), st.binary(min_size=1, max_size=8)).map(
        lambda t: t[0][: t[1]] + t[2].decode("utf-8", "surrogateescape") + t[0][t[1]:]),
)


# -- properties ------------------------------------------------------------------------

def parse_or_error(data: str | bytes) -> ClientFrame | ProtocolError:
    """Parse, turning a ``ProtocolError`` into a value; anything else propagates (a failure)."""
    try:
        return parse_client_frame(data, LIMITS)
    except ProtocolError as err:
        return err


def check_error(err: ProtocolError) -> None:
    """The error carries a documented code and makes an ``error`` frame of strict UTF-8 JSON."""
    assert err.code in CODES, f"undocumented code {err.code!r}"
    assert err.request_id is None or re.fullmatch(r"[A-Za-z0-9_.:\-]{1,128}", err.request_id)
    assert len(err.message) <= 512, "an error message must not echo hostile input at length"
    wire = error_frame(err.code, err.message, err.request_id)
    frame = json.loads(wire.decode("utf-8"))  # strict: no surrogates or invalid bytes on the wire
    assert frame["type"] == "error" and frame["code"] == err.code and frame["message"] == err.message
    assert frame.get("id") == err.request_id


def check_frame(frame: ClientFrame) -> None:
    """A frame the parser accepts satisfies every documented constraint."""
    if frame.id is not None:
        assert re.fullmatch(r"[A-Za-z0-9_.:\-]{1,128}", frame.id), f"bad id {frame.id!r} accepted"
    if isinstance(frame, ChatFrame):
        assert 1 <= len(frame.messages) <= LIMITS.max_messages
        assert all(m.role in ("system", "user", "assistant") and isinstance(m.content, str) for m in frame.messages)
        assert sum(len(m.content) for m in frame.messages) <= LIMITS.max_prompt_chars
        assert type(frame.max_tokens) is int and 1 <= frame.max_tokens <= LIMITS.max_tokens_limit
        assert type(frame.temperature) is float and 0.0 <= frame.temperature <= 2.0
        assert type(frame.top_p) is float and 0.0 < frame.top_p <= 1.0
        assert frame.seed is None or (type(frame.seed) is int and 0 <= frame.seed < 2**63)
        assert frame.deadline_ms is None or (type(frame.deadline_ms) is int and frame.deadline_ms >= 1)
    elif isinstance(frame, ResumeFrame):
        assert type(frame.last_seq) is int and frame.last_seq >= -1
    else:
        assert isinstance(frame, CancelFrame)


def check(data: str | bytes) -> None:
    result = parse_or_error(data)
    if isinstance(result, ProtocolError):
        check_error(result)
    else:
        check_frame(result)


@_FUZZ
@given(hostile_text)
def test_hostile_text_gets_a_frame_or_a_documented_error(data: str) -> None:
    check(data)


@_FUZZ
@given(st.binary(max_size=1000))
def test_binary_frames_are_refused(data: bytes) -> None:
    result = parse_or_error(data)
    assert isinstance(result, ProtocolError) and result.code == "binary_frame"
    check_error(result)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4 * LIMITS.max_frame_bytes), st.sampled_from(["x", "é", "€", "\U0001f600"]))
def test_frame_size_limit_counts_utf8_bytes(num_chars: int, char: str) -> None:
    """The limit is in bytes, as documented: multi-byte characters count for their encoding."""
    frame = json.dumps({"type": "cancel", "id": "x", "pad": char * num_chars}, ensure_ascii=False)
    result = parse_or_error(frame)
    if len(frame.encode("utf-8")) > LIMITS.max_frame_bytes:
        assert isinstance(result, ProtocolError) and result.code == "frame_too_large"
    else:
        assert result == CancelFrame("x")


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 20_000), st.sampled_from(["type", "id", "messages", "max_tokens", "role", "content"]))
@example(1500, "messages")  # past msgspec's recursion limit yet within the frame limit: RecursionError
@example(2, "role")  # an unhashable role once raised TypeError from the ``in ROLES`` test
@example(LIMITS.max_nesting, "type")  # the frame object adds a level: one past the limit
@example(LIMITS.max_nesting - 1, "type")  # exactly at the limit: parsed (and refused as unknown_type)
def test_deep_nesting_in_any_field_is_refused_cleanly(depth: int, name: str) -> None:
    """Nesting beyond ``max_nesting`` is ``invalid_json`` whatever the interpreter's recursion
    limit or the caller's stack depth; within it, the field's own check answers."""
    nested = deep_json(depth)
    message = {"role": "user", "content": "hi"}
    frame = {"type": "chat", "id": "deep", "messages": [message], "max_tokens": 8}
    text = json.dumps(frame)
    if name in ("role", "content"):
        text = text.replace(json.dumps(message[name]), nested, 1)
    else:
        text = text.replace(json.dumps(frame[name]), nested, 1)
    total_depth = depth + (3 if name in ("role", "content") else 1)
    result = parse_or_error(text)
    assert isinstance(result, ProtocolError), result
    check_error(result)
    if len(text) <= LIMITS.max_frame_bytes:
        assert (result.code == "invalid_json") == (total_depth > LIMITS.max_nesting), (total_depth, result.code)


def _message() -> st.SearchStrategy[dict[str, str]]:
    return st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                  "content": st.text(max_size=60)})


@st.composite
def valid_chats(draw: st.DrawFn) -> dict[str, Any]:
    """A chat frame inside every limit, with optional fields present or absent."""
    frame: dict[str, Any] = {"type": "chat", "messages": draw(st.lists(_message(), min_size=1,
                                                                        max_size=LIMITS.max_messages))}
    optional = {
        "id": valid_ids,
        "max_tokens": st.integers(1, LIMITS.max_tokens_limit),
        "temperature": st.one_of(st.integers(0, 2), st.floats(0.0, 2.0)),
        "top_p": st.floats(1e-6, 1.0),
        "seed": st.integers(0, 2**63 - 1),
        "deadline_ms": st.integers(1, 3_600_000),
        "unknown_extra": _json_values(finite=True),
    }
    for name, strategy in optional.items():
        if draw(st.booleans()):
            frame[name] = draw(strategy)
    return frame


@_FUZZ
@given(valid_chats(), st.booleans())
def test_valid_chat_frames_round_trip(frame: dict[str, Any], ascii_only: bool) -> None:
    parsed = parse_client_frame(json.dumps(frame, ensure_ascii=ascii_only), LIMITS)
    assert isinstance(parsed, ChatFrame)
    assert parsed.id == frame.get("id")
    assert [(m.role, m.content) for m in parsed.messages] == [(m["role"], m["content"]) for m in frame["messages"]]
    assert parsed.max_tokens == frame.get("max_tokens", LIMITS.default_max_tokens)
    assert parsed.temperature == float(frame.get("temperature", 0.7))
    assert parsed.top_p == frame.get("top_p", 1.0)
    assert parsed.seed == frame.get("seed")
    assert parsed.deadline_ms == frame.get("deadline_ms")
    check_frame(parsed)


@_FUZZ
@given(valid_ids, st.integers(-1, 2**31))
def test_valid_cancel_and_resume_round_trip(request_id: str, last_seq: int) -> None:
    assert parse_client_frame(json.dumps({"type": "cancel", "id": request_id}), LIMITS) == CancelFrame(request_id)
    resume = json.dumps({"id": request_id, "last_seq": last_seq, "type": "resume"})
    assert parse_client_frame(resume, LIMITS) == ResumeFrame(request_id, last_seq)


@_FUZZ
@given(valid_ids, st.sampled_from(["\n", "\r", " ", "\t", "\x00", "é", "/"]), st.booleans())
def test_ids_outside_the_charset_are_refused(request_id: str, bad: str, at_end: bool) -> None:
    """Ids end up in Redis keys and logs: a trailing newline must not slip past the check."""
    bad_id = request_id[:127] + bad if at_end else bad + request_id[:127]
    result = parse_or_error(json.dumps({"type": "cancel", "id": bad_id}))
    assert isinstance(result, ProtocolError) and result.code == "invalid_field"


# -- the OpenAI API's body (``openai_compat.parse_request``) ------------------------------

_OPENAI_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
                  "stream", "stream_options", "n", "user", "tools", "tool_choice", "logprobs", "response_format",
                  "deadline_ms", "top_k"]
_MESSAGE_KEYS = ["role", "content", "name", "tool_calls", "refusal", "audio", "function_call", "tool_call_id", "x"]
finite_json = _json_values(finite=True)


@st.composite
def openai_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A plausible ``/v1/chat/completions`` body with fields, a message's keys or content parts
    replaced by any JSON value (as msgspec decodes it: no NaN)."""
    message: dict[str, Any] = {"role": "user", "content": "hi"}
    for key in draw(st.lists(st.sampled_from(_MESSAGE_KEYS), max_size=3)):
        message[key] = draw(finite_json | st.sampled_from(["user", "assistant", "tool", "developer"]))
    if draw(st.booleans()):
        message["content"] = [draw(st.dictionaries(st.sampled_from(["type", "text", "image_url"]),
                                                   finite_json | st.just("text"), max_size=3))]
    body: dict[str, Any] = {"model": "default", "messages": [message]}
    for name in draw(st.lists(st.sampled_from(_OPENAI_FIELDS), max_size=4)):
        body[name] = draw(finite_json)
    return body


@_FUZZ
@given(openai_bodies())
@example({"model": "default", "messages": [{"role": ["user"], "content": "hi"}]})  # unhashable: was a 500
@example({"model": "default", "messages": [{"role": {"a": 1}, "content": "hi"}]})
def test_any_openai_body_is_parsed_or_refused_400(body: dict[str, Any]) -> None:
    """Any body is a request or a 400 in OpenAI's shape naming a field; any other exception is a
    500 with a plain-text body (a role sent as a list once was: ``role in _ROLES`` hashed it)."""
    from lanes.ws_server.openai_compat import APIError, CompletionRequest, parse_request

    try:
        parsed = parse_request(body, LIMITS)
    except APIError as refused:
        assert refused.status == 400 and refused.message, refused
        assert json.loads(refused.body())["error"]["type"] == "invalid_request_error"
    else:
        assert isinstance(parsed, CompletionRequest) and parsed.frame.messages
