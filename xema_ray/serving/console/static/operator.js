// Operator view: per model group its plans, live queues, attainment, preemption, memory, replicas,
// and each template's memory trace against the budget (SVG). Refreshes itself every REFRESH_MS.
"use strict";
// ?refresh=SECONDS sets the period (0.5 to 60)
const REFRESH_MS = Math.round(1000 * Math.min(60, Math.max(0.5, parseFloat(new URLSearchParams(location.search).get("refresh")) || 2)));
const traces = {};  // template -> {config, view} (a trace is fetched once per planned configuration)
const SVGNS = "http://www.w3.org/2000/svg";
const svg = (tag, attrs = {}, content) => {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (typeof content === "string") e.textContent = content; else if (content) e.append(content);
  return e;
};
const pill = (cls, text) => el("span", { class: "pill " + cls, text });
const stat = (value, label) => el("div", { class: "stat" }, el("b", { text: String(value) }), el("span", { text: label }));
const td = (text, cls) => el("td", cls ? { class: cls, text } : { text });
const bar = (frac, over) => el("span", { class: "bar" + (over ? " over" : ""), style: `width:${Math.max(1, Math.min(1, frac) * 90).toFixed(0)}px` });

function plansTable(g) {
  const head = el("tr", {}, ...["template", "configuration", "mitigations", "latency", "SLO", "peak / budget", "static layout", "attainment"].map((h, i) => el("th", { class: [3, 4, 5, 7].includes(i) ? "num" : "", text: h })));
  const rows = g.plans.map((p) => {
    const a = g.attainment[p.template];
    const att = a && a.requests ? `${(100 * a.fraction).toFixed(0)}% of ${a.requests}` : "no requests yet";
    const peak = el("td", { class: "num" }, bar(p.predicted_peak_bytes / p.budget_bytes, p.predicted_peak_bytes > p.budget_bytes), " " + gb(p.predicted_peak_bytes) + " / " + gb(p.budget_bytes));
    const layout = el("td", {}, pill(p.layout_armed ? "ok" : "warn", p.layout_armed ? "armed" : "not armed"), el("div", { class: "mute", text: p.layout_why }));
    return el("tr", { "data-template": p.template }, td(p.template), td(p.config), td(p.mitigations.join("; ") || "none"),
      td(secs(p.predicted_latency_s), "num"), td(secs(p.slo_s), "num"), peak, layout, td(att, "num"));
  });
  return el("table", { class: "plans" }, el("thead", {}, head), el("tbody", {}, ...rows));
}

function replicasTable(g) {
  if (!g.replicas.length) return el("div", { class: "mute", text: "no replica summary (the group did not answer in time)" });
  const head = el("tr", {}, ...["replica", "queued per template", "running batches", "free SP groups"].map((h) => el("th", { text: h })));
  const rows = g.replicas.map((r) => {
    const queues = Object.entries(r.queues).map(([t, q]) => `${t}: ${q.queued}` + (q.queued ? ` (oldest ${secs(q.oldest_wait_s)})` : "")).join("; ") || "empty";
    const running = r.running.map((b) => `${b.template} ×${b.requests} on [${b.workers}]${b.paused ? " paused" : ""} · ${b.remaining_steps} steps left`).join("; ") || "idle";
    const free = Object.entries(r.free_groups).map(([t, n]) => `${t}: ${n}`).join("; ");
    return el("tr", {}, td(r.replica + (r.draining ? " (draining)" : "")), td(queues), td(running), td(free));
  });
  return el("table", { class: "replicas" }, el("thead", {}, head), el("tbody", {}, ...rows));
}

function memoryTable(g) {
  const workers = g.static_layouts ? Object.entries(g.static_layouts.workers || {}) : [];
  if (!workers.length) return el("div", { class: "mute", text: "no batch has run yet: each worker's memory appears after its first batch" });
  const planned = Object.fromEntries(g.plans.map((p) => [p.template, p.predicted_peak_bytes]));
  const head = el("tr", {}, ...["worker", "last batch", "peak", "planned peak", "", "source"].map((h, i) => el("th", { class: [2, 3].includes(i) ? "num" : "", text: h })));
  const rows = workers.map(([w, m]) => {
    const plan = planned[m.template];
    return el("tr", {}, td(w), td(m.template), td(gb(m.peak_bytes), "num"), td(gb(plan), "num"),
      el("td", {}, plan ? bar(m.peak_bytes / plan, m.peak_bytes > plan) : ""), td(m.source + (m.source === "rss" ? " (host process, CPU workers)" : "")));
  });
  return el("table", { class: "memory" }, el("thead", {}, head), el("tbody", {}, ...rows));
}

function preemptionLine(g) {
  const p = g.preemption;
  if (!p) return "preemption: no answer";
  const per = Object.values(p.per_template || {});
  const n = per.reduce((s, t) => s + (t.preemptions || 0), 0), now = per.reduce((s, t) => s + (t.paused_now || 0), 0);
  const held = per.reduce((s, t) => s + (t.paused_bytes || 0), 0), ps = per.reduce((s, t) => s + (t.paused_s || 0), 0);
  return `preemption ${p.enabled === false ? "off" : "on"} · ${n} pauses · ${now} paused now holding ${gb(held)} · ${ps.toFixed(1)} s paused in all`;
}

// W: the plot's width in CSS pixels (its viewBox is as wide as it is drawn: text is never stretched)
function plotTrace(v, W) {
  const H = 210, L = 46, R = 8, T = 16, B = 40;
  const n = Math.max(1, v.events), top = Math.max(v.budget_bytes, ...v.unmitigated, ...v.mitigated, v.predicted_peak_bytes) * 1.08;
  const X = (e) => L + ((W - L - R) * e) / n, Y = (b) => T + (H - T - B) * (1 - Math.max(0, b) / top);
  const s = svg("svg", { class: "trace", viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img", "aria-label": `memory trace of ${v.template}` });
  for (const ph of v.phases) {
    s.append(svg("rect", { x: X(ph.start), y: T, width: Math.max(0.5, X(ph.stop) - X(ph.start)), height: H - T - B, fill: ph.label === "denoise" ? "#f2f5fa" : "#fafafa" }));
    if (X(ph.stop) - X(ph.start) > 30) s.append(svg("text", { x: X(ph.start) + 2, y: T - 4 }, ph.label));
  }
  for (const p of v.pressure) s.append(svg("rect", { class: "pressure", x: X(p.start), y: T, width: Math.max(2, X(p.stop) - X(p.start)), height: H - T - B, fill: "#c43b3b", "fill-opacity": "0.25" }, svg("title", {}, p.label)));
  const path = (ys) => v.x.map((x, i) => `${i ? "L" : "M"}${X(x).toFixed(1)},${Y(ys[i]).toFixed(1)}`).join("") + `L${X(n).toFixed(1)},${Y(ys[ys.length - 1]).toFixed(1)}`;
  s.append(svg("path", { class: "unmitigated", d: path(v.unmitigated), fill: "none", stroke: "#9aa3ad", "stroke-width": 1.2 }));
  s.append(svg("path", { class: "mitigated", d: path(v.mitigated), fill: "none", stroke: "#2f6fdf", "stroke-width": 1.6 }));
  s.append(svg("line", { class: "budget", x1: L, x2: W - R, y1: Y(v.budget_bytes), y2: Y(v.budget_bytes), stroke: "#c43b3b", "stroke-dasharray": "5 3" }));
  s.append(svg("text", { x: W - R - 2, y: Y(v.budget_bytes) - 3, "text-anchor": "end" }, `budget ${gb(v.budget_bytes)}`));
  s.append(svg("line", { x1: L, x2: W - R, y1: Y(v.predicted_peak_bytes), y2: Y(v.predicted_peak_bytes), stroke: "#1f9254", "stroke-dasharray": "2 3" }));
  s.append(svg("text", { x: L + 2, y: Y(v.predicted_peak_bytes) - 3 }, `planned peak ${gb(v.predicted_peak_bytes)}`));
  for (const f of [0, 0.5, 1]) s.append(svg("text", { x: L - 4, y: Y(top * f / 1.08) + 3, "text-anchor": "end" }, gb(top * f / 1.08).replace(" ", "")));
  s.append(svg("line", { x1: L, x2: L, y1: T, y2: H - B, stroke: "#bbb" }));
  let row = 0;
  for (const m of v.mitigations) {
    const y = H - B + 6 + (row % 3) * 10; row++;
    if (m.stop > m.start) s.append(svg("rect", { class: "mitigation", x: X(m.start), y, width: Math.max(1, X(m.stop) - X(m.start)), height: 6, fill: "#2f6fdf", "fill-opacity": "0.55" }));
    const right = X(m.start) > (W + L) / 2;  // a span on the right half is labelled to its left
    s.append(svg("text", { x: right ? X(m.start) - 3 : X(m.stop) + 3, y: y + 6, "text-anchor": right ? "end" : "start" }, m.label));
  }
  if (!v.mitigations.length) s.append(svg("text", { x: L, y: H - B + 14 }, "no mitigation: the plan fits the budget as it is"));
  return s;
}

function traceCard(template, entry, width) {
  const box = el("div", { class: "trace-card", "data-template": template });
  const v = entry && entry.view;
  box.append(el("h3", { text: `${template}` }));
  if (!v) { box.append(el("div", { class: "mute", text: entry && entry.error ? entry.error : "tracing on the meta device…" })); return box; }
  box.append(el("div", { class: "mute", text: `${v.config} · ${v.events.toLocaleString()} events (${v.steps_traced} steps traced) · ${v.pressure.length} pressure interval(s)` }));
  box.append(plotTrace(v, width));
  box.append(el("div", { class: "legend" }, el("i", { style: "background:#9aa3ad" }), "without mitigations", el("i", { style: "background:#2f6fdf" }), "as planned",
    el("i", { style: "background:#c43b3b" }), "budget / pressure", el("i", { style: "background:#1f9254" }), "planned peak"));
  return box;
}

function fetchTrace(p) {
  const have = traces[p.template];
  if (have && have.config === p.config) return;
  traces[p.template] = { config: p.config, view: null };
  api(`/v1/console/traces/${p.template.split("/").map(encodeURIComponent).join("/")}`)
    .then((v) => { traces[p.template] = { config: p.config, view: v }; render(); })
    .catch((e) => { traces[p.template] = { config: p.config, view: null, error: e.message }; render(); });
}

// the width of one plot: the .traces grid (auto-fit, columns of at least 520 px, 13 px apart) in the page's main column
function traceWidth(n) {
  const avail = Math.min(document.documentElement.clientWidth, 1400) - 2 * 19 - 2 * 17;
  const cols = Math.max(1, Math.min(n, Math.floor((avail + 13) / (520 + 13))));
  return Math.max(320, Math.floor((avail - (cols - 1) * 13) / cols));
}

let last = null;
function render() {
  if (!last) return;
  const d = last;
  $("#summary").replaceChildren(stat(d.hardware, "plan hardware"), stat(gb(d.budget_bytes), "budget per GPU"), stat(d.received, "requests received"),
    stat(d.groups.reduce((s, g) => s + g.queued, 0), "queued now"), stat(d.groups.reduce((s, g) => s + g.running, 0), "batches running"));
  $("#refreshed").textContent = "updated " + new Date(d.t * 1000).toLocaleTimeString();
  const cards = d.groups.map((g) => {
    const st = g.status === "ok" ? "ok" : g.status === "starting" ? "warn" : "bad";
    const reps = `${g.replicas_running ?? "?"} running · target ${g.replicas_target ?? "?"}` + (g.autoscaling ? ` · autoscaling ${g.autoscaling}` : " · fixed");
    const card = el("section", { class: "card group", "data-model": g.model },
      el("h2", {}, g.model + " ", pill(st, g.status), el("span", { class: "mute", text: ` · ${g.workers} workers per replica · replicas: ${reps}` })),
      g.reason ? el("div", { class: "status error", text: g.reason }) : "",
      el("div", { class: "stats" }, el("div", { class: "stat", "data-stat": "queued" }, el("b", { text: String(g.queued) }), el("span", { text: "queued (all replicas)" })),
        stat(g.running, "batches running"), stat(g.paused, "batches paused"), stat(Object.values(g.attainment).reduce((s, a) => s + a.requests, 0), `finished (last ${Math.round((Object.values(g.attainment)[0] || { window_s: 60 }).window_s)} s)`)),
      el("div", { class: "mute", text: preemptionLine(g) }),
      el("h3", { text: "Plans" }), plansTable(g),
      el("h3", { text: "Replicas" }), replicasTable(g),
      el("h3", { text: "Device memory per worker against its plan" }), memoryTable(g),
      el("h3", { text: "Memory traces (analyzer, per GPU)" }), el("div", { class: "traces" }, ...g.plans.map((p) => traceCard(p.template, traces[p.template], traceWidth(g.plans.length)))));
    return card;
  });
  $("#groups").replaceChildren(...cards);
}

let timer = null;
async function refresh() {
  clearTimeout(timer);
  try {
    last = await api("/v1/console/operator");
    $("#status").textContent = ""; $("#status").classList.remove("error");
    for (const g of last.groups) for (const p of g.plans) fetchTrace(p);
    render();
  } catch (e) {
    const msg = e.status === 401 ? "this deployment needs an API key: enter an admin key above"
      : e.status === 403 ? "this key is not an admin key: the operator view needs one" : e.message;
    $("#status").textContent = msg; $("#status").classList.add("error");
  }
  if ($("#auto").checked) timer = setTimeout(refresh, REFRESH_MS);
}

setupHeader();
$("#every").textContent = String(REFRESH_MS / 1000);
$("#auto").addEventListener("change", refresh);
document.addEventListener("xema-key", refresh);
window.addEventListener("resize", render);
refresh();
