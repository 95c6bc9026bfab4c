"""SemaphoreQueue.permit(): one permit for the body of an ``async with`` (issue 10), against a
real holder over the in-memory transport, on virtual time.

Each test names the rule it leans on: the permit is a queue item, so it is admitted like one
(R15a: grant claims confirmed before use, R34: lease draws need no round trip) and its release
is a cumulative report (R13, R19)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from semaphore import BlockedReason, ItemState, PermitKind, PermitTimeoutError, QueueItem
from semaphore.testing import SEED_ROUNDS, SEED_TIMING, T0, ClientSide, HolderSide, Net, SimClock, async_test

KEY = "acct"
LEASES = {"provisioning": {"mode": "strict"}, "permitsPerLease": 4, "ttlMs": 60_000}

pytestmark = pytest.mark.usefixtures("quiet_logs")


def finished(queue, item_id: str) -> bool:
    """A permit() item is done once its caller left the block; the next pump deletes it (its id
    is random, so there is nothing to remember it for)."""
    item = queue.item(item_id)
    return item is None or item.state is ItemState.DONE


class Setup:
    def __init__(self, limit: int = 2, **holder_options: Any) -> None:
        self.clock = SimClock(T0)
        self.holder = HolderSide(self.clock, limit=limit, **{"leases": None, **holder_options})  # grants: these tests are of the grant path (the default leases: test_reusable_leases.py)
        self.net = Net(self.holder, self.clock)
        self.side = ClientSide("c1", self.clock, self.net, report_releases_within_ms=0)

    @property
    def queue(self):
        return self.side.queue

    async def usage(self) -> dict:
        return await self.holder.usage()

    def spawn(self, coro) -> asyncio.Task:
        return self.side.spawn(coro)

    async def hold(self, group: str = "g", **options: Any) -> tuple[asyncio.Event, asyncio.Event, dict]:
        """Start a task that holds a permit until ``release`` is set; ``got`` is set inside."""
        got, release, seen = asyncio.Event(), asyncio.Event(), {}

        async def body() -> None:
            async with self.queue.permit(KEY, group=group, **options) as item:
                seen["item"] = item
                got.set()
                await release.wait()

        seen["task"] = self.spawn(body())
        return got, release, seen


@async_test
async def test_r15a_permit_through_a_round_and_a_confirmed_claim_then_released_durably():
    s = Setup(limit=2)
    got, release, seen = await s.hold()
    await s.clock.advance(3000)  # the round (round_wait_ms), then the claim's confirming sync
    assert got.is_set()
    item: QueueItem = seen["item"]
    assert item.is_permit and item.state is ItemState.RUNNING and item.admitted
    assert item.permit is not None and item.permit.kind is PermitKind.GRANT
    grant = s.side.client.grant(KEY, item.permit.id)
    assert grant is not None and grant.confirmed >= item.permit.slot  # R15a: used only once confirmed
    assert [m["type"] for m in s.net.sent][:2] == ["request", "sync"]
    assert (await s.usage())["outstanding"] >= 1
    release.set()
    await s.clock.advance(1000)
    assert seen["task"].done() and seen["task"].exception() is None
    assert finished(s.queue, item.item_id)
    await s.clock.advance(11_000)  # the unclaimed rest of the grant returns at claimBy (R15)
    assert (await s.usage())["outstanding"] == 0  # R19: the release reached the holder


@async_test
async def test_r34_permit_from_a_live_lease_at_once_without_a_holder_call():
    s = Setup(limit=8, leases=LEASES)
    got, release, seen = await s.hold()
    await s.clock.advance(3000)
    assert got.is_set()
    assert s.side.client.leases(KEY), "the first request also got a lease"
    sent = len(s.net.sent)
    async with s.queue.permit(KEY, group="g") as item:  # no virtual time passes: it is at once
        assert item.permit is not None and item.permit.kind is PermitKind.LEASE
        assert len(s.net.sent) == sent  # R34: drawn locally, no round trip
    release.set()
    await s.clock.advance(1000)


@async_test
async def test_permit_timeout_raises_with_the_blocked_reason_and_leaves_nothing_charged():
    s = Setup(limit=1)
    got, release, _ = await s.hold()
    await s.clock.advance(3000)
    assert got.is_set()
    before = await s.usage()

    async def wait_for_second() -> None:
        async with s.queue.permit(KEY, group="g", timeout_ms=5000):
            raise AssertionError("no permit should come while the limit is held")

    task = s.spawn(wait_for_second())
    await s.clock.advance(6000)
    assert task.done()
    err = task.exception()
    assert isinstance(err, PermitTimeoutError) and isinstance(err, TimeoutError)
    assert err.blocked is not None and err.blocked.reason is BlockedReason.LIMIT  # R23: why it waited
    assert "limit" in str(err)
    (held,) = [i for i in s.queue.items(KEY) if i.state is not ItemState.DONE]  # the withdrawn one is done
    assert held.admitted  # only the first caller's item is live
    assert all(i.permit is None for i in s.queue.items(KEY) if i.state is ItemState.DONE)  # never charged
    assert s.queue.demand(KEY) == []  # nothing asked for any more
    await s.clock.advance(5000)
    after = await s.usage()
    assert after["outstanding"] == before["outstanding"] == 1
    release.set()
    await s.clock.advance(1000)


@async_test
async def test_body_that_raises_releases_the_permit_and_the_error_propagates():
    s = Setup(limit=1)

    async def failing() -> None:
        async with s.queue.permit(KEY, group="g"):
            raise KeyError("boom")

    task = s.spawn(failing())
    await s.clock.advance(3000)
    assert isinstance(task.exception(), KeyError)
    assert all(i.state is ItemState.DONE for i in s.queue.items(KEY))
    await s.clock.advance(12_000)
    assert (await s.usage())["outstanding"] == 0  # R19: released, and the grant's rest reclaimed


@async_test
async def test_cancelled_waiter_withdraws_its_request():
    s = Setup(limit=1)
    got, release, _ = await s.hold()
    await s.clock.advance(3000)
    task = s.spawn(_enter_and_wait(s))
    await s.clock.advance(2500)
    assert not task.done()
    task.cancel()
    await s.clock.advance(10)
    assert task.cancelled()
    waiting = [i for i in s.queue.items(KEY) if i.state is not ItemState.DONE]
    assert len(waiting) == 1  # only the holder of the permit is left
    assert s.queue.demand(KEY) == []
    release.set()
    await s.clock.advance(1000)


async def _enter_and_wait(s: Setup) -> None:
    async with s.queue.permit(KEY, group="g"):
        await asyncio.sleep(3600)


@async_test
async def test_permit_held_across_an_eviction_is_released_by_the_next_instance():
    # Durable across eviction: the caller died with the object; its permit must not stay charged.
    s = Setup(limit=1)
    got, _release, seen = await s.hold()
    await s.clock.advance(3000)
    assert got.is_set()
    held: QueueItem = seen["item"]
    assert (await s.usage())["outstanding"] == 1
    s.side.evict()  # the body dies with the object: nothing it would have written is written
    assert s.queue.item(held.item_id).state is ItemState.RUNNING
    await s.clock.advance(61_000)  # at the latest orphan_check_ms later, the alarm's pump releases it
    assert finished(s.queue, held.item_id)
    await s.clock.advance(1000)
    assert (await s.usage())["outstanding"] == 0
    # and the new instance serves new permits
    got2, release2, seen2 = await s.hold()
    await s.clock.advance(4000)
    assert got2.is_set()
    release2.set()
    await s.clock.advance(1000)


@async_test
async def test_permit_waiting_across_an_eviction_is_withdrawn_by_the_next_instance():
    s = Setup(limit=1)
    got, release, _ = await s.hold()
    await s.clock.advance(3000)
    s.spawn(_enter_and_wait(s))
    await s.clock.advance(100)
    waiting = [i for i in s.queue.items(KEY) if i.state is ItemState.QUEUED]
    assert len(waiting) == 1
    s.side.evict()  # both callers die
    await s.clock.advance(61_000)
    assert all(i.state is ItemState.DONE for i in s.queue.items(KEY))
    await s.clock.advance(12_000)
    assert (await s.usage())["outstanding"] == 0  # the held one released, the waiting one never charged


@async_test
async def test_permit_rejects_bad_ids_and_timeouts_naming_the_field():
    from semaphore import ConfigurationError

    s = Setup()
    for kwargs, field in (({"group": ""}, "group"), ({"timeout_ms": -1}, "timeout_ms"),
                          ({"group": "a\x00b"}, "group")):
        with pytest.raises(ConfigurationError) as err:
            async with s.queue.permit(KEY, **kwargs):
                pass
        assert err.value.field == field
    assert s.queue.items() == []


@async_test
async def test_a_queue_without_on_admit_refuses_enqueue_but_serves_permits():
    from semaphore import ConfigurationError

    s = Setup()
    with pytest.raises(ConfigurationError) as err:
        await s.queue.enqueue(KEY, "g", "job-1")
    assert err.value.field == "on_admit"
    assert s.queue.items() == []


def test_a_second_queue_on_the_same_scheduler_is_refused():
    # One queue per object (it serves permit() and callbacks for every key): a second one on the
    # same scheduler would replace the first's wake-up participant, so the first's permit
    # callers would never be handed their admitted permits and its on_admit never called
    # (review finding F1).
    from semaphore import ConfigurationError, SemaphoreQueue

    s = Setup(limit=1)
    with pytest.raises(ConfigurationError) as err:
        SemaphoreQueue(client=s.side.client, scheduler=s.side.scheduler)
    assert err.value.field == "scheduler" and "one queue per object" in str(err.value)


@async_test
async def test_a_permit_withdrawn_while_its_claim_is_in_flight_is_released_once_and_not_reported_as_orphan(caplog):
    # R15a: the claim's confirming sync reaches the holder but its reply is lost, and the
    # timeout hits before the retry; the claim is released when the holder answers the retry,
    # exactly once, and the withdrawn item is not taken for an orphan ("no caller" warning).
    import logging

    s = Setup(limit=1, **SEED_TIMING)  # staged on batched rounds (R9), not R9a's rounds at once
    original = s.net.intercept

    async def run() -> None:
        async with s.queue.permit(KEY, group="g", timeout_ms=1500):
            raise AssertionError("the claim is confirmed only after the timeout")

    lost = {"done": False}

    def lose_first_sync_reply(key: str, message: dict) -> None:
        if message.get("type") == "sync" and not lost["done"]:
            lost["done"] = True
            s.net.p["lose_reply"] = 1.0  # the claim reaches the holder, its reply is lost
        else:
            s.net.p["lose_reply"] = 0.0
        return None if original is None else original(key, message)

    s.net.intercept = lose_first_sync_reply
    with caplog.at_level(logging.WARNING, logger="semaphore.queue"):
        task = s.spawn(run())
        while not task.done():
            await s.clock.advance(50)
        (item,) = s.queue.items(KEY)
        assert item.state is ItemState.CLAIMING  # withdrawn while its claim is on the way
        await s.clock.advance(20_000)
    assert isinstance(task.exception(), PermitTimeoutError)
    assert all(i.state is ItemState.DONE for i in s.queue.items(KEY))
    assert not [r for r in caplog.records if "no caller" in r.getMessage()]
    await s.clock.advance(12_000)
    assert (await s.usage())["outstanding"] == 0


# ---------------------------------------------------------------------------- review findings
@async_test
async def test_a_dead_instances_claiming_permit_does_not_keep_the_wakeup_due_while_the_holder_is_down():
    # Review F2: the dead instance's item, withdrawn with its claim in flight, is left to the
    # claim's own network-paced wake-up; its stale orphan check must not make the key due "now"
    # after every pump (the scheduler would back off the whole queue as making no progress).
    from semaphore import HolderUnavailableError, SemaphoreQueue

    s = Setup(limit=1)
    s.side.queue_options["orphan_check_ms"] = 5_000
    s.side.evict()  # restart with the option
    down = {"on": False}

    def intercept(key: str, message: dict) -> None:
        if message.get("type") == "sync" or down["on"]:
            down["on"] = True
            raise HolderUnavailableError("holder down (test)")
        return None

    s.net.intercept = intercept
    s.spawn(_enter_and_wait(s))
    await s.clock.advance(1500)  # the round; its claim's confirming sync fails
    (item,) = s.queue.items(KEY)
    assert item.state is ItemState.CLAIMING
    await s.clock.advance(10_000)
    s.side.evict()
    await s.clock.advance(66_000)
    assert s.side.scheduler.attempts(SemaphoreQueue.TIMER) == 0
    await s.queue.pump(KEY)
    assert s.queue.wake_at(KEY) > s.clock.now  # paced by retry_ms, not due at once


@async_test
async def test_a_permit_drawn_from_a_lease_at_once_arms_the_alarm_for_its_orphan_check():
    # Review F4: served from a lease with no holder call, the permit still re-arms the alarm, so
    # after an eviction its permit is released within orphan_check_ms, not at whatever the alarm
    # was armed for before (an idle lease's stop, up to ttlMs later).
    leases = {"provisioning": {"mode": "strict"}, "permitsPerLease": 4, "ttlMs": 1_800_000}
    s = Setup(limit=8, leases=leases)
    got, release, _ = await s.hold()
    await s.clock.advance(3000)
    assert got.is_set() and s.side.client.leases(KEY)
    release.set()
    await s.clock.advance(100_000)  # idle: the lease is live with undrawn permits
    got2, _release2, seen2 = await s.hold()
    await s.clock.settle()
    assert got2.is_set() and seen2["item"].permit.kind is PermitKind.LEASE
    s.side.evict()  # the body dies with the object
    await s.clock.advance(65_000)
    assert finished(s.queue, seen2["item"].item_id)


@async_test
async def test_complete_refuses_the_item_of_a_live_permit_call():
    # Review F5: complete() of a waiting caller's item would leave the caller waiting forever (and
    # of a running one, its body running without a permit): refused, naming the field.
    from semaphore import ConfigurationError

    s = Setup(limit=1)
    got1, release1, _ = await s.hold()
    await s.clock.advance(3000)
    _got2, release2, seen2 = await s.hold()
    await s.clock.advance(100)
    for item in s.queue.items(KEY):
        with pytest.raises(ConfigurationError) as err:
            await s.queue.complete(item.item_id)
        assert err.value.field == "item_id"
    release1.set()
    await s.clock.advance(5000)
    assert "item" in seen2  # the waiter got the freed permit
    release2.set()
    await s.clock.advance(1000)
    assert seen2["task"].done() and seen2["task"].exception() is None


@async_test
async def test_permit_cost_does_not_grow_with_finished_items():
    # Review F7: finished permit items are deleted (their ids are random: nothing to remember),
    # and the insert's MAX(seq) is an index lookup, so one permit() costs the same SQLite work
    # over 10 or 50,000 earlier finished items.
    async def vm_steps(done_rows: int) -> int:
        s = Setup(limit=4)
        s.queue.ensure_schema()
        conn = s.side.storage.connection
        conn.executemany(
            "INSERT INTO durability_semaphore_client_items(item_id, key, group_name, payload, enqueued_at, seq,"
            " state, permit_kind, permit_id, slot, started_at, admitted, attempts, retry_at, checked_at,"
            " finished_at, cancel, owner) VALUES (?, ?, 'g', 'null', ?, ?, 'done', '', '', 0, 0, 1, 0, 0, 0, ?,"
            " 0, '')", ((f"job-{n}", f"other{n % 50}", T0, n + 1, T0) for n in range(done_rows)))
        steps = [0]

        def count() -> int:
            steps[0] += 1
            return 0

        conn.set_progress_handler(count, 100)
        async with s.queue.permit(KEY, timeout_ms=0):  # a try on a free holder (R9b): served at once
            pass
        conn.set_progress_handler(None, 0)
        await s.clock.advance(5000)
        return steps[0] * 100

    small, large = await vm_steps(10), await vm_steps(50_000)
    assert large < 2 * small + 2_000, (small, large)


@async_test
async def test_finished_permit_items_are_deleted_at_the_next_pump():
    s = Setup(limit=2)

    async def three() -> None:
        for _ in range(3):
            async with s.queue.permit(KEY, timeout_ms=10_000):
                pass

    task = s.spawn(three())
    for _ in range(100):
        if task.done():
            break
        await s.clock.advance(500)
    assert task.done() and task.exception() is None
    await s.queue.pump(KEY)
    assert s.queue.items(KEY) == []


@async_test
async def test_a_grant_answering_a_withdrawn_permit_s_request_goes_back_at_once():
    # R15b: the permit times out while its request waits for the round (the key is contended:
    # its previous request was blocked); the permit held meanwhile is released in a side sync
    # before that round runs, so the round grants the withdrawn demand. Nothing queued can use
    # the grant: it goes back at once, not at its claimBy (R15), so the capacity is not held
    # idle for grant_timeout_ms (10 s) while others may wait for it.
    s = Setup(limit=1, **SEED_ROUNDS)  # staged on the original's batched round timing
    got, release, seen = await s.hold()
    await s.clock.advance(3000)
    assert got.is_set()
    first = seen["item"].permit.id

    async def wait_for_second() -> None:
        async with s.queue.permit(KEY, group="g", timeout_ms=2500):
            raise AssertionError("no permit should come while the limit is held")

    task = s.spawn(wait_for_second())
    await s.clock.advance(2600)  # blocked at the round of +1 s; asked again at +2 s for the round of +3 s
    assert isinstance(task.exception(), PermitTimeoutError)
    assert s.net.sent[-1]["type"] == "request" and s.net.sent[-1]["demand"], s.net.sent[-1]
    release.set()  # released at once (a side sync: the key is contended), before the round
    await s.clock.advance(1000)  # the round ran and answered the withdrawn demand
    late = [g for g in s.side.client.grants(KEY, include_gone=True) if g.grant_id != first]
    assert len(late) == 1 and late[0].permits == 1, late
    assert late[0].claimed == late[0].released == 1, late  # given back (claimed to be released, never used)
    assert (await s.usage())["outstanding"] == 0  # long before its claimBy
    assert s.queue.items(KEY) == [] and s.queue.demand(KEY) == []


@async_test
async def test_a_given_back_grant_is_reported_at_once_with_the_default_report_window():
    # R37 decision (surplus grants), R15a: c1's permit times out while its request waits for the
    # round, which then grants the withdrawn demand. c1 gives the grant back: it claims it, and
    # once the holder confirms the claim it releases it and reports that at once, as an undrawn
    # lease stop (R29), not after report_releases_within_ms (10 s by default; before, c2 waited
    # 13 s, longer than the grant's own claimBy would have kept it).
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=1, **SEED_TIMING, grant_timeout_ms=4_000, leases=None)
    net = Net(holder, clock)
    c1, c2 = ClientSide("c1", clock, net), ClientSide("c2", clock, net)  # default report window

    async def withdrawn() -> None:
        async with c1.queue.permit(KEY, group="g", timeout_ms=300):
            raise AssertionError("no permit: the round comes after the timeout")

    first = c1.spawn(withdrawn())
    await clock.advance(2_000)
    assert isinstance(first.exception(), PermitTimeoutError)
    got: dict[str, int] = {}

    async def later() -> None:
        async with c2.queue.permit(KEY, group="g", timeout_ms=30_000):
            got["at"] = clock.now - T0

    second = c2.spawn(later())
    await clock.advance(2_000)
    assert second.done() and second.exception() is None and got["at"] <= 3_000, got
    (grant,) = c1.client.grants(KEY, include_gone=True)
    assert grant.claimed == grant.released == 1, grant  # given back, never used
