// The Sluice web administration page: plain JavaScript over the REST API.
// The token lives in sessionStorage (this tab only) and goes in the
// Authorization header of every call.  Data is only ever written with
// textContent, never parsed as HTML.
"use strict";

const API = "/api/v1";
const KEY = "sluice.token";
const FAST_MS = 2000;   // counts, throughput, scheduler, suspensions
const SLOW_MS = 6000;   // qshape, audit history

let timers = [];
let pending = null;     // the previewed action, applied by "Apply"

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells, cls) {
  const tr = el("tr", null, cls);
  for (const c of cells) {
    const td = el("td");
    if (c instanceof Node) td.appendChild(c); else td.textContent = c === null ? "" : String(c);
    tr.appendChild(td);
  }
  return tr;
}

function fill(tbody, rows) { tbody.replaceChildren(...rows); }

function fmtNum(n) { return Number(n).toLocaleString("en"); }

function fmtRate(x) { return x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2); }

function fmtSpan(s) {
  s = Math.max(0, Math.round(s));
  const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600),
        m = Math.floor(s % 3600 / 60), r = s % 60;
  if (d) return `${d}d${h}h`;
  if (h) return `${h}h${m}m`;
  if (m) return `${m}m${r}s`;
  return `${r}s`;
}

function fmtTime(at) { return new Date(at * 1000).toISOString().replace("T", " ").slice(0, 19); }

class ApiError extends Error {
  constructor(status, body) {
    const detail = body && body.detail;
    const text = Array.isArray(detail)
      ? detail.map((p) => `${p.path}: ${p.message}`).join("; ")
      : (detail || "");
    super(`${body && body.error ? body.error : "HTTP " + status}${text ? ": " + text : ""}`);
    this.status = status;
  }
}

async function call(method, path, body, token) {
  const headers = { "Authorization": "Bearer " + (token || sessionStorage.getItem(KEY) || "") };
  const init = { method, headers };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const resp = await fetch(API + path, init);
  let data = null;
  try { data = await resp.json(); } catch (e) { data = null; }
  if (!resp.ok) {
    if (resp.status === 401 && !token) logout("Your session ended: sign in again.");
    throw new ApiError(resp.status, data);
  }
  return data;
}

function reason() {
  const text = $("reason").value.trim();
  if (!text) {
    $("reason").focus();
    throw new Error("give a reason for the change (it is kept in the audit history)");
  }
  return text;
}

function showError(err) {
  const box = $("error");
  if (!err) { box.hidden = true; box.textContent = ""; return; }
  box.textContent = err.message || String(err);
  box.hidden = false;
}

// -- login -------------------------------------------------------------------------

async function login(event) {
  event.preventDefault();
  const token = $("token").value.trim();
  $("login-error").textContent = "";
  try {
    await call("GET", "/scheduler/stats", undefined, token);
  } catch (err) {
    $("login-error").textContent = err.status === 401 ? "That token is not accepted." :
      "The server did not answer: " + err.message;
    return;
  }
  sessionStorage.setItem(KEY, token);
  $("token").value = "";
  start();
}

function logout(message) {
  sessionStorage.removeItem(KEY);
  for (const t of timers) clearInterval(t);
  timers = [];
  $("dashboard").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
}

function start() {
  $("login").hidden = true;
  $("dashboard").hidden = false;
  route();  // console.js: the view the URL names
  refreshFast();
  refreshSlow();
  timers = [setInterval(refreshFast, FAST_MS), setInterval(refreshSlow, SLOW_MS)];
}

// -- polling -------------------------------------------------------------------------

async function refreshFast() {
  try {
    const [counts, thr, stats, susp, subq, ctrs, shaping] = await Promise.all([
      call("GET", "/queue/counts"), call("GET", "/throughput"),
      call("GET", "/scheduler/stats"), call("GET", "/suspensions"),
      call("GET", "/scheduler/subqueues?limit=20"),
      call("GET", "/scheduler/counters?limit=20"),
      call("GET", "/shaping"),
    ]);
    drawCounts(counts);
    drawThroughput(thr);
    drawStats(stats);
    drawSuspensions(susp);
    drawSubqueues(subq);
    drawCounters(ctrs);
    drawShaping(shaping);
    refreshView();  // console.js: the destinations or charts, if on screen
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
    showError(null);
  } catch (err) {
    if (err.status !== 401) showError(err);
  }
}

async function refreshSlow() {
  try {
    const [shape, audit, cluster] = await Promise.all([
      call("GET", "/queue/shape?top=20"), call("GET", "/audit?limit=20"),
      call("GET", "/cluster"),
    ]);
    drawShape(shape);
    drawAudit(audit);
    drawCluster(cluster);
  } catch (err) {
    if (err.status !== 401) showError(err);
  }
}

// -- drawing ---------------------------------------------------------------------------

function drawCluster(c) {
  // Shown only when this node is part of a cluster (limits in Redis).
  const panel = $("cluster-panel");
  panel.hidden = c.redis === null;
  if (panel.hidden) return;
  const reach = (part) => part === null ? "not configured"
    : part.reachable ? "reachable" : "UNREACHABLE";
  $("cluster-stores").textContent =
    `Redis ${reach(c.redis)}, PostgreSQL ${reach(c.postgres)}`;
  const names = Object.keys(c.nodes).sort();
  fill($("cluster"), names.map((name) => {
    const n = c.nodes[name];
    const beat = n.heartbeat_age_s ?? n.redis_heartbeat_age_s;
    return row([name + (name === c.node ? " (this node)" : ""),
      n.alive === false ? "dead" : (n.limits ?? "-"),
      beat === undefined ? "-" : `${beat.toFixed(1)} s ago`,
      n.claims ?? "-", n.up_s === undefined ? "-" : fmtSpan(n.up_s)]);
  }));
}

function drawCounts(c) {
  for (const [state, n] of Object.entries(c.by_state)) {
    const cell = $("count-" + state);
    if (cell) cell.textContent = fmtNum(n);
  }
  $("count-recipients").textContent = fmtNum(c.recipients);
  $("count-messages").textContent = fmtNum(c.messages);
}

function drawThroughput(t) {
  const names = ["accepted", "delivered", "deferred", "bounced"];
  fill($("throughput"), names.map((n) => row(
    [n, fmtRate(t.per_s_10s[n]), fmtRate(t.per_s_60s[n]), fmtNum(t.totals[n])])));
  const pts = t.points;
  const svg = $("spark");
  svg.replaceChildren();
  if (pts.length < 2) return;
  const rates = [];
  for (let i = 1; i < pts.length; i++) {
    const dt = pts[i].at - pts[i - 1].at;
    rates.push(dt > 0 ? (pts[i].delivered - pts[i - 1].delivered) / dt : 0);
  }
  const max = Math.max(1, ...rates);
  const step = 300 / Math.max(1, rates.length - 1);
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", rates.map((r, i) =>
    `${(i * step).toFixed(1)},${(58 - 56 * r / max).toFixed(1)}`).join(" "));
  svg.appendChild(line);
}

function meter(used, limit) {
  const outer = el("span", null, "meter");
  const inner = el("span");
  inner.style.width = (limit > 0 ? Math.min(100, 100 * used / limit) : 0) + "%";
  outer.appendChild(inner);
  return outer;
}

function drawStats(s) {
  $("node").textContent = "node " + s.node;
  $("uptime").textContent = "up " + fmtSpan(s.uptime_s);
  const a = s.active_queue, c = s.connections;
  const items = [
    ["in memory", `${fmtNum(a.memory_used)} of ${fmtNum(a.maxmemoryqueue)}`,
     meter(a.memory_used, a.maxmemoryqueue)],
    ["waiting for pickup", fmtNum(a.queued_entries)],
    ["being delivered", `${fmtNum(a.inflight_entries)} recipients, ${fmtNum(a.inflight_jobs)} transactions`],
    ["sub-queues", `${fmtNum(a.subqueues)} (${fmtNum(a.parked_subqueues)} parked)`],
    ["counter entries", fmtNum(a.counter_entries)],
    ["connections", `${fmtNum(c.open)} open, ${fmtNum(c.idle)} idle`],
    ["delivered / deferred / bounced",
     `${fmtNum(s.manager.delivered)} / ${fmtNum(s.manager.deferred)} / ${fmtNum(s.manager.bounced)}`],
  ];
  const dl = $("active");
  dl.replaceChildren();
  for (const [k, v, extra] of items) {
    dl.appendChild(el("dt", k));
    const dd = el("dd", v);
    if (extra) dd.appendChild(extra);
    dl.appendChild(dd);
  }
}

function drawShape(s) {
  const table = $("shape");
  const head = el("thead");
  const tr = el("tr");
  for (const h of ["", ...s.header]) tr.appendChild(el("th", h));
  head.appendChild(tr);
  const body = el("tbody");
  body.appendChild(row([s.total.domain, s.total.total, ...s.total.buckets], "total"));
  for (const r of s.rows) body.appendChild(row([r.domain, r.total, ...r.buckets]));
  table.replaceChildren(head, body);
}

function fieldsText(fields) {
  return Object.entries(fields).map(([k, v]) => `${k}=${v || "(default)"}`).join(", ");
}

function drawSubqueues(p) {
  $("subqueue-total").textContent = p.total ? `${p.items.length} of ${p.total}` : "none";
  fill($("subqueues").tBodies[0], p.items.map((q) => row([
    q.route.destination || q.route.recipientdomain,
    [q.route.tenantid, q.route.jobid].filter(Boolean).join(" / "),
    q.route.localip.join(", "),
    `${q.entries} (${q.jobs} jobs)`,
    q.held_by.join("; "),
  ], q.parked ? "parked" : "")));
}

function drawCounters(p) {
  $("counter-total").textContent = p.total ? `${p.items.length} of ${p.total}` : "none";
  fill($("counters").tBodies[0], p.items.map((c) => row([
    c.counter,
    fieldsText(c.key),
    c.concurrency === null ? String(c.inflight) : `${c.inflight} / ${c.concurrency}`,
    c.rate === null ? "" : `${c.rate_used} / ${c.rate}`,
    c.exceeded ? "over" : "",
  ], c.exceeded ? "exceeded" : "")));
}

function drawSuspensions(p) {
  const now = Date.now() / 1000;
  fill($("suspensions").tBodies[0], p.manual.map((s) => {
    const lift = el("button", "Lift", "quiet");
    lift.type = "button";
    lift.dataset.id = s.id;
    lift.addEventListener("click", () => liftSuspension(s.id));
    return row([s.id, s.expires_at === null ? "when lifted" : "in " + fmtSpan(s.expires_at - now),
                s.reason, s.waiting_subqueues, lift]);
  }));
  $("automatic").textContent = p.automatic_total
    ? `${p.automatic_total} counter entries over their thresholds: ` +
      p.automatic.slice(0, 5).map((s) => s.id).join(", ")
    : "No counter is over its threshold.";
}

function drawShaping(p) {
  const now = Date.now() / 1000;
  fill($("shaping").tBodies[0], p.active.map((a) => {
    const lift = el("button", "Lift", "quiet");
    lift.type = "button";
    lift.dataset.key = a.key;
    lift.addEventListener("click", () => liftShaping(a.key));
    return row([a.rule, fieldsText(a.fields), a.text, "in " + fmtSpan(a.until_at - now), lift]);
  }));
  const fired = Object.entries(p.firings).map(([r, n]) => `${r} ${n}`).join(", ");
  $("shaping-summary").textContent = `${p.rules.length} rules; ${p.backoff_groups} groups ` +
    "backed off" + (fired ? "; fired: " + fired : "; none fired yet");
}

async function liftShaping(key) {
  try {
    await call("POST", "/shaping/actions/lift?key=" + encodeURIComponent(key));
    result(`lifted ${key}`, true);
    refreshFast();
    refreshSlow();
  } catch (err) {
    result(err.message, false);
  }
}

function drawAudit(p) {
  fill($("audit").tBodies[0], p.records.map((r) => {
    let last = "";
    if (r.rolled_back_by !== null) {
      last = "rolled back (#" + r.rolled_back_by + ")";
    } else if (r.reversible) {
      last = el("button", "Roll back", "quiet");
      last.type = "button";
      last.addEventListener("click", () => rollback(r.id));
    }
    const tr = row([r.id, fmtTime(r.at), r.who,
                    r.action + (r.rollback_of ? " #" + r.rollback_of : ""), r.target, r.reason,
                    last]);
    tr.cells[1].className = "nowrap";
    return tr;
  }));
}

// -- changes ------------------------------------------------------------------------------

function result(text, ok) {
  const p = $("action-result");
  p.textContent = text;
  p.className = "result " + (ok ? "ok" : "bad");
}

function selector() {
  const sel = {};
  const put = (key, id) => { const v = $(id).value.trim(); if (v) sel[key] = v; };
  put("domain", "sel-domain");
  put("sender", "sel-sender");
  put("tenantid", "sel-tenant");
  put("jobid", "sel-job");
  const state = $("sel-state").value;
  if (state) sel.states = [state];
  const qids = $("sel-qids").value.trim();
  if (qids) sel.qids = qids.split(/[\s,]+/).filter(Boolean);
  return sel;
}

async function preview(event) {
  event.preventDefault();
  $("apply").hidden = true;
  pending = null;
  const body = { action: $("action").value, selector: selector(), dry_run: true };
  try {
    const r = await call("POST", "/queue/actions", body);
    pending = { action: body.action, selector: body.selector };
    result(`${body.action}: would change ${fmtNum(r.count)} recipient(s)`, true);
    if (r.count > 0) {
      const apply = $("apply");
      apply.textContent = `Apply to ${fmtNum(r.count)}`;
      apply.className = body.action === "delete" ? "danger" : "";
      apply.hidden = false;
    }
  } catch (err) {
    result(err.message, false);
  }
}

async function apply() {
  if (!pending) return;
  const body = { ...pending, dry_run: false, reason: $("reason").value.trim() };
  $("apply").hidden = true;
  pending = null;
  try {
    const r = await call("POST", "/queue/actions", body);
    result(`${body.action}: changed ${fmtNum(r.count)} recipient(s)` +
           (r.audit_id ? ` (audit #${r.audit_id})` : ""), true);
    refreshFast();
    refreshSlow();
  } catch (err) {
    result(err.message, false);
  }
}

async function suspend(event) {
  event.preventDefault();
  try {
    const body = { fields: { [$("suspend-field").value]: $("suspend-value").value.trim() },
                   reason: reason() };
    const ttl = $("suspend-ttl").value.trim();
    if (ttl) body.ttl = ttl;
    const r = await call("POST", "/suspensions", body);
    result(`suspended ${r.suspension.id} (audit #${r.audit_id})`, true);
    $("suspend-value").value = "";
    refreshFast();
    refreshSlow();
  } catch (err) {
    result(err.message, false);
  }
}

async function liftSuspension(id) {
  try {
    const why = reason();
    const r = await call("DELETE", "/suspensions/" + encodeURIComponent(id) +
                         "?reason=" + encodeURIComponent(why));
    result(`lifted ${id} (audit #${r.audit_id})`, true);
    refreshFast();
    refreshSlow();
  } catch (err) {
    result(err.message, false);
  }
}

async function rollback(id) {
  try {
    const r = await call("POST", `/audit/${id}/rollback`, { reason: reason() });
    result(`rolled back #${id} (audit #${r.audit_id})`, true);
    refreshFast();
    refreshSlow();
  } catch (err) {
    result(err.message, false);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", login);
  $("logout").addEventListener("click", () => logout());
  $("action-form").addEventListener("submit", preview);
  $("apply").addEventListener("click", apply);
  $("suspend-form").addEventListener("submit", suspend);
  for (const id of ["action", "sel-domain", "sel-sender", "sel-tenant", "sel-job", "sel-state",
                    "sel-qids"]) {
    $(id).addEventListener("input", () => { $("apply").hidden = true; pending = null; });
  }
  if (sessionStorage.getItem(KEY)) start();
});
