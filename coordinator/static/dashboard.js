// The cluster dashboard: polls /api/cluster once a second and redraws the page from it.
// DOM nodes are built with textContent only, so a node id or address can never inject markup.
"use strict";

const POLL_MS = 1000;
const STALE_HEARTBEAT_S = 5;
const GiB = 1024 ** 3;

const $ = (id) => document.getElementById(id);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const stageColor = (index) => `var(--stage-${index % 8})`;
const fmtBytes = (b) => (b >= GiB ? `${(b / GiB).toFixed(1)} GiB` : `${(b / 1024 ** 2).toFixed(0)} MiB`);
const fmtAge = (s) => (s < 1 ? `${Math.round(s * 1000)} ms ago` : s < 120 ? `${s.toFixed(1)} s ago` : `${Math.round(s / 60)} min ago`);

function meter(label, used, total, color) {
  const box = el("div", "meter");
  const ratio = total > 0 ? Math.min(used / total, 1) : 0;
  const caption = el("div", "meter-label");
  caption.append(el("span", "", label), el("span", "mono", `${fmtBytes(used)} / ${fmtBytes(total)} · ${Math.round(ratio * 100)}%`));
  const track = el("div", "meter-track");
  const fill = el("div", "meter-fill" + (ratio > 0.95 ? " full" : ratio > 0.8 ? " high" : ""));
  fill.style.width = `${(ratio * 100).toFixed(1)}%`;
  fill.style.setProperty("--stage-color", color);
  track.append(fill);
  box.append(caption, track);
  return box;
}

const STEP_PHASES = ["layers", "handoff", "decode", "encode", "send", "queued"];

// The coordinator's own links to a node (/api/cluster "coordinator_links"), drawn as a hop is.
const LINK_LABELS = { steps: "From coordinator", results: "To coordinator", control: "Control" };

function coordinatorLinkRow(link) {
  const off = link.degraded || link.failed;
  const via = link.transport === "grpc" ? " · gRPC" : "";
  const dd = el("dd", off ? "mono degraded" : "mono", `${link.address} · ${link.kind || "?"}${via}`);
  if (link.failed) dd.append(" · no address answers");
  else if (link.degraded) dd.append(` · degraded (best ${link.best_address || "?"})`);
  if (link.failovers) {
    dd.append(` · ${link.failovers} failover${link.failovers === 1 ? "" : "s"}`);
    dd.title = `last: ${link.last_failover || "?"}`;
  }
  if (link.failed) dd.title = link.failed;
  return [LINK_LABELS[link.role] || link.role, dd];
}

function nodeCard(node, index, links) {
  const card = el("article", "node" + (node.up ? "" : " node-down"));
  card.dataset.nodeId = node.node_id;
  card.style.setProperty("--stage-color", stageColor(index));

  const head = el("div", "node-head");
  head.append(el("div", "node-id mono", node.node_id));
  const badge = el("span", node.up ? "badge badge-up" : "badge badge-down", node.up ? "UP" : "DOWN");
  badge.setAttribute("role", "status");
  head.append(badge);

  const roles = el("div", "roles");
  if (node.is_head) roles.append(el("span", "role role-head", "head · embed"));
  if (node.is_tail) roles.append(el("span", "role role-tail", "tail · lm_head + MTP"));
  if (!node.is_head && !node.is_tail) roles.append(el("span", "role", "middle"));

  const kv = el("dl", "kv");
  const heartbeat = el("dd", node.last_heartbeat_s > STALE_HEARTBEAT_S ? "stale" : "", fmtAge(node.last_heartbeat_s));
  const rows = [
    ["Address", el("dd", "mono", node.address)],
    ["Device", el("dd", "", node.device)],
    ["Layers", el("dd", "mono", `[${node.start}, ${node.end}) · ${node.end - node.start}`)],
    ["Step latency", el("dd", "mono", `${node.step_latency_ms.toFixed(1)} ms`)],
    ["Heartbeat", heartbeat],
  ];
  const phases = node.step_phases_ms || {};
  if (phases.layers) {
    // Where the node's recent decode steps went (NodeInfo.step_phases): a slow pipeline
    // shows here whether its time is in the layers or around them.
    const parts = STEP_PHASES.map((name) => `${name} ${phases[name].toFixed(2)}`);
    rows.push(["Step phases", el("dd", "mono", `${parts.join(" · ")} ms`)]);
  }
  if (node.running_requests || node.request_cache_bytes) {
    // The KV and GatedDeltaNet state of the requests the node holds, and per request.
    const fmt = (b) => (b >= 2 ** 20 ? fmtBytes(b) : `${(b / 1024).toFixed(0)} KiB`);
    const each = node.running_requests ? ` · ${fmt(node.request_cache_bytes / node.running_requests)} each` : "";
    rows.push(["Request caches", el("dd", "mono", `${node.running_requests} · ${fmt(node.request_cache_bytes)}${each}`)]);
  }
  if (node.prefix_budget_bytes) {
    const mib = (node.prefix_snapshot_bytes / 2 ** 20).toFixed(1);
    const budget = (node.prefix_budget_bytes / 2 ** 20).toFixed(0);
    rows.push(["Prefix cache", el("dd", "mono", `${node.prefix_snapshots} · ${mib} / ${budget} MiB`)]);
  }
  if (node.mlx_active_bytes || node.mlx_cache_bytes) {
    const mlx = `${fmtBytes(node.mlx_active_bytes)} active · ${fmtBytes(node.mlx_cache_bytes)} cached · ${fmtBytes(node.mlx_peak_bytes)} peak`;
    rows.push(["MLX memory", el("dd", "mono", mlx)]);
  }
  if (node.weights_fraction !== null && node.weights_fraction !== undefined) {
    rows.push(["Weights", el("dd", "mono", `fetching ${(node.weights_fraction * 100).toFixed(0)}%`)]);
  }
  if (node.hop) {
    const how = node.hop.measured ? `${node.hop.rtt_ms.toFixed(2)} ms` : "given";
    const hop = el("dd", node.hop.degraded ? "mono degraded" : "mono", `${node.hop.address} · ${node.hop.kind || "?"} · ${how}`);
    if (node.hop.degraded) hop.append(` · degraded (best ${node.hop.best_address || "?"})`);
    if (node.hop.failovers) {
      hop.append(` · ${node.hop.failovers} failover${node.hop.failovers === 1 ? "" : "s"}`);
      hop.title = `last: ${node.hop.last_failover || "?"}`;
    }
    rows.push(["Next hop", hop]);
  } else if (node.hop_state === "measuring") {
    rows.push(["Next hop", el("dd", "mono", "measuring")]);
  }
  for (const link of links) rows.push(coordinatorLinkRow(link));
  // Whether the node holds its Mac awake while serving (a power assertion), or why not.
  const awake = node.keeps_awake
    ? el("dd", "awake", "yes")
    : el("dd", "asleep", `no · ${node.keep_awake_note || "unknown"}`);
  awake.title = node.keep_awake_note || "";
  rows.push(["Keeps awake", awake]);
  for (const [label, value] of rows) kv.append(el("dt", "", label), value);

  card.append(head, roles, kv, meter("Memory", node.memory_used_bytes, node.memory_total_bytes, stageColor(index)));
  return card;
}

function drawLayerMap(nodes) {
  const map = $("layer-map");
  const total = nodes.reduce((m, n) => Math.max(m, n.end), 0);
  $("layer-count").textContent = total ? `${total} decoder layers over ${nodes.length} nodes` : "";
  map.replaceChildren();
  nodes.forEach((node, index) => {
    for (let layer = node.start; layer < node.end; layer++) {
      const cell = el("div", "layer" + (node.up ? "" : " down"), String(layer));
      cell.style.background = stageColor(index);
      cell.title = `layer ${layer} on ${node.node_id}`;
      map.append(cell);
    }
  });
}

function drawNodes(nodes, links) {
  const box = $("nodes");
  box.replaceChildren();
  if (!nodes.length) {
    box.append(el("div", "empty", "No nodes have joined yet."));
    return;
  }
  nodes.forEach((node, index) => {
    if (index > 0) box.append(el("div", "arrow", "→"));
    box.append(nodeCard(node, index, links.filter((link) => link.node_address === node.address)));
  });
}

function drawStats(data) {
  const { stats, admission } = data;
  $("model-id").textContent = stats.model_id;
  // What the served model lacks, e.g. "no MTP head: served without drafts"; hidden when none.
  const note = (data.model && data.model.note) || "";
  $("model-note").textContent = note;
  $("model-note").hidden = !note;
  $("stat-tps").textContent = stats.tokens_per_s.toFixed(1);
  $("stat-acceptance").textContent = `${(stats.acceptance_rate * 100).toFixed(1)}%`;
  $("stat-inflight").textContent = String(stats.requests_in_flight);
  $("stat-queued").textContent = admission ? `${admission.queued} / ${admission.max_queued}` : "—";
  $("stat-prefix").textContent = `${stats.prefix_cache_hits} (${stats.prefix_cache_saved_tokens} tok saved)`;
  $("stat-prefix").title = `${stats.prefix_cache_entries} prefixes cached on every node`;
  const misses = Object.entries(stats.prefix_cache_misses || {}).filter(([, n]) => n > 0);
  $("stat-prefix-misses").textContent = misses.length
    ? "misses: " + misses.map(([reason, n]) => `${n} ${reason.replace("_", " ")}`).join(" · ") : "";
  $("stat-replays").textContent = String(stats.replays_total);
  $("stat-replays").title = `${stats.replays_failed} could not be replayed (no placement fits)`;
  $("stat-requests").textContent = String(stats.requests_total);
  $("stat-errors").textContent = String(stats.errors_total);
  $("stat-errors").classList.toggle("bad", stats.errors_total > 0);
}

function drawHealth(text, cls) {
  const pill = $("health");
  pill.textContent = text;
  pill.className = `pill ${cls}`;
}

function draw(data) {
  drawStats(data);
  drawLayerMap(data.nodes);
  const links = data.coordinator_links || [];
  drawNodes(data.nodes, links);
  const down = data.nodes.filter((n) => !n.up).length;
  // Links running over a slower address than their best: served, but flagged.
  const slow = data.nodes.filter((n) => n.hop && n.hop.degraded).length
    + links.filter((link) => link.degraded || link.failed).length;
  if (!data.nodes.length) drawHealth("no nodes", "pill-bad");
  else if (down) drawHealth(`degraded · ${down} down`, "pill-bad");
  else if (data.warmup && data.warmup.state === "warming") {
    // Not ready yet: every node runs each shape it will serve ("warming 3/12").
    drawHealth(`warming ${data.warmup.done + 1}/${data.warmup.total}`, "pill-bad");
  } else if (slow) drawHealth(`healthy · ${slow} link${slow === 1 ? "" : "s"} degraded`, "pill-warn");
  else drawHealth("healthy", "pill-ok");
  $("health").title = data.warmup ? data.warmup.line : "";
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

// With API keys on, the data needs the key: asked once, kept for this tab only.
const KEY_ITEM = "cluster-api-key";

function authHeaders() {
  const key = sessionStorage.getItem(KEY_ITEM);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function poll() {
  try {
    const response = await fetch("/api/cluster", {
      cache: "no-store",
      headers: authHeaders(),
      signal: AbortSignal.timeout(2500),
    });
    if (response.status === 401) {
      const key = window.prompt("This coordinator needs its API key:");
      if (key) sessionStorage.setItem(KEY_ITEM, key.trim());
      throw new Error("API key needed");
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    draw(await response.json());
  } catch (err) {
    drawHealth("coordinator unreachable", "pill-bad");
    $("updated").textContent = String(err.message || err);
  } finally {
    setTimeout(poll, POLL_MS); // after the answer, so slow answers never pile up
  }
}

poll();
