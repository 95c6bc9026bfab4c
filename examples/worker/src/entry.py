# src/entry.py
import asyncio
import contextlib
import json
import logging
import sys
import time
import zlib
from urllib.parse import parse_qs, urlparse

from workers import DurableObject, Response, WorkerEntrypoint

from semaphore import (
    ConfigurationError,
    DurabilityScheduler,
    DurabilitySemaphore,
    PermitTimeoutError,
    SemaphoreClient,
    SemaphoreQueue,
)
from semaphore.runtime import Storage, plain

# INFO: the holder's one JSON line per round (logger "semaphore.round") reaches `wrangler dev`'s
# console and, deployed, Workers Logs ([observability] in wrangler.toml).
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

# How a client object reaches an account's holder: env.BUDGET.getByName(account).permits(message).
limits = DurabilitySemaphore.client(binding="BUDGET", invoke=lambda stub, message: stub.permits(message))


def env_int(env, name):
    """The integer [vars] entry `name`; a missing or malformed one fails at once, naming it."""
    raw = getattr(env, name, None)
    if raw is None:
        raise ConfigurationError(f"env has no var {name!r}: set it under [vars] in wrangler.toml", field=name)
    try:
        return int(str(raw))
    except ValueError:
        raise ConfigurationError(f"var {name} must be an integer, got {raw!r}", field=name) from None


class Budget(DurableObject):
    """The holder: one per account, owns that account's limit for every Jobs object."""

    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        limit = env_int(env, "LIMIT")
        self.scheduler = DurabilityScheduler(ctx)
        self.semaphore = DurabilitySemaphore(scheduler=self.scheduler, limit=limit)

    async def permits(self, message):          # the RPC method clients call
        return await self.semaphore.handle(message)

    async def usage(self):
        return await self.semaphore.usage()

    async def alarm(self, alarm_info=None):    # must delegate to the scheduler
        await self.scheduler.alarm(alarm_info)


class Jobs(DurableObject):
    """A client object: runs jobs under permits of the account's budget. The front spreads an
    account's jobs over SHARDS of these; all of them share the one limit. One queue serves both
    ways: permit() around a block of code, and work= for jobs it runs in the background."""

    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.sql = Storage(ctx)
        self.sql.exec("CREATE TABLE IF NOT EXISTS job_runs (job TEXT PRIMARY KEY, runs INTEGER NOT NULL,"
                      " started_at INTEGER NOT NULL, finished_at INTEGER)")
        self.queue = SemaphoreQueue(client=SemaphoreClient(ctx, limits.transport(env)),
                                    scheduler=DurabilityScheduler(ctx), work=self.job)

    async def run(self, account, job, seconds):  # a permit for one block of code; waits for it
        async with contextlib.AsyncExitStack() as stack:
            permit = self.queue.permit(account, group="exports", timeout_ms=30_000)
            try:
                item = await stack.enter_async_context(permit)
            except PermitTimeoutError:         # only the acquisition: no permit within 30 s, nothing charged
                return {"error": "permit_timeout"}
            started = now_ms()
            result = await export(job, seconds)  # holds the permit; leaving the block releases it
            return {"account": account, "job": job, "result": result, "item": item.item_id,
                    "started_at": started, "finished_at": now_ms()}

    async def submit(self, account, job, seconds):  # queue a job and return at once; idempotent on job
        await self.queue.enqueue(account, "exports", job, {"seconds": seconds})
        return await self.status(job)

    async def job(self, item):                 # work=: run by the queue once the item holds a permit
        self.sql.exec("INSERT INTO job_runs VALUES (?, 1, ?, NULL) ON CONFLICT(job) DO UPDATE"
                      " SET runs = runs + 1, started_at = excluded.started_at", item.item_id, now_ms())
        await export(item.item_id, item.payload["seconds"])
        self.sql.exec("UPDATE job_runs SET finished_at = ? WHERE job = ?", now_ms(), item.item_id)
        # returning completes the item: its permit is released

    async def status(self, job):               # the job's item as the queue sees it, and its runs
        item = self.queue.item(job)
        if item is None:
            return {"job": job, "state": "unknown"}
        run = self.sql.one("SELECT runs, started_at, finished_at FROM job_runs WHERE job = ?", job) or {}
        return {"job": job, "state": item.state.value,   # queued, claiming, running or done
                "permit": item.permit.kind.value if item.permit else None,     # grant or lease
                "blocked": item.blocked.reason.value if item.blocked else None,  # while queued: why
                "runs": run.get("runs", 0), "started_at": run.get("started_at"),
                "finished_at": run.get("finished_at"), "error": item.error}

    async def alarm(self, alarm_info=None):
        await self.queue.scheduler.alarm(alarm_info)


async def export(job, seconds):
    await asyncio.sleep(seconds)               # your work here
    return f"{job} exported"


def now_ms():
    return int(time.time() * 1000)


def json_response(data, status=200):
    return Response(json.dumps(data), status=status, headers={"content-type": "application/json"})


def jobs_of(env, account, job):
    """The Jobs object of `job`: one of the account's SHARDS, chosen by the job id (so a job's
    status is found where it runs). Every shard asks the same holder, BUDGET/<account>."""
    shard = zlib.crc32(job.encode()) % env_int(env, "SHARDS")
    return env.JOBS.getByName(f"{account}:{shard}")


class Default(WorkerEntrypoint):
    """POST /run?account=A&job=J&seconds=S runs job J under a permit of A's budget, answers when done;
    POST /submit?account=A&job=J&seconds=S queues job J and answers at once;
    GET /job?account=A&job=J shows it; GET /usage?account=A is the holder's usage()."""

    async def fetch(self, request):
        url = urlparse(request.url)
        query = {name: values[0] for name, values in parse_qs(url.query).items()}
        account, job = query.get("account"), query.get("job", "job")
        if not account:
            return json_response({"error": "account is required"}, 400)
        try:
            seconds = float(query.get("seconds", 0.1))
            if request.method == "POST" and url.path == "/run":
                reply = plain(await jobs_of(self.env, account, job).run(account, job, seconds))
                return json_response(reply, 504 if "error" in reply else 200)
            if request.method == "POST" and url.path == "/submit":
                return json_response(plain(await jobs_of(self.env, account, job).submit(account, job, seconds)), 202)
            if request.method == "GET" and url.path == "/job":
                return json_response(plain(await jobs_of(self.env, account, job).status(job)))
            if request.method == "GET" and url.path == "/usage":
                return json_response(plain(await self.env.BUDGET.getByName(account).usage()))
        except ConfigurationError as exc:      # e.g. a var missing from wrangler.toml: say which
            return json_response({"error": "configuration", "message": exc.message, "field": exc.field}, 500)
        except ValueError:
            return json_response({"error": "seconds must be a number"}, 400)
        return json_response({"error": "not found"}, 404)
