"""Group-limited tenants: one account's budget shared by tenants, each under its own ceiling.

The composition (runnable on CPython: ``python examples/group_limited_tenants.py``):

* ``Account`` - the holder object of one account (the semaphore key): ``limit=6`` in total, and
  per-tenant ceilings through ``group_limit``, here a callable over the tenants' plans
  (``tenant-a`` 2, ``tenant-b`` 2, ``tenant-c`` none: only the account's limit). Each tenant is a
  *group*; a mapping ``{"tenant-a": 2, ...}`` works the same.
* ``Region`` - a client object (one per region) whose ``SemaphoreQueue`` runs each job with
  ``work=``: the queue calls ``work(item)`` once the item holds its permit and completes the
  item (releasing the permit) when it returns.
* Three regions enqueue jobs for the three tenants. No tenant ever runs more than its ceiling,
  the account never more than 6; ``usage()`` shows per tenant what is charged and what one more
  request could get (``available``); every waiting item says why it waits
  (``queue.item(id).blocked``: ``group_limit`` for a tenant at its ceiling, ``limit`` when the
  account's limit is what is left).

All objects run in one process on the :mod:`semaphore.testing` kit (real SQLite, virtual time,
the kit's alarm driver). In a Worker they subclass ``workers.DurableObject``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from semaphore import (  # noqa: E402
    DurabilityScheduler,
    DurabilitySemaphore,
    ItemState,
    QueueItem,
    SemaphoreClient,
    SemaphoreQueue,
)
from semaphore.testing import LocalContext, Namespace, TaskAlarmDriver, VirtualClock  # noqa: E402

T0 = 1_700_000_000_000
clock = VirtualClock(T0)
LIMIT = 6
PLANS = {"tenant-a": 2, "tenant-b": 2, "tenant-c": None}  # a tenant's ceiling (None: none)
SECONDS = {"tenant-a": 2, "tenant-b": 2, "tenant-c": 5}  # how long a job of each tenant runs
running: Counter[str] = Counter()
most: Counter[str] = Counter()


def say(text: str) -> None:
    print(f"[t={(clock.now - T0) / 1000:6.1f}s] {text}")


class Account:
    """The holder object (a DurableObject in a Worker): one per account."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.scheduler = DurabilityScheduler(ctx, clock=clock)
        self.semaphore = DurabilitySemaphore(scheduler=self.scheduler, limit=LIMIT, clock=clock,
                                             group_limit=lambda tenant: PLANS.get(tenant))
        self.driver = TaskAlarmDriver(clock, ctx.storage, self.alarm)

    async def permits(self, message: dict) -> dict:  # the RPC method clients call
        return await self.semaphore.handle(message)

    async def alarm(self, info: Any = None) -> None:
        await self.scheduler.alarm(info)


ACCOUNT = Namespace(lambda name: Account(LocalContext(name=name)))  # env.ACCOUNT: getByName -> stub
limits = DurabilitySemaphore.client(namespace=ACCOUNT, invoke=lambda stub, message: stub.permits(message))


class Region:
    """A client object (a DurableObject in a Worker): runs its jobs with ``work=``."""

    def __init__(self, name: str) -> None:
        self.ctx = LocalContext(name=name)
        self.scheduler = DurabilityScheduler(self.ctx, clock=clock)
        client = SemaphoreClient(self.ctx, limits.transport(None), clock=clock)
        self.queue = SemaphoreQueue(client=client, scheduler=self.scheduler, work=self.work,
                                    report_releases_within_ms=0)
        self.driver = TaskAlarmDriver(clock, self.ctx.storage, self.alarm)

    async def work(self, item: QueueItem) -> None:  # runs under the item's permit
        tenant = item.group
        running[tenant] += 1
        most[tenant] = max(most[tenant], running[tenant])
        most["total"] = max(most["total"], sum(running[t] for t in PLANS))
        try:
            await clock.sleep(item.payload["seconds"] * 1000)
        finally:
            running[tenant] -= 1

    async def alarm(self, info: Any = None) -> None:
        await self.scheduler.alarm(info)


async def snapshot(regions: list[Region]) -> None:
    """One line for the account, one per tenant: usage() and why its queued items wait."""
    usage = await ACCOUNT.getByName("acct-1").semaphore.usage()
    total = sum(running[t] for t in PLANS)
    say(f"running {total} of {usage['limit']}; account charged {usage['charged']}, available {usage['available']}")
    for tenant in PLANS:
        g = usage["groups"].get(tenant)  # listed while something is charged in the group
        if g is None:
            top = usage["available"]
            g = {"limit": PLANS[tenant], "charged": 0, "available": top if PLANS[tenant] is None
                 else min(top, PLANS[tenant])}
        waits = [item for region in regions for item in region.queue.items(state=ItemState.QUEUED)
                 if item.group == tenant]
        reasons = Counter(i.blocked.reason.value if i.blocked else "not said yet" for i in waits)
        said = max((i.blocked_at for i in waits if i.blocked_at is not None), default=None)
        why = ", ".join(f"{r} x{n}" for r, n in sorted(reasons.items()))
        when = "" if said is None else f" (holder's word at t={(said - T0) / 1000:.1f}s)"
        say(f"  {tenant}: running {running[tenant]}, limit {g['limit']}, charged {g['charged']},"
            f" available {g['available']}; {len(waits)} waiting" + (f": {why}{when}" if waits else ""))


async def main() -> None:
    logging.disable(logging.CRITICAL)
    regions = [Region(f"region-{n}") for n in (1, 2, 3)]
    say(f"account limit {LIMIT}; tenant ceilings {PLANS}; three regions enqueue 5 jobs per tenant"
        " (a job of tenant-a or tenant-b runs 2 s, of tenant-c 5 s)")
    for n in range(5):
        for tenant in PLANS:
            await regions[n % 3].queue.enqueue("acct-1", tenant, f"{tenant}-job-{n}", {"seconds": SECONDS[tenant]})
    seen = None
    while any(r.queue.items(state=s) for r in regions for s in (ItemState.QUEUED, ItemState.CLAIMING,
                                                                ItemState.RUNNING)):
        await clock.advance(500)
        why = sorted((i.group, i.blocked.reason.value if i.blocked else "") for r in regions
                     for i in r.queue.items(state=ItemState.QUEUED))
        now = ({t: running[t] for t in PLANS}, why)
        if now != seen and sum(now[0].values()):
            await snapshot(regions)  # whenever what runs, or why work waits, changes
            seen = now
    say("all jobs done")
    await clock.advance(15_000)  # unclaimed grant permits come back at claimBy
    await snapshot(regions)
    say("most running at once: " + ", ".join(f"{t} {most[t]} (ceiling {PLANS[t]})" for t in PLANS)
        + f", account {most['total']} (limit {LIMIT})")
    assert most["tenant-a"] <= 2 and most["tenant-b"] <= 2 and most["total"] <= LIMIT, most
    assert most["total"] == LIMIT, most  # the budget was used in full
    assert (await ACCOUNT.getByName("acct-1").semaphore.usage())["charged"] == 0
    for region in regions:
        await region.queue.drain()


if __name__ == "__main__":
    asyncio.run(main())
