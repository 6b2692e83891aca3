"""The OpenAI-compatible API, driven by the official ``openai`` package and by ``curl -N``
against real processes (edge, scheduler, a worker on the tiny model)."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from e2e_support import System, fixed_http_server
from lanes.ws_server.auth import generate_key, hash_key

pytestmark = pytest.mark.e2e

KEY = generate_key()
QUESTION = "What does a class definition do?"


@pytest.fixture(scope="module")
def app_page() -> Iterator[int]:
    """A web app's page on a real loopback HTTP server (its port). As ``http://localhost:PORT``
    it is on the "cors" edge's allowlist; as ``http://127.0.0.1:PORT`` it is another origin. A
    page Chromium fetches from no server is a public one, which may not reach loopback at all."""
    with fixed_http_server(b"<html><body>app</body></html>", "text/html") as port:
        yield port


@pytest.fixture(scope="module")
def system(make_cluster, app_page: int) -> System:
    sys_ = make_cluster(workers=1, worker_args=("--max-slots", "4"))
    sys_.start_edge("keyed", LANES_API_KEY_HASHES=hash_key(KEY), LANES_KEY_RATE_PER_S="0.5", LANES_KEY_BURST="1")
    sys_.start_edge("full", LANES_MAX_DEPTH_SHORT="0", LANES_MAX_DEPTH_MEDIUM="0", LANES_MAX_DEPTH_LONG="0")
    sys_.start_edge("cors", LANES_API_KEY_HASHES=hash_key(KEY), LANES_ALLOWED_ORIGINS=f"http://localhost:{app_page}/")
    return sys_


def base(sys_: System, edge: str = "edge") -> str:
    return f"http://127.0.0.1:{sys_.edge_ports[edge]}/v1"


def client(sys_: System, edge: str = "edge", key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=base(sys_, edge), api_key=key, max_retries=0, timeout=60)


def ask(**extra: object) -> dict[str, object]:
    return {"model": "default", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "max_tokens": 24, **extra}


def test_non_streaming_completion_is_the_greedy_answer(system: System, greedy_reference) -> None:
    ref = greedy_reference(QUESTION, 24)
    raw = client(system).chat.completions.with_raw_response.create(**ask())
    answer = raw.parse()
    assert raw.headers["x-lanes-lane"] in ("short", "medium", "long")
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].message.content == ref.text
    assert answer.choices[0].finish_reason == ("stop" if len(ref.ids) < 24 else "length")
    assert answer.usage is not None and answer.usage.completion_tokens == len(ref.ids)
    assert answer.usage.prompt_tokens == ref.prompt_tokens
    assert answer.usage.total_tokens == ref.prompt_tokens + len(ref.ids)


def test_streaming_with_usage(system: System, greedy_reference) -> None:
    ref = greedy_reference(QUESTION, 24)
    chunks = list(client(system).chat.completions.create(**ask(stream=True, stream_options={"include_usage": True})))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop" if len(ref.ids) < 24 else "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(ref.ids)


async def test_async_client_streaming_and_not(system: System, greedy_reference) -> None:
    ref = greedy_reference(QUESTION, 24)
    aclient = openai.AsyncOpenAI(base_url=base(system), api_key="none", max_retries=0, timeout=60)
    whole = await aclient.chat.completions.create(**ask())
    stream = await aclient.chat.completions.create(**ask(stream=True))
    parts = [c.choices[0].delta.content or "" async for c in stream]
    assert whole.choices[0].message.content == "".join(parts) == ref.text
    await aclient.close()


def test_stop_sequence_ends_the_answer_before_it(system: System, greedy_reference) -> None:
    ref = greedy_reference(QUESTION, 24)
    words = ref.text.split()
    assert len(words) > 3, ref.text
    stop = " " + words[len(words) // 2]
    expected = ref.text[: ref.text.index(stop)]
    answer = client(system).chat.completions.create(**ask(stop=[stop]))
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].finish_reason == "stop"


def test_models_lists_the_pools(system: System) -> None:
    models = client(system).models.list()
    assert [m.id for m in models.data] == ["default", "auto"]
    assert client(system).models.retrieve("default").id == "default"
    assert client(system).models.retrieve("auto").id == "auto", "a chat may name it: so may a lookup"


def test_arguments_passed_as_none_take_their_defaults(system: System, greedy_reference) -> None:
    """The SDK sends null for an argument passed as None (wrappers do: ``top_p=cfg.get("top_p")``)."""
    ref = greedy_reference(QUESTION, 24)
    answer = client(system).chat.completions.create(**ask(top_p=None, n=None, seed=None, stop=None, stream=None))
    assert answer.choices[0].message.content == ref.text


@pytest.mark.parametrize("extra,param", [({"n": 2}, "n"), ({"n": True}, "n"), ({"temperature": 5}, "temperature"),
                                         ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                                         ({"max_tokens": 10**6}, "max_tokens"), ({"logprobs": True}, "logprobs"),
                                         ({"response_format": {"type": "json_object"}}, "response_format")])
def test_bad_requests_are_400_naming_the_field(system: System, extra: dict[str, object], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client(system).chat.completions.create(**ask(**extra))
    assert refused.value.status_code == 400 and param in str(refused.value.body)


def test_unknown_paths_and_methods_answer_in_openais_error_shape(system: System) -> None:
    for method, path, status in (("GET", "/chat/completions", 405), ("POST", "/completions", 404),
                                 ("POST", "/embeddings", 404)):
        req = urllib.request.Request(base(system) + path, data=b"{}" if method == "POST" else None, method=method)
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(req, timeout=10)
        error = json.loads(answer.value.read())["error"]
        assert answer.value.code == status and path in error["message"], error
        assert "/v1/chat/completions" in error["message"] and error["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):  # the SDK's own class, with the message it read
        client(system).completions.create(model="default", prompt="hi")
    with pytest.raises(urllib.error.HTTPError) as outside:  # other paths keep plain text
        urllib.request.urlopen(base(system).removesuffix("/v1") + "/nope", timeout=10)
    assert outside.value.code == 404 and outside.value.headers["content-type"].startswith("text/plain")


def test_fields_at_their_defaults_are_accepted_and_what_we_cannot_do_is_refused() -> None:
    """Clients that send every field at OpenAI's default work; a field that asks for something this
    server does not do (logprobs, JSON mode, penalties...) is refused naming it, never ignored."""
    from lanes.ws_server.openai_compat import APIError, parse_request
    from lanes.ws_server.protocol import Limits

    defaults = {"logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"}, "logit_bias": {},
                "frequency_penalty": 0, "presence_penalty": 0.0, "tools": [], "tool_choice": "none",
                "parallel_tool_calls": True, "modalities": ["text"], "audio": None, "user": "u1"}
    parsed = parse_request(ask(**defaults), Limits())
    assert parsed.frame.max_tokens == 24 and parsed.frame.temperature == 0
    asks = {"logprobs": True, "top_logprobs": 2, "response_format": {"type": "json_object"}, "logit_bias": {"50": 5},
            "frequency_penalty": 0.5, "presence_penalty": -1, "tool_choice": "auto", "modalities": ["text", "audio"],
            "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content", "content": "x"},
            "web_search_options": {}}
    for name, value in asks.items():
        with pytest.raises(APIError) as refused:
            parse_request(ask(**{name: value}), Limits())
        assert (refused.value.status, refused.value.param, refused.value.code) == (400, name, "unsupported_parameter")
        assert "leave it out" in refused.value.message
    # null is the default, as the SDK sends it for every argument passed as None
    nulls = parse_request(ask(max_tokens=None, temperature=None, top_p=None, n=None, stream=None, seed=None, stop=None,
                              stream_options=None), Limits())
    assert (nulls.frame.max_tokens, nulls.frame.temperature, nulls.frame.top_p, nulls.stream) == (256, 1.0, 1.0, False)
    # text parts are joined by newlines, as vLLM's and TensorRT-LLM's servers join them
    parts = parse_request(ask(messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                                     {"type": "text", "text": "World"}]}]), Limits())
    assert parts.frame.messages[0].content == "Hello\nWorld"
    for body, param in ((ask(max_tokens=10**6), "max_tokens"), (ask(max_completion_tokens=10**6, max_tokens=None),
                                                                "max_completion_tokens"),
                        (ask(messages=[{"role": "user", "content": "x" * 70_000}]), "messages")):
        with pytest.raises(APIError) as refused:
            parse_request(body, Limits())
        assert refused.value.param == param, refused.value
    with pytest.raises(APIError, match="send false"):
        parse_request(ask(logprobs=0), Limits())  # JSON false and 0 differ
    with pytest.raises(APIError, match="'model' must be a string"):
        parse_request(ask(model=5), Limits())
    # content is required, as OpenAI requires it, except in an assistant turn (null there: a tool call)
    with pytest.raises(APIError, match=r"messages\[0\].content is required"):
        parse_request(ask(messages=[{"role": "user"}]), Limits())
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "?"}]
    assert parse_request(ask(messages=turns), Limits()).frame.messages[1].content == ""
    # top_p 0 (OpenAI's range is 0..1) is the nucleus of one token; engines get the smallest top_p they take
    assert parse_request(ask(top_p=0), Limits()).frame.top_p == 1e-6


def test_unknown_fields_are_refused_as_openai_refuses_them() -> None:
    """An engine's extension or a misspelt field was dropped in silence (``max_token: 5`` gave a
    256-token answer, ``guided_choice`` an unconstrained one); OpenAI answers 400 "Unrecognized
    request argument supplied". Bookkeeping fields that ask nothing of the answer pass."""
    from lanes.ws_server.openai_compat import APIError, parse_request
    from lanes.ws_server.protocol import Limits

    for name, value in (("max_token", 5), ("temprature", 0), ("top_k", 5), ("min_tokens", 10), ("ignore_eos", True),
                        ("guided_choice", ["yes", "no"]), ("repetition_penalty", 1.2), ("best_of", 2), ("echo", True)):
        with pytest.raises(APIError) as refused:
            parse_request(ask(**{name: value}), Limits())
        assert (refused.value.status, refused.value.param, refused.value.code) == (400, name, "unknown_parameter")
        assert refused.value.message.startswith(f"Unrecognized request argument supplied: {name}")
    for name, value in (("reasoning_effort", "high"), ("verbosity", "low")):  # they change the answer
        with pytest.raises(APIError) as refused:
            parse_request(ask(**{name: value}), Limits())
        assert refused.value.code == "unsupported_parameter"
    quiet = {"user": "u1", "store": False, "metadata": {"team": "a"}, "service_tier": "auto",
             "prompt_cache_key": "k", "safety_identifier": "s", "deadline_ms": 5000, "top_k": None}
    assert parse_request(ask(**quiet), Limits()).frame.deadline_ms == 5000
    with pytest.raises(APIError, match="only allowed when 'stream' is true") as refused:
        parse_request(ask(stream_options={"include_usage": True}), Limits())
    assert refused.value.param == "stream_options"


def test_stream_options_and_message_keys_are_checked_not_dropped(system: System, greedy_reference) -> None:
    """``stream_options: {"include_usage": "no"}`` streamed a usage chunk (any truthy value was
    true) and an unknown key there passed; a message's unknown keys were dropped, an assistant
    turn's ``tool_calls`` with them (the prompt lost the call without a word). Now each is a 400
    naming the key; the SDK's own assistant message, appended to the conversation as it is, still
    passes, and so does a message's ``name`` and ``include_obfuscation``."""
    sdk = client(system)
    refused = {"stream_options.include_usage": ({"stream": True, "stream_options": {"include_usage": "no"}},
                                                "invalid_field"),
               "stream_options.include_usag": ({"stream": True, "stream_options": {"include_usag": True}},
                                               "unknown_parameter"),
               "messages[0].contents": ({"messages": [{"role": "user", "content": QUESTION, "contents": "x"}]},
                                        "unknown_parameter"),
               "messages[0].name": ({"messages": [{"role": "user", "content": QUESTION, "name": 5}]}, "invalid_field"),
               "messages[1].tool_calls": ({"messages": [
                   {"role": "user", "content": "Weather?"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                   {"role": "user", "content": QUESTION}]}, "unsupported_parameter")}
    for param, (extra, code) in refused.items():
        with pytest.raises(openai.BadRequestError) as answer:
            sdk.chat.completions.create(**ask(**extra))
        error = answer.value.body
        assert (answer.value.status_code, error["param"], error["code"]) == (400, param, code), error
        assert param in error["message"]
    ref = greedy_reference(QUESTION, 24)
    named = sdk.chat.completions.create(**ask(messages=[{"role": "user", "content": QUESTION, "name": "ann"}]))
    assert named.choices[0].message.content == ref.text, "name is not put in the prompt"
    chunks = list(sdk.chat.completions.create(**ask(stream=True, stream_options={"include_usage": False,
                                                                                  "include_obfuscation": False})))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert all(c.usage is None for c in chunks), "include_usage false: no usage chunk"
    follow_up = [{"role": "user", "content": QUESTION}, named.choices[0].message, {"role": "user", "content": "And?"}]
    again = sdk.chat.completions.create(**ask(messages=follow_up))  # refusal, tool_calls, audio... as null
    assert again.choices[0].finish_reason in ("stop", "length") and again.usage.prompt_tokens > ref.prompt_tokens


def test_a_prompt_over_the_limit_counts_as_on_the_websocket(system: System) -> None:
    """The edge's refusal of a prompt over ``LANES_MAX_PROMPT_CHARS`` answers OpenAI's code
    (``context_length_exceeded``) but counts under the outcome a WebSocket chat's does
    (``prompt_too_long``): it was counted under a second name, only on this API."""
    def counted() -> float:
        text = urllib.request.urlopen(base(system).removesuffix("/v1") + "/metrics", timeout=10).read().decode()
        line = 'lanes_requests_total{lane="none",outcome="prompt_too_long",pool="none"} '
        return sum(float(row.removeprefix(line)) for row in text.splitlines() if row.startswith(line))

    before = counted()
    with pytest.raises(openai.BadRequestError) as answer:
        client(system).chat.completions.create(**ask(messages=[{"role": "user", "content": "x" * 70_000}]))
    assert (answer.value.body["code"], answer.value.body["param"]) == ("context_length_exceeded", "messages")
    assert counted() == before + 1


def test_how_our_frames_end_an_openai_answer() -> None:
    """A ``done`` that says ``cancelled`` is an error (a cut answer is not a complete one); the
    worker's prompt_too_long is OpenAI's context_length_exceeded; a retry hint keeps its
    milliseconds in ``retry-after-ms`` (read first by the SDKs) beside ``Retry-After``."""
    from lanes.ws_server.openai_compat import ending_error, error_from_frame

    cut = ending_error({"type": "done", "finish_reason": "cancelled", "usage": {}})
    assert cut is not None and (cut.status, cut.code) == (500, "cancelled")
    assert ending_error({"type": "done", "finish_reason": "length"}) is None
    assert ending_error({"type": "delta", "seq": 0, "text": "x"}) is None
    long = error_from_frame({"type": "error", "code": "prompt_too_long", "message": "prompt has 6414 tokens"})
    assert (long.status, long.code, long.param) == (400, "context_length_exceeded", "messages")
    busy = error_from_frame({"type": "error", "code": "overloaded", "message": "busy", "retry_after_ms": 69})
    assert busy.headers() == {"Retry-After": "1", "retry-after-ms": "69"}


def test_every_answer_names_its_request_and_a_cross_site_form_post_is_refused(system: System) -> None:
    """Refusals carry ``x-request-id`` too (the SDK's ``APIStatusError.request_id`` was None for
    them). A body sent as text/plain or a form, which any web page can make a visitor's browser
    send without asking, is refused 415 before it costs a token."""
    with pytest.raises(openai.BadRequestError) as bad:
        client(system).chat.completions.create(**ask(messages=[]))
    assert (bad.value.request_id or "").startswith("chatcmpl-")
    with pytest.raises(openai.NotFoundError) as unknown:
        client(system).chat.completions.create(**ask(model="nope"))
    assert (unknown.value.request_id or "").startswith("chatcmpl-")
    for content_type in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data"):
        post = urllib.request.Request(f"{base(system)}/chat/completions", data=json.dumps(ask()).encode(),
                                      headers={"Content-Type": content_type, "Origin": "https://elsewhere.example"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(post, timeout=10)
        error = json.loads(refused.value.read())["error"]
        assert (refused.value.code, error["code"]) == (415, "unsupported_media_type"), error
        assert "application/json" in error["message"]
    # No Content-Type at all (a page's fetch of a Blob, sendBeacon): refused too (audit).
    host, port = base(system).removeprefix("http://").removesuffix("/v1").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/v1/chat/completions", skip_accept_encoding=True)
    body = json.dumps(ask()).encode()
    conn.putheader("Content-Length", str(len(body)))
    conn.putheader("Origin", "https://elsewhere.example")
    conn.endheaders(body)
    bare = conn.getresponse()
    assert (bare.status, json.loads(bare.read())["error"]["code"]) == (415, "unsupported_media_type")
    conn.close()
    # Every answer under /v1 names itself, the model list and the 404s too (audit).
    with urllib.request.urlopen(f"{base(system)}/models", timeout=10) as listed_models:
        assert listed_models.headers["x-request-id"].startswith("req_")
    for path in ("/models/nope", "/nope"):
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(base(system) + path, timeout=10)
        assert missing.value.code == 404 and missing.value.headers["x-request-id"].startswith("req_"), path
    # OpenAI takes any signed 64-bit seed (a negative one was a 400).
    assert client(system).chat.completions.create(**ask(seed=-7)).choices[0].message.content
    listed = [client(system).models.list().data[0].created for _ in range(2)]
    time.sleep(1.1)
    assert client(system).models.list().data[0].created == listed[0] == listed[1], "created is fixed"


def test_wrong_key_is_401_and_the_rate_limit_429(system: System) -> None:
    with pytest.raises(openai.AuthenticationError) as refused:
        client(system, "keyed", "lanes_wrong").chat.completions.create(**ask())
    assert refused.value.body["code"] == "invalid_api_key"
    good = client(system, "keyed", KEY)
    assert good.chat.completions.create(**ask()).choices[0].message.content  # the burst of 1
    with pytest.raises(openai.RateLimitError) as limited:
        good.chat.completions.create(**ask())
    assert limited.value.body["code"] == "rate_limited" and int(limited.value.response.headers["retry-after"]) >= 1


def test_overload_is_429_with_retry_after(system: System) -> None:
    time.sleep(1.0)  # the edge acts on the scheduler's depth snapshots
    with pytest.raises(openai.RateLimitError) as refused:
        client(system, "full").chat.completions.create(**ask())
    assert refused.value.body["code"] == "overloaded" and "retry-after" in refused.value.response.headers
    assert int(refused.value.response.headers["retry-after-ms"]) >= 100
    assert refused.value.request_id.startswith("chatcmpl-")


def test_no_worker_is_503(make_cluster) -> None:
    bare = make_cluster(workers=0)
    time.sleep(1.0)
    with pytest.raises(openai.InternalServerError) as refused:
        client(bare).chat.completions.create(**ask())
    assert refused.value.status_code == 503 and refused.value.body["code"] == "unavailable"


def test_two_pools_each_answer_on_their_own_worker_and_default_names_them(make_cluster) -> None:
    """Two models side by side (pools small and big, no default pool, no routing rules): a
    completion runs on a worker of the pool its ``model`` names and answers in that name (body
    and ``x-lanes-pool``); ``/v1/models`` lists both. ``model: "default"``, as the README's
    single-pool examples send it, was a bare 503 "retry shortly" (that the SDK retries in vain);
    it now names the pools to ask, as a chat without a model or ``auto`` is told; an unknown
    model's 404 no longer offers ``auto`` there."""
    two = make_cluster(workers=0, env={"LANES_POOLS": "small,big"})
    workers = {pool: two.start_worker(f"{pool}-1", "", "--engine", "sim", "--sim-time-scale", "20",
                                      LANES_POOL=pool) for pool in ("small", "big")}
    two.wait_workers(2)
    sdk = client(two)
    assert sorted(m.id for m in sdk.models.list()) == ["big", "small"]
    for pool in ("small", "big"):
        raw = sdk.chat.completions.with_raw_response.create(**ask(model=pool, max_tokens=8))
        answer = raw.parse()
        assert (answer.model, raw.headers["x-lanes-pool"], answer.choices[0].finish_reason) == (pool, pool, "length")

        async def status(plane, rid=answer.id, pool=pool):  # noqa: ANN001 - QueuePlane
            return await plane.for_pool(pool).request_status(rid)

        assert two.query(status)[1] == workers[pool], f"{pool}'s request ran on another worker"
    with pytest.raises(openai.InternalServerError) as refused:
        sdk.chat.completions.create(**ask(model="default"))
    assert refused.value.status_code == 503 and "(big, small)" in refused.value.body["message"], refused.value.body
    # An unknown model's 404 lists the pools; it offered "(or 'auto')" too, which here (auto is
    # the default pool, which has no worker; /v1/models does not list it) could only be a 503.
    with pytest.raises(openai.NotFoundError) as unknown:
        sdk.chat.completions.create(**ask(model="gpt-4o"))
    assert unknown.value.body["message"].endswith("pools with live workers: big, small"), unknown.value.body
    assert (unknown.value.body["code"], unknown.value.body["param"]) == ("model_not_found", "model")


def test_a_client_that_disconnects_cancels_its_request(system: System) -> None:
    body = ask(stream=True, max_tokens=2000, messages=[{"role": "user", "content": "Explain it all, slowly."}])
    conn = http.client.HTTPConnection("127.0.0.1", system.edge_ports["edge"], timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    request_id = resp.getheader("x-request-id")
    while not (line := resp.readline().decode()).startswith("data: ") or '"content":""' in line:
        pass  # until the first chunk with text
    conn.sock.shutdown(2)  # streaming: now hang up
    conn.close()
    deadline = time.monotonic() + 10
    while system.query(lambda plane: plane.request_status(request_id))[0] != "cancelled":
        assert time.monotonic() < deadline, "the request was not cancelled after the client left"
        time.sleep(0.05)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streams_server_sent_events(system: System) -> None:
    out = subprocess.run(["curl", "-sN", f"{base(system)}/chat/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps(ask(stream=True))], capture_output=True, text=True, timeout=60)
    events = [line[len("data: "):] for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1


async def test_concurrent_completions_and_websocket_chats_share_the_lanes(system: System) -> None:
    aclient = openai.AsyncOpenAI(base_url=base(system), api_key="none", max_retries=0, timeout=60)
    answers = await asyncio.gather(*(aclient.chat.completions.create(**ask(max_tokens=8, seed=i)) for i in range(6)))
    assert all(a.choices[0].message.content for a in answers)
    assert len({a.id for a in answers}) == 6
    await aclient.close()


def test_a_base_url_without_v1_gets_a_hint_in_openais_shape(system: System) -> None:
    no_v1 = openai.OpenAI(base_url=f"http://127.0.0.1:{system.edge_ports['edge']}", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError) as refused:
        no_v1.chat.completions.create(**ask())
    assert "base_url ends in /v1" in refused.value.body["message"], refused.value.body


def test_a_body_that_is_not_json_is_400(system: System) -> None:
    post = urllib.request.Request(f"{base(system)}/chat/completions", data=b"{nope",
                                  headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(post, timeout=10)
    assert refused.value.code == 400 and json.loads(refused.value.read())["error"]["code"] == "invalid_json"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{base(system)}/chat/completions", timeout=10)
    assert refused.value.code == 405
    # A role sent as a list or an object was a 500 with a plain-text body (``role in _ROLES``
    # hashed it): now a 400 in OpenAI's shape naming the field, as any other wrong type.
    for role in (["user"], {"a": 1}):
        bad_role = urllib.request.Request(f"{base(system)}/chat/completions", headers={"Content-Type": "application/json"},
                                          data=json.dumps(ask(messages=[{"role": role, "content": "hi"}])).encode())
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bad_role, timeout=10)
        error = json.loads(refused.value.read())["error"]
        assert (refused.value.code, error["param"]) == (400, "messages[0].role"), error
    # A gzip body was read as it came: "not valid JSON ... (byte 0)", naming nothing the client did.
    gzipped = urllib.request.Request(f"{base(system)}/chat/completions", data=gzip.compress(json.dumps(ask()).encode()),
                                     headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(gzipped, timeout=10)
    error = json.loads(refused.value.read())["error"]
    assert (refused.value.code, error["code"]) == (415, "unsupported_media_type") and "Content-Encoding: gzip" in \
        error["message"], error
    # Valid JSON nested too deep: refused as on the WebSocket, by a limit that names itself (it
    # was accepted to 500 levels, and from ~2,000 called "not valid JSON": a recursion limit).
    for depth in (40, 5000):
        deep = ('{"model": "default", "messages": [{"role": "user", "content": "hi"}], "metadata": '
                + "[" * depth + "]" * depth + "}")
        post = urllib.request.Request(f"{base(system)}/chat/completions", data=deep.encode(),
                                      headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(post, timeout=10)
        body = json.loads(refused.value.read())["error"]
        assert refused.value.code == 400 and body["message"] == "the body is nested deeper than 32 levels", depth


def test_an_oversized_body_is_413_even_when_chunked(system: System) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", system.edge_ports["edge"], timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    chunk = b"x" * 65536
    try:
        for _ in range(8):  # 512 KiB, twice the limit
            conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        conn.send(b"0\r\n\r\n")
    except OSError:
        pass  # the edge may answer and close before the whole body is sent
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "frame_too_large"


def test_an_oversized_body_with_a_length_is_413_and_the_connection_closes(system: System) -> None:
    """The rest of the body is never read: the edge must not parse it as the next request."""
    conn = http.client.HTTPConnection("127.0.0.1", system.edge_ports["edge"], timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(5_000_000))
    conn.endheaders()
    try:
        conn.send(b"x" * 300_000)  # past the 256 KiB limit; the other 4.7 MB never come
    except OSError:
        pass
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "frame_too_large"
    assert resp.getheader("connection") == "close" and resp.will_close


async def test_a_refused_streaming_request_leaves_no_session(redis_url: str, key_prefix: str) -> None:
    """A streaming request refused before it started (here: an unknown model) is answered 404
    and leaves nothing behind on the edge."""
    import asyncio

    from lanes.queue.plane import QueuePlane
    from lanes.ws_server.edge import Edge
    from lanes.ws_server.settings import EdgeSettings

    settings = EdgeSettings(redis_url=redis_url, key_prefix=key_prefix, port=0)
    plane = QueuePlane.from_settings(settings)
    edge = Edge(settings, plane)
    ready = asyncio.Event()
    task = asyncio.create_task(edge.serve(ready))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{edge.port}/v1", api_key="none", max_retries=0)
        for _ in range(3):
            with pytest.raises(openai.NotFoundError):
                await api.chat.completions.create(**ask(stream=True, model="no-such-pool"))
        assert edge.sessions == {} and edge.core.entries == {}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await plane.close()


async def test_a_fault_of_ours_is_a_500_in_openais_shape(start_edge, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception no route catches (a parser bug: the unhashable role was one) was Starlette's
    plain-text "Internal Server Error"; the SDK then showed no message. Now it is a 500 in
    OpenAI's shape under /v1/ (which the SDKs retry as any 500), plain text elsewhere."""
    from lanes.ws_server import openai_compat

    def broken(body: object, limits: object) -> None:
        raise RuntimeError("an injected parser fault")

    monkeypatch.setattr(openai_compat, "parse_request", broken)
    host = await start_edge()
    api = openai.AsyncOpenAI(base_url=f"http://{host}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.InternalServerError) as failed:
        await api.chat.completions.create(**ask())
    error = failed.value.body
    assert (failed.value.status_code, error["type"], error["code"]) == (500, "server_error", "internal"), error
    assert "RuntimeError" in error["message"] and failed.value.response.headers["x-request-id"].startswith("req_")
    await api.close()


def test_an_oversized_body_sent_in_full_gets_its_413_not_a_reset(system: System) -> None:
    """A client that keeps sending a 5 MB body (under the drain bound) reads the 413 afterwards."""
    import socket

    body = b'{"x":"' + b"a" * 5_000_000 + b'"}'
    with socket.create_connection(("127.0.0.1", system.edge_ports["edge"]), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"frame_too_large" in reply and b"connection: close" in reply.lower()


async def test_an_idle_stream_sends_keep_alive_comments(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a request waits (queued, a long prefill) its stream sends SSE comments, which every
    SSE client skips, so proxies with idle timeouts do not cut it; then the answer as usual."""
    from lanes.queue.messages import FinishReason, Usage
    from lanes.ws_server import completions, protocol

    class Edge:
        def __init__(self) -> None:
            self.closed: list[tuple[int, bool]] = []

        def close_session(self, conn: int, *, abandoned: bool) -> None:
            self.closed.append((conn, abandoned))

    monkeypatch.setattr(completions, "KEEPALIVE_S", 0.05)
    session, edge = completions.HttpSession(), Edge()
    events = completions._events(edge, 7, session, "chatcmpl-x", 0, "default", False, None)  # type: ignore[arg-type]
    assert b'"role":"assistant"' in await anext(events)
    assert [await anext(events) for _ in range(2)] == [b": keep-alive\n\n"] * 2
    session.send(protocol.delta_frame("chatcmpl-x", 0, "Hi"))
    session.send(protocol.done_frame("chatcmpl-x", FinishReason.STOP, Usage(3, 1), protocol.Timing(1, 2, 3)))
    rest = [chunk async for chunk in events]
    assert b'"content":"Hi"' in rest[0] and b'"finish_reason":"stop"' in rest[1] and rest[-1] == b"data: [DONE]\n\n"
    assert edge.closed == [(7, False)]


def test_a_client_that_leaves_while_sending_its_body_logs_nothing(system: System) -> None:
    """A POST cut off mid-body (a client that gave up) is not an error of ours: before, each
    one logged a 45-line ASGI traceback (starlette's ClientDisconnect), so anyone could flood
    the edge's log."""
    import socket

    log_path = system.children["edge"].log_path
    assert log_path is not None
    before = log_path.read_text()
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", system.edge_ports["edge"]), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"model\": ")
    urllib.request.urlopen(f"http://127.0.0.1:{system.edge_ports['edge']}/healthz", timeout=5).read()  # still serving
    time.sleep(0.5)
    added = log_path.read_text()[len(before):]
    assert "Traceback" not in added and "ClientDisconnect" not in added, added[-2000:]


async def test_a_stream_the_worker_refuses_is_a_4xx_not_an_error_after_200(system: System) -> None:
    """A prompt within the edge's character limit but longer than the model's context is refused
    by the worker. Streaming, that was a 200 and then an error event, which SDKs raise as a bare
    ``APIError`` with no status; now the status waits for the answer's first frame, as it does
    for a whole answer: ``BadRequestError`` with ``prompt_too_long`` either way."""
    too_long = [{"role": "user", "content": "please explain the list " * 800}]  # ~4,000 tokens, 19 K chars
    for stream in (True, False):
        with pytest.raises(openai.BadRequestError) as refused:
            client(system).chat.completions.create(**ask(messages=too_long, stream=stream))
        # OpenAI's code for it (clients key their handling of an overflowing context on it)
        assert refused.value.body["code"] == "context_length_exceeded", (stream, refused.value.body)
    chunks = list(client(system).chat.completions.create(**ask(stream=True)))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason


def _options(sys_: System, edge: str, origin: str, headers: str = "authorization,content-type,x-stainless-os"
             ) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", sys_.edge_ports[edge], timeout=10)
    conn.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": headers})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp


def test_cors_is_granted_to_the_allowed_origins_only(system: System, app_page: int) -> None:
    """A web app on an origin of ``LANES_ALLOWED_ORIGINS`` may call the API from a browser (the
    OpenAI JS SDK sends ``Authorization`` and ``x-stainless-*`` headers, so every call is
    preflighted); any other origin's preflight is refused, and an edge without an allowlist
    grants no CORS at all (its pages' JSON POSTs stay same-origin)."""
    app = f"http://localhost:{app_page}"
    granted = _options(system, "cors", app)
    assert granted.status == 200
    assert granted.getheader("access-control-allow-origin") == app
    assert "POST" in granted.getheader("access-control-allow-methods")
    assert granted.getheader("access-control-allow-headers") == "authorization,content-type,x-stainless-os"
    refused = _options(system, "cors", "http://evil.example")
    assert refused.status == 400 and refused.getheader("access-control-allow-origin") is None
    no_allowlist = _options(system, "edge", app)
    assert no_allowlist.status == 405 and no_allowlist.getheader("access-control-allow-origin") is None
    # A refusal is readable by the allowed app (a browser hides a response without the header).
    post = urllib.request.Request(f"{base(system, 'cors')}/chat/completions", data=json.dumps(ask()).encode(),
                                  headers={"Content-Type": "application/json", "Origin": app,
                                           "Authorization": "Bearer lanes_wrong"})
    with pytest.raises(urllib.error.HTTPError) as unauthorized:
        urllib.request.urlopen(post, timeout=10)
    assert unauthorized.value.code == 401
    assert unauthorized.value.headers["access-control-allow-origin"] == app
    assert "x-request-id" in unauthorized.value.headers["access-control-expose-headers"]


def test_the_allowlist_takes_origins_only() -> None:
    """``*`` (which Starlette's CORS reads as any origin, and the WebSocket check as no
    browser at all) and a host without its scheme (which no browser's Origin ever equals) are
    refused at start, naming the form an origin has (review)."""
    import pydantic
    from lanes.ws_server.settings import EdgeSettings

    assert EdgeSettings(allowed_origins="https://app.example.com, http://localhost:3000/").allowed_origins
    for bad in ("*", "app.example.com", "https://app.example.com/path"):
        with pytest.raises(pydantic.ValidationError, match="scheme://host"):
            EdgeSettings(allowed_origins=bad)


#: What a page runs: a streaming completion by ``fetch``, read to its end (or the error).
_FETCH = """async ([url, key, body]) => {
  try {
    const r = await fetch(url, {method: "POST", body: JSON.stringify(body),
                                headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json"}});
    let text = "";
    const reader = r.body.getReader(), decoder = new TextDecoder();
    for (;;) { const {done, value} = await reader.read(); if (done) break; text += decoder.decode(value, {stream: true}); }
    return {status: r.status, request_id: r.headers.get("x-request-id"), text};
  } catch (e) { return {error: String(e)}; }
}"""


async def test_a_web_app_on_an_allowed_origin_streams_a_completion_in_a_browser(system: System, app_page: int,
                                                                                greedy_reference) -> None:
    """Chromium, a page on the allowed origin (``localhost``, a different origin from the
    edge's ``127.0.0.1``), ``fetch`` with a key: the preflight, the streamed answer (the greedy
    one) and its ``x-request-id``. The same page on another origin cannot call it at all."""
    from browser_support import CHROMIUM, FLAGS, chromium_or_reason

    if (reason := chromium_or_reason()) is not None:
        pytest.skip(reason)
    from playwright.async_api import async_playwright

    ref = greedy_reference(QUESTION, 24)
    url, body = f"{base(system, 'cors')}/chat/completions", ask(stream=True)
    app, other = f"http://localhost:{app_page}", f"http://127.0.0.1:{app_page}"
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        try:
            results = {}
            for origin in (app, other):
                page = await browser.new_page()
                await page.goto(f"{origin}/")
                results[origin] = await page.evaluate(_FETCH, [url, KEY, body])
                await page.close()
        finally:
            await browser.close()
    allowed = results[app]
    assert allowed.get("status") == 200, allowed
    assert (allowed["request_id"] or "").startswith("chatcmpl-"), "x-request-id is exposed to the page"
    events = [line[len("data: "):] for line in allowed["text"].splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, events[:-1]) if c["choices"])
    assert text == ref.text
    assert "Failed to fetch" in results[other].get("error", ""), results[other]


def test_a_body_that_trickles_in_is_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's header timeout ends at the headers: a body sent a byte a second held its
    connection with no end (audit: still open after 40 s). The whole body now has ``BODY_S``."""
    from starlette.requests import Request

    from lanes.ws_server import completions

    # 30 s, or 64 KiB a second of a larger body limit (16 MiB: 256 s).
    assert completions.body_deadline_s(256 << 10) == 30.0 and completions.body_deadline_s(16 << 20) == 256.0
    # By the body's declared length, and never past what 16 MiB needs (a 1 GiB limit gave a
    # 10-byte body 16,384 s: re-review).
    assert completions.body_deadline_s(16 << 20, declared=10) == 30.0
    assert completions.body_deadline_s(1 << 30) == 256.0
    monkeypatch.setattr(completions, "BODY_S", 0.3)
    monkeypatch.setattr(completions, "MIN_BODY_BYTES_PER_S", 1 << 40)

    async def trickle() -> dict[str, object]:
        await asyncio.sleep(0.1)
        return {"type": "http.request", "body": b"{", "more_body": True}

    async def whole() -> dict[str, object]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    scope = {"type": "http", "method": "POST", "headers": [(b"content-length", b"100")]}
    with pytest.raises(completions.BodyTooSlow):
        asyncio.run(completions._body(Request(scope, trickle), 1 << 20))
    assert asyncio.run(completions._body(Request(scope, whole), 1 << 20)) == b"{}"

