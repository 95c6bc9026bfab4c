"""Client reports beyond the wire limit, and tombstones that cost nothing (SPEC R7, R8, R13, R15a,
R17, R35, R37; I3). Real holder and real client/queue over the in-memory transport
(``semaphore.testing``), real SQLite on both sides; costs are counted (rows SQL hands to Python,
SQLite VM steps), never timed.

* A message carries at most 1,000 grant (and lease) reports (R7). With more grants than that, the
  entries with something to report (claims, releases) go first, oldest first, and a delivered
  report moves an entry behind the waiting ones: ``n`` such entries need ``ceil(n / 1000)``
  messages, and the newest grants are confirmed (R15a) and released (R13) like the oldest.
* Tombstones (dropped grants, settled leases) are never read by the client's everyday work: an
  idle queue pump reads as many rows with 2,000 of them as without.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from semaphore import Demand, ItemState, QueueItem, SemaphoreClient
from semaphore.client._store import GRANTS, LEASES
from semaphore.core.client_state import GONE, PRUNE_EVERY, ClientGrant, ClientLease, prune_due
from semaphore.testing import (
    SEED_TIMING,
    T0,
    ClientSide,
    HolderSide,
    LocalContext,
    LocalStorage,
    Net,
    SimClock,
    async_test,
    check_aggregates,
)

KEY = "k"


pytestmark = pytest.mark.usefixtures("quiet_logs")  # failures are injected on purpose


class ClientSetup:
    """A SemaphoreClient (no queue) and a real holder."""

    def __init__(self, limit: int = 5000, **options: Any) -> None:
        self.clock = SimClock(T0)
        self.holder = HolderSide(self.clock, limit=limit, **{"leases": None, **options})  # grants: these tests are of the grant path (the default leases: test_reusable_leases.py)
        self.net = Net(self.holder, self.clock)
        self.storage = LocalStorage()
        self.client = SemaphoreClient(LocalContext(self.storage, name="c1"), self.net, clock=self.clock,
                                      client_id="c1", recheck_ms=0)

    async def run(self, coro: Any) -> Any:
        task = asyncio.ensure_future(coro)
        await self.clock.settle()
        while not task.done():
            t = self.clock.next_event()
            assert t is not None, "stuck"
            await self.clock.advance_to(t)
        return task.result()

    def held(self) -> dict[str, tuple[int, int]]:
        """The holder's ``(claimed, released)`` per grant."""
        return {g: (c, r) for g, c, r in self.holder.storage.connection.execute(
            "SELECT grant_id, claimed, released FROM durability_semaphore_grants")}

    async def outstanding(self) -> int:
        return (await self.holder.usage())["outstanding"]


async def _eleven_hundred_grants(s: ClientSetup) -> tuple[list[str], list[str]]:
    """1,100 one-permit grants for ``c1``: 1,000 from a first round (the demand list holds at most
    1,000 groups, R7), then 100 newer ones (later ``claimBy``). Returns (older, newest) ids."""
    first = await s.run(s.client.request(KEY, [Demand(f"g{i}", 1, T0) for i in range(1000)]))
    older = [g.grant_id for g in first.response.grants]
    second = await s.run(s.client.request(KEY, [Demand(f"h{i}", 1, T0) for i in range(100)]))
    newest = [g.grant_id for g in second.response.grants if g.group.startswith("h")]
    assert len(older) == 1000 and len(newest) == 100
    assert len(s.client.grants(KEY)) == 1100
    assert max(g.claim_by for g in s.client.grants(KEY) if g.grant_id in older) < \
        min(g.claim_by for g in s.client.grants(KEY) if g.grant_id in newest)
    return older, newest


@async_test
async def test_r15a_r7_claims_and_releases_of_grants_beyond_the_first_1000_reach_the_holder():
    s = ClientSetup(grant_timeout_ms=3_600_000, **SEED_TIMING)  # staged on batched rounds (R9), not R9a's rounds at once
    older, newest = await _eleven_hundred_grants(s)

    # R15a: claims on the newest grants (the ones a claimBy-ordered window of 1,000 leaves out)
    # are carried by the very next sync and confirmed by its reply
    for gid in newest:
        assert s.client.claim(KEY, gid, 1) == [1]
    sent = len(s.net.sent)
    applied = await s.run(s.client.sync(KEY))
    assert len(s.net.sent) - sent == 1
    reported = {r["grantId"] for r in s.net.sent[-1]["grants"]}
    assert set(newest) <= reported and len(reported) == 1000  # R7: the window is full, never over
    assert all(s.client.grant(KEY, gid).confirmed == 1 for gid in newest)
    assert all(s.held()[gid] == (1, 0) for gid in newest)
    assert not applied.more and not s.client.dirty(KEY)

    # 1,100 entries with something to report (claims on the older 1,000, releases of the newest
    # 100): ceil(1100 / 1000) = 2 messages carry them all, oldest first (R13)
    for gid in older:
        assert s.client.claim(KEY, gid, 1) == [1]
    for gid in newest:
        assert s.client.release(KEY, gid, 1) == 1
    sent = len(s.net.sent)
    replies = await s.run(s.client.flush(KEY))
    assert [a.more for a in replies] == [True, False] and len(s.net.sent) - sent == 2
    assert all(len(m["grants"]) <= 1000 for m in s.net.sent[sent:])
    assert all(s.client.grant(KEY, gid).confirmed == 1 for gid in older)
    assert all(gid not in s.held() for gid in newest)  # R17: released in full, settled
    assert all(s.client.grant(KEY, gid).status == GONE for gid in newest)
    assert await s.outstanding() == 1000

    # releases of everything reach the holder: usage back to zero (I3)
    for gid in older:
        assert s.client.release(KEY, gid, 1) == 1
    replies = await s.run(s.client.flush(KEY))
    assert len(replies) == 1
    assert await s.outstanding() == 0 and s.held() == {}
    assert s.client.grants(KEY) == [] and not s.client.dirty(KEY)
    assert check_aggregates(s.holder.storage)["total"]["outstanding"] == 0


@async_test
async def test_r7_r8_a_full_window_rotates_so_every_grant_is_reported():
    # With nothing to report, the 1,000 entries a message carries rotate (least recently
    # reported first): two syncs carry all 1,100 grants, so none is left unreported (e.g. a
    # grant the holder deleted is only learnt by reporting it, R15: not_found). Grants the
    # message did not carry are still merged from the reply (R8 lists every grant of the client).
    s = ClientSetup(grant_timeout_ms=3_600_000, **SEED_TIMING)  # staged on batched rounds (R9), not R9a's rounds at once
    older, newest = await _eleven_hundred_grants(s)
    sent = len(s.net.sent)
    for _ in range(2):
        await s.run(s.client.sync(KEY))
    carried = [{r["grantId"] for r in m["grants"]} for m in s.net.sent[sent:]]
    assert all(len(c) == 1000 for c in carried)
    assert carried[0] | carried[1] == set(older) | set(newest)
    # R8 + R15a: with 1,100 claims, the reply to the first window lists the 100 grants it did
    # not carry too (claimed 0 at the holder); they are merged without confirming or losing
    # the local claim, and the next message carries and confirms them
    every = older + newest
    for gid in every:
        assert s.client.claim(KEY, gid, 1) == [1]
    applied = await s.run(s.client.sync(KEY))
    carried = {r["grantId"] for r in s.net.sent[-1]["grants"]}
    left_out = set(every) - carried
    assert applied.more and len(left_out) == 100
    assert left_out <= {g.grant_id for g in applied.response.grants}  # listed anyway (R8)
    for gid in left_out:
        g = s.client.grant(KEY, gid)
        assert (g.claimed, g.confirmed, g.status, g.dirty) == (1, 0, "active", True)
        assert s.held()[gid] == (0, 0)
    applied = await s.run(s.client.sync(KEY))
    assert not applied.more
    assert all(s.client.grant(KEY, gid).confirmed == 1 and s.held()[gid] == (1, 0) for gid in every)


@async_test
async def test_r15a_r37_queue_confirms_claims_beyond_1000_grants_and_reports_all_releases():
    # The queue: 1,000 items in 1,000 groups, then 100 more in new groups (their grants are the
    # newest of 1,100). Every item is admitted (its claim confirmed, R15a); when all complete,
    # the releases reach the holder in ceil(1100 / 1000) = 2 syncs, both when the release bound
    # (report_releases_within_ms) is reached: the second window is not held back another
    # bound. Usage is back to 0 (I3).
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=5000, grant_timeout_ms=60_000, leases=None)
    net = Net(holder, clock)
    admitted: list[QueueItem] = []
    side = ClientSide("c1", clock, net, on_admit=lambda side, item: admitted.append(item), recheck_ms=0,
                      report_releases_within_ms=5000)
    q = side.queue
    for i in range(1000):
        await q.enqueue(KEY, f"g{i}", f"a{i}")
    await clock.advance(1500)
    assert len(admitted) == 1000
    for i in range(100):
        await q.enqueue(KEY, f"h{i}", f"b{i}")
    await clock.advance(5000)
    assert len(side.client.grants(KEY)) == 1100
    assert [i.item_id for i in q.items(KEY, ItemState.CLAIMING)] == []
    assert {i.item_id for i in admitted} == {f"a{i}" for i in range(1000)} | {f"b{i}" for i in range(100)}
    assert (await holder.usage())["outstanding"] == 1100

    sent = len(net.sent)
    for item in list(admitted):
        await q.complete(item.item_id)
    await clock.advance(4990)
    assert net.sent[sent:] == []
    times: list[int] = []
    net.intercept = lambda key, message: times.append(clock.now)  # type: ignore[func-returns-value]
    await clock.advance(20)
    syncs = net.sent[sent:]
    assert [m["type"] for m in syncs] == ["sync", "sync"] and times[0] == times[1]
    assert all(len(m["grants"]) <= 1000 for m in syncs)
    assert (await holder.usage())["outstanding"] == 0
    assert side.client.grants(KEY) == []
    await clock.advance(60_000)
    assert len(net.sent) == sent + 2  # nothing left to say


# ----------------------------------------------------------------------------- tombstones


class Counter:
    """Counts, on one client storage, the rows SQL hands back to Python and the SQLite VM steps
    (every VM instruction)."""

    def __init__(self, storage: LocalStorage) -> None:
        self.storage = storage
        self.rows = 0
        self.steps = 0
        self.queries: list[str] = []
        sql = storage.sql
        original = sql.exec

        def counting(query: str, *bindings: Any) -> Any:
            cursor = original(query, *bindings)
            if self.on:
                self.rows += cursor.rowsRead
                self.queries.append(query)
            return cursor

        sql.exec = counting  # the adapter calls ``sql.exec`` on this object
        self.on = False

    def _step(self) -> int:
        self.steps += 1
        return 0

    async def measure(self, coro: Any) -> tuple[int, int]:
        self.rows = self.steps = 0
        self.queries = []
        self.on = True
        self.storage.connection.set_progress_handler(self._step, 1)
        try:
            await coro
        finally:
            self.storage.connection.set_progress_handler(None, 0)
            self.on = False
        return self.rows, self.steps


def _bury(side: ClientSide, count: int, now: int) -> None:
    """``count`` dropped grants and ``count`` settled leases, as the client writes them (recent,
    so not yet pruned)."""
    client = side.client

    def body() -> None:
        for i in range(count):
            client.rows.write_grant(ClientGrant(KEY, f"dead-g{i}", "old", 1, 1, 1, 1, now, GONE, 1, 1), now)
            client.rows.write_lease(ClientLease(KEY, f"dead-l{i}", "old", 4, 2, 2, True, "settled", now, now,
                                            2, 2, True), now)

    client.storage.transaction(body)


@async_test
async def test_idle_pump_reads_no_tombstones():
    # R35, I2: 2,000 dropped grants and 2,000 settled leases (kept so a stale reply cannot resurrect
    # them) do not make an idle pump read more: the client filters them out in SQL through
    # partial indexes, so its rows read and SQLite work stay O(live)
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=10, leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 4,
                                                 "ttlMs": 600_000})
    net = Net(holder, clock)
    side = ClientSide("c1", clock, net, on_admit=lambda side, item: None, recheck_ms=0)
    counter = Counter(side.storage)
    for i in range(3):
        await side.queue.enqueue(KEY, "g", f"i{i}")
    await clock.advance(1500)
    assert [i.state for i in side.queue.items(KEY)] == [ItemState.RUNNING] * 3
    live = len(side.client.grants(KEY)) + len(side.client.leases(KEY))
    assert live >= 1

    sent = len(net.sent)
    await side.queue.pump(KEY)
    base_rows, base_steps = await counter.measure(side.queue.pump(KEY))
    assert len(net.sent) == sent  # idle: nothing to send
    _bury(side, 2000, clock.now)
    assert len(side.client.grants(KEY, include_gone=True)) == 2000 + len(side.client.grants(KEY))
    rows, steps = await counter.measure(side.queue.pump(KEY))
    assert len(net.sent) == sent
    assert rows == base_rows, (base_rows, rows)  # not one tombstone handed to Python
    assert rows < 100
    assert steps <= base_steps * 1.1, (base_steps, steps)  # and SQLite does not walk them
    # the queries reading client grants/leases go through the live-row indexes
    conn = side.storage.connection
    for query in {q for q in counter.queries if GRANTS in q or LEASES in q}:
        if not query.lstrip().upper().startswith("SELECT"):
            continue
        args = [KEY] * query.count("?")
        plan = " | ".join(str(r[3]) for r in conn.execute("EXPLAIN QUERY PLAN " + query, args))
        assert "_live" in plan, (query, plan)


@async_test
async def test_tombstones_are_pruned_through_their_index():
    # pruning (after every reply) deletes expired tombstones without walking live rows or
    # younger tombstones, and the client keeps working (R35)
    s = ClientSetup(limit=5)
    applied = await s.run(s.client.request(KEY, [Demand("g", 1, T0)]))
    (g,) = applied.response.grants
    side_storage = s.storage
    now = s.clock.now

    def body() -> None:
        for i in range(50):
            s.client.rows.write_grant(ClientGrant(KEY, f"dead{i}", "old", 1, 1, 1, 1, now, GONE, 1, 1), now)

    s.client.storage.transaction(body)
    plan = " | ".join(str(r[3]) for r in side_storage.connection.execute(
        f"EXPLAIN QUERY PLAN DELETE FROM {GRANTS} WHERE key = ? AND status = 'gone' AND updated_at < ?",
        (KEY, now)))
    assert "_gone" in plan, plan
    await s.clock.advance(s.client.tombstone_ms + 1)
    await s.run(s.client.sync(KEY))
    assert [x.grant_id for x in s.client.grants(KEY, include_gone=True)] == [g.grant_id]


def _record(storage: LocalStorage) -> list[str]:
    """Every statement the storage runs from now on (appended to the list returned)."""
    queries: list[str] = []
    inner = storage.sql.exec

    def exec_(query: str, *bindings: Any) -> Any:
        queries.append(query)
        return inner(query, *bindings)

    storage.sql.exec = exec_
    return queries


def _deletes(queries: list[str], before: int) -> list[str]:
    return [q for q in queries[before:] if q.startswith("DELETE")]


@async_test
async def test_r35_a_reply_prunes_tombstones_at_most_every_sixteenth_of_tombstone_ms():
    # R35 decision (tombstones): a tombstone lives between tombstone_ms and 17/16 of it; a reply
    # deletes them only tombstone_ms / 16 after the key's last prune (or its row's first write:
    # a new key has no tombstones), so most replies run no DELETE.
    s = ClientSetup(limit=5)
    queries = _record(s.storage)
    await s.run(s.client.request(KEY, [Demand("g", 1, T0)]))
    now = s.clock.now
    s.client.storage.transaction(lambda: s.client.rows.write_grant(
        ClientGrant(KEY, "dead", "old", 1, 1, 1, 1, now, GONE, 1, 1), now))
    slack = s.client.tombstone_ms // PRUNE_EVERY
    await s.run(s.client.sync(KEY))
    assert _deletes(queries, 0) == []  # the key's row was written a moment ago
    await s.clock.advance(s.client.tombstone_ms + 1)   # "dead" is past tombstone_ms ...
    s.client.storage.transaction(lambda: s.client._touch_key(KEY, s.clock.now, pruned_at=s.clock.now - 2))
    await s.run(s.client.sync(KEY))   # ... but the last prune was less than the slack ago
    assert _deletes(queries, 0) == [] and s.client.grant(KEY, "dead") is not None
    await s.clock.advance(slack)
    before = len(queries)
    await s.run(s.client.sync(KEY))
    assert len(_deletes(queries, before)) == 2 and s.client.grant(KEY, "dead") is None
    before = len(queries)
    await s.run(s.client.sync(KEY))
    assert _deletes(queries, before) == []


def test_r35_prune_due_after_a_sixteenth_of_tombstone_ms():
    # R35 decision (tombstones), the arithmetic
    assert not prune_due(1000, 1000 + 3_600_000 // 16 - 1, 3_600_000)
    assert prune_due(1000, 1000 + 3_600_000 // 16, 3_600_000)
    assert prune_due(0, 5, 0)  # tombstone_ms 0: every reply


# ----------------------------------------------------------------------------- schema upgrade

_OLD_GRANTS = (
    f"CREATE TABLE {GRANTS} ("
    " key TEXT NOT NULL, grant_id TEXT NOT NULL, group_name TEXT NOT NULL,"
    " permits INTEGER NOT NULL, claimed INTEGER NOT NULL, released INTEGER NOT NULL,"
    " confirmed INTEGER NOT NULL, claim_by INTEGER NOT NULL, status TEXT NOT NULL,"
    " sent_claimed INTEGER NOT NULL, sent_released INTEGER NOT NULL, updated_at INTEGER NOT NULL,"
    " PRIMARY KEY (key, grant_id))")
_OLD_LEASES = (
    f"CREATE TABLE {LEASES} ("
    " key TEXT NOT NULL, lease_id TEXT NOT NULL, group_name TEXT NOT NULL,"
    " permits INTEGER NOT NULL, drawn INTEGER NOT NULL, released INTEGER NOT NULL,"
    " stopped INTEGER NOT NULL, status TEXT NOT NULL, expires_at INTEGER NOT NULL,"
    " heartbeat_at INTEGER NOT NULL, sent_drawn INTEGER NOT NULL, sent_released INTEGER NOT NULL,"
    " sent_stopped INTEGER NOT NULL, updated_at INTEGER NOT NULL,"
    " PRIMARY KEY (key, lease_id))")


@pytest.mark.parametrize("via_migrate", [False, True])
def test_tables_of_the_previous_release_are_upgraded_on_first_use(via_migrate):
    # R35: a client over storage written by the previous release (no report_at column, no
    # indexes) upgrades it in place: rows kept, dirty rows reported first, indexes created
    storage = LocalStorage()
    conn = storage.connection
    conn.execute(_OLD_GRANTS)
    conn.execute(_OLD_LEASES)
    conn.execute(f"INSERT INTO {GRANTS} VALUES ('k', 'g1', 'g', 2, 1, 0, 0, {T0 + 10_000}, 'active', 0, 0, {T0})")
    conn.execute(f"INSERT INTO {GRANTS} VALUES ('k', 'g0', 'g', 1, 1, 1, 1, {T0}, 'gone', 1, 1, {T0})")

    async def transport(key: str, message: dict) -> dict:
        return {"v": 1, "grants": [], "leases": [], "blocked": [], "contended": False, "nextRequestAt": 0}

    ctx = LocalContext(storage, name="c1")
    if via_migrate:
        SemaphoreClient.migrate(ctx, 1)
        SemaphoreClient.migrate(ctx, 1)  # idempotent
    client = SemaphoreClient(ctx, transport, clock=lambda: T0 + 1, client_id="c1")
    assert [g.grant_id for g in client.grants("k")] == ["g1"] and client.dirty("k")
    columns = {r[1] for r in conn.execute(f"PRAGMA table_info({GRANTS})")}
    assert "report_at" in columns and "report_at" in {r[1] for r in conn.execute(f"PRAGMA table_info({LEASES})")}
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {f"{GRANTS}_live", f"{GRANTS}_gone", f"{LEASES}_live", f"{LEASES}_settled"} <= indexes
    grants, leases = client.reports("k")
    assert [(r.grant_id, r.claimed) for r in grants] == [("g1", 1)] and leases == ()
    SemaphoreClient.migrate(ctx, None)
    assert {r[0] for r in conn.execute("SELECT name FROM sqlite_master")} == set()


@async_test
async def test_r7_r21_queue_demand_over_1000_groups_asks_for_the_oldest_1000_first():
    # 1,100 items in 1,100 groups: a request may carry at most 1,000 demand entries (R7), so the
    # queue asks for the 1,000 groups with the oldest items (R21 serves oldest first anyway) and
    # the rest in the next request; every item is admitted and no request is invalid. Before,
    # the queue sent all 1,100, got invalid_message back and retried the same request forever.
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=5000, grant_timeout_ms=60_000, **SEED_TIMING, leases=None)  # staged on batched rounds (R9), not R9a's rounds at once
    net = Net(holder, clock)
    admitted: list[QueueItem] = []
    side = ClientSide("c1", clock, net, on_admit=lambda side, item: admitted.append(item), recheck_ms=0)
    q = side.queue
    for i in range(1100):
        await q.enqueue(KEY, f"g{i:04d}", f"a{i}")
        if i == 99:
            await clock.advance(1)  # g0000..g0099 are the oldest
    demand = q.demand(KEY)
    assert len(demand) == 1000
    assert {d.group for d in demand} >= {f"g{i:04d}" for i in range(100)}
    await clock.advance(10_000)
    requests = [m for m in net.sent if m["type"] == "request"]
    assert requests and all(len(m["demand"]) <= 1000 for m in requests)
    assert {i.item_id for i in admitted} == {f"a{i}" for i in range(1100)}


@async_test
async def test_r30_r7_flush_delivers_every_dirty_lease_beyond_1000():
    # R30, R7: 1,100 leases, each with one draw to report: flush() must keep syncing until all are
    # carried (ceil(1100 / 1000) = 2 messages). Before, its count of due leases bound the time
    # and the key in the wrong order, counted 0 and stopped after one sync with 100 draws left.
    s = ClientSetup(limit=10_000, leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 1})
    await s.run(s.client.request(KEY, [Demand(f"g{i}", 1, T0) for i in range(1000)]))
    await s.run(s.client.request(KEY, [Demand(f"h{i}", 1, T0) for i in range(100)]))
    assert len(s.client.leases(KEY)) == 1100
    for x in s.client.leases(KEY):
        assert s.client.draw(KEY, x.lease_id) == 1
    replies = await s.run(s.client.flush(KEY))
    assert [r.more for r in replies] == [True, False]
    assert [x.lease_id for x in s.client.leases(KEY) if x.dirty] == []
