"""Completing many items at once (:meth:`SemaphoreQueue.complete_many`, SPEC R35, R37): each item
completed as :meth:`complete` completes it, in one transaction, with one write for the items
whose release needs no record and one per permit for the others; what a batch records is what the
holder gets back, also after an eviction and after a purge; a bad batch is refused whole."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from semaphore import ConfigurationError, ItemState, QueueItem
from semaphore.testing import SEED_TIMING, T0, ClientSide, HolderSide, Net, SimClock, async_test
from sql_counting import statements

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


def item_updates(side: ClientSide) -> contextlib.AbstractContextManager[list[str]]:
    """The UPDATE statements of the items table ``side``'s storage runs meanwhile."""
    return statements(side, "UPDATE durability_semaphore_client_items")


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


def _released_by_permit(side: ClientSide) -> dict[tuple[str, str], int]:
    return {**{("lease", x.lease_id): x.released for x in side.client.leases(KEY, include_settled=True)},
            **{("grant", g.grant_id): g.released for g in side.client.grants(KEY, include_gone=True)}}


@pytest.mark.parametrize("leases", ["default", "none"])
@async_test
async def test_a_partial_batch_over_several_permits_releases_exactly_its_items(leases):
    # R35: each permit's items record that permit's own highest count, never another's (a
    # count read back is clamped to the permit's claimed or drawn count, so a wrong one would
    # free permits still in use), also read back from SQL by a new instance.
    s = Setup(**({} if leases == "default" else {"leases": None}))
    ids = [f"i{n:03}" for n in range(100)]
    await s.admit(ids[:50])
    await s.side.queue.enqueue_many(KEY, "g", ids[50:])  # a second exchange: another permit
    await s.run_until(lambda: len({i.item_id for i in s.admitted}) == 100, 30_000)
    by_permit: dict[tuple[str, str], list[str]] = {}
    for item in s.side.queue.items(KEY):
        assert item.permit is not None
        by_permit.setdefault((item.permit.kind.value, item.permit.id), []).append(item.item_id)
    assert len(by_permit) >= 2, by_permit
    for items in by_permit.values():  # each permit's row now has something to report: the rest record
        await s.side.queue.complete(items[0])
    big = max(by_permit, key=lambda p: len(by_permit[p]))
    batch = [i for p, items in by_permit.items() for i in (items[1:21] if p == big else items[1:2])]
    await s.side.queue.complete_many(batch)
    expected = {p: (21 if p == big else min(2, len(items))) for p, items in by_permit.items()}
    assert _released_by_permit(s.side) == expected
    s.side.evict()
    assert _released_by_permit(s.side) == expected


@pytest.mark.parametrize("evicted", [False, True], ids=["alive", "evicted at once"])
@async_test
async def test_complete_many_over_two_keys_pumps_both_at_once(evicted):
    # R37 (wake-ups), R34a: every key of the batch is pumped by this instance at once, so each
    # holder gets its releases now, not at the key's fallback wake-up; and each key's durable
    # wake-up is due within the fallback (KICK_FALLBACK_MS), so an instance that dies before
    # its pumps ran leaves both to the next one then.
    from semaphore.client._queue_pump import KICK_FALLBACK_MS

    clock = SimClock(T0)
    holders = {k: HolderSide(clock, limit=10) for k in ("k1", "k2")}  # the default leases: an idle one goes back at once
    nets = {k: Net(h, clock) for k, h in holders.items()}
    admitted: list[str] = []

    async def route(key: str, message: dict[str, Any]) -> Any:
        return await nets[key](key, message)

    side = ClientSide("c1", clock, route, on_admit=lambda _s, i: admitted.append(i.item_id))
    await side.queue.enqueue_many("k1", "g", ["a", "b"])
    await side.queue.enqueue_many("k2", "g", ["x0", "x1"])
    await clock.settle()
    while len(set(admitted)) < 4:
        t = clock.next_event()
        assert t is not None and t < T0 + 30_000
        await clock.advance_to(t)
    await clock.advance(3000)
    assert {k: h.charged()[0] for k, h in holders.items()} == {"k1": 2, "k2": 2}
    assert await side.queue.complete_many(["a", "x0", "b", "x1"]) == [True] * 4
    if evicted:
        side.evict()  # its background pumps die with it
        await clock.advance(KICK_FALLBACK_MS + 2000)
    else:
        await clock.advance(1000)  # well before the fallback wake-up
    assert {k: h.charged()[0] for k, h in holders.items()} == {"k1": 0, "k2": 0}
    side.driver.close()
    for h in holders.values():
        h.driver.close()


@pytest.mark.usefixtures("quiet_logs")
@async_test
async def test_every_on_done_hook_of_a_batch_runs_and_an_awaitable_one_raises_after_all():
    # R37 (on_done): each hook in its own transaction, as complete() runs it; one that raises
    # is left to the pump, one that returns an awaitable is misuse, raised after every hook ran.
    ran: list[str] = []

    async def later() -> None:
        pass

    def on_done(item: QueueItem) -> Any:
        ran.append(item.item_id)
        if item.item_id == "b":
            return later()
        if item.item_id == "c":
            raise RuntimeError("boom")
        return None

    s = Setup()
    s.side.queue.on_done = on_done
    await s.admit(["a", "b", "c", "d"])
    with pytest.raises(ConfigurationError, match="on_done"):
        await s.side.queue.complete_many(["a", "b", "c", "d"])
    assert ran == ["a", "b", "c", "d"]
    assert all(s.side.queue.item(i).state is ItemState.DONE for i in "abcd")


@pytest.mark.parametrize("how", ["batch", "one by one"])
@async_test
async def test_a_batch_of_claiming_and_running_items_completes_as_one_by_one(how):
    # R15a, R37: a claiming item of the batch is only marked cancelled (its claim resolves
    # later, and it never runs); a running one releases its permit; the holder gets all back.
    from semaphore import HolderUnavailableError

    s = Setup(leases=None, **SEED_TIMING)
    await s.admit(["r1", "r2"])
    lost = {"n": 0}

    def lose_a_confirming_sync(key: str, message: dict[str, Any]) -> None:
        if message["type"] == "sync" and message["grants"] and lost["n"] < 1:
            lost["n"] += 1
            raise HolderUnavailableError("lost")
        return None

    s.side.transport.intercept = lose_a_confirming_sync
    await s.side.queue.enqueue_many(KEY, "g", ["c1", "c2"])
    await s.run_until(lambda: all(s.side.queue.item(i).state is ItemState.CLAIMING for i in ("c1", "c2")), 20_000)
    ids = ["c1", "r1", "c2", "r2"]
    done = await s.side.queue.complete_many(ids) if how == "batch" else \
        [await s.side.queue.complete(i) for i in ids]
    assert done == [True] * 4
    assert s.side.queue.item("c1").state is ItemState.CLAIMING  # cancelled, its claim still to resolve
    await s.run_until(lambda: all(i.state is ItemState.DONE for i in s.side.queue.items(KEY)), 30_000)
    await s.run_until(lambda: s.holder.charged()[0] == 0, 60_000)
    assert not [i for i in s.admitted if i.item_id in ("c1", "c2")]


@async_test
async def test_a_batch_of_queued_items_is_one_write():
    # R37: items withdrawn before admission: one write for the batch, not one per item.
    s = Setup()
    ids = [f"q{n}" for n in range(20)]
    await s.side.queue.enqueue_many("other", "g", ids)  # not pumped yet: queued
    with item_updates(s.side) as updates:
        assert await s.side.queue.complete_many(ids) == [True] * 20
    assert len(updates) == 1, updates


@async_test
async def test_complete_many_takes_ten_thousand_ids():
    # R7: the bound is inclusive (10,001 is refused above).
    s = Setup()
    assert await s.side.queue.complete_many([f"u{n}" for n in range(10_000)]) == [False] * 10_000


@async_test
async def test_a_batch_on_a_new_instance_reads_its_items_together():
    # R37: right after an eviction nothing is loaded; the batch's rows are read in one go, not
    # one point read per item.
    s = Setup()
    ids = [f"i{n:03}" for n in range(100)]
    await s.admit(ids)
    s.side.evict()
    s.side.queue.ensure_schema()  # the instance's schema step (once), not the batch's
    s.side.scheduler.ensure_schema()
    before = s.side.storage.statements
    assert await s.side.queue.complete_many(ids) == [True] * 100
    assert s.side.storage.statements - before <= 15, s.side.storage.statements - before


@async_test
async def test_a_batch_purged_before_any_report_is_folded_into_its_permits_row():
    # R35: the holder unreachable, nothing writes the lease's row after the batch; a new
    # instance's purge of the finished items folds their highest recorded release into it.
    from semaphore import HolderUnavailableError
    from semaphore.client._store import LEASES

    def unreachable(key: str, message: dict[str, Any]) -> None:
        raise HolderUnavailableError("down")

    s = Setup()
    ids = [f"i{n:02}" for n in range(30)]
    await s.admit(ids)
    await s.side.queue.complete("i00")  # the lease's row has something to report: the rest record
    s.side.transport.intercept = unreachable
    await s.side.queue.complete_many(ids[1:])
    s.side.evict()

    def stored() -> list[int]:  # the row's own column, as SQL holds it
        return [int(r["released"]) for r in s.side.storage.sql.exec(f"SELECT released FROM {LEASES}")]

    assert stored()[0] < 30
    s.side.queue.retention_ms = 16
    await s.clock.advance(100)
    await s.side.queue.pump(KEY)
    assert s.side.queue.item("i05") is None  # purged
    assert stored() == [30]
