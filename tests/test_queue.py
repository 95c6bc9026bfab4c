"""SemaphoreQueue against a real holder over the in-memory transport (SPEC R15a, R29-R37)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from semaphore import ConfigurationError, HolderUnavailableError, ItemState, PermitKind, QueueItem
from semaphore.testing import SEED_TIMING, T0, ClientSide, HolderSide, Net, SimClock, async_test
from sql_counting import statements

KEY = "acct"
LEASES = {"provisioning": {"mode": "strict"}, "permitsPerLease": 2, "ttlMs": 20_000}


pytestmark = pytest.mark.usefixtures("quiet_logs")  # failures are injected on purpose


class Setup:
    def __init__(self, limit: int = 3, *, fail_admit: int = 0, **holder_options: Any) -> None:
        self.clock = SimClock(T0)
        self.holder = HolderSide(self.clock, limit=limit, **{"leases": None, **holder_options})  # grants: these tests are of the grant path (the default leases: test_reusable_leases.py)
        self.net = Net(self.holder, self.clock)
        self.admitted: list[QueueItem] = []
        self.alive: set[str] = set()
        self.fail_admit = fail_admit
        self.side = ClientSide("c1", self.clock, self.net, on_admit=self.on_admit,
                               check_running=lambda side, item: item.item_id in self.alive,
                               reconcile_after_ms=30_000)

    def on_admit(self, side: ClientSide, item: QueueItem) -> None:
        self.admitted.append(item)
        self.alive.add(item.item_id)
        if self.fail_admit:
            self.fail_admit -= 1
            raise RuntimeError("crashed after starting the work")

    @property
    def queue(self):
        return self.side.queue

    def state(self, item_id: str) -> ItemState:
        return self.queue.item(item_id).state

    async def complete(self, item_id: str) -> None:
        self.alive.discard(item_id)
        await self.queue.complete(item_id)

    async def usage(self) -> dict:
        return await self.holder.usage()

    def sent(self, kind: str | None = None) -> list[dict]:
        return [m for m in self.net.sent if kind is None or m["type"] == kind]


@pytest.mark.parametrize("payload", [float("nan"), {"x": [float("inf")]}, {"blob": "x" * 1_000_001}, {1, 2}],
                         ids=["nan", "infinity", "over 1 MB", "a set"])
@async_test
async def test_a_payload_that_is_not_strict_json_or_too_big_is_refused_and_nothing_is_queued(payload):
    # R37: a payload is stored as JSON in the item's row: NaN or Infinity would be written back
    # as bare NaN (not JSON for any reader), over the row limit the insert fails late; both are
    # refused at once, naming the field, with nothing written (the same for permit()).
    s = Setup()
    with pytest.raises(ConfigurationError) as refused:
        await s.queue.enqueue(KEY, "g", "a", payload)
    assert refused.value.field == "payload"
    with pytest.raises(ConfigurationError):
        async with s.queue.permit(KEY, "g", payload=payload):
            raise AssertionError("a permit started with a refused payload")
    assert s.queue.items() == [] and s.sent() == []
    await s.queue.enqueue(KEY, "g", "a", {"blob": "x" * 900_000, "n": 1.5})  # strict JSON within the limit


@async_test
async def test_enqueue_is_idempotent_and_demand_comes_from_items():
    # R37: the same item id queues once (a retried enqueue), demand = count/oldestAt of items
    s = Setup(**SEED_TIMING)  # staged on batched rounds (R9), not R9a's rounds at once
    await s.queue.enqueue(KEY, "g", "a")
    await s.clock.advance(10)
    await s.queue.enqueue(KEY, "g", "b")
    again = await s.queue.enqueue(KEY, "g", "a", {"ignored": True})
    assert again.payload is None and len(s.queue.items()) == 2
    (d,) = s.queue.demand(KEY)
    assert (d.group, d.count, d.oldest_at) == ("g", 2, T0)
    await s.clock.advance(6000)
    assert sorted(i.item_id for i in s.admitted) == ["a", "b"]
    await s.complete("a")
    await s.queue.enqueue(KEY, "g", "a")  # retried after it finished: not run again
    await s.clock.advance(5000)
    assert [i.item_id for i in s.admitted].count("a") == 1


@async_test
async def test_grant_items_start_only_after_the_claim_is_confirmed():
    # R15a: claim, send it with a sync, start only what the reply shows claimed and active
    s = Setup(**SEED_TIMING)  # staged on batched rounds (R9), not R9a's rounds at once
    for i in range(2):
        await s.queue.enqueue(KEY, "g", f"i{i}")
    lost = {"n": 0}

    def lose_syncs(key: str, message: dict) -> Any:
        if message["type"] == "sync" and message["grants"] and lost["n"] < 2:
            lost["n"] += 1
            raise HolderUnavailableError("lost")
        return None

    s.net.intercept = lose_syncs
    await s.clock.advance(1500)  # the round grants 2; the claim's sync is lost
    assert s.admitted == [] and s.state("i0") is ItemState.CLAIMING
    await s.clock.advance(1000)  # retry lost again
    assert s.admitted == []
    await s.clock.advance(1000)  # retry reaches the holder
    assert [i.item_id for i in s.admitted] == ["i0", "i1"]
    assert all(i.permit.kind is PermitKind.GRANT for i in s.admitted)
    held = s.holder.storage.connection.execute("SELECT claimed FROM durability_semaphore_grants").fetchall()
    assert held == [(2,)]


@async_test
async def test_claim_answered_expired_requeues_and_runs_later():
    # R15, R15a: a claim reaching the holder after claimBy is refused; the item is re-queued
    s = Setup(grant_timeout_ms=2000)
    await s.queue.enqueue(KEY, "g", "x")

    def lose_syncs(key: str, message: dict) -> Any:
        if message["type"] == "sync":
            raise HolderUnavailableError("lost")
        return None

    s.net.intercept = lose_syncs
    await s.clock.advance(1200)
    first_grant = s.queue.item("x").permit
    assert first_grant is not None and s.state("x") is ItemState.CLAIMING
    await s.clock.advance(2500)  # claimBy passes; the holder reclaims the grant
    s.net.intercept = None
    await s.clock.advance(8000)
    assert [i.item_id for i in s.admitted] == ["x"]
    assert s.admitted[0].permit.id != first_grant.id  # ran under a new, confirmed grant
    await s.complete("x")
    await s.clock.advance(12_000)  # the release is reported within report_releases_within_ms (10 s)
    assert (await s.usage())["outstanding"] == 0


@async_test
async def test_lease_draws_need_no_round_trip_and_are_one_shot():
    # R30, R34: items drawn from a live lease start without a message
    s = Setup(limit=10, leases={**LEASES, "permitsPerLease": 3})
    await s.queue.enqueue(KEY, "g", "a")
    await s.clock.advance(1500)
    (lease,) = s.side.client.leases(KEY)
    assert lease.permits == 3
    sent = len(s.net.sent)
    await s.queue.enqueue(KEY, "g", "b")
    await s.queue.pump(KEY)
    assert s.state("b") is ItemState.RUNNING and s.queue.item("b").permit.kind is PermitKind.LEASE
    assert len(s.net.sent) == sent  # no round trip
    slots = {(i.permit.id, i.permit.slot) for i in s.admitted if i.permit.kind is PermitKind.LEASE}
    await s.complete("b")
    await s.queue.enqueue(KEY, "g", "c")
    await s.queue.pump(KEY)
    c = s.queue.item("c").permit
    assert (c.id, c.slot) not in slots  # a released permit is never drawn again


@async_test
async def test_lease_in_use_is_heartbeated_at_half_ttl_even_when_idle():
    # R31, R37: heartbeats keep a lease with running work live
    s = Setup(limit=10, leases={**LEASES, "permitsPerLease": 4})
    await s.queue.enqueue(KEY, "g", "a")
    await s.queue.enqueue(KEY, "g", "b")
    await s.clock.advance(1500)
    (lease,) = s.side.client.leases(KEY)
    await s.queue.enqueue(KEY, "g", "c")
    await s.queue.pump(KEY)
    drawn = [i for i in s.admitted if i.permit.kind is PermitKind.LEASE]
    assert [i.item_id for i in drawn] == ["a", "b", "c"]  # all fit in the lease: drawn, no claim
    await s.clock.advance(5000)
    await s.clock.advance(60_000)  # three TTLs, nothing else happening
    syncs = [m for m in s.sent("sync") if m.get("leases")]
    assert len(syncs) >= 5
    row = s.holder.storage.connection.execute(
        "SELECT status FROM durability_semaphore_leases WHERE lease_id = ?", (lease.lease_id,)).fetchone()
    assert row == ("live",)
    for i in s.admitted:
        await s.complete(i.item_id)
    await s.clock.advance(30_000)
    usage = await s.usage()
    assert (usage["outstanding"], usage["leaseFootprint"]) == (0, 0)  # I3


@async_test
async def test_contended_reply_stops_idle_leases_and_reports_until_settled():
    # R29, R37: on contended, leases in groups with nothing queued are stopped and reported
    s = Setup(limit=4, leases={**LEASES, "permitsPerLease": 2})
    await s.queue.enqueue(KEY, "idle", "a")
    await s.clock.advance(1500)
    lease = next(x for x in s.side.client.leases(KEY) if x.group == "idle")
    await s.complete("a")
    await s.clock.advance(100)
    # another client's demand the holder cannot serve makes replies contended
    other = asyncio.ensure_future(s.holder.handle({
        "type": "request", "v": 1, "clientId": "other",
        "demand": [{"group": "busy", "count": 9, "oldestAt": T0}], "grants": []}))
    await s.clock.advance(2500)
    assert other.result()["contended"] is True
    for item_id in ("b", "b2", "b3"):  # more than is free: the client's round is contended too
        await s.queue.enqueue(KEY, "other-group", item_id)
    await s.clock.advance(4000)
    stopped = [m for m in s.net.sent if any(x["leaseId"] == lease.lease_id and x["stopped"]
                                               for x in m.get("leases", []))]
    assert stopped
    assert s.side.client.lease(KEY, lease.lease_id).status == "settled"
    row = s.holder.storage.connection.execute(
        "SELECT COUNT(*) FROM durability_semaphore_leases WHERE lease_id = ?", (lease.lease_id,)).fetchone()
    assert row == (0,)


@async_test
async def test_retired_lease_stops_drawing_at_once():
    # R33: lowering the limit retires live leases; the client stops drawing at once
    limit = {"value": 10}
    s = Setup(limit=lambda: limit["value"], leases={**LEASES, "permitsPerLease": 4})
    await s.queue.enqueue(KEY, "g", "a")
    await s.clock.advance(1500)
    (lease,) = s.side.client.leases(KEY)
    limit["value"] = 5
    await s.queue.enqueue(KEY, "h", "b")  # next round retires the lease
    await s.clock.advance(3000)
    assert s.side.client.lease(KEY, lease.lease_id).stopped
    await s.queue.enqueue(KEY, "g", "c")
    pump = asyncio.ensure_future(s.queue.pump(KEY))  # may wait for a request's round (joinInMs)
    await s.clock.advance(3000)
    await pump
    assert s.queue.item("c").permit is None or s.queue.item("c").permit.id != lease.lease_id


@async_test
async def test_admission_callback_is_retried_under_the_same_permit():
    # R37, R18: retry-safe admission: a crashed callback is called again for the same item and permit
    s = Setup(fail_admit=2)
    await s.queue.enqueue(KEY, "g", "a")
    await s.clock.advance(6000)
    calls = [i for i in s.admitted if i.item_id == "a"]
    assert len(calls) == 3
    assert len({(c.permit.id, c.permit.slot) for c in calls}) == 1
    assert [c.attempts for c in calls] == [1, 2, 3] and s.queue.item("a").admitted


@async_test
async def test_reconciliation_releases_work_whose_completion_was_lost():
    # R37, I3: items running longer than the bound are checked, and released when gone
    s = Setup()
    await s.queue.enqueue(KEY, "g", "a")
    await s.clock.advance(1500)
    assert s.state("a") is ItemState.RUNNING
    await s.clock.advance(40_000)
    assert s.state("a") is ItemState.RUNNING  # still running: checked, kept
    s.alive.discard("a")  # the work ended but complete() never came
    await s.clock.advance(40_000)
    assert s.state("a") is ItemState.DONE
    assert (await s.usage())["outstanding"] == 0


@async_test
async def test_queue_survives_eviction():
    # R37: items, claims and permits survive eviction of the client object
    s = Setup()
    for i in range(4):
        await s.queue.enqueue(KEY, "g", f"i{i}")
    await s.clock.advance(1200)
    s.side.evict()
    await s.clock.advance(2000)
    running = {i.item_id for i in s.queue.items(state=ItemState.RUNNING)}
    assert len(running) == 3
    s.side.evict()
    for item_id in sorted(running):
        await s.complete(item_id)
    s.side.evict()
    await s.clock.advance(10_000)
    assert len({i.item_id for i in s.admitted}) == 4
    await s.complete("i3")
    await s.clock.advance(30_000)
    assert all(i.state is ItemState.DONE for i in s.queue.items())
    usage = await s.usage()
    assert (usage["outstanding"], usage["leaseFootprint"]) == (0, 0)


@async_test
async def test_r7_enqueue_refuses_ids_outside_the_wire_alphabet_and_writes_nothing():
    # R7: a group (or key, or item id) the holder would refuse is refused at enqueue, naming the
    # field, so one bad item can never make the holder reject the queue's whole request.
    from semaphore import ConfigurationError

    s = Setup()
    await s.queue.enqueue(KEY, "good", "ok")
    for key, group, item_id, field in [
        (KEY, "bulk\x00x", "a", "group"),
        (KEY, "b\ud800", "b", "group"),
        ("k\x1f", "g", "c", "key"),
        (KEY, "g", "i\x7f", "item_id"),
    ]:
        with pytest.raises(ConfigurationError) as err:
            await s.queue.enqueue(key, group, item_id)
        assert err.value.field == field
    assert [i.item_id for i in s.queue.items()] == ["ok"]
    await s.clock.advance(6000)
    assert [i.item_id for i in s.admitted] == ["ok"]
    assert all("error" not in m for m in s.net.sent)


@async_test
async def test_on_done_is_called_once_for_every_item_that_turns_done():
    # on_done(item) runs once for every item that turns done, whichever way: a queued or running
    # item's complete(), a claim cancelled while claiming (done only when the pump resolves it),
    # reconciliation. R37 review: it runs after the transition, in a transaction of its own; a
    # raising on_done leaves the item done (permit released) with its hook pending, and the pump
    # calls it again later.
    s = Setup(**SEED_TIMING)  # staged on batched rounds (R9), not R9a's rounds at once
    done: list[tuple[str, ItemState, bool]] = []
    fail = {"on": False}

    def on_done(item: QueueItem) -> None:
        if fail["on"]:
            raise RuntimeError("outbox full")
        row = s.side.storage.connection.execute(
            "SELECT state FROM durability_semaphore_client_items WHERE item_id = ?", (item.item_id,)).fetchone()
        done.append((item.item_id, item.state, row[0] == "done" and item.finished_at > 0))

    s.side.queue_options["on_done"] = on_done
    s.side.evict()  # the queue again, with the hook
    await s.queue.enqueue(KEY, "g", "queued")
    await s.queue.complete("queued")  # cancelled before admission
    assert done == [("queued", ItemState.DONE, True)]

    lost = {"n": 0}

    def lose_a_sync(key: str, message: dict) -> Any:
        if message["type"] == "sync" and message["grants"] and lost["n"] < 1:
            lost["n"] += 1
            raise HolderUnavailableError("lost")
        return None

    s.net.intercept = lose_a_sync
    await s.queue.enqueue(KEY, "g", "claiming")
    await s.clock.advance(1500)
    assert s.state("claiming") is ItemState.CLAIMING
    assert await s.queue.complete("claiming") is True
    assert len(done) == 1 and s.state("claiming") is ItemState.CLAIMING  # not done yet
    await s.clock.advance(1000)  # the pump resolves the claim: cancelled, done
    assert s.state("claiming") is ItemState.DONE and done[1:] == [("claiming", ItemState.DONE, True)]

    await s.queue.enqueue(KEY, "g", "running")
    await s.queue.enqueue(KEY, "g", "lost")
    await s.clock.advance(3000)
    assert s.state("running") is ItemState.RUNNING and s.state("lost") is ItemState.RUNNING
    fail["on"] = True
    await s.complete("running")  # the hook raises: logged, not propagated
    assert s.state("running") is ItemState.DONE and len(done) == 2 and pending(s) == ["running"]
    fail["on"] = False
    await s.clock.advance(1000)  # the pump calls it again (backoff 1 s)
    assert len(done) == 3 and pending(s) == []
    assert await s.queue.complete("running") is False  # once per transition
    s.alive.discard("lost")  # reconciliation completes it
    await s.clock.advance(80_000)
    assert s.state("lost") is ItemState.DONE
    assert [d[0] for d in done] == ["queued", "claiming", "running", "lost"] and all(d[2] for d in done)


def pending(s: Setup) -> list[str]:
    """Items whose on_done hook has not run yet (R37 review: the done_pending flag)."""
    return [r[0] for r in s.side.storage.connection.execute(
        "SELECT item_id FROM durability_semaphore_client_items WHERE done_pending = 1 ORDER BY seq")]


class Died(BaseException):
    """The object dies (eviction, crash) where this is raised: nothing after it runs and the
    storage transaction around it does not commit."""


def lose_claims(s: Setup) -> dict[str, bool]:
    """While ``on``, every sync carrying a claim is lost (the claiming items stay claiming)."""
    switch = {"on": True}

    def intercept(key: str, message: dict) -> Any:
        if switch["on"] and message["type"] == "sync" and message["grants"]:
            raise HolderUnavailableError("lost")
        return None

    s.net.intercept = intercept
    return switch


@async_test
async def test_r37_a_raising_on_done_does_not_stall_the_key_and_is_retried_with_backoff():
    # R37 review (MEDIUM): on_done ran inside the shared transactions (_resolve_claims in every
    # admission step and every reply), so a hook raising for one cancelled claiming item rolled
    # back every step of the key: nothing admitted, replies discarded, a sync about once a
    # second forever. Now the item turns done in the shared step, its hook runs on its own.
    s = Setup(limit=1)
    calls: list[int] = []
    broken = {"on": True}
    outbox: list[str] = []

    def on_done(item: QueueItem) -> None:
        if item.item_id == "bad":
            calls.append(s.clock.now)
            if broken["on"]:
                raise RuntimeError("outbox full")
        outbox.append(item.item_id)

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("semaphore.queue").addHandler(handler)
    logging.disable(logging.NOTSET)
    try:
        s.side.queue_options["on_done"] = on_done
        s.side.evict()
        lossy = lose_claims(s)
        await s.queue.enqueue(KEY, "g", "bad")
        await s.clock.advance(1500)
        assert s.state("bad") is ItemState.CLAIMING
        assert await s.queue.complete("bad") is True  # cancelled while claiming
        await s.queue.enqueue(KEY, "g", "a")
        await s.queue.enqueue(KEY, "g", "b")
        lossy["on"] = False
        await s.clock.advance(1000)  # the claim is confirmed: "bad" turns done, its permit released
        assert s.state("bad") is ItemState.DONE and calls and pending(s) == ["bad"]
        await s.clock.advance(15_000)
        assert [i.item_id for i in s.admitted] == ["a"]  # limit 1: a runs (claim confirmed)
        assert s.state("a") is ItemState.RUNNING and s.queue.item("a").permit.kind is PermitKind.GRANT
        await s.complete("a")
        await s.clock.advance(15_000)
        assert [i.item_id for i in s.admitted] == ["a", "b"] and s.state("b") is ItemState.RUNNING
        await s.complete("b")
        await s.clock.advance(15_000)
        assert outbox == ["a", "b"] and pending(s) == ["bad"]
        assert (await s.usage())["outstanding"] == 0
        # Idle for 120 s: the hook of "bad" is retried with backoff, and no retry contacts the holder.
        sent, first = len(s.net.sent), len(calls)
        await s.clock.advance(120_000)
        assert len(s.net.sent) - sent <= 2
        assert len(calls) > first and 5 <= len(calls) <= 10, calls  # about 165 s since "bad" was done
        gaps = [b - a for a, b in zip(calls, calls[1:])]
        assert gaps == sorted(gaps) and gaps[-1] >= 8 * gaps[0], gaps  # backing off
        assert gaps[-1] <= 300_000
        warnings = [r for r in records if r.levelno == logging.WARNING and "on_done" in r.getMessage()]
        assert warnings and all("'bad'" in r.getMessage() for r in warnings)
        # It stops raising: the next retry runs it once and clears the flag.
        broken["on"] = False
        n = len(calls)
        await s.clock.advance(400_000)
        assert len(calls) == n + 1 and outbox == ["a", "b", "bad"] and pending(s) == []
        await s.clock.advance(600_000)
        assert len(calls) == n + 1
    finally:
        logging.getLogger("semaphore.queue").removeHandler(handler)


@async_test
async def test_r37_async_on_done_is_refused():
    # R37 review (LOW): an async def on_done was accepted and never ran (its coroutine dropped).
    from semaphore import ConfigurationError, SemaphoreQueue

    s = Setup()

    async def on_done(item: QueueItem) -> None:
        pass

    class AsyncHook:
        async def __call__(self, item: QueueItem) -> None:
            pass

    for hook in (on_done, AsyncHook()):
        with pytest.raises(ConfigurationError) as err:
            SemaphoreQueue(client=s.side.client, scheduler=s.side.scheduler, on_admit=lambda item: None,
                           on_done=hook)
        assert err.value.field == "on_done" and "on_done" in str(err.value)

    # A plain function returning an awaitable is caught when called: the item is done, its hook
    # stays pending (it never ran), and complete() says why.
    s.side.queue_options["on_done"] = lambda item: on_done(item)
    s.side.evict()
    await s.queue.enqueue(KEY, "g", "x")
    with pytest.raises(ConfigurationError) as err:
        await s.queue.complete("x")
    assert err.value.field == "on_done"
    assert s.state("x") is ItemState.DONE and pending(s) == ["x"]
    await s.clock.advance(5000)  # the pump logs it and backs off; the key is not stalled
    await s.queue.enqueue(KEY, "g", "y")
    await s.clock.advance(3000)
    assert [i.item_id for i in s.admitted] == ["y"]


@async_test
async def test_r37_on_done_runs_once_per_item_across_eviction_before_the_hook_ran():
    # R37 review: the object may die after the transition committed and before the hook ran
    # (in complete(), or in the pump resolving a cancelled claim): the next instance's pump runs
    # the pending hook, once; its SQL writes commit with clearing the flag.
    s = Setup()
    die: set[str] = set()
    called: list[str] = []

    def on_done(item: QueueItem) -> None:
        called.append(item.item_id)
        if item.item_id in die:
            die.discard(item.item_id)
            if item.item_id == "claim":
                s.side.evict()  # inside the pump: later alarms reach the next instance only
            raise Died()
        s.side.storage.connection.execute("INSERT INTO outbox(item_id) VALUES (?)", (item.item_id,))

    s.side.storage.connection.execute("CREATE TABLE outbox (item_id TEXT NOT NULL)")
    s.side.queue_options["on_done"] = on_done
    s.side.evict()
    await s.queue.enqueue(KEY, "g", "run")
    await s.clock.advance(3000)
    assert s.state("run") is ItemState.RUNNING
    die.add("run")
    with pytest.raises(Died):
        await s.queue.complete("run")
    assert s.state("run") is ItemState.DONE and pending(s) == ["run"]  # marked, hook not run
    s.side.evict()

    lossy = lose_claims(s)
    await s.queue.enqueue(KEY, "g", "claim")
    await s.clock.advance(1500)
    assert s.state("claim") is ItemState.CLAIMING
    await s.queue.complete("claim")
    die.add("claim")
    lossy["on"] = False
    await s.clock.advance(1000)  # the pump resolves the claim, the object dies in the hook
    assert s.state("claim") is ItemState.DONE and not die

    await s.clock.advance(10_000)  # the new instance runs both pending hooks
    assert pending(s) == []
    await s.clock.advance(60_000)
    s.side.evict()
    await s.clock.advance(60_000)
    rows = s.side.storage.connection.execute("SELECT item_id FROM outbox ORDER BY rowid").fetchall()
    assert sorted(r[0] for r in rows) == ["claim", "run"]  # each hook's writes committed once
    assert sorted(called) == ["claim", "claim", "run", "run"]  # the died call, then one more
    assert (await s.usage())["outstanding"] == 0


@async_test
async def test_r37_items_tables_of_an_older_release_gain_the_pending_hook_columns():
    # R37 review: done_pending (and its backoff columns) are added in place, with a partial index.
    from semaphore import SemaphoreQueue as Q
    from semaphore.testing import LocalContext, LocalStorage

    raw = LocalStorage()
    raw.connection.execute(
        "CREATE TABLE durability_semaphore_client_items ("
        " item_id TEXT PRIMARY KEY, key TEXT NOT NULL, group_name TEXT NOT NULL, payload TEXT NOT NULL,"
        " enqueued_at INTEGER NOT NULL, seq INTEGER NOT NULL, state TEXT NOT NULL,"
        " permit_kind TEXT NOT NULL, permit_id TEXT NOT NULL, slot INTEGER NOT NULL,"
        " started_at INTEGER NOT NULL, admitted INTEGER NOT NULL, attempts INTEGER NOT NULL,"
        " retry_at INTEGER NOT NULL, checked_at INTEGER NOT NULL, finished_at INTEGER NOT NULL,"
        " cancel INTEGER NOT NULL)")
    raw.connection.execute("INSERT INTO durability_semaphore_client_items VALUES"
                           " ('old', 'k', 'g', 'null', 1, 1, 'done', '', '', 0, 0, 0, 0, 0, 0, 1, 0)")
    Q.migrate(LocalContext(raw, name="old"), 1)
    columns = {r[1] for r in raw.connection.execute("PRAGMA table_info(durability_semaphore_client_items)")}
    assert {"done_pending", "done_attempts", "done_retry_at"} <= columns
    assert raw.connection.execute(
        "SELECT done_pending FROM durability_semaphore_client_items").fetchall() == [(0,)]
    plan = " ".join(str(r) for r in raw.connection.execute(
        "EXPLAIN QUERY PLAN SELECT MIN(done_retry_at) FROM durability_semaphore_client_items"
        " WHERE key = 'k' AND done_pending = 1"))
    assert "durability_semaphore_client_items_done_pending" in plan


@async_test
async def test_r37_callbacks_that_returned_are_not_called_again_when_a_later_one_raises_a_base_exception():
    # R37 decision (callbacks): a synchronous on_admit that returned counts as admitted even when
    # a later one of the same pass raises what is not an Exception (asyncio.CancelledError from
    # a cancelled future's result()): only that one is called again.
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=10, leases=None)
    calls: list[str] = []

    def on_admit(side, item):
        calls.append(item.item_id)
        if item.item_id == "i2" and calls.count("i2") == 1:
            raise asyncio.CancelledError()

    side = ClientSide("c1", clock, Net(holder, clock), on_admit=on_admit)
    for item_id in ("i1", "i2", "i3"):
        await side.queue.enqueue("k", "g", item_id)
    end = clock.now + 600_000
    while (t := clock.next_event()) is not None and t <= end and len(calls) < 10:
        await clock.advance_to(t)
    holder.driver.close()
    side.driver.close()
    assert calls.count("i1") == 1 and calls.count("i2") == 2 and calls.count("i3") == 1, calls


def item_inserts(side: ClientSide) -> contextlib.AbstractContextManager[list[str]]:
    """The INSERT statements into the items table ``side``'s storage runs meanwhile."""
    return statements(side, "INSERT INTO durability_semaphore_client_items")


@async_test
async def test_r37_enqueue_many_queues_in_order_in_one_statement_and_returns_known_ids_unchanged():
    # R37: a batch is queued as enqueue() queues each item, oldest first in the order given
    # (their seq), in one transaction whose new items are one INSERT, with one wake-up; an id
    # already known (queued, running or finished) comes back unchanged, in its place.
    s = Setup(limit=100, **SEED_TIMING)
    await s.queue.enqueue(KEY, "g", "known", {"first": True})
    ids = [f"item-{n:02}" for n in range(60)]
    with item_inserts(s.side) as statements:
        items = await s.queue.enqueue_many(KEY, "g", [ids[0], "known", *ids[1:]],
                                           [{"n": 0}, {"ignored": True}, *({"n": n} for n in range(1, 60))])
    assert len(statements) == 1, statements
    assert [i.item_id for i in items] == [ids[0], "known", *ids[1:]]
    assert items[1].payload == {"first": True} and items[2].payload == {"n": 1}
    queued = [i.item_id for i in s.queue.items(KEY, ItemState.QUEUED)]  # in enqueue (seq) order
    assert queued == ["known", *ids]
    (d,) = s.queue.demand(KEY)
    assert (d.count, d.oldest_at) == (61, T0)
    await s.clock.advance(6000)
    assert sorted(i.item_id for i in s.admitted) == sorted(["known", *ids])
    assert await s.queue.enqueue_many(KEY, "g", []) == []
    again = await s.queue.enqueue_many(KEY, "g", ids[:3])  # a retried batch: nothing queued twice
    assert [i.state for i in again] == [ItemState.RUNNING] * 3 and len(s.queue.items()) == 61


@async_test
async def test_r37_enqueue_many_splits_large_payloads_into_batches_and_keeps_their_order():
    # R37: a batch's ids and payloads travel as one JSON binding per statement, each within
    # INSERT_BATCH_BYTES (a Durable Object's SQLite takes at most 2 MB in one value); larger
    # payloads take more statements, an item over the bound alone one of its own.
    from semaphore.client._item_store import INSERT_BATCH_BYTES

    s = Setup(limit=100, **SEED_TIMING)
    big = "x" * (INSERT_BATCH_BYTES // 3)
    payloads: list[Any] = [{"b": big}, "small", {"b": big}, {"b": big}, {"b": "y" * INSERT_BATCH_BYTES}, 7]
    ids = [f"i{n}" for n in range(len(payloads))]
    with item_inserts(s.side) as statements:
        items = await s.queue.enqueue_many(KEY, "g", ids, payloads)
    # [big, "small"], [big], [big], [the one over the bound], [7]: each part's JSON (escapes
    # counted at most twice) within the bound.
    assert len(statements) == 5
    assert [i.payload for i in items] == payloads
    assert [i.item_id for i in s.queue.items(KEY, ItemState.QUEUED)] == ids
    assert [i.payload for i in s.queue.items(KEY, ItemState.QUEUED)] == payloads


@pytest.mark.parametrize("item_ids, payloads, field, words", [
    ("abc", None, "item_ids", "expected a list of item ids, got str"),
    (["a", "b", "a"], None, "item_ids[2]", "given twice"),
    (["a", "b\x00c"], None, "item_ids[1]", "control character"),
    (["a", "b"], [1], "payloads", "one payload per item id (2), got 1 payloads"),
    (["a", "b"], "ab", "payloads", "expected a list of payloads, one per item id, got str"),
    (["a", "b"], {1, 2}, "payloads", "got set"),
    (["a", "b"], [1, float("nan")], "payloads[1]", "not strict JSON"),
    ([f"i{n}" for n in range(10_001)], None, "item_ids", "10001 items, over the 10000"),
    ([f"i{n}" for n in range(20)], ["x" * 900_000] * 20, "payloads", "16000000 bytes"),
    (["a", "b\x00c"], [float("nan"), 1], "payloads[0]", "not strict JSON"),
    (["a\x00", "b"], [1, float("nan")], "item_ids[0]", "control character"),
], ids=["a string", "an id twice", "an id outside the alphabet", "payloads of another length",
        "payloads a string", "payloads a set", "a payload not JSON", "over 10,000 items", "over 16 MB of payloads",
        "the first fault named: a payload before a later id", "the first fault named: an id before its payload"])
@async_test
async def test_r37_enqueue_many_refuses_a_bad_batch_naming_the_field_and_writes_nothing(item_ids, payloads, field,
                                                                                        words):
    # R37, R7: every id and payload of a batch is checked before anything is written, and a
    # batch is bounded (one transaction, held in memory meanwhile): the error says what is wrong.
    s = Setup()
    with pytest.raises(ConfigurationError) as refused:
        await s.queue.enqueue_many(KEY, "g", item_ids, payloads)
    assert refused.value.field == field and words in str(refused.value), str(refused.value)
    assert s.queue.items() == [] and s.sent() == []


@async_test
async def test_finished_items_are_purged_in_batches_a_sixteenth_of_the_retention_apart():
    # R37 (finished items' purge): a pump deletes finished items once the earliest is 1/16 of
    # retention_ms past it, then every one older than retention_ms, not one purge per pump.
    s = Setup()
    s.side.queue.retention_ms = 16_000
    await s.queue.enqueue(KEY, "g", "a")
    await s.clock.advance(3000)
    await s.complete("a")
    await s.clock.advance(16_500)  # past the retention, within its 1/16
    await s.queue.enqueue(KEY, "g", "b")  # a pump
    await s.clock.advance(100)
    assert s.queue.item("a") is not None
    await s.clock.advance(1000)  # past 17/16 of the retention
    await s.queue.enqueue(KEY, "g", "c")
    await s.clock.advance(100)
    assert s.queue.item("a") is None and s.queue.item("b") is not None


def _purging_side(clock: SimClock, failing: Callable[[str], bool] | None = None, **options: Any) -> ClientSide:
    """A client object whose finished items are kept 16 s; with ``failing``: an ``on_done`` hook
    that raises for the item ids it says so."""
    def on_done(item: QueueItem) -> None:
        if failing is not None and failing(item.item_id):
            raise RuntimeError("hook down")

    if failing is not None:
        options["on_done"] = on_done
    return ClientSide("c1", clock, Net(HolderSide(clock, limit=3, leases=None), clock),
                      on_admit=lambda side, item: None, retention_ms=16_000, **options)


async def _finish(side: ClientSide, clock: SimClock, *item_ids: str) -> None:
    """Enqueue ``item_ids``, run them 3 s, complete them."""
    for item_id in item_ids:
        await side.queue.enqueue(KEY, "g", item_id)
    await clock.advance(3000)
    for item_id in item_ids:
        await side.queue.complete(item_id)


async def _pump(side: ClientSide, clock: SimClock, times: int, every_ms: int, prefix: str = "n") -> None:
    """``times`` pumps ``every_ms`` apart (each enqueues an item that never finishes)."""
    for i in range(times):
        await side.queue.enqueue(KEY, "g", f"{prefix}{i}")
        await clock.advance(every_ms)


@contextlib.contextmanager
def _purges(side: ClientSide, at: Callable[[], Any]) -> Iterator[list[Any]]:
    """``at()`` of every purge (its ``DELETE`` of finished items) while the block runs."""
    purges: list[Any] = []
    inner = side.storage.sql.exec

    def counted(query: str, *args: Any) -> Any:
        if query.startswith("DELETE") and "finished_at" in query:
            purges.append(at())
        return inner(query, *args)

    side.storage.sql.exec = counted  # type: ignore[method-assign]
    try:
        yield purges
    finally:
        side.storage.sql.exec = inner  # type: ignore[method-assign]


@async_test
async def test_a_finished_item_whose_hook_keeps_failing_does_not_make_every_pump_purge():
    # R37 (finished items' purge): the purge keeps an item whose on_done hook is pending, so
    # the earliest finished time that makes a purge due does not count it; else every pump
    # would purge (and fold, R35) for as long as the hook keeps failing.
    clock = SimClock(T0)
    side = _purging_side(clock, lambda item_id: item_id == "stuck")
    await _finish(side, clock, "stuck")
    await clock.advance(20_000)
    with _purges(side, lambda: clock.now) as purges:
        await _pump(side, clock, 6, 500)  # six pumps, each past the retention of "stuck"
    assert purges == [] and side.queue.item("stuck") is not None


@async_test
async def test_a_hook_failing_after_a_purge_does_not_make_every_pump_purge():
    # R37 (finished items' purge): after a purge, the earliest finished time is read again on
    # its own (not with the wake times), and that read leaves out an item whose hook is
    # pending too; else every pump would purge while the hook keeps failing.
    clock = SimClock(T0)
    side = _purging_side(clock, lambda item_id: item_id == "stuck")
    await _finish(side, clock, "old", "stuck")
    await clock.advance(20_000)
    await _pump(side, clock, 1, 500, prefix="p")  # a pump: purges "old", keeps "stuck"
    assert side.queue.item("old") is None and side.queue.item("stuck") is not None
    with _purges(side, lambda: clock.now) as purges:
        await _pump(side, clock, 6, 500)
    assert purges == []


@async_test
async def test_a_finished_item_whose_hook_ran_late_is_purged_though_nothing_finishes_after_it():
    # R37 (finished items' purge): an item whose on_done hook succeeds after failing becomes
    # purgeable then; the earliest finished time the purge waits for counts it from then on.
    # Before, a time read while its hook was pending left it out, and nothing purged the item
    # until another item finished in the same instance (here: never).
    clock = SimClock(T0)
    fails = [True] * 3
    side = _purging_side(clock, lambda item_id: item_id == "late" and bool(fails) and fails.pop())
    await _finish(side, clock, "late")
    await clock.advance(20_000)  # a purge, which keeps it (its hook is pending)
    await _pump(side, clock, 6, 500)
    assert fails == []  # its hook ran at last
    await _pump(side, clock, 20, 1000, prefix="m")  # pumps only: queued items that never finish
    assert side.queue.item("late") is None


@async_test
async def test_a_queue_without_on_done_purges_the_items_whose_hook_an_earlier_deployment_left_pending():
    # R37 (finished items' purge): a hook left pending (failing) by a deployment with on_done
    # never runs once the queue has none; its items are purged after the retention like any.
    clock = SimClock(T0)
    side = _purging_side(clock, lambda item_id: True)
    await _finish(side, clock, "a")
    await clock.advance(1000)
    side.queue_options.pop("on_done")
    side.evict()  # redeployed without the hook
    await _pump(side, clock, 40, 1000, prefix="m")
    assert side.queue.item("a") is None


@async_test
async def test_a_queue_started_by_its_alarm_without_on_done_purges_the_items_of_the_hooks_it_dropped(
        caplog: pytest.LogCaptureFixture):
    # R37 (finished items' purge): the alarm (the hook's retry wake-up) starts the instance; the
    # scheduler reads the purge's earliest finished time before the queue drops the hooks, so
    # the drop makes it read again (else the item would wait for another one to finish). The
    # drop is logged with the number of hooks.
    clock = SimClock(T0)
    side = _purging_side(clock, lambda item_id: True)
    await _finish(side, clock, "a")
    await clock.advance(100)
    side.queue_options.pop("on_done")
    side.evict()
    with caplog.at_level(logging.WARNING, logger="semaphore.queue"):
        await clock.advance(20_000)  # the hook's retry wake-up fires in the new instance first
    assert any("1 finished item(s) had an on_done hook pending" in r.getMessage() for r in caplog.records)
    await _pump(side, clock, 40, 1000, prefix="m")
    assert side.queue.item("a") is None


@async_test
async def test_steady_completions_purge_finished_items_once_per_sixteenth_of_the_retention():
    # R37 (finished items' purge): with an item finishing every 250 ms, purges run at least
    # 1/16 of retention_ms apart (not at nearly every pump), and nothing is kept past 17/16 of it.
    clock = SimClock(T0)
    side = _purging_side(clock)
    with _purges(side, lambda: clock.now) as purges:
        for n in range(160):  # 40 s
            await side.queue.enqueue(KEY, "g", f"i{n}")
            await clock.advance(125)
            for item in side.queue.items(state=ItemState.RUNNING):
                await side.queue.complete(item.item_id)
            await clock.advance(125)
    assert len(purges) >= 10 and all(b - a >= 1000 for a, b in zip(purges, purges[1:])), purges
    kept = [i.item_id for i in side.queue.items(state=ItemState.DONE)
            if 0 < i.finished_at < clock.now - 17_000 - 1000]
    assert kept == []


@async_test
async def test_a_queue_step_that_fails_after_a_reply_was_applied_rolls_the_reply_back_in_sql_and_in_memory(
        monkeypatch: pytest.MonkeyPatch):
    # R35, R37: the queue applies a reply (client.apply) and moves its items on it in ONE
    # transaction of its own. When its step raises after the apply, the reply's merge is rolled
    # back in SQL and the client's in-memory copy forgets it too (the queue's and the client's
    # Storage objects are distinct here, as in the test kit: the rollback hook between them
    # carries it), so memory and SQL never disagree; the pump asks again and the item runs.
    from semaphore import SemaphoreClient
    from semaphore.client import _queue_pump

    s = Setup()
    assert s.queue.storage is not s.side.client.storage
    real = _queue_pump.client_step.after_reply
    seen: list[list[str]] = []

    def fails_once(*args: Any, **kwargs: Any) -> Any:
        if not seen:
            seen.append([g.grant_id for g in s.side.client.grants(KEY)])  # the merge, visible inside
            raise RuntimeError("the queue's step failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(_queue_pump.client_step, "after_reply", fails_once)
    await s.queue.enqueue(KEY, "g", "a")
    await s.clock.settle()
    assert seen and seen[0], "the reply's grant was not visible inside the queue's step"
    fresh = SemaphoreClient(s.side.ctx, s.side.client.transport, clock=s.clock, client_id="c1")
    assert [g.grant_id for g in s.side.client.grants(KEY)] == [g.grant_id for g in fresh.grants(KEY)] == []
    await s.clock.advance(10_000)
    assert [i.item_id for i in s.admitted] == ["a"]
