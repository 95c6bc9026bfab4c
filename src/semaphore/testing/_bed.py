"""A holder object on the test bed: :class:`Bed` (VirtualClock + LocalContext +
DurabilityScheduler + DurabilitySemaphore + AlarmDriver) with eviction and storage reset, and
:class:`HolderSide`, the same object with the defaults the client-side tests use.

Everything runs the real library on a real SQLite database; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from typing import Any

from ..holder import GROUPS, META, DurabilitySemaphore
from ..scheduler import DurabilityScheduler
from ._inspect import check_aggregates, dump, grant_rows, lease_rows, query, tables
from ._local import T0, AlarmDriver, LocalContext, LocalStorage, VirtualClock
from ._tasks import ObjectTasks

__all__ = ["Bed", "HolderSide"]


class Bed:
    """A holder object: the ``ctx``, scheduler and semaphore an application's holder Durable
    Object would have, its ``alarm()`` fired by an :class:`AlarmDriver` on a virtual clock.

    ``Bed(limit=5, group_limit=..., ...)`` passes ``limit`` and its other keyword options to
    :class:`~semaphore.DurabilitySemaphore`. Ids are ``<id_prefix>1``, ``<id_prefix>2``, ...
    (never repeated, even across :meth:`evict` and :meth:`reset`; a lease id is that id followed
    by ``.<epoch>.<permits>.<mac>``, SPEC R32). The ``secret_factory`` bytes (per-storage lease-id
    secret and storage epoch) are deterministic (two beds of one name fed the same rounds store
    the same rows) but differ at every call, so a secret or epoch re-created instead of read
    back (e.g. after :meth:`evict`) would show. ``alarm_delay_ms`` models late alarm delivery,
    ``alarm_retries`` how often the runtime retries a raising ``alarm()``; ``name`` is the
    object's name (its ``ctx.id`` reads ``id:<name>``). ``storage`` may be any object shaped
    like ``ctx.storage`` (default: a new :class:`LocalStorage`).

    Create it inside the event loop that uses it (inside the test's coroutine)."""

    def __init__(
        self,
        limit: Any = 5,
        *,
        storage: Any = None,
        clock: VirtualClock | None = None,
        alarm_delay_ms: int = 0,
        alarm_retries: int = 6,
        name: str = "object",
        id_prefix: str = "id",
        **options: Any,
    ) -> None:
        self.clock = clock if clock is not None else VirtualClock(T0)
        #: The virtual time the bed started at.
        self.t0 = self.clock.now
        self.storage: Any = storage if storage is not None else LocalStorage()
        self.name = name
        self.ctx = LocalContext(self.storage, name=name)
        #: Keyword options of the semaphore (:meth:`evict` and :meth:`reset` may change them).
        self.options: dict[str, Any] = {"limit": limit, **options}
        self.alarm_delay_ms = alarm_delay_ms
        self.alarm_retries = alarm_retries
        self.id_prefix = id_prefix
        self._ids = itertools.count(1)
        self._secrets = itertools.count(1)
        #: Times the holder drew its lease-id secret and epoch (R32: once per storage).
        self.secrets_made = 0
        #: Times the object was evicted (:meth:`evict`, :meth:`reset`).
        self.evictions = 0
        self._alarm_at: int | None = None
        self._alarm_fires = 0
        #: Times the alarm loop guard tripped (see :meth:`alarm`); :meth:`check` asserts 0.
        self.alarm_loops = 0
        self._start()

    def _start(self) -> None:
        self.tasks = ObjectTasks()
        self.scheduler = DurabilityScheduler(self.ctx, clock=self.clock)
        self.sem = DurabilitySemaphore(
            scheduler=self.scheduler,
            clock=self.clock,
            id_factory=lambda: f"{self.id_prefix}{next(self._ids)}",
            secret_factory=self._secret,
            **self.options,
        )
        self.driver = AlarmDriver(self.clock, self.storage, self.alarm, delay_ms=self.alarm_delay_ms,
                                  max_retries=self.alarm_retries)

    def _secret(self) -> bytes:
        self.secrets_made += 1
        return hashlib.sha256(f"bed secret {self.name} {next(self._secrets)}".encode()).digest()

    @property
    def now(self) -> int:
        """The current virtual time."""
        return self.clock.now

    # ------------------------------------------------------------------ the object's methods
    async def alarm(self, info: Any = None) -> None:
        """The holder object's ``alarm()``: delegates to the scheduler.

        Guards the virtual clock against an alarm that keeps re-arming at the same instant (it
        would hang the test): after 100 fires at one instant it raises, so the driver backs off
        and time moves on; :meth:`check` then fails."""
        now = self.clock.now
        self._alarm_fires = self._alarm_fires + 1 if self._alarm_at == now else 1
        self._alarm_at = now
        if self._alarm_fires > 100:
            self.alarm_loops += 1
            raise RuntimeError(f"alarm re-armed at the same instant {now} over 100 times")
        await self.tasks.call(self.scheduler.alarm(info))

    async def handle(self, message: Any) -> dict[str, Any]:
        """The holder object's RPC method: ``sem.handle(message)`` (a request waits for its
        round). Use it as the target of a transport (see :class:`~semaphore.testing.Net`)."""
        return await self.tasks.call(self.sem.handle(message))

    async def usage(self) -> dict[str, Any]:
        """``sem.usage()``."""
        return await self.tasks.call(self.sem.usage())

    # ------------------------------------------------------------------ lifecycle
    def evict(self, **options: Any) -> None:
        """Lose the in-memory instance: every task it started (its round timer, a round in
        progress) is cancelled, so calls waiting for a round fail (SPEC R4). Then a new
        scheduler and semaphore start over the same storage, optionally with changed options."""
        self.tasks.cancel()
        self.driver.close()
        self.evictions += 1
        self.options.update(options)
        self._start()

    def reset(self, *, fresh_storage: bool = False, **options: Any) -> None:
        """A holder storage reset while clients keep their leases: ``migrate(ctx, None)`` drops
        the semaphore's tables (grants, leases, meta with the lease-id secret and epoch), or with
        ``fresh_storage`` the object gets new, empty storage (``deleteAll()``, a re-created
        holder); then a new instance starts over it (:meth:`evict`)."""
        if fresh_storage:
            self.storage = LocalStorage()
            self.ctx = LocalContext(self.storage, name=self.name)  # the same object, reset
        else:
            DurabilitySemaphore.migrate(self.ctx, None)
        self.evict(**options)

    # ------------------------------------------------------------------ driving
    def send(self, message: Any) -> asyncio.Task[dict[str, Any]]:
        """Start :meth:`handle` of ``message`` as a task (a request waits for its round)."""
        return asyncio.ensure_future(self.handle(message))

    async def settle(self) -> None:
        """Let every task that can run, run."""
        await self.clock.settle()

    async def finish(self, *tasks: asyncio.Future[Any], within_ms: int = 60_000) -> list[Any]:
        """Advance virtual time event by event until every task is done; return their results."""
        end = self.clock.now + within_ms
        await self.clock.settle()
        while not all(t.done() for t in tasks):
            t = self.clock.next_event()
            assert t is not None and t <= end, "tasks did not finish (nothing left to wait for)"
            await self.clock.advance_to(t)
        return [t.result() for t in tasks]

    async def round(self, *messages: Any) -> list[dict[str, Any]]:
        """Send messages together and run time until all are answered; return the replies."""
        tasks = [self.send(m) for m in messages]
        return await self.finish(*tasks)

    async def one(self, message: Any) -> dict[str, Any]:
        """Send one message and run time until it is answered; return the reply."""
        return (await self.round(message))[0]

    # ------------------------------------------------------------------ storage
    def grants(self) -> dict[str, dict[str, Any]]:
        """The grant rows keyed by grant id."""
        return grant_rows(self.storage)

    def leases(self) -> dict[str, dict[str, Any]]:
        """The lease rows keyed by lease id."""
        return lease_rows(self.storage)

    def dump(self) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of every table (see :func:`~semaphore.testing.dump`)."""
        return dump(self.storage)

    def charged(self) -> tuple[int, dict[str, int]]:
        """Total and per-group charged capacity (outstanding grant permits plus lease
        footprint), read straight from the holder's aggregates."""
        if META not in tables(self.storage):
            return 0, {}
        meta = {str(r["key"]): int(r["value"]) for r in query(
            self.storage, f"SELECT key, value FROM {META} WHERE key IN ('outstanding', 'lease_footprint')")}
        groups = {str(r["group_name"]): int(r["outstanding"]) + int(r["lease_footprint"])
                  for r in query(self.storage, f"SELECT * FROM {GROUPS}")}
        return meta.get("outstanding", 0) + meta.get("lease_footprint", 0), groups

    def check(self) -> dict[str, Any]:
        """:func:`~semaphore.testing.check_aggregates` on this bed's storage, and no alarm loop
        happened."""
        assert self.alarm_loops == 0, "the alarm kept re-arming at the same instant"
        return check_aggregates(self.storage)


class HolderSide(Bed):
    """The holder object of client-side tests: a :class:`Bed` named ``holder`` on a shared
    ``clock``, ids ``h1``, ``h2``, ..., and an alarm the runtime retries (almost) forever.
    ``options`` go to :class:`~semaphore.DurabilitySemaphore` (``limit`` included)."""

    def __init__(self, clock: VirtualClock, **options: Any) -> None:
        options.setdefault("name", "holder")
        options.setdefault("id_prefix", "h")
        options.setdefault("alarm_retries", 1000)
        super().__init__(clock=clock, **options)
