// The dashboard's feed: `GET /v1/stats/stream` (server-sent events, one sample a second, the
// stored 15 minutes first) read with fetch, not EventSource, because EventSource cannot send
// `Authorization` and the stream needs a key when the edge protects its metrics. After a drop
// it reconnects with `Last-Event-ID`, so the edge sends only the samples the page lacks.

import { authHeaders } from "./key.js";

const BACKOFF_MS = [500, 1000, 2000, 4000];

export class SampleStream {
  /** @param {{onSample: (s: object) => void, onStatus: (state: string, text: string) => void,
   *           onNeedKey: (message: string) => void}} handlers */
  constructor(handlers) {
    this.handlers = handlers;
    this.lastId = "";
    this.failures = 0;
  }

  async start() {
    for (;;) {
      try {
        await this.readOnce();
        this.failures = 0;
      } catch (err) {
        if (err.needKey) {
          this.handlers.onNeedKey(err.message);
          return; // start() again once a key is entered
        }
        this.failures += 1;
      }
      const delay = BACKOFF_MS[Math.min(this.failures, BACKOFF_MS.length - 1)];
      this.handlers.onStatus("warn", `stream lost; reconnecting in ${(delay / 1000).toFixed(1)} s`);
      await new Promise((resolve) => setTimeout(resolve, delay));
    }
  }

  async readOnce() {
    const headers = { ...authHeaders(), Accept: "text/event-stream" };
    if (this.lastId) headers["Last-Event-ID"] = this.lastId;
    const response = await fetch("/v1/stats/stream", { headers, cache: "no-store" });
    if (response.status === 401 || response.status === 403) {
      const err = new Error((await response.text()).trim());
      err.needKey = true;
      throw err;
    }
    if (!response.ok || !response.body) throw new Error(`HTTP ${response.status}`);
    // The server's clock against ours (1 s resolution): how old the samples are.
    const serverMs = Date.parse(response.headers.get("date") || "");
    this.clockOffsetMs = Number.isNaN(serverMs) ? 0 : serverMs - Date.now();
    this.handlers.onStatus("ok", "live");
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        this.event(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
      }
    }
  }

  /** One event block: `id:` and `data:` lines (comments and `retry:` ignored). */
  event(block) {
    let data = "", id = "";
    for (const line of block.split("\n")) {
      if (line.startsWith("data:")) data += line.slice(5).trimStart();
      else if (line.startsWith("id:")) id = line.slice(3).trim();
    }
    if (!data) return;
    if (id) this.lastId = id;
    this.handlers.onSample(JSON.parse(data));
  }
}
