"""A lowered limit or group limit reaches every lease (SPEC R33, R33a), reusable and one-shot,
under ``limitedGroups`` ``exclude`` and ``withinGroupLimit``: after the limit lowers, no new
item starts from a lease later than the stated bound (the lease ``recheckMs`` plus one sync)
unless the new limit leaves room for it, while the items already running finish.

The real holder, client and queue objects, through the queue, on a virtual clock with the
default round timing and the default lease lifetime (``ttlMs`` 30 minutes: a heartbeat at 15).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from semaphore import ConfigurationError, LeaseConfig
from semaphore.testing import SEED_TIMING, T0, ClientSide, HolderSide, Net, SimClock, async_test, request, sync

#: SPEC R33a: with the default ``recheckMs`` (4 s) a lowered limit stops new admissions from
#: every lease within 5 s (the recheck, its sync, and the client's next pump).
BOUND_MS = 5000
JOB_MS = 1000

REUSABLE = {"provisioning": {"mode": "strict"}, "permitsPerLease": 8, "reusable": True, "leaseFirst": True}
ONE_SHOT = {"provisioning": {"mode": "strict"}, "permitsPerLease": 16}


class Load:
    """One client keeping its queue busy: items that each run ``JOB_MS``, started by the queue
    (``on_admit``) and completed by the test; ``starts`` records ``(time, running after it)``."""

    def __init__(self, clock: SimClock, net: Net, group: str, name: str = "c1", **queue_options: Any) -> None:
        self.clock, self.group = clock, group
        self.running: dict[str, int] = {}
        self.starts: list[tuple[int, int]] = []
        self.n = 0
        self.side = ClientSide(name, clock, net, on_admit=self.admit, **queue_options)

    def admit(self, side: ClientSide, item: Any) -> None:
        self.running[item.item_id] = self.clock.now
        self.starts.append((self.clock.now, len(self.running)))

    async def enqueue(self, count: int) -> None:
        for _ in range(count):
            self.n += 1
            await self.side.queue.enqueue("acct", self.group, f"i{self.n}")

    async def run(self, until: int, *, arrive_every_ms: int | None = None, step_ms: int = 100) -> None:
        next_arrival = self.clock.now
        while self.clock.now < until:
            if arrive_every_ms is not None and self.clock.now >= next_arrival:
                await self.enqueue(1)
                next_arrival += arrive_every_ms
            for item_id, at in list(self.running.items()):
                if self.clock.now - at >= JOB_MS:
                    del self.running[item_id]
                    await self.side.queue.complete(item_id)
            await self.clock.advance(step_ms)


def world(leases: dict[str, Any], box: dict[str, Any], group: str = "g", hold_ms: int = 0):
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=lambda: box["limit"],
                        group_limit=lambda g: box.get(g), leases=leases, hold_blocked_ms=hold_ms)
    net = Net(holder, clock)
    return clock, holder, net, Load(clock, net, group, request_wait_ms=hold_ms)


CASES = [
    # (name, leases, limits before, limits after, items: a backlog, or one every this many ms)
    ("reusable, limit", REUSABLE, {"limit": 3}, {"limit": 1}, None),
    ("reusable, group limit, withinGroupLimit", {**REUSABLE, "limitedGroups": "withinGroupLimit"},
     {"limit": 10, "g": 3}, {"limit": 10, "g": 1}, None),
    ("reusable, a group limit appears, exclude", REUSABLE, {"limit": 3}, {"limit": 3, "g": 1}, None),
    # waiting requests (R9, the bench's reuse-held hold): the key's request is held while it
    # draws, answered by a round that retires the lease, but no round need come before the
    # hold's deadline (30 s): the recheck goes beside the held request
    ("reusable, limit, waiting requests", {**REUSABLE, "hold": 30_000}, {"limit": 3}, {"limit": 1}, None),
    # a one-shot lease gets what grants leave (R25): 1 granted, a lease of 16 drawn one by one
    ("one-shot, limit", ONE_SHOT, {"limit": 20}, {"limit": 0}, 2000),
    ("one-shot, group limit, withinGroupLimit", {**ONE_SHOT, "limitedGroups": "withinGroupLimit"},
     {"limit": 30, "g": 20}, {"limit": 30, "g": 0}, 2000),
]


@pytest.mark.parametrize("name, leases, before, after, every", CASES, ids=[c[0] for c in CASES])
@async_test
async def test_r33_r33a_a_lowered_limit_stops_new_admissions_from_every_lease_within_the_bound(
        name, leases, before, after, every):
    box = dict(before)
    leases = dict(leases)
    hold_ms = leases.pop("hold", 0)
    clock, holder, net, load = world(leases, box, hold_ms=hold_ms)
    await load.enqueue(200 if every is None else 1)
    await load.run(clock.now + (20_000 if every is None else 6000), arrive_every_ms=every)
    # served by a lease that can still admit (a reusable one, or undrawn one-shot permits)
    assert any(x["status"] == "live" and (x["reusable"] or x["drawn"] < x["permits"])
               for x in holder.leases().values())
    box.clear()
    box.update(after)
    lowered = clock.now
    await load.run(clock.now + 40_000, arrive_every_ms=every)
    new_limit = min(v for v in after.values())
    late = [(t - lowered, n) for t, n in load.starts if t > lowered + BOUND_MS and n > new_limit]
    assert late == [], f"{name}: items started above the lowered limit after the bound: {late[:5]}"
    if new_limit:  # not starved either: items start under the new limit once the others finished
        assert any(t > lowered + BOUND_MS for t, _ in load.starts)
    load.side.driver.kill()


def test_r33a_recheck_ms_parses_in_both_spellings_defaults_to_4_s_and_0_turns_it_off():
    assert LeaseConfig().recheck_ms == 4000
    assert LeaseConfig.parse({"recheckMs": 0}).recheck_ms == 0  # type: ignore[union-attr]
    assert LeaseConfig.parse({"recheck_ms": 2500}).recheck_ms == 2500  # type: ignore[union-attr]
    with pytest.raises(ConfigurationError) as info:
        LeaseConfig.parse({"recheckMs": -1})
    assert info.value.field == "leases.recheckMs"


@async_test
async def test_r33a_replies_tell_the_recheck_and_a_sync_reporting_a_lease_retires_it_when_the_limit_lowered():
    # R33a at the holder: a sync that reports leases resolves the limit; below the last round's,
    # it retires every live lease (R33) in its own transaction, and its reply says so.
    box = {"limit": 4}
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=lambda: box["limit"], leases={**REUSABLE, "recheckMs": 3000})
    [reply] = await holder.round(request("a", {"g": 2}, leases=[]))
    assert reply["leaseRecheckMs"] == 3000
    (lease,) = reply["leases"]
    assert lease["status"] == "live"
    [other] = await holder.round(request("b", {"g": 2}, leases=[]))
    box["limit"] = 2
    answer = await holder.one(sync("a", leases=[(lease["leaseId"], 1, 0, False)]))
    assert [x["status"] for x in answer["leases"]] == ["retired"]
    assert all(x["status"] == "retired" for x in holder.leases().values())  # b's too (R33)
    # the limit is written as the last round's: the next round retires nothing new
    assert holder.storage.connection.execute(
        "SELECT value FROM durability_semaphore_meta WHERE key = 'last_limit'").fetchone()[0] == 2
    del other
    holder.check()


@async_test
async def test_r33a_a_reply_counts_as_fresh_from_when_its_message_was_sent():
    # R33a: the recheck bound runs from what the reply shows, which is the holder as of no
    # earlier than the message's sending; a slow return leg does not make it fresher, and a
    # slower reply of an earlier message never moves the mark back.
    from semaphore import SemaphoreClient
    from semaphore.testing import LocalContext

    clock = SimClock(T0)
    holder = HolderSide(clock, limit=3, leases=REUSABLE)
    net = Net(holder, clock)
    delays = [3000]

    async def slow(key: str, message: dict[str, Any]) -> dict[str, Any]:
        reply = await net(key, message)
        await clock.sleep(delays.pop(0) if delays else 0)  # the reply's way back
        return reply

    client = SemaphoreClient(LocalContext(), slow, clock=clock, client_id="c1")
    sent = clock.now
    call = asyncio.ensure_future(client.sync("k", leases=True))
    await clock.advance(3000)
    await call
    assert client.key_state("k").replied_at == sent  # not sent + 3000
    await client.sync("k", leases=True)
    assert client.key_state("k").replied_at == clock.now


# R33, R33a: a callable canGrant is asked at a sync that reports leases, for the client's
# live-lease pairs, so a client served wholly by its reusable lease (it never requests, so no
# round asks for it) stops drawing within the bound once canGrant refuses its (client, group).
@async_test
async def test_r33a_can_grant_turning_false_stops_new_admissions_from_a_reusable_lease_of_a_client_that_only_syncs():
    box: dict[str, Any] = {"ok": True}
    asked: list[tuple[str, str]] = []

    def can_grant(client: str, group: str) -> bool:
        asked.append((client, group))
        return bool(box["ok"])

    clock = SimClock(T0)
    holder = HolderSide(clock, limit=3, can_grant=can_grant, leases=REUSABLE)
    net = Net(holder, clock)
    load = Load(clock, net, "g")
    await load.enqueue(1)
    # one item a second, each running 1 s: everything fits in the lease, so the client never
    # needs a request; its recheck syncs (R33a) and heartbeats keep the lease live
    await load.run(clock.now + 20_000, arrive_every_ms=1000)
    assert any(x["status"] == "live" and x["reusable"] for x in holder.leases().values())
    box["ok"] = False  # the application withdraws the client's permission for the group
    refused, asked_before = clock.now, len(asked)
    await load.run(clock.now + 120_000, arrive_every_ms=1000)
    late = [t - refused for t, _ in load.starts if t > refused + BOUND_MS]
    load.side.driver.kill()
    assert late == [], f"{len(late)} items started from the lease after canGrant said no (last at +{late[-1]} ms)"
    assert not [x for x in holder.leases().values() if x["status"] == "live"]
    assert set(asked[asked_before:]) == {("c1", "g")}  # only the reporting client's lease pair


# R33, R33a: leases that outlived the holder's `leases` option (restarted without it) keep the
# bound: replies listing a live lease still tell the default recheck, and a sync reporting one
# still resolves the limit and retires what R33 would.
@async_test
async def test_r33a_a_lowered_limit_reaches_leases_that_outlived_the_leases_option():
    box = {"limit": 3}
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=lambda: box["limit"], leases=REUSABLE)
    net = Net(holder, clock)
    load = Load(clock, net, "g")
    await load.enqueue(1)
    await load.run(clock.now + 20_000, arrive_every_ms=1000)  # 1 running: always fits in the lease
    assert any(x["status"] == "live" and x["reusable"] for x in holder.leases().values())
    holder.evict(leases=None)  # the operator turns leases off (redeploy) ...
    # ... the lease outlives it (ttlMs) and keeps serving the client, whose replies come from
    # the holder without the option now ...
    started = len(load.starts)
    await load.run(clock.now + 20_000, arrive_every_ms=1000)
    assert len(load.starts) - started >= 15, "the lease served the client after the restart"
    assert any(x["status"] == "live" and x["reusable"] for x in holder.leases().values())
    box["limit"] = 0  # ... and then stops all new work
    lowered = clock.now
    await load.run(clock.now + 120_000, arrive_every_ms=1000)
    late = [(t - lowered, n) for t, n in load.starts if t > lowered + BOUND_MS]
    load.side.driver.kill()
    assert late == [], f"{len(late)} items started under a limit of 0 (e.g. {late[:3]})"
    assert not [x for x in holder.leases().values() if x["status"] == "live"]


# R33a: with leases not configured, a reply tells the recheck only while it lists a live lease.
@async_test
async def test_r33a_without_the_leases_option_a_reply_tells_the_recheck_only_while_it_lists_a_live_lease():
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=4, leases=REUSABLE)
    (ra,) = await holder.round(request("a", {"g": 2}, leases=[]))
    (la,) = ra["leases"]
    holder.evict(leases=None)
    live = await holder.one(sync("a", leases=[(la["leaseId"], 0, 0, False)]))
    assert [x["status"] for x in live["leases"]] == ["live"]
    assert live["leaseRecheckMs"] == LeaseConfig().recheck_ms
    settled = await holder.one(sync("a", leases=[(la["leaseId"], 0, 0, True)]))
    assert "leaseRecheckMs" not in settled
    (rb,) = await holder.round(request("b", {"g": 1}, leases=[]))
    assert "leaseRecheckMs" not in rb


# R33, R33a: a round that resolved the old limit before a lowering sync commits after it; the
# lease it issues is retired by the next sync (the round wrote its last_limit back).
@async_test
async def test_r33a_a_round_resolved_before_a_lowering_sync_leaves_no_lease_the_next_sync_misses():
    # The round resolves limit 4 (slowly); meanwhile the limit drops to 1 and b's sync retires
    # every live lease and writes last_limit 1. The stale round then commits under 4 and issues
    # c a lease: it writes last_limit 4 back, so the next sync (any client) retires it again.
    box = {"limit": 4, "slow": False}
    clock = SimClock(T0)

    async def limit() -> int:
        value = box["limit"]
        if box["slow"]:
            await clock.sleep(1000)
        return value

    holder = HolderSide(clock, limit=limit, leases=REUSABLE, **SEED_TIMING)  # staged on batched rounds (R9), not R9a's rounds at once
    ra, rb = await holder.round(request("a", {"g": 2}, leases=[]), request("b", {"g": 2}, leases=[]))
    (la,), (lb,) = ra["leases"], rb["leases"]
    await holder.one(sync("a", leases=[(la["leaseId"], 0, 0, True)]))  # a settles: 2 free
    box["slow"] = True
    round_task = holder.send(request("c", {"g": 2}, leases=[]))
    await clock.advance(2500)  # the round began and awaits limit()
    box.update(limit=1, slow=False)
    answer = await holder.one(sync("b", leases=[(lb["leaseId"], 0, 0, False)]))
    assert [x["status"] for x in answer["leases"]] == ["retired"]
    [rc] = await holder.finish(round_task)
    live = [x for x in holder.leases().values() if x["status"] == "live"]
    assert live, "the stale round issued c a lease under the old limit (the case under test)"
    if live:  # the stale round issued under 4: the next check must retire it
        (lc,) = rc["leases"]
        again = await holder.one(sync("c", leases=[(lc["leaseId"], 0, 0, False)]))
        assert [x["status"] for x in again["leases"]] == ["retired"]
    assert not [x for x in holder.leases().values() if x["status"] == "live"]
    holder.check()
