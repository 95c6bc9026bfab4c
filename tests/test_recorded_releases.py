"""Tier 1: a finished callback item records its permit's release in its own row (SPEC R35).

When the queue completes a running callback item whose grant (or lease) already has something
to report, the release is written once, in the item's own row (``release_n``: the permit's
``released`` count after it), and the permit's row stays unwritten: one write per completion
instead of two. Every read of the permit's row from SQL counts the recorded releases
(:class:`~semaphore.client._store.ClientRows`), a new instance included, and the purge of
finished items folds them into the permit's row before it deletes them. Nothing is lost: the
holder gets every release back, across evictions and purges.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from semaphore import ItemState, PermitKind
from semaphore.client import SemaphoreClient
from semaphore.client._store import ClientRows
from semaphore.runtime import Storage
from semaphore.testing import T0, ClientSide, HolderSide, Net, SimClock, async_test

KEY = "acct"
GRANTS = "durability_semaphore_client_grants"
ITEMS = "durability_semaphore_client_items"

pytestmark = pytest.mark.usefixtures("quiet_logs")


class Setup:
    """A client object (limit 3, the grant path) whose callback items run until completed."""

    def __init__(self, **queue_options: Any) -> None:
        self.clock = SimClock(T0)
        self.holder = HolderSide(self.clock, limit=3, leases=None)
        self.net = Net(self.holder, self.clock)
        self.side = ClientSide("c1", self.clock, self.net, on_admit=lambda side, item: None, **queue_options)

    def sql(self, query: str, *args: Any) -> list[dict[str, Any]]:
        return [dict(r) for r in Storage(self.side.ctx).exec(query, *args)]

    def grant_released(self) -> list[int]:
        """The ``released`` column of the key's grant rows as SQL holds it (not counting records)."""
        return [int(r["released"]) for r in self.sql(f"SELECT released FROM {GRANTS} WHERE key = ?", KEY)]

    async def running(self, n: int) -> list[str]:
        for i in range(n):
            await self.side.queue.enqueue(KEY, "g", f"i{i}")
        await self.clock.advance(3000)
        running = sorted(i.item_id for i in self.side.queue.items(state=ItemState.RUNNING))
        assert len(running) == n
        return running

    async def completed(self, n: int) -> list[str]:
        """``n`` items run (:meth:`running`), then completed one by one."""
        running = await self.running(n)
        for item_id in running:
            await self.side.queue.complete(item_id)
        return running

    async def outstanding(self) -> int:
        return int((await self.holder.usage())["outstanding"])


@async_test
async def test_a_completion_on_a_permit_with_something_to_report_writes_only_the_items_row():
    # R35: the first release turns the grant dirty (written: its report time moves); the next
    # ones are recorded in the finished items' rows, and the grant's row is not written for them.
    s = Setup()
    running = await s.running(3)
    assert s.grant_released() == [0]
    writes: list[str] = []
    storage = s.side.storage
    inner = storage.sql.exec

    def counted(query: str, *args: Any) -> Any:
        if query.lstrip().upper().startswith(("UPDATE", "INSERT", "DELETE")):
            writes.append(query)
        return inner(query, *args)

    storage.sql.exec = counted
    try:
        await s.side.queue.complete(running[0])
        assert s.grant_released() == [1] and any(GRANTS in w for w in writes)
        writes.clear()
        await s.side.queue.complete(running[1])
        await s.side.queue.complete(running[2])
    finally:
        storage.sql.exec = inner
    assert not any(w.split()[1] == GRANTS for w in writes if w.split()[0].upper() == "UPDATE")
    assert s.grant_released() == [1]  # SQL's own column: the two later releases are recorded
    recorded = s.sql(f"SELECT item_id, release_n FROM {ITEMS} ORDER BY item_id")
    assert [r["release_n"] for r in recorded] == [0, 2, 3]
    (grant,) = s.side.client.grants(KEY)
    assert grant.released == 3  # this instance's copy
    fresh = SemaphoreClient(s.side.ctx, s.side.transport, clock=s.clock, client_id="c1")
    assert [g.released for g in fresh.grants(KEY)] == [3]  # a new instance reads the records
    assert [g.released for g in fresh.grants(KEY, include_gone=True)] == [3]
    await s.clock.advance(15_000)
    assert await s.outstanding() == 0  # all three releases reached the holder


@async_test
async def test_recorded_releases_survive_an_eviction_and_reach_the_holder():
    # R35, I2: the object is evicted after the completions, before the report: the new
    # instance reads the recorded releases back and reports them; none counted twice.
    s = Setup()
    await s.completed(3)
    assert s.grant_released() == [1]
    s.side.evict()
    assert [g.released for g in s.side.client.grants(KEY)] == [3]
    await s.clock.advance(15_000)
    assert await s.outstanding() == 0
    await s.side.queue.enqueue(KEY, "g", "after")  # the freed capacity is there again
    await s.clock.advance(3000)
    assert s.side.queue.item("after").state is ItemState.RUNNING


@async_test
async def test_the_purge_of_finished_items_folds_their_recorded_releases_into_the_permits_row():
    # R35: finished items' rows are deleted (after retention_ms); a release recorded in one is
    # written into its permit's row first, in the same transaction, so no read loses it.
    s = Setup()
    await s.completed(3)
    assert s.grant_released() == [1]
    queue = s.side.queue
    queue.storage.transaction(lambda: queue._items.purge_done(s.clock.now + 1))
    assert s.sql(f"SELECT item_id FROM {ITEMS}") == []
    assert s.grant_released() == [3]  # folded into SQL's own column
    fresh = SemaphoreClient(s.side.ctx, s.side.transport, clock=s.clock, client_id="c1")
    assert [g.released for g in fresh.grants(KEY)] == [3]
    s.side.evict()
    await s.clock.advance(15_000)
    assert await s.outstanding() == 0


@async_test
async def test_deleting_finished_permit_items_keeps_every_item_that_records_a_release():
    # R35: the quick delete of finished permit() items folds nothing, so it deletes no item
    # that records a release (the purge, which folds, deletes those), nor any callback item.
    # (That it skips a permit item recording one: tests/test_queue_item_store.py.)
    s = Setup()
    await s.completed(3)
    queue = s.side.queue
    queue.storage.transaction(lambda: queue._items.delete_done_permits(KEY))
    assert [r["item_id"] for r in s.sql(f"SELECT item_id FROM {ITEMS} ORDER BY item_id")] == ["i0", "i1", "i2"]
    fresh = SemaphoreClient(s.side.ctx, s.side.transport, clock=s.clock, client_id="c1")
    assert [g.released for g in fresh.grants(KEY)] == [3]


@async_test
async def test_a_purge_folds_through_the_finished_items_index_not_every_record():
    # R35: the fold the purge runs reads the purged items through the finished items' index;
    # the records' partial index would walk every record kept (a day of them, by default).
    s = Setup(retention_ms=16_000)
    await s.completed(3)
    plans: list[str] = []
    storage = Storage(s.side.ctx)
    inner = s.side.storage.sql.exec

    def explained(query: str, *args: Any) -> Any:
        if query.startswith("SELECT") and "MAX(release_n)" in query:  # what the purge folds
            plans.extend(str(r["detail"]) for r in storage.exec("EXPLAIN QUERY PLAN " + query, *args))
        return inner(query, *args)

    s.side.storage.sql.exec = explained
    try:
        await s.clock.advance(20_000)
        await s.side.queue.enqueue(KEY, "g", "later")  # a pump after the retention: the purge runs
        await s.clock.advance(100)
    finally:
        s.side.storage.sql.exec = inner
    assert plans and any("_done" in p for p in plans), plans
    assert not any(p.startswith("SCAN") and ITEMS in p for p in plans), plans


@async_test
async def test_a_permit_items_release_is_written_to_its_permits_row():
    # R35: a permit() item's row is deleted soon after it finishes: its release is not
    # recorded, even on a grant with something to report (three permits of one grant).
    s = Setup()
    gate = asyncio.Event()
    inside: list[Any] = []

    async def hold() -> None:
        async with s.side.queue.permit(KEY, "g") as item:
            inside.append(item)
            await gate.wait()

    tasks = [asyncio.ensure_future(hold()) for _ in range(3)]
    await s.clock.advance(3000)
    assert len(inside) == 3 and len({item.permit.id for item in inside}) == 1
    gate.set()
    await asyncio.gather(*tasks)
    assert s.grant_released() == [3]
    assert s.sql(f"SELECT item_id FROM {ITEMS} WHERE release_n > 0") == []


@async_test
async def test_a_lease_items_recorded_releases_survive_an_eviction_and_reach_the_holder():
    # R35 with the default leases: releases of drawn permits are recorded the same way.
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=3)
    side = ClientSide("c1", clock, Net(holder, clock), on_admit=lambda side, item: None)
    for i in range(3):
        await side.queue.enqueue(KEY, "g", f"i{i}")
    await clock.advance(3000)
    running = sorted(i.item_id for i in side.queue.items(state=ItemState.RUNNING))
    assert running and all(i.permit is not None and i.permit.kind == PermitKind.LEASE
                           for i in side.queue.items(state=ItemState.RUNNING))
    for item_id in running:
        await side.queue.complete(item_id)
    recorded = [r["release_n"] for r in Storage(side.ctx).exec(f"SELECT release_n FROM {ITEMS} WHERE release_n > 0")]
    assert recorded  # some releases live in the items only
    side.evict()
    assert sum(x.released for x in side.client.leases(KEY, include_settled=True)) == len(running)
    await clock.advance(60_000)
    usage = await holder.usage()  # long before the lease's expiry (30 minutes): returned, all released
    assert (usage["outstanding"], usage["leaseFootprint"], usage["liveLeases"]) == (0, 0, 0)


@async_test
async def test_the_retention_purge_folds_releases_the_holder_has_not_received():
    # R35, R37: the holder is unreachable, so the grant's row stays behind its records; the
    # pump's purge (after 17/16 of retention_ms) deletes the items and folds their releases
    # into the row first; once the holder is back, it gets all of them.
    from semaphore import HolderUnavailableError

    s = Setup(retention_ms=16_000)
    running = await s.running(3)
    down = {"on": True}

    def unreachable(key: str, message: dict) -> Any:
        if down["on"]:
            raise HolderUnavailableError("down")
        return None

    s.net.intercept = unreachable
    for item_id in running:
        await s.side.queue.complete(item_id)
    assert s.grant_released() == [1]
    await s.clock.advance(20_000)
    await s.side.queue.enqueue(KEY, "g", "later")  # a pump after the retention: the purge runs
    await s.clock.advance(1000)
    assert s.sql(f"SELECT item_id FROM {ITEMS} WHERE item_id IN ('i0', 'i1', 'i2')") == []
    assert s.grant_released() == [3]  # folded before the delete
    s.side.evict()
    down["on"] = False
    await s.clock.advance(30_000)
    await s.side.queue.complete("later")
    await s.clock.advance(30_000)
    assert await s.outstanding() == 0


@async_test
async def test_naming_the_records_table_reloads_a_key_read_before_it():
    # R35: a store that loaded a key before it knew of the records reads the key again.
    s = Setup()
    await s.completed(3)
    rows = ClientRows(Storage(s.side.ctx))
    assert [g.released for g in rows.grants(KEY)] == [1]  # the row alone
    rows.records_releases_in(ITEMS)
    assert [g.released for g in rows.grants(KEY)] == [3]
