"""Misconfiguration fails at once with a ConfigurationError that names the thing, never retried as
if the holder were down: a holder class without SQLite storage (its ``new_sqlite_classes``
migration missing), a binding to a class that is not a holder, as a waiting ``permit()`` sees them.

The storage stand-ins below answer as workerd does (its message for a class that is not
SQLite-backed, seen on workerd 1.20261117.1); the holder, client and queue are the library's own,
on real SQLite. tests/workerd/test_misconfiguration_runtime.py runs the same cases on workerd.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from semaphore import ConfigurationError, DurabilityScheduler, DurabilitySemaphore, retry
from semaphore.runtime import NOT_SQLITE, SQL_NOT_ENABLED, Storage
from semaphore.testing import T0, ClientSide, LocalContext, LocalStorage, SimClock, async_test

WORKERD_NOT_SQLITE = (f"Error: {SQL_NOT_ENABLED}. To enable it, change `new_classes` to `new_sqlite_classes` within "
                      "the 'migrations' field in your wrangler.jsonc or wrangler.toml file.")


class KvSql:
    """``ctx.storage.sql`` of a class that is not SQLite-backed: workerd has the attribute, and
    every ``exec`` raises its error."""

    def exec(self, query: str, *bindings: Any) -> Any:
        raise RuntimeError(WORKERD_NOT_SQLITE)


def kv_backed_context() -> LocalContext:
    storage = LocalStorage()
    storage.sql = KvSql()  # type: ignore[assignment]
    return LocalContext(storage, name="holder")


def sync() -> dict:
    return {"type": "sync", "v": 1, "clientId": "c1", "grants": []}


@async_test
async def test_a_holder_class_without_sqlite_storage_answers_a_configuration_error():
    ctx = kv_backed_context()
    holder = DurabilitySemaphore(scheduler=DurabilityScheduler(ctx), limit=2)
    reply = await holder.handle(sync())
    assert reply["error"]["code"] == ConfigurationError.code and reply["error"]["field"] == "migrations", reply
    assert "new_sqlite_classes" in reply["error"]["message"], reply

    class Env:
        BUDGET = type("Ns", (), {"getByName": staticmethod(lambda name: holder)})()

    helper = DurabilitySemaphore.client(binding="BUDGET", invoke="handle").with_(retry(5))
    with pytest.raises(ConfigurationError) as err:  # the client raises it, never retried
        await helper.request(Env(), "k", sync())
    assert err.value.field == "migrations" and "new_sqlite_classes" in str(err.value)
    assert str(err.value).startswith("env.BUDGET (holder 'k'): "), err.value


def test_storage_without_sql_is_a_configuration_error_naming_the_migration():
    ctx = LocalContext(name="holder")
    ctx.storage = type("KvStorage", (), {})()  # no .sql at all
    with pytest.raises(ConfigurationError) as err:
        Storage(ctx)
    assert str(err.value) == NOT_SQLITE and err.value.field == "migrations"
    with pytest.raises(ConfigurationError):
        Storage(kv_backed_context()).exec("SELECT 1")


class NoSqlHolder:
    """A holder class as a Worker writes it (``ctx`` kept as ``self.ctx``, as the SDK's
    ``DurableObject`` does), whose migration lists it under ``new_classes``."""

    def __init__(self, ctx: Any, env: Any = None) -> None:
        self.ctx, self.env = ctx, env
        self.scheduler = DurabilityScheduler(ctx)
        self.semaphore = DurabilitySemaphore(scheduler=self.scheduler, limit=2)

    async def permits(self, message: Any) -> dict:
        return await self.semaphore.handle(message)


class KvExports:
    """A client class whose storage has no ``sql`` at all."""

    def __init__(self, ctx: Any, env: Any = None) -> None:
        self.ctx, self.env = ctx, env
        self.scheduler = DurabilityScheduler(ctx)


@async_test
async def test_the_error_names_the_durable_object_class_without_sqlite_and_the_client_the_binding():
    holder = NoSqlHolder(kv_backed_context())
    reply = await holder.permits(sync())
    named = "the Durable Object class NoSqlHolder has no SQLite storage: list NoSqlHolder under new_sqlite_classes"
    assert reply["error"]["message"].startswith(named) and reply["error"]["field"] == "migrations", reply

    class Env:
        BUDGET = type("Ns", (), {"getByName": staticmethod(lambda name: holder)})()

    helper = DurabilitySemaphore.client(binding="BUDGET", invoke="permits")
    with pytest.raises(ConfigurationError) as err:  # the binding (client side) and the class (holder side)
        await helper.request(Env(), "k", sync())
    assert str(err.value).startswith(f"env.BUDGET (holder 'k'): {named}"), err.value

    ctx = LocalContext(name="acme/e1")
    ctx.storage = type("KvStorage", (), {})()  # no .sql: refused when the object is constructed
    with pytest.raises(ConfigurationError) as err:
        KvExports(ctx)
    assert str(err.value).startswith("the Durable Object class KvExports has no SQLite storage: list KvExports "
                                     "under new_sqlite_classes"), err.value
    assert err.value.field == "migrations"


class NotAHolder:
    """A Durable Object class that is not a holder (no ``permits`` method)."""

    async def status(self, job: str) -> dict:
        return {"job": job}


@async_test
async def test_a_waiting_permit_fails_at_once_when_the_binding_is_not_a_holder():
    clock = SimClock(T0)

    class Env:
        BUDGET = type("Ns", (), {"getByName": staticmethod(lambda name: NotAHolder())})()

    helper = DurabilitySemaphore.client(binding="BUDGET", invoke=lambda stub, message: stub.permits(message))
    side = ClientSide("c1", clock, helper.transport(Env()))

    async def permit() -> None:
        async with side.queue.permit("acct", timeout_ms=30_000):
            raise AssertionError("admitted by a class that is not a holder")

    task = side.spawn(permit())
    for _ in range(20):  # no virtual time passes: the first exchange fails, and so does the waiter
        await asyncio.sleep(0)
        if task.done():
            break
    assert task.done(), "permit() kept waiting on a binding whose class is not a holder"
    err = task.exception()
    assert isinstance(err, ConfigurationError) and err.field == "binding" and "env.BUDGET" in str(err), err
    assert clock() == T0


@pytest.mark.parametrize("env, named", [
    (type("Env", (), {})(), "EXPORTS_PER_ACCOUNT"),                      # a var the Worker does not set
    (type("Env", (), {"EXPORTS_PER_ACCOUNT": "two"})(), "'two'"),        # a var that is not an integer
])
@async_test
async def test_r12_a_limit_read_with_env_int_fails_a_waiting_permit_at_once_when_the_var_is_wrong(env, named):
    # R12 decision (misconfigured limit): a limit callable raising ConfigurationError (here
    # semaphore.runtime.env_int's, for a missing or malformed var) answers the round's requests
    # with it: a waiting permit() raises it at once, naming the var, and nothing is charged.
    # Before, the round failed closed (limit_resolution_error) and permit() waited out its timeout.
    from semaphore.runtime import env_int
    from semaphore.testing import HolderSide, Net

    clock = SimClock(T0)
    holder = HolderSide(clock, limit=lambda: env_int(env, "EXPORTS_PER_ACCOUNT"))
    side = ClientSide("c1", clock, Net(holder, clock))

    async def permit() -> None:
        async with side.queue.permit("acct", timeout_ms=60_000):
            raise AssertionError("admitted under a limit that could not be read")

    task = side.spawn(permit())
    await clock.advance(3_000)  # the request's round
    assert task.done(), "permit() kept waiting on a limit that cannot be read"
    err = task.exception()
    assert isinstance(err, ConfigurationError) and err.field == "EXPORTS_PER_ACCOUNT" and named in str(err), err
    assert holder.charged()[0] == 0 and holder.grants() == {}
    usage = await holder.usage()
    assert usage["limit"] is None, usage  # a read shows the limit as unresolved, it does not raise


@async_test
async def test_r12_a_limit_callable_raising_anything_else_still_fails_closed():
    # R12: a ValueError (say a stored override that is junk) is not the application saying it is
    # misconfigured: the round admits nothing, with limit_resolution_error, and waits go on.
    from semaphore.testing import HolderSide, Net

    clock = SimClock(T0)
    holder = HolderSide(clock, limit=lambda: int("oops"))
    side = ClientSide("c1", clock, Net(holder, clock))
    task = side.spawn(side.queue.permit("acct", timeout_ms=60_000).__aenter__())
    await clock.advance(5_000)
    assert not task.done() and side.queue.blocked("acct")["default"].reason.value == "limit_resolution_error"
    task.cancel()


def test_env_int_names_the_var_and_reads_text_vars():
    from semaphore.runtime import env_int

    env = type("Env", (), {"A": " 7 ", "B": "-1"})()
    assert env_int(env, "A") == 7
    for name, words in (("B", "at least 0"), ("C", "has no var 'C'")):
        with pytest.raises(ConfigurationError) as err:
            env_int(env, name)
        assert err.value.field == name and words in str(err.value), err.value


@async_test
async def test_r12_a_misconfigured_limit_of_one_key_fails_only_that_keys_waiting_permits():
    # R12 decision: the ConfigurationError is one key's holder's; a permit waiting on another key,
    # whose holder reads its limit fine, is not failed with it (it was, for every waiter).
    from semaphore.runtime import env_int
    from semaphore.testing import HolderSide, Net

    clock = SimClock(T0)
    holders = {"bad": HolderSide(clock, limit=lambda: env_int(object(), "MISSING")), "good": HolderSide(clock, limit=0)}
    nets = {k: Net(h, clock) for k, h in holders.items()}

    async def transport(key, message):
        return await nets[key](key, message)

    side = ClientSide("c1", clock, transport)
    good = side.spawn(side.queue.permit("good", timeout_ms=60_000).__aenter__())
    await clock.advance(100)
    bad = side.spawn(side.queue.permit("bad", timeout_ms=60_000).__aenter__())
    await clock.advance(3_000)
    assert bad.done() and isinstance(bad.exception(), ConfigurationError)
    assert not good.done(), "a permit of a healthy key failed with another key's ConfigurationError"
    good.cancel()
