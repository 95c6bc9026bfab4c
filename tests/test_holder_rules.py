"""Tier 1: the holder core, one or more tests per SPEC rule of §1-§6 and §9 (R1-R24, R38).

Every test runs the real DurabilitySemaphore on the SQLite test bed with a virtual clock; each
names the rule it checks. ``bed.check()`` recomputes the stored aggregates by full scan.
"""

from __future__ import annotations

import asyncio
import inspect

import pytest

from semaphore import DurabilityScheduler, DurabilitySemaphore
from semaphore.errors import ConfigurationError, RoundFailedError, error_from_reply
from semaphore.holder import GRANTS, GROUPS, LEASES, META
from semaphore.testing import (
    RECLAIM_TIMER,
    SEED_TIMING,
    TIMERS,
    Bed,
    DurableObjectRuleError,
    LocalContext,
    async_test,
    blocked,
    by_id,
    check_aggregates,
    dump,
    grant_rows,
    request,
    sync,
    tables,
    timers,
)

ROUND_KEYS = {"v", "grants", "leases", "blocked", "contended", "nextRequestAt", "joinInMs"}  # R8, R11 decision
GRANT_KEYS = {"grantId", "group", "permits", "claimed", "released", "claimBy", "status"}


def fail_statement(storage, fragment: str, exc: Exception | None = None) -> list[str]:
    """Fault injection on the test bed (not the code under test): the next SQL statement
    containing ``fragment`` raises. Returns a list that records the failed statement."""
    original = storage.sql.exec
    failed: list[str] = []

    def exec_(query, *bindings):
        if not failed and fragment in query:
            failed.append(query)
            raise exc or DurableObjectRuleError("injected storage failure")
        return original(query, *bindings)

    storage.sql.exec = exec_
    return failed


# =============================================================================== §2 storage


@async_test
async def test_r1_schema_created_on_first_use_and_versioned():
    # R1: tables in ctx.storage.sql, created on first use, versioned.
    bed = Bed(limit=3)
    assert not any(t.startswith("durability_semaphore") for t in tables(bed.storage))
    await bed.one(request("a", {"g": 1}))
    names = tables(bed.storage)
    assert {GRANTS, LEASES, GROUPS, META} <= names
    assert TIMERS in names  # the scheduler's own durability_-prefixed table
    meta = {r[0]: r[1] for r in bed.storage.connection.execute(f"SELECT key, value FROM {META}")}
    assert meta["schema_version"] == 1


@async_test
async def test_r1_newer_schema_version_is_refused_and_nothing_written():
    # R1: a schema written by a newer release is refused (decision: the reply is a round_failed
    # error value naming the newer schema; nothing is written).
    bed = Bed(limit=3)
    await bed.one(request("a", {"g": 1}))
    # 3: newer than the newest this release reads (2: storage holding reusable leases, R34a)
    bed.storage.connection.execute(f"UPDATE {META} SET value = 3 WHERE key = 'schema_version'")
    bed.evict()
    before = dump(bed.storage)
    reply = await bed.one(request("b", {"g": 1}))
    assert reply["error"]["code"] == "round_failed"
    assert "newer" in reply["error"]["message"]
    assert dump(bed.storage) == before
    with pytest.raises(Exception, match="newer"):
        await bed.sem.usage()


def test_r1_migrate_to_current_version_creates_schema_unknown_version_refused():
    # R1: migrate(ctx, 1) creates the versioned schema; an unknown target version is refused.
    ctx = LocalContext()
    DurabilitySemaphore.migrate(ctx, 1)
    assert {GRANTS, LEASES, GROUPS, META} <= tables(ctx.storage)
    with pytest.raises(ConfigurationError):
        DurabilitySemaphore.migrate(ctx, 7)


@async_test
async def test_r2_round_commits_before_any_client_hears_back():
    # R2: when a caller receives its reply, the round's grant is already in storage.
    bed = Bed(limit=3)
    seen: list[dict] = []
    task = bed.send(request("a", {"g": 2}))
    task.add_done_callback(lambda t: seen.append(grant_rows(bed.storage)))
    [reply] = await bed.finish(task)
    gid = reply["grants"][0]["grantId"]
    assert gid in seen[0] and seen[0][gid]["permits"] == 2


@async_test
async def test_r2_failing_transaction_fails_every_request_and_writes_nothing():
    # R2: the round's transaction fails mid-way (after the grants were written, while updating
    # the aggregates): every request of the round gets a round_failed error value and NOTHING
    # is written -- neither the new grants nor the reports carried by the round.
    bed = Bed(limit=10)
    [first] = await bed.round(request("a", {"g": 2}))
    gid = first["grants"][0]["grantId"]
    before, alarm_before = dump(bed.storage), bed.storage.alarm
    failed = fail_statement(bed.storage, f"INSERT INTO {GROUPS}")
    replies = await bed.round(
        request("a", {"g": 3}, grants=[(gid, 2, 1)]),
        request("b", {"g": 1, "h": 2}),
    )
    assert failed, "the injected failure did not happen inside the round"
    for reply in replies:
        assert set(reply) == {"v", "error"} and reply["v"] == 1
        assert reply["error"]["code"] == "round_failed"
        assert isinstance(error_from_reply(reply), RoundFailedError)
    assert dump(bed.storage) == before
    assert bed.storage.alarm == alarm_before
    bed.check()
    # The clients simply ask again.
    a, b = await bed.round(request("a", {"g": 3}, grants=[(gid, 2, 1)]), request("b", {"g": 1}))
    assert by_id(a)[gid]["claimed"] == 2 and by_id(a)[gid]["released"] == 1
    assert [g["permits"] for g in b["grants"]] == [1]
    bed.check()


@async_test
async def test_r2_storage_fault_at_round_start_fails_round_and_writes_nothing():
    # R2: the test bed's fail_next_exec fault (the first statement of the round raises).
    bed = Bed(limit=10, **SEED_TIMING)  # batched rounds (R9), not R9a's rounds at once
    [first] = await bed.round(request("a", {"g": 2}))
    gid = first["grants"][0]["grantId"]
    tasks = [bed.send(request("a", {"g": 1}, grants=[(gid, 1, 0)])), bed.send(request("b", {"g": 1}))]
    await bed.settle()
    before = dump(bed.storage)
    bed.storage.fail_next_exec = RuntimeError("disk on fire")
    replies = await bed.finish(*tasks)
    assert bed.storage.fail_next_exec is None  # the fault was consumed by the round
    assert all(r["error"]["code"] == "round_failed" for r in replies)
    assert dump(bed.storage) == before


@async_test
async def test_r2_failing_sync_transaction_writes_nothing():
    # R2/R6: a sync whose transaction fails is answered round_failed and writes nothing.
    bed = Bed(limit=10)
    [first] = await bed.round(request("a", {"g": 2}))
    gid = first["grants"][0]["grantId"]
    before = dump(bed.storage)
    fail_statement(bed.storage, f"INSERT INTO {GROUPS}")
    reply = await bed.sem.handle(sync("a", [(gid, 2, 2)]))
    assert reply["error"]["code"] == "round_failed"
    assert dump(bed.storage) == before


@async_test
async def test_r3_migrate_none_drops_tables_and_semaphore_timers_only():
    # R3: migrate(ctx, None) removes the semaphore's tables and its scheduler entries, and
    # leaves other timers (and the scheduler's table) alone.
    bed = Bed(limit=5)
    bed.scheduler.on("app:cleanup", lambda name, due: None)
    await bed.scheduler.schedule("app:cleanup", bed.now + 50_000)
    await bed.one(request("a", {"g": 2}))
    assert RECLAIM_TIMER in bed.scheduler.due_times()
    DurabilitySemaphore.migrate(bed.ctx, None)
    names = tables(bed.storage)
    assert not any(t.startswith("durability_semaphore") for t in names)
    assert timers(bed.storage) == {"app:cleanup": bed.t0 + 50_000}
    # A fresh instance recreates the schema and works.
    bed.evict()
    reply = await bed.one(request("a", {"g": 1}))
    assert reply["grants"][0]["permits"] == 1
    # Idempotent on an empty storage.
    DurabilitySemaphore.migrate(LocalContext(), None)


@async_test
async def test_r4_new_instance_sees_all_durable_state():
    # R4: a new instance over the same storage sees the grants (durable) and their usage.
    bed = Bed(limit=5)
    a, b = await bed.round(request("a", {"g": 2}), request("b", {"h": 3}))
    ga, gb = a["grants"][0]["grantId"], b["grants"][0]["grantId"]
    bed.evict()
    usage = await bed.usage()
    assert usage["outstanding"] == 5
    reply = await bed.sem.handle(sync("a", [(ga, 1, 0)]))
    assert by_id(reply)[ga]["claimed"] == 1 and by_id(reply)[ga]["status"] == "active"
    # The limit is still enforced against the old grants.
    [c] = await bed.round(request("c", {"g": 1}))
    assert c["grants"] == [] and blocked(c) == {"g": ("limit", 1)}
    # The reclaim alarm survives too: b's unclaimed grant is reclaimed on time.
    await bed.clock.advance_to(bed.t0 + 1000 + 10_000)
    assert gb not in bed.grants()
    bed.check()


@async_test
async def test_r4_evicted_instance_loses_waiting_calls_client_asks_again():
    # R4: waiting requests live only in memory: eviction fails them, nothing of them is
    # durable (an older waiting request does not win the next round), the client asks again.
    bed = Bed(limit=1, **SEED_TIMING)  # batched rounds (R9), not R9a's rounds at once
    lost = bed.send(request("a", {"g": 1}, oldest_at=1))  # older than b
    await bed.clock.advance(500)
    bed.evict()
    await bed.settle()
    assert lost.done() and "error" in lost.result()
    assert bed.grants() == {}
    [b] = await bed.round(request("b", {"g": 1}, oldest_at=100))
    assert [g["permits"] for g in b["grants"]] == [1]
    assert {g["client_id"] for g in bed.grants().values()} == {"b"}
    [a] = await bed.round(request("a", {"g": 1}, oldest_at=1))
    assert blocked(a) == {"g": ("limit", 1)}


@async_test
async def test_r4_r9_round_spacing_survives_eviction():
    # R4/R9 (decision): the previous round's start is durable (meta last_round_at), so a new
    # instance still keeps roundPeriodMs after it.
    bed = Bed(limit=5, **SEED_TIMING)  # batched rounds (R9), not R9a's rounds at once
    await bed.one(request("a", {"g": 1}))
    first_round = bed.now
    bed.evict()
    await bed.clock.advance(100)
    task = bed.send(request("a", {"g": 1}))
    await bed.finish(task)
    assert bed.now == first_round + 2000


# =============================================================================== §3 messages


@async_test
async def test_r5_leases_key_present_means_lease_support():
    # R5: `leases` present (even empty) = lease-capable client; absent = no leases.
    bed = Bed(limit=10, leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 4})
    without, with_ = await bed.round(request("a", {"g": 1}), request("b", {"g": 1}, leases=[]))
    assert without["leases"] == []
    assert [x["permits"] for x in with_["leases"]] == [4]
    assert {x["client_id"] for x in bed.leases().values()} == {"b"}
    bed.check()


@async_test
async def test_r6_sync_answered_at_once_without_a_round():
    # R6: a sync is applied in its own transaction and answered without waiting for a round,
    # even while a round is pending.
    bed = Bed(limit=5, **SEED_TIMING, leases=None)  # batched rounds (R9), not R9a's rounds at once; grants
    [a] = await bed.round(request("a", {"g": 3}))
    gid = a["grants"][0]["grantId"]
    pending = bed.send(request("b", {"g": 1}))
    await bed.settle()
    t = bed.now
    s = bed.send(sync("a", [(gid, 2, 1)]))
    await bed.settle()
    assert s.done() and bed.now == t
    assert not pending.done()
    reply = s.result()
    assert set(reply) == ROUND_KEYS
    assert by_id(reply)[gid]["claimed"] == 2 and by_id(reply)[gid]["released"] == 1
    assert reply["blocked"] == []
    row = bed.grants()[gid]
    assert (row["claimed"], row["released"]) == (2, 1)
    await bed.finish(pending)
    bed.check()


@async_test
async def test_r8_response_shape_and_contents():
    # R8: grants of a reply = new grants + reported grants (unknown ones too) + every other
    # active grant of the client; never another client's grants.
    bed = Bed(limit=10, leases=None)
    a1, b1 = await bed.round(request("a", {"g": 2}), request("b", {"g": 1}))
    g1 = a1["grants"][0]["grantId"]
    gb = b1["grants"][0]["grantId"]
    assert set(a1) == ROUND_KEYS and set(a1["grants"][0]) == GRANT_KEYS
    assert a1["grants"][0]["status"] == "active" and a1["grants"][0]["group"] == "g"
    assert a1["grants"][0]["claimBy"] == bed.now + 10_000
    assert a1["contended"] is False and isinstance(a1["nextRequestAt"], int)
    a2 = (await bed.round(request("a", {"h": 1})))[0]   # g1 unreported: still listed
    g2 = next(g["grantId"] for g in a2["grants"] if g["group"] == "h")
    assert set(by_id(a2)) == {g1, g2}
    a3 = (await bed.round(request("a", {"k": 1}, grants=[(g1, 1, 0), ("nope", 0, 0)])))[0]
    ids = by_id(a3)
    g3 = next(g["grantId"] for g in a3["grants"] if g["group"] == "k")
    assert set(ids) == {g1, g2, g3, "nope"}
    assert ids[g1]["claimed"] == 1 and ids["nope"]["status"] == "not_found"
    assert ids["nope"]["group"] is None and ids["nope"]["claimBy"] is None
    assert gb not in ids


@async_test
async def test_r8_lost_reply_heals_at_next_request():
    # R8: a grant whose reply was lost reaches its client at its next request (or sync).
    bed = Bed(limit=5)
    lost = bed.send(request("a", {"g": 3}))
    await bed.finish(lost)
    gid = next(iter(bed.grants()))
    # the reply "was lost": the client knows nothing and asks again with the same demand
    [again] = await bed.round(request("a", {"g": 3}))
    assert list(by_id(again)) == [gid]
    assert by_id(again)[gid]["permits"] == 3 and by_id(again)[gid]["status"] == "active"
    assert len(bed.grants()) == 1  # R20: the unclaimed grant covers the demand
    s = await bed.sem.handle(sync("a"))
    assert list(by_id(s)) == [gid]


# =============================================================================== §4 rounds


@async_test
async def test_r9_concurrent_requests_join_one_round():
    # R9: the round runs roundWaitMs after the first waiting request; later ones join it.
    bed = Bed(limit=10, **SEED_TIMING)  # batched rounds (R9), not R9a's rounds at once
    a = bed.send(request("a", {"g": 1}))
    await bed.clock.advance(500)
    b = bed.send(request("b", {"g": 1}))
    await bed.clock.advance(499)
    assert not a.done() and not b.done()
    await bed.clock.advance(1)
    assert a.done() and b.done()
    assert bed.now == bed.t0 + 1000
    ra, rb = a.result(), b.result()
    assert ra["nextRequestAt"] == rb["nextRequestAt"] == bed.t0 + 1000 + 2000
    rows = bed.grants().values()
    assert len(rows) == 2 and {g["issued_at"] for g in rows} == {bed.t0 + 1000}


@async_test
async def test_r9_round_spacing_period_from_previous_round_start_wait_from_first_request():
    # R9: never sooner than roundPeriodMs after the previous round began; otherwise roundWaitMs
    # after the first waiting request.
    bed = Bed(limit=10, round_wait_ms=300, round_period_ms=5000, free_at_once=False)  # batched rounds (R9), not R9a's rounds at once
    await bed.one(request("a", {"g": 1}))
    r1 = bed.now
    assert r1 == bed.t0 + 300
    await bed.clock.advance(100)
    await bed.one(request("a", {"g": 1}))
    assert bed.now == r1 + 5000  # period wins over wait
    r2 = bed.now
    await bed.clock.advance(20_000)
    t = bed.now
    await bed.one(request("b", {"g": 1}))
    assert bed.now == t + 300  # long after: wait from the first waiting request
    assert r2 < t


@async_test
async def test_r10_second_request_replaces_demand_and_both_calls_get_the_answer():
    # R10: the latest demand snapshot wins; every call of the client gets the round's answer;
    # the reports of both messages are applied.
    bed = Bed(limit=20, **SEED_TIMING)  # batched rounds (R9), not R9a's rounds at once
    [prev] = await bed.round(request("a", {"x": 2, "y": 2}))
    gx = next(g["grantId"] for g in prev["grants"] if g["group"] == "x")
    gy = next(g["grantId"] for g in prev["grants"] if g["group"] == "y")
    first = bed.send(request("a", {"x": 7, "z": 5}, grants=[(gx, 1, 0)]))
    await bed.clock.advance(100)
    second = bed.send(request("a", {"x": 4}, grants=[(gy, 2, 1)]))
    r1, r2 = await bed.finish(first, second)
    assert r1 == r2
    rows = bed.grants()
    assert (rows[gx]["claimed"], rows[gx]["released"]) == (1, 0)
    assert (rows[gy]["claimed"], rows[gy]["released"]) == (2, 1)
    new = [g for g in r1["grants"] if g["grantId"] not in (gx, gy)]
    # latest demand x=4, minus x's 1 unclaimed permit -> 3; z's demand was replaced
    assert [(g["group"], g["permits"]) for g in new] == [("x", 3)]
    assert not any(g["group_name"] == "z" for g in rows.values())
    bed.check()


@async_test
async def test_r11_next_request_at():
    # R11: nextRequestAt is the earliest time the next round can run; an earlier request is
    # accepted and waits until then.
    bed = Bed(limit=10, **SEED_TIMING)  # batched rounds (R9), not R9a's rounds at once
    [r] = await bed.round(request("a", {"g": 1}))
    round_at = bed.now
    assert r["nextRequestAt"] == round_at + 2000
    assert bed.sem.next_request_at() == round_at + 2000
    await bed.clock.advance(100)
    s = await bed.sem.handle(sync("a"))
    assert s["nextRequestAt"] == round_at + 2000
    early = bed.send(request("a", {"g": 2}))   # too early: accepted, waits
    await bed.settle()
    assert bed.sem.next_request_at() == round_at + 2000
    s = await bed.sem.handle(sync("b"))
    assert s["nextRequestAt"] == round_at + 2000   # the pending round
    [r2] = await bed.finish(early)
    assert bed.now == round_at + 2000 and "error" not in r2
    await bed.clock.advance(10_000)
    s = await bed.sem.handle(sync("a"))
    assert s["nextRequestAt"] == bed.now   # nothing pending, period passed: now


@async_test
async def test_r12_limit_raising_admits_nothing_applies_reports_blocks_all():
    # R12: limit raises -> nothing admitted, reports applied, every blocked group gets
    # limit_resolution_error.
    state = {"fail": False}

    def limit():
        if state["fail"]:
            raise RuntimeError("config store down")
        return 10

    bed = Bed(limit=limit)
    [a] = await bed.round(request("a", {"g": 2}))
    gid = a["grants"][0]["grantId"]
    state["fail"] = True
    a2, b2 = await bed.round(request("a", {"g": 5, "h": 1}, grants=[(gid, 2, 1)]), request("b", {"g": 1}))
    assert [g["grantId"] for g in a2["grants"]] == [gid]
    assert by_id(a2)[gid]["claimed"] == 2 and by_id(a2)[gid]["released"] == 1
    row = bed.grants()[gid]
    assert (row["claimed"], row["released"]) == (2, 1)
    assert blocked(a2) == {"g": ("limit_resolution_error", 5), "h": ("limit_resolution_error", 1)}
    assert blocked(b2) == {"g": ("limit_resolution_error", 1)}
    assert len(bed.grants()) == 1
    assert (await bed.usage())["limit"] is None
    state["fail"] = False
    [b3] = await bed.round(request("b", {"g": 1}))
    assert [g["permits"] for g in b3["grants"]] == [1]
    bed.check()


@async_test
async def test_r12_limit_returning_invalid_value_fails_closed():
    # R12 (decision): a limit resolving to a non-integer / negative value counts as raising.
    for bad in (-1, "10", 2.5, None, True):
        bed = Bed(limit=lambda bad=bad: bad)
        [r] = await bed.round(request("a", {"g": 1}))
        assert r["grants"] == [] and blocked(r) == {"g": ("limit_resolution_error", 1)}, bad


@async_test
async def test_r12_group_limit_raising_fails_only_that_group():
    # R12: a group whose groupLimit raises fails closed for that round; other groups proceed.
    def group_limit(group):
        if group == "bad":
            raise KeyError(group)
        return None

    bed = Bed(limit=10, group_limit=group_limit)
    a, b = await bed.round(request("a", {"bad": 2, "ok": 2}), request("b", {"bad": 1}))
    assert [(g["group"], g["permits"]) for g in a["grants"]] == [("ok", 2)]
    assert blocked(a) == {"bad": ("limit_resolution_error", 2)}
    assert blocked(b) == {"bad": ("limit_resolution_error", 1)}
    assert b["grants"] == []


@async_test
async def test_r12_async_callables():
    # R12: limit, groupLimit and canGrant may be async.
    async def limit():
        await asyncio.sleep(0)
        return 3

    async def group_limit(group):
        await asyncio.sleep(0)
        return 1 if group == "narrow" else None

    async def can_grant(client, group):
        await asyncio.sleep(0)
        return client != "banned"

    bed = Bed(limit=limit, group_limit=group_limit, can_grant=can_grant, **SEED_TIMING)  # R9 batching
    a, b, c = await bed.round(
        request("a", {"narrow": 2}, oldest_at=1),
        request("b", {"wide": 5}, oldest_at=2),
        request("banned", {"wide": 1}, oldest_at=0),
    )
    assert [g["permits"] for g in a["grants"]] == [1] and blocked(a) == {"narrow": ("group_limit", 1)}
    assert [g["permits"] for g in b["grants"]] == [2] and blocked(b) == {"wide": ("limit", 3)}
    assert c["grants"] == [] and blocked(c) == {"wide": ("not_permitted", 1)}
    usage = await bed.usage()
    assert usage["limit"] == 3 and usage["groups"]["narrow"]["limit"] == 1
    assert usage["groups"]["wide"]["limit"] is None


@async_test
async def test_r12_callbacks_resolved_once_per_round():
    # R12: limit once per round, groupLimit once per group, canGrant once per (client, group).
    calls = {"limit": 0, "group": [], "can": []}

    def limit():
        calls["limit"] += 1
        return 100

    def group_limit(group):
        calls["group"].append(group)
        return 50

    def can_grant(client, group):
        calls["can"].append((client, group))
        return True

    bed = Bed(limit=limit, group_limit=group_limit, can_grant=can_grant, **SEED_TIMING)  # R9 batching
    first = bed.send(request("a", {"x": 1, "y": 1}))
    await bed.clock.advance(10)
    second = bed.send(request("a", {"x": 2, "y": 1}))  # same client again (R10)
    others = [bed.send(request(c, {"x": 1})) for c in ("b", "c")]
    await bed.finish(first, second, *others)
    assert calls["limit"] == 1
    assert sorted(calls["group"]) == ["x", "y"]
    assert sorted(calls["can"]) == [("a", "x"), ("a", "y"), ("b", "x"), ("c", "x")]
    await bed.round(request("a", {"x": 1}))
    assert calls["limit"] == 2 and len(calls["group"]) == 3 and len(calls["can"]) == 5


@async_test
async def test_r12_r22_can_grant_raising_counts_as_not_permitted():
    # R12/R22 (decision): a canGrant callback that raises fails closed (not_permitted).
    def can_grant(client, group):
        raise RuntimeError("policy service down")

    bed = Bed(limit=5, can_grant=can_grant)
    [r] = await bed.round(request("a", {"g": 2}))
    assert r["grants"] == [] and blocked(r) == {"g": ("not_permitted", 2)}


# =============================================================================== §5 grants


async def _granted(bed: Bed, client: str, group: str, count: int) -> str:
    [reply] = await bed.round(request(client, {group: count}))
    new = [g for g in reply["grants"] if g["group"] == group and g["claimed"] == 0]
    assert new and new[-1]["permits"] == count
    return new[-1]["grantId"]


@async_test
async def test_r13_high_water_marks_stale_reordered_repeated_reports():
    # R13: reports raise high-water marks; lower values change nothing; claimed clamped to
    # permits, released to claimed; repeats never return capacity twice.
    bed = Bed(limit=10)
    gid = await _granted(bed, "a", "g", 5)

    async def report(claimed, released):
        reply = await bed.sem.handle(sync("a", [(gid, claimed, released)]))
        return by_id(reply).get(gid)

    st = await report(3, 1)
    assert (st["claimed"], st["released"]) == (3, 1)
    assert (await bed.usage())["outstanding"] == 4
    st = await report(3, 1)  # repeated
    assert (st["claimed"], st["released"]) == (3, 1) and (await bed.usage())["outstanding"] == 4
    st = await report(2, 0)  # stale
    assert (st["claimed"], st["released"]) == (3, 1) and (await bed.usage())["outstanding"] == 4
    st = await report(2, 2)  # reordered: released rises, claimed stays
    assert (st["claimed"], st["released"]) == (3, 2) and (await bed.usage())["outstanding"] == 3
    st = await report(9, 4)  # claimed clamped to permits
    assert (st["claimed"], st["released"]) == (5, 4) and st["permits"] == 5
    assert (await bed.usage())["outstanding"] == 1
    row = bed.grants()[gid]
    assert (row["claimed"], row["released"]) == (5, 4)
    bed.check()
    # via a request too: the same stale report in a round changes nothing
    [r] = await bed.round(request("a", {}, grants=[(gid, 1, 1)]))
    assert (by_id(r)[gid]["claimed"], by_id(r)[gid]["released"]) == (5, 4)
    st = await report(9, 9)  # released clamped to claimed (5): settled
    assert (st["claimed"], st["released"]) == (5, 5)
    assert (await bed.usage())["outstanding"] == 0


@async_test
async def test_r13_released_clamped_to_recorded_claimed():
    # R13: released is clamped to the (clamped) claimed count: a report claiming more than
    # the grant holds cannot release more than its permits.
    bed = Bed(limit=10)
    gid = await _granted(bed, "a", "g", 2)
    st = by_id(await bed.sem.handle(sync("a", [(gid, 7, 6)])))[gid]
    assert (st["claimed"], st["released"]) == (2, 2)
    assert (await bed.usage())["outstanding"] == 0
    bed.check()


@async_test
async def test_r14_foreign_grant_report_not_applied_answered_not_found():
    # R14: a report for another client's grant is not applied and is answered not_found.
    bed = Bed(limit=10)
    gid = await _granted(bed, "a", "g", 3)
    before = dump(bed.storage)
    s = await bed.sem.handle(sync("mallory", [(gid, 3, 3)]))
    assert by_id(s)[gid] == {"grantId": gid, "group": None, "permits": 0, "claimed": 0, "released": 0,
                             "claimBy": None, "status": "not_found"}
    assert dump(bed.storage) == before
    [r] = await bed.round(request("mallory", {}, grants=[(gid, 2, 1)]))
    assert by_id(r)[gid]["status"] == "not_found"
    row = bed.grants()[gid]
    assert (row["claimed"], row["released"], row["client_id"]) == (0, 0, "a")
    assert (await bed.usage())["outstanding"] == 3


@async_test
async def test_r15_reclaim_shrinks_or_deletes_and_late_reports_expired_or_not_found():
    # R15: past claimBy, a grant shrinks to its claimed count (answered expired, with clamped
    # counts) or, with nothing claimed, is deleted (answered not_found).
    bed = Bed(limit=10)
    a, b = await bed.round(request("a", {"g": 5}), request("b", {"g": 2}))
    ga, gb = a["grants"][0]["grantId"], b["grants"][0]["grantId"]
    claim_by = a["grants"][0]["claimBy"]
    assert claim_by == bed.now + 10_000
    await bed.sem.handle(sync("a", [(ga, 2, 0)]))
    await bed.clock.advance_to(claim_by)  # the alarm reclaims
    rows = bed.grants()
    assert gb not in rows
    assert rows[ga]["permits"] == 2 and rows[ga]["reclaimed"] == 1
    st = by_id(await bed.sem.handle(sync("a", [(ga, 4, 1)])))[ga]
    assert st == {"grantId": ga, "group": "g", "permits": 2, "claimed": 2, "released": 1,
                  "claimBy": claim_by, "status": "expired"}
    stb = by_id(await bed.sem.handle(sync("b", [(gb, 1, 0)])))[gb]
    assert stb["status"] == "not_found"
    assert (await bed.usage())["outstanding"] == 1
    bed.check()


@async_test
async def test_r15_r15a_late_claim_is_clamped_even_before_the_alarm_runs():
    # R15/R15a/R16: a claim reaching the holder after claimBy is clamped; the sync reclaims
    # first, even when the alarm is late.
    bed = Bed(limit=10, alarm_delay_ms=60_000)
    [a] = await bed.round(request("a", {"g": 4}))
    gid, claim_by = a["grants"][0]["grantId"], a["grants"][0]["claimBy"]
    await bed.sem.handle(sync("a", [(gid, 1, 0)]))
    await bed.clock.advance_to(claim_by + 1)
    assert bed.driver.fired == 0
    st = by_id(await bed.sem.handle(sync("a", [(gid, 3, 0)])))[gid]
    assert (st["status"], st["permits"], st["claimed"]) == ("expired", 1, 1)
    # A grant with nothing claimed: the late claim finds nothing.
    [b] = await bed.round(request("b", {"g": 2}))
    gb = b["grants"][0]["grantId"]
    await bed.clock.advance_to(b["grants"][0]["claimBy"] + 5)
    [r] = await bed.round(request("b", {"g": 2}, grants=[(gb, 2, 0)]))
    assert by_id(r)[gb]["status"] == "not_found"
    assert (await bed.usage())["outstanding"] == 1 + 2  # a's claimed 1 + b's new grant of 2
    bed.check()


@async_test
async def test_r15_claim_at_exactly_claim_by_is_late():
    # R15 (decision): the deadline is exclusive -- a claim arriving at claimBy itself is
    # reclaimed first (answered expired/not_found).
    bed = Bed(limit=10, alarm_delay_ms=60_000)
    [a] = await bed.round(request("a", {"g": 2}))
    gid, claim_by = a["grants"][0]["grantId"], a["grants"][0]["claimBy"]
    await bed.clock.advance_to(claim_by - 1)
    st = by_id(await bed.sem.handle(sync("a", [(gid, 1, 0)])))[gid]
    assert st["status"] == "active" and st["claimed"] == 1
    await bed.clock.advance_to(claim_by)
    st = by_id(await bed.sem.handle(sync("a", [(gid, 2, 0)])))[gid]
    assert (st["status"], st["claimed"], st["permits"]) == ("expired", 1, 1)


@async_test
async def test_r16_alarm_reclaims_without_any_request_and_follows_earliest_claim_by():
    # R16: the alarm follows the earliest claimBy of grants with unclaimed permits and reclaims
    # without another request.
    bed = Bed(limit=10, **SEED_TIMING)  # batched rounds (R9), not R9a's rounds at once
    [a] = await bed.round(request("a", {"g": 3}))
    g1, c1 = a["grants"][0]["grantId"], a["grants"][0]["claimBy"]
    # the holder is a scheduler participant: its due time is read from the grants, no timer row
    assert bed.storage.alarm == c1 and bed.scheduler.due_times() == {RECLAIM_TIMER: c1}
    assert timers(bed.storage) == {}
    await bed.clock.advance(5000)
    [b] = await bed.round(request("b", {"h": 2}))
    g2, c2 = b["grants"][0]["grantId"], b["grants"][0]["claimBy"]
    assert c2 > c1 and bed.storage.alarm == c1
    await bed.sem.handle(sync("a", [(g1, 3, 0)]))   # g1 fully claimed: alarm moves on
    assert bed.storage.alarm == c2
    [c] = await bed.round(request("c", {"k": 4}))
    g3, c3 = c["grants"][0]["grantId"], c["grants"][0]["claimBy"]
    await bed.sem.handle(sync("c", [(g3, 1, 0)]))   # partially claimed: still unclaimed
    assert bed.storage.alarm == c2
    fired = bed.driver.fired
    await bed.clock.advance_to(c2)   # no request: the alarm alone reclaims g2
    assert bed.driver.fired == fired + 1
    assert g2 not in bed.grants()
    assert bed.storage.alarm == c3
    usage = await bed.usage()
    assert usage["outstanding"] == 3 + 4 and "h" not in usage["groups"]
    await bed.clock.advance_to(c3)
    assert bed.grants()[g3]["permits"] == 1
    assert bed.storage.alarm is None and timers(bed.storage) == {}
    assert (await bed.usage())["outstanding"] == 3 + 1
    assert bed.driver.failures == []
    bed.check()


@async_test
async def test_r16_rounds_reclaim_too():
    # R16: a round reclaims overdue grants (alarm delayed) before allocating.
    bed = Bed(limit=3, alarm_delay_ms=120_000)
    await _granted(bed, "a", "g", 3)
    await bed.clock.advance(10_500)
    [b] = await bed.round(request("b", {"g": 3}))
    assert [g["permits"] for g in b["grants"]] == [3]
    assert {r["client_id"] for r in bed.grants().values()} == {"b"}


@async_test
async def test_r17_settled_grants_are_deleted():
    # R17: a grant whose permits are all released is settled and deleted.
    bed = Bed(limit=10)
    gid = await _granted(bed, "a", "g", 2)
    s = await bed.sem.handle(sync("a", [(gid, 2, 2)]))
    assert by_id(s)[gid]["released"] == 2 and by_id(s)[gid]["status"] == "active"
    assert gid not in bed.grants()
    assert (await bed.usage())["groups"] == {}
    s = await bed.sem.handle(sync("a", [(gid, 2, 2)]))
    assert by_id(s)[gid]["status"] == "not_found"
    # A grant fully released of what it kept after reclaim is deleted too.
    g2 = await _granted(bed, "a", "g", 4)
    await bed.sem.handle(sync("a", [(g2, 1, 1)]))
    await bed.clock.advance(10_000)
    assert g2 not in bed.grants()
    bed.check()


@async_test
async def test_r18_confirmed_claims_stay_charged_until_released():
    # R18: claimed permits stay charged past the deadline and when limits drop.
    limit = {"v": 4}
    bed = Bed(limit=lambda: limit["v"])
    gid = await _granted(bed, "a", "g", 4)
    await bed.sem.handle(sync("a", [(gid, 3, 0)]))
    await bed.clock.advance(60_000)
    limit["v"] = 1
    [b] = await bed.round(request("b", {"g": 1}))
    assert b["grants"] == []
    row = bed.grants()[gid]
    assert (row["permits"], row["claimed"], row["released"]) == (3, 3, 0)
    assert (await bed.usage())["outstanding"] == 3


# =============================================================================== §6 allocation


@async_test
async def test_r19_charged_capacity_arithmetic():
    # R19: charged = sum(permits - released) after reclaim (+ lease footprint); the round
    # grants exactly the room left.
    bed = Bed(limit=10)
    gid = await _granted(bed, "a", "g", 5)
    await bed.sem.handle(sync("a", [(gid, 3, 1)]))
    u = await bed.usage()
    assert u["outstanding"] == 4 and u["groups"]["g"]["outstanding"] == 4
    [b] = await bed.round(request("b", {"h": 100}))
    assert [g["permits"] for g in b["grants"]] == [6] and blocked(b) == {"h": ("limit", 94)}
    await bed.clock.advance(20_000)   # reclaim: g shrinks to claimed 3, released 1 -> 2
    u = await bed.usage()
    assert u["groups"]["g"]["outstanding"] == 2 and "h" not in u["groups"]
    assert u["outstanding"] == 2
    [c] = await bed.round(request("c", {"h": 100}))
    assert [g["permits"] for g in c["grants"]] == [8]
    bed.check()


@async_test
async def test_r19_lease_footprint_counts_against_the_limit():
    # R19: total charged includes lease footprint (strict provisioning).
    bed = Bed(limit=10, leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 4})
    [a] = await bed.round(request("a", {"g": 2}, leases=[]))
    assert [g["permits"] for g in a["grants"]] == [2] and [x["permits"] for x in a["leases"]] == [4]
    u = await bed.usage()
    assert (u["outstanding"], u["leaseFootprint"]) == (2, 4)
    assert u["groups"]["g"]["leaseFootprint"] == 4 and u["liveLeases"] == 1
    [b] = await bed.round(request("b", {"h": 50}))
    assert [g["permits"] for g in b["grants"]] == [4]   # 10 - 2 - 4
    bed.check()


@async_test
async def test_r20_need_subtracts_unclaimed_grant_permits():
    # R20: need = count - unclaimed grant permits held in the group, never below zero.
    bed = Bed(limit=20)
    gid = await _granted(bed, "a", "g", 3)
    [r] = await bed.round(request("a", {"g": 5}))
    new = [g for g in r["grants"] if g["grantId"] != gid]
    assert [g["permits"] for g in new] == [2]
    g2 = new[0]["grantId"]
    await bed.sem.handle(sync("a", [(gid, 3, 0), (g2, 1, 0)]))  # unclaimed now: 1 (g2)
    [r] = await bed.round(request("a", {"g": 5}))
    new = [g for g in r["grants"] if g["grantId"] not in (gid, g2)]
    assert [g["permits"] for g in new] == [4]
    # unclaimed (1 + 4) > count: need 0 -> no grant and not blocked
    [r] = await bed.round(request("a", {"g": 1, "h": 0}))
    assert len(r["grants"]) == 3 and r["blocked"] == [] and r["contended"] is False
    # other groups are independent
    [r] = await bed.round(request("a", {"h": 2}))
    assert [g["permits"] for g in r["grants"] if g["group"] == "h"] == [2]


@async_test
async def test_r20_need_subtracts_undrawn_lease_permits():
    # R20: undrawn permits of the client's live lease in the group reduce its need.
    bed = Bed(limit=20, leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 4})
    [a] = await bed.round(request("a", {"g": 1}, leases=[]))
    lease = a["leases"][0]
    g1 = a["grants"][0]["grantId"]
    await bed.sem.handle(sync("a", [(g1, 1, 0)], leases=[(lease["leaseId"], 1, 0)]))  # 3 undrawn
    [r] = await bed.round(request("a", {"g": 5}, leases=[(lease["leaseId"], 1, 0)]))
    new = [g for g in r["grants"] if g["grantId"] != g1]
    assert [g["permits"] for g in new] == [2]   # 5 - 3 undrawn
    bed.check()


@async_test
async def test_r21_oldest_first_with_tie_breaks():
    # R21: ascending oldestAt; ties go to the request that arrived first (not the client id).
    bed = Bed(limit=3)
    x = bed.send(request("x", {"g": 2}, oldest_at=200))
    y = bed.send(request("y", {"g": 2}, oldest_at=100))
    await bed.clock.advance(10)
    z = bed.send(request("a", {"g": 2}, oldest_at=100))  # same age as y, arrived later
    rx, ry, rz = await bed.finish(x, y, z)
    assert [g["permits"] for g in ry["grants"]] == [2]
    assert [g["permits"] for g in rz["grants"]] == [1] and blocked(rz) == {"g": ("limit", 1)}
    assert rx["grants"] == [] and blocked(rx) == {"g": ("limit", 2)}
    assert rx["contended"] and ry["contended"] and rz["contended"]


@async_test
async def test_r21_oldest_first_across_groups_of_one_client():
    # R21: entries (not clients) are ordered: a client's old group before another's, its young
    # group after.
    bed = Bed(limit=4)
    a, b = await bed.round(
        request("a", [("old", 2, 10), ("young", 2, 300)]),
        request("b", [("mid", 2, 100)]),
    )
    assert {g["group"]: g["permits"] for g in a["grants"]} == {"old": 2}
    assert {g["group"]: g["permits"] for g in b["grants"]} == {"mid": 2}
    assert blocked(a) == {"young": ("limit", 2)}


@async_test
async def test_r21_one_grant_per_client_group_per_round_never_above_need():
    # R21: at most one new grant per (client, group) per round, never more than the need,
    # min(need, room) when room is short.
    bed = Bed(limit=100)
    t1 = bed.send(request("a", {"g": 3}))
    t2 = bed.send(request("a", {"g": 3}))
    await bed.finish(t1, t2)
    assert [(r["group_name"], r["permits"]) for r in bed.grants().values()] == [("g", 3)]
    bed2 = Bed(limit=5)
    [r] = await bed2.round(request("a", {"g": 8}))
    assert [g["permits"] for g in r["grants"]] == [5] and blocked(r) == {"g": ("limit", 3)}


@async_test
async def test_r22_can_grant_false_blocks_with_not_permitted():
    # R22: canGrant(clientId, group) false blocks that entry; others are unaffected.
    bed = Bed(limit=5, can_grant=lambda client, group: not (client == "a" and group == "secret"))
    a, b = await bed.round(request("a", {"secret": 2, "open": 1}, oldest_at=0),
                           request("b", {"secret": 2}, oldest_at=5))
    assert [(g["group"], g["permits"]) for g in a["grants"]] == [("open", 1)]
    assert blocked(a) == {"secret": ("not_permitted", 2)}
    assert [g["permits"] for g in b["grants"]] == [2] and b["blocked"] == []
    # constant False
    bed2 = Bed(limit=5, can_grant=False)
    [r] = await bed2.round(request("a", {"g": 1}))
    assert r["grants"] == [] and blocked(r) == {"g": ("not_permitted", 1)}


@async_test
async def test_r23_blocked_reason_order():
    # R23: first constraint that stopped the entry, in the order not_permitted,
    # limit_resolution_error, group_limit, limit; `waiting` is what is left.
    def group_limit(group):
        if group in ("err", "denied_err"):
            raise RuntimeError("boom")
        return {"narrow": 1, "tight": 3}.get(group)

    bed = Bed(limit=4, group_limit=group_limit,
              can_grant=lambda client, group: group != "denied_err")
    [r] = await bed.round(request("a", [
        ("denied_err", 1, 0),   # not permitted AND its group limit raises -> not_permitted
        ("err", 2, 1),          # limit_resolution_error
        ("narrow", 3, 2),       # group room 1 < need 3: group_limit (gets 1, 2 waiting)
        ("wide", 2, 3),         # room 3 -> gets 2
        ("tight", 3, 4),        # group room 3 = need, but only 1 left under limit -> limit
    ]))
    assert {g["group"]: g["permits"] for g in r["grants"]} == {"narrow": 1, "wide": 2, "tight": 1}
    assert blocked(r) == {
        "denied_err": ("not_permitted", 1),
        "err": ("limit_resolution_error", 2),
        "narrow": ("group_limit", 2),
        "tight": ("limit", 2),
    }
    assert [b["group"] for b in r["blocked"]] == ["denied_err", "err", "narrow", "tight"]


@async_test
async def test_r23_group_limit_reported_when_both_group_and_limit_stop_it():
    # R23: an entry stopped by both its group limit and the limit reports group_limit.
    bed = Bed(limit=2, group_limit={"g": 1})
    [r] = await bed.round(request("a", {"g": 5}))
    assert [g["permits"] for g in r["grants"]] == [1] and blocked(r) == {"g": ("group_limit", 4)}
    bed2 = Bed(limit=0, group_limit={"g": 0})
    [r] = await bed2.round(request("a", {"g": 1}))
    assert blocked(r) == {"g": ("group_limit", 1)}


@async_test
async def test_r24_lowered_limit_never_revokes_and_stops_admissions_until_below():
    # R24: lowering the limit keeps running work; admissions resume once charged < limit.
    limit = {"v": 5}
    bed = Bed(limit=lambda: limit["v"])
    gid = await _granted(bed, "a", "g", 5)
    await bed.sem.handle(sync("a", [(gid, 5, 0)]))
    limit["v"] = 2
    before = bed.grants()
    [b] = await bed.round(request("b", {"g": 1}))
    assert b["grants"] == [] and blocked(b) == {"g": ("limit", 1)}
    assert bed.grants() == before
    await bed.sem.handle(sync("a", [(gid, 5, 3)]))   # charged 2: not below 2 yet
    [b] = await bed.round(request("b", {"g": 1}))
    assert b["grants"] == []
    await bed.sem.handle(sync("a", [(gid, 5, 4)]))   # charged 1
    [b] = await bed.round(request("b", {"g": 5}))
    assert [g["permits"] for g in b["grants"]] == [1] and blocked(b) == {"g": ("limit", 4)}
    assert (await bed.usage())["outstanding"] == 2
    bed.check()


@async_test
async def test_r24_lowered_group_limit_never_revokes():
    # R24: same for a group limit.
    gl = {"g": 4}
    bed = Bed(limit=100, group_limit=lambda g: gl.get(g))
    gid = await _granted(bed, "a", "g", 4)
    await bed.sem.handle(sync("a", [(gid, 4, 0)]))
    gl["g"] = 1
    [b] = await bed.round(request("b", {"g": 1, "other": 1}))
    assert [g["group"] for g in b["grants"]] == ["other"] and blocked(b) == {"g": ("group_limit", 1)}
    assert bed.grants()[gid]["permits"] == 4
    await bed.sem.handle(sync("a", [(gid, 4, 4)]))
    [b] = await bed.round(request("b", {"g": 3}))
    assert [g["permits"] for g in b["grants"] if g["group"] == "g"] == [1]


# =============================================================================== §9


@async_test
async def test_r38_usage_shape_and_values():
    # R38: usage() returns the limit, outstanding grant permits, lease footprint, and
    # per-group usage (outstanding, lease footprint, group limit if any).
    bed = Bed(limit=lambda: 12, group_limit={"capped": 5},
              leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 3})
    empty = await bed.usage()
    assert empty == {"limit": 12, "outstanding": 0, "leaseFootprint": 0, "liveLeases": 0,
                     "retiredLeases": 0, "charged": 0, "available": 12, "groups": {}}
    a, b = await bed.round(request("a", {"capped": 4}), request("b", {"free": 2}, leases=[]))
    gb = b["grants"][0]["grantId"]
    await bed.sem.handle(sync("b", [(gb, 2, 1)]))
    u = await bed.usage()
    assert u == {
        "limit": 12, "outstanding": 5, "leaseFootprint": 3, "liveLeases": 1, "retiredLeases": 0,
        "charged": 8, "available": 4,
        "groups": {
            "capped": {"outstanding": 4, "leaseFootprint": 0, "liveLeases": 0, "retiredLeases": 0,
                       "limit": 5, "charged": 4, "available": 1},
            "free": {"outstanding": 1, "leaseFootprint": 3, "liveLeases": 1, "retiredLeases": 0,
                     "limit": None, "charged": 4, "available": 4},
        },
    }
    agg = bed.check()
    assert agg["total"] == {"outstanding": 5, "lease_footprint": 3, "live_leases": 1, "retired_leases": 0}


def test_check_aggregates_detects_drift():
    # Self-test of the checker other suites rely on: a corrupted aggregate is caught.
    async def main():
        bed = Bed(limit=5)
        await bed.round(request("a", {"g": 2}))
        bed.check()
        bed.storage.connection.execute(f"UPDATE {GROUPS} SET outstanding = outstanding + 1")
        with pytest.raises(AssertionError, match="group 'g'"):
            check_aggregates(bed.storage)
        bed.storage.connection.execute(f"UPDATE {GROUPS} SET outstanding = outstanding - 1")
        bed.storage.connection.execute(f"UPDATE {META} SET value = 9 WHERE key = 'outstanding'")
        with pytest.raises(AssertionError, match="totals"):
            check_aggregates(bed.ctx)

    asyncio.run(main())


@async_test
async def test_scheduler_handlers_survive_via_constructor_registration():
    # R1/R16 wiring: the semaphore takes part in the alarm of the scheduler it is given.
    bed = Bed(limit=5)
    assert isinstance(bed.scheduler, DurabilityScheduler)
    assert RECLAIM_TIMER in bed.scheduler.participants


@async_test
async def test_r4_a_round_timer_that_dies_while_waiting_does_not_block_later_rounds():
    # R4: losing the round timer fails the waiting calls (they ask again); it must not leave the
    # instance believing a round is still scheduled, or no later request would ever be answered
    bed = Bed(5, **SEED_TIMING)  # batched rounds (R9), not R9a's rounds at once
    first = bed.send(request("c1", {"g": 1}))
    await bed.settle()
    bed.sem._round_task.cancel()
    await bed.settle()
    assert first.result()["error"]["code"] == "round_failed"
    (reply,) = await bed.finish(bed.send(request("c2", {"g": 2})), within_ms=5_000)
    assert [g["permits"] for g in reply["grants"]] == [2]
    bed.check()


@async_test
async def test_r4_a_round_timer_cancelled_before_its_first_step_fails_its_calls_and_is_replaced():
    # R4: a round task cancelled before its first step (its coroutine never ran, so nothing in it
    # can clean up) must not stay behind as "the round timer": its waiting call fails with
    # round_failed (the client asks again) and the next request starts a new round. Bounded by
    # asyncio.wait_for so the old behaviour (every later request waits forever) fails the test.
    bed = Bed(5)
    first = bed.send(request("c1", {"g": 1}))
    while bed.sem._round_task is None:  # handle() runs up to creating the round task
        await asyncio.sleep(0)
    task = bed.sem._round_task
    assert inspect.getcoroutinestate(task.get_coro()) == inspect.CORO_CREATED  # not started
    task.cancel()
    reply = await asyncio.wait_for(asyncio.shield(first), timeout=30)  # a hang, not a slow machine
    assert reply["error"]["code"] == "round_failed"
    second = bed.send(request("c2", {"g": 2}))
    while bed.sem._round_task is None or bed.sem._round_task is task:
        await asyncio.sleep(0)
    assert bed.sem._round_task in bed.sem._round_tasks  # a strong reference while not done
    (reply,) = await asyncio.wait_for(bed.finish(second, within_ms=5_000), timeout=30)
    assert [g["permits"] for g in reply["grants"]] == [2]
    # Also when the next request comes before the cancelled timer's done callback ran (here it
    # never runs): the request itself notices the finished timer.
    third = bed.send(request("c3", {"g": 1}))
    while bed.sem._round_task is None:
        await asyncio.sleep(0)
    task = bed.sem._round_task
    task.remove_done_callback(bed.sem._round_ended)
    task.cancel()
    while not task.done():
        await asyncio.sleep(0)
    assert bed.sem._round_task is task  # still registered as the waiting round timer
    fourth = bed.send(request("c4", {"g": 1}))
    r3, r4 = await asyncio.wait_for(bed.finish(third, fourth, within_ms=5_000), timeout=30)
    assert r3["error"]["code"] == "round_failed"
    assert [g["permits"] for g in r4["grants"]] == [1]
    assert bed.sem._round_tasks == set()  # finished round tasks are not kept
    bed.check()
