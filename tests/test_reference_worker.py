"""Tier 1: the reference Worker's (src/entry.py) storage and exposure rules on host CPython.

Host CPython cannot import the Workers SDK, so a minimal stand-in ``workers`` module (the three
names entry.py imports) is installed for the import, and objects run on the library's test bed
(:class:`semaphore.testing.LocalContext`, real SQLite). RPC between objects is a direct call;
tier 2 (tests/pyodide/py/test_http_front.py, test_job_queue.py) runs the same rules with the
real SDK. Checked here: reads never create storage, job payloads need the admin token, every
error value carries ``"v": 1``, the job directory forgets finished jobs after the retention (also
a job completed while ``claiming``, one whose ``finish_job`` failed, retried from the queue's
outbox, and an id its queue no longer knows; a late notice never marks a new job), the
``LEASES`` var sets the leases (empty: the default leases; ``off``: none), ``HOLD_BLOCKED_MS``/``REQUEST_WAIT_MS`` turn waiting requests on
(with the queue's RPC timeout above ``REQUEST_WAIT_MS + ROUND_PERIOD_MS``, and a raised limit
serving held requests at once), an invalid var is answered as a ``configuration_error`` value
(500) on every route, ``PUT .../limit`` repairs a corrupt stored override, and the no-op
``GET .../ping`` creates nothing, an unknown path is a 404 ``not_found`` value that reaches no
object. What the front reads and writes: a body nested too deeply or
holding ``NaN``/``Infinity`` is a 400 on every route that reads one, a payload over the size
limit a 413 before anything is registered, a job that cannot be created leaves no directory
entry, every answer is strict JSON, and a blank ``ADMIN_TOKEN`` is not configured (one with
surrounding whitespace is stripped).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import types
from urllib.parse import urlparse

import pytest

from semaphore.core import json_text
from semaphore.testing import LocalContext

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


class _Response:
    def __init__(self, body: str, status: int = 200, headers: dict | None = None) -> None:
        self.body, self.status, self.headers = body, status, dict(headers or {})


class _Base:
    def __init__(self, ctx, env) -> None:
        self.ctx, self.env = ctx, env


@pytest.fixture
def entry(monkeypatch):
    fake = types.ModuleType("workers")
    fake.DurableObject = type("DurableObject", (_Base,), {})
    fake.WorkerEntrypoint = type("WorkerEntrypoint", (_Base,), {})
    fake.Response = _Response
    monkeypatch.setitem(sys.modules, "workers", fake)
    monkeypatch.delitem(sys.modules, "entry", raising=False)
    module = importlib.import_module("entry")
    yield module
    sys.modules.pop("entry", None)


class _Namespace:
    """env.NAME: getByName(name) -> the one instance of that object (constructed on first use)."""

    def __init__(self, env, cls) -> None:
        self.env, self.cls, self.objects, self.contexts = env, cls, {}, {}

    def getByName(self, name: str):
        if name not in self.objects:
            self.contexts[name] = LocalContext(name=name)
            self.objects[name] = self.cls(self.contexts[name], self.env)
        return self.objects[name]

    def tables(self, name: str) -> list[str]:
        ctx = self.contexts.get(name)
        if ctx is None:
            return []
        rows = ctx.storage.connection.execute("SELECT name FROM sqlite_master").fetchall()
        return [r[0] for r in rows]


class _Request:
    def __init__(self, url: str, method: str = "GET", headers: dict | None = None, body: str = "") -> None:
        self.url, self.method, self.headers, self._body = url, method, dict(headers or {}), body

    async def text(self) -> str:
        return self._body


class World:
    def __init__(self, entry, **vars) -> None:
        self.env = types.SimpleNamespace(**{"ACCOUNT_CONCURRENCY": "7", "ADMIN_TOKEN": TOKEN, **vars})
        self.env.ACCOUNT_LIMIT = _Namespace(self.env, entry.AccountLimit)
        self.env.JOB_QUEUE = _Namespace(self.env, entry.JobQueue)
        self.entry = entry

    async def fetch(self, method: str, path: str, body=None, headers=None):
        req = _Request("http://w" + path, method, headers or {}, "" if body is None else json.dumps(body))
        assert urlparse(req.url).path == path
        resp = await self.entry.Default(None, self.env).fetch(req)
        await settle(self.env)
        return resp.status, json.loads(resp.body)


async def settle(env) -> None:
    """Let every client object's background pumps end (a queue pumps its keys itself after an
    enqueue or a completion, SPEC R37 wake-ups), so each step of a test sees its effects; the
    work its callbacks run is left running."""
    for obj in list(env.JOB_QUEUE.objects.values()):
        while tasks := [t for t in obj.queue._pumps() if not t.done()]:
            await asyncio.gather(*tasks, return_exceptions=True)


def run(coro):
    return asyncio.run(coro)


def test_reads_of_never_used_objects_create_no_storage(entry):
    world = World(entry)

    async def scenario():
        status, usage = await world.fetch("GET", "/accounts/ghost/usage")
        assert status == 200 and usage["limit"] == 7 and usage["outstanding"] == 0 and usage["groups"] == {}
        assert usage["limitOverride"] is None and usage["defaultLimit"] == 7
        status, body = await world.fetch("GET", "/accounts/ghost/queues/q")
        assert status == 200 and body["jobs"] == []
        status, _ = await world.fetch("POST", "/accounts/ghost/jobs/x/complete", headers=AUTH)
        assert status == 404
        status, _ = await world.fetch("PUT", "/accounts/ghost/limit", {"limit": None}, headers=AUTH)
        assert status == 200
        status, body = await world.fetch("GET", "/accounts/ghost/queues/q/runs", headers=AUTH)
        assert status == 200 and body["runs"] == [] and body["scheduler"]["alarm"] is None, body
        assert body["scheduler"]["due"] == {}, body
        status, body = await world.fetch("GET", "/accounts/ghost/scheduler", headers=AUTH)
        assert status == 200 and (body["alarm"], body["due"]) == (None, {}) and body["now"] > 0, body

    run(scenario())
    assert world.env.ACCOUNT_LIMIT.tables("ghost") == []
    assert world.env.JOB_QUEUE.tables(json.dumps(["ghost", "q"])) == []
    assert world.env.ACCOUNT_LIMIT.contexts["ghost"].storage.alarm is None


def test_an_unknown_path_is_a_404_error_value_and_reaches_no_object(entry):
    world = World(entry)

    async def scenario():
        for path in ("/nope", "/accounts", "/accounts/acme", "/accounts/acme/queues", "/accounts/a/b/c/d/e", "//"):
            for method in ("GET", "POST"):
                status, body = await world.fetch(method, path)
                assert status == 404, (method, path, status, body)
                assert body == {"v": 1, "error": {"code": "not_found", "message": f"no route for {path}"}}, body

    run(scenario())
    assert world.env.ACCOUNT_LIMIT.objects == {} and world.env.JOB_QUEUE.objects == {}


def test_payloads_need_the_admin_token_and_errors_carry_v1(entry):
    world = World(entry)

    async def scenario():
        status, _ = await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j1", "payload": {"k": 1}},
                                      headers=AUTH)
        assert status == 201
        status, body = await world.fetch("GET", "/accounts/a/queues/q")
        assert status == 200 and "payload" not in body["jobs"][0]
        status, body = await world.fetch("GET", "/accounts/a/queues/q", headers=AUTH)
        assert body["jobs"][0]["payload"] == {"k": 1}
        status, body = await world.fetch("GET", "/accounts/a/queues/q", headers={"authorization": "Bearer x"})
        assert status == 401 and body["v"] == 1
        status, body = await world.fetch("PUT", "/accounts/a/limit", {"limit": -1}, headers=AUTH)
        assert status == 400 and body["v"] == 1 and body["error"]["field"] == "limit"
        reply = await world.env.ACCOUNT_LIMIT.getByName("a").set_limit("3")
        assert reply["v"] == 1 and reply["error"]["code"] == "invalid_limit"
        for method, path in (("GET", "/nope"), ("POST", "/accounts/a/usage"), ("PUT", "/accounts/a/limit")):
            status, body = await world.fetch(method, path)
            assert status in (401, 404, 405) and body["v"] == 1, body

    run(scenario())


def test_the_public_queue_view_carries_no_payloads_over_rpc_and_the_admin_view_is_capped(entry, monkeypatch):
    # Payloads need the admin token (README, the routes section): the public view asks
    # JobQueue.status for none (with_payloads false), so they never cross the RPC. The front
    # used to ask for every job with its payload (up to MAX_PAYLOAD_BYTES each) and drop them
    # only itself: ~33 jobs at the size limit exceed a Workers RPC message (32 MiB) and failed the
    # public view for everyone. The admin view carries at most MAX_VIEW_PAYLOAD_BYTES of payloads
    # in all, in enqueue order; a job past that is listed with payloadOmitted instead.
    world = World(entry)
    monkeypatch.setattr(entry, "MAX_VIEW_PAYLOAD_BYTES", 250_000, raising=False)

    async def scenario():
        for i in range(3):
            status, _ = await world.fetch("POST", "/accounts/a/queues/q/jobs",
                                          {"id": f"j{i}", "payload": "x" * 100_000}, headers=AUTH)
            assert status == 201
        jq = queue_object(world, "a", "q")
        real_status, replies = jq.status, []

        async def spy(*args, **kwargs):
            reply = await real_status(*args, **kwargs)
            replies.append(json.dumps(reply))
            return reply

        jq.status = spy
        status, body = await world.fetch("GET", "/accounts/a/queues/q")  # public: no payloads
        assert status == 200 and [j["id"] for j in body["jobs"]] == ["j0", "j1", "j2"]
        assert all("payload" not in j for j in body["jobs"]), body
        assert len(replies) == 1 and len(replies[0]) < 10_000 and "xxxx" not in replies[0], len(replies[0])
        status, body = await world.fetch("GET", "/accounts/a/queues/q", headers=AUTH)  # admin: capped
        assert status == 200 and [len(j.get("payload", "")) for j in body["jobs"]] == [100_000, 100_000, 0]
        assert body["jobs"][2]["payloadOmitted"] is True and body["payloadsOmitted"] == 1, body["jobs"][2]
        assert len(replies[1]) < 250_000 + 10_000
        assert await real_status("a") == json.loads(replies[0])  # no payloads unless asked for

    run(scenario())


def test_job_directory_forgets_finished_jobs_after_the_retention(entry):
    world = World(entry, JOB_RETENTION_MS="1000")

    async def scenario():
        for job_id in ("j1", "j2"):
            assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": job_id}, headers=AUTH))[0] == 201
        status, body = await world.fetch("POST", "/accounts/a/jobs/j1/complete", headers=AUTH)
        assert status == 200 and body["job"]["state"] == "done"
        holder = world.env.ACCOUNT_LIMIT.getByName("a")
        ctx = world.env.ACCOUNT_LIMIT.contexts["a"]
        rows = dict(ctx.storage.connection.execute("SELECT job_id, done_at FROM app_job_directory").fetchall())
        assert rows["j1"] is not None and rows["j2"] is None
        assert ctx.storage.alarm == rows["j1"] + 1000
        # The prune is a participant: its due time is read from the directory, no timer row.
        assert holder.scheduler.due_times() == {entry.JOB_PRUNE_TIMER: rows["j1"] + 1000}
        assert scheduler_rows(ctx) == {}
        later = rows["j1"] + 1001
        holder.scheduler.clock = lambda: later
        await holder.alarm()
        rows = dict(ctx.storage.connection.execute("SELECT job_id, done_at FROM app_job_directory").fetchall())
        assert rows == {"j2": None}
        assert ctx.storage.alarm is None  # nothing left to prune
        assert holder.scheduler.due_times() == {} and scheduler_rows(ctx) == {}

    run(scenario())


def scheduler_rows(ctx) -> dict[str, tuple[int, int]]:
    """The rows of the scheduler's table: ``{name: (due_at, attempts)}``."""
    return {r[0]: (r[1], r[2]) for r in ctx.storage.connection.execute(
        "SELECT name, due_at, attempts FROM durability_scheduler_timers").fetchall()}


def test_r16_a_prune_timer_row_of_an_earlier_release_is_harmless(entry):
    # R16 (the scheduler's participants): an earlier release kept the timer row
    # app:prune_job_directory in step with the directory by hand. After the upgrade it arms the
    # alarm at its time at the latest, is deleted by the prune's next run, and no prune is lost.
    world = World(entry, JOB_RETENTION_MS="1000")

    async def scenario():
        for job_id in ("j1", "j2"):
            assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": job_id}, headers=AUTH))[0] == 201
        assert (await world.fetch("POST", "/accounts/a/jobs/j1/complete", headers=AUTH))[0] == 200
        holder = world.env.ACCOUNT_LIMIT.getByName("a")
        ctx = world.env.ACCOUNT_LIMIT.contexts["a"]
        done_at = directory(world)["j1"]
        holder.scheduler.storage.exec(   # the earlier release's row, left early (attempts 0)
            "INSERT INTO durability_scheduler_timers(name, due_at) VALUES (?, ?) ON CONFLICT(name)"
            " DO UPDATE SET due_at = excluded.due_at, attempts = 0", entry.JOB_PRUNE_TIMER, done_at + 400)
        # The upgraded release starts: a new instance over the same storage (an instance keeps
        # the timer rows it read until it writes them; nothing else writes them while it lives).
        holder = world.env.ACCOUNT_LIMIT.objects["a"] = entry.AccountLimit(ctx, world.env)
        await holder.scheduler.arm()
        assert holder.scheduler.due_times()[entry.JOB_PRUNE_TIMER] == done_at + 400
        assert ctx.storage.alarm == done_at + 400
        holder.scheduler.clock = lambda: done_at + 400
        await holder.alarm()   # nothing to forget yet; the row goes
        assert directory(world)["j1"] == done_at
        assert scheduler_rows(ctx) == {}
        assert holder.scheduler.due_times() == {entry.JOB_PRUNE_TIMER: done_at + 1000}
        assert ctx.storage.alarm == done_at + 1000
        holder.scheduler.clock = lambda: done_at + 1001
        await holder.alarm()   # the directory's own due time still comes
        assert "j1" not in directory(world) and ctx.storage.alarm is None and scheduler_rows(ctx) == {}

    run(scenario())


LEASES = '{"provisioning": {"mode": "strict"}, "permitsPerLease": 2, "ttlMs": 4000}'


def queue_object(world, account: str, queue: str):
    return world.env.JOB_QUEUE.getByName(json.dumps([account, queue]))


def test_leases_var_is_parsed_once_and_jobs_are_drawn_from_leases(entry):
    from semaphore import DEFAULT_LEASES, LeaseConfig

    for unset in ({}, {"LEASES": ""}, {"LEASES": "  "}):  # the holder's default leases
        assert World(entry, **unset).env.ACCOUNT_LIMIT.getByName("a").semaphore.leases == DEFAULT_LEASES, unset
    for off in ({"LEASES": "off"}, {"LEASES": " off "}):
        assert World(entry, **off).env.ACCOUNT_LIMIT.getByName("a").semaphore.leases is None, off
    snake = World(entry, LEASES='{"provisioning": {"mode": "under", "reserve": 2}, "permits_per_lease": 3}')
    assert snake.env.ACCOUNT_LIMIT.getByName("a").semaphore.leases == LeaseConfig(
        mode="under", reserve=2, permits_per_lease=3)

    world = World(entry, LEASES=LEASES, ROUND_WAIT_MS="0", ROUND_PERIOD_MS="0")
    holder = world.env.ACCOUNT_LIMIT.getByName("a")
    assert holder.semaphore.leases == LeaseConfig(mode="strict", permits_per_lease=2, ttl_ms=4000)

    async def scenario():
        assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j1"}, headers=AUTH))[0] == 201
        jq = queue_object(world, "a", "q")
        for _ in range(3):  # the queue's alarm asks for permits (a round) and admits the job
            await jq.alarm()
            status, body = await world.fetch("GET", "/accounts/a/queues/q")
            if body["jobs"][0]["state"] == "running":
                break
        [job] = body["jobs"]
        assert job["state"] == "running" and job["permit"]["kind"] == "lease", job  # drawn, no grant
        status, usage = await world.fetch("GET", "/accounts/a/usage")
        # limit 7, demand 1: a grant of 1 (left unclaimed), then a lease of permitsPerLease 2.
        assert (usage["leaseFootprint"], usage["liveLeases"], usage["retiredLeases"]) == (2, 1, 0), usage
        assert usage["groups"]["default"]["leaseFootprint"] == 2, usage

    run(scenario())


def test_queue_view_shows_the_holders_blocked_reason_per_queued_job(entry, monkeypatch):
    # The queue view (GET /accounts/{account}/queues/{queue}) shows, for each job, the holder's
    # latest blocked entry for its group while it is queued (QueueItem.blocked / blocked_at):
    # limit 1, two jobs: the first runs (no reason), the second waits for "limit".
    wall = _Wall(monkeypatch)
    world = World(entry, ACCOUNT_CONCURRENCY="1", ROUND_WAIT_MS="0", ROUND_PERIOD_MS="0")

    async def scenario():
        jq = queue_object(world, "a", "q")
        before = jq.queue.clock()
        # Each enqueue is pumped at once: a round gives one grant (claimed, confirmed), the rest
        # is blocked by the limit.
        for job_id in ("j1", "j2"):
            assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": job_id}, headers=AUTH))[0] == 201
        status, body = await world.fetch("GET", "/accounts/a/queues/q")
        j1, j2 = body["jobs"]
        assert (j1["id"], j1["state"], j1["blocked"]) == ("j1", "running", None), body
        assert j2["id"] == "j2" and j2["state"] == "queued", body
        assert set(j2["blocked"]) == {"reason", "waiting", "at"}, j2
        assert (j2["blocked"]["reason"], j2["blocked"]["waiting"]) == ("limit", 1), j2
        assert before <= j2["blocked"]["at"] <= jq.queue.clock(), j2
        assert json.loads(json.dumps(body)) == body  # plain JSON
        # Completing j1 frees the permit: j2 runs and shows no reason any more.
        assert (await world.fetch("POST", "/accounts/a/jobs/j1/complete", headers=AUTH))[0] == 200
        for _ in range(4):
            wall.advance(1001)
            await jq.alarm()
            jobs = (await world.fetch("GET", "/accounts/a/queues/q"))[1]["jobs"]
            if jobs[1]["state"] == "running":
                break
        assert [(j["state"], j["blocked"]) for j in jobs] == [("done", None), ("running", None)], jobs

    run(scenario())


ROUTES = [  # (method, path, body), every route of the front
    ("GET", "/accounts/a/usage", None),
    ("PUT", "/accounts/a/limit", {"limit": 3}),
    ("POST", "/accounts/a/queues/q/jobs", {"id": "j1"}),
    ("GET", "/accounts/a/queues/q", None),
    ("POST", "/accounts/a/jobs/j1/complete", None),
    ("POST", "/accounts/a/permits", {"type": "sync", "v": 1, "clientId": "c", "grants": []}),
    ("GET", "/accounts/a/ping", None),
    ("GET", "/accounts/a/queues/q/runs", None),
    ("GET", "/accounts/a/scheduler", None),
    ("GET", "/healthz", None),  # a health check must not say ok either
]


@pytest.mark.parametrize("var, value", [
    ("ACCOUNT_CONCURRENCY", "oops"),
    ("ACCOUNT_CONCURRENCY", str(2**53)),  # accepted before, then every round blocked
    ("ACCOUNT_CONCURRENCY", "-1"),
    ("GRANT_TIMEOUT_MS", "0"),
    ("ROUND_WAIT_MS", "soon"),
    ("ROUND_PERIOD_MS", str(2**60)),
    ("JOB_RETENTION_MS", "0"),
    ("LEASES", "{not json"),
    ("LEASES", "[1, 2]"),
    ("LEASES", "null"),
    ("LEASES", "[" * 100_000),  # issue 21 (6): a RecursionError crashed every object's constructor
    ("LEASES", '{"ttlMs": 0}'),
    ("LEASES", '{"provisioning": {"mode": "sideways"}}'),
    ("LEASES", '{"permitsPerLease": 2, "extra": 1}'),
    ("HOLD_BLOCKED_MS", "-1"),
    ("HOLD_BLOCKED_MS", "ten"),
    ("REQUEST_WAIT_MS", str(2**53)),
    ("REQUEST_WAIT_MS", "1.5"),
    ("ORPHAN_CHECK_MS", "0"),
    ("FREE_AT_ONCE", "maybe"),
    ("FREE_AT_ONCE", "1"),
])
def test_an_invalid_var_is_a_configuration_error_value_on_every_route(entry, var, value):
    world = World(entry, **{var: value})

    def check(body, where):
        assert set(body) == {"v", "error"} and body["v"] == 1, (where, body)
        error = body["error"]
        assert (error["code"], error["field"]) == ("configuration_error", var), (where, body)
        assert var in error["message"], (where, body)

    async def scenario():
        for method, path, data in ROUTES:
            status, body = await world.fetch(method, path, data, headers=AUTH)
            assert status == 500, (method, path, status, body)
            check(body, path)
        # The objects themselves: constructing them does not raise, their RPC methods answer
        # the same error value (a JobQueue reads the same vars: its timeout depends on them).
        holder = world.env.ACCOUNT_LIMIT.getByName("b")
        for reply in (await holder.usage(), await holder.set_limit(2), await holder.find_job("x"),
                      await holder.ping(),
                      await holder.permits({"type": "sync", "v": 1, "clientId": "c", "grants": []})):
            check(reply, "AccountLimit")
        jq = queue_object(world, "b", "q")
        check(await jq.status("b"), "JobQueue")
        check(await jq.enqueue("b", "j", "default"), "JobQueue")

    run(scenario())
    assert world.env.ACCOUNT_LIMIT.tables("a") == [] and world.env.ACCOUNT_LIMIT.tables("b") == []


def test_r9a_free_at_once_var_reaches_the_holder(entry):
    # FREE_AT_ONCE -> the holder's free_at_once (default true; "false", any case: the seed's timing)
    for value, want in ((None, True), ("", True), ("true", True), ("FALSE", False), (" false ", False)):
        world = World(entry) if value is None else World(entry, FREE_AT_ONCE=value)
        assert world.env.ACCOUNT_LIMIT.getByName("a").semaphore.timing.free_at_once is want, value


def test_waiting_request_vars_reach_the_holder_and_the_queues_with_a_timeout_above_the_wait(entry):
    # HOLD_BLOCKED_MS -> the holder's hold_blocked_ms, REQUEST_WAIT_MS -> each JobQueue's
    # request_wait_ms; off ("0" or absent) by default. The queue's RPC timeout must exceed
    # request_wait_ms + round_period_ms (SemaphoreQueue's docs): 5 s + the wait + the longer of
    # the round wait and period; without waiting requests it stays 5 s.
    for off in ({}, {"HOLD_BLOCKED_MS": "0", "REQUEST_WAIT_MS": "0"}, {"HOLD_BLOCKED_MS": " ", "REQUEST_WAIT_MS": ""}):
        world = World(entry, **off)
        assert world.env.ACCOUNT_LIMIT.getByName("a").semaphore.hold_blocked_ms == 0, off
        jq = queue_object(world, "a", "q")
        assert jq.queue.request_wait_ms == 0 and jq.request_timeout_ms == entry.RPC_TIMEOUT_MS == 5000, off
    world = World(entry, HOLD_BLOCKED_MS="10000", REQUEST_WAIT_MS="8000", ROUND_WAIT_MS="1000",
                  ROUND_PERIOD_MS="2000")
    assert world.env.ACCOUNT_LIMIT.getByName("a").semaphore.hold_blocked_ms == 10_000
    jq = queue_object(world, "a", "q")
    assert jq.queue.request_wait_ms == 8000
    assert jq.request_timeout_ms == 5000 + 8000 + 2000 > 8000 + 2000
    slow_wait = World(entry, REQUEST_WAIT_MS="8000", ROUND_WAIT_MS="3000", ROUND_PERIOD_MS="500")
    assert queue_object(slow_wait, "a", "q").request_timeout_ms == 5000 + 8000 + 3000
    # A held request delays the key's lease heartbeats: with LEASES, the wait must stay below
    # half the lease TTL.
    lease_vars = {"LEASES": '{"ttlMs": 4000}', "ROUND_WAIT_MS": "0", "ROUND_PERIOD_MS": "0"}
    assert queue_object(World(entry, REQUEST_WAIT_MS="1999", **lease_vars), "a", "q").config_error is None
    bad = World(entry, REQUEST_WAIT_MS="2000", **lease_vars)
    status, body = run(bad.fetch("GET", "/healthz"))
    assert status == 500 and body["error"]["field"] == "REQUEST_WAIT_MS" and "ttlMs" in body["error"]["message"]


def test_a_raised_limit_serves_held_requests_at_once(entry):
    # With waiting requests a blocked request is held open; nothing but freed capacity or its
    # deadline started its next round, so PUT .../limit raising the limit left it waiting out
    # the hold (HOLD_BLOCKED_MS). set_limit now starts a round for the held requests.
    world = World(entry, ACCOUNT_CONCURRENCY="0", HOLD_BLOCKED_MS="60000", ROUND_WAIT_MS="0",
                  ROUND_PERIOD_MS="0")
    holder = world.env.ACCOUNT_LIMIT.getByName("a")
    request = {"type": "request", "v": 1, "clientId": "c", "grants": [], "waitMs": 60_000,
               "demand": [{"group": "g", "count": 1, "oldestAt": 0}]}

    async def scenario():
        held = asyncio.ensure_future(holder.permits(request))
        for _ in range(20):
            await asyncio.sleep(0.005)  # its round ran: limit 0, so it is held, not answered
        assert not held.done()
        status, _ = await world.fetch("PUT", "/accounts/a/limit", {"limit": 1}, headers=AUTH)
        assert status == 200
        reply = await asyncio.wait_for(held, 20)  # at once; without the fix, after the 60 s hold
        assert [g["permits"] for g in reply["grants"]] == [1] and not reply["blocked"], reply
        status, ping = await world.fetch("GET", "/accounts/a/ping", headers=AUTH)
        assert status == 200 and ping["instance"]["messages"] == {"request": 1, "sync": 0, "other": 0}, ping

    run(scenario())


def test_ping_is_a_no_op_for_the_admin_that_creates_nothing(entry):
    world = World(entry)

    async def scenario():
        status, body = await world.fetch("GET", "/accounts/ghost/ping")
        assert status == 401 and body["v"] == 1
        status, body = await world.fetch("GET", "/accounts/ghost/ping", headers=AUTH)
        assert status == 200 and body["ok"] is True, body
        assert body["instance"]["messages"] == {"request": 0, "sync": 0, "other": 0}
        assert isinstance(body["instance"]["startedAt"], int)
        assert world.env.ACCOUNT_LIMIT.tables("ghost") == []  # read nothing, wrote nothing
        holder = world.env.ACCOUNT_LIMIT.getByName("b")
        await holder.permits({"type": "sync", "v": 1, "clientId": "c", "grants": []})
        await holder.permits({"type": "nonsense"})
        assert (await holder.ping())["instance"]["messages"] == {"request": 0, "sync": 1, "other": 1}
        # As JSON text (what the client helper and the front send, SPEC R7 "JSON text"): answered
        # as text, tallied by the type it holds; text that is not JSON is "other", answered as text.
        answer = await holder.permits('{"type": "sync", "v": 1, "clientId": "c", "grants": []}')
        assert isinstance(answer, str) and json.loads(answer)["grants"] == [], answer
        refused = await holder.permits("{not json")
        assert isinstance(refused, str) and json.loads(refused)["error"]["code"] == "invalid_message", refused
        assert (await holder.ping())["instance"]["messages"] == {"request": 0, "sync": 2, "other": 2}
        # Only an answer without an error registers the account (its storage exists then).
        fresh = world.env.ACCOUNT_LIMIT.getByName("e")
        await fresh.permits("{not json")
        await fresh.permits('{"type": "sync", "v": 2, "clientId": "c", "grants": []}')
        assert fresh._indexed is False
        await fresh.permits('{"type": "sync", "v": 1, "clientId": "c", "grants": []}')
        assert fresh._indexed is True

    run(scenario())
    assert world.env.ACCOUNT_LIMIT.contexts["ghost"].storage.alarm is None


def test_the_largest_exact_integer_is_a_valid_limit(entry):
    world = World(entry, ACCOUNT_CONCURRENCY=str(2**53 - 1))
    status, usage = run(world.fetch("GET", "/accounts/a/usage"))
    assert status == 200 and usage["limit"] == usage["defaultLimit"] == 2**53 - 1, usage


def test_put_limit_repairs_a_corrupt_stored_override(entry):
    world = World(entry)
    ns = world.env.ACCOUNT_LIMIT

    async def scenario():
        assert (await world.fetch("PUT", "/accounts/a/limit", {"limit": 3}, headers=AUTH))[0] == 200
        ns.contexts["a"].storage.connection.execute(
            "UPDATE app_account_settings SET value = 'oops' WHERE key = 'limit'")
        ns.objects["a"] = entry.AccountLimit(ns.contexts["a"], world.env)  # a fresh instance reads it
        status, usage = await world.fetch("GET", "/accounts/a/usage")  # no semaphore tables yet
        assert status == 200 and usage["limit"] is None, usage  # unresolvable, as the semaphore says
        status, body = await world.fetch("PUT", "/accounts/a/limit", {"limit": 4}, headers=AUTH)
        assert (status, body) == (200, {"limit": 4, "override": 4, "defaultLimit": 7})
        assert (await world.fetch("GET", "/accounts/a/usage"))[1]["limit"] == 4
        ns.objects["a"] = entry.AccountLimit(ns.contexts["a"], world.env)
        assert (await world.fetch("GET", "/accounts/a/usage"))[1]["limit"] == 4  # durable
        # Clearing a corrupt override works too.
        ns.contexts["a"].storage.connection.execute(
            "UPDATE app_account_settings SET value = 'junk' WHERE key = 'limit'")
        ns.objects["a"] = entry.AccountLimit(ns.contexts["a"], world.env)
        status, body = await world.fetch("PUT", "/accounts/a/limit", {"limit": None}, headers=AUTH)
        assert (status, body) == (200, {"limit": 7, "override": None, "defaultLimit": 7})

    run(scenario())


def test_ids_outside_the_wire_alphabet_are_refused_with_400_and_create_nothing(entry):
    # R7 (one id alphabet, semaphore.wire.id_problem): a job group or id, or a path segment,
    # with a control character or a lone surrogate is a 400 naming it, before any object is
    # touched (before, a NUL group was queued and then made the holder refuse the queue's whole
    # request).
    world = World(entry)

    async def scenario():
        for body in ({"id": "j1", "group": "bulk\x00x"}, {"id": "j\x07"}, {"id": "j2", "group": "g\ud800"}):
            status, reply = await world.fetch("POST", "/accounts/a/queues/q/jobs", body, headers=AUTH)
            assert status == 400 and reply["v"] == 1 and reply["error"]["code"] == "invalid_request", reply
        status, reply = await world.fetch("GET", "/accounts/a%00b/usage")
        assert status == 400 and "path segment" in reply["error"]["message"]

    run(scenario())
    assert world.env.JOB_QUEUE.tables(json.dumps(["a", "q"])) == []
    assert world.env.ACCOUNT_LIMIT.tables("a") == []


# ------------------------------------------------------------------ the job directory's outbox
class _Wall:
    """Wall-clock time moved by hand: ``time.time`` (what every object's default clock reads)
    plus an offset."""

    def __init__(self, monkeypatch) -> None:
        import time

        self.offset_ms = 0
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + self.offset_ms / 1000)

    def advance(self, ms: int) -> None:
        self.offset_ms += ms


def directory(world, account: str = "a") -> dict:
    ctx = world.env.ACCOUNT_LIMIT.contexts[account]
    return dict(ctx.storage.connection.execute("SELECT job_id, done_at FROM app_job_directory").fetchall())


def outbox(world, account: str = "a", queue: str = "q") -> list:
    ctx = world.env.JOB_QUEUE.contexts[json.dumps([account, queue])]
    if not ctx.storage.connection.execute(
            "SELECT name FROM sqlite_master WHERE name = 'app_finished_jobs'").fetchall():
        return []
    return [r[0] for r in ctx.storage.connection.execute("SELECT job_id FROM app_finished_jobs").fetchall()]


async def fire(obj, times: int = 1) -> None:
    for _ in range(times):
        await obj.alarm()


async def until_pruned(world, wall, job_id: str, retention_ms: int) -> None:
    """The directory has ``job_id`` marked done and its prune timer armed; past the retention
    the holder's alarm forgets it and leaves no prune timer."""
    holder = world.env.ACCOUNT_LIMIT.getByName("a")
    ctx = world.env.ACCOUNT_LIMIT.contexts["a"]
    done_at = directory(world)[job_id]
    assert done_at is not None
    assert ctx.storage.alarm is not None and ctx.storage.alarm <= done_at + retention_ms
    wall.advance(retention_ms + 1)
    await holder.alarm()
    assert job_id not in directory(world)
    assert "app:prune_job_directory" not in holder.scheduler.due_times()
    assert "app:prune_job_directory" not in scheduler_rows(ctx)


def test_a_job_completed_while_claiming_is_forgotten_by_the_directory(entry, monkeypatch):
    # Review (MEDIUM): complete() of a claiming job only marks it cancelled; it turns done later,
    # in the queue's pump, and nothing told the directory: the entry stayed with done_at NULL
    # forever (and no prune timer was set). Now the queue's outbox announces it.
    wall = _Wall(monkeypatch)
    world = World(entry, JOB_RETENTION_MS="1000", ROUND_WAIT_MS="0", ROUND_PERIOD_MS="0", LEASES="off")  # a grant claim
    holder = world.env.ACCOUNT_LIMIT.getByName("a")

    async def scenario():
        real = holder.permits
        lost = []

        async def flaky(message):  # the holder is unavailable for the claim-confirming sync
            sent = json.loads(message)  # the client helper sends JSON text (SPEC §3)
            if sent.get("type") == "sync" and not lost:
                lost.append(sent)
                raise RuntimeError("holder unavailable")
            return await real(message)

        holder.permits = flaky
        # pumped at once: request (a grant), claim, confirming sync lost
        assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j1"}, headers=AUTH))[0] == 201
        jq = queue_object(world, "a", "q")
        assert lost and lost[0]["grants"][0]["claimed"] == 1, lost
        status, body = await world.fetch("POST", "/accounts/a/jobs/j1/complete", headers=AUTH)
        assert status == 200 and body["job"]["state"] == "claiming" and body["changed"] is True, body
        assert directory(world) == {"j1": None}
        wall.advance(1001)  # past the queue's retry_ms
        for _ in range(4):  # the pump confirms the claim, cancels the job; the outbox announces it
            await jq.alarm()
            if directory(world)["j1"] is not None:
                break
        status, body = await world.fetch("GET", "/accounts/a/queues/q")
        assert body["jobs"][0]["state"] == "done", body
        assert directory(world)["j1"] is not None, directory(world)
        assert outbox(world) == []
        await until_pruned(world, wall, "j1", 1000)

    run(scenario())


def test_a_failed_finish_job_is_retried_until_the_holder_acknowledges(entry, monkeypatch):
    # Review (MEDIUM): finish_job was a separate RPC of the front after complete; when it failed
    # the entry stayed forever. Now it is an outbox row of the queue, sent until acknowledged.
    wall = _Wall(monkeypatch)
    world = World(entry, JOB_RETENTION_MS="1000", ROUND_WAIT_MS="0", ROUND_PERIOD_MS="0")
    holder = world.env.ACCOUNT_LIMIT.getByName("a")

    async def scenario():
        assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j1"}, headers=AUTH))[0] == 201
        jq = queue_object(world, "a", "q")
        await fire(jq, 2)
        assert (await world.fetch("GET", "/accounts/a/queues/q"))[1]["jobs"][0]["state"] == "running"
        calls = []

        async def down(job_id, queue=None):
            calls.append(job_id)
            raise RuntimeError("holder unavailable")

        holder.finish_job = down
        try:
            status, body = await world.fetch("POST", "/accounts/a/jobs/j1/complete", headers=AUTH)
        except RuntimeError as exc:  # the front's own finish_job call (before the fix)
            status, body = 500, {"error": str(exc)}
        assert status == 200 and body["job"]["state"] == "done", body
        assert directory(world) == {"j1": None} and outbox(world) == ["j1"]
        for _ in range(3):  # still down: retried with the scheduler's backoff
            wall.advance(300_001)
            await jq.alarm()
        assert len(calls) >= 3 and outbox(world) == ["j1"]
        assert jq.scheduler.attempts("app:announce_finished_jobs") >= 2
        del holder.finish_job  # the holder answers again
        wall.advance(300_001)
        await jq.alarm()
        assert outbox(world) == [] and jq.scheduler.timer("app:announce_finished_jobs") is None
        await until_pruned(world, wall, "j1", 1000)

    run(scenario())


def test_an_entry_its_queue_does_not_know_is_forgotten_once_completed(entry, monkeypatch):
    # Follow-on: once the queue no longer knows a job (never created there, or dropped after its
    # retention), complete answered 404 and the entry stayed forever (409 for every other
    # queue). Now the queue announces an id it does not know as finished.
    wall = _Wall(monkeypatch)
    world = World(entry, JOB_RETENTION_MS="1000")

    async def scenario():
        assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j1"}, headers=AUTH))[0] == 201
        jq = queue_object(world, "a", "q")
        jq.queue.storage.exec("DELETE FROM durability_semaphore_client_items")  # the queue forgot it
        assert directory(world) == {"j1": None}
        status, body = await world.fetch("POST", "/accounts/a/jobs/j1/complete", headers=AUTH)
        assert status == 404, body
        await until_pruned(world, wall, "j1", 1000)
        status, body = await world.fetch("POST", "/accounts/a/queues/q2/jobs", {"id": "j1"}, headers=AUTH)
        assert status == 201, body  # the id is free again

    run(scenario())


def test_a_late_announcement_never_marks_a_new_job_with_the_same_id(entry, monkeypatch):
    # The queue forgot a finished job whose announcement is still unacknowledged; the same id is
    # enqueued again while that announcement is in flight. The queue registers the new job only
    # after the send settled, so the directory keeps the new job live.
    wall = _Wall(monkeypatch)
    world = World(entry, JOB_RETENTION_MS="1000")
    holder = world.env.ACCOUNT_LIMIT.getByName("a")

    async def scenario():
        assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j1"}, headers=AUTH))[0] == 201
        jq = queue_object(world, "a", "q")
        real = holder.finish_job
        gate = asyncio.Event()
        down = True

        async def slow(job_id, queue=None):
            if down:
                raise RuntimeError("holder unavailable")
            await gate.wait()
            return await real(job_id, queue)

        holder.finish_job = slow
        assert (await world.fetch("POST", "/accounts/a/jobs/j1/complete", headers=AUTH))[0] == 200
        assert outbox(world) == ["j1"]
        wall.advance(2000)
        await jq.queue.pump("a")  # past the queue's retention: the finished job is dropped
        assert jq.queue.item("j1") is None and outbox(world) == ["j1"]
        down = False
        wall.advance(300_001)
        sending = asyncio.ensure_future(jq.alarm())  # the announcement, held at the holder
        await asyncio.sleep(0.01)
        enqueue = asyncio.ensure_future(world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j1"},
                                                    headers=AUTH))
        await asyncio.sleep(0.01)
        gate.set()
        await sending
        status, body = await enqueue
        assert status == 201 and body["job"]["state"] == "queued", body
        assert directory(world) == {"j1": None}  # live: never forgotten
        assert outbox(world) == []

    run(scenario())


def test_r16_arming_an_account_without_a_job_directory_runs_no_failing_read(entry):
    # R16 (review fix): the job-directory prune and the holder's reclaim are scheduler
    # participants; on an account whose tables do not exist, every arm() (after each round and
    # sync) used to run a failing MIN(...) read and then a schema read for each. Now one schema
    # read at most (semaphore.runtime.TableWatch; the directory's absence is remembered).
    world = World(entry)
    ns = world.env.ACCOUNT_LIMIT

    async def scenario():
        status, _ = await world.fetch("PUT", "/accounts/a/limit", {"limit": 3}, headers=AUTH)
        assert status == 200
        obj = ns.objects["a"]
        seen: list[str] = []
        connection = ns.contexts["a"].storage.connection
        connection.set_trace_callback(seen.append)
        await obj.scheduler.arm()
        await obj.scheduler.arm()
        connection.set_trace_callback(None)
        return seen

    seen = run(scenario())
    # neither the directory nor the holder's grants (no round ran: no semaphore tables) is read
    # while absent: the directory's absence costs one schema read for the instance (only it
    # creates the directory), the grants' one schema read per arm() (the holder's tables also
    # come from the static migrate), never a failing read
    for table, most in (("app_job_directory", 1), ("durability_semaphore_grants", 2)):
        assert not [q for q in seen if table in q and "sqlite_master" not in q], seen
        assert len([q for q in seen if "sqlite_master" in q and table in q]) <= most, seen


# ------------------------------------------------ what the front reads and writes: JSON, the token
#: Every route that reads a JSON body, with a valid body for it.
BODY_ROUTES = [
    ("PUT", "/accounts/a/limit", {"limit": 3}),
    ("POST", "/accounts/a/queues/q/jobs", {"id": "j1"}),
    ("POST", "/accounts/a/permits", {"type": "sync", "v": 1, "clientId": "c", "grants": []}),
    ("POST", "/accounts/a/holders/c/settle", {"reason": "gone"}),
]


def strict_json(text: str):
    """``text`` parsed as JSON proper: ``NaN``/``Infinity`` (which ``json.loads`` accepts) raise."""
    def refuse(name):
        raise AssertionError(f"not JSON: {name} in {text[:200]!r}")
    return json.loads(text, parse_constant=refuse)


async def fetch_raw(world, method: str, path: str, text: str, headers=None):
    """The front's answer to a request whose body is ``text`` as given (not made by json.dumps);
    the answer must be strict JSON."""
    resp = await world.entry.Default(None, world.env).fetch(_Request("http://w" + path, method,
                                                                  AUTH if headers is None else headers, text))
    return resp.status, strict_json(resp.body)


def nested(depth: int) -> str:
    """A JSON object ``depth`` containers deep: ``{"id": "j1", "payload": [[...]]}``."""
    return '{"id": "j1", "payload": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def test_a_deeply_nested_body_is_a_400_on_every_route_that_reads_one(entry):
    # Issue 21 (6): a body nested past the interpreter's recursion limit raised RecursionError out
    # of read_json (it caught only ValueError): a 500 on every route that reads a body. Now any
    # body nested deeper than MAX_JSON_DEPTH is a 400 invalid_json saying so, and nothing is created.
    world = World(entry)
    limit = entry.MAX_JSON_DEPTH

    async def scenario():
        for method, path, _ in BODY_ROUTES:
            for text in ("[" * 100_000 + "]" * 100_000, "[" * 100_000, '{"a": ' * 50_000):
                status, body = await fetch_raw(world, method, path, text)
                assert status == 400 and body["v"] == 1 and body["error"]["code"] == "invalid_json", (path, body)
                assert f"nested deeper than {limit}" in body["error"]["message"], (path, body)
        # Below the recursion limit but past MAX_JSON_DEPTH: refused the same way; at it: accepted.
        status, body = await fetch_raw(world, "POST", "/accounts/a/queues/q/jobs", nested(limit + 1))
        assert status == 400 and body["error"]["code"] == "invalid_json", body
        assert world.env.ACCOUNT_LIMIT.tables("a") == [] and world.env.JOB_QUEUE.tables(json.dumps(["a", "q"])) == []
        status, body = await fetch_raw(world, "POST", "/accounts/a/queues/q/jobs", nested(limit))
        assert status == 201, body
        # Brackets inside strings (escaped quotes too) are text, not nesting.
        text = json.dumps({"id": "s1", "payload": ['\\"[{' * 1000, "]" * 1000]})
        status, body = await fetch_raw(world, "POST", "/accounts/a/queues/q/jobs", text)
        assert status == 201, body

    run(scenario())


def test_the_depth_scan_matches_an_unterminated_string_to_the_end_so_it_is_linear(entry):
    # MAX_JSON_DEPTH (text_too_deep, the front's scan before json.loads): a string literal that
    # never ends ('"' + '\\"' * n) must match from its opening quote to the end of the text. The
    # old pattern had no match from such a quote, so re.sub retried from every later quote:
    # O(n**2), 32 KB cost ~5 s of CPU. One match spanning the text is what makes the scan linear
    # (each character read once); checked structurally, not with a clock.
    pattern = json_text._JSON_STRING  # the library's scan, which the front uses
    for prefix, tail in (("", '"' + '\\"' * 20_000), ('{"id": ', '"' + '\\"' * 20_000), ("[", '"abc'),
                         ("[", '"abc\\'), ('{"a": "b", "c": ', '"' + '\\"[{' * 5_000)):
        text = prefix + tail
        assert pattern.match(text, len(prefix)).end() == len(text), text[:40]  # from its quote to the end
        assert [m.end() for m in pattern.finditer(text)][-1] == len(text)
        assert entry.text_too_deep(text) is False  # the rest is string text, not nesting
        with pytest.raises(entry.JsonError, match="not valid JSON"):
            entry.parse_json(text)
    # Terminated strings still end at their closing quote: brackets after them are counted.
    deep = '["\\"", "[", ' + "[" * 64 + "]" * 64 + "]"
    assert pattern.findall(deep) == ['"\\""', '"["'] and entry.text_too_deep(deep) is True
    assert entry.text_too_deep('["\\"", "[", ' + "[" * 63 + "]" * 63 + "]") is False


def test_non_finite_numbers_are_refused_and_every_answer_is_json(entry):
    # Issue 21 (8): a payload holding NaN or Infinity was accepted, stored, and written back as a
    # bare NaN, so the queue's view was not JSON. Now NaN, Infinity, -Infinity and numbers that
    # overflow to infinity (1e999) are refused at input (400 invalid_json, nothing created), an
    # RPC caller of JobQueue.enqueue gets the error value naming "payload" (nothing registered),
    # and the front writes strict JSON only (allow_nan=False): an answer holding a non-finite
    # number (a payload stored by an earlier version) is a JSON 500, never a bare NaN.
    world = World(entry)

    async def scenario():
        for constant in ("NaN", "Infinity", "-Infinity", "1e999", "-1e999"):
            text = '{"id": "j1", "payload": {"x": [1, ' + constant + "]}}"
            status, body = await fetch_raw(world, "POST", "/accounts/a/queues/q/jobs", text)
            assert status == 400 and body["error"]["code"] == "invalid_json", (constant, body)
            status, body = await fetch_raw(world, "PUT", "/accounts/a/limit", '{"limit": ' + constant + "}")
            assert status == 400 and body["error"]["code"] == "invalid_json", (constant, body)
        assert world.env.ACCOUNT_LIMIT.tables("a") == [] and world.env.JOB_QUEUE.tables(json.dumps(["a", "q"])) == []
        jq = queue_object(world, "a", "q")
        for value in (float("nan"), float("inf"), {"deep": [float("-inf")]}):
            reply = await jq.enqueue("a", "j1", "default", value, "q")
            assert reply["error"]["code"] == "invalid_request" and reply["error"]["field"] == "payload", reply
        assert world.env.ACCOUNT_LIMIT.tables("a") == []  # never registered in the directory
        # A job whose payload an earlier version stored with a NaN: the admin view is JSON.
        assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "old", "payload": 1},
                                  headers=AUTH))[0] == 201
        ctx = world.env.JOB_QUEUE.contexts[json.dumps(["a", "q"])]
        ctx.storage.connection.execute("UPDATE durability_semaphore_client_items SET payload = 'NaN'")
        status, body = await fetch_raw(world, "GET", "/accounts/a/queues/q", "", AUTH)
        assert status == 500 and body["error"]["code"] == "internal_error", body
        status, body = await fetch_raw(world, "GET", "/accounts/a/queues/q", "", {})
        assert status == 200 and [j["id"] for j in body["jobs"]] == ["old"], body  # public view: no payload

    run(scenario())


def test_a_payload_over_the_size_limit_is_a_413_and_leaves_no_directory_entry(entry):
    # Issue 21 (7): a payload over Durable Object SQL's 2 MB row limit escaped as a 500, and the
    # job directory entry registered before the queue's insert failed stayed listed for a job
    # that does not exist (the id then "belonged" to that queue: 409 for any other). Now a
    # payload whose JSON is over MAX_PAYLOAD_BYTES is a 413 naming "payload" before anything is
    # registered, at the front and for an RPC caller of JobQueue.enqueue.
    world = World(entry)
    limit = entry.MAX_PAYLOAD_BYTES

    async def scenario():
        for size in (limit + 1, 1_900_000):  # a body over MAX_BODY_BYTES is refused unread (below)
            body = {"id": "big", "payload": "x" * (size - 2)}  # its JSON: the string's quotes + size - 2
            status, reply = await world.fetch("POST", "/accounts/a/queues/q/jobs", body, headers=AUTH)
            assert status == 413 and reply["error"]["code"] == "payload_too_large", reply
            assert reply["error"]["field"] == "payload" and str(limit) in reply["error"]["message"], reply
        reply = await queue_object(world, "a", "q").enqueue("a", "big", "default", "x" * limit, "q")
        assert reply["error"]["code"] == "payload_too_large" and reply["error"]["field"] == "payload", reply
        assert world.env.ACCOUNT_LIMIT.tables("a") == []
        assert (await world.env.ACCOUNT_LIMIT.getByName("a").find_job("big")) == {"queue": None}
        # The id is free for any queue; a payload of exactly the limit is kept and shown.
        status, reply = await world.fetch("POST", "/accounts/a/queues/other/jobs",
                                          {"id": "big", "payload": "y" * (limit - 2)}, headers=AUTH)
        assert status == 201, reply
        status, reply = await world.fetch("GET", "/accounts/a/queues/other", headers=AUTH)
        assert len(reply["jobs"][0]["payload"]) == limit - 2

    run(scenario())


def test_the_payload_check_keeps_no_per_item_state_and_an_oversized_body_is_refused_unparsed(entry):
    # MAX_PAYLOAD_BYTES / MAX_JSON_DEPTH (payload_problem): json_depth pushed a (node, depth)
    # tuple for every child, scalars included, so a 2 MB flat array '[0,0,...]' (1M items, over
    # the size limit) peaked at ~64 MB before its 413, in the front and again in the JobQueue.
    # Now only containers are pushed. Deterministic: tracemalloc's peak, not the clock.
    import tracemalloc

    payload = entry.parse_json("[" + "0," * 1_000_000 + "0]")
    tracemalloc.start()
    try:
        problem = entry.payload_problem(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert problem is not None and problem["error"]["code"] == "payload_too_large", problem
    assert peak < 16_000_000, peak  # the JSON text (2 MB) and its bytes, not 64 MB of tuples
    assert entry.json_depth([0, [1, {"a": [2]}], 3]) == 4 and entry.json_depth(0) == 0
    # A body over MAX_BODY_BYTES (twice the payload limit) is a 413 before it is scanned or parsed
    # (read_json), by its length. It is read first, whatever its Content-Length says: an answer
    # before the body was read cut the client off mid-send (tier 3 on a loaded machine: "broken
    # pipe" instead of the 413).
    world = World(entry)
    limit = entry.MAX_BODY_BYTES
    assert limit == 2 * entry.MAX_PAYLOAD_BYTES
    read: list[int] = []

    class Declared(_Request):
        async def text(self) -> str:
            read.append(1)
            return "[" * (limit + 1)  # too long: refused before the depth scan would see it

    async def scenario():
        text = '{"id": "j1", "payload": [' + "0," * (limit // 2) + "0]}"
        for method, path, _ in BODY_ROUTES:
            status, body = await fetch_raw(world, method, path, text)
            assert status == 413 and body["error"]["code"] == "payload_too_large", (path, body)
            assert str(limit) in body["error"]["message"], body
            headers = {**AUTH, "content-length": str(limit + 1)}
            resp = await entry.Default(None, world.env).fetch(Declared("http://w" + path, method, headers))
            assert resp.status == 413 and json.loads(resp.body)["error"]["code"] == "payload_too_large"
            assert read, "the body was answered before it was read"
            read.clear()
        assert world.env.ACCOUNT_LIMIT.tables("a") == [] and world.env.JOB_QUEUE.tables(json.dumps(["a", "q"])) == []
        # At the limit, the body is read (and here, answered for its payload's size).
        text = '{"id": "j1", "payload": "' + "x" * (limit - 27) + '"}'
        assert len(text) == limit
        status, body = await fetch_raw(world, "POST", "/accounts/a/queues/q/jobs", text)
        assert status == 413 and body["error"]["field"] == "payload", body

    run(scenario())


def test_a_job_that_cannot_be_created_leaves_no_directory_entry(entry):
    # Issue 21 (7): the directory write and the queue's insert are consistent on any failure:
    # when creating the job fails after it was registered (here an injected storage failure of
    # the queue's insert transaction), the queue withdraws the entry (AccountLimit.forget_job),
    # answers the error value internal_error (the front: a JSON 500), and the id stays free.
    from semaphore.testing import StorageFault

    world = World(entry)

    async def scenario():
        assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j0"}, headers=AUTH))[0] == 201
        storage = world.env.JOB_QUEUE.contexts[json.dumps(["a", "q"])].storage
        storage.fail_transaction = lambda: 0  # every transaction fails at its first statement
        status, reply = await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j1"}, headers=AUTH)
        assert status == 500 and reply["error"]["code"] == "internal_error", reply
        assert StorageFault.__name__ in reply["error"]["message"], reply
        storage.fail_transaction = None
        assert directory(world) == {"j0": None}  # j1's entry is gone; j0 untouched
        status, reply = await world.fetch("GET", "/accounts/a/queues/q", headers=AUTH)
        assert [j["id"] for j in reply["jobs"]] == ["j0"], reply
        assert (await world.fetch("POST", "/accounts/a/queues/other/jobs", {"id": "j1"}, headers=AUTH))[0] == 201
        # A holder that does not answer the withdrawal: the entry goes through the outbox instead
        # (finish_job: forgotten after the retention), never left live.
        storage.fail_transaction = lambda: 0
        holder = world.env.ACCOUNT_LIMIT.getByName("a")
        real = holder.forget_job

        async def down(*args):
            raise RuntimeError("holder unreachable")

        holder.forget_job = down
        status, reply = await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j2"}, headers=AUTH)
        assert status == 500 and reply["error"]["code"] == "internal_error", reply
        storage.fail_transaction = None
        holder.forget_job = real
        assert directory(world)["j2"] is not None and outbox(world) == []  # marked finished, sent at once

    run(scenario())


def test_a_job_queued_before_a_later_step_failed_is_answered_queued_and_woken(entry):
    # The job directory's consistency (JobQueue.enqueue): when SemaphoreQueue.enqueue fails AFTER
    # its insert committed (here arming the alarm), the job is queued and keeps its directory
    # entry. The answer used to be 500 "...; nothing was queued", so a caller could resubmit it
    # under a new id and it ran twice. Now it is answered as created (201, the job's view, a
    # warning), its wake-up is armed again, and the queue's alarm admits it.
    world = World(entry, ROUND_WAIT_MS="0", ROUND_PERIOD_MS="0")

    async def scenario():
        jq = queue_object(world, "a", "q")
        ctx = world.env.JOB_QUEUE.contexts[json.dumps(["a", "q"])]
        real_arm, calls = jq.scheduler.arm, {"n": 0}

        async def arm_fails(times):
            async def arm(*args, **kwargs):
                calls["n"] += 1
                if calls["n"] <= times:
                    raise RuntimeError("setAlarm failed")
                return await real_arm(*args, **kwargs)
            return arm

        jq.scheduler.arm = await arm_fails(1)  # the queue's arm fails once; the retry succeeds
        status, reply = await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j1"}, headers=AUTH)
        jq.scheduler.arm = real_arm
        assert status == 201 and reply["created"] is True and reply["job"]["id"] == "j1", reply
        assert reply["job"]["state"] == "queued" and "setAlarm failed" in reply["warning"], reply
        assert "armed again" in reply["warning"] and "nothing was queued" not in json.dumps(reply)
        assert "j1" in directory(world) and ctx.storage.alarm is not None  # its wake-up is set
        for _ in range(3):
            await jq.alarm()
        _, listing = await world.fetch("GET", "/accounts/a/queues/q", headers=AUTH)
        assert [(j["id"], j["state"]) for j in listing["jobs"]] == [("j1", "running")], listing
        # Both arms fail: still answered queued, saying the wake-up waits for the next arm.
        await ctx.storage.deleteAlarm()
        calls["n"] = 0
        jq.scheduler.arm = await arm_fails(2)
        status, reply = await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j2"}, headers=AUTH)
        jq.scheduler.arm = real_arm
        assert status == 201 and reply["job"]["id"] == "j2" and "failed again" in reply["warning"], reply
        assert "j2" in directory(world)  # and the queue pumps it itself: its pump arms the alarm again
        # Enqueued again (the caller's retry of the same id): already known, the wake-up armed.
        status, reply = await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j2"}, headers=AUTH)
        assert status == 200 and reply["created"] is False and ctx.storage.alarm is not None, reply
        # A known job whose enqueue fails the same way is answered known (200), not created.
        jq.scheduler.arm, calls["n"] = await arm_fails(1), 0
        status, reply = await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j2"}, headers=AUTH)
        jq.scheduler.arm = real_arm
        assert status == 200 and reply["created"] is False and "warning" in reply, reply

    run(scenario())


@pytest.mark.parametrize("token", ["", " ", "\n", " \t\r\n "])
def test_a_blank_admin_token_means_not_configured(entry, token):
    # Issue 21 (9): a whitespace-only ADMIN_TOKEN counted as configured (`if not token`), so
    # "Authorization: Bearer <the blanks>" changed state. Blank is not configured: 401 on every
    # writing route, whatever is sent, and nothing is created.
    world = World(entry, ADMIN_TOKEN=token)

    async def scenario():
        for headers in ({}, {"authorization": f"Bearer {token}"}, {"authorization": "Bearer "},
                        {"authorization": "Bearer"}):
            for method, path, data in BODY_ROUTES:
                status, body = await world.fetch(method, path, data, headers=headers)
                assert status == 401 and "not configured" in body["error"]["message"], (headers, path, body)

    run(scenario())
    assert world.env.ACCOUNT_LIMIT.tables("a") == [] and world.env.JOB_QUEUE.tables(json.dumps(["a", "q"])) == []


def test_surrounding_whitespace_of_the_admin_token_is_stripped(entry):
    # Issue 21 (9): a secret set with a stray newline or spaces ("  s3cret\n", a value pasted or
    # piped with its line end) is the token "s3cret" (README, the reference Worker's token section).
    world = World(entry, ADMIN_TOKEN=f"  {TOKEN}\n")

    async def scenario():
        status, body = await world.fetch("PUT", "/accounts/a/limit", {"limit": 3}, headers=AUTH)
        assert status == 200 and body["limit"] == 3, body
        status, body = await world.fetch("GET", "/accounts/a/queues/q", headers=AUTH)
        assert status == 200, body
        for wrong in (f"Bearer   {TOKEN}\n", "Bearer", f"Bearer {TOKEN}x"):
            status, body = await world.fetch("PUT", "/accounts/a/limit", {"limit": 4}, headers={"authorization": wrong})
            assert status == 401 and "wrong" in body["error"]["message"], (wrong, body)


READ = "r3ad"
#: The operator's reading routes: the read token or the admin token opens them.
READER_ROUTES = ("/metrics", "/accounts/a/holders", "/accounts/a/audit", "/accounts/a/scheduler",
                 "/accounts/a/queues/q/runs", "/accounts/a/ping")


def test_reads_take_the_read_token_or_the_admin_token(entry):
    world = World(entry, READ_TOKEN=f" {READ}\n")

    async def scenario():
        for path in READER_ROUTES:
            for headers in ({"authorization": f"Bearer {READ}"}, AUTH):
                status, body = await world.fetch("GET", path, headers=headers) if path != "/metrics" \
                    else (await metrics_status(world, headers), None)
                assert status == 200, (path, headers, body)
            for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": f"Bearer {READ}x"}):
                status, body = await world.fetch("GET", path, headers=headers)
                assert status == 401 and "READ_TOKEN or ADMIN_TOKEN" in body["error"]["message"], (path, body)

    run(scenario())
    assert world.env.ACCOUNT_LIMIT.tables("a") == [] and world.env.JOB_QUEUE.tables(json.dumps(["a", "q"])) == []


async def metrics_status(world, headers) -> int:
    req = _Request("http://w/metrics", "GET", headers)
    return (await world.entry.Default(None, world.env).fetch(req)).status


def test_the_read_token_changes_nothing_and_sees_no_payloads(entry):
    world = World(entry, READ_TOKEN=READ)
    reader = {"authorization": f"Bearer {READ}"}

    async def scenario():
        for method, path, data in BODY_ROUTES:
            status, body = await world.fetch(method, path, data, headers=reader)
            assert status == 403 and body["error"]["code"] == "forbidden", (path, body)
            assert "needs ADMIN_TOKEN" in body["error"]["message"], body
        assert world.env.ACCOUNT_LIMIT.tables("a") == [] and world.env.JOB_QUEUE.tables(json.dumps(["a", "q"])) == []
        status, _ = await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j1", "payload": {"k": 1}},
                                      headers=AUTH)
        assert status == 201
        status, body = await world.fetch("GET", "/accounts/a/queues/q", headers=reader)  # the public view
        assert status == 200 and body["jobs"][0]["id"] == "j1" and "payload" not in body["jobs"][0], body

    run(scenario())


@pytest.mark.parametrize("configured", [{}, {"ADMIN_TOKEN": " "}])
def test_with_no_token_configured_reads_name_the_secret_to_set(entry, configured):
    world = World(entry, **configured)
    if not configured:
        del world.env.ADMIN_TOKEN

    async def scenario():
        for path in READER_ROUTES:
            for headers in ({}, AUTH):
                status, body = await world.fetch("GET", path, headers=headers)
                message = body["error"]["message"]
                assert status == 401 and "set the secret READ_TOKEN" in message and "ADMIN_TOKEN" in message, body
                assert "state changes are disabled" not in message, body

    run(scenario())


def test_with_only_the_read_token_state_changes_stay_disabled(entry):
    world = World(entry, READ_TOKEN=READ)
    del world.env.ADMIN_TOKEN

    async def scenario():
        assert (await world.fetch("GET", "/accounts/a/holders", headers={"authorization": f"Bearer {READ}"}))[0] == 200
        for method, path, data in BODY_ROUTES:
            for headers in ({}, {"authorization": f"Bearer {READ}"}):
                status, body = await world.fetch(method, path, data, headers=headers)
                assert status == 401 and "ADMIN_TOKEN is not configured" in body["error"]["message"], (path, body)

    run(scenario())


# ------------------------------------------------------------------ in-Worker jobs and their runs
class _Gates:
    """A JobQueue's ``sleep`` for in-Worker jobs, driven by the test: each call waits for its
    own event (``release(i)``); ``calls`` lists the seconds asked for."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.events: list[asyncio.Event] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)
        self.events.append(asyncio.Event())
        await self.events[-1].wait()

    def release(self, i: int) -> None:
        self.events[i].set()


async def _settle(until, what: str, obj=None, wall=None, tries: int = 50):
    """Let the objects' tasks run (and, with ``obj``, fire its alarm with virtual time moved on
    by ``wall``) until ``until()`` holds; fail with ``what`` otherwise."""
    for _ in range(tries):
        got = await until()
        if got:
            return got
        if obj is not None:
            if wall is not None:
                wall.advance(1001)
            await obj.alarm()
        for _ in range(5):
            await asyncio.sleep(0)
    raise AssertionError(f"not reached: {what}")


def test_a_work_ms_job_runs_in_its_queue_and_leaves_one_run_record(entry):
    # R37 (the reference Worker's in-Worker jobs): a payload {"workMs": n} is run by the
    # JobQueue itself; its run record (start, permit) is written when the work starts, its end
    # together with the completion that releases its permit. Other payloads stay external.
    world = World(entry, ROUND_WAIT_MS="0", ROUND_PERIOD_MS="0")
    gates = _Gates()

    async def scenario():
        jq = queue_object(world, "a", "q")
        jq.sleep = gates
        assert jq.queue.orphan_check_ms == entry.DEFAULT_ORPHAN_CHECK_MS == 60_000
        for job_id, payload in (("w1", {"workMs": 150}), ("x1", {"workMs": 0}), ("x2", {"workMs": True}),
                                ("x3", None)):
            body = {"id": job_id, "payload": payload}
            assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", body, headers=AUTH))[0] == 201

        async def jobs():
            return {j["id"]: j for j in (await world.fetch("GET", "/accounts/a/queues/q"))[1]["jobs"]}

        async def started():
            return gates.calls and all(j["state"] == "running" for j in (await jobs()).values())

        await _settle(started, "every job running, w1's work started", obj=jq)
        assert gates.calls == [0.15]  # only w1 is run here
        status, body = await world.fetch("GET", "/accounts/a/queues/q/runs", headers=AUTH)
        assert status == 200, body
        [r] = body["runs"]
        w1 = (await jobs())["w1"]
        assert (r["jobId"], r["attempt"], r["endedAt"]) == ("w1", 1, None), r
        kind, permit_id, slot = r["permit"].split(":")
        assert (kind, permit_id) == (w1["permit"]["kind"], w1["permit"]["id"]) and int(slot) >= 0, (r, w1)
        assert r["startedAt"] >= w1["enqueuedAt"], (r, w1)
        assert (await world.fetch("GET", "/accounts/a/queues/q/runs"))[0] == 401  # admin only

        gates.release(0)

        async def w1_done():
            return (await jobs())["w1"]["state"] == "done"

        await _settle(w1_done, "w1 done")
        [r] = (await world.fetch("GET", "/accounts/a/queues/q/runs", headers=AUTH))[1]["runs"]
        assert r["endedAt"] is not None and r["endedAt"] >= r["startedAt"], r
        states = {j: v["state"] for j, v in (await jobs()).items()}
        assert states == {"w1": "done", "x1": "running", "x2": "running", "x3": "running"}, states

    run(scenario())


def test_a_work_ms_job_cut_short_by_an_eviction_runs_again_under_the_same_permit(entry, monkeypatch):
    # R37: the attempt is persisted before the call; an eviction during the work leaves its run
    # without an end, and the next instance calls it again under the same permit (within
    # ORPHAN_CHECK_MS once the old call had been seen running): a second run record, the only
    # completed one.
    wall = _Wall(monkeypatch)
    world = World(entry, ROUND_WAIT_MS="0", ROUND_PERIOD_MS="0", ORPHAN_CHECK_MS="3000")
    first, second = _Gates(), _Gates()
    name = json.dumps(["a", "q"])

    async def scenario():
        jq = queue_object(world, "a", "q")
        assert jq.queue.orphan_check_ms == 3000
        jq.sleep = first
        body = {"id": "w1", "payload": {"workMs": 100}}
        assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", body, headers=AUTH))[0] == 201

        async def runs():
            return (await world.fetch("GET", "/accounts/a/queues/q/runs", headers=AUTH))[1]["runs"]

        async def running():
            return first.calls and await runs()

        await _settle(running, "w1's work started", obj=jq)
        await jq.alarm()  # a pump while the call is in flight: its retry moves ORPHAN_CHECK_MS on
        # The instance dies mid-work: its task goes with it, and a new instance takes the storage.
        for task in list(jq.queue._inflight.values()):
            task.cancel()
        await asyncio.sleep(0)
        ctx = world.env.JOB_QUEUE.contexts[name]
        fresh = entry.JobQueue(ctx, world.env)
        fresh.sleep = second
        world.env.JOB_QUEUE.objects[name] = fresh

        async def again():
            return second.calls

        await _settle(again, "w1 called again", obj=fresh, wall=wall)
        second.release(0)

        async def done():
            rows = await runs()
            return len(rows) == 2 and rows[1]["endedAt"] is not None and rows

        one, two = await _settle(done, "w1's second run completed", obj=fresh, wall=wall)
        assert (one["attempt"], one["endedAt"]) == (1, None), one
        assert two["attempt"] == 2 and two["permit"] == one["permit"] and two["startedAt"] >= one["startedAt"], two
        [job] = (await world.fetch("GET", "/accounts/a/queues/q"))[1]["jobs"]
        assert job["state"] == "done", job
        status, view = await world.fetch("GET", "/accounts/a/queues/q/runs", headers=AUTH)
        assert set(view["scheduler"]) == {"alarm", "due", "now"}, view

    run(scenario())


def test_the_scheduler_route_shows_the_holders_alarm_and_what_is_due(entry):
    # R16: GET /accounts/{account}/scheduler (admin) answers the holder's alarm and its
    # scheduler's due times, read only; here the job directory's prune participant.
    world = World(entry, JOB_RETENTION_MS="1000")

    async def scenario():
        assert (await world.fetch("POST", "/accounts/a/queues/q/jobs", {"id": "j1"}, headers=AUTH))[0] == 201
        assert (await world.fetch("POST", "/accounts/a/jobs/j1/complete", headers=AUTH))[0] == 200
        status, body = await world.fetch("GET", "/accounts/a/scheduler", headers=AUTH)
        done_at = directory(world)["j1"]
        assert status == 200 and body["due"] == {entry.JOB_PRUNE_TIMER: done_at + 1000}, body
        assert body["alarm"] == done_at + 1000 and body["now"] >= done_at, body
        assert (await world.fetch("GET", "/accounts/a/scheduler"))[0] == 401

    run(scenario())


def test_the_permits_route_answers_the_holders_reply_and_its_error_values(entry):
    # POST /accounts/{a}/permits sends the body to the holder as JSON text and answers the text it
    # gets (SPEC R7 "JSON text"): 200 with the reply, 400 with the holder's invalid_message.
    world = World(entry, ROUND_WAIT_MS="0", ROUND_PERIOD_MS="0")

    async def scenario():
        message = {"type": "request", "v": 1, "clientId": "c", "grants": [],
                   "demand": [{"group": "g", "count": 2, "oldestAt": 1}]}
        status, body = await world.fetch("POST", "/accounts/a/permits", message, headers=AUTH)
        assert status == 200 and [g["permits"] for g in body["grants"]] == [2], body
        status, body = await world.fetch("POST", "/accounts/a/permits", {**message, "v": 2}, headers=AUTH)
        assert status == 400 and body["error"]["code"] == "invalid_message" and body["error"]["field"] == "v", body
        status, body = await world.fetch("POST", "/accounts/a/permits", {"type": "sync", "v": 1, "clientId": "c",
                                                                          "grants": []}, headers=AUTH)
        assert status == 200 and [g["permits"] for g in body["grants"]] == [2], body

    run(scenario())
