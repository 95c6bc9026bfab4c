#!/usr/bin/env python3
"""Leases under a bursty workload: utilization, overshoot and holder calls per admitted item.

Drives the REAL library end to end on one ``VirtualClock``: one holder object (the real
``DurabilitySemaphore`` on SQLite, with its scheduler and alarm driver) and many client objects,
each with its own ``LocalStorage``/``LocalContext``, ``DurabilityScheduler`` (alarm fired as a
task, as the runtime does), ``SemaphoreClient`` and ``SemaphoreQueue``. They talk over an
in-memory transport that counts ``request`` and ``sync`` calls. Nothing is modelled: demand,
claims, confirmations, draws, heartbeats, stops and reports are whatever the queue does.

Workload (seeded, identical in every mode): every client owns one of a few groups and receives
bursts of items at random times (exponential quiet gaps between bursts), each burst's items
arriving over a random span. ``on_admit`` starts a job of random duration (seeded per item id);
when it ends the job calls ``queue.complete(item_id)``. After the arrival window the run drains
until every item has run and the holder's charged capacity is back to zero (or a cap is hit).

Reported per mode (no leases, ``strict``, ``under``, ``over``):

* util: time-weighted share of the ceiling (``limit``, or ``limit + extra`` for ``over``) held by
  running items while some item is queued anywhere (demand waits);
* wait: mean time an item spent queued before admission;
* run>lim / chg>lim: the most running items above ``limit``, and the most charged capacity
  (outstanding grant permits + lease footprint, from the holder's aggregates, sampled after every
  holder call and admission) above ``limit``. Must be 0 for none/strict/under and never above
  ``extra`` for over;
* admitted, share admitted from leases, holder calls per admitted item (requests and syncs
  separately) and the ratio against the run without leases.

    .venv/bin/python scripts/bench_leases.py                  # all modes, default workload
    .venv/bin/python scripts/bench_leases.py --modes none,over --report-releases-within-ms 5000
    .venv/bin/python scripts/bench_leases.py --report-releases-within-ms 0 --no-prefer-leases  # old policy
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from semaphore import LeaseConfig, PermitKind, QueueItem  # noqa: E402
from semaphore.simulate import sync_reason  # noqa: E402
from semaphore.testing import T0, ClientSide, HolderSide, SimClock  # noqa: E402

KEY = "acct"


@dataclass
class Params:
    seed: int = 1
    clients: int = 30
    groups: int = 5
    limit: int = 300
    minutes: float = 8.0
    burst_gap_ms: int = 120_000  # mean quiet time between bursts of one client (exponential)
    burst_min: int = 5
    burst_max: int = 60
    burst_span_min_ms: int = 5_000
    burst_span_max_ms: int = 40_000
    run_min_ms: int = 1_000
    run_max_ms: int = 20_000
    permits_per_lease: int = 64
    ttl_ms: int = 1_800_000
    reserve_share: float = 0.3
    extra_ratio: float = 0.25
    drain_ms: int = 3_600_000
    queue_options: dict | None = None


def lease_options(p: Params, mode: str) -> dict[str, Any] | None:
    if mode == "none":
        return None
    provisioning: dict[str, Any] = {"mode": mode}
    if mode == "under":
        provisioning["reserve"] = int(p.limit * p.reserve_share)
    elif mode == "over":
        provisioning["extra"] = {"ratio": p.extra_ratio}
    return {"provisioning": provisioning, "permitsPerLease": p.permits_per_lease, "ttlMs": p.ttl_ms}


class Bench:
    def __init__(self, p: Params, mode: str) -> None:
        self.p = p
        self.mode = mode
        self.clock = SimClock(T0)
        leases = lease_options(p, mode)
        config = LeaseConfig.parse(leases)
        self.extra = config.extra(p.limit) if config else 0
        self.ceiling = p.limit + self.extra
        opts: dict[str, Any] = {"limit": p.limit}
        opts["leases"] = leases  # None for mode "none": no leases (not the holder's default)
        self.holder = HolderSide(self.clock, **opts)
        self.requests = 0
        self.syncs = 0
        self.reasons: dict[str, int] = {}
        self.sides = [
            ClientSide(f"c{i:03d}", self.clock, self.transport, on_admit=self.on_admit,
                       leases=leases is not None, **(p.queue_options or {}))
            for i in range(p.clients)
        ]
        self.group = {s.name: f"g{i % p.groups}" for i, s in enumerate(self.sides)}
        self.side_of = {s.name: s for s in self.sides}
        # accounting
        self.queued = 0
        self.running = 0
        self.enqueued = 0
        self.admitted = 0
        self.by_lease = 0
        self.finished = 0
        self.started: set[str] = set()
        self.enqueued_at: dict[str, int] = {}
        self.wait_total = 0
        self.last_t = T0
        self.busy = 0.0
        self.waiting_ms = 0
        self.max_running_over = -10**9
        self.max_charged_over = -10**9
        self.problems: list[str] = []

    # ------------------------------------------------------------------ transport
    async def transport(self, key: str, message: dict) -> dict:
        if message.get("type") == "request":
            self.requests += 1
        else:
            self.syncs += 1
            reason = self.sync_reason(key, message)
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
        reply = await self.holder.handle(message)
        self.sample_charged()
        return reply

    def sync_reason(self, key: str, message: dict) -> str:
        """Why the queue sent this sync (:func:`semaphore.simulate.sync_reason`)."""
        return sync_reason(self.side_of[message["clientId"]], key)

    def sample_charged(self) -> None:
        charged, _ = self.holder.charged()
        self.max_charged_over = max(self.max_charged_over, charged - self.p.limit)

    # ------------------------------------------------------------------ accounting
    def account(self) -> None:
        now = self.clock.now
        dt = now - self.last_t
        if dt > 0 and self.queued > 0:
            self.busy += min(1.0, self.running / self.ceiling) * dt
            self.waiting_ms += dt
        self.last_t = now

    # ------------------------------------------------------------------ application
    def on_admit(self, side: ClientSide, item: QueueItem) -> None:
        if item.item_id in self.started:
            return  # a retried admission: the job already runs
        self.started.add(item.item_id)
        self.account()
        self.queued -= 1
        self.running += 1
        self.admitted += 1
        self.wait_total += self.clock.now - self.enqueued_at[item.item_id]
        assert item.permit is not None
        if item.permit.kind is PermitKind.LEASE:
            self.by_lease += 1
        self.max_running_over = max(self.max_running_over, self.running - self.p.limit)
        self.sample_charged()
        charged, _ = self.holder.charged()
        if self.running > charged:
            self.problems.append(f"{self.running} running > {charged} charged at {self.clock.now - T0}")
        duration = random.Random(f"{self.p.seed}:{item.item_id}").randint(self.p.run_min_ms, self.p.run_max_ms)
        side.spawn(self.job(side, item.item_id, duration))

    async def job(self, side: ClientSide, item_id: str, duration: int) -> None:
        await self.clock.sleep(duration)
        self.account()
        self.running -= 1
        self.finished += 1
        await side.queue.complete(item_id)

    async def arrivals(self, side: ClientSide, rng: random.Random, end: int) -> None:
        p = self.p
        t = self.clock.now + int(rng.expovariate(1 / p.burst_gap_ms))
        n_item = 0
        while t < end:
            n = rng.randint(p.burst_min, p.burst_max)
            span = rng.randint(p.burst_span_min_ms, p.burst_span_max_ms)
            for at in sorted(t + rng.randint(0, span) for _ in range(n)):
                await self.clock.sleep_until(at)
                item_id = f"{side.name}-{n_item}"
                n_item += 1
                self.account()
                self.queued += 1
                self.enqueued += 1
                self.enqueued_at[item_id] = self.clock.now
                await side.queue.enqueue(KEY, self.group[side.name], item_id)
            t += span + int(rng.expovariate(1 / p.burst_gap_ms))

    # ------------------------------------------------------------------ run
    async def run(self) -> dict[str, Any]:
        p = self.p
        end = T0 + int(p.minutes * 60_000)
        tasks = [asyncio.ensure_future(self.arrivals(s, random.Random(f"{p.seed}:{i}:arrivals"), end))
                 for i, s in enumerate(self.sides)]
        await self.clock.advance_to(end)
        # drain: step until every item ran and the holder's charged capacity is back to zero
        stop = end + p.drain_ms
        while self.clock.now < stop:
            await self.clock.advance(10_000)
            if self.finished == self.enqueued and self.holder.charged()[0] == 0:
                break
        drained_ms = self.clock.now - end
        self.account()
        usage = await self.holder.usage()
        for t in tasks:
            t.cancel()
        for s in self.sides:
            s.driver.kill()
            for t in list(s.tasks):
                t.cancel()
        calls = self.requests + self.syncs
        per = (lambda n: n / self.admitted) if self.admitted else (lambda n: float("nan"))
        return {
            "mode": self.mode, "ceiling": self.ceiling, "extra": self.extra,
            "util": self.busy / self.waiting_ms if self.waiting_ms else float("nan"),
            "wait_s": self.wait_total / self.admitted / 1000 if self.admitted else float("nan"),
            "run_over": max(0, self.max_running_over), "chg_over": max(0, self.max_charged_over),
            "enqueued": self.enqueued, "admitted": self.admitted,
            "lease_share": self.by_lease / self.admitted if self.admitted else 0.0,
            "requests": self.requests, "syncs": self.syncs, "calls": calls,
            "calls_per_item": per(calls), "req_per_item": per(self.requests), "sync_per_item": per(self.syncs),
            "final_charged": usage["outstanding"] + usage["leaseFootprint"], "drained_s": drained_ms / 1000,
            "problems": self.problems, "reasons": dict(sorted(self.reasons.items(), key=lambda kv: -kv[1])),
        }


def simulate(p: Params, mode: str) -> dict[str, Any]:
    started = time.perf_counter()
    result = asyncio.run(Bench(p, mode).run())
    result["seconds"] = time.perf_counter() - started
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clients", type=int, default=30)
    ap.add_argument("--groups", type=int, default=5)
    ap.add_argument("--limit", type=int, default=300)
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--permits-per-lease", type=int, default=64)
    ap.add_argument("--modes", default="none,strict,under,over")
    ap.add_argument("--report-releases-within-ms", type=int, default=None,
                    help="SemaphoreQueue option (default: the queue's default)")
    ap.add_argument("--no-prefer-leases", action="store_true",
                    help="SemaphoreQueue prefer_leases=False (claim grants before drawing leases)")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    queue_options: dict[str, Any] = {}
    if args.report_releases_within_ms is not None:
        queue_options["report_releases_within_ms"] = args.report_releases_within_ms
    if args.no_prefer_leases:
        queue_options["prefer_leases"] = False
    p = Params(seed=args.seed, clients=args.clients, groups=args.groups, limit=args.limit,
               minutes=args.minutes, permits_per_lease=args.permits_per_lease, queue_options=queue_options)
    print(f"seed {p.seed}: {p.clients} clients (real SemaphoreQueue + SemaphoreClient each) in {p.groups} groups, "
          f"limit {p.limit}, {p.minutes:g} min of bursts ({p.burst_min}-{p.burst_max} items arriving over "
          f"{p.burst_span_min_ms // 1000}-{p.burst_span_max_ms // 1000} s, then ~{p.burst_gap_ms // 1000} s "
          f"quiet, per client; jobs {p.run_min_ms // 1000}-{p.run_max_ms // 1000} s); permitsPerLease "
          f"{p.permits_per_lease}, ttl {p.ttl_ms // 1000} s, under reserve {int(p.limit * p.reserve_share)}, "
          f"over extra ratio {p.extra_ratio}; queue options {queue_options or 'default'}")
    results = []
    for mode in args.modes.split(","):
        results.append(simulate(p, mode))
    base = next((r for r in results if r["mode"] == "none"), None)
    header = (f"{'mode':<7} {'ceil':>4} {'util':>6} {'wait':>6} {'run>lim':>7} {'chg>lim':>7} {'extra':>5} "
              f"{'admitted':>8} {'leased':>6} {'req':>5} {'sync':>5} {'req/it':>7} {'sync/it':>7} "
              f"{'calls/it':>8} {'vs none':>7} {'final':>5} {'drain':>6} {'secs':>5}")
    print(header)
    print("-" * len(header))
    failures = []
    for r in results:
        rel = r["calls_per_item"] / base["calls_per_item"] if base else float("nan")
        print(f"{r['mode']:<7} {r['ceiling']:>4} {r['util']:>6.1%} {r['wait_s']:>5.1f}s {r['run_over']:>7} "
              f"{r['chg_over']:>7} {r['extra']:>5} {r['admitted']:>8} {r['lease_share']:>6.0%} "
              f"{r['requests']:>5} {r['syncs']:>5} {r['req_per_item']:>7.3f} {r['sync_per_item']:>7.3f} "
              f"{r['calls_per_item']:>8.3f} {rel:>7.2f} {r['final_charged']:>5} {r['drained_s']:>5.0f}s "
              f"{r['seconds']:>5.1f}")
        if r["run_over"] > r["extra"] or r["chg_over"] > r["extra"]:
            failures.append(f"{r['mode']}: overshoot above {r['extra']}")
        if r["admitted"] != r["enqueued"]:
            failures.append(f"{r['mode']}: {r['enqueued'] - r['admitted']} items never admitted")
        if r["final_charged"]:
            failures.append(f"{r['mode']}: {r['final_charged']} still charged after the drain")
        failures += [f"{r['mode']}: {x}" for x in r["problems"][:3]]
    print("\nutil = share of the ceiling held by running items while some item is queued; wait = mean queued "
          "time per item; run>lim / chg>lim = worst running items / charged capacity above the limit (0 for "
          "none/strict/under, <= extra for over); final = charged after the drain; drain = virtual time after "
          "the last arrival until everything settled.")
    print("syncs by reason: " + "; ".join(
        f"{r['mode']}: " + ", ".join(f"{k} {v}" for k, v in r["reasons"].items()) for r in results))
    for r in results:
        if r["mode"] != "none":
            ok = r["calls_per_item"] <= 0.05
            print(f"{r['mode']}: {r['calls_per_item']:.3f} holder calls per admitted item -> target <= 0.05 "
                  f"{'MET' if ok else 'NOT MET'}")
    for f in failures:
        print("FAILED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
