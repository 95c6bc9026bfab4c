"""The reference app (src/entry.py) end to end inside Pyodide: HTTP through ``Default.fetch``,
RPC from the front to ``AccountLimit`` and ``JobQueue`` objects, RPC from each ``JobQueue`` (a
SemaphoreQueue client object) to the account's holder through the client helper, and the
objects' alarms firing by themselves on real timers (``auto_alarms=True``) to admit jobs.
"""

import asyncio
import json
import time

from standins import Runtime, settle_queue

from entry import AccountLimit, Default, JobQueue

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
VARS = {"LEASES": "off",  # grants: these follow claims and their confirming syncs
        "ACCOUNT_CONCURRENCY": "2", "ROUND_WAIT_MS": "10", "ROUND_PERIOD_MS": "50",
        "GRANT_TIMEOUT_MS": "5000", "ADMIN_TOKEN": TOKEN}
BASE = "http://w/accounts/a"
RELEASE_REPORT_MS = 10_000
QUEUE_OF = {"a": "q1", "b": "q2", "c": "q3"}   # job id prefix -> queue


def runtime(**kw):
    return Runtime({"ACCOUNT_LIMIT": AccountLimit, "JOB_QUEUE": JobQueue}, vars=VARS, **kw)


async def call(rt, method, path, body=None, auth=True):
    resp = await rt.fetch(Default, BASE + path, method=method, headers=AUTH if auth else {},
                          body=None if body is None else json.dumps(body))
    return resp.status, json.loads(await resp.text())


async def enqueue(rt, queue, job_id, **extra):
    return await call(rt, "POST", f"/queues/{queue}/jobs", {"id": job_id, **extra})


async def states(rt, queues):
    """{job id: state} across queues, via GET /accounts/a/queues/{q}."""
    out = {}
    for q in queues:
        status, body = await call(rt, "GET", f"/queues/{q}", auth=False)
        assert status == 200 and body["account"] == "a" and body["queue"] == q, body
        out.update({j["id"]: j["state"] for j in body["jobs"]})
    return out


async def usage(rt):
    status, body = await call(rt, "GET", "/usage", auth=False)
    assert status == 200, body
    return body


POLL_BOUND_S = 20.0  # how long any "eventually" here may take: a hang, not a slow machine


async def until(rt, queues, done, *, limit, seconds=POLL_BOUND_S, step=None):
    """Poll the HTTP front until done(states) holds, checking at every step that no more than
    ``limit`` jobs run at once across the queues and the holder has no more out (I1).
    ``step`` (async) runs between polls, e.g. to fire alarms by hand; by default the due alarms
    are fired as well, which only makes the polling quicker (alarms also fire by themselves: the
    stand-in re-arms a timer that fired a millisecond before ``Date.now()`` reached the alarm)."""
    deadline = time.monotonic() + seconds
    while True:
        s = await states(rt, queues)
        running = [j for j, st in s.items() if st == "running"]
        assert len(running) <= limit, s
        u = await usage(rt)
        assert u["outstanding"] <= limit and len(running) <= u["outstanding"], (s, u)
        if done(s):
            return s
        assert time.monotonic() < deadline, f"timed out waiting; states {s}, usage {u}"
        await asyncio.sleep(0.03)
        await (step or rt.fire_due_alarms)()


def queue_object(account, queue):
    """The JOB_QUEUE object name of (account, queue) in src/entry.py."""
    return json.dumps([account, queue])


def release_pending(rt, queue):
    """Whether the queue object has grant releases the holder has not received yet."""
    name = queue_object("a", queue)
    if not rt.sql("JOB_QUEUE", name, "SELECT name FROM sqlite_master WHERE name = 'durability_semaphore_client_grants'"):
        return False
    (row,) = rt.sql("JOB_QUEUE", name, "SELECT COUNT(*) AS n FROM durability_semaphore_client_grants"
                                       " WHERE status != 'gone' AND released > sent_released")
    return row["n"] > 0


async def complete(rt, queue, job_id):
    """POST .../jobs/{id}/complete, then make sure the release reaches the holder: a queue may
    hold a release back for a while, to send it with its next message (the queue's
    release-report bound; 10 s by default where it exists, counted from a wake-up after the
    release). Moving Date.now() past it re-arms the objects' alarms, so the report goes out."""
    status, body = await call(rt, "POST", f"/jobs/{job_id}/complete")
    deadline = time.monotonic() + POLL_BOUND_S  # (alarm handlers run in real time meanwhile)
    while release_pending(rt, queue):
        assert time.monotonic() < deadline, f"the release of {job_id} never reached the holder"
        await rt.fire_due_alarms()
        rt.advance(RELEASE_REPORT_MS + 1)
        await asyncio.sleep(0.05)
    return status, body


async def settle(rt, outstanding=0):
    """Wait until the holder's outstanding count is ``outstanding`` (every release arrived)."""
    deadline = time.monotonic() + POLL_BOUND_S
    while (await usage(rt))["outstanding"] != outstanding:
        assert time.monotonic() < deadline, await usage(rt)
        await rt.fire_due_alarms()
        rt.advance(RELEASE_REPORT_MS + 1)
        await asyncio.sleep(0.05)


def count(s, state):
    return sum(1 for v in s.values() if v == state)


async def test_jobs_of_three_queues_run_at_most_limit_at_once_until_all_done():
    # R21, I1: one account budget (limit 2) shared by three queue objects; alarms admit jobs
    rt = runtime(auto_alarms=True)
    queues = ["q1", "q2", "q3"]
    jobs = {"q1": ["a1", "a2"], "q2": ["b1", "b2"], "q3": ["c1"]}
    status, body = await call(rt, "POST", "/queues/q1/jobs", {"id": "a1"}, auth=False)
    assert status == 401 and body["error"]["code"] == "unauthorized"
    for q, ids in jobs.items():
        for job_id in ids:
            status, body = await enqueue(rt, q, job_id, payload={"n": job_id})
            assert status == 201 and body["created"] is True, body
            assert body["job"]["state"] == "queued" and body["job"]["payload"] == {"n": job_id}
    s = await until(rt, queues, lambda s: count(s, "running") == 2, limit=2)
    # Several round periods later still exactly two run: the others stay queued (R21).
    await asyncio.sleep(0.3)
    s = await until(rt, queues, lambda s: True, limit=2)
    assert count(s, "running") == 2 and count(s, "queued") == 3, s
    finished = set()
    while len(finished) < 5:
        running = sorted(j for j, st in s.items() if st == "running")
        assert running, s
        status, body = await complete(rt, QUEUE_OF[running[0][0]], running[0])
        assert status == 200 and body["changed"] is True and body["job"]["state"] == "done", body
        assert body["job"]["finishedAt"] >= body["job"]["startedAt"] > 0
        finished.add(running[0])
        want = min(2, 5 - len(finished))
        s = await until(rt, queues, lambda s: count(s, "done") == len(finished) and count(s, "running") == want,
                        limit=2)
    await settle(rt)                                              # every release arrived (I3)
    status, body = await call(rt, "POST", "/jobs/a1/complete")
    assert status == 200 and body["changed"] is False          # completing twice changes nothing
    await rt.quiesce()


async def test_enqueue_is_idempotent_and_job_ids_are_unique_per_account():
    rt = runtime(auto_alarms=False)
    # q1's instance is closed before it pumps (abandon(): what the object's death does to it), so
    # j1 stays queued: a live instance admits it at once, in the background (SPEC R37
    # wake-ups). Its changes are left to the object's alarm, due at once.
    (await rt.instance("JOB_QUEUE", queue_object("a", "q1"))).queue.abandon()
    status, body = await enqueue(rt, "q1", "j1", group="g1")
    assert status == 201 and body["job"]["group"] == "g1"
    status, body = await enqueue(rt, "q1", "j1", group="g1")
    assert status == 200 and body["created"] is False and body["job"]["id"] == "j1"
    status, body = await enqueue(rt, "q2", "j1")
    assert status == 409 and body["error"]["code"] == "conflict" and "'q1'" in body["error"]["message"]
    assert await states(rt, ["q1", "q2"]) == {"j1": "queued"}
    status, body = await call(rt, "POST", "/jobs/nope/complete")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = await call(rt, "POST", "/jobs/j1/complete", auth=False)
    assert status == 401
    status, body = await enqueue(rt, "q1", "")
    assert status == 400 and body["error"]["code"] == "invalid_request"
    status, body = await call(rt, "POST", "/queues/q1/jobs", {"id": "x" * 300})
    assert status == 400
    # Completing a queued job cancels it: it never runs and asks for nothing more.
    status, body = await call(rt, "POST", "/jobs/j1/complete")
    assert status == 200 and body["changed"] is True and body["job"]["state"] == "done"
    assert body["job"]["startedAt"] is None and body["job"]["permit"] is None
    rt.evict("JOB_QUEUE", queue_object("a", "q1"))
    assert (await rt.fire_alarm("JOB_QUEUE", queue_object("a", "q1")))["error"] is None  # a new instance
    await settle_queue(rt, "JOB_QUEUE", queue_object("a", "q1"))
    assert await states(rt, ["q1"]) == {"j1": "done"}
    assert (await usage(rt))["outstanding"] == 0


async def test_lowering_the_limit_stops_admissions_without_revoking_running_jobs():
    # R24: a lower limit takes effect at the next round; running jobs keep their permits
    rt = runtime(auto_alarms=True)
    for job_id in ("j1", "j2", "j3", "j4"):
        assert (await enqueue(rt, "q", job_id))[0] == 201
    s = await until(rt, ["q"], lambda s: count(s, "running") == 2, limit=2)
    status, body = await call(rt, "PUT", "/limit", {"limit": 1})
    assert status == 200 and body["limit"] == 1
    rt.evict("ACCOUNT_LIMIT", "a")                              # the override is durable
    u = await usage(rt)
    assert (u["limit"], u["limitOverride"], u["defaultLimit"]) == (1, 1, 2), u
    s = await until(rt, ["q"], lambda s: True, limit=2)
    assert count(s, "running") == 2, s                        # not revoked
    first, second = sorted(j for j, st in s.items() if st == "running")
    assert (await complete(rt, "q", first))[0] == 200
    await settle(rt, 1)                                         # the release reached the holder
    # One still runs: at the new limit of 1, nothing more is admitted (the queue keeps asking).
    deadline = time.monotonic() + 0.4
    while time.monotonic() < deadline:
        s = await until(rt, ["q"], lambda s: True, limit=1)
        assert count(s, "running") == 1 and count(s, "queued") == 2, s
        await asyncio.sleep(0.05)
    assert (await complete(rt, "q", second))[0] == 200
    s = await until(rt, ["q"], lambda s: count(s, "done") == 2 and count(s, "running") == 1, limit=1)
    assert (await usage(rt))["limit"] == 1
    await rt.quiesce()


async def test_raw_permits_endpoint_shows_a_queue_clients_grants():
    # R8: a sync with no reports lists every grant the holder has for that client
    rt = runtime(auto_alarms=False)
    for job_id in ("j1", "j2"):
        await enqueue(rt, "q", job_id)
    await settle_queue(rt, "JOB_QUEUE", queue_object("a", "q"))   # the queue pumps its enqueues itself
    assert await states(rt, ["q"]) == {"j1": "running", "j2": "running"}
    client_id = rt.js.recordFor("JOB_QUEUE", queue_object("a", "q")).id.toString()
    message = {"type": "sync", "v": 1, "clientId": client_id, "grants": []}
    status, body = await call(rt, "POST", "/permits", message, auth=False)
    assert status == 401
    status, body = await call(rt, "POST", "/permits", message)
    assert status == 200 and body["v"] == 1, body
    # One grant, or one per enqueue: the second enqueue's demand may go in a request beside the
    # first's (SPEC R37 wake-ups); two permits, both claimed, either way.
    grants = body["grants"]
    assert {(g["group"], g["status"]) for g in grants} == {("default", "active")}, grants
    assert sum(g["permits"] for g in grants) == sum(g["claimed"] for g in grants) == 2, grants
    # An invalid message: the holder's error value, with a 400 (it used to be a 200).
    status, body = await call(rt, "POST", "/permits", {"type": "sync", "v": 1, "grants": []})
    assert status == 400, (status, body)
    assert body["error"]["code"] == "invalid_message" and body["error"]["field"] == "clientId", body


async def test_evicting_queue_and_holder_objects_between_steps_loses_nothing():
    # R35, R37, I2: every object keeps its state in its own SQLite; fresh instances continue.
    # Alarms are fired by hand and every object is evicted between the HTTP steps, once its own
    # background pumps have ended (a queue pumps its enqueues and completions itself, SPEC R37
    # wake-ups), so no evicted instance still has work in flight (the stand-in's eviction is not
    # a crash).
    rt = runtime(auto_alarms=False)
    queues = ["q1", "q2"]

    async def evict_all():
        for name in (queue_object("a", "q1"), queue_object("a", "q2")):
            await settle_queue(rt, "JOB_QUEUE", name, live_only=True)
            rt.evict("JOB_QUEUE", name)
        rt.evict("ACCOUNT_LIMIT", "a")

    for q, job_id in (("q1", "a1"), ("q1", "a2"), ("q2", "b1"), ("q2", "b2")):
        assert (await enqueue(rt, q, job_id))[0] == 201
        await evict_all()
    assert (await enqueue(rt, "q1", "a1"))[0] == 200              # the job directory survived
    await evict_all()
    assert (await enqueue(rt, "q2", "a1"))[0] == 409
    await evict_all()
    s = await until(rt, queues, lambda s: count(s, "running") == 2, limit=2, step=rt.fire_due_alarms)
    await evict_all()
    assert await states(rt, queues) == s
    done = 0
    while done < 4:
        running = sorted(j for j, st in s.items() if st == "running")
        await evict_all()
        assert (await complete(rt, QUEUE_OF[running[0][0]], running[0]))[0] == 200
        done += 1
        want = min(2, 4 - done)
        s = await until(rt, queues, lambda s: count(s, "done") == done and count(s, "running") == want,
                        limit=2, step=rt.fire_due_alarms)
        await evict_all()
    await settle(rt)                                              # every release arrived (I3)
    constructs = [e for e in rt.events if e["kind"] == "construct" and e["binding"] == "JOB_QUEUE"]
    assert len(constructs) >= 10                                  # really served by fresh instances


async def test_queues_are_isolated_per_account_and_path_segments_are_validated():
    # Account "a:b" + queue "c" and account "a" + queue "b:c" are different objects: neither can
    # see or complete the other's jobs (a shared object would let one account release another's
    # permits). Over-long path segments and out-of-range limits are 400s that change nothing.
    rt = runtime(auto_alarms=False)

    async def at(method, path, body=None):
        resp = await rt.fetch(Default, "http://w" + path, method=method, headers=AUTH,
                              body=None if body is None else json.dumps(body))
        return resp.status, json.loads(await resp.text())

    assert (await at("POST", "/accounts/a:b/queues/c/jobs", {"id": "x"}))[0] == 201
    status, body = await at("GET", "/accounts/a/queues/b:c")
    assert status == 200 and body["jobs"] == []
    assert (await at("POST", "/accounts/a/jobs/x/complete"))[0] == 404
    status, body = await at("POST", "/accounts/a/queues/b:c/jobs", {"id": "x"})
    assert status == 201 and body["created"] is True
    await settle_queue(rt, "JOB_QUEUE", json.dumps(["a:b", "c"]))   # it pumps its enqueue itself
    status, body = await at("GET", "/accounts/a:b/queues/c")
    assert [j["id"] for j in body["jobs"]] == ["x"] and body["jobs"][0]["state"] == "running"
    long = "n" * 257
    status, body = await at("POST", f"/accounts/{long}/queues/q/jobs", {"id": "y"})
    assert status == 400 and body["error"]["code"] == "invalid_request"
    assert (await at("GET", f"/accounts/{long}/usage"))[0] == 400
    status, body = await at("PUT", "/accounts/a/limit", {"limit": 2**53})
    assert status == 400 and body["error"]["code"] == "invalid_limit"
    status, body = await at("GET", "/accounts/a/usage")
    assert body["limitOverride"] is None


async def test_job_payloads_are_shown_only_with_the_admin_token():
    rt = runtime(auto_alarms=False)
    status, _ = await enqueue(rt, "q", "j1", payload={"secret": "s"})
    assert status == 201
    await settle_queue(rt, "JOB_QUEUE", queue_object("a", "q"))   # the queue pumps its enqueue itself
    status, body = await call(rt, "GET", "/queues/q", auth=False)
    assert status == 200 and [j["id"] for j in body["jobs"]] == ["j1"]
    assert "payload" not in body["jobs"][0] and body["jobs"][0]["state"] == "running", body
    status, body = await call(rt, "GET", "/queues/q")
    assert status == 200 and body["jobs"][0]["payload"] == {"secret": "s"}
    resp = await rt.fetch(Default, BASE + "/queues/q", headers={"authorization": "Bearer nope"})
    assert resp.status == 401 and "jobs" not in json.loads(await resp.text())


def directory(rt):
    return {r["job_id"]: r["done_at"] for r in rt.sql(
        "ACCOUNT_LIMIT", "a", "SELECT job_id, done_at FROM app_job_directory ORDER BY job_id")}


async def test_job_directory_forgets_finished_jobs_after_the_retention():
    rt = runtime(auto_alarms=False)
    for job_id in ("j1", "j2"):
        assert (await enqueue(rt, "q1", job_id))[0] == 201
    assert directory(rt) == {"j1": None, "j2": None}
    status, body = await call(rt, "POST", "/jobs/j1/complete")         # cancels the queued job
    assert status == 200 and body["job"]["state"] == "done"
    done_at = directory(rt)["j1"]
    assert done_at is not None and directory(rt)["j2"] is None
    retention = 86_400_000
    assert rt.get_alarm("ACCOUNT_LIMIT", "a") <= done_at + retention
    # Within the retention the id still belongs to q1: enqueueing it again is the finished job.
    status, body = await enqueue(rt, "q1", "j1")
    assert status == 200 and body["created"] is False and body["job"]["state"] == "done"
    assert (await enqueue(rt, "q2", "j1"))[0] == 409
    assert directory(rt)["j1"] is not None
    rt.advance(retention + 1000)
    for _ in range(5):                                                   # every due timer
        await rt.fire_alarm("ACCOUNT_LIMIT", "a")
        if "j1" not in directory(rt):
            break
    assert directory(rt) == {"j2": None}                                 # live jobs stay
    assert rt.sql("ACCOUNT_LIMIT", "a", "SELECT name FROM durability_scheduler_timers"
                                        " WHERE name = 'app:prune_job_directory'") == []
    # The id is free again; completing it now is the new job.
    status, body = await enqueue(rt, "q2", "j1")
    assert status == 201 and body["created"] is True
    assert (await call(rt, "POST", "/jobs/j1/complete"))[1]["job"]["state"] == "done"


async def test_job_directory_of_an_earlier_version_gets_the_completion_column():
    rt = runtime(auto_alarms=False)
    rt.sql("ACCOUNT_LIMIT", "a", "CREATE TABLE app_job_directory (job_id TEXT PRIMARY KEY, queue TEXT NOT NULL)")
    rt.sql("ACCOUNT_LIMIT", "a", "INSERT INTO app_job_directory VALUES ('old', 'q1')")
    assert (await enqueue(rt, "q1", "old"))[0] == 201
    assert (await call(rt, "POST", "/jobs/old/complete"))[0] == 200
    assert directory(rt)["old"] is not None


class HolderLosingAClaimSync(AccountLimit):
    """The account's holder, unavailable for the first sync that carries a claim (the queue's
    claim-confirming sync)."""

    lost: list = []  # noqa: RUF012 (shared by every instance: the test reads it)

    async def permits(self, message):
        sent = json.loads(message) if isinstance(message, str) else message  # the helper sends JSON text
        grants = sent.get("grants") or []
        if sent.get("type") == "sync" and any(g.get("claimed") for g in grants) \
                and not HolderLosingAClaimSync.lost:
            HolderLosingAClaimSync.lost.append(sent.get("type"))
            raise RuntimeError("holder unavailable")
        return await super().permits(message)


async def test_a_job_completed_while_claiming_is_forgotten_by_the_directory():
    # Review (MEDIUM): complete() of a claiming job only cancels it; it turns done later, in the
    # queue's pump. The queue's outbox tells the directory then (before, the entry stayed with
    # done_at NULL forever and the holder set no prune timer).
    HolderLosingAClaimSync.lost.clear()
    rt = Runtime({"ACCOUNT_LIMIT": HolderLosingAClaimSync, "JOB_QUEUE": JobQueue}, vars=VARS,
                 auto_alarms=False)
    qname = queue_object("a", "q1")
    assert (await enqueue(rt, "q1", "j1"))[0] == 201
    # pumped by the queue itself, at once (SPEC R37 wake-ups): grant, claim, confirming sync lost
    await settle_queue(rt, "JOB_QUEUE", qname)
    assert HolderLosingAClaimSync.lost == ["sync"]
    assert await states(rt, ["q1"]) == {"j1": "claiming"}
    status, body = await call(rt, "POST", "/jobs/j1/complete")
    assert status == 200 and body["job"]["state"] == "claiming" and body["changed"] is True, body
    await settle_queue(rt, "JOB_QUEUE", qname)   # the completion's pump: the claim waits for retry_ms
    assert directory(rt) == {"j1": None}
    rt.advance(1001)                                           # past the queue's retry_ms
    for _ in range(5):                                         # the pump, then the outbox's timer
        await rt.fire_alarm("JOB_QUEUE", qname)
        if directory(rt)["j1"] is not None:
            break
    assert await states(rt, ["q1"]) == {"j1": "done"}
    done_at = directory(rt)["j1"]
    assert done_at is not None, directory(rt)
    assert rt.sql("JOB_QUEUE", qname, "SELECT job_id FROM app_finished_jobs") == []
    retention = 86_400_000
    assert rt.get_alarm("ACCOUNT_LIMIT", "a") <= done_at + retention
    rt.advance(retention + 1000)
    for _ in range(5):
        await rt.fire_alarm("ACCOUNT_LIMIT", "a")
        if "j1" not in directory(rt):
            break
    assert directory(rt) == {}
