"""Proves the tier-2 harness: the real `workers` SDK over the JS stand-ins, inside Pyodide.

Each test documents one conversion fact a Python Durable Object relies on. They run under
tests/pyodide/harness.mjs (see tests/test_pyodide_tier.py), not under host pytest.
"""

import asyncio
import time

import workers
from pyodide.ffi import JsException, JsProxy
from standins import Runtime
from workers import DurableObject, Response, WorkerEntrypoint  # noqa: F401  (import must work)
from workers.entrypoints import DurableObjectContext
from workers.rpc import JsDict, _BindingWrapper, _EnvWrapper

POLL_BOUND_S = 60  # how long an alarm firing by itself may take: a hang, not a slow machine


async def until(condition, what):
    """Poll ``condition()`` every 10 ms (real time: timers fire by themselves) up to POLL_BOUND_S."""
    deadline = time.monotonic() + POLL_BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {POLL_BOUND_S} s"
        await asyncio.sleep(0.01)


def describe(value):
    """Type tree of a value, to show what crossed a boundary."""
    if isinstance(value, dict):
        return {"__type__": type(value).__name__, **{k: describe(v) for k, v in value.items()}}
    if isinstance(value, list):
        return [type(value).__name__] + [describe(v) for v in value]
    return type(value).__name__


class Store(DurableObject):
    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.alarm_calls = []
        self.fail_alarms = 0
        ctx.storage.sql.exec(
            "CREATE TABLE IF NOT EXISTS kv (k TEXT PRIMARY KEY, v INTEGER, f REAL, b BLOB, t TEXT)")

    # --- RPC methods ---
    def put(self, k, v):
        self.ctx.storage.sql.exec("INSERT OR REPLACE INTO kv (k, v) VALUES (?, ?)", k, v)
        return self.ctx.storage.sql.exec("SELECT count(*) AS n FROM kv").one().n

    def get(self, k):
        rows = self.ctx.storage.sql.exec("SELECT k, v FROM kv WHERE k = ?", k).toArray()
        return rows[0].v if rows else None

    def echo(self, payload):
        return {"payload": payload, "types": describe(payload)}

    async def relay(self, peer, payload):
        # DO -> DO through self.env, as the library's client does.
        return await self.env.STORE.getByName(peer).echo(payload)

    def boom(self, message):
        raise ValueError(message)

    def bad_tuple(self):
        return (1, 2)

    def _private(self):
        return "hidden"

    async def alarm(self, alarm_info):
        inside = await self.ctx.storage.getAlarm()
        self.alarm_calls.append({"retryCount": alarm_info.retryCount, "isRetry": alarm_info.isRetry,
                                 "getAlarm_inside": inside})
        if self.fail_alarms:
            self.fail_alarms -= 1
            raise RuntimeError("alarm failed")


def sql(inst):
    return inst.ctx.storage.sql


# --------------------------------------------------------------------------------------------
# SDK bootstrap and wrapping
# --------------------------------------------------------------------------------------------

async def test_ctx_env_wrapped_like_runtime():
    rt = Runtime({"STORE": Store})
    inst = await rt.instance("STORE", "alpha")
    assert isinstance(inst.ctx, DurableObjectContext)
    assert isinstance(inst.env, _EnvWrapper)
    # ctx.storage is wrapped because its JS class is named DurableObjectStorage; nested JS
    # objects reached through it (sql, cursors) are wrapped too.
    assert type(inst.ctx.storage) is _BindingWrapper
    assert type(inst.ctx.storage.sql) is _BindingWrapper
    assert type(inst.ctx.storage.sql.exec("SELECT 1 AS one")) is _BindingWrapper
    # ctx.id stays a raw JS object: str() / toString() give the 64-hex id, .name the name.
    assert isinstance(inst.ctx.id, JsProxy)
    assert len(str(inst.ctx.id)) == 64 and str(inst.ctx.id) == inst.ctx.id.toString()
    assert inst.ctx.id.name == "alpha"
    # snake_case spellings do not exist.
    for missing in ("set_alarm", "transaction_sync"):
        try:
            getattr(inst.ctx.storage, missing)
        except AttributeError:
            pass
        else:
            raise AssertionError(f"{missing} should not exist")
    # workers.env reads cloudflare:workers' env: the same bindings.
    assert hasattr(workers.env, "STORE")


# --------------------------------------------------------------------------------------------
# SQL rows and values
# --------------------------------------------------------------------------------------------

async def test_rows_are_jsdict_with_python_values():
    rt = Runtime({"STORE": Store})
    s = sql(await rt.instance("STORE", "rows"))
    s.exec("INSERT INTO kv (k, v, f, b, t) VALUES (?, ?, ?, ?, ?)", "a", 7, 1.5, b"\x00\x01", None)
    # 2**53 + 1 cannot be bound (it reaches JS as a BigInt); stored by SQL it reads back lossy.
    s.exec("INSERT INTO kv (k, v, f) VALUES (?, 9007199254740993, ?)", "b", 2.0)
    row = s.exec("SELECT * FROM kv WHERE k = ?", "a").one()
    assert type(row) is JsDict and isinstance(row, dict)
    assert row.k == row["k"] == "a"
    assert row.v == 7 and type(row.v) is int
    assert row.f == 1.5 and type(row.f) is float
    assert type(row.b) is memoryview and bytes(row.b) == b"\x00\x01"
    assert row.t is None                     # SQL NULL -> None (not jsnull)
    b = s.exec("SELECT v, f FROM kv WHERE k = 'b'").one()
    # Integral doubles come back as int, whatever the column type says ...
    assert b.f == 2 and type(b.f) is int
    # ... but only up to 2**53: above that a JS number becomes a Python float.
    assert type(b.v) is float and b.v == float(2 ** 53) and b.v != 2 ** 53 + 1
    rows = s.exec("SELECT k FROM kv ORDER BY k").toArray()
    assert type(rows) is list and [type(r) for r in rows] == [JsDict, JsDict]
    assert [r.k for r in s.exec("SELECT k FROM kv ORDER BY k")] == ["a", "b"]   # iteration
    cur = s.exec("SELECT k, v FROM kv ORDER BY k")
    assert list(cur.columnNames) == ["k", "v"]
    assert [list(r) for r in cur.raw()] == [["a", 7], ["b", float(2 ** 53)]]
    assert s.exec("SELECT k FROM kv WHERE k = 'zzz'").toArray() == []
    for bad_one in ("SELECT k FROM kv", "SELECT k FROM kv WHERE k = 'zzz'"):
        try:
            s.exec(bad_one).one()
        except JsException as exc:
            assert "Expected exactly one result" in str(exc)
        else:
            raise AssertionError("one() should raise")


async def test_bindings_are_checked():
    rt = Runtime({"STORE": Store})
    s = sql(await rt.instance("STORE", "bind"))
    for bad in (True, 2 ** 53 + 1, [1], {"a": 1}):
        try:
            s.exec("SELECT ? AS x", bad)
        except JsException as exc:
            assert exc.name == "TypeError", exc
        else:
            raise AssertionError(f"binding {bad!r} should be refused")
    # Large ids must travel as TEXT.
    s.exec("INSERT INTO kv (k, t) VALUES (?, ?)", "big", str(2 ** 63 - 1))
    assert int(s.exec("SELECT t FROM kv WHERE k = 'big'").one().t) == 2 ** 63 - 1
    # At most 100 bound parameters.
    ok = s.exec("SELECT " + ", ".join("?" for _ in range(100)) + " AS x", *range(100)).toArray()
    assert len(ok) == 1
    try:
        s.exec("SELECT " + ", ".join("?" for _ in range(101)), *range(101))
    except JsException as exc:
        assert "too many SQL variables" in str(exc)
    else:
        raise AssertionError("101 bindings should be refused")


async def test_sql_refuses_transaction_statements_and_reports_sqlite_errors():
    rt = Runtime({"STORE": Store})
    s = sql(await rt.instance("STORE", "txn"))
    for stmt in ("BEGIN", "BEGIN TRANSACTION", "COMMIT", "ROLLBACK", "SAVEPOINT sp",
                 "RELEASE sp", "END"):
        try:
            s.exec(stmt)
        except JsException as exc:
            assert "transactionSync" in str(exc), (stmt, str(exc))
        else:
            raise AssertionError(f"{stmt} should be refused")
    s.exec("INSERT INTO kv (k, v) VALUES ('dup', 1)")
    try:
        s.exec("INSERT INTO kv (k, v) VALUES ('dup', 2)")
    except JsException as exc:
        assert "UNIQUE constraint failed" in str(exc) and "SQLITE_CONSTRAINT" in str(exc)
    else:
        raise AssertionError("duplicate key should fail")
    # Several statements in one exec() run in order; the cursor is the last one's.
    cur = s.exec("CREATE TABLE m (x); INSERT INTO m VALUES (1); INSERT INTO m VALUES (2); "
                 "SELECT sum(x) AS s FROM m")
    assert cur.one().s == 3


async def test_open_cursor_locks_table_for_drop():
    rt = Runtime({"STORE": Store})
    s = sql(await rt.instance("STORE", "lock"))
    for i in range(3):
        s.exec("INSERT INTO kv (k, v) VALUES (?, ?)", f"k{i}", i)
    cur = s.exec("SELECT k FROM kv")
    next(iter(cur))           # partly consumed: the statement is still running
    try:
        s.exec("DROP TABLE kv")
    except JsException as exc:
        assert "locked" in str(exc)
    else:
        raise AssertionError("DROP with a running cursor should fail")
    cur.toArray()             # finish it
    s.exec("DROP TABLE kv")


async def test_rows_read_written_are_cached_by_the_sdk_on_first_read():
    rt = Runtime({"STORE": Store})
    s = sql(await rt.instance("STORE", "counts"))
    w = s.exec("INSERT INTO kv (k, v) VALUES ('a', 1), ('b', 2)")
    assert w.rowsWritten == 2
    cur = s.exec("SELECT k FROM kv")
    early = cur.rowsRead          # read before consuming: the SDK caches this attribute
    cur.toArray()
    assert cur.rowsRead == early  # still the cached value
    cur2 = s.exec("SELECT k FROM kv")
    cur2.toArray()
    assert cur2.rowsRead == 2     # read after consuming: the full count


# --------------------------------------------------------------------------------------------
# transactionSync with Python callables
# --------------------------------------------------------------------------------------------

async def test_transaction_sync_commits_returns_and_rolls_back():
    rt = Runtime({"STORE": Store})
    inst = await rt.instance("STORE", "tx")
    storage, s = inst.ctx.storage, sql(inst)

    def body():
        s.exec("INSERT INTO kv (k, v) VALUES ('x', 1)")
        return {"done": True, "n": 1}

    result = storage.transactionSync(body)
    assert result == {"done": True, "n": 1}          # the Python value comes back unchanged
    assert storage.transactionSync(lambda: s.exec("SELECT v FROM kv WHERE k='x'").one().v) == 1

    class Boom(Exception):
        pass

    def failing():
        s.exec("UPDATE kv SET v = 99 WHERE k = 'x'")
        s.exec("INSERT INTO kv (k, v) VALUES ('y', 2)")
        raise Boom("abort")

    try:
        storage.transactionSync(failing)
    except Boom as exc:                               # the same Python exception, same type
        assert str(exc) == "abort"
    else:
        raise AssertionError("transactionSync should re-raise")
    assert s.exec("SELECT v FROM kv WHERE k = 'x'").one().v == 1     # rolled back
    assert s.exec("SELECT count(*) AS n FROM kv WHERE k = 'y'").one().n == 0

    # Nested transactionSync: the inner one rolls back alone.
    def outer():
        s.exec("INSERT INTO kv (k, v) VALUES ('o', 1)")
        try:
            storage.transactionSync(lambda: (s.exec("INSERT INTO kv (k, v) VALUES ('i', 1)"), 1 / 0))
        except ZeroDivisionError:
            pass
        return s.exec("SELECT group_concat(k) AS ks FROM kv WHERE k IN ('o','i')").one().ks

    assert storage.transactionSync(outer) == "o"

    async def not_sync():
        return 1

    try:
        storage.transactionSync(not_sync)
    except JsException as exc:
        assert "synchronous" in str(exc)
    else:
        raise AssertionError("an async callback should be refused")


# --------------------------------------------------------------------------------------------
# Alarms
# --------------------------------------------------------------------------------------------

async def test_alarm_api_values_and_manual_firing():
    rt = Runtime({"STORE": Store}, auto_alarms=False)
    inst = await rt.instance("STORE", "alarm")
    storage = inst.ctx.storage
    assert await storage.getAlarm() is None
    when = rt.now() + 5_000
    assert await storage.setAlarm(when) is None
    got = await storage.getAlarm()
    assert got == when and type(got) is int
    await storage.deleteAlarm()
    assert await storage.getAlarm() is None
    await storage.setAlarm(when)
    assert (await rt.fire_alarm("STORE", "alarm"))["fired"] is False   # not due yet
    rt.advance(5_000)
    res = await rt.fire_alarm("STORE", "alarm")
    assert res["fired"] and res["error"] is None
    assert inst.alarm_calls == [{"retryCount": 0, "isRetry": False, "getAlarm_inside": None}]
    assert await storage.getAlarm() is None

    # A failing handler is retried with backoff.
    inst.fail_alarms = 1
    await storage.setAlarm(rt.now())
    res = await rt.fire_alarm("STORE", "alarm")
    assert res["error"] and res["retryScheduled"]
    retry_at = rt.get_alarm("STORE", "alarm")
    assert retry_at >= rt.now() + 1_900
    rt.advance(2_000)
    await rt.fire_alarm("STORE", "alarm")
    assert inst.alarm_calls[-1]["retryCount"] == 1 and inst.alarm_calls[-1]["isRetry"]
    assert rt.get_alarm("STORE", "alarm") is None


async def test_alarm_fires_by_itself_and_after_eviction():
    rt = Runtime({"STORE": Store})
    inst = await rt.instance("STORE", "auto")
    inst.ctx.storage.sql.exec("INSERT INTO kv (k, v) VALUES ('kept', 1)")
    await inst.ctx.storage.setAlarm(rt.now() + 60_000)
    rt.evict("STORE", "auto")                 # memory gone, storage and alarm stay
    rt.advance(60_000)                        # moving the clock re-arms the alarm timer
    await until(lambda: any(e["kind"] == "alarm" for e in rt.events), "the alarm")
    fresh = await rt.instance("STORE", "auto")
    assert fresh is not inst
    # the event is recorded as the delivery starts: its handler may still be on its way
    await until(lambda: len(fresh.alarm_calls) >= 1, "the alarm handler's run")
    assert len(fresh.alarm_calls) == 1
    assert fresh.get("kept") == 1


async def test_an_alarm_timer_firing_before_the_alarm_time_re_arms():
    # setTimeout can fire a millisecond before Date.now() reaches the alarm; the stand-in must
    # then wait for the rest instead of giving up (the alarm would never fire by itself). Made
    # deterministic by moving the clock back behind the runtime's back (no re-arm): the timer
    # set for 20 ms then fires ~150 ms before clock.now() reaches the alarm.
    import _standin_js
    import js

    class Timed(Store):
        async def alarm(self, alarm_info):
            self.fired_at = js.Date.now()
            await super().alarm(alarm_info)

    rt = Runtime({"STORE": Timed})
    inst = await rt.instance("STORE", "early")
    when = rt.now() + 20
    await inst.ctx.storage.setAlarm(when)
    _standin_js.clock.offset -= 150   # close_all() resets the clock after the test
    await until(lambda: inst.alarm_calls, "the alarm")
    assert len(inst.alarm_calls) == 1, (rt.events, rt.get_alarm("STORE", "early"))
    assert inst.fired_at >= when        # not before its time (by the runtime's clock)
    assert rt.get_alarm("STORE", "early") is None
    await rt.quiesce()


# --------------------------------------------------------------------------------------------
# RPC through the env stub
# --------------------------------------------------------------------------------------------

async def test_rpc_between_objects_with_nested_payload():
    rt = Runtime({"STORE": Store})
    payload = {"type": "request", "v": 1, "clientId": "c-1",
               "demand": [{"group": "g", "count": 3, "oldestAt": 1_700_000_000_000}],
               "leases": [], "ratio": 0.5, "stopped": False, "none": None,
               "nested": {"deep": [[1, 2], {"x": "y"}]}}
    reply = await rt.stub("STORE", "a").relay("b", payload)
    assert type(reply) is JsDict
    assert reply["payload"] == payload               # values survive the round trip
    t = reply["types"]                               # what the callee saw
    assert t["__type__"] == "JsDict"
    assert t["demand"] == ["list", {"__type__": "JsDict", "group": "str", "count": "int",
                                    "oldestAt": "int"}]
    assert t["stopped"] == "bool" and t["none"] == "NoneType" and t["ratio"] == "float"
    assert t["leases"] == ["list"]
    assert reply["payload"]["nested"]["deep"][1].x == "y"
    # Ints, strs and None as plain arguments/results.
    assert await rt.stub("STORE", "a").put("k", 5) == 1
    assert await rt.stub("STORE", "a").get("k") == 5
    assert await rt.stub("STORE", "a").get("missing") is None


async def test_rpc_errors_and_unsendable_values():
    rt = Runtime({"STORE": Store})
    stub = rt.stub("STORE", "err")
    try:
        await stub.boom("kaput")
    except JsException as exc:     # the Python type is lost; the traceback text survives
        assert exc.name == "Error"
        assert "ValueError: kaput" in str(exc)
    else:
        raise AssertionError("should raise")
    for call in (lambda: stub.echo((1, 2)), lambda: stub.echo({"a": (1, 2)})):
        try:
            await call()
        except TypeError as exc:   # the SDK refuses tuples before anything is sent
            assert "tuple" in str(exc)
        else:
            raise AssertionError("tuples should be refused")
    try:
        await stub.bad_tuple()     # refused on the callee side, reaches the caller as an Error
    except JsException as exc:
        assert "TypeError" in str(exc) and "tuple" in str(exc)
    else:
        raise AssertionError("tuple results should be refused")
    for name in ("nope", "_private"):
        try:
            await getattr(stub, name)()
        except JsException as exc:
            assert exc.name == "TypeError" and "does not exist" in str(exc)
        else:
            raise AssertionError(f"{name} should not be callable")


async def test_block_concurrency_while_and_eviction_keep_storage():
    rt = Runtime({"STORE": Store})
    inst = await rt.instance("STORE", "bcw")
    order = []

    async def init():
        order.append("init-start")
        await asyncio.sleep(0.02)
        order.append("init-end")
        return 42

    blocked = asyncio.ensure_future(inst.ctx.blockConcurrencyWhile(init))
    await asyncio.sleep(0)
    call = asyncio.ensure_future(rt.stub("STORE", "bcw").put("z", 1))
    assert await blocked == 42
    order.append("after-bcw")
    assert await call == 1
    assert order[:2] == ["init-start", "init-end"]
    rt.evict("STORE", "bcw")
    assert await rt.stub("STORE", "bcw").get("z") == 1
    assert [e["kind"] for e in rt.events].count("construct") == 2


async def test_evicted_instance_tasks_keep_their_storage_and_stubs_expose_id_and_name():
    # "Eviction is not a crash" here: a task the old instance left running must still be able to
    # open transactions after a new instance took over the same database (shared authorizer).
    rt = Runtime({"STORE": Store}, auto_alarms=False)
    old = await rt.instance("STORE", "ev")
    rt.evict("STORE", "ev")
    assert await rt.stub("STORE", "ev").put("a", 1) == 1          # a new instance opened storage
    assert old.ctx.storage.transactionSync(lambda: sql(old).exec("SELECT 7 AS n").one().n) == 7
    try:
        sql(old).exec("BEGIN")
    except JsException as exc:
        assert "transactionSync" in str(exc)                         # still workerd's message
    else:
        raise AssertionError("BEGIN should be refused")
    assert rt.sql("STORE", "ev", "SELECT k FROM kv") == [{"k": "a"}]
    # stub.id / stub.name are the stub's own members (not RPC methods).
    stub = rt.stub("STORE", "ev")
    assert stub.name == "ev" and stub.id.name == "ev" and len(stub.id.toString()) == 64
