"""Free means now (SPEC R9a) and tries (R9b) under contention, races and faults: what the holder
and the queue must still guarantee (every call answered once, a try never waits for a later
round, no round per exchange for a blocked try, R9a's own definition of contention)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from semaphore import PermitTimeoutError
from semaphore.core.batching import ROUND_WAIT_MS
from semaphore.testing import SEED_TIMING, T0, Bed, ClientSide, HolderSide, Net, SimClock, async_test, request, sync

KEY = "acct"
pytestmark = pytest.mark.usefixtures("quiet_logs")


def granted(reply: dict[str, Any]) -> int:
    return sum(g["permits"] for g in reply["grants"])


def try_request(client_id: str, demand: dict[str, int], **kw: Any) -> dict[str, Any]:
    return {**request(client_id, demand, **kw), "noWait": True}


class _Queue:
    def __init__(self, limit: int, queue: dict[str, Any] | None = None, **holder: Any) -> None:
        self.clock = SimClock(T0)
        self.holder = HolderSide(self.clock, limit=limit, **{"leases": None, **holder})  # grants: these tests are of the grant path (the default leases: test_reusable_leases.py)
        self.net = Net(self.holder, self.clock)
        self.side = ClientSide("c1", self.clock, self.net, **(queue or {}))

    async def run(self, coro: Any, within_ms: int = 60_000) -> Any:
        task = self.side.spawn(coro)
        end = self.clock.now + within_ms
        while not task.done():
            assert self.clock.now < end, "the call never ended"
            await self.clock.advance(10)
        return task.result()

    def requests(self) -> list[dict[str, Any]]:
        return [m for m in self.net.sent if m.get("type") == "request"]


async def _attempt(q: _Queue, key: str = KEY) -> tuple[int, Any]:
    asked = q.clock.now
    try:
        async with q.side.queue.permit(key, group="g", timeout_ms=0):
            return q.clock.now - asked, None
    except PermitTimeoutError as exc:
        return q.clock.now - asked, exc


async def _hold_one(q: _Queue, key: str = KEY) -> tuple[asyncio.Task[None], asyncio.Event]:
    got, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with q.side.queue.permit(key, group="g"):
            got.set()
            await release.wait()

    task = q.side.spawn(hold())
    while not got.is_set():
        await q.clock.advance(10)
    return task, release


# ============================================================== the queue's try (R9b)
@async_test
async def test_r9b_a_blocked_try_sends_one_request_not_one_per_pump_exchange():
    q = _Queue(limit=1)
    await _hold_one(q)
    before = len(q.requests())
    waited, exc = await q.run(_attempt(q))
    assert exc is not None and waited <= 50
    tries = q.requests()[before:]
    assert len(tries) == 1, f"a blocked try sent {len(tries)} noWait requests (one holder round each)"


# ============================================================== R9a's contention vs R29's "full"
@async_test
async def test_r9a_after_a_round_that_filled_the_limit_and_a_release_the_next_request_runs_at_once():
    """R9a: contention is "the last committed round left need unserved"; a round that took the
    last permits left none unserved (R29's full flag only makes releases go at once)."""
    bed = Bed(limit=1)
    first = await bed.one(request("a", {"g": 1}))  # at once; it filled the limit
    assert granted(first) == 1 and bed.now == bed.t0
    gid = first["grants"][0]["grantId"]
    await bed.one(sync("a", grants=[(gid, 1, 1)]))  # released: the holder is idle again
    second = bed.send(request("a", {"g": 1}))
    await bed.settle()
    assert second.done(), "a mutex used in turn waits a batched round (roundWaitMs) at every acquire"
    assert granted(second.result()) == 1


@async_test
async def test_r9a_a_mutex_used_in_turn_by_one_client_object_waits_no_round():
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=1)
    side = ClientSide("c1", clock, Net(holder, clock))
    waits: list[int] = []

    async def run() -> None:
        for _ in range(4):
            asked = clock.now
            async with side.queue.permit(KEY, group="g"):
                waits.append(clock.now - asked)
                await clock.sleep(100)

    task = side.spawn(run())
    while not task.done():
        await clock.advance(10)
    task.result()
    assert max(waits) <= 50, f"waits per acquire of a limit-1 semaphore: {waits}"


# ============================================================== the holder's try (R9b)
@async_test
async def test_r9b_a_try_joined_by_a_later_request_of_its_client_is_still_answered_at_once():
    """R10 joins a client's requests; the try among them must still be answered by a round run
    at once, never declined (R9a) nor held (R9 decision) because a later message of its client
    (the queue's side request, ``request_wait_ms``) carries no ``noWait``."""
    bed = Bed(limit=1, hold_blocked_ms=10_000)
    await bed.one(request("a", {"g": 1}))
    tried = bed.send(try_request("c", {"g": 1}))
    bed.send({**request("c", {"g": 1, "h": 1}), "waitMs": 10_000})  # joins the try (R10)
    await bed.settle()  # no virtual time passes
    assert tried.done(), "the try waits for a batched round (or a hold) once its client asks again"
    assert tried.result()["blocked"]


@async_test
async def test_r9b_a_try_that_arrives_while_a_round_runs_is_answered_as_that_round_ends():
    gate = asyncio.Event()
    calls: list[int] = []

    async def limit() -> int:
        calls.append(bed.now)
        if len(calls) == 1:
            await gate.wait()
        return 1

    bed = Bed(limit=limit, hold_blocked_ms=10_000)
    first = bed.send(request("a", {"g": 1}))
    await bed.settle()
    tried = bed.send(try_request("c", {"g": 1}))
    bed.send({**request("c", {"g": 1}), "waitMs": 10_000})  # joins the try (R10)
    await bed.settle()
    gate.set()
    await bed.settle()
    assert first.done() and granted(first.result()) == 1
    assert tried.done(), "the try waits for a batched round (or a hold) once its client asks again"


@async_test
async def test_r9b_a_try_on_a_key_whose_request_is_held_is_answered_at_once():
    """``request_wait_ms``: the key's pump waits for its held request; a try made meanwhile
    must not wait out that hold (R9b: it never waits for a later round)."""
    q = _Queue(limit=1, queue={"request_wait_ms": 5_000}, hold_blocked_ms=5_000)
    await _hold_one(q)

    async def wait_for_permit() -> None:
        async with q.side.queue.permit(KEY, group="g"):
            pass

    q.side.spawn(wait_for_permit())  # blocked: its request is held at the holder
    await q.clock.advance(200)
    waited, exc = await q.run(_attempt(q))
    assert exc is not None
    assert waited <= 50, f"the try waited {waited} ms for the held request"


@async_test
async def test_r9b_a_first_try_on_a_key_while_its_woken_pump_waits_for_a_batched_round():
    """The key's pump, woken by the alarm (not by a kick), is waiting for its request's batched
    round when the first try on the key is made: the try is answered as soon as the pump can
    send its ``noWait`` request, not a retry period later."""
    q = _Queue(limit=1)
    await _hold_one(q)

    async def wait_for_permit() -> None:
        async with q.side.queue.permit(KEY, group="g"):
            pass

    q.side.spawn(wait_for_permit())  # blocked; the alarm pumps the key at nextRequestAt
    for _ in range(400):  # until the alarm's pump has a request in flight
        await q.clock.advance(10)
        kick = q.side.queue._kicks.get(KEY)
        if KEY in q.side.queue._requesting and (kick is None or kick.done()):
            break
    assert KEY in q.side.queue._requesting
    in_flight_since = q.clock.now
    waited, exc = await q.run(_attempt(q))
    assert exc is not None
    # it may wait for the round of the request in flight (<= roundWaitMs), not a retry more
    assert in_flight_since > T0 and waited <= 1_050, f"the try waited {waited} ms"


# ============================================================== R29's "full" flag and reusable leases
REUSE_FIRST = {"provisioning": {"mode": "strict"}, "permitsPerLease": 2, "ttlMs": 20_000, "reusable": True,
               "leaseFirst": True}


async def _reuse_after_a_pause(**timing: Any) -> tuple[list[str], int]:
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, leases=REUSE_FIRST, **timing)
    net = Net(holder, clock)
    started: list[str] = []
    side = ClientSide("c1", clock, net, on_admit=lambda s, i: started.append(i.item_id))
    q = side.queue
    await q.enqueue(KEY, "g", "i0")
    await q.enqueue(KEY, "g", "i1")
    await clock.advance(1500)
    assert started == ["i0", "i1"]  # one reusable lease of 2: the whole limit, nobody else asks
    await q.complete("i0")
    await clock.advance(100)  # i1 still runs; nothing queued
    sent = len(net.sent)
    await q.enqueue(KEY, "g", "i2")
    await clock.advance(1)
    side.driver.kill()
    return started, len(net.sent) - sent


@async_test
async def test_r34a_r29_a_lone_client_whose_reusable_lease_fills_the_limit_reuses_a_freed_slot():
    """Nobody else asks: the freed slot of the lease is drawn again at once with no holder call,
    as with the seed's timing; the full flag (R29 decision) must not make the queue stop the
    lease as idle under contention that does not exist."""
    seed_started, seed_sent = await _reuse_after_a_pause(**SEED_TIMING)
    assert seed_started[-1] == "i2" and seed_sent == 0  # the reference
    started, sent = await _reuse_after_a_pause(free_at_once=True)
    assert started[-1] == "i2" and sent == 0, f"started {started}, {sent} holder messages"


@async_test
async def test_r32_r9a_a_declined_round_draws_no_lease_id_secret():
    """``secret_factory`` is called at most once per storage (R32): a round run at once that is
    declined (R9a) must not draw one it then throws away."""
    bed = Bed(limit=3, leases={"provisioning": {"mode": "under", "reserve": 1}, "permitsPerLease": 2,
                               "ttlMs": 10_000})
    reply = await bed.one(request("a", [("g", 2), ("h", 5)], leases=[]))  # at once: need left -> declined
    assert reply["leases"] and reply["contended"]
    assert bed.secrets_made == 1, f"secret_factory called {bed.secrets_made} times"


@async_test
async def test_r9b_a_try_after_a_lost_message_asks_the_holder_rather_than_failing_unasked():
    """A transient transport failure puts the key's pump in backoff (``retry_ms``); a try made
    during it on a free holder must still ask the holder (R9b: one request at once) instead of
    raising "no permit free now" without any message sent."""
    from semaphore import HolderUnavailableError

    q = _Queue(limit=5)
    lost: list[str] = []

    def lose_once(key: str, message: dict[str, Any]) -> None:
        if not lost:
            lost.append(message["type"])
            raise HolderUnavailableError("lost (test)")

    q.net.intercept = lose_once
    with pytest.raises(HolderUnavailableError):  # the holder was not reached: its error, not "not free"
        await q.run(_attempt(q))
    assert lost == ["request"]
    sent = len(q.net.sent)
    waited, exc = await q.run(_attempt(q))  # the network is fine again; 5 permits free
    assert len(q.net.sent) > sent, "the try raised without sending anything"
    assert exc is None, f"a try on a free holder failed: {exc}"


# ============================================================== R4: no call waits for a round that will not come
@async_test
async def test_r4_r9a_a_request_waiting_for_a_running_round_to_end_is_answered_if_that_round_is_cancelled():
    """R9a: a request that arrives while a round runs starts no timer (that round's end starts
    the next). If the running round's task is cancelled (not the callers), the request must not
    wait for a round that will not come (R4: it is failed, ``round_failed``, or served)."""
    gate = asyncio.Event()

    async def limit() -> int:
        await gate.wait()  # the round is running
        return 10

    bed = Bed(limit=limit)
    first = bed.send(request("a", {"g": 1}))
    await bed.settle()
    joiner = bed.send(request("b", {"g": 1}))
    await bed.settle()
    assert not first.done() and not joiner.done()
    for task in list(bed.sem._round_tasks):  # the running round dies (fault injection)
        task.cancel()
    await bed.settle()
    assert first.done() and "error" in first.result()  # R4: its call is failed
    gate.set()
    await bed.clock.advance(10_000)
    assert joiner.done(), "the request that arrived meanwhile waits for a round that will not come"


# ============================================================== R11 after a round run at once
@async_test
async def test_r11_r9a_next_request_at_of_a_contended_round_run_at_once_is_no_later_than_the_next_round():
    """R11: ``nextRequestAt`` is the earliest time the next round can run. A round run at once
    does not space batched rounds (R9a), so after one that left the limit full the next round
    can run ``roundWaitMs`` after the next request, not ``roundPeriodMs`` after this round."""
    bed = Bed(limit=1)
    first = await bed.one(request("a", {"g": 1}))  # at once, full: contended (R29 decision)
    assert first["contended"] and bed.now == bed.t0
    await bed.one(request("b", {"g": 1}))  # the next round: batched
    ran_at = bed.now
    assert ran_at == bed.t0 + ROUND_WAIT_MS
    assert first["nextRequestAt"] <= ran_at, (
        f"told nextRequestAt +{first['nextRequestAt'] - bed.t0} ms; the next round ran at +{ran_at - bed.t0} ms")
