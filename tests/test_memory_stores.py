"""The queue over the in-memory twins of its stores (:class:`semaphore.testing.MemoryStores`):
a client object of the test kit made with ``stores="memory"`` keeps its client's rows and its
queue's items and marks there, not in SQLite; the twins commit and roll back with the object's
transactions (:meth:`LocalStorage.keep_in_step`); and a seeded run of the fault simulation and of
the soak sends exactly the same messages over the twins as over the SQL stores (SPEC R35, R37:
each SQL store answers the queue as its twin does, under evictions, lost, repeated and reordered
messages). ``scripts/traffic_digest.py --stores memory`` runs the same comparison over 60 seeds."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from semaphore import ItemState
from semaphore.client._item_store import ITEMS
from semaphore.client._queue_store import BLOCKED, PENDING, WAKEUPS
from semaphore.client._store import GRANTS, KEYS, LEASES
from semaphore.simulate.faults import FAULT_CONFIGS, Config, Sim, Stats
from semaphore.simulate.soak import SoakConfig, SoakSim
from semaphore.testing import (
    T0,
    ClientSide,
    HolderSide,
    LocalStorage,
    MemoryStores,
    Net,
    SimClock,
    StorageFault,
    dump,
)

pytestmark = pytest.mark.usefixtures("quiet_logs")  # faults are injected on purpose


async def _one_life(stores: str) -> tuple[ClientSide, list[str]]:
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=10)
    admitted: list[str] = []
    side = ClientSide("c1", clock, Net(holder, clock), stores=stores,
                      on_admit=lambda _side, item: admitted.append(item.item_id))
    await side.queue.enqueue_many("acct", "g", ["a", "b", "c"])
    while len(admitted) < 3:
        await clock.settle()
        t = clock.next_event()
        assert t is not None and t < T0 + 60_000, "the items were not admitted"
        await clock.advance_to(t)
    await side.queue.complete("a")
    await clock.settle()
    holder.driver.close()
    side.driver.close()
    return side, admitted


def test_a_queue_made_over_memory_keeps_its_rows_there_and_none_in_sql():
    # R35, R37
    side, admitted = asyncio.run(_one_life("memory"))
    assert sorted(admitted) == ["a", "b", "c"]
    assert side.memory is not None
    tables = dump(side.storage)
    for table in (ITEMS, GRANTS, LEASES, KEYS, WAKEUPS, PENDING, BLOCKED):
        assert tables.get(table, []) == [], table  # the SQL tables exist, and stay empty
    assert {r["item_id"] for r in side.memory.items.rows("acct")} >= {"b", "c"}
    assert side.queue.item("a") is not None and side.queue.item("a").state.value == "done"
    assert side.client.keys() == ["acct"]  # read through the client: its rows are the twin's
    sql_side, _ = asyncio.run(_one_life("sql"))
    assert sql_side.memory is None and dump(sql_side.storage)[ITEMS]  # the default: SQL


def test_a_client_object_refuses_an_unknown_kind_of_stores():
    with pytest.raises(ValueError, match="stores"):
        ClientSide("c1", SimClock(T0), lambda key, msg: asyncio.sleep(0), stores="redis")


@pytest.mark.parametrize("used", ["queue", "client"])
def test_memory_stores_go_to_a_new_queue_only(used: str):
    # a used queue's (or client's) schema step has told the SQL stores where releases are
    # recorded, not these
    side = ClientSide("c1", SimClock(T0), lambda key, msg: asyncio.sleep(0), on_admit=lambda _s, _i: None)
    (side.queue if used == "queue" else side.client).ensure_schema()
    with pytest.raises(RuntimeError, match="used already"):
        MemoryStores().use_in(side.queue)
    side.driver.close()


def test_a_failed_batch_completion_leaves_the_twins_as_they_were():
    # R35, R37: the transaction fails at its commit; the twins are restored with it
    async def go() -> None:
        clock = SimClock(T0)
        holder = HolderSide(clock, limit=5)
        side = ClientSide("c1", clock, Net(holder, clock), stores="memory", on_admit=lambda _s, _i: None)
        await side.queue.enqueue_many("k", "g", ["a", "b"])
        while not all(i.state is ItemState.RUNNING for i in side.queue.items("k")):
            await clock.settle()
            t = clock.next_event()
            assert t is not None and t < T0 + 60_000
            await clock.advance_to(t)
        assert side.memory is not None
        before = side.memory.snapshot()
        side.storage.fail_transaction = lambda: 10**9  # after every statement: at the commit
        with pytest.raises(StorageFault):
            await side.queue.complete_many(["a", "b"])
        side.storage.fail_transaction = None
        assert side.memory.snapshot() == before
        assert side.queue.item("a").state is ItemState.RUNNING
        side.driver.close()
        holder.driver.close()
    asyncio.run(go())


class _Counter:
    """A twin with one value, to see what a transaction keeps of it."""

    def __init__(self) -> None:
        self.value = 0

    def snapshot(self) -> int:
        return self.value

    def restore(self, state: int) -> None:
        self.value = state


def test_twins_kept_in_step_roll_back_with_the_transaction_and_its_savepoints():
    storage = LocalStorage()
    twin = _Counter()
    storage.keep_in_step(twin)

    def inner_fails() -> None:
        twin.value = 2
        raise StorageFault("inner")

    def outer() -> None:
        twin.value = 1
        with pytest.raises(StorageFault):
            storage.transactionSync(inner_fails)  # a savepoint: only its change is undone
        assert twin.value == 1

    storage.transactionSync(outer)
    assert twin.value == 1

    def fails() -> None:
        twin.value = 5
        raise StorageFault("outer")

    with pytest.raises(StorageFault):
        storage.transactionSync(fails)
    assert twin.value == 1
    storage.fail_transaction = lambda: 0  # an injected fault rolls the twin back as well
    with pytest.raises(StorageFault):
        storage.transactionSync(lambda: setattr(twin, "value", 9))
    assert twin.value == 1


def test_memory_stores_snapshot_and_restore_all_three_twins():
    stores = MemoryStores()
    before = stores.snapshot()
    stores.marks.set_wake("k", 5)
    stores.rows.touch_key("k", 1, needs_sync=1)
    assert stores.marks.wake("k") == 5 and stores.rows.key_row("k") is not None
    stores.restore(before)
    assert stores.marks.wake("k") is None and stores.rows.key_row("k") is None
    assert stores.items.before_delete == stores.rows.fold_releases  # wired as the queue wires SQL


def _faults_run(config: Config) -> tuple[list[Any], Any, Stats]:
    async def go() -> tuple[list[Any], Any, Stats]:
        sim = Sim(config)
        await sim.run()
        checks = await sim.final_checks()
        for side in sim.sides:
            side.driver.kill()
        # every check but the list of items the queues still hold, which a purge shortens
        problems = [p for p in checks["problems"] if config.retention_ms is None or not p.startswith("queued items")]
        assert not problems, problems
        return sim.net.sent, dump(sim.holder.storage), sim.stats
    return asyncio.run(go())


#: The named configurations compared (one per lease provisioning kind: none, strict, over).
COMPARED = ("grants-only", "strict", "over")


@pytest.mark.parametrize("variant", ["kept", "purged", "batched"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", COMPARED)
def test_the_fault_simulation_sends_the_same_messages_over_the_twins_as_over_sql(name: str, seed: int,
                                                                               variant: str):
    # R35, R37, I1-I4: evictions, lost/duplicated/reordered messages, lost completions; with
    # finished items kept (a day), or purged 10 s after (their recorded releases folded first;
    # longer than the simulation waits before it enqueues an item again, so no id is forgotten),
    # or completed in batches (complete_many: twice the items, enqueued within 5 s) and purged
    def config(stores: str) -> Config:  # a fresh config each: a run changes its own
        config = dataclasses.replace(FAULT_CONFIGS[name](seed), client_stores=stores,
                                     retention_ms=None if variant == "kept" else 10_000)
        if variant == "batched":
            config = dataclasses.replace(config, batch_completions=True, items=16, enqueue_window_ms=5000)
        return config

    over_sql = _faults_run(config("sql"))
    over_memory = _faults_run(config("memory"))
    if variant == "batched":
        assert over_sql[2].multi_item_batches >= 1, over_sql[2]  # batches of several items were sent
    assert over_memory[0] == over_sql[0]  # every message, in order
    assert over_memory[1] == over_sql[1]  # and the holder's final rows


def _soak_run(config: SoakConfig, soak: type[SoakSim] = SoakSim) -> tuple[list[Any], Any, Any]:
    async def go() -> tuple[list[Any], Any, Any]:
        sim = soak(config)
        await sim.run()
        await sim.finish()
        for side in sim.sides:
            side.driver.kill()
        return sim.net.sent, dump(sim.holder.storage), sim.stats
    return asyncio.run(go())


@pytest.mark.parametrize("mode", ["none", "reuse-held"])
def test_the_soak_sends_the_same_messages_over_the_twins_as_over_sql(mode: str):
    # R35, R37, I1-I5: clock skew, late/duplicated/retried alarms, holder storage faults (the
    # clients' transactions do not fail: where a fault lands depends on how many statements a
    # transaction runs, which differs between SQL and a twin)
    sent, holder, stats = _soak_run(SoakConfig.for_mode(3, mode, ops=150, client_tx_faults=False))
    sent_m, holder_m, stats_m = _soak_run(SoakConfig.for_mode(3, mode, ops=150, client_stores="memory",
                                                              client_tx_faults=False))
    assert sum(stats.violations.values()) == 0 and sum(stats_m.violations.values()) == 0
    assert sent_m == sent
    assert holder_m == holder


class _FaultsAtCommit(SoakSim):
    """The soak with each client storage fault at its transaction's commit (after every
    statement), so the same transactions fail over SQL and over the twins."""

    def _side(self, i: int) -> ClientSide:
        side = super()._side(i)
        tx = side.storage.fail_transaction
        assert tx is not None
        side.storage.fail_transaction = lambda: None if tx() is None else 10**9
        return side


def test_the_soak_with_client_storage_faults_sends_the_same_messages_over_the_twins_as_over_sql():
    # R35, R37, I1-I5: a failed client transaction rolls the twins back as it rolls SQL back
    sent, holder, stats = _soak_run(SoakConfig.for_mode(5, "reuse", ops=150), _FaultsAtCommit)
    sent_m, holder_m, stats_m = _soak_run(SoakConfig.for_mode(5, "reuse", ops=150, client_stores="memory"),
                                          _FaultsAtCommit)
    assert stats.client_tx_failed > 0 and stats_m.client_tx_failed == stats.client_tx_failed
    assert sum(stats.violations.values()) == 0 and sum(stats_m.violations.values()) == 0
    assert sent_m == sent
    assert holder_m == holder


def test_the_soak_over_the_twins_with_client_storage_faults_finds_no_violation():
    # I1-I5 with the clients' transactions failing midway: the twins roll back with them
    config = SoakConfig.for_mode(5, "reuse", ops=150, client_stores="memory")
    _, _, stats = _soak_run(config, SoakSim)
    assert stats.client_tx_failed > 0
    assert sum(stats.violations.values()) == 0, stats.violations
