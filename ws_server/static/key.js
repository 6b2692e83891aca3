// The API key of this browser tab, for edges that require keys (LANES_AUTH_REQUIRED).
//
// It comes from a `#key=...` fragment (browsers never send a fragment to a server, so it
// lands in no log) or from the key form, is kept in sessionStorage (this tab only, gone when
// it closes) and is removed from the address bar at once. It is only ever sent in an
// `Authorization: Bearer` header: to fetch data, and to exchange it for a WebSocket ticket.

const STORE = "lanes.apiKey";

/** Move a `#key=` fragment into this tab's storage and out of the address bar. */
export function takeKeyFromFragment() {
  const params = new URLSearchParams(location.hash.slice(1));
  const key = params.get("key");
  if (!key) return;
  sessionStorage.setItem(STORE, key.trim());
  params.delete("key");
  const rest = params.toString();
  history.replaceState(null, "", location.pathname + location.search + (rest ? "#" + rest : ""));
}

export function apiKey() {
  return sessionStorage.getItem(STORE) || "";
}

export function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: "Bearer " + key } : {};
}

/**
 * Show the key form in `panel` with `message`; `onKey` runs once a key is entered.
 * The panel's markup is in the page; this only wires it.
 */
export function askForKey(panel, message, onKey) {
  panel.hidden = false;
  panel.querySelector("[data-key-message]").textContent = message;
  const form = panel.querySelector("form");
  form.onsubmit = (event) => {
    event.preventDefault();
    const input = form.querySelector("input");
    const key = input.value.trim();
    if (!key) return;
    sessionStorage.setItem(STORE, key);
    input.value = "";
    panel.hidden = true;
    onKey();
  };
}
