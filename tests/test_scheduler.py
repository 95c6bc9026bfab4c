"""Tier 1: DurabilityScheduler, named timers multiplexed over the object's single alarm
(SPEC §1 "Scheduler", R1, R16)."""

from __future__ import annotations

import asyncio
import logging

from semaphore import DurabilityScheduler
from semaphore.testing import (
    RECLAIM_TIMER,
    T0,
    AlarmDriver,
    Bed,
    LocalContext,
    VirtualClock,
    async_test,
    request,
    tables,
    timers,
)


def make(ctx=None, clock=None):
    clock = clock or VirtualClock(T0)
    ctx = ctx or LocalContext()
    return ctx, clock, DurabilityScheduler(ctx, clock=clock)


@async_test
async def test_timers_multiplexed_over_one_alarm_earliest_wins():
    ctx, clock, s = make()
    await s.schedule("a", T0 + 300)
    assert ctx.storage.alarm == T0 + 300
    await s.schedule("b", T0 + 100)
    assert ctx.storage.alarm == T0 + 100
    await s.schedule("c", T0 + 200)
    assert ctx.storage.alarm == T0 + 100
    assert (s.timer("a"), s.timer("b"), s.timer("zzz")) == (T0 + 300, T0 + 100, None)
    await s.schedule("b", T0 + 900)   # replacing a time moves the alarm
    assert ctx.storage.alarm == T0 + 200
    await s.cancel("c")
    assert ctx.storage.alarm == T0 + 300
    await s.cancel("a")
    await s.cancel("b")
    assert ctx.storage.alarm is None and timers(ctx.storage) == {}


@async_test
async def test_alarm_runs_due_handlers_in_order_and_rearms():
    ctx, clock, s = make()
    ran = []

    async def async_handler(name, due):
        ran.append((name, due))

    for name in ("x", "y", "z", "later"):
        s.on(name, async_handler if name == "y" else (lambda n, d: ran.append((n, d))))
    await s.schedule("z", T0 + 100)
    await s.schedule("y", T0 + 100)
    await s.schedule("x", T0 + 150)
    await s.schedule("later", T0 + 500)
    clock.set(T0 + 200)
    await s.alarm({"retryCount": 0, "isRetry": False})
    assert ran == [("y", T0 + 100), ("z", T0 + 100), ("x", T0 + 150)]
    assert timers(ctx.storage) == {"later": T0 + 500}
    assert ctx.storage.alarm == T0 + 500


@async_test
async def test_alarm_driver_fires_as_virtual_time_passes():
    ctx, clock, s = make()
    ran = []
    s.on("t", lambda n, d: ran.append(clock.now))
    AlarmDriver(clock, ctx.storage, s.alarm)
    await s.schedule("t", T0 + 1000)
    await clock.advance(999)
    assert ran == []
    await clock.advance(1)
    assert ran == [T0 + 1000] and ctx.storage.alarm is None


@async_test
async def test_handler_may_reschedule_itself():
    ctx, clock, s = make()
    count = []

    def tick(name, due):
        count.append(due)
        if len(count) < 3:
            s.set_timer(name, due + 100)

    s.on("tick", tick)
    AlarmDriver(clock, ctx.storage, s.alarm)
    await s.schedule("tick", T0 + 100)
    await clock.run_until_idle()
    assert count == [T0 + 100, T0 + 200, T0 + 300]
    assert timers(ctx.storage) == {} and ctx.storage.alarm is None


@async_test
async def test_timers_persist_across_a_new_scheduler_instance():
    ctx, clock, s = make()
    await s.schedule("job", T0 + 100)
    s2 = DurabilityScheduler(ctx, clock=clock)   # eviction: same storage, new instance
    assert s2.timer("job") == T0 + 100 and s2.earliest() == T0 + 100
    ran = []
    s2.on("job", lambda n, d: ran.append(n))
    clock.set(T0 + 100)
    await s2.alarm()
    assert ran == ["job"] and s2.timer("job") is None


@async_test
async def test_unknown_due_timers_are_dropped():
    ctx, clock, s = make()
    ran = []
    s.on("known", lambda n, d: ran.append(n))
    await s.schedule("orphan", T0 + 10)
    await s.schedule("known", T0 + 10)
    await s.schedule("orphan-later", T0 + 1000)
    clock.set(T0 + 50)
    await s.alarm()
    assert ran == ["known"]
    assert timers(ctx.storage) == {"orphan-later": T0 + 1000}   # not yet due: kept
    assert ctx.storage.alarm == T0 + 1000


@async_test
async def test_raising_handler_keeps_its_timer_backed_off_others_run_nothing_raised(caplog):
    """A raising handler keeps its timer (moved back by the backoff) and the other due timers
    still run. This used to assert that the first error was re-raised to the runtime, leaving
    the retry to the runtime's alarm backoff; that contract was dropped (SPEC R16): the runtime's
    retries are limited, and once spent no alarm was left, so one failing timer stopped every
    other one (the holder's reclaim). Now alarm() returns normally and re-arms itself."""
    # R16
    ctx, clock, s = make()
    ran = []
    state = {"fail": True}

    def flaky(name, due):
        if state["fail"]:
            raise RuntimeError("flaky")
        ran.append(name)

    s.on("a", flaky)
    s.on("b", lambda n, d: ran.append(n))
    await s.schedule("a", T0 + 10)
    await s.schedule("b", T0 + 20)
    clock.set(T0 + 30)
    with caplog.at_level(logging.ERROR, logger="semaphore.scheduler"):
        await s.alarm()   # does not raise
    assert ran == ["b"]
    assert timers(ctx.storage) == {"a": T0 + 30 + 1000} and s.attempts("a") == 1
    assert ctx.storage.alarm == T0 + 30 + 1000
    (record,) = [r for r in caplog.records if r.name == "semaphore.scheduler"]
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert "'a'" in record.getMessage() and "attempt 1" in record.getMessage()
    # with the driver: the scheduler retries (backoff) until the handler succeeds; the runtime
    # never sees a failure
    driver = AlarmDriver(clock, ctx.storage, s.alarm)
    await clock.advance(1000)
    assert driver.failures == [] and s.attempts("a") == 2
    assert ctx.storage.alarm == clock.now + 2000
    state["fail"] = False
    await clock.run_until_idle()
    assert ran == ["b", "a"] and timers(ctx.storage) == {} and ctx.storage.alarm is None
    assert driver.failures == []


@async_test
async def test_r16_an_always_failing_timer_never_starves_a_later_one():
    # R16: timer "a" always raises; "b" (say the holder's reclaim) is due long after the
    # runtime's alarm retries (6, 2 s doubling: ~2 min) would have been spent. After every
    # alarm() the alarm is still set, "a" backs off exponentially (1 s doubling, capped at
    # 5 min) with its attempts recorded, and "b" runs on time.
    ctx, clock, s = make()
    ran = []

    def broken(name, due):
        raise RuntimeError("always")

    s.on("a", broken)
    s.on("b", lambda n, d: ran.append((n, clock.now)))
    await s.schedule("a", T0)
    b_due = T0 + 30 * 60_000
    await s.schedule("b", b_due)
    delays = []
    logging.disable(logging.CRITICAL)
    try:
        for attempt in range(1, 25):
            clock.set(ctx.storage.alarm)
            await ctx.storage.deleteAlarm()   # the runtime clears the alarm before delivering it
            await s.alarm({})
            assert ctx.storage.alarm is not None, f"no alarm left after alarm() #{attempt}"
            if ran:
                break
            assert s.attempts("a") == attempt
            delays.append(s.timer("a") - clock.now)
            assert ctx.storage.alarm == min(s.timer("a"), b_due)
    finally:
        logging.disable(logging.NOTSET)
    assert delays[:9] == [1000, 2000, 4000, 8000, 16_000, 32_000, 64_000, 128_000, 256_000]
    assert all(d == DurabilityScheduler.BACKOFF_MAX_MS == 300_000 for d in delays[9:])
    assert ran == [("b", b_due)]
    assert set(timers(ctx.storage)) == {"a"} and ctx.storage.alarm == s.timer("a")
    assert DurabilityScheduler.backoff_ms(1) == 1000 and DurabilityScheduler.backoff_ms(10**6) == 300_000


@async_test
async def test_r16_a_timer_that_succeeds_after_failures_resets_its_attempts():
    # R16: attempts count consecutive failures only: a run that returns resets them, so the
    # next failure backs off from 1 s again. Setting the timer meanwhile keeps the count.
    ctx, clock, s = make()
    fails = {"left": 3}
    ran = []

    def flaky(name, due):
        if fails["left"]:
            fails["left"] -= 1
            raise RuntimeError("flaky")
        ran.append(due)
        s.set_timer(name, clock.now + 60_000)   # a periodic job: it re-schedules itself

    s.on("job", flaky)
    AlarmDriver(clock, ctx.storage, s.alarm)
    await s.schedule("job", T0 + 100)
    logging.disable(logging.CRITICAL)
    try:
        await clock.advance(100 + 1000 + 2000)   # runs at +100, +1100, +3100: three failures
        assert s.attempts("job") == 3 and s.timer("job") == clock.now + 4000
        s.set_timer("job", clock.now + 4000)   # re-set by a request: the count stays
        assert s.attempts("job") == 3
        await clock.advance(4000)   # succeeds
        assert ran == [T0 + 100 + 1000 + 2000 + 4000] and s.attempts("job") == 0
        assert s.timer("job") == clock.now + 60_000 == ctx.storage.alarm
        fails["left"] = 1
        await clock.advance(60_000)   # fails again: backs off from 1 s, not 16 s
        assert s.attempts("job") == 1 and s.timer("job") == clock.now + 1000
    finally:
        logging.disable(logging.NOTSET)


@async_test
async def test_r16_a_handler_that_reschedules_itself_later_then_raises_keeps_the_later_time():
    # R16: the backoff never brings a timer earlier than where its handler put it.
    ctx, clock, s = make()

    def later_then_fail(name, due):
        s.set_timer(name, clock.now + 3_600_000)
        raise RuntimeError("after rescheduling")

    s.on("t", later_then_fail)
    await s.schedule("t", T0)
    logging.disable(logging.CRITICAL)
    try:
        await s.alarm({})
    finally:
        logging.disable(logging.NOTSET)
    assert s.timer("t") == T0 + 3_600_000 and s.attempts("t") == 1
    assert ctx.storage.alarm == T0 + 3_600_000


@async_test
async def test_r1_a_timer_table_of_an_earlier_release_is_migrated_in_place():
    # R1: the scheduler's table is versioned by its columns: a table created by an earlier
    # release (name, due_at) gets the attempts column (default 0); its timers survive and run.
    ctx = LocalContext()
    conn = ctx.storage.connection
    conn.execute("CREATE TABLE durability_scheduler_timers (name TEXT PRIMARY KEY, due_at INTEGER NOT NULL)")
    conn.execute("CREATE INDEX durability_scheduler_timers_due ON durability_scheduler_timers(due_at)")
    conn.execute("INSERT INTO durability_scheduler_timers VALUES ('old', ?), ('later', ?)", (T0, T0 + 500))
    clock = VirtualClock(T0)
    s = DurabilityScheduler(ctx, clock=clock)
    assert s.attempts("old") == 0 and s.timer("later") == T0 + 500
    columns = [r[1] for r in conn.execute("PRAGMA table_info(durability_scheduler_timers)")]
    assert columns == ["name", "due_at", "attempts"]
    # an older release writing (name, due_at) only still works against the new table
    conn.execute("INSERT INTO durability_scheduler_timers(name, due_at) VALUES ('legacy', ?)", (T0 + 900,))
    assert s.attempts("legacy") == 0
    ran = []
    s.on("old", lambda n, d: ran.append(n))
    s.on("later", lambda n, d: ran.append(n))
    await s.alarm({})
    assert ran == ["old"] and timers(ctx.storage) == {"later": T0 + 500, "legacy": T0 + 900}
    # idempotent: a second instance (and migrate(ctx, 1)) change nothing
    DurabilityScheduler.migrate(ctx, 1)
    assert DurabilityScheduler(ctx, clock=clock).timer("later") == T0 + 500
    assert [r[1] for r in conn.execute("PRAGMA table_info(durability_scheduler_timers)")] == columns
    DurabilityScheduler.migrate(ctx, None)
    assert "durability_scheduler_timers" not in tables(ctx.storage)


@async_test
async def test_arm_repairs_a_missing_or_stale_alarm():
    ctx, clock, s = make()
    s.set_timer("t", T0 + 700)   # persisted without arming (e.g. evicted before setAlarm)
    assert ctx.storage.alarm is None
    await s.arm()
    assert ctx.storage.alarm == T0 + 700
    await ctx.storage.setAlarm(T0 + 5)   # stale alarm
    await s.arm()
    assert ctx.storage.alarm == T0 + 700
    s.clear_timer("t")
    await s.arm()
    assert ctx.storage.alarm is None


@async_test
async def test_clear_prefix_only_touches_matching_names():
    ctx, clock, s = make()
    for name in ("durability_semaphore:reclaim", "durability_semaphore:x", "app:y", "durability_semaphoreZ"):
        s.set_timer(name, T0 + 1)
    s.clear_prefix("durability_semaphore:")
    assert set(timers(ctx.storage)) == {"app:y", "durability_semaphoreZ"}


def test_a_timer_rescheduled_by_an_earlier_handler_of_the_same_alarm_does_not_run():
    # The due list is read once per alarm; a handler that reschedules (or cancels) another due
    # timer must win: that timer neither runs now nor loses its new time.
    async def main() -> None:
        clock = VirtualClock(1_000)
        ctx = LocalContext()
        sched = DurabilityScheduler(ctx, clock=clock)
        ran: list[str] = []

        async def first(name: str, due: int) -> None:
            ran.append(name)
            sched.set_timer("b", clock.now + 3_600_000)
            sched.set_timer("c", clock.now + 60_000)
            sched.clear_timer("c")

        sched.on("a", first)
        sched.on("b", lambda name, due: ran.append(name))
        sched.on("c", lambda name, due: ran.append(name))
        sched.set_timer("a", 1_000)
        sched.set_timer("b", 1_001)
        sched.set_timer("c", 1_002)
        await clock.advance(10)
        await sched.alarm({})
        assert ran == ["a"]
        assert sched.timer("b") == 1_010 + 3_600_000 and sched.timer("c") is None
        assert await ctx.storage.getAlarm() == 1_010 + 3_600_000

    asyncio.run(main())


@async_test
async def test_r16_holder_reclaim_still_happens_via_the_alarm_when_another_timer_raises():
    # R16: the holder object's scheduler also carries an application timer that always raises.
    # The grant's claimBy (10 min) lies after the runtime's alarm retries (6, from 2 s doubling:
    # ~2 min) would have been spent, so with a scheduler that leaves the retry to the runtime no
    # alarm is left by then and the unclaimed permits are never reclaimed without a request.
    bed = Bed(limit=5, grant_timeout_ms=600_000)

    def broken(name, due):
        raise RuntimeError("application timer bug")

    bed.scheduler.on("app:broken", broken)
    await bed.scheduler.schedule("app:broken", bed.now + 1)
    logging.disable(logging.CRITICAL)
    try:
        [reply] = await bed.round(request("a", {"g": 2}))
        (grant,) = reply["grants"]
        assert grant["permits"] == 2 and bed.scheduler.due_times()[RECLAIM_TIMER] == grant["claimBy"]
        assert (await bed.usage())["outstanding"] == 2
        await bed.clock.advance_to(grant["claimBy"])   # no request: only the alarm can reclaim
    finally:
        logging.disable(logging.NOTSET)
    assert grant["grantId"] not in bed.grants()   # nothing claimed: deleted at reclaim (R15)
    assert (await bed.usage())["outstanding"] == 0
    assert RECLAIM_TIMER not in bed.scheduler.due_times()
    assert bed.scheduler.attempts("app:broken") > 6   # kept failing, kept being retried
    assert bed.storage.alarm == bed.scheduler.timer("app:broken")   # still armed
    assert bed.driver.failures == [] and bed.alarm_loops == 0
    bed.check()
