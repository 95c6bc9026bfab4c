"""Test bed for the client side (tier 1): a real holder and real clients on SQLite, connected by
an in-memory transport that can lose, duplicate, delay and reorder messages.

* :class:`HolderSide` - a holder object (scheduler + DurabilitySemaphore + AlarmDriver) with
  :meth:`HolderSide.evict` (cancels the in-memory round, so waiting calls fail, SPEC R4).
* :class:`Net` - the transport ``async (key, message) -> reply``. Every delivery runs in its own
  task (a client that is evicted or gives up does not stop a message already sent). Faults:
  ``lose_request`` (never delivered, or delivered late: reordered after newer messages),
  ``lose_reply`` (delivered, answer lost), ``duplicate`` (delivered twice, the copy possibly
  late), ``delay`` (both ways). The caller sees a lost message as HolderUnavailableError.
* :class:`TaskAlarmDriver` - fires a client object's alarm as a task, so virtual time can pass
  while the handler waits for a holder round (the runtime runs alarms concurrently with time);
  alarms never overlap; a handler that raises or is cancelled by eviction is retried with backoff.
* :class:`ClientSide` - a client object: SemaphoreClient + DurabilityScheduler + SemaphoreQueue,
  with :meth:`ClientSide.evict`.
* :func:`async_test` - run an ``async def`` test on a fresh loop (pytest-asyncio is not used).

Nothing here mocks the library under test.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import random
from typing import Any, Awaitable, Callable

from semaphore import (
    DurabilityScheduler,
    DurabilitySemaphore,
    HolderUnavailableError,
    SemaphoreClient,
    SemaphoreQueue,
)
from semaphore.testing import AlarmDriver, LocalContext, LocalStorage, VirtualClock

T0 = 1_700_000_000_000


def async_test(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


class SimClock(VirtualClock):
    """VirtualClock whose ``settle`` stops as soon as the event loop has nothing ready to run
    (instead of always yielding 50 times); same semantics, much faster simulations."""

    @staticmethod
    async def settle(rounds: int = 50) -> None:
        loop = asyncio.get_running_loop()
        ready = getattr(loop, "_ready", None)
        idle = 0
        for _ in range(rounds):
            await asyncio.sleep(0)
            if ready is not None and not ready:
                idle += 1
                if idle >= 2:
                    return
            else:
                idle = 0


class HolderSide:
    """One holder object. ``options`` go to DurabilitySemaphore."""

    def __init__(self, clock: VirtualClock, **options: Any) -> None:
        self.clock = clock
        self.storage = LocalStorage()
        self.ctx = LocalContext(self.storage, name="holder")
        self.options = options
        self._ids = iter(range(1, 10**9))
        self.evictions = 0
        self.driver = AlarmDriver(clock, self.storage, self._alarm, max_retries=1000)
        self._start()

    def _start(self) -> None:
        self.scheduler = DurabilityScheduler(self.ctx, clock=self.clock)
        self.sem = DurabilitySemaphore(scheduler=self.scheduler, clock=self.clock,
                                       id_factory=lambda: f"h{next(self._ids)}", **self.options)

    async def _alarm(self, info: Any) -> None:
        await self.scheduler.alarm(info)

    async def handle(self, message: Any) -> dict:
        return await self.sem.handle(message)

    def evict(self) -> None:
        task = self.sem._round_task
        if task is not None and not task.done():
            task.cancel()
        self.evictions += 1
        self._start()

    async def usage(self) -> dict:
        return await self.sem.usage()

    def charged(self) -> tuple[int, dict[str, int]]:
        """Total and per-group charged capacity straight from the holder's aggregates."""
        conn = self.storage.connection
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "durability_semaphore_meta" not in names:
            return 0, {}
        meta = dict(conn.execute("SELECT key, value FROM durability_semaphore_meta").fetchall())
        groups = {g: o + f for g, o, f in conn.execute(
            "SELECT group_name, outstanding, lease_footprint FROM durability_semaphore_groups")}
        return meta.get("outstanding", 0) + meta.get("lease_footprint", 0), groups


class Net:
    """In-memory transport to one holder, with seeded faults (all probabilities default 0)."""

    def __init__(
        self,
        holder: HolderSide,
        clock: VirtualClock,
        rng: random.Random | None = None,
        *,
        lose_request: float = 0.0,
        lose_reply: float = 0.0,
        duplicate: float = 0.0,
        delay: float = 0.0,
        max_delay_ms: int = 3000,
    ) -> None:
        self.holder = holder
        self.clock = clock
        self.rng = rng or random.Random(0)
        self.p = {"lose_request": lose_request, "lose_reply": lose_reply, "duplicate": duplicate, "delay": delay}
        self.max_delay_ms = max_delay_ms
        self.enabled = True
        self.sent: list[dict] = []
        self.stats = {"sent": 0, "lost_request": 0, "late": 0, "lost_reply": 0, "duplicated": 0, "delayed": 0}
        self.tasks: set[asyncio.Task[Any]] = set()
        #: Set to a callable (key, message) -> reply | None to intercept one call (tests).
        self.intercept: Callable[[str, dict], Any] | None = None

    def _roll(self, name: str) -> bool:
        return self.enabled and self.rng.random() < self.p[name]

    def _delay(self) -> int:
        return self.rng.randint(1, self.max_delay_ms)

    async def _deliver(self, message: dict, delay_ms: int = 0) -> dict:
        if delay_ms:
            await self.clock.sleep(delay_ms)
        return await self.holder.handle(copy.deepcopy(message))

    def _spawn(self, coro: Awaitable[Any]) -> "asyncio.Task[Any]":
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def __call__(self, key: str, message: dict) -> dict:
        self.stats["sent"] += 1
        self.sent.append(copy.deepcopy(message))
        if self.intercept is not None:
            result = self.intercept(key, message)
            if result is not None:
                return result
        if self._roll("lose_request"):
            self.stats["lost_request"] += 1
            if self.rng.random() < 0.5:  # delivered later: reordered after newer messages
                self.stats["late"] += 1
                self._spawn(self._deliver(message, self._delay()))
            await self.clock.sleep(self.rng.randint(1, 500))
            raise HolderUnavailableError("request lost (test network)")
        if self._roll("duplicate"):
            self.stats["duplicated"] += 1
            self._spawn(self._deliver(message, self.rng.choice([0, self._delay()])))
        delay = 0
        if self._roll("delay"):
            self.stats["delayed"] += 1
            delay = self._delay()
        delivery = self._spawn(self._deliver(message, delay))
        reply = await asyncio.shield(delivery)
        if self._roll("lose_reply"):
            self.stats["lost_reply"] += 1
            raise HolderUnavailableError("reply lost (test network)")
        if self._roll("delay"):
            self.stats["delayed"] += 1
            await self.clock.sleep(self._delay())
        return copy.deepcopy(reply)


class TaskAlarmDriver(AlarmDriver):
    """Runs a client object's alarm handler as a task (see the module documentation)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("max_retries", 10_000)
        super().__init__(*args, **kwargs)
        self.task: asyncio.Task[Any] | None = None
        self._last_fire_at = -1
        self._same_time = 0

    def due(self) -> int | None:
        if self.task is not None and not self.task.done():
            return None
        return super().due()

    async def fire(self) -> None:
        if self.storage.alarm is None or (self.task is not None and not self.task.done()):
            return
        if self.clock.now == self._last_fire_at:
            self._same_time += 1
            if self._same_time > 500:  # the object re-arms its alarm for "now" forever
                raise AssertionError(f"alarm spins at {self.clock.now}")
        else:
            self._last_fire_at, self._same_time = self.clock.now, 0
        self.storage._alarm = None
        self._delayed_for = None
        self.fired += 1
        info = {"retryCount": self._retry_count, "isRetry": self._retry_count > 0}
        self.task = asyncio.ensure_future(self._run(info))

    async def _run(self, info: Any) -> None:
        try:
            await self.handler(info)
        except BaseException as exc:  # noqa: BLE001 - cancelled by eviction counts as a failure
            self.failures.append(exc)
            if self.storage.alarm is None and self._retry_count < self.max_retries:
                self._retry_count += 1
                self.storage._alarm = self.clock.now + min(2000 * 2 ** (self._retry_count - 1), 16_000)
            return
        self._retry_count = 0

    def kill(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()


class ClientSide:
    """A client object: SemaphoreClient + scheduler + SemaphoreQueue over one LocalStorage.

    ``on_admit``/``check_running`` are called with ``(side, item)``."""

    def __init__(
        self,
        name: str,
        clock: VirtualClock,
        transport: Callable[[str, dict], Awaitable[Any]],
        *,
        on_admit: Callable[["ClientSide", Any], Any],
        check_running: Callable[["ClientSide", Any], Any] | None = None,
        recheck_ms: int = 30_000,
        **queue_options: Any,
    ) -> None:
        self.name = name
        self.clock = clock
        self.transport = transport
        self.storage = LocalStorage()
        self.ctx = LocalContext(self.storage, name=name)
        self._on_admit = on_admit
        self._check_running = check_running
        self.queue_options = queue_options
        self.recheck_ms = recheck_ms
        self.evictions = 0
        self.tasks: set[asyncio.Task[Any]] = set()
        self.driver = TaskAlarmDriver(clock, self.storage, self._alarm)
        self._start()

    def _start(self) -> None:
        self.scheduler = DurabilityScheduler(self.ctx, clock=self.clock)
        self.client = SemaphoreClient(self.ctx, self.transport, clock=self.clock, client_id=self.name,
                                     recheck_ms=self.recheck_ms)
        options = dict(self.queue_options)
        if self._check_running is not None:
            options["check_running"] = lambda item: self._check_running(self, item)
        self.queue = SemaphoreQueue(client=self.client, scheduler=self.scheduler,
                                    on_admit=lambda item: self._on_admit(self, item), **options)

    async def _alarm(self, info: Any) -> None:
        await self.scheduler.alarm(info)

    def spawn(self, coro: Awaitable[Any]) -> "asyncio.Task[Any]":
        """Run a call into this object as a task (cancelled if the object is evicted)."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def evict(self) -> None:
        """Lose every in-memory thing of the object: running alarm, calls in flight, instances."""
        self.driver.kill()
        for task in list(self.tasks):
            task.cancel()
        self.evictions += 1
        self._start()
