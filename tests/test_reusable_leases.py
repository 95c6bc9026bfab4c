"""Reusable leases and lease-first sizing (issue 13; SPEC R28a, R30a, R31a, R34a): the options
``reusable`` and ``leaseFirst`` of the holder's ``leases=``, on in the holder's default leases
(``DEFAULT_LEASES``), off in a leases mapping as given.

Holder rules on the SQLite test bed with hand-written messages (the arithmetic next to each
assertion); the queue's side (draw again after a release, no request while a reusable lease
serves a contended key, stop before expiry, draw beside a held request) with the real queue,
client and holder objects on a virtual clock.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from typing import Any

import pytest

from semaphore import ConfigurationError, LeaseConfig
from semaphore.core.client_state import COVER_AFTER_MS
from semaphore.holder._store import read_meta
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


@async_test
async def test_r31a_r23_a_newcomer_the_limit_blocks_starves_though_its_group_limit_is_below_its_need():
    # Limit 3, group "small" limited to 2 (no leases there: exclude, R27). a holds a reusable
    # lease of the whole limit; b asks 3 in "small": the group has room for 2, the account for
    # 0, so the limit stopped it (R23), and the end of a's lease would serve it: it starves
    # (R31a) and a's reports no longer extend the lease.
    bed = Bed(3, group_limit={"small": 2}, leases=REUSE_FIRST)
    (r,) = await bed.round(request("a", {"big": 5}, leases=[], oldest_at=1))
    lid = only(r)["leaseId"]
    assert only(r)["permits"] == 3
    await bed.clock.advance(2000)
    (rb,) = await bed.round(request("b", {"small": 3}, leases=[], oldest_at=2))
    assert rb["grants"] == [] and blocked(rb) == {"small": ("limit", 3)}
    assert read_meta(bed.sem.storage)["starving"] == 1
    before = bed.leases()[lid]["expires_at"]
    await bed.clock.advance(5000)
    await bed.one(sync("a", leases=[(lid, 4, 1)]))
    assert bed.leases()[lid]["expires_at"] == before
    # a stops its lease (its queue does before it expires); b gets what its group allows, and
    # waits for its group, not the limit: a full group starves nobody under exclude.
    await bed.clock.advance(before - bed.now - 500)
    await bed.one(sync("a", leases=[(lid, 6, 6, True)]))
    (rb,) = await bed.round(request("b", {"small": 3}, leases=[], oldest_at=2))
    assert [g["permits"] for g in rb["grants"]] == [2] and blocked(rb) == {"small": ("group_limit", 1)}
    await bed.clock.advance(2000)
    (rc,) = await bed.round(request("c", {"small": 1}, leases=[], oldest_at=3))
    assert rc["grants"] == [] and blocked(rc) == {"small": ("group_limit", 1)}  # room 1, group 0
    assert read_meta(bed.sem.storage)["starving"] == 0
    bed.check()


# ====================================================================== R31b
SHARE = {**REUSE_FIRST, "permitsPerLease": 4}


def states(bed: Bed) -> dict[str, str]:
    return {lid: row["status"] for lid, row in bed.leases().items()}


async def take(bed: Bed, client: str, demand: dict[str, int], oldest_at: int) -> str:
    """``client``'s first request: the one lease its round issues, by id."""
    (r,) = await bed.round(request(client, demand, leases=[], oldest_at=oldest_at))
    return str(only(r)["leaseId"])


async def take_more(bed: Bed, client: str, demand: dict[str, int], held: tuple[str, int], oldest_at: int) -> str:
    """``client`` asks again reporting ``held`` (its lease, every slot drawn, none released):
    the new lease its round issues, by id."""
    (r,) = await bed.round(request(client, demand, leases=[(held[0], held[1], 0)], oldest_at=oldest_at))
    return str(next(x["leaseId"] for x in r["leases"] if x["leaseId"] != held[0]))


async def starve(bed: Bed, client: str, group: str, oldest_at: int) -> None:
    """``client`` asks 1 in ``group`` and gets nothing: the limit blocks it (R31a: starving)."""
    (r,) = await bed.round(request(client, {group: 1}, leases=[], oldest_at=oldest_at))
    assert r["grants"] == [] and r["leases"] == [] and blocked(r) == {group: ("limit", 1)}


@async_test
async def test_r31a_a_blocked_entry_starves_unless_its_client_holds_a_live_lease_in_its_group():
    # R31a: a, whose live lease holds the whole limit, asks for more and is blocked: it draws
    # from a lease, so it is served (not starving). Once that lease is retired (a lowered
    # limit, R33) it no longer serves a: a blocked again starves.
    limit = {"value": 4}
    bed = Bed(lambda: limit["value"], leases=SHARE)
    lid = await take(bed, "a", {"g": 9}, 1)
    await bed.clock.advance(2000)
    (r,) = await bed.round(request("a", {"g": 9}, leases=[(lid, 4, 0)], oldest_at=1))
    assert r["grants"] == [] and blocked(r) == {"g": ("limit", 9)}
    assert read_meta(bed.sem.storage).get("starving", 0) == 0
    limit["value"] = 3  # lowered: every live lease is retired at the next round (R33)
    await bed.clock.advance(2000)
    (r,) = await bed.round(request("a", {"g": 9}, leases=[(lid, 4, 0)], oldest_at=1))
    assert states(bed) == {lid: "retired"} and r["grants"] == []
    assert [x["status"] for x in r["leases"]] == ["retired"]  # its own, answered retired
    assert read_meta(bed.sem.storage)["starving"] == 1
    bed.check()


@async_test
async def test_r31b_while_a_request_starves_a_reusable_lease_above_the_fair_share_is_retired_at_its_report():
    # Limit 4: a's reusable lease holds all 4; b asks 1 and gets nothing (starving 1, R31a).
    # Fair share = max(1, 4 // (1 live lease + 1 starving)) = 2 < 4: a's next report is
    # answered `retired` (R31b), not at ttlMs (R31). The lease keeps every slot charged until
    # a's stop report (R30a), then charges what still runs, and b is served from what frees.
    bed = Bed(4, leases=SHARE)
    lid = await take(bed, "a", {"g": 9}, 1)
    assert bed.leases()[lid]["permits"] == 4
    await bed.clock.advance(2000)
    await starve(bed, "b", "g", 2)
    bed.evict()  # the share is not lost with the instance (recomputed from meta)
    await bed.clock.advance(1000)
    reply = await bed.one(sync("a", leases=[(lid, 6, 2)]))
    assert only(reply)["status"] == "retired" and states(bed) == {lid: "retired"}
    assert await charged(bed) == 4  # R30a: every slot until the stop report
    await bed.one(sync("a", leases=[(lid, 6, 3, True)]))
    assert await charged(bed) == 3  # min(4, 6 - 3): what still runs
    await bed.clock.advance(1000)
    (rb,) = await bed.round(request("b", {"g": 1}, leases=[], oldest_at=2))
    assert [x["permits"] for x in rb["leases"]] == [1]
    bed.check()


@async_test
async def test_r31b_only_the_leases_above_the_share_are_retired_the_largest_first():
    # Limit 6. a holds a reusable lease of 1; c holds two, of 4 then 1 (its second round's,
    # R26: every slot of the first busy); b asks and starves. Live leases 3, starving 1:
    # share = max(1, 6 // 4) = 1. a's 1 is within it and stays live; of c's 5, the 4 goes
    # (5 - 4 = 1 left, within the share) and the 1 stays.
    bed = Bed(6, leases=SHARE)
    la = await take(bed, "a", {"g": 1}, 1)
    await bed.clock.advance(2000)
    big = await take(bed, "c", {"g": 4}, 2)
    await bed.clock.advance(2000)
    small = await take_more(bed, "c", {"g": 5}, (big, 4), 2)
    assert bed.leases()[small]["permits"] == 1 and await charged(bed) == 6
    await bed.clock.advance(2000)
    await starve(bed, "b", "g", 3)
    await bed.clock.advance(1000)
    ra = await bed.one(sync("a", leases=[(la, 3, 2)]))
    assert only(ra)["status"] == "live"
    rc = await bed.one(sync("c", leases=[(big, 4, 0), (small, 1, 0)]))
    assert {x["leaseId"]: x["status"] for x in rc["leases"]} == {big: "retired", small: "live"}
    bed.check()


@async_test
async def test_r31b_nothing_is_retired_while_nothing_starves():
    # Limit 4: a's lease of 3 and c's of 1 fill it, and nobody waits. a holds more than an
    # even split (2), but no request starves: its report extends the lease (R31), retires nothing.
    bed = Bed(4, leases=SHARE)
    lid = await take(bed, "a", {"g": 3}, 1)
    await bed.clock.advance(2000)
    (rc,) = await bed.round(request("c", {"g": 1}, leases=[], oldest_at=2))
    assert only(rc)["permits"] == 1 and await charged(bed) == 4
    await bed.clock.advance(3000)
    reply = await bed.one(sync("a", leases=[(lid, 6, 2)]))
    assert only(reply)["status"] == "live" and bed.leases()[lid]["expires_at"] == bed.now + TTL
    bed.check()


@pytest.mark.parametrize("evicted", [False, True], ids=["same_instance", "fresh_instance"])
@async_test
async def test_r31b_the_share_is_the_last_rounds_whether_or_not_the_holder_was_evicted(evicted: bool):
    # Limit 12: a holds 7, c 5, b starves: share = 12 // (2 live + 1 starving) = 4, stored by
    # the round (meta lease_share). a's sync retires a's lease (7 > 4); c's 5 > 4 is retired
    # too, by the same instance or a fresh one: the share is the round's, not recounted after
    # a sync retired a lease (which would give 12 // 2 = 6 and keep c's).
    bed = Bed(12, leases={**SHARE, "permitsPerLease": 8})
    la = await take(bed, "a", {"g": 7}, 1)
    await bed.clock.advance(2000)
    lc = await take(bed, "c", {"g": 5}, 2)
    await bed.clock.advance(2000)
    await starve(bed, "b", "g", 3)
    assert read_meta(bed.sem.storage)["lease_share"] == 4
    await bed.clock.advance(500)
    assert only(await bed.one(sync("a", leases=[(la, 7, 0)])))["status"] == "retired"
    if evicted:
        bed.evict()
    assert only(await bed.one(sync("c", leases=[(lc, 5, 0)])))["status"] == "retired"
    bed.check()


@async_test
async def test_r31b_a_report_inside_a_round_is_judged_too_and_one_shot_leases_never_are():
    # Limit 4, a's reusable lease of 4; b starves (share 2). a's next
    # request reports the lease: its round answers it retired (the round's own reports, R31b).
    bed = Bed(4, leases=SHARE)
    lid = await take(bed, "a", {"g": 9}, 1)
    await bed.clock.advance(2000)
    await starve(bed, "b", "g", 2)
    await bed.clock.advance(2000)
    (r,) = await bed.round(request("a", {"g": 9}, leases=[(lid, 5, 1)], oldest_at=1))
    assert {x["leaseId"]: x["status"] for x in r["leases"]}[lid] == "retired"
    # The same with one-shot leases: never retired so (they end by themselves).
    bed = Bed(4, leases={**SHARE, "reusable": False})
    lid = await take(bed, "a", {"g": 9}, 1)
    await bed.clock.advance(2000)
    await starve(bed, "b", "g", 2)
    await bed.clock.advance(1000)
    assert only(await bed.one(sync("a", leases=[(lid, 2, 1)])))["status"] == "live"
    bed.check()


@async_test
async def test_r31b_an_entry_its_group_limit_blocks_retires_no_lease_in_another_group():
    # Limit 10, group g1 limited to 2 (withinGroupLimit): c's lease holds g1's 2; b asks 1 in
    # g1 and starves on the group limit (R31a counts it). a's lease of 6 in g2 could never
    # serve b: it stays live at a's report (before, it was retired at every report).
    bed = Bed(10, leases={**SHARE, "permitsPerLease": 8, "limitedGroups": "withinGroupLimit"},
              group_limit={"g1": 2})
    (rc,) = await bed.round(request("c", {"g1": 2}, leases=[], oldest_at=1))
    assert only(rc)["permits"] == 2
    await bed.clock.advance(2000)
    la = await take(bed, "a", {"g2": 6}, 2)
    await bed.clock.advance(2000)
    (rb,) = await bed.round(request("b", {"g1": 1}, leases=[], oldest_at=3))
    assert blocked(rb) == {"g1": ("group_limit", 1)} and read_meta(bed.sem.storage)["starving"] == 1
    await bed.clock.advance(500)
    assert only(await bed.one(sync("a", leases=[(la, 6, 6)])))["status"] == "live"
    bed.check()


@async_test
async def test_r31b_a_lease_stopped_in_the_same_message_does_not_count_and_ties_retire_the_later_one():
    # Limit 12: a holds x (2) then y (3), c holds 7; b starves: share = 12 // (3 + 1) = 3.
    # a stops x in the message that reports y: y alone is within the share and stays live.
    bed = Bed(12, leases={**SHARE, "permitsPerLease": 8})
    x = await take(bed, "a", {"g": 2}, 1)
    await bed.clock.advance(2000)
    y = await take_more(bed, "a", {"g": 3}, (x, 2), 1)
    await bed.clock.advance(2000)
    await bed.round(request("c", {"g": 7}, leases=[], oldest_at=2))
    await bed.clock.advance(2000)
    await starve(bed, "b", "g", 3)
    assert await charged(bed) == 12
    await bed.clock.advance(500)
    r = await bed.one(sync("a", leases=[(x, 2, 1, True), (y, 0, 0)]))
    assert {v["leaseId"]: v["status"] for v in r["leases"]} == {x: "retired", y: "live"}
    # Ties: d holds two leases of 2 and e a grant of 2 (limit 6); f starves: share =
    # 6 // (2 live + 1 starving) = 2. Of d's equal leases the later issued goes.
    bed = Bed(6, leases={**SHARE, "permitsPerLease": 2})
    first = await take(bed, "d", {"g": 2}, 1)
    await bed.clock.advance(2000)
    second = await take_more(bed, "d", {"g": 2}, (first, 2), 1)
    await bed.clock.advance(2000)
    (re_,) = await bed.round(request("e", {"g": 2}, oldest_at=2))
    assert [g["permits"] for g in re_["grants"]] == [2] and re_["leases"] == [], (re_, bed.leases())
    await bed.clock.advance(2000)
    await starve(bed, "f", "g", 3)
    assert read_meta(bed.sem.storage)["lease_share"] == 2
    await bed.clock.advance(500)
    r = await bed.one(sync("d", leases=[(first, 2, 0), (second, 2, 0)]))
    assert {v["leaseId"]: v["status"] for v in r["leases"]} == {first: "live", second: "retired"}
    bed.check()


@async_test
async def test_r31b_through_the_queue_a_newcomer_behind_a_reusable_lease_of_the_whole_limit_starts_within_seconds():
    # a's queue keeps more work than the limit and holds the whole limit (3) as one reusable
    # lease with the default lifetime (30 min); b's queue asks for one item. b starves, a's
    # next recheck (recheckMs) hears `retired` (R31b), and b's item starts once one of a's
    # 1 s items ends. Before, it waited for a's lease to end: the whole ttlMs.
    clock, a, b, starts = backlog(3, {**SHARE, "ttlMs": 1_800_000}, {})
    feeder = asyncio.ensure_future(keep_busy(clock, a.queue, "g"))
    await clock.advance(3000)
    asked = clock.now
    await b.queue.enqueue("acct", "g", "b0")
    await clock.advance(15_000)
    assert "b0" in starts and starts["b0"] - asked <= 15_000, starts.get("b0")
    await clock.advance(10_000)
    assert len([i for i in starts if i.startswith("a") and starts[i] > asked + 15_000]) > 5  # a runs on
    feeder.cancel()
    stop_all({"a": a, "b": b})


# ====================================================================== R34a room
async def _full_with_a_grant(leases: dict, **options: Any) -> tuple[Bed, str, str]:
    """Limit 4: ``b`` (no leases, oldest) holds a claimed grant of 1 and ``a`` a lease of 3, with
    more need unserved: nothing free, the round was contended (R29)."""
    bed = Bed(4, leases=leases, **options)
    (ra, rb) = await bed.round(request("a", {"g": 5}, leases=[], oldest_at=2), request("b", {"g": 1}, oldest_at=1))
    assert ra["contended"] and len(ra["leases"]) == 1 and ra["leases"][0]["permits"] == 3
    (grant,) = rb["grants"]
    await bed.one(sync("b", grants=[(grant["grantId"], 1, 0)]))
    return bed, only(ra)["leaseId"], grant["grantId"]


@async_test
async def test_r34a_a_sync_says_room_once_capacity_frees_while_nobody_waits_until_the_next_round():
    bed, lid, gid = await _full_with_a_grant(REUSE_FIRST)
    assert "room" not in await bed.one(sync("a", leases=[(lid, 3, 0)]))  # nothing freed yet
    freeing = await bed.one(sync("b", grants=[(gid, 1, 1)]))  # b's release frees 1
    assert freeing.get("room") is True and freeing["contended"] is True  # R29 unchanged
    assert (await bed.one(sync("a", leases=[(lid, 4, 1)]))).get("room") is True
    await bed.round(request("a", {"g": 5}, leases=[(lid, 4, 1)], oldest_at=1))  # a round takes it
    assert "room" not in await bed.one(sync("a", leases=[(lid, 4, 1)]))
    bed.check()


@async_test
async def test_r34a_no_room_without_reusable_leases_nor_while_a_request_waits_at_the_holder():
    bed, lid, gid = await _full_with_a_grant({**REUSE_FIRST, "reusable": False})
    assert "room" not in await bed.one(sync("b", grants=[(gid, 1, 1)]))  # one-shot leases: asked anyway
    bed, lid, gid = await _full_with_a_grant(REUSE_FIRST, hold_blocked_ms=10_000)
    held = bed.send(request("c", {"g": 2}, oldest_at=3))  # blocked, held open (R9 held requests)
    await bed.settle()
    assert not held.done()
    freeing = await bed.one(sync("b", grants=[(gid, 1, 1)]))
    assert "room" not in freeing  # the held request takes what frees, in the round it starts
    (reply,) = await bed.finish(held)
    assert reply["grants"] and reply["grants"][0]["permits"] == 1


# ====================================================================== R28a
@async_test
async def test_r28a_lease_first_shares_the_budget_as_leases_before_grants_each_at_most_its_need():
    # limit 10, three lease-capable clients and a younger one without leases, all waiting.
    bed = Bed(10, leases={**REUSE_FIRST, "permitsPerLease": 64})
    replies = await bed.round(request("a", {"g": 9}, leases=[], oldest_at=1),
                              request("b", {"g": 2}, leases=[], oldest_at=2),
                              request("c", {"g": 9}, leases=[], oldest_at=3),
                              request("d", {"g": 5}, oldest_at=4))
    ra, rb, rc, rd = replies
    # R28a: budget 10 over 3 candidates -> share 3; b's lease is capped at its need 2.
    assert [x["permits"] for x in ra["leases"]] == [3]
    assert [x["permits"] for x in rb["leases"]] == [2]
    assert [x["permits"] for x in rc["leases"]] == [3]
    # Grants serve what is left (10 - 8 = 2), oldest first: a's remaining need (oldest_at 1)
    # gets both; d, younger than every lease, waits.
    assert [g["permits"] for g in ra["grants"]] == [2] and rd["grants"] == [] and rc["grants"] == []
    assert await charged(bed) == 10
    assert blocked(ra) == {"g": ("limit", 4)} and blocked(rd) == {"g": ("limit", 5)}
    bed.check()


@async_test
async def test_r28a_a_lease_takes_only_what_older_entries_that_cannot_take_one_leave():
    # R28a with R21: d (no leases, R5) is older than every candidate, so it is served its grant
    # before their leases are sized; c (no leases) is older than b and is served before b's
    # lease; e (no leases) is younger than b, the last lease, and waits behind the leases as
    # before. Limit 12, two candidates (a, b): share min(64, 12 // 2) = 6.
    bed = Bed(12, leases={**REUSE_FIRST, "permitsPerLease": 64})
    ra, rb, rc, rd, re = await bed.round(request("a", {"g": 9}, leases=[], oldest_at=1),
                                         request("b", {"g": 9}, leases=[], oldest_at=3),
                                         request("c", {"g": 1}, oldest_at=2),
                                         request("d", {"g": 4}, oldest_at=0),
                                         request("e", {"g": 4}, oldest_at=4))
    # d: a grant of 4 (room 12 -> 8); a: a lease of 6 (-> 2); c: a grant of 1 (-> 1);
    # b: a lease of min(6, 1) = 1; then grants from nothing: a's 3, b's 8 and e's 4 wait.
    assert [g["permits"] for g in rd["grants"]] == [4] and rd["leases"] == []
    assert [x["permits"] for x in ra["leases"]] == [6] and ra["grants"] == []
    assert [g["permits"] for g in rc["grants"]] == [1]
    assert [x["permits"] for x in rb["leases"]] == [1] and rb["grants"] == []
    assert re["grants"] == [] and blocked(re) == {"g": ("limit", 4)}
    assert blocked(ra) == {"g": ("limit", 3)} and blocked(rb) == {"g": ("limit", 8)}
    assert await charged(bed) == 12
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


async def _own_backlog(leases: dict):
    """One client, limit 2, five items: the round gives it a reusable lease of 2 and answers
    contended (3 wait), so its demand is covered by its own busy lease (R34a)."""
    clock, holder, net, sides, started = world(2, leases)
    for i in range(5):
        await sides["c1"].queue.enqueue("acct", "g", f"i{i}")
    await clock.advance(1500)
    return clock, net, sides


@async_test
async def test_r31a_a_contended_key_served_by_a_reusable_lease_asks_while_its_demand_is_young_then_only_at_its_heartbeat():
    # With the recheck off (recheckMs 0) the cover lasts until the lease's heartbeat.
    # Young demand in a young contention is not covered (R34a decision): until COVER_AFTER_MS
    # into it the demand goes to each round (requests at 1 s and 2 s here, each at its
    # nextRequestAt).
    clock, net, sides = await _own_backlog({**REUSE_FIRST, "recheckMs": 0})

    def requests() -> list[dict]:
        return [m for m in net.sent if m["type"] == "request"]

    assert len(requests()) == 2  # at once, and at 1 s
    await clock.advance(COVER_AFTER_MS)
    assert len(requests()) == 3  # and at 2 s
    await clock.advance(TTL // 2 - 3000 - COVER_AFTER_MS)  # before the heartbeat (half the lifetime)
    assert len(requests()) == 3  # covered since: no request every round
    await clock.advance(4000)  # the heartbeat goes as a request carrying the demand
    later = requests()
    assert len(later) == 4 and later[3]["demand"] and later[3]["leases"]
    stop_all(sides)


@async_test
async def test_r34a_a_contended_key_covered_by_a_busy_reusable_lease_checks_for_room_backing_off_to_the_recheck():
    # R34a decision (the room check), R33a: while a busy reusable lease covers the demand (it
    # does not go to rounds), the queue still asks the holder whether capacity was freed (a
    # sync; its reply says room) after as long as the key had been contended (4, 8, 16, 32 s
    # in), at most leaseRecheckMs (30 s here) apart. Before, it heard nothing until the
    # lease's heartbeat (5 min here). The contention and the demand are young until 3 s in
    # (R34a decision): at 1 s and 2 s the demand goes in requests, not room checks (one at 2 s
    # before that decision).
    clock, net, sides = await _own_backlog({**REUSE_FIRST, "recheckMs": 30_000, "ttlMs": 600_000})
    t0 = clock.now - 1500  # the request went at once (R9a); its reply was contended (3 wait)

    def syncs() -> int:
        return sum(1 for m in net.sent if m["type"] == "sync")

    expected = [(1_900, 0), (3_900, 0), (4_100, 1), (7_900, 1), (8_100, 2), (15_900, 2),
                (16_100, 3), (31_900, 3), (32_100, 4), (61_900, 4), (62_100, 5)]
    for at, count in expected:
        await clock.advance(t0 + at - clock.now)
        assert syncs() == count, (at, syncs())
    assert all(m["leases"] for m in net.sent if m["type"] == "sync")
    assert [m["type"] for m in net.sent].count("request") == 3  # at once and the young contention's; no room freed
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
async def test_r34a_the_schema_mark_is_written_once_not_by_every_round():
    # R34a, R1: once the storage is marked (schema_version 2), later rounds that store reusable
    # leases do not write the mark again (a round's writes grow with its work, not with every
    # round: an UPSERT of the same value each round would be a statement for nothing)
    bed = Bed(10, leases=REUSE)
    await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    sql = bed.storage.sql
    inner = sql.exec
    marks: list[str] = []

    def counted(query: str, *bindings: Any) -> Any:
        if "schema_version" in query or any("schema_version" in str(b) for b in bindings):
            marks.append(query)
        return inner(query, *bindings)

    sql.exec = counted
    try:
        await bed.round(request("b", {"g": 1}, leases=[], oldest_at=2))
    finally:
        sql.exec = inner
    assert len(bed.leases()) == 2 and marks == []
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


# --- Reusable leases: draws beside requests, heartbeats, fairness, resets ----------------------
# Review of the reusable-lease / lease-first change (SPEC R28a, R30a, R31a, R34a), by a cold
# review (helper session) of 6707a92.
#
# One test per finding; each FAILED on the reviewed snapshot and says in its docstring what was
# wrong and why it matters. They use only the public test kit (real holder, client and queue
# objects on a virtual clock; nothing of the library is mocked or patched). All pass on the fix
# (one was a strict xfail until the room check of R34a came).


def _stop(*sides: ClientSide) -> None:
    for side in sides:
        side.driver.kill()


async def _until(clock: SimClock, cond, step_ms: int = 50, within_ms: int = 10_000) -> None:
    for _ in range(within_ms // step_ms):
        if cond():
            return
        await clock.advance(step_ms)
    assert cond(), "condition never held"


# ====================================================================== 1. callbacks run twice
@async_test
async def test_sync_work_of_items_drawn_beside_a_request_runs_once_each():
    """HIGH. ``complete()`` of an item while the key's request is in flight calls
    ``_draw_beside_request`` -> ``_run_callbacks``. With a synchronous ``work=`` function the
    callback completes its item inside ``_run_callbacks`` (``_complete_logged`` ->
    ``complete``), which draws beside the request again and runs a NESTED ``_run_callbacks``
    over the same rows. When the nested call returns, the outer loop carries on with its stale
    row list (``r["attempts"] == 0``) and calls ``work`` again for items the nested call already
    ran and completed: their permits are released, so the second run is UNCHARGED (the
    application runs more than the limit) and ``work`` runs twice per item, breaking the
    queue's "never a second call while one ran / never under a second permit" contract. With a
    few hundred queued items the nesting also hits ``RecursionError`` (one nesting level per
    completed item; seen with 400 items: 979 calls for 400 items, then RecursionError logged).

    Reach: any key with a live lease (reusable or not) whose request for ANOTHER group is in
    flight when a permit/item of the leased group completes."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=6, leases={**REUSE_FIRST, "permitsPerLease": 4, "ttlMs": 60_000},
                        group_limit=lambda g: 0 if g == "h" else None)
    net = Net(holder, clock)
    calls: Counter[str] = Counter()
    side = ClientSide("c1", clock, net, work=lambda item: calls.update([item.item_id]))
    q = side.queue
    events = [asyncio.Event() for _ in range(4)]

    async def hold(ev: asyncio.Event) -> None:
        async with q.permit("acct", "g"):
            await ev.wait()

    holders = [asyncio.ensure_future(hold(ev)) for ev in events]
    await clock.advance(1500)  # one round: a reusable lease of 4 in g, all 4 slots held
    (lease,) = side.client.leases("acct")
    assert lease.permits == 4 and lease.reusable
    for ev in events[1:]:
        ev.set()
    await clock.advance(10)  # 3 slots free again, 1 still held (the lease stays live)
    await q.enqueue("acct", "h", "h0")  # group h (limit 0): the key asks a round for it
    await _until(clock, lambda: "acct" in q._requesting)
    for i in range(3):
        await q.enqueue("acct", "g", f"b{i}")  # queued in g while the request waits
    events[0].set()  # a permit of g completes beside the request: draws b0..b2 beside it
    await clock.advance(5)
    await clock.advance(3000)
    assert set(calls) == {"b0", "b1", "b2"}
    assert dict(calls) == {"b0": 1, "b1": 1, "b2": 1}, f"work called more than once per item: {dict(calls)}"
    for t in holders:
        t.cancel()
    _stop(side)


# ====================================================================== 2. heartbeat sync storm
@async_test
async def test_a_heartbeat_the_holder_did_not_extend_does_not_turn_into_a_sync_storm():
    """HIGH (load). While meta ``starving`` > 0 the holder does not move a reusable lease's
    ``expiresAt`` (R31a), so the reply to its heartbeat carries the same ``expiresAt`` and
    ``merge_lease`` keeps the old ``heartbeat_at``, which is already past. ``heartbeat_due``
    stays true, ``next_wake`` asks for the key at once, and ``plan_exchange`` sends a SYNC every
    time it may not send a request: 8 syncs per pump, a 1 s backoff, again, until the lease is
    within ``lease_margin_ms`` of its expiry. Measured here (ttl 20 s): 60 syncs in 8 s from one
    client; with the default ``ttlMs`` (30 min) that is ~7,000+ useless holder transactions per
    lease per half-lifetime, exactly when the key is contended. One heartbeat per lifetime
    half (or per round period) is what the protocol needs."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, leases=REUSE_FIRST)
    net = Net(holder, clock)
    c1 = ClientSide("c1", clock, net, on_admit=lambda s, i: None)  # items run until the test ends
    c2 = ClientSide("c2", clock, net, on_admit=lambda s, i: None)
    for i in range(5):
        await c1.queue.enqueue("acct", "g", f"i{i}")
    await clock.advance(1500)  # c1: a reusable lease of 2 (the limit), 3 more queued
    await c2.queue.enqueue("acct", "g", "b0")
    await clock.advance(3000)  # c2 asked and got nothing: starving = 1
    (row,) = holder.leases().values()
    expires = row["expires_at"]
    heartbeat_at = c1.client.leases("acct")[0].heartbeat_at
    await clock.advance(heartbeat_at - clock.now + 1)
    start = len(net.sent)
    await clock.advance(expires - 2000 - clock.now)  # ~8 s, up to shortly before the stop
    syncs = sum(1 for m in net.sent[start:] if m["clientId"] == "c1" and m["type"] == "sync")
    assert syncs <= 8, f"c1 sent {syncs} syncs in {(expires - 2000 - heartbeat_at) // 1000} s for one lease heartbeat"
    _stop(c1, c2)


# ====================================================================== 3. starving counts the unservable
@async_test
async def test_a_client_refused_by_can_grant_does_not_stop_every_reusable_lease_from_being_extended():
    """MEDIUM. ``_starving`` counts every blocked entry without a live lease, whatever the
    reason: ``not_permitted`` (canGrant false), ``limit_resolution_error`` and ``group_limit``
    of an excluded group too. Ending reusable leases can never serve such an entry, yet while
    one exists no reusable lease of ANY client is extended (R31a): a single tenant that
    canGrant refuses, whose queue asks every round, makes every reusable lease in the key churn
    every ``ttlMs`` (stop, drain, new round) and triggers finding 2's sync storm, forever, with
    capacity idle. Here the limit has 2 free permits, only ``x`` (refused) waits, and ``a``'s
    heartbeat is not extended."""
    bed = Bed(4, leases=REUSE_FIRST, can_grant=lambda client, group: client != "x")
    (ra,) = await bed.round(request("a", {"g": 2}, leases=[], oldest_at=1))
    (lease,) = ra["leases"]
    lid = lease["leaseId"]
    await bed.clock.advance(2000)
    (rx,) = await bed.round(request("x", {"g": 1}, leases=[], oldest_at=2))
    assert blocked(rx) == {"g": ("not_permitted", 1)}
    await bed.clock.advance(3000)
    await bed.one(sync("a", leases=[(lid, 5, 3)]))  # a's heartbeat (2 slots busy)
    assert bed.leases()[lid]["expires_at"] == bed.now + TTL, \
        "a's reusable lease was not extended although the only waiting entry can never be served by its end"


# ====================================================================== 4. idle capacity
@async_test
async def test_capacity_freed_elsewhere_reaches_a_contended_key_covered_by_a_reusable_lease():
    """MEDIUM (liveness / utilisation; the behaviour R31a's last sentences prescribe). While
    the key's last reply was ``contended``, ``covered_groups`` keeps the queue from asking for
    the demand of a group its active reusable lease serves until that lease's heartbeat (half
    its lifetime). The key is contended by its OWN backlog, so when capacity frees elsewhere
    nobody asks for it: here 3 of 4 permits sit idle from the moment ``b`` reports its releases
    until ``a``'s heartbeat ~17 s later (ttl 60 s); with the default ``ttlMs`` of 30 min, up to
    15 min of idle capacity while work waits. Without ``reusable`` the queue asks every round
    and takes them within one round period.

    Kept as a strict xfail (a documented trade-off) until the room check (R34a): once the
    key's last reply is older than the holder's ``leaseRecheckMs`` (4 s here) the queue syncs,
    the reply says ``room``, and the covered demand goes in a request whose round takes the
    freed permits. It failed before: 1 of 4 running after 6 s."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=4, leases={**REUSE_FIRST, "permitsPerLease": 8, "ttlMs": 60_000})
    net = Net(holder, clock)
    running: dict[str, set[str]] = {"a": set(), "b": set()}
    a = ClientSide("a", clock, net, on_admit=lambda s, i: running["a"].add(i.item_id))
    b = ClientSide("b", clock, net, on_admit=lambda s, i: running["b"].add(i.item_id), leases=False,
                   report_releases_within_ms=0)
    for i in range(3):
        await b.queue.enqueue("acct", "g", f"b{i}")
    await clock.advance(1500)
    assert len(running["b"]) == 3
    for i in range(10):
        await a.queue.enqueue("acct", "g", f"a{i}")
    await clock.advance(2500)
    assert len(running["a"]) == 1  # a reusable lease of 1 (what was left); a's key is contended
    for item in sorted(running["b"]):
        await b.queue.complete(item)
    await clock.advance(1000)
    u = await holder.usage()
    assert u["outstanding"] == 0, u  # b's releases reached the holder: 3 permits free
    await clock.advance(6000)  # three round periods
    u = await holder.usage()
    assert len(running["a"]) >= 3, (f"{u['limit'] - u['charged']} of {u['limit']} permits idle for 6 s while a has"
                                    f" {10 - len(running['a'])} items queued")
    _stop(a, b)


# ====================================================================== 5. reply of an older holder
def _strip_reusable(reply: dict[str, Any]) -> dict[str, Any]:
    for x in reply.get("leases", []) or []:
        x.pop("reusable", None)
    return reply


@async_test
async def test_a_lease_the_holder_no_longer_calls_reusable_is_not_reused_by_the_client():
    """MEDIUM (compatibility: a holder rolled back to the previous release). ``merge_lease``
    keeps ``local.reusable`` for a lease it knows and ignores the reply's (absent) ``reusable``
    field, and the holder's schema version was not bumped when the ``reusable`` column came,
    so the previous release opens storage holding reusable leases without complaint and reads
    them as one-shot: footprint ``permits - released`` (R30), drawn clamped to permits. The
    upgraded client goes on reusing released slots of a lease the holder no longer charges:
    here (limit 2) the client runs 2 items under a lease whose footprint the holder has
    dropped to 0, and the holder admits 2 more elsewhere: 4 running above a limit of 2 (I1).
    The older holder is emulated faithfully for what it does with such a row: replies without
    ``reusable`` and the row read as one-shot (its ``reusable`` column ignored, i.e. 0)."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, leases={**REUSE_FIRST, "permitsPerLease": 2, "ttlMs": 60_000})
    rolled_back = {"on": False}

    async def transport(message: dict[str, Any]) -> dict[str, Any]:
        reply = await holder.handle(message)
        return _strip_reusable(reply) if rolled_back["on"] else reply

    net = Net(transport, clock)
    running: set[str] = set()
    c1 = ClientSide("c1", clock, net, on_admit=lambda s, i: running.add(i.item_id), report_releases_within_ms=0)
    c2 = ClientSide("c2", clock, net, on_admit=lambda s, i: running.add(i.item_id))
    for i in range(2):
        await c1.queue.enqueue("acct", "g", f"a{i}")
    await clock.advance(1500)
    assert running == {"a0", "a1"}
    (lease,) = c1.client.leases("acct")
    assert lease.reusable and lease.permits == 2
    # The holder object is rolled back to the previous release (no `reusable` anywhere).
    rolled_back["on"] = True
    holder.storage.connection.execute("UPDATE durability_semaphore_leases SET reusable = 0")
    holder.evict()
    await c1.client.sync("acct")  # a reply of the older holder (no `reusable` field)
    for item in ("a0", "a1"):
        await c1.queue.complete(item)
        running.discard(item)
    await c1.client.sync("acct")  # the releases reach the older holder: footprint 2 - 2 = 0
    for i in range(2, 4):
        await c1.queue.enqueue("acct", "g", f"a{i}")  # drawn again from the "reusable" slots
    await clock.advance(100)
    for i in range(2):
        await c2.queue.enqueue("acct", "g", f"c{i}")
    await clock.advance(5000)
    assert len(running) <= 2, f"{sorted(running)} run at once under a limit of 2"
    _stop(c1, c2)


# ====================================================================== 6. R32 charge vs draws beside a request
@async_test
async def test_after_a_storage_reset_draws_beside_the_request_are_charged_by_its_round():
    """MEDIUM-LOW (needs a holder storage reset; with ``lease_secret``, the configuration in
    which R32 promises to charge work still running under leases issued before the reset).
    The round charges an unknown lease ``min(drawn - released, id permits)`` FROM THE REPORT
    its request carried. The new ``_draw_beside_request`` (``complete()`` while the key's
    request waits for its round) draws further items from that same lease after the report
    left, before the client hears ``retired``: the round admits others on top of them. Here
    (limit 4): the request reports 2 running, 2 more are drawn beside it, the round gives
    another client 2, and 5 run at once. This change makes such draws routine: the pump's
    early return and every ``complete()`` during a request now draw beside it (only a new
    ``permit()`` did before). R30a itself says the holder cannot learn from the counts of a
    live reusable lease what runs under it, yet R32 charges exactly those counts."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=4, leases={**REUSE_FIRST, "permitsPerLease": 4, "ttlMs": 60_000},
                        lease_secret="app-secret-0123456789abcdef", group_limit=lambda g: 0 if g == "h" else None)
    net = Net(holder, clock)
    running: set[str] = set()
    c1 = ClientSide("c1", clock, net, on_admit=lambda s, i: running.add(i.item_id))
    c2 = ClientSide("c2", clock, net, on_admit=lambda s, i: running.add(i.item_id))
    q = c1.queue
    events = [asyncio.Event() for _ in range(4)]
    inside: set[int] = set()

    async def hold(n: int, ev: asyncio.Event) -> None:
        async with q.permit("acct", "g"):
            inside.add(n)
            await ev.wait()
            inside.discard(n)

    holders = [asyncio.ensure_future(hold(n, ev)) for n, ev in enumerate(events)]
    await clock.advance(1500)  # a reusable lease of 4, all 4 slots held
    assert inside == {0, 1, 2, 3}
    events[0].set()
    events[1].set()
    await clock.advance(10)  # 2 still run under it
    holder.reset()  # migrate(None): the holder forgets the lease; lease_secret keeps its id verifiable
    await q.enqueue("acct", "h", "h0")  # c1 asks a round (its report: 2 running under the lease)
    for i in range(4):
        await c2.queue.enqueue("acct", "g", f"c{i}")
    await _until(clock, lambda: "acct" in q._requesting, step_ms=20)
    await q.enqueue("acct", "g", "x0")
    await q.enqueue("acct", "g", "x1")
    events[2].set()  # complete() beside the request: x0 and x1 are drawn from the unknown lease
    await clock.advance(3000)
    total = len(inside) + len(running)
    assert total <= 4, f"{total} run at once under a limit of 4: {sorted(inside)} permits, {sorted(running)}"
    events[3].set()
    await clock.advance(10)
    for t in holders:
        t.cancel()
    _stop(c1, c2)


# --- Reusable leases after a reset; keys not held up by held requests --------------------------
# Each finding of the cold review of the reusable-lease fixes (the section above):
#
# One test per finding; each FAILS on the reviewed snapshot and says in its docstring what is
# wrong and why it matters. Only the public test kit is used (real holder, client and queue
# objects on a virtual clock; nothing of the library is mocked or patched).


SECRET = "app-secret-0123456789abcdef"


# ====================================================================== 1. flag flip then clamp
@async_test
async def test_a_reused_lease_unknown_after_a_reset_stays_charged_while_its_work_runs():
    """MEDIUM (I1, over-admission; needs a holder storage reset under ``lease_secret``, the
    configuration in which R32 promises to keep charging work still running under leases
    issued before the reset). New in the fix: ``merge_lease`` sets ``reusable`` to False
    when a reply lacks the flag, and the R32 reply to an unknown lease never carries it. The
    count clamp of THAT merge still uses the old flag (unbounded), but every later merge
    clamps ``drawn``/``released`` to ``permits`` (the lease is one-shot now). A reused lease
    routinely has ``drawn > permits``: here permits 2, drawn 4, released 2 (2 items run).
    Second reply after the reset: ``raise_counts(4, 2, 4, 2, cap=2)`` -> drawn 2, released
    2, so the client's next (stopped) report is ``released == drawn``: answered ``settled``,
    charged 0 (R32), the lease becomes a tombstone while its 2 items still run. The holder
    then admits a full limit on top: 6 run under a limit of 4, although c1 reports in every
    round. (With the clamp kept at ``max(permits, local.drawn)`` the same run stays at 4.)
    Suggested fix: never clamp a local count below what it already is (cap
    ``max(cap, local.drawn)``), or keep the unbounded cap for a lease that was ever
    reusable (e.g. when ``drawn > permits``)."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=4, leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 2,
                                                "ttlMs": 60_000, "reusable": True, "leaseFirst": True},
                        lease_secret=SECRET, group_limit=lambda g: 0 if g == "h" else None)
    net = Net(holder, clock)
    running: set[str] = set()
    c1 = ClientSide("c1", clock, net, on_admit=lambda s, i: running.add(i.item_id))
    c2 = ClientSide("c2", clock, net, on_admit=lambda s, i: running.add(i.item_id))
    await c1.queue.enqueue("acct", "g", "a0")
    await c1.queue.enqueue("acct", "g", "a1")
    await clock.advance(1500)  # a reusable lease of 2, both slots busy
    for n, old in ((2, "a0"), (3, "a1")):  # each slot reused once: drawn 4, released 2
        await c1.queue.complete(old)
        running.discard(old)
        await c1.queue.enqueue("acct", "g", f"a{n}")
        await clock.advance(50)
    (lease,) = c1.client.leases("acct")
    assert lease.reusable and (lease.permits, lease.drawn, lease.released) == (2, 4, 2)
    assert running == {"a2", "a3"}
    holder.reset()  # migrate(None): the lease is unknown now; lease_secret keeps its id verifiable
    await c1.queue.enqueue("acct", "h", "h0")  # group h (limit 0): c1 is in every round from now on
    await clock.advance(6000)
    leases = [(x.status, x.drawn, x.released) for x in c1.client.leases("acct")]  # settled: not listed
    for i in range(4):
        await c2.queue.enqueue("acct", "g", f"c{i}")
    await clock.advance(6000)
    assert len(running) <= 4, (f"{sorted(running)} run at once under a limit of 4 (c1's lease after the"
                               f" reset, while a2 and a3 ran: {leases or 'settled'})")
    _stop(c1, c2)


# ====================================================================== 2. other keys behind a held request
@async_test
async def test_a_new_item_of_another_key_is_not_held_up_by_held_requests():
    """LOW-MEDIUM (liveness; documentation contradicted). README (``request_wait_ms`` row,
    "Known limit") says that while one key's request is held, the alarm's wake-ups of the
    object's other keys wait "up to ``request_wait_ms``" and that "a new item of such a key
    still pumps it at once"; the changelog of this change says a wake-up no longer waits for
    a key's answer, "which held up the wake-up run, and so every other key of the object".
    But the early return only helps a SECOND pump of the requesting key: the pump that sent
    the held request was itself started by the alarm's wake-up run, which awaits it, and
    ``enqueue()`` only re-arms the alarm (no kick, unlike ``permit()``). So a new item of
    another key waits until every held key's pump in that run has returned: measured here
    with 2 blocked keys (request_wait_ms 15 s): about 29 s; with 3: 44 s (n x
    request_wait_ms, not "up to request_wait_ms", not "at once"); ``permit()`` on the same
    key: 1 s. Suggested fix: let ``enqueue()`` kick its key like ``permit()`` does, and/or
    run the request of a pump started by the wake-up run in a background task (the early
    return then covers the rest), or correct the README."""
    clock = SimClock(T0)
    holders = {f"A{i}": HolderSide(clock, name=f"hA{i}", limit=0, hold_blocked_ms=20_000) for i in range(2)}
    holders["B"] = HolderSide(clock, name="hB", limit=5, hold_blocked_ms=20_000)

    async def transport(key: str, message: dict[str, Any]) -> dict[str, Any]:
        return await holders[key].handle(message)

    started: dict[str, int] = {}
    c = ClientSide("c1", clock, transport, on_admit=lambda s, i: started.setdefault(i.item_id, clock.now),
                   request_wait_ms=15_000)
    for i in range(2):
        await c.queue.enqueue(f"A{i}", "g", f"a{i}")  # keys whose holder has no capacity: held requests
    await clock.advance(2000)
    t = clock.now
    await c.queue.enqueue("B", "g", "b0")  # a key whose holder has room
    await clock.advance(60_000)
    assert "b0" in started
    assert started["b0"] - t <= 3000, f"b0 of key B started {started['b0'] - t} ms after its enqueue"
    _stop(c)


# ====================================================================== the queue under a standing backlog (R21, R28a, R31a)
def backlog(limit: int, leases: dict, b_options: dict, **holder_options):
    """A holder and two clients whose items each run 1 s: ``a`` (leases on) and ``b``
    (``b_options`` to its queue); ``starts`` records when each item started."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=limit, leases=leases, **holder_options)
    net = Net(holder, clock)
    starts: dict[str, int] = {}

    async def work(item) -> None:
        starts[item.item_id] = clock.now
        await clock.sleep(1000)

    a = ClientSide("a", clock, net, work=work)
    b = ClientSide("b", clock, net, work=work, **b_options)
    return clock, a, b, starts


async def keep_busy(clock: SimClock, queue, group: str) -> None:
    """Five items at once, then one every 200 ms: more work than the limit runs, for ever."""
    for n in itertools.count():
        await queue.enqueue("acct", group, f"a{n}")
        if n >= 4:
            await clock.sleep(200)


@async_test
async def test_r31a_r23_through_the_queue_a_newcomer_in_a_group_capped_below_its_need_is_served_within_ttl():
    # a's reusable lease holds the whole limit (3) and a always has more queued than it runs;
    # b asks 3 in "small" (group limit 2). Blocked by the limit (R23), b starves (R31a), so a's
    # lease is not extended and ends within ttlMs; by then b's items are older than anything a
    # has queued and are served first (R21, R28a). Before, b waited for ever (group_limit, not
    # counted as starving, and each new lease of a sized before b's grant).
    clock, a, b, starts = backlog(3, REUSE_FIRST, {}, group_limit={"small": 2})
    feeder = asyncio.ensure_future(keep_busy(clock, a.queue, "big"))
    await clock.advance(3000)
    asked = clock.now
    for i in range(3):
        await b.queue.enqueue("acct", "small", f"b{i}")
    await clock.advance(TTL + 5000)
    assert {"b0", "b1"} <= set(starts), starts
    assert max(starts["b0"], starts["b1"]) - asked <= TTL + 5000
    await clock.advance(5000)
    assert "b2" in starts  # the group's third, once one of its two ends
    feeder.cancel()
    stop_all({"a": a, "b": b})


@pytest.mark.parametrize("reusable", [True, False], ids=["reusable", "one_shot"])
@async_test
async def test_r28a_r31a_through_the_queue_a_client_without_leases_is_served_within_ttl(reusable: bool):
    # b's queue has leases=False (its requests carry no `leases`, R5) and one item, which soon
    # is older than everything a has queued. a's leases never take what b, older, could use
    # (R28a), and b starves while a reusable lease holds the limit (R31a): b's item starts
    # within ttlMs. Before, every permit freed went to a's next lease and b got nothing.
    clock, a, b, starts = backlog(2, {**REUSE_FIRST, "reusable": reusable}, {"leases": False})
    feeder = asyncio.ensure_future(keep_busy(clock, a.queue, "g"))
    await clock.advance(3000)
    asked = clock.now
    await b.queue.enqueue("acct", "g", "b0")
    await clock.advance(TTL + 5000)
    assert "b0" in starts and starts["b0"] - asked <= TTL + 5000, starts.get("b0")
    assert len([i for i in starts if i.startswith("a")]) > 10  # and a ran all along
    feeder.cancel()
    stop_all({"a": a, "b": b})


def freed_beside(ttl_ms: int):
    """Limit 4, reusable lease-first leases of 3 (``ttl_ms``): ``b`` (no leases) takes one permit
    as a grant for an item of 6 s; then ``a`` keeps a backlog of 1 s items in the same group and
    takes the other 3 as a reusable lease, which leaves nothing free: the key is contended (R29)
    and, once that contention is older than ``COVER_AFTER_MS`` (3 s; young demand in a young
    one is not covered, R34a decision), the demand ``a``'s lease covers is not asked again
    before its heartbeat (R34a). b's item ends after that."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=4, leases={**REUSE_FIRST, "ttlMs": ttl_ms})
    net = Net(holder, clock)
    running: Counter[str] = Counter()

    async def work(item) -> None:
        running[item.item_id[0]] += 1
        try:
            await clock.sleep(6000 if item.item_id.startswith("b") else 1000)
        finally:
            running[item.item_id[0]] -= 1

    replies: list[dict[str, Any]] = []

    async def transport(key: str, message: dict[str, Any]) -> Any:
        reply = await net(key, message)
        replies.append({**reply, "sent": (message["clientId"], message["type"])})
        return reply

    a = ClientSide("a", clock, transport, work=work)
    b = ClientSide("b", clock, transport, work=work, leases=False, report_releases_within_ms=0)
    return clock, holder, replies, running, a, b


async def sample(clock: SimClock, running: Counter[str], n: int = 10) -> list[int]:
    out = []
    for _ in range(n):
        await clock.advance(500)
        out.append(running["a"])
    return out


@async_test
async def test_r34a_capacity_freed_beside_a_drawn_reusable_lease_is_asked_for_by_its_next_sync():
    # b's release frees 1 permit while a's key is contended and its lease covers its backlog.
    # The reply to a's next sync (a recheck of its draws, R33a) says `room` (nobody waits at
    # the holder), so a asks now and runs 4; before, it ran 3 until its lease's heartbeat (30 s
    # here; 15 min at the default ttlMs).
    clock, holder, replies, running, a, b = freed_beside(60_000)
    await b.queue.enqueue("acct", "g", "b0")
    await clock.advance(500)
    feeder = asyncio.ensure_future(keep_busy(clock, a.queue, "g"))
    await clock.advance(2000)
    assert (running["a"], running["b"]) == (3, 1)
    heartbeat_at = a.client.leases("acct")[0].heartbeat_at
    await clock.advance(8000)  # b's item ended at 6.5 s; a rechecks within 4 s and asks
    assert clock.now < heartbeat_at - 10_000
    assert min(await sample(clock, running)) == 4 and holder.charged()[0] == 4
    assert any(r.get("room") is True for r in replies), "no reply said room"
    # the reply to the request that took the room says nothing of it: a's key forgets it, and
    # a asks no more until its heartbeat (no request at every pump)
    assert not a.client.key_state("acct").room
    start = len(replies)
    await clock.advance(8000)
    asked = [r for r in replies[start:] if r["sent"] == ("a", "request")]
    assert len(asked) <= 2, f"a asked {len(asked)} times in 8 s once the room was taken"
    feeder.cancel()
    stop_all({"a": a, "b": b})


@async_test
async def test_r34a_r37_a_recheck_that_extends_a_reusable_lease_does_not_postpone_its_heartbeat():
    # The same, but the holder is evicted after b's release, so no reply says `room` (it is
    # kept in memory only): a's lease heartbeat, at half its lifetime, asks for the demand it
    # covers. a's recheck syncs extend the lease meanwhile; before, each extension moved the
    # heartbeat on too, so it never came, and a ran 3 of 4 for ever.
    clock, holder, replies, running, a, b = freed_beside(TTL)
    await b.queue.enqueue("acct", "g", "b0")
    await clock.advance(500)
    feeder = asyncio.ensure_future(keep_busy(clock, a.queue, "g"))
    await clock.advance(6200)  # b's item ends at 6.5 s: its release goes at once
    holder.evict()
    await clock.advance(1000)
    heartbeat_at = a.client.leases("acct")[0].heartbeat_at
    assert running["a"] == 3 and holder.charged()[0] == 3
    await clock.advance(heartbeat_at - clock.now)
    # the heartbeat goes as a request carrying a's demand; it joins a batched round (R9)
    assert max(await sample(clock, running)) == 4, "a's covered demand was not asked at its heartbeat"
    feeder.cancel()
    stop_all({"a": a, "b": b})


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


async def _covered_beside_a_free_slot(*, evict: bool) -> tuple[SimClock, dict[str, set[str]], ClientSide]:
    """Limit 2, the holder's default leases: c runs one item under a lease of one, a takes the
    other slot as a lease of one with four more items queued (contended: its demand is covered,
    R34a). Then c's item ends and c hands its slot back; with ``evict`` the holder is evicted
    right after."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2)
    net = Net(holder, clock)
    running: dict[str, set[str]] = {"a": set(), "c": set()}
    sides = {n: ClientSide(n, clock, net, on_admit=lambda s, i: running[s.name].add(i.item_id)) for n in ("a", "c")}
    await sides["c"].queue.enqueue("acct", "g", "c0")
    await clock.advance(100)
    for i in range(5):
        await sides["a"].queue.enqueue("acct", "g", f"a{i}")
    await clock.advance(1500)  # a's need does not fit: a batched round (R9a)
    assert len(running["a"]) == 1 and running["c"] == {"c0"}
    await sides["c"].queue.complete("c0")
    await clock.advance(10)
    assert (await holder.usage())["charged"] == 1  # c's slot went back at once (a lease stop)
    if evict:
        holder.evict()
    return clock, running, sides


@async_test
async def test_r34a_a_slot_freed_before_an_eviction_reaches_the_covered_demand_at_its_room_check():
    # R34a decision (room): the flag lives in memory, so an instance that has committed no
    # round yet says room. Before, the new instance said nothing: a's room checks heard no room
    # and the freed slot sat idle until a's lease heartbeat (15 min with the default lifetime;
    # seen on workerd after a SIGKILL, tests/workerd/test_app.py's kill test).
    for evict in (False, True):
        clock, running, sides = await _covered_beside_a_free_slot(evict=evict)
        await clock.advance(5_000)  # a's room checks: 2 s and 4 s into its contention
        assert len(running["a"]) == 2, (evict, running)
        stop_all(sides)


@async_test
async def test_r34a_syncs_say_room_while_the_last_round_left_capacity_free():
    # R34a decision (room), on the holder: a committed round that leaves capacity free keeps
    # syncs saying room (until a round takes it); one that leaves none clears it. Before, every
    # committed round cleared it, so capacity a round left free never reached demand covered by
    # reusable leases before their heartbeats.
    bed = Bed(4)  # the default leases
    [a] = await bed.round(request("a", {"g": 1}, leases=[]))
    [lease] = a["leases"]
    reply = await bed.one(sync("a", leases=[(lease["leaseId"], 1, 0)]))
    assert reply.get("room") is True, reply  # 3 of 4 free after a's round
    await bed.round(request("b", {"g": 3}, leases=[]))
    reply = await bed.one(sync("a", leases=[(lease["leaseId"], 1, 0)]))
    assert "room" not in reply, reply  # b's round took the rest


def group_at_its_limit(group: str) -> tuple[SimClock, Net]:
    """Limit 10, ``group`` limited to 2, the default leases with ``withinGroupLimit``: a lease in
    ``group`` counts against its limit (R27), so a client there holds at most 2."""
    from dataclasses import replace

    from semaphore import DEFAULT_LEASES

    clock = SimClock(T0)
    holder = HolderSide(clock, limit=10, group_limit={group: 2},
                        leases=replace(DEFAULT_LEASES, limited_groups="withinGroupLimit"))
    return clock, Net(holder, clock)


@async_test
async def test_r34a_a_round_that_leaves_need_unserved_says_no_room_so_a_covered_client_does_not_ask_in_vain():
    # R34a decision (room): a round that left need unserved says no room, whatever capacity it
    # left free. Here a's group is at its own limit (withinGroupLimit): 8 of 10 permits free,
    # none a's. Before, syncs said room after every such round, and a's room checks each
    # became a request and a round (before: 22 requests in 10 minutes; now none).
    from collections import Counter

    clock, net = group_at_its_limit("g")
    running: set[str] = set()
    a = ClientSide("a", clock, net, on_admit=lambda s, i: running.add(i.item_id))
    for i in range(6):
        await a.queue.enqueue("acct", "g", f"a{i}")
    await clock.advance(5_000)
    assert len(running) == 2
    sent = len(net.sent)
    await clock.advance(600_000)
    kinds = Counter(m["type"] for m in net.sent[sent:])
    a.driver.kill()
    assert kinds["request"] <= 2, kinds


@async_test
async def test_r34a_demand_that_has_waited_stays_covered_while_other_clients_rounds_restart_the_contention():
    # R34a decision (young demand in a young contention): a's group is at its own limit
    # (withinGroupLimit, 2 of 10) and a keeps a backlog of 1 s items there; b's short items in
    # another group are each served by a round of their own that leaves nothing unserved, so
    # the key's replies go uncontended and contended again every second or so. a's demand has
    # waited (its oldest item is old), so each new contention covers it: it asks only after a
    # room check heard `room` (b's releases free capacity; the room is the key's, not a's
    # group's), never more often than it checks. Before, each restart of the contention
    # opened a young window in which a asked at every round in vain: 90 requests and 30 room
    # checks in 120 s (a cold review).
    from collections import Counter

    clock, net = group_at_its_limit("ga")

    async def work(item) -> None:
        await clock.sleep(1000 if item.group == "ga" else 500)

    a = ClientSide("a", clock, net, work=work)
    b = ClientSide("b", clock, net, work=work)

    async def a_backlog() -> None:
        for n in itertools.count():
            await a.queue.enqueue("acct", "ga", f"a{n}")
            if n >= 10:
                await clock.sleep(500)  # more than the group's 2 slots run (2 items a second)

    async def b_items() -> None:
        for n in itertools.count():
            await b.queue.enqueue("acct", "gb", f"b{n}")
            await clock.sleep(1000)

    contentions: set[int] = set()  # the premise: b's rounds restart a's contention again and again

    async def watch() -> None:
        while True:
            contentions.add(a.client.key_state("acct").contended_since)
            await clock.sleep(100)

    feeders = [asyncio.ensure_future(a_backlog()), asyncio.ensure_future(b_items()), asyncio.ensure_future(watch())]
    await clock.advance(10_000)
    sent = len(net.sent)
    await clock.advance(120_000)
    kinds = Counter(m["type"] for m in net.sent[sent:] if m["clientId"] == "a")
    for task in feeders:
        task.cancel()
    stop_all({"a": a, "b": b})
    assert len(contentions - {0}) >= 10, len(contentions)
    assert kinds["request"] <= kinds["sync"] <= 65, kinds
