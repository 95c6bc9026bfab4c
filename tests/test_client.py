"""SemaphoreClient against a real holder in the same process (SPEC R35, R8, R13-R15a, R29-R34)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from semaphore import (
    Demand,
    GrantStatus,
    HolderUnavailableError,
    InvalidMessageError,
    RoundFailedError,
    SemaphoreClient,
    SemaphoreError,
)
from semaphore.runtime import Storage
from semaphore.testing import SEED_TIMING, T0, HolderSide, LocalContext, LocalStorage, Net, VirtualClock, async_test

LEASES = {"provisioning": {"mode": "strict"}, "permitsPerLease": 4, "ttlMs": 20_000}


class Setup:
    def __init__(self, limit: int = 5, **options: Any) -> None:
        self.clock = VirtualClock(T0)
        self.holder = HolderSide(self.clock, limit=limit, **{"leases": None, **options})  # grants: these tests are of the grant path (the default leases: test_reusable_leases.py)
        self.net = Net(self.holder, self.clock)
        self.storage = LocalStorage()
        self.ctx = LocalContext(self.storage, name="c1")
        self.client = self.new_client()

    def new_client(self, **kwargs: Any) -> SemaphoreClient:
        return SemaphoreClient(self.ctx, self.net, clock=self.clock, client_id="c1", **kwargs)

    async def run(self, coro: Any) -> Any:
        """Run ``coro`` to completion while virtual time advances event by event."""
        task = asyncio.ensure_future(coro)
        await self.clock.settle()
        while not task.done():
            t = self.clock.next_event()
            assert t is not None, "stuck"
            await self.clock.advance_to(t)
        return task.result()

    async def ask(self, group: str = "g", count: int = 1, **kwargs: Any):
        return await self.run(self.client.request("k", [Demand(group, count, T0)], **kwargs))


@async_test
async def test_reports_are_cumulative():
    # R13, R35: every message carries cumulative counts built from durable state
    s = Setup()
    applied = await s.ask(count=3)
    (g,) = applied.response.grants
    assert s.client.claim("k", g.grant_id, 2) == [1, 2]
    await s.run(s.client.sync("k"))
    assert s.client.release("k", g.grant_id, 1) == 1
    await s.run(s.client.sync("k"))
    await s.run(s.client.sync("k"))
    reports = [m["grants"] for m in s.net.sent[1:]]
    assert reports == [[{"grantId": g.grant_id, "claimed": 2, "released": 0}],
                       [{"grantId": g.grant_id, "claimed": 2, "released": 1}],
                       [{"grantId": g.grant_id, "claimed": 2, "released": 1}]]
    held = s.holder.storage.connection.execute(
        "SELECT claimed, released FROM durability_semaphore_grants").fetchall()
    assert held == [(2, 1)]
    assert "leases" in s.net.sent[0]  # R5: the client announces lease support by default
    await s.run(s.client.request("k", [], leases=False))
    assert "leases" not in s.net.sent[-1]


@async_test
async def test_next_request_at_is_respected():
    # R11, R35: the client does not ask before the reply's joinInMs from then (round_wait_ms
    # before nextRequestAt: a request sent then joins the round at nextRequestAt) unless forced
    s = Setup(**SEED_TIMING)  # staged on batched rounds (R9), not R9a's rounds at once
    first = await s.ask()
    next_round = first.response.next_request_at
    not_before = first.now + first.response.join_in_ms
    assert not_before == next_round - 1000 and not_before > s.clock.now
    assert s.client.not_before("k") == not_before
    sent_at: list[int] = []
    s.net.intercept = lambda key, msg: sent_at.append(s.clock.now)  # type: ignore[func-returns-value]
    await s.ask()
    assert sent_at[0] >= not_before
    assert s.clock.now >= next_round  # its round ran no sooner than the first reply said (R9)
    # force=True sends at once
    before = s.clock.now
    await s.ask(force=True)
    assert sent_at[1] == before


@async_test
async def test_error_replies_become_typed_exceptions():
    # R7: error values turn into typed exceptions on the client side
    s = Setup(**SEED_TIMING)  # staged on batched rounds (R9), not R9a's rounds at once
    bad = SemaphoreClient(s.ctx, s.net, clock=s.clock, client_id="x" * 300)
    with pytest.raises(InvalidMessageError) as info:
        await s.run(bad.request("k", [Demand("g", 1, T0)]))
    assert info.value.field == "clientId"
    # R2: a round that cannot commit is answered round_failed
    from semaphore.testing import DurableObjectRuleError
    await s.run(s.holder.usage())   # the holder's schema is ready: the failure hits the round
    task = asyncio.ensure_future(s.client.request("k", [Demand("g", 1, T0)]))
    await s.clock.settle()
    s.holder.storage.fail_next_exec = DurableObjectRuleError("disk full")
    with pytest.raises(RoundFailedError):
        await s.run(task)
    # transport failures and malformed replies
    async def broken(key: str, message: dict) -> Any:
        raise RuntimeError("connection reset")
    c = SemaphoreClient(s.ctx, broken, clock=s.clock, client_id="c1")
    with pytest.raises(HolderUnavailableError):
        await c.sync("k")

    async def weird(key: str, message: dict) -> Any:
        return ["not", "a", "dict"]
    c = SemaphoreClient(s.ctx, weird, clock=s.clock, client_id="c1")
    with pytest.raises(HolderUnavailableError):
        await c.sync("k")

    async def unknown_code(key: str, message: dict) -> Any:
        return {"v": 1, "error": {"code": "teapot", "message": "short and stout"}}
    c = SemaphoreClient(s.ctx, unknown_code, clock=s.clock, client_id="c1")
    with pytest.raises(SemaphoreError) as err:
        await c.sync("k")
    assert err.value.code == "teapot"


@async_test
async def test_not_found_drops_the_grant():
    # R15: nothing claimed by claimBy -> the grant is deleted; a later report is not_found
    s = Setup()
    (g,) = (await s.ask(count=2)).response.grants
    await s.clock.advance_to(g.claim_by + 1)  # the holder's alarm reclaims
    applied = await s.run(s.client.sync("k"))
    assert applied.dropped == [g.grant_id]
    assert s.client.grants("k") == []
    assert s.client.grant("k", g.grant_id).status == "gone"  # tombstone
    await s.run(s.client.sync("k"))
    assert s.net.sent[-1]["grants"] == []  # no longer reported


@async_test
async def test_expired_clamps_unconfirmed_claims():
    # R15, R15a: a claim reaching the holder after claimBy is clamped; only confirmed slots run
    s = Setup()
    (g,) = (await s.ask(count=3)).response.grants
    s.client.claim("k", g.grant_id, 2)
    await s.run(s.client.sync("k"))
    assert s.client.grant("k", g.grant_id).confirmed == 2
    assert s.client.claim("k", g.grant_id, 1) == [3]  # too late: not confirmed before claimBy
    await s.clock.advance_to(g.claim_by + 1)
    applied = await s.run(s.client.sync("k"))
    assert applied.expired == [g.grant_id]
    local = s.client.grant("k", g.grant_id)
    assert (local.permits, local.claimed, local.confirmed, local.status) == (2, 2, 2, "expired")
    assert local.confirmed < 3 and local.final  # slot 3 will never be confirmed
    # releasing the confirmed slots settles it
    s.client.release("k", g.grant_id, 2)
    applied = await s.run(s.client.sync("k"))
    assert applied.dropped == [g.grant_id]
    assert (await s.holder.usage())["outstanding"] == 0


@async_test
async def test_r15a_a_claim_is_released_only_once_the_holder_has_confirmed_it():
    # R15a, R15, I4: an unconfirmed claim may reach the holder after claimBy and be refused; a
    # release reported for it would be counted against a slot the holder did take (one an item
    # runs under). So release() releases confirmed slots only; a refused one is dropped at expiry.
    s = Setup()
    (g,) = (await s.ask(count=2)).response.grants
    assert s.client.claim("k", g.grant_id, 1) == [1]
    assert s.client.release("k", g.grant_id, 1) == 0  # not confirmed yet
    await s.run(s.client.sync("k"))
    assert s.client.claim("k", g.grant_id, 1) == [2]  # slot 1 runs an item; slot 2 not confirmed
    await s.clock.advance_to(g.claim_by + 1)
    await s.holder.alarm()  # the holder reclaims: it keeps slot 1, the claim of slot 2 comes late
    await s.run(s.client.sync("k"))
    local = s.client.grant("k", g.grant_id)
    assert (local.permits, local.claimed, local.confirmed, local.released) == (1, 1, 1, 0), local
    assert (await s.holder.usage())["outstanding"] == 1  # slot 1 is still charged
    assert s.client.release("k", g.grant_id, 2) == 1
    assert (await s.run(s.client.sync("k"))).dropped == [g.grant_id]


@async_test
async def test_adopts_grants_and_leases_of_a_lost_reply():
    # R8: a grant (and lease) whose reply was lost reaches the client at its next message
    s = Setup(limit=10, leases=LEASES)
    delivered: list[dict] = []
    # deliver for real, then lose the reply
    orig = s.net.__call__

    async def deliver_then_lose(key: str, message: dict) -> dict:
        reply = await orig(key, message)
        delivered.append(reply)
        raise HolderUnavailableError("reply lost")

    s.client.transport = deliver_then_lose
    with pytest.raises(HolderUnavailableError):
        await s.ask(count=3)
    assert delivered and delivered[0]["grants"] and delivered[0]["leases"]
    assert s.client.grants("k") == [] and s.client.needs_sync("k")
    s.client.transport = s.net
    applied = await s.run(s.client.sync("k"))
    assert applied.adopted_grants == [delivered[0]["grants"][0]["grantId"]]
    assert applied.adopted_leases == [delivered[0]["leases"][0]["leaseId"]]
    assert not s.client.needs_sync("k")
    g = s.client.grants("k")[0]
    assert s.client.claim("k", g.grant_id, 3) == [1, 2, 3]
    await s.run(s.client.sync("k"))
    assert s.client.grant("k", g.grant_id).confirmed == 3


@async_test
async def test_r13_a_delivered_report_is_durable_even_when_its_reply_merges_nothing():
    # R13, R35: the holder applied the report, so its counts are acknowledged (sent_*) and the
    # entry moves behind the others (report_at); that is written with the reply's merge of the
    # row, or on its own when the reply lists the row nowhere: a new instance over the same
    # storage knows it (here a reply that lists no grant at all).
    s = Setup()
    (g,) = (await s.ask(count=2)).response.grants
    assert s.client.claim("k", g.grant_id, 2) == [1, 2]
    empty = {"ok": True, "grants": [], "leases": [], "nextRequestAt": s.clock.now, "contended": False}
    s.net.intercept = lambda key, msg: empty
    await s.run(s.client.sync("k"))
    assert s.net.sent[-1]["grants"] == [{"grantId": g.grant_id, "claimed": 2, "released": 0}]
    fresh = s.new_client()
    assert fresh.grant("k", g.grant_id).sent_claimed == 2
    assert not fresh.dirty("k")


@async_test
async def test_stale_reply_cannot_resurrect_a_dropped_grant():
    # I2 on the client: tombstones keep a stale "active" from bringing a dropped grant back
    s = Setup()
    first = await s.ask(count=1)
    stale = first.response.to_wire()
    (g,) = first.response.grants
    await s.clock.advance_to(g.claim_by + 1)
    await s.run(s.client.sync("k"))
    assert s.client.grants("k") == []

    s.net.intercept = lambda key, msg: stale
    await s.run(s.client.sync("k"))
    assert s.client.grants("k") == []


@async_test
async def test_lease_retired_stops_and_settles():
    # R30, R31, R33, R34: a retired lease stops drawing at once; stopped reports until settled
    s = Setup(limit=10, leases={**LEASES, "ttlMs": 5_000})
    applied = await s.ask(count=2)
    (lease,) = applied.response.leases
    lid = lease.lease_id
    assert s.client.draw("k", lid) == 1
    await s.clock.advance(6_000)  # unreported for ttlMs: the holder retires it
    applied = await s.run(s.client.sync("k"))
    assert applied.retired == [lid]
    local = s.client.lease("k", lid)
    assert local.stopped and local.status == "retired"
    assert s.client.draw("k", lid) is None  # stops drawing at once
    assert s.net.sent[-1]["leases"][0]["drawn"] == 1
    await s.run(s.client.sync("k"))
    assert s.net.sent[-1]["leases"] == [{"leaseId": lid, "drawn": 1, "released": 0, "stopped": True}]
    assert (await s.holder.usage())["leaseFootprint"] == 1  # drawn - released once confirmed
    assert s.client.release_lease("k", lid) == 1
    assert s.client.release_lease("k", lid) == 0  # one-shot
    applied = await s.run(s.client.sync("k"))
    assert applied.settled == [lid]
    assert s.client.leases("k") == []
    assert (await s.holder.usage())["leaseFootprint"] == 0


@async_test
async def test_draw_is_one_shot_and_stop_returns_undrawn():
    # R34, R29: releasing never makes a permit drawable again; stopping returns the undrawn ones
    s = Setup(limit=10, leases=LEASES)
    (lease,) = (await s.ask(count=1)).response.leases
    lid = lease.lease_id
    slots = [s.client.draw("k", lid) for _ in range(lease.permits + 1)]
    assert slots == list(range(1, lease.permits + 1)) + [None]
    s.client.release_lease("k", lid, lease.permits)
    assert s.client.draw("k", lid) is None
    assert s.client.stop_lease("k", lid)
    applied = await s.run(s.client.sync("k"))
    assert applied.settled == [lid]
    assert (await s.holder.usage())["leaseFootprint"] == 0


@async_test
async def test_r30_drawing_many_permits_is_one_write_and_stops_where_draws_one_by_one_stop():
    # R30, R34: the queue draws a step's items from a lease in one write: the same slots as
    # drawing one at a time, as many as the lease still has, none from a stopped lease.
    s = Setup(limit=10, leases=LEASES)
    (lease,) = (await s.ask(count=1)).response.leases
    lid = lease.lease_id
    unit = s.client.unit("k")
    before = s.client.storage.statements
    assert s.client.storage.transaction(lambda: unit.draw_many(lid, 3)) == [1, 2, 3]
    assert s.client.storage.statements - before == 1
    rest = s.client.storage.transaction(lambda: unit.draw_many(lid, lease.permits))
    assert rest == list(range(4, lease.permits + 1))
    assert s.client.storage.transaction(lambda: unit.draw_many(lid, 1)) == []
    assert s.client.lease("k", lid).drawn == lease.permits
    assert s.client.stop_lease("k", lid)
    s.client.release_lease("k", lid, lease.permits)
    assert s.client.storage.transaction(lambda: unit.draw_many(lid, 1)) == []


@async_test
async def test_survives_eviction():
    # R35: everything the client needs is in its own storage
    s = Setup(limit=10, leases=LEASES)
    applied = await s.ask(count=3)
    g = next(x for x in applied.response.grants)
    (lease,) = applied.response.leases
    s.client.claim("k", g.grant_id, 2)
    s.client.draw("k", lease.lease_id)
    not_before = s.client.not_before("k")

    fresh = s.new_client()  # a new instance over the same storage
    assert fresh.not_before("k") == not_before
    assert fresh.grant("k", g.grant_id).claimed == 2
    assert fresh.lease("k", lease.lease_id).drawn == 1
    assert fresh.dirty("k")
    await s.run(fresh.sync("k"))
    assert not fresh.dirty("k")
    assert fresh.grant("k", g.grant_id).confirmed == 2
    held = s.holder.storage.connection.execute(
        "SELECT drawn FROM durability_semaphore_leases").fetchall()
    assert held == [(1,)]


@async_test
async def test_recheck_sync_after_a_request():
    # R8 + the seed's "lost response": one sync recheck_ms after a request, so a lease issued to
    # a duplicated or late copy of the request (whose reply nobody received) is adopted
    s = Setup(limit=10, leases=LEASES)
    first = await s.ask(count=1)
    copy = dict(s.net.sent[-1], demand=[{"group": "h", "count": 1, "oldestAt": T0}])
    late = await s.run(s.holder.handle(copy))  # a late duplicate with other demand
    (late_lease,) = [x for x in late["leases"] if x["group"] == "h"]
    assert s.client.check_at("k") is not None
    await s.clock.advance_to(s.client.check_at("k"))
    assert s.client.needs_sync("k")
    applied = await s.run(s.client.sync("k"))
    assert late_lease["leaseId"] in applied.adopted_leases
    assert not s.client.needs_sync("k") and s.client.check_at("k") is None
    assert first.response.grants[0].status is GrantStatus.ACTIVE


@async_test
async def test_a_sent_reply_changes_nothing_until_the_caller_applies_it_in_its_own_transaction():
    # R35 (issue 20's inversion): send_sync/send_request return the checked answer unapplied;
    # apply() runs in the CALLER's transaction, so a caller whose own step fails rolls back
    # the reply's merge with it, and nothing of the reply is lost: the same answer applies later.
    s = Setup()
    applied = await s.ask(count=2)
    (g,) = applied.response.grants
    assert s.client.claim("k", g.grant_id, 1) == [1]
    reply = await s.run(s.client.send_sync("k"))
    assert s.client.grant("k", g.grant_id).confirmed == 0  # sent and answered, not applied

    def fails() -> None:
        s.client.apply(reply)
        assert s.client.grant("k", g.grant_id).confirmed == 1  # applied inside the transaction
        raise RuntimeError("the caller's own step failed")

    with pytest.raises(RuntimeError):
        s.client.storage.transaction(fails)
    fresh = s.new_client()  # what SQL holds: nothing of the reply
    assert fresh.grant("k", g.grant_id).confirmed == 0
    assert s.client.grant("k", g.grant_id).confirmed == 0  # the copy forgot it too
    s.client.storage.transaction(lambda: s.client.apply(reply))
    assert s.client.grant("k", g.grant_id).confirmed == 1
    assert s.new_client().grant("k", g.grant_id).confirmed == 1
    assert s.client.grant("k", g.grant_id).sent_claimed == 1  # its report counts as delivered


@pytest.mark.parametrize("outer", [False, True], ids=["no-transaction", "another-adapters-transaction"])
@async_test
async def test_a_reply_is_applied_whole_or_not_at_all(outer: bool):
    # R2, R35: apply() is a transaction of its own (a savepoint inside the caller's): a
    # statement that fails part way leaves nothing of the reply in SQL or in the client's copy,
    # and the same answer applies later; so too inside a transaction of another adapter over
    # the same ctx (the object's scheduler's, say), whose rollback the client does not hear
    # of. (Before, outside a transaction each statement committed on its own: the first
    # group's grant was stored and the second's lost.)
    s = Setup()
    reply = await s.run(s.client.send_request("k", [Demand("g", 1, T0), Demand("h", 1, T0)], force=True))
    assert len(reply.response.grants) == 2
    inner = s.storage.sql.exec
    writes = []

    def second_write_fails(query: str, *bindings: Any) -> Any:
        if query.lstrip().split(None, 1)[0].upper() in ("INSERT", "UPDATE", "DELETE"):
            writes.append(query)
            if len(writes) == 2:
                raise RuntimeError("the disk failed")
        return inner(query, *bindings)

    s.storage.sql.exec = second_write_fails  # type: ignore[method-assign]
    other = Storage(s.ctx)
    with pytest.raises(RuntimeError, match="the disk failed"):
        if outer:
            other.transaction(lambda: s.client.apply(reply))
        else:
            s.client.apply(reply)
    s.storage.sql.exec = inner  # type: ignore[method-assign]
    assert len(writes) == 2  # it failed part way
    assert s.new_client().grants("k") == [] and s.client.grants("k") == []  # the copy forgot it too
    s.client.apply(reply)  # outside a transaction again: whole
    assert {g.group for g in s.new_client().grants("k")} == {"g", "h"}
    assert {g.group for g in s.client.grants("k")} == {"g", "h"}
