"""The WebSocket protocol parser is sans-I/O: frames in, typed frames or errors out."""

from __future__ import annotations

import json

import pytest

from lanes.ws_server.protocol import (
    CancelFrame, ChatFrame, Limits, ProtocolError, ResumeFrame, error_frame, parse_client_frame,
)

LIMITS = Limits(max_frame_bytes=4096, max_messages=4, max_prompt_chars=200, max_tokens_limit=512)


def chat(**fields: object) -> str:
    frame = {"type": "chat", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(frame)


def code_of(data: str | bytes) -> str:
    with pytest.raises(ProtocolError) as info:
        parse_client_frame(data, LIMITS)
    return info.value.code


def test_chat_defaults() -> None:
    frame = parse_client_frame(chat(), LIMITS)
    assert isinstance(frame, ChatFrame)
    assert frame.id is None and frame.max_tokens == LIMITS.default_max_tokens and frame.temperature == 0.7
    assert frame.messages[0].role == "user" and frame.messages[0].content == "hi"


def test_chat_full() -> None:
    frame = parse_client_frame(chat(id="a-1", max_tokens=16, temperature=0, seed=3, deadline_ms=500), LIMITS)
    assert isinstance(frame, ChatFrame)
    assert (frame.id, frame.max_tokens, frame.temperature, frame.seed, frame.deadline_ms) == ("a-1", 16, 0.0, 3, 500)


def test_cancel_and_resume() -> None:
    assert parse_client_frame('{"type":"cancel","id":"x"}', LIMITS) == CancelFrame("x")
    assert parse_client_frame('{"type":"resume","id":"x","last_seq":4}', LIMITS) == ResumeFrame("x", 4)


@pytest.mark.parametrize(("data", "code"), [
    (b'{"type":"chat"}', "binary_frame"),
    ("{not json", "invalid_json"),
    ("[1,2]", "invalid_frame"),
    ('"chat"', "invalid_frame"),
    ('{"type":"dance"}', "unknown_type"),
    ('{"messages":[]}', "unknown_type"),
    ('{"type":"chat"}', "missing_field"),
    ('{"type":"cancel"}', "missing_field"),
    ('{"type":"resume","id":"x"}', "missing_field"),
    ('{"type":"chat","messages":"hi"}', "invalid_field"),
    ('{"type":"chat","messages":[]}', "invalid_field"),
    ('{"type":"chat","messages":[{"role":"robot","content":"x"}]}', "invalid_field"),
    ('{"type":"chat","messages":[{"role":"user","content":5}]}', "invalid_field"),
    ('{"type":"chat","messages":[{"role":"user"}]}', "invalid_field"),
    (chat(max_tokens="many"), "invalid_field"),
    (chat(max_tokens=0), "invalid_field"),
    (chat(max_tokens=True), "invalid_field"),
    (chat(max_tokens=513), "max_tokens_too_large"),
    (chat(temperature=-1), "invalid_field"),
    (chat(temperature="hot"), "invalid_field"),
    (chat(id=7), "invalid_field"),
    (chat(id="has space"), "invalid_field"),
    (chat(id="x" * 129), "invalid_field"),
    (chat(messages=[{"role": "user", "content": "x"}] * 5), "too_many_messages"),
    (chat(messages=[{"role": "user", "content": "x" * 201}]), "prompt_too_long"),
    (chat(pad="x" * 5000), "frame_too_large"),
])
def test_bad_frames_get_a_code(data: str | bytes, code: str) -> None:
    assert code_of(data) == code


def test_error_names_the_field_and_keeps_the_id() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_client_frame(chat(id="r1", max_tokens="many"), LIMITS)
    assert info.value.request_id == "r1"
    assert "max_tokens" in info.value.message


def test_error_frame_shape() -> None:
    frame = json.loads(error_frame("overloaded", "busy", "r1", retry_after_ms=250))
    assert frame == {"type": "error", "code": "overloaded", "message": "busy", "id": "r1", "retry_after_ms": 250}


@pytest.mark.parametrize("content", ["\ud800", "\\ud800"])
def test_lone_surrogates_are_invalid_json(content: str) -> None:
    assert code_of('{"type":"chat","messages":[{"role":"user","content":"a%sb"}]}' % content) == "invalid_json"


def test_messages_say_what_is_wrong() -> None:
    """A missing type and a lone surrogate escape: the message names them, not "type None" or
    msgspec's "truncated"."""
    with pytest.raises(ProtocolError) as no_type:
        parse_client_frame('{"id":"a"}', LIMITS)
    assert (no_type.value.code, no_type.value.message) == ("unknown_type", "frame has no 'type'; expected chat, cancel or resume")
    with pytest.raises(ProtocolError) as lone:
        parse_client_frame('{"type":"chat","messages":[{"role":"user","content":"\\ud800"}]}', LIMITS)
    assert "not half of a surrogate pair" in lone.value.message
    with pytest.raises(ProtocolError) as cut:  # a pair is text: a real error elsewhere keeps its reason
        parse_client_frame('{"type":"chat","messages":[{"role":"user","content":"\\ud83d\\ude00"}]', LIMITS)
    assert "surrogate" not in cut.value.message


def test_a_deep_frame_with_a_lone_surrogate_escape_is_refused_as_invalid_json() -> None:
    """Found by the fuzz test in CI: the lone-surrogate explanation re-parses the frame with the
    standard library, which raised RecursionError past ~1,000 levels instead of refusing it."""
    deep = '[' * 1500 + ']' * 1500
    # msgspec stops at the raw surrogate (invalid UTF-8) before the depth; the escape sends the
    # explanation to the standard library, which walks the whole frame.
    frame = '{"\ud800type":"chat","x":%s,"id":{"\\ud800": null}}' % deep
    assert code_of(frame) == "invalid_json"


@pytest.mark.parametrize("size", [0, 1, 125, 126, 127, 65535, 65536, 300_000])
def test_the_edge_frames_text_exactly_as_the_websockets_library_does(size: int) -> None:
    from websockets.frames import Frame, Opcode

    from lanes.ws_server.session import _text_header

    payload = b"{" + b"x" * max(0, size - 2) + b"}" if size >= 2 else b"x" * size
    assert _text_header(len(payload)) + payload == Frame(Opcode.TEXT, payload).serialize(mask=False, extensions=[])
