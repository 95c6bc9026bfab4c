"""Tier 1: the pure allocation function (SPEC §6, issuance part of §7) on hand-computed cases."""

from __future__ import annotations

from semaphore.core.allocation import LIMIT_ERROR, Entry, Usage, allocate, grant_ceiling
from semaphore.core.config import LeaseConfig, LimitedGroups, Provisioning
from semaphore.core.wire import BlockedReason as R


def E(client, group, need, oldest_at=0, arrival=0, *, count=None, permitted=True, lease=False):
    return Entry(client_id=client, group=group, count=need if count is None else count,
                 oldest_at=oldest_at, arrival=arrival, need=need, permitted=permitted,
                 lease_candidate=lease)


def blocked(result):
    return {(c, g): (reason, waiting) for c, g, reason, waiting in result.blocked}


STRICT = LeaseConfig(mode=Provisioning.STRICT, permits_per_lease=4)


def test_r21_order_oldest_then_arrival_then_client_id():
    # R21: ascending oldestAt; ties by arrival, then clientId.
    entries = [
        E("d", "g", 1, oldest_at=50, arrival=0),
        E("c", "g", 1, oldest_at=10, arrival=3),
        E("b", "g", 1, oldest_at=10, arrival=1),
        E("a", "g", 1, oldest_at=10, arrival=1),
    ]
    r = allocate(entries, limit=3, group_limits={}, usage=Usage())
    assert r.grants == {("a", "g"): 1, ("b", "g"): 1, ("c", "g"): 1}
    assert blocked(r) == {("d", "g"): (R.LIMIT, 1)}
    r = allocate(entries, limit=1, group_limits={}, usage=Usage())
    assert r.grants == {("a", "g"): 1}
    # blocked list in serving order
    assert [(c, g) for c, g, *_ in r.blocked] == [("b", "g"), ("c", "g"), ("d", "g")]


def test_r21_min_of_need_room_and_group_room():
    # R21: each entry gets min(need, room under limit, room under its group limit).
    r = allocate(
        [E("a", "x", 5, 1), E("b", "y", 5, 2), E("c", "x", 5, 3)],
        limit=9, group_limits={"x": 6}, usage=Usage(grants=1, groups={"x": 1}),
    )
    # room 8: a gets min(5, 8, 5) = 5; b min(5, 3) = 3; c: group x room 0 -> nothing
    assert r.grants == {("a", "x"): 5, ("b", "y"): 3}
    assert blocked(r) == {("b", "y"): (R.LIMIT, 2), ("c", "x"): (R.GROUP_LIMIT, 5)}
    assert r.contended


def test_r20_r21_need_zero_skipped_not_blocked_one_grant_per_entry():
    # R20/R21: an entry with no need gets nothing and is not blocked; never more than need;
    # one grant per (client, group).
    r = allocate([E("a", "g", 0, count=4), E("b", "g", 2)], limit=100, group_limits={}, usage=Usage())
    assert r.grants == {("b", "g"): 2}
    assert r.blocked == [] and not r.contended


def test_r19_usage_counts_grants_and_leases():
    # R19: room = limit - grant charge - lease footprint.
    r = allocate([E("a", "g", 10)], limit=10, group_limits={}, usage=Usage(grants=3, leases=4))
    assert r.grants == {("a", "g"): 3}
    assert blocked(r) == {("a", "g"): (R.LIMIT, 7)}


def test_r24_over_the_limit_admits_nothing():
    # R24: charged above a lowered limit: room is zero, never negative.
    r = allocate([E("a", "g", 1), E("b", "h", 1)], limit=2, group_limits={"h": 1},
                 usage=Usage(grants=5, groups={"h": 3}))
    assert r.grants == {}
    assert blocked(r) == {("a", "g"): (R.LIMIT, 1), ("b", "h"): (R.GROUP_LIMIT, 1)}


def test_r12_r23_limit_error_blocks_everything_with_resolution_error():
    # R12: limit failed -> nothing admitted (no leases either), reason limit_resolution_error,
    # except not_permitted, which comes first (R23).
    r = allocate([E("a", "g", 2, lease=True), E("b", "g", 1, permitted=False)],
                 limit=LIMIT_ERROR, group_limits={}, usage=Usage(), leases=STRICT)
    assert r.grants == {} and r.leases == {}
    assert blocked(r) == {("a", "g"): (R.LIMIT_RESOLUTION_ERROR, 2), ("b", "g"): (R.NOT_PERMITTED, 1)}


def test_r12_group_limit_error_fails_only_that_group():
    # R12: a group whose limit failed is closed for the round; others proceed.
    r = allocate([E("a", "bad", 2, 0), E("a", "ok", 2, 1)], limit=10,
                 group_limits={"bad": LIMIT_ERROR, "ok": None}, usage=Usage())
    assert r.grants == {("a", "ok"): 2}
    assert blocked(r) == {("a", "bad"): (R.LIMIT_RESOLUTION_ERROR, 2)}


def test_r22_r23_reason_order():
    # R23: not_permitted > limit_resolution_error > group_limit > limit.
    r = allocate(
        [
            E("a", "err", 1, 0, permitted=False),
            E("b", "err", 1, 1),
            E("c", "capped", 4, 2),
            E("d", "free", 4, 3),
        ],
        limit=4, group_limits={"err": LIMIT_ERROR, "capped": 2}, usage=Usage(),
    )
    # c: group room 2 < need 4 -> gets 2, group_limit; d: room 2 left -> gets 2, limit
    assert r.grants == {("c", "capped"): 2, ("d", "free"): 2}
    assert blocked(r) == {
        ("a", "err"): (R.NOT_PERMITTED, 1),
        ("b", "err"): (R.LIMIT_RESOLUTION_ERROR, 1),
        ("c", "capped"): (R.GROUP_LIMIT, 2),
        ("d", "free"): (R.LIMIT, 2),
    }


def test_r23_limit_reason_when_group_room_would_have_sufficed():
    # R23: group room >= need, stopped by the shared limit -> limit.
    r = allocate([E("a", "g", 3)], limit=1, group_limits={"g": 5}, usage=Usage())
    assert r.grants == {("a", "g"): 1} and blocked(r) == {("a", "g"): (R.LIMIT, 2)}


def test_r23_limit_reason_when_the_account_has_less_room_than_the_group():
    # R23: the first constraint that stopped the entry is the one that ran out first. The
    # group has room for 2, the account for 0 (a lease holds it all): the limit stopped it.
    r = allocate([E("b", "small", 3)], limit=3, group_limits={"small": 2}, usage=Usage(leases=3))
    assert r.grants == {} and blocked(r) == {("b", "small"): (R.LIMIT, 3)}
    # Room 1 under the account, 2 under the group: 1 granted, the limit stopped the rest.
    r = allocate([E("b", "small", 3)], limit=3, group_limits={"small": 2}, usage=Usage(leases=2))
    assert r.grants == {("b", "small"): 1} and blocked(r) == {("b", "small"): (R.LIMIT, 2)}
    # Both run out at 2: the group limit comes first in R23's order.
    r = allocate([E("b", "small", 3)], limit=3, group_limits={"small": 2}, usage=Usage(leases=1))
    assert r.grants == {("b", "small"): 2} and blocked(r) == {("b", "small"): (R.GROUP_LIMIT, 1)}


STRICT_FIRST = LeaseConfig(mode=Provisioning.STRICT, permits_per_lease=4, lease_first=True)


def test_r28a_lease_first_serves_older_entries_that_cannot_take_a_lease_before_the_lease():
    # R28a with R21: n (no lease support, R5) is older than the candidate a: its grant comes
    # first, and a's lease takes what it leaves. Before, a's lease took all 4 and n waited.
    r = allocate([E("a", "g", 9, 1, lease=True), E("n", "g", 3, 0)], limit=4, group_limits={},
                 usage=Usage(), leases=STRICT_FIRST)
    assert r.grants == {("n", "g"): 3} and r.leases == {("a", "g"): 1}
    assert blocked(r) == {("a", "g"): (R.LIMIT, 8)}
    # The same for an entry whose group admits no lease (R27, exclude) and one that holds a
    # live lease with free slots (not a candidate, R26); a younger one waits behind the lease.
    r = allocate([E("a", "g", 9, 2, lease=True), E("s", "small", 1, 0), E("h", "g", 1, 1),
                  E("y", "g", 1, 3)],
                 limit=4, group_limits={"small": 2}, usage=Usage(), leases=STRICT_FIRST)
    assert r.grants == {("s", "small"): 1, ("h", "g"): 1} and r.leases == {("a", "g"): 2}
    assert blocked(r) == {("a", "g"): (R.LIMIT, 7), ("y", "g"): (R.LIMIT, 1)}


def test_r28a_lease_first_without_older_entries_that_cannot_take_a_lease_is_unchanged():
    # R28a: every entry that cannot take a lease is younger than the last lease: leases first,
    # then grants oldest first (a's remaining need before the younger n).
    r = allocate([E("a", "g", 9, 0, lease=True), E("b", "g", 1, 1, lease=True), E("n", "g", 3, 2)],
                 limit=8, group_limits={}, usage=Usage(), leases=STRICT_FIRST)
    assert r.leases == {("a", "g"): 4, ("b", "g"): 1} and r.grants == {("a", "g"): 3}
    assert blocked(r) == {("a", "g"): (R.LIMIT, 2), ("n", "g"): (R.LIMIT, 3)}


def test_r28a_lease_first_older_grants_under_each_provisioning_mode():
    # R25 with R28a: the older entry's grant comes from the grant room of the mode, the lease
    # from the lease room left after it.
    older = [E("n", "g", 9, 0), E("a", "g", 9, 1, lease=True)]
    under = LeaseConfig(mode=Provisioning.UNDER, reserve=3, permits_per_lease=64, lease_first=True)
    r = allocate(older, limit=10, group_limits={}, usage=Usage(), leases=under)
    assert r.grants == {("n", "g"): 7} and r.leases == {("a", "g"): 3}  # grants <= 10 - 3
    over = LeaseConfig(mode=Provisioning.OVER, extra_count=4, permits_per_lease=64, lease_first=True)
    r = allocate(older, limit=10, group_limits={}, usage=Usage(), leases=over)
    assert r.grants == {("n", "g"): 9, ("a", "g"): 1} and r.leases == {("a", "g"): 4}  # leases from extra


def test_r25_strict_leases_from_what_grants_leave():
    # R25 strict: grants first, then leases from limit - charged.
    r = allocate([E("a", "g", 3, 0, lease=True), E("b", "g", 2, 1, lease=True)],
                 limit=10, group_limits={}, usage=Usage(grants=1), leases=STRICT)
    assert r.grants == {("a", "g"): 3, ("b", "g"): 2}
    # budget 10 - 1 - 5 = 4, two candidates: min(4, 4 // 2) = 2 each
    assert r.leases == {("a", "g"): 2, ("b", "g"): 2}
    assert not r.contended


def test_r25_under_reserve_arithmetic():
    # R25 under: grants use at most limit - reserve, leases the rest of limit.
    under = LeaseConfig(mode=Provisioning.UNDER, reserve=4, permits_per_lease=64)
    r = allocate([E("a", "g", 10, 0, lease=True), E("b", "h", 10, 1)],
                 limit=10, group_limits={}, usage=Usage(), leases=under)
    assert r.grants == {("a", "g"): 6}
    assert r.leases == {("a", "g"): 4}
    # a's leftover need is covered by its lease; b is left waiting
    assert blocked(r) == {("b", "h"): (R.LIMIT, 10)}
    # grant ceiling keeps one permit when reserve >= limit, and none when limit is 0
    assert grant_ceiling(3, LeaseConfig(mode=Provisioning.UNDER, reserve=5)) == 1
    assert grant_ceiling(0, LeaseConfig(mode=Provisioning.UNDER, reserve=5)) == 0
    assert grant_ceiling(10, under) == 6 and grant_ceiling(10, STRICT) == 10 and grant_ceiling(10, None) == 10
    r = allocate([E("a", "g", 5)], limit=3, group_limits={},
                 usage=Usage(), leases=LeaseConfig(mode=Provisioning.UNDER, reserve=5))
    assert r.grants == {("a", "g"): 1}


def test_r25_under_existing_lease_footprint():
    # R25 under: total never exceeds limit; grant room = min(limit - all charged,
    # ceiling - grant charge).
    under = LeaseConfig(mode=Provisioning.UNDER, reserve=2)
    r = allocate([E("a", "g", 10)], limit=10, group_limits={}, usage=Usage(grants=1, leases=8), leases=under)
    assert r.grants == {("a", "g"): 1}
    r = allocate([E("a", "g", 10)], limit=10, group_limits={}, usage=Usage(grants=7, leases=0), leases=under)
    assert r.grants == {("a", "g"): 1}


def test_r25_over_extra_budget_arithmetic():
    # R25 over: leases from `extra` above the limit; ceiling limit + extra.
    over = LeaseConfig(mode=Provisioning.OVER, extra_count=5, permits_per_lease=64)
    r = allocate([E("a", "g", 20, 0, lease=True)], limit=10, group_limits={}, usage=Usage(), leases=over)
    assert r.grants == {("a", "g"): 10} and r.leases == {("a", "g"): 5}
    assert blocked(r) == {("a", "g"): (R.LIMIT, 5)}
    # lease footprint above `extra` eats the limit: 7 footprint, extra 5 -> 2 overflow
    r = allocate([E("a", "g", 20, 0, lease=True)], limit=10, group_limits={},
                 usage=Usage(grants=3, leases=7), leases=over)
    assert r.grants == {("a", "g"): 5} and r.leases == {}
    ratio = LeaseConfig(mode=Provisioning.OVER, extra_ratio=0.5)
    assert ratio.extra(9) == 4
    r = allocate([E("a", "g", 1, 0, lease=True)], limit=9, group_limits={}, usage=Usage(grants=9), leases=ratio)
    assert r.grants == {} and r.leases == {("a", "g"): 4}


def test_r28_equal_share_and_one_each_for_the_oldest():
    # R28: budget shared equally among candidates in oldestAt order; if the share is zero,
    # the oldest `budget` candidates get one permit each.
    cands = [E(c, "g", 0, oldest_at=t, count=1, lease=True) for c, t in (("x", 30), ("y", 10), ("z", 20))]
    cfg = LeaseConfig(permits_per_lease=64)
    r = allocate(cands, limit=2, group_limits={}, usage=Usage(), leases=cfg)
    assert r.leases == {("y", "g"): 1, ("z", "g"): 1}
    r = allocate(cands, limit=7, group_limits={}, usage=Usage(), leases=cfg)
    assert r.leases == {("x", "g"): 2, ("y", "g"): 2, ("z", "g"): 2}
    r = allocate(cands, limit=100, group_limits={}, usage=Usage(), leases=LeaseConfig(permits_per_lease=3))
    assert set(r.leases.values()) == {3}


def test_r28_a_budget_of_one_goes_to_the_oldest_candidate():
    # R28: one permit left for leases and two candidates: the oldest gets a lease of one (the
    # share is zero), the other nothing; no budget, no lease.
    cands = [E(c, "g", 0, oldest_at=t, count=1, lease=True) for c, t in (("x", 30), ("y", 10))]
    cfg = LeaseConfig(permits_per_lease=64)
    assert allocate(cands, limit=1, group_limits={}, usage=Usage(), leases=cfg).leases == {("y", "g"): 1}
    assert allocate(cands, limit=1, group_limits={}, usage=Usage(grants=1), leases=cfg).leases == {}


def test_r21_a_full_holder_serves_nothing_and_a_failed_limit_serves_nothing():
    # R21: the room is what the limit leaves above the charged usage, never below zero: at or
    # above the limit (a lowered one) the oldest entry gets nothing; a limit that failed to
    # resolve serves nothing at all.
    entries = [E("a", "g", 2, 1), E("b", "g", 1, 2)]
    for charged in (5, 6):
        r = allocate(entries, limit=5, group_limits={}, usage=Usage(grants=charged))
        assert r.grants == {} and blocked(r) == {("a", "g"): (R.LIMIT, 2), ("b", "g"): (R.LIMIT, 1)}
    r = allocate(entries, limit=LIMIT_ERROR, group_limits={}, usage=Usage())
    assert r.grants == {} and r.leases == {}


def test_r26_r27_lease_candidates_and_limited_groups():
    # R26/R27: non-candidates, not permitted entries and (under exclude) limited groups get
    # no lease; withinGroupLimit clips the lease to the group's room.
    entries = [
        E("a", "limited", 1, 0, lease=True),
        E("b", "free", 1, 1, lease=False),
        E("c", "free", 1, 2, lease=True, permitted=False),
        E("d", "free", 1, 3, lease=True),
    ]
    r = allocate(entries, limit=100, group_limits={"limited": 3}, usage=Usage(), leases=STRICT)
    assert r.leases == {("d", "free"): 4}
    within = LeaseConfig(permits_per_lease=4, limited_groups=LimitedGroups.WITHIN_GROUP_LIMIT)
    r = allocate(entries, limit=100, group_limits={"limited": 3}, usage=Usage(), leases=within)
    # a: grant 1 leaves group room 2 -> lease clipped to 2
    assert r.leases == {("a", "limited"): 2, ("d", "free"): 4}


def test_r29_contended_iff_need_left():
    # R29: contended exactly when some need is unserved.
    assert not allocate([E("a", "g", 2)], limit=2, group_limits={}, usage=Usage()).contended
    assert allocate([E("a", "g", 3)], limit=2, group_limits={}, usage=Usage()).contended
    assert allocate([E("a", "g", 1, permitted=False)], limit=2, group_limits={}, usage=Usage()).contended
