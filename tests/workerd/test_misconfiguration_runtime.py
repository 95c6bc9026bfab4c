"""Misconfiguration on the real runtime, tier 3: each fails at once with a ConfigurationError that
names it, at the client, never retried as if the holder were down.

A small Worker (written into a temporary folder, with this checkout's ``semaphore`` and the
vendored SDK) binds four namespaces: a proper holder, a holder class whose migration lists it
under ``new_classes`` (no SQLite storage), a class that is not a holder (no ``permits``), and a
holder whose constructor reads a var the ``env`` does not have. ``GET /<BINDING>`` sends one
``sync`` through the client helper (with ``retry(3)``: a ConfigurationError is not retried) and
answers the exception's type, field and message. What the runtime says in each case (seen on
workerd 1.20261117.1): "SQL is not enabled for this Durable Object class" from
``sql.exec``; "TypeError: Method permits does not exist"; a JsException whose message holds the
callee's Python traceback, ``semaphore.errors.ConfigurationError: ...`` on its last line.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from .small_worker import small_worker

pytestmark = pytest.mark.workerd

WRANGLER_TOML = """
name = "misconfigured"
main = "src/entry.py"
compatibility_date = "2026-11-01"
compatibility_flags = ["python_workers"]

[[durable_objects.bindings]]
name = "GOOD"
class_name = "Good"
[[durable_objects.bindings]]
name = "NO_SQL"
class_name = "NoSqlHolder"
[[durable_objects.bindings]]
name = "NOT_HOLDER"
class_name = "NotHolder"
[[durable_objects.bindings]]
name = "NO_VAR"
class_name = "NeedsVar"

[[migrations]]
tag = "v1"
new_sqlite_classes = ["Good", "NotHolder", "NeedsVar"]
new_classes = ["NoSqlHolder"]
"""

ENTRY = '''
import json
from urllib.parse import urlparse

from workers import DurableObject, Response, WorkerEntrypoint

from semaphore import ConfigurationError, DurabilityScheduler, DurabilitySemaphore, retry


class Good(DurableObject):
    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.scheduler = DurabilityScheduler(ctx)
        self.semaphore = DurabilitySemaphore(scheduler=self.scheduler, limit=self.limit(env))

    def limit(self, env):
        return 2

    async def permits(self, message):
        return await self.semaphore.handle(message)

    async def alarm(self, alarm_info=None):
        await self.scheduler.alarm(alarm_info)


class NoSqlHolder(Good):
    pass


class NeedsVar(Good):
    def limit(self, env):
        if getattr(env, "LIMIT", None) is None:
            raise ConfigurationError("env has no var 'LIMIT': set it under [vars]", field="LIMIT")
        return int(env.LIMIT)


class NotHolder(DurableObject):
    async def status(self, job):
        return {"job": job}


class Default(WorkerEntrypoint):
    async def fetch(self, request):
        binding = urlparse(request.url).path.strip("/")
        helper = DurabilitySemaphore.client(binding=binding, invoke=lambda stub, m: stub.permits(m)).with_(retry(3))
        try:
            reply = await helper.request(self.env, "acme", {"type": "sync", "v": 1, "clientId": "c", "grants": []})
            out = {"type": None, "reply": list(reply)}
        except Exception as exc:
            out = {"type": type(exc).__name__, "field": getattr(exc, "field", None), "message": str(exc)}
        return Response(json.dumps(out), headers={"content-type": "application/json"})
'''


@pytest.fixture(scope="module")
def misconfigured(workerd_runtime, workerd_bin, tmp_path_factory):
    if workerd_runtime["skip"]:
        pytest.skip(workerd_runtime["skip"])
    with small_worker(tmp_path_factory.mktemp("misconfigured"), WRANGLER_TOML, ENTRY, workerd_bin) as proc:
        yield proc


def ask(proc, binding: str) -> tuple[dict, float]:
    started = time.monotonic()
    with urllib.request.urlopen(f"{proc.url}/{binding}", timeout=60) as response:
        return json.loads(response.read()), time.monotonic() - started


def test_the_proper_holder_answers(misconfigured):
    answer, _ = ask(misconfigured, "GOOD")
    assert answer["type"] is None and "grants" in answer["reply"], answer


@pytest.mark.parametrize("binding, field, words", [
    ("NO_SQL", "migrations", "the Durable Object class NoSqlHolder has no SQLite storage: list NoSqlHolder under "
                             "new_sqlite_classes"),
    ("NOT_HOLDER", "binding", "Method permits does not exist"),
    ("NO_VAR", "holder", "env has no var 'LIMIT'"),
])
def test_a_misconfigured_holder_is_a_configuration_error_at_the_client(misconfigured, binding, field, words):
    answer, seconds = ask(misconfigured, binding)
    print(f"\nGET /{binding} ({seconds * 1000:.0f} ms): {answer}")
    assert answer["type"] == "ConfigurationError" and answer["field"] == field, answer
    assert words in answer["message"] and f"env.{binding}" in answer["message"], answer
