"""Tier 1: DurabilityScheduler when the object dies while a timer handler runs (R4, R16, R37).

A run cut short by the death of the instance is neither a success nor a failure: the timer keeps
its run lease (``RUN_LEASE_MS``) and its ``attempts`` count, and runs again on the re-delivered
alarm; only a handler that raises is backed off (see ``tests/test_scheduler.py``).

Alarms are at-least-once: when a handler is cut short (the process is killed, the object is
evicted), the runtime delivers the alarm again to a new instance. The timer whose handler was
running must then still be there, or its work (a queue's wake-up, a reclaim) is never done.
Found by driving the reference app through a kill in the middle of a queue pump (the queue's
wake-up timer was deleted before the pump awaited its holder round, so after the restart the
queue never asked again).
"""

from __future__ import annotations

import asyncio
import logging

from semaphore import DurabilityScheduler
from semaphore.testing import T0, LocalContext, VirtualClock, async_test, timers

NAME = "durability_semaphore_queue:wake"


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


@async_test
async def test_a_run_cut_short_by_the_death_of_the_instance_runs_again_after_restart():
    clock, ctx = VirtualClock(T0), LocalContext()
    first = DurabilityScheduler(ctx, clock=clock)
    never = asyncio.get_running_loop().create_future()
    started: list[int] = []

    async def pump(name: str, due_at: int) -> None:  # awaits a holder round that never answers
        started.append(due_at)
        await never

    first.on(NAME, pump)
    await first.schedule(NAME, T0 + 100)
    await clock.advance(100)
    delivery = asyncio.ensure_future(first.alarm({}))  # the runtime delivers the alarm
    await settle()
    assert started == [T0 + 100]
    delivery.cancel()  # the process dies mid-handler: no except/else path of the handler runs
    await settle()

    # Restart: a new instance on the same storage; the unacknowledged alarm comes again.
    second = DurabilityScheduler(ctx, clock=clock)
    ran: list[int] = []
    second.on(NAME, lambda name, due_at: ran.append(due_at))
    await second.alarm({"isRetry": True})
    for _ in range(5):  # then whatever alarm the scheduler arms, as time passes
        at = ctx.storage.alarm
        if ran or at is None:
            break
        await clock.advance_to(max(at, clock.now))
        await ctx.storage.deleteAlarm()  # the runtime clears it before delivering it
        await second.alarm({})
    assert ran, f"the timer of the interrupted run is gone: timers={timers(ctx.storage)}"
    assert NAME not in timers(ctx.storage)  # done once it ran to the end
    assert ctx.storage.alarm is None


@async_test
async def test_a_running_timer_never_runs_twice_at_once_nor_spins_and_reruns_if_due_again():
    clock, ctx = VirtualClock(T0), LocalContext()
    sched = DurabilityScheduler(ctx, clock=clock)
    gate = asyncio.get_running_loop().create_future()
    runs: list[int] = []

    async def pump(name: str, due_at: int) -> None:
        runs.append(due_at)
        if len(runs) == 1:
            await gate

    sched.on(NAME, pump)
    await sched.schedule(NAME, T0)
    first = asyncio.ensure_future(sched.alarm({}))
    await settle()
    assert runs == [T0]
    assert sched.timer(NAME) is None  # the handler sees itself unscheduled, as before
    # Meanwhile an enqueue asks for a wake-up now, and the alarm is delivered again.
    await sched.schedule(NAME, clock.now)
    await sched.alarm({})
    assert runs == [T0], "ran twice at once"
    assert ctx.storage.alarm is not None and ctx.storage.alarm > clock.now, "alarm left due: spins"
    gate.set_result(None)
    await first
    # It came due again during the run, so it runs once more, right away.
    assert ctx.storage.alarm == clock.now
    await sched.alarm({})
    assert runs == [T0, clock.now]
    assert NAME not in timers(ctx.storage) and ctx.storage.alarm is None


@async_test
async def test_a_handler_may_reschedule_itself_to_any_time_even_its_lease():
    clock, ctx = VirtualClock(T0), LocalContext()
    sched = DurabilityScheduler(ctx, clock=clock)
    lease = T0 + DurabilityScheduler.RUN_LEASE_MS

    def again(name: str, due_at: int) -> None:
        sched.set_timer(name, lease)  # exactly where the run lease sits

    sched.on(NAME, again)
    await sched.schedule(NAME, T0)
    await sched.alarm({})
    assert timers(ctx.storage) == {NAME: lease} and ctx.storage.alarm == lease


@async_test
async def test_a_failing_timer_cut_short_by_death_runs_again_and_keeps_its_attempts():
    # R16, R4: a timer backing off after failures is leased like any other while it runs: if
    # the instance dies mid-run it runs again on the re-delivered alarm, its failure count is
    # kept (the death is not a success), and a run that returns resets it.
    clock, ctx = VirtualClock(T0), LocalContext()
    first = DurabilityScheduler(ctx, clock=clock)
    never = asyncio.get_running_loop().create_future()
    calls: list[int] = []

    async def failing_then_hanging(name: str, due_at: int) -> None:
        calls.append(due_at)
        if len(calls) <= 2:
            raise RuntimeError("fails")
        await never

    first.on(NAME, failing_then_hanging)
    await first.schedule(NAME, T0)
    logging.disable(logging.CRITICAL)
    try:
        await first.alarm({})                       # attempt 1 fails: retry in 1 s
        await clock.advance_to(ctx.storage.alarm)
        await first.alarm({})                       # attempt 2 fails: retry in 2 s
    finally:
        logging.disable(logging.NOTSET)
    assert first.attempts(NAME) == 2 and ctx.storage.alarm == clock.now + 2000
    await clock.advance_to(ctx.storage.alarm)
    delivery = asyncio.ensure_future(first.alarm({}))  # third run hangs: the process dies
    await settle()
    assert len(calls) == 3
    delivery.cancel()
    await settle()

    second = DurabilityScheduler(ctx, clock=clock)
    assert second.attempts(NAME) == 2                # kept through the death
    ran: list[int] = []
    second.on(NAME, lambda name, due_at: ran.append(due_at))
    await second.alarm({"isRetry": True})              # not yet: the run lease holds it
    assert ran == [] and ctx.storage.alarm == clock.now + DurabilityScheduler.RUN_LEASE_MS
    await clock.advance_to(ctx.storage.alarm)
    await second.alarm({})
    assert len(ran) == 1 and NAME not in timers(ctx.storage) and ctx.storage.alarm is None
