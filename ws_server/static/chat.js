// The chat page: a conversation over the edge's WebSocket protocol (docs/protocol.md).
//
// One answer streams at a time. Each answer shows its lane (from `accepted`), its time to first
// token and tokens/s (from `done`'s timing), and how it ended. Stop sends `cancel`. When the
// connection drops, `Connection` reconnects and every unfinished answer sends `resume` with the
// last seq it shows, so the edge replays exactly what is missing: deltas at or below that seq
// (a replay overlapping what arrived before the drop) are ignored, never shown twice.
//
// Answers are rendered as Markdown (markdown.js: no HTML from the answer ever reaches the page).
// While one streams, the whole text is re-parsed at most once per animation frame and never
// more than a tenth of the time (a parse of a long or pathological answer takes 100s of ms: the
// page stays responsive), and past STREAM_MARKDOWN_CHARS it streams as plain text, rendered
// once at its end. `lanesChat.answers` keeps each one's raw text, and Copy copies that.

import { Connection } from "./connection.js";
import { askForKey, takeKeyFromFragment } from "./key.js";
import { renderMarkdown } from "./markdown.js";

takeKeyFromFragment();

const $ = (id) => document.getElementById(id);
/** Longer answers stream as plain text (a full parse per render would grow with the square of their length). */
const STREAM_MARKDOWN_CHARS = 24_000;
/** Longer answers stay plain text even at their end. */
const FINAL_MARKDOWN_CHARS = 400_000;
/** The conversation sent with every chat: {role, content}. */
const turns = [];
/** Request id -> Answer, for every answer of this page. */
const answers = new Map();
let current = null;

class Answer {
  constructor(id, messages) {
    this.id = id;
    this.messages = messages;
    this.lastSeq = -1;
    this.text = "";
    this.sentAt = performance.now();
    this.firstAt = null;
    this.accepted = false;
    this.finished = false;
    this.numResumes = 0;
    this.numRepeated = 0;
    this.el = addTurn("assistant", "");
    this.el.dataset.id = id;
    this.renderPending = false;
    this.nextRenderAt = 0; // performance.now() before which no streaming render starts
    this.setState("streaming");
  }

  setState(state) {
    this.el.dataset.state = state;
    this.el.className = `turn assistant ${state}`;
  }

  meta(parts) {
    this.el.querySelector(".meta").replaceChildren(...parts.map((part) => {
      const span = document.createElement("span");
      if (typeof part === "string") span.textContent = part;
      else Object.assign(span, part);
      return span;
    }));
  }

  onAccepted(frame) {
    this.accepted = true;
    this.lane = frame.lane;
    this.el.dataset.lane = frame.lane;
    this.meta([{ className: `lane lane-${frame.lane}`, textContent: `${frame.lane} lane` },
               `~${frame.predicted_tokens} tokens predicted`]);
  }

  onResumed() {
    this.accepted = true;
    this.numResumes += 1;
    this.el.dataset.resumes = String(this.numResumes);
  }

  onDelta(frame) {
    if (frame.seq <= this.lastSeq) {
      this.numRepeated += 1; // replayed after a resume: already shown
      this.el.dataset.repeated = String(this.numRepeated);
      return;
    }
    if (frame.seq !== this.lastSeq + 1) {
      this.el.dataset.gap = `${this.lastSeq}->${frame.seq}`; // the protocol promises none
    }
    if (this.firstAt === null) this.firstAt = performance.now();
    this.lastSeq = frame.seq;
    this.el.dataset.lastSeq = String(frame.seq);
    this.text += frame.text;
    if (!this.renderPending) {
      this.renderPending = true;
      const wait = Math.max(0, this.nextRenderAt - performance.now());
      setTimeout(() => requestAnimationFrame(() => this.render(false)), wait);
    }
  }

  render(final) {
    this.renderPending = false;
    if (!final && this.finished) return; // a streaming render that came after the final one
    const following = window.innerHeight + window.scrollY >= document.body.scrollHeight - 40;
    const started = performance.now();
    const target = this.el.querySelector(".text");
    if (this.text.length > (final ? FINAL_MARKDOWN_CHARS : STREAM_MARKDOWN_CHARS)) target.textContent = this.text;
    else renderMarkdown(target, this.text);
    this.nextRenderAt = performance.now() + 9 * (performance.now() - started);
    if (following) window.scrollTo(0, document.body.scrollHeight); // a reader scrolled up stays put
  }

  onDone(frame) {
    const { usage, timing } = frame;
    // After a resume the edge times from the resume; the page's own clock spans the whole answer.
    const ttftMs = this.numResumes || !timing ? (this.firstAt ?? performance.now()) - this.sentAt : timing.ttft_ms;
    const decodeS = this.numResumes || !timing
      ? (performance.now() - (this.firstAt ?? this.sentAt)) / 1000 : (timing.total_ms - timing.ttft_ms) / 1000;
    const tokensPerS = usage.completion_tokens > 1 && decodeS > 0 ? (usage.completion_tokens - 1) / decodeS : 0;
    this.el.dataset.finish = frame.finish_reason;
    this.el.dataset.ttftMs = ttftMs.toFixed(1);
    this.el.dataset.tokensPerS = tokensPerS.toFixed(1);
    const lane = this.lane ? [{ className: `lane lane-${this.lane}`, textContent: `${this.lane} lane` }] : [];
    this.meta([...lane, `TTFT ${ttftMs.toFixed(0)} ms`, `${tokensPerS.toFixed(0)} tokens/s`,
               `${usage.completion_tokens} tokens`, frame.finish_reason,
               ...(this.numResumes ? [`resumed ×${this.numResumes}`] : [])]);
    this.end(frame.finish_reason === "cancelled" ? "cancelled" : "done");
  }

  onError(frame) {
    if (frame.code === "unknown_id" && !this.accepted) {
      send({ type: "chat", id: this.id, ...this.messages }); // the chat never reached the edge
      return;
    }
    this.el.dataset.error = frame.code;
    const hint = ["too_many_messages", "prompt_too_long"].includes(frame.code) && turns.length > 1
      ? " (start a New conversation)" : "";
    this.meta([`${frame.code}: ${frame.message}${hint}`]);
    this.end("failed");
  }

  interrupt(why) {
    this.el.dataset.error = "key_refused";
    this.meta([why]);
    this.end("failed");
  }

  end(state) {
    this.finished = true;
    this.render(true); // the whole text, now (a background tab runs no animation frames)
    this.setState(state);
    if (this.text) {
      turns.push({ role: "assistant", content: this.text });
      if (navigator.clipboard) { // secure contexts only (https, localhost)
        const copy = Object.assign(document.createElement("button"), {
          type: "button", className: "copy", textContent: "Copy", title: "Copy the answer as Markdown" });
        copy.addEventListener("click", () => navigator.clipboard.writeText(this.text).then(
          () => { copy.textContent = "Copied"; }, () => { copy.textContent = "Copy failed"; }));
        this.el.querySelector(".meta").append(copy);
      }
    } else if (turns.at(-1)?.content === this.question) {
      // No answer (refused, failed or cancelled before a token): the question leaves the
      // history, so the next message is not sent after it, and comes back to the prompt box.
      turns.pop();
      if (state === "failed" && !$("prompt").value) $("prompt").value = this.question;
    }
    if (current === this) current = null;
    updateButtons();
  }
}

function addTurn(role, text) {
  $("empty")?.remove();
  const el = document.createElement("div");
  el.className = `turn ${role}`;
  el.innerHTML = '<div class="who"></div><div class="text"></div><div class="meta"></div>';
  el.querySelector(".who").textContent = role === "user" ? "you" : "lanes";
  el.querySelector(".text").textContent = text;
  $("conversation").append(el);
  window.scrollTo(0, document.body.scrollHeight);
  return el;
}

function setStatus(state, text) {
  const pill = $("status");
  pill.dataset.state = state;
  pill.className = `pill ${state === "connecting" ? "" : state}`;
  pill.textContent = text;
}

function updateButtons() {
  $("send").disabled = current !== null;
  $("stop").disabled = current === null;
  $("clear").disabled = current !== null; // stop the answer first
}

const connection = new Connection({
  onStatus: setStatus,
  onNeedKey: (message) => {
    // The key was refused (revoked, or never given): answers in flight cannot be resumed under
    // another key, so they end here instead of streaming forever.
    for (const answer of answers.values()) {
      if (!answer.finished) answer.interrupt(`interrupted: ${message}`);
    }
    askForKey($("key-panel"), message, () => connection.connect());
  },
  onFrame: (frame) => {
    const answer = answers.get(frame.id);
    if (!answer) return;
    ({ accepted: () => answer.onAccepted(frame), resumed: () => answer.onResumed(frame),
       delta: () => answer.onDelta(frame), done: () => answer.onDone(frame),
       error: () => answer.onError(frame) })[frame.type]?.();
  },
  onOpen: () => {
    for (const answer of answers.values()) {
      if (answer.finished) continue;
      if (answer.accepted || answer.sent) send({ type: "resume", id: answer.id, last_seq: answer.lastSeq });
      else answer.sent = send({ type: "chat", id: answer.id, ...answer.messages });
      if (answer.cancelRequested) send({ type: "cancel", id: answer.id });
    }
  },
});

function send(frame) {
  return connection.send(frame);
}

function ask(content) {
  turns.push({ role: "user", content });
  addTurn("user", content);
  const id = "c-" + crypto.randomUUID();
  const request = {
    messages: turns.map((t) => ({ ...t })),
    max_tokens: Number($("max-tokens").value) || 256,
    temperature: Number($("temperature").value),
  };
  current = new Answer(id, request);
  current.question = content;
  answers.set(id, current);
  current.sent = send({ type: "chat", id, ...request });
  updateButtons();
}

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const content = $("prompt").value.trim();
  if (!content || current) return;
  $("prompt").value = "";
  ask(content);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => {
  if (!current) return;
  current.cancelRequested = true; // sent again after a reconnect if the socket is down now
  send({ type: "cancel", id: current.id });
});
$("clear").addEventListener("click", () => {
  if (current) return;
  turns.length = 0;
  $("conversation").replaceChildren();
});

// For tests and for trying resume by hand: `lanesChat.drop()` in the console.
window.lanesChat = { drop: () => connection.drop(), answers, turns };

updateButtons();
connection.connect();
