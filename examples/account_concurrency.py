"""Account concurrency: at most N jobs of an account run at once, across many client objects.

The composition (runnable on CPython: ``python examples/account_concurrency.py``):

* ``AccountLimit`` - the holder object, one per account (the semaphore key), limit 2.
* ``JobRunner`` - a client object that queues jobs with a :class:`SemaphoreQueue` and starts
  them in an external "job system" (here a dict standing in for a workflow engine).
* Retry-safe admission: the queue item id *is* the job id. A retried ``enqueue`` queues once; a
  retried admission callback (it crashed after starting the job, or the object was evicted) is
  called for the same item under the same permit, and the job system starts a job id only once.
  So no job ever runs twice under two permits.
* Reconciliation after a lost completion notice: items running longer than
  ``reconcile_after_ms`` are checked with ``check_running`` (ask the job system); a job that is
  gone is completed, returning its permit.

Here both objects run in one process on the :mod:`semaphore.testing` bed (real SQLite, virtual
time). In a Worker, ``AccountLimit`` and ``JobRunner`` subclass ``workers.DurableObject``, the
namespace comes from ``env`` (``binding="ACCOUNT_LIMIT"``) and ``alarm()`` is the runtime's.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from semaphore import (  # noqa: E402
    DurabilityScheduler,
    DurabilitySemaphore,
    QueueItem,
    SemaphoreClient,
    SemaphoreQueue,
    timeout,
)
from semaphore.testing import LocalContext, Namespace, VirtualClock  # noqa: E402

clock = VirtualClock(1_700_000_000_000)


def say(text: str) -> None:
    print(f"[t={(clock.now - 1_700_000_000_000) / 1000:6.1f}s] {text}")


# ------------------------------------------------------------------------------ the holder
class AccountLimit:
    """The holder object (a DurableObject in a Worker): one per account."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.scheduler = DurabilityScheduler(ctx, clock=clock)
        self.semaphore = DurabilitySemaphore(scheduler=self.scheduler, limit=2, clock=clock)

    async def permits(self, message: dict) -> dict:  # the RPC method
        return await self.semaphore.handle(message)

    async def alarm(self, info: Any = None) -> None:
        await self.scheduler.alarm(info)


ACCOUNT_LIMIT = Namespace(lambda name: AccountLimit(LocalContext(name=name)))  # env.ACCOUNT_LIMIT: getByName -> stub
limits = DurabilitySemaphore.client(namespace=ACCOUNT_LIMIT, invoke=lambda stub, msg: stub.permits(msg))


# ------------------------------------------------------------------------------ a job system
class JobSystem:
    """An external system that runs jobs; starting a job id twice is a no-op (idempotent)."""

    def __init__(self) -> None:
        self.running: dict[str, int] = {}
        self.starts: dict[str, int] = {}
        self.max_running = 0

    def start(self, job_id: str, seconds: int) -> bool:
        if job_id in self.starts:
            return False
        self.starts[job_id] = 1
        self.running[job_id] = clock.now + seconds * 1000
        self.max_running = max(self.max_running, len(self.running))
        return True

    def finished(self) -> list[str]:
        done = [j for j, end in self.running.items() if end <= clock.now]
        for j in done:
            del self.running[j]
        return done


jobs = JobSystem()


# ------------------------------------------------------------------------------ the client
class JobRunner:
    """A client object (a DurableObject in a Worker) that queues jobs of one account."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.crash_once = {"job-2"}
        self.scheduler = DurabilityScheduler(ctx, clock=clock)
        self.client = SemaphoreClient(ctx, limits.with_(timeout(5_000, clock=clock)).transport(None), clock=clock)
        self.queue = SemaphoreQueue(
            client=self.client, scheduler=self.scheduler, on_admit=self.start_job,
            reconcile_after_ms=20_000, check_running=self.job_is_running, clock=clock)

    async def submit(self, account: str, job_id: str, seconds: int) -> None:
        await self.queue.enqueue(account, "default", job_id, {"seconds": seconds})

    async def start_job(self, item: QueueItem) -> None:
        started = jobs.start(item.item_id, item.payload["seconds"])
        say(f"admit {item.item_id} under {item.permit.kind.value} {item.permit.id}#{item.permit.slot}"
            f" (attempt {item.attempts}): {'started' if started else 'already running, not started again'}")
        if item.item_id in self.crash_once:
            self.crash_once.discard(item.item_id)
            raise RuntimeError("crashed after starting the job")

    def job_is_running(self, item: QueueItem) -> bool:
        running = item.item_id in jobs.running
        say(f"reconcile {item.item_id}: {'still running' if running else 'gone -> release its permit'}")
        return running

    async def job_finished(self, job_id: str) -> None:  # the job system's completion notice
        await self.queue.complete(job_id)

    async def alarm(self, info: Any = None) -> None:
        await self.scheduler.alarm(info)


# ------------------------------------------------------------------------------ the "runtime"
async def run_alarms(objects: list[Any], stop: asyncio.Event) -> None:
    """Fire each object's alarm when virtual time reaches it (as a task: the runtime lets time
    pass while an alarm handler waits for a holder round)."""
    busy: dict[int, asyncio.Task[Any]] = {}
    while not stop.is_set():
        for obj in objects:
            at = obj.ctx.storage.alarm
            task = busy.get(id(obj))
            if at is not None and at <= clock.now and (task is None or task.done()):
                await obj.ctx.storage.deleteAlarm()  # the runtime clears an alarm it fires
                busy[id(obj)] = asyncio.ensure_future(obj.alarm())
        await asyncio.sleep(0)


async def main() -> None:
    logging.disable(logging.CRITICAL)
    runner = JobRunner(LocalContext(name="runner-1"))
    holder = ACCOUNT_LIMIT.getByName("acct-42")
    stop = asyncio.Event()
    driver = asyncio.ensure_future(run_alarms([runner, holder], stop))

    say("submit job-1..job-4 (limit 2); job-3 is submitted twice (a retried enqueue)")
    for job_id, seconds in [("job-1", 3), ("job-2", 5), ("job-3", 4), ("job-4", 2)]:
        await runner.submit("acct-42", job_id, seconds)
    await runner.submit("acct-42", "job-3", 4)
    lost_notice = "job-1"
    for _ in range(120):
        await clock.advance(500)
        for job_id in jobs.finished():
            if job_id == lost_notice:
                say(f"{job_id} finished, but its completion notice is lost")
                continue
            say(f"{job_id} finished -> complete()")
            await runner.job_finished(job_id)
    usage = await holder.semaphore.usage()
    say(f"all done: starts per job {jobs.starts}, most running at once {jobs.max_running}")
    say(f"holder usage: outstanding {usage['outstanding']}, lease footprint {usage['leaseFootprint']}")
    assert jobs.max_running <= 2 and all(n == 1 for n in jobs.starts.values()) and usage["outstanding"] == 0
    stop.set()
    await driver


if __name__ == "__main__":
    asyncio.run(main())
