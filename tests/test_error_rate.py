"""The error-rate metrics on a real edge: every chat the edge answers counts once in
``lanes_requests_total`` by outcome, refused bad input included, over the WebSocket and the
OpenAI API alike; the common series exist at 0 before the first event (README, "Metrics and
Grafana")."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request
import uuid

import pytest
from conftest import scaled
from e2e_support import Client, System
from test_ui_metrics import scrape

pytestmark = pytest.mark.e2e

#: What the README's error-rate formula counts as a request that did not fail.
SUCCESSES = ("stop", "length", "cancelled", "disconnected", "resumed_elsewhere")


@pytest.fixture(scope="module")
def system(make_cluster) -> System:  # noqa: ANN001
    return make_cluster(workers=1, worker_args=("--engine", "sim", "--max-slots", "4"))


def outcomes(samples: dict[str, float], family: str, label: str) -> dict[str, float]:
    """``family``'s samples summed by the value of ``label``."""
    found: dict[str, float] = {}
    for name, value in samples.items():
        if name.startswith(family + "{"):
            key = re.search(label + r'="([^"]*)"', name).group(1)  # type: ignore[union-attr]
            found[key] = found.get(key, 0.0) + value
    return found


def counted(before: dict[str, float], after: dict[str, float], family: str, label: str) -> dict[str, float]:
    """What ``family`` counted between two scrapes, by ``label``, leaving out what did not move."""
    old = outcomes(before, family, label)
    return {k: v - old.get(k, 0.0) for k, v in outcomes(after, family, label).items() if v != old.get(k, 0.0)}


def post(url: str, body: dict[str, object]) -> int:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=scaled(60)) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_refused_input_counts_as_a_request_on_both_apis(system: System) -> None:
    port = system.edge_ports["edge"]
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    before = scrape(metrics_url)
    # Before any refusal, the common series read 0 (rate() of them is 0, not "no data").
    for code in ("invalid_field", "invalid_json", "unknown_parameter", "rate_limited"):
        assert before[f'lanes_requests_total{{lane="none",outcome="{code}",pool="none"}}'] == 0.0, before
        assert before[f'lanes_errors_total{{code="{code}"}}'] == 0.0

    async def ws() -> None:
        client = await Client.connect(system.edge_urls["edge"])
        good = f"ok-{uuid.uuid4().hex[:6]}"
        await client.chat(good, "hello there", max_tokens=8)
        assert (await client.wait(good, scaled(30)))["type"] == "done"
        await client.send({"type": "chat", "id": "bad-1", "temperature": 9,
                           "messages": [{"role": "user", "content": "hi"}]})
        assert (await client.wait("bad-1", scaled(10)))["code"] == "invalid_field"
        await client.send("{not json")
        await client.send({"type": "cancel"})  # a bad control frame: an error, not a request
        await client.send({"type": "cancel", "id": "nobody"})  # unknown_id: an error, not a request
        assert (await client.wait("nobody", scaled(10)))["code"] == "unknown_id"
        await client.close()

    asyncio.run(ws())
    completions = f"http://127.0.0.1:{port}/v1/chat/completions"
    ask = {"model": "default", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    assert post(completions, ask) == 200
    assert post(completions, {**ask, "frobnicate": 1}) == 400  # unknown_parameter
    assert post(completions, {**ask, "temperature": "hot"}) == 400

    after = scrape(metrics_url)
    answered = counted(before, after, "lanes_requests_total", "outcome")
    errors = counted(before, after, "lanes_errors_total", "code")
    # Two answers, three refused chats / bodies on the two APIs; the bad cancels are not requests.
    assert sum(answered.values()) == 6, answered
    assert sum(v for k, v in answered.items() if k in SUCCESSES) == 2, answered
    assert answered["invalid_field"] == 2 and answered["invalid_json"] == 1, answered
    assert answered["unknown_parameter"] == 1, answered
    assert "missing_field" not in answered and "unknown_id" not in answered, answered
    # Every refused request is an error answer too, and the cancels' errors are there alone.
    for code in ("invalid_field", "invalid_json", "unknown_parameter"):
        assert errors[code] == answered[code], (code, errors)
    assert errors["missing_field"] == 1 and errors["unknown_id"] == 1, errors
    failed = sum(v for k, v in answered.items() if k not in SUCCESSES)
    assert failed / sum(answered.values()) == pytest.approx(4 / 6)
