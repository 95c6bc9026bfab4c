#!/usr/bin/env python3
"""SQL statements the client object runs per item.

A client object of the test kit (:class:`~semaphore.testing.ClientSide`: SemaphoreClient,
DurabilityScheduler and SemaphoreQueue over its own real SQLite) talks to a holder object
(:class:`~semaphore.testing.HolderSide`, limit 1,000) over the in-memory network, on one virtual
clock: first with ``leases=None`` (the grant path: claim, confirming sync), then with the holder's
default leases (the item is drawn from a lease). Its tables are created first (the queue's, the
client's and the scheduler's); then every ``storage.sql.exec`` of the CLIENT object (the queue's,
the client's and its scheduler's statements, alarms included) is counted while

  (a) one item lives its whole life: enqueued, requested, claimed, confirmed by a sync (or drawn
      from a lease), started (``on_admit``), completed, and its release reported and applied at
      the holder (the holder's charged capacity back to 0);
  (b) the same for 10 items enqueued together, and
  (c) for 100 items enqueued together,

each enqueued by its own ``enqueue()`` call and completed by its own ``complete()`` call;
then enqueued by one ``enqueue_many()`` call (one transaction, one INSERT for the batch) and
completed one by one; then enqueued by one ``enqueue_many()`` and completed by one
``complete_many()`` call (one transaction, one write per permit).

Virtual time runs event by event until the holder has applied every release (the client's
alarms, its report wait ``report_releases_within_ms`` included). Prints the counts, the ratio
(c)/(b) and the statements by kind (first word and table) with ``--detail``.

    .venv/bin/python scripts/client_sql_count.py
    .venv/bin/python scripts/client_sql_count.py --detail
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from semaphore.testing import T0, ClientSide, HolderSide, Net, SimClock  # noqa: E402

KEY = "acct"
GROUP = "g"
#: Most virtual time one life may take (the report wait is 10 s; anything near this is a hang).
LIMIT_MS = 600_000


def _kind(query: str) -> str:
    """``SELECT durability_semaphore_client_items`` etc.: the statement's verb and first table."""
    verb = query.split(None, 1)[0].upper() if query.strip() else "?"
    while True:  # not a table read in a subquery: the statement's own
        outer = re.sub(r"\([^()]*\)", "", query)
        if outer == query:
            break
        query = outer
    table = re.search(r"(durability_\w+|sqlite_master)", query)
    return f"{verb} {table.group(1) if table else '-'}"


async def _run_until(clock: SimClock, done: Any, what: str) -> None:
    end = clock.now + LIMIT_MS
    await clock.settle()
    while not done():
        t = clock.next_event()
        if t is None or t > end:
            raise SystemExit(f"stuck before {what} (virtual time {clock.now - T0} ms)")
        await clock.advance_to(t)


async def life(items: int, grants: bool, many: bool = False, complete_many: bool = False
               ) -> tuple[int, Counter[str]]:
    """Client SQL statements (and their kinds) for ``items`` items' whole lives (``grants``: the
    grant path, ``leases=None``; else the default leases; ``many``: enqueued by one
    ``enqueue_many()`` call, else one ``enqueue()`` each; ``complete_many``: completed by one
    ``complete_many()`` call, else one ``complete()`` each)."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=1000, **({"leases": None} if grants else {}))
    net = Net(holder, clock)
    admitted: list[str] = []
    side = ClientSide("c1", clock, net, on_admit=lambda _side, item: admitted.append(item.item_id))
    side.queue.ensure_schema()
    side.scheduler.ensure_schema()
    counts: Counter[str] = Counter()
    sql = side.storage.sql
    inner = sql.exec

    def counted(query: str, *bindings: Any) -> Any:
        counts[_kind(query)] += 1
        return inner(query, *bindings)

    sql.exec = counted  # type: ignore[method-assign]
    ids = [f"item-{i}" for i in range(items)]
    if many:
        await side.queue.enqueue_many(KEY, GROUP, ids)
    else:
        for item_id in ids:
            await side.queue.enqueue(KEY, GROUP, item_id)
    await _run_until(clock, lambda: len(set(admitted)) == items, "every item was admitted")
    if complete_many:
        await side.queue.complete_many(ids)
    else:
        for item_id in ids:
            await side.queue.complete(item_id)
    await _run_until(clock, lambda: holder.charged()[0] == 0, "the holder applied every release")
    await side.queue.drain()
    sql.exec = inner  # type: ignore[method-assign]
    holder.driver.close()
    side.driver.close()
    return sum(counts.values()), counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--detail", action="store_true", help="statements by kind for each run")
    args = parser.parse_args()
    for grants, path in ((True, "the grant path (leases=None)"), (False, "the default leases")):
        for many, batch, how in ((False, False, "one enqueue() and one complete() each"),
                                 (True, False, "one enqueue_many(), one complete() each"),
                                 (True, True, "one enqueue_many(), one complete_many()")):
            results = {n: asyncio.run(life(n, grants, many, batch)) for n in (1, 10, 100)}
            print(f"{path}, {how}:")
            for n, (total, kinds) in results.items():
                print(f"{n:>4} item(s): {total:>6} client SQL statements ({total / n:.1f} per item)")
                if args.detail:
                    for kind, count in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])):
                        print(f"        {count:>6}  {kind}")
            print(f"100 items / 10 items: {results[100][0] / results[10][0]:.2f}x")

if __name__ == "__main__":
    main()
