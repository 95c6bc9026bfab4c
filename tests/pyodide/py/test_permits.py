"""SemaphoreQueue.permit(), concurrent async on_admit callbacks and work= inside Pyodide, through
the real SDK.

Client objects reach the reference Worker's ``AccountLimit`` holder (bound as ``ACCOUNT_LIMIT``)
over the stand-in RPC (``structuredClone``); rounds are 10 ms of the holder's real time. ``permit()`` is driven
by the queue's own background pump (an asyncio task started in the caller's RPC call), callbacks
run as asyncio tasks on Pyodide's event loop (the WebLoop), and the release of a finished permit
reaches the holder through the pump its completion kicks (an enqueue, a permit and a completion
are pumped by their own instance at once, in the background, not through the object's alarm:
SPEC R37 wake-ups). ``report_releases_within_ms=0`` keeps the release reports immediate. A test about a
timeout gives the client object a :class:`~semaphore.testing.VirtualClock` (``TimedPermits``):
the timeout then expires when the test moves that clock, after what it waits for has happened,
not after a stretch of real time that a loaded machine may fill differently.
"""

import asyncio
import time

from standins import Runtime
from workers import DurableObject

from entry import AccountLimit
from semaphore import (
    BlockedReason,
    DurabilityScheduler,
    DurabilitySemaphore,
    ItemState,
    PermitKind,
    PermitTimeoutError,
    SemaphoreClient,
    SemaphoreQueue,
    timeout,
)
from semaphore.runtime import Storage
from semaphore.testing import VirtualClock

KEY = "acct"
VARS = {"LEASES": "off",  # grants: these follow claims and their confirming syncs
        "ROUND_WAIT_MS": "10", "ROUND_PERIOD_MS": "0", "GRANT_TIMEOUT_MS": "10000", "ACCOUNT_CONCURRENCY": "1"}
HELPER = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke=lambda stub, message: stub.permits(message))
DRAIN_S = 20  # a callback or pump still running after this is a hang (e.g. serialised callbacks)


async def until(condition, what):
    """Poll ``condition()`` (real time: what it waits for is the holder's round) up to DRAIN_S."""
    deadline = time.monotonic() + DRAIN_S
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {DRAIN_S} s"
        await asyncio.sleep(0.005)


def holder_usage(env):
    """The holder's usage() over RPC (a JsDict)."""
    return env.ACCOUNT_LIMIT.getByName(KEY).usage()


class Base(DurableObject):
    """A client object: SemaphoreClient + SemaphoreQueue over the helper; its alarm drives the queue."""

    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.storage = Storage(ctx)
        self.clock = self.make_clock()
        self.scheduler = DurabilityScheduler(ctx, clock=self.clock)
        self.client = SemaphoreClient(ctx, HELPER.with_(timeout(30_000)).transport(env), clock=self.clock)
        self.queue = SemaphoreQueue(client=self.client, scheduler=self.scheduler, report_releases_within_ms=0,
                                    **self.options())

    def make_clock(self):
        return None  # the wall clock (Date.now())

    def options(self):
        return {}

    async def enqueue(self, item_id):
        return (await self.queue.enqueue(KEY, "g", str(item_id), {"n": item_id})).state.value

    async def alarm(self, info=None):
        await self.scheduler.alarm(info)


class Permits(Base):
    """No on_admit: the queue is used through permit() only."""

    async def hold_once(self):
        """RPC: one permit for a body that reads the holder's usage; what it saw, as plain data."""
        async with self.queue.permit(KEY, "g", payload={"job": 1}) as item:
            inside = await holder_usage(self.env)
            seen = {"item_id": item.item_id, "is_permit": item.is_permit, "state": item.state.value,
                    "admitted": item.admitted, "kind": item.permit.kind.value, "payload": item.payload,
                    "charged": inside.charged, "available": inside.available,
                    "grant_confirmed": None if (g := self.client.grant(KEY, item.permit.id)) is None else g.confirmed}
        # Left: the item is done, or deleted already by the pump its completion kicked (a
        # finished permit item is deleted at the next pump: its id is random).
        after = self.queue.item(seen["item_id"])
        seen["after_state"] = "deleted" if after is None else after.state.value
        await asyncio.wait_for(self.queue.drain(), DRAIN_S)
        seen["left"] = [i.item_id for i in self.queue.items(KEY)]
        return seen


class TimedPermits(Permits):
    """Permits on a VirtualClock (from the wall clock's now): its permit timeouts expire when
    the test advances the clock. The holder keeps the real clock (its rounds run by themselves)."""

    def make_clock(self):
        return VirtualClock(int(time.time() * 1000))

    async def time_out_behind(self, timeout_ms):
        """RPC: hold a permit (limit 1) and ask for a second with a timeout, which expires once
        the holder said why the second waits and the key's pump has stopped (nothing in flight)."""
        async with self.queue.permit(KEY, "g") as first:

            async def second_permit():
                try:
                    async with self.queue.permit(KEY, "g", timeout_ms=int(timeout_ms)):
                        return None
                except PermitTimeoutError as exc:
                    return exc

            waiter = asyncio.ensure_future(second_permit())
            await until(lambda: "g" in self.queue.blocked(KEY), "the holder's blocked answer")
            # The pump asked again each round until its 8-exchange bound paused the key (for
            # retry_ms on the frozen clock): no request is in flight when the timeout expires.
            await asyncio.wait_for(self.queue.drain(), DRAIN_S)
            assert not waiter.done()
            (second_id,) = [i.item_id for i in self.queue.items(KEY) if i.item_id != first.item_id]
            await self.clock.advance(int(timeout_ms))
            err = await asyncio.wait_for(waiter, DRAIN_S)
            if err is None:
                return {"raised": None}
            during = await holder_usage(self.env)
            # The withdrawn item is done, never charged, or deleted already by the pump its
            # withdrawal kicked (a finished permit item is deleted at the next pump).
            second = self.queue.item(second_id)
            seen = {"raised": type(err).__name__, "is_timeout": isinstance(err, TimeoutError),
                    "reason": err.blocked.reason is BlockedReason.LIMIT if err.blocked else None,
                    "waiting": err.blocked.waiting if err.blocked else None, "message": str(err),
                    "second": None if second is None else [second.state.value, second.permit is None,
                                                           second.is_permit],
                    "demand": [d.count for d in self.queue.demand(KEY)], "charged": during.charged}
        await asyncio.wait_for(self.queue.drain(), DRAIN_S)
        return seen

    def left(self):
        """RPC: the key's items (finished permit items are deleted at the next pump)."""
        return [i.item_id for i in self.queue.items(KEY)]


class Admits(Base):
    """Async on_admit: item "a" waits for an event that item "b"'s callback sets."""

    def options(self):
        self.order = []
        self.ev = asyncio.Event()
        return {"on_admit": self.on_admit}

    async def on_admit(self, item):
        self.order.append(("start", item.item_id, item.permit.kind.value))
        if item.item_id == "a":
            await self.ev.wait()   # a pump awaiting callbacks one at a time never gets to "b"
        else:
            await asyncio.sleep(0.01)
            self.ev.set()
        self.order.append(("end", item.item_id))


class Works(Base):
    """work=: the coroutine is the item's whole work; its return completes the item."""

    def options(self):
        return {"work": self.work}

    async def work(self, item):
        await asyncio.sleep(0.01)
        self.storage.exec("CREATE TABLE IF NOT EXISTS test_worked (item_id TEXT, kind TEXT, state TEXT)")
        self.storage.exec("INSERT INTO test_worked VALUES (?, ?, ?)", item.item_id, item.permit.kind.value,
                          item.state.value)


async def test_permit_through_a_round_and_a_confirmed_claim_is_released_to_the_holder():
    # R15a, R19, R37: permit() asks the holder (a round), claims, confirms with a sync, runs the
    # body; leaving it releases the permit, and the pump the release kicks (on the instance, not
    # the object's alarm: SPEC R37 wake-ups; hold_once waits for it) reports the release.
    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "PERMITS": Permits}, vars=VARS, auto_alarms=False)
    seen = await asyncio.wait_for(rt.stub("PERMITS", "p").hold_once(), DRAIN_S)
    assert seen.is_permit is True and seen.state == "running" and seen.admitted is True, seen
    assert seen.kind == "grant" and seen.grant_confirmed == 1, seen   # used only once confirmed (R15a)
    assert seen.payload == {"job": 1} and (seen.charged, seen.available) == (1, 0), seen
    assert seen.after_state in ("done", "deleted") and seen.left == [], seen
    usage = await holder_usage(rt.env)
    assert (usage.charged, usage.outstanding, usage.available) == (0, 0, 1), usage
    assert rt.sql("ACCOUNT_LIMIT", KEY, "SELECT * FROM durability_semaphore_grants") == []


async def test_permit_under_the_default_leases_is_a_lease_slot_handed_back_at_once():
    # The holder's default leases (LEASES unset): permit() gets its permit as a reusable lease of
    # one slot (no confirming sync), and leaving the block stops the lease, which the pump the
    # release kicks reports at once: nothing stays charged.
    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "PERMITS": Permits},
                 vars={k: v for k, v in VARS.items() if k != "LEASES"}, auto_alarms=False)
    seen = await asyncio.wait_for(rt.stub("PERMITS", "p").hold_once(), DRAIN_S)
    assert seen.is_permit is True and seen.state == "running" and seen.admitted is True, seen
    assert seen.kind == "lease" and (seen.charged, seen.available) == (1, 0), seen
    assert seen.after_state in ("done", "deleted") and seen.left == [], seen
    usage = await holder_usage(rt.env)
    assert (usage.charged, usage.leaseFootprint, usage.available) == (0, 0, 1), usage


async def test_permit_timeout_raises_with_the_limit_reason_and_leaves_nothing_charged():
    # R23: PermitTimeoutError carries the holder's blocked entry; the withdrawn request was never
    # charged and is asked for no more.
    # The timeout runs on the client object's VirtualClock: it expires after the holder's
    # blocked answer and once no request is in flight, however slow the machine is.
    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "PERMITS": TimedPermits}, vars=VARS, auto_alarms=False)
    p = rt.stub("PERMITS", "p")
    seen = await asyncio.wait_for(p.time_out_behind(400), 2 * DRAIN_S)  # within the harness's 60 s
    assert seen.raised == "PermitTimeoutError" and seen.is_timeout is True, seen
    assert seen.reason is True and seen.waiting == 1 and "limit" in seen.message, seen
    assert seen.second in (None, ["done", True, True]) and seen.demand == [], seen
    assert seen.charged == 1, seen                       # the first permit only
    # The withdrawal ended the key's request pause; the pump the first's release kicks (on the
    # instance, not the object's alarm: SPEC R37 wake-ups; time_out_behind waits for it)
    # reports that release and deletes both finished permit items.
    usage = await holder_usage(rt.env)
    assert (usage.charged, usage.outstanding) == (0, 0), usage
    assert await p.left() == []


async def test_async_on_admit_callbacks_of_one_key_run_concurrently():
    # Two async callbacks of one key are asyncio tasks on Pyodide's loop: "a" waits for an event
    # only "b" sets, so running them one after the other would never end.
    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "ADMITS": Admits}, vars={**VARS, "ACCOUNT_CONCURRENCY": "2"},
                 auto_alarms=False)
    q = rt.stub("ADMITS", "q")
    assert [await q.enqueue("a"), await q.enqueue("b")] == ["queued", "queued"]
    # The instance pumps its enqueues itself (SPEC R37 wake-ups): request, claim, sync, start;
    # drain() waits for both callbacks as well ("a" ends only once "b" ran).
    inst = await rt.instance("ADMITS", "q")
    await asyncio.wait_for(inst.queue.drain(), DRAIN_S)
    assert inst.order == [("start", "a", "grant"), ("start", "b", "grant"), ("end", "b"), ("end", "a")], inst.order
    items = {i.item_id: i for i in inst.queue.items(KEY)}
    assert all(i.state is ItemState.RUNNING and i.admitted and i.attempts == 1 and i.error is None
               for i in items.values()), items
    assert (await holder_usage(rt.env)).charged == 2


async def test_work_completes_the_item_when_the_coroutine_returns():
    # work=: the item runs under its permit, turns done when the coroutine returns, and its
    # release reaches the holder (the returning work kicks a pump; releases are reported at once).
    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "WORKS": Works}, vars=VARS, auto_alarms=False)
    q = rt.stub("WORKS", "q")
    assert await q.enqueue("j1") == "queued"
    inst = await rt.instance("WORKS", "q")
    await asyncio.wait_for(inst.queue.drain(), DRAIN_S)   # the instance pumps its enqueue (R37)
    assert rt.sql("WORKS", "q", "SELECT * FROM test_worked") == [{"item_id": "j1", "kind": "grant",
                                                                   "state": "running"}]
    item = inst.queue.item("j1")
    assert item.state is ItemState.DONE and item.permit.kind is PermitKind.GRANT, item
    assert item.attempts == 1 and item.error is None and item.admitted, item
    usage = await holder_usage(rt.env)
    assert (usage.charged, usage.outstanding) == (0, 0), usage
