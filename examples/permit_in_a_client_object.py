"""The permit API in a client object: ``async with queue.permit(...)`` around a block of code.

The composition (runnable on CPython: ``python examples/permit_in_a_client_object.py``):

* ``Budget`` - the holder object, one per account (the semaphore key), limit 2.
* ``Exporter`` - a client object whose ``export()`` runs each job inside
  ``async with self.queue.permit(account, group="exports", timeout_ms=...)``: a queue used only
  for permits needs no ``on_admit``. The body runs only once the permit is confirmed (R15a).
* Leaving the block releases the permit durably, whether the body returns or raises (the
  exception still reaches the caller). With ``timeout_ms``, no permit in time raises
  ``PermitTimeoutError``; its ``.blocked`` is the holder's reason (here ``limit``) and the
  request is withdrawn, so nothing stays charged for it.

Two exporters share the account's budget: four jobs, at most two run at once. Here every object
runs in one process on the :mod:`semaphore.testing` kit (real SQLite, virtual time, the kit's
alarm driver). In a Worker the objects subclass ``workers.DurableObject``, the namespace comes
from ``env`` (``binding="BUDGET"``) and the runtime fires ``alarm()``.
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
    PermitTimeoutError,
    SemaphoreClient,
    SemaphoreQueue,
)
from semaphore.testing import LocalContext, Namespace, TaskAlarmDriver, VirtualClock  # noqa: E402

clock = VirtualClock(1_700_000_000_000)
running: set[str] = set()
most_at_once = 0


def say(text: str) -> None:
    print(f"[t={(clock.now - 1_700_000_000_000) / 1000:6.1f}s] {text}")


class Budget:
    """The holder object (a DurableObject in a Worker): one per account, limit 2."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.scheduler = DurabilityScheduler(ctx, clock=clock)
        self.semaphore = DurabilitySemaphore(scheduler=self.scheduler, limit=2, clock=clock)
        self.driver = TaskAlarmDriver(clock, ctx.storage, self.alarm)  # the runtime's alarm

    async def permits(self, message: dict) -> dict:  # the RPC method clients call
        return await self.semaphore.handle(message)

    async def alarm(self, info: Any = None) -> None:
        await self.scheduler.alarm(info)


BUDGET = Namespace(lambda name: Budget(LocalContext(name=name)))  # env.BUDGET: getByName -> stub
limits = DurabilitySemaphore.client(namespace=BUDGET, invoke=lambda stub, message: stub.permits(message))


class Exporter:
    """A client object (a DurableObject in a Worker): runs each export under one permit."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.scheduler = DurabilityScheduler(ctx, clock=clock)
        self.queue = SemaphoreQueue(client=SemaphoreClient(ctx, limits.transport(None), clock=clock),
                                    scheduler=self.scheduler)  # permits only: no on_admit
        self.driver = TaskAlarmDriver(clock, ctx.storage, self.alarm)

    async def export(self, account: str, job: str, seconds: int, *, timeout_ms: int | None = None,
                     fail: bool = False) -> str:
        global most_at_once
        try:
            async with self.queue.permit(account, group="exports", timeout_ms=timeout_ms) as item:
                running.add(job)
                most_at_once = max(most_at_once, len(running))
                say(f"{job}: permit ({item.permit.kind.value}), running for {seconds} s; running now: "
                    f"{sorted(running)}")
                try:
                    await clock.sleep(seconds * 1000)  # the work
                    if fail:
                        raise RuntimeError("the export failed")
                finally:
                    running.discard(job)
            say(f"{job}: done, permit released")
            return "done"
        except PermitTimeoutError as exc:
            reason = exc.blocked.reason.value if exc.blocked else "not said"
            waiting = exc.blocked.waiting if exc.blocked else "?"
            say(f"{job}: PermitTimeoutError after {timeout_ms} ms (blocked: {reason}, {waiting} waiting);"
                " nothing stays charged")
            return "timeout"
        except RuntimeError as exc:  # raised in the body: the block released the permit first
            say(f"{job}: raised {type(exc).__name__} ({exc}); leaving the block released its permit,"
                " the error goes on to the caller")
            raise

    async def alarm(self, info: Any = None) -> None:
        await self.scheduler.alarm(info)


async def main() -> None:
    logging.disable(logging.CRITICAL)
    holder = BUDGET.getByName("acct-7")
    one, two = Exporter(LocalContext(name="exporter-1")), Exporter(LocalContext(name="exporter-2"))
    say("exporter-1 starts job-a (4 s) and job-b (2 s, raises); exporter-2 job-c (3 s) and"
        " job-d (gives up after 2.5 s); limit 2")
    tasks = {"job-a": asyncio.ensure_future(one.export("acct-7", "job-a", 4)),
             "job-b": asyncio.ensure_future(one.export("acct-7", "job-b", 2, fail=True))}
    await clock.advance(500)
    tasks["job-c"] = asyncio.ensure_future(two.export("acct-7", "job-c", 3))
    tasks["job-d"] = asyncio.ensure_future(two.export("acct-7", "job-d", 1, timeout_ms=2_500))
    while not all(t.done() for t in tasks.values()):
        await clock.advance(250)
    await clock.advance(15_000)  # releases reach the holder; unclaimed grant permits come back
    usage = await holder.semaphore.usage()
    say(f"most running at once: {most_at_once} (limit 2)")
    say(f"holder usage at the end: outstanding {usage['outstanding']}, charged {usage['charged']},"
        f" available {usage['available']}")
    results = {job: (t.result() if t.exception() is None else "raised") for job, t in tasks.items()}
    say(f"results: {results}")
    assert most_at_once <= 2 and usage["outstanding"] == 0 and usage["charged"] == 0
    assert results == {"job-a": "done", "job-b": "raised", "job-c": "done", "job-d": "timeout"}, results


if __name__ == "__main__":
    asyncio.run(main())
