"""The chat page and the dashboard in a real browser (Chromium, driven by Playwright) against
real processes: scheduler, edge and worker on a real Redis.

- Chat (tiny transformers model, greedy): an answer streams and equals the model's own greedy
  answer; Stop ends it ``cancelled``; a dropped socket and a ``kill -9`` of the edge both resume
  with the full text, nothing repeated or missing.
- Keys on (sim worker): the page without a key asks for one and cannot open the socket; with a
  key (form or ``#key=``) it gets a ticket and chats, and the key is in no URL it requested.
- Dashboard (keys on, the demo model on three slots kept busy by long answers): the numbers
  follow a burst of load and its refusals, and match ``/v1/depths`` snapshot for snapshot; a
  page opened later shows the past.

Screenshots of both pages go to ``$LANES_SCREENSHOT_DIR`` (``docs/screenshots/`` to refresh the README's),
else to a temporary folder: a plain test run leaves the checkout as it was.
"""

from __future__ import annotations

import asyncio
import signal
import json
import os
import re
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from typer.testing import CliRunner

from browser_support import CHROMIUM, FLAGS, chromium_or_reason
from conftest import REPO_ROOT, scaled
from e2e_support import Client, System
from lanes.cli.main import app

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

SCREENSHOTS = Path(os.environ.get("LANES_SCREENSHOT_DIR") or Path(tempfile.gettempdir()) / "lanes-screenshots")
#: The tiny model's greedy answer to this runs past 400 tokens.
LONG_PROMPT = "Explain it all, slowly."
CHAT_ENV = {"LANES_RESUME_GRACE_S": "60", "LANES_ORPHAN_GRACE_S": "60"}
DEMO = REPO_ROOT / "workers" / "models" / "demo"
#: The demo model's greedy answer to this runs past 1500 tokens (no end of sequence).
BLOCKER_PROMPT = "Describe every module in the standard library."


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    reason = chromium_or_reason()
    if reason is not None:
        pytest.skip(reason)
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        yield launched
        await launched.close()


class Tab:
    """One page in its own browser context, remembering every URL it asked for."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.urls: list[str] = []
        self.sockets: list[str] = []
        self.errors: list[str] = []
        page.on("request", lambda request: self.urls.append(request.url))
        page.on("websocket", lambda ws: self.sockets.append(ws.url))
        page.on("pageerror", lambda error: self.errors.append(str(error)))

    async def until(self, expression: str, timeout_s: float = 30, arg: Any = None) -> Any:
        handle = await self.page.wait_for_function(expression, arg=arg, timeout=scaled(timeout_s) * 1000)
        return await handle.json_value()

    async def ask(self, prompt: str, max_tokens: int, temperature: float = 0.0) -> None:
        await self.until("() => document.querySelector('#status').dataset.state === 'ok'")
        await self.page.fill("#max-tokens", str(max_tokens))
        await self.page.fill("#temperature", str(temperature))
        await self.page.fill("#prompt", prompt)
        await self.page.press("#prompt", "Enter")

    async def answer(self, index: int = -1) -> dict[str, Any]:
        """An answer's state, its raw text (as streamed: the page shows it rendered as Markdown)
        and its meta line."""
        return await self.page.evaluate("""i => {
            const el = [...document.querySelectorAll('.turn.assistant')].at(i);
            return {...el.dataset, text: window.lanesChat.answers.get(el.dataset.id).text,
                    meta: el.querySelector('.meta').textContent};
        }""", index)

    async def finished(self, timeout_s: float = 60) -> dict[str, Any]:
        await self.until("() => document.querySelector('.turn.assistant:last-of-type')?.dataset.state !== 'streaming'",
                         timeout_s)
        return await self.answer()

    async def streamed_past(self, seq: int) -> None:
        await self.until("s => Number(document.querySelector('.turn.assistant:last-of-type')?.dataset.lastSeq) >= s",
                         arg=seq)


@pytest.fixture
async def new_tab(browser: Any) -> AsyncIterator[Any]:
    contexts = []

    async def make() -> Tab:
        context = await browser.new_context(viewport={"width": 1200, "height": 820})
        contexts.append(context)
        return Tab(await context.new_page())

    yield make
    for context in contexts:
        await context.close()


def base_url(sys_: System) -> str:
    return f"http://127.0.0.1:{sys_.edge_ports['edge']}"


def only_local(tab: Tab, base: str) -> None:
    outside = [u for u in tab.urls + tab.sockets if not u.startswith((base, base.replace("http", "ws", 1), "data:"))]
    assert not outside, f"the page asked for something off this edge: {outside}"
    assert not tab.errors, tab.errors


# -- chat ------------------------------------------------------------------------------


#: A fixed answer (served by the edge, streamed in pieces like a model's) in Markdown, with
#: markup a prompt could make a model write: none of it may reach the page as HTML.
MARKDOWN_QUESTION = "show me the markdown sample"
MARKDOWN_ANSWER = """## Steps

1. Install it with `pip install lanes`.
2. Run **both** commands:
   - `up.sh`
   - `test.sh`

```python
print("a < b")
```

| lane | bound |
| --- | ---: |
| short | 150 |

<img src=x onerror="window.pwned = 1"> <script>window.pwned = 2</script>
[docs](https://example.com/docs) [bad](javascript:window.pwned=3) ![leak](https://example.com/x.png?q=secret)

Tom &amp; Jerry &lt;3, [query](https://example.com/?a=1&amp;b=2) [tab](java&#x09;script:window.pwned=4)"""


@pytest.fixture(scope="module")
def chat_system(make_cluster, tmp_path_factory: pytest.TempPathFactory) -> System:
    fixed = tmp_path_factory.mktemp("fixed") / "fixed_answers.toml"
    fixed.write_text("[[answers]]\nname = \"markdown\"\n"
                     f"questions = [\"{MARKDOWN_QUESTION}\"]\nanswer = '''{MARKDOWN_ANSWER}'''\n")
    return make_cluster(workers=1, env={**CHAT_ENV, "LANES_FIXED_ANSWERS_FILE": str(fixed)})


async def test_chat_page_streams_an_answer(chat_system: System, new_tab, greedy_reference) -> None:
    tab, base = await new_tab(), base_url(chat_system)
    await tab.page.goto(base + "/")
    prompt = "What does a class definition do?"
    await tab.ask(prompt, max_tokens=40)
    answer = await tab.finished()
    expected = greedy_reference(prompt, 40)
    assert answer["state"] == "done" and answer["text"] == expected.text, "the model's own greedy answer"
    shown = await tab.page.evaluate("() => document.querySelector('.turn.assistant:last-of-type .text').textContent")
    words = re.findall(r"[A-Za-z]{4,}", expected.text)
    assert words and all(word in shown for word in words), (shown, expected.text)  # what the page shows
    assert answer["lane"] in ("short", "medium", "long") and f"{answer['lane']} lane" in answer["meta"]
    assert float(answer["ttftMs"]) > 0 and float(answer["tokensPerS"]) > 0
    assert "TTFT" in answer["meta"] and "tokens/s" in answer["meta"] and "repeated" not in answer
    await tab.ask("And what is a method?", max_tokens=48, temperature=0.7)  # the conversation goes on
    follow_up = await tab.finished()
    assert follow_up["state"] == "done" and follow_up["text"]
    only_local(tab, base)


async def test_answers_render_as_markdown_and_never_as_html(chat_system: System, new_tab) -> None:
    """An answer is shown as Markdown (headings, lists, code, tables, links) built from text
    nodes only: the answer's HTML is shown as text, no script runs, a ``javascript:`` link is
    not a link, and an image is never fetched (its URL could carry the conversation out)."""
    tab, base = await new_tab(), base_url(chat_system)
    await tab.page.goto(base + "/")
    await tab.ask(MARKDOWN_QUESTION, max_tokens=256)
    answer = await tab.finished()
    assert answer["state"] == "done" and answer["text"] == MARKDOWN_ANSWER
    shown = await tab.page.evaluate("""() => {
        const t = document.querySelector('.turn.assistant:last-of-type .text');
        const all = (sel) => [...t.querySelectorAll(sel)].map((e) => e.textContent);
        return {h2: all('h2'), items: all('ol > li').length, nested: all('ol li ul li'),
                code: all('pre code'), lang: t.querySelector('pre code')?.dataset.lang,
                inline: all('li code'), strong: all('strong'), cells: all('td'),
                align: t.querySelector('td:last-child')?.style.textAlign,
                links: [...t.querySelectorAll('a')].map((a) => [a.textContent, a.href, a.rel]),
                elements: t.querySelectorAll('img, script, iframe, [onerror]').length,
                text: t.textContent, pwned: window.pwned ?? null};
    }""")
    assert shown["h2"] == ["Steps"] and shown["items"] == 2 and shown["nested"] == ["up.sh", "test.sh"]
    assert shown["code"] == ['print("a < b")'] and shown["lang"] == "python"
    assert "pip install lanes" in shown["inline"] and shown["strong"] == ["both"]
    assert shown["cells"] == ["short", "150"] and shown["align"] == "right"
    assert shown["links"] == [["docs", "https://example.com/docs", "noopener noreferrer nofollow"],
                              ["[image: leak]", "https://example.com/x.png?q=secret", "noopener noreferrer nofollow"],
                              ["query", "https://example.com/?a=1&b=2", "noopener noreferrer nofollow"]]
    assert "Tom & Jerry <3" in shown["text"], "character references are decoded, as an HTML renderer would"
    assert shown["elements"] == 0 and shown["pwned"] is None, "the answer's markup became elements"
    assert '<img src=x onerror="window.pwned = 1">' in shown["text"] and "<script>" in shown["text"]
    assert "bad" in shown["text"], "the javascript: link is kept as its text"
    assert not [u for u in tab.urls if "x.png" in u], "the image was fetched"
    only_local(tab, base)


async def test_a_refused_question_leaves_the_conversation_usable(chat_system: System, new_tab) -> None:
    """A question the edge refuses (here: longer than LANES_MAX_PROMPT_CHARS) comes back to the
    prompt box and leaves the history; before, it and an empty answer stayed in the history, so
    every later message was refused the same way. A temperature of 0.75 is accepted (the field
    took only multiples of 0.1), and "New conversation" is disabled while an answer streams."""
    tab, base = await new_tab(), base_url(chat_system)
    await tab.page.goto(base + "/")
    too_long = "x" * 70_000
    await tab.ask(too_long, max_tokens=8)
    refused = await tab.finished()
    assert refused["state"] == "failed" and refused["error"] == "prompt_too_long", refused
    assert await tab.page.input_value("#prompt") == too_long, "the question is back for a retry"
    assert await tab.page.evaluate("() => lanesChat.turns.length") == 0
    await tab.page.fill("#temperature", "0.75")
    assert await tab.page.evaluate("() => document.querySelector('#temperature').checkValidity()")
    await tab.ask(LONG_PROMPT, max_tokens=1500)
    await tab.streamed_past(3)
    assert await tab.page.is_disabled("#clear")
    await tab.page.click("#stop")
    answer = await tab.finished()
    assert answer["state"] == "cancelled" and answer["text"], (answer.get("error"), answer["meta"])
    assert await tab.page.evaluate("() => lanesChat.turns.map(t => t.role)") == ["user", "assistant"]
    assert await tab.page.is_enabled("#clear")


async def test_stop_ends_the_answer_cancelled(chat_system: System, new_tab, greedy_reference) -> None:
    tab, base = await new_tab(), base_url(chat_system)
    await tab.page.goto(base + "/")
    await tab.ask(LONG_PROMPT, max_tokens=1500)
    await tab.streamed_past(3)
    await tab.page.click("#stop")
    answer = await tab.finished()
    assert answer["state"] == "cancelled" and answer["finish"] == "cancelled" and "cancelled" in answer["meta"]
    full = greedy_reference(LONG_PROMPT, 400).text
    assert answer["text"] and full.startswith(answer["text"]), "what was shown is the answer's true beginning"
    assert await tab.page.is_disabled("#stop") and await tab.page.is_enabled("#send")


async def test_a_dropped_connection_resumes_with_the_full_text(chat_system: System, new_tab,
                                                               greedy_reference) -> None:
    tab, base = await new_tab(), base_url(chat_system)
    await tab.page.goto(base + "/")
    await tab.ask(LONG_PROMPT, max_tokens=300)
    await tab.streamed_past(5)
    await tab.page.evaluate("() => lanesChat.drop()")
    answer = await tab.finished()
    assert answer["state"] == "done" and answer.get("resumes") == "1", answer
    assert answer["text"] == greedy_reference(LONG_PROMPT, 300).text, "nothing repeated or missing"
    assert "gap" not in answer and len(tab.sockets) == 2


async def test_a_killed_edge_is_resumed_after_its_restart(chat_system: System, new_tab, greedy_reference) -> None:
    tab, base = await new_tab(), base_url(chat_system)
    await tab.page.goto(base + "/")
    await tab.ask(LONG_PROMPT, max_tokens=400)
    await tab.streamed_past(5)
    chat_system.kill("edge")  # SIGKILL: no close frame, the socket just dies
    await tab.until("() => document.querySelector('#status').dataset.state === 'warn'")
    chat_system.restart("edge")
    await asyncio.to_thread(chat_system.wait_edge, "edge", scaled(60))
    answer = await tab.finished(timeout_s=90)
    assert answer["state"] == "done" and int(answer.get("resumes", "0")) >= 1, answer
    assert answer["text"] == greedy_reference(LONG_PROMPT, 400).text, "the full answer across the restart"
    assert "gap" not in answer


# -- keys on: tickets ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ops_system(make_cluster) -> tuple[System, str]:
    """Keys on; the shipped demo model on two workers (two slots, and one with speculative decoding)
    (so the dashboard has KV-cache use and acceptance to show); lanes capped at 12 waiting."""
    caps = {f"LANES_MAX_DEPTH_{lane}": "12" for lane in ("SHORT", "MEDIUM", "LONG")}
    # Long answers may take every slot (by default one of the two is kept for the short lane):
    # the dashboard test fills all three slots with them.
    open_slots = {"LANES_MAX_LONG_SLOTS": "2", "LANES_MAX_MEDIUM_LONG_SLOTS": "2"}
    sys_ = make_cluster(workers=1, env={"LANES_AUTH_REQUIRED": "true", **caps, **open_slots},
                        worker_args=("--model", str(DEMO / "target"), "--max-slots", "2"))
    # The speculative engine runs one request at a time.
    sys_.start_worker("worker-spec", str(DEMO / "target"), "--spec-method", "draft_model",
                      "--draft-model", str(DEMO / "draft"))
    sys_.wait_workers(2, timeout_s=scaled(120))
    result = CliRunner().invoke(app, ["keys", "create", "ops"],
                                env={"LANES_REDIS_URL": sys_.redis_url, "LANES_KEY_PREFIX": sys_.prefix})
    assert result.exit_code == 0, result.output
    return sys_, result.stdout.strip()


async def test_with_keys_on_the_page_needs_a_key_and_uses_a_ticket(ops_system: tuple[System, str], new_tab) -> None:
    sys_, key = ops_system
    base = base_url(sys_)
    tab = await new_tab()
    await tab.page.goto(base + "/")
    await tab.until("() => !document.querySelector('#key-panel').hidden")
    assert await tab.page.get_attribute("#status", "data-state") == "bad"
    refused = await tab.page.evaluate("""url => new Promise(done => {
        const ws = new WebSocket(url);
        ws.onopen = () => done('open'); ws.onclose = (e) => done('closed ' + e.code);
    })""", base.replace("http", "ws", 1) + "/v1/chat")
    assert refused == "closed 1006", "no key, no ticket: the handshake is refused"
    await tab.page.fill("#key-panel input", key)
    await tab.page.click("#key-panel button")
    await tab.ask("hello there", max_tokens=8)
    assert (await tab.finished())["state"] == "done"
    assert any("ticket=" in url for url in tab.sockets)
    assert not any(key in url for url in tab.urls + tab.sockets), "the key never travels in a URL"

    by_fragment = await new_tab()
    await by_fragment.page.goto(f"{base}/#key={key}")
    await by_fragment.ask("Explain what a class definition does", max_tokens=60)  # greedy: the next answer
    # continues this conversation, and a sampled one could steer it to an early end (a flake)
    assert (await by_fragment.finished())["state"] == "done"
    await by_fragment.ask(BLOCKER_PROMPT, max_tokens=1500)
    await by_fragment.streamed_past(12)
    await by_fragment.page.click("#stop")
    assert (await by_fragment.finished())["state"] == "cancelled"
    assert key not in by_fragment.page.url, "the fragment is cleared from the address bar"
    assert not any(key in url for url in by_fragment.urls + by_fragment.sockets)
    only_local(by_fragment, base)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    await by_fragment.page.screenshot(path=str(SCREENSHOTS / "chat.png"))


# -- dashboard -------------------------------------------------------------------------


async def first_frame(client: Client, request_id: str, timeout_s: float = 20) -> dict[str, Any]:
    async def wait() -> dict[str, Any]:
        while not client.frames[request_id]:
            await asyncio.sleep(0.01)
        return client.frames[request_id][0]

    return await asyncio.wait_for(wait(), scaled(timeout_s))


def depths_snapshot(base: str, key: str) -> dict[str, Any]:
    request = urllib.request.Request(base + "/v1/depths", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())


SHOWN = """() => {
    const table = document.querySelector('#lanes-now');
    const rows = [...table.querySelectorAll('tbody tr')];
    return {at_ms: Number(table.dataset.depthsAtMs),
            depth: Object.fromEntries(rows.map(r => [r.dataset.lane, Number(r.querySelector('[data-field=depth]').textContent)])),
            ttft50: Object.fromEntries(rows.map(r => [r.dataset.lane, r.querySelector('[data-field=ttft50]').textContent])),
            slots: [...document.querySelectorAll('#workers-now [data-field=slots]')].map(td => td.textContent),
            pools: Object.fromEntries([...document.querySelectorAll('#pools-now tbody tr')].map(
                r => [r.dataset.pool, r.querySelector('[data-field=waiting]').textContent])),
            samples: lanesDashboard.samples.length};
}"""


async def test_dashboard_follows_load_and_matches_depths(ops_system: tuple[System, str], new_tab) -> None:
    sys_, key = ops_system
    base = base_url(sys_)
    test_started_ms = time.time() * 1000
    seen: dict[int, dict[str, int]] = {}
    polling = True

    def poll() -> None:  # every snapshot the scheduler publishes (each 0.5 s), by its time
        while polling:
            snapshot = depths_snapshot(base, key)
            if "at_ms" in snapshot:
                seen[snapshot["at_ms"]] = snapshot["pending"]
            time.sleep(0.1)

    poller = asyncio.create_task(asyncio.to_thread(poll))
    tab = await new_tab()
    await tab.page.goto(f"{base}/dashboard#key={key}")
    await tab.until("() => document.querySelector('#status').dataset.state === 'ok'")
    ws = await websockets.connect(base.replace("http", "ws", 1) + "/v1/chat",
                                  additional_headers={"Authorization": f"Bearer {key}"})
    client = Client(ws)
    # Three long answers take the three slots (the demo model's greedy answer to this runs
    # past 1500 tokens), so what comes next waits in its lane until the end of the test.
    blockers = [f"block-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    for rid in blockers:
        await client.chat(rid, BLOCKER_PROMPT, max_tokens=1500)
    await tab.until("() => [...document.querySelectorAll('#workers-now [data-field=slots]')]"
                    ".reduce((n, td) => n + td.textContent.split(' of ')[0].split(' / ').reduce((a, b) => a + +b, 0), 0) === 3")
    # A burst over the key's bucket (burst 20: the rest are rate_limited) and over the lane's
    # cap (12 waiting: lane_full).
    ids = [f"load-{i}-{uuid.uuid4().hex[:6]}" for i in range(28)]
    for rid in ids:
        await client.chat(rid, "Write a long story about queues.", max_tokens=400, temperature=0.7)

    matched: list[dict[str, Any]] = []
    deadline = time.monotonic() + scaled(40)
    while time.monotonic() < deadline and len(matched) < 3:
        shown = await tab.page.evaluate(SHOWN)
        if sum(shown["depth"].values()) > 0 and shown["at_ms"] in seen:
            assert shown["depth"] == seen[shown["at_ms"]], (shown, seen[shown["at_ms"]])
            # The pool table shows the one pool's own depths (the lane table adds pools up).
            waiting = " / ".join(str(seen[shown["at_ms"]].get(lane, 0)) for lane in ("short", "medium", "long"))
            assert shown["pools"] == {"default": waiting}, shown
            if not matched or matched[-1]["at_ms"] != shown["at_ms"]:
                matched.append(shown)
        await asyncio.sleep(0.2)
    assert len(matched) >= 3, f"the page never showed a queue that /v1/depths had: {matched}"
    assert any(not slots.startswith("0 / 0 / 0") for m in matched for slots in m["slots"]), "slots in use shown"
    await tab.until("() => [...document.querySelectorAll('#lanes-now [data-field=ttft50]')]"
                    ".some(td => td.textContent !== '–')", timeout_s=60)
    # The pool's own TTFT (with two models, the lane table adds their first tokens up).
    await tab.until("() => [...document.querySelectorAll('#pools-now [data-field=ttft99]')]"
                    ".some(td => td.textContent !== '–')", timeout_s=30)
    for rid in ids:
        await first_frame(client, rid)
    expected: dict[str, int] = {}
    for rid in ids:
        frame = client.frames[rid][0]
        if frame["type"] == "error":
            reason = frame.get("reason") or frame["code"]
            expected[reason] = expected.get(reason, 0) + 1
    assert expected.get("rate_limited") and expected.get("lane_full"), expected
    await tab.until("""expected => {
        const counts = {};
        for (const s of lanesDashboard.samples) {
            for (const [r, n] of Object.entries(s.refusals_no_lane)) counts[r] = (counts[r] || 0) + n;
            for (const lane of Object.values(s.lanes))
                for (const [r, n] of Object.entries(lane.refusals)) counts[r] = (counts[r] || 0) + n;
        }
        return JSON.stringify(Object.fromEntries(Object.entries(counts).sort())) === JSON.stringify(expected);
    }""", arg=dict(sorted(expected.items())), timeout_s=20)

    for rid in ids + blockers:  # drain: the queue empties and the page follows
        await client.send({"type": "cancel", "id": rid})
    await tab.until("() => [...document.querySelectorAll('#lanes-now [data-field=depth]')]"
                    ".every(td => td.textContent === '0')", timeout_s=30)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    await tab.page.screenshot(path=str(SCREENSHOTS / "dashboard.png"), full_page=True)
    only_local(tab, base)

    opened_at_ms = time.time() * 1000
    later = await new_tab()  # the history is the server's: a new page shows the past at once
    await later.page.goto(f"{base}/dashboard#key={key}")
    first = await later.until("() => lanesDashboard.samples.length > 0 && lanesDashboard.samples[0].at_ms")
    # The server's history reaches back before this test began (how far depends on how fast the
    # steps above ran: 14 s in one run, over 15 s in others), a second or more per sample.
    shown_samples = (await later.page.evaluate(SHOWN))["samples"]
    assert first < test_started_ms < opened_at_ms and shown_samples >= (opened_at_ms - test_started_ms) / 1000 / 2
    polling = False
    await poller
    await client.close()


async def test_dashboard_shows_a_silent_worker_as_silent(make_cluster, new_tab) -> None:  # noqa: ANN001
    """A worker that stops answering (SIGSTOP here, ``kill -9`` alike) is live for the scheduler's
    10 s: its row said nothing of it, showing its last slots as now. Past 2 s it reads "silent N s",
    dimmed, and comes back when the worker does. Killed (SIGKILL) and dropped at 10 s, its row
    vanished without a word; now it reads "lost (last heard <time>)" and the summary counts it."""
    sys_ = make_cluster(workers=1, worker_args=("--engine", "sim"))
    tab = await new_tab()
    await tab.page.goto(f"{base_url(sys_)}/dashboard")
    await tab.until("() => document.querySelectorAll('#workers-now tbody tr').length === 1")
    assert await tab.page.evaluate("() => document.querySelector('#workers-now tr.silent')") is None
    process = sys_.children["worker"].process
    process.send_signal(signal.SIGSTOP)
    try:
        shown = await tab.until("() => document.querySelector('#workers-now tr.silent [data-field=worker]')"
                                "?.textContent", timeout_s=10)
        assert re.search(r" · silent [2-9] s$", shown), shown
        assert "(+1 silent)" in await tab.page.text_content("#summary")
    finally:
        process.send_signal(signal.SIGCONT)
    await tab.until("() => document.querySelectorAll('#workers-now tbody tr').length === 1"
                    " && !document.querySelector('#workers-now tr.silent')", timeout_s=10)
    worker_id = sys_.child_env_id("worker", "LANES_WORKER_ID")
    sys_.kill("worker")  # SIGKILL: no deregistration, the heartbeats just stop
    killed_ms = int(time.time() * 1000)
    await tab.until("() => document.querySelector('#workers-now tr.silent')", timeout_s=10)
    # Dropped 10 s after its last heartbeat: the row turns into the lost marker, not nothing.
    lost = await tab.until("() => { const tr = document.querySelector('#workers-now tr.lost');"
                           " return tr && [tr.dataset.worker, tr.dataset.lastHeardMs, tr.textContent]; }",
                           timeout_s=30)
    assert lost[0] == worker_id, lost
    assert killed_ms - 5000 <= int(lost[1]) <= killed_ms, "its last heartbeat, just before the kill"
    assert re.search(r" · lost \(last heard \d{1,2}:\d\d:\d\d", lost[2]), lost
    assert await tab.page.evaluate("() => document.querySelectorAll('#workers-now tbody tr').length") == 1
    assert "0 worker(s) · 1 lost in the last 5 min" in await tab.page.text_content("#summary")
    assert not tab.errors, tab.errors


def crafted_sample(at_ms: int, workers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A sample as the scheduler writes it (``StatsSample``), with these workers and fields."""
    lane = {"depth": 0, "running": 0, "oldest_wait_ms": 0, "ttft_p50_ms": None, "ttft_p99_ms": None,
            "num_first_tokens": 0, "refusals": {}, "finished": 0}
    return {"at_ms": at_ms, "depths_at_ms": at_ms, "lanes": {lane_: lane for lane_ in ("short", "medium", "long")},
            "tokens_per_s": 0.0, "ttft_window_s": 10.0, "num_edges": 1, "refusals_no_lane": {}, "pools": {},
            "workers": [{"pool": "default", "engine": "sim", "slots": 4, "running": {}, "tokens_per_s": 0.0,
                         "kv_cache_usage": None, "spec_acceptance": None, **w} for w in workers], **extra}


async def serve_samples(tab: Tab, samples: list[dict[str, Any]]) -> None:
    """The page's sample stream answered with ``samples`` (the edge's page, these numbers)."""
    body = "retry: 1000\n\n" + "".join(f"id: {s['at_ms']}\ndata: {json.dumps(s)}\n\n" for s in samples)

    async def answer(route: Any) -> None:
        await route.fulfill(status=200, content_type="text/event-stream", body=body)

    await tab.page.route("**/v1/stats/stream*", answer)


async def test_dashboard_takes_silence_from_the_sample(make_cluster, new_tab) -> None:  # noqa: ANN001
    """The scheduler decides which worker is silent (``silent`` in each worker's row); the page
    holds no bound of its own (it had a copy of ``SILENT_AFTER_MS``, 2 s, that could drift
    from the scheduler's). Samples whose ``silent`` disagrees with any fixed bound on
    ``silent_ms`` are shown as the sample says."""
    sys_ = make_cluster(workers=0, scheduler=False)
    tab = await new_tab()
    now_ms = int(time.time() * 1000)
    await serve_samples(tab, [crafted_sample(now_ms, [
        {"worker": "quiet-but-live", "silent_ms": 5000, "silent": False},
        {"worker": "called-silent", "silent_ms": 1500, "silent": True},
        {"worker": "live", "silent_ms": 100, "silent": False},
    ])])
    await tab.page.goto(f"{base_url(sys_)}/dashboard")
    await tab.until("() => document.querySelectorAll('#workers-now tbody tr').length === 3")
    rows = await tab.page.evaluate("""() => [...document.querySelectorAll('#workers-now tbody tr')].map(
        (tr) => [tr.dataset.worker, tr.className, tr.querySelector('[data-field=worker]').textContent])""")
    assert rows == [["quiet-but-live", "", "quiet-but-live"], ["called-silent", "silent", "called-silent · silent 1 s"],
                    ["live", "", "live"]], rows
    assert (await tab.page.text_content("#summary")).startswith("2 worker(s) (+1 silent)")
    assert not tab.errors, tab.errors


async def test_dashboard_says_when_its_numbers_go_stale(ops_system: tuple[System, str], new_tab) -> None:
    """While no sample arrives (the scheduler paused: the stream stays open), the status pill
    says so instead of "live" over frozen numbers, and is live again once samples resume."""
    sys_, key = ops_system
    tab = await new_tab()
    await tab.page.goto(f"{base_url(sys_)}/dashboard#key={key}")
    await tab.until("() => document.querySelector('#status').dataset.state === 'ok'")
    scheduler = sys_.procs["scheduler"]
    scheduler.send_signal(signal.SIGSTOP)
    try:
        stale = await tab.until("() => { const s = document.querySelector('#status');"
                                " return s.dataset.state === 'warn' && s.textContent; }", timeout_s=20)
    finally:
        scheduler.send_signal(signal.SIGCONT)
    assert "no new sample" in stale, stale
    await tab.until("() => document.querySelector('#status').dataset.state === 'ok'", timeout_s=20)
    assert not tab.errors, tab.errors


async def test_an_answer_whose_key_is_revoked_ends_instead_of_streaming_forever(ops_system: tuple[System, str],
                                                                               new_tab) -> None:
    """The key is revoked mid-answer and the connection drops: the page cannot reconnect with
    that key (nor resume under another: ids are per key), so the answer ends as interrupted and
    the page is usable again (before: a blinking cursor forever, Send disabled)."""
    sys_, _ = ops_system
    env = {"LANES_REDIS_URL": sys_.redis_url, "LANES_KEY_PREFIX": sys_.prefix}
    created = CliRunner().invoke(app, ["keys", "create", "short-lived"], env=env)
    assert created.exit_code == 0, created.output
    tab = await new_tab()
    await tab.page.goto(f"{base_url(sys_)}/#key={created.stdout.strip()}")
    await tab.ask(BLOCKER_PROMPT, max_tokens=1500)
    await tab.streamed_past(3)
    revoked = CliRunner().invoke(app, ["keys", "revoke", "short-lived"], env=env)
    assert revoked.exit_code == 0, revoked.output
    await tab.page.evaluate("() => lanesChat.drop()")
    answer = await tab.finished()
    assert answer["state"] == "failed" and answer["error"] == "key_refused" and "interrupted" in answer["meta"]
    assert await tab.page.is_enabled("#send") and await tab.page.is_disabled("#stop")
