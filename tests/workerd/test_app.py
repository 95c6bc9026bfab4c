"""Tier 3: the reference app (src/entry.py) in the real workerd, driven over HTTP.

Everything runs through the real runtime: the Default front, real RPC between the JobQueue client
objects and the AccountLimit holder, the real SQLite storage on disk, real alarms, and real
process deaths (graceful stop and ``kill -9``) on the same storage directory.

The worker is configured by wrangler.toml, with only these changes passed through the harness:
short timings (``APP_VARS``) so the tests are fast, and the ``ADMIN_TOKEN`` secret.

Where workerd cannot get the Pyodide bundle, the ``workerd_factory`` fixture skips every test
that needs the runtime with workerd's own error; ``test_app_config_*`` needs no bundle and runs
everywhere.

How running jobs are counted soundly from several HTTP samples: only this test completes jobs,
so between two of its own completions no job leaves ``running``. A sample taken without
completing anything in between therefore never over-counts (a job counted in an earlier queue is
still running when a later queue is read), and the holder's ``charged``, read after the
queues, charges at least every job counted as running (a confirmed claim or a lease slot stays
charged until its release is reported, R18, R30a; the app runs the holder's default leases).
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from semaphore.core import json_text
from semaphore.testing.workerd import WorkerdProcess, generate_config, validate_config

pytestmark = pytest.mark.workerd

TOKEN = "tier3-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
LIMIT = 3
GRANT_TIMEOUT_MS = 1500
ROUND_PERIOD_MS = 100
APP_VARS = {  # text, as in wrangler.toml's [vars]
    "ACCOUNT_CONCURRENCY": str(LIMIT),
    "GRANT_TIMEOUT_MS": str(GRANT_TIMEOUT_MS),
    "ROUND_WAIT_MS": "50",
    "ROUND_PERIOD_MS": str(ROUND_PERIOD_MS),
}
APP_SECRETS = {"ADMIN_TOKEN": TOKEN}
STATES = {"queued", "claiming", "running", "done"}
DEADLINE_S = 30.0  # any single "eventually" in these tests
POLL_S = 0.03
HOLD_S = 3 * ROUND_PERIOD_MS / 1000  # keep the budget full for a few rounds before freeing it


def now_ms() -> int:
    return int(time.time() * 1000)


class App:
    """HTTP client of the reference app served by one :class:`WorkerdProcess` (thread-safe)."""

    def __init__(self, proc: WorkerdProcess, token: str = TOKEN) -> None:
        self.proc = proc
        self.auth = {"authorization": f"Bearer {token}"}

    def call(self, method: str, path: str, body: Any = None, *, auth: bool = True,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:
        hdrs = dict(self.auth if auth else {})
        hdrs.update(headers or {})
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            hdrs["content-type"] = "application/json"
        status, raw = self.proc.request(path, method=method, body=data, headers=hdrs)
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            raise AssertionError(f"{method} {path}: {status}, not JSON: {raw[:2000]!r}") from None

    def ok(self, method: str, path: str, body: Any = None, expect: Iterable[int] = (200,)) -> Any:
        status, data = self.call(method, path, body)
        assert status in tuple(expect), f"{method} {path} -> {status} {data}"
        return data

    def enqueue(self, account: str, queue: str, job_id: str, payload: Any = None) -> dict[str, Any]:
        body = {"id": job_id, "group": "default", "payload": payload}
        return self.ok("POST", f"/accounts/{account}/queues/{queue}/jobs", body, expect=(200, 201))

    def complete(self, account: str, job_id: str) -> dict[str, Any]:
        return self.ok("POST", f"/accounts/{account}/jobs/{job_id}/complete")

    def jobs(self, account: str, queue: str) -> dict[str, dict[str, Any]]:
        data = self.ok("GET", f"/accounts/{account}/queues/{queue}")
        assert data["account"] == account and data["queue"] == queue, data
        return {job["id"]: job for job in data["jobs"]}

    def all_jobs(self, account: str, queues: Iterable[str]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for queue in queues:
            for job_id, job in self.jobs(account, queue).items():
                assert job_id not in out, f"job {job_id} listed in two queues"
                assert job["state"] in STATES, job
                out[job_id] = {**job, "queue": queue}
        return out

    def usage(self, account: str) -> dict[str, Any]:
        return self.ok("GET", f"/accounts/{account}/usage")

    def permits(self, account: str, message: dict[str, Any]) -> dict[str, Any]:
        return self.ok("POST", f"/accounts/{account}/permits", message)


def by_state(jobs: dict[str, dict[str, Any]], state: str) -> dict[str, dict[str, Any]]:
    return {job_id: job for job_id, job in jobs.items() if job["state"] == state}


def wait_for(probe: Callable[[], Any], what: str, timeout: float = DEADLINE_S) -> Any:
    """Call ``probe`` every POLL_S until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(POLL_S)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last probe: {last!r}")


def sample(app: App, account: str, queues: Iterable[str], limit: int) -> tuple[dict, dict]:
    """All jobs, then usage; asserts the budget at this sample (see the module docstring)."""
    jobs = app.all_jobs(account, queues)
    usage = app.usage(account)
    running = len(by_state(jobs, "running"))
    assert running <= limit, f"{running} jobs running over limit {limit}: {jobs}"  # I1, R21
    assert usage["limit"] == limit, usage
    assert usage["charged"] <= limit, f"holder charges over its limit: {usage}"  # I1
    # Every running job holds a confirmed claim or a lease slot (the default leases), charged
    # until its release (R15a, R18, R30a).
    assert usage["charged"] >= running, f"{running} running, holder charges {usage}"
    return jobs, usage


def drain(app: App, account: str, queues: list[str], expected: set[str], limit: int,
          completed: set[str] | None = None) -> dict[str, Any]:
    """Sample until every job of ``expected`` ran and was completed by us, asserting the limit at
    every sample. Running jobs are completed once as many are running as can (``limit``, or all
    jobs not yet completed) and they stayed so for HOLD_S, so waiting demand sits against a full
    budget for a few rounds each time. Returns counters; ``completed`` is updated in place."""
    completed = set() if completed is None else completed
    deadline = time.monotonic() + DEADLINE_S + 6 * len(expected)
    full_since: float | None = None
    peak = samples = 0
    while True:
        jobs, _usage = sample(app, account, queues, limit)
        samples += 1
        running = by_state(jobs, "running")
        peak = max(peak, len(running))
        for job_id in completed:
            assert jobs[job_id]["state"] == "done", (job_id, jobs[job_id])
        if completed >= expected:
            break
        assert not set(running) & completed, "a completed job is running again"
        target = min(limit, len(expected - completed))
        if len(running) >= target:
            full_since = full_since or time.monotonic()
            if time.monotonic() - full_since >= HOLD_S:
                for job_id in running:
                    reply = app.complete(account, job_id)
                    assert reply["changed"] is True, reply  # each job completes exactly once
                    assert reply["job"]["state"] == "done", reply
                    completed.add(job_id)
                full_since = None
        else:
            full_since = None
        assert time.monotonic() < deadline, (
            f"jobs did not all run: {len(completed)}/{len(expected)} completed; {jobs}")
        time.sleep(POLL_S)
    assert set(jobs) == expected, "jobs appeared or vanished"
    for job in jobs.values():
        assert job["state"] == "done" and job["startedAt"] and job["finishedAt"], job
        assert job["startedAt"] <= job["finishedAt"], job
    return {"peak": peak, "samples": samples, "jobs": jobs}


def wait_released(app: App, account: str, charged: int = 0) -> dict[str, Any]:
    """Releases (and lease stops) reach the holder with the queues' next sync: wait for the
    holder's ``charged`` (grants outstanding plus lease footprint)."""
    return wait_for(lambda: (u := app.usage(account))["charged"] == charged and u,
                    f"usage charged == {charged} in {account}")


@pytest.fixture
def app(workerd_factory: Callable[..., WorkerdProcess]):
    proc = workerd_factory(vars_override=APP_VARS, secrets=APP_SECRETS)
    yield App(proc)
    # Shown by pytest only when the test failed.
    print(f"--- workerd output ({proc.runs} run(s)) ---\n{proc.logs[-30000:]}")


# --------------------------------------------------------------------- no bundle needed


def test_app_config_carries_overrides_and_secret(workerd_bin, project_wrangler_toml, tmp_path):
    """The config the ``app`` fixture runs: wrangler.toml with APP_VARS replacing its [vars] and
    ADMIN_TOKEN as a text binding, each binding once; workerd accepts its schema."""
    import tomllib

    config = generate_config(project_wrangler_toml, tmp_path / "cfg", storage_dir=tmp_path / "s",
                             vars_override=APP_VARS, secrets=APP_SECRETS)
    text = config.read_text()
    wrangler_vars = tomllib.loads(project_wrangler_toml.read_text()).get("vars", {})
    assert set(APP_VARS) <= set(wrangler_vars), "override only what wrangler.toml declares"
    for name, value in {**wrangler_vars, **APP_VARS, **APP_SECRETS}.items():
        assert text.count(f'(name = "{name}", ') == 1, name
        assert f'(name = "{name}", text = {json.dumps(value)})' in text, (name, value)
    for name, value in wrangler_vars.items():
        if name in APP_VARS and APP_VARS[name] != value:
            assert f'(name = "{name}", text = {json.dumps(value)})' not in text
    assert '(name = "ACCOUNT_LIMIT", durableObjectNamespace = (className = "AccountLimit"))' in text
    assert '(name = "JOB_QUEUE", durableObjectNamespace = (className = "JobQueue"))' in text
    validate_config(config, binary=workerd_bin)  # workerd compile --config-only


# --------------------------------------------------------------------- in workerd


def test_admission_through_rpc_between_objects(app):
    """Jobs of one queue are admitted up to the limit through JobQueue -> AccountLimit RPC;
    completing one admits the next."""
    acct, queue = "acme", "q"
    ids = [f"j{i}" for i in range(1, 6)]
    for i, job_id in enumerate(ids):
        reply = app.enqueue(acct, queue, job_id, payload={"n": i})
        assert reply["created"] is True and reply["job"]["id"] == job_id, reply
        assert reply["job"]["payload"] == {"n": i}, reply
    again = app.enqueue(acct, queue, "j1", payload={"n": "other"})  # idempotent on id (R37)
    assert again["created"] is False and again["job"]["payload"] == {"n": 0}, again

    def three_running():
        jobs, usage = sample(app, acct, [queue], LIMIT)
        return len(by_state(jobs, "running")) == LIMIT and (jobs, usage)

    jobs, _ = wait_for(three_running, f"{LIMIT} jobs running")  # R9, R15a, R21
    running = by_state(jobs, "running")
    for job in running.values():
        assert job["permit"]["kind"] == "lease" and job["permit"]["id"], job  # the default leases
        assert job["startedAt"] and job["finishedAt"] is None, job
    assert set(by_state(jobs, "queued")) == set(ids) - set(running), jobs
    # Demand waits against a full budget: several rounds later nothing more was admitted.
    end = time.monotonic() + 5 * ROUND_PERIOD_MS / 1000
    while time.monotonic() < end:
        jobs, usage = sample(app, acct, [queue], LIMIT)
        assert by_state(jobs, "running").keys() == running.keys(), jobs
        time.sleep(POLL_S)
    assert usage["charged"] == LIMIT and usage["groups"]["default"]["charged"] == LIMIT

    first = sorted(running)[0]
    reply = app.complete(acct, first)
    assert reply["changed"] is True and reply["job"]["state"] == "done", reply
    assert reply["job"]["finishedAt"], reply
    queued_before = set(ids) - set(running)

    def replaced():
        jobs, _ = sample(app, acct, [queue], LIMIT)
        now_running = by_state(jobs, "running")
        return len(now_running) == LIMIT and jobs

    jobs = wait_for(replaced, "another job admitted after a completion")  # R17, R21
    newly = set(by_state(jobs, "running")) - set(running)
    assert len(newly) == 1 and newly <= queued_before, jobs
    assert jobs[first]["state"] == "done", jobs[first]
    assert len(by_state(jobs, "queued")) == 1, jobs
    assert app.complete(acct, first)["changed"] is False  # idempotent completion
    wait_released(app, acct, LIMIT)


def test_limit_never_exceeded_with_racing_queues(app):
    """4 queues x 5 jobs enqueued concurrently under one account: at every sample the running
    jobs and the holder's charged permits stay within the limit, until every job ran once."""
    acct = "race"
    queues = [f"q{n}" for n in range(4)]
    expected = {f"{q}-j{i}" for q in queues for i in range(5)}

    def enqueue_all(queue: str) -> list[bool]:
        return [app.enqueue(acct, queue, f"{queue}-j{i}")["created"] for i in range(5)]

    with ThreadPoolExecutor(max_workers=len(queues)) as pool:
        futures = [pool.submit(enqueue_all, q) for q in queues]
        stats = drain(app, acct, queues, expected, LIMIT)  # samples while enqueues race
        assert all(all(f.result()) for f in futures)
    assert stats["peak"] == LIMIT, stats["peak"]  # the budget was really contended
    usage = wait_released(app, acct, 0)
    assert usage["groups"].get("default", {}).get("charged", 0) == 0, usage


def test_unclaimed_grants_are_reclaimed_by_the_alarm(app):
    """A grant nobody claims is reclaimed at claimBy by the holder's alarm alone (no further
    permit message; GET /usage only reads)."""
    acct = "reclaim"
    sent = now_ms()
    reply = app.permits(acct, {
        "type": "request", "v": 1, "clientId": "fake-client",
        "demand": [{"group": "default", "count": 5, "oldestAt": sent}], "grants": [],
    })
    assert "error" not in reply, reply
    assert len(reply["grants"]) == 1, reply
    grant = reply["grants"][0]
    assert grant["group"] == "default" and grant["permits"] == LIMIT, grant  # R21
    assert grant["claimed"] == 0 and grant["released"] == 0 and grant["status"] == "active"
    assert reply["blocked"] == [{"group": "default", "reason": "limit", "waiting": 5 - LIMIT}]
    assert reply["contended"] is True, reply  # R29
    claim_by = grant["claimBy"]
    assert sent - 5 <= claim_by - GRANT_TIMEOUT_MS <= now_ms() + 5, (sent, grant)  # R15

    # Poll /usage (a read: usage() never reclaims) until the alarm has reclaimed the grant.
    reclaimed_seen_at = None
    held_samples = 0
    deadline = claim_by / 1000 + DEADLINE_S
    while time.time() < deadline:
        usage = app.usage(acct)
        answered = now_ms()
        if usage["outstanding"] == 0:
            reclaimed_seen_at = answered
            break
        assert usage["outstanding"] == LIMIT, usage
        held_samples += answered < claim_by
        time.sleep(0.1)
    assert reclaimed_seen_at is not None, f"not reclaimed {DEADLINE_S}s after claimBy: {usage}"
    assert held_samples > 0, "no sample before claimBy: the machine is too slow for this test"
    assert reclaimed_seen_at >= claim_by, "reclaimed before its claimBy"  # R15, R16
    assert usage["groups"].get("default", {}).get("outstanding", 0) == 0, usage

    # A late claim is refused: the grant had nothing claimed, so reclaim deleted it (R15).
    late = app.permits(acct, {"type": "sync", "v": 1, "clientId": "fake-client",
                              "grants": [{"grantId": grant["grantId"], "claimed": 1,
                                          "released": 0}]})
    [state] = [g for g in late["grants"] if g["grantId"] == grant["grantId"]]
    assert state["status"] == "not_found", late
    assert app.usage(acct)["outstanding"] == 0
    # The capacity is really back: a job is admitted up to the full limit.
    for i in range(LIMIT):
        app.enqueue(acct, "q", f"after-{i}")
    wait_for(lambda: len(by_state(sample(app, acct, ["q"], LIMIT)[0], "running")) == LIMIT,
             "jobs admitted into the reclaimed capacity")


@pytest.fixture
def grant_app(workerd_factory: Callable[..., WorkerdProcess]):
    """The app without leases (``LEASES=off``): every permit a grant."""
    proc = workerd_factory(vars_override={**APP_VARS, "LEASES": "off"}, secrets=APP_SECRETS)
    yield App(proc)
    print(f"--- workerd output ({proc.runs} run(s)) ---\n{proc.logs[-30000:]}")


def test_rows_survive_a_graceful_restart(grant_app):
    """Jobs, their states and permits, the limit override and usage are all in SQLite: a workerd
    stopped with SIGTERM and started on the same storage serves them unchanged, and the override
    keeps governing admission. Without leases: the test compares two snapshots of a quiet
    state, and with the default leases the clients' room checks (2, 4, 8, ... s into a
    contention) keep the holder's lease rows moving, as R31b retires leases above a share."""
    app = grant_app
    acct, queues = "durable", ["alpha", "beta"]
    limit = 2
    assert app.ok("PUT", f"/accounts/{acct}/limit", {"limit": limit}) == {
        "limit": limit, "override": limit, "defaultLimit": LIMIT}
    expected = {"a1", "a2", "a3", "a4", "b1"}
    for job_id in sorted(expected):
        app.enqueue(acct, "alpha" if job_id[0] == "a" else "beta", job_id, payload={"id": job_id})
    jobs = wait_for(lambda: len(by_state(j := sample(app, acct, queues, limit)[0], "running"))
                    == limit and j, f"{limit} running under the override")  # R24
    first = sorted(by_state(jobs, "running"))[0]
    assert app.complete(acct, first)["changed"] is True
    completed = {first}
    wait_for(lambda: len(by_state(sample(app, acct, queues, limit)[0], "running")) == limit,
             "a replacement admitted")

    def snapshot() -> tuple[dict, dict]:
        jobs, usage = sample(app, acct, queues, limit)
        # A queued job's blocked reason carries the time of the latest round's reply, which
        # moves with every round: compare the reason, not its time.
        for job in jobs.values():
            if job.get("blocked"):
                job["blocked"] = {k: v for k, v in job["blocked"].items() if k != "at"}
        return jobs, usage

    def quiet():  # two identical snapshots a few rounds apart, releases reported
        a = snapshot()
        time.sleep(3 * ROUND_PERIOD_MS / 1000)
        b = snapshot()
        return a == b and b[1]["charged"] == limit and b

    before_jobs, before_usage = wait_for(quiet, "a quiescent state")
    assert Counter(j["state"] for j in before_jobs.values()) == {
        "running": 2, "queued": 2, "done": 1}, before_jobs

    app.proc.restart()  # SIGTERM, same storage dir and port
    assert app.proc.runs == 2

    after_jobs, after_usage = snapshot()
    assert after_jobs == before_jobs  # ids, states, permits, payloads, timestamps
    assert after_usage == before_usage
    assert after_usage["limit"] == limit and after_usage["limitOverride"] == limit
    assert after_usage["defaultLimit"] == LIMIT and after_usage["charged"] == limit

    stats = drain(app, acct, queues, expected, limit, completed)  # the override still rules
    assert stats["peak"] == limit
    usage = wait_released(app, acct, 0)
    assert usage["limit"] == limit and usage["limitOverride"] == limit


def test_sigkill_mid_rounds_loses_nothing_and_over_admits_nothing(app):
    """kill -9 while jobs are being admitted (a release just sent, rounds running), restart on
    the same storage: every job is still there in a consistent state, what we saw running keeps
    its permit, what we completed stays done, and the limit holds until every job ran once."""
    acct = "crash"
    queues = ["k0", "k1", "k2"]
    expected = {f"{q}-j{i}" for q in queues for i in range(4)}
    for job_id in sorted(expected):
        app.enqueue(acct, job_id.split("-")[0], job_id)
    rng = random.Random(20261117)
    completed: set[str] = set()

    for cycle in range(2):  # two full admission cycles; the kill comes during the third
        def full():
            jobs, _ = sample(app, acct, queues, LIMIT)
            return len(by_state(jobs, "running")) == LIMIT and jobs

        jobs = wait_for(full, f"cycle {cycle}: {LIMIT} running")
        for job_id in by_state(jobs, "running"):
            assert app.complete(acct, job_id)["changed"] is True
            completed.add(job_id)
    # Releases are on their way and the next round is being asked for: look once more at some
    # point in there (what is running now must survive), then die right away.
    time.sleep(rng.uniform(0, 3 * ROUND_PERIOD_MS) / 1000)
    jobs, _ = sample(app, acct, queues, LIMIT)
    seen_running = by_state(jobs, "running")
    in_flight = Counter(job["state"] for job in jobs.values())
    app.proc.restart(hard=True)  # SIGKILL, then start on the same storage dir and port
    assert app.proc.runs == 2
    print(f"killed with {in_flight} ({len(completed)} completed)")

    jobs, usage = sample(app, acct, queues, LIMIT)  # running <= limit right after restart
    assert set(jobs) == expected, f"jobs lost or invented: {sorted(set(jobs) ^ expected)}"
    for job_id in completed:  # acknowledged completions are durable
        assert jobs[job_id]["state"] == "done", jobs[job_id]
    for job_id, seen in seen_running.items():
        # Once seen running (the answer left workerd only after its write was durable), a job
        # never goes back to the queue nor runs under a second permit (R15a, R18).
        assert jobs[job_id]["state"] == "running", (seen, jobs[job_id])
        assert jobs[job_id]["permit"] == seen["permit"], (seen, jobs[job_id])
    for job in jobs.values():
        if job["state"] in ("running", "done"):
            assert job["startedAt"] and job["permit"], job
        if job["state"] == "queued":
            assert job["permit"] is None and not job["startedAt"], job

    stats = drain(app, acct, queues, expected, LIMIT, completed)
    assert stats["samples"] > 0
    wait_released(app, acct, 0)  # every permit returned: nothing leaked by the crash


def test_state_changes_need_the_admin_token(app):
    """Without the right bearer token every state-changing route answers 401 and changes
    nothing; reads stay open."""
    acct, queue = "guarded", "q"
    app.enqueue(acct, queue, "x1")
    wait_for(lambda: by_state(app.jobs(acct, queue), "running"), "x1 running")
    wait_released(app, acct, 1)
    before = (app.jobs(acct, queue), app.jobs(acct, "other"), app.usage(acct))

    bad_headers = [{}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN},
                   {"authorization": f"Basic {TOKEN}"}, {"authorization": f"Bearer {TOKEN}x"},
                   {"authorization": "Bearer "}]
    attempts = [
        ("PUT", f"/accounts/{acct}/limit", {"limit": 0}),
        ("POST", f"/accounts/{acct}/queues/{queue}/jobs", {"id": "x2"}),
        ("POST", f"/accounts/{acct}/queues/other/jobs", {"id": "y1"}),
        ("POST", f"/accounts/{acct}/jobs/x1/complete", None),
        ("POST", f"/accounts/{acct}/permits",
         {"type": "request", "v": 1, "clientId": "intruder",
          "demand": [{"group": "default", "count": 1, "oldestAt": now_ms()}], "grants": []}),
    ]
    for headers in bad_headers:
        for method, path, body in attempts:
            status, data = app.call(method, path, body, auth=False, headers=headers)
            assert status == 401, (method, path, headers, status, data)
            assert data["error"]["code"] == "unauthorized", data

    time.sleep(3 * ROUND_PERIOD_MS / 1000)  # a round would have run by now had one been asked
    after = (app.jobs(acct, queue), app.jobs(acct, "other"), app.usage(acct))
    assert after == before
    assert after[1] == {} and after[2]["limitOverride"] is None and after[2]["charged"] == 1
    # The right token still works (so the 401s above were about the token).
    assert app.complete(acct, "x1")["changed"] is True


def test_without_admin_token_state_changes_are_disabled(workerd_factory):
    """No ADMIN_TOKEN secret: every state change is refused, even with an empty bearer."""
    proc = workerd_factory(vars_override=APP_VARS)
    app = App(proc)
    for headers in ({}, {"authorization": "Bearer "}, {"authorization": "Bearer None"}):
        status, data = app.call("PUT", "/accounts/a/limit", {"limit": 1}, auth=False,
                                headers=headers)
        assert status == 401 and "not configured" in data["error"]["message"], data
    assert app.usage("a")["limitOverride"] is None
    assert app.call("GET", "/healthz", auth=False) == (200, {"ok": True})


def test_reads_take_the_read_token_and_it_changes_nothing(workerd_factory):
    """The operator's reading routes take the secret READ_TOKEN (as ``.dev.vars`` sets it under
    wrangler dev) or the admin token; the read token is refused where state changes (403); with
    neither secret set, reads say which secret to set."""
    app = App(workerd_factory(vars_override=APP_VARS, secrets={**APP_SECRETS, "READ_TOKEN": "r3ad"}))
    reader = {"authorization": "Bearer r3ad"}
    for path in ("/accounts/a/holders", "/accounts/a/audit", "/accounts/a/scheduler"):
        assert app.call("GET", path, auth=False, headers=reader)[0] == 200, path
        assert app.call("GET", path)[0] == 200, path  # the admin token reads too
        status, data = app.call("GET", path, auth=False)
        assert status == 401 and "READ_TOKEN or ADMIN_TOKEN" in data["error"]["message"], data
    status, data = app.call("PUT", "/accounts/a/limit", {"limit": 1}, auth=False, headers=reader)
    assert status == 403 and data["error"]["code"] == "forbidden", data
    assert app.usage("a")["limitOverride"] is None
    bare = App(workerd_factory(vars_override=APP_VARS))
    status, data = bare.call("GET", "/accounts/a/holders", auth=False)
    assert status == 401 and "set the secret READ_TOKEN" in data["error"]["message"], data


def test_holders_show_each_queue_objects_name_as_its_label(app):
    """The operator's view on the real runtime: a JobQueue reached with
    ``JOB_QUEUE.getByName('["<account>", "<queue>"]')`` reads that name from ``ctx.id.name``
    (workerd sets it inside the object for named ids), sends it as its ``label``, and
    ``GET .../holders`` lists it beside the client's 64-hex object id; each queue has its own.
    After a restart of workerd the stored labels are still listed, and a queue object first
    started by the new process (its constructor is where the client reads the name) has its
    own too."""
    acct = "labels"
    app.enqueue(acct, "exports", "l1")
    app.enqueue(acct, "imports", "l2")
    wait_for(lambda: len(by_state(app.all_jobs(acct, ["exports", "imports"]), "running")) == 2, "both jobs running")
    page = app.ok("GET", f"/accounts/{acct}/holders")
    labels = {h["clientId"]: h["label"] for h in page["holders"]}
    assert sorted(labels.values()) == [json.dumps([acct, q]) for q in ("exports", "imports")], page
    assert all(len(i) == 64 and int(i, 16) >= 0 for i in labels), page  # ids stay the objects' hex ids
    app.proc.restart()
    app.enqueue(acct, "reports", "l3")
    wait_for(lambda: app.jobs(acct, "reports")["l3"]["state"] == "running", "l3 running after the restart")
    again = {h["clientId"]: h["label"] for h in app.ok("GET", f"/accounts/{acct}/holders")["holders"]}
    assert sorted(again.values()) == [json.dumps([acct, q]) for q in ("exports", "imports", "reports")], again
    assert {i: again[i] for i in labels} == labels, (again, labels)


def strict_json(raw: bytes) -> Any:
    """``raw`` as JSON proper: a bare ``NaN``/``Infinity`` (which ``json.loads`` reads) fails."""
    def refuse(name: str) -> Any:
        raise AssertionError(f"not JSON: {name} in {raw[:300]!r}")
    return json.loads(raw, parse_constant=refuse)


def test_bad_bodies_and_payloads_are_refused_and_leave_no_directory_entry(app):
    """Issue 21 (6, 7, 8) on the real runtime: a body nested too deeply, or holding NaN or
    Infinity, is a 400 on every route that reads one (before: a 500, the isolate's stack
    overflowing in json.loads, or NaN stored and written back bare); a payload over the size
    limit a 413 naming ``payload`` (before: SQLITE_TOOBIG as a 500, with the job's directory
    entry left, so the id was taken: 409 in any other queue), and a body over
    ``MAX_BODY_BYTES`` a 413 before it is parsed. Every answer is JSON proper."""
    acct = "bodies"
    routes = [("PUT", f"/accounts/{acct}/limit"), ("POST", f"/accounts/{acct}/queues/q/jobs"),
              ("POST", f"/accounts/{acct}/permits"), ("POST", f"/accounts/{acct}/holders/c/settle")]
    bodies = ["[" * 100_000 + "]" * 100_000, '{"id": "j1", "limit": NaN, "payload": [1e999], "reason": "x"}']
    for method, path in routes:
        for text in bodies:
            status, raw = app.proc.request(path, method=method, body=text.encode(),
                                           headers={**app.auth, "content-type": "application/json"})
            answer = strict_json(raw)
            assert status == 400 and answer["error"]["code"] == "invalid_json", (path, text[:40], answer)
    big = json.dumps({"id": "big", "payload": "x" * 1_900_000}).encode()
    status, raw = app.proc.request(f"/accounts/{acct}/queues/q/jobs", method="POST", body=big,
                                   headers={**app.auth, "content-type": "application/json"})
    answer = strict_json(raw)
    assert status == 413 and answer["error"]["field"] == "payload", answer
    # A body over MAX_BODY_BYTES (2,000,000, its Content-Length) is refused before it is parsed.
    huge = json.dumps({"id": "big", "payload": [0] * 1_000_000}).encode()
    status, raw = app.proc.request(f"/accounts/{acct}/queues/q/jobs", method="POST", body=huge,
                                   headers={**app.auth, "content-type": "application/json"})
    answer = strict_json(raw)
    assert status == 413 and answer["error"]["code"] == "payload_too_large", answer
    assert "2000000" in answer["error"]["message"] and "field" not in answer["error"], answer
    # Nothing was registered: the id is free for another queue, and the first queue has no job.
    assert app.enqueue(acct, "other", "big", {"ok": True})["created"] is True
    assert app.jobs(acct, "q") == {} and app.usage(acct)["limitOverride"] is None
    status, raw = app.proc.request(f"/accounts/{acct}/queues/other", headers=app.auth)
    assert status == 200 and strict_json(raw)["jobs"][0]["payload"] == {"ok": True}


def test_admin_token_whitespace_is_stripped_and_blank_is_not_configured(workerd_factory):
    """Issue 21 (9): an ADMIN_TOKEN of only whitespace counted as configured, and one with a
    stray newline could never be sent (the runtime trims header values). Blank now means not
    configured (401 "not configured"); a padded one is the token without its whitespace."""
    blank = App(workerd_factory(vars_override=APP_VARS, secrets={"ADMIN_TOKEN": " \n"}), token=" \n")
    for headers in ({}, {"authorization": "Bearer "}, {"authorization": "Bearer   "}):
        status, data = blank.call("PUT", "/accounts/a/limit", {"limit": 1}, auth=False, headers=headers)
        assert status == 401 and "not configured" in data["error"]["message"], (headers, data)
    padded = App(workerd_factory(vars_override=APP_VARS, secrets={"ADMIN_TOKEN": f"  {TOKEN}\n"}))
    assert padded.ok("PUT", "/accounts/a/limit", {"limit": 2})["limit"] == 2
    status, data = padded.call("PUT", "/accounts/a/limit", {"limit": 3}, auth=False,
                               headers={"authorization": f"Bearer {TOKEN}x"})
    assert status == 401, data


def test_a_permits_message_crosses_the_rpc_as_json_text_both_ways(app):
    """SPEC R7 "JSON text", on workerd's own RPC: ``POST .../permits`` sends the body to the holder
    as JSON text and answers the holder's text as it came. The body is the compact text the
    holder wrote (``json_text.encode``), not the front's own encoding of an object (which puts a
    space after each separator), and the holder tallied the text as the sync it holds."""
    acct = "as-text"
    before = app.ok("GET", f"/accounts/{acct}/ping")["instance"]["messages"]
    message = {"type": "sync", "v": 1, "clientId": "text-client", "grants": []}
    status, raw = app.proc.request(f"/accounts/{acct}/permits", method="POST", body=json.dumps(message).encode(),
                                   headers={**app.auth, "content-type": "application/json"})
    text = raw.decode() if isinstance(raw, bytes) else raw
    assert status == 200, text
    reply = json.loads(text)
    assert reply["v"] == 1 and reply["grants"] == [], reply
    assert text == json_text.encode(reply) and text != json.dumps(reply), text
    after = app.ok("GET", f"/accounts/{acct}/ping")["instance"]["messages"]
    assert after["sync"] == before["sync"] + 1 and after["other"] == before["other"], (before, after)
