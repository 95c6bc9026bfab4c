"""Tier 1: the shipped test kit (:mod:`semaphore.testing`) used the way an application uses it
to test its own objects: a holder Durable Object of its own that wraps DurabilitySemaphore,
client objects (ClientSide) talking to it over the faulty in-memory network (Net), everything on
one virtual clock, eviction through ObjectTasks, storage read back with the inspection helpers.
Only the kit's public API is used here (issue 9)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import semaphore.testing as kit
from semaphore import DurabilityScheduler, DurabilitySemaphore, ItemState, QueueItem
from semaphore.testing import (
    RECLAIM_TIMER,
    SEED_TIMING,
    T0,
    AlarmDriver,
    Bed,
    ClientSide,
    LocalContext,
    Net,
    ObjectTasks,
    SimClock,
    VirtualClock,
    async_test,
    blocked,
    by_id,
    check_aggregates,
    dump,
    request,
    run,
    sync,
    timers,
)

KEY = "acct"


class AccountLimit:
    """An application's holder object (a ``workers.DurableObject`` in a Worker)."""

    def __init__(self, ctx: Any, clock: VirtualClock, limit: int, **options: Any) -> None:
        self.ctx = ctx
        self.tasks = ObjectTasks()  # test-only: lets the test evict this instance
        self.scheduler = DurabilityScheduler(ctx, clock=clock)
        self.semaphore = DurabilitySemaphore(scheduler=self.scheduler, limit=limit, clock=clock, **options)

    async def permits(self, message: dict[str, Any]) -> dict[str, Any]:  # the RPC method
        return await self.tasks.call(self.semaphore.handle(message))

    async def alarm(self, info: Any = None) -> None:
        await self.tasks.call(self.scheduler.alarm(info))


class App:
    """The application under test: one holder object, some client objects, a job system."""

    def __init__(self, *, limit: int = 2, clients: int = 2, faults: float = 0.0, seed: int = 1) -> None:
        self.clock = SimClock(T0)
        self.ctx = LocalContext(name="acct-holder")
        self.limit = limit
        self.holder = AccountLimit(self.ctx, self.clock, limit)
        AlarmDriver(self.clock, self.ctx.storage, lambda info: self.holder.alarm(info), max_retries=100)
        self.net = Net(lambda message: self.holder.permits(message), self.clock, random.Random(seed),
                       lose_request=faults, lose_reply=faults, duplicate=faults, delay=faults)
        self.running: set[str] = set()
        self.most = 0
        self.sides = [ClientSide(f"runner{i}", self.clock, self.net, on_admit=self.start, retry_ms=500)
                      for i in range(clients)]

    async def start(self, side: ClientSide, item: QueueItem) -> None:
        self.running.add(item.item_id)
        self.most = max(self.most, len(self.running))

    async def finish(self, side: ClientSide, item_id: str) -> None:
        self.running.discard(item_id)
        await side.spawn(side.queue.complete(item_id))

    def evict_holder(self) -> None:
        self.holder.tasks.cancel()
        self.holder = AccountLimit(self.ctx, self.clock, self.limit)

    async def run_jobs(self, jobs: int) -> None:
        for n in range(jobs):
            side = self.sides[n % len(self.sides)]
            await side.spawn(side.queue.enqueue(KEY, "default", f"job{n}"))
        for _ in range(400):
            await self.clock.advance(500)
            for side in self.sides:
                for item in side.queue.items(KEY, ItemState.RUNNING):
                    if item.item_id in self.running:
                        await self.finish(side, item.item_id)
            if all(i.state is ItemState.DONE for s in self.sides for i in s.queue.items(KEY)):
                return

    def done(self) -> bool:
        return all(i.state is ItemState.DONE for s in self.sides for i in s.queue.items(KEY))

    async def returned(self) -> dict[str, Any]:
        """Run time until the clients have reported every permit back; the holder's usage."""
        for _ in range(200):
            usage = await self.holder.semaphore.usage()
            if usage["outstanding"] == 0 and usage["leaseFootprint"] == 0:
                break
            await self.clock.advance(1_000)
        return usage


@async_test
async def test_a_users_holder_object_serves_client_objects_over_the_in_memory_network():
    # I1, I3: never more jobs running than the limit; every permit comes back.
    app = App(limit=2, clients=3)
    await app.run_jobs(7)
    assert app.done() and app.most == 2
    usage = await app.returned()
    assert usage["outstanding"] == 0 and usage["leaseFootprint"] == 0
    assert check_aggregates(app.ctx)["total"]["outstanding"] == 0
    assert app.net.stats["sent"] > 0 and app.net.stats["lost_request"] == 0


@async_test
async def test_a_users_objects_survive_a_lossy_network_and_evictions():
    # I1, I3 under faults: messages lost, duplicated, delayed; both sides evicted mid-run.
    app = App(limit=2, clients=2, faults=0.1, seed=7)
    for n in range(6):
        side = app.sides[n % 2]
        await side.spawn(side.queue.enqueue(KEY, "default", f"job{n}"))
    await app.clock.advance(3_000)
    app.evict_holder()
    app.sides[0].evict()
    app.net.enabled = False  # heal the network; the rest must settle on its own
    await app.run_jobs(0)
    assert app.done() and app.most <= 2
    assert app.net.stats["lost_request"] + app.net.stats["lost_reply"] + app.net.stats["duplicated"] > 0
    assert app.sides[0].evictions == 1
    assert (await app.returned())["outstanding"] == 0
    check_aggregates(app.ctx)


@async_test
async def test_evicting_a_users_holder_fails_the_calls_waiting_for_its_round():
    # R4: the instance's round timer dies with it; the waiting call is answered round_failed,
    # nothing was granted, and a fresh instance over the same storage serves the retry.
    clock = VirtualClock()
    ctx = LocalContext()
    holder = AccountLimit(ctx, clock, limit=3, **SEED_TIMING)  # a batched round waits (R9)
    waiting = holder.tasks.call(holder.semaphore.handle(request("c1", {"g": 2}, oldest_at=T0)))
    task = asyncio.ensure_future(waiting)
    await clock.settle()
    assert holder.tasks.pending() == 1  # the round timer
    holder.tasks.cancel()
    await clock.settle()
    assert task.done() and task.result()["error"]["code"] == "round_failed"
    holder = AccountLimit(ctx, clock, limit=3)
    retry = asyncio.ensure_future(holder.permits(request("c1", {"g": 2}, oldest_at=T0)))
    await clock.advance(1_000)
    (grant,) = (await retry)["grants"]
    assert grant["permits"] == 2 and holder.scheduler.due_times()[RECLAIM_TIMER] == grant["claimBy"]


@async_test
async def test_the_holder_bed_with_message_builders_and_inspection():
    # R9, R23, R7, I5 through the Bed: a round, a blocked group, a sync, an invalid message.
    bed = Bed(limit=3)
    replies = dict(zip("ab", await bed.round(request("a", {"g": 2}), request("b", {"g": 2}))))
    permits = {c: sum(g["permits"] for g in r["grants"]) for c, r in replies.items()}
    assert sorted(permits.values()) == [1, 2]
    full, short = sorted(replies, key=lambda c: -permits[c])
    assert blocked(replies[short]) == {"g": ("limit", 1)}
    (grant_id,) = by_id(replies[full])
    reply = await bed.one(sync(full, [(grant_id, 2, 1)]))   # both claimed, one released
    assert "error" not in reply and bed.grants()[grant_id]["released"] == 1
    before = dump(bed.storage)
    bad = await bed.one({"type": "request", "v": 1})
    assert bad["error"]["code"] == "invalid_message" and dump(bed.storage) == before
    bed.evict()
    assert (await bed.usage())["outstanding"] == 2 and bed.evictions == 1
    assert bed.check()["total"]["outstanding"] == 2 and bed.charged() == (2, {"g": 2})


@async_test
async def test_driving_a_scheduler_by_hand_with_the_public_clock_and_storage():
    # R16: the alarm is delivered by hand: clear it as the runtime does, put the clock at it.
    clock = VirtualClock()
    ctx = LocalContext()
    scheduler = DurabilityScheduler(ctx, clock=clock)
    ran: list[int] = []
    scheduler.on("app:job", lambda name, due: ran.append(clock()))
    await scheduler.schedule("app:job", T0 + 5_000)
    clock.set(ctx.storage.alarm)
    await ctx.storage.deleteAlarm()
    await scheduler.alarm({})
    assert ran == [T0 + 5_000] and ctx.storage.alarm is None and timers(ctx) == {}


def test_run_and_the_public_names():
    async def answer() -> int:
        return 42

    assert run(answer()) == 42
    assert all(getattr(kit, name).__doc__ for name in kit.__all__ if callable(getattr(kit, name)))
    assert {"Bed", "HolderSide", "ClientSide", "Net", "SimClock", "TaskAlarmDriver", "request",
            "sync", "check_aggregates", "dump", "timers", "async_test"} <= set(kit.__all__)
