"""Completing many items at once (:meth:`SemaphoreQueue.complete_many`, SPEC R35, R37): each item
completed as :meth:`complete` completes it, in one transaction, with one write for the items
whose release needs no record and one per permit for the others; what a batch records is what the
holder gets back, also after an eviction and after a purge; a bad batch is refused whole."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from semaphore import ConfigurationError, ItemState, QueueItem
from semaphore.testing import T0, ClientSide, HolderSide, Net, SimClock, async_test

KEY = "acct"


class Setup:
    def __init__(self, **holder_options: Any) -> None:
        self.clock = SimClock(T0)
        self.holder = HolderSide(self.clock, limit=100, **holder_options)
        self.admitted: list[QueueItem] = []
        self.side = ClientSide("c1", self.clock, Net(self.holder, self.clock),
                               on_admit=lambda _side, item: self.admitted.append(item))

    async def run_until(self, done: Any, within_ms: int) -> None:
        end = self.clock.now + within_ms
        await self.clock.settle()
        while not done():
            t = self.clock.next_event()
            assert t is not None and t <= end, f"not done within {within_ms} ms"
            await self.clock.advance_to(t)

    async def admit(self, ids: list[str]) -> None:
        await self.side.queue.enqueue_many(KEY, "g", ids)
        await self.run_until(lambda: len({i.item_id for i in self.admitted}) == len(ids), 30_000)


@contextlib.contextmanager
def item_updates(side: ClientSide) -> Iterator[list[str]]:
    """The UPDATE statements of the items table ``side``'s storage runs meanwhile."""
    statements: list[str] = []
    sql = side.storage.sql
    inner = sql.exec

    def counted(query: str, *bindings: Any) -> Any:
        if query.lstrip().upper().startswith("UPDATE DURABILITY_SEMAPHORE_CLIENT_ITEMS"):
            statements.append(query)
        return inner(query, *bindings)

    sql.exec = counted  # type: ignore[method-assign]
    try:
        yield statements
    finally:
        sql.exec = inner  # type: ignore[method-assign]


@pytest.mark.parametrize("leases", ["default", "none"])
@async_test
async def test_complete_many_completes_each_item_in_one_write_per_permit_and_the_holder_gets_all_back(leases):
    # R35, R37: 100 items (under the default leases: a 64-permit lease and one more permit for
    # the rest; without leases: grants), completed in one call, a few writes of the items table
    # instead of one per item; every permit goes back to the holder.
    s = Setup(**({} if leases == "default" else {"leases": None}))
    ids = [f"i{n:03}" for n in range(100)]
    await s.admit(ids)
    await s.side.queue.complete("i000")  # finished already: False below
    with item_updates(s.side) as updates:
        done = await s.side.queue.complete_many([*ids, "unknown"])
    assert done == [False, *[True] * 99, False]
    permits = {(i.permit.kind, i.permit.id) for i in s.side.queue.items(KEY) if i.permit and i.item_id != "i000"}
    assert len(updates) <= 1 + len(permits), updates  # the unrecorded ones, and one per permit
    assert all(s.side.queue.item(i).state is ItemState.DONE for i in ids)
    await s.run_until(lambda: s.holder.charged()[0] == 0, 30_000)
    for lease in s.side.client.leases(KEY):
        assert lease.released == lease.drawn, lease  # every drawn slot released, none twice


@async_test
async def test_what_a_batch_records_is_reported_by_the_next_instance_and_survives_the_purge():
    # R35: the batch records its releases in the items' rows (the lease's row unwritten);
    # evicted before reporting, the next instance reads the lease's released count from them,
    # and once the items are purged from the lease's row, into which the purge folded them.
    s = Setup()
    ids = [f"i{n:02}" for n in range(30)]
    await s.admit(ids)
    await s.side.queue.complete("i00")  # the lease's row now has something to report: the rest record
    await s.side.queue.complete_many(ids[1:])
    (lease,) = s.side.client.leases(KEY)
    assert lease.released == 30
    s.side.evict()
    assert s.side.client.lease(KEY, lease.lease_id).released == 30  # read from SQL by a new instance
    s.side.queue.retention_ms = 16
    await s.run_until(lambda: s.holder.charged()[0] == 0, 15_000)  # before the lease could expire
    await s.side.queue.enqueue(KEY, "g", "later")  # a pump: the finished items are purged
    await s.clock.advance(2000)
    assert s.side.queue.item("i05") is None
    s.side.evict()
    after = s.side.client.lease(KEY, lease.lease_id)  # settled: a tombstone, read from SQL
    assert after is not None and (after.released, after.status) == (30, "settled")


@pytest.mark.parametrize("item_ids, field, words", [
    ("abc", "item_ids", "expected a list of item ids, got str"),
    (["a", "b", "a"], "item_ids[2]", "given twice"),
    (["a", "b\x00c"], "item_ids[1]", "control character"),
    ([f"i{n}" for n in range(10_001)], "item_ids", "10001 items, over the 10000"),
], ids=["a string", "an id twice", "an id outside the alphabet", "over 10,000 items"])
@async_test
async def test_complete_many_refuses_a_bad_batch_naming_the_field_and_completes_nothing(item_ids, field, words):
    # R37, R7: every id is checked before anything is written.
    s = Setup()
    await s.admit(["a", "b"])
    with pytest.raises(ConfigurationError) as refused:
        await s.side.queue.complete_many(item_ids)
    assert refused.value.field == field and words in str(refused.value), str(refused.value)
    assert [i.state for i in s.side.queue.items(KEY)] == [ItemState.RUNNING] * 2
    assert await s.side.queue.complete_many([]) == []


@async_test
async def test_complete_many_refuses_an_item_of_a_running_permit_call():
    # R37: a permit() item is completed when its caller leaves the block, never by complete().
    s = Setup()
    await s.admit(["a"])
    async with s.side.queue.permit(KEY, "g") as permit:
        with pytest.raises(ConfigurationError) as refused:
            await s.side.queue.complete_many(["a", permit.item_id])
        assert refused.value.field == "item_ids[1]"
    assert s.side.queue.item("a").state is ItemState.RUNNING
