#!/usr/bin/env python3
"""A chaos run on the real runtime: the reference Worker in workerd, killed with SIGKILL again and
again under load, then checked from what it stored.

Starts the pinned ``workerd`` on the project's ``wrangler.toml`` (tier 3's harness,
``semaphore.testing.workerd``, with the development Pyodide bundle where ``../shared/devbundle``
exists, as ``scripts/devbundle.sh`` builds it) on a storage folder of its own. One account
(``chaos``) under one limit (``--limit``, the default ``ACCOUNT_CONCURRENCY`` 10) and
``--queues`` client objects (``JobQueue`` ``q0``, ``q1``, ...). It enqueues ``--jobs`` in-Worker
jobs (payload ``{"workMs": n}``, n drawn from ``--work-ms``): each is run by its JobQueue under
its permit and leaves a durable run record per attempt (start, end, permit; ``GET
.../queues/{queue}/runs``). Meanwhile it kills workerd with SIGKILL ``--kills`` times at random
moments (``--kill-after`` seconds after each start, drawn from the seeded RNG) and starts it
again on the same storage and port; the jobs are fed in step with the kills (before kill ``k``,
counted from 0, at most ``jobs * (k + 1) / (kills + 1)`` are enqueued), so the kills land in the
middle of the work, not after it. All
requests go to 127.0.0.1 from bounded loops (a few enqueuers, one poller), every loop retries
through the restarts, and the run stops by itself (``--timeout``).

Then, from what was stored, it checks:

* **lost**: a job acknowledged at enqueue that is not ``done``, or done without a completed run;
* **run twice**: a job with more than one completed run (a run whose end was written: the end
  is written in the step that completes the job, so the runtime commits them together), or
  with two runs at once, or runs under two permits. A run cut short by a kill has no end; the
  queue calls the job again under the same permit (SPEC R37): a **re-attempt**, counted apart;
  a re-attempt not preceded by a cut-short run and a kill is a violation;
* **above the limit**: the most runs at once over every client object, from the run intervals
  (start to end; a run with no end ends at the kill after its start, taken once the process
  was reaped; one with no end and no kill after it is a hung run, a violation);
* **charge**: the holder's ``usage()`` never shows more charged than the limit (polled during the
  run: the settings here never over-provision), returns to ``charged`` 0 (waited for, ``--settle``
  seconds at most) and ``holders()`` lists no one;
* **alarms**: no object is left with something due and no alarm, an alarm later than its
  earliest due time, or a due time long past (``GET /accounts/chaos/scheduler`` and each
  queue's ``.../runs``: the alarm and the scheduler's due times); no job queued, claiming or
  running, and no finished job left in a queue's outbox to the job directory.

Settings (``--setting``): ``defaults`` (wrangler.toml's vars: rounds of 100/1000 ms, no leases,
no waiting requests) and ``reuse-held``, the fastest named setting of the README's benchmarks
(strict reusable lease-first leases, ``ttlMs`` 60 s, waiting requests held 25 s, rounds of
250/500 ms; the Worker requires ``REQUEST_WAIT_MS`` below half the ``ttlMs``, so 25 s, not the
benchmark's 30). Both set ``ORPHAN_CHECK_MS`` to ``--orphan-check-ms`` (2 s): a job cut short by
a kill is called again within that of the restart, not 60 s later.

    scripts/chaos                                   # defaults: 1,000 jobs, 25 kills
    scripts/chaos --setting reuse-held
    scripts/chaos --jobs 40 --kills 3 --queues 4    # a short one (tier 3 runs about this)

Exit status 0 when every check passed and the run reached its kills and jobs, 1 on a violation,
a run that did not finish, or a workerd that cannot start; 2 for bad options.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_runtime import BenchError, Conn, devbundle_env  # noqa: E402

from semaphore.testing.workerd import WorkerdError, WorkerdProcess, generate_config, workerd_binary  # noqa: E402

ACCOUNT = "chaos"
LEASES_REUSE = {"provisioning": {"mode": "strict"}, "reusable": True, "leaseFirst": True, "ttlMs": 60_000}
SETTINGS: dict[str, dict[str, str]] = {
    "defaults": {},
    "reuse-held": {"LEASES": json.dumps(LEASES_REUSE), "HOLD_BLOCKED_MS": "25000", "REQUEST_WAIT_MS": "25000",
                   "ROUND_WAIT_MS": "250", "ROUND_PERIOD_MS": "500"},
}
#: The JobQueue's outbox timer (finished jobs not yet acknowledged by the job directory).
ANNOUNCE_TIMER = "app:announce_finished_jobs"
#: A due time this far in the past at the end means an alarm that did not fire (ms).
OVERDUE_MS = 30_000


class ChaosError(Exception):
    """The run could not be carried out (the message says why)."""


@dataclass
class Options:
    setting: str = "defaults"
    jobs: int = 1000
    kills: int = 25
    queues: int = 12
    limit: int = 10
    seed: int = 1
    work_ms: tuple[int, int] = (50, 200)
    kill_after: tuple[float, float] = (2.0, 8.0)
    orphan_check_ms: int = 2000
    enqueuers: int = 3
    timeout: float = 1500.0
    settle: float = 180.0
    keep: bool = False
    quiet: bool = False
    trace: bool = False


@dataclass
class Kill:
    at_ms: int  # just before the SIGKILL
    dead_ms: int  # once the process was reaped: every run it started began before this
    up_ms: int = 0  # listening again
    restart_s: float = 0.0


@dataclass
class Report:
    """What a run measured and found; :attr:`violations` empty means every check passed."""

    setting: str
    seed: int
    limit: int
    queues: int
    jobs: int = 0  # acknowledged at enqueue
    kills: list[Kill] = field(default_factory=list)
    wall_s: float = 0.0
    runs: int = 0
    completed_runs: int = 0
    cut_short: int = 0
    reattempts: int = 0
    jobs_reattempted: int = 0
    lost: list[str] = field(default_factory=list)
    twice: list[str] = field(default_factory=list)
    max_running: int = 0
    max_charged: int = 0  # the most the holder's usage showed charged, polled during the run
    final_usage: dict[str, Any] = field(default_factory=dict)
    holders_left: int = 0
    alarms: dict[str, Any] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    retries: Counter[str] = field(default_factory=Counter)
    permits: Counter[str] = field(default_factory=Counter)
    wait_ms: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def log(opts: Options, msg: str) -> None:
    if not opts.quiet:
        print(msg, flush=True)


def now_ms() -> int:
    return int(time.time() * 1000)


# ------------------------------------------------------------------------------ the run
class Chaos:
    def __init__(self, opts: Options, base: Path) -> None:
        self.opts = opts
        self.base = base
        self.rng = random.Random(opts.seed)
        self.token = secrets.token_hex(16)
        self.up = asyncio.Event()
        self.report = Report(opts.setting, opts.seed, opts.limit, opts.queues)
        self.proc: WorkerdProcess | None = None
        self.queue_names = [f"q{i}" for i in range(opts.queues)]
        # job id -> (queue, workMs), in enqueue order
        self.plan = [(f"j{i:05d}", self.queue_names[i % opts.queues], self.rng.randint(*opts.work_ms))
                     for i in range(opts.jobs)]
        self.kill_delays = [self.rng.uniform(*opts.kill_after) for _ in range(opts.kills)]
        self.acknowledged: dict[str, str] = {}  # job id -> queue
        self.enqueued_at: dict[str, int] = {}
        self.done: set[str] = set()
        self.stop = False
        self.deadline = 0.0

    # -- workerd ----------------------------------------------------------------------------
    def start(self) -> None:
        binary = workerd_binary()
        if binary is None or not binary.exists():
            raise ChaosError("no workerd binary: run scripts/setup or set SEMAPHORE_WORKERD")
        vars_override = {"ACCOUNT_CONCURRENCY": str(self.opts.limit),
                         "ORPHAN_CHECK_MS": str(self.opts.orphan_check_ms), **SETTINGS[self.opts.setting]}
        config = generate_config(ROOT / "wrangler.toml", self.base / "config", storage_dir=self.base / "storage",
                                 port=0, vars_override=vars_override, secrets={"ADMIN_TOKEN": self.token})
        self.proc = WorkerdProcess(config, binary=binary, log_dir=self.base / "logs")
        self._start_proc()

    def _start_proc(self) -> None:
        assert self.proc is not None
        try:
            self.proc.start()
        except WorkerdError as err:
            tail = "\n".join(err.output.strip().splitlines()[-15:])
            raise ChaosError(f"workerd could not start: {err}\n--- workerd output (tail) ---\n{tail}") from None

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    # -- HTTP through the kills -------------------------------------------------------------
    def conn(self) -> Conn:
        assert self.proc is not None and self.proc.port is not None
        return Conn(self.proc.address, self.proc.port, {"authorization": f"Bearer {self.token}",
                                                        "connection": "keep-alive"})

    async def call(self, conn: Conn, method: str, path: str, body: Any = None,
                   ok: tuple[int, ...] = (200,), what: str = "") -> Any:
        """``method path`` until it answers a status in ``ok``: through connection errors
        (workerd killed or restarting: wait until it is up) and 5xx answers (an object reset by
        the kill); fails on any other status, or at the run's deadline."""
        while True:
            if time.monotonic() > self.deadline:
                raise ChaosError(f"{method} {path}: the run's --timeout passed")
            await self.up.wait()
            try:
                status, data = await asyncio.wait_for(conn.call(method, path, body), 90)
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
                await conn.close()
                self.report.retries[what or type(exc).__name__] += 1
                await asyncio.sleep(0.2)
                continue
            if status in ok:
                return data
            if status >= 500:
                self.report.retries[f"{what or path}: {status}"] += 1
                await asyncio.sleep(0.2)
                continue
            raise ChaosError(f"{method} {path}: HTTP {status} {str(data)[:300]}")

    # -- load -------------------------------------------------------------------------------
    async def enqueuer(self, todo: asyncio.Queue[tuple[str, str, int]]) -> None:
        conn = self.conn()
        try:
            while not todo.empty():
                job_id, queue, ms = todo.get_nowait()
                # Fed in step with the kills: before kill k, at most jobs * (k + 1) / (kills + 1).
                while len(self.acknowledged) >= self.allowed() and not self.stop:
                    await asyncio.sleep(0.05)
                if self.stop:
                    return
                self.enqueued_at[job_id] = now_ms()
                body = {"id": job_id, "group": "default", "payload": {"workMs": ms}}
                await self.call(conn, "POST", f"/accounts/{ACCOUNT}/queues/{queue}/jobs", body, ok=(200, 201),
                                what="enqueue")
                self.acknowledged[job_id] = queue
        finally:
            await conn.close()

    def allowed(self) -> int:
        k = len(self.report.kills)
        if k >= self.opts.kills:
            return self.opts.jobs
        return max(1, self.opts.jobs * (k + 1) // (self.opts.kills + 1))

    async def poller(self) -> None:
        """Watch the queues (their public views) until every job is done."""
        conn = self.conn()
        try:
            while not self.stop:
                states: dict[str, Counter[str]] = {}
                for queue in self.queue_names:
                    data = await self.call(conn, "GET", f"/accounts/{ACCOUNT}/queues/{queue}", what="poll")
                    self.done.update(j["id"] for j in data["jobs"] if j["state"] == "done")
                    states[queue] = Counter(j["state"] for j in data["jobs"])
                usage = await self.call(conn, "GET", f"/accounts/{ACCOUNT}/usage", what="poll")
                self.report.max_charged = max(self.report.max_charged, int(usage.get("charged") or 0))
                if self.opts.trace:
                    await self.trace(conn, states, usage)
                if len(self.done) >= self.opts.jobs and len(self.acknowledged) >= self.opts.jobs:
                    return
                await asyncio.sleep(0.5)
        finally:
            await conn.close()

    async def trace(self, conn: Conn, states: dict[str, Counter[str]], usage: dict[str, Any]) -> None:
        """``--trace``: one line per poll: what each queue has queued/running and what the holder
        charges to whom (a grant as ``g<outstanding>``, a lease as ``L<permits>/<drawn>-<released>``)."""
        holders = await self.call(conn, "GET", f"/accounts/{ACCOUNT}/holders?limit=1000", what="poll")
        charged = []
        for h in holders.get("holders", []):
            parts = [f"g{g['permits'] - g['released']}" for g in h.get("grants", [])]
            parts += [f"L{x['permits']}/{x['drawn']}-{x['released']}{'s' if x.get('stopped') else ''}"
                      for x in h.get("leases", [])]
            charged.append(f"{h['clientId'][:4]}:{'+'.join(parts)}")
        queues = " ".join(f"{q}={c['queued']}/{c['running'] + c['claiming']}" for q, c in states.items()
                          if c["queued"] or c["running"] or c["claiming"])
        print(f"  {time.strftime('%H:%M:%S')} done {len(self.done)} charged {usage.get('charged')}"
              f" (leases {usage.get('leaseFootprint')}) | {queues} | {' '.join(charged)}", flush=True)

    async def killer(self) -> None:
        assert self.proc is not None
        for delay in self.kill_delays:
            await asyncio.sleep(delay)
            if self.stop:
                return
            self.up.clear()
            kill = Kill(at_ms=now_ms(), dead_ms=0)
            await asyncio.to_thread(self.proc.kill)
            kill.dead_ms = now_ms()
            t = time.perf_counter()
            await asyncio.to_thread(self._start_proc)
            kill.restart_s = time.perf_counter() - t
            kill.up_ms = now_ms()
            self.report.kills.append(kill)
            self.up.set()
            log(self.opts, f"  kill {len(self.report.kills)}/{self.opts.kills}: restarted in {kill.restart_s:.1f} s;"
                           f" {len(self.acknowledged)} enqueued, {len(self.done)} done")

    async def run(self) -> Report:
        opts = self.opts
        t0 = time.perf_counter()
        self.deadline = time.monotonic() + opts.timeout
        self.start()
        self.up.set()
        log(opts, f"chaos: setting {opts.setting!r}, seed {opts.seed}: {opts.jobs} jobs of {opts.work_ms[0]}-"
                  f"{opts.work_ms[1]} ms over {opts.queues} queues under a limit of {opts.limit},"
                  f" {opts.kills} kills; workerd started in {time.perf_counter() - t0:.1f} s")
        todo: asyncio.Queue[tuple[str, str, int]] = asyncio.Queue()
        for item in self.plan:
            todo.put_nowait(item)
        killer = asyncio.ensure_future(self.killer())
        loads = [asyncio.ensure_future(self.enqueuer(todo)) for _ in range(opts.enqueuers)]
        poller = asyncio.ensure_future(self.poller())
        try:
            await asyncio.gather(*loads, poller)
            await killer  # the kills were all taken before the last jobs were fed
        except BaseException:
            self.stop = True
            for task in (killer, poller, *loads):
                task.cancel()
            await asyncio.gather(killer, poller, *loads, return_exceptions=True)
            raise
        log(opts, f"  all {len(self.done)} jobs done after {time.perf_counter() - t0:.0f} s; settling")
        await self.check()
        self.report.wall_s = time.perf_counter() - t0
        return self.report

    # -- the checks -------------------------------------------------------------------------
    async def settle(self, conn: Conn) -> dict[str, Any]:
        """The holder's usage once nothing is charged any more (released permits reported,
        leases stopped and settled), or the last one read after ``--settle`` seconds."""
        until = time.monotonic() + self.opts.settle
        while True:
            usage = await self.call(conn, "GET", f"/accounts/{ACCOUNT}/usage", what="usage")
            if (usage.get("charged"), usage.get("liveLeases", 0)) == (0, 0) or time.monotonic() > until:
                return usage
            await asyncio.sleep(1.0)

    async def check(self) -> None:
        rep, opts = self.report, self.opts
        conn = self.conn()
        try:
            rep.final_usage = await self.settle(conn)
            holders = await self.call(conn, "GET", f"/accounts/{ACCOUNT}/holders?limit=1000", what="holders")
            jobs: dict[str, dict[str, Any]] = {}
            runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
            views: dict[str, dict[str, Any]] = {}
            for queue in self.queue_names:
                data = await self.call(conn, "GET", f"/accounts/{ACCOUNT}/queues/{queue}", what="status")
                for job in data["jobs"]:
                    if job["id"] in jobs:
                        rep.violations.append(f"job {job['id']} listed in two queues")
                    jobs[job["id"]] = {**job, "queue": queue}
                data = await self.call(conn, "GET", f"/accounts/{ACCOUNT}/queues/{queue}/runs", what="runs")
                for r in data["runs"]:
                    runs[r["jobId"]].append({**r, "queue": queue})
                views[f"queue {queue}"] = data["scheduler"]
            views["holder"] = await self.call(conn, "GET", f"/accounts/{ACCOUNT}/scheduler", what="scheduler")
        finally:
            await conn.close()
        rep.jobs = len(self.acknowledged)
        rep.holders_left = len(holders.get("holders", []))
        self.check_jobs(jobs, runs)
        self.check_concurrency(runs)
        self.check_alarms(views, jobs)
        usage = rep.final_usage
        if usage.get("charged") != 0 or usage.get("outstanding") != 0 or usage.get("leaseFootprint", 0) != 0:
            rep.violations.append(f"the holder's charge did not return to 0 within {opts.settle:.0f} s: {usage}")
        if rep.max_charged > rep.limit:
            rep.violations.append(f"the holder's usage showed {rep.max_charged} charged under a limit of {rep.limit}")
        if rep.alarms.get("due", {}).get(ANNOUNCE_TIMER):
            rep.violations.append(f"{rep.alarms['due'][ANNOUNCE_TIMER]} queue(s) still have finished jobs to announce"
                                  " to the job directory")
        if rep.holders_left:
            rep.violations.append(f"holders() still lists {rep.holders_left} client(s): {holders['holders'][:3]}")
        if len(rep.kills) < opts.kills:
            rep.violations.append(f"only {len(rep.kills)} of {opts.kills} kills were made")

    def check_jobs(self, jobs: dict[str, dict[str, Any]], runs: dict[str, list[dict[str, Any]]]) -> None:
        rep = self.report
        invented = set(jobs) - set(self.acknowledged)
        if invented:
            rep.violations.append(f"{len(invented)} job(s) nobody enqueued: {sorted(invented)[:5]}")
        for job_id, queue in self.acknowledged.items():
            job = jobs.get(job_id)
            mine = sorted(runs.get(job_id, []), key=lambda r: r["attempt"])
            rep.runs += len(mine)
            completed = [r for r in mine if r["endedAt"] is not None]
            cut = [r for r in mine if r["endedAt"] is None]
            rep.completed_runs += len(completed)
            rep.cut_short += len(cut)
            if job is None or job["state"] != "done" or not completed:
                rep.lost.append(job_id)
                continue
            if job["queue"] != queue:
                rep.violations.append(f"job {job_id} is in queue {job['queue']}, enqueued in {queue}")
            if len(completed) > 1:
                rep.twice.append(job_id)
            if len({r["permit"] for r in mine}) > 1:
                rep.twice.append(job_id)
                rep.violations.append(f"job {job_id} ran under two permits: {mine}")
            if mine:
                rep.permits[mine[0]["permit"].split(":", 1)[0]] += 1
                rep.wait_ms.append(mine[0]["startedAt"] - self.enqueued_at.get(job_id, mine[0]["startedAt"]))
            if len(mine) > 1:
                rep.jobs_reattempted += 1
                rep.reattempts += len(mine) - 1
            # Every attempt but the last was cut short, by a kill between it and the next one;
            # the runs of a job never overlap.
            for earlier, later in zip(mine, mine[1:]):
                if earlier["endedAt"] is not None:
                    rep.twice.append(job_id)
                    rep.violations.append(f"job {job_id}: attempt {later['attempt']} after a completed run: {mine}")
                elif not any(earlier["startedAt"] <= k.dead_ms and k.at_ms <= later["startedAt"]
                             for k in rep.kills):
                    rep.violations.append(f"job {job_id}: attempt {later['attempt']} with no kill since attempt"
                                          f" {earlier['attempt']} began: {mine}")
        if rep.lost:
            rep.violations.append(f"{len(rep.lost)} job(s) lost (not done with a completed run): {rep.lost[:10]}")
        rep.twice = sorted(set(rep.twice))
        if rep.twice:
            rep.violations.append(f"{len(rep.twice)} job(s) run twice: {rep.twice[:10]}")

    def run_end(self, run: dict[str, Any]) -> int | None:
        """A run's end: its ``endedAt``, or for a run cut short the death of the process after its
        start; ``None`` when no kill came after it (a hung run)."""
        if run["endedAt"] is not None:
            return int(run["endedAt"])
        return next((k.dead_ms for k in self.report.kills if k.dead_ms >= run["startedAt"]), None)

    def check_concurrency(self, runs: dict[str, list[dict[str, Any]]]) -> None:
        rep = self.report
        events: list[tuple[int, int]] = []
        for job_id, mine in runs.items():
            for r in mine:
                end = self.run_end(r)
                if end is None:
                    rep.violations.append(f"job {job_id} attempt {r['attempt']}: a run with no end and no kill"
                                          f" after its start (hung): {r}")
                    continue
                events += [(int(r["startedAt"]), 1), (end, -1)]
        running = 0
        for _, step in sorted(events):  # at the same ms an end (-1) sorts before a start
            running += step
            rep.max_running = max(rep.max_running, running)
        if rep.max_running > rep.limit:
            rep.violations.append(f"{rep.max_running} jobs ran at once under a limit of {rep.limit}")

    def check_alarms(self, views: dict[str, dict[str, Any]], jobs: dict[str, dict[str, Any]]) -> None:
        rep = self.report
        states = Counter(j["state"] for j in jobs.values())
        left = {s: n for s, n in states.items() if s != "done"}
        if left:
            rep.violations.append(f"jobs left not done: {left}")
        stuck: list[str] = []
        due_names: Counter[str] = Counter()
        for name, view in views.items():
            alarm, due, now = view["alarm"], view["due"], view["now"]
            due_names.update(due.keys())
            if due and alarm is None:
                stuck.append(f"{name}: {due} due and no alarm")
            elif due and alarm > min(due.values()):
                stuck.append(f"{name}: alarm {alarm} after its earliest due time {min(due.values())} ({due})")
            overdue = {n: t for n, t in due.items() if t < now - OVERDUE_MS}
            if overdue:
                stuck.append(f"{name}: due {overdue} more than {OVERDUE_MS // 1000} s ago (now {now})")
        rep.alarms = {"objects": len(views), "with_alarm": sum(1 for v in views.values() if v["alarm"] is not None),
                      "due": dict(due_names), "stuck": stuck}
        rep.violations += stuck


# ------------------------------------------------------------------------------ report
def render(rep: Report, opts: Options) -> str:
    restarts = [k.restart_s for k in rep.kills]
    down = [(k.up_ms - k.at_ms) / 1000 for k in rep.kills]
    usage = rep.final_usage
    waits = sorted(rep.wait_ms)

    def pct(q: float) -> str:
        return "-" if not waits else f"{waits[min(len(waits) - 1, int(q * len(waits)))] / 1000:.1f} s"

    kills = str(len(rep.kills))
    if rep.kills:
        kills += (f"; restart {statistics.median(restarts):.1f} s median, down {statistics.median(down):.1f} s"
                  f" median, {sum(down):.0f} s in all")
    by_kind = ", ".join(f"{n} by {k}" for k, n in rep.permits.items())
    rows = [
        ("setting", f"{rep.setting} (vars {SETTINGS[rep.setting] or 'of wrangler.toml'};"
                    f" ORPHAN_CHECK_MS {opts.orphan_check_ms})"),
        ("seed", str(rep.seed)),
        ("client objects (queues) / limit", f"{rep.queues} / {rep.limit}"),
        ("kills (SIGKILL, restart on the same storage)", kills),
        ("jobs (acknowledged at enqueue)", f"{rep.jobs:,} ({by_kind})"),
        ("wall time", f"{rep.wall_s:.0f} s"),
        ("runs / completed / cut short by a kill", f"{rep.runs:,} / {rep.completed_runs:,} / {rep.cut_short:,}"),
        ("re-attempts after kills (jobs)", f"{rep.reattempts} ({rep.jobs_reattempted} jobs)"),
        ("lost", str(len(rep.lost))),
        ("run twice (completed twice, overlapping, or two permits)", str(len(rep.twice))),
        ("most running at once / limit", f"{rep.max_running} / {rep.limit} (most charged seen in usage polls:"
                                         f" {rep.max_charged})"),
        ("holder's charge at the end", f"charged {usage.get('charged')}, outstanding {usage.get('outstanding')},"
                                       f" lease footprint {usage.get('leaseFootprint')}; holders left"
                                       f" {rep.holders_left}"),
        ("alarms at the end", f"{rep.alarms.get('with_alarm')} of {rep.alarms.get('objects')} objects armed,"
                              f" due: {rep.alarms.get('due') or 'nothing'}; stuck: {len(rep.alarms.get('stuck', []))}"),
        ("wait from enqueue to first start p50 / p95", f"{pct(0.5)} / {pct(0.95)}"),
        ("requests retried through kills", f"{sum(rep.retries.values()):,}"),
    ]
    width = max(len(k) for k, _ in rows)
    out = [f"{k.ljust(width)}  {v}" for k, v in rows]
    out.append("")
    out.append("PASS: every check held" if rep.ok else "FAIL:\n  " + "\n  ".join(rep.violations))
    return "\n".join(out)


# ------------------------------------------------------------------------------ main
def run_chaos(opts: Options) -> Report:
    """One chaos run (workerd started and stopped here; its files removed unless ``keep``)."""
    (ROOT / ".tmp").mkdir(exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="chaos-", dir=ROOT / ".tmp"))
    chaos = Chaos(opts, base)
    try:
        devbundle_env()
        return asyncio.run(chaos.run())
    except BenchError as exc:
        raise ChaosError(str(exc)) from None
    finally:
        chaos.close()
        if opts.keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)


def pair(kind: type, text: str) -> tuple[Any, Any]:
    lo, _, hi = text.partition(",")
    a, b = kind(lo), kind(hi or lo)
    if a > b or a <= 0:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 0 < LO <= HI, got {text!r}")
    return a, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Options()
    ap.add_argument("--setting", choices=sorted(SETTINGS), default=d.setting)
    ap.add_argument("--jobs", type=int, default=d.jobs, help=f"jobs to run (default {d.jobs})")
    ap.add_argument("--kills", type=int, default=d.kills, help=f"SIGKILLs of workerd (default {d.kills})")
    ap.add_argument("--queues", type=int, default=d.queues, help=f"client objects (default {d.queues})")
    ap.add_argument("--limit", type=int, default=d.limit, help=f"the account's limit (default {d.limit})")
    ap.add_argument("--seed", type=int, default=d.seed, help="the RNG seed: job lengths, kill moments")
    ap.add_argument("--work-ms", type=lambda t: pair(int, t), default=d.work_ms, metavar="LO,HI",
                    help="job length range, ms (default 50,200)")
    ap.add_argument("--kill-after", type=lambda t: pair(float, t), default=d.kill_after, metavar="LO,HI",
                    help="seconds from a start to the next kill (default 2,8)")
    ap.add_argument("--orphan-check-ms", type=int, default=d.orphan_check_ms,
                    help="the Worker's ORPHAN_CHECK_MS (default 2000)")
    ap.add_argument("--timeout", type=float, default=d.timeout, help="stop after this many seconds (default 1500)")
    ap.add_argument("--settle", type=float, default=d.settle,
                    help="seconds to wait for the charge to return to 0 (default 180)")
    ap.add_argument("--keep", action="store_true", help="keep workerd's config, logs and storage (printed)")
    ap.add_argument("--trace", action="store_true",
                    help="print each poll: queued/running per queue, what the holder charges to whom")
    args = ap.parse_args()
    for name in ("jobs", "kills", "queues", "limit", "orphan_check_ms"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    opts = Options(setting=args.setting, jobs=args.jobs, kills=args.kills, queues=args.queues, limit=args.limit,
                   seed=args.seed, work_ms=args.work_ms, kill_after=args.kill_after,
                   orphan_check_ms=args.orphan_check_ms, timeout=args.timeout, settle=args.settle, keep=args.keep,
                   trace=args.trace)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks stop workerd
    load = os.getloadavg()
    print(f"chaos: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    try:
        rep = run_chaos(opts)
    except ChaosError as exc:
        print(f"chaos: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("chaos: interrupted", file=sys.stderr)
        return 1
    print()
    print(render(rep, opts))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
