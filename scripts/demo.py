#!/usr/bin/env python3
"""A short tour of the holder: a few simulated clients going through rounds.

Everything printed comes from the real ``DurabilitySemaphore``'s replies (and ``usage()``),
running on real SQLite (a file in a temp dir) with a virtual clock, so the run is instant and
deterministic (ids come from a seeded generator).

    scripts/demo              # the story: group limit, account limit, claims, reclaim by alarm
    scripts/demo --leases     # ... plus a round that issues a strict-mode lease
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from semaphore import DurabilityScheduler, DurabilitySemaphore  # noqa: E402
from semaphore.testing import AlarmDriver, LocalContext, LocalStorage, VirtualClock  # noqa: E402

START = 1_700_000_000_000
LIMIT = 5                      # the account's shared limit
GROUP_LIMITS = {"emails": 2}   # a group with its own ceiling under it


def t(ms: int) -> str:
    return f"+{(ms - START) / 1000:.1f}s"


class Client:
    """A simulated client: remembers the grants and leases its replies show."""

    def __init__(self, name: str, oldest_at: int, *, leases: bool = False) -> None:
        self.name = name
        self.oldest_at = oldest_at  # when its oldest queued item arrived: older is served first
        self.grants: dict[str, dict[str, Any]] = {}
        self.leases: dict[str, dict[str, Any]] | None = {} if leases else None

    def report(self, grant_id: str, claimed: int, released: int = 0) -> dict[str, Any]:
        return {"grantId": grant_id, "claimed": claimed, "released": released}

    def grant(self, group: str, new: bool = False) -> str:
        """Id of the client's (newest, with ``new``) grant in ``group``."""
        ids = [g for g, s in self.grants.items() if s["group"] == group]
        return ids[-1] if new else ids[0]

    def take(self, reply: dict[str, Any]) -> None:
        for g in reply["grants"]:
            self.grants[g["grantId"]] = g
        for lease in reply["leases"]:
            if self.leases is not None:
                self.leases[lease["leaseId"]] = lease


class Demo:
    def __init__(self, path: str, leases: bool) -> None:
        rng = random.Random(7)
        self.clock = VirtualClock(START)
        self.storage = LocalStorage(path)
        ctx = LocalContext(self.storage, name="semaphore:demo")
        scheduler = DurabilityScheduler(ctx, clock=self.clock)
        self.sem = DurabilitySemaphore(
            scheduler=scheduler, limit=LIMIT, group_limit=GROUP_LIMITS, clock=self.clock,
            leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 4} if leases else None,
            id_factory=lambda: f"{rng.getrandbits(24):06x}",
        )
        # The holder object's alarm() delegates to the scheduler; the driver fires it on time.
        self.alarms = AlarmDriver(self.clock, self.storage, scheduler.alarm)
        self.round_no = 0

    async def round(self, asks: dict[Client, dict[str, Any]]) -> None:
        """Every client sends one request; the round runs when the clock reaches it."""
        tasks = {}
        for c, ask in asks.items():
            message = {"type": "request", "v": 1, "clientId": c.name,
                       "demand": [{"group": g, "count": n, "oldestAt": c.oldest_at}
                                  for g, n in ask.get("demand", {}).items()],
                       "grants": ask.get("grants", [])}
            if c.leases is not None:
                message["leases"] = ask.get("leases", [])
            tasks[c] = asyncio.ensure_future(self.sem.handle(message))
        await self.clock.settle()
        await self.clock.advance_to(self.sem.next_request_at())
        self.round_no += 1
        print(f"\nround {self.round_no} at {t(self.clock.now)}")
        contended = next_at = None
        for c, task in tasks.items():
            reply = task.result()
            known = set(c.grants)
            c.take(reply)
            demand = asks[c].get("demand", {})
            wants = ", ".join(f"{g} {n}" for g, n in demand.items()) or "nothing"
            print(f"  {c.name:6} wants {wants}")
            reported = {r["grantId"] for r in asks[c].get("grants", [])}
            for g in reply["grants"]:
                if g["grantId"] in reported:
                    settled = " (all released: settled)" if g["permits"] and g["released"] == g["permits"] else ""
                    print(f"         report {g['grantId']}: claimed {g['claimed']}/{g['permits']},"
                          f" released {g['released']} -> {g['status']}{settled}")
            new = [g for g in reply["grants"] if g["grantId"] not in reported and g["grantId"] not in known]
            for g in new:
                print(f"         granted {g['group']} x{g['permits']} (grant {g['grantId']},"
                      f" claim by {t(g['claimBy'])})")
            for lease in reply["leases"]:
                print(f"         lease {lease['leaseId']}: {lease['group']} x{lease['permits']},"
                      f" drawn {lease['drawn']}, {lease['status']}")
            for b in reply["blocked"]:
                print(f"         blocked {b['group']} x{b['waiting']}: {b['reason']}")
            contended, next_at = reply["contended"], reply["nextRequestAt"]
        print(f"  contended: {str(contended).lower()}; next round not before {t(next_at)}")

    async def sync(self, c: Client, grants: list[dict[str, Any]], leases: list[Any] | None = None,
                   note: str = "") -> None:
        message: dict[str, Any] = {"type": "sync", "v": 1, "clientId": c.name, "grants": grants}
        if leases is not None:
            message["leases"] = leases
        reply = await self.sem.handle(message)
        c.take(reply)
        ids = {r["grantId"] for r in grants} | {x["leaseId"] for x in leases or ()}
        shown = [f"{g['grantId']} claimed {g['claimed']}/{g['permits']} released {g['released']}"
                 f" ({g['status']})" for g in reply["grants"] if g["grantId"] in ids]
        shown += [f"lease {x['leaseId']} drawn {x['drawn']} released {x['released']} ({x['status']})"
                  for x in reply["leases"] if x["leaseId"] in ids]
        print(f"  {t(self.clock.now)} sync {c.name}{note}: " + "; ".join(shown))


async def story(path: str, with_leases: bool) -> None:
    demo = Demo(path, with_leases)
    alpha, beta, gamma = (Client(n, START - 3000 + 1000 * i) for i, n in enumerate(["alpha", "beta", "gamma"]))
    print(f"holder: limit {LIMIT} (the account), group limit emails {GROUP_LIMITS['emails']};"
          " grants must be claimed within 10 s")

    await demo.round({alpha: {"demand": {"emails": 3, "reports": 2}},
                      beta: {"demand": {"emails": 2}},
                      gamma: {"demand": {"reports": 3}}})
    # Clients confirm claims before starting work (R15a).
    a_mail, a_rep, g_rep = alpha.grant("emails"), alpha.grant("reports"), gamma.grant("reports")
    await demo.sync(alpha, [alpha.report(a_mail, 2), alpha.report(a_rep, 2)], note=" (claims)")
    await demo.sync(gamma, [gamma.report(g_rep, 1)], note=" (claim)")

    await demo.clock.advance(1000)  # alpha's emails finish; it reports the release in its request
    await demo.round({alpha: {"demand": {"emails": 1}, "grants": [alpha.report(a_mail, 2, 2)]},
                      beta: {"demand": {"emails": 2}},
                      gamma: {"demand": {"reports": 2}, "grants": [gamma.report(g_rep, 1)]}})
    a_mail2, b_mail = alpha.grant("emails", new=True), beta.grant("emails")
    await demo.sync(alpha, [alpha.report(a_mail2, 1)], note=" (claim)")
    print(f"  ... beta crashes before claiming {b_mail}; holder alarm set for {t(demo.storage.alarm or 0)}")

    before = (await demo.sem.usage())["outstanding"]
    fired = demo.alarms.fired
    await demo.clock.advance_to(demo.storage.alarm or demo.clock.now)
    after = await demo.sem.usage()
    print(f"\nalarm fired {demo.alarms.fired - fired}x at {t(demo.clock.now)}: outstanding permits"
          f" {before} -> {after['outstanding']} (emails {after['groups'].get('emails', {}).get('outstanding', 0)})")

    # beta restarts and asks again, still reporting the grant it never claimed.
    await demo.round({alpha: {"grants": [alpha.report(a_rep, 2, 2), alpha.report(a_mail2, 1, 1)]},
                      beta: {"demand": {"emails": 2}, "grants": [beta.report(b_mail, 0)]},
                      gamma: {"demand": {"reports": 2}, "grants": [gamma.report(g_rep, 1, 1)]}})
    b_mail, g_rep = beta.grant("emails", new=True), gamma.grant("reports", new=True)
    await demo.sync(beta, [beta.report(b_mail, 2)], note=" (claim)")
    await demo.sync(gamma, [gamma.report(g_rep, 2)], note=" (claim)")

    if with_leases:
        delta = Client("delta", START, leases=True)
        await demo.clock.advance(2000)
        await demo.sync(beta, [beta.report(b_mail, 2, 2)], note=" (done)")
        await demo.sync(gamma, [gamma.report(g_rep, 2, 2)], note=" (done)")
        print("  delta reports leases, so it is a lease candidate (strict: leases only from what"
              " grants leave)")
        await demo.round({delta: {"demand": {"reports": 1}}})
        lease_id = next(iter(delta.leases or {}))
        await demo.sync(delta, [], [{"leaseId": lease_id, "drawn": 2, "released": 1, "stopped": False}],
                        note=" (draws 2 from its lease, finishes 1)")

    u = await demo.sem.usage()
    print(f"\nusage(): limit {u['limit']}, outstanding {u['outstanding']}, lease footprint"
          f" {u['leaseFootprint']}, live leases {u['liveLeases']}")
    for group, g in u["groups"].items():
        limit = "" if g["limit"] is None else f" (group limit {g['limit']})"
        print(f"  {group:8} outstanding {g['outstanding']}, lease footprint {g['leaseFootprint']}{limit}")
    demo.storage.close()


def main() -> None:
    ap = argparse.ArgumentParser(description="A short tour of the semaphore holder.")
    ap.add_argument("--leases", action="store_true", help="also show a strict-mode lease round")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="semaphore-demo-") as tmp:
        asyncio.run(story(os.path.join(tmp, "holder.sqlite"), args.leases))


if __name__ == "__main__":
    main()
