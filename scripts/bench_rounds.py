#!/usr/bin/env python3
"""Round cost of the holder on CPython with real SQLite.

For each storage kind (a file in a temp dir, and ``:memory:``), each number of live grants
(1k, 10k, 100k) and each number of requesting clients (10, 100, 1,000), this script:

1. builds a holder database with that many live grants (through the holder's own
   ``Ledger`` and ``SqlStore``, so the per-group and total aggregates are right): most belong to OTHER
   clients (3 grants each over 100 groups, 95% fully claimed and running, 5% still unclaimed
   with a claim deadline an hour away), and every requesting client holds 2 grants itself;
2. runs rounds through the public path (``handle()`` for every client, then the virtual clock
   reaches the round time): every requesting client reports its grants (claims what it got last
   round, releases what has run for two rounds) and asks for 3 permits in each of two groups.
   The limit leaves room for about one permit per client, and one group has a group limit, so
   every round admits, settles, deletes and blocks;
3. times the round itself: the holder's ``_run_round`` (from the round timer firing to every
   reply set), wrapped on the instance with a timer, median over the measured rounds; counts the
   SQL statements of the round (``LocalStorage.statements``) and SQLite virtual-machine steps
   (a progress handler; a proxy for rows read: it stays flat when no query scans).

It prints one table, the ratio 100k/10k per client count, the targets, and the query plans
(``EXPLAIN QUERY PLAN``) of the statements of one round.

Targets: 1,000 clients over 10k grants <= 50 ms per round; 100k/10k <= 1.5.

    .venv/bin/python scripts/bench_rounds.py            # full run (< 3 minutes)
    .venv/bin/python scripts/bench_rounds.py --quick    # smaller, for a smoke check
    .venv/bin/python scripts/bench_rounds.py --profile 1000x10000   # cProfile one config
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import itertools
import os
import pstats
import random
import re
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from semaphore import DurabilityScheduler, DurabilitySemaphore  # noqa: E402
from semaphore.core.ledger import Ledger, Snapshot  # noqa: E402
from semaphore.core.rows import GrantRow  # noqa: E402
from semaphore.holder._store import SqlStore, ensure_schema  # noqa: E402
from semaphore.runtime import Storage  # noqa: E402
from semaphore.testing import AlarmDriver, LocalContext, LocalStorage, VirtualClock  # noqa: E402

START = 1_700_000_000_000
GROUPS = [f"group-{i:02d}" for i in range(100)]
LIMITED_GROUP = GROUPS[0]
ROUND_PERIOD_MS = 2000
OWN_GRANTS = 2  # grants each requesting client holds at the start
TARGET_MS = 50.0
TARGET_RATIO = 1.5


# ------------------------------------------------------------------------------ population
def _population(live: int, clients: int, seed: int) -> tuple[list[GrantRow], dict[str, int]]:
    """Live grants: ``OWN_GRANTS`` per requesting client, the rest held by other clients."""
    rng = random.Random(seed)
    rows: list[GrantRow] = []
    for c in range(clients):
        for k in range(OWN_GRANTS):
            group = GROUPS[(c + k * 37) % len(GROUPS)]
            permits = 2
            rows.append(GrantRow(f"own-{c}-{k}", f"client-{c}", group, permits, 1, 0, START - 5000,
                                 START + 3_600_000, False))
    for i in range(live - len(rows)):
        permits = rng.randint(1, 4)
        unclaimed = rng.random() < 0.05
        claimed = 0 if unclaimed else permits
        released = 0 if unclaimed else rng.randint(0, permits - 1)
        rows.append(GrantRow(f"live-{i:06d}", f"other-{i // 3}", GROUPS[i % len(GROUPS)], permits,
                             claimed, released, START - 5000, START + 3_600_000, False))
    per_group: dict[str, int] = {}
    for g in rows:
        per_group[g.group_name] = per_group.get(g.group_name, 0) + g.charge
    return rows, per_group


def _populate(path: str, rows: list[GrantRow]) -> None:
    template = LocalStorage(path)
    storage = Storage(LocalContext(template))
    ensure_schema(storage)

    def body() -> None:
        store = SqlStore(storage)
        ledger = Ledger(Snapshot(meta=store.meta()))
        for g in rows:
            ledger.put_grant(g)
        store.persist(ledger.changes())

    storage.transaction(body)
    template.close()


def _open(kind: str, template_path: str, tmp: str, tag: str) -> LocalStorage:
    """A fresh copy of the template database (file in ``tmp`` or ``:memory:``)."""
    path = ":memory:" if kind == "memory" else os.path.join(tmp, f"holder-{tag}.sqlite")
    if path != ":memory:" and os.path.exists(path):
        os.remove(path)
    storage = LocalStorage(path)
    src = sqlite3.connect(template_path)
    src.backup(storage.connection)
    src.close()
    return storage


# ------------------------------------------------------------------------------ clients
class SimClient:
    """A requesting client: keeps the grants its replies show, reports them cumulatively."""

    def __init__(self, index: int) -> None:
        self.client_id = f"client-{index}"
        self.groups = sorted({GROUPS[(index * 7) % len(GROUPS)], GROUPS[(index * 13 + 1) % len(GROUPS)]})
        if index % 10 == 0:
            self.groups = sorted({LIMITED_GROUP, *self.groups})[:2]
        self.oldest_at = START - 60_000 + index
        # grant_id -> [permits, claimed, released, rounds running]
        # (staggered ages, so every round sees releases and admissions, not waves)
        self.held: dict[str, list[int]] = {
            f"own-{index}-{k}": [2, 1, 0, (index + k) % 3] for k in range(OWN_GRANTS)
        }
        self.admitted = 0
        self.blocked = 0
        self.age = index % 2  # new grants run 2 or 3 rounds before release, by client

    def message(self) -> dict[str, Any]:
        reports = []
        for gid, st in self.held.items():
            permits, claimed, released, running = st
            if claimed < permits:
                st[1] = permits  # claim what it got (R15a: confirmed by the reply)
            elif running >= 2 and released < claimed:
                st[2] = claimed  # work done: release
            st[3] += 1
            reports.append({"grantId": gid, "claimed": st[1], "released": st[2]})
        return {
            "type": "request", "v": 1, "clientId": self.client_id,
            "demand": [{"group": g, "count": 3, "oldestAt": self.oldest_at} for g in self.groups],
            "grants": reports,
        }

    def take(self, reply: dict[str, Any]) -> None:
        if "error" in reply:
            raise RuntimeError(f"{self.client_id}: {reply['error']}")
        seen = set()
        for g in reply["grants"]:
            gid = g["grantId"]
            seen.add(gid)
            if g["status"] != "active" or g["released"] >= g["permits"]:
                self.held.pop(gid, None)
            elif gid not in self.held:
                self.held[gid] = [g["permits"], g["claimed"], g["released"], self.age]
                self.admitted += g["permits"]
        for gid in [x for x in self.held if x not in seen]:
            self.held.pop(gid)  # settled and deleted by the holder
        self.blocked += sum(b["waiting"] for b in reply["blocked"])


# ------------------------------------------------------------------------------ one config
class Config:
    def __init__(self, kind: str, clients: int, live: int, rounds: int) -> None:
        self.kind, self.clients, self.live, self.rounds = kind, clients, live, rounds


async def _run_config(cfg: Config, template: str, per_group: dict[str, int], total_charge: int,
                      tmp: str, *, plans: bool = False, profile: cProfile.Profile | None = None
                      ) -> dict[str, Any]:
    local = _open(cfg.kind, template, tmp, f"{cfg.clients}x{cfg.live}")
    ctx = LocalContext(local)
    clock = VirtualClock(START)
    sched = DurabilityScheduler(ctx, clock=clock)
    ids = (f"g{n:08d}" for n in itertools.count())
    sem = DurabilitySemaphore(
        scheduler=sched,
        limit=total_charge + cfg.clients,                        # ~1 permit of room per client
        group_limit={LIMITED_GROUP: per_group.get(LIMITED_GROUP, 0) + 3},
        round_wait_ms=1000, round_period_ms=ROUND_PERIOD_MS,
        clock=clock, id_factory=lambda: next(ids),
        free_at_once=False,  # every round batched: the cost of one round over all the clients
    )
    AlarmDriver(clock, local, sched.alarm)

    timings: list[float] = []
    cpu: list[float] = []
    statements: list[int] = []
    vm_steps: list[int] = []
    counting = {"on": False, "steps": 0}
    original = sem._run_round

    async def timed_round(batch: Any, *args: Any) -> None:
        s0 = local.statements
        gc.collect()  # collect the previous round's garbage outside the measurement
        if profile is not None:
            profile.enable()
        c0, t0 = time.process_time(), time.perf_counter()
        await original(batch, *args)
        timings.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
        if profile is not None:
            profile.disable()
        statements.append(local.statements - s0)

    sem._run_round = timed_round  # type: ignore[method-assign]

    def step() -> int:
        counting["steps"] += 1
        return 0

    sims = [SimClient(i) for i in range(cfg.clients)]
    traced: list[str] = []
    total_rounds = cfg.rounds + 2  # warm-up round, then measured rounds, then one counted round
    for r in range(total_rounds):
        last = r == total_rounds - 1
        if last:
            local.connection.set_progress_handler(step, 100)
            if plans:
                local.connection.set_trace_callback(traced.append)
        tasks = [asyncio.ensure_future(sem.handle(c.message())) for c in sims]
        await clock.settle()
        assert sem._round_at is not None
        await clock.advance_to(sem._round_at)
        replies = await asyncio.gather(*tasks)
        for c, reply in zip(sims, replies):
            c.take(reply)
        if last:
            local.connection.set_progress_handler(None, 0)
            local.connection.set_trace_callback(None)
            vm_steps.append(counting["steps"] * 100)
    measured = timings[1:-1]
    live_now = local.connection.execute("SELECT COUNT(*) FROM durability_semaphore_grants").fetchone()[0]
    result = {
        "ms": statistics.median(measured),
        "ms_min": min(measured),
        "cpu": statistics.median(cpu[1:-1]),
        "statements": statistics.median(statements[1:-1]),
        "vm_steps": vm_steps[-1],
        "admitted": sum(c.admitted for c in sims) / total_rounds,
        "blocked": sum(c.blocked for c in sims) / total_rounds,
        "live_after": live_now,
    }
    if plans:
        result["plans"] = _plans(local.connection, traced)
    local.close()
    return result


def _normalise(sql: str) -> str:
    sql = re.sub(r"'[^']*'", "?", sql)
    sql = re.sub(r"\b\d+\b", "?", sql)
    sql = re.sub(r"\((\?\s*,\s*)+\?\)", "(?)", sql)
    sql = re.sub(r"(\(\?\)\s*,\s*)+\(\?\)", "(?)", sql)
    return re.sub(r"\s+", " ", sql).strip()


def _plans(conn: sqlite3.Connection, traced: list[str]) -> list[tuple[str, int, list[str]]]:
    """EXPLAIN QUERY PLAN of each distinct statement shape of a round (reads and deletes)."""
    shapes: dict[str, tuple[str, int]] = {}
    for sql in traced:
        head = sql.lstrip().split(None, 1)[0].upper()
        if head not in ("SELECT", "DELETE", "UPDATE", "INSERT"):
            continue
        key = _normalise(sql)
        first, count = shapes.get(key, (sql, 0))
        shapes[key] = (first, count + 1)
    out = []
    for key, (sql, count) in shapes.items():
        try:
            rows = conn.execute("EXPLAIN QUERY PLAN " + sql).fetchall()
        except sqlite3.Error as exc:
            rows = [(0, 0, 0, f"(no plan: {exc})")]
        out.append((key, count, [r[3] for r in rows]))
    return out


def _calibrate() -> float:
    """Best of 20 runs of a small pure-Python workload, in microseconds: a yardstick that lets a
    reader compare this machine's table with another machine's."""
    data = list(range(2000))
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        {(i, i) for i in data}
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


# ------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller run (1k/10k grants, 10/100 clients)")
    ap.add_argument("--storage", choices=["file", "memory", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=None, help="measured rounds per config")
    ap.add_argument("--no-plans", action="store_true", help="skip the EXPLAIN QUERY PLAN listing")
    ap.add_argument("--only", metavar="CLIENTSxGRANTS", help="run one config, e.g. 1000x10000")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the measured rounds (use with --only) and print the top entries")
    args = ap.parse_args()

    if args.only:
        clients_s, live_s = args.only.lower().split("x")
        client_counts, live_counts = [int(clients_s)], [int(live_s)]
        kinds = ["file", "memory"] if args.storage == "both" else [args.storage]
    elif args.quick:
        client_counts, live_counts = [10, 100], [1_000, 10_000]
        kinds = ["memory"] if args.storage == "both" else [args.storage]
    else:
        client_counts, live_counts = [10, 100, 1_000], [1_000, 10_000, 100_000]
        kinds = ["file", "memory"] if args.storage == "both" else [args.storage]
    rounds = args.rounds or (3 if args.quick else 7)

    started = time.perf_counter()
    print(f"CPython {sys.version.split()[0]}, SQLite {sqlite3.sqlite_version}, {os.cpu_count()} CPUs; "
          f"{rounds} measured rounds per row (median), after one warm-up round")
    print(f"machine speed reference: {_calibrate():.0f} us for {{(i, i) for i in range(2000)}}"
          " (to compare machines)\n")
    results: dict[tuple[str, int, int], dict[str, Any]] = {}
    plans: list[tuple[str, int, list[str]]] | None = None
    profile = cProfile.Profile() if args.profile else None
    with tempfile.TemporaryDirectory(prefix="bench-rounds-") as tmp:
        for live in live_counts:
            for clients in client_counts:
                rows, per_group = _population(live, clients, seed=live * 7 + clients)
                total_charge = sum(per_group.values())
                template = os.path.join(tmp, f"template-{clients}x{live}.sqlite")
                _populate(template, rows)
                del rows  # keep the bench's own objects out of the rounds' garbage collections
                gc.collect()
                for kind in kinds:
                    want_plans = (not args.no_plans and plans is None and kind == kinds[-1]
                                  and live == live_counts[-1] and clients == client_counts[-1])
                    res = asyncio.run(_run_config(Config(kind, clients, live, rounds), template,
                                                  per_group, total_charge, tmp, plans=want_plans,
                                                  profile=profile))
                    if want_plans:
                        plans = res.pop("plans")
                    results[(kind, clients, live)] = res
                    print(f"  {kind:6} {clients:5} clients x {live:7,} grants: {res['ms']:7.2f} ms "
                          f"({res['statements']:.0f} statements)", flush=True)
                os.remove(template)

    print()
    header = (f"{'storage':7} {'clients':>7} {'live grants':>11} {'ms/round':>9} {'min ms':>7} "
              f"{'CPU ms':>7} {'SQL stmts':>9} {'VM steps':>9} {'admitted':>8} {'blocked':>8}")
    print(header)
    print("-" * len(header))
    for (kind, clients, live), res in results.items():
        print(f"{kind:7} {clients:>7,} {live:>11,} {res['ms']:>9.2f} {res['ms_min']:>7.2f} "
              f"{res['cpu']:>7.2f} {res['statements']:>9.0f} {res['vm_steps']:>9,} "
              f"{res['admitted']:>8.0f} {res['blocked']:>8.0f}")
    print("ms/round: wall time of the round, median (min ms: fastest round); CPU ms: process CPU time,\n"
          "median (less disturbed by other load on the machine); SQL stmts: statements per round;\n"
          "VM steps: SQLite VM instructions in one round (a proxy for rows read: flat if nothing scans);\n"
          "admitted/blocked: permits per round over all clients")

    if len(live_counts) >= 2:
        hi, lo = live_counts[-1], live_counts[-2]
        print(f"\nratio {hi // 1000}k/{lo // 1000}k grants (ms per round):")
        for kind in kinds:
            for clients in client_counts:
                a, b = results[(kind, clients, hi)], results[(kind, clients, lo)]
                ratio = a["ms"] / b["ms"]
                steps = a["vm_steps"] / max(1, b["vm_steps"])
                mark = "ok" if ratio <= TARGET_RATIO else "MISSED"
                print(f"  {kind:6} {clients:>5,} clients: {ratio:5.2f}  (VM steps {steps:4.2f})  "
                      f"target <= {TARGET_RATIO}: {mark}")
    for kind in kinds:
        key = (kind, 1_000, 10_000)
        if key in results:
            ms = results[key]["ms"]
            mark = "ok" if ms <= TARGET_MS else "MISSED"
            print(f"target 1,000 clients x 10k grants <= {TARGET_MS:.0f} ms ({kind}): {ms:.2f} ms {mark}")

    if plans:
        print(f"\nQuery plans of one round ({client_counts[-1]:,} clients x {live_counts[-1]:,} grants;"
              " statement shape, times run in the round, plan):")
        for sql, count, plan in plans:
            short = sql if len(sql) <= 150 else sql[:147] + "..."
            print(f"  [{count:3}x] {short}")
            for line in plan:
                print(f"          {line}")

    if profile is not None:
        print()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    print(f"\ntotal run time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
