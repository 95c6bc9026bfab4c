"""Tier 1: the SQLite test bed enforces the Durable Object storage rules, and the library's
runtime adapter works over both row shapes (so tier-1 passes mean something in the runtime)."""

from __future__ import annotations

import pytest

from semaphore.runtime import Storage
from semaphore.testing import Bed, DurableObjectRuleError, LocalContext, LocalStorage, async_test, request


def sql(storage: LocalStorage, query: str, *bindings):
    return storage.sql.exec(query, *bindings).toArray()


@pytest.mark.parametrize("statement", [
    "BEGIN",
    "begin transaction",
    "BEGIN IMMEDIATE",
    "COMMIT",
    "END",
    "ROLLBACK",
    "SAVEPOINT sp",
    "RELEASE sp",
    "   \n\tBEGIN",
    "-- a comment\nBEGIN",
    "/* block */ COMMIT",
    "  -- one\n  /* two\n lines */\n  savepoint x",
    "/**/ROLLBACK TO x",
])
def test_transaction_statements_rejected_in_exec(statement):
    storage = LocalStorage()
    with pytest.raises(DurableObjectRuleError, match="transaction"):
        storage.sql.exec(statement)
    assert not storage.connection.in_transaction


@pytest.mark.parametrize("statement", [
    "SELECT 'BEGIN'",
    "SELECT 1 -- COMMIT",
    "CREATE TABLE begin_log (x)",
])
def test_statements_mentioning_keywords_are_allowed(statement):
    sql(LocalStorage(), statement)


def test_binding_count_limit():
    storage = LocalStorage()
    marks = "+".join("?" * 100)
    assert sql(storage, f"SELECT {marks} AS s", *range(100)) == [{"s": sum(range(100))}]
    with pytest.raises(DurableObjectRuleError, match="too many"):
        storage.sql.exec(f"SELECT {marks}+? AS s", *range(101))
    with pytest.raises(ValueError):
        Storage(LocalContext(storage)).exec(f"SELECT {marks}+? AS s", *range(101))


@pytest.mark.parametrize("value", [True, False, [1], {"a": 1}, object(), 2**53, -(2**53), 10**20])
def test_bad_bindings_rejected(value):
    with pytest.raises(DurableObjectRuleError):
        LocalStorage().sql.exec("SELECT ?", value)


@pytest.mark.parametrize("value", [None, "s", 2**53 - 1, -(2**53 - 1), 1.5, b"\x00\x01"])
def test_good_bindings_accepted(value):
    assert sql(LocalStorage(), "SELECT ? AS v", value)[0]["v"] == value


def test_large_integers_read_back_rejected():
    storage = LocalStorage()
    with pytest.raises(DurableObjectRuleError, match="precision"):
        storage.sql.exec("SELECT 9007199254740992 AS big")


def test_statement_size_limit():
    with pytest.raises(DurableObjectRuleError, match="100 KB"):
        LocalStorage().sql.exec("SELECT '" + "x" * 100_001 + "'")


def test_transaction_sync_rolls_back_on_exception_and_commits_otherwise():
    storage = LocalStorage()
    sql(storage, "CREATE TABLE t (x INTEGER)")

    def failing():
        sql(storage, "INSERT INTO t VALUES (1)")
        raise KeyError("boom")

    with pytest.raises(KeyError):
        storage.transactionSync(failing)
    assert sql(storage, "SELECT * FROM t") == []

    def nested():
        sql(storage, "INSERT INTO t VALUES (2)")
        with pytest.raises(ValueError):
            storage.transactionSync(lambda: (sql(storage, "INSERT INTO t VALUES (3)"), int("x")))
        return "ok"

    assert storage.transactionSync(nested) == "ok"
    assert [r["x"] for r in sql(storage, "SELECT * FROM t")] == [2]
    assert not storage.connection.in_transaction


def test_storage_transaction_adapter_rolls_back_and_returns_python_values():
    storage = LocalStorage()
    st = Storage(LocalContext(storage))
    st.exec("CREATE TABLE t (x INTEGER)")
    with pytest.raises(RuntimeError):
        st.transaction(lambda: (st.exec("INSERT INTO t VALUES (1)"), (_ for _ in ()).throw(RuntimeError())))
    assert st.exec("SELECT * FROM t") == []
    value = {"k": [1, 2]}
    assert st.transaction(lambda: (st.exec("INSERT INTO t VALUES (5)"), value)[1]) is value
    assert st.exec("SELECT x FROM t") == [{"x": 5}]


def test_fail_next_exec_fails_exactly_once():
    storage = LocalStorage()
    storage.fail_next_exec = OSError("io")
    with pytest.raises(OSError):
        storage.sql.exec("SELECT 1")
    assert sql(storage, "SELECT 1 AS one") == [{"one": 1}]


@pytest.mark.parametrize("mode", ["dict", "attr"])
def test_row_modes_through_runtime_storage(mode):
    storage = LocalStorage(row_mode=mode)
    raw = storage.sql.exec("SELECT 1 AS a, 'x' AS b, NULL AS c").toArray()[0]
    assert raw.a == 1 and raw.b == "x" and raw.c is None   # attribute access in both modes
    if mode == "attr":
        with pytest.raises(TypeError):
            raw["a"]  # noqa: B018 - the runtime's built-in rows allow attribute access only
    st = Storage(LocalContext(storage))
    assert st.exec("SELECT 1 AS a, 'x' AS b, NULL AS c") == [{"a": 1, "b": "x", "c": None}]
    assert st.one("SELECT 2 AS a WHERE 0") is None
    assert st.exec("SELECT 1 AS a WHERE 0") == []


@pytest.mark.parametrize("mode", ["dict", "attr"])
@async_test
async def test_semaphore_round_on_both_row_modes(mode):
    bed = Bed(limit=3, storage=LocalStorage(row_mode=mode))
    a, b = await bed.round(request("a", {"g": 2}), request("b", {"g": 2}))
    assert [g["permits"] for g in a["grants"]] == [2] and [g["permits"] for g in b["grants"]] == [1]
    assert (await bed.usage())["outstanding"] == 3
    bed.check()


@async_test
async def test_alarm_api_shape():
    storage = LocalStorage()
    assert await storage.getAlarm() is None
    await storage.setAlarm(123.0)
    assert await storage.getAlarm() == 123
    with pytest.raises(DurableObjectRuleError):
        await storage.setAlarm(True)
    await storage.deleteAlarm()
    assert storage.alarm is None
