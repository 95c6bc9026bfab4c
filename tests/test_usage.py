"""``usage()`` (SPEC R38): ``charged`` and ``available``, in total and per group, in every lease
provisioning mode (R25) and group-limit mode (R27); the typed view ``SemaphoreUsage``; the
reference Worker's empty usage; what usage reads (aggregates only); and why it lags (R37).

Definitions (core/usage.py, README "The holder"):

* ``charged`` = ``outstanding + leaseFootprint`` (R19, R30).
* ``available`` = what one new grant request could get now: the grant room of the mode (R25)
  under the limit, never below 0, ``None`` when the limit is unresolved; per group
  ``min(available, max(0, group limit - group charged))`` when the group has a limit (its lease
  footprint always counts against it, R27), else the top-level ``available``; ``None`` when the
  group's limit is unresolved.

Most tests check ``available`` against its meaning: a fresh client without lease support asks for
far more than any limit (:func:`probe`) and the next round grants it exactly ``available``.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

import semaphore
import test_reference_worker as reference
from semaphore import GroupUsage, LeaseConfig, Provisioning, SemaphoreUsage
from semaphore.core.allocation import LIMIT_ERROR, Entry, Usage, allocate
from semaphore.core.config import LimitedGroups
from semaphore.core.usage import grant_room, group_available
from semaphore.holder import GRANTS, LEASES
from semaphore.testing import T0, Bed, ClientSide, HolderSide, Net, SimClock, async_test, request, sync

pytestmark = pytest.mark.usefixtures("quiet_logs")  # limit callbacks raise on purpose

TOP_KEYS = {"limit", "outstanding", "leaseFootprint", "liveLeases", "retiredLeases", "charged", "available",
            "groups"}
GROUP_KEYS = {"outstanding", "leaseFootprint", "liveLeases", "retiredLeases", "limit", "charged", "available"}
HUGE = 1_000_000
entry = reference.entry  # the reference Worker's module, with a stand-in ``workers`` (fixture)


def lease_options(mode: str = "strict", **options):
    prov = {"mode": mode}
    for key in ("reserve", "extra"):
        if key in options:
            prov[key] = options.pop(key)
    return {"provisioning": prov, **options}


_probes = iter(range(1, 10_000))


async def probe(bed: Bed, group: str) -> int:
    """What one new grant request gets now: a fresh client without lease support asks for far
    more than any limit; returns the permits of the grant it got in ``group``."""
    (reply,) = await bed.round(request(f"probe{next(_probes)}", {group: HUGE}, oldest_at=bed.now))
    return sum(g["permits"] for g in reply["grants"] if g["group"] == group)


def check_charged(u: dict) -> None:
    # R38/R19: charged = outstanding + leaseFootprint, at the top and in every group.
    assert set(u) == TOP_KEYS and u["charged"] == u["outstanding"] + u["leaseFootprint"], u
    for name, g in u["groups"].items():
        assert set(g) == GROUP_KEYS and g["charged"] == g["outstanding"] + g["leaseFootprint"], (name, g)


# ====================================================================== no leases


@async_test
async def test_r38_charged_and_available_without_leases():
    # R38 (fails on the code before charged/available): limit 10, group "capped" limited to 4.
    bed = Bed(10, group_limit={"capped": 4})
    empty = await bed.usage()
    assert (empty["charged"], empty["available"], empty["groups"]) == (0, 10, {})
    a, b = await bed.round(request("a", {"capped": 3}), request("b", {"free": 2}))
    gb = b["grants"][0]["grantId"]
    await bed.sem.handle(sync("b", [(gb, 2, 1)]))  # b claims 2, releases 1 (R13)
    u = await bed.usage()
    check_charged(u)
    # outstanding = (3 - 0) + (2 - 1) = 4 (unclaimed permits count until claimBy, R15)
    assert (u["limit"], u["outstanding"], u["charged"], u["available"]) == (10, 4, 4, 10 - 4)
    assert u["groups"]["capped"] == {"outstanding": 3, "leaseFootprint": 0, "liveLeases": 0,
                                     "retiredLeases": 0, "limit": 4, "charged": 3, "available": 1}
    assert (u["groups"]["free"]["charged"], u["groups"]["free"]["available"]) == (1, 6)  # no limit: top's
    assert await probe(bed, "capped") == 1                 # min(6, 4 - 3)
    assert (await bed.usage())["available"] == 5
    assert await probe(bed, "free") == 5
    u = await bed.usage()
    assert u["available"] == 0 and all(g["available"] == 0 for g in u["groups"].values())
    bed.check()


@async_test
async def test_r38_r24_available_is_zero_not_negative_under_a_lowered_limit():
    # R24: lowering the limit revokes nothing; charged stays above it and available is 0.
    limit = {"v": 10}
    bed = Bed(lambda: limit["v"], group_limit={"g": 9})
    (a,) = await bed.round(request("a", {"g": 8}))
    await bed.sem.handle(sync("a", [(a["grants"][0]["grantId"], 8, 0)]))
    limit["v"] = 5
    u = await bed.usage()
    assert (u["limit"], u["charged"], u["available"]) == (5, 8, 0)
    assert u["groups"]["g"]["available"] == 0  # min(0, 9 - 8)
    assert await probe(bed, "g") == 0 and await probe(bed, "other") == 0


@async_test
async def test_r38_r12_available_is_none_when_a_limit_cannot_be_resolved():
    # R12: an unresolvable limit (or group limit) is reported as limit None; available is None
    # there (a round admits nothing: limit_resolution_error), a group without a limit shows the
    # top-level available.
    broken = {"limit": False, "group": False}

    def limit():
        if broken["limit"]:
            raise RuntimeError("limit source down")
        return 10

    def group_limit(g):
        if g == "bad" and broken["group"]:
            raise RuntimeError("group source down")
        return 6 if g == "bad" else None

    bed = Bed(limit, group_limit=group_limit)
    await bed.round(request("a", {"bad": 2, "free": 1}))
    broken["group"] = True
    u = await bed.usage()
    check_charged(u)
    assert (u["limit"], u["available"]) == (10, 7)
    assert (u["groups"]["bad"]["limit"], u["groups"]["bad"]["available"]) == (None, None)
    assert (u["groups"]["free"]["limit"], u["groups"]["free"]["available"]) == (None, 7)
    assert await probe(bed, "bad") == 0
    broken["limit"] = True
    u = await bed.usage()
    assert (u["limit"], u["charged"], u["available"]) == (None, 3, None)
    assert all(g["available"] is None for g in u["groups"].values())
    assert await probe(bed, "free") == 0


# ====================================================================== R25 provisioning


@async_test
async def test_r38_r25_strict_available_is_limit_minus_charged():
    # R25 strict: grants and leases share the limit; available = limit - outstanding - footprint.
    bed = Bed(10, leases=lease_options("strict"))
    (ra,) = await bed.round(request("a", {"g": 4}, leases=[], oldest_at=1))
    lid = ra["leases"][0]["leaseId"]
    u = await bed.usage()
    assert (u["outstanding"], u["leaseFootprint"], u["charged"], u["available"]) == (4, 6, 10, 0)
    await bed.sem.handle(sync("a", leases=[(lid, 2, 0, True)]))  # stopped: footprint drawn - released (R30)
    u = await bed.usage()
    check_charged(u)
    assert (u["leaseFootprint"], u["charged"], u["available"]) == (2, 6, 10 - 6)
    assert await probe(bed, "g") == 4


@async_test
async def test_r38_r25_under_available_keeps_the_reserve_for_leases():
    # R25 under, limit 10, reserve 4: grants use at most 6, so available is 6 with nothing
    # charged (not limit - charged = 10): available = min(limit - charged, 6 - outstanding).
    bed = Bed(10, leases=lease_options("under", reserve=4))
    u = await bed.usage()
    assert (u["charged"], u["available"]) == (0, 6)
    (ra,) = await bed.round(request("a", {"g": 20}, leases=[], oldest_at=1))
    gid = ra["grants"][0]["grantId"]
    u = await bed.usage()
    assert (u["outstanding"], u["leaseFootprint"], u["available"]) == (6, 4, 0)
    await bed.sem.handle(sync("a", [(gid, 6, 6)]))  # grants settled, the lease's 4 stay charged
    u = await bed.usage()
    check_charged(u)
    assert (u["charged"], u["available"]) == (4, min(10 - 4, 6 - 0))
    assert await probe(bed, "g") == 6
    # the one permit grants always keep (limit >= 1): reserve above the limit leaves available 1
    small = Bed(3, leases=lease_options("under", reserve=5))
    assert (await small.usage())["available"] == 1 and await probe(small, "g") == 1


@async_test
async def test_r38_r25_over_charged_may_exceed_the_limit_and_available_ignores_the_extra():
    # R25 over, limit 10, extra 5: leases live in a budget of 5 above the limit; grant room is
    # limit - outstanding - max(0, footprint - extra).
    bed = Bed(10, leases=lease_options("over", extra={"count": 5}))
    (ra,) = await bed.round(request("a", {"g": 20}, leases=[], oldest_at=1))
    gid = ra["grants"][0]["grantId"]
    u = await bed.usage()
    check_charged(u)
    assert (u["limit"], u["outstanding"], u["leaseFootprint"]) == (10, 10, 5)
    assert (u["charged"], u["available"]) == (15, 0)  # charged above the limit, up to limit + extra (I1)
    await bed.sem.handle(sync("a", [(gid, 10, 10)]))
    u = await bed.usage()
    # charged 5 (the lease), yet the whole limit is grant room: 10 - 0 - max(0, 5 - 5)
    assert (u["charged"], u["available"]) == (5, 10)
    assert await probe(bed, "g") == 10


# ====================================================================== R27 group limits


@async_test
async def test_r38_r27_within_group_limit_lease_footprint_counts_against_the_group():
    # R27 withinGroupLimit: the group gets a lease inside its limit; group available =
    # min(top available, group limit - outstanding - footprint).
    bed = Bed(100, group_limit={"lim": 5}, leases=lease_options("strict", limitedGroups="withinGroupLimit"))
    (ra,) = await bed.round(request("a", {"lim": 2}, leases=[], oldest_at=1))
    lid = ra["leases"][0]["leaseId"]
    u = await bed.usage()
    check_charged(u)
    assert (u["charged"], u["available"]) == (5, 95)
    assert (u["groups"]["lim"]["charged"], u["groups"]["lim"]["available"]) == (5, 0)
    await bed.sem.handle(sync("a", leases=[(lid, 1, 0, True)]))  # footprint 3 -> 1
    u = await bed.usage()
    assert (u["groups"]["lim"]["charged"], u["groups"]["lim"]["available"]) == (3, 2)
    assert await probe(bed, "lim") == 2


@async_test
async def test_r38_r27_exclude_a_retired_lease_still_counts_against_its_new_group_limit():
    # R27 exclude + R33: group h gains a limit, its live lease is retired at the next round but
    # stays charged (R30) until its client reports, in the group too: available min(top, 6 - 5).
    limits: dict[str, int] = {}
    bed = Bed(100, group_limit=lambda g: limits.get(g), leases=lease_options("strict", permitsPerLease=4))
    await bed.round(request("a", {"h": 1}, leases=[], oldest_at=1))
    limits["h"] = 6
    await bed.round(request("b", {}, leases=[]))  # retires h's lease (R33)
    u = await bed.usage()
    check_charged(u)
    h = u["groups"]["h"]
    assert (h["outstanding"], h["leaseFootprint"], h["retiredLeases"], h["limit"]) == (1, 4, 1, 6)
    assert (u["available"], h["charged"], h["available"]) == (95, 5, 1)
    assert await probe(bed, "h") == 1


def test_r38_available_is_what_allocate_grants_one_new_request():
    # R21, R25, R27: grant_room/group_available against the round's own allocation, one entry of
    # unbounded need (not a lease candidate), over random states of every mode.
    rng = random.Random(38)
    configs = [None, LeaseConfig(), LeaseConfig(mode=Provisioning.UNDER, reserve=3),
               LeaseConfig(mode=Provisioning.UNDER, reserve=30), LeaseConfig(mode=Provisioning.OVER, extra_count=4),
               LeaseConfig(mode=Provisioning.OVER, extra_ratio=0.5, limited_groups=LimitedGroups.WITHIN_GROUP_LIMIT)]
    for _ in range(3000):
        config, limit = rng.choice(configs), rng.randint(0, 20)
        grants, footprint = rng.randint(0, 25), rng.randint(0, 25)
        group_limit = rng.choice([None, LIMIT_ERROR, rng.randint(0, 15)])
        group_charged = rng.randint(0, grants + footprint)
        entry_ = Entry("z", "g", HUGE, 0, 0, HUGE)
        got = allocate([entry_], limit=limit, group_limits={"g": group_limit}, leases=config,
                       usage=Usage(grants=grants, leases=footprint, groups={"g": group_charged})).grants
        want = group_available(grant_room(limit, grants, footprint, config), group_limit, group_charged)
        assert got.get(("z", "g"), 0) == (want or 0), (config, limit, grants, footprint, group_limit, group_charged)


# ====================================================================== cost


@async_test
async def test_r38_usage_reads_only_aggregates_whatever_the_number_of_grants():
    # R38 (docs/ARCHITECTURE.md): usage() reads the meta and group aggregate rows, never the
    # grant or lease tables, in the same few statements for 3 grants or 300.
    async def statements(clients: int) -> list[str]:
        bed = Bed(HUGE, leases=lease_options("strict", permitsPerLease=1))
        await bed.round(*(request(f"c{i}", {f"g{i % 3}": 1}, leases=[]) for i in range(clients)))
        await bed.usage()  # schema checks of a first call are not what we count
        seen: list[str] = []
        original = bed.storage.sql.exec

        def exec_(query, *bindings):
            seen.append(query)
            return original(query, *bindings)

        bed.storage.sql.exec = exec_
        u = await bed.usage()
        assert u["outstanding"] == clients and u["liveLeases"] == clients
        return seen

    few, many = await statements(3), await statements(300)
    assert len(few) == len(many) <= 3, many
    assert not [q for q in many if GRANTS in q or LEASES in q], many


# ====================================================================== the typed view


@async_test
async def test_r38_semaphore_usage_round_trips_the_wire():
    bed = Bed(12, group_limit={"capped": 5}, leases=lease_options("strict", permitsPerLease=3))
    await bed.round(request("a", {"capped": 4}), request("b", {"free": 2}, leases=[]))
    wire = await bed.usage()
    view = SemaphoreUsage.from_wire(wire)
    assert view.to_wire() == wire
    assert (view.limit, view.outstanding, view.lease_footprint, view.charged, view.available) == (12, 6, 3, 9, 3)
    assert view.groups["capped"] == GroupUsage(outstanding=4, limit=5, charged=4, available=1)
    assert view.groups["free"].lease_footprint == 3 and view.groups["free"].live_leases == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.charged = 0  # type: ignore[misc]


def test_r38_semaphore_usage_from_wire_is_lenient():
    # Unknown keys (the reference Worker's) are ignored; a holder of an earlier release has no
    # charged/available: charged is derived, available unknown (None).
    old = {"limit": 7, "outstanding": 2, "leaseFootprint": 3, "liveLeases": 1, "retiredLeases": 0,
           "groups": {"g": {"outstanding": 2, "leaseFootprint": 3, "liveLeases": 1, "retiredLeases": 0,
                            "limit": None}},
           "defaultLimit": 7, "limitOverride": None}
    view = SemaphoreUsage.from_wire(old)
    assert (view.charged, view.available, view.groups["g"].charged, view.groups["g"].available) == (5, None, 5, None)
    assert SemaphoreUsage.empty(None) == SemaphoreUsage()
    assert SemaphoreUsage.empty(8).to_wire() == {
        "limit": 8, "outstanding": 0, "leaseFootprint": 0, "liveLeases": 0, "retiredLeases": 0,
        "charged": 0, "available": 8, "groups": {}}
    assert SemaphoreUsage.empty(8, LeaseConfig(mode=Provisioning.UNDER, reserve=3)).available == 5


def test_r38_the_usage_types_are_exported_and_documented():
    for name in ("SemaphoreUsage", "GroupUsage"):
        assert name in semaphore.__all__ and getattr(semaphore, name).__doc__
    for fn in (SemaphoreUsage.from_wire, SemaphoreUsage.to_wire, SemaphoreUsage.empty, GroupUsage.from_wire,
               GroupUsage.to_wire, grant_room, group_available, semaphore.core.usage.measure):
        assert fn.__doc__, fn


# ====================================================================== the reference Worker


def test_r38_reference_worker_empty_usage_has_the_same_keys(entry):
    # src/entry.py: a holder with no tables answers the empty usage without creating storage,
    # with the semaphore's keys: charged 0, available the whole grant room.
    world = reference.World(entry)
    status, usage = reference.run(world.fetch("GET", "/accounts/ghost/usage"))
    assert status == 200 and set(usage) == TOP_KEYS | {"defaultLimit", "limitOverride"}, usage
    assert (usage["limit"], usage["charged"], usage["available"], usage["groups"]) == (7, 0, 7, {})
    assert world.env.ACCOUNT_LIMIT.tables("ghost") == []
    under = reference.World(entry, LEASES='{"provisioning": {"mode": "under", "reserve": 2}}')
    _, usage = reference.run(under.fetch("GET", "/accounts/ghost/usage"))
    assert (usage["limit"], usage["available"]) == (7, 5)  # the reserve is kept for leases (R25)


# ====================================================================== why usage lags


class Queued:
    """A real holder and one SemaphoreQueue client over the in-memory network."""

    def __init__(self, limit: int, **queue) -> None:
        self.clock = SimClock(T0)
        self.holder = HolderSide(self.clock, limit=limit, leases=None)  # grants: R37 releases of grants
        self.admitted: list[str] = []
        self.side = ClientSide("c1", self.clock, Net(self.holder, self.clock),
                               on_admit=lambda side, item: self.admitted.append(item.item_id), **queue)

    async def charged(self) -> int:
        return (await self.holder.usage())["charged"]


@async_test
async def test_r38_r37_a_release_shows_in_usage_only_once_reported():
    # R37: releases ride on the next message and are sent within report_releases_within_ms;
    # until then usage still charges the finished work (charged is an upper bound).
    s = Queued(10, report_releases_within_ms=5000)
    await s.side.queue.enqueue("acct", "g", "a")
    await s.clock.advance(1500)  # round, claim, confirming sync (R15a)
    assert s.admitted == ["a"] and await s.charged() == 1
    await s.side.queue.complete("a")
    await s.clock.advance(4900)
    assert await s.charged() == 1  # finished, not yet reported
    await s.clock.advance(200)
    assert await s.charged() == 0


@async_test
async def test_r38_r29_a_release_is_reported_by_the_next_round_when_contended():
    # R29/R37: after a contended reply a release is not held back past the time a request
    # joins the next round (joinInMs), whatever report_releases_within_ms says.
    s = Queued(1, report_releases_within_ms=60_000)
    await s.side.queue.enqueue("acct", "g", "a")
    await s.side.queue.enqueue("acct", "g", "b")  # limit 1: b waits, the round is contended
    await s.clock.advance(1500)
    assert s.admitted == ["a"] and await s.charged() == 1
    await s.side.queue.complete("a")
    await s.clock.advance(s.side.client.not_before("acct") - s.clock.now)
    await s.clock.advance(1000)  # b's request carried it to b's round (R9: round_wait_ms later)
    assert s.admitted == ["a", "b"] and await s.charged() == 1
