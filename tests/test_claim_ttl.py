"""Crash expiry of claimed permits (issue 11): ``claim_ttl_ms``, off by default. With it, the
holder releases the claimed permits of a client it has not heard from for that long (R18's
exception, like Redisson's lease time); a live client's queue heartbeats its claims so running
work keeps its permit; nothing is freed twice (I2)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from semaphore import DEFAULT_LEASES, ConfigurationError, HolderUnavailableError, LeaseConfig, PermitResponse
from semaphore.core.config import holder_leases
from semaphore.holder import CLIENTS
from semaphore.testing import (
    SEED_TIMING,
    T0,
    Bed,
    ClientSide,
    HolderSide,
    Net,
    SimClock,
    async_test,
    query,
    request,
    sync,
)

pytestmark = pytest.mark.usefixtures("quiet_logs")
TTL = 5_000


async def claimed(bed: Bed, client: str = "c", permits: int = 3, claim: int = 2) -> str:
    (reply,) = await bed.round(request(client, {"g": permits}))
    (grant,) = reply["grants"]
    await bed.sem.handle(sync(client, [(grant["grantId"], claim, 0)]))
    return grant["grantId"]


@async_test
async def test_claims_of_a_client_unheard_of_for_claim_ttl_ms_are_released_by_the_alarm():
    bed = Bed(10, grant_timeout_ms=600_000, claim_ttl_ms=TTL)
    gid = await claimed(bed)
    assert (await bed.usage())["outstanding"] == 3
    await bed.clock.advance(TTL - 100)
    assert (await bed.usage())["outstanding"] == 3  # not yet
    await bed.clock.advance(200)
    u = await bed.usage()
    assert u["outstanding"] == 1  # the 2 claimed released; the unclaimed 1 waits for its claimBy
    (h,) = (await bed.sem.holders())["holders"]
    assert [(g["claimed"], g["released"]) for g in h["grants"]] == [(2, 2)]
    # The client was alive after all: its reports free nothing twice (I2), a new claim is charged.
    for released in (0, 1, 2):
        await bed.sem.handle(sync("c", [(gid, 2, released)]))
        assert (await bed.usage())["outstanding"] == 1
    await bed.sem.handle(sync("c", [(gid, 3, 2)]))
    assert (await bed.usage())["outstanding"] == 1  # the 3rd permit claimed: still charged
    bed.check()


@async_test
async def test_reports_heartbeat_the_claims_and_the_default_never_expires():
    bed = Bed(10, grant_timeout_ms=600_000, claim_ttl_ms=TTL)
    gid = await claimed(bed)
    for _ in range(10):
        await bed.clock.advance(TTL // 2)
        await bed.sem.handle(sync("c", [(gid, 2, 0)]))
    assert (await bed.usage())["outstanding"] == 3
    off = Bed(10, grant_timeout_ms=600_000)
    await claimed(off)
    await off.clock.advance(10 * TTL)
    assert (await off.usage())["outstanding"] == 3  # R18: off by default


@async_test
async def test_replies_carry_claim_ttl_ms_only_when_set_and_it_is_validated():
    bed = Bed(10, claim_ttl_ms=TTL)
    (reply,) = await bed.round(request("c", {"g": 1}))
    assert reply["claimTtlMs"] == TTL and PermitResponse.from_wire(reply).claim_ttl_ms == TTL
    off = Bed(10)
    (reply,) = await off.round(request("c", {"g": 1}))
    assert "claimTtlMs" not in reply and PermitResponse.from_wire(reply).claim_ttl_ms is None
    for bad in (0, -1, "5", True):
        with pytest.raises(ConfigurationError) as err:
            Bed(10, claim_ttl_ms=bad)
        assert err.value.field == "claim_ttl_ms"


def _client(clock: SimClock, holder: HolderSide, started: list[str], name: str = "c1") -> tuple[Net, ClientSide]:
    net = Net(holder, clock)
    side = ClientSide(name, clock, net, on_admit=lambda s, item: started.append(item.item_id),
                      report_releases_within_ms=60_000)
    return net, side


@async_test
async def test_a_live_queue_heartbeats_its_claims_so_long_work_keeps_its_permit():
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, grant_timeout_ms=10_000, claim_ttl_ms=TTL)
    started: list[str] = []
    net, side = _client(clock, holder, started)
    await side.queue.enqueue("acct", "g", "long")
    await clock.advance(3000)
    assert started == ["long"]
    await clock.advance(60_000)  # the job runs a minute: 12 claim TTLs
    assert (await holder.usage())["outstanding"] == 1
    syncs = [m for m in net.sent if m["type"] == "sync"]
    assert len(syncs) >= 60_000 // TTL  # a heartbeat at least every claim_ttl_ms / 2... roughly
    await side.queue.complete("long")
    await clock.advance(70_000)
    assert (await holder.usage())["outstanding"] == 0


@async_test
async def test_a_client_cut_off_from_the_holder_loses_its_claims_after_claim_ttl_ms():
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, grant_timeout_ms=10_000, claim_ttl_ms=TTL)
    started: list[str] = []
    net, side = _client(clock, holder, started)
    await side.queue.enqueue("acct", "g", "job")
    await clock.advance(3000)
    assert started == ["job"] and (await holder.usage())["outstanding"] == 1

    def cut(key: str, message: dict) -> None:
        raise HolderUnavailableError("partitioned (test)")

    net.intercept = cut
    await clock.advance(TTL + 2_000)
    assert (await holder.usage())["outstanding"] == 0  # the documented risk: the job runs uncharged


# --- Crash expiry: who is told the TTL, rows forgotten, bounded reads --------------------------
# Crash expiry (``claim_ttl_ms``), from its cold review: a client is expired only after its
# reply told it the TTL (enabling or lowering the option never expires a live client that has not
# heard of it); expiry forgets the client rows it empties; the next-due read does not grow with
# clients that hold no claim; claims of clients without a last-report row (written before this
# release) never expire (documented).


def _steps(bed: Bed, fn) -> int:
    """SQLite VM instructions fn() runs on the bed's connection (a proxy for rows read)."""
    conn = bed.storage.connection
    count = [0]

    def tick() -> int:
        count[0] += 1
        return 0

    conn.set_progress_handler(tick, 1)
    try:
        fn()
    finally:
        conn.set_progress_handler(None, 1)
    return count[0]


# ---------------------------------------------------------------------------- F1
@async_test
async def test_enabling_claim_ttl_ms_never_expires_a_live_client_not_yet_told():
    """A deploy that turns claim_ttl_ms on: a client whose last reply carried no claimTtlMs does
    not heartbeat, so its claims expire only once a reply has told it the TTL (they were released
    at the first alarm after any traffic: a live job lost its permit)."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, grant_timeout_ms=10_000, leases=None)
    started: list[str] = []
    net, side = _client(clock, holder, started)
    await side.queue.enqueue("acct", "g", "long")
    await clock.advance(3000)
    assert started == ["long"] and (await holder.usage())["outstanding"] == 1
    await clock.advance(60_000)  # a long job, nothing to say
    holder.evict(claim_ttl_ms=TTL)  # the deploy turning crash expiry on
    await holder.round(request("other", {"g": 1}))  # any traffic arms the alarm
    await clock.advance(TTL)
    # the live client's running job must stay charged (1) plus the other's grant (1)
    assert (await holder.usage())["outstanding"] == 2


@async_test
async def test_lowering_claim_ttl_ms_keeps_the_ttl_a_client_was_told_until_its_next_reply():
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, grant_timeout_ms=10_000, claim_ttl_ms=60_000)
    started: list[str] = []
    net, side = _client(clock, holder, started)
    await side.queue.enqueue("acct", "g", "long")
    await clock.advance(3000)
    assert started == ["long"]
    holder.evict(claim_ttl_ms=TTL)  # lowered: the client still heartbeats every 30 s
    await holder.round(request("other", {"g": 1}))
    await clock.advance(3 * TTL)
    (c1,) = [h for h in (await holder.sem.holders())["holders"] if h["clientId"] == "c1"]
    assert c1["charged"] == 1  # told 60 s at its last reply: its claim is still charged


# ---------------------------------------------------------------------------- F2
@async_test
async def test_claim_expiry_forgets_the_client_rows_it_emptied():
    """run_claim_expiry deletes grants claimed in full but does not call _forget: the client
    rows of crashed clients (the very clients the feature is for) pile up at the oldest end of
    clients_seen, walked by claim_expiry_due on every arm()."""
    bed = Bed(100, grant_timeout_ms=600_000, claim_ttl_ms=TTL)
    for i in range(5):
        await claimed(bed, f"crashed{i}", permits=2, claim=2)  # claimed in full
    await bed.clock.advance(TTL + 100)
    assert (await bed.usage())["outstanding"] == 0
    assert bed.grants() == {}
    assert query(bed.storage, f"SELECT client_id FROM {CLIENTS}") == []
    bed.check()


# ---------------------------------------------------------------------------- F3
async def _crowd(n: int) -> Bed:
    bed = Bed(100_000, grant_timeout_ms=600_000, claim_ttl_ms=600_000)
    for start in range(0, n, 1000):
        await bed.round(*(request(f"u{i}", {"g": 1}) for i in range(start, min(n, start + 1000))))
    await bed.clock.advance(10)
    await claimed(bed, "z", permits=1, claim=1)  # the one claiming client, heard from last
    return bed


@async_test
async def test_the_expiry_due_read_does_not_grow_with_clients_holding_no_claim():
    """_reclaim_due runs after every round and sync (scheduler arm()); with claim_ttl_ms its
    claim_expiry_due walks clients_seen oldest first and probes grants per client until one
    claims: every client holding only unclaimed grants (a burst), only leases, or nothing
    (rows F2 leaves) is read on each arm()."""
    small, big = await _crowd(10), await _crowd(3000)
    s = _steps(small, small.sem.store.claim_expiry_due)
    b = _steps(big, big.sem.store.claim_expiry_due)
    plan = query(big.storage, "EXPLAIN QUERY PLAN SELECT c.last_report_at FROM durability_semaphore_clients c"
                 " WHERE EXISTS (SELECT 1 FROM durability_semaphore_grants g WHERE g.client_id = c.client_id"
                 " AND g.claimed > g.released) ORDER BY c.last_report_at LIMIT 1")
    print([r["detail"] for r in plan], s, b)
    assert b < 10 * s, (s, b)


# ---------------------------------------------------------------------------- F4
@async_test
async def test_claims_of_a_client_without_a_last_report_row_never_expire():
    """Grants written before the clients table existed have no last-report row: their client was
    never told a TTL, so crash expiry never releases them (documented in README and SPEC R18)."""
    bed = Bed(10, grant_timeout_ms=600_000)
    await claimed(bed, "legacy", permits=2, claim=2)
    bed.storage.sql.exec(f"DELETE FROM {CLIENTS}")  # as an older release left it (no such table)
    bed.evict(claim_ttl_ms=TTL)
    await bed.round(request("other", {"g": 1}))
    await bed.clock.advance(10 * TTL)
    assert (await bed.usage())["outstanding"] == 3  # legacy's 2 claimed kept, other's 1


# ---------------------------------------------------------------------------- probes that pass
@async_test
async def test_more_than_1000_stale_clients_expire_without_an_alarm_loop():
    bed = Bed(100_000, grant_timeout_ms=600_000, claim_ttl_ms=TTL, **SEED_TIMING)  # staged on batched rounds (R9), not R9a's rounds at once
    ids = [f"s{i}" for i in range(2500)]
    for start in range(0, len(ids), 1000):
        replies = await bed.round(*(request(c, {"g": 1}) for c in ids[start:start + 1000]))
        for c, r in zip(ids[start:start + 1000], replies):
            await bed.sem.handle(sync(c, [(r["grants"][0]["grantId"], 1, 0)]))
    assert (await bed.usage())["outstanding"] == 2500
    await bed.clock.advance(TTL + 1000)
    assert (await bed.usage())["outstanding"] == 0
    bed.check()


@async_test
async def test_expiry_then_force_settle_then_reports_free_nothing_twice():
    bed = Bed(10, grant_timeout_ms=600_000, claim_ttl_ms=TTL)
    gid = await claimed(bed, "c", permits=3, claim=2)
    await bed.clock.advance(TTL + 100)
    assert (await bed.usage())["outstanding"] == 1
    record = await bed.sem.force_settle("c", "gone")
    assert record["grantPermits"] == 1
    assert (await bed.usage())["outstanding"] == 0
    for c, r in ((2, 2), (3, 3), (3, 0)):
        await bed.sem.handle(sync("c", [(gid, c, r)]))
        assert (await bed.usage())["outstanding"] == 0
    bed.check()


@async_test
async def test_no_heartbeat_when_claim_ttl_ms_is_off():
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, grant_timeout_ms=10_000, leases=None)
    started: list[str] = []
    net, side = _client(clock, holder, started)
    await side.queue.enqueue("acct", "g", "long")
    await clock.advance(3000)
    assert started == ["long"]
    await clock.advance(20_000)  # the claim confirmation (and any re-check) has gone
    before = len(net.sent)
    await clock.advance(60_000)  # (a pre-existing sync at ~90 s, also before a9ef73d, is outside)
    assert len(net.sent) == before


@async_test
async def test_heartbeat_survives_a_partition_shorter_than_half_the_ttl():
    from semaphore import HolderUnavailableError
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, grant_timeout_ms=10_000, claim_ttl_ms=TTL)
    started: list[str] = []
    net, side = _client(clock, holder, started)
    await side.queue.enqueue("acct", "g", "long")
    await clock.advance(3000)

    def cut(key: str, message: dict) -> None:
        raise HolderUnavailableError("partitioned (test)")

    net.intercept = cut
    await clock.advance(TTL // 2 - 200)
    net.intercept = None
    await clock.advance(60_000)
    assert (await holder.usage())["outstanding"] == 1


@async_test
async def test_a_leases_only_client_keeps_its_row_but_is_never_read_by_the_expiry_due_time():
    """A leases-only client keeps its row (holders() shows its last report) while it holds its
    retired lease; the expiry's due time reads only clients holding claims (partial index)."""
    bed = Bed(10, leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 3, "ttlMs": 60_000},
              claim_ttl_ms=TTL)
    await bed.round(request("leaser", {"g": 3}, leases=[], oldest_at=1))
    await bed.clock.advance(120_000)
    await bed.round(request("other", {"g": 1}))  # retires the expired lease
    assert query(bed.storage, f"SELECT claims FROM {CLIENTS} WHERE client_id = 'leaser'") == [{"claims": 0}]
    plan = bed.storage.connection.execute(
        f"EXPLAIN QUERY PLAN SELECT MIN(expires_at) AS at FROM {CLIENTS} WHERE claims = 1").fetchall()
    assert any("expiry" in str(row) for row in plan), plan  # the partial index, not a scan


@async_test
async def test_r16_an_alarm_lost_after_a_commit_is_armed_by_the_next_sync_even_one_that_writes_nothing():
    # R16, R38 decision (last seen): a sync that writes nothing skips arming the alarm (it moved
    # no deadline), unless an earlier arm failed after its commit: then the next sync arms it, as
    # every sync did before. Here a's claiming sync commits its crash expiry (+30 s) but its
    # setAlarm fails; a then goes silent. b's unchanged syncs repair the alarm, so a's claims are
    # released by crash expiry (before, they stayed charged until the hour-long claimBy alarm).
    bed = Bed(5, grant_timeout_ms=3_600_000, claim_ttl_ms=30_000)
    [ra] = await bed.round(request("a", {"g": 2}))
    [rb] = await bed.round(request("b", {"g": 1}))
    ga, gb = ra["grants"][0]["grantId"], rb["grants"][0]["grantId"]
    set_alarm = bed.storage.setAlarm

    async def fails(at):
        raise RuntimeError("setAlarm failed")

    bed.storage.setAlarm = fails
    with pytest.raises(RuntimeError):
        await bed.sem.handle(sync("a", [(ga, 2, 0)]))  # committed; its alarm was not set
    bed.storage.setAlarm = set_alarm
    for _ in range(3):
        await bed.clock.advance(5_000)
        assert "error" not in await bed.sem.handle(sync("b", [(gb, 0, 0)]))
    assert await bed.storage.getAlarm() <= T0 + 31_000
    await bed.clock.advance(60_000)
    assert (await bed.sem.usage())["outstanding"] == 1  # a's 2 released by crash expiry; b's 1 left


@async_test
async def test_crash_expiry_frees_a_cut_off_clients_permit_when_leases_are_left_at_their_default():
    # SPEC §7 decision "the default leases": crash expiry frees claimed grant permits, not lease
    # slots, so a holder given claim_ttl_ms and no leases= issues no leases. Before, it issued
    # the default reusable leases, and a client cut off from the holder kept its slot charged
    # for the lease's lifetime (30 min) and, once retired, until its stop report (found by a
    # cold review: charged 1 after claim_ttl_ms and 10 minutes more).
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, grant_timeout_ms=10_000, claim_ttl_ms=TTL)  # leases: the default
    assert holder.sem.leases is None
    net = Net(holder, clock)
    started: list[str] = []
    side = ClientSide("c1", clock, net, on_admit=lambda s, item: started.append(item.item_id),
                      report_releases_within_ms=60_000)
    await side.queue.enqueue("acct", "g", "job")
    await clock.advance(3000)
    assert started == ["job"] and (await holder.usage())["charged"] == 1

    def cut(key, message):
        raise HolderUnavailableError("partitioned (test)")

    net.intercept = cut
    await clock.advance(TTL + 2_000)
    assert (await holder.usage())["charged"] == 0
    side.driver.kill()


def test_leases_named_beside_claim_ttl_ms_are_kept():
    # Only the default gives way: leases the application names are issued as before (and crash
    # expiry does not cover them, as the holder reference says).
    assert holder_leases(DEFAULT_LEASES, None) == DEFAULT_LEASES
    assert holder_leases(DEFAULT_LEASES, TTL) is None
    assert holder_leases(replace(DEFAULT_LEASES, ttl_ms=60_000), TTL) == replace(DEFAULT_LEASES, ttl_ms=60_000)
    assert holder_leases({"provisioning": {"mode": "strict"}}, TTL) == LeaseConfig()
    assert holder_leases(None, None) is None
