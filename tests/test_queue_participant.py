"""Tier 1: the queue's wake-up is a scheduler participant (SPEC R16, R37; issue 9).

The queue keeps its per-key wake times in its own table (``durability_semaphore_client_wakeups``)
and reports the earliest through ``next_due()``: no timer row is kept in step with it. The
scheduler has a row of the queue's name only while the wake-up is failing (its backoff, which
survives eviction); a timer row an earlier release left under that name (``attempts = 0``) is
harmless. A wake-up leaves no key due at the time it ran for, so work that comes due during it
at the same millisecond is not counted as "no progress"; a wake-up that really makes none is
backed off instead of re-arming the alarm for "now".

The holder is out of reach throughout (every call raises :class:`HolderUnavailableError`): the
queue then retries each key after ``retry_ms``, which gives it a wake time in the future with no
holder round to wait for, on a clock that stands still unless a test moves it.
"""

from __future__ import annotations

import asyncio

import pytest

from semaphore import HolderUnavailableError, SemaphoreQueue
from semaphore.testing import T0, ClientSide, SimClock, async_test, tables, timers

WAKE = SemaphoreQueue.TIMER
WAKEUPS = "durability_semaphore_client_wakeups"
RETRY = 1000  # the queue's retry_ms (default)
KEY_A = "a"
KICK_FALLBACK_MS = 10_000  # the queue's durable wake-up of a change its instance pumps itself


pytestmark = pytest.mark.usefixtures("quiet_logs")  # failures are injected on purpose


class Down:
    """A transport to a holder that never answers; ``calls`` lists the keys asked for.
    ``during`` (a coroutine function of the key) runs inside the call first: a request that
    reaches the object while its alarm awaits the holder."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.during = None

    async def __call__(self, key: str, message: dict) -> dict:
        self.calls.append(key)
        if self.during is not None:
            during, self.during = self.during, None
            await during(key)
        raise HolderUnavailableError("holder down (test)")


def client_object(clock: SimClock, net: Down) -> ClientSide:
    side = ClientSide("c1", clock, net, on_admit=lambda side, item: None)
    side.driver.close()  # the tests deliver the alarm themselves, on a clock that stands still
    return side


async def deliver(side: ClientSide) -> None:
    """The runtime delivers the object's alarm: the clock at it, the alarm cleared, ``alarm()``."""
    assert side.storage.alarm is not None
    side.clock.set(max(side.storage.alarm, side.clock.now))
    await side.storage.deleteAlarm()
    await side.alarm({})


#: When the staged wake-up of :func:`enqueue_unpumped` is due (R37 wake-ups).
S = T0 + KICK_FALLBACK_MS


async def enqueue_unpumped(side: ClientSide, key: str, group: str, item_id: str) -> None:
    """Enqueue, then lose the instance before it pumped the key itself (R37 wake-ups): the key's
    wake-up is left to the object's alarm, ``KICK_FALLBACK_MS`` after the enqueue (at :data:`S`)."""
    await side.queue.enqueue(key, group, item_id)
    side.evict()


def sql(side: ClientSide, query: str, *args) -> list[dict]:
    return side.scheduler.storage.exec(query, *args)


def block_wakeups(side: ClientSide, raise_: str) -> None:
    """Make every write of the wake-up table fail (``raise_ = "ABORT, 'disk full'"``)."""
    for op in ("INSERT", "UPDATE", "DELETE"):
        sql(side, f"CREATE TRIGGER block_{op.lower()} BEFORE {op} ON {WAKEUPS} BEGIN SELECT RAISE({raise_}); END")


def unblock_wakeups(side: ClientSide) -> None:
    for op in ("insert", "update", "delete"):
        sql(side, f"DROP TRIGGER block_{op}")


def stale_wake_row(side: ClientSide, due_at: int) -> None:
    """The row an earlier release kept in step with the queue's wake times (``attempts`` 0)."""
    sql(side, "INSERT INTO durability_scheduler_timers(name, due_at) VALUES (?, ?)"
              " ON CONFLICT(name) DO UPDATE SET due_at = excluded.due_at, attempts = 0", WAKE, due_at)


@async_test
async def test_r37_r16_the_queue_wake_arms_the_alarm_with_no_timer_row():
    # R37: the queue's wake-ups drive the object's alarm through its participant; R16: the alarm
    # follows the earliest due time, here read from the queue's own table, never a mirror row.
    clock, net = SimClock(T0), Down()
    side = client_object(clock, net)
    await enqueue_unpumped(side, "a", "g", "item1")
    assert side.queue.wake_at("a") == S
    assert timers(side.storage) == {}   # the wake time is only in the queue's table
    assert side.scheduler.due_times() == {WAKE: S} and side.storage.alarm == S
    assert WAKE in side.scheduler.participants
    await deliver(side)
    assert net.calls == ["a"]   # the wake-up pumped the key; the holder is down: retry later
    assert side.queue.wake_at("a") == S + RETRY
    assert side.scheduler.due_times() == {WAKE: S + RETRY} and side.storage.alarm == S + RETRY
    assert timers(side.storage) == {} and side.scheduler.attempts(WAKE) == 0
    side.evict()   # a new instance reads the same due time from the same table
    assert side.scheduler.due_times() == {WAKE: S + RETRY}


@async_test
async def test_r37_r16_a_wake_timer_row_of_an_earlier_release_is_harmless():
    # R37, R16: an earlier release kept the row (durability_semaphore_queue:wake, due_at,
    # attempts 0) in step with the wake times by hand. After the upgrade it arms the alarm at its
    # time at the latest, is deleted by the wake-up's next run, and no wake-up is lost.
    clock, net = SimClock(T0), Down()
    side = client_object(clock, net)
    await enqueue_unpumped(side, "a", "g", "item1")
    await deliver(side)   # the key now wakes at S + RETRY
    # The earlier release's mirror, left earlier than the queue's own wake time (for instance
    # written before its last run was cut short).
    stale_wake_row(side, S + 400)
    side.evict()
    await side.scheduler.arm()
    assert side.scheduler.due_times() == {WAKE: S + 400} and side.storage.alarm == S + 400
    await deliver(side)   # nothing of the queue's is due yet: nothing happens, the row goes
    assert net.calls == ["a"] and clock.now == S + 400
    assert timers(side.storage) == {} and side.scheduler.attempts(WAKE) == 0
    assert side.scheduler.due_times() == {WAKE: S + RETRY} and side.storage.alarm == S + RETRY
    await deliver(side)   # the queue's own wake-up still comes
    assert net.calls == ["a", "a"] and clock.now == S + RETRY
    # A row left later than the wake time does not delay it either, and goes with its first run.
    stale_wake_row(side, S + 60_000)
    side.evict()
    await side.scheduler.arm()
    assert side.scheduler.due_times() == {WAKE: S + 2 * RETRY} and side.storage.alarm == S + 2 * RETRY
    await deliver(side)
    assert net.calls == ["a"] * 3 and timers(side.storage) == {}
    assert side.scheduler.due_times() == {WAKE: S + 3 * RETRY}


@async_test
async def test_r16_r37_a_failing_wake_backs_off_survives_eviction_and_leaves_no_row_once_it_works():
    # R16: a wake-up that fails is logged, counted and backed off (1 s, doubling), never thrown to
    # the runtime; its backoff is a row of the queue's name (it survives eviction), deleted by the
    # first run that works. R37: the queued work is still done then.
    clock, net = SimClock(T0), Down()
    side = client_object(clock, net)
    await enqueue_unpumped(side, "a", "g", "item1")
    block_wakeups(side, "ABORT, 'disk full'")   # the wake-up can record nothing: the run fails
    await deliver(side)
    assert net.calls == ["a"] and side.scheduler.attempts(WAKE) == 1
    assert timers(side.storage) == {WAKE: S + 1000} and side.storage.alarm == S + 1000
    side.evict()   # a new instance keeps the backoff
    assert side.scheduler.attempts(WAKE) == 1 and side.scheduler.due_times() == {WAKE: S + 1000}
    await deliver(side)
    assert side.scheduler.attempts(WAKE) == 2
    assert side.scheduler.due_times() == {WAKE: S + 3000} and side.storage.alarm == S + 3000
    unblock_wakeups(side)
    side.evict()
    await deliver(side)   # works: the key's retry is in the queue's table, the backoff row goes
    assert clock.now == S + 3000 and net.calls == ["a"] * 3
    assert timers(side.storage) == {} and side.scheduler.attempts(WAKE) == 0
    assert side.queue.wake_at("a") == S + 3000 + RETRY
    assert side.scheduler.due_times() == {WAKE: S + 3000 + RETRY} and side.storage.alarm == S + 3000 + RETRY


@async_test
async def test_r16_r37_work_due_during_a_wake_at_the_same_millisecond_is_done_by_it_not_counted_as_no_progress():
    # R16 (no-progress rule): a run that leaves next_due() at or before the time it ran for counts
    # as a failure. A request that reaches the object while the wake-up awaits the holder (on a
    # clock that has not moved) makes key "b" due at that very millisecond: the wake-up pumps it
    # too, so it is neither backed off as "no progress" nor left to an alarm re-armed for "now".
    # (An enqueue is pumped by its own instance; here "b" is an item inserted with its wake-up
    # due at once, as an instance that cannot pump it itself leaves it.)
    clock, net = SimClock(T0), Down()
    side = client_object(clock, net)
    await enqueue_unpumped(side, "a", "g", "item1")

    async def enqueue_b(key: str) -> None:
        side.queue.storage.transaction(lambda: side.queue._insert("b", "g", "item2", "null", clock.now, owner=""))

    net.during = enqueue_b
    await deliver(side)
    assert clock.now == S and net.calls == ["a", "b"]   # both keys in the one wake-up
    assert side.scheduler.attempts(WAKE) == 0 and timers(side.storage) == {}
    assert side.queue.wake_at("a") == side.queue.wake_at("b") == S + RETRY
    assert side.storage.alarm == S + RETRY   # not "now": the alarm does not fire in a loop


@async_test
async def test_r37_arming_again_reads_no_table():
    # R37: the wake-up's next_due() is answered from the queue's copy of the wake times (every
    # key's row read once, then kept by each write), and the scheduler keeps its rows until it
    # next writes them: after the first arm() of an instance, arming again runs no statement.
    clock, net = SimClock(T0), Down()
    side = client_object(clock, net)
    await enqueue_unpumped(side, "a", "g", "item1")   # a fresh instance: nothing read yet
    await side.scheduler.arm()   # reads the schema, the timer rows and every key's wake time
    before = side.storage.statements
    await side.scheduler.arm()
    assert side.storage.statements == before
    assert side.scheduler.due_times() == {WAKE: S} and side.storage.alarm == S


@async_test
async def test_r3_the_wake_participant_reads_no_table_into_existence():
    # R3: an object whose queue was never used (or was migrated away) has no wake-up table; the
    # participant is not due and arming or delivering the alarm creates nothing.
    clock, net = SimClock(T0), Down()
    side = client_object(clock, net)
    await side.scheduler.arm()
    assert side.scheduler.due_times() == {} and side.storage.alarm is None
    await side.storage.setAlarm(T0)   # an alarm that still fires (e.g. set before a migrate)
    await deliver(side)
    assert not any(t.startswith("durability_semaphore_client") for t in tables(side.storage))
    assert side.storage.alarm is None


# ---------------------------------------------------------------- review fixes (issue 9, second review)
from semaphore import ConfigurationError, DurabilityScheduler, DurabilitySemaphore, SemaphoreClient  # noqa: E402
from semaphore.testing import Bed, LocalContext, LocalStorage, VirtualClock, request  # noqa: E402


class _Down:
    """A holder out of reach: every call raises; ``latency`` ms of the clock pass per call."""

    def __init__(self, clock: VirtualClock, latency: int = 0, on_call=None) -> None:
        self.clock, self.latency, self.on_call, self.calls = clock, latency, on_call, []

    async def __call__(self, key, message):
        self.calls.append(key)
        if self.on_call is not None:
            self.on_call()
        self.clock.set(self.clock.now + self.latency)
        raise HolderUnavailableError("down")


async def _deliver(ctx, scheduler, clock) -> None:
    """The runtime firing the alarm: time reaches it, it is cleared, the handler runs."""
    clock.set(max(ctx.storage.alarm, clock.now))
    await ctx.storage.deleteAlarm()
    await scheduler.alarm({})


@async_test
async def test_r16_r37_the_queue_keeps_the_schedulers_time_when_its_clients_clock_lags():
    # R16/R37 (review fix): the queue's wake times are compared with the scheduler's clock, so
    # the queue reads that clock. Before, it read the client's: a client clock 1.5 s behind made
    # every wake-up "no progress" and backed the whole queue off (11 wake-ups in 811 s).
    clock = VirtualClock(T0)
    ctx = LocalContext(LocalStorage())
    down = _Down(clock)
    scheduler = DurabilityScheduler(ctx, clock=clock)
    client = SemaphoreClient(ctx, down, clock=lambda: clock.now - 1500, client_id="c1")
    queue = SemaphoreQueue(client=client, scheduler=scheduler, on_admit=lambda item: None)
    await queue.enqueue("a", "g", "i1")
    for _ in range(10):
        await _deliver(ctx, scheduler, clock)
    assert scheduler.attempts(WAKE) == 0
    # one retry per second (after the enqueue's own pump, whose wake-up the first alarm comes for)
    assert clock.now - T0 <= KICK_FALLBACK_MS + 10 * RETRY and len(down.calls) >= 10


@async_test
async def test_r3_r16_a_queue_migrated_away_during_its_wake_up_leaves_no_backoff():
    # R3/R16 (review fix): SemaphoreQueue.migrate(ctx, None) while the wake-up awaits the holder
    # drops the queue's tables; the rest of the run fails. Nothing is due any more, so the
    # failure is not recorded: before, a backoff row was written after the migrate and the
    # alarm stayed armed for ever on the live instance (retrying up to every 5 minutes).
    clock = VirtualClock(T0)
    ctx = LocalContext(LocalStorage())
    down = _Down(clock, on_call=lambda: None if down.calls[1:] else SemaphoreQueue.migrate(ctx, None))
    scheduler = DurabilityScheduler(ctx, clock=clock)
    client = SemaphoreClient(ctx, down, clock=clock, client_id="c1")
    queue = SemaphoreQueue(client=client, scheduler=scheduler, on_admit=lambda item: None)
    await queue.enqueue("a", "g", "i1")
    await _deliver(ctx, scheduler, clock)
    assert not [t for t in tables(ctx.storage) if "client" in t]
    assert timers(ctx.storage) == {} and ctx.storage.alarm is None


@async_test
async def test_r37_a_wake_up_pumps_what_was_due_at_its_time_not_what_came_due_while_it_ran():
    # R37/R16 (review fix): every pass of a wake-up takes the keys due at the time of the run;
    # keys that come due while it runs (the clock moves during I/O) wait for the next alarm.
    # Before, each pass re-read the clock: 8 keys behind a 300 ms holder took 20 holder calls
    # (6 s) in one alarm instead of 8.
    clock = VirtualClock(T0)
    ctx = LocalContext(LocalStorage())
    down = _Down(clock, latency=300)
    scheduler = DurabilityScheduler(ctx, clock=clock)
    client = SemaphoreClient(ctx, down, clock=clock, client_id="c1")
    queue = SemaphoreQueue(client=client, scheduler=scheduler, on_admit=lambda item: None)
    for key in "abcdefgh":
        await queue.enqueue(key, "g", "i" + key)
    down.calls.clear()
    await _deliver(ctx, scheduler, clock)
    assert len(down.calls) == 8 and sorted(down.calls) == list("abcdefgh")
    assert scheduler.attempts(WAKE) == 0


@pytest.mark.parametrize("option", ["retry_ms", "admit_retry_ms", "reconcile_after_ms"])
def test_r37_retry_options_below_one_ms_are_refused(option: str):
    # R37/R7 (review fix): a retry of 0 ms would keep a key due at the time its wake-up ran for
    # (counted as no progress, backing off every key of the queue); refused, naming the field.
    ctx = LocalContext(LocalStorage())
    scheduler = DurabilityScheduler(ctx)
    client = SemaphoreClient(ctx, _Down(VirtualClock(T0)), client_id="c1")
    extra = {"check_running": lambda item: True} if option == "reconcile_after_ms" else {}
    with pytest.raises(ConfigurationError) as caught:
        SemaphoreQueue(client=client, scheduler=scheduler, on_admit=lambda item: None, **{option: 0}, **extra)
    assert caught.value.field == option


@async_test
async def test_r15_r16_a_holder_clock_behind_the_schedulers_still_reclaims_on_time():
    # R15/R16 (review fix): the reclaim runs at the time the scheduler ran it for at the latest;
    # before, a holder clock behind the scheduler's reclaimed nothing (no progress) and was
    # backed off, leaving the unclaimed permits charged.
    bed = Bed(5, grant_timeout_ms=1000)
    [reply] = await bed.round(request("a", {"g": 3}))
    bed.driver.close()  # a new instance takes over the object, its holder clock 5 s behind
    lagging = DurabilitySemaphore(scheduler=DurabilityScheduler(bed.ctx, clock=bed.clock), limit=5,
                                  grant_timeout_ms=1000, clock=lambda: bed.clock.now - 5000)
    deadline = reply["grants"][0]["claimBy"]
    bed.clock.set(deadline)
    await lagging.scheduler.alarm({})
    assert (await lagging.usage())["outstanding"] == 0
    assert lagging.scheduler.attempts(DurabilitySemaphore.RECLAIM_TIMER) == 0


@async_test
async def test_r3_a_queue_uninstalled_while_its_alarm_runs_is_not_recreated_by_its_wake_up():
    # R3 (third review): an alarm lists a fresh instance's due work; an earlier timer awaits and
    # meanwhile the queue is uninstalled (migrate(ctx, None)); the wake-up's turn must create
    # nothing. It used to trust a cached "the wake-up table exists" and re-create every table.
    clock = VirtualClock(T0)
    ctx = LocalContext(LocalStorage())

    def build():
        scheduler = DurabilityScheduler(ctx, clock=clock)
        client = SemaphoreClient(ctx, _Down(clock), clock=clock, client_id="c1")
        return scheduler, SemaphoreQueue(client=client, scheduler=scheduler, on_admit=lambda item: None)

    scheduler, queue = build()
    await queue.enqueue("a", "g", "i1")
    scheduler, queue = build()  # eviction: a new instance, whose arm() sees the wake-up table

    async def uninstall_meanwhile(name, due_at):
        await asyncio.sleep(0)
        SemaphoreQueue.migrate(ctx, None)

    scheduler.on("app:first", uninstall_meanwhile)
    scheduler.set_timer("app:first", T0 - 1)
    await scheduler.arm()
    await ctx.storage.deleteAlarm()
    await scheduler.alarm({})
    assert not [t for t in tables(ctx.storage) if "client" in t]


@async_test
async def test_r16_r37_reinstalled_tables_are_seen_by_the_next_arm_of_a_live_instance():
    # R16/R37 (third review): uninstall, an arm() that sees the tables gone, re-install by app
    # code (migrate(ctx, 1)) on the same live instances: the queue's wake-up and the holder's
    # reclaim are armed again. A cached "absent" used to keep next_due() None until eviction.
    clock = VirtualClock(T0)
    ctx = LocalContext(LocalStorage())
    scheduler = DurabilityScheduler(ctx, clock=clock)
    client = SemaphoreClient(ctx, _Down(clock), clock=clock, client_id="c1")
    queue = SemaphoreQueue(client=client, scheduler=scheduler, on_admit=lambda item: None)
    queue.ensure_schema()
    SemaphoreQueue.migrate(ctx, None)
    await scheduler.arm()
    SemaphoreQueue.migrate(ctx, 1)
    await queue.enqueue("a", "g", "i1")
    assert scheduler.due_times().get(WAKE) == queue.wake_at("a") == ctx.storage.alarm

    bed = Bed(5, grant_timeout_ms=1000)
    await bed.round(request("a", {"g": 3}))
    DurabilitySemaphore.migrate(bed.ctx, None)
    await bed.sem.scheduler.arm()
    DurabilitySemaphore.migrate(bed.ctx, 1)
    [reply] = await bed.round(request("a", {"g": 3}))
    deadline = reply["grants"][0]["claimBy"]
    assert bed.sem.scheduler.due_times()[DurabilitySemaphore.RECLAIM_TIMER] == deadline == bed.ctx.storage.alarm


# ---------------------------------------------------------------- the instance pumps its own changes
from semaphore.testing import HolderSide, Net  # noqa: E402


async def _queue_on_a_free_holder(limit: int = 2, leases=None):
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=limit, leases=leases)
    admitted: list[str] = []
    side = ClientSide("c1", clock, Net(holder, clock), on_admit=lambda side, item: admitted.append(item.item_id),
                      leases=leases)
    return clock, side, admitted


@async_test
async def test_r37_an_enqueue_and_a_completion_are_pumped_by_their_instance_not_by_the_objects_alarm():
    # R37 (wake-ups): an enqueue and a completion are pumped by the instance that made them, in
    # the background; the object's alarm (each invocation a billed request) is not used for them.
    # Before, each one set the key's wake-up to "now" and the alarm fired for it: one alarm per
    # enqueue and per completion.
    clock, side, admitted = await _queue_on_a_free_holder(limit=3)
    for i in range(3):
        await side.queue.enqueue(KEY_A, "g", f"i{i}")
    await clock.advance(3_000)   # the requests' round
    assert admitted == ["i0", "i1", "i2"] and side.driver.fired == 0
    await side.queue.complete("i0")
    await side.queue.enqueue(KEY_A, "g", "i3")
    await clock.advance(3_000)   # the release rides on i3's request; its round serves i3
    assert admitted == ["i0", "i1", "i2", "i3"] and side.driver.fired == 0


@async_test
async def test_r37_an_instance_that_dies_before_pumping_its_enqueue_leaves_it_to_the_alarm():
    # R37 (wake-ups): the durable wake-up of an enqueue is 10 s later: if the instance dies
    # before it pumped the key, the object's alarm wakes the next instance then, which admits it.
    clock, side, admitted = await _queue_on_a_free_holder()
    await side.queue.enqueue(KEY_A, "g", "i0")
    side.evict()   # before its background pump ran
    assert side.queue.wake_at(KEY_A) == S and side.storage.alarm == S
    await clock.advance(KICK_FALLBACK_MS - 1)
    assert admitted == [] and side.driver.fired == 0
    await clock.advance(3_000)   # the wake-up's request and its round
    assert side.driver.fired == 1 and [i.state.value for i in side.queue.items(KEY_A)] == ["running"]


@async_test
async def test_r3_r37_a_queue_reinstalled_under_a_live_instance_does_not_loop_its_wake_up():
    # R3, R37: migrate(ctx, None) then migrate(ctx, 1) while an instance lives (its copy of the
    # wake times says a key is due; SQL has no row): the wake-up sees its due keys differ from
    # SQL, forgets the copy and is not due again, rather than backed off forever for no
    # progress.
    clock, net = SimClock(T0), Down()
    side = client_object(clock, net)
    await enqueue_unpumped(side, "a", "g", "item1")
    await side.scheduler.arm()   # the copy: "a" due at S
    SemaphoreQueue.migrate(side.ctx, None)
    SemaphoreQueue.migrate(side.ctx, 1)
    await deliver(side)
    assert side.scheduler.attempts(WAKE) == 0 and timers(side.storage) == {}
    assert side.storage.alarm is None and side.scheduler.due_times() == {}
