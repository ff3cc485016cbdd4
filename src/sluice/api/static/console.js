// The Sluice console's views beside the overview: find a message, one message, the
// destinations, the charts.  Uses app.js's helpers (call, el, row, fill, fmt*).
// Views are chosen by the URL's fragment (#messages, #message/SPID, #destinations,
// #charts); only the view on screen is refreshed.  Charts are inline SVG drawn here:
// no library, no request beyond this server.  Data is only ever written as text.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLOURS = { accepted: "#6b7482", delivered: "#2e7d32", deferred: "#b26a00",
                  bounced: "#c62828", recipients: "#1f6feb" };
const VIEWS = ["overview", "messages", "message", "destinations", "charts"];
const PAGE = 50;

let view = "overview";
let findAfter = [];          // the 'after' cursor of each page shown (keyset paging)
let findNext = null;
let findQuery = "";          // the search of the page shown: its next and first pages repeat it
let findSeq = 0;             // the latest search: an answer to an older one is dropped
let currentSpid = null;
let destSort = { key: "state", desc: false };

// -- views -----------------------------------------------------------------------------

function route() {
  if (!sessionStorage.getItem(KEY)) return;  // start() routes after signing in
  const hash = location.hash.replace(/^#/, "");
  const [name, arg] = hash.split("/", 2);
  view = VIEWS.includes(name) ? name : "overview";
  for (const v of VIEWS) $("view-" + v).hidden = v !== view;
  for (const a of document.querySelectorAll("#tabs a")) {
    a.classList.toggle("active", a.dataset.view === view ||
                                 (view === "message" && a.dataset.view === "messages"));
  }
  if (view === "message" && arg) openMessage(decodeURIComponent(arg));
  else if (view === "messages" && findNext === null && findAfter.length === 0) find();
  refreshView();
}

function refreshView() {
  if (!sessionStorage.getItem(KEY)) return;
  if (view === "destinations") loadDestinations();
  else if (view === "charts") loadCharts();
}

function fmtAgo(at) {
  return at === null || at === undefined ? "" : fmtSpan(Date.now() / 1000 - at) + " ago";
}

function fmtWhen(at) {
  const d = at - Date.now() / 1000;
  return d <= 0 ? "now" : "in " + fmtSpan(d);
}

function reply(r) { return r ? `${r.code} ${r.enhanced} ${r.text}`.trim() : ""; }

function link(text, hash) {
  const a = el("a", text);
  a.href = "#" + hash;
  return a;
}

// -- find a message --------------------------------------------------------------------

function findParams() {
  const p = new URLSearchParams();
  const put = (key, id) => { const v = $(id).value.trim(); if (v) p.append(key, v); };
  put("recipient", "find-recipient");
  put("sender", "find-sender");
  put("domain", "find-domain");
  put("qid", "find-qid");
  put("tenantid", "find-tenant");
  put("jobid", "find-job");
  put("state", "find-state");
  return p;
}

async function find(after, query) {
  // A page is asked for with the search it belongs to: the form's for a new
  // search, the shown page's for its next and first pages.  Until the answer
  // comes, the paging buttons are off: a cursor is only good for its own search.
  const seq = ++findSeq;
  const search = query === undefined ? findParams().toString() : query;
  const p = new URLSearchParams(search);
  p.set("limit", String(PAGE));
  if (after) p.set("after", after);
  const shown = $("find-info").textContent;
  $("find-next").disabled = true;
  $("find-first").disabled = true;
  $("find-info").textContent = "searching\u2026";
  const settle = () => {
    $("find-next").disabled = !findNext;
    $("find-first").disabled = findAfter.length <= 1;
  };
  try {
    const page = await call("GET", "/queue/entries?" + p.toString());
    // A search started while this one waited (the first, unfiltered page
    // opening the view, then the operator's) wins: its cursor is not ours.
    if (seq !== findSeq) return;
    if (!after) findAfter = [];
    findAfter.push(after || null);
    findNext = page.next;
    findQuery = search;
    fill($("found").tBodies[0], page.entries.map((e) => {
      const tr = row([link(e.qid, "message/" + e.spid), e.state, e.sender || "<>",
        e.recipient, [e.tenantid, e.jobid].filter(Boolean).join(" / "),
        fmtTime(e.arrival_at), e.attempts,
        e.state === "hold" ? "held" : fmtWhen(e.next_attempt_at), reply(e.last_reply)]);
      tr.cells[5].className = "nowrap";
      return tr;
    }));
    settle();
    const n = page.entries.length;
    $("find-info").textContent = n ? `page ${findAfter.length}: ${n} recipient(s)` +
      (findNext ? "" : " (the last page)") : "nothing matches";
    showError(null);
  } catch (err) {
    if (seq !== findSeq) return;
    settle();  // the page shown is still good, and so is its cursor
    $("find-info").textContent = shown;
    if (err.status !== 401) showError(err);
  }
}

// -- one message -------------------------------------------------------------------------

async function openMessage(spid, keepResult) {
  currentSpid = spid;
  $("msg-spid").textContent = spid;
  if (!keepResult) $("msg-result").textContent = "";
  $("msg-body").hidden = true;
  $("msg-body").textContent = "";
  $("msg-body-note").textContent = "";
  const got = await Promise.allSettled([
    call("GET", "/messages/" + encodeURIComponent(spid)),
    call("GET", "/queue/entries/" + encodeURIComponent(spid) + "/why"),
    call("GET", "/messages/" + encodeURIComponent(spid) + "/headers"),
  ]);
  if (currentSpid !== spid) return;
  const [msg, why, head] = got.map((g) => g.status === "fulfilled" ? g.value : null);
  if (got[0].status === "rejected") {
    showError(got[0].reason);
    return;
  }
  showError(null);
  drawMessage(msg);
  drawWhy(why);
  drawHeaders(head);
}

function drawMessage(m) {
  $("msg-summary").textContent = (m.arrival_at ? "arrived " + fmtTime(m.arrival_at) + ", " : "") +
    `${m.recipients.length} recipient(s) still queued`;
  fill($("msg-recipients").tBodies[0], m.recipients.map((e) => row([
    e.qid, e.recipient, e.state + (e.priority ? " (high)" : ""), e.attempts,
    e.state === "hold" ? "held" : fmtWhen(e.next_attempt_at), reply(e.last_reply)])));
  fill($("msg-history").tBodies[0], m.history.map((h) => {
    const host = [h.remotemx, h.remoteip].filter(Boolean).join(" ");
    const text = h.code === null || h.code === undefined ? (h.response || "")
      : `${h.code} ${h.enhanced || ""} ${h.response || ""}`.replace(/\s+/g, " ").trim();
    const tr = row([h.time.replace("T", " ").replace("Z", ""), h.event, h.recipient || "",
                    host, text]);
    tr.className = "ev-" + h.event;
    tr.cells[0].className = "nowrap";
    return tr;
  }));
  $("msg-history-note").textContent = `${m.history.length} event(s) from ${m.history_files} ` +
    `file(s)` + (m.history_truncated ? " — cut short (api.history_max_bytes)" : "");
}

function drawWhy(w) {
  const list = $("msg-why");
  if (!w) { list.replaceChildren(el("li", "Nothing waits: no recipient is queued.")); return; }
  list.replaceChildren(...w.explanations.map((x) => {
    const li = el("li");
    li.appendChild(el("strong", x.qid + ": "));
    li.appendChild(document.createTextNode(x.lines.join(" ")));
    return li;
  }));
}

function drawHeaders(h) {
  const body = $("msg-headers").tBodies[0];
  if (!h) {
    fill(body, [row(["", "The content is gone (every recipient is done)."])]);
    $("msg-body-button").hidden = true;
    return;
  }
  fill(body, h.headers.map((f) => {
    const tr = row([f.name + ":", f.value]);
    tr.cells[0].className = "name";
    return tr;
  }));
  $("msg-body-button").hidden = !h.body_allowed;
  $("msg-body-note").textContent = h.body_allowed ? ""
    : "Your token may not read message bodies (api.body_tokens).";
}

async function showBody() {
  try {
    const b = await call("GET", "/messages/" + encodeURIComponent(currentSpid) + "/body");
    $("msg-body").textContent = b.text;
    $("msg-body").hidden = false;
    $("msg-body-note").textContent = `${fmtNum(b.bytes)} bytes` +
      (b.truncated ? " (cut short)" : "");
  } catch (err) {
    $("msg-body-note").textContent = err.message;
  }
}

async function messageAction(event) {
  event.preventDefault();
  const what = event.submitter ? event.submitter.dataset.action : null;
  const why = $("msg-reason").value.trim();
  const out = $("msg-result");
  if (!what) return;
  if (!why) {
    out.textContent = "Give a reason: it is kept in the audit history.";
    out.className = "result bad";
    $("msg-reason").focus();
    return;
  }
  const body = { selector: { qids: [currentSpid] }, reason: why, action: what };
  if (what.startsWith("priority-")) {
    body.action = "priority";
    body.priority = Number(what.slice(-1));
  }
  try {
    const r = await call("POST", "/queue/actions", body);
    out.textContent = `${body.action}: changed ${fmtNum(r.count)} recipient(s)` +
      (r.audit_id ? ` (audit #${r.audit_id})` : "");
    out.className = "result ok";
    openMessage(currentSpid, true);
  } catch (err) {
    out.textContent = err.message;
    out.className = "result bad";
  }
}

// -- destinations --------------------------------------------------------------------------

async function loadDestinations() {
  const p = new URLSearchParams({ sort: destSort.key, desc: String(destSort.desc),
                                  limit: "500" });
  const q = $("dest-q").value.trim();
  if (q) p.set("q", q);
  const st = $("dest-state").value;
  if (st) p.set("state", st);
  try {
    const t = await call("GET", "/destinations?" + p.toString());
    $("dest-total").textContent = t.total > t.items.length
      ? `${t.items.length} of ${t.total}` : `${t.total}`;
    fill($("destinations").tBodies[0], t.items.map((d) => {
      const name = link(d.destination, "messages");
      name.addEventListener("click", () => findDomain(d.destination));
      let state = d.state;
      if (d.until_at) state += " until " + fmtTime(d.until_at).slice(11);
      if (d.state === "slow start") state += ` (${d.window.toFixed(1)} of ${d.limit})`;
      const last = d.last_reply ? `${d.last_reply} (${d.last_host}, ${fmtAgo(d.last_at)})` : "";
      const tr = row([name, state, d.queued, d.inflight, d.delivered_5m, d.deferred_5m,
                      d.bounced_5m, d.delivered_1h, d.deferred_1h, d.bounced_1h, last]);
      tr.className = "st-" + d.state.replace(" ", "-");
      tr.title = d.held_by.join("; ");
      return tr;
    }));
    for (const th of document.querySelectorAll("#destinations th[data-sort]")) {
      th.classList.toggle("sorted", th.dataset.sort === destSort.key);
      th.classList.toggle("desc", th.dataset.sort === destSort.key && destSort.desc);
    }
    showError(null);
  } catch (err) {
    if (err.status !== 401) showError(err);
  }
}

function sortDestinations(key) {
  destSort = destSort.key === key ? { key, desc: !destSort.desc }
    : { key, desc: !["destination", "state"].includes(key) };
  loadDestinations();
}

function findDomain(domain) {
  for (const id of ["find-recipient", "find-sender", "find-qid", "find-tenant", "find-job"]) {
    $(id).value = "";
  }
  $("find-state").value = "";
  $("find-domain").value = domain;
  findAfter = [];
  findNext = null;
}

// -- charts ----------------------------------------------------------------------------------

function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = String(text);
  return e;
}

function niceMax(x) {
  if (x <= 0) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(x)));
  for (const m of [1, 2, 2.5, 5, 10]) if (x <= m * p) return m * p;
  return 10 * p;
}

// A line chart: ``series`` is [{name, values}], all over the same times ``at``.
function lineChart(svg, at, series, t0, t1) {
  const W = 900, H = 220, L = 52, R = 10, T = 10, B = 24;
  svg.replaceChildren();
  const max = niceMax(Math.max(0, ...series.flatMap((s) => s.values)));
  const x = (t) => L + (W - L - R) * (t - t0) / Math.max(1, t1 - t0);
  const y = (v) => H - B - (H - T - B) * v / max;
  for (const f of [0, 0.5, 1]) {
    svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: y(max * f), y2: y(max * f),
                                    class: "grid" }));
    svg.appendChild(svgEl("text", { x: L - 6, y: y(max * f) + 4, class: "axis",
                                    "text-anchor": "end" }, fmtRate(max * f)));
  }
  for (const f of [0, 0.25, 0.5, 0.75, 1]) {
    const t = t0 + (t1 - t0) * f;
    svg.appendChild(svgEl("text", { x: x(t), y: H - 6, class: "axis",
      "text-anchor": f === 0 ? "start" : f === 1 ? "end" : "middle" },
      new Date(t * 1000).toISOString().slice(11, 16)));
  }
  for (const s of series) {
    if (at.length === 0) continue;
    const pts = at.map((t, i) => `${x(t).toFixed(1)},${y(s.values[i]).toFixed(1)}`);
    svg.appendChild(svgEl("polyline", { points: pts.join(" "), stroke: COLOURS[s.name],
                                        class: "series", "data-name": s.name }));
  }
}

function barChart(svg, items) {
  const W = 900, rowH = 21, L = 8;
  svg.replaceChildren();
  const max = Math.max(1, ...items.map((r) => r.count));
  svg.setAttribute("viewBox", `0 0 ${W} ${Math.max(1, items.length) * rowH + 4}`);
  items.forEach((r, i) => {
    const w = (W - 80) * r.count / max;
    svg.appendChild(svgEl("rect", { x: L, y: i * rowH + 2, width: Math.max(1, w),
                                    height: rowH - 4, class: "bar" }));
    svg.appendChild(svgEl("text", { x: L + 6, y: i * rowH + 15, class: "bar-label" },
                          r.reason.length > 110 ? r.reason.slice(0, 110) + "…" : r.reason));
    svg.appendChild(svgEl("text", { x: W - 4, y: i * rowH + 15, class: "axis",
                                    "text-anchor": "end" }, fmtNum(r.count)));
  });
}

async function loadCharts() {
  try {
    const c = await call("GET", "/charts?window_s=3600&step_s=10&top=10");
    const names = ["accepted", "delivered", "deferred", "bounced"];
    const t1 = Math.floor(c.at), t0 = t1 - c.window_s;
    lineChart($("chart-rates"), c.rates.map((p) => p.at),
              names.map((n) => ({ name: n, values: c.rates.map((p) => p[n]) })), t0, t1);
    const legend = $("rate-legend");
    legend.replaceChildren(...names.map((n) => {
      const last = c.rates.slice(-6).reduce((a, p) => a + p[n], 0) / Math.max(1, Math.min(6, c.rates.length));
      const span = el("span", `${n} ${fmtRate(last)}/s`, "key");
      span.style.setProperty("--key", COLOURS[n]);
      return span;
    }));
    lineChart($("chart-queue"), c.queue.map((q) => q.at),
              [{ name: "recipients", values: c.queue.map((q) => q.recipients) }], t0, t1);
    barChart($("chart-reasons"), c.reasons);
    $("reasons-none").textContent = c.reasons.length ? "" : "No deferrals in the last hour.";
  } catch (err) {
    if (err.status !== 401) showError(err);
  }
}

// -- wiring ----------------------------------------------------------------------------------

document.addEventListener("DOMContentLoaded", () => {
  window.addEventListener("hashchange", route);
  $("find-form").addEventListener("submit", (e) => { e.preventDefault(); find(); });
  $("find-next").addEventListener("click", () => { if (findNext) find(findNext, findQuery); });
  $("find-first").addEventListener("click", () => find(undefined, findQuery));
  $("msg-actions").addEventListener("submit", messageAction);
  $("msg-body-button").addEventListener("click", showBody);
  $("dest-form").addEventListener("submit", (e) => { e.preventDefault(); loadDestinations(); });
  $("dest-q").addEventListener("input", loadDestinations);
  $("dest-state").addEventListener("change", loadDestinations);
  for (const th of document.querySelectorAll("#destinations th[data-sort]")) {
    th.addEventListener("click", () => sortDestinations(th.dataset.sort));
  }
});
