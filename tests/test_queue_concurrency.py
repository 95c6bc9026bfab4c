"""The queue does not serialise work (issue 10): async ``on_admit`` callbacks of one key run
concurrently, bounded by ``admit_concurrency``; ``work=`` runs a coroutine as the item's work;
the holder's ``blocked`` reason is kept per ``(key, group)`` and shown in the item view (R23)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from semaphore import BlockedReason, ConfigurationError, ItemState, QueueItem
from semaphore.testing import T0, ClientSide, HolderSide, Net, SimClock, async_test

KEY = "acct"

pytestmark = pytest.mark.usefixtures("quiet_logs")


def setup(limit: int = 4, *, on_admit: Any = None, **queue_options: Any) -> tuple[SimClock, HolderSide, Net, ClientSide]:
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=limit, group_limit=queue_options.pop("group_limit", None),
                        leases=None)  # grants: the queue's claims (the default leases: test_reusable_leases.py)
    net = Net(holder, clock)
    side = ClientSide("c1", clock, net, on_admit=on_admit, report_releases_within_ms=0, **queue_options)
    return clock, holder, net, side


@async_test
async def test_r37_async_on_admit_callbacks_of_one_key_run_concurrently():
    # Two callbacks of one key: the first waits for the second to have started. Run one after
    # the other (the old pump awaited each), the first would wait forever.
    second_started = asyncio.Event()
    finished: list[str] = []

    async def on_admit(side: ClientSide, item: QueueItem) -> None:
        if item.item_id == "a":
            await second_started.wait()
        else:
            second_started.set()
        finished.append(item.item_id)

    clock, _holder, _net, side = setup(on_admit=on_admit)
    await side.queue.enqueue(KEY, "g", "a")
    await side.queue.enqueue(KEY, "g", "b")
    await clock.advance(4000)
    assert sorted(finished) == ["a", "b"]
    assert all(side.queue.item(i).admitted for i in ("a", "b"))


@async_test
async def test_r37_a_slow_callback_does_not_hold_other_items_heartbeats_or_releases():
    # "a" never returns from on_admit. "b" is admitted, completed, and its release reaches the
    # holder (a sync) while "a"'s callback is still running.
    gate = asyncio.Event()

    async def on_admit(side: ClientSide, item: QueueItem) -> None:
        if item.item_id == "a":
            await gate.wait()

    clock, holder, net, side = setup(limit=1, on_admit=on_admit)
    await side.queue.enqueue(KEY, "g", "a")
    await clock.advance(4000)
    assert side.queue.item("a").state is ItemState.RUNNING and not side.queue.item("a").admitted
    await side.queue.enqueue(KEY, "g", "b")
    await side.queue.complete("a")  # a's work is done elsewhere even though its callback hangs
    await clock.advance(6000)
    assert side.queue.item("b").state is ItemState.RUNNING and side.queue.item("b").admitted
    await side.queue.complete("b")
    await clock.advance(15_000)
    assert (await holder.usage())["outstanding"] == 0  # both releases reported; nothing waited for "a"
    gate.set()
    await side.queue.drain()


@async_test
async def test_admit_concurrency_bounds_admissions_and_demand_and_a_returning_callback_admits_the_next():
    gates: dict[str, asyncio.Event] = {}
    started: list[str] = []

    async def on_admit(side: ClientSide, item: QueueItem) -> None:
        started.append(item.item_id)
        gates.setdefault(item.item_id, asyncio.Event())
        await gates[item.item_id].wait()

    clock, holder, net, side = setup(limit=10, on_admit=on_admit, admit_concurrency=2)
    for n in range(5):
        await side.queue.enqueue(KEY, "g", f"i{n}")
    (d,) = side.queue.demand(KEY)
    assert d.count == 2  # asks only for what it may admit
    await clock.advance(4000)
    assert started == ["i0", "i1"]
    requests = [m for m in net.sent if m["type"] == "request"]
    assert [x["count"] for x in requests[0]["demand"]] == [2]
    assert (await holder.usage())["outstanding"] <= 2  # no permit held idle for a callback slot
    gates["i0"].set()
    await clock.advance(4000)
    assert started == ["i0", "i1", "i2"]  # the freed slot admitted the next, oldest first
    for g in list(gates.values()):
        g.set()
    for _ in range(4):
        for g in list(gates.values()):
            g.set()
        await clock.advance(4000)
    assert started == ["i0", "i1", "i2", "i3", "i4"]


@async_test
async def test_work_runs_the_coroutine_and_completes_the_item_when_it_returns():
    ran: list[str] = []

    async def work(item: QueueItem) -> None:
        ran.append(item.item_id)

    clock, holder, _net, side = setup(limit=2, work=work)
    await side.queue.enqueue(KEY, "g", "j1")
    await clock.advance(4000)
    assert ran == ["j1"]
    assert side.queue.item("j1").state is ItemState.DONE  # completed: its permit released
    await clock.advance(12_000)
    assert (await holder.usage())["outstanding"] == 0


@async_test
async def test_work_that_raises_is_retried_under_the_same_permit_then_released_after_work_attempts(caplog):
    calls: list[tuple[str, Any]] = []

    async def work(item: QueueItem) -> None:
        calls.append((item.item_id, item.permit))
        raise RuntimeError(f"attempt {item.attempts}")

    clock, holder, _net, side = setup(limit=2, work=work, work_attempts=3, admit_retry_ms=1000)
    with caplog.at_level(logging.ERROR, logger="semaphore.queue"):
        await side.queue.enqueue(KEY, "g", "j1")
        await clock.advance(10_000)
    assert len(calls) == 3 and len({p for _, p in calls}) == 1  # never under a second permit
    item = side.queue.item("j1")
    assert item.state is ItemState.DONE and item.error is not None and "attempt 3" in item.error
    assert any("completing it" in r.getMessage() for r in caplog.records)
    await clock.advance(12_000)
    assert (await holder.usage())["outstanding"] == 0


@async_test
async def test_work_interrupted_by_eviction_runs_again_under_the_same_permit():
    calls: list[Any] = []
    block = asyncio.Event()

    async def work(item: QueueItem) -> None:
        calls.append(item.permit)
        if len(calls) == 1:
            await block.wait()  # the object dies in here

    clock, _holder, _net, side = setup(limit=2, work=work)
    await side.queue.enqueue(KEY, "g", "j1")
    await clock.advance(4000)
    assert len(calls) == 1
    side.evict()
    # The call outlived admit_retry_ms, so its retry moved orphan_check_ms (60 s) on: the next
    # instance calls it again within that time.
    await clock.advance(62_000)
    assert len(calls) == 2 and calls[0] == calls[1]
    assert side.queue.item("j1").state is ItemState.DONE


def test_on_admit_and_work_together_are_refused():
    clock = SimClock(T0)
    with pytest.raises(ConfigurationError) as err:
        ClientSide("c1", clock, Net(HolderSide(clock, limit=1), clock), on_admit=lambda s, i: None,
                   work=lambda i: None)
    assert err.value.field == "work"
    for option, value in (("work_attempts", 0), ("admit_concurrency", 0), ("orphan_check_ms", 0)):
        with pytest.raises(ConfigurationError) as err:
            ClientSide("c1", clock, Net(HolderSide(clock, limit=1), clock), **{option: value})
        assert err.value.field == option


@async_test
async def test_r23_item_view_shows_the_holders_blocked_reason_per_key_and_group():
    admitted: list[str] = []
    clock, _holder, _net, side = setup(limit=3, on_admit=lambda s, item: admitted.append(item.item_id),
                                       group_limit={"small": 1})
    for n in range(2):
        await side.queue.enqueue(KEY, "small", f"s{n}")
    await clock.advance(10)  # "small" has the oldest demand (R21)
    for n in range(4):
        await side.queue.enqueue(KEY, "big", f"b{n}")
    await clock.advance(4000)
    assert "s0" in admitted and "s1" not in admitted
    small, big = side.queue.item("s1"), side.queue.item("b3")
    assert small.state is ItemState.QUEUED and small.blocked is not None
    assert small.blocked.reason is BlockedReason.GROUP_LIMIT and small.blocked_at is not None
    assert big.state is ItemState.QUEUED and big.blocked is not None and big.blocked.reason is BlockedReason.LIMIT
    assert side.queue.item("s0").blocked is None  # running: not waiting
    assert set(side.queue.blocked(KEY)) == {"small", "big"}
    assert [i.blocked.reason for i in side.queue.items(KEY, ItemState.QUEUED)] == [BlockedReason.GROUP_LIMIT] + \
        [BlockedReason.LIMIT] * 2


# ---------------------------------------------------------------------------- review findings
def test_demand_asks_for_exactly_the_items_it_would_admit():
    # Review F3: the admit_concurrency room goes to the oldest items across groups, and the
    # demand asks for exactly those (not for whole groups, oldest group first).
    from semaphore.core import queue_plan as plan

    queued = (plan.QueuedItem("a1", "A", 1, True, T0), plan.QueuedItem("b1", "B", 2, True, T0 + 5),
              plan.QueuedItem("a2", "A", 3, True, T0 + 10), plan.QueuedItem("p1", "B", 4, False, T0 + 20))
    snap = plan.KeySnapshot(now=T0, queued=queued, admit_room=2)
    assert plan.admissible(snap) == {"A": ["a1"], "B": ["b1", "p1"]}  # permit items are not bounded
    assert plan.demand_of(queued, 2) == [("A", 1, T0), ("B", 2, T0 + 5)]
    assert plan.demand_of(queued, None) == [("A", 2, T0), ("B", 2, T0 + 5)]


@async_test
async def test_no_granted_permit_idles_while_an_admissible_item_of_another_group_is_not_asked_for():
    gates: dict[str, asyncio.Event] = {}

    async def on_admit(side: ClientSide, item: QueueItem) -> None:
        await gates.setdefault(item.item_id, asyncio.Event()).wait()

    clock, _holder, _net, side = setup(limit=10, on_admit=on_admit, admit_concurrency=2)
    await side.queue.enqueue(KEY, "A", "a1")
    clock.set(T0 + 5)
    await side.queue.enqueue(KEY, "B", "b1")
    clock.set(T0 + 10)
    await side.queue.enqueue(KEY, "A", "a2")
    await clock.advance(3000)
    idle = sum(g.unclaimed for g in side.client.grants(KEY) if g.group == "A")
    assert idle == 0 and side.queue.item("b1").state is ItemState.RUNNING
    for g in gates.values():
        g.set()
    await clock.advance(30_000)


@async_test
async def test_a_synchronous_work_function_completes_its_item_when_it_returns():
    # Review F6: a plain function as work= is done when it returns (it was marked admitted and
    # never completed: its permit stayed charged forever).
    ran: list[str] = []
    clock, holder, _net, side = setup(limit=1, work=lambda item: ran.append(item.item_id))
    await side.queue.enqueue(KEY, "g", "j1")
    await clock.advance(4000)
    assert ran == ["j1"] and side.queue.item("j1").state is ItemState.DONE
    await clock.advance(12_000)
    assert (await holder.usage())["outstanding"] == 0


@async_test
async def test_r23_the_blocked_reason_is_forgotten_once_nothing_of_the_key_is_queued():
    # Review remark: blocked rows were deleted only by the next request's reply, so a key that
    # went idle kept a stale reason (and its row) for ever.
    admitted: list[str] = []
    clock, _holder, _net, side = setup(limit=1, on_admit=lambda s, item: admitted.append(item.item_id))
    await side.queue.enqueue(KEY, "g", "a")
    await side.queue.enqueue(KEY, "g", "b")
    await clock.advance(4000)
    assert side.queue.blocked(KEY)["g"].reason is BlockedReason.LIMIT
    await side.queue.complete("b")  # cancelled while queued: no request is sent for the key again
    await clock.advance(6000)
    assert side.queue.blocked(KEY) == {}
