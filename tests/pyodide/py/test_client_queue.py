"""SemaphoreClient, SemaphoreQueue and the RPC client helper inside Pyodide, through the real SDK.

A client Durable Object (``CLIENT`` / ``QUEUE``) reaches the holder bound as ``ACCOUNT_LIMIT``
with ``DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke=...)``: the message dict is
``structuredClone``d by the stand-in RPC, arrives at the holder as ``JsDict``, the reply comes back
as ``JsDict`` (or a JS ``Error`` when the holder raises), and the client turns it into typed
objects and exceptions. Client state lives in the client object's own SQLite
(``durability_semaphore_client_*``), whose rows are read back as ``JsDict``.
"""

import asyncio
import json
import time

from standins import Runtime, settle_queue
from workers import DurableObject
from workers.rpc import JsDict

from entry import AccountLimit
from semaphore import (
    ConfigurationError,
    Demand,
    DurabilityScheduler,
    DurabilitySemaphore,
    HolderUnavailableError,
    InvalidMessageError,
    ItemState,
    PermitKind,
    PermitResponse,
    SemaphoreClient,
    SemaphoreQueue,
    SemaphoreTimeoutError,
    timeout,
)
from semaphore.rpc import get_by_name
from semaphore.runtime import Storage

KEY = "acct"
FAST = {"ROUND_WAIT_MS": "10", "ROUND_PERIOD_MS": "50", "GRANT_TIMEOUT_MS": "10000",
        "ACCOUNT_CONCURRENCY": "3", "LEASES": "off"}  # AccountLimit issues grants (the leases: LeaseHolder)
RELEASE_REPORT_MS = 10_000
LEASES = {"provisioning": {"mode": "strict"}, "permitsPerLease": 3, "ttlMs": 20_000}

#: The client helper exactly as an application writes it (SPEC R36).
HELPER = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke=lambda stub, message: stub.permits(message))


def raised(exc):
    return {"type": type(exc).__name__, "field": exc.field, "code": exc.code, "message": str(exc),
            "cause": type(exc.__cause__).__name__ if exc.__cause__ is not None else None}


class Client(DurableObject):
    """A client object: a SemaphoreClient over the helper, with an RPC timeout that only tells a
    hang from a loaded machine (:class:`QuickClient`: a short one, for the timeout tests)."""

    TIMEOUT_MS = 30_000

    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.client = SemaphoreClient(ctx, HELPER.with_(timeout(self.TIMEOUT_MS)).transport(env), recheck_ms=0)

    async def ask(self, key, count):
        """RPC: request `count` permits of group g, claim them, confirm with a sync; report types."""
        applied = await self.client.request(key, [Demand("g", int(count), int(time.time() * 1000))], force=True)
        response = applied.response
        (state,) = response.grants
        slots = self.client.claim(key, state.grant_id, int(count))
        confirmed = await self.client.sync(key)
        grant = self.client.grant(key, state.grant_id)
        return {
            "response": type(response).__name__,
            "status": type(state.status).__name__ + "." + state.status.name,
            "int_fields": all(type(getattr(state, f)) is int for f in ("permits", "claimed", "released", "claim_by")),
            "next_request_at": type(response.next_request_at).__name__,
            "slots": slots,
            "confirmed": grant.confirmed,
            "sync_status": confirmed.response.grants[0].status.value,
        }

    async def raw(self, key, message):
        """RPC: one message through the helper; a typed exception comes back described."""
        try:
            reply = await HELPER.with_(timeout(self.TIMEOUT_MS)).request(self.env, key, message)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"raised": raised(exc)}
        return {"reply": reply}


class SilentHolder(DurableObject):
    """A holder that does not answer until released (an overloaded or stuck holder)."""

    release = None

    async def permits(self, message):
        if type(self).release is None:
            type(self).release = asyncio.Event()
        await type(self).release.wait()
        return {"v": 1, "grants": [], "leases": [], "blocked": [], "contended": False,
                "nextRequestAt": 0}


class BrokenHolder(DurableObject):
    async def permits(self, message):
        sent = json.loads(message) if isinstance(message, str) else message  # the helper sends JSON text
        raise RuntimeError(f"holder crashed on a {sent['type']}")


class LeaseHolder(DurableObject):
    """A holder that issues leases (AccountLimit issues none)."""

    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.scheduler = DurabilityScheduler(ctx)
        self.semaphore = DurabilitySemaphore(scheduler=self.scheduler, limit=4, round_wait_ms=10,
                                             round_period_ms=50, leases=LEASES)

    calls = 0

    async def permits(self, message):
        type(self).calls += 1
        return await self.semaphore.handle(message)

    async def usage(self):
        return await self.semaphore.usage()

    async def alarm(self, info=None):
        await self.scheduler.alarm(info)


class Queue(DurableObject):
    """A client object running a SemaphoreQueue; its alarm drives the queue (scheduler timer)."""

    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.storage = Storage(ctx)
        self.scheduler = DurabilityScheduler(ctx)
        self.client = SemaphoreClient(ctx, HELPER.with_(timeout(30_000)).transport(env))
        self.queue = SemaphoreQueue(client=self.client, scheduler=self.scheduler, on_admit=self.on_admit)

    def on_admit(self, item):
        self.storage.exec("CREATE TABLE IF NOT EXISTS test_admitted (item_id TEXT, kind TEXT, permit TEXT)")
        self.storage.exec("INSERT INTO test_admitted VALUES (?, ?, ?)", item.item_id, item.permit.kind.value,
                          item.permit.id)

    async def enqueue(self, item_id, group="g"):
        item = await self.queue.enqueue(KEY, str(group), str(item_id), {"n": item_id})
        return item.state.value

    async def complete(self, item_id):
        return await self.queue.complete(str(item_id))

    async def alarm(self, info=None):
        await self.scheduler.alarm(info)


def states(inst):
    return {i.item_id: i.state for i in inst.queue.items()}


async def test_request_and_sync_round_trip_from_a_client_object_are_typed():
    # R5, R6, R15a: request -> grant, claim, sync -> confirmed; replies are PermitResponse
    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "CLIENT": Client}, vars=FAST, auto_alarms=False)
    out = await rt.stub("CLIENT", "c1").ask(KEY, 2)
    assert out == {"response": "PermitResponse", "status": "GrantStatus.ACTIVE", "int_fields": True,
                   "next_request_at": "int", "slots": [1, 2], "confirmed": 2, "sync_status": "active"}
    # The holder's durable copy agrees; the client's rows are in its own SQLite (R35).
    (held,) = rt.sql("ACCOUNT_LIMIT", KEY, "SELECT claimed, permits FROM durability_semaphore_grants")
    assert held == {"claimed": 2, "permits": 2}
    (mine,) = rt.sql("CLIENT", "c1", "SELECT claimed, confirmed, sent_claimed, status"
                                     " FROM durability_semaphore_client_grants")
    assert mine == {"claimed": 2, "confirmed": 2, "sent_claimed": 2, "status": "active"}
    # Rows read through the SDK-wrapped storage are JsDict, and the typed views accept them.
    c = await rt.instance("CLIENT", "c1")
    (raw,) = c.ctx.storage.sql.exec("SELECT * FROM durability_semaphore_client_grants").toArray()
    assert type(raw) is JsDict and type(raw.claimed) is int and type(raw.status) is str
    (row,) = c.client.storage.exec("SELECT * FROM durability_semaphore_client_grants")
    assert isinstance(row, dict) and row == dict(raw)
    (grant,) = c.client.grants(KEY)
    assert grant.confirmed == 2 and not grant.dirty
    # Release and sync: the holder settles and deletes the grant; the client keeps a tombstone (R17).
    assert c.client.release(KEY, grant.grant_id, 2) == 2
    applied = await c.client.sync(KEY)
    assert isinstance(applied.response, PermitResponse) and applied.dropped == [grant.grant_id]
    assert rt.sql("ACCOUNT_LIMIT", KEY, "SELECT * FROM durability_semaphore_grants") == []
    assert c.client.grants(KEY) == [] and c.client.grant(KEY, grant.grant_id).status == "gone"
    assert (await rt.stub("ACCOUNT_LIMIT", KEY).usage()).outstanding == 0


async def test_error_values_cross_rpc_and_become_typed_exceptions():
    # R7: the holder answers an error value; the helper raises it typed, with its field
    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "CLIENT": Client}, vars=FAST, auto_alarms=False)
    client = rt.stub("CLIENT", "c1")
    bad = {"type": "request", "v": 1, "clientId": "c1", "grants": [],
           "demand": [{"group": "g", "count": 1.5, "oldestAt": 0}]}
    out = await client.raw(KEY, bad)
    assert out.raised.type == "InvalidMessageError" and out.raised.field == "demand[0].count", out
    assert out.raised.code == "invalid_message" and out.raised.cause is None
    out = await client.raw(KEY, {"type": "sync", "v": 2, "clientId": "c1", "grants": []})
    assert out.raised.type == "InvalidMessageError" and out.raised.field == "v"
    # A valid sync comes back as a plain dict reply (converted from JsDict).
    out = await client.raw(KEY, {"type": "sync", "v": 1, "clientId": "c1", "grants": []})
    assert out.reply.grants == [] and out.reply.contended is False
    # SemaphoreClient raises the same typed exception (here from the caller's own task).
    c = await rt.instance("CLIENT", "c1")
    try:
        await c.client.request(KEY, [Demand("", 1, 0)], force=True)   # empty group name
    except InvalidMessageError as exc:
        assert exc.field == "demand[0].group", exc.field
    else:
        raise AssertionError("should raise InvalidMessageError")


class QuickClient(Client):
    """A client object with a 300 ms RPC timeout: for a holder that never answers."""

    TIMEOUT_MS = 300


async def test_holder_that_never_answers_times_out():
    # R36: timeout(ms) gives up with SemaphoreTimeoutError; the request is remembered as unanswered
    rt = Runtime({"ACCOUNT_LIMIT": SilentHolder, "CLIENT": QuickClient}, vars=FAST, auto_alarms=False)
    try:
        started = time.monotonic()
        out = await rt.stub("CLIENT", "c1").raw(KEY, {"type": "sync", "v": 1, "clientId": "c1", "grants": []})
        assert out.raised.type == "SemaphoreTimeoutError" and out.raised.code == "timeout", out
        assert out.raised.message == f"holder {KEY!r} did not answer within 300 ms"
        c = await rt.instance("CLIENT", "c1")
        try:
            await c.client.request(KEY, [Demand("g", 1, 0)], force=True)
        except SemaphoreTimeoutError as exc:
            assert isinstance(exc, HolderUnavailableError)     # retry-safe family
        else:
            raise AssertionError("should time out")
        elapsed = time.monotonic() - started
        # Two real 300 ms timeouts: never sooner; the upper bound only tells a timeout from a
        # hang (generous: a loaded machine runs the same steps slower).
        assert 0.55 <= elapsed < 20, elapsed
        assert c.client.needs_sync(KEY)   # the lost reply may have carried a lease: sync next (R35)
    finally:
        if SilentHolder.release is not None:
            SilentHolder.release.set()     # let the stuck calls finish before the runtime closes
            await asyncio.sleep(0)
        SilentHolder.release = None


async def test_holder_exception_reaches_the_client_as_holder_unavailable():
    # R36: an exception in the holder crosses RPC as a JS Error (type lost): HolderUnavailableError
    rt = Runtime({"ACCOUNT_LIMIT": BrokenHolder, "CLIENT": Client}, vars=FAST, auto_alarms=False)
    out = await rt.stub("CLIENT", "c1").raw(KEY, {"type": "sync", "v": 1, "clientId": "c1", "grants": []})
    assert out.raised.type == "HolderUnavailableError" and out.raised.cause == "JsException", out
    assert "RuntimeError" in out.raised.message and "holder crashed on a sync" in out.raised.message
    # A method the holder does not have: the runtime's TypeError is a misconfiguration, never
    # retried as if the holder were down (ConfigurationError naming the binding).
    rt2 = Runtime({"ACCOUNT_LIMIT": BrokenHolder, "CLIENT": Client}, vars=FAST, auto_alarms=False)
    c = await rt2.instance("CLIENT", "c1")
    wrong = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke="no_such_method")
    try:
        await wrong.request(c.env, KEY, {"type": "sync", "v": 1, "clientId": "c1", "grants": []})
    except ConfigurationError as exc:
        assert not isinstance(exc, HolderUnavailableError) and "no_such_method does not exist" in str(exc)
        assert "ACCOUNT_LIMIT" in str(exc)
    else:
        raise AssertionError("should raise")


async def test_get_by_name_on_the_sdk_wrapped_namespace():
    # R36: the helper resolves env.<binding> (the SDK's namespace wrapper) with getByName
    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "CLIENT": Client}, vars=FAST, auto_alarms=False)
    c = await rt.instance("CLIENT", "c1")
    ns = HELPER.resolve_namespace(c.env)
    assert type(ns).__name__ == "_DurableObjectNamespaceWrapper"
    stub = get_by_name(ns, "acct-x")
    usage = await stub.usage()
    assert type(usage) is JsDict and usage.limit == 3
    assert stub.id.name == "acct-x" and stub.id.toString() == ns.idFromName("acct-x").toString()

    class OldNamespace:   # a runtime without getByName: idFromName + get
        idFromName = staticmethod(ns.idFromName)
        get = staticmethod(ns.get)

    old = get_by_name(OldNamespace(), "acct-x")
    assert old.id.toString() == stub.id.toString()
    # The namespace= escape hatch with a callable env -> namespace reaches the same object.
    via = DurabilitySemaphore.client(namespace=lambda env: env.ACCOUNT_LIMIT, invoke="permits")
    reply = await via.request(c.env, "acct-x", {"type": "sync", "v": 1, "clientId": "c1", "grants": []})
    assert reply["grants"] == []
    assert rt.sql("ACCOUNT_LIMIT", "acct-x", "SELECT name FROM sqlite_master WHERE name ="
                  " 'durability_semaphore_grants'") != []


async def test_a_service_binding_or_a_var_is_not_taken_for_the_holders_namespace():
    # R36: a JS Fetcher (a service binding) answers every attribute; the binding's runtime class
    # tells it from a namespace, raw or wrapped by the SDK, when the transport is made.
    from pyodide.code import run_js
    from workers.rpc import _FetcherWrapper

    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "CLIENT": Client}, vars=FAST, auto_alarms=False)
    c = await rt.instance("CLIENT", "c1")
    fetcher = run_js("new (class Fetcher { getByName() { return null; } })()")

    class Env:
        pass

    env = Env()
    env.RAW = fetcher
    env.WRAPPED = _FetcherWrapper(fetcher)
    env.NAMESPACE = c.env.ACCOUNT_LIMIT._binding  # the raw JS namespace: accepted
    for name in ("RAW", "WRAPPED"):
        try:
            DurabilitySemaphore.client(binding=name, invoke="permits").transport(env)
        except ConfigurationError as exc:
            assert exc.field == "binding" and "not a Durable Object namespace" in str(exc), exc
        else:
            raise AssertionError(f"{name}: a Fetcher was taken for a namespace")
    DurabilitySemaphore.client(binding="NAMESPACE", invoke="permits").transport(env)
    DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke="permits").transport(c.env)  # the SDK's wrapper


async def test_client_state_survives_eviction_of_the_client_object():
    # R35: grants, local claims and nextRequestAt live in the client's SQLite
    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "CLIENT": Client}, vars=FAST, auto_alarms=False)
    c = await rt.instance("CLIENT", "c1")
    applied = await c.client.request(KEY, [Demand("g", 3, 0)], force=True)
    gid = applied.response.grants[0].grant_id
    assert c.client.claim(KEY, gid, 1) == [1]          # local only, not yet reported
    not_before = c.client.not_before(KEY)
    rt.evict("CLIENT", "c1")
    fresh = await rt.instance("CLIENT", "c1")
    assert fresh is not c
    (g,) = fresh.client.grants(KEY)
    assert (g.grant_id, g.claimed, g.confirmed, g.dirty) == (gid, 1, 0, True)
    assert fresh.client.not_before(KEY) == not_before and fresh.client.keys() == [KEY]
    assert fresh.client.claim(KEY, gid, 5) == [2, 3]    # slots continue after the eviction
    await fresh.client.sync(KEY)
    (g,) = fresh.client.grants(KEY)
    assert g.confirmed == 3 and not g.dirty
    (held,) = rt.sql("ACCOUNT_LIMIT", KEY, "SELECT claimed FROM durability_semaphore_grants")
    assert held == {"claimed": 3}
    tables = {r["name"] for r in rt.sql("CLIENT", "c1", "SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"durability_semaphore_client_grants", "durability_semaphore_client_leases",
            "durability_semaphore_client_keys"} <= tables


def gone_before_pumping(inst):
    """Stage an instance that dies before it pumps what it is asked next: ``abandon()`` (what the
    object's death does to it, as the test kit's eviction) closes its queue, which then commits
    an enqueue or a completion, pumps nothing and leaves the key's wake-up due at once, for the
    object's alarm (SPEC R37 wake-ups; a live instance pumps the key itself, in the background,
    and sets the durable wake-up only as a fallback 10 s later). Evict it after that step."""
    inst.queue.abandon()


async def test_queue_alarm_admits_under_the_limit_and_completion_admits_the_rest():
    # R15a, R37: the object's alarm (scheduler timer) pumps the queue; never more than the limit.
    # The alarm path: the instance that enqueues dies before it pumps (gone_before_pumping).
    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "QUEUE": Queue}, vars=FAST, auto_alarms=False)
    q = rt.stub("QUEUE", "q")
    gone = await rt.instance("QUEUE", "q")
    gone_before_pumping(gone)
    for i in range(5):
        assert await q.enqueue(f"j{i}") == "queued"
    # The queue's wake-up is a scheduler participant: its due time is read from the queue's own
    # table, no timer row mirrors it.
    assert rt.sql("QUEUE", "q", "SELECT name FROM durability_scheduler_timers") == []
    due = gone.scheduler.due_times()
    assert list(due) == ["durability_semaphore_queue:wake"]
    assert rt.get_alarm("QUEUE", "q") == due["durability_semaphore_queue:wake"] == gone.queue.wake_at(KEY)
    rt.evict("QUEUE", "q")
    assert (await rt.fire_alarm("QUEUE", "q"))["error"] is None      # a new instance pumps
    inst = await rt.instance("QUEUE", "q")
    s = states(inst)
    running = sorted(k for k, v in s.items() if v is ItemState.RUNNING)
    assert running == ["j0", "j1", "j2"], s          # limit 3, oldest first
    assert all(i.permit.kind is PermitKind.GRANT for i in inst.queue.items(state=ItemState.RUNNING))
    admitted = rt.sql("QUEUE", "q", "SELECT item_id, kind FROM test_admitted ORDER BY item_id")
    assert [a["item_id"] for a in admitted] == running and {a["kind"] for a in admitted} == {"grant"}
    assert (await rt.stub("ACCOUNT_LIMIT", KEY).usage()).outstanding == 3
    assert rt.get_alarm("QUEUE", "q") is not None     # waits for nextRequestAt to ask again
    # Completing two releases their permits (reported by the next sync) and admits the rest:
    # the live instance pumps its completions itself; the alarm fired below only runs what
    # waits for nextRequestAt.
    assert await q.complete("j0") is True and await q.complete("j1") is True
    assert await q.complete("j1") is False            # idempotent
    deadline = time.monotonic() + 20                     # a bound on polling, not a timing check
    while True:
        await asyncio.sleep(0.06)                        # past nextRequestAt (round period 50 ms)
        await rt.fire_alarm("QUEUE", "q")
        s = states(inst)
        if s["j3"] is ItemState.RUNNING and s["j4"] is ItemState.RUNNING:
            break
        assert sum(v is ItemState.RUNNING for v in s.values()) <= 3, s
        assert time.monotonic() < deadline, s
    assert [s[f"j{i}"] for i in range(5)] == [ItemState.DONE] * 2 + [ItemState.RUNNING] * 3, s
    usage = await rt.stub("ACCOUNT_LIMIT", KEY).usage()
    assert usage.outstanding == 3


async def test_queue_survives_eviction_and_its_alarm_finds_the_timer_in_sql():
    # R37: items and the wake-up timer survive eviction; a fresh instance continues from SQL.
    # Each change is made by an instance that dies before it pumps it (gone_before_pumping), so
    # only the wake-up in SQL brings the next instance to it.
    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "QUEUE": Queue}, vars=FAST, auto_alarms=False)
    q = rt.stub("QUEUE", "q")
    gone_before_pumping(await rt.instance("QUEUE", "q"))
    await q.enqueue("a")
    await q.enqueue("b")
    rt.evict("QUEUE", "q")
    assert (await rt.fire_alarm("QUEUE", "q"))["error"] is None      # a new instance pumps
    inst = await rt.instance("QUEUE", "q")
    assert states(inst) == {"a": ItemState.RUNNING, "b": ItemState.RUNNING}
    rt.evict("QUEUE", "q")
    gone_before_pumping(await rt.instance("QUEUE", "q"))
    assert await q.complete("a") is True
    rt.evict("QUEUE", "q")
    assert (await rt.fire_alarm("QUEUE", "q"))["error"] is None      # a fresh instance again
    # The release is durable; the queue may hold its report back for a while (its release-report
    # bound, 10 s by default where it exists) to send it with another message: let time pass.
    rt.advance(RELEASE_REPORT_MS + 1)
    assert (await rt.fire_alarm("QUEUE", "q")).get("error") is None  # sends the release (if not yet)
    held = rt.sql("ACCOUNT_LIMIT", KEY, "SELECT permits, claimed, released FROM durability_semaphore_grants")
    assert sum(r["permits"] - r["released"] for r in held) == 1, held
    events = [e["kind"] for e in rt.events if e.get("binding") == "QUEUE"]
    assert events.count("construct") == 4 and events.count("evict") == 3


async def test_queue_draws_leases_without_a_round_trip_and_settles_them():
    # R30, R34, R37, I3: lease draws start items locally; released draws are reported; an idle
    # lease is stopped before its expiry and reported until the holder answers settled
    rt = Runtime({"ACCOUNT_LIMIT": LeaseHolder, "QUEUE": Queue}, auto_alarms=False)
    LeaseHolder.calls = 0
    q = rt.stub("QUEUE", "q")
    await q.enqueue("a")
    inst = await settle_queue(rt, "QUEUE", "q")     # the instance pumps its enqueue itself (R37)
    # Strict provisioning, limit 4: demand 1 gets a grant of 1 plus a lease of 3 (R25); the
    # queue runs "a" under one of them.
    (lease,) = inst.client.leases(KEY)
    assert lease.permits == 3 and lease.status == "live"
    assert inst.queue.item("a").state is ItemState.RUNNING
    drawn = inst.client.lease(KEY, lease.lease_id).drawn
    calls = LeaseHolder.calls
    assert await q.enqueue("b") == "queued"
    await settle_queue(rt, "QUEUE", "q")
    item_b = inst.queue.item("b")
    assert item_b.state is ItemState.RUNNING and item_b.permit == type(item_b.permit)(
        PermitKind.LEASE, lease.lease_id, drawn + 1)
    assert LeaseHolder.calls == calls                  # drawn with no round trip (R30)
    (row,) = rt.sql("QUEUE", "q", "SELECT kind FROM test_admitted WHERE item_id = 'b'")
    assert row == {"kind": "lease"}
    # Completion releases the permits; the releases reach the holder (possibly held back for
    # the queue's release-report bound: let that time pass).
    assert await q.complete("a") and await q.complete("b")
    await settle_queue(rt, "QUEUE", "q")             # the instance pumps its completions itself
    rt.advance(RELEASE_REPORT_MS + 1)
    assert (await rt.fire_alarm("QUEUE", "q")).get("error") is None
    (held,) = rt.sql("ACCOUNT_LIMIT", KEY, "SELECT drawn, released, status FROM durability_semaphore_leases")
    assert held["drawn"] == held["released"] == drawn + 1 and held["status"] == "live", held
    # Idle: the queue's alarm stops the lease before it expires; the holder settles it.
    for _ in range(5):
        x = inst.client.lease(KEY, lease.lease_id)
        if x.status == "settled":
            break
        wake = rt.get_alarm("QUEUE", "q")
        assert wake is not None and wake < x.expires_at, (wake, x)
        rt.advance(max(0, wake - rt.now()) + 1)
        assert (await rt.fire_alarm("QUEUE", "q"))["error"] is None
    assert inst.client.lease(KEY, lease.lease_id).status == "settled"
    assert rt.sql("ACCOUNT_LIMIT", KEY, "SELECT * FROM durability_semaphore_leases") == []
    await rt.stub("ACCOUNT_LIMIT", KEY).permits(      # a round reclaims the grant if left unclaimed
        {"type": "sync", "v": 1, "clientId": "other", "grants": []})
    usage = await rt.stub("ACCOUNT_LIMIT", KEY).usage()
    assert (usage.outstanding, usage.leaseFootprint) == (0, 0)


class ObjectsOnlyHolder(AccountLimit):
    """The account's holder as a release before JSON text answered: a message given as text is
    its ``invalid_message`` of the message itself, as an object; the types it got are kept."""

    received: list = []  # noqa: RUF012 (shared by every instance: the test reads it)

    async def permits(self, message):
        ObjectsOnlyHolder.received.append("str" if isinstance(message, str) else "object")
        if isinstance(message, str):
            return InvalidMessageError("", "message must be an object, got a str").to_wire()
        return await super().permits(message)


class TypesSeen(AccountLimit):
    """The account's holder, keeping the Python types of the messages and replies that crossed."""

    seen: list = []  # noqa: RUF012

    async def permits(self, message):
        reply = await super().permits(message)
        TypesSeen.seen.append((type(message).__name__, type(reply).__name__))
        return reply


async def test_messages_cross_the_real_rpc_as_json_text():
    # SPEC R7 "JSON text", R36 "encoding": through the Workers SDK's RPC a text message reaches the
    # holder as a Python str and its text reply comes back decoded to the reply dict.
    TypesSeen.seen.clear()
    rt = Runtime({"ACCOUNT_LIMIT": TypesSeen, "CLIENT": Client}, vars=FAST, auto_alarms=False)
    out = await rt.stub("CLIENT", "c1").ask(KEY, 2)
    assert out["slots"] == [1, 2] and out["confirmed"] == 2 and out["sync_status"] == "active", out
    assert TypesSeen.seen == [("str", "str"), ("str", "str")], TypesSeen.seen


async def test_a_holder_that_takes_only_objects_gets_objects_after_its_first_answer():
    # SPEC R36 "encoding": a holder of an earlier release refuses the text (nothing written, I5);
    # the helper sends that message again as an object, and the later ones of its transport too.
    ObjectsOnlyHolder.received.clear()
    rt = Runtime({"ACCOUNT_LIMIT": ObjectsOnlyHolder, "CLIENT": Client}, vars=FAST, auto_alarms=False)
    out = await rt.stub("CLIENT", "c1").ask(KEY, 2)
    assert out["slots"] == [1, 2] and out["confirmed"] == 2 and out["sync_status"] == "active", out
    assert ObjectsOnlyHolder.received == ["str", "object", "object"], ObjectsOnlyHolder.received
