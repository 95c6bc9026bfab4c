"""Tier 1: the reference Worker's (src/entry.py) storage and exposure rules on host CPython.

Host CPython cannot import the Workers SDK, so a minimal stand-in ``workers`` module (the three
names entry.py imports) is installed for the import, and objects run on the library's test bed
(:class:`semaphore.testing.LocalContext`, real SQLite). RPC between objects is a direct call;
tier 2 (tests/pyodide/py/test_http_front.py, test_job_queue.py) runs the same rules with the
real SDK. Checked here: reads never create storage, job payloads need the admin token, every
error value carries ``"v": 1``, and the job directory forgets finished jobs after the retention.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import types
from urllib.parse import urlparse

import pytest

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
        self.env = types.SimpleNamespace(ACCOUNT_CONCURRENCY="7", ADMIN_TOKEN=TOKEN, **vars)
        self.env.ACCOUNT_LIMIT = _Namespace(self.env, entry.AccountLimit)
        self.env.JOB_QUEUE = _Namespace(self.env, entry.JobQueue)
        self.entry = entry

    async def fetch(self, method: str, path: str, body=None, headers=None):
        req = _Request("http://w" + path, method, headers or {}, "" if body is None else json.dumps(body))
        assert urlparse(req.url).path == path
        resp = await self.entry.Default(None, self.env).fetch(req)
        return resp.status, json.loads(resp.body)


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

    run(scenario())
    assert world.env.ACCOUNT_LIMIT.tables("ghost") == []
    assert world.env.JOB_QUEUE.tables(json.dumps(["ghost", "q"])) == []
    assert world.env.ACCOUNT_LIMIT.contexts["ghost"].storage.alarm is None


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
        later = rows["j1"] + 1001
        holder.scheduler.clock = lambda: later
        await holder.alarm()
        rows = dict(ctx.storage.connection.execute("SELECT job_id, done_at FROM app_job_directory").fetchall())
        assert rows == {"j2": None}
        assert ctx.storage.alarm is None  # nothing left to prune

    run(scenario())
