// The dashboard's last 15 minutes: polls /api/history (the coordinator's ring of samples, so a
// page opened late still has them) and draws each series as an inline SVG sparkline.
// Loaded after dashboard.js, whose el(), $() and authHeaders() it uses. No library, no build.
"use strict";

const HISTORY_POLL_MS = 2000;
const SVG_NS = "http://www.w3.org/2000/svg";
const CHART_W = 300;
const CHART_H = 92;
const PAD = { left: 40, right: 6, top: 8, bottom: 16 };

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, String(value));
  if (text !== undefined) node.textContent = text;
  return node;
}

const fmtNumber = (v) => (v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2));
const fmtPercent = (v) => `${(v * 100).toFixed(0)}%`;
const isNum = (v) => typeof v === "number" && Number.isFinite(v);

// One chart: each series a polyline over times `t` (seconds), broken where a value is null
// (no request finished, nothing drafted); a lone point is a dot. The x axis is the window
// ending at the latest sample; the y axis runs from 0 (or the lowest value, if negative) to
// the highest value, labelled at both ends with `fmt`.
function sparkline(t, series, { windowS, fmt = fmtNumber, yMax } = {}) {
  const root = svg("svg", { viewBox: `0 0 ${CHART_W} ${CHART_H}`, class: "spark", role: "img" });
  const values = series.flatMap((s) => s.values.filter(isNum));
  const end = t.length ? t[t.length - 1] : 0;
  const start = end - windowS;
  const hi = Math.max(yMax ?? 0, ...values, 1e-9);
  const lo = Math.min(0, ...values);
  const plotW = CHART_W - PAD.left - PAD.right;
  const plotH = CHART_H - PAD.top - PAD.bottom;
  const x = (time) => PAD.left + ((time - start) / windowS) * plotW;
  const y = (v) => PAD.top + (1 - (v - lo) / (hi - lo)) * plotH;

  root.append(
    svg("line", { x1: PAD.left, y1: y(lo), x2: CHART_W - PAD.right, y2: y(lo), class: "axis" }),
    svg("line", { x1: PAD.left, y1: y(hi), x2: CHART_W - PAD.right, y2: y(hi), class: "grid" }),
    svg("text", { x: PAD.left - 4, y: y(hi) + 4, class: "tick", "text-anchor": "end" }, fmt(hi)),
    svg("text", { x: PAD.left - 4, y: y(lo), class: "tick", "text-anchor": "end" }, fmt(lo)),
    svg("text", { x: PAD.left, y: CHART_H - 2, class: "tick" }, `-${Math.round(windowS / 60)} min`),
    svg("text", { x: CHART_W - PAD.right, y: CHART_H - 2, class: "tick", "text-anchor": "end" }, "now"),
  );
  for (const s of series) {
    let run = [];
    const flush = () => {
      if (run.length === 1) {
        const [px, py] = run[0];
        const dot = svg("circle", { cx: px, cy: py, r: 1.8, class: "series dot" });
        dot.style.fill = s.color; // a style, not an attribute: attributes take no var()
        root.append(dot);
      } else if (run.length > 1) {
        const points = run.map(([px, py]) => `${px.toFixed(1)},${py.toFixed(1)}`).join(" ");
        const line = svg("polyline", { points, class: "series" });
        line.style.stroke = s.color;
        root.append(line);
      }
      run = [];
    };
    s.values.forEach((v, i) => {
      if (isNum(v) && t[i] >= start) run.push([x(t[i]), y(v)]);
      else flush();
    });
    flush();
  }
  return root;
}

// A chart's card: its title, the latest value of each series as a legend, and the SVG.
function chartCard(id, title, t, series, options) {
  const card = el("figure", "chart");
  card.dataset.chart = id;
  const caption = el("figcaption", "chart-title", title);
  const legend = el("div", "chart-legend");
  for (const s of series) {
    const latest = s.values.filter(isNum).pop();
    const item = el("span", "legend-item mono");
    const swatch = el("span", "swatch");
    swatch.style.background = s.color;
    const fmt = (options && options.fmt) || fmtNumber;
    item.append(swatch, document.createTextNode(`${s.name} ${latest === undefined ? "—" : fmt(latest)}`));
    legend.append(item);
  }
  card.append(caption, legend, sparkline(t, series, options));
  return card;
}

function drawHistory(data) {
  const windowS = data.interval_s * data.capacity;
  const t = data.t;
  const p50 = "var(--accent)";
  const p99 = "var(--warn)";
  const perNode = (key) =>
    data.nodes.map((n, i) => ({ name: n.node_id, color: stageColor(i), values: n[key] }));
  const charts = [
    ["tokens", "Tokens / s", [{ name: "tok/s", color: p50, values: data.tokens_per_s }], {}],
    [
      "ttft",
      "TTFT (ms)",
      [
        { name: "p50", color: p50, values: data.ttft_ms.p50 },
        { name: "p99", color: p99, values: data.ttft_ms.p99 },
      ],
      {},
    ],
    [
      "tpot",
      "TPOT (ms)",
      [
        { name: "p50", color: p50, values: data.tpot_ms.p50 },
        { name: "p99", color: p99, values: data.tpot_ms.p99 },
      ],
      {},
    ],
    ["step", "Step time per node (ms)", perNode("step_ms"), {}],
    ["busy", "Busy share per node", perNode("busy_share"), { fmt: fmtPercent, yMax: 1 }],
    ["acceptance", "MTP acceptance", [{ name: "accepted", color: "var(--ok)", values: data.acceptance }], { fmt: fmtPercent, yMax: 1 }],
  ];
  const box = $("history");
  box.replaceChildren(
    ...charts.map(([id, title, series, options]) => chartCard(id, title, t, series, { windowS, ...options })),
  );
  const spanS = t.length ? Math.min(windowS, t[t.length - 1] - t[0] + data.interval_s) : 0;
  const span = spanS < 120 ? `${Math.round(spanS)} s` : `${Math.round(spanS / 60)} min`;
  $("history-span").textContent = t.length
    ? `${span} kept · one sample every ${data.interval_s} s`
    : "no samples yet";
}

async function pollHistory() {
  try {
    const response = await fetch("/api/history", {
      cache: "no-store",
      headers: authHeaders(), // the key dashboard.js asked for, when there is one
      signal: AbortSignal.timeout(2500),
    });
    if (response.ok) drawHistory(await response.json());
  } catch (err) {
    // dashboard.js already says when the coordinator is unreachable
  } finally {
    setTimeout(pollHistory, HISTORY_POLL_MS);
  }
}

pollHistory();
