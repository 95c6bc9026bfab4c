"""Reusable leases and lease-first sizing (issue 13; SPEC R28a, R30a, R31a, R34a): the options
``reusable`` and ``leaseFirst`` of the holder's ``leases=``, off by default.

Holder rules on the SQLite test bed with hand-written messages (the arithmetic next to each
assertion); the queue's side (draw again after a release, no request while a reusable lease
serves a contended key, stop before expiry, draw beside a held request) with the real queue,
client and holder objects on a virtual clock.
"""

from __future__ import annotations

import pytest

from semaphore import ConfigurationError, LeaseConfig
from semaphore.testing import T0, Bed, ClientSide, HolderSide, Net, SimClock, async_test, blocked, request, sync
from test_leases import only
from test_leases import total_charged as charged

TTL = 20_000
REUSE = {"provisioning": {"mode": "strict"}, "permitsPerLease": 3, "ttlMs": TTL, "reusable": True}
REUSE_FIRST = {**REUSE, "leaseFirst": True}




# ====================================================================== options
def test_r34a_r28a_options_parse_in_both_spellings_and_are_off_by_default():
    assert LeaseConfig.parse({"provisioning": {"mode": "strict"}}) == LeaseConfig()
    assert not LeaseConfig().reusable and not LeaseConfig().lease_first
    c = LeaseConfig.parse({"reusable": True, "leaseFirst": True})
    assert c is not None and c.reusable and c.lease_first
    c = LeaseConfig.parse({"lease_first": True})
    assert c is not None and c.lease_first and not c.reusable
    for bad, field in (({"reusable": 1}, "leases.reusable"), ({"leaseFirst": "yes"}, "leases.leaseFirst"),
                       ({"leaseFirst": True, "lease_first": True}, "leases.leaseFirst")):
        with pytest.raises(ConfigurationError) as info:
            LeaseConfig.parse(bad)
        assert info.value.field == field


# ====================================================================== R34a, R30a on the holder
@async_test
async def test_r34a_r30a_a_reusable_lease_charges_every_slot_while_live_whatever_its_counts_say():
    bed = Bed(10, leases=REUSE_FIRST)
    (r,) = await bed.round(request("a", {"g": 3}, leases=[], oldest_at=1))
    lease = only(r)
    assert lease["reusable"] is True and lease["permits"] == 3 and r["grants"] == []  # R28a: min(3, 10, need 3)
    lid = lease["leaseId"]
    assert await charged(bed) == 3
    # R34a: 7 items drawn and 6 released over time (never more than 3 at once): drawn is not
    # capped at permits, and the footprint stays 3 (R30a), not permits - released.
    reply = await bed.one(sync("a", leases=[(lid, 7, 6)]))
    assert only(reply)["drawn"] == 7 and only(reply)["released"] == 6 and only(reply)["status"] == "live"
    assert await charged(bed) == 3
    # A stale report (lower counts) changes nothing (R13); a repeat frees nothing twice (I2).
    await bed.one(sync("a", leases=[(lid, 2, 1)]))
    await bed.one(sync("a", leases=[(lid, 7, 6)]))
    assert await charged(bed) == 3 and bed.leases()[lid]["drawn"] == 7
    # R30a: once stopped, min(permits, drawn - released) = 1; settled when released == drawn.
    await bed.one(sync("a", leases=[(lid, 7, 6, True)]))
    assert await charged(bed) == 1
    reply = await bed.one(sync("a", leases=[(lid, 7, 7, True)]))
    assert only(reply)["status"] == "settled" and await charged(bed) == 0
    bed.check()


@async_test
async def test_r30a_a_retired_reusable_lease_keeps_every_slot_charged_until_its_stop_report():
    bed = Bed(10, leases=REUSE)
    (r,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    lid = only(r)["leaseId"]
    await bed.one(sync("a", leases=[(lid, 5, 4)]))
    await bed.clock.advance(TTL + 1)  # R31: unreported for ttlMs -> retired at the next report
    reply = await bed.one(sync("b"))
    assert bed.leases()[lid]["status"] == "retired"
    # Not permits - released (3 - 4 < 0): the client may still run up to 3 under it (R30a).
    assert await charged(bed) == 3
    reply = await bed.one(sync("a", leases=[(lid, 6, 4, True)]))
    assert only(reply)["status"] == "retired" and await charged(bed) == 2  # min(3, 6 - 4)
    bed.check()


@async_test
async def test_r34a_the_undrawn_permits_of_a_reusable_lease_are_its_free_slots_for_need_and_candidacy():
    # R20/R26 with R34a: a reusable lease of 3 with 3 drawn and 1 released has 1 free slot.
    bed = Bed(10, leases=REUSE_FIRST)
    (r,) = await bed.round(request("a", {"g": 3}, leases=[], oldest_at=1))
    lid = only(r)["leaseId"]
    await bed.clock.advance(2000)
    # need = 4 - 1 free slot = 3 -> a grant of 3; not a lease candidate (a free slot left).
    (r,) = await bed.round(request("a", {"g": 4}, leases=[(lid, 3, 1)], oldest_at=1))
    assert [g["permits"] for g in r["grants"]] == [3]
    assert [x["leaseId"] for x in r["leases"]] == [lid]
    gid = r["grants"][0]["grantId"]
    await bed.clock.advance(2000)
    # All 3 slots busy (4 drawn, 1 released): a candidate again (R26), its need whole (9):
    # lease budget 10 - 3 - 3 = 4 -> a new lease of 3 (R28a), then a grant of the last 1.
    (r,) = await bed.round(request("a", {"g": 9}, grants=[(gid, 3, 0)], leases=[(lid, 4, 1)], oldest_at=1))
    assert [x["permits"] for x in r["leases"] if x["leaseId"] != lid] == [3]
    assert [g["permits"] for g in r["grants"] if g["grantId"] != gid] == [1]
    assert await charged(bed) == 10
    bed.check()


# ====================================================================== R31a
@async_test
async def test_r31a_a_report_extends_a_reusable_lease_only_while_no_request_waits_unserved():
    bed = Bed(3, leases=REUSE_FIRST)
    (r,) = await bed.round(request("a", {"g": 5}, leases=[], oldest_at=1))
    lid = only(r)["leaseId"]
    issued = bed.leases()[lid]["expires_at"]
    await bed.clock.advance(5000)
    await bed.one(sync("a", leases=[(lid, 3, 0)]))  # a waits for more, but holds a lease: extends
    assert bed.leases()[lid]["expires_at"] == bed.now + TTL > issued
    # b asks and gets nothing: 1 entry left with need, nothing served, no live lease (R31a).
    await bed.clock.advance(2000)
    (rb,) = await bed.round(request("b", {"g": 1}, leases=[], oldest_at=2))
    assert rb["grants"] == [] and rb["leases"] == [] and blocked(rb) == {"g": ("limit", 1)}
    before = bed.leases()[lid]["expires_at"]
    await bed.clock.advance(5000)
    await bed.one(sync("a", leases=[(lid, 6, 3)]))  # a heartbeat while b starves: not extended
    assert bed.leases()[lid]["expires_at"] == before
    # The lease ends within ttlMs of its last extension; once b is served, heartbeats extend again.
    await bed.clock.advance(before - bed.now + 1)
    await bed.one(sync("a", leases=[(lid, 6, 6, True)]))  # a stops it (its queue does, R31a)
    (rb,) = await bed.round(request("b", {"g": 1}, leases=[], oldest_at=2))
    assert [x["permits"] for x in rb["leases"]] == [1]  # R28a: at most its need
    lb = rb["leases"][0]["leaseId"]
    await bed.clock.advance(3000)
    await bed.one(sync("b", leases=[(lb, 1, 0)]))
    assert bed.leases()[lb]["expires_at"] == bed.now + TTL
    bed.check()


@async_test
async def test_r31a_the_starving_count_survives_an_eviction():
    bed = Bed(1, leases=REUSE_FIRST)
    (r,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    lid = only(r)["leaseId"]
    await bed.clock.advance(2000)
    (rb,) = await bed.round(request("b", {"g": 1}, oldest_at=2))
    assert blocked(rb) == {"g": ("limit", 1)}
    before = bed.leases()[lid]["expires_at"]
    bed.evict()
    await bed.clock.advance(1000)
    await bed.one(sync("a", leases=[(lid, 1, 0)]))
    assert bed.leases()[lid]["expires_at"] == before  # a fresh instance still knows b starves
    bed.check()


# ====================================================================== R28a
@async_test
async def test_r28a_lease_first_shares_the_budget_as_leases_before_grants_each_at_most_its_need():
    # limit 10, three lease-capable clients and one without leases, all waiting.
    bed = Bed(10, leases={**REUSE_FIRST, "permitsPerLease": 64})
    replies = await bed.round(request("a", {"g": 9}, leases=[], oldest_at=1),
                              request("b", {"g": 2}, leases=[], oldest_at=2),
                              request("c", {"g": 9}, leases=[], oldest_at=3),
                              request("d", {"g": 5}, oldest_at=0))
    ra, rb, rc, rd = replies
    # R28a: budget 10 over 3 candidates -> share 3; b's lease is capped at its need 2.
    assert [x["permits"] for x in ra["leases"]] == [3]
    assert [x["permits"] for x in rb["leases"]] == [2]
    assert [x["permits"] for x in rc["leases"]] == [3]
    # Grants serve what is left (10 - 8 = 2), oldest first: d (oldest_at 0) gets both.
    assert [g["permits"] for g in rd["grants"]] == [2] and ra["grants"] == [] and rc["grants"] == []
    assert await charged(bed) == 10
    assert blocked(ra) == {"g": ("limit", 6)} and blocked(rd) == {"g": ("limit", 3)}
    bed.check()


@async_test
async def test_r28a_without_lease_first_grants_come_first_as_before():
    bed = Bed(10, leases={**REUSE, "permitsPerLease": 64})
    (ra, rb) = await bed.round(request("a", {"g": 9}, leases=[], oldest_at=1),
                               request("b", {"g": 2}, leases=[], oldest_at=2))
    assert [g["permits"] for g in ra["grants"]] == [9] and [g["permits"] for g in rb["grants"]] == [1]
    assert ra["leases"] == [] and rb["leases"] == []
    bed.check()


# ====================================================================== the queue (R34a, R31a)
def world(limit: int, leases: dict, **queue_options):
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=limit, leases=leases)
    net = Net(holder, clock)
    started: list[tuple[str, str]] = []
    sides = {name: ClientSide(name, clock, net, on_admit=lambda s, i: started.append((s.name, i.item_id)),
                              **queue_options) for name in ("c1", "c2")}
    return clock, holder, net, sides, started


def stop_all(sides) -> None:
    for side in sides.values():
        side.driver.kill()


@async_test
async def test_r34a_the_queue_reuses_a_released_slot_at_once_with_no_holder_call():
    clock, holder, net, sides, started = world(2, REUSE_FIRST)
    c1 = sides["c1"].queue
    for i in range(6):
        await c1.enqueue("acct", "g", f"i{i}")
    await clock.advance(1500)
    assert started == [("c1", "i0"), ("c1", "i1")]  # a lease of 2 (the limit)
    sent = len(net.sent)
    for done, nxt in (("i0", "i2"), ("i1", "i3"), ("i2", "i4")):
        await c1.complete(done)
        await clock.advance(1)
        assert started[-1] == ("c1", nxt)  # the freed slot is drawn again at once (R34a)
    assert len(net.sent) == sent  # and no message went to the holder for it
    (lease,) = holder.leases().values()
    assert lease["permits"] == 2 and lease["reusable"] == 1
    stop_all(sides)


@async_test
async def test_r31a_a_contended_key_served_by_a_reusable_lease_asks_again_only_at_its_heartbeat():
    clock, holder, net, sides, started = world(2, REUSE_FIRST)
    c1 = sides["c1"].queue
    for i in range(5):
        await c1.enqueue("acct", "g", f"i{i}")
    await clock.advance(1500)  # the round: a lease of 2, contended (3 wait)
    first = [m for m in net.sent if m["type"] == "request"]
    assert len(first) == 1
    await clock.advance(TTL // 2 - 3000)  # before the heartbeat (half the lifetime)
    assert len([m for m in net.sent if m["type"] == "request"]) == 1  # no request every round
    await clock.advance(4000)  # the heartbeat goes as a request carrying the demand
    later = [m for m in net.sent if m["type"] == "request"]
    assert len(later) == 2 and later[1]["demand"] and later[1]["leases"]
    stop_all(sides)


@async_test
async def test_r31a_an_idle_reusable_lease_is_stopped_and_its_slots_go_back():
    clock, holder, net, sides, started = world(4, REUSE_FIRST)
    c1 = sides["c1"].queue
    await c1.enqueue("acct", "g", "a")
    await clock.advance(1500)
    assert started == [("c1", "a")]
    assert (await holder.usage())["leaseFootprint"] == 1  # R28a: at most its need
    await c1.complete("a")
    await clock.advance(100)  # nothing running, nothing queued: stopped, settled
    u = await holder.usage()
    assert u["leaseFootprint"] == 0 and u["liveLeases"] == 0
    stop_all(sides)


@async_test
async def test_r34a_draws_from_a_reusable_lease_do_not_wait_behind_a_held_request():
    # With request_wait_ms the key's request may be held for seconds; a slot freed meanwhile is
    # drawn again at once (a draw needs no holder, R30), not after the hold.
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, leases=REUSE_FIRST, hold_blocked_ms=10_000)
    net = Net(holder, clock)
    started: list[str] = []
    side = ClientSide("c1", clock, net, on_admit=lambda s, i: started.append(i.item_id), request_wait_ms=10_000)
    for i in range(5):
        await side.queue.enqueue("acct", "g", f"i{i}")
    await clock.advance(1500)
    assert started == ["i0", "i1"]
    await clock.advance(1500)  # the key asks again (held: nothing to give)
    assert side.queue._requesting  # a request is in flight (held at the holder)
    await side.queue.complete("i0")
    await clock.advance(1)
    assert started == ["i0", "i1", "i2"]
    side.driver.kill()


# ====================================================================== storage written by an older release
OLD_HOLDER_LEASES = (
    "CREATE TABLE durability_semaphore_leases ("
    " lease_id TEXT PRIMARY KEY, client_id TEXT NOT NULL, group_name TEXT NOT NULL,"
    " permits INTEGER NOT NULL, drawn INTEGER NOT NULL, released INTEGER NOT NULL,"
    " stopped INTEGER NOT NULL, status TEXT NOT NULL, issued_at INTEGER NOT NULL,"
    " expires_at INTEGER NOT NULL)")
OLD_CLIENT_LEASES = (
    "CREATE TABLE durability_semaphore_client_leases ("
    " key TEXT NOT NULL, lease_id TEXT NOT NULL, group_name TEXT NOT NULL,"
    " permits INTEGER NOT NULL, drawn INTEGER NOT NULL, released INTEGER NOT NULL,"
    " stopped INTEGER NOT NULL, status TEXT NOT NULL, expires_at INTEGER NOT NULL,"
    " heartbeat_at INTEGER NOT NULL, sent_drawn INTEGER NOT NULL, sent_released INTEGER NOT NULL,"
    " sent_stopped INTEGER NOT NULL, updated_at INTEGER NOT NULL,"
    " report_at INTEGER NOT NULL DEFAULT 0,"
    " PRIMARY KEY (key, lease_id))")


def columns(storage, table: str) -> set[str]:
    return {str(r[1]) for r in storage.connection.execute(f"PRAGMA table_info({table})")}


@async_test
async def test_r34a_lease_tables_of_an_older_release_gain_the_reusable_column_and_read_one_shot():
    # R1: the holder's and the client's lease tables, as the release before this one wrote
    # them (no `reusable` column, one lease row each), gain the column on first use; their
    # leases read as one-shot (R34) and keep charging permits - released (R30).
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=10, leases=REUSE)
    holder.storage.connection.execute(OLD_HOLDER_LEASES)
    holder.storage.connection.execute(
        "INSERT INTO durability_semaphore_leases VALUES ('old.1', 'c1', 'g', 4, 2, 1, 0, 'live', ?, ?)", (T0, T0 + TTL))
    side = ClientSide("c1", clock, Net(holder, clock))
    side.storage.connection.execute(OLD_CLIENT_LEASES)
    side.storage.connection.execute("INSERT INTO durability_semaphore_client_leases VALUES"
                                    " ('acct', 'old.1', 'g', 4, 2, 1, 0, 'live', ?, ?, 2, 1, 0, ?, ?)",
                                    (T0 + TTL, T0, T0, T0))
    await holder.usage()
    assert "reusable" in columns(holder.storage, "durability_semaphore_leases")
    assert holder.leases()["old.1"]["reusable"] == 0
    (lease,) = side.client.leases("acct")
    assert "reusable" in columns(side.storage, "durability_semaphore_client_leases")
    assert not lease.reusable and lease.undrawn == 2  # one-shot: 4 - 2 drawn
    side.driver.kill()


@async_test
async def test_r31a_an_entry_can_grant_refuses_does_not_stop_reusable_leases_being_extended():
    # b is refused by can_grant (R22, not_permitted): no lease's end would serve it, so it does
    # not count as starving and a's reports keep extending its reusable lease.
    bed = Bed(3, leases=REUSE_FIRST, can_grant=lambda client, group: client != "b")
    (r,) = await bed.round(request("a", {"g": 5}, leases=[], oldest_at=1))
    lid = only(r)["leaseId"]
    await bed.clock.advance(2000)
    (rb,) = await bed.round(request("b", {"g": 1}, oldest_at=2))
    assert blocked(rb) == {"g": ("not_permitted", 1)}
    await bed.clock.advance(3000)
    await bed.one(sync("a", leases=[(lid, 4, 1)]))
    assert bed.leases()[lid]["expires_at"] == bed.now + TTL
    bed.check()


@async_test
async def test_r34a_the_first_reusable_lease_marks_the_storage_so_an_earlier_release_refuses_it():
    # R1 with R34a: a release that knows only schema v1 would read a reusable lease as one-shot
    # (footprint permits - released) and charge too little; the round that stores the first one
    # writes schema_version 2, which such a release refuses ("newer than this release"), while
    # this one reads it. A storage that never held one stays at v1 (a rollback still works).
    from semaphore.holder import SCHEMA_VERSION
    from semaphore.holder._store import NEWEST_SCHEMA, read_meta

    one_shot = Bed(10, leases={**REUSE, "reusable": False})
    await one_shot.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    assert read_meta(one_shot.sem.storage)["schema_version"] == SCHEMA_VERSION == 1
    bed = Bed(10, leases=REUSE)
    await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    assert read_meta(bed.sem.storage)["schema_version"] == 2 > SCHEMA_VERSION
    assert NEWEST_SCHEMA == 2
    bed.evict()  # a fresh instance of this release opens it
    assert (await bed.usage())["leaseFootprint"] == 3
    bed.check()


@async_test
async def test_r34a_a_slot_reused_beside_a_held_request_sends_no_request_of_its_own():
    # While the key's request is held, a completion frees a slot and the next item is drawn
    # beside it: the demand only went down, so no side request goes (one would cost a holder
    # call per item under a standing backlog; only new demand must not wait out the hold).
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, leases=REUSE_FIRST, hold_blocked_ms=10_000)
    net = Net(holder, clock)
    started: list[str] = []
    side = ClientSide("c1", clock, net, on_admit=lambda s, i: started.append(i.item_id), request_wait_ms=10_000)
    for i in range(6):
        await side.queue.enqueue("acct", "g", f"i{i}")
    await clock.advance(3000)
    assert started == ["i0", "i1"] and side.queue._requesting  # its next request is held
    requests = len([m for m in net.sent if m["type"] == "request"])
    for done, nxt in (("i0", "i2"), ("i1", "i3")):
        await side.queue.complete(done)
        await clock.advance(1)
        assert started[-1] == nxt
    assert len([m for m in net.sent if m["type"] == "request"]) == requests
    side.driver.kill()


# ====================================================================== a storage reset (R32, R33a)
@async_test
async def test_r32_a_reusable_leases_id_says_so_and_a_reset_charges_it_every_slot_whatever_the_option_is_now():
    # R32 decision: a reusable lease's id carries the mark ("3r", signed with the rest), so a
    # holder whose storage was reset with `reusable` turned off still charges every slot of it:
    # x has reused its slots (drawn 40, released 38: 2 running), and `permits - released` would
    # charge nothing. Charged 3, honest gets 10 - 3 = 7.
    from test_leases import APP_SECRET, held

    bed = Bed(10, leases=REUSE_FIRST, lease_secret=APP_SECRET)
    [r] = await bed.round(request("x", {"g": 3}, leases=[]))
    lease = only(r)
    assert lease["reusable"] and lease["leaseId"].split(".")[-2] == "3r"
    bed.reset(leases={**REUSE_FIRST, "reusable": False})
    await bed.clock.advance(2000)
    rx, ry = await bed.round(request("x", {}, leases=[(lease["leaseId"], 40, 38)], oldest_at=0),
                             request("honest", {"g": 10}, oldest_at=1))
    assert only(rx)["status"] == "retired"
    assert held(ry) == 7
    # a one-shot lease's id is unmarked, and verifies and charges as before
    [r] = await bed.round(request("y", {"g": 1}, leases=[]))
    assert "r" not in only(r)["leaseId"].split(".")[-2]
    bed.check()


@async_test
async def test_r33a_after_a_reset_a_client_served_by_a_reusable_lease_stops_drawing_from_it_within_the_bound():
    # R32, R33a (issue 21, a gap): with lease_secret, after a holder storage reset a client
    # served by a reusable lease sent nothing until its heartbeat (15 min at the default ttl),
    # drawing new items all along while the holder gave others the whole limit. Its recheck
    # sync is answered `retired` (the holder does not know the lease): it stops drawing within
    # the bound, and from then on the key runs at most the limit.
    from test_leases import APP_SECRET
    from test_lowered_limits import BOUND_MS, JOB_MS, Load

    config = {**REUSE_FIRST, "ttlMs": LeaseConfig().ttl_ms}
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=3, leases=config, lease_secret=APP_SECRET)
    net = Net(holder, clock)
    first = Load(clock, net, "g")
    await first.enqueue(200)
    await first.run(clock.now + 10_000)
    assert max(n for _, n in first.starts) == 3
    holder.reset()
    reset_at = clock.now
    second = Load(clock, net, "g", name="c2")
    await second.enqueue(200)
    step = 100
    while clock.now < reset_at + 40_000:
        for load in (first, second):
            await load.run(clock.now + step)
        if clock.now > reset_at + BOUND_MS + JOB_MS:
            assert len(first.running) + len(second.running) <= 3, clock.now - reset_at
    assert second.starts  # the newcomer is served
    first.side.driver.kill()
    second.side.driver.kill()
