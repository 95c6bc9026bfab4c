"""Tier 1: ``migrate(ctx, None)`` of the client side and of the holder leaves no timer behind
that would run over dropped tables (SPEC R3, read for the client side too: a component's
``migrate(ctx, None)`` removes its tables AND its scheduler entries).

Found: ``SemaphoreQueue.migrate(ctx, None)`` dropped the queue's and the client's tables but left
the queue's wake timer (``durability_semaphore_queue:wake``) in the scheduler's table, so the next
alarm ran the queue's wake-up over the dropped tables ("no such table") on a live instance, and on
a fresh instance re-created the dropped tables.

Decision: the scheduler's own table ``durability_scheduler_timers`` stays (like
``DurabilitySemaphore.migrate``, which leaves it too): it is shared with the holder and the
application, and a live scheduler instance keeps using it. ``DurabilityScheduler.migrate(ctx,
None)`` drops it, for a full uninstall.
"""

from __future__ import annotations

import pytest

from semaphore import DurabilityScheduler, DurabilitySemaphore, SemaphoreClient, SemaphoreQueue
from semaphore.testing import (
    RECLAIM_TIMER,
    T0,
    Bed,
    ClientSide,
    HolderSide,
    Net,
    SimClock,
    async_test,
    request,
    tables,
    timers,
)

KEY = "acct"
APP_TIMER = "app:cleanup"


pytestmark = pytest.mark.usefixtures("quiet_logs")  # failures are injected on purpose


def client_side_tables(storage) -> set[str]:
    return {t for t in tables(storage) if t.startswith("durability_semaphore_client")}


async def queue_in_use(limit: int = 2):
    """A client object whose queue has admitted work and has a wake-up pending, plus an
    application timer and a holder-style timer on the same scheduler."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=limit, leases=None)  # grants: its pumps touch the tables after migrate
    side = ClientSide("c1", clock, Net(holder, clock), on_admit=lambda side, item: None)
    side.scheduler.on(APP_TIMER, lambda name, due: None)
    await side.scheduler.schedule(APP_TIMER, T0 + 3_600_000)
    for i in range(3):
        await side.queue.enqueue(KEY, "g", f"item{i}")
    await clock.advance(6_000)
    side.driver.close()   # from here on the test delivers the client's alarm itself
    while side.driver.task is not None and not side.driver.task.done():
        await clock.advance(10)   # let the wake-up in flight finish its holder round
    await side.queue.enqueue(KEY, "g", "late")   # pumped in the background, a wake-up pending
    assert {i.state.value for i in side.queue.items(KEY)} == {"running", "queued"}
    assert side.scheduler.due_times()[SemaphoreQueue.TIMER] > clock.now   # its participant
    assert SemaphoreQueue.TIMER not in timers(side.storage)   # no timer row mirrors it
    assert client_side_tables(side.storage) >= {
        "durability_semaphore_client_items", "durability_semaphore_client_wakeups"}
    return clock, side


@async_test
async def test_r3_queue_migrate_none_removes_its_tables_and_its_wake_timer():
    # R3: after SemaphoreQueue.migrate(ctx, None) no table of the queue (or its client) and no
    # queue timer is left; other timers and the scheduler's table stay.
    clock, side = await queue_in_use()
    side.scheduler.set_timer(RECLAIM_TIMER, T0 + 7_200_000)   # an object that is a holder too
    # The queue's row in the scheduler's table: the backoff of a failing wake-up (attempts >= 1).
    side.scheduler.storage.exec("INSERT INTO durability_scheduler_timers(name, due_at, attempts)"
                                " VALUES (?, ?, 2)", SemaphoreQueue.TIMER, clock.now + 2_000)
    assert side.scheduler.due_times()[SemaphoreQueue.TIMER] == clock.now + 2_000
    SemaphoreQueue.migrate(side.ctx, None)
    assert client_side_tables(side.storage) == set()
    assert timers(side.storage) == {APP_TIMER: T0 + 3_600_000, RECLAIM_TIMER: T0 + 7_200_000}
    assert "durability_scheduler_timers" in tables(side.storage)
    # The live queue answers the scheduler from its copy of the wake times (no SQL per arm), so
    # its wake-up may still be due once; that run finds the table gone, forgets the copy and
    # creates nothing: from then on its participant is never due over the dropped table.
    assert set(side.scheduler.due_times()) <= {APP_TIMER, RECLAIM_TIMER, SemaphoreQueue.TIMER}
    clock.set(max(clock.now, side.scheduler.due_times().get(SemaphoreQueue.TIMER, clock.now)))
    await side.scheduler.alarm({})
    assert side.scheduler.due_times() == {APP_TIMER: T0 + 3_600_000, RECLAIM_TIMER: T0 + 7_200_000}
    assert client_side_tables(side.storage) == set()
    assert timers(side.storage) == {APP_TIMER: T0 + 3_600_000, RECLAIM_TIMER: T0 + 7_200_000}


@async_test
async def test_r3_after_queue_migrate_none_the_next_alarm_neither_fails_nor_recreates_tables():
    # R3: the alarm that was armed for the queue's wake-up still comes; neither the live
    # scheduler instance nor a fresh one (after eviction) may fail on it ("no such table"), and
    # none may re-create the dropped tables.
    clock, side = await queue_in_use()
    SemaphoreQueue.migrate(side.ctx, None)
    clock.set(clock.now + 1_000)   # the queue's wake-up is due (no driver runs it)
    await side.scheduler.alarm({})   # live instance: must not raise
    assert client_side_tables(side.storage) == set()
    side.evict()   # fresh scheduler + client + queue over the same storage
    await side.scheduler.alarm({})
    assert client_side_tables(side.storage) == set()
    assert timers(side.storage) == {APP_TIMER: T0 + 3_600_000}
    assert side.scheduler.due_times() == {APP_TIMER: T0 + 3_600_000}
    assert side.storage.alarm == T0 + 3_600_000   # re-armed for what is left
    # Idempotent, also on a storage that never had any of it.
    SemaphoreQueue.migrate(side.ctx, None)
    SemaphoreQueue.migrate(ClientSide("c2", clock, side.transport, on_admit=lambda s, i: None).ctx, None)


@async_test
async def test_r3_queue_migrate_then_fresh_queue_starts_from_scratch():
    # R3, R37: after migrate(None) a new queue recreates its schema on first use and works.
    clock, side = await queue_in_use(limit=10)
    SemaphoreQueue.migrate(side.ctx, None)
    side.evict()
    side.driver = type(side.driver)(clock, side.storage, side.alarm)   # the closed one's successor
    admitted = []
    side.on_admit = lambda s, item: admitted.append(item.item_id)
    await side.queue.enqueue(KEY, "g", "fresh")
    await clock.advance(6_000)
    assert admitted == ["fresh"]


@async_test
async def test_r3_client_and_holder_migrate_none_leave_no_timer_that_runs_over_dropped_tables():
    # R3: SemaphoreClient owns no timer; DurabilitySemaphore.migrate removes its reclaim timer,
    # so a fresh holder's alarm does not re-create its tables either.
    clock, side = await queue_in_use()
    before = timers(side.storage)
    SemaphoreClient.migrate(side.ctx, None)
    assert timers(side.storage) == before   # nothing of the client's in the scheduler

    bed = Bed(limit=5)
    await bed.one(request("a", {"g": 2}))
    assert RECLAIM_TIMER in bed.scheduler.due_times()
    bed.driver.close()
    DurabilitySemaphore.migrate(bed.ctx, None)
    assert RECLAIM_TIMER not in timers(bed.storage)
    bed.clock.set(bed.clock.now + 60_000)   # the reclaim would be due
    bed.evict()
    await bed.scheduler.alarm({})
    assert not any(t.startswith("durability_semaphore") for t in tables(bed.storage))


@async_test
async def test_r1_scheduler_migrate_none_drops_its_table_for_a_full_uninstall():
    # R1, R3: once every component is migrated away, DurabilityScheduler.migrate(ctx, None)
    # removes the last durability_ table; a fresh scheduler recreates it on first use.
    clock, side = await queue_in_use()
    SemaphoreQueue.migrate(side.ctx, None)
    DurabilityScheduler.migrate(side.ctx, None)
    assert not any(t.startswith("durability_") for t in tables(side.storage))
    fresh = DurabilityScheduler(side.ctx, clock=clock)
    await fresh.alarm({})
    assert fresh.earliest() is None and side.storage.alarm is None


@async_test
async def test_r3_an_alarm_after_the_scheduler_is_migrated_away_deletes_itself_and_creates_nothing():
    # R3: after DurabilityScheduler.migrate(ctx, None) the object's alarm may still be set (the
    # migration is synchronous SQL). When it fires, the live instance (which an object keeps from
    # its constructor) must neither fail with "no such table" nor re-create the table; a fresh
    # instance neither. The alarm is deleted.
    clock, side = await queue_in_use()
    live = side.queue.scheduler
    SemaphoreQueue.migrate(side.ctx, None)
    DurabilityScheduler.migrate(side.ctx, None)
    await side.storage.setAlarm(clock.now)
    await live.alarm({})
    assert side.storage.alarm is None
    assert not any(t.startswith("durability_") for t in tables(side.storage))
    await side.storage.setAlarm(clock.now)
    await DurabilityScheduler(side.ctx, clock=clock).alarm({})
    assert side.storage.alarm is None
    assert not any(t.startswith("durability_") for t in tables(side.storage))


@async_test
async def test_r3_a_pump_of_the_live_queue_after_migrate_none_is_skipped_without_an_error(caplog):
    # R3, R37 wake-ups: an enqueue pumps its key in the background; when migrate(ctx, None) drops
    # the tables before that pump runs, the live instance's pump finds them gone. It stops there,
    # logged at INFO, with no ERROR ("no such table") and no wake-up written (nothing re-created).
    import logging

    clock, side = await queue_in_use()
    await clock.advance(1_000)
    await side.queue.drain()   # no pump of the key runs now
    await side.queue.enqueue(KEY, "g", "after")   # its pump is kicked: it runs at the next yield
    SemaphoreQueue.migrate(side.ctx, None)
    logging.disable(logging.NOTSET)   # this test reads the log
    with caplog.at_level(logging.INFO, logger="semaphore"):
        await clock.advance(1_000)
        await side.queue.drain()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert any("tables are gone" in r.getMessage() for r in caplog.records), caplog.records
    assert client_side_tables(side.storage) == set()


@async_test
async def test_r3_a_side_request_in_flight_at_migrate_none_stops_without_an_error(caplog):
    # R3: a request sent beside the key's waiting one (request_wait_ms, a try) that fails because
    # migrate(ctx, None) dropped the tables meanwhile is logged at INFO, not as an ERROR.
    import logging

    from semaphore import Demand

    clock, side = await queue_in_use()
    await clock.advance(1_000)
    await side.queue.drain()
    SemaphoreQueue.migrate(side.ctx, None)
    logging.disable(logging.NOTSET)   # this test reads the log
    with caplog.at_level(logging.INFO, logger="semaphore"):
        await side.queue._side_request(KEY, [Demand("g", 1, clock.now)], set())
        await clock.advance(1_000)
        await side.queue.drain()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert any(r.getMessage().startswith("side request") and "tables are gone" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert client_side_tables(side.storage) == set()
