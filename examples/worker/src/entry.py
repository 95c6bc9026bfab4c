# src/entry.py
import asyncio
import contextlib
import json
import time
from urllib.parse import parse_qs, urlparse

from workers import DurableObject, Response, WorkerEntrypoint

from semaphore import (
    DurabilityScheduler,
    DurabilitySemaphore,
    PermitTimeoutError,
    SemaphoreClient,
    SemaphoreQueue,
)
from semaphore.runtime import Storage, plain

# How a client object reaches a key's holder: env.BUDGET.getByName(key).permits(message).
limits = DurabilitySemaphore.client(binding="BUDGET", invoke=lambda stub, message: stub.permits(message))


class Budget(DurableObject):
    """The holder: one per key, owns that key's limit."""

    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.scheduler = DurabilityScheduler(ctx)
        self.semaphore = DurabilitySemaphore(scheduler=self.scheduler, limit=lambda: int(env.LIMIT))

    async def permits(self, message):          # the RPC method clients call
        return await self.semaphore.handle(message)

    async def usage(self):
        return await self.semaphore.usage()

    async def alarm(self, alarm_info=None):    # must delegate to the scheduler
        await self.scheduler.alarm(alarm_info)


class Jobs(DurableObject):
    """A client object: runs jobs under permits of the key's budget. One queue serves both ways:
    permit() around a block of code, and work= for jobs it runs in the background."""

    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.sql = Storage(ctx)
        self.sql.exec("CREATE TABLE IF NOT EXISTS job_runs (job TEXT PRIMARY KEY, runs INTEGER NOT NULL,"
                      " started_at INTEGER NOT NULL, finished_at INTEGER)")
        self.queue = SemaphoreQueue(client=SemaphoreClient(ctx, limits.transport(env)),
                                    scheduler=DurabilityScheduler(ctx), work=self.job)

    async def run(self, key, job):             # a permit for one block of code; waits for it
        async with contextlib.AsyncExitStack() as stack:
            permit = self.queue.permit(key, group="default", timeout_ms=30_000)
            try:
                item = await stack.enter_async_context(permit)
            except PermitTimeoutError:         # only the acquisition: no permit within 30 s, nothing charged
                return {"error": "permit_timeout"}
            result = await do_the_work(job)    # holds the permit; leaving the block releases it
            return {"key": key, "job": job, "result": result, "item": item.item_id}

    async def submit(self, key, job, seconds):  # queue a job and return at once; idempotent on job
        await self.queue.enqueue(key, "default", job, {"seconds": seconds})
        return await self.status(job)

    async def job(self, item):                 # work=: run by the queue once the item holds a permit
        self.sql.exec("INSERT INTO job_runs VALUES (?, 1, ?, NULL) ON CONFLICT(job) DO UPDATE"
                      " SET runs = runs + 1, started_at = excluded.started_at", item.item_id, now_ms())
        await asyncio.sleep(item.payload["seconds"])   # your work here
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


async def do_the_work(job):
    await asyncio.sleep(0.1)                       # your work here
    return f"{job} done"


def now_ms():
    return int(time.time() * 1000)


def json_response(data, status=200):
    return Response(json.dumps(data), status=status, headers={"content-type": "application/json"})


class Default(WorkerEntrypoint):
    """POST /run?key=K&job=J runs one job under a permit of K's budget and answers when done;
    POST /submit?key=K&job=J&seconds=S queues job J (S seconds of work) and answers at once;
    GET /job?key=K&job=J shows it; GET /usage?key=K is the holder's usage()."""

    async def fetch(self, request):
        url = urlparse(request.url)
        query = {name: values[0] for name, values in parse_qs(url.query).items()}
        key = query.get("key")
        if not key:
            return json_response({"error": "key is required"}, 400)
        jobs = self.env.JOBS.getByName(key)
        if request.method == "POST" and url.path == "/run":
            reply = plain(await jobs.run(key, query.get("job", "job")))
            return json_response(reply, 504 if "error" in reply else 200)
        if request.method == "POST" and url.path == "/submit" and "job" in query:
            seconds = float(query.get("seconds", 1))
            return json_response(plain(await jobs.submit(key, query["job"], seconds)), 202)
        if request.method == "GET" and url.path == "/job" and "job" in query:
            return json_response(plain(await jobs.status(query["job"])))
        if request.method == "GET" and url.path == "/usage":
            return json_response(plain(await self.env.BUDGET.getByName(key).usage()))
        return json_response({"error": "not found"}, 404)
