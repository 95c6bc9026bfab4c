"""Tier 3, wider: behaviour of the reference Worker (src/entry.py) that only the real workerd
runtime can show. Every check drives the Worker over HTTP (the Default front, then real RPC into
the AccountLimit / JobQueue objects) unless it says otherwise.

* ``shared`` (module scope): one workerd process for the checks whose state does not interfere
  (each uses its own account names): two accounts kept apart, the error value of an invalid
  message over real RPC, and ``json_each``-bound id lists through rounds and syncs.
* ``test_holder_killed_between_grant_and_claim...``: its own process, restarted once with
  ``kill -9``: a grant issued before the kill is claimed after it, the holder's persisted alarm
  reclaims with no traffic at all, and a ``limit`` callable that raises (its stored override
  corrupted on disk while workerd is down) fails the round closed.
* ``test_store_sql_on_durable_object_sqlite_matches_cpython``: the direct check of the store's
  SQL (``json_each`` bindings, ``UPDATE ... FROM``, upserts, partial indexes) on the SQLite of a
  Durable Object: the library's holder runs on host CPython over a JavaScript Durable Object's
  ``ctx.storage.sql`` (the same storage API Python objects call), beside the CPython test bed.

* ``test_leases_through_the_worker...``: its own process with the ``LEASES`` var set (strict,
  2 permits per lease, 4 s TTL): JobQueues of two accounts draw jobs from leases, a lease in use
  outlives its TTL by heartbeats, a contended account gets a lease's idle permits back, and
  everything settles to zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import sqlite3
import textwrap
import threading
import time
import types
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from semaphore.testing.workerd import WorkerdError, WorkerdProcess, generate_config
from semaphore.testing.workerd._harness import _capnp_text

from .small_worker import started
from .test_app import DEADLINE_S, POLL_S, App, by_state, now_ms, wait_for

pytestmark = pytest.mark.workerd

TOKEN = "tier3-wide-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SECRETS = {"ADMIN_TOKEN": TOKEN}
DEFAULT_LIMIT = 3  # ACCOUNT_CONCURRENCY of every process here
SHARED_VARS = {
    "LEASES": "off",  # grants: these tests follow the grant protocol (claims, reclaims, batched rounds)
    "ACCOUNT_CONCURRENCY": str(DEFAULT_LIMIT),
    "GRANT_TIMEOUT_MS": "3000",
    # Long enough for requests sent together from threads to join one round (R9).
    "ROUND_WAIT_MS": "150",
    "FREE_AT_ONCE": "false",  # requests sent together share one batched round (R9), not R9a's at once
    "ROUND_PERIOD_MS": "150",
}
ROUND_S = 0.15
WORKER_NAME = "durability-semaphore"  # wrangler.toml name: uniqueKey <name>-<class>


class Front(App):
    """HTTP client of the reference Worker in one :class:`WorkerdProcess` (thread-safe)."""

    def __init__(self, proc: WorkerdProcess, storage: Path) -> None:
        super().__init__(proc, TOKEN)
        self.storage = storage

    def set_limit(self, account: str, limit: int | None) -> dict[str, Any]:
        return self.ok("PUT", f"/accounts/{account}/limit", {"limit": limit})

    def permits(self, account: str, message: Any, expect: int = 200) -> dict[str, Any]:
        return self.ok("POST", f"/accounts/{account}/permits", message, expect=(expect,))

    def enqueue(self, account: str, queue: str, job_id: str, group: str = "default",
                payload: Any = None) -> dict[str, Any]:
        return self.ok("POST", f"/accounts/{account}/queues/{queue}/jobs",
                       {"id": job_id, "group": group, "payload": payload}, expect=(200, 201))

    def object_files(self, class_name: str) -> set[str]:
        """Ids (hex) of the objects of ``class_name`` that have a SQLite file on disk."""
        folder = self.storage / f"{WORKER_NAME}-{class_name}"
        return {Path(f).name[:-len(".sqlite")] for f in glob.glob(f"{folder}/*.sqlite")
                if Path(f).name != "metadata.sqlite"}

    def new_object(self, class_name: str, touch: Callable[[], Any]) -> tuple[str, Any]:
        """Run ``touch`` (the first request reaching one new object of ``class_name``) and
        return that object's id, the name of the SQLite file it created, with what ``touch``
        returned. The id is also the object's ``str(ctx.id)``: the ``clientId`` a JobQueue
        reports (the SemaphoreClient default)."""
        before = self.object_files(class_name)
        result = touch()
        created = self.object_files(class_name) - before
        assert len(created) == 1, f"expected one new {class_name} file, got {created}"
        return created.pop(), result

    def db_path(self, class_name: str, object_id: str) -> Path:
        return self.storage / f"{WORKER_NAME}-{class_name}" / f"{object_id}.sqlite"


def request_msg(client: str, demand: dict[str, int] | None = None,
                grants: Iterable[tuple[str, int, int]] = (), oldest_at: int | None = None
                ) -> dict[str, Any]:
    at = now_ms() if oldest_at is None else oldest_at
    return {"type": "request", "v": 1, "clientId": client,
            "demand": [{"group": g, "count": c, "oldestAt": at} for g, c in (demand or {}).items()],
            "grants": [{"grantId": i, "claimed": c, "released": r} for i, c, r in grants]}


def sync_msg(client: str, grants: Iterable[tuple[str, int, int]] = ()) -> dict[str, Any]:
    return {"type": "sync", "v": 1, "clientId": client,
            "grants": [{"grantId": i, "claimed": c, "released": r} for i, c, r in grants]}


def together(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run the calls from threads released at the same instant (so requests join one round)."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def grants_by_id(reply: dict[str, Any]) -> dict[str, dict[str, Any]]:
    ids = [g["grantId"] for g in reply["grants"]]
    assert len(ids) == len(set(ids)), f"a grant listed twice: {reply}"
    return {g["grantId"]: g for g in reply["grants"]}


def start_process(workerd_runtime: dict[str, Any], workerd_bin: Path, toml: Path, base: Path,
                  vars_override: dict[str, str]) -> tuple[WorkerdProcess, Path]:
    if workerd_runtime["skip"]:
        pytest.skip(workerd_runtime["skip"])
    storage = base / "storage"
    config = generate_config(toml, base / "config", storage_dir=storage, port=0,
                             vars_override=vars_override, secrets=SECRETS)
    proc = WorkerdProcess(config, binary=workerd_bin, log_dir=base / "logs")
    try:
        proc.start()
    except WorkerdError as err:
        pytest.fail(f"{err}\n--- workerd output ---\n{err.output}", pytrace=False)
    return proc, storage


@contextlib.contextmanager
def front_of(workerd_runtime: dict[str, Any], workerd_bin: Path, toml: Path, base: Path,
             vars_override: dict[str, str]) -> Iterator[Front]:
    """A workerd process of its own for one test, as a :class:`Front`; its log tail is printed
    afterwards (shown by pytest when the test failed)."""
    proc, storage = start_process(workerd_runtime, workerd_bin, toml, base, vars_override)
    try:
        yield Front(proc, storage)
    finally:
        print(f"--- workerd output ({proc.runs} run(s)) ---\n{proc.logs[-30000:]}")
        proc.stop()


@pytest.fixture(scope="module")
def shared_process(workerd_runtime, workerd_bin, project_wrangler_toml, tmp_path_factory):
    proc, storage = start_process(workerd_runtime, workerd_bin, project_wrangler_toml,
                                  tmp_path_factory.mktemp("wide-shared"), SHARED_VARS)
    yield Front(proc, storage)
    proc.stop()


@pytest.fixture
def shared(shared_process: Front):
    """The shared worker; its log tail is printed (shown by pytest when the test failed)."""
    yield shared_process
    print(f"--- workerd output ---\n{shared_process.proc.logs[-20000:]}")


# ------------------------------------------------------------------------- two accounts


def test_two_accounts_keep_separate_budgets_directories_and_usage(shared: Front):
    """Accounts X (override limit 2) and Y (default 3) run JobQueues with the SAME queue name
    and the SAME job ids at the same time, each in its own group. At every sample each
    account's running jobs and charged permits stay within its own limit and its usage shows
    only its own group; both are saturated at once (5 running, more than either limit, so the
    budgets are really separate); completing X's jobs never touches Y's jobs of the same id;
    every job runs once and completes exactly once."""
    x, y = "iso-x", "iso-y"
    spec = {  # account -> (limit, group, {queue: job ids})
        x: (2, "gx", {"qa": ["j1", "j2", "j3"], "qb": ["k1", "k2"]}),
        y: (DEFAULT_LIMIT, "gy", {"qa": ["j1", "j2", "j3"], "qc": ["k1", "k2"]}),
    }
    assert shared.set_limit(x, 2) == {"limit": 2, "override": 2, "defaultLimit": DEFAULT_LIMIT}
    for acct, (_, group, queues) in spec.items():
        for queue, ids in queues.items():
            for job_id in ids:
                reply = shared.enqueue(acct, queue, job_id, group, {"account": acct, "queue": queue})
                assert reply["created"] is True, reply  # the same id in another account is new

    def sample() -> dict[str, dict[str, dict[str, Any]]]:
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for acct, (limit, group, queues) in spec.items():
            jobs: dict[str, dict[str, Any]] = {}
            for queue, ids in queues.items():
                listed = shared.jobs(acct, queue)
                assert set(listed) == set(ids), (acct, queue, listed)  # only this queue's jobs
                for job_id, job in listed.items():
                    assert job["payload"] == {"account": acct, "queue": queue}, job
                    assert job["group"] == group, job
                    jobs[job_id] = job
            usage = shared.usage(acct)
            running = len(by_state(jobs, "running"))
            assert usage["limit"] == limit, usage
            assert usage["limitOverride"] == (2 if acct == x else None), usage
            assert set(usage["groups"]) <= {group}, f"{acct} shows another account's group: {usage}"
            assert running <= limit, f"{acct}: {running} running over its limit {limit}: {jobs}"
            assert running <= usage["outstanding"] <= limit, (acct, running, usage)  # I1, R18
            out[acct] = jobs
        return out

    first = wait_for(lambda: (s := sample()) and all(
        len(by_state(s[a], "running")) == spec[a][0] for a in spec) and s,
        "both accounts saturated at once")
    # Several rounds later nothing more was admitted in either account.
    end = time.monotonic() + 4 * ROUND_S
    while time.monotonic() < end:
        now = sample()
        for acct in spec:
            assert by_state(now[acct], "running").keys() == by_state(first[acct], "running").keys()
        time.sleep(POLL_S)

    # Complete X's running jobs; Y's jobs of the same ids are untouched.
    y_before = sample()[y]
    for job_id in sorted(by_state(first[x], "running")):
        reply = shared.complete(x, job_id)
        assert reply["changed"] is True and reply["job"]["state"] == "done", reply
    y_after = sample()[y]
    for job_id, job in y_before.items():
        if job["state"] == "running":
            assert y_after[job_id] == job, (job_id, y_after[job_id])

    # Drain both: complete each account's running jobs once it is full (or has no more).
    completed: dict[str, set[str]] = {x: set(by_state(first[x], "running")), y: set()}
    deadline = time.monotonic() + DEADLINE_S
    while True:
        jobs = sample()
        for acct, (limit, _, queues) in spec.items():
            for job_id in completed[acct]:
                assert jobs[acct][job_id]["state"] == "done", (acct, jobs[acct][job_id])
        if all(len(completed[a]) == len(jobs[a]) for a in spec):
            break
        for acct, (limit, _, _) in spec.items():
            running = by_state(jobs[acct], "running")
            assert not set(running) & completed[acct], "a completed job runs again"
            if running and len(running) >= min(limit, len(jobs[acct]) - len(completed[acct])):
                for job_id in sorted(running):
                    reply = shared.complete(acct, job_id)
                    assert reply["changed"] is True, reply  # completes exactly once
                    completed[acct].add(job_id)
        assert time.monotonic() < deadline, f"jobs did not all run: {completed} {jobs}"
        time.sleep(POLL_S)
    for acct in spec:
        for job in jobs[acct].values():
            assert job["state"] == "done" and job["startedAt"] and job["finishedAt"], job
        assert shared.complete(acct, "j1")["changed"] is False  # idempotent, per account
    assert shared.usage(x)["limitOverride"] == 2 and shared.usage(y)["limitOverride"] is None


# ------------------------------------------------------------------------- invalid messages


def test_invalid_messages_come_back_as_error_values_and_change_nothing(shared: Front):
    """R7/I5 over real RPC: each invalid message reaches the holder through the admin route and
    its answer crosses the object boundary as the error VALUE {"v": 1, "error": {"code":
    "invalid_message", "field": <the offending field>, "message": ...}} (HTTP 400). Every one of
    them carries, besides its fault, a valid report claiming the client's grant and valid
    demand, so a partial application would show: usage and the client's grant are identical
    before and after. A valid control message then does change them."""
    acct, client = "inv", "c-inv"
    reply = shared.permits(acct, request_msg(client, {"default": 2}))
    [grant] = reply["grants"]
    assert grant["permits"] == 2 and grant["status"] == "active", reply
    gid = grant["grantId"]
    confirmed = shared.permits(acct, sync_msg(client, [(gid, 1, 0)]))
    assert grants_by_id(confirmed)[gid]["claimed"] == 1, confirmed

    def state() -> tuple[dict[str, Any], dict[str, Any]]:
        view = shared.permits(acct, sync_msg(client))  # no reports: a read of the grants (R8)
        return shared.usage(acct), {k: view[k] for k in ("grants", "leases", "blocked")}

    before = state()
    assert before[0]["outstanding"] == 2 and before[1]["grants"][0]["claimed"] == 1, before
    ok_report = {"grantId": gid, "claimed": 2, "released": 1}
    at = now_ms()

    def req(**changes: Any) -> dict[str, Any]:
        message = {"type": "request", "v": 1, "clientId": client,
                   "demand": [{"group": "default", "count": 1, "oldestAt": at}],
                   "grants": [ok_report]}
        message.update(changes)
        return {k: v for k, v in message.items() if v is not DROP}

    DROP = object()
    ok_demand = {"group": "default", "count": 1, "oldestAt": at}
    cases: list[tuple[dict[str, Any], str]] = [
        (req(demand=[ok_demand, {"group": "other", "count": -1, "oldestAt": at}]), "demand[1].count"),
        (req(demand=[ok_demand, {"group": "other", "count": 1.5, "oldestAt": at}]), "demand[1].count"),
        # Above 2**53 - 1: crosses RPC as a BigInt, must not arrive rounded into a valid count.
        (req(demand=[{"group": "default", "count": 2**53 + 1, "oldestAt": at}]), "demand[0].count"),
        (req(demand=[ok_demand, dict(ok_demand)]), "demand[1].group"),
        (req(demand=[{"group": "default", "count": 1}]), "demand[0].oldestAt"),
        (req(demand=[ok_demand] * 1001), "demand"),
        (req(grants=[ok_report, {"grantId": "zz", "claimed": 1, "released": 2}]), "grants[1].released"),
        (req(grants=[ok_report, dict(ok_report)]), "grants[1].grantId"),
        (req(grants=[{"grantId": gid, "claimed": True, "released": 0}]), "grants[0].claimed"),
        (req(grants=DROP), "grants"),
        (req(leases=[{"leaseId": "l1", "drawn": 1, "released": 0, "stopped": 1}]), "leases[0].stopped"),
        (req(v=2), "v"),
        (req(v=True), "v"),
        (req(type="grab"), "type"),
        (req(clientId=""), "clientId"),
        (req(clientId="c" * 257), "clientId"),
        ({"type": "sync", "v": 1, "clientId": client, "grants": [ok_report, {"grantId": ""}]},
         "grants[1].grantId"),
    ]
    for message, field in cases:
        status, body = shared.call("POST", f"/accounts/{acct}/permits", message)
        assert status == 400, (field, status, body)
        assert set(body) == {"v", "error"} and body["v"] == 1, (field, body)
        error = body["error"]
        assert set(error) == {"code", "field", "message"}, (field, body)
        assert error["code"] == "invalid_message" and error["field"] == field, (field, body)
        assert isinstance(error["message"], str) and error["message"], (field, body)
    time.sleep(2 * ROUND_S)  # a round would have run by now had any of them joined one
    assert state() == before, "an invalid message changed something"

    # Control: the same message without its fault is applied (so the cases above could have).
    control = grants_by_id(shared.permits(acct, req()))
    assert (control[gid]["claimed"], control[gid]["released"]) == (2, 1), control
    [fresh] = [g for i, g in control.items() if i != gid]  # its demand got a grant too
    assert fresh["permits"] == 1 and fresh["status"] == "active", control
    assert shared.usage(acct)["outstanding"] == 2, "the control message was not applied"


# ------------------------------------------------------------------------- json_each, via rounds


def test_rounds_and_syncs_bind_many_ids_as_one_json_value(shared: Front):
    """The store reads and writes a round's clients, reported grant ids, groups and rows as ONE
    json_each(?) binding each. Five clients whose ids and groups hold quotes, backslashes,
    brackets, commas, non-ASCII and astral characters request together (one round), then
    report on all their grants together (some fully released, some over-claimed, plus a foreign
    and an unknown id), then settle: every grant, status, clamp and per-group total must be
    exact, R14 foreign reports must not apply, and everything returns to zero."""
    acct = "json-ids"
    shared.set_limit(acct, 1000)
    clients = ['c"quote', "c\\back\\slash", "c-üñí-☃-😀", 'c [1,{"a":null}]', "c'apos,comma"]
    groups = ["g'apos", 'g"dq', "g😀", "g\\", "g [0]", "g ü"]
    want: dict[str, dict[str, int]] = {  # client -> {group: count}
        c: {groups[(i + k) % len(groups)]: 1 + i + 2 * k for k in range(3)} for i, c in enumerate(clients)}

    replies = together([lambda c=c: shared.permits(acct, request_msg(c, want[c])) for c in clients])
    issued: dict[str, dict[str, dict[str, Any]]] = {}  # client -> {group: grant}
    for c, reply in zip(clients, replies):
        assert reply["blocked"] == [] and reply["contended"] is False, (c, reply)
        by_group = {g["group"]: g for g in reply["grants"]}
        assert len(by_group) == len(reply["grants"]) == 3, (c, reply)
        for group, count in want[c].items():
            g = by_group[group]
            assert (g["permits"], g["claimed"], g["released"], g["status"]) == (count, 0, 0, "active"), g
        issued[c] = by_group
    claim_bys = {g["claimBy"] for c in clients for g in issued[c].values()}
    assert len(claim_bys) == 1, f"the requests did not share one round: {claim_bys}"
    usage = shared.usage(acct)
    expected = {g: sum(want[c].get(g, 0) for c in clients) for g in groups}
    assert {g: u["outstanding"] for g, u in usage["groups"].items()} == expected, usage
    assert usage["outstanding"] == sum(expected.values()), usage

    # Reports: per client, in its groups' order: k=0 fully released, k=1 over-claimed (clamped,
    # R13) with one release, k=2 one claim; plus the next client's k=2 grant (foreign, R14) as
    # fully released, and an id nobody issued.
    def plan(c: str) -> list[tuple[str, int, int]]:
        gs = [issued[c][g] for g in want[c]]
        return [(gs[0]["grantId"], gs[0]["permits"], gs[0]["permits"]),
                (gs[1]["grantId"], gs[1]["permits"] + 7, 1),
                (gs[2]["grantId"], 1, 0)]

    foreign = {c: list(issued[clients[(i + 1) % len(clients)]].values())[2] for i, c in enumerate(clients)}
    reports = {c: plan(c) + [(foreign[c]["grantId"], foreign[c]["permits"], foreign[c]["permits"]),
                             (f"never-issued-{i}", 1, 0)]
               for i, c in enumerate(clients)}
    replies = together([lambda c=c: shared.permits(acct, request_msg(c, {}, reports[c])) for c in clients])
    remaining = {g: 0 for g in groups}
    for c, reply in zip(clients, replies):
        states = grants_by_id(reply)
        own = [issued[c][g] for g in want[c]]
        assert set(states) == {r[0] for r in reports[c]}, (c, reply)  # R8: nothing else is active
        exp = [(own[0]["permits"], own[0]["permits"], own[0]["permits"]),
               (own[1]["permits"], own[1]["permits"], 1),
               (own[2]["permits"], 1, 0)]
        for g, (permits, claimed, released) in zip(own, exp):
            s = states[g["grantId"]]
            assert (s["group"], s["permits"], s["claimed"], s["released"], s["status"]) == (
                g["group"], permits, claimed, released, "active"), (c, s)
            remaining[g["group"]] += permits - released
        for gid in (foreign[c]["grantId"], reports[c][-1][0]):
            assert states[gid] == {"grantId": gid, "group": None, "permits": 0, "claimed": 0,
                                   "released": 0, "claimBy": None, "status": "not_found"}, (c, states[gid])
        assert reply["blocked"] == [], reply
    usage = shared.usage(acct)
    assert {g: u["outstanding"] for g, u in usage["groups"].items()} == {
        g: n for g, n in remaining.items() if n}, usage  # emptied groups are gone
    assert usage["outstanding"] == sum(remaining.values()), usage

    # One sync carrying every id of one client: the fully released grant was deleted (R17).
    c0 = clients[0]
    view = grants_by_id(shared.permits(acct, sync_msg(c0, [(r[0], r[1], r[2]) for r in plan(c0)])))
    assert view[plan(c0)[0][0]]["status"] == "not_found", view
    assert (view[plan(c0)[1][0]]["claimed"], view[plan(c0)[2][0]]["claimed"]) == (
        issued[c0][list(want[c0])[1]]["permits"], 1), view

    # Settle everything together: all charged capacity comes back, every group row is deleted.
    def settle(c: str) -> dict[str, Any]:  # (unclaimed permits stay charged until claimBy)
        _, g1, g2 = plan(c)
        permits = issued[c][list(want[c])[2]]["permits"]
        return shared.permits(acct, sync_msg(c, [(g1[0], g1[1], g1[1]), (g2[0], permits, permits)]))

    together([lambda c=c: settle(c) for c in clients])
    usage = shared.usage(acct)
    assert usage["outstanding"] == 0 and usage["groups"] == {}, usage


# ------------------------------------------------------------------------- kill -9, alarm, limit

EVICT_VARS = {
    "LEASES": "off",  # grants: a kill between a grant and its claim
    "ACCOUNT_CONCURRENCY": str(DEFAULT_LIMIT),
    # Long enough to restart workerd (a few seconds, Python loads cold) before claimBy.
    "GRANT_TIMEOUT_MS": "7000",
    "ROUND_WAIT_MS": "50",
    "ROUND_PERIOD_MS": "100",
}
EVICT_ROUND_S = int(EVICT_VARS["ROUND_PERIOD_MS"]) / 1000
CLAIM_MARGIN_MS = 500  # SemaphoreQueue default: it never claims this close to claimBy
ALARM_SLACK_MS = 2000  # alarm delivery + a cold object start after claimBy


def test_holder_killed_between_grant_and_claim_then_alarm_and_raising_limit(
        workerd_runtime, workerd_bin, project_wrangler_toml, tmp_path):
    """One process, killed with -9 once, three accounts (no account sees another's traffic):

    1. ``ev`` (limit 1): a grant is committed for JobQueue Q (its request's reply lost: sent on
       Q's clientId through the admin route), then workerd is killed. After the restart Q gets a
       job: the reply to its request re-sends the grant (R8), Q claims it, the fresh holder
       instance confirms the claim from SQLite (R15a) and the job runs under THAT grant: no
       second grant, never more than 1 charged, the job runs once and completes once.
    2. ``br``: its stored limit override is corrupted on disk while workerd is down, so the
       Worker's ``limit`` callable (``AccountLimit.current_limit``) raises ValueError. A round
       then admits nothing, applies the reports it carries, and blocks every group with
       ``limit_resolution_error`` (R12); a JobQueue job stays queued.
    3. ``al``: grants issued before the kill (one unclaimed, one half claimed) are reclaimed by
       the holder's persisted alarm in the new process with NO request to that holder: the one
       read made after claimBy already shows the reclaim (R15, R16, I4); later reports get
       ``not_found`` / ``expired``, and the queue's next job gets a fresh grant.
    """
    with front_of(workerd_runtime, workerd_bin, project_wrangler_toml, tmp_path, EVICT_VARS) as app:
        _killed_between_grant_and_claim(app)


def _killed_between_grant_and_claim(app: Front) -> None:
    # --- run 1 -------------------------------------------------------------------------------
    assert app.set_limit("ev", 1)["limit"] == 1
    q, _ = app.new_object("JobQueue", lambda: app.jobs("ev", "q"))  # Q exists, no job yet
    [g] = app.permits("ev", request_msg(q, {"default": 1}))["grants"]
    assert (g["permits"], g["claimed"], g["status"]) == (1, 0, "active"), g

    q2, _ = app.new_object("JobQueue", lambda: app.jobs("al", "q2"))
    al, first = app.new_object("AccountLimit",
                               lambda: app.permits("al", request_msg(q2, {"default": 1})))
    [a] = first["grants"]
    [h] = app.permits("al", request_msg("half", {"default": 2}))["grants"]
    assert (a["permits"], h["permits"]) == (1, 2), (a, h)
    half = grants_by_id(app.permits("al", sync_msg("half", [(h["grantId"], 1, 0)])))[h["grantId"]]
    assert (half["claimed"], half["status"]) == (1, "active"), half

    br, _ = app.new_object("AccountLimit", lambda: app.set_limit("br", DEFAULT_LIMIT))
    [b] = app.permits("br", request_msg("b1", {"g0": 2}))["grants"]
    assert grants_by_id(app.permits("br", sync_msg("b1", [(b["grantId"], 2, 0)])))[b["grantId"]][
        "claimed"] == 2

    app.proc.kill()  # kill -9: no flush, no goodbye; every reply above was already durable
    with sqlite3.connect(app.db_path("AccountLimit", br)) as db:  # the override becomes junk
        assert db.execute("SELECT value FROM app_account_settings WHERE key = 'limit'").fetchall() == [
            (DEFAULT_LIMIT,)]
        db.execute("UPDATE app_account_settings SET value = 'oops' WHERE key = 'limit'")
    db.close()
    with sqlite3.connect(f"file:{app.db_path('AccountLimit', al)}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT grant_id, permits, claimed FROM durability_semaphore_grants").fetchall()
    db.close()
    assert sorted(rows) == sorted([(a["grantId"], 1, 0), (h["grantId"], 2, 1)]), rows  # durable
    app.proc.start()
    assert app.proc.runs == 2

    # --- 1. the grant committed before the kill is claimed after it ---------------------------
    enqueued_at = now_ms()
    in_time = enqueued_at < g["claimBy"] - CLAIM_MARGIN_MS - 1000
    app.enqueue("ev", "q", "J")
    app.enqueue("ev", "q", "J2")  # waits: Q's replies are contended, releases go at once
    order = ["queued", "claiming", "running", "done"]
    seen: dict[str, list[str]] = {"J": [], "J2": []}
    permits: dict[str, set[str]] = {"J": set(), "J2": set()}

    def sample() -> dict[str, dict[str, Any]]:
        jobs = app.jobs("ev", "q")
        usage = app.usage("ev")
        running = len(by_state(jobs, "running"))
        assert running <= 1 and running <= usage["outstanding"] <= 1, (jobs, usage)  # I1, R18
        for job_id, job in jobs.items():
            states = seen[job_id]
            if not states or states[-1] != job["state"]:
                assert not states or order.index(job["state"]) > order.index(states[-1]), (
                    f"{job_id} went back: {states} -> {job['state']}")
                states.append(job["state"])
            if job["permit"]:
                permits[job_id].add(job["permit"]["id"])
        return jobs

    jobs = wait_for(lambda: (j := sample())["J"]["state"] == "running" and j, "J running")
    j_permit = jobs["J"]["permit"]["id"]
    if in_time or j_permit == g["grantId"]:
        assert j_permit == g["grantId"], (
            f"J runs under {j_permit}, not the grant {g['grantId']} issued before the kill")
        assert jobs["J"]["startedAt"] < g["claimBy"], jobs["J"]
    else:  # the restart took too long: the queue let the grant expire; it must be gone
        late = grants_by_id(app.permits("ev", sync_msg(q)))
        assert g["grantId"] not in late, late
    end = time.monotonic() + 5 * EVICT_ROUND_S
    while time.monotonic() < end:  # several rounds: nothing else admitted, one permit charged
        jobs = sample()
        assert jobs["J2"]["state"] == "queued" and app.usage("ev")["outstanding"] == 1, jobs
        time.sleep(POLL_S)
    assert app.complete("ev", "J")["changed"] is True
    jobs = wait_for(lambda: (j := sample())["J2"]["state"] == "running" and j, "J2 admitted after J")
    assert jobs["J"]["state"] == "done" and app.complete("ev", "J")["changed"] is False
    assert permits["J"] == {j_permit} and len(permits["J2"]) == 1 and permits["J2"] != permits["J"]
    assert seen["J"] in (["queued", "claiming", "running", "done"], ["queued", "running", "done"],
                         ["claiming", "running", "done"], ["running", "done"]), seen
    assert app.complete("ev", "J2")["changed"] is True

    # --- 2. a limit callable that raises -----------------------------------------------------
    usage = app.usage("br")
    assert usage["limit"] is None and usage["outstanding"] == 2, usage  # unresolvable limit
    r1, r2 = together([
        lambda: app.permits("br", request_msg("b1", {"g0": 1}, [(b["grantId"], 2, 1)])),
        lambda: app.permits("br", request_msg("b2", {"g2": 2})),
    ])
    assert r1["grants"] == [{**b, "claimed": 2, "released": 1}], r1  # report applied, no new grant
    assert r2["grants"] == [], r2
    assert r1["blocked"] == [{"group": "g0", "reason": "limit_resolution_error", "waiting": 1}], r1
    assert r2["blocked"] == [{"group": "g2", "reason": "limit_resolution_error", "waiting": 2}], r2
    assert r1["contended"] is True and r2["contended"] is True, (r1, r2)  # R29
    assert app.usage("br")["outstanding"] == 1
    app.enqueue("br", "qb", "JB")
    end = time.monotonic() + 8 * EVICT_ROUND_S  # several rounds of the queue's requests
    while time.monotonic() < end:
        job = app.jobs("br", "qb")["JB"]
        assert job["state"] == "queued" and job["permit"] is None, job
        time.sleep(POLL_S)
    assert app.usage("br")["outstanding"] == 1
    logs = app.proc.run_logs
    assert "limit callback raised" in logs, "the raising limit was not logged"
    assert "ValueError: invalid literal for int() with base 10: 'oops'" in logs

    # --- 3. the persisted alarm reclaims, with no request to that holder ---------------------
    wake = max(a["claimBy"], h["claimBy"]) + ALARM_SLACK_MS
    time.sleep(max(0.0, (wake - now_ms()) / 1000))
    # The first requests to this holder since the kill are reads (usage() never reclaims): the
    # alarm alone reclaims; polled, as alarm delivery and a cold start after claimBy take
    # longer on a loaded machine than ALARM_SLACK_MS.
    usage = wait_for(lambda: (u := app.usage("al"))["outstanding"] == 1 and u,
                     "the persisted alarm's reclaim, without traffic")
    assert usage["groups"]["default"]["outstanding"] == 1, usage
    late_a = grants_by_id(app.permits("al", sync_msg(q2, [(a["grantId"], 1, 0)])))[a["grantId"]]
    assert late_a["status"] == "not_found", late_a  # nothing claimed: deleted at reclaim (R15)
    late_h = grants_by_id(app.permits("al", sync_msg("half", [(h["grantId"], 2, 0)])))[h["grantId"]]
    assert (late_h["status"], late_h["permits"], late_h["claimed"]) == ("expired", 1, 1), late_h
    app.enqueue("al", "q2", "J3")
    job = wait_for(lambda: (j := app.jobs("al", "q2")["J3"])["state"] == "running" and j, "J3 running")
    assert job["permit"]["id"] != a["grantId"], job  # a fresh grant, not the reclaimed one
    assert app.usage("al")["outstanding"] == 2


# ------------------------------------------------------------------------- leases, end to end

LEASE_TTL_MS = 4000
LEASE_VARS = {
    "ACCOUNT_CONCURRENCY": "4",
    "GRANT_TIMEOUT_MS": "2000",  # unclaimed grant permits (the queues draw from leases) come back soon
    "ROUND_WAIT_MS": "50",
    "ROUND_PERIOD_MS": "100",
    "LEASES": json.dumps({"provisioning": {"mode": "strict"}, "permitsPerLease": 2, "ttlMs": LEASE_TTL_MS}),
}


def test_leases_through_the_worker_draw_return_heartbeat_and_settle(
        workerd_runtime, workerd_bin, project_wrangler_toml, tmp_path):
    """Strict leases on (the ``LEASES`` var), two accounts with the same queue names and job ids:
    A (default limit 4, group ga) and B (override 3, group gb).

    1. Draw: each account's JobQueue q1 gets job j1. The round gives q1 a grant of 1 and a lease
       of 2 (permitsPerLease) from what is left; j1 is drawn from the lease (queue view: permit
       kind ``lease``, the lease's id) and the grant is never claimed: after claimBy the usage
       is ``outstanding`` 0 with ``leaseFootprint`` 2, one live lease, and q1 holds no grant.
    2. Heartbeat (R31/R37): j1 keeps running past the lease's TTL; the lease is still live with
       its ``expiresAt`` moved forward (an unreported one would be retired by then).
    3. Contended return (R29): A's q2 gets four jobs (five in A for a limit of 4). Its rounds
       leave need unserved, so q1 (its next heartbeat's reply is ``contended``) stops its lease:
       the undrawn permit comes back (the lease retired at drawn 1, j1 still running under it)
       and q2 runs 3 jobs: A runs 4 and charges exactly 4 (outstanding + footprint). B's lease
       is untouched: still live, footprint 2, B's replies not contended.
    4. Settle: every job is completed; usage returns to 0 with no live or retired lease left in
       either account.

    At every sample each account stays within its own limit (running <= outstanding + lease
    footprint <= limit, strict: I1) and shows only its own group."""
    with front_of(workerd_runtime, workerd_bin, project_wrangler_toml, tmp_path, LEASE_VARS) as app:
        _leases_end_to_end(app)


def _leases_end_to_end(app: Front) -> None:
    a, b = "lease-a", "lease-b"
    spec = {a: (4, "ga"), b: (3, "gb")}  # account -> (limit, group)
    queues = {a: ["q1", "q2"], b: ["q1"]}
    assert app.set_limit(b, 3)["limit"] == 3
    clients: dict[tuple[str, str], str] = {}  # (account, queue) -> the JobQueue's clientId
    for acct, names in queues.items():
        for queue in names:  # a first read opens the object's SQLite file (it creates no table)
            clients[acct, queue], _ = app.new_object("JobQueue", lambda acct=acct, queue=queue: app.jobs(acct, queue))
    for acct, (_, group) in spec.items():
        assert app.enqueue(acct, "q1", "j1", group)["created"] is True

    def sample() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
        """account -> ({job id: job}, usage), checking each account's budget and isolation."""
        out = {}
        for acct, (limit, group) in spec.items():
            jobs: dict[str, dict[str, Any]] = {}
            for queue in queues[acct]:
                for job_id, job in app.jobs(acct, queue).items():
                    assert job["group"] == group and job_id not in jobs, (acct, queue, job)
                    jobs[job_id] = {**job, "queue": queue}
            usage = app.usage(acct)
            running = len(by_state(jobs, "running"))
            assert usage["limit"] == limit, (acct, usage)
            assert set(usage["groups"]) <= {group}, f"{acct} shows another account's group: {usage}"
            assert running <= usage["outstanding"] + usage["leaseFootprint"] <= limit, (acct, running, usage)
            out[acct] = (jobs, usage)
        return out

    def lease_view(acct: str, queue: str) -> dict[str, Any]:
        """A sync without reports on the queue's clientId: the holder's view of its grants and
        leases (R8), after the holder's reclaim and retirement of expired leases."""
        return app.permits(acct, sync_msg(clients[acct, queue]))

    # --- 1. jobs drawn from leases ----------------------------------------------------------
    def drawn(s: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> bool:
        # Running; and, if drawn from a lease, its account's unclaimed grant reclaimed. A job
        # under a grant (leases off) ends the wait at once, to fail the checks below.
        return all(jobs["j1"]["state"] == "running"
                   and (usage["outstanding"] == 0 or jobs["j1"]["permit"]["kind"] != "lease")
                   for jobs, usage in s.values())

    s = wait_for(lambda: (x := sample()) and drawn(x) and x,
                 "j1 running in both accounts and the unclaimed grants reclaimed")
    first: dict[str, dict[str, Any]] = {}
    for acct, (_, group) in spec.items():
        jobs, usage = s[acct]
        permit = jobs["j1"]["permit"]
        assert usage["leaseFootprint"] == 2, f"{acct}: no lease footprint (leases off?): {usage}"
        assert permit is not None and permit["kind"] == "lease", jobs["j1"]  # no grant for the job
        assert (usage["outstanding"], usage["leaseFootprint"], usage["liveLeases"], usage["retiredLeases"]) == (
            0, 2, 1, 0), (acct, usage)
        assert usage["groups"] == {group: {"outstanding": 0, "leaseFootprint": 2, "liveLeases": 1,
                                           "retiredLeases": 0, "limit": None, "charged": 2,
                                           "available": spec[acct][0] - 2}}, (acct, usage)
        view = lease_view(acct, "q1")
        [lease] = view["leases"]
        assert (lease["leaseId"], lease["group"], lease["permits"], lease["drawn"], lease["released"],
                lease["status"]) == (permit["id"], group, 2, 1, 0, "live"), (acct, view)
        assert view["grants"] == [] and view["contended"] is False, (acct, view)
        first[acct] = lease

    # --- 2. heartbeats keep the lease in use live past its TTL --------------------------------
    past_ttl = max(x["expiresAt"] for x in first.values()) + LEASE_TTL_MS // 4
    while now_ms() < past_ttl:
        for jobs, usage in sample().values():
            assert jobs["j1"]["state"] == "running" and usage["liveLeases"] == 1, (jobs, usage)
        time.sleep(POLL_S)
    for acct in spec:
        [lease] = lease_view(acct, "q1")["leases"]
        assert lease["leaseId"] == first[acct]["leaseId"] and lease["status"] == "live", (acct, lease)
        assert lease["expiresAt"] > first[acct]["expiresAt"] and lease["expiresAt"] > now_ms(), (
            f"{acct}: the lease was not heartbeated: {first[acct]} -> {lease}")
        jobs, usage = sample()[acct]
        assert (usage["leaseFootprint"], usage["liveLeases"], usage["retiredLeases"]) == (2, 1, 0), usage

    # --- 3. contention in A: q1's idle lease permit comes back (R29); B is untouched ----------
    for k in ("k1", "k2", "k3", "k4"):
        assert app.enqueue(a, "q2", k, "ga")["created"] is True

    def returned() -> Any:
        s = sample()
        [lease] = lease_view(a, "q1")["leases"]
        return lease["status"] == "retired" and len(by_state(s[a][0], "running")) == 4 and (s, lease)

    s, lease = wait_for(returned, "A's q1 returning its idle lease permit and A running 4 jobs")
    jobs, usage = s[a]
    # q1 stopped its lease with 1 of 2 permits drawn: the lease is retired at its final drawn
    # count (footprint 2 -> 1) and j1 keeps running under it (no work is revoked).
    assert (lease["leaseId"], lease["drawn"], lease["released"]) == (first[a]["leaseId"], 1, 0), lease
    assert jobs["j1"]["state"] == "running" and jobs["j1"]["permit"]["id"] == lease["leaseId"], jobs
    # A is full and every charged permit is a running job: no idle lease permit is held back.
    running = by_state(jobs, "running")
    assert set(running) == {"j1", "k1", "k2", "k3"} and jobs["k4"]["state"] == "queued", jobs
    assert usage["outstanding"] + usage["leaseFootprint"] == 4 == len(running), usage
    assert usage["groups"]["ga"]["leaseFootprint"] == usage["leaseFootprint"], usage
    assert lease_view(a, "q1")["contended"] is True  # k4 waits: A's rounds leave need unserved
    view = lease_view(b, "q1")
    [lease] = view["leases"]
    assert lease["leaseId"] == first[b]["leaseId"] and lease["status"] == "live", view
    assert view["contended"] is False, view
    jobs, usage = s[b]
    assert jobs["j1"]["state"] == "running" and (usage["leaseFootprint"], usage["liveLeases"]) == (2, 1), usage

    # --- 4. settle: complete every job, everything returns to zero -----------------------------
    completed: set[tuple[str, str]] = set()
    deadline = time.monotonic() + DEADLINE_S
    while True:
        s = sample()
        for acct, (jobs, _) in s.items():
            for job_id, job in by_state(jobs, "running").items():
                assert (acct, job_id) not in completed, f"{acct} {job_id} runs again"
                reply = app.complete(acct, job_id)
                assert reply["changed"] is True and reply["job"]["state"] == "done", reply
                completed.add((acct, job_id))
        if all(job["state"] == "done" for jobs, _ in s.values() for job in jobs.values()):
            break
        assert time.monotonic() < deadline, f"jobs did not all run: {completed} {s}"
        time.sleep(POLL_S)
    assert completed == {(a, "j1"), (a, "k1"), (a, "k2"), (a, "k3"), (a, "k4"), (b, "j1")}, completed

    def settled() -> Any:
        usages = {acct: app.usage(acct) for acct in spec}
        return all((u["outstanding"], u["leaseFootprint"], u["liveLeases"], u["retiredLeases"], u["groups"])
                   == (0, 0, 0, 0, {}) for u in usages.values()) and usages

    wait_for(settled, "usage back to 0 with no lease left in either account")
    for (acct, queue) in clients:
        view = lease_view(acct, queue)
        assert view["leases"] == [], (acct, queue, view)  # settled leases are deleted (R30)


# ------------------------------------------------------------------------- direct SQL check

SQL_WORKER = """\
import { DurableObject } from "cloudflare:workers";
export class Sql extends DurableObject {
  run(sql, bindings) {
    try {
      return { rows: this.ctx.storage.sql.exec(sql, ...bindings).toArray() };
    } catch (e) {
      return { error: String((e && e.message) || e) };
    }
  }
}
export default {
  async fetch(request, env) {
    const { db, sql, bindings } = await request.json();
    return Response.json(await env.SQL.getByName(db).run(sql, bindings));
  },
};
"""


def sql_worker_config(base: Path) -> Path:
    storage = base / "storage"
    storage.mkdir(parents=True)
    config = base / "sql.capnp"
    config.write_text(textwrap.dedent(f"""\
        using Workerd = import "/workerd/workerd.capnp";
        const config :Workerd.Config = (
          services = [
            (name = "main", worker = (
              modules = [(name = "w.js", esModule = {_capnp_text(SQL_WORKER)})],
              compatibilityDate = {_capnp_text(os.environ.get("SEMAPHORE_COMPAT_DATE") or "2026-11-01")},
              bindings = [(name = "SQL", durableObjectNamespace = (className = "Sql"))],
              durableObjectNamespaces = [(className = "Sql", uniqueKey = "wide-Sql", enableSql = true)],
              durableObjectStorage = (localDisk = "do-storage"))),
            (name = "do-storage", disk = (path = {json.dumps(str(storage))}, writable = true)),
          ],
          sockets = [(name = "http", address = "127.0.0.1:0", http = (), service = "main")]
        );
        """))
    return config


@contextlib.contextmanager
def sql_worker(workerd_bin: str, tmp_path: Path) -> Iterator[WorkerdProcess]:
    """workerd serving :data:`SQL_WORKER` (a failed start fails the test with its output); its
    last output is printed when it stops."""
    with started(WorkerdProcess(sql_worker_config(tmp_path), binary=workerd_bin, pyodide_cache=None,
                                log_dir=tmp_path / "logs"), log_chars=10_000) as proc:
        yield proc


class RemoteSql:
    """``ctx.storage.sql`` of a JavaScript Durable Object, called from host Python over HTTP."""

    def __init__(self, url: str, db: str) -> None:
        self.url, self.db = url, db
        self.statements = 0

    def exec(self, query: str, *bindings: Any) -> Any:
        self.statements += 1
        body = json.dumps({"db": self.db, "sql": query, "bindings": list(bindings)}).encode()
        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            answer = json.loads(resp.read())
        if "error" in answer:
            raise RuntimeError(f"Durable Object SQL error: {answer['error']} in {query[:200]!r}")
        rows = answer["rows"]
        return types.SimpleNamespace(toArray=lambda: rows)


class RemoteStorage:
    """``ctx.storage`` shaped like :class:`semaphore.testing.LocalStorage` (alarm kept on the
    host, driven by the virtual clock) whose SQL runs in the Durable Object. ``transactionSync``
    runs the function without a transaction: this check is about what each statement does."""

    def __init__(self, url: str, db: str) -> None:
        self.sql = RemoteSql(url, db)
        self._alarm: int | None = None

    def transactionSync(self, fn: Callable[[], Any]) -> Any:
        return fn()

    async def getAlarm(self) -> int | None:
        return self._alarm

    async def setAlarm(self, at: int) -> None:
        self._alarm = int(at)

    async def deleteAlarm(self) -> None:
        self._alarm = None

    @property
    def alarm(self) -> int | None:
        return self._alarm


def typed_dump(storage: Any) -> dict[str, list[tuple[str, ...]]]:
    """Every row of the library's tables, each cell as SQLite's quote() (so 3, 3.0 and '3'
    differ), in a canonical order."""
    from semaphore.runtime import Storage

    view = Storage(types.SimpleNamespace(storage=storage))
    names = sorted(str(r["name"]) for r in view.exec(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'durability_%'"))
    out: dict[str, list[tuple[str, ...]]] = {}
    for name in names:
        rows = view.exec(f"SELECT * FROM {name}")
        if not rows:
            out[name] = []
            continue
        cols = sorted(rows[0])
        quoted = view.exec(f"SELECT {', '.join(f'quote({c}) AS {c}' for c in cols)} FROM {name}")
        out[name] = sorted(tuple(str(r[c]) for c in cols) for r in quoted)
    indexes = view.exec("SELECT name, tbl_name FROM sqlite_master WHERE type = 'index'"
                        " AND name LIKE 'durability_%' ORDER BY name")
    out["indexes"] = [(str(r["name"]), str(r["tbl_name"])) for r in indexes]
    return out


def test_store_sql_on_durable_object_sqlite_matches_cpython(workerd_bin, tmp_path):
    """Direct check: the library's holder (strict leases on) runs the same script of rounds,
    syncs, reclaims (alarm), lease draws/stops and TTL retirement twice on host CPython with a
    virtual clock: once on the CPython test bed's SQLite, once with every statement executed by
    a Durable Object's SQLite in workerd. Ids and group names carry quotes, backslashes and
    astral characters; reports bind up to dozens of ids as one json_each value. Every reply and
    every row (typed, via quote()) must be identical on both, and the aggregates must match a
    full recount on the Durable Object side."""
    from semaphore.testing import Bed, check_aggregates  # the shipped test kit (tier 1's test bed)

    with sql_worker(workerd_bin, tmp_path) as proc:
        remote = RemoteStorage(proc.url + "/", "store")
        asyncio.run(_differential_script(remote, Bed, check_aggregates))
        assert remote.sql.statements > 100, remote.sql.statements  # it really ran remotely


async def _differential_script(remote: RemoteStorage, Bed: Any, check_aggregates: Any) -> None:
    from semaphore.runtime import Storage

    options = dict(limit=20, grant_timeout_ms=1000, round_wait_ms=0, round_period_ms=0,
                   leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 2, "ttlMs": 5000})
    local_bed, remote_bed = Bed(**options), Bed(storage=remote, **options)
    beds = (local_bed, remote_bed)
    clients = ['a"q', "b\\s", "c😀", 'd[{"x":1}]', "e,ü"]
    groups = ["g'1", 'g"2', "g😀3"]

    async def both(*messages: dict[str, Any]) -> list[dict[str, Any]]:
        out = [await bed.round(*messages) for bed in beds]
        assert out[0] == out[1], f"replies differ:\nlocal  {out[0]}\nremote {out[1]}"
        dumps = [typed_dump(bed.storage) for bed in beds]
        assert dumps[0] == dumps[1], f"rows differ:\nlocal  {dumps[0]}\nremote {dumps[1]}"
        check_aggregates(Storage(types.SimpleNamespace(storage=remote)))
        return out[0]

    async def advance(ms: int) -> None:
        for bed in beds:
            await bed.clock.advance(ms)
        assert typed_dump(local_bed.storage) == typed_dump(remote)

    def req(client: str, demand: dict[str, int], grants=(), leases=None, at: int = 0) -> dict[str, Any]:
        m = request_msg(client, demand, grants, oldest_at=local_bed.t0 + at)
        if leases is not None:
            m["leases"] = [{"leaseId": i, "drawn": d, "released": r, "stopped": s} for i, d, r, s in leases]
        return m

    # Round 1: five clients, three groups; the lease-capable ones get leases from what is left.
    first = await both(*[req(c, {groups[(i + k) % 3]: 1 + k for k in range(2)},
                             leases=[] if i % 2 == 0 else None, at=i)
                         for i, c in enumerate(clients)])
    grants = {c: [g for g in r["grants"]] for c, r in zip(clients, first)}
    leases = {c: [x for x in r["leases"]] for c, r in zip(clients, first)}
    assert sum(len(v) for v in grants.values()) >= 5 and any(leases.values()), first

    # Syncs with many ids each: claims (some over-claimed), foreign and unknown ids.
    all_ids = [g["grantId"] for c in clients for g in grants[c]]
    for i, c in enumerate(clients):
        own = [(g["grantId"], g["permits"] + (i % 2), 0) for g in grants[c]]
        others = [(gid, 1, 0) for gid in all_ids if gid not in {o[0] for o in own}]
        unknown = [(f"nope-{i}-{n}", 0, 0) for n in range(20)]
        lease_reports = [(x["leaseId"], 1, 0, False) for x in leases[c]] or None
        msg = sync_msg(c, own[:1] + others + unknown)
        if lease_reports:
            msg["leases"] = [{"leaseId": l, "drawn": d, "released": r, "stopped": s}
                             for l, d, r, s in lease_reports]
        await both(msg)

    # Past every claimBy: the alarm reclaims the unclaimed rest (grants shrink or go).
    await advance(1500)
    # Round 2: releases (some full: deleted) and new demand from everyone; the first client
    # stops its leases (settled), the other lease holders send no lease reports at all.
    second = await both(*[req(c, {groups[i % 3]: 3},
                              [(g["grantId"], g["permits"], g["permits"] if i % 2 else 0) for g in grants[c]],
                              [(x["leaseId"], 1, 1, True) for x in leases[c]] if i == 0 else None,
                              at=100 + i)
                          for i, c in enumerate(clients)])
    # Past the lease TTL: the unreported live leases are retired at the next round (R31).
    await advance(6000)
    third = await both(*[req(c, {groups[(i + 1) % 3]: 1},
                             [(g["grantId"], g["permits"], g["permits"]) for g in r["grants"]],
                             [] if i % 2 == 0 else None, at=200 + i)
                         for i, (c, r) in enumerate(zip(clients, second))])
    retired = [x for r in third for x in r["leases"] if x["status"] == "retired"]
    assert len(retired) == len(leases[clients[2]]) + len(leases[clients[4]]), third
    # Settle: release everything, stop every lease with its final count.
    await advance(1500)
    for c, r in zip(clients, third):
        msg = sync_msg(c, [(g["grantId"], g["permits"], g["permits"]) for g in r["grants"]])
        if r["leases"]:
            msg["leases"] = [{"leaseId": x["leaseId"], "drawn": x["drawn"], "released": x["drawn"],
                              "stopped": True} for x in r["leases"]]
        await both(msg)
    usage = [await bed.usage() for bed in beds]
    assert usage[0] == usage[1], usage
    assert (usage[0]["outstanding"], usage[0]["leaseFootprint"], usage[0]["groups"]) == (0, 0, {}), usage


def test_queue_item_sql_on_durable_object_sqlite_matches_cpython(workerd_bin, tmp_path):
    """Direct check of the queue's item store (``QueueItems``: the key's load of its items and
    marks as JSON in one statement, inserts numbered with ``row_number()`` that skip known ids,
    ``json_each`` updates with per-item values, the purge, with the highest release its items
    record per permit read by one ``GROUP BY`` and folded into the client's lease row by
    ``ClientRows.fold_releases``'s ``UPDATE … FROM json_each … GROUP BY``, and the deletion of
    finished permit items) on a Durable Object's SQLite, beside the CPython test bed's: the same
    operations on both, with ids carrying quotes, backslashes and astral characters and payloads
    at and past the kept bound (multi-byte); every read and every row (typed, via quote()) must
    be identical."""
    from semaphore.client._item_rows import COLUMNS, PAYLOAD_KEPT
    from semaphore.client._item_store import ITEMS, Add, DonePending, QueueItems
    from semaphore.client._queue import SemaphoreQueue
    from semaphore.client._store import ClientRows
    from semaphore.core.client_state import ClientLease
    from semaphore.runtime import Storage
    from semaphore.testing import LocalStorage

    with sql_worker(workerd_bin, tmp_path) as proc:
        remote = RemoteStorage(proc.url + "/", "items")
        locals_ = LocalStorage()
        storages = [Storage(types.SimpleNamespace(storage=s)) for s in (locals_, remote)]
        key, other = 'k"\\😀', "κ"
        client_rows = []
        for storage in storages:
            SemaphoreQueue.migrate(storage, 1)
            rows = ClientRows(storage)
            rows.records_releases_in(ITEMS)
            rows.write_lease(ClientLease(key, "l'1", "g'1", 3, 3, 0, False, "live", 10**6, 10**5, 3, 0, False), 1)
            client_rows.append(rows)

        def instances() -> list[QueueItems]:
            return [QueueItems(s, done_hooks=True, on_load=lambda *marks: None, before_delete=rows.fold_releases)
                    for s, rows in zip(storages, client_rows)]

        stores = instances()
        ids = ['a"q', "b\\s", "c😀", 'd[{"x":1}]', "e,ü", "p1", "p2"]
        at_bound = json.dumps("é" * (PAYLOAD_KEPT // 2 - 1), ensure_ascii=False)  # 1,024 bytes
        past = json.dumps("é" * (PAYLOAD_KEPT // 2 - 1) + "x", ensure_ascii=False)

        def new(item_id: str, k: str, payload: str = "null", owner: str = "") -> dict[str, Any]:
            row = {c: 0 for c in COLUMNS if c != "seq"}
            return {**row, "item_id": item_id, "key": k, "group_name": "g'1", "enqueued_at": 5, "state": "queued",
                    "permit_kind": "", "permit_id": "", "owner": owner, "error": "", "payload": payload}

        def reads(s: QueueItems) -> Any:
            return ([s.rows(k) for k in (key, other)], [s.find(i) for i in ids], s.find_many(ids),
                    s.payloads(s.rows(key)), s.view(), s.view(key, "done"))

        def both(op: Callable[[QueueItems], Any]) -> None:
            answers = [op(s) for s in stores]
            assert answers[0] == answers[1], f"answers differ:\nlocal  {answers[0]}\nremote {answers[1]}"
            assert reads(stores[0]) == reads(stores[1])
            fresh = [reads(QueueItems(s, done_hooks=True, on_load=lambda *marks: None)) for s in storages]
            assert fresh[0] == fresh[1] == reads(stores[0])
            dumps = [typed_dump(s) for s in (locals_, remote)]
            assert dumps[0] == dumps[1], f"rows differ:\nlocal  {dumps[0]}\nremote {dumps[1]}"

        both(lambda s: s.insert_new(new(ids[0], key, at_bound)))
        both(lambda s: s.rows(other))  # the other key loaded (empty) before its first item
        # a known id among new ones takes no number; the shared values go in once
        both(lambda s: s.insert_many([new(i, key, past) for i in (ids[1], ids[0], ids[2], ids[3])]))
        both(lambda s: s.insert_many([new(i, other) for i in (ids[4], ids[3])]))
        # a new instance (nothing loaded): known ids are found by SQL alone and take no number
        stores = instances()
        both(lambda s: s.insert_many([new(i, other, past) for i in ("n1", ids[0], ids[4], "n2")]))
        ids += ["n1", "n2"]
        both(lambda s: s.insert_new(new(ids[5], key, owner="tok")))
        both(lambda s: s.insert_new(new(ids[6], key, owner="tok")))
        both(lambda s: s.update(key, ids[:3], {"state": "running", "permit_kind": "lease", "permit_id": "l'1",
                                               "attempts": Add(1)}, {"slot": [3, 1, 2], "error": ["x", "é", "😀"]}))
        both(lambda s: s.update(key, ids[:2], {"state": "done", "finished_at": 7, "done_pending": DonePending(True),
                                               "release_n": 2}))
        both(lambda s: s.update(key, [ids[2], ids[5]], {"state": "done", "finished_at": 8,
                                                        "done_pending": DonePending(True)}))
        both(lambda s: s.update(key, [ids[6]], {"state": "done", "finished_at": 8, "release_n": 1,
                                                "done_pending": DonePending(True)}))
        both(lambda s: s.update(key, [ids[0]], {"done_pending": 0}))
        both(lambda s: s.insert_new(new("r1", key)))
        both(lambda s: s.update(key, ["r1"], {"state": "done", "finished_at": 7, "permit_kind": "lease",
                                              "permit_id": "l'1", "release_n": 1, "done_pending": DonePending(False)}))
        both(lambda s: s.purge_done(8))  # ids[0] and r1: finished at 7, no hook pending; ids[1]'s is pending
        # the highest release they record of lease l'1 (2, not r1's 1) folded into its row before they went
        assert storages[0].exec("SELECT lease_id, released FROM durability_semaphore_client_leases") \
            == [{"lease_id": "l'1", "released": 2}]
        both(lambda s: s.delete_done_permits(key))  # ids[5] (no release recorded), not ids[6]
        assert [r["item_id"] for r in stores[0].view(key)] == [ids[1], ids[2], ids[3], ids[6]]
        assert [(r["item_id"], r["seq"]) for r in stores[0].view(other)] == [(ids[4], 5), ("n1", 6), ("n2", 7)]
        both(lambda s: s.purge_done(100))  # ids[6] now; the pending hooks keep theirs
        both(lambda s: s.drop_hooks())
        both(lambda s: s.purge_done(100))  # and theirs once dropped
        assert remote.sql.statements > 20, remote.sql.statements  # it really ran remotely
