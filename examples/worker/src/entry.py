# src/entry.py
import asyncio
import json
from urllib.parse import parse_qs, urlparse

from workers import DurableObject, Response, WorkerEntrypoint

from semaphore import (
    DurabilityScheduler,
    DurabilitySemaphore,
    PermitTimeoutError,
    SemaphoreClient,
    SemaphoreQueue,
)
from semaphore.runtime import plain

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
    """A client object: runs each job under a permit of the key's budget."""

    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.queue = SemaphoreQueue(client=SemaphoreClient(ctx, limits.transport(env)),
                                    scheduler=DurabilityScheduler(ctx))

    async def run(self, key, job):
        try:
            async with self.queue.permit(key, group="default", timeout_ms=30_000) as item:
                result = await do_the_work(job)
                return {"key": key, "job": job, "result": result, "item": item.item_id}
        except PermitTimeoutError:                 # no permit within 30 s; nothing is charged
            return {"error": "permit_timeout"}

    async def alarm(self, alarm_info=None):
        await self.queue.scheduler.alarm(alarm_info)


async def do_the_work(job):
    await asyncio.sleep(0.1)                       # your work here
    return f"{job} done"


def json_response(data, status=200):
    return Response(json.dumps(data), status=status, headers={"content-type": "application/json"})


class Default(WorkerEntrypoint):
    """POST /run?key=K&job=J runs one job under a permit of K's budget; GET /usage?key=K."""

    async def fetch(self, request):
        url = urlparse(request.url)
        query = {name: values[0] for name, values in parse_qs(url.query).items()}
        key = query.get("key")
        if not key:
            return json_response({"error": "key is required"}, 400)
        if request.method == "POST" and url.path == "/run":
            reply = plain(await self.env.JOBS.getByName(key).run(key, query.get("job", "job")))
            return json_response(reply, 504 if "error" in reply else 200)
        if request.method == "GET" and url.path == "/usage":
            return json_response(plain(await self.env.BUDGET.getByName(key).usage()))
        return json_response({"error": "not found"}, 404)
