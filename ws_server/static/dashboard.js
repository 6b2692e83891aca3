// The operator's dashboard: the fleet's per-second samples (scheduler/sampling.py) for the last
// 15 minutes, drawn as time series, plus a table of the newest sample. The history comes from
// the server, so a page opened now shows the past; new samples arrive live, one a second.

import { askForKey, takeKeyFromFragment } from "./key.js";
import { legend, plot } from "./plot.js";
import { SampleStream } from "./samples.js";

takeKeyFromFragment();

const WINDOW_MS = 15 * 60 * 1000;
const LANE_COLORS = { short: "#3b6fd4", medium: "#e08a1e", long: "#c8453b" };
const PALETTE = ["#3b6fd4", "#e08a1e", "#2e8b57", "#c8453b", "#8e5cc4", "#1f9aa8", "#b0902a", "#d4589a"];
const $ = (id) => document.getElementById(id);
/** Samples in time order, at most 15 minutes' worth. */
const samples = [];
let drawPending = false;

function laneColor(lane, i) {
  return LANE_COLORS[lane] ?? PALETTE[i % PALETTE.length];
}

function addSample(sample) {
  const newest = samples.at(-1);
  if (newest && sample.at_ms <= newest.at_ms) return; // already have it
  samples.push(sample);
  while (samples.length && samples[0].at_ms < sample.at_ms - WINDOW_MS) samples.shift();
  if (!drawPending) {
    drawPending = true;
    requestAnimationFrame(() => { drawPending = false; draw(); });
  }
}

const ms = (v) => (v === null || v === undefined ? "–" : v >= 1000 ? `${(v / 1000).toFixed(2)} s` : `${v.toFixed(0)} ms`);
const pct = (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(1)} %`);
const sum = (obj) => Object.values(obj || {}).reduce((a, b) => a + b, 0);

function cell(text, data = {}) {
  const td = document.createElement("td");
  td.textContent = text;
  Object.assign(td.dataset, data);
  return td;
}

function drawTables(s) {
  const rows = Object.entries(s.lanes).map(([lane, l]) => {
    const tr = document.createElement("tr");
    tr.dataset.lane = lane;
    const name = cell(lane);
    name.className = `lane lane-${lane}`;
    const reasons = Object.entries(l.refusals).map(([r, n]) => `${r} ${n}`).join(", ");
    tr.append(name, cell(String(l.depth), { field: "depth" }), cell(String(l.running), { field: "running" }),
              cell(`${(l.oldest_wait_ms / 1000).toFixed(1)} s`, { field: "oldest" }),
              cell(ms(l.ttft_p50_ms), { field: "ttft50" }), cell(ms(l.ttft_p99_ms), { field: "ttft99" }),
              cell(String(l.num_first_tokens)), cell(String(l.finished), { field: "finished" }),
              cell(reasons ? `${sum(l.refusals)} (${reasons})` : "0", { field: "refused" }));
    return tr;
  });
  $("lanes-now").querySelector("tbody").replaceChildren(...rows);
  $("lanes-now").dataset.depthsAtMs = String(s.depths_at_ms);
  const workers = s.workers.map((w) => {
    const tr = document.createElement("tr");
    tr.dataset.worker = w.worker;
    const r = w.running;
    // The sample says whether a worker is silent (queue/stats.py decides, past SILENT_AFTER_MS:
    // killed, paused, cut off from Redis): its row is its last report, dimmed, until the
    // scheduler drops it.
    const silent = w.silent === true;
    if (silent) {
      tr.className = "silent";
      tr.dataset.silentS = String(Math.floor(w.silent_ms / 1000));
    }
    const name = silent ? `${w.worker} · silent ${Math.floor(w.silent_ms / 1000)} s` : w.worker;
    tr.append(cell(name, { field: "worker" }), cell(w.pool), cell(w.engine),
              cell(`${r.short || 0} / ${r.medium || 0} / ${r.long || 0} of ${w.slots}`, { field: "slots" }),
              cell(w.tokens_per_s.toFixed(0)), cell(pct(w.kv_cache_usage)), cell(pct(w.spec_acceptance)));
    return tr;
  });
  // Workers the scheduler dropped after 10 s of silence, listed for lost_window_s after they were
  // last heard from (the sample bounds the list; num_lost_workers counts them all): a silent
  // row must not just vanish.
  const lost = (s.lost_workers || []).map((w) => {
    const tr = document.createElement("tr");
    tr.className = "lost";
    tr.dataset.worker = w.worker;
    tr.dataset.lastHeardMs = String(w.last_heard_ms);
    tr.append(cell(`${w.worker} · lost (last heard ${new Date(w.last_heard_ms).toLocaleTimeString()})`,
                   { field: "worker" }), cell(w.pool || "–"), cell("–"), cell("–"),
              cell("–"), cell("–"), cell("–"));
    return tr;
  });
  $("workers-now").querySelector("tbody").replaceChildren(...workers, ...lost);
  const bySlot = (by) => `${by.short || 0} / ${by.medium || 0} / ${by.long || 0}`;
  const pools = Object.entries(s.pools || {}).sort(([a], [b]) => a.localeCompare(b)).map(([name, p]) => {
    const tr = document.createElement("tr");
    tr.dataset.pool = name;
    tr.append(cell(name), cell(`${p.workers} (${p.desired_workers})`, { field: "workers" }),
              cell(bySlot(p.waiting), { field: "waiting" }), cell(bySlot(p.running), { field: "running" }),
              cell(`${(p.oldest_wait_ms / 1000).toFixed(1)} s`, { field: "oldest" }),
              cell(ms(p.ttft_p99_ms), { field: "ttft99" }));
    return tr;
  });
  $("pools-now").querySelector("tbody").replaceChildren(...pools);
  const noLane = sum(s.refusals_no_lane);
  const numSilent = s.workers.filter((w) => w.silent === true).length;
  $("summary").textContent = `${s.workers.length - numSilent} worker(s)` +
    (numSilent ? ` (+${numSilent} silent)` : "") +
    (s.num_lost_workers ? ` · ${s.num_lost_workers} lost in the last ${Math.round(s.lost_window_s / 60)} min` : "") +
    ` · ${s.tokens_per_s.toFixed(0)} tokens/s` +
    (noLane ? ` · ${noLane} refused before a lane` : "") +
    ` · sample ${new Date(s.at_ms).toLocaleTimeString()}`;
}

/** One line per key of `keysOf(sample)`, valued by `valueOf(sample, key)`. */
function seriesBy(keysOf, valueOf, style) {
  const keys = [...new Set(samples.flatMap(keysOf))];
  return keys.map((key, i) => ({
    ...style(key, i),
    points: samples.map((s) => [s.at_ms, keysOf(s).includes(key) ? valueOf(s, key) : null]),
  }));
}

/** The time shown: all the samples there are, on a scale of 1, 5 or 15 minutes. */
function shownMs() {
  const span = samples.at(-1).at_ms - samples[0].at_ms;
  return [60000, 300000].find((ms) => span <= ms) ?? WINDOW_MS;
}

function chart(name, series, opts = {}) {
  const endMs = samples.at(-1).at_ms;
  plot($(`chart-${name}`), { series, startMs: endMs - shownMs(), endMs, ...opts });
  legend($(`legend-${name}`), series);
}

function draw() {
  if (!samples.length) return;
  drawTables(samples.at(-1));
  const lanes = (s) => Object.keys(s.lanes);
  const laneStyle = (lane, i) => ({ label: lane, color: laneColor(lane, i) });
  chart("depth", seriesBy(lanes, (s, l) => s.lanes[l].depth, laneStyle), { counts: true });
  chart("oldest", seriesBy(lanes, (s, l) => s.lanes[l].oldest_wait_ms / 1000, laneStyle));
  chart("ttft", [
    ...seriesBy(lanes, (s, l) => s.lanes[l].ttft_p50_ms, (l, i) => ({ label: `${l} p50`, color: laneColor(l, i) })),
    ...seriesBy(lanes, (s, l) => s.lanes[l].ttft_p99_ms,
                (l, i) => ({ label: `${l} p99`, color: laneColor(l, i), dash: true })),
  ]);
  const reasonsOf = (s) => [...new Set([...Object.values(s.lanes).flatMap((l) => Object.keys(l.refusals)),
                                        ...Object.keys(s.refusals_no_lane || {})])];
  const refusedFor = (s, reason) =>
    Object.values(s.lanes).reduce((n, l) => n + (l.refusals[reason] || 0), 0) + ((s.refusals_no_lane || {})[reason] || 0);
  // Every second counts, also those without refusals: zero, not a gap.
  chart("refusals", seriesBy(reasonsOf, refusedFor, (r, i) => ({ label: r, color: PALETTE[i % PALETTE.length] }))
    .map((line) => ({ ...line, points: samples.map((s) => [s.at_ms, refusedFor(s, line.label)]) })), { counts: true });
  chart("tokens", [{ label: "tokens/s", color: PALETTE[2], points: samples.map((s) => [s.at_ms, s.tokens_per_s]) }]);
  // A silent worker's last report is not a reading of now: its lines break while it is silent.
  const workers = (s) => s.workers.filter((w) => w.silent !== true).map((w) => w.worker);
  const worker = (s, id) => s.workers.find((w) => w.worker === id);
  const workerStyle = (id, i) => ({ label: id, color: PALETTE[i % PALETTE.length] });
  chart("slots", seriesBy(workers, (s, id) => sum(worker(s, id).running), workerStyle), { counts: true });
  const percent = (field) => (s, id) => {
    const v = worker(s, id)[field];
    return v === null || v === undefined ? null : 100 * v;
  };
  chart("kv", seriesBy(workers, percent("kv_cache_usage"), workerStyle), { yMax: 100 });
  chart("acceptance", seriesBy(workers, percent("spec_acceptance"), workerStyle), { yMax: 100 });
}

function setStatus(state, text) {
  const pill = $("status");
  pill.dataset.state = state;
  pill.className = `pill ${state}`;
  pill.textContent = text;
}

// "live" only while samples keep coming: the stream stays open when the scheduler or Redis is
// down, and the numbers on the page are then from before.
const STALE_MS = 6000;
let streamOk = false;

function freshness() {
  if (!streamOk) return;
  const newest = samples.at(-1);
  if (!newest) {
    setStatus("warn", "connected; no sample yet (is the scheduler running?)");
    return;
  }
  const ageMs = Date.now() + (stream.clockOffsetMs || 0) - newest.at_ms;
  if (ageMs > STALE_MS) {
    setStatus("warn", `no new sample for ${Math.round(ageMs / 1000)} s (scheduler or Redis down?): ` +
              "the numbers are from then");
  } else {
    setStatus("ok", "live");
  }
}

function streamStatus(state, text) {
  streamOk = state === "ok";
  if (streamOk) freshness();
  else setStatus(state, text);
}

const stream = new SampleStream({
  onSample: (sample) => { addSample(sample); freshness(); },
  onStatus: streamStatus,
  onNeedKey: (message) => {
    setStatus("bad", "API key needed");
    askForKey($("key-panel"), message, () => stream.start());
  },
});
window.addEventListener("resize", () => draw());
setInterval(freshness, 1000);
window.lanesDashboard = { samples };
stream.start();
