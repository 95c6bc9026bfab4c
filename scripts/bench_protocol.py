#!/usr/bin/env python3
"""The protocol benchmark, side by side in one run (issue 12): the same workload and seed through

  (a) ``naive``  - a naive semaphore object: one durable counter in SQLite; each item calls
                   ``acquire()`` (succeeds while the counter is below the limit, else retried after
                   a backoff: 250 ms doubling to 2 s, jittered +-50%) and ``release()`` when its
                   job ends; no queue, no fairness: a newcomer may win a freed permit;
  (b) ``defaults`` - this library as a user gets it who sets only the limit: strict reusable
                   leases sized before grants, recheck 30 s (``semaphore.DEFAULT_LEASES``),
                   rounds at once while nothing competes (SPEC R9a), else batched (100 ms
                   after the first waiting request, at most one a second: R9's default timing);
                   ``rounds`` - the same without leases (``leases=None``: every permit a
                   grant, confirmed claims); ``batched`` - that with the seed's timing
                   (``free_at_once=False``: every round batched, 1,000 ms after the first
                   waiting request, at most one every 2 s);
  (c) ``strict`` / ``under`` / ``over`` - this library with the original's one-shot leases in
                   each provisioning mode (grants first, recheck 4 s),
  (d) ``held`` / ``held-over`` - named settings: waiting requests (the holder's
                   ``hold_blocked_ms`` and the queues' ``request_wait_ms``, 10 s) with rounds of
                   250/500 ms, without leases and with ``over`` leases,
  (e) ``reuse`` / ``reuse-held`` - named settings: strict leases whose slots are reused while
                   they live (``reusable``), sized before grants (``leaseFirst``), lifetime 60 s,
                   recheck 4 s;
                   then with waiting requests held 30 s and rounds of 250/500 ms,

for two workloads: a standing backlog (20 client objects keeping 50 items queued each, limit 100:
demand always above the limit) and a bursty one (the simulator's bursts). Per mode it prints
utilization (running / limit over the whole run, and while items waited), admission latency
(enqueue to start) and freed-to-start latency percentiles, holder calls per admitted item and the
worst overshoot, and each as a ratio against (a); then what each costs on Cloudflare (billed
requests and active object-seconds per item, dollars per million items, from the published prices:
:mod:`semaphore.simulate.cost`), with its ratio against (a). Modes (b) to (e) run the REAL holder, client and
queue code through :mod:`semaphore.simulate`; (a) runs on the same virtual clock with the same
arrivals and job durations (:func:`~semaphore.simulate.plan_arrivals`,
:func:`~semaphore.simulate.job_duration`).

    scripts/bench_protocol.py                      # both workloads, all modes (a few minutes)
    scripts/bench_protocol.py --run-s 120          # shorter runs
    scripts/bench_protocol.py --workloads bursty --modes naive,rounds
    scripts/bench_protocol.py --workloads bursty --modes naive,defaults --set round_wait_ms=250

``--set NAME=VALUE`` (repeatable) sets an option of :class:`~semaphore.simulate.Scenario` (the
simulator's, e.g. ``round_wait_ms``, ``limit``) for every mode, over the workload's and the
mode's own settings: a candidate default measured beside the naive object and today's modes
(its header line says what was set; the naive object takes only the workload's options, such as
``limit``; a ``leases`` set makes every library mode that lease mode under its own name).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from semaphore.simulate import Scenario, ScenarioError, job_duration, percentiles, plan_arrivals, run_scenario  # noqa: E402
from semaphore.simulate.cost import PRICES, PRICING_SOURCE, ActiveTime, Cost, Usage, cost  # noqa: E402
from semaphore.simulate.engine import RunningTime  # noqa: E402
from semaphore.testing import SEED_TIMING, T0, LocalStorage, SimClock  # noqa: E402

WORKLOADS: dict[str, dict[str, Any]] = {
    # issue 13's standing backlog: demand always above the limit
    "backlog": dict(limit=100, clients=20, arrivals=["backlog"], backlog=50, backlog_clients=0,
                    job_duration="exponential", job_ms=5000.0),
    # the simulator's bursts: 8 client objects, 8 items per burst every 60 s each, limit 20
    "bursty": dict(limit=20, clients=8, arrivals=["bursty"], burst_size=8, burst_every_s=60.0,
                   job_duration="exponential", job_ms=8000.0),
}
MODES = ("naive", "defaults", "batched", "rounds", "strict", "under", "over", "held", "held-over", "reuse",
         "reuse-held")
#: The named settings of the waiting-request modes (issue 13): blocked requests held open at the
#: holder (hold_blocked_ms, the queues' request_wait_ms) with short rounds, which then cost no
#: extra holder calls; ``held`` without leases, ``held-over`` with over-provisioned leases.
HELD = dict(hold_blocked_ms=10_000, request_wait_ms=10_000, round_wait_ms=250, round_period_ms=500)
#: The named setting ``reuse`` (issue 13): strict leases whose slots are reused while they live
#: (SPEC R34a), sized before grants (R28a), with a 60 s lifetime (R31a: a lease is not extended
#: while a request waits unserved, so it bounds how long a newcomer waits behind leases).
REUSE = dict(leases="strict", reusable=True, lease_first=True, lease_ttl_ms=60_000, lease_recheck_ms=4000)
#: The original's one-shot leases (modes strict, under, over, held-over): grants first, recheck 4 s.
ONE_SHOT = dict(reusable=False, lease_first=False, lease_recheck_ms=4000)
#: ``reuse-held``: ``reuse`` with waiting requests held 30 s, rounds of 250/500 ms.
REUSE_HELD = dict(hold_blocked_ms=30_000, request_wait_ms=30_000, round_wait_ms=250, round_period_ms=500)


@dataclass
class Row:
    """One mode's figures."""

    mode: str
    utilization: float | None
    utilization_backlog: float | None
    latency: dict[str, float]
    free_to_start: dict[str, float]
    calls_per_item: float | None
    overshoot: int
    admitted: int
    wall_s: float
    cost: Cost


# ------------------------------------------------------------------------------ (a) the naive one
class NaiveSemaphore:
    """One durable counter in its own SQLite storage (a Durable Object with ``acquire`` and
    ``release`` RPC methods); every call is one holder call."""

    def __init__(self, limit: int) -> None:
        self.storage = LocalStorage()
        self.limit = limit
        self.calls = 0
        self.storage.sql.exec("CREATE TABLE counter (id INTEGER PRIMARY KEY, in_use INTEGER NOT NULL)")
        self.storage.sql.exec("INSERT INTO counter VALUES (1, 0)")

    async def acquire(self) -> bool:
        self.calls += 1
        cur = self.storage.sql.exec("UPDATE counter SET in_use = in_use + 1 WHERE id = 1 AND in_use < ?", self.limit)
        return cur.rowsWritten > 0

    async def release(self) -> None:
        self.calls += 1
        self.storage.sql.exec("UPDATE counter SET in_use = in_use - 1 WHERE id = 1 AND in_use > 0")


class NaiveRun(RunningTime):
    """The naive semaphore under the scenario's workload, on a virtual clock."""

    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        self.clock = SimClock(T0)
        self.sem = NaiveSemaphore(scenario.limit)
        self.running = 0
        self.queued = 0
        self.max_running = 0
        self.waits: list[int] = []
        self.free_to_start: list[int] = []
        self.freed: list[int] = []  # times a permit freed while items waited (FIFO of pending frees)
        self.samples: list[tuple[int, int]] = []  # (running, queued)
        self.admitted = 0
        self.counters: dict[int, int] = {}
        # running-item time integrals, kept by the simulator's own RunningTime (its utilization)
        self.area = self.area_backlog = 0.0
        self.backlog_ms = 0
        self.last_t = self.clock.now
        self.rng = random.Random(f"{scenario.seed}:naive")
        self.tasks: set[asyncio.Task[None]] = set()
        #: per client object: active while one of its items waits in memory to retry acquire()
        #: (a pending timer keeps the object from hibernating); the calls themselves take no time
        self.active: dict[int, ActiveTime] = {}

    def spawn(self, client: int, duration: int | None = None, *, backlog: bool = False) -> None:
        """Queue one item of client object ``client``, named as the simulator names it
        (``c<client>-<n>``, so the n-th item of a client has the same job duration in every mode)."""
        n = self.counters.get(client, 0)
        self.counters[client] = n + 1
        self._account()
        self.queued += 1  # queued now (the task's first step may come after the clock moved on)
        task = asyncio.ensure_future(self.item(client, f"c{client}-{n}", duration, backlog, self.clock.now))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def item(self, client: int, item_id: str, duration: int | None, backlog: bool, enqueued: int) -> None:
        backoff = 250
        active = self.active.setdefault(client, ActiveTime())
        active.begin(self.clock.now)
        try:
            while not await self.sem.acquire():
                await self.clock.sleep(int(backoff * self.rng.uniform(0.5, 1.5)))  # jittered, seeded
                backoff = min(2000, backoff * 2)
        finally:
            active.end(self.clock.now)
        self._account()
        self.queued -= 1
        self.running += 1
        self.admitted += 1
        self.max_running = max(self.max_running, self.running)
        self.waits.append(self.clock.now - enqueued)
        if self.freed:
            self.free_to_start.append(self.clock.now - self.freed.pop(0))
        if self.queued == 0:
            self.freed.clear()
        if backlog and self.clock.now - T0 < self.s.run_s * 1000:
            self.spawn(client, backlog=True)  # a backlog client keeps its items queued
        await self.clock.sleep(duration if duration is not None else job_duration(self.s, item_id))
        self._account()
        self.running -= 1
        await self.sem.release()
        if self.queued > 0:
            self.freed.append(self.clock.now)

    async def run(self) -> Row:
        started = time.monotonic()
        run_ms = int(self.s.run_s * 1000)
        if "backlog" in self.s.arrivals:
            backlog_clients = self.s.backlog_clients or self.s.clients
            for client in range(backlog_clients):
                for _ in range(self.s.backlog):
                    self.spawn(client, backlog=True)
        sampler = asyncio.ensure_future(self._sample(run_ms))
        for a in plan_arrivals(self.s):
            await self.clock.advance_to(T0 + a.at_ms)
            self.spawn(a.client, a.duration_ms)
        await self.clock.advance_to(T0 + run_ms)
        self._account()
        for task in [*self.tasks, sampler]:
            task.cancel()
        return self._row(time.monotonic() - started)

    async def _sample(self, run_ms: int) -> None:
        """One sample every ``sample_ms`` of virtual time, as the simulator samples."""
        while len(self.samples) * self.s.sample_ms < run_ms:
            self.samples.append((self.running, self.queued))
            await self.clock.sleep(self.s.sample_ms)

    def _row(self, wall_s: float) -> Row:
        limit, run_ms = self.s.limit, int(self.s.run_s * 1000)
        util = self.area / (run_ms * limit) if run_ms else None
        return Row("naive", util, self.area_backlog / (self.backlog_ms * limit) if self.backlog_ms else None,
                   percentiles(self.waits), percentiles(self.free_to_start),
                   self.sem.calls / self.admitted if self.admitted else None, self.max_running - limit,
                   self.admitted, wall_s, cost(self.usage(), self.admitted))

    def usage(self) -> Usage:
        """Every call a billed request to the naive object (which answers at once: no active time
        of its own); the client objects active while items wait to retry."""
        now = self.clock.now
        return Usage(holder_calls=self.sem.calls, holder_alarms=0, client_alarms=0, holder_active_s=0.0,
                     client_active_s=sum(a.total_ms(now) for a in self.active.values()) / 1000)


# ------------------------------------------------------------------------------ (b), (c): the library
def library_row(mode: str, scenario: Scenario, sets: dict[str, str] | None = None) -> Row:
    """One mode's row; ``scenario`` carries the library's defaults (``Scenario``'s lease fields
    are ``DEFAULT_LEASES``), which mode ``defaults`` runs as they are; ``sets`` (``--set``)
    over the mode's own settings."""
    leases = {"defaults": "strict", "rounds": "off", "batched": "off", "held": "off", "held-over": "over",
              "reuse": "strict", "reuse-held": "strict"}.get(mode, mode)
    s = replace(scenario, leases=leases, reserve=max(1, scenario.limit // 5))
    if mode in ("strict", "under", "over", "held-over"):
        s = replace(s, **ONE_SHOT)
    if mode == "batched":
        s = replace(s, **SEED_TIMING)  # the original's timing whole
    if mode.startswith("held"):
        s = replace(s, **HELD)
    if mode.startswith("reuse"):
        s = replace(s, **REUSE)
    if mode == "reuse-held":
        s = replace(s, **REUSE_HELD)
    if sets:
        s = Scenario.from_mapping(sets, s)
    r = run_scenario(s)
    # the leases the run had (a --set may change the mode's): "over" charges above the limit by design
    over = max(r.max_running_over, r.max_charged_over) if s.leases in ("off", "strict", "under") \
        else r.max_running_over
    assert r.usage is not None
    return Row(mode, r.utilization, r.utilization_backlog, r.latency_ms, r.free_to_start_ms,
               r.per_item(r.calls), over, r.admitted, r.wall_s, cost(r.usage, r.admitted))


# ------------------------------------------------------------------------------ the table
def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ms(d: dict[str, float], key: str) -> str:
    return "-" if key not in d else f"{d[key] / 1000:.2f} s"


def _ratio(x: float | None, base: float | None, *, floor: float = 0.0) -> str:
    """``x / base``, or ``-`` when either is missing or ``base`` is at or below ``floor`` (a
    ratio against about nothing, e.g. a latency of 1 ms, says nothing)."""
    return "-" if x is None or not base or base <= floor else f"{x / base:.2f}x"


#: Latency ratios need a base above this (ms): the naive object's freed-to-start median is ~1 ms.
MEANINGFUL_MS = 10.0


def table(workload: str, rows: list[Row]) -> str:
    base = next((r for r in rows if r.mode == "naive"), None)
    head = ("| mode | utilization | ... while waiting | wait p50 / p95 / p99 | freed-to-start p50 / p95"
            " | holder calls / item | overshoot | admitted | vs naive: util / util waiting / calls / wait p95"
            " / freed-to-start p50 |")
    lines = [f"workload: {workload}", head, "|" + " --- |" * 9]
    costs = [f"cost, {workload}: | mode | billed requests / item | active object-s / item | USD per million items"
             " | vs naive |", "|" + " --- |" * 5]
    for r in rows:
        c = r.cost
        vs_naive = "-" if base is None or r is base else _ratio(c.usd_per_million_items,
                                                                base.cost.usd_per_million_items)
        costs.append(f"| {r.mode} | {_num(c.requests_per_item)} | {_num(c.active_s_per_item)} | "
                     f"{_usd(c.usd_per_million_items)} | {vs_naive} |")
    for r in rows:
        vs = "-" if base is None or r is base else " / ".join((
            _ratio(r.utilization, base.utilization), _ratio(r.utilization_backlog, base.utilization_backlog),
            _ratio(r.calls_per_item, base.calls_per_item),
            _ratio(r.latency.get("p95"), base.latency.get("p95"), floor=MEANINGFUL_MS),
            _ratio(r.free_to_start.get("p50"), base.free_to_start.get("p50"), floor=MEANINGFUL_MS)))
        lines.append(
            f"| {r.mode} | {_pct(r.utilization)} | {_pct(r.utilization_backlog)} | "
            f"{_ms(r.latency, 'p50')} / {_ms(r.latency, 'p95')} / {_ms(r.latency, 'p99')} | "
            f"{_ms(r.free_to_start, 'p50')} / {_ms(r.free_to_start, 'p95')} | "
            f"{'-' if r.calls_per_item is None else f'{r.calls_per_item:.3f}'} | {max(0, r.overshoot)} | "
            f"{r.admitted} | {vs} |")
    return "\n".join(lines) + "\n\n" + "\n".join(costs) + (
        f"\n(prices: ${PRICES.usd_per_million_requests}/M requests, ${PRICES.usd_per_million_gb_s}/M GB-s at "
        f"{PRICES.gb_per_object * 1000:.0f} MB per object; {PRICING_SOURCE})")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _usd(x: float | None) -> str:
    return "-" if x is None else f"${x:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-s", type=float, default=300.0, help="virtual seconds per run (default 300)")
    parser.add_argument("--seed", type=int, default=1, help="the seed of every run (default 1)")
    parser.add_argument("--workloads", default="backlog,bursty", help="comma-separated: backlog, bursty")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a Scenario option for every mode, over the mode's own settings (repeatable)")
    args = parser.parse_args(argv)
    if any("=" not in item for item in args.set):
        parser.error("--set: expected NAME=VALUE")
    sets = dict(item.partition("=")[::2] for item in args.set)
    if len(sets) < len(args.set):
        parser.error("--set: a name given twice")
    try:
        Scenario.from_mapping(sets, Scenario())
    except ScenarioError as exc:
        parser.error(f"--set: {exc}")
    runners: dict[str, Callable[[Scenario], Row]] = {
        "naive": lambda s: asyncio.run(NaiveRun(s).run()),
        **{m: (lambda s, m=m: library_row(m, s, sets)) for m in MODES if m != "naive"}}
    if sets:
        print("set for every mode: " + ", ".join(f"{k}={v}" for k, v in sets.items()) + "\n")
    for workload in args.workloads.split(","):
        scenario = Scenario(run_s=args.run_s, seed=args.seed, **WORKLOADS[workload])
        if sets:
            scenario = Scenario.from_mapping(sets, scenario)
        rows = []
        for mode in args.modes.split(","):
            print(f"  {workload}: {mode} ...", file=sys.stderr, flush=True)
            rows.append(runners[mode](scenario))
        print(table(workload, rows))
        print(f"(virtual {args.run_s:.0f} s per run, seed {args.seed}; wall s per mode: "
              + ", ".join(f"{r.mode} {r.wall_s:.1f}" for r in rows) + ")\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
