"""Tier 1: DurabilityScheduler participants (SPEC §1 "Scheduler", R3, R16).

A participant keeps its own due time in its own tables and reports it through ``next_due()``;
the scheduler arms the alarm at the minimum over its timers and every participant, runs the
participants whose time has come, backs a failing one off (persisted: it survives eviction),
never throws to the runtime and always re-arms. No timer row mirrors a participant's state.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from semaphore import DurabilityScheduler, DurabilitySemaphore
from semaphore.errors import ConfigurationError
from semaphore.testing import (
    RECLAIM_TIMER,
    T0,
    AlarmDriver,
    Bed,
    DurableObjectRuleError,
    LocalContext,
    VirtualClock,
    async_test,
    request,
    sync,
    tables,
    timers,
)

GRANTS = "durability_semaphore_grants"


class Jobs:
    """A participant as the library's components are: its due times live in its own table
    (``app_jobs``), ``next_due()`` is one SQL read, ``run`` does the due jobs."""

    def __init__(self, scheduler: DurabilityScheduler, name: str, clock: VirtualClock) -> None:
        self.scheduler, self.name, self.clock = scheduler, name, clock
        self.storage = scheduler.storage
        self.storage.exec("CREATE TABLE IF NOT EXISTS app_jobs (owner TEXT, job TEXT, due INTEGER)")
        self.ran: list[tuple[str, int, int]] = []  # (job, due_at given, clock at the run)
        self.fail = 0  # runs left that raise
        self.hang: asyncio.Future[None] | None = None
        scheduler.participate(name, self.next_due, self.run)

    def add(self, job: str, due: int) -> None:  # the participant's own state: no timer write
        self.storage.exec("INSERT INTO app_jobs VALUES (?, ?, ?)", self.name, job, due)

    def next_due(self) -> int | None:
        row = self.storage.one("SELECT MIN(due) AS due FROM app_jobs WHERE owner = ?", self.name)
        return None if row is None or row["due"] is None else int(row["due"])

    async def run(self, name: str, due_at: int) -> None:
        assert name == self.name
        if self.hang is not None:
            await self.hang
        if self.fail:
            self.fail -= 1
            raise RuntimeError(f"{name} broken")
        now = self.clock.now
        for r in self.storage.exec("SELECT job FROM app_jobs WHERE owner = ? AND due <= ? ORDER BY due",
                                   self.name, now):
            self.ran.append((str(r["job"]), due_at, now))
        self.storage.exec("DELETE FROM app_jobs WHERE owner = ? AND due <= ?", self.name, now)


def make(ctx: LocalContext | None = None, clock: VirtualClock | None = None):
    clock = clock or VirtualClock(T0)
    ctx = ctx or LocalContext()
    return ctx, clock, DurabilityScheduler(ctx, clock=clock)


async def deliver(ctx: LocalContext, clock: VirtualClock, scheduler: DurabilityScheduler) -> None:
    """The runtime delivers the alarm: the clock at it, the alarm cleared, then ``alarm()``."""
    clock.set(max(ctx.storage.alarm, clock.now))
    await ctx.storage.deleteAlarm()
    await scheduler.alarm({})


# =============================================================================== arming


@async_test
async def test_r16_the_alarm_is_the_minimum_over_timers_and_participants():
    # R16: the alarm follows the earliest due time of anything that uses it.
    ctx, clock, s = make()
    a, b = Jobs(s, "app:a", clock), Jobs(s, "app:b", clock)
    s.on("t", lambda n, d: None)
    await s.arm()
    assert ctx.storage.alarm is None   # nothing due anywhere
    s.set_timer("t", T0 + 500)
    a.add("a1", T0 + 300)
    b.add("b1", T0 + 900)
    await s.arm()
    assert ctx.storage.alarm == T0 + 300
    assert s.due_times() == {"t": T0 + 500, "app:a": T0 + 300, "app:b": T0 + 900}
    assert timers(ctx.storage) == {"t": T0 + 500}   # no row mirrors a participant
    b.add("b0", T0 + 100)
    await s.arm()
    assert ctx.storage.alarm == T0 + 100
    s.set_timer("t", T0 + 50)
    await s.arm()
    assert ctx.storage.alarm == T0 + 50
    assert s.participants == ("app:a", "app:b")


@async_test
async def test_r16_a_participant_whose_state_changes_without_a_timer_write_is_picked_up_at_arm():
    # R16: the participant's own rows are the only record of its due time; the next arm() (after
    # the commit that changed them) reads them: no timer row to keep in step by hand.
    ctx, clock, s = make()
    jobs = Jobs(s, "app:jobs", clock)
    jobs.add("late", T0 + 10_000)
    await s.arm()
    assert ctx.storage.alarm == T0 + 10_000
    writes = ctx.storage.statements
    jobs.add("soon", T0 + 2_000)   # one write, to the participant's table only
    assert ctx.storage.statements == writes + 1 and timers(ctx.storage) == {}
    await s.arm()
    assert ctx.storage.alarm == T0 + 2_000
    jobs.storage.exec("DELETE FROM app_jobs")
    await s.arm()
    assert ctx.storage.alarm is None


@async_test
async def test_r16_alarm_runs_due_participants_and_timers_earliest_first_and_rearms():
    # R16
    ctx, clock, s = make()
    order: list[str] = []
    a, b = Jobs(s, "app:a", clock), Jobs(s, "app:b", clock)
    s.on("t", lambda n, d: order.append(n))
    a.add("a1", T0 + 30)
    a.add("a-later", T0 + 5_000)
    b.add("b1", T0 + 10)
    s.set_timer("t", T0 + 20)
    clock.set(T0 + 40)
    await s.alarm({})
    assert [j for j, _, _ in b.ran + a.ran] == ["b1", "a1"]
    assert b.ran == [("b1", T0 + 10, T0 + 40)] and a.ran == [("a1", T0 + 30, T0 + 40)]
    assert order == ["t"] and timers(ctx.storage) == {}
    assert ctx.storage.alarm == T0 + 5_000 == s.due_times()["app:a"]
    AlarmDriver(clock, ctx.storage, s.alarm)
    await clock.advance_to(T0 + 5_000)
    assert a.ran[-1] == ("a-later", T0 + 5_000, T0 + 5_000) and ctx.storage.alarm is None


# =============================================================================== failures


@async_test
async def test_r16_a_failing_participant_backs_off_persisted_across_eviction_and_never_raises(caplog):
    # R16: a participant whose run raises is logged (ERROR), counted and backed off (1 s, 2 s,
    # ...) in a row of the timer table, so a new instance over the same storage (eviction)
    # keeps the count and the retry time; alarm() returns normally and the alarm stays set;
    # the other participants still run; the first run that returns clears the row.
    ctx, clock, s = make()
    broken, other = Jobs(s, "app:broken", clock), Jobs(s, "app:other", clock)
    broken.fail = 3
    broken.add("x", T0)
    other.add("y", T0 + 1_500)
    await s.arm()   # (an alarm comes only after an arm(), which creates the timer table)
    with caplog.at_level(logging.ERROR, logger="semaphore.scheduler"):
        await s.alarm({})   # does not raise
    (record,) = [r for r in caplog.records if r.name == "semaphore.scheduler"]
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert "'app:broken'" in record.getMessage() and "attempt 1" in record.getMessage()
    assert s.attempts("app:broken") == 1 and timers(ctx.storage) == {"app:broken": T0 + 1_000}
    assert ctx.storage.alarm == T0 + 1_000   # its retry, not its (past) next_due()

    s2 = DurabilityScheduler(ctx, clock=clock)   # eviction: the backoff is in storage
    broken, other = Jobs(s2, "app:broken", clock), Jobs(s2, "app:other", clock)
    broken.fail = 2
    await s2.arm()
    assert ctx.storage.alarm == T0 + 1_000 and s2.attempts("app:broken") == 1
    clock.set(T0 + 999)
    await s2.alarm({})   # early delivery: not yet retried
    assert broken.fail == 2 and ctx.storage.alarm == T0 + 1_000
    logging.disable(logging.CRITICAL)
    try:
        await deliver(ctx, clock, s2)   # attempt 2 fails: retry in 2 s
        assert s2.attempts("app:broken") == 2 and ctx.storage.alarm == T0 + 1_500   # other's job
        await deliver(ctx, clock, s2)
        assert other.ran == [("y", T0 + 1_500, T0 + 1_500)]
        assert ctx.storage.alarm == T0 + 1_000 + 2_000
        await deliver(ctx, clock, s2)   # attempt 3 fails: retry in 4 s
        assert s2.attempts("app:broken") == 3 and ctx.storage.alarm == T0 + 3_000 + 4_000
    finally:
        logging.disable(logging.NOTSET)
    await deliver(ctx, clock, s2)   # succeeds
    assert broken.ran == [("x", T0 + 7_000, T0 + 7_000)]
    assert s2.attempts("app:broken") == 0 and timers(ctx.storage) == {} and ctx.storage.alarm is None


@async_test
async def test_r16_an_always_failing_participant_never_starves_a_timer_and_the_alarm_stays_set():
    # R16: with the runtime's driver (retries limited to 6), a participant that always raises is
    # retried by the scheduler forever (capped at 5 min) and a timer due 30 min later still runs.
    ctx, clock, s = make()
    broken = Jobs(s, "app:broken", clock)
    broken.fail = 10**6
    broken.add("x", T0)
    ran: list[int] = []
    s.on("app:t", lambda n, d: ran.append(clock.now))
    s.set_timer("app:t", T0 + 30 * 60_000)
    driver = AlarmDriver(clock, ctx.storage, s.alarm)
    await s.arm()
    logging.disable(logging.CRITICAL)
    try:
        await clock.advance_to(T0 + 40 * 60_000)
    finally:
        logging.disable(logging.NOTSET)
    assert ran == [T0 + 30 * 60_000]
    assert driver.failures == [] and s.attempts("app:broken") > 6
    assert ctx.storage.alarm == s.due_times()["app:broken"] <= clock.now + DurabilityScheduler.BACKOFF_MAX_MS


@async_test
async def test_r16_a_next_due_that_raises_never_fails_arm_and_is_backed_off_by_the_alarm():
    # R16
    ctx, clock, s = make()
    state = {"broken": True}

    def next_due() -> int | None:
        if state["broken"]:
            raise RuntimeError("bad read")
        return None

    s.participate("app:p", next_due, lambda n, d: None)
    logging.disable(logging.CRITICAL)
    try:
        await s.arm()   # does not raise: the alarm is set now, so that alarm() records it
        assert ctx.storage.alarm == T0
        await s.alarm({})
    finally:
        logging.disable(logging.NOTSET)
    assert s.attempts("app:p") == 1 and ctx.storage.alarm == T0 + 1_000
    state["broken"] = False
    await deliver(ctx, clock, s)   # the retry runs it, next_due() is None now: all clear
    assert s.attempts("app:p") == 0 and timers(ctx.storage) == {} and ctx.storage.alarm is None


@async_test
async def test_r16_a_run_that_makes_no_progress_is_backed_off_not_looped():
    # R16: a run that returns but leaves next_due() where it was would re-arm the alarm at the
    # same (past) instant forever; it is counted as a failure and backed off instead.
    ctx, clock, s = make()
    runs: list[int] = []
    s.participate("app:stuck", lambda: T0, lambda n, d: runs.append(clock.now))
    driver = AlarmDriver(clock, ctx.storage, s.alarm)
    await s.arm()
    logging.disable(logging.CRITICAL)
    try:
        await clock.advance(1_000 + 2_000 + 4_000)
    finally:
        logging.disable(logging.NOTSET)
    assert runs == [T0, T0 + 1_000, T0 + 3_000, T0 + 7_000]
    assert s.attempts("app:stuck") == 4 and driver.failures == []


@async_test
async def test_r16_a_failure_whose_row_cannot_be_written_is_still_backed_off_in_memory():
    # R16
    ctx, clock, s = make()
    jobs = Jobs(s, "app:jobs", clock)
    jobs.add("x", T0)
    original = ctx.storage.sql.exec

    def exec_(query: str, *bindings: Any) -> Any:   # writes to the timer table fail (disk full)
        if query.startswith("INSERT INTO durability_scheduler_timers"):
            raise DurableObjectRuleError("database full")
        if query.startswith("DELETE FROM app_jobs"):
            raise DurableObjectRuleError("database full")
        return original(query, *bindings)

    await s.arm()
    ctx.storage.sql.exec = exec_
    logging.disable(logging.CRITICAL)
    try:
        await s.alarm({})
    finally:
        logging.disable(logging.NOTSET)
    assert ctx.storage.alarm == T0 + 1_000   # not T0: no alarm loop
    ctx.storage.sql.exec = original
    await deliver(ctx, clock, s)
    assert jobs.next_due() is None and s.attempts("app:jobs") == 0 and ctx.storage.alarm is None


# =============================================================================== runs


@async_test
async def test_r16_a_running_participant_never_runs_twice_at_once_nor_leaves_the_alarm_due():
    # R16
    ctx, clock, s = make()
    jobs = Jobs(s, "app:jobs", clock)
    jobs.hang = asyncio.get_running_loop().create_future()
    jobs.add("x", T0)
    await s.arm()
    await ctx.storage.deleteAlarm()   # the runtime clears the alarm before delivering it
    first = asyncio.ensure_future(s.alarm({}))
    for _ in range(5):
        await asyncio.sleep(0)
    assert ctx.storage.alarm is None   # the runtime cleared it; nothing re-armed yet
    await s.arm()   # e.g. a request meanwhile: the run lease, not the (past) due time
    assert ctx.storage.alarm == T0 + DurabilityScheduler.RUN_LEASE_MS
    clock.set(T0 + DurabilityScheduler.RUN_LEASE_MS)
    await s.alarm({})   # delivered again while it still runs: deferred, lease extended
    assert jobs.ran == [] and ctx.storage.alarm == clock.now + DurabilityScheduler.RUN_LEASE_MS
    jobs.hang.set_result(None)
    await first
    assert [j for j, _, _ in jobs.ran] == ["x"] and ctx.storage.alarm is None


@async_test
async def test_r16_a_run_cut_short_by_the_death_of_the_instance_runs_again_on_the_next_alarm():
    # R16
    # Its own state still says it is due: the re-delivered alarm runs it on the new instance.
    ctx, clock, s = make()
    jobs = Jobs(s, "app:jobs", clock)
    jobs.hang = asyncio.get_running_loop().create_future()
    jobs.add("x", T0)
    await s.arm()
    delivery = asyncio.ensure_future(s.alarm({}))
    for _ in range(5):
        await asyncio.sleep(0)
    delivery.cancel()   # the process dies mid-run
    for _ in range(5):
        await asyncio.sleep(0)
    s2 = DurabilityScheduler(ctx, clock=clock)
    jobs2 = Jobs(s2, "app:jobs", clock)
    await s2.alarm({"isRetry": True})
    assert [j for j, _, _ in jobs2.ran] == ["x"] and s2.attempts("app:jobs") == 0
    assert ctx.storage.alarm is None and timers(ctx.storage) == {}


def test_names_are_either_a_timer_or_a_participant():
    # R16
    s = DurabilityScheduler(LocalContext(), clock=VirtualClock(T0))
    s.on("t", lambda n, d: None)
    s.participate("p", lambda: None, lambda n, d: None)
    with pytest.raises(ConfigurationError):
        s.participate("t", lambda: None, lambda n, d: None)
    with pytest.raises(ConfigurationError):
        s.on("p", lambda n, d: None)


@async_test
async def test_r3_after_scheduler_migrate_none_participants_do_not_run_and_the_alarm_is_deleted():
    # R3
    ctx, clock, s = make()
    jobs = Jobs(s, "app:jobs", clock)
    jobs.add("x", T0)
    await s.arm()
    DurabilityScheduler.migrate(ctx, None)
    await s.alarm({})
    assert jobs.ran == [] and ctx.storage.alarm is None
    assert "durability_scheduler_timers" not in tables(ctx.storage)


# =============================================================================== the holder


@async_test
async def test_r16_holder_reclaim_is_a_participant_and_runs_at_the_deadline():
    # R16: the alarm follows the earliest claimBy of grants with unclaimed permits and reclaims
    # without a request; no timer row is written by rounds, syncs or the reclaim.
    bed = Bed(limit=10)
    assert RECLAIM_TIMER in bed.scheduler.participants
    [a] = await bed.round(request("a", {"g": 3}))
    g1, c1 = a["grants"][0]["grantId"], a["grants"][0]["claimBy"]
    assert bed.storage.alarm == c1 and bed.scheduler.due_times() == {RECLAIM_TIMER: c1}
    assert timers(bed.storage) == {}
    await bed.clock.advance(5_000)
    [b] = await bed.round(request("b", {"h": 2}))
    g2, c2 = b["grants"][0]["grantId"], b["grants"][0]["claimBy"]
    assert c2 > c1 and bed.storage.alarm == c1
    await bed.one(sync("a", [(g1, 3, 0)]))   # g1 fully claimed: the alarm moves on
    assert bed.storage.alarm == c2
    await bed.clock.advance_to(c2)   # no request: the alarm reclaims g2
    assert g2 not in bed.grants() and g1 in bed.grants()
    assert bed.storage.alarm is None and timers(bed.storage) == {}
    assert bed.driver.failures == []
    bed.check()


@async_test
async def test_r16_a_failing_holder_reclaim_backs_off_survives_eviction_and_then_reclaims():
    # R16
    bed = Bed(limit=5)
    [a] = await bed.round(request("a", {"g": 2}))
    gid, claim_by = a["grants"][0]["grantId"], a["grants"][0]["claimBy"]
    broken = {"on": True}
    original = bed.storage.sql.exec

    def exec_(query: str, *bindings: Any) -> Any:   # the reclaim's delete fails while broken
        if broken["on"] and query.startswith(f"DELETE FROM {GRANTS}"):
            raise DurableObjectRuleError("injected storage failure")
        return original(query, *bindings)

    bed.storage.sql.exec = exec_
    logging.disable(logging.CRITICAL)
    try:
        await bed.clock.advance_to(claim_by)
        assert gid in bed.grants() and bed.scheduler.attempts(RECLAIM_TIMER) == 1
        assert timers(bed.storage) == {RECLAIM_TIMER: claim_by + 1_000} == bed.scheduler.due_times()
        await bed.clock.advance(1_000)
        assert bed.scheduler.attempts(RECLAIM_TIMER) == 2 and bed.storage.alarm == bed.now + 2_000
        bed.evict()   # the backoff is in storage
        assert bed.scheduler.attempts(RECLAIM_TIMER) == 2
        assert bed.scheduler.due_times() == {RECLAIM_TIMER: bed.now + 2_000}
    finally:
        logging.disable(logging.NOTSET)
    broken["on"] = False
    await bed.clock.advance(2_000)
    assert gid not in bed.grants() and (await bed.usage())["outstanding"] == 0
    assert timers(bed.storage) == {} and bed.storage.alarm is None
    assert bed.driver.failures == []
    bed.check()


@async_test
async def test_r16_a_reclaim_timer_row_left_by_an_earlier_release_breaks_nothing():
    # R16
    # An earlier release mirrored the reclaim deadline into a timer row (attempts 0). It arms the
    # alarm no later than its time; the reclaim still runs at the real deadline, and the row is
    # deleted by the reclaim's next run.
    bed = Bed(limit=5)
    [a] = await bed.round(request("a", {"g": 2}))
    gid, claim_by = a["grants"][0]["grantId"], a["grants"][0]["claimBy"]
    bed.storage.connection.execute(
        "INSERT INTO durability_scheduler_timers(name, due_at) VALUES (?, ?)", (RECLAIM_TIMER, claim_by + 60_000))
    bed.evict()   # the new release starts over the old storage
    await bed.scheduler.arm()
    assert bed.storage.alarm == claim_by
    await bed.clock.advance_to(claim_by)
    assert gid not in bed.grants() and timers(bed.storage) == {} and bed.storage.alarm is None
    # A stale row with nothing left to reclaim: one alarm at its time deletes it.
    bed.storage.connection.execute(
        "INSERT INTO durability_scheduler_timers(name, due_at) VALUES (?, ?)", (RECLAIM_TIMER, bed.now + 500))
    bed.evict()
    await bed.scheduler.arm()
    assert bed.storage.alarm == bed.now + 500
    await bed.clock.advance(500)
    assert timers(bed.storage) == {} and bed.storage.alarm is None
    assert bed.driver.failures == []
    bed.check()


@async_test
async def test_r3_holder_migrate_none_removes_its_backoff_and_nothing_runs_over_dropped_tables():
    # R3: DurabilitySemaphore.migrate(ctx, None) deletes the reclaim's backoff row with its
    # tables; a fresh holder's next_due() reads no table it would re-create (None), so neither
    # arm() nor alarm() fails or re-creates anything.
    bed = Bed(limit=5)
    [a] = await bed.round(request("a", {"g": 2}))
    claim_by = a["grants"][0]["claimBy"]
    bed.storage.connection.execute(
        "INSERT INTO durability_scheduler_timers(name, due_at, attempts) VALUES (?, ?, 3)",
        (RECLAIM_TIMER, claim_by))   # say it was failing
    bed.driver.close()
    DurabilitySemaphore.migrate(bed.ctx, None)
    assert timers(bed.storage) == {}
    bed.clock.set(claim_by + 60_000)
    bed.evict()
    assert bed.scheduler.due_times() == {}
    await bed.scheduler.arm()
    await bed.scheduler.alarm({})
    assert not any(t.startswith("durability_semaphore") for t in tables(bed.storage))
    assert bed.storage.alarm is None and bed.scheduler.attempts(RECLAIM_TIMER) == 0


@async_test
async def test_r16_arming_for_the_holder_costs_one_read_and_a_round_writes_no_timer_row():
    # R16: the round's transaction no longer mirrors the reclaim deadline into a timer row (it
    # read the row and rewrote it); arm() after the commit reads the holder's next_due() only:
    # the timers' and participants' rows were read by an earlier arm() and nothing has written
    # the timer table since (the scheduler keeps that read until its next write).
    bed = Bed(limit=10)
    await bed.round(request("a", {"g": 3}))
    before = bed.storage.statements
    await bed.scheduler.arm()
    assert bed.storage.statements - before == 1
    assert timers(bed.storage) == {}


@async_test
async def test_r16_a_timer_written_after_an_arm_is_armed_by_the_next_arm():
    # R16: the rows arm() keeps are dropped by every write of the timer table (set, clear,
    # a prefix cleared) and by a rolled-back transaction, so the next arm() sees the write.
    bed = Bed(limit=10)
    await bed.round(request("a", {"g": 3}))
    await bed.scheduler.arm()
    armed = bed.storage.alarm
    bed.scheduler.on("app:soon", lambda name, due: None)
    for at, clear in ((5, bed.scheduler.clear_timer), (6, lambda name: bed.scheduler.clear_prefix("app:"))):
        bed.scheduler.set_timer("app:soon", bed.clock.now + at)
        await bed.scheduler.arm()
        assert bed.storage.alarm == bed.clock.now + at
        clear("app:soon")
        await bed.scheduler.arm()
        assert bed.storage.alarm == armed

    def set_then_fail() -> None:
        bed.scheduler.set_timer("app:soon", bed.clock.now + 7)
        bed.scheduler._participant_rows()  # read inside the transaction, then rolled back
        raise RuntimeError("rolled back")

    with pytest.raises(RuntimeError):
        bed.scheduler.storage.transaction(set_then_fail)
    await bed.scheduler.arm()
    assert bed.storage.alarm == armed
