"""Tier 3: reusable leases (issue 13; SPEC R28a, R30a, R34a) in the real workerd.

The reference Worker with ``LEASES`` set to strict, reusable, lease-first leases: one JobQueue
gets its share as one reusable lease from one round, then runs every further job of its queue
by drawing a released slot again, locally, with no message to the holder (the holder's tally
of ``permits`` messages comes from ``GET /accounts/{account}/ping``). Meanwhile the holder's
usage never shows more charged than the limit, and once the queue has nothing queued and
nothing running its lease is stopped and settled: nothing stays charged. What only the real
runtime can decide here: the ``reusable`` column in Durable Object SQL, the reply's
``"reusable": true`` crossing the real RPC, and the JobQueue's draws in Pyodide.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from semaphore.testing.workerd import WorkerdProcess

from .test_app import APP_SECRETS, App, by_state, wait_for

pytestmark = pytest.mark.workerd

ACCOUNT = "reuse-acct"
QUEUE = "qa"
LIMIT = 2
JOBS = [f"j{i}" for i in range(8)]
REUSED = 4  # completions measured while jobs are still queued (then the lease keeps its slots)
VARS = {
    "ACCOUNT_CONCURRENCY": str(LIMIT),
    "ROUND_WAIT_MS": "100",
    "ROUND_PERIOD_MS": "500",
    "LEASES": json.dumps({"provisioning": {"mode": "strict"}, "permitsPerLease": LIMIT, "ttlMs": 60_000,
                          "reusable": True, "leaseFirst": True}),
}


@pytest.fixture
def reuse_app(workerd_factory: Callable[..., WorkerdProcess]) -> Iterator[App]:
    proc = workerd_factory(vars_override=VARS, secrets=APP_SECRETS)
    yield App(proc)
    print(f"--- workerd output ---\n{proc.logs[-30000:]}")


def messages(app: App) -> dict[str, int]:
    return app.ok("GET", f"/accounts/{ACCOUNT}/ping")["instance"]["messages"]


def quiet_messages(app: App, quiet_s: float = 4 * int(VARS["ROUND_PERIOD_MS"]) / 1000) -> dict[str, int]:
    """The holder's message tally once it stayed the same for ``quiet_s`` (four round periods);
    a message landing late (a loaded machine) starts the wait again, up to wait_for's bound."""
    last: dict[str, int] = {}

    def unchanged() -> dict[str, int] | None:
        nonlocal last
        now = messages(app)
        if now == last:
            return now
        last = now
        time.sleep(quiet_s)
        return None

    return wait_for(unchanged, f"no holder message for {quiet_s:.1f} s")


def jobs_now(app: App) -> dict[str, dict[str, Any]]:
    jobs = app.jobs(ACCOUNT, QUEUE)
    assert len(by_state(jobs, "running")) <= LIMIT, jobs
    usage = app.usage(ACCOUNT)
    assert usage["charged"] <= LIMIT, usage  # I1: strict leases never overshoot
    return jobs


def test_a_reusable_lease_runs_job_after_job_with_no_holder_call(reuse_app: App) -> None:
    app = reuse_app
    for job_id in JOBS:
        app.enqueue(ACCOUNT, QUEUE, job_id)

    def two_running() -> dict[str, dict[str, Any]] | None:
        jobs = jobs_now(app)
        return jobs if len(by_state(jobs, "running")) == LIMIT else None

    jobs = wait_for(two_running, "the first two jobs running")
    running = sorted(by_state(jobs, "running"))
    assert all(jobs[j]["permit"]["kind"] == "lease" for j in running), jobs
    # Jobs arrive one HTTP call at a time, so a round may see a need of 1 and issue a lease of
    # 1 (R28a: at most the need), the next round another: one or two leases, 2 slots in all.
    leases = {jobs[j]["permit"]["id"] for j in running}
    usage = app.usage(ACCOUNT)
    assert usage["leaseFootprint"] == LIMIT and usage["outstanding"] == 0, usage
    before = quiet_messages(app)  # the admission's own messages (request, any follow-up) landed

    # Complete running jobs one at a time: each freed slot is drawn again by the next job
    # (R34a), under the same lease, and no message reaches the holder for it.
    done: list[str] = []
    for _ in range(REUSED):
        current = sorted(by_state(jobs_now(app), "running"))
        finished = current[0]
        app.complete(ACCOUNT, finished)
        done.append(finished)

        def next_started(current: list[str] = current) -> dict[str, dict[str, Any]] | None:
            jobs = jobs_now(app)
            started = set(by_state(jobs, "running")) - set(current)
            return jobs if started else None

        jobs = wait_for(next_started, f"a queued job started after {finished} completed", timeout=10)
        new = set(by_state(jobs, "running")) - set(current)
        assert all(jobs[j]["permit"]["kind"] == "lease" and jobs[j]["permit"]["id"] in leases for j in new), jobs
        # While the lease is live its footprint is every slot, whatever was released (R30a).
        assert app.usage(ACCOUNT)["leaseFootprint"] == LIMIT
    after = messages(app)
    assert after == before, (before, after)  # no request, no sync: the slots were reused locally
    assert len(by_state(jobs_now(app), "queued")) == len(JOBS) - LIMIT - REUSED

    # Drain: the last jobs complete, the lease is stopped (idle) and settled: nothing charged.
    while True:
        jobs = jobs_now(app)
        if all(j["state"] == "done" for j in jobs.values()):
            break
        for job_id in sorted(by_state(jobs, "running")):
            app.complete(ACCOUNT, job_id)
        time.sleep(0.2)
    wait_for(lambda: app.usage(ACCOUNT)["charged"] == 0 and app.usage(ACCOUNT)["liveLeases"] == 0,
             "the idle lease stopped and settled")
    jobs = jobs_now(app)
    assert all(j["state"] == "done" for j in jobs.values()), jobs
