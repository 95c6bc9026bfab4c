"""Tier 1: the operations dashboard page (src/dashboard.py, ``GET /``) and the operations routes
of the reference Worker (``GET .../holders``, ``POST .../holders/{clientId}/settle``,
``GET .../audit``) on host CPython, with the fake ``workers`` module and in-process objects of
tests/test_reference_worker.py.

The page: nothing external (no ``src``/``href`` to any URL, no CSS ``url()``/``@import``, no
inline event handlers, one inline script and one style whose SHA-256 hashes are exactly the CSP's),
every id and ``data-field`` its script looks up exists in the markup, the token field has no
``name`` (it can never be submitted into a URL) and every form control has a label. The routes:
admin only, reads of a made-up account create nothing, settle of an account without state is 404
and creates nothing, a real settle frees the client's permits and is listed by the audit route.
The page's script also runs in Node (``vm``, over a minimal DOM built from the page's own markup,
``fetch`` answering the public routes): accounts named ``constructor``, ``__proto__``,
``toString`` each get their own section and are polled like any other. A browser test of the
page is tests/workerd/test_dashboard.py (tier 3).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import re
import shutil
import subprocess
import sys
import types
from html.parser import HTMLParser
from urllib.parse import quote

import pytest

import dashboard
import test_reference_worker as ref
from test_reference_worker import AUTH, World, queue_object, run

SVG_NS = "http://www.w3.org/2000/svg"
#: Where the page keeps the typed token (its script's ``TOKEN_KEY``).
TOKEN_KEY = "durability-semaphore.adminToken"


@pytest.fixture
def entry(monkeypatch):
    """src/entry.py imported over a stand-in ``workers`` module (as tests/test_reference_worker.py)."""
    fake = types.ModuleType("workers")
    fake.DurableObject = type("DurableObject", (ref._Base,), {})
    fake.WorkerEntrypoint = type("WorkerEntrypoint", (ref._Base,), {})
    fake.Response = ref._Response
    monkeypatch.setitem(sys.modules, "workers", fake)
    monkeypatch.delitem(sys.modules, "entry", raising=False)
    module = importlib.import_module("entry")
    yield module
    sys.modules.pop("entry", None)


class Page(HTMLParser):
    """Every start tag with its attributes, and the text of each script and style element."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.blocks: dict[str, list[str]] = {"script": [], "style": []}
        self._in: str | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag in self.blocks:
            self._in = tag
            self.blocks[tag].append("")

    def handle_endtag(self, tag):
        if tag == self._in:
            self._in = None

    def handle_data(self, data):
        if self._in:
            self.blocks[self._in][-1] += data


async def fetch(world: World, method: str, url: str, body=None, headers=None) -> tuple[int, object]:
    """Like ``World.fetch``, for a URL that may carry a query string."""
    req = ref._Request("http://w" + url, method, headers or {}, "" if body is None else json.dumps(body))
    resp = await world.entry.Default(None, world.env).fetch(req)
    return resp.status, json.loads(resp.body)


def parsed() -> Page:
    page = Page()
    page.feed(dashboard.PAGE)
    page.close()
    return page


def sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def test_the_page_loads_nothing_external():
    page = parsed()
    for tag, attrs in page.tags:
        for name in ("src", "href", "action", "poster", "data", "srcset"):
            value = attrs.get(name)
            if value is not None:
                assert not re.match(r"\s*(https?:)?//", value), (tag, name, value)
                assert value.startswith(("data:", "#", "/")) or tag == "form", (tag, name, value)
        assert not any(name.startswith("on") for name in attrs), (tag, attrs)  # the CSP blocks those
    assert [t for t, a in page.tags if t == "script" and "src" in a] == []
    assert [t for t, a in page.tags if t == "link" and a.get("rel") != "icon"] == []
    # The only URL in the whole page is the SVG namespace (a name, never fetched).
    assert set(re.findall(r"https?://[^\s\"')]+", dashboard.PAGE)) == {SVG_NS}
    style = "".join(page.blocks["style"])
    assert "url(" not in style and "@import" not in style and "@font-face" not in style


def test_the_csp_allows_exactly_the_inline_script_and_style():
    page = parsed()
    assert len(page.blocks["script"]) == 1 and len(page.blocks["style"]) == 1
    assert page.blocks["script"][0] == dashboard.SCRIPT and page.blocks["style"][0] == dashboard.STYLE
    csp = dict(part.strip().split(" ", 1) for part in dashboard.HEADERS["content-security-policy"].split(";"))
    assert csp["default-src"] == "'none'"
    assert csp["script-src"] == sha256(dashboard.SCRIPT)
    assert csp["style-src"] == sha256(dashboard.STYLE)
    assert csp["connect-src"] == "'self'" and csp["frame-ancestors"] == "'none'"
    assert dashboard.HEADERS["content-type"] == "text/html; charset=utf-8"


def test_every_id_and_field_the_script_uses_exists():
    page = parsed()
    ids = [a["id"] for _, a in page.tags if a.get("id")]
    assert len(ids) == len(set(ids)), "duplicate ids"
    used = set(re.findall(r"byId\(\"([^\"]+)\"\)", dashboard.SCRIPT))
    assert used and used <= set(ids), sorted(used - set(ids))
    fields = {a["data-field"] for _, a in page.tags if a.get("data-field")}
    used_fields = set(re.findall(r"field\([a-z.]+, \"([^\"]+)\"\)", dashboard.SCRIPT))
    assert used_fields and used_fields <= fields, sorted(used_fields - fields)
    stats = {a["data-stat"] for _, a in page.tags if a.get("data-stat")}
    assert {"charged", "limit", "available", "outstanding", "leaseFootprint"} <= stats
    # The template holds one account's section; the script clones it.
    assert ("template", {"id": "account-template"}) in page.tags


def test_controls_are_labelled_and_the_token_never_goes_into_a_url():
    page = parsed()
    labels = {a["for"] for t, a in page.tags if t == "label" and a.get("for")}
    inputs = [a for t, a in page.tags if t == "input"]
    assert inputs and all(a["id"] in labels for a in inputs), inputs
    token = next(a for a in inputs if a["id"] == "token-input")
    assert token["type"] == "password" and "name" not in token  # never part of a form submission
    assert "sessionStorage" in dashboard.SCRIPT and "localStorage" not in dashboard.SCRIPT
    # The only URL the script writes is built from these query parameters (no token).
    assert set(re.findall(r"q\.set\(\"([^\"]+)\"", dashboard.SCRIPT)) == {"account", "queues", "interval"}
    assert dashboard.SCRIPT.count("history.replaceState") == 1 and "location.href =" not in dashboard.SCRIPT
    # Tables have column headers; the holders table is one of them.
    assert sum(1 for t, a in page.tags if t == "th" and a.get("scope") == "col") >= 20
    assert any(t == "tbody" and a.get("data-field") == "holders" for t, a in page.tags)


def test_get_slash_serves_the_page(entry):
    world = World(entry)

    async def scenario():
        front = entry.Default(None, world.env)
        resp = await front.fetch(ref._Request("http://w/"))
        assert resp.status == 200 and resp.body == dashboard.PAGE
        assert resp.headers == dashboard.HEADERS
        resp = await front.fetch(ref._Request("http://w/", "POST"))
        assert resp.status == 405 and json.loads(resp.body)["error"]["code"] == "method_not_allowed"

    run(scenario())
    assert world.env.ACCOUNT_LIMIT.objects == {}  # the page touches no object


def test_operations_routes_are_admin_only_and_reads_create_nothing(entry):
    world = World(entry)

    async def scenario():
        for method, path in (("GET", "/accounts/ghost/holders"), ("GET", "/accounts/ghost/audit"),
                             ("POST", "/accounts/ghost/holders/c1/settle")):
            status, body = await world.fetch(method, path, {"reason": "x"} if method == "POST" else None)
            assert status == 401 and body["v"] == 1, (path, body)
            status, body = await world.fetch(method, path, None, headers={"authorization": "Bearer nope"})
            assert status == 401, (path, body)
        assert await world.fetch("GET", "/accounts/ghost/holders", headers=AUTH) == (
            200, {"holders": [], "cursor": None})
        assert await world.fetch("GET", "/accounts/ghost/audit", headers=AUTH) == (200, {"records": [], "cursor": None})
        status, body = await world.fetch("POST", "/accounts/ghost/holders/c1/settle", {"reason": "gone"}, headers=AUTH)
        assert status == 404 and body["error"]["code"] == "not_found", body
        for query, field in (("limit=0", "limit"), ("limit=x", "limit"), ("limit=1001", "limit")):
            status, body = await fetch(world, "GET", f"/accounts/ghost/holders?{query}", headers=AUTH)
            assert status == 400 and body["error"]["field"] == field, (query, body)
        status, body = await fetch(world, "GET", "/accounts/ghost/audit?cursor=abc", headers=AUTH)
        assert status == 400 and body["error"]["field"] == "cursor", body

    run(scenario())
    assert world.env.ACCOUNT_LIMIT.tables("ghost") == []
    assert world.env.ACCOUNT_LIMIT.contexts["ghost"].storage.alarm is None


def test_holders_settle_and_audit_through_the_front(entry):
    world = World(entry, ACCOUNT_CONCURRENCY="1", ROUND_WAIT_MS="0", ROUND_PERIOD_MS="0", LEASES="off")  # grants

    async def scenario():
        for job_id in ("j1", "j2"):
            assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": job_id}, headers=AUTH))[0] == 201
        await queue_object(world, "a", "q").alarm()  # a round: j1 runs, j2 waits ("limit")
        status, body = await world.fetch("GET", "/accounts/a/holders", headers=AUTH)
        assert status == 200 and body["cursor"] is None and len(body["holders"]) == 1, body
        holder = body["holders"][0]
        assert holder["charged"] == 1 and [g["claimed"] for g in holder["grants"]] == [1], holder
        # its label is the queue object's name (ctx.id.name: JOB_QUEUE.getByName(["a", "q"]))
        assert holder["label"] == entry.to_json(["a", "q"]), holder
        client = holder["clientId"]
        status, body = await world.fetch("POST", f"/accounts/a/holders/{client}/settle", {}, headers=AUTH)
        assert status == 400 and body["error"]["field"] == "reason", body  # a reason is required
        status, record = await world.fetch("POST", f"/accounts/a/holders/{client}/settle",
                                           {"reason": "host lost", "actor": "ops"}, headers=AUTH)
        assert status == 200, record
        assert (record["clientId"], record["reason"], record["actor"], record["grantPermits"]) == (
            client, "host lost", "ops", 1), record
        assert (await world.fetch("GET", "/accounts/a/usage"))[1]["charged"] == 0
        status, body = await world.fetch("GET", "/accounts/a/audit", headers=AUTH)
        assert status == 200 and body["records"] == [record], body
        status, body = await fetch(world, "GET", "/accounts/a/audit?limit=1&cursor=1", headers=AUTH)
        assert status == 200 and body["records"] == [], body

    run(scenario())


# ------------------------------------------------------------ the page's script, run in Node
class Tree(HTMLParser):
    """The page's markup as a tree of ``{"tag", "attrs", "text", "children"}`` (for the fake DOM)."""

    VOID = {"input", "meta", "link", "br", "img", "hr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root: dict = {"tag": "body", "attrs": {}, "text": "", "children": []}
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        node = {"tag": tag, "attrs": {k: v or "" for k, v in attrs}, "text": "", "children": []}
        self.stack[-1]["children"].append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        if tag not in self.VOID and len(self.stack) > 1:
            self.stack.pop()

    def handle_data(self, data):
        if data.strip():
            self.stack[-1]["children"].append({"tag": "#text", "attrs": {}, "text": data, "children": []})


#: Runs the page's script (``SCRIPT``) in a ``vm`` context over a minimal DOM built from the page's
#: own markup (``BODY``), with ``fetch`` answering the public routes, polls it twice, then submits
#: the view form with ``keep`` accounts; prints what the page shows (JSON).
NODE_PAGE = r"""
const vm = require("vm");
const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
class El {
  constructor(tag, attrs, text) {
    this.tagName = tag; this.attrs = new Map(Object.entries(attrs || {})); this.children = [];
    this.parent = null; this.own = text || ""; this.style = {}; this.value = ""; this.hidden = false;
    this.clientWidth = 800; this.listeners = new Map(); this.content = null;
    const cls = new Set();
    this.classList = {add: (c) => cls.add(c), remove: (c) => cls.delete(c),
      toggle: (c, on) => { if (on === undefined ? !cls.has(c) : on) { cls.add(c); } else { cls.delete(c); } }};
  }
  setAttribute(k, v) { this.attrs.set(k, String(v)); }
  getAttribute(k) { return this.attrs.has(k) ? this.attrs.get(k) : null; }
  appendChild(c) {
    if (!(c instanceof El)) { throw new TypeError("appendChild: not a node: " + c); }
    if (c.parent) { c.parent.removeChild(c); }
    c.parent = this; this.children.push(c); return c;
  }
  removeChild(c) { this.children.splice(this.children.indexOf(c), 1); c.parent = null; return c; }
  remove() { if (this.parent) { this.parent.removeChild(this); } }
  get firstChild() { return this.children[0] || null; }
  get firstElementChild() { return this.children.find((c) => c.tagName !== "#text") || null; }
  get textContent() { return this.own + this.children.map((c) => c.textContent).join(""); }
  set textContent(t) { this.children = []; this.own = String(t); }
  addEventListener(type, fn) { this.listeners.set(type, fn); }
  all(pred, out) {
    for (const c of this.children) { if (pred(c)) { out.push(c); } c.all(pred, out); }
    return out;
  }
  querySelector(sel) {
    const m = /^\[([\w-]+)="?([^"\]]*)"?\]$/.exec(sel);
    if (!m) { throw new Error("fake DOM: unsupported selector " + sel); }
    return this.all((c) => c.getAttribute(m[1]) === m[2], [])[0] || null;
  }
  cloneNode() {
    const copy = new El(this.tagName, Object.fromEntries(this.attrs), this.own);
    this.children.forEach((c) => copy.appendChild(c.cloneNode()));
    return copy;
  }
  showModal() {} close() {} focus() {}
}
function build(node) {
  const el = new El(node.tag, node.attrs, node.text);
  const kids = node.children.map(build);
  if (node.tag === "template") { el.content = new El("#fragment"); kids.forEach((k) => el.content.appendChild(k)); }
  else { kids.forEach((k) => el.appendChild(k)); }
  return el;
}
const body = build(input.body);
const byId = (id) => body.all((c) => c.getAttribute("id") === id, [])[0] || null;
const document = {title: "", getElementById: byId, createElement: (t) => new El(t),
  createElementNS: (ns, t) => new El(t), createTextNode: (t) => new El("#text", {}, t)};
const usage = {limit: 3, outstanding: 1, leaseFootprint: 0, liveLeases: 0, retiredLeases: 0, charged: 1,
  available: 2, defaultLimit: 3, limitOverride: null, groups: JSON.parse(
  '{"default": {"charged": 1, "limit": null, "available": 2, "leaseFootprint": 0},' +
  ' "__proto__": {"charged": 0, "limit": 1, "available": 1}, "constructor": {"charged": 0, "limit": 2, "available": 2}}')};
const requested = [];
async function fetch(url) {
  requested.push(url);
  const parts = url.split("/").map(decodeURIComponent);
  if (url.endsWith("/holders")) { return {status: 200, json: async () => JSON.parse(JSON.stringify(input.holders))}; }
  if (url.endsWith("/audit")) { return {status: 200, json: async () => ({records: [], cursor: null})}; }
  const data = url.endsWith("/usage") ? usage : {account: parts[2], queue: parts[4], jobs: [
    {id: "j1", group: "default", state: "running", blocked: null},
    {id: "j2", group: "default", state: "queued", blocked: {reason: "limit", waiting: 1, at: 1}}]};
  return {status: 200, json: async () => JSON.parse(JSON.stringify(data))};
}
let pending = null;
const store = new Map(input.token ? [[input.tokenKey, input.token]] : []);
const context = vm.createContext({document, fetch, URLSearchParams, console,
  location: {search: input.search, pathname: "/"}, history: {replaceState() {}},
  sessionStorage: {getItem: (k) => store.has(k) ? store.get(k) : null, setItem: (k, v) => store.set(k, v),
    removeItem: (k) => store.delete(k), get length() { return store.size; }},
  setTimeout: (fn) => { pending = fn; return 1; }, clearTimeout: () => {}});
const settle = () => new Promise((r) => setTimeout(r, 20));
function shown() {
  return {status: byId("status").textContent,
    sections: byId("accounts").children.filter((c) => c.getAttribute("data-account") !== null).map((c) => ({
      account: c.getAttribute("data-account"), samples: c.getAttribute("data-samples"),
      title: c.querySelector('[data-field="account"]').textContent,
      error: c.querySelector('[data-field="error"]').textContent,
      groups: c.querySelector('[data-field="groups"]').children.map((tr) => [tr.getAttribute("data-group"),
        tr.querySelector('[data-field="limit"]').textContent]),
      blocked: c.all((n) => n.getAttribute("data-reason") !== null, []).map((n) => n.textContent),
      holders: c.all((n) => n.getAttribute("data-client") !== null, []).map((tr) => [
        tr.querySelector('[data-field="clientId"]').textContent, tr.querySelector('[data-field="label"]').textContent,
        tr.querySelector('[data-action="settle"]').getAttribute("aria-label")])}))};
}
(async () => {
  const out = {};
  try {
    vm.runInContext(input.script, context);
    await settle();
    pending(); await settle();  // the second poll
    out.polled = shown();
    byId("accounts-input").value = input.keep;
    byId("view-form").listeners.get("submit")({preventDefault() {}});
    await settle();
    out.kept = shown();
  } catch (e) {
    out.error = String(e && e.stack || e);
  }
  out.requested = requested;
  process.stdout.write(JSON.stringify(out));
})();
"""


def run_page(search: str, keep: str, *, token: str | None = None, holders: dict | None = None) -> dict:
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on PATH (scripts/setup installs it; tier 2 needs it too)")
    tree = Tree()
    tree.feed(dashboard.BODY)
    tree.close()
    proc = subprocess.run([node, "-e", NODE_PAGE], input=json.dumps(
        {"script": dashboard.SCRIPT, "body": tree.root, "search": search, "keep": keep, "token": token,
         "tokenKey": TOKEN_KEY, "holders": holders}),
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_account_names_that_are_object_prototype_keys_render_and_refresh():
    # Issue 21 (10): the page kept its per-account views in a plain object keyed by account
    # name, so "constructor", "toString" or "__proto__" found Object.prototype's members there:
    # the page's start threw a TypeError and every refresh failed. The page's real script runs
    # over a DOM built from its real markup; every account gets its own section and both polls.
    names = ["constructor", "toString", "__proto__", "hasOwnProperty", "acme"]
    shown = run_page("?account=" + ",".join(names) + "&queues=valueOf", "toString, acme")
    assert "error" not in shown, shown.get("error")
    polled = shown["polled"]
    assert polled["status"].startswith("Updated"), polled["status"]
    assert [(s["account"], s["title"], s["samples"], s["error"]) for s in polled["sections"]] == [
        (name, name, "2", "") for name in names], polled
    # Group names are anyone's too (rows in name order, each with its own limit).
    assert all(s["groups"] == [["__proto__", "1"], ["constructor", "2"], ["default", "-"]] for s in polled["sections"]), polled
    # The queue named "valueOf" is read, and its waiting job shown with the reason's text.
    for section in polled["sections"]:
        [row] = section["blocked"]
        assert row.startswith("valueOfdefaultlimit") and "account limit reached" in row, section
    assert {u for u in shown["requested"] if u.endswith("/usage")} == {f"/accounts/{quote(n, safe='')}/usage" for n in names}
    # The view form keeps the named accounts' sections and drops the others.
    assert [s["account"] for s in shown["kept"]["sections"]] == ["toString", "acme"], shown["kept"]


def test_the_holders_table_shows_each_clients_label_beside_its_id():
    # The operator's view: GET .../holders lists a readable label (the client object's name by
    # default) beside the 64-hex id; the page shows it in the row, "-" for a client without one,
    # and names it on the row's "Force settle" button.
    hexid = "a" * 64
    holders = {"holders": [
        {"clientId": hexid, "label": '["acme","exports"]', "lastReportAt": 1, "charged": 1, "grants": [], "leases": []},
        {"clientId": "b" * 64, "label": None, "lastReportAt": 1, "charged": 0, "grants": [], "leases": []}],
        "cursor": None}
    shown = run_page("?account=acme", "acme", token="t0ken", holders=holders)
    assert "error" not in shown, shown.get("error")
    [section] = shown["polled"]["sections"]
    assert section["holders"] == [
        [hexid, '["acme","exports"]', f'Force settle {hexid} (["acme","exports"])'],
        ["b" * 64, "-", "Force settle " + "b" * 64]], section
