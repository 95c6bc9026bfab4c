"""Free means now (SPEC R9a): a request on a holder with no contention is served by a round run
at once; a round run at once that would leave need unserved writes nothing, and its requests
wait for a batched round (R9). Also the R29 decision that a round leaving no permit free is
contended, and R11's ``nextRequestAt`` while rounds run at once.

Holder-level tests use the :class:`~semaphore.testing.Bed`; the permit latencies go through
the real queue (``permit()``) over the in-memory transport, on virtual time."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from semaphore import ConfigurationError
from semaphore.core.batching import (
    ROUND_PERIOD_MS,
    ROUND_WAIT_MS,
    Timing,
    next_request_at,
    round_may_commit,
    round_start,
)
from semaphore.testing import (
    SEED_ROUNDS,
    SEED_TIMING,
    T0,
    Bed,
    ClientSide,
    HolderSide,
    Net,
    SimClock,
    async_test,
    request,
    sync,
)

KEY = "acct"
pytestmark = pytest.mark.usefixtures("quiet_logs")


def granted(reply: dict[str, Any]) -> int:
    return sum(g["permits"] for g in reply["grants"])


# ============================================================== the pure decisions
def test_r9a_r9_round_start_at_once_without_contention_batched_with_it():
    t = Timing(round_wait_ms=1000, round_period_ms=2000, free_at_once=True)
    assert round_start(t, 5000, first_since=5000, last_batched_at=4900, contended=False, running=False) == 5000
    assert round_start(t, 5000, first_since=5000, last_batched_at=4900, contended=False, running=True) is None
    # R9: batched, wait from the first arrival, never sooner than a period after the last round
    assert round_start(t, 5000, first_since=4800, last_batched_at=1000, contended=True, running=False) == 5800
    assert round_start(t, 5000, first_since=4800, last_batched_at=4000, contended=True, running=True) == 6000
    seed = Timing(1000, 2000, free_at_once=False)
    assert round_start(seed, 5000, first_since=5000, last_batched_at=None, contended=False, running=False) == 6000


def test_r9a_only_a_round_run_at_once_that_leaves_need_unserved_is_declined():
    t = Timing()
    assert round_may_commit(t, immediate=True, unserved=False)
    assert not round_may_commit(t, immediate=True, unserved=True)
    assert round_may_commit(t, immediate=False, unserved=True)


def test_r11_r9a_next_request_at_is_now_while_rounds_run_at_once():
    t = Timing(1000, 2000, True)
    assert next_request_at(t, 5000, last_round_at=4900, contended=False, round_at=None) == 5000
    assert next_request_at(t, 5000, last_round_at=4900, contended=True, round_at=None) == 6900
    assert next_request_at(t, 5000, last_round_at=4900, contended=True, round_at=5500) == 5500
    assert next_request_at(Timing(1000, 2000, False), 5000, last_round_at=4900, contended=False,
                           round_at=None) == 6900


# ============================================================== the holder
@async_test
async def test_r9a_a_request_on_an_idle_holder_is_served_at_once():
    bed = Bed(limit=5)
    task = bed.send(request("a", {"g": 2}))
    await bed.settle()  # no virtual time passes
    assert task.done(), "the request waited for a batched round"
    reply = task.result()
    assert granted(reply) == 2 and reply["contended"] is False
    assert reply["nextRequestAt"] == bed.now == bed.t0  # R11: the next request is served at once too
    second = await bed.one(request("b", {"g": 3}))
    assert granted(second) == 3 and bed.now == bed.t0


@async_test
async def test_r9a_free_at_once_false_keeps_the_seeds_batched_timing():
    bed = Bed(limit=5, **SEED_TIMING)
    task = bed.send(request("a", {"g": 2}))
    await bed.settle()
    assert not task.done()
    await bed.clock.advance(999)
    assert not task.done()
    await bed.clock.advance(1)
    assert granted(task.result()) == 2


@async_test
async def test_r9a_a_round_at_once_that_would_leave_need_unserved_writes_nothing_then_a_batched_round_decides():
    bed = Bed(limit=3)
    first = await bed.one(request("a", {"g": 2}))
    assert granted(first) == 2
    before = bed.dump()
    late = bed.send(request("b", {"g": 2}, oldest_at=T0 - 5000))  # does not fit: 1 free
    await bed.settle()
    assert not late.done() and bed.dump() == before  # declined: nothing written, nobody answered
    older = bed.send(request("c", {"g": 1}, oldest_at=T0 - 9000))  # arrives in the batching window
    await bed.clock.advance(ROUND_WAIT_MS - 1)
    assert not late.done() and not older.done()
    await bed.clock.advance(1)  # R9: round_wait_ms (the default) after b arrived
    b, c = late.result(), older.result()
    assert granted(c) == 1 and granted(b) == 0  # oldest demand first (R21) among what arrived
    assert b["contended"] is True and b["blocked"][0]["reason"] == "limit"


@async_test
async def test_r9a_requests_that_arrive_while_a_round_runs_join_the_round_that_starts_as_it_ends():
    gate = asyncio.Event()
    resolved: list[int] = []

    async def limit() -> int:
        resolved.append(bed.now)
        if len(resolved) == 1:
            await gate.wait()  # the first round is still running
        return 10

    bed = Bed(limit=limit)
    first = bed.send(request("a", {"g": 1}))
    await bed.settle()
    joiners = [bed.send(request(c, {"g": 1})) for c in ("b", "c")]
    await bed.settle()
    assert len(resolved) == 1 and not first.done()  # no second round overlaps the first
    gate.set()
    await bed.settle()
    assert all(granted(t.result()) == 1 for t in (first, *joiners))
    assert resolved == [bed.t0, bed.t0]  # b and c were served together, at once, by one round


@async_test
async def test_r9a_a_blocked_holder_batches_until_a_round_leaves_nothing_unserved():
    bed = Bed(limit=2)
    [a] = await bed.round(request("a", {"g": 2}))
    blocked = await bed.one(request("b", {"g": 1}))  # declined at once, then batched: blocked
    assert blocked["contended"] and bed.now == bed.t0 + ROUND_WAIT_MS
    gid = a["grants"][0]["grantId"]
    await bed.one(sync("a", grants=[(gid, 2, 2)]))  # a releases everything
    at = bed.now
    served = await bed.one(request("b", {"g": 1}))  # still contended as far as the holder knows
    assert granted(served) == 1 and bed.now > at and served["contended"] is False
    again = bed.now
    assert granted(await bed.one(request("c", {"g": 1}))) == 1 and bed.now == again  # free again: at once


@async_test
async def test_r29_a_round_that_leaves_no_permit_free_is_contended_with_free_at_once():
    bed = Bed(limit=2)
    reply = await bed.one(request("a", {"g": 2}))
    assert granted(reply) == 2 and reply["contended"] is True  # full: releases should go at once (R37)
    seed = Bed(limit=2, **SEED_TIMING, name="seed")
    assert (await seed.one(request("a", {"g": 2})))["contended"] is False


@async_test
async def test_r9a_free_at_once_must_be_a_bool():
    with pytest.raises(ConfigurationError) as info:
        Bed(limit=2, free_at_once="yes")
    assert info.value.field == "free_at_once" and "expected a bool" in str(info.value)


# ============================================================== the queue, end to end
async def _permit_waits(sides: list[ClientSide], clock: SimClock, rounds: int = 1) -> list[int]:
    """Each side runs ``rounds`` permits one after another; returns each permit's wait (ms)."""
    waits: list[int] = []

    async def run(side: ClientSide) -> None:
        for _ in range(rounds):
            asked = clock.now
            async with side.queue.permit(KEY, group="g"):
                waits.append(clock.now - asked)
                await clock.sleep(100)

    tasks = [side.spawn(run(side)) for side in sides]
    while not all(t.done() for t in tasks):
        await clock.advance(10)
    for t in tasks:
        t.result()
    return waits


@async_test
async def test_r9a_with_the_defaults_every_permit_on_an_idle_holder_starts_within_50_ms():
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=10)
    net = Net(holder, clock)
    one = ClientSide("c1", clock, net)
    assert await _permit_waits([one], clock) == [0]  # the first
    assert max(await _permit_waits([one], clock, rounds=4)) <= 50  # four in a row in one object
    five = [ClientSide(f"o{n}", clock, net) for n in range(5)]
    assert max(await _permit_waits(five, clock)) <= 50  # five objects at once
    requests = [m for m in net.sent if m.get("type") == "request"]
    assert len(requests) <= 10  # one request per permit (a confirming sync may follow each)


@async_test
async def test_r9a_with_the_seeds_timing_a_permit_on_an_idle_holder_waits_a_round():
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=10, **SEED_TIMING)
    one = ClientSide("c1", clock, Net(holder, clock))
    assert await _permit_waits([one], clock) == [1000]  # the comparison the R9a decision gives


# ============================================================== tries (R9b)
def try_request(client_id: str, demand: dict[str, int], **kw: Any) -> dict[str, Any]:
    return {**request(client_id, demand, **kw), "noWait": True}


@async_test
async def test_r9b_a_try_on_a_contended_holder_is_answered_at_once_and_waiting_requests_join_its_round():
    bed = Bed(limit=1)
    await bed.one(request("a", {"g": 1}))
    waiting = bed.send(request("b", {"g": 1}, oldest_at=T0 - 100))  # declined at once: waits for a batch
    await bed.settle()
    assert not waiting.done()
    tried = bed.send(try_request("c", {"g": 1}))
    await bed.settle()  # no virtual time passes
    assert tried.done() and waiting.done() and bed.now == bed.t0
    c, b = tried.result(), waiting.result()
    assert granted(c) == 0 and c["blocked"][0]["reason"] == "limit" and granted(b) == 0


@async_test
async def test_r9b_a_try_replaces_a_waiting_batched_timer_and_oldest_demand_first_still_decides():
    bed = Bed(limit=1, **SEED_TIMING)
    older = bed.send(request("a", {"g": 1}, oldest_at=T0 - 5000))
    await bed.settle()
    tried = bed.send(try_request("b", {"g": 1}, oldest_at=T0))
    await bed.settle()
    assert tried.done() and older.done() and bed.now == bed.t0  # no timer failed, nobody waited
    assert granted(older.result()) == 1 and granted(tried.result()) == 0
    assert "error" not in older.result()
    assert granted(await bed.one(try_request("c", {"h": 0}))) == 0  # a try with nothing to ask: answered


@async_test
async def test_r9b_a_try_is_never_held():
    bed = Bed(limit=1, hold_blocked_ms=10_000)
    await bed.one(request("a", {"g": 1}))
    tried = bed.send({**try_request("b", {"g": 1}), "waitMs": 10_000})
    await bed.settle()
    assert tried.done() and tried.result()["blocked"][0]["reason"] == "limit"


@async_test
async def test_r9b_r7_no_wait_must_be_a_boolean():
    bed = Bed(limit=1)
    reply = await bed.one({**request("a", {"g": 1}), "noWait": "yes"})
    assert reply["error"]["code"] == "invalid_message" and "noWait" in reply["error"]["message"]
    assert bed.grants() == {}


class _Queue:
    def __init__(self, limit: int, **holder: Any) -> None:
        self.clock = SimClock(T0)
        self.holder = HolderSide(self.clock, limit=limit, **holder)
        self.net = Net(self.holder, self.clock)
        self.side = ClientSide("c1", self.clock, self.net)

    async def run(self, coro: Any) -> Any:
        task = self.side.spawn(coro)
        while not task.done():
            await self.clock.advance(10)
        return task.result()


@async_test
async def test_r9b_a_try_on_free_capacity_runs_its_block_at_once_even_on_a_batched_holder():
    q = _Queue(limit=2, **SEED_TIMING)
    views: list[str] = []
    view = q.side.queue.item
    q.side.queue.item = lambda item_id: views.append(item_id) or view(item_id)  # type: ignore[method-assign]

    async def body() -> int:
        asked = q.clock.now
        async with q.side.queue.permit(KEY, group="g", timeout_ms=0):
            return q.clock.now - asked

    assert await q.run(body()) <= 50
    assert [m.get("noWait") for m in q.net.sent if m["type"] == "request"] == [True]
    assert views == []  # an admitted try reads no item view (a SQL read) to learn what it knows


@async_test
async def test_r9b_a_try_on_a_full_holder_raises_at_once_with_the_reason_and_leaves_nothing_charged():
    from semaphore import PermitTimeoutError

    q = _Queue(limit=1)
    got, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with q.side.queue.permit(KEY, group="g"):
            got.set()
            await release.wait()

    holder_task = q.side.spawn(hold())
    while not got.is_set():
        await q.clock.advance(10)

    async def attempt() -> tuple[int, Any]:
        asked = q.clock.now
        try:
            async with q.side.queue.permit(KEY, group="g", timeout_ms=0):
                return q.clock.now - asked, None
        except PermitTimeoutError as exc:
            return q.clock.now - asked, exc

    waited, exc = await q.run(attempt())
    assert exc is not None and waited <= 50
    assert exc.blocked is not None and exc.blocked.reason.value == "limit" and "free now" in str(exc)
    release.set()
    while not holder_task.done():
        await q.clock.advance(10)
    await q.clock.advance(30_000)
    usage = await q.holder.usage()
    assert usage["charged"] == 0 and usage["outstanding"] == 0


async def _freed_to_start(**timing: Any) -> int:
    """Limit 1: ``a``'s item holds it; ``b``'s item is blocked for a few rounds; then ``a``'s
    item completes. How long after that ``b``'s item starts (grants, the queue's defaults)."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=1, leases=None, **timing)
    net = Net(holder, clock)
    started: dict[str, int] = {}
    a, b = (ClientSide(name, clock, net, on_admit=lambda side, item: started.setdefault(item.item_id, clock.now))
            for name in ("a", "b"))
    await a.queue.enqueue(KEY, "g", "a0")
    await clock.advance(50)
    await b.queue.enqueue(KEY, "g", "b0")
    await clock.advance(5_050)
    assert "a0" in started and "b0" not in started
    freed = clock.now
    await a.queue.complete("a0")
    await clock.advance(10_000)
    return started["b0"] - freed


@async_test
async def test_r9_with_the_default_round_timing_freed_capacity_reaches_a_blocked_client_within_a_round_period():
    # R9 decision (round timing): under contention a blocked client asks again at its joinInMs
    # (R11), so the round period is how soon a freed permit reaches it. With the defaults
    # (ROUND_WAIT_MS, ROUND_PERIOD_MS) b starts within a period and a round wait of a's
    # completion (its release goes at once: the key is contended, R37); with the original's
    # timing it waited longer.
    assert (ROUND_WAIT_MS, ROUND_PERIOD_MS) == (100, 1000)  # SPEC R9, docs/reference/holder.md
    now = await _freed_to_start()
    assert 0 < now <= ROUND_PERIOD_MS + ROUND_WAIT_MS, now
    seed = await _freed_to_start(**SEED_ROUNDS)
    assert seed > ROUND_PERIOD_MS + ROUND_WAIT_MS, seed
