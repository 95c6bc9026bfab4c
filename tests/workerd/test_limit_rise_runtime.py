"""Tier 3: a limit that rises serves a held request by itself (SPEC R9 decision "limits that
rise") in the real workerd.

A Worker of its own (written into an empty folder outside the checkout and vendored the offline
way, as ``test_readme_worker.py`` does): a holder whose ``limit`` is a callable over a value the
application changes through an RPC method that does NOT call ``start_round()``, with waiting
requests on (``hold_blocked_ms``; each client object's queue ``request_wait_ms``), both 60 s.

Two exports under a limit of 1: the first holds its permit for 150 s, so the second's request is
held open at the holder. The limit is then raised to 2. The holder's own check (an asyncio task
of the Durable Object, every ``round_period_ms``) finds the rise and starts the round that serves
the held request, so the second export finishes while the first one still runs. Without the check
the held request would wait for the first export's release (150 s) or its 60 s deadline. The order
of the two events decides (the rise must serve the second export within the first one's 150 s,
which only a machine stalled for minutes could miss); the first export's own answer is not
waited for.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sample_worker import built_wheel, create_sample

from .test_runtime_wide import front_of

pytestmark = pytest.mark.workerd

ROUND_LINE = re.compile(r'\{"at":\d+,"durationMs".*?"error":(?:null|"[^"]*")\}')

WRANGLER = """\
name = "limit-rise"
main = "src/entry.py"
compatibility_date = "2026-11-01"
compatibility_flags = ["python_workers"]

[[durable_objects.bindings]]
name = "ACCOUNT_LIMIT"
class_name = "AccountLimit"

[[durable_objects.bindings]]
name = "EXPORTS"
class_name = "Exports"

[[migrations]]
tag = "v1"
new_sqlite_classes = ["AccountLimit", "Exports"]

[python_modules]
exclude = ["**/*.pyc", "semaphore/testing/**", "semaphore/simulate/**"]
"""

ENTRY = """\
import asyncio
import logging
import sys
from urllib.parse import urlparse

from workers import DurableObject, Response, WorkerEntrypoint

from semaphore import DurabilityScheduler, DurabilitySemaphore, SemaphoreClient, SemaphoreQueue
from semaphore.runtime import plain

logging.basicConfig(stream=sys.stdout, level=logging.INFO)

limits = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke="permits")
WAIT_MS = 60_000


class AccountLimit(DurableObject):
    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.limit = 1
        self.scheduler = DurabilityScheduler(ctx)
        self.semaphore = DurabilitySemaphore(scheduler=self.scheduler, limit=lambda: self.limit, leases=None,
                                             hold_blocked_ms=WAIT_MS, round_wait_ms=200, round_period_ms=1000)

    async def permits(self, message):
        return await self.semaphore.handle(message)

    async def set_limit(self, limit):
        self.limit = int(limit)  # no start_round(): the holder finds the rise itself
        return self.limit

    async def alarm(self, alarm_info=None):
        await self.scheduler.alarm(alarm_info)


class Exports(DurableObject):
    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.queue = SemaphoreQueue(client=SemaphoreClient(ctx, limits.transport(env)),
                                    scheduler=DurabilityScheduler(ctx), request_wait_ms=WAIT_MS)

    async def export(self, account, name, seconds):
        async with self.queue.permit(account, group="exports", timeout_ms=120_000):
            await asyncio.sleep(float(seconds))
            return f"{name} exported"

    async def alarm(self, alarm_info=None):
        await self.queue.scheduler.alarm(alarm_info)


class Default(WorkerEntrypoint):
    async def fetch(self, request):
        parts = urlparse(request.url).path.split("/")
        if request.method == "PUT" and len(parts) == 4 and parts[1] == "limit":
            return Response(str(plain(await self.env.ACCOUNT_LIMIT.getByName(parts[2]).set_limit(int(parts[3])))))
        if request.method == "POST" and len(parts) == 5 and parts[1] == "exports":
            _, _, account, name, seconds = parts
            exports = self.env.EXPORTS.getByName(f"{account}/{name}")
            return Response(plain(await exports.export(account, name, seconds)))
        return Response("not found", status=404)
"""


def test_a_raised_limit_serves_a_held_request_without_start_round(workerd_runtime, workerd_bin, tmp_path_factory):
    project = create_sample(tmp_path_factory.mktemp("limit-rise") / "app", built_wheel(),
                            {"wrangler.toml": WRANGLER, "src/entry.py": ENTRY})
    with front_of(workerd_runtime, workerd_bin, project.wrangler_toml, tmp_path_factory.mktemp("run"), {}) as front:

        def export(name: str, seconds: float) -> tuple[int, str]:
            status, body = front.proc.request(f"/exports/acme/{name}/{seconds}", method="POST", timeout=180)
            return status, body.decode()

        pool = ThreadPoolExecutor(2)
        try:
            first = pool.submit(export, "first", 150)
            rounds_seen = 0
            while rounds_seen < 1 and not first.done():  # the first export holds the one permit
                rounds_seen = len(ROUND_LINE.findall(front.proc.logs))
                time.sleep(0.2)
            second = pool.submit(export, "second", 0.1)
            while not second.done() and not _held(front.proc.logs):  # its request is held open
                time.sleep(0.2)
            assert not second.done() and not first.done(), (second.done(), first.done())
            assert front.proc.request("/limit/acme/2", method="PUT", timeout=60) == (200, b"2")
            answer = second.result()
            # The first export still holds its permit (for 150 s): the held request was served by
            # the rise, not by its release. Its own answer is not waited for: workerd stops here.
            assert not first.done(), first.result()
            logs = front.proc.logs
        finally:
            front.proc.kill()  # not SIGTERM: workerd would wait for the first export's call to end
            pool.shutdown(wait=False, cancel_futures=True)
    assert answer == (200, "second exported"), answer
    rounds = [json.loads(m.group(0)) for m in ROUND_LINE.finditer(logs)]
    assert not any(r["failed"] for r in rounds), rounds
    assert max(r["charged"] for r in rounds) == 2, rounds  # both permits out at once, never more


def _held(logs: str) -> bool:
    """A round left the second export's demand blocked by the limit (it is then held open)."""
    return any(json.loads(m.group(0))["blocked"].get("limit", 0) > 0 for m in ROUND_LINE.finditer(logs))
