"""The holder (src/entry.py's AccountLimit over semaphore.DurabilitySemaphore) inside Pyodide,
through the real `workers` SDK ctx/env and RPC stand-ins.

Every message and reply crosses a structuredClone boundary and the SDK's python_to_rpc /
python_from_rpc conversions, as between two Durable Objects in production.
"""

import asyncio
import json

from pyodide.ffi import JsException
from standins import Runtime
from workers import DurableObject
from workers.rpc import JsDict

from entry import AccountLimit
from semaphore import (
    DurabilityScheduler,
    DurabilitySemaphore,
    InvalidMessageError,
    RoundFailedError,
    error_from_reply,
)

FAST = {"ROUND_WAIT_MS": "20", "ROUND_PERIOD_MS": "0", "GRANT_TIMEOUT_MS": "10000",
        "ACCOUNT_CONCURRENCY": "5", "LEASES": "off"}  # grants: the holder rules over RPC


def request(client, demand, grants=(), leases=None):
    msg = {"type": "request", "v": 1, "clientId": client,
           "demand": [{"group": g, "count": c, "oldestAt": t} for g, c, t in demand],
           "grants": [{"grantId": i, "claimed": c, "released": r} for i, c, r in grants]}
    if leases is not None:
        msg["leases"] = leases
    return msg


def sync(client, grants):
    return {"type": "sync", "v": 1, "clientId": client,
            "grants": [{"grantId": i, "claimed": c, "released": r} for i, c, r in grants]}


class Client(DurableObject):
    """A client object that talks to the holder by RPC from inside its own handler."""

    async def ask(self, account, message):
        return await self.env.ACCOUNT_LIMIT.getByName(account).permits(message)


def runtime(**kw):
    return Runtime({"ACCOUNT_LIMIT": AccountLimit, "CLIENT": Client}, vars=FAST, **kw)


def holder_rows(rt, account, table="durability_semaphore_grants"):
    return rt.sql("ACCOUNT_LIMIT", account, f"SELECT * FROM {table} ORDER BY rowid")


async def test_request_round_trip_between_objects_has_python_types():
    rt = runtime(auto_alarms=False)
    now = rt.now()
    reply = await rt.stub("CLIENT", "c1").ask("acct", request("c1", [("g", 3, now)]))
    assert type(reply) is JsDict and reply.v == 1
    (grant,) = reply.grants
    assert type(grant) is JsDict
    assert grant.group == "g" and grant.permits == 3 and grant.status == "active"
    for key in ("permits", "claimed", "released", "claimBy"):
        assert type(grant[key]) is int, (key, type(grant[key]))
    assert type(reply.nextRequestAt) is int and reply.contended is False
    assert reply.blocked == [] and reply.leases == []
    # Durable: the grant row is in the holder's SQLite, and the alarm follows claimBy (R16).
    (row,) = holder_rows(rt, "acct")
    assert row["grant_id"] == grant.grantId and row["permits"] == 3
    assert rt.get_alarm("ACCOUNT_LIMIT", "acct") == grant.claimBy


async def test_one_round_serves_concurrent_clients_up_to_the_limit():
    rt = runtime(auto_alarms=False)
    now = rt.now()
    replies = await asyncio.gather(
        rt.stub("CLIENT", "a").ask("acct", request("a", [("g", 4, now - 10)])),
        rt.stub("CLIENT", "b").ask("acct", request("b", [("g", 4, now)])),
    )
    granted = {r.grants[0].permits if r.grants else 0 for r in replies}
    assert granted == {4, 1}                       # limit 5, oldest first (R21)
    assert all(r.contended for r in replies)        # need left unserved (R29)
    assert replies[1].blocked[0].reason == "limit" and replies[1].blocked[0].waiting == 3
    usage = await rt.stub("ACCOUNT_LIMIT", "acct").usage()
    assert usage.limit == 5 and usage.outstanding == 5


async def test_sync_confirms_claims_and_release_settles():
    rt = runtime(auto_alarms=False)
    holder = rt.stub("ACCOUNT_LIMIT", "acct")
    reply = await holder.permits(request("c", [("g", 2, rt.now())]))
    gid = reply.grants[0].grantId
    confirmed = await holder.permits(sync("c", [(gid, 2, 0)]))
    assert confirmed.grants[0].claimed == 2 and confirmed.grants[0].status == "active"
    assert rt.get_alarm("ACCOUNT_LIMIT", "acct") is None      # nothing unclaimed: no reclaim
    settled = await holder.permits(sync("c", [(gid, 2, 2)]))
    assert settled.grants[0].released == 2
    assert holder_rows(rt, "acct") == []                        # settled grants are deleted (R17)
    # A stale, lower report changes nothing and cannot return capacity twice (R13, I2).
    again = await holder.permits(sync("c", [(gid, 1, 0)]))
    assert again.grants[0].status == "not_found"
    assert (await holder.usage()).outstanding == 0


async def test_alarm_reclaims_unclaimed_permits_after_claim_by():
    rt = runtime(auto_alarms=False)
    holder = rt.stub("ACCOUNT_LIMIT", "acct")
    reply = await holder.permits(request("c", [("g", 3, rt.now())]))
    grant = reply.grants[0]
    await holder.permits(sync("c", [(grant.grantId, 1, 0)]))   # claim 1 of 3
    assert (await rt.fire_alarm("ACCOUNT_LIMIT", "acct"))["fired"] is False   # not due yet
    rt.advance(10_001)
    fired = await rt.fire_alarm("ACCOUNT_LIMIT", "acct")
    assert fired == {"fired": True, "error": None, "retryScheduled": False}
    (row,) = holder_rows(rt, "acct")
    assert row["permits"] == 1 and row["claimed"] == 1       # shrunk to the claimed count (R15)
    assert rt.get_alarm("ACCOUNT_LIMIT", "acct") is None       # nothing left to reclaim
    late = await holder.permits(sync("c", [(grant.grantId, 3, 0)]))
    assert late.grants[0].status == "expired" and late.grants[0].claimed == 1


async def test_alarm_reclaim_survives_eviction():
    rt = runtime(auto_alarms=False)
    holder = rt.stub("ACCOUNT_LIMIT", "acct")
    await holder.permits(request("c", [("g", 2, rt.now())]))
    rt.evict("ACCOUNT_LIMIT", "acct")       # a fresh instance must find the timer in SQLite
    rt.advance(10_001)
    assert (await rt.fire_alarm("ACCOUNT_LIMIT", "acct"))["error"] is None
    assert holder_rows(rt, "acct") == []
    assert (await holder.usage()).outstanding == 0


async def test_invalid_messages_come_back_as_error_values_and_write_nothing():
    rt = runtime(auto_alarms=False)
    holder = rt.stub("ACCOUNT_LIMIT", "acct")
    bad = [
        ({"type": "request", "v": 2, "clientId": "c", "demand": [], "grants": []}, "v"),
        (request("c", [("g", -1, 0)]), "demand[0].count"),
        (request("c", [("g", 1.5, 0)]), "demand[0].count"),
        (request("c", [("g", True, 0)]), "demand[0].count"),
        (request("c", [("g", 1, 0), ("g", 1, 0)]), "demand[1].group"),
        ("not a dict", ""),
        ([1, 2], ""),
    ]
    for message, field in bad:
        reply = await holder.permits(message)
        if isinstance(message, str):  # taken as JSON text (R7 "JSON text"): answered as text
            assert isinstance(reply, str), reply
            value = json.loads(reply)
            assert value["error"]["code"] == "invalid_message" and value["error"]["field"] == "", value
            assert isinstance(error_from_reply(value), InvalidMessageError)
            continue
        assert type(reply) is JsDict and reply.v == 1, reply
        assert reply.error.code == "invalid_message", reply
        if field:
            assert reply.error.field == field, (field, reply)
        # The client side turns the error value back into a typed exception.
        exc = error_from_reply(reply)
        assert isinstance(exc, InvalidMessageError)
    # Nothing at all was written: not even the schema (I5).
    assert rt.sql("ACCOUNT_LIMIT", "acct", "SELECT name FROM sqlite_master") == []


async def test_limit_override_rpc_values():
    rt = runtime(auto_alarms=False)
    holder = rt.stub("ACCOUNT_LIMIT", "acct")
    assert (await holder.set_limit(2)).limit == 2
    assert (await holder.usage()).limitOverride == 2
    for bad in (True, -1, "3", 1.5):
        reply = await holder.set_limit(bad)
        assert reply.error.code == "invalid_limit", (bad, reply)
    cleared = await holder.set_limit(None)       # None travels as null and back as None
    assert cleared.override is None and cleared.limit == 5


class FailingIds(DurableObject):
    """A holder whose id factory fails inside the round transaction (after reports applied)."""

    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.scheduler = DurabilityScheduler(ctx)
        self.fail = False
        self.semaphore = DurabilitySemaphore(
            scheduler=self.scheduler, limit=5, round_wait_ms=10, round_period_ms=0,
            id_factory=self._new_id)
        self._n = 0

    def _new_id(self):
        if self.fail:
            raise RuntimeError("id source broken")
        self._n += 1
        return f"id-{self._n}"

    async def permits(self, message):
        return await self.semaphore.handle(message)

    def break_ids(self):
        self.fail = True

    async def alarm(self, info=None):
        await self.scheduler.alarm(info)


async def test_failed_round_transaction_rolls_back_everything():
    rt = Runtime({"H": FailingIds}, auto_alarms=False)
    holder = rt.stub("H", "h")
    first = await holder.permits(request("c", [("g", 2, rt.now())]))
    gid = first.grants[0].grantId
    await holder.break_ids()
    # This round applies a claim report AND needs a new grant id: the id factory raises inside
    # transactionSync, so the report must be rolled back too (R2).
    reply = await holder.permits(request("c", [("g", 4, rt.now())], grants=[(gid, 2, 0)]))
    assert reply.error.code == "round_failed" and "id source broken" in reply.error.message
    assert isinstance(error_from_reply(reply), RoundFailedError)
    (row,) = rt.sql("H", "h", "SELECT claimed, permits FROM durability_semaphore_grants")
    assert row == {"claimed": 0, "permits": 2}


async def test_holder_exception_reaches_caller_as_js_error():
    rt = runtime(auto_alarms=False)
    try:
        await rt.stub("ACCOUNT_LIMIT", "acct").permits()     # missing argument: TypeError in Python
    except JsException as exc:
        assert exc.name == "Error" and "TypeError" in str(exc) and "permits()" in str(exc)
    else:
        raise AssertionError("should raise")


async def test_text_nested_past_any_limit_is_refused_before_it_is_parsed():
    # SPEC R7 "JSON text": in Pyodide json.loads of a deep enough text overflows the WebAssembly
    # stack (a fatal error of the whole isolate); the holder reads its depth first and refuses it.
    rt = runtime(auto_alarms=False)
    holder = rt.stub("ACCOUNT_LIMIT", "acct")
    reply = json.loads(await holder.permits("[" * 200_000 + "]" * 200_000))
    assert reply["error"]["code"] == "invalid_message" and reply["error"]["field"] == "", reply
    assert "deeper than 64" in reply["error"]["message"], reply
    alive = json.loads(await holder.permits('{"type": "sync", "v": 1, "clientId": "c", "grants": []}'))
    assert alive["v"] == 1 and alive["grants"] == [], alive  # the isolate lives on
