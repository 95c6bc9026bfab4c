"""semaphore.runtime.Storage over the SDK-wrapped ``ctx.storage`` inside Pyodide: SQL statements
and transactions go to the JavaScript object itself, not through the SDK's RPC converters
(``workers/rpc.py`` ``_BindingWrapper``), and every value still crosses as it did through them."""

from standins import Runtime
from workers import DurableObject
from workers.rpc import _BindingWrapper

from semaphore.runtime import Storage


class Plain(DurableObject):
    pass


async def storage_of_an_object():
    rt = Runtime({"PLAIN": Plain}, auto_alarms=False)
    inst = await rt.instance("PLAIN", "p")
    assert isinstance(inst.ctx.storage, _BindingWrapper)  # what workerd's SDK hands a Python object
    return Storage(inst.ctx)


async def test_sql_and_transactions_bypass_the_sdk_converters():
    storage = await storage_of_an_object()
    assert storage._direct  # the JS object's own sql.exec and transactionSync
    assert not isinstance(storage._sql, _BindingWrapper)
    storage.exec("CREATE TABLE t (k TEXT PRIMARY KEY, n INTEGER, x REAL, b BLOB, z TEXT)")
    storage.exec("INSERT INTO t VALUES (?, ?, ?, ?, ?)", "a", 2**40, 1.5, b"\x00\x01\xff", None)
    (row,) = storage.exec("SELECT k, n, x, b, z, z IS NULL AS z_null, typeof(b) AS bt FROM t")
    # None is bound as SQL NULL (Pyodide alone would pass undefined), bytes as a BLOB
    assert row == {"k": "a", "n": 2**40, "x": 1.5, "b": b"\x00\x01\xff", "z": None, "z_null": 1, "bt": "blob"}
    assert all(type(v) in (str, int, float, bytes, type(None)) for v in row.values())
    assert storage.exec("SELECT k FROM t WHERE z IS ?", None) == [{"k": "a"}]
    assert storage.exec("SELECT k FROM t WHERE k = ?", "missing") == []


def test_bindings_for_a_direct_call_are_bound_as_cpython_binds_them():
    # None would reach JavaScript as undefined, a bool as true (bound as the text 'true' by
    # workerd), a list as its text: the adapter binds them as CPython's sqlite3 does, or refuses.
    from pyodide.ffi import JsProxy, jsnull

    from semaphore.runtime import _js_binding

    assert _js_binding(None) is jsnull
    assert _js_binding(True) == 1 and type(_js_binding(True)) is int and _js_binding(False) == 0
    assert _js_binding("a") == "a" and _js_binding(7) == 7 and _js_binding(1.5) == 1.5
    blob = _js_binding(b"\x00\xff")
    assert isinstance(blob, JsProxy) and blob.constructor.name == "Uint8Array" and blob.to_py() == b"\x00\xff"
    for bad in ([1], (1,), {"a": 1}):
        try:
            _js_binding(bad)
        except TypeError:
            continue
        raise AssertionError(f"{bad!r} was bound")
    # Pyodide passes an int from 2**53 - 1 either way as a BigInt, which workerd refuses: the
    # largest safe integer goes as the number it equals exactly, beyond it is refused.
    assert type(_js_binding(2**53 - 2)) is int
    for edge in (2**53 - 1, -(2**53 - 1)):
        assert type(_js_binding(edge)) is float and _js_binding(edge) == edge
    for big in (2**53, -(2**53), 2**63):
        try:
            _js_binding(big)
        except OverflowError:
            continue
        raise AssertionError(f"{big} was bound")


async def test_a_bool_reads_back_as_an_integer():
    storage = await storage_of_an_object()
    (row,) = storage.exec("SELECT ? AS t, ? AS f, ? = 1 AS one", True, False, True)
    assert row == {"t": 1, "f": 0, "one": 1}, row  # a number, never the text 'true'



async def test_a_direct_transaction_commits_returns_and_rolls_back():
    storage = await storage_of_an_object()
    storage.exec("CREATE TABLE t (k TEXT PRIMARY KEY)")
    forgot = []
    storage.on_rollback(lambda: forgot.append(1))
    assert storage.transaction(lambda: storage.exec("INSERT INTO t VALUES ('a')") or {"kept": [1]}) == {"kept": [1]}

    def fails():
        storage.exec("INSERT INTO t VALUES ('b')")
        raise KeyError("boom")

    try:
        storage.transaction(fails)
    except KeyError as exc:  # the Python exception itself comes back through JavaScript
        assert exc.args == ("boom",)
    else:
        raise AssertionError("the transaction did not raise")
    assert forgot == [1]
    assert storage.exec("SELECT k FROM t") == [{"k": "a"}]


async def test_a_wrapper_whose_inner_object_is_not_the_storage_keeps_the_wrapper():
    # An SDK release that keeps something else under ``_binding``: the adapter must not break
    # (it goes through the wrapper, as before the direct path).
    from pyodide.ffi import to_js

    real = (await storage_of_an_object())._storage

    class _BindingWrapper:  # noqa: N801 - the SDK's class name is what the adapter recognises
        def __init__(self) -> None:
            self._binding = to_js({})  # a JS object without sql / transactionSync
            self.sql = real.sql
            self.transactionSync = real.transactionSync

    class Ctx:
        storage = _BindingWrapper()

    storage = Storage(Ctx())
    assert not storage._direct
    storage.exec("CREATE TABLE u (k TEXT)")
    storage.transaction(lambda: storage.exec("INSERT INTO u VALUES (?)", "a"))
    assert storage.exec("SELECT k FROM u") == [{"k": "a"}]
