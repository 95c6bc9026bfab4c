"""Leases on the holder (SPEC §7: R25-R34, with the lease parts of R8, R19, R38).

Every case is small and hand-computed; the arithmetic is written next to each assertion. The
provisioning arithmetic (decided in docs, see the report of issue "Leases on the holder"):

* strict: grant room = limit - grants - leaseFootprint; lease room = limit - charged.
* under:  grant room = min(limit - grants - leaseFootprint, ceiling - grants) with
          ceiling = max(limit - reserve, 1 if limit >= 1 else 0); lease room = limit - charged.
* over:   grant room = limit - grants - max(0, leaseFootprint - extra);
          lease room = min(extra - leaseFootprint, limit + extra - charged).

``charged`` includes the grants of the round. Lease footprint counts against a group's limit
whenever the group has one; an unknown lease's charge (R32) counts against the total for its
round only, and only if its id verifies for the reporting client and was issued before a
storage reset (lease ids carry the storage epoch and an HMAC, see the R32 section): at most the
id's permits, ``permitsPerLease`` per client and the ceiling in total, and nothing when leases
are not configured.
"""

from __future__ import annotations

import itertools
import re

import pytest

from semaphore import ConfigurationError, DurabilitySemaphore, LeaseConfig, Provisioning
from semaphore.core.allocation import grant_ceiling
from semaphore.core.config import LimitedGroups
from semaphore.core.wire import id_problem
from semaphore.testing import Bed, async_test, blocked, by_id, request, sync

STRICT = {"provisioning": {"mode": "strict"}}


def leases(mode: str = "strict", **options):
    prov = {"mode": mode}
    for key in ("reserve", "extra"):
        if key in options:
            prov[key] = options.pop(key)
    return {"provisioning": prov, **options}


def only(reply, kind="leases"):
    items = reply[kind]
    assert len(items) == 1, items
    return items[0]


async def total_charged(bed: Bed) -> int:
    u = await bed.usage()
    return u["outstanding"] + u["leaseFootprint"]


# ====================================================================== R25 provisioning


@async_test
async def test_r25_strict_leases_take_what_grants_leave_and_reserve_their_footprint():
    # R25 strict, limit 10: a (lease-capable) wants 4 -> grant 4, lease 10 - 4 = 6.
    bed = Bed(10, leases=leases("strict"))
    (ra,) = await bed.round(request("a", {"g": 4}, leases=[], oldest_at=1))
    assert only(ra, "grants")["permits"] == 4
    assert only(ra)["permits"] == 6 and only(ra)["status"] == "live"
    assert await total_charged(bed) == 10
    # The live lease's footprint is reserved from the same pool: b gets 10 - 4 - 6 = 0.
    (rb,) = await bed.round(request("b", {"g": 3}, oldest_at=2))
    assert rb["grants"] == [] and blocked(rb) == {"g": ("limit", 3)}
    assert await total_charged(bed) == 10
    bed.check()


@async_test
async def test_r25_under_grants_capped_at_limit_minus_reserve_leases_use_the_rest():
    # R25 under, limit 10, reserve 4: grants at most 6; the lease gets 10 - 6 = 4.
    bed = Bed(10, leases=leases("under", reserve=4))
    (ra,) = await bed.round(request("a", {"g": 20}, leases=[], oldest_at=1))
    assert only(ra, "grants")["permits"] == 6
    assert only(ra)["permits"] == 4
    assert blocked(ra) == {"g": ("limit", 20 - 6 - 4)}
    assert await total_charged(bed) == 10
    # A client without lease support cannot go past the ceiling either.
    bed2 = Bed(10, leases=leases("under", reserve=4))
    (rb,) = await bed2.round(request("b", {"g": 20}, oldest_at=1))
    assert only(rb, "grants")["permits"] == 6 and rb["leases"] == []
    assert blocked(rb) == {"g": ("limit", 14)}
    bed.check(), bed2.check()


@pytest.mark.parametrize("limit,reserve,expected", [(3, 5, 1), (4, 4, 1), (1, 1, 1), (0, 3, 0), (10, 4, 6)])
def test_r25_under_grant_ceiling(limit, reserve, expected):
    # R25 under: ceiling = max(limit - reserve, 1 if limit >= 1 else 0)
    config = LeaseConfig.parse(leases("under", reserve=reserve))
    assert grant_ceiling(limit, config) == expected


@async_test
async def test_r25_under_reserve_at_or_above_limit_keeps_one_permit_for_grants():
    # R25 under, limit 3, reserve 5: grant ceiling max(3 - 5, 1) = 1.
    bed = Bed(3, leases=leases("under", reserve=5))
    (ra,) = await bed.round(request("a", {"g": 5}, oldest_at=1))  # no lease support
    assert only(ra, "grants")["permits"] == 1
    assert blocked(ra) == {"g": ("limit", 4)}
    # b (lease-capable): grant room min(3 - 1 - 0, 1 - 1) = 0; lease room 3 - 1 = 2.
    (rb,) = await bed.round(request("b", {"g": 2}, leases=[], oldest_at=2))
    assert rb["grants"] == [] and only(rb)["permits"] == 2
    assert await total_charged(bed) == 3
    bed.check()


@async_test
async def test_r25_under_lowering_limit_below_reserve_still_leaves_grants_one():
    # R25 under, reserve 5: at limit 10 grants get 5; after lowering to 4 the ceiling is
    # max(4 - 5, 1) = 1, not 0.
    current = {"limit": 10}
    bed = Bed(lambda: current["limit"], leases=leases("under", reserve=5))
    (ra,) = await bed.round(request("a", {"g": 8}, oldest_at=1))
    g = only(ra, "grants")
    assert g["permits"] == 5
    current["limit"] = 4
    # a claims and releases its 5 (the grant settles, outstanding 0) and asks for 8 again.
    (ra,) = await bed.round(request("a", {"g": 8}, grants=[(g["grantId"], 5, 5)], oldest_at=1))
    new = [x for x in ra["grants"] if x["grantId"] != g["grantId"]]
    assert len(new) == 1 and new[0]["permits"] == 1
    assert blocked(ra) == {"g": ("limit", 7)}
    assert await total_charged(bed) == 1
    bed.check()


@async_test
async def test_r25_over_ratio_leases_come_from_extra_above_the_limit():
    # R25 over, limit 10, extra ratio 0.5 -> floor(10 * 0.5) = 5; ceiling 15.
    bed = Bed(10, leases=leases("over", extra={"ratio": 0.5}))
    (ra,) = await bed.round(request("a", {"g": 12}, leases=[], oldest_at=1))
    # grants: 10 - 0 - max(0, 0 - 5) = 10; lease: min(5 - 0, 15 - 10) = 5.
    assert only(ra, "grants")["permits"] == 10
    assert only(ra)["permits"] == 5
    assert await total_charged(bed) == 15
    bed.check()


@async_test
async def test_r25_over_count_lease_footprint_within_extra_does_not_eat_the_limit():
    # R25 over, limit 4, extra count 3.
    bed = Bed(4, leases=leases("over", extra={"count": 3}))
    (ra,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    # grant 1; lease min(3 - 0, 7 - 1) = 3.
    assert only(ra, "grants")["permits"] == 1 and only(ra)["permits"] == 3
    # b: grants 4 - 1 - max(0, 3 - 3) = 3; the lease footprint stays in the extra budget.
    (rb,) = await bed.round(request("b", {"g": 5}, oldest_at=2))
    assert only(rb, "grants")["permits"] == 3
    assert blocked(rb) == {"g": ("limit", 2)}
    assert await total_charged(bed) == 7
    bed.check()


@async_test
async def test_r25_over_footprint_overflowing_extra_eats_the_limit():
    # R25 over, ratio 0.5: limit 10 -> extra 5, lease of 5; lowering the limit to 6 makes extra
    # floor(6 * 0.5) = 3, so 5 - 3 = 2 of the lease footprint overflows into the limit.
    current = {"limit": 10}
    bed = Bed(lambda: current["limit"], leases=leases("over", extra={"ratio": 0.5}))
    (ra,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    g = only(ra, "grants")
    assert g["permits"] == 1 and only(ra)["permits"] == 5
    await bed.sem.handle(sync("a", grants=[(g["grantId"], 1, 1)]))  # grant settled
    current["limit"] = 6
    (rb,) = await bed.round(request("b", {"h": 10}, oldest_at=2))
    # grants: 6 - 0 - max(0, 5 - 3) = 4; total 4 + 5 = 9 = limit + extra.
    assert only(rb, "grants")["permits"] == 4
    assert await total_charged(bed) == 9
    bed.check()


@async_test
async def test_r25_over_lease_room_bounded_by_ceiling_when_grants_run_above_limit():
    # R25 over / I1: limit 10 -> 4 with extra count 3 while 8 grant permits run: lease room is
    # min(3 - 0, 4 + 3 - 8) < 0, so nothing is issued (extra alone would have given 3 -> 11 > 7).
    current = {"limit": 10}
    bed = Bed(lambda: current["limit"], leases=leases("over", extra={"count": 3}))
    (ra,) = await bed.round(request("a", {"g": 8}, oldest_at=1))
    g = only(ra, "grants")
    assert g["permits"] == 8
    await bed.sem.handle(sync("a", grants=[(g["grantId"], 8, 0)]))  # all 8 running
    current["limit"] = 4
    (rb,) = await bed.round(request("b", {"g": 2}, leases=[], oldest_at=2))
    assert rb["grants"] == [] and rb["leases"] == []
    assert blocked(rb) == {"g": ("limit", 2)}
    assert await total_charged(bed) == 8
    bed.check()


# ====================================================================== R26 candidates


@async_test
async def test_r26_lease_candidates():
    bed = Bed(100, leases=leases("strict", permitsPerLease=4))
    r_no, r_zero, r_yes = await bed.round(
        request("noleases", {"g": 2}, oldest_at=1),           # no `leases` key: not capable (R5)
        request("zero", {"g": 0}, leases=[], oldest_at=2),    # count 0: not a candidate
        request("yes", {"g": 2}, leases=[], oldest_at=3),     # candidate even though grants served it
    )
    assert r_no["leases"] == [] and r_zero["leases"] == []
    assert only(r_yes, "grants")["permits"] == 2 and only(r_yes)["permits"] == 4
    lease = only(r_yes)
    # A live lease with undrawn permits in g: no new lease in g, but one in another group h.
    first = only(r_yes, "grants")["grantId"]
    (r2,) = await bed.round(request("yes", {"g": 9, "h": 1}, grants=[(first, 2, 0)],
                                    leases=[(lease["leaseId"], 3, 0)], oldest_at=3))
    new = [x for x in r2["leases"] if x["leaseId"] != lease["leaseId"]]
    assert [x["group"] for x in new] == ["h"]
    # R20: need in g = 9 - 0 unclaimed - 1 undrawn = 8 (grant 8).
    assert [x["permits"] for x in r2["grants"] if x["group"] == "g" and x["grantId"] != first] == [8]
    bed.check()


@async_test
async def test_r26_r34_fully_drawn_lease_makes_client_a_candidate_again_and_released_draws_stay_spent():
    # R34: a drawn permit is one-shot: a lease of 4 drawn 4, released 4 has no undrawn permits,
    # its releases do not make it drawable again (need is not reduced by it, R20), and the
    # client is a lease candidate again (R26).
    bed = Bed(10, leases=leases("strict", permitsPerLease=4))
    (r1,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    grant, lease = only(r1, "grants"), only(r1)
    assert (grant["permits"], lease["permits"]) == (1, 4)
    (r2,) = await bed.round(request("a", {"g": 3}, grants=[(grant["grantId"], 1, 1)],
                                    leases=[(lease["leaseId"], 4, 4)], oldest_at=5))
    old = by_id(r2, "leases")[lease["leaseId"]]
    assert (old["drawn"], old["released"], old["status"]) == (4, 4, "live")
    new_grants = [x for x in r2["grants"] if x["grantId"] != grant["grantId"]]
    assert [x["permits"] for x in new_grants] == [3]  # need 3 - 0 undrawn
    new_leases = [x for x in r2["leases"] if x["leaseId"] != lease["leaseId"]]
    assert [x["permits"] for x in new_leases] == [4]  # lease room 10 - 3 - 0 = 7, capped at 4
    u = await bed.usage()
    assert u["leaseFootprint"] == 0 + 4 and u["outstanding"] == 3
    bed.check()


# ====================================================================== R27 limited groups


@async_test
async def test_r27_exclude_gives_limited_groups_no_leases():
    bed = Bed(100, group_limit={"lim": 5}, leases=leases("strict"))
    (r,) = await bed.round(request("a", {"lim": 2, "free": 1}, leases=[], oldest_at=1))
    assert {x["group"] for x in r["leases"]} == {"free"}
    assert {x["group"]: x["permits"] for x in r["grants"]} == {"lim": 2, "free": 1}
    bed.check()


@async_test
async def test_r27_within_group_limit_lease_footprint_counts_against_the_group():
    bed = Bed(100, group_limit={"lim": 5}, leases=leases("strict", limitedGroups="withinGroupLimit"))
    (ra,) = await bed.round(request("a", {"lim": 2}, leases=[], oldest_at=1))
    # grant 2; lease min(64, 100 - 2) clamped to the group room 5 - 2 = 3.
    assert only(ra, "grants")["permits"] == 2 and only(ra)["permits"] == 3
    u = await bed.usage()
    assert u["groups"]["lim"] == {"outstanding": 2, "leaseFootprint": 3, "liveLeases": 1,
                                  "retiredLeases": 0, "limit": 5, "charged": 5, "available": 0}
    (rb,) = await bed.round(request("b", {"lim": 1}, oldest_at=2))
    assert rb["grants"] == [] and blocked(rb) == {"lim": ("group_limit", 1)}
    bed.check()


# ====================================================================== R28 sharing


@async_test
async def test_r28_equal_share_in_oldest_order():
    # R28: limit 10, three candidates wanting 1 each: grants 3, budget 7 -> floor(7/3) = 2 each.
    bed = Bed(10, leases=leases("strict"))
    replies = await bed.round(*(request(c, {c: 1}, leases=[], oldest_at=i) for i, c in enumerate("abc")))
    assert [only(r)["permits"] for r in replies] == [2, 2, 2]
    assert await total_charged(bed) == 9
    # permitsPerLease caps the share: budget 97 / 3 = 32 -> 5.
    bed2 = Bed(100, leases=leases("strict", permitsPerLease=5))
    replies = await bed2.round(*(request(c, {c: 1}, leases=[], oldest_at=i) for i, c in enumerate("abc")))
    assert [only(r)["permits"] for r in replies] == [5, 5, 5]
    bed.check(), bed2.check()


@async_test
async def test_r28_fewer_permits_than_candidates_oldest_get_one_each():
    # R28: limit 5, three candidates wanting 1: grants 3, budget 2 -> share 0 -> the two oldest
    # by oldestAt (not by arrival) get 1 each.
    bed = Bed(5, leases=leases("strict"))
    rc, rb, ra = await bed.round(
        request("c", {"c": 1}, leases=[], oldest_at=30),
        request("b", {"b": 1}, leases=[], oldest_at=20),
        request("a", {"a": 1}, leases=[], oldest_at=10),
    )
    assert only(ra)["permits"] == 1 and only(rb)["permits"] == 1 and rc["leases"] == []
    assert await total_charged(bed) == 5
    bed.check()


# ====================================================================== R29 contended


@async_test
async def test_r29_contended_on_every_reply_of_a_round_with_unserved_need():
    bed = Bed(2, leases=leases("strict"))
    ra, rb, rc = await bed.round(
        request("a", {"g": 5}, oldest_at=1),              # 2 granted, 3 unserved
        request("b", {"h": 0}, leases=[], oldest_at=2),   # asks for nothing
        request("c", {}, leases=[], oldest_at=3),
    )
    assert blocked(ra) == {"g": ("limit", 3)}
    assert ra["contended"] is rb["contended"] is rc["contended"] is True
    # A round that serves everything is not contended.
    bed2 = Bed(10, leases=leases("strict"))
    ra, rb = await bed2.round(request("a", {"g": 2}, oldest_at=1), request("b", {"h": 1}, leases=[], oldest_at=2))
    assert ra["contended"] is False and rb["contended"] is False
    # Need served by a lease is not unserved: 3 wanted, grant 2 + lease... limit 4: grant 3, lease 1.
    bed3 = Bed(4, leases=leases("strict"))  # lease footprint filling the limit is not "full"
    (r,) = await bed3.round(request("a", {"g": 3}, leases=[], oldest_at=1))
    assert r["contended"] is False
    bed4 = Bed(4, leases=leases("strict"), name="full")  # R29 decision: grants left no permit free
    (r,) = await bed4.round(request("a", {"g": 4}, oldest_at=1))
    assert r["contended"] is True


def fail_commit_once(storage) -> list[str]:
    """Fault injection on the test bed (not the code under test): the next transaction runs its
    body and then fails as its commit would, so everything it wrote is rolled back."""
    original = storage.transactionSync
    failed: list[str] = []

    def transaction_sync(fn):
        if failed:
            return original(fn)
        failed.append("commit")

        def body():
            fn()
            raise RuntimeError("injected commit failure")

        return original(body)

    storage.transactionSync = transaction_sync
    return failed


def meta(bed: Bed) -> dict[str, int]:
    return {k: v for k, v in bed.storage.connection.execute("SELECT key, value FROM durability_semaphore_meta")}


@async_test
async def test_r29_contended_flag_is_durable_and_answered_by_syncs_after_eviction():
    # R29/R4: the last round's contended flag is durable (meta `contended`, written in the
    # round's transaction): after an eviction a new instance answers a sync with it, so a
    # queue keeps returning idle lease permits while others wait.
    bed = Bed(2, leases=leases("strict"))
    (ra,) = await bed.round(request("a", {"g": 5}, leases=[], oldest_at=1))  # 3 unserved
    assert ra["contended"] is True
    assert (await bed.sem.handle(sync("b", leases=[])))["contended"] is True
    bed.evict()
    reply = await bed.sem.handle(sync("b", leases=[]))
    assert "error" not in reply and reply["contended"] is True
    # ... and a later round that serves everything clears it, durably too.
    grant = only(ra, "grants")["grantId"]
    (ra2,) = await bed.round(request("a", {"g": 0}, grants=[(grant, 2, 2)], leases=[]))
    assert ra2["contended"] is False
    bed.evict()
    assert (await bed.sem.handle(sync("b", leases=[])))["contended"] is False
    bed.check()


@async_test
async def test_r29_a_round_whose_transaction_fails_does_not_change_the_contended_flag():
    # R29/R2: only a committed round sets the flag; a round whose transaction fails (here: at
    # commit, after its body ran) leaves it as the last committed round left it, in memory
    # and in storage.
    bed = Bed(2)
    (ra,) = await bed.round(request("a", {"g": 5}, oldest_at=1))
    assert ra["contended"] is True
    before = meta(bed)
    grant = only(ra, "grants")["grantId"]
    failed = fail_commit_once(bed.storage)
    (rb,) = await bed.round(request("a", {"g": 0}, grants=[(grant, 2, 2)]))  # would be uncontended
    assert failed and rb["error"]["code"] == "round_failed"
    assert meta(bed) == before
    assert (await bed.sem.handle(sync("b")))["contended"] is True
    bed.evict()
    assert (await bed.sem.handle(sync("b")))["contended"] is True
    bed.check()


# ====================================================================== R30 footprint


@async_test
async def test_r30_footprint_of_live_retired_stopped_and_settlement():
    bed = Bed(100, leases=leases("strict", permitsPerLease=6))
    (r,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    lid = only(r)["leaseId"]
    await bed.sem.handle(sync("a", grants=[(only(r, "grants")["grantId"], 1, 1)]))
    # live: permits - released = 6 - 1 (drawn 4 makes no difference)
    await bed.sem.handle(sync("a", leases=[(lid, 4, 1)]))
    assert (await bed.usage())["leaseFootprint"] == 5
    # retired by TTL, not stopped: still permits - released = 5
    await bed.clock.advance(bed.sem.leases.ttl_ms)
    reply = await bed.sem.handle(sync("other"))
    u = await bed.usage()
    assert u["leaseFootprint"] == 5 and u["retiredLeases"] == 1 and u["liveLeases"] == 0
    assert bed.leases()[lid]["status"] == "retired"
    # stopped: drawn - released = 4 - 2
    reply = await bed.sem.handle(sync("a", leases=[(lid, 4, 2, True)]))
    assert by_id(reply, "leases")[lid]["status"] == "retired"
    assert (await bed.usage())["leaseFootprint"] == 2
    # released == final drawn: settled and deleted
    reply = await bed.sem.handle(sync("a", leases=[(lid, 4, 4, True)]))
    assert by_id(reply, "leases")[lid]["status"] == "settled"
    assert lid not in bed.leases()
    u = await bed.usage()
    assert u["leaseFootprint"] == 0 and u["retiredLeases"] == 0 and u["groups"] == {}
    bed.check()


@async_test
async def test_r30_stopping_a_live_lease_returns_its_undrawn_permits():
    bed = Bed(10, leases=leases("strict", permitsPerLease=6))
    (r,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    lid = only(r)["leaseId"]
    assert only(r)["permits"] == 6
    reply = await bed.sem.handle(sync("a", leases=[(lid, 4, 1, True)]))
    assert by_id(reply, "leases")[lid]["status"] == "retired"
    assert (await bed.usage())["leaseFootprint"] == 3  # 4 - 1
    # the freed 3 are admitted to someone else: 10 - 1 (grant) - 3 = 6
    (rb,) = await bed.round(request("b", {"g": 9}, oldest_at=2))
    assert only(rb, "grants")["permits"] == 6
    bed.check()


@async_test
async def test_r30_i2_repeated_stale_and_excessive_lease_reports_return_capacity_once():
    # I2 / R31 clamping like R13: drawn clamps to permits, released to drawn, both only rise.
    bed = Bed(100, leases=leases("strict", permitsPerLease=5))
    (r,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    lid = only(r)["leaseId"]
    await bed.sem.handle(sync("a", leases=[(lid, 4, 3)]))
    await bed.sem.handle(sync("a", leases=[(lid, 2, 1)]))  # stale
    row = bed.leases()[lid]
    assert (row["drawn"], row["released"]) == (4, 3)
    await bed.sem.handle(sync("a", leases=[(lid, 50, 50)]))  # clamped to permits
    row = bed.leases()[lid]
    assert (row["drawn"], row["released"]) == (5, 5)
    assert (await bed.usage())["leaseFootprint"] == 0
    for _ in range(3):  # stopping again and again settles once and then stays settled
        reply = await bed.sem.handle(sync("a", leases=[(lid, 5, 5, True)]))
        assert by_id(reply, "leases")[lid]["status"] == "settled"
    assert (await bed.usage())["leaseFootprint"] == 0
    bed.check()


@async_test
async def test_r30_r31_drawn_is_final_after_the_stop_a_later_higher_drawn_changes_nothing():
    # R30/R31: a report with stopped: true fixes drawn; a later report with a higher drawn (a
    # stale, buggy or hostile client) must not re-inflate the footprint, or the capacity freed
    # by the stop (already admitted to others) would be charged twice and exceed the limit.
    bed = Bed(10, leases=leases("strict", permitsPerLease=6))
    (r,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    lid = only(r)["leaseId"]
    reply = await bed.sem.handle(sync("a", leases=[(lid, 2, 0, True)]))
    assert by_id(reply, "leases")[lid]["status"] == "retired"
    assert (await bed.usage())["leaseFootprint"] == 2  # drawn 2 - released 0
    (rb,) = await bed.round(request("b", {"g": 9}, oldest_at=2))
    assert only(rb, "grants")["permits"] == 10 - 1 - 2
    assert await total_charged(bed) == 10
    for later in [(lid, 6, 0), (lid, 5, 1, True), (lid, 6, 0, True)]:
        reply = await bed.sem.handle(sync("a", leases=[later]))
        state = by_id(reply, "leases")[lid]
        assert state["drawn"] == 2 and state["status"] == "retired"
        assert bed.leases()[lid]["drawn"] == 2
        assert await total_charged(bed) <= 10
    # released still rises, up to the final drawn; then it is settled.
    assert (await bed.usage())["leaseFootprint"] == 1  # 2 - 1 (released 1 applied above)
    (ra,) = await bed.round(request("a", {"g": 0}, leases=[(lid, 6, 2, True)]))
    assert by_id(ra, "leases")[lid]["status"] == "settled"
    assert lid not in bed.leases() and (await bed.usage())["leaseFootprint"] == 0
    bed.check()


# ====================================================================== R31 heartbeat and TTL


@async_test
async def test_r31_reports_heartbeat_a_lease():
    bed = Bed(10, leases=leases("strict", ttlMs=60_000))
    (r,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    lease = only(r)
    assert lease["expiresAt"] == bed.now + 60_000
    await bed.clock.advance(40_000)
    reply = await bed.sem.handle(sync("a", leases=[(lease["leaseId"], 0, 0)]))
    assert by_id(reply, "leases")[lease["leaseId"]]["expiresAt"] == bed.now + 60_000
    await bed.clock.advance(40_000)  # 80 s after issue, 40 s after the heartbeat: still live
    reply = await bed.sem.handle(sync("b"))
    assert bed.leases()[lease["leaseId"]]["status"] == "live"
    # a heartbeat inside a request works too
    (r2,) = await bed.round(request("a", {"g": 0}, leases=[(lease["leaseId"], 1, 0)]))
    assert by_id(r2, "leases")[lease["leaseId"]]["expiresAt"] == bed.now + 60_000
    bed.check()


@async_test
async def test_r31_unreported_lease_retired_at_next_round_never_deleted():
    bed = Bed(10, leases=leases("strict", ttlMs=60_000))
    (r,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    lid = only(r)["leaseId"]
    permits = only(r)["permits"]
    await bed.sem.handle(sync("a", grants=[(only(r, "grants")["grantId"], 1, 0)]))  # running
    await bed.clock.advance(60_000)
    assert bed.leases()[lid]["status"] == "live"  # retirement happens at a round or report
    (rb,) = await bed.round(request("b", {"h": 1}, oldest_at=2))
    assert bed.leases()[lid]["status"] == "retired"
    # still charged in full: 10 - 1 (a's grant) - 9 (lease) = 0 for b
    assert rb["grants"] == [] and blocked(rb) == {"h": ("limit", 1)}
    await bed.clock.advance(10 * 60_000)
    await bed.round(request("b", {"h": 1}, oldest_at=2))
    assert bed.leases()[lid]["status"] == "retired"
    u = await bed.usage()
    assert u["retiredLeases"] == 1 and u["leaseFootprint"] == permits
    # its owner hears it is retired (and no new lease while... a gets a new one: no undrawn live)
    (ra,) = await bed.round(request("a", {"g": 0}, leases=[]))
    assert by_id(ra, "leases")[lid]["status"] == "retired"
    bed.check()


@async_test
async def test_r31_expired_lease_retired_at_next_report():
    bed = Bed(10, leases=leases("strict", ttlMs=1_000))
    (r,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    lid = only(r)["leaseId"]
    await bed.clock.advance(1_000)
    # a report after expiry does not revive the lease: it is retired first
    reply = await bed.sem.handle(sync("a", leases=[(lid, 2, 0)]))
    assert by_id(reply, "leases")[lid]["status"] == "retired"
    assert bed.leases()[lid]["drawn"] == 2
    bed.check()


# ====================================================================== R32 unknown leases
#
# Lease ids are verifiable (decision, README "Leases"): ``<nonce>.<epoch>.<permits>.<mac>``, the
# nonce from id_factory, the epoch the storage's (meta row lease_epoch, 32 random bits drawn with
# the storage's lease-id state, new after a reset), the mac the first 32 hex digits of
# HMAC-SHA256 over client id, nonce, epoch and permits under ``lease_secret`` (an application
# secret) or, without it, a per-storage secret (meta rows lease_key_0..7). A report of an unknown
# lease is charged only if its id verifies for the reporting client AND carries another epoch (a
# lease issued before a storage reset, whose work may still run): min(drawn - released, the id's
# permits), at most permitsPerLease per client per round and the ceiling in total. A verified id
# of the current epoch is a lease this storage settled (its work released): charged nothing, like
# a fabricated id, another client's id, or one under another secret.

LEASE_ID = re.compile(r"^(?P<nonce>.+)\.(?P<epoch>[0-9a-f]{8})\.(?P<permits>[1-9][0-9]{0,15})\.(?P<mac>[0-9a-f]{32})$")
APP_SECRET = "lease secret of the test application"  # what a Worker secret binding would hold
HUGE = 2**53 - 1


async def settled_lease(bed: Bed, client: str, *, drawn: int = 3, group: str = "g") -> str:
    """A genuine lease id of ``client`` whose row is gone: issued (with a grant of 1), ``drawn``
    permits drawn and released, stopped and settled (the grant released too): nothing stays
    charged."""
    (r,) = await bed.round(request(client, {group: 1}, leases=[], oldest_at=0))
    lease = only(r)
    grants = [(g["grantId"], g["permits"], g["permits"]) for g in r["grants"]]
    reply = await bed.sem.handle(sync(client, grants, leases=[(lease["leaseId"], drawn, drawn, True)]))
    assert by_id(reply, "leases")[lease["leaseId"]]["status"] == "settled"
    assert bed.leases() == {} and bed.grants() == {} and await total_charged(bed) == 0
    return lease["leaseId"]


async def running_lease(bed: Bed, client: str) -> tuple[str, int]:
    """A lease of ``client`` with every permit drawn and none released (its grant of 1 released
    and settled): ``(lease id, permits)``."""
    (r,) = await bed.round(request(client, {"g": 1}, leases=[], oldest_at=0))
    lease, grant = only(r), only(r, "grants")
    await bed.sem.handle(sync(client, [(grant["grantId"], 1, 1)],
                              leases=[(lease["leaseId"], lease["permits"], 0)]))
    assert bed.grants() == {} and await total_charged(bed) == lease["permits"]
    return lease["leaseId"], lease["permits"]


def id_state(bed: Bed) -> dict[str, int]:
    """The meta rows of the lease-id state: ``lease_epoch`` and ``lease_key_0..7``."""
    return {k: v for k, v in meta(bed).items() if k == "lease_epoch" or k.startswith("lease_key_")}


def held(reply) -> int:
    """Permits a reply's active grants still hold (``permits - released``)."""
    return sum(g["permits"] - g["released"] for g in reply["grants"] if g["status"] == "active")


def bed_secret(bed: Bed) -> bytes:
    from semaphore.core.lease_ids import stored_secret

    secret = stored_secret(meta(bed))
    assert secret is not None
    return secret


def minted(bed: Bed, client: str, nonce: str, permits: int, *, secret: bytes | None = None) -> str:
    """An id that verifies for ``client`` on ``bed`` and carries another epoch than the bed's
    storage: the holder cannot tell it from a lease issued to ``client`` before a storage reset.
    Under ``secret`` (default: the bed's per-storage secret)."""
    from semaphore.core.lease_ids import holder_key, lease_id_for
    from semaphore.runtime import object_id

    other_epoch = (meta(bed).get("lease_epoch", 0) + 1) % 2**32
    # an application secret is keyed per holder object (its ctx.id), as the holder does
    key = holder_key(secret, str(object_id(bed.sem.scheduler.ctx))) if secret else bed_secret(bed)
    return lease_id_for(key, client, nonce, other_epoch, permits)


REPLAY = {
    "strict": (leases("strict"), 10),
    "under": (leases("under", reserve=2), 8),  # grants at most 10 - 2
    "over": (leases("over", extra={"count": 2}), 10),
}


@pytest.mark.parametrize("mode", sorted(REPLAY))
@async_test
async def test_r32_replaying_a_settled_leases_id_for_hours_never_reduces_other_grants(mode):
    # R32 (review fault, HIGH): a lease row is deleted only at the settle, so a verified unknown
    # id of this storage is a settled lease with no work left. Its client replaying
    # (lid, huge drawn, 0) every round used to withhold permitsPerLease from everyone,
    # invisibly (usage showed 0). Now: answered retired, charged nothing, for hours, across an
    # eviction, whatever the report says.
    config, grant_room = REPLAY[mode]
    bed = Bed(10, leases=config)
    lid = await settled_lease(bed, "x", drawn=2)
    start = bed.now
    for i in range(20):  # a round every 10 minutes: 3 hours 20 minutes
        await bed.clock.advance(600_000)  # honest's unclaimed grant is reclaimed meanwhile
        if i == 10:
            bed.evict()
        report = [(lid, HUGE, 0)] if i % 2 == 0 else [(lid, 64, 1, True)]
        rx, ry = await bed.round(
            request("x", {}, leases=report, oldest_at=0),
            request("honest", {"g": 10}, oldest_at=1),
        )
        assert by_id(rx, "leases")[lid]["status"] == "retired"
        assert held(ry) == grant_room, (i, ry)
        usage = await bed.usage()
        assert usage["leaseFootprint"] == 0 and usage["outstanding"] == grant_room
    assert bed.now - start >= 3 * 3_600_000 and bed.leases() == {}
    bed.check()


@async_test
async def test_r32_many_client_ids_replaying_their_settled_leases_starve_no_one():
    # R32: the replay multiplied by client ids (each id's own genuine, settled leases, two each)
    # charges nothing either: the honest client gets the whole limit every round.
    bed = Bed(10, leases=leases("strict", permitsPerLease=4))
    sybils = [f"sybil{i}" for i in range(8)]
    ids = {c: [await settled_lease(bed, c, drawn=4), await settled_lease(bed, c, drawn=1)] for c in sybils}
    for i in range(12):  # a round every 5 minutes for an hour
        await bed.clock.advance(300_000)
        replies = await bed.round(
            *[request(c, {}, leases=[(lid, HUGE, 0) for lid in ids[c]], oldest_at=0) for c in sybils],
            request("honest", {"g": 10}, oldest_at=1),
        )
        for c, r in zip(sybils, replies):
            assert {x["leaseId"]: x["status"] for x in r["leases"]} == dict.fromkeys(ids[c], "retired")
        assert held(replies[-1]) == 10 and blocked(replies[-1]) == {}, (i, replies[-1])
        assert (await bed.usage())["leaseFootprint"] == 0
    bed.check()


@async_test
async def test_r32_holders_sharing_a_lease_secret_never_charge_each_others_lease_ids():
    # R32 (review fault): one lease_secret serves every holder of a Worker (one per key). A lease
    # issued and settled at holder A, replayed to holder B (another epoch, so it would look like
    # a lease from before a reset of B), must charge B nothing: the MAC key is bound to the
    # holder object's id. Before, B charged it every round with no reset at all.
    a = Bed(10, leases=STRICT, lease_secret=APP_SECRET, name="holder-a")
    b = Bed(10, leases=STRICT, lease_secret=APP_SECRET, name="holder-b")
    next(b._secrets)  # B's storage draws other bytes than A's: its epoch differs
    lid = await settled_lease(a, "x")
    await settled_lease(b, "seed")  # B has an epoch of its own
    assert meta(a)["lease_epoch"] != meta(b)["lease_epoch"]
    for i in range(3):
        await b.clock.advance(60_000)
        rx, ry = await b.round(request("x", {}, leases=[(lid, 9, 0)], oldest_at=0),
                               request("honest", {"g": 10}, oldest_at=1))
        assert by_id(rx, "leases")[lid]["status"] == "retired"
        assert held(ry) == 10 and blocked(ry) == {}, (i, ry)
    b.check()


@pytest.mark.parametrize("fresh_storage", [False, True], ids=["migrate_none", "new_storage"])
@async_test
async def test_r32_with_lease_secret_a_lease_from_before_a_storage_reset_is_charged(fresh_storage):
    # R32 (review fault, MEDIUM): the one unknown lease with work running is one issued before
    # a holder storage reset (migrate(None), or new storage) that its client keeps. With
    # lease_secret its id still verifies, and its other epoch shows it was not settled here:
    # x's report (lid, 9, 0) is charged 9, so honest gets 10 - 9 = 1 (not a full limit on top
    # of x's running work), every round x reports it, until x settles it.
    bed = Bed(10, leases=STRICT, lease_secret=APP_SECRET)
    lid, permits = await running_lease(bed, "x")  # grant 1 + lease 9, all 9 drawn
    assert permits == 9
    bed.reset(fresh_storage=fresh_storage)
    await bed.sem.handle(sync("nobody"))  # the new instance creates its (empty) schema
    assert bed.leases() == {} and id_state(bed) == {}

    async def honest_gets(report) -> int:
        await bed.clock.advance(60_000)  # honest's previous grant is reclaimed
        rx, ry = await bed.round(request("x", {}, leases=[report], oldest_at=0),
                                 request("honest", {"g": 10}, oldest_at=1))
        assert by_id(rx, "leases")[lid]["status"] == ("settled" if report[-1] is True else "retired")
        return held(ry)

    assert await honest_gets((lid, 9, 0)) == 10 - 9
    assert await honest_gets((lid, 64, 0)) == 10 - 9  # drawn 64 of a 9-permit lease: at most 9
    # the new storage issues (and settles) a lease of its own: its epoch differs from lid's
    await bed.clock.advance(60_000)
    (ry,) = await bed.round(request("y", {"g": 1}, leases=[], oldest_at=0))
    ylease = only(ry)
    await bed.sem.handle(sync("y", [(only(ry, "grants")["grantId"], 1, 1)], leases=[(ylease["leaseId"], 0, 0, True)]))
    assert LEASE_ID.match(ylease["leaseId"])["epoch"] != LEASE_ID.match(lid)["epoch"]
    assert await honest_gets((lid, 9, 4)) == 10 - (9 - 4)
    assert await honest_gets((lid, 9, 9, True)) == 10  # settled: nothing left to charge
    assert bed.leases() == {} and (await bed.usage())["leaseFootprint"] == 0
    bed.check()


@async_test
async def test_r32_reports_of_one_unknown_lease_in_a_round_merge_whatever_their_order():
    # R32/R13 (found by the core machines, issue 9): two messages of one client in a round that
    # report the same lease the holder does not know (a stale, unstopped snapshot and the final,
    # settled one) are merged as high-water marks: answered ``settled`` and charged nothing in
    # either order. Before, the report applied last decided: the stale one last answered
    # ``retired`` and charged its ``drawn - released`` (9) for the round.
    answers = {}
    for order in ("final last", "stale last"):
        bed = Bed(10, leases=STRICT, lease_secret=APP_SECRET)
        lid, permits = await running_lease(bed, "x")
        bed.reset(fresh_storage=True)
        await bed.sem.handle(sync("nobody"))
        stale, final = (lid, 9, 0), (lid, 9, 9, True)
        first, last = (stale, final) if order == "final last" else (final, stale)
        tasks = [bed.send(request("x", {}, leases=[first], oldest_at=0)),
                 bed.send(request("x", {}, leases=[last], oldest_at=0)),
                 bed.send(request("honest", {"g": 10}, oldest_at=1))]
        await bed.clock.advance(60_000)
        rx, _, ry = [t.result() for t in tasks]
        answers[order] = (by_id(rx, "leases")[lid]["status"], held(ry))
    assert answers == {"final last": ("settled", 10), "stale last": ("settled", 10)}, answers


@async_test
async def test_r32_without_lease_secret_a_reset_forgets_old_leases_the_documented_trade_off():
    # R32 (decision): without lease_secret the secret is per storage: a settled lease's replay
    # is charged nothing, and after a storage reset the old ids cannot verify, so the same
    # report of x's running 9-permit lease charges nothing (honest gets the full 10; README
    # "Leases": pass lease_secret to have such leases charged).
    bed = Bed(10, leases=STRICT)
    settled = await settled_lease(bed, "x", drawn=2)
    rx, ry = await bed.round(request("x", {}, leases=[(settled, 9, 0)], oldest_at=0),
                             request("honest", {"g": 10}, oldest_at=1))
    assert by_id(rx, "leases")[settled]["status"] == "retired" and held(ry) == 10
    await bed.clock.advance(60_000)
    lid, permits = await running_lease(bed, "x")
    assert permits == 9
    bed.reset()
    await bed.clock.advance(60_000)
    rx, ry = await bed.round(request("x", {}, leases=[(lid, 9, 0)], oldest_at=0),
                             request("honest", {"g": 10}, oldest_at=1))
    assert by_id(rx, "leases")[lid]["status"] == "retired"
    assert held(ry) == 10
    bed.check()


def test_r32_lease_secret_option_is_validated():
    # R32: lease_secret is a str or bytes of at least 16 bytes (a real application secret).
    for bad in ("short", b"", 12345, ["x" * 32], "\ud800" * 16):
        with pytest.raises(ConfigurationError) as info:
            Bed(10, leases=STRICT, lease_secret=bad)
        assert info.value.field == "lease_secret"
    Bed(10, leases=STRICT, lease_secret=b"\x00" * 16), Bed(10, leases=STRICT, lease_secret="é" * 8)


@async_test
async def test_r32_unknown_lease_answered_retired_and_charged_for_that_round_only():
    # R32: a report of a lease issued to x before a storage reset (its row is gone) is answered
    # retired and its drawn - released is charged for that round only.
    bed = Bed(5, leases=leases("strict", permitsPerLease=3), lease_secret=APP_SECRET)
    (r,) = await bed.round(request("x", {"g": 1}, leases=[], oldest_at=0))  # grant 1 + lease 3
    lid = only(r)["leaseId"]
    bed.reset()
    rx, ry = await bed.round(
        request("x", {}, leases=[(lid, 3, 1)], oldest_at=1),
        request("y", {"g": 5}, oldest_at=2),
    )
    stale = by_id(rx, "leases")[lid]
    assert stale["status"] == "retired" and stale["group"] is None
    # y gets 5 - (3 - 1) = 3: the report's live footprint is charged this round.
    assert only(ry, "grants")["permits"] == 3
    assert lid not in bed.leases()
    # The charge is transient: next round (no report) y gets the remaining 5 - 3 = 2.
    first = only(ry, "grants")["grantId"]
    (ry2,) = await bed.round(request("y", {"g": 2}, grants=[(first, 3, 0)], oldest_at=2))
    assert [x["permits"] for x in ry2["grants"] if x["grantId"] != first] == [2]
    assert await total_charged(bed) == 5
    bed.check()


@async_test
async def test_r32_unknown_stopped_settled_report_is_answered_settled_without_charge():
    bed = Bed(5, leases=leases("strict"))
    rx, ry = await bed.round(
        request("x", {}, leases=[("gone", 3, 3, True)], oldest_at=1),
        request("y", {"g": 5}, oldest_at=2),
    )
    assert by_id(rx, "leases")["gone"]["status"] == "settled"
    assert only(ry, "grants")["permits"] == 5
    # A stopped report with work still running is retired; it is charged (5 - (3 - 1) = 3) if
    # its id is one issued to x before a storage reset, not if it is fabricated.
    bed2 = Bed(5, leases=leases("strict", permitsPerLease=3), lease_secret=APP_SECRET)
    (r,) = await bed2.round(request("x", {"g": 1}, leases=[], oldest_at=0))
    lid = only(r)["leaseId"]
    bed2.reset()
    rx, ry = await bed2.round(
        request("x", {}, leases=[(lid, 3, 1, True), ("gone", 3, 1, True)], oldest_at=1),
        request("y", {"g": 5}, oldest_at=2),
    )
    assert by_id(rx, "leases")[lid]["status"] == "retired"
    assert by_id(rx, "leases")["gone"]["status"] == "retired"
    assert only(ry, "grants")["permits"] == 3
    # its settle report is answered settled and charged nothing
    rx, ry = await bed2.round(request("x", {}, leases=[(lid, 3, 3, True)], oldest_at=1),
                              request("z", {"g": 5}, oldest_at=2))
    assert by_id(rx, "leases")[lid]["status"] == "settled" and only(ry, "grants")["permits"] == 5 - 3
    # sync: answered the same way, nothing stored
    reply = await bed2.sem.handle(sync("x", leases=[("other", 2, 0)]))
    assert by_id(reply, "leases")["other"]["status"] == "retired"
    assert bed2.leases() == {}
    bed.check(), bed2.check()


@async_test
async def test_r32_an_unknown_pre_reset_lease_not_stopped_is_charged_what_it_may_still_run():
    # R32: before its stop a pre-reset lease's client may still draw: a report of one with
    # nothing drawn (or everything released) is charged permits - released, not 0.
    secret = APP_SECRET.encode()
    bed = Bed(10, leases=leases("strict", permitsPerLease=3), lease_secret=APP_SECRET)
    await bed.sem.handle(sync("warm-up"))
    _, ry = await bed.round(
        request("x", {}, leases=[(minted(bed, "x", "n0", 2, secret=secret), 0, 0)], oldest_at=1),
        request("y", {"g": 10}, oldest_at=2),
    )
    assert only(ry, "grants")["permits"] == 10 - 2
    bed.check()


@async_test
async def test_r32_lease_of_another_client_is_treated_as_unknown():
    bed = Bed(100, leases=leases("strict", permitsPerLease=4))
    (ra,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    lid = only(ra)["leaseId"]
    reply = await bed.sem.handle(sync("b", leases=[(lid, 4, 4, True)]))
    assert by_id(reply, "leases")[lid]["status"] == "settled"
    row = bed.leases()[lid]  # a's lease untouched
    assert (row["drawn"], row["released"], row["status"]) == (0, 0, "live")
    bed.check()


@async_test
async def test_r32_unknown_lease_charge_is_bounded_by_permits_per_lease_and_the_ceiling():
    # R32: a pre-reset report is charged min(drawn - released, the id's permits), at most
    # permitsPerLease per client per round and at most the ceiling in total: drawn near 2**53,
    # repeated every round, withholds no more than that.
    secret = APP_SECRET.encode()
    bed = Bed(10, leases=leases("strict", permitsPerLease=3), lease_secret=APP_SECRET)
    await bed.sem.handle(sync("warm-up"))  # schema (no lease issued: no epoch yet)
    rx, ry = await bed.round(
        request("x", {}, leases=[(minted(bed, "x", "n0", 64, secret=secret), HUGE, 0)], oldest_at=1),
        request("y", {"g": 10}, oldest_at=2),
    )
    assert only(rx)["status"] == "retired"
    assert only(ry, "grants")["permits"] == 10 - 3  # charged min(huge - 0, 64, 3)
    # the id's permits bound it too: a 2-permit lease reported with drawn huge charges 2
    await bed.clock.advance(60_000)
    _, ry = await bed.round(
        request("x", {}, leases=[(minted(bed, "x", "n1", 2, secret=secret), HUGE, 0)], oldest_at=1),
        request("y", {"g": 10}, oldest_at=2),
    )
    assert held(ry) == 10 - 2
    # Two pre-reset ids of x (3 for x in all) plus one of w (3): 6, so z gets 10 - 6 = 4.
    bed2 = Bed(10, leases=leases("strict", permitsPerLease=3), lease_secret=APP_SECRET)
    await settled_lease(bed2, "seed")  # the storage has an epoch of its own
    _, _, rz = await bed2.round(
        request("x", {}, leases=[(minted(bed2, "x", "n1", 64, secret=secret), HUGE, 0),
                                 (minted(bed2, "x", "n2", 64, secret=secret), HUGE, 1)], oldest_at=1),
        request("w", {}, leases=[(minted(bed2, "w", "n3", 64, secret=secret), HUGE, 0)], oldest_at=2),
        request("z", {"g": 10}, oldest_at=3),
    )
    assert only(rz, "grants")["permits"] == 4
    # over: the total charge is bounded by the ceiling limit + extra (4 + 2 = 6); with 10
    # clients charged 3 each the grants see room 0, and nothing is stored or persisted.
    bed3 = Bed(4, leases=leases("over", extra={"count": 2}, permitsPerLease=3), lease_secret=APP_SECRET)
    await bed3.sem.handle(sync("warm-up"))
    replies = await bed3.round(
        *[request(f"c{i}", {}, leases=[(minted(bed3, f"c{i}", "n", 3, secret=secret), HUGE, 0)], oldest_at=1)
          for i in range(10)],
        request("y", {"g": 4}, oldest_at=2),
    )
    ry = replies[-1]
    assert ry["grants"] == [] and blocked(ry) == {"g": ("limit", 4)}
    assert bed3.leases() == {} and (await bed3.usage())["leaseFootprint"] == 0
    (ry,) = await bed3.round(request("y", {"g": 4}, oldest_at=2))
    assert only(ry, "grants")["permits"] == 4
    bed.check(), bed2.check(), bed3.check()


MALLORY = {
    "strict": ({"leases": STRICT}, 10),
    "under": ({"leases": leases("under", reserve=2)}, 8),  # grants at most 10 - 2
    "over": ({"leases": leases("over", extra={"count": 2})}, 10),
    "can_grant": ({"leases": STRICT, "can_grant": lambda c, g: c != "mallory"}, 10),
    "lease_secret": ({"leases": STRICT, "lease_secret": APP_SECRET}, 10),
}


@pytest.mark.parametrize("mode", sorted(MALLORY))
@async_test
async def test_r32_fabricated_lease_reports_are_charged_nothing_and_starve_no_one(mode):
    # R32 (review fault): with permitsPerLease (64) >= limit, fabricated reports repeated every
    # round used to charge the whole ceiling: every other client was blocked with `limit` and
    # usage() showed nothing. Ids that do not verify (no mac, macs of the right shape with
    # another epoch, a non-ASCII "mac", an old-format id, and with a secret in place) are
    # answered retired and charged nothing.
    options, grant_room = MALLORY[mode]
    bed = Bed(10, **options)
    await settled_lease(bed, "seed", drawn=2)  # the holder has issued leases: it has a secret
    for i in range(5):
        forged = [f"ghost{i}", f"ghost{i}.{'0' * 32}", f"ghost{i}.{'é' * 32}", f"ghost{i}.{'A' * 32}",
                  f"ghost{i}.{'0' * 8}.64.{'0' * 32}", f"ghost{i}.ffffffff.9.{'a' * 32}",
                  f"ghost{i}.{'0' * 8}.064.{'0' * 32}", f"ghost{i}.{'0' * 8}.64.{'é' * 32}"]
        rx, ry = await bed.round(
            request("mallory", {}, leases=[(x, 64, 0) for x in forged], oldest_at=0),
            request("honest", {"g": 10}, oldest_at=1),
        )
        assert {x["leaseId"]: x["status"] for x in rx["leases"]} == dict.fromkeys(forged, "retired")
        # honest holds all the grant room every round (its grant, or a new one after reclaim)
        assert held(ry) == grant_room, (i, ry)
        assert ("limit" not in {b["reason"] for b in ry["blocked"]}) == (grant_room == 10)
        usage = await bed.usage()
        assert usage["leaseFootprint"] == 0 and usage["outstanding"] == grant_room
    assert bed.leases() == {}
    bed.check()


@async_test
async def test_r32_secret_and_epoch_survive_an_eviction():
    # R32: the secret and epoch are durable (meta rows, written once): after an eviction a
    # stale report of a lease issued and settled before it is recognised as this storage's
    # (same epoch) and charged nothing, and the new instance issues ids under the same secret
    # and epoch.
    bed = Bed(10, leases=STRICT)
    lid = await settled_lease(bed, "x")  # grant 1 + lease 9, settled
    keys = id_state(bed)
    bed.evict()
    rx, ry = await bed.round(
        request("x", {}, leases=[(lid, 3, 1), ("forged", 3, 1)], oldest_at=0),
        request("honest", {"g": 10}, oldest_at=1),
    )
    assert by_id(rx, "leases")[lid]["status"] == "retired"
    assert by_id(rx, "leases")["forged"]["status"] == "retired"
    assert only(ry, "grants")["permits"] == 10
    assert LEASE_ID.match(lid) and bed.secrets_made == 1
    assert len(keys) == 9 and all(0 <= v < 2**32 for v in keys.values())
    assert int(LEASE_ID.match(lid)["epoch"], 16) == keys["lease_epoch"]
    # a lease issued by the new instance carries a mac under the same secret, in the same epoch
    await bed.clock.advance(60_000)  # honest's grant is reclaimed
    (ra,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=2))
    from semaphore.core.lease_ids import verified_lease_id

    parts = verified_lease_id(bed_secret(bed), "a", only(ra)["leaseId"])
    assert parts is not None and parts.epoch == keys["lease_epoch"] and parts.permits == 9
    assert id_state(bed) == keys
    assert bed.secrets_made == 1
    bed.check()


@async_test
async def test_r32_another_clients_genuine_lease_ids_are_charged_nothing():
    # R32: the mac binds the client id: mallory reporting x's ids (one issued before a storage
    # reset, which x itself would be charged for, and x's live lease) is answered retired and
    # charged nothing; x's live lease is untouched.
    bed = Bed(10, leases=leases("strict", permitsPerLease=3), lease_secret=APP_SECRET)
    (r,) = await bed.round(request("x", {"g": 1}, leases=[], oldest_at=0))
    before_reset = only(r)["leaseId"]
    bed.reset()
    (rx,) = await bed.round(request("x", {"g": 1}, leases=[], oldest_at=0))  # grant 1 + lease 3
    live = only(rx)["leaseId"]
    rm, ry = await bed.round(
        request("mallory", {}, leases=[(before_reset, 3, 1), (live, 3, 0)], oldest_at=0),
        request("honest", {"g": 10}, oldest_at=1),
    )
    assert {x["leaseId"]: x["status"] for x in rm["leases"]} == {before_reset: "retired", live: "retired"}
    assert only(ry, "grants")["permits"] == 10 - 4  # only x's grant and live lease are charged
    row = bed.leases()[live]
    assert (row["drawn"], row["released"], row["status"], row["client_id"]) == (0, 0, "live", "x")
    # x's own report of the same pre-reset id is charged its 3 - 1 = 2
    await bed.clock.advance(60_000)
    _, ry = await bed.round(request("x", {}, leases=[(before_reset, 3, 1), (live, 0, 0)], oldest_at=0),
                            request("honest", {"g": 10}, oldest_at=1))
    assert held(ry) == 10 - 3 - 2  # x's unclaimed grant of 1 was reclaimed; its lease 3 remains
    bed.check()


def _holder(**options):
    """A holder on the test bed with the library's defaults (Bed always passes id_factory)."""
    bed = Bed(10, leases=STRICT)
    bed.sem = DurabilitySemaphore(scheduler=bed.scheduler, clock=bed.clock, limit=10, leases=STRICT,
                                  **options)
    return bed


BAD_NONCES = ["new\nline", "nul\x00byte", "c1\x85", "del\x7f", "", 42]


@async_test
async def test_r32_lease_ids_stay_in_the_wire_alphabet_and_within_256_characters():
    # R32/R7: a lease id is <nonce>.<8 hex epoch>.<permits>.<32 hex mac>: with the default
    # factory 24 + 1 + 8 + 1 + 1 + 1 + 32 = 68 characters for 9 permits; it verifies for its
    # client only, carries the storage's epoch and its permits, and round-trips as a report.
    from semaphore.core.lease_ids import LEASE_NONCE_MAX, verified_lease_id

    bed = _holder()
    (ra,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=0))
    lid = only(ra)["leaseId"]
    assert re.fullmatch(r"[0-9a-f]{24}\.[0-9a-f]{8}\.9\.[0-9a-f]{32}", lid) and id_problem(lid) is None
    parts = verified_lease_id(bed_secret(bed), "a", lid)
    assert parts is not None and (parts.epoch, parts.permits) == (meta(bed)["lease_epoch"], 9)
    assert verified_lease_id(bed_secret(bed), "b", lid) is None
    assert verified_lease_id(bed_secret(bed), "a", lid[:-1] + ("0" if lid[-1] != "0" else "1")) is None
    assert verified_lease_id(bed_secret(bed), "a", lid.replace(".9.", ".8.")) is None  # permits are signed
    # The longest nonce the holder takes: 197 characters, so with 16 permit digits (a lease
    # of 2**53 - 2 permits) the id is exactly 256. Nonces may contain dots.
    assert LEASE_NONCE_MAX == 197
    n = itertools.count()
    big = leases("strict", permitsPerLease=HUGE)
    for factory, permits in ((lambda: f"{next(n):0197d}", HUGE - 1), (lambda: f"a.b.{next(n)}", HUGE - 1)):
        bed = Bed(HUGE, leases=big)
        bed.sem = DurabilitySemaphore(scheduler=bed.scheduler, clock=bed.clock, limit=HUGE, leases=big,
                                      id_factory=factory)
        (ra,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=0))
        lid = only(ra)["leaseId"]
        assert only(ra)["permits"] == permits and id_problem(lid) is None and LEASE_ID.match(lid)
        assert len(lid) <= 256 and verified_lease_id(bed_secret(bed), "a", lid).permits == permits
        (ra,) = await bed.round(request("a", {"g": 1}, leases=[(lid, 1, 0)], oldest_at=0))
        assert by_id(ra, "leases")[lid]["status"] == "live" and bed.leases()[lid]["drawn"] == 1
    bed.check()


@async_test
async def test_r32_an_id_factory_nonce_outside_the_wire_alphabet_is_a_configuration_error(caplog):
    # R32/R7: one character more than 197, or a nonce outside the wire alphabet
    # (semaphore.wire.id_problem: control characters, empty, not a str), cannot make a valid
    # lease id: the round fails with a ConfigurationError naming id_factory and writes nothing.
    for nonce in [f"{0:0198d}", *BAD_NONCES]:
        bed = _holder(id_factory=lambda: nonce)
        await bed.sem.handle(sync("a"))
        before = bed.dump()
        caplog.clear()
        (ra,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=0))
        assert "error" in ra and ra["error"]["code"] == "round_failed", (nonce, ra)
        assert "id_factory" in ra["error"]["message"]
        assert any(r.exc_info and isinstance(r.exc_info[1], ConfigurationError) for r in caplog.records)
        assert bed.dump() == before
        bed.check()


@async_test
async def test_r32_secret_is_written_once_and_costs_no_statement():
    # R32/R2: the secret and epoch travel in the round's own meta upsert (written once, by the
    # first round that issues a lease) and are read from the meta rows the round loads anyway:
    # the round that creates them runs as many statements as the same round later, and a round
    # that charges a pre-reset report as many as one with a fabricated or settled report.
    for options in ({}, {"lease_secret": APP_SECRET}):
        bed = Bed(100, leases=leases("strict", permitsPerLease=2), **options)
        await bed.sem.handle(sync("warm-up"))  # schema and instance start outside the counts

        async def statements(*messages) -> int:
            before = bed.storage.statements
            replies = await bed.round(*messages)
            count = bed.storage.statements - before
            for m, r in zip(messages, replies):  # release the grants: each round starts alike
                await bed.sem.handle(sync(m["clientId"], [(g["grantId"], 1, 1) for g in r["grants"]]))
            return count

        first = await statements(request("a", {"g": 1}, leases=[]), request("b", {"h": 1}, leases=[]))
        rows = id_state(bed)
        # with lease_secret only the epoch is stored; without it, the secret too
        assert set(rows) == {"lease_epoch", *([] if options else [f"lease_key_{i}" for i in range(8)])}
        assert bed.secrets_made == 1
        later = await statements(request("c", {"i": 1}, leases=[]), request("d", {"j": 1}, leases=[]))
        assert first == later
        secret = APP_SECRET.encode() if options else bed_secret(bed)
        pre_reset = await statements(request("x", {}, leases=[(minted(bed, "x", "n1", 2, secret=secret), 2, 0)]))
        forged = await statements(request("x", {}, leases=[("forged.n1", 2, 0)]))
        assert pre_reset == forged
        assert id_state(bed) == rows
        assert bed.secrets_made == 1
        bed.check()


# ====================================================================== R33 retirement


@async_test
async def test_r33_group_gaining_a_limit_under_exclude_retires_its_leases():
    limits: dict[str, int] = {}
    bed = Bed(100, group_limit=lambda g: limits.get(g), leases=leases("strict", permitsPerLease=4))
    (ra,) = await bed.round(request("a", {"g": 1, "h": 1}, leases=[], oldest_at=1))
    ids = {x["group"]: x["leaseId"] for x in ra["leases"]}
    limits["g"] = 50
    await bed.round(request("b", {"z": 1}, oldest_at=2))  # any round, even without a
    rows = bed.leases()
    assert rows[ids["g"]]["status"] == "retired" and rows[ids["h"]]["status"] == "live"
    # retired footprint still counts against the group's new limit (R19)
    u = await bed.usage()
    assert u["groups"]["g"]["leaseFootprint"] == 4 and u["groups"]["g"]["retiredLeases"] == 1
    bed.check()


@async_test
async def test_r33_within_group_limit_keeps_leases_when_the_group_gains_a_limit():
    limits: dict[str, int] = {}
    bed = Bed(100, group_limit=lambda g: limits.get(g),
              leases=leases("strict", permitsPerLease=4, limitedGroups="withinGroupLimit"))
    (ra,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    lid = only(ra)["leaseId"]
    limits["g"] = 50
    await bed.round(request("b", {"z": 1}, oldest_at=2))
    assert bed.leases()[lid]["status"] == "live"


@async_test
async def test_r33_can_grant_turning_false_retires_the_clients_leases():
    denied: set[tuple[str, str]] = set()
    bed = Bed(100, can_grant=lambda c, g: (c, g) not in denied, leases=leases("strict", permitsPerLease=4))
    (ra,) = await bed.round(request("a", {"g": 1, "h": 1}, leases=[], oldest_at=1))
    ids = {x["group"]: x["leaseId"] for x in ra["leases"]}
    denied.add(("a", "g"))
    (ra,) = await bed.round(request("a", {}, leases=[]))
    states = by_id(ra, "leases")
    assert states[ids["g"]]["status"] == "retired" and states[ids["h"]]["status"] == "live"
    bed.check()


@async_test
async def test_r33_lowering_the_limit_retires_live_leases_raising_does_not():
    current = {"limit": 100}
    bed = Bed(lambda: current["limit"], leases=leases("strict", permitsPerLease=4))
    (ra,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    lid = only(ra)["leaseId"]
    current["limit"] = 200
    await bed.round(request("b", {"z": 1}, oldest_at=2))
    assert bed.leases()[lid]["status"] == "live"
    current["limit"] = 150  # lower than the previous round's 200
    await bed.round(request("b", {"z": 1}, oldest_at=2))
    assert bed.leases()[lid]["status"] == "retired"
    assert (await bed.usage())["leaseFootprint"] == 4
    bed.check()


# ====================================================================== R8 re-sending leases


@async_test
async def test_r8_reply_carries_the_clients_live_and_retired_leases_it_did_not_mention():
    limits: dict[str, int] = {}
    bed = Bed(100, group_limit=lambda g: limits.get(g), leases=leases("strict", permitsPerLease=4))
    (ra,) = await bed.round(request("a", {"g1": 1, "g2": 1}, leases=[], oldest_at=1))
    (rb,) = await bed.round(request("b", {"g1": 1}, leases=[], oldest_at=1))
    ids = {x["group"]: x["leaseId"] for x in ra["leases"]}
    limits["g2"] = 10  # retires a's g2 lease at the next round
    (ra2,) = await bed.round(request("a", {}, leases=[]))
    states = by_id(ra2, "leases")
    assert {lid: s["status"] for lid, s in states.items()} == {ids["g1"]: "live", ids["g2"]: "retired"}
    assert only(rb)["leaseId"] not in states  # only the client's own leases
    reply = await bed.sem.handle(sync("a"))
    assert set(by_id(reply, "leases")) == set(ids.values())
    # a client without lease support still hears about its leases
    (ra3,) = await bed.round(request("a", {"g1": 1}))
    assert set(ids.values()) <= set(by_id(ra3, "leases"))


# ====================================================================== R38 usage


@async_test
async def test_r38_usage_reports_lease_footprint_per_group_and_total():
    limits: dict[str, int] = {}
    bed = Bed(100, group_limit=lambda g: limits.get(g), leases=leases("strict", permitsPerLease=4))
    (ra,) = await bed.round(request("a", {"g": 2, "h": 1}, leases=[], oldest_at=1))
    ids = {x["group"]: x["leaseId"] for x in ra["leases"]}
    await bed.sem.handle(sync("a", leases=[(ids["g"], 3, 1)]))
    limits["h"] = 20
    await bed.round(request("b", {}, leases=[]))  # retires h's lease (R33)
    u = await bed.usage()
    assert u["limit"] == 100
    assert u["outstanding"] == 3 and u["leaseFootprint"] == (4 - 1) + 4
    assert u["liveLeases"] == 1 and u["retiredLeases"] == 1
    assert u["groups"]["g"] == {"outstanding": 2, "leaseFootprint": 3, "liveLeases": 1,
                                "retiredLeases": 0, "limit": None, "charged": 5, "available": 90}
    assert u["groups"]["h"] == {"outstanding": 1, "leaseFootprint": 4, "liveLeases": 0,
                                "retiredLeases": 1, "limit": 20, "charged": 5, "available": 15}
    agg = bed.check()
    assert agg["total"]["lease_footprint"] == u["leaseFootprint"]


# ====================================================================== LeaseConfig


def test_lease_config_defaults_and_both_spellings():
    camel = LeaseConfig.parse({"provisioning": {"mode": "over", "extra": {"ratio": 0.5}},
                               "permitsPerLease": 16, "ttlMs": 5_000, "limitedGroups": "withinGroupLimit"})
    snake = LeaseConfig.parse({"provisioning": {"mode": "over", "extra": {"ratio": 0.5}},
                               "permits_per_lease": 16, "ttl_ms": 5_000, "limited_groups": "within_group_limit"})
    assert camel == snake
    assert camel.mode is Provisioning.OVER and camel.extra(10) == 5 and camel.extra(3) == 1
    assert camel.limited_groups is LimitedGroups.WITHIN_GROUP_LIMIT
    d = LeaseConfig.parse({})
    assert (d.mode, d.permits_per_lease, d.ttl_ms, d.limited_groups) == (
        Provisioning.STRICT, 64, 1_800_000, LimitedGroups.EXCLUDE)
    assert LeaseConfig.parse({"provisioning": {"mode": "over", "extra": {"count": 7}}}).extra(100) == 7
    assert LeaseConfig.parse(None) is None


@pytest.mark.parametrize("value,field", [
    ({"provisioning": {"mode": "under", "reserve": -1}}, "leases.provisioning.reserve"),
    ({"provisioning": {"mode": "under"}}, "leases.provisioning.reserve"),
    ({"provisioning": {"mode": "over", "extra": {"ratio": -0.1}}}, "leases.provisioning.extra.ratio"),
    ({"provisioning": {"mode": "over", "extra": {"ratio": float("nan")}}}, "leases.provisioning.extra.ratio"),
    ({"provisioning": {"mode": "over", "extra": {"count": -1}}}, "leases.provisioning.extra.count"),
    ({"provisioning": {"mode": "over"}}, "leases.provisioning.extra"),
    ({"provisioning": {"mode": "over", "extra": {"ratio": 1, "count": 1}}}, "leases.provisioning.extra"),
    ({"provisioning": {"mode": "strict", "reserve": 2}}, "leases.provisioning.reserve"),
    ({"provisioning": {"mode": "strict", "extra": {"count": 2}}}, "leases.provisioning.extra"),
    ({"provisioning": {"mode": "under", "reserve": 2, "resreve": 1}}, "leases.provisioning"),
    ({"provisioning": {"mode": "fast"}}, "leases.provisioning.mode"),
    ({"provisioning": "strict"}, "leases.provisioning"),
    ({"permitsPerLease": 0}, "leases.permitsPerLease"),
    ({"permits_per_lease": 1.5}, "leases.permitsPerLease"),
    ({"ttlMs": 0}, "leases.ttlMs"),
    ({"ttl_ms": True}, "leases.ttlMs"),
    ({"permitsPerLease": 4, "permits_per_lease": 4}, "leases.permitsPerLease"),
    ({"limitedGroups": "exclude", "limited_groups": "exclude"}, "leases.limitedGroups"),
    ({"limitedGroups": "sometimes"}, "leases.limitedGroups"),
    ({"limitedGroups": ["exclude"]}, "leases.limitedGroups"),
    ({"permitsPerLeas": 4}, "leases"),
    ("strict", "leases"),
])
def test_lease_config_validation_errors_are_clear(value, field):
    with pytest.raises(ConfigurationError) as info:
        LeaseConfig.parse(value)
    assert info.value.field == field
    assert field.split(".")[-1] in str(info.value)


def test_lease_config_direct_construction_validates_and_coerces():
    # Built directly with plain strings, the mode must still be honoured (not silently strict).
    config = LeaseConfig(mode="over", extra_count=3)
    assert config.mode is Provisioning.OVER and config.extra(10) == 3
    assert LeaseConfig(limited_groups="withinGroupLimit").limited_groups is LimitedGroups.WITHIN_GROUP_LIMIT
    for bad in (dict(mode="fast"), dict(mode="over"), dict(permits_per_lease=0), dict(ttl_ms=-5),
                dict(mode="under", reserve=-1), dict(mode="strict", extra_count=2),
                dict(limited_groups="never")):
        with pytest.raises(ConfigurationError):
            LeaseConfig(**bad)


def test_holder_rejects_bad_lease_options_at_construction():
    with pytest.raises(ConfigurationError):
        Bed(5, leases={"provisioning": {"mode": "under", "reserve": -2}})


@async_test
async def test_r33_a_reported_lease_retired_by_the_same_round_is_answered_retired():
    # R33: "a retired lease stops drawing at once on the client": the reply of the round that
    # retires a lease must say so even when the message also reported that lease (the report is
    # applied before the retirement)
    limit = {"value": 10}
    bed = Bed(lambda: limit["value"], leases=leases("strict", permitsPerLease=4))
    (ra,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    lid = only(ra)["leaseId"]
    limit["value"] = 2  # lowered below the previous round's limit
    (ra,) = await bed.round(request("a", {"g": 1}, leases=[(lid, 1, 0)]))
    assert bed.leases()[lid]["status"] == "retired"
    assert by_id(ra, "leases")[lid]["status"] == "retired"
    bed.check()


@async_test
async def test_r33_can_grant_turning_false_retires_leases_of_clients_not_in_the_round():
    # R33: a client living off its lease may never send a request; can_grant turning false must
    # still retire its lease at the next round (whoever is in that round)
    denied: set[tuple[str, str]] = set()
    bed = Bed(100, can_grant=lambda c, g: (c, g) not in denied, leases=leases("strict", permitsPerLease=4))
    (ra,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    lid = only(ra)["leaseId"]
    denied.add(("a", "g"))
    await bed.round(request("b", {"h": 1}, leases=[]))  # a round without client a
    assert bed.leases()[lid]["status"] == "retired"
    (sa,) = await bed.round(sync("a", leases=[(lid, 1, 0)]))
    assert by_id(sa, "leases")[lid]["status"] == "retired"
    bed.check()


# ---------------------------------------------------------------------------- the default leases
@async_test
async def test_the_holder_given_no_leases_option_issues_the_default_reusable_leases():
    # SPEC §7, decision "the default leases": no leases= is DEFAULT_LEASES (strict, reusable,
    # leaseFirst, recheck 30 s); leases=None issues none (every permit a grant, the original's).
    from semaphore import DEFAULT_LEASES
    assert DEFAULT_LEASES == LeaseConfig(reusable=True, lease_first=True, recheck_ms=30_000)
    bed = Bed(10)
    assert bed.sem.leases == DEFAULT_LEASES
    [a] = await bed.round(request("a", {"g": 3}, leases=[]))
    assert a["grants"] == [] and [(x["permits"], x.get("reusable")) for x in a["leases"]] == [(3, True)]
    assert a["leaseRecheckMs"] == 30_000
    off = Bed(10, leases=None)
    assert off.sem.leases is None
    [b] = await off.round(request("a", {"g": 3}, leases=[]))
    assert b["leases"] == [] and [g["permits"] for g in b["grants"]] == [3]


def test_the_simulators_default_scenario_runs_the_default_leases():
    # "Defaults are the product": the simulator and the benchmark's `defaults` row run what a
    # holder given only its limit runs.
    from semaphore import DEFAULT_LEASES
    from semaphore.simulate import Scenario
    assert LeaseConfig.parse(Scenario().lease_options()) == DEFAULT_LEASES
