"""A round's SQL cost does not grow with the number of clients or of live grants (SPEC §2 R2:
one transaction per round; the store's lists travel as one JSON binding each, and every read goes
through an index). Checked by statement counts and SQLite VM steps, not by wall time, so it is
deterministic. scripts/bench_rounds.py measures the time."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from semaphore import DurabilityScheduler, DurabilitySemaphore
from semaphore.testing import AlarmDriver, LocalContext, LocalStorage, VirtualClock


def _request(client_id: str, demand: dict[str, int], grants: list[tuple[str, int, int]] = ()) -> dict[str, Any]:
    return {"type": "request", "v": 1, "clientId": client_id,
            "demand": [{"group": g, "count": n, "oldestAt": 0} for g, n in demand.items()],
            "grants": [{"grantId": g, "claimed": c, "released": r} for g, c, r in grants]}


async def _round_cost(clients: int, other_grants: int) -> tuple[int, int]:
    """Statements and SQLite VM steps (in units of 100) of the second of two rounds in which
    ``clients`` clients each report on the grants they got and ask again."""
    clock, storage = VirtualClock(), LocalStorage()
    scheduler = DurabilityScheduler(LocalContext(storage), clock=clock)
    ids = itertools.count()
    sem = DurabilitySemaphore(scheduler=scheduler, limit=10_000, grant_timeout_ms=3_600_000,
                              clock=clock, id_factory=lambda: f"id{next(ids)}")
    AlarmDriver(clock, storage, scheduler.alarm)

    async def round_of(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        tasks = [asyncio.ensure_future(sem.handle(m)) for m in messages]
        await clock.settle()
        await clock.advance_to(sem.next_request_at())
        return [t.result() for t in tasks]

    if other_grants:
        await round_of([_request(f"other-{i}", {f"g{i % 10}": 1}) for i in range(other_grants)])
        await clock.advance(2000)
    first = await round_of([_request(f"c{i}", {"a": 1, "b": 1}) for i in range(clients)])
    await clock.advance(2000)
    messages = [_request(f"c{i}", {"a": 2, "b": 1},
                         [(g["grantId"], 1, 1 if g["group"] == "b" else 0) for g in reply["grants"]])
                for i, reply in enumerate(first)]
    steps = [0]

    def count() -> int:
        steps[0] += 1
        return 0

    before = storage.statements
    storage.connection.set_progress_handler(count, 100)
    replies = await round_of(messages)
    storage.connection.set_progress_handler(None, 0)
    assert all("error" not in r and len(r["grants"]) == 4 for r in replies)  # 2 reported + 2 new
    return storage.statements - before, steps[0]


def test_r2_round_statements_do_not_grow_with_clients():
    asyncio.run(_statements_do_not_grow_with_clients())


def test_r2_round_reads_do_not_grow_with_live_grants():
    asyncio.run(_reads_do_not_grow_with_live_grants())


async def _statements_do_not_grow_with_clients():
    # R2: one transaction; a round of 300 clients runs about as many statements as a round of 3
    # (+1 per 500 written rows; before the JSON lists: one statement per 99 ids and per 11 rows).
    few, _ = await _round_cost(3, 0)
    many, _ = await _round_cost(300, 0)
    assert many <= few + 2, (few, many)
    assert many <= 20


async def _reads_do_not_grow_with_live_grants():
    # Indexes: the same round over 20x more live grants of other clients does the same SQLite
    # work (VM steps within 10%), i.e. no statement scans the grant table.
    small_statements, small_steps = await _round_cost(20, 50)
    large_statements, large_steps = await _round_cost(20, 1000)
    assert large_statements == small_statements
    assert large_steps <= small_steps * 1.1, (small_steps, large_steps)


def test_r6_r16_a_sync_and_the_reclaim_alarm_read_no_meta_rows():
    # R6/R16 (review fix): only a round reads the meta rows (limit, epoch, contended flag); a sync
    # (the heartbeat and report path) and the reclaim alarm change totals only through deltas, so
    # they run no meta read (after the refactor to load -> decide -> persist they each ran one).
    from semaphore.testing import Bed, request, sync

    async def scenario() -> list[str]:
        bed = Bed(5, grant_timeout_ms=1000)
        [reply] = await bed.round(request("a", {"g": 3}))
        await bed.sem.handle(sync("a"))  # instance start (schema, meta) outside the trace
        seen: list[str] = []
        bed.storage.connection.set_trace_callback(seen.append)
        grant = reply["grants"][0]["grantId"]
        await bed.sem.handle(sync("a", [(grant, 1, 0)]))
        await bed.clock.advance(2000)  # past claimBy: the alarm reclaims the unclaimed permits
        bed.storage.connection.set_trace_callback(None)
        return seen

    seen = asyncio.run(scenario())
    assert any("durability_semaphore_grants" in s and "claim_by <=" in s for s in seen), seen
    assert not [s for s in seen if s.lstrip().upper().startswith("SELECT") and "FROM durability_semaphore_meta" in s]


def test_r38_a_sync_that_changes_nothing_writes_no_row():
    # R38 decision (last seen): a heartbeat sync that changes no grant, lease, claims flag, label
    # or crash expiry writes nothing (before, every sync rewrote the client's last-report row, and
    # a Durable Object call that writes is answered only after its commit). The row is rewritten
    # once LAST_SEEN_REFRESH_MS have passed, and at once when the message changes something.
    from semaphore.core.seen import LAST_SEEN_REFRESH_MS
    from semaphore.testing import Bed, request, sync

    async def scenario() -> list[int]:
        bed = Bed(5, grant_timeout_ms=3_600_000)  # no reclaim during the test
        [reply] = await bed.round(request("a", {"g": 2}))
        grant = reply["grants"][0]["grantId"]
        await bed.sem.handle(sync("a", [(grant, 1, 0)]))  # claims: the row changes
        conn = bed.storage.connection
        written = []
        for step, report in ((1_000, (grant, 1, 0)), (1_000, (grant, 1, 0)),
                             (LAST_SEEN_REFRESH_MS, (grant, 1, 0)), (1_000, (grant, 2, 0))):
            await bed.clock.advance(step)
            before = conn.total_changes
            await bed.sem.handle(sync("a", [report]))
            written.append(conn.total_changes - before)
        return written

    # unchanged, unchanged, the last-seen refresh (one row), a new claim (the grant row only:
    # the client's claims flag is unchanged)
    assert asyncio.run(scenario()) == [0, 0, 1, 1]


def test_r6_a_sync_reads_each_table_once_through_its_indexes():
    # R6, R2: a sync that changes nothing runs three statements, one read per table (the due
    # grants and the client's grants in one UNION ALL, likewise the leases, then the client's
    # row), each through an index, and no alarm re-arming (it moved no deadline); every
    # JS<->Python crossing on the runtime costs CPU.
    from semaphore.testing import Bed, request, sync

    async def scenario() -> tuple[list[str], list[str]]:
        bed = Bed(5, grant_timeout_ms=3_600_000)
        [reply] = await bed.round(request("a", {"g": 2}))
        grant = reply["grants"][0]["grantId"]
        await bed.sem.handle(sync("a", [(grant, 1, 0)]))
        await bed.clock.advance(1_000)
        seen: list[str] = []  # every statement of the call, the alarm's re-arming reads included
        bed.storage.connection.set_trace_callback(seen.append)
        await bed.sem.handle(sync("a", [(grant, 1, 0)]))
        bed.storage.connection.set_trace_callback(None)
        plans = [row[3] for s in seen if s.lstrip().upper().startswith("SELECT")
                 for row in bed.storage.connection.execute("EXPLAIN QUERY PLAN " + s)]
        return [s for s in seen if not s.startswith(("SAVEPOINT", "RELEASE"))], plans

    statements, plans = asyncio.run(scenario())
    assert [s.split(" WHERE")[0] for s in statements] == [
        "SELECT * FROM durability_semaphore_grants", "SELECT * FROM durability_semaphore_leases",
        "SELECT * FROM durability_semaphore_clients"], statements
    assert not [p for p in plans if p.startswith("SCAN") and "json_each" not in p], plans
