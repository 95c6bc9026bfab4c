"""Tier 1: DurabilityScheduler, named timers multiplexed over the object's single alarm
(SPEC §1 "Scheduler", R1, R16)."""

from __future__ import annotations

import asyncio

import pytest

from helpers import T0, async_test, timers
from semaphore import DurabilityScheduler
from semaphore.testing import AlarmDriver, LocalContext, VirtualClock


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
    clock._now = T0 + 200
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
    clock._now = T0 + 100
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
    clock._now = T0 + 50
    await s.alarm()
    assert ran == ["known"]
    assert timers(ctx.storage) == {"orphan-later": T0 + 1000}   # not yet due: kept
    assert ctx.storage.alarm == T0 + 1000


@async_test
async def test_raising_handler_keeps_its_timer_others_run_error_reraised():
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
    clock._now = T0 + 30
    with pytest.raises(RuntimeError, match="flaky"):
        await s.alarm()
    assert ran == ["b"]
    assert timers(ctx.storage) == {"a": T0 + 10}
    # with the driver: the runtime retries (backoff) until the handler succeeds
    driver = AlarmDriver(clock, ctx.storage, s.alarm)
    await s.arm()
    await clock.advance(0)
    assert len(driver.failures) == 1 and ctx.storage.alarm == clock.now + 2000
    state["fail"] = False
    await clock.run_until_idle()
    assert ran == ["b", "a"] and timers(ctx.storage) == {} and ctx.storage.alarm is None


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
