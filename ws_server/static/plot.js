// A small time-series line plot on a <canvas>: shared time axis, nice y ticks, gaps for nulls.

const FONT = "11px system-ui, sans-serif";
const PAD = { left: 46, right: 8, top: 8, bottom: 18 };
/** Spacing of the time axis' ticks, the first that gives at most six. */
const X_TICKS_MS = [10000, 30000, 60000, 120000, 300000];

/** 1, 2 or 5 times a power of ten, at least `x`. */
function niceCeil(x) {
  if (!(x > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(x));
  return [1, 2, 5, 10].map((m) => m * power).find((v) => v >= x - 1e-9);
}

function formatTick(v) {
  if (v >= 1e6) return (v / 1e6).toFixed(v % 1e6 ? 1 : 0) + "M";
  if (v >= 1e3) return (v / 1e3).toFixed(v % 1e3 ? 1 : 0) + "k";
  return Number.isInteger(v) ? String(v) : v.toFixed(v < 1 ? 2 : 1);
}

/**
 * Draw `series` ([{label, color, dash, points: [[ms, value|null], ...]}]) between
 * `startMs` and `endMs`. `yMax` fixes the scale (e.g. 100 for percentages); `counts` keeps
 * the ticks on whole numbers.
 */
export function plot(canvas, { series, startMs, endMs, yMax = null, counts = false }) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);
  g.font = FONT;

  const values = series.flatMap((s) => s.points.map((p) => p[1]).filter((v) => v !== null && v !== undefined));
  const step = niceCeil((Math.max(0, ...values) * 1.1) / 4);
  const top = yMax ?? 4 * (counts ? Math.max(1, Math.ceil(step)) : step);
  const plotW = width - PAD.left - PAD.right, plotH = height - PAD.top - PAD.bottom;
  const x = (ms) => PAD.left + ((ms - startMs) / (endMs - startMs)) * plotW;
  const y = (v) => PAD.top + plotH - (Math.min(v, top) / top) * plotH;

  // Grid and labels: four y steps, and x ticks counted back from the right edge ("now").
  g.strokeStyle = "#e7eaee"; g.fillStyle = "#68717d"; g.lineWidth = 1;
  g.textAlign = "right"; g.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const v = (top * i) / 4, py = Math.round(y(v)) + 0.5;
    g.beginPath(); g.moveTo(PAD.left, py); g.lineTo(width - PAD.right, py); g.stroke();
    g.fillText(formatTick(v), PAD.left - 6, py);
  }
  g.textAlign = "center"; g.textBaseline = "top";
  const tickMs = X_TICKS_MS.find((t) => (endMs - startMs) / t <= 6) ?? X_TICKS_MS.at(-1);
  for (let back = 0; endMs - back >= startMs; back += tickMs) {
    const label = back === 0 ? "now" : back < 60000 ? `-${back / 1000} s` : `-${back / 60000} min`;
    g.fillText(label, Math.min(x(endMs - back), width - PAD.right - 12), height - PAD.bottom + 4);
  }

  for (const s of series) {
    g.strokeStyle = s.color; g.lineWidth = 1.6; g.setLineDash(s.dash ? [5, 4] : []);
    g.beginPath();
    let drawing = false;
    for (const [ms, v] of s.points) {
      if (v === null || v === undefined || ms < startMs) { drawing = false; continue; }
      if (drawing) g.lineTo(x(ms), y(v)); else g.moveTo(x(ms), y(v));
      drawing = true;
    }
    g.stroke();
  }
  g.setLineDash([]);
}

/** Legend entries under a chart. */
export function legend(el, series) {
  el.replaceChildren(...series.map((s) => {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = s.color;
    swatch.style.borderColor = s.color;
    if (s.dash) swatch.className = "dashed";
    item.append(swatch, s.label);
    return item;
  }));
}
