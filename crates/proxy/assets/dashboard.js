// The router's live dashboard: polls GET /debug/dashboard once a second and draws it.
// No libraries and nothing from the network but this admin port. With an admin token the
// page sends it as `Authorization: Bearer`; it comes from `?token=` or the form, and is kept
// in sessionStorage (this tab only).
"use strict";

const COLORS = ["#58a6ff", "#f0883e", "#bc8cff", "#3fb950", "#f85149", "#d29922", "#39c5cf", "#db61a2"];
const SVG = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);

(function takeTokenFromUrl() {
  const url = new URL(window.location.href);
  const t = url.searchParams.get("token");
  if (t) {
    sessionStorage.setItem("kinference-token", t);
    url.searchParams.delete("token");
    window.history.replaceState(null, "", url.pathname + url.search);
  }
})();

$("auth").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem("kinference-token", $("token").value.trim());
  $("auth").hidden = true;
  poll();
});

function fmtInt(n) { return Math.round(n).toLocaleString("en-US"); }
function fmtNum(n, digits) {
  if (n === null || n === undefined || !isFinite(n)) return "–";
  return n.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}
function fmtDuration(s) {
  if (s < 120) return fmtNum(s, 1) + " s";
  if (s < 7200) return fmtNum(s / 60, 1) + " min";
  return fmtNum(s / 3600, 2) + " h";
}
function pct(x) { return x === null || x === undefined ? "–" : fmtNum(100 * x, 1) + "%"; }
// Shows `text` and keeps the raw number in data-value, for tools that read the page.
function show(id, text, value) {
  const el = $(id);
  el.textContent = text;
  if (value !== undefined) el.dataset.value = String(value);
}

function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

// Line chart of series [{values: [y|null], color}] against x (seconds), y from 0 to max.
function lineChart(svg, xs, series, yMax, yFmt) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = 600, H = 180, L = 40, B = 16, T = 6;
  let top = yMax;
  if (top === undefined) {
    top = 0;
    for (const s of series) for (const v of s.values) if (v !== null && v > top) top = v;
    top = top > 0 ? top * 1.1 : 1;
  }
  const x0 = xs.length ? xs[0] : 0, x1 = xs.length ? xs[xs.length - 1] : 1;
  const sx = (x) => L + (W - L) * (x1 > x0 ? (x - x0) / (x1 - x0) : 1);
  const sy = (y) => T + (H - T - B) * (1 - Math.min(y, top) / top);
  for (const f of [0, 0.5, 1]) {
    const y = sy(top * f);
    const g = document.createElementNS(SVG, "line");
    g.setAttribute("class", "grid");
    g.setAttribute("x1", L); g.setAttribute("x2", W); g.setAttribute("y1", y); g.setAttribute("y2", y);
    svg.appendChild(g);
    const t = document.createElementNS(SVG, "text");
    t.setAttribute("x", 2); t.setAttribute("y", y + 3);
    t.textContent = yFmt(top * f);
    svg.appendChild(t);
  }
  if (xs.length) {
    const t = document.createElementNS(SVG, "text");
    t.setAttribute("x", L); t.setAttribute("y", H - 3);
    t.textContent = "-" + fmtDuration(x1 - x0);
    svg.appendChild(t);
  }
  for (const s of series) {
    let pts = [];
    const flush = () => {
      if (pts.length) {
        const p = document.createElementNS(SVG, "polyline");
        p.setAttribute("points", pts.join(" "));
        p.setAttribute("stroke", s.color);
        svg.appendChild(p);
      }
      pts = [];
    };
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) { flush(); return; }
      pts.push(sx(xs[i]).toFixed(1) + "," + sy(v).toFixed(1));
    });
    flush();
  }
}

function renderSavings(d) {
  const s = d.savings, t = s.total;
  show("saved-tokens", fmtInt(t.saved_prefill_tokens), t.saved_prefill_tokens);
  show("saved-gpu-seconds", fmtNum(t.saved_gpu_seconds, 2) + " GPU·s", t.saved_gpu_seconds);
  show("saved-kwh", fmtNum(t.saved_kwh * 1000, 2) + " Wh", t.saved_kwh);
  show("saved-usd", "$" + fmtNum(t.saved_usd, 4), t.saved_usd);
  show("observed", fmtInt(t.requests_observed), t.requests_observed);
  // Against each baseline: what it would have saved had it routed the same requests itself.
  const rate = (x) => (t.prompt_tokens ? fmtNum((100 * x) / t.prompt_tokens, 1) + " %" : "–");
  const vs = (s.baselines || []).map((b) =>
    `Saved vs ${b.policy} (estimated): ${fmtNum(b.saved_vs_gpu_seconds, 2)} GPU·s, ` +
    `$${fmtNum(b.saved_vs_usd, 4)}; hit rate ${rate(t.saved_prefill_tokens)} measured, ` +
    `${rate(b.cached_tokens)} for ${b.policy}.`);
  const first = (s.baselines || [])[0];
  show("baselines", vs.join(" "), first ? first.saved_vs_gpu_seconds : undefined);
  const profiles = s.pools.map((p) => `${p.name}: ${p.profile} (${p.gpus_per_replica} GPU/replica)`).join("; ");
  show("prices", `Valued at $${s.usd_per_gpu_hour}/GPU-hour and ${s.gpu_watts} W/GPU; ` +
    `GPU time from the timing profile of each pool (${profiles}), for the cached tokens the replicas reported.`);
  show("uptime", fmtDuration(s.uptime_secs), s.uptime_secs);
}

function renderRates(d) {
  const h = d.history;
  // The mean over the last 5 points, for steadier numbers than one second's.
  const recent = h.slice(-5);
  const mean = (f) => {
    const v = recent.map(f).filter((x) => x !== null && x !== undefined);
    return v.length ? v.reduce((a, b) => a + b, 0) / v.length : null;
  };
  const rps = mean((p) => p.requests_per_s);
  show("rps", fmtNum(rps, 1), rps === null ? "" : rps);
  const hit = mean((p) => p.reported_hit_rate), pred = mean((p) => p.predicted_hit_rate);
  show("hit", pct(hit) + " / " + pct(pred), hit === null ? "" : hit);
  const last = h.length ? h[h.length - 1] : null;
  const ms = (v) => (v === null || v === undefined ? "–" : fmtNum(v, 0));
  show("ttft", last ? `${ms(last.ttft_p50_ms)} · ${ms(last.ttft_p90_ms)} · ${ms(last.ttft_p99_ms)} ms` : "–",
    last && last.ttft_p50_ms !== null ? last.ttft_p50_ms : "");

  const xs = h.map((p) => p.t);
  lineChart($("chart-hit"), xs, [
    { values: h.map((p) => p.reported_hit_rate), color: COLORS[0] },
    { values: h.map((p) => p.predicted_hit_rate), color: COLORS[1] },
  ], 1, (v) => Math.round(v * 100) + "%");
  lineChart($("chart-ttft"), xs, [
    { values: h.map((p) => p.ttft_p50_ms), color: COLORS[0] },
    { values: h.map((p) => p.ttft_p90_ms), color: COLORS[1] },
    { values: h.map((p) => p.ttft_p99_ms), color: COLORS[2] },
  ], undefined, (v) => fmtNum(v, 0));
  const replicas = [];
  for (const p of h) for (const l of p.load) if (!replicas.includes(l.replica)) replicas.push(l.replica);
  const loadSeries = replicas.map((r, i) => ({
    color: COLORS[i % COLORS.length],
    values: h.map((p) => {
      const l = p.load.find((x) => x.replica === r);
      return l ? l.running + l.waiting : null;
    }),
  }));
  lineChart($("chart-load"), xs, loadSeries, undefined, (v) => fmtNum(v, 0));
  const key = $("load-key");
  key.textContent = "";
  replicas.forEach((r, i) => {
    const c = el("i");
    c.style.background = COLORS[i % COLORS.length];
    key.appendChild(c);
    key.appendChild(document.createTextNode(r));
  });
}

function renderReasons(d) {
  const box = $("reasons");
  box.textContent = "";
  const entries = Object.entries(d.reasons).sort((a, b) => b[1] - a[1]);
  const total = entries.reduce((a, [, n]) => a + n, 0);
  if (!total) { box.appendChild(el("p", { class: "muted" }, "no decisions yet")); return; }
  for (const [reason, n] of entries) {
    const row = el("div", { class: "bar", "data-reason": reason });
    row.appendChild(el("span", { class: "name" }, reason));
    const fill = el("span", { class: "fill" });
    fill.style.width = (60 * n / total).toFixed(1) + "%";
    row.appendChild(fill);
    row.appendChild(el("span", { "data-value": String(n) }, `${fmtInt(n)} (${pct(n / total)})`));
    box.appendChild(row);
  }
}

function renderPools(d) {
  const box = $("pools");
  box.textContent = "";
  for (const pool of d.fleet.pools) {
    const saved = d.savings.pools.find((p) => p.name === pool.name);
    box.appendChild(el("h2", {}, `pool ${pool.name} · ${pool.policy} · block ${pool.block_size} · ` +
      `index ${fmtInt(pool.index_entries)} entries / ${fmtInt(pool.index_blocks)} blocks` +
      (saved ? ` · saved ${fmtNum(saved.saved_gpu_seconds, 2)} GPU·s` : "")));
    const table = el("table", { class: "replicas" });
    const head = el("tr");
    for (const c of ["replica", "health", "scorable", "running", "waiting", "KV", "in flight",
      "index entries", "events", "lag", "gaps", "replays", "resyncs"]) head.appendChild(el("th", {}, c));
    table.appendChild(head);
    for (const r of pool.replicas) {
      const w = r.workers;
      const sum = (f) => w.reduce((a, x) => a + f(x), 0);
      const ev = w.map((x) => x.events).filter((e) => e);
      const tr = el("tr", { "data-replica": r.url });
      tr.appendChild(el("td", {}, r.url));
      tr.appendChild(el("td", { class: r.health }, r.health + (r.last_error ? ` (${r.last_error})` : "")));
      tr.appendChild(el("td", { class: r.scorable ? "up" : "warn" },
        r.scorable ? "yes" : "no" + (r.unscorable_reason ? `: ${r.unscorable_reason}` : "")));
      tr.appendChild(el("td", { "data-value": sum((x) => x.load.running) }, fmtInt(sum((x) => x.load.running))));
      tr.appendChild(el("td", {}, fmtInt(sum((x) => x.load.waiting))));
      tr.appendChild(el("td", {}, pct(Math.max(0, ...w.map((x) => x.load.kv_usage)))));
      tr.appendChild(el("td", {}, fmtInt(sum((x) => x.load.in_flight))));
      tr.appendChild(el("td", { class: "index-entries", "data-value": sum((x) => x.index_entries) },
        fmtInt(sum((x) => x.index_entries))));
      if (ev.length) {
        const lag = Math.max(...ev.map((e) => e.last_event_age_ms || 0));
        tr.appendChild(el("td", { class: ev.every((e) => e.connected) ? "up" : "down" },
          [...new Set(ev.map((e) => e.sync))].join(",")));
        tr.appendChild(el("td", {}, fmtNum(lag / 1000, 1) + " s"));
        tr.appendChild(el("td", {}, fmtInt(ev.reduce((a, e) => a + e.gaps, 0))));
        tr.appendChild(el("td", {}, `${fmtInt(ev.reduce((a, e) => a + e.replays_succeeded, 0))}/` +
          fmtInt(ev.reduce((a, e) => a + e.replays_attempted, 0))));
        tr.appendChild(el("td", {}, fmtInt(ev.reduce((a, e) => a + e.resets, 0))));
      } else {
        tr.appendChild(el("td", { class: "muted" }, r.events_error || r.events_mode));
        for (let i = 0; i < 4; i++) tr.appendChild(el("td", { class: "muted" }, "–"));
      }
      table.appendChild(tr);
    }
    box.appendChild(table);
  }
}

let timer = null;
async function poll() {
  clearTimeout(timer);
  const headers = {};
  const token = sessionStorage.getItem("kinference-token");
  if (token) headers["Authorization"] = "Bearer " + token;
  try {
    const resp = await fetch("/debug/dashboard", { headers, cache: "no-store" });
    if (resp.status === 401) {
      $("auth").hidden = false;
      show("status", "needs the admin token");
      return;
    }
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const d = await resp.json();
    renderSavings(d);
    renderRates(d);
    renderReasons(d);
    renderPools(d);
    const n = (parseInt(document.body.dataset.updates || "0", 10) + 1);
    document.body.dataset.updates = String(n);
    show("status", "live · " + new Date().toLocaleTimeString());
  } catch (e) {
    show("status", "cannot read the router: " + e.message);
  }
  timer = setTimeout(poll, 1000);
}
poll();
