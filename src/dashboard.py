"""The reference Worker's operations dashboard: one self-contained HTML page served at ``GET /``.

No build step and nothing external: the page's CSS and JavaScript are inline (no ``src``/``href``
to another origin, no fonts, no images), and its Content-Security-Policy allows exactly those two
inline blocks (by their SHA-256 hashes) and ``fetch`` to the Worker's own origin. It reads only
the Worker's JSON routes:

* ``GET /accounts/{account}/usage`` (public): the numbers (limit, charged, outstanding, lease
  footprint, available), the per-group bars, and one sample of the "charged over time" chart per
  poll (the history is kept in the page, so it starts when the page is opened);
* ``GET /accounts/{account}/queues/{queue}`` (public) for each queue named in the URL: job states
  and, for queued jobs, the holder's latest ``blocked`` reason;
* with a token (``Authorization: Bearer ...``): ``GET .../holders`` (the holders table) and
  ``GET .../audit`` with the read token (secret ``READ_TOKEN``) or the admin token, and
  ``POST .../holders/{clientId}/settle`` (the table's "Force settle" button) with the admin
  token only (the read token is answered 403 there).

What is shown comes from the URL: ``/?account=acme,beta&queues=q1,q2&interval=2000`` (``account``
may repeat; ``interval`` is the poll period in ms, default 2000). The token is typed into a
field and kept in ``sessionStorage`` (gone with the tab), never put in the URL.

Stable hooks for tests and scripts: every account is a ``section[data-account]``; its numbers are
``[data-stat=charged|limit|available|outstanding|leaseFootprint]``; group rows are
``tr[data-group]`` with cells ``[data-field=...]``; blocked rows ``tr[data-reason]``; holder rows
``tr[data-client]`` (the client id in ``[data-field=clientId]``, its label, the name its messages
carry, beside it in ``[data-field=label]``, ``-`` for none); ``data-samples`` on the section
counts the polls it has rendered.
"""

from __future__ import annotations

import base64
import hashlib

__all__ = ["PAGE", "HEADERS", "SCRIPT", "STYLE"]

STYLE = """
:root { --fg: #1d2330; --muted: #5b6577; --line: #d9dee7; --bg: #f5f7fa; --card: #fff;
  --ok: #2f7d4f; --warn: #b7791f; --bad: #c53030; --bar: #3867d6; --lease: #8e6bd6; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
  color: var(--fg); background: var(--bg); }
header { background: #1d2330; color: #fff; padding: 12px 20px; display: flex; flex-wrap: wrap;
  gap: 12px 28px; align-items: center; }
header h1 { font-size: 17px; margin: 0 12px 0 0; font-weight: 600; }
header form { display: flex; gap: 6px; align-items: center; flex-wrap: wrap; }
header label { color: #c9d1e0; font-size: 12px; }
header input { font: inherit; padding: 3px 6px; border-radius: 4px; border: 1px solid #536078;
  background: #2a3243; color: #fff; min-width: 9em; }
button { font: inherit; padding: 3px 10px; border-radius: 4px; border: 1px solid #8a96ab;
  background: #eef1f6; color: #1d2330; cursor: pointer; white-space: nowrap; }
button:focus-visible, input:focus-visible { outline: 2px solid #7aa2ff; outline-offset: 1px; }
#status { margin: 0; font-size: 12px; color: #c9d1e0; flex-basis: 100%; }
#status.error { color: #ffb4b4; }
main { padding: 16px 20px; display: grid; gap: 16px; }
.empty-hint { color: var(--muted); }
section.account { background: var(--card); border: 1px solid var(--line); border-radius: 8px;
  padding: 14px 18px; display: grid; gap: 14px; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); }
section.account > h2 { grid-column: 1 / -1; margin: 0; font-size: 16px; display: flex; gap: 10px;
  align-items: baseline; }
.account-error { grid-column: 1 / -1; color: var(--bad); margin: 0; }
.account-error:empty { display: none; }
.limit-source { color: var(--muted); font-weight: normal; font-size: 12px; }
dl.stats { grid-column: 1 / -1; display: flex; flex-wrap: wrap; gap: 10px; margin: 0; }
dl.stats > div { border: 1px solid var(--line); border-radius: 6px; padding: 6px 12px; min-width: 110px; }
dl.stats dt { font-size: 11px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); }
dl.stats dd { margin: 0; font-size: 22px; font-weight: 600; font-variant-numeric: tabular-nums; }
dl.stats dd.full { color: var(--bad); }
figure { margin: 0; grid-column: 1 / -1; }
figcaption, caption { font-weight: 600; text-align: left; margin-bottom: 4px; font-size: 13px; }
svg.chart { width: 100%; height: 200px; display: block; border: 1px solid var(--line); border-radius: 6px;
  background: #fbfcfe; }
svg.chart .grid { stroke: #e6e9ef; }
svg.chart .axis { fill: var(--muted); font-size: 11px; }
svg.chart .limit { stroke: var(--bad); stroke-dasharray: 6 4; fill: none; stroke-width: 1.5; }
svg.chart .charged { stroke: var(--bar); fill: none; stroke-width: 2; }
svg.chart .area { fill: rgba(56, 103, 214, .14); }
svg.chart .lease { stroke: var(--lease); fill: none; stroke-width: 1.5; stroke-dasharray: 2 3; }
.legend { font-size: 12px; color: var(--muted); display: flex; gap: 14px; margin-top: 4px; }
.legend span::before { content: ""; display: inline-block; width: 14px; height: 3px; margin-right: 5px;
  vertical-align: middle; background: var(--bar); }
.legend .l-limit::before { background: var(--bad); }
.legend .l-lease::before { background: var(--lease); }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid var(--line); vertical-align: middle; }
thead th { font-size: 11px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted); }
td.num, th.num { text-align: right; }
.wide { grid-column: 1 / -1; }
.bar { position: relative; height: 12px; min-width: 120px; background: #edf0f5; border-radius: 3px;
  overflow: hidden; }
.bar > .fill { position: absolute; left: 0; top: 0; bottom: 0; background: var(--bar); }
.bar > .fill.full { background: var(--bad); }
.bar > .lease-fill { position: absolute; top: 0; bottom: 0; background: var(--lease); }
.reason { font-weight: 600; }
.reason-limit, .reason-group_limit { color: var(--warn); }
.reason-not_permitted, .reason-limit_resolution_error { color: var(--bad); }
.muted { color: var(--muted); }
.holders th[scope=row], .audit [data-field=clientId] { font: 12px ui-monospace, "SFMono-Regular", Menlo, monospace;
  word-break: break-all; }
.state-running { color: var(--ok); font-weight: 600; }
.state-queued { color: var(--warn); font-weight: 600; }
dialog { border: 1px solid var(--line); border-radius: 8px; padding: 16px 18px; max-width: 460px; }
dialog form { display: grid; gap: 8px; }
dialog input { font: inherit; padding: 4px 6px; }
dialog menu { display: flex; gap: 8px; justify-content: flex-end; padding: 0; margin: 4px 0 0; }
@media (max-width: 900px) { section.account { grid-template-columns: minmax(0, 1fr); } }
"""

BODY = """
<header>
  <h1>durability-semaphore</h1>
  <form id="view-form" role="search" aria-label="What to show">
    <label for="accounts-input">Accounts</label>
    <input id="accounts-input" name="account" placeholder="acme, beta" autocomplete="off">
    <label for="queues-input">Queues</label>
    <input id="queues-input" name="queues" placeholder="q1, q2" autocomplete="off">
    <button type="submit">Show</button>
  </form>
  <form id="token-form" aria-label="Token">
    <label for="token-input">Token (READ_TOKEN or ADMIN_TOKEN)</label>
    <input id="token-input" type="password" autocomplete="off" placeholder="kept in this tab only">
    <button type="submit">Use</button>
    <button type="button" id="token-forget">Forget</button>
    <span id="token-state" aria-live="polite"></span>
  </form>
  <p id="status" role="status" aria-live="polite">Starting...</p>
</header>
<main id="accounts" aria-live="off">
  <p class="empty-hint" id="empty-hint">Name one or more accounts above (or open
    <code>/?account=acme&amp;queues=q1,q2</code>) to watch their budgets.</p>
</main>
<template id="account-template">
  <section class="account">
    <h2><span data-field="account"></span><span class="limit-source" data-field="limit-source"></span></h2>
    <p class="account-error" role="alert" data-field="error"></p>
    <dl class="stats">
      <div><dt>Charged</dt><dd data-stat="charged">-</dd></div>
      <div><dt>Limit</dt><dd data-stat="limit">-</dd></div>
      <div><dt>Available</dt><dd data-stat="available">-</dd></div>
      <div><dt>Outstanding grants</dt><dd data-stat="outstanding">-</dd></div>
      <div><dt>Lease footprint</dt><dd data-stat="leaseFootprint">-</dd></div>
      <div><dt>Live leases</dt><dd data-stat="liveLeases">-</dd></div>
    </dl>
    <figure>
      <figcaption>Charged against the limit over time</figcaption>
      <svg class="chart" data-field="chart" role="img" viewBox="0 0 800 200"
        aria-label="No samples yet"></svg>
      <div class="legend" aria-hidden="true"><span>charged</span><span class="l-limit">limit</span>
        <span class="l-lease">lease footprint</span></div>
    </figure>
    <table class="groups">
      <caption>Groups</caption>
      <thead><tr><th scope="col">Group</th><th scope="col" class="num">Charged</th>
        <th scope="col" class="num">Limit</th><th scope="col" class="num">Available</th>
        <th scope="col">Use</th></tr></thead>
      <tbody data-field="groups"></tbody>
    </table>
    <table class="blocked">
      <caption>Why work waits</caption>
      <thead><tr><th scope="col">Queue</th><th scope="col">Group</th><th scope="col">Reason</th>
        <th scope="col" class="num">Queued jobs</th><th scope="col" class="num">Waiting (holder)</th>
        <th scope="col">Since</th></tr></thead>
      <tbody data-field="blocked"></tbody>
    </table>
    <table class="queues wide">
      <caption>Queues</caption>
      <thead><tr><th scope="col">Queue</th><th scope="col" class="num">Queued</th>
        <th scope="col" class="num">Claiming</th><th scope="col" class="num">Running</th>
        <th scope="col" class="num">Done</th></tr></thead>
      <tbody data-field="queues"></tbody>
    </table>
    <table class="holders wide">
      <caption>Holders (clients charged by this account)</caption>
      <thead><tr><th scope="col">Client</th><th scope="col">Label</th><th scope="col" class="num">Charged</th>
        <th scope="col">Grants</th><th scope="col">Leases</th><th scope="col">Last report</th>
        <th scope="col"><span class="muted">Action</span></th></tr></thead>
      <tbody data-field="holders"></tbody>
    </table>
    <table class="audit wide">
      <caption>Audit log</caption>
      <thead><tr><th scope="col">When</th><th scope="col">Action</th><th scope="col">Client</th>
        <th scope="col">Actor</th><th scope="col">Reason</th><th scope="col">Details</th></tr></thead>
      <tbody data-field="audit"></tbody>
    </table>
  </section>
</template>
<dialog id="settle-dialog" aria-labelledby="settle-title">
  <form id="settle-form" method="dialog">
    <h3 id="settle-title">Force settle <span id="settle-client"></span></h3>
    <p class="muted">The holder stops charging this client's grants and leases (its work is treated as
      finished). Use it only for a client that is gone for good.</p>
    <label for="settle-reason">Reason (recorded in the audit log)</label>
    <input id="settle-reason" required maxlength="500" autocomplete="off">
    <menu><button type="button" id="settle-cancel">Cancel</button>
      <button type="submit" id="settle-confirm">Force settle</button></menu>
  </form>
</dialog>
"""

SCRIPT = """
"use strict";
(function () {
  var TOKEN_KEY = "durability-semaphore.adminToken";
  var HISTORY = 600;
  var WINDOW_MS = 10000;
  var REASONS = new Map([
    ["limit", "account limit reached"],
    ["group_limit", "group limit reached"],
    ["not_permitted", "not permitted for this client"],
    ["limit_resolution_error", "limit could not be resolved"]
  ]);
  function byId(id) { return document.getElementById(id); }
  function splitList(values) {
    var out = [];
    values.forEach(function (v) {
      v.split(",").forEach(function (s) { s = s.trim(); if (s && out.indexOf(s) < 0) { out.push(s); } });
    });
    return out;
  }
  var params = new URLSearchParams(location.search);
  var accounts = splitList(params.getAll("account").concat(params.getAll("accounts")));
  var queues = splitList(params.getAll("queues").concat(params.getAll("queue")));
  var interval = parseInt(params.get("interval") || "2000", 10);
  if (!(interval >= 250)) { interval = 2000; }
  interval = Math.min(interval, 60000);
  // Per-account state, keyed by account name: a Map, because names are anyone's ("constructor",
  // "toString" and "__proto__" are Object.prototype's keys in a plain object).
  var views = new Map();
  var timer = null;
  var settleTarget = null;

  function token() {
    try { return sessionStorage.getItem(TOKEN_KEY) || ""; } catch (e) { return ""; }
  }
  function fmt(v) { return v === null || v === undefined ? "-" : String(v); }
  function path(parts) { return "/" + parts.map(encodeURIComponent).join("/"); }
  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined && text !== null) { node.textContent = String(text); }
    return node;
  }
  function svg(tag, attrs) {
    var node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, String(attrs[k])); });
    return node;
  }
  function clock(ms) { return ms ? new Date(ms).toLocaleTimeString() : "-"; }
  function ago(ms) {
    if (!ms) { return "-"; }
    var s = Math.max(0, Math.round((Date.now() - ms) / 1000));
    return s < 90 ? s + " s ago" : Math.round(s / 60) + " min ago";
  }
  function field(root, name) { return root.querySelector('[data-field="' + name + '"]'); }
  function emptyRow(tbody, cols, text) {
    var tr = el("tr", {"class": "empty"});
    tr.appendChild(el("td", {colspan: String(cols), "class": "muted"}, text));
    tbody.appendChild(tr);
  }

  async function getJSON(url, admin, method, body) {
    var headers = {accept: "application/json"};
    if (admin) { headers.authorization = "Bearer " + token(); }
    if (body !== undefined) { headers["content-type"] = "application/json"; }
    var resp = await fetch(url, {method: method || "GET", headers: headers, cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body)});
    var data = null;
    try { data = await resp.json(); } catch (e) { data = null; }
    return {status: resp.status, data: data};
  }
  function problem(r) {
    var e = r.data && r.data.error;
    return "HTTP " + r.status + (e ? " " + e.code + ": " + e.message : "");
  }

  function view(account) {
    if (views.has(account)) { return views.get(account); }
    var root = byId("account-template").content.firstElementChild.cloneNode(true);
    root.setAttribute("data-account", account);
    root.setAttribute("data-samples", "0");
    root.setAttribute("aria-label", "Account " + account);
    field(root, "account").textContent = account;
    byId("accounts").appendChild(root);
    var v = {root: root, history: [], account: account};
    views.set(account, v);
    return v;
  }

  function renderStats(root, u) {
    ["charged", "limit", "available", "outstanding", "leaseFootprint", "liveLeases"].forEach(function (k) {
      var dd = root.querySelector('[data-stat="' + k + '"]');
      dd.textContent = fmt(u[k]);
      dd.setAttribute("data-value", u[k] === null || u[k] === undefined ? "" : String(u[k]));
    });
    root.querySelector('[data-stat="available"]').classList.toggle("full", u.available === 0);
    field(root, "limit-source").textContent = u.limitOverride === null || u.limitOverride === undefined
      ? "default limit " + fmt(u.defaultLimit) : "limit override (default " + fmt(u.defaultLimit) + ")";
  }

  function renderChart(v) {
    var chart = field(v.root, "chart");
    var h = v.history, W = Math.max(320, Math.round(chart.clientWidth || 800)), H = 200, L = 34, R = 10, T = 10,
      B = 22;
    chart.setAttribute("viewBox", "0 0 " + W + " " + H);
    while (chart.firstChild) { chart.removeChild(chart.firstChild); }
    if (!h.length) { return; }
    var top = 1;
    h.forEach(function (s) { top = Math.max(top, s.charged, s.limit || 0); });
    top = Math.ceil(top * 1.15);
    var t1 = h[h.length - 1].t, t0 = Math.min(h[0].t, t1 - WINDOW_MS);
    function x(t) { return L + (W - L - R) * (t - t0) / (t1 - t0); }
    function y(n) { return T + (H - T - B) * (1 - n / top); }
    var ticks = [0, Math.round(top / 2), top];
    ticks.forEach(function (n) {
      chart.appendChild(svg("line", {"class": "grid", x1: L, x2: W - R, y1: y(n), y2: y(n)}));
      var lbl = svg("text", {"class": "axis", x: L - 6, y: y(n) + 4, "text-anchor": "end"});
      lbl.textContent = String(n);
      chart.appendChild(lbl);
    });
    var span = svg("text", {"class": "axis", x: W - R, y: H - 6, "text-anchor": "end"});
    span.textContent = "now";
    chart.appendChild(span);
    var first = svg("text", {"class": "axis", x: L, y: H - 6});
    first.textContent = "-" + Math.round((t1 - t0) / 1000) + " s";
    chart.appendChild(first);
    function line(key) {
      return h.map(function (s, i) {
        var p = x(s.t).toFixed(1) + "," + y(s[key] || 0).toFixed(1);
        return (i && key === "limit") ? x(s.t).toFixed(1) + "," + y(h[i - 1].limit || 0).toFixed(1) + " " + p : p;
      }).join(" ");
    }
    var pts = line("charged");
    chart.appendChild(svg("polygon", {"class": "area", points: x(h[0].t).toFixed(1) + "," + y(0) + " " + pts + " " +
      x(h[h.length - 1].t).toFixed(1) + "," + y(0)}));
    if (h.some(function (s) { return s.leaseFootprint > 0; })) {
      chart.appendChild(svg("polyline", {"class": "lease", points: line("leaseFootprint")}));
    }
    chart.appendChild(svg("polyline", {"class": "limit", points: line("limit")}));
    chart.appendChild(svg("polyline", {"class": "charged", points: pts}));
    var last = h[h.length - 1];
    chart.setAttribute("aria-label", "Charged " + last.charged + " of limit " + fmt(last.limit) + " over the last " +
      Math.round((last.t - h[0].t) / 1000) + " s (" + h.length + " samples)");
    chart.setAttribute("data-samples", String(h.length));
  }

  function renderGroups(root, u) {
    var tbody = field(root, "groups");
    tbody.textContent = "";
    var names = Object.keys(u.groups || {}).sort();
    if (!names.length) { emptyRow(tbody, 5, "No group has anything charged."); return; }
    names.forEach(function (name) {
      var g = u.groups[name];
      var tr = el("tr", {"data-group": name});
      tr.appendChild(el("th", {scope: "row", "data-field": "group"}, name));
      tr.appendChild(el("td", {"class": "num", "data-field": "charged", "data-value": String(g.charged)},
        fmt(g.charged)));
      tr.appendChild(el("td", {"class": "num", "data-field": "limit"}, g.limit === null ? "-" : fmt(g.limit)));
      tr.appendChild(el("td", {"class": "num", "data-field": "available"}, fmt(g.available)));
      var cap = g.limit !== null && g.limit !== undefined ? g.limit : u.limit;
      var cell = el("td");
      var bar = el("div", {"class": "bar", role: "img",
        "aria-label": name + ": " + g.charged + " charged of " + fmt(cap)});
      var denom = Math.max(cap || 0, g.charged, 1);
      var fill = el("div", {"class": "fill"});
      var grants = g.charged - (g.leaseFootprint || 0);
      fill.style.width = (100 * grants / denom).toFixed(1) + "%";
      if (cap !== null && cap !== undefined && g.charged >= cap) { fill.classList.add("full"); }
      bar.appendChild(fill);
      if (g.leaseFootprint) {
        var lf = el("div", {"class": "lease-fill"});
        lf.style.left = (100 * grants / denom).toFixed(1) + "%";
        lf.style.width = (100 * g.leaseFootprint / denom).toFixed(1) + "%";
        bar.appendChild(lf);
      }
      cell.appendChild(bar);
      tr.appendChild(cell);
      tbody.appendChild(tr);
    });
  }

  function renderQueues(root, results) {
    var qbody = field(root, "queues"), bbody = field(root, "blocked");
    qbody.textContent = "";
    bbody.textContent = "";
    var blocked = new Map();
    if (!results.length) { emptyRow(qbody, 5, "No queues named (add ?queues=q1,q2 to the URL)."); }
    results.forEach(function (r) {
      var tr = el("tr", {"data-queue": r.queue});
      tr.appendChild(el("th", {scope: "row"}, r.queue));
      if (r.status !== 200) {
        tr.appendChild(el("td", {colspan: "4", "class": "muted"}, problem(r)));
        qbody.appendChild(tr);
        return;
      }
      var counts = new Map([["queued", 0], ["claiming", 0], ["running", 0], ["done", 0]]);
      r.data.jobs.forEach(function (job) {
        if (counts.has(job.state)) { counts.set(job.state, counts.get(job.state) + 1); }
        if (job.state === "queued" && job.blocked) {
          var key = JSON.stringify([r.queue, job.group, job.blocked.reason]);
          if (!blocked.has(key)) {
            blocked.set(key, {queue: r.queue, group: job.group, reason: job.blocked.reason,
              jobs: 0, waiting: 0, at: 0});
          }
          var b = blocked.get(key);
          b.jobs += 1;
          b.waiting = Math.max(b.waiting, job.blocked.waiting || 0);
          b.at = Math.max(b.at, job.blocked.at || 0);
        }
      });
      ["queued", "claiming", "running", "done"].forEach(function (s) {
        tr.appendChild(el("td", {"class": "num" + (counts.get(s) && s !== "done" ? " state-" + s : ""),
          "data-field": s}, counts.get(s)));
      });
      qbody.appendChild(tr);
    });
    var keys = Array.from(blocked.keys()).sort();
    if (!keys.length) { emptyRow(bbody, 6, "Nothing in these queues is blocked."); }
    keys.forEach(function (key) {
      var b = blocked.get(key);
      var tr = el("tr", {"data-reason": b.reason, "data-queue": b.queue, "data-group": b.group});
      tr.appendChild(el("td", {"data-field": "queue"}, b.queue));
      tr.appendChild(el("td", {"data-field": "group"}, b.group));
      var cell = el("td", {"data-field": "reason"});
      cell.appendChild(el("span", {"class": "reason reason-" + b.reason}, b.reason));
      cell.appendChild(document.createTextNode(" - " + (REASONS.get(b.reason) || "")));
      tr.appendChild(cell);
      tr.appendChild(el("td", {"class": "num", "data-field": "jobs"}, b.jobs));
      tr.appendChild(el("td", {"class": "num", "data-field": "waiting"}, b.waiting));
      tr.appendChild(el("td", {"data-field": "since", title: b.at ? new Date(b.at).toISOString() : ""}, ago(b.at)));
      bbody.appendChild(tr);
    });
  }

  function summarize(items, live) {
    var active = items.filter(function (i) { return live.indexOf(i.status) >= 0; });
    if (!items.length) { return "-"; }
    return items.map(function (i) {
      var parts = [i.group, i.permits + " permits"];
      if (i.claimed !== undefined) { parts.push(i.claimed + " claimed"); }
      if (i.drawn !== undefined) { parts.push(i.drawn + " drawn"); }
      parts.push(i.released + " released");
      if (live.indexOf(i.status) < 0 || active.length !== items.length) { parts.push(i.status); }
      return parts.join(", ");
    }).join("; ");
  }

  function renderHolders(v, r) {
    var tbody = field(v.root, "holders");
    tbody.textContent = "";
    if (!token()) { emptyRow(tbody, 7, "Enter a token (READ_TOKEN or ADMIN_TOKEN) above to see the holders."); return; }
    if (!r || r.status !== 200) {
      emptyRow(tbody, 7, r && r.status === 401 ? "The token was refused (HTTP 401)." :
        r && r.status === 404 ? "This Worker has no holders view." : "Holders unavailable: " + (r ? problem(r) : ""));
      return;
    }
    var list = r.data.holders || [];
    if (!list.length) { emptyRow(tbody, 7, "No client holds anything."); }
    list.forEach(function (h) {
      var tr = el("tr", {"data-client": h.clientId});
      tr.appendChild(el("th", {scope: "row", "data-field": "clientId"}, h.clientId));
      tr.appendChild(el("td", {"data-field": "label"}, fmt(h.label)));
      tr.appendChild(el("td", {"class": "num", "data-field": "charged"}, fmt(h.charged)));
      tr.appendChild(el("td", {"data-field": "grants"}, summarize(h.grants || [], ["active"])));
      tr.appendChild(el("td", {"data-field": "leases"}, summarize(h.leases || [], ["live"])));
      tr.appendChild(el("td", {"data-field": "lastReportAt",
        title: h.lastReportAt ? new Date(h.lastReportAt).toISOString() : ""}, ago(h.lastReportAt)));
      var cell = el("td");
      var btn = el("button", {type: "button", "data-action": "settle",
        "aria-label": "Force settle " + h.clientId + (h.label ? " (" + h.label + ")" : "")}, "Force settle");
      btn.addEventListener("click", function () { openSettle(v.account, h.clientId); });
      cell.appendChild(btn);
      tr.appendChild(cell);
      tbody.appendChild(tr);
    });
    if (r.data.cursor) { emptyRow(tbody, 7, "More holders exist (the first page is shown)."); }
  }

  function renderAudit(v, r) {
    var tbody = field(v.root, "audit");
    tbody.textContent = "";
    if (!token()) {
      emptyRow(tbody, 6, "Enter a token (READ_TOKEN or ADMIN_TOKEN) above to see the audit log."); return;
    }
    if (!r || r.status !== 200) {
      emptyRow(tbody, 6, r && r.status === 404 ? "This Worker has no audit log." :
        "Audit log unavailable: " + (r ? problem(r) : ""));
      return;
    }
    var records = (r.data.records || []).slice(0, 20);
    if (!records.length) { emptyRow(tbody, 6, "No operator action recorded."); }
    records.forEach(function (rec) {
      var tr = el("tr", {"data-audit": String(rec.auditId), "data-client": rec.clientId || ""});
      tr.appendChild(el("td", {title: rec.at ? new Date(rec.at).toISOString() : ""}, clock(rec.at)));
      tr.appendChild(el("td", {"data-field": "action"}, fmt(rec.action)));
      tr.appendChild(el("td", {"data-field": "clientId"}, fmt(rec.clientId)));
      tr.appendChild(el("td", {"data-field": "actor"}, fmt(rec.actor)));
      tr.appendChild(el("td", {"data-field": "reason"}, fmt(rec.reason)));
      var freed = "freed " + fmt(rec.grantPermits) + " grant permit(s) (" + (rec.grants || []).length +
        " grant(s)), " + fmt(rec.leasePermits) + " lease permit(s) (" + (rec.leases || []).length + " lease(s))";
      tr.appendChild(el("td", {"class": "muted", "data-field": "details"}, freed));
      tbody.appendChild(tr);
    });
  }

  async function refreshAccount(account) {
    var v = view(account);
    var base = path(["accounts", account]);
    var admin = !!token();
    var calls = [getJSON(base + "/usage", false)];
    queues.forEach(function (q) { calls.push(getJSON(base + path(["queues", q]), admin)); });
    if (admin) { calls.push(getJSON(base + "/holders", true), getJSON(base + "/audit", true)); }
    var res = await Promise.all(calls);
    var usage = res[0];
    var qres = res.slice(1, 1 + queues.length).map(function (r, i) {
      return {queue: queues[i], status: r.status, data: r.data};
    });
    var errorBox = field(v.root, "error");
    if (usage.status !== 200 || !usage.data) {
      errorBox.textContent = "usage: " + problem(usage);
      return false;
    }
    errorBox.textContent = "";
    var u = usage.data;
    v.history.push({t: Date.now(), charged: u.charged, limit: u.limit, leaseFootprint: u.leaseFootprint});
    if (v.history.length > HISTORY) { v.history.shift(); }
    renderStats(v.root, u);
    renderChart(v);
    renderGroups(v.root, u);
    renderQueues(v.root, qres);
    renderHolders(v, admin ? res[1 + queues.length] : null);
    renderAudit(v, admin ? res[2 + queues.length] : null);
    v.root.setAttribute("data-samples", String(Number(v.root.getAttribute("data-samples")) + 1));
    v.root.setAttribute("data-updated", String(Date.now()));
    return true;
  }

  async function refresh() {
    clearTimeout(timer);
    var status = byId("status");
    if (accounts.length) {
      try {
        var ok = await Promise.all(accounts.map(refreshAccount));
        var failed = ok.filter(function (x) { return !x; }).length;
        status.classList.toggle("error", failed > 0);
        status.textContent = (failed ? failed + " account(s) could not be read. " : "") + "Updated " +
          new Date().toLocaleTimeString() + ", every " + (interval / 1000) + " s.";
      } catch (e) {
        status.classList.add("error");
        status.textContent = "Refresh failed: " + e + " (retrying every " + (interval / 1000) + " s)";
      }
    } else {
      status.textContent = "No account selected.";
    }
    timer = setTimeout(refresh, interval);
  }

  function showTokenState() {
    byId("token-state").textContent = token() ? "token set for this tab" : "no token (public view)";
  }

  function openSettle(account, clientId) {
    settleTarget = {account: account, clientId: clientId};
    byId("settle-client").textContent = clientId;
    byId("settle-reason").value = "";
    byId("settle-dialog").showModal();
    byId("settle-reason").focus();
  }

  byId("settle-cancel").addEventListener("click", function () {
    settleTarget = null;
    byId("settle-dialog").close();
  });
  byId("settle-form").addEventListener("submit", async function (ev) {
    ev.preventDefault();
    var target = settleTarget;
    var reason = byId("settle-reason").value.trim();
    if (!target || !reason) { return; }
    byId("settle-dialog").close();
    settleTarget = null;
    var r = await getJSON(path(["accounts", target.account, "holders", target.clientId, "settle"]), true, "POST",
      {reason: reason, actor: "dashboard"});
    var status = byId("status");
    status.classList.toggle("error", r.status !== 200);
    status.textContent = r.status === 200 ? "Settled " + target.clientId + "." :
      "Force settle of " + target.clientId + " failed: " + problem(r);
    refresh();
  });

  byId("token-form").addEventListener("submit", function (ev) {
    ev.preventDefault();
    var input = byId("token-input");
    try {
      var typed = input.value.trim();  // as the Worker reads ADMIN_TOKEN: no surrounding whitespace
      if (typed) { sessionStorage.setItem(TOKEN_KEY, typed); }
    } catch (e) { /* storage unavailable: public view only */ }
    input.value = "";
    showTokenState();
    refresh();
  });
  byId("token-forget").addEventListener("click", function () {
    try { sessionStorage.removeItem(TOKEN_KEY); } catch (e) { /* nothing kept */ }
    showTokenState();
    refresh();
  });
  byId("view-form").addEventListener("submit", function (ev) {
    ev.preventDefault();
    accounts = splitList([byId("accounts-input").value]);
    queues = splitList([byId("queues-input").value]);
    var q = new URLSearchParams();
    if (accounts.length) { q.set("account", accounts.join(",")); }
    if (queues.length) { q.set("queues", queues.join(",")); }
    if (interval !== 2000) { q.set("interval", String(interval)); }
    history.replaceState(null, "", location.pathname + (q.toString() ? "?" + q.toString() : ""));
    Array.from(views.keys()).forEach(function (a) {
      if (accounts.indexOf(a) < 0) { views.get(a).root.remove(); views.delete(a); }
    });
    start();
  });

  function start() {
    byId("accounts-input").value = accounts.join(", ");
    byId("queues-input").value = queues.join(", ");
    byId("empty-hint").hidden = accounts.length > 0;
    document.title = (accounts.length ? accounts.join(", ") + " - " : "") + "durability-semaphore";
    accounts.forEach(function (a) { byId("accounts").appendChild(view(a).root); });
    refresh();
  }
  showTokenState();
  start();
})();
"""


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") + "'"


PAGE = ("<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        "<title>durability-semaphore</title>\n<link rel=\"icon\" href=\"data:,\">\n"
        f"<style>{STYLE}</style>\n</head>\n<body>{BODY}<script>{SCRIPT}</script>\n</body>\n</html>\n")

#: The page's response headers: only its own inline style and script may run (by hash), and it may
#: connect only to the Worker's origin; no framing, no referrer, never cached.
HEADERS = {
    "content-type": "text/html; charset=utf-8",
    "content-security-policy": (
        f"default-src 'none'; script-src {_csp_hash(SCRIPT)}; style-src {_csp_hash(STYLE)}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}
