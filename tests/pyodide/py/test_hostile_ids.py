"""Hostile ids and shapes (SPEC R7, fault 8) inside Pyodide, through the real SDK and RPC stand-ins.

JavaScript strings are UTF-16 and may hold what storage cannot: the conversions on the way
(structuredClone, the SDK's python_from_rpc, Pyodide's str conversion) keep NUL and lone
surrogates intact, so the holder must refuse them itself (they used to be accepted here too):

* a NUL in a client id or a group: SQLite's JSON functions may cut it (CPython's SQLite does:
  ``"a\\x00evil"`` stored as ``"a"``, ``"bulk\\x00x"`` escaping bulk's limit while charging it);
* a lone surrogate: CPython cannot bind it (the round of every client failed), and the
  JavaScript SQLite binding stores U+FFFD instead (``"b\\ud800"`` and ``"b\\udfff"`` collide);
* nesting: a message handed to ``handle()`` as a JavaScript proxy is read one level per field
  (never fully converted), so any depth in an unknown key is ignored. Through RPC the SDK's own
  ``python_from_rpc`` converts the whole argument first, recursively: past ~450 levels it raises
  before the holder runs (an SDK limit); the caller gets an exception, nothing is written and
  other clients are unaffected.
"""

import asyncio

from pyodide.code import run_js
from pyodide.ffi import JsException
from standins import Runtime
from workers import DurableObject

from semaphore import DurabilityScheduler, DurabilitySemaphore, InvalidMessageError, error_from_reply

GRANTS = "durability_semaphore_grants"


class Holder(DurableObject):
    """A holder with a group limit (bulk: 1) and leases, answering over RPC."""

    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.scheduler = DurabilityScheduler(ctx)
        self.semaphore = DurabilitySemaphore(
            scheduler=self.scheduler, limit=6, group_limit={"bulk": 1}, round_wait_ms=20,
            round_period_ms=0, leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 2})

    async def permits(self, message):
        return await self.semaphore.handle(message)

    async def alarm(self, info=None):
        await self.scheduler.alarm(info)


class Client(DurableObject):
    """A client object: its messages cross two RPC boundaries, as in production."""

    async def ask(self, message):
        return await self.env.HOLDER.getByName("h").permits(message)


def runtime():
    return Runtime({"HOLDER": Holder, "CLIENT": Client}, auto_alarms=False)


def request(client, demand, grants=(), leases=None):
    msg = {"type": "request", "v": 1, "clientId": client,
           "demand": [{"group": g, "count": c, "oldestAt": 0} for g, c in demand],
           "grants": [{"grantId": i, "claimed": c, "released": r} for i, c, r in grants]}
    if leases is not None:
        msg["leases"] = [{"leaseId": i, "drawn": d, "released": r, "stopped": False} for i, d, r in leases]
    return msg


def js_message(source):
    """A message built in JavaScript (its strings never were Python strings)."""
    return run_js(f"({source})")


def assert_invalid(reply, field):
    assert "error" in reply, (field, dict(reply))
    assert reply.error.code == "invalid_message" and reply.error.field == field, (field, dict(reply.error))
    exc = error_from_reply(reply)
    assert isinstance(exc, InvalidMessageError) and exc.field == field


def grant_rows(rt):
    return rt.sql("HOLDER", "h", f"SELECT client_id, group_name, permits FROM {GRANTS} ORDER BY rowid")


async def test_nul_client_id_cannot_take_another_clients_grant():
    rt = runtime()
    a = rt.stub("CLIENT", "a")
    evil = rt.stub("CLIENT", "evil")
    mine, theirs, js_made = await asyncio.gather(
        a.ask(request("a", [("g", 2)])),
        evil.ask(request("a\x00evil", [("g", 3)])),
        evil.ask(js_message("{type: 'request', v: 1, clientId: 'a\\u0000js', demand: [{group: 'g', count: 1,"
                            " oldestAt: 0}], grants: []}")),
    )
    assert_invalid(theirs, "clientId")
    assert_invalid(js_made, "clientId")
    assert "error" not in mine and [g.permits for g in mine.grants] == [2]
    assert [dict(r) for r in grant_rows(rt)] == [{"client_id": "a", "group_name": "g", "permits": 2}]
    # Every control character (C0, DEL, C1), as JS built it, in any id field.
    for code in (0x01, 0x0A, 0x1F, 0x7F, 0x85, 0x9F):
        for source, field in (
            (f"clientId: 'c\\u{code:04x}', demand: [], grants: []", "clientId"),
            (f"clientId: 'c', demand: [{{group: 'g\\u{code:04x}', count: 1, oldestAt: 0}}], grants: []",
             "demand[0].group"),
            (f"clientId: 'c', demand: [], grants: [{{grantId: '\\u{code:04x}', claimed: 0, released: 0}}]",
             "grants[0].grantId"),
        ):
            assert_invalid(await evil.ask(js_message(f"{{type: 'request', v: 1, {source}}}")), field)
    assert len(grant_rows(rt)) == 1


async def test_nul_group_cannot_escape_its_group_limit():
    rt = runtime()
    x, y = rt.stub("CLIENT", "x"), rt.stub("CLIENT", "y")
    first = await x.ask(request("x", [("bulk", 1)]))
    assert [g.permits for g in first.grants] == [1]
    again, hostile = await asyncio.gather(
        x.ask(request("x", [("bulk", 1)])),
        y.ask(request("y", [("bulk\x00x", 5)])),
    )
    assert_invalid(hostile, "demand[0].group")
    assert "error" not in again
    usage = await (await rt.instance("HOLDER", "h")).semaphore.usage()
    assert list(usage["groups"]) == ["bulk"] and usage["groups"]["bulk"]["outstanding"] == 1
    assert {(r["client_id"], r["group_name"]) for r in grant_rows(rt)} == {("x", "bulk")}


async def test_lone_surrogates_do_not_fail_the_round_of_other_clients():
    rt = runtime()
    good = rt.stub("CLIENT", "good")
    bad = rt.stub("CLIENT", "bad")
    seed = await good.ask(request("good", [("g", 1)], leases=[]))
    assert "error" not in seed
    hostile = [
        (request("b\ud800", [("g", 1)]), "clientId"),
        (request("b", [("\udfff", 1)]), "demand[0].group"),
        (request("b", [("g", 1)], grants=[("gr\udbff", 0, 0)]), "grants[0].grantId"),
        (request("b", [("g", 1)], leases=[("\ud83d", 0, 0)]), "leases[0].leaseId"),
        (js_message("{type: 'sync', v: 1, clientId: 's\\uD800', grants: []}"), "clientId"),
        (js_message("{type: 'request', v: 1, clientId: 'b', demand: [{group: 'x\\uDC00y', count: 2,"
                    " oldestAt: 0}], grants: []}"), "demand[0].group"),
    ]
    replies = await asyncio.gather(
        good.ask(request("good", [("g", 3)], leases=[])),
        *(bad.ask(message) for message, _ in hostile),
    )
    served, *refused = replies
    assert "error" not in served, dict(served)                # not round_failed (R2)
    assert sum(g.permits for g in served.grants) + sum(x.permits for x in served.leases) >= 3
    for reply, (_, field) in zip(refused, hostile):
        assert_invalid(reply, field)
    assert {r["client_id"] for r in grant_rows(rt)} == {"good"}


async def test_valid_exotic_ids_round_trip_exactly():
    rt = runtime()
    c = rt.stub("CLIENT", "c")
    for ident in ("\U0001f600" * 256, "e\u0301", "\u00e9", "line\u2028sep", "\ufeff\u00a0\u200b", "k" * 256):
        reply = await c.ask(request(ident, [(ident, 1)]))
        assert "error" not in reply, (ascii(ident), dict(reply))
        assert [g.group for g in reply.grants] == [ident]
    rows = grant_rows(rt)
    assert [(r["client_id"], r["group_name"]) for r in rows] == [(r["group_name"], r["group_name"]) for r in rows]
    assert len({r["group_name"] for r in rows}) == 6     # NFC and NFD spellings stay distinct


async def test_deep_nesting_in_a_js_proxy_message_handed_to_handle():
    # handle() given a JavaScript object (no SDK conversion): read one level per field, so
    # 20,000 levels in an unknown key are ignored and deep known fields are refused.
    rt = runtime()
    holder = await rt.instance("HOLDER", "h")

    def deep(depth, inner):
        return run_js(f"(() => {{ let v = {{}}; for (let i = 0; i < {depth}; i++) v = {{k: [v]}};"
                      f" return {inner}; }})()")

    reply = await holder.semaphore.handle(
        deep(20_000, "{type: 'sync', v: 1, clientId: 'a', grants: [], trace: v}"))
    assert "error" not in reply and reply["grants"] == [], reply
    for inner, field in (
        ("[[v]]", ""),
        ("{type: 'sync', v: 1, clientId: v, grants: []}", "clientId"),
        ("{type: v, v: 1, clientId: 'a', grants: []}", "type"),
        ("{type: 'request', v: 1, clientId: 'a', demand: [[v]], grants: []}", "demand[0]"),
        ("{type: 'sync', v: 1, clientId: 'a', grants: [{grantId: 'x', claimed: v, released: 0}]}",
         "grants[0].claimed"),
    ):
        reply = await holder.semaphore.handle(deep(20_000, inner))
        assert set(reply) == {"v", "error"} and reply["v"] == 1, reply
        assert reply["error"]["code"] == "invalid_message" and reply["error"]["field"] == field, reply
    assert grant_rows(rt) == []  # (the valid sync created the schema; nothing else was written)


async def test_deep_nesting_through_rpc():
    # Through RPC the SDK converts the whole argument (python_from_rpc) before the holder runs.
    # Within its reach, deep unknown keys are ignored; beyond it the call fails in the SDK (or in
    # structuredClone), the caller gets an exception, nothing is written, others are served.
    rt = runtime()
    c = rt.stub("CLIENT", "c")
    plain = await c.ask(request("c", [("g", 1)]))
    assert "error" not in plain

    def deep(depth):
        return run_js(f"(() => {{ let v = {{}}; for (let i = 0; i < {depth}; i++) v = {{k: [v]}};"
                      f" return {{type: 'sync', v: 1, clientId: 'c', grants: [], trace: v}}; }})()")

    reply = await c.ask(deep(300))
    assert "error" not in reply and [g.grantId for g in reply.grants] == [g.grantId for g in plain.grants]
    before = grant_rows(rt)
    other = rt.stub("CLIENT", "other")
    for depth in (600, 5000):
        served, failed = await asyncio.gather(
            other.ask(request("other", [("g", 1)])),
            c.ask(deep(depth)),
            return_exceptions=True,
        )
        assert not isinstance(served, BaseException) and "error" not in served
        if isinstance(failed, BaseException):
            assert isinstance(failed, JsException), repr(failed)
        else:
            assert "error" not in failed or failed.error.code == "invalid_message", dict(failed)
    rows = grant_rows(rt)
    assert [r for r in rows if r["client_id"] == "c"] == [r for r in before if r["client_id"] == "c"]
