#!/usr/bin/env python3
"""Leases under a bursty workload: utilization, overshoot and holder calls per admitted item.

In the style of Doorman's simulation: one holder (the real ``DurabilitySemaphore`` on real SQLite
through the SQLite test bed) and many clients, driven on a ``VirtualClock``. For each mode (no
leases, ``strict``, ``under``, ``over``) the same seeded workload runs: every client owns one of a
few groups and receives bursts of items at random times, each item running for a random duration.

The clients are modelled in this script (an honest client following SPEC §3-§8, not the library's
``SemaphoreQueue``):

* a client with queued items and no undrawn lease permits sends a ``request`` with its demand
  and cumulative reports, no earlier than the ``nextRequestAt`` it was given (R11);
* new grant permits are claimed in a ``sync`` and only confirmed claims run (R15a);
* lease permits are drawn locally, one per item, one-shot (R34), with no holder call;
* grant releases are reported in a ``sync`` batched over ``--report-ms``; lease releases ride on
  the next request, a heartbeat or a stop report; leases with permits in use are heartbeated at
  half their TTL (R37);
* a lease that is fully drawn, retired (R33) or idle in a ``contended`` round (R29) is stopped,
  and reported (batched) until the holder answers ``settled`` (R30).

Measured per mode:

* utilization: time-weighted share of the ceiling (``limit``, or ``limit + extra`` for ``over``)
  held by running items while some demand waits (queued items exist);
* worst overshoot: the most running items above ``limit``, and the most charged capacity
  (grants outstanding + lease footprint, read from the holder) above ``limit``; must be 0 for
  strict/under/no leases and never above ``extra`` for over;
* holder calls (requests + syncs) per admitted item, and relative to the no-lease run.

    .venv/bin/python scripts/bench_leases.py                 # full run
    .venv/bin/python scripts/bench_leases.py --seed 7 --minutes 5
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from semaphore import DurabilityScheduler, DurabilitySemaphore, LeaseConfig  # noqa: E402
from semaphore.testing import AlarmDriver, LocalContext, LocalStorage, VirtualClock  # noqa: E402

T0 = 1_700_000_000_000


@dataclass
class Params:
    seed: int = 1
    clients: int = 50
    groups: int = 5
    limit: int = 400
    minutes: float = 10.0
    burst_gap_ms: int = 120_000  # mean time between bursts of one client (exponential)
    burst_min: int = 5
    burst_max: int = 60
    burst_span_min_ms: int = 10_000
    burst_span_max_ms: int = 60_000
    run_min_ms: int = 1_000
    run_max_ms: int = 20_000
    report_ms: int = 2_000
    permits_per_lease: int = 64
    ttl_ms: int = 1_800_000
    reserve: int = 120
    extra_ratio: float = 0.25


@dataclass
class Stats:
    calls: int = 0
    requests: int = 0
    syncs: int = 0
    admitted: int = 0
    admitted_lease: int = 0
    running: int = 0
    queued: int = 0
    busy_integral: float = 0.0  # running/ceiling * dt while demand waits
    waiting_time: float = 0.0
    last_t: int = 0
    max_running_over: int = 0
    max_charged_over: int = 0
    unserved_wait_ms: int = 0


@dataclass
class SimClient:
    cid: str
    group: str
    queue: deque = field(default_factory=deque)  # enqueue times
    grants: dict[str, dict[str, int]] = field(default_factory=dict)
    leases: dict[str, dict[str, Any]] = field(default_factory=dict)
    next_request_at: int = 0
    report_due: int | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    arriving: bool = True


class Sim:
    def __init__(self, p: Params, mode: str) -> None:
        self.p = p
        self.mode = mode
        self.clock = VirtualClock(T0)
        self.storage = LocalStorage()
        ctx = LocalContext(self.storage)
        self.scheduler = DurabilityScheduler(ctx, clock=self.clock)
        leases: dict[str, Any] | None
        if mode == "none":
            leases = None
        elif mode == "strict":
            leases = {"provisioning": {"mode": "strict"}}
        elif mode == "under":
            leases = {"provisioning": {"mode": "under", "reserve": p.reserve}}
        else:
            leases = {"provisioning": {"mode": "over", "extra": {"ratio": p.extra_ratio}}}
        if leases is not None:
            leases.update(permitsPerLease=p.permits_per_lease, ttlMs=p.ttl_ms)
        self.config = LeaseConfig.parse(leases)
        ids = itertools.count(1)
        self.sem = DurabilitySemaphore(scheduler=self.scheduler, limit=p.limit, leases=leases,
                                       clock=self.clock, id_factory=lambda: f"id{next(ids)}")
        self.driver = AlarmDriver(self.clock, self.storage, self.scheduler.alarm)
        self.ceiling = p.limit + (self.config.extra(p.limit) if self.config else 0)
        self.stats = Stats(last_t=T0)
        self.clients = [SimClient(f"c{i:03d}", f"g{i % p.groups}") for i in range(p.clients)]
        self.lease_capable = mode != "none"
        self.stopping = False

    # ------------------------------------------------------------------ accounting
    def _account(self) -> None:
        now = self.clock.now
        dt = now - self.stats.last_t
        if dt > 0 and self.stats.queued > 0:
            self.stats.busy_integral += min(1.0, self.stats.running / self.ceiling) * dt
            self.stats.waiting_time += dt
        self.stats.last_t = now

    def _start_items(self, c: SimClient, kind: str, ident: str, n: int, rng: random.Random) -> None:
        self._account()
        for _ in range(n):
            c.queue.popleft()
            self.stats.queued -= 1
            self.stats.running += 1
            self.stats.admitted += 1
            if kind == "lease":
                self.stats.admitted_lease += 1
            duration = rng.randint(self.p.run_min_ms, self.p.run_max_ms)
            asyncio.ensure_future(self._finish(c, kind, ident, duration))
        over = self.stats.running - self.p.limit
        self.stats.max_running_over = max(self.stats.max_running_over, over)

    async def _finish(self, c: SimClient, kind: str, ident: str, duration: int) -> None:
        await self.clock.sleep(duration)
        self._account()
        self.stats.running -= 1
        if kind == "grant":
            c.grants[ident]["released"] += 1
            self._report_soon(c)
        else:
            lease = c.leases[ident]
            lease["released"] += 1
            if lease["stopped"] and lease["released"] == lease["drawn"]:
                self._report_soon(c)  # ready to settle
        c.wake.set()

    def _report_soon(self, c: SimClient) -> None:
        due = self.clock.now + self.p.report_ms
        if c.report_due is None or c.report_due > due:
            c.report_due = due

    # ------------------------------------------------------------------ holder calls
    def _reports(self, c: SimClient) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        grants = [{"grantId": gid, "claimed": g["claimed"], "released": g["released"]}
                  for gid, g in c.grants.items()]
        if not self.lease_capable:
            return grants, None
        leases = [{"leaseId": lid, "drawn": x["drawn"], "released": x["released"], "stopped": x["stopped"]}
                  for lid, x in c.leases.items()]
        return grants, leases

    async def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        self.stats.calls += 1
        if message["type"] == "request":
            self.stats.requests += 1
        else:
            self.stats.syncs += 1
        reply = await self.sem.handle(message)
        if "error" in reply:
            raise RuntimeError(reply)
        self._sample_charged()
        return reply

    def _sample_charged(self) -> None:
        meta = {r[0]: r[1] for r in self.storage.connection.execute(
            "SELECT key, value FROM durability_semaphore_meta")}
        charged = meta.get("outstanding", 0) + meta.get("lease_footprint", 0)
        self.stats.max_charged_over = max(self.stats.max_charged_over, charged - self.p.limit)

    async def _sync(self, c: SimClient) -> dict[str, Any]:
        grants, leases = self._reports(c)
        message: dict[str, Any] = {"type": "sync", "v": 1, "clientId": c.cid, "grants": grants}
        if leases is not None:
            message["leases"] = leases
        c.report_due = None
        reply = await self._call(message)
        self._absorb(c, reply)
        return reply

    async def _request(self, c: SimClient, rng: random.Random) -> None:
        grants, leases = self._reports(c)
        message: dict[str, Any] = {
            "type": "request", "v": 1, "clientId": c.cid,
            "demand": [{"group": c.group, "count": len(c.queue), "oldestAt": c.queue[0]}],
            "grants": grants,
        }
        if leases is not None:
            message["leases"] = leases
        c.report_due = None
        reply = await self._call(message)
        c.next_request_at = reply["nextRequestAt"]
        self._absorb(c, reply)
        # claim new grant permits for queued items; only confirmed claims run (R15a)
        claims = {}
        for gid, g in c.grants.items():
            k = min(g["permits"] - g["claimed"], len(c.queue) - sum(claims.values()))
            if k > 0:
                g["claimed"] += k
                claims[gid] = k
        if claims:
            confirm = await self._sync(c)
            states = {s["grantId"]: s for s in confirm["grants"]}
            for gid, k in claims.items():
                g = c.grants.get(gid)
                s = states.get(gid)
                ok = k if s is not None and s["status"] == "active" and s["claimed"] >= g["claimed"] else 0
                if ok < k:
                    g["claimed"] -= k - ok
                if ok:
                    self._start_items(c, "grant", gid, min(ok, len(c.queue)), rng)
        if reply["contended"] and not c.queue:
            self._stop_idle(c)

    def _absorb(self, c: SimClient, reply: dict[str, Any]) -> None:
        for s in reply["grants"]:
            gid = s["grantId"]
            g = c.grants.get(gid)
            if s["status"] == "not_found":
                c.grants.pop(gid, None)
                continue
            if g is None:
                c.grants[gid] = {"permits": s["permits"], "claimed": 0, "released": 0}
                continue
            g["permits"] = s["permits"]
            g["claimed"] = min(g["claimed"], max(s["claimed"], g["released"]))
            if s["released"] >= s["permits"] and g["released"] >= g["permits"]:
                del c.grants[gid]  # settled (R17)
        for s in reply["leases"]:
            lid = s["leaseId"]
            x = c.leases.get(lid)
            if s["status"] == "settled":
                c.leases.pop(lid, None)
                continue
            if x is None:
                if s["group"] is not None:
                    c.leases[lid] = {"permits": s["permits"], "drawn": 0, "released": 0,
                                     "stopped": s["status"] != "live", "expires_at": s["expiresAt"]}
                continue
            x["expires_at"] = s["expiresAt"]
            if s["status"] == "retired" and not x["stopped"]:
                x["stopped"] = True  # R33: stop drawing at once
                self._report_soon(c)
        if reply["contended"]:
            self._stop_idle(c)

    def _stop_idle(self, c: SimClient) -> None:
        """R29: a contended reply stops live leases of a client with nothing queued."""
        if c.queue:
            return
        for x in c.leases.values():
            if not x["stopped"]:
                x["stopped"] = True
                self._report_soon(c)

    def _draw(self, c: SimClient, rng: random.Random) -> None:
        for lid, x in list(c.leases.items()):
            if x["stopped"] or not c.queue:
                continue
            if x["expires_at"] is not None and x["expires_at"] - self.clock.now < 1_000:
                continue
            k = min(x["permits"] - x["drawn"], len(c.queue))
            if k > 0:
                x["drawn"] += k
                self._start_items(c, "lease", lid, k, rng)
            if x["drawn"] == x["permits"]:
                x["stopped"] = True  # nothing left to draw; settles once all are released

    def _heartbeat_due(self, c: SimClient) -> int | None:
        due = None
        for x in c.leases.values():
            if x["drawn"] > x["released"] and x["expires_at"] is not None:
                t = x["expires_at"] - self.p.ttl_ms // 2
                due = t if due is None else min(due, t)
        return due

    # ------------------------------------------------------------------ processes
    async def client_loop(self, c: SimClient, rng: random.Random) -> None:
        while True:
            self._draw(c, rng)
            now = self.clock.now
            hb = self._heartbeat_due(c)
            if c.queue and now >= c.next_request_at:
                await self._request(c, rng)
                continue
            if (c.report_due is not None and now >= c.report_due) or (hb is not None and now >= hb):
                await self._sync(c)
                continue
            if self.stopping and not c.queue and not c.arriving:
                if any(not x["stopped"] for x in c.leases.values()):
                    for x in c.leases.values():
                        x["stopped"] = True  # the workload is over: return idle lease permits
                    self._report_soon(c)
                    continue
                if not c.grants and not c.leases:
                    return
            times = [t for t in (c.next_request_at if c.queue else None, c.report_due, hb) if t is not None]
            c.wake.clear()
            waiter = asyncio.ensure_future(c.wake.wait())
            sleeper = asyncio.ensure_future(self.clock.sleep_until(min(times))) if times else None
            await asyncio.wait([t for t in (waiter, sleeper) if t is not None],
                               return_when=asyncio.FIRST_COMPLETED)
            for t in (waiter, sleeper):
                if t is not None and not t.done():
                    t.cancel()

    async def arrivals(self, c: SimClient, rng: random.Random, end: int) -> None:
        t = self.clock.now + int(rng.expovariate(1 / self.p.burst_gap_ms))
        while t < end:
            # a burst: n items arriving at random times over its span
            n = rng.randint(self.p.burst_min, self.p.burst_max)
            span = rng.randint(self.p.burst_span_min_ms, self.p.burst_span_max_ms)
            for at in sorted(t + rng.randint(0, span) for _ in range(n)):
                await self.clock.sleep_until(at)
                self._account()
                c.queue.append(self.clock.now)
                self.stats.queued += 1
                c.wake.set()
            t += span + int(rng.expovariate(1 / self.p.burst_gap_ms))
        c.arriving = False
        c.wake.set()

    async def run(self) -> dict[str, Any]:
        end = T0 + int(self.p.minutes * 60_000)
        tasks = []
        for i, c in enumerate(self.clients):
            # same arrivals and durations in every mode: one generator per client and purpose
            tasks.append(asyncio.ensure_future(self.arrivals(c, random.Random(f"{self.p.seed}:{i}:a"), end)))
            tasks.append(asyncio.ensure_future(self.client_loop(c, random.Random(f"{self.p.seed}:{i}:d"))))
        await self.clock.advance_to(end)
        self.stopping = True
        for c in self.clients:
            c.wake.set()
        await self.clock.advance_to(end + 600_000)  # drain: queued work runs, leases settle
        self._account()
        usage = await self.sem.usage()
        for t in tasks:
            if not t.done():
                t.cancel()
        s = self.stats
        return {
            "mode": self.mode,
            "ceiling": self.ceiling,
            "utilization": s.busy_integral / s.waiting_time if s.waiting_time else float("nan"),
            "waiting_s": s.waiting_time / 1000,
            "max_running_over": max(0, s.max_running_over),
            "max_charged_over": max(0, s.max_charged_over),
            "admitted": s.admitted,
            "lease_share": s.admitted_lease / s.admitted if s.admitted else 0.0,
            "calls": s.calls,
            "requests": s.requests,
            "syncs": s.syncs,
            "calls_per_item": s.calls / s.admitted if s.admitted else float("nan"),
            "left_queued": s.queued,
            "final_charged": usage["outstanding"] + usage["leaseFootprint"],
            "extra": self.config.extra(self.p.limit) if self.config else 0,
        }


def simulate(p: Params, mode: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        return await Sim(p, mode).run()

    started = time.perf_counter()
    result = asyncio.run(go())
    result["seconds"] = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--groups", type=int, default=5)
    ap.add_argument("--limit", type=int, default=400)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--permits-per-lease", type=int, default=64)
    ap.add_argument("--modes", default="none,strict,under,over")
    args = ap.parse_args(argv)
    p = Params(seed=args.seed, clients=args.clients, groups=args.groups, limit=args.limit,
               minutes=args.minutes, permits_per_lease=args.permits_per_lease,
               reserve=args.limit * 3 // 10)
    print(f"seed {p.seed}: {p.clients} clients in {p.groups} groups, limit {p.limit}, {p.minutes:g} min of "
          f"bursts ({p.burst_min}-{p.burst_max} items arriving over {p.burst_span_min_ms // 1000}-"
          f"{p.burst_span_max_ms // 1000} s, then ~{p.burst_gap_ms // 1000} s quiet, per client; "
          f"{p.run_min_ms // 1000}-{p.run_max_ms // 1000} s each); permitsPerLease {p.permits_per_lease}, "
          f"ttl {p.ttl_ms // 1000} s, under reserve {p.reserve}, over extra ratio {p.extra_ratio}")
    results = [simulate(p, mode) for mode in args.modes.split(",")]
    base = next((r for r in results if r["mode"] == "none"), None)
    header = (f"{'mode':<7} {'ceiling':>7} {'util':>6} {'run>lim':>7} {'chg>lim':>7} {'extra':>5} "
              f"{'admitted':>8} {'leased':>6} {'calls':>6} {'req':>5} {'sync':>5} {'calls/item':>10} "
              f"{'vs none':>7} {'left':>4} {'final':>5} {'secs':>5}")
    print(header)
    print("-" * len(header))
    failures = []
    for r in results:
        rel = r["calls_per_item"] / base["calls_per_item"] if base else float("nan")
        print(f"{r['mode']:<7} {r['ceiling']:>7} {r['utilization']:>6.1%} {r['max_running_over']:>7} "
              f"{r['max_charged_over']:>7} {r['extra']:>5} {r['admitted']:>8} {r['lease_share']:>6.0%} "
              f"{r['calls']:>6} {r['requests']:>5} {r['syncs']:>5} {r['calls_per_item']:>10.3f} "
              f"{rel:>7.2f} {r['left_queued']:>4} {r['final_charged']:>5} {r['seconds']:>5.1f}")
        bound = r["extra"]
        if r["max_running_over"] > bound or r["max_charged_over"] > bound:
            failures.append(f"{r['mode']}: overshoot above {bound}")
        if r["mode"] != "none" and r["calls_per_item"] > 0.05:
            failures.append(f"{r['mode']}: {r['calls_per_item']:.3f} holder calls per item (target <= 0.05)")
    print("\nutil = share of the ceiling held by running items while demand waits; run>lim / chg>lim = "
          "worst running items / charged capacity above the limit (0 for strict/under/none, <= extra "
          "for over); left = items still queued after the drain; final = charged after the drain.")
    for f in failures:
        print("MISSED:", f)
    return 1 if any("overshoot" in f for f in failures) else 0


if __name__ == "__main__":
    raise SystemExit(main())
