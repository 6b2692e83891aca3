// One chat WebSocket to the edge that comes back by itself.
//
// Before every (re)connect it asks `POST /v1/ws-ticket` (with the tab's key, if any) for a
// single-use ticket and puts it in the URL: browsers cannot set `Authorization` on a
// WebSocket, and a ticket in a log is worthless seconds later. With keys off the edge answers
// `{"ticket": null}` and the page connects without one. After a drop it reconnects with a
// growing pause and calls `onOpen` again, where the chat resumes its unfinished answers.

import { authHeaders } from "./key.js";

const BACKOFF_MS = [250, 500, 1000, 2000, 4000];

export class Connection {
  /**
   * @param {{onFrame: (frame: object) => void, onOpen: () => void,
   *          onStatus: (state: string, text: string) => void, onNeedKey: (message: string) => void}} handlers
   */
  constructor(handlers) {
    this.handlers = handlers;
    this.ws = null;
    this.failures = 0;
    this.timer = null;
    this.stopped = false;
  }

  get open() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  async connect() {
    clearTimeout(this.timer);
    this.stopped = false;
    this.handlers.onStatus("connecting", "connecting…");
    let ticket;
    try {
      ticket = await this.ticket();
    } catch (err) {
      if (err.needKey) {
        this.stopped = true; // nothing to retry until the user gives a key
        this.handlers.onStatus("bad", "API key needed");
        this.handlers.onNeedKey(err.message);
        return;
      }
      // fetch's own TypeError ("Failed to fetch") means the edge could not be reached.
      this.retry(err instanceof TypeError ? "cannot reach the server" : String(err.message || err));
      return;
    }
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    const query = ticket ? "?ticket=" + encodeURIComponent(ticket) : "";
    const ws = new WebSocket(`${scheme}://${location.host}/v1/chat${query}`);
    this.ws = ws;
    ws.onopen = () => {
      this.failures = 0;
      this.handlers.onStatus("ok", "connected");
      this.handlers.onOpen();
    };
    ws.onmessage = (event) => {
      if (this.ws !== ws) return; // a socket we already gave up on
      let frame;
      try {
        frame = JSON.parse(event.data);
      } catch {
        return;
      }
      this.handlers.onFrame(frame);
    };
    ws.onclose = () => {
      if (this.ws === ws) this.ws = null;
      if (!this.stopped) this.retry("connection lost");
    };
  }

  /** A ticket for the next handshake, null when the edge needs none. */
  async ticket() {
    const response = await fetch("/v1/ws-ticket", { method: "POST", headers: authHeaders(), cache: "no-store" });
    if (response.status === 401 || response.status === 403) {
      const err = new Error((await response.text()).trim() || "this edge requires an API key");
      err.needKey = true;
      throw err;
    }
    if (!response.ok) throw new Error(`ticket: HTTP ${response.status}`);
    return (await response.json()).ticket;
  }

  retry(why) {
    const delay = BACKOFF_MS[Math.min(this.failures, BACKOFF_MS.length - 1)];
    this.failures += 1;
    this.handlers.onStatus("warn", `${why}; reconnecting in ${(delay / 1000).toFixed(1)} s`);
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.connect(), delay);
  }

  /** Send one frame; false when the socket is down (the caller retries after `onOpen`). */
  send(frame) {
    if (!this.open) return false;
    this.ws.send(JSON.stringify(frame));
    return true;
  }

  /** Close the socket the way a network failure would look to the page: it reconnects. */
  drop() {
    if (this.ws) this.ws.close(4000, "dropped on purpose");
  }
}
