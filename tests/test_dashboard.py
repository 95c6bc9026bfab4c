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
A browser test of the page is tests/workerd/test_dashboard.py (tier 3).
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import json
import re
import sys
import types
from html.parser import HTMLParser

import pytest

import dashboard
import test_reference_worker as ref
from test_reference_worker import AUTH, World, queue_object, run

SVG_NS = "http://www.w3.org/2000/svg"


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
    world = World(entry, ACCOUNT_CONCURRENCY="1", ROUND_WAIT_MS="0", ROUND_PERIOD_MS="0")

    async def scenario():
        for job_id in ("j1", "j2"):
            assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": job_id}, headers=AUTH))[0] == 201
        await queue_object(world, "a", "q").alarm()  # a round: j1 runs, j2 waits ("limit")
        status, body = await world.fetch("GET", "/accounts/a/holders", headers=AUTH)
        assert status == 200 and body["cursor"] is None and len(body["holders"]) == 1, body
        holder = body["holders"][0]
        assert holder["charged"] == 1 and [g["claimed"] for g in holder["grants"]] == [1], holder
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
