"""The client side of the test kit: client objects talking to a holder object over a faulty
in-memory network, all on one virtual clock.

* :class:`SimClock` - a :class:`~semaphore.testing.VirtualClock` that settles as soon as nothing
  is ready to run (much faster simulations, same semantics).
* :class:`Net` - the transport ``async (key, message) -> reply`` to one holder object. Every
  delivery runs in its own task (a client that is evicted or gives up does not stop a message
  already sent). Faults: ``lose_request`` (never delivered, or delivered late: reordered after
  newer messages), ``lose_reply`` (delivered, answer lost), ``duplicate`` (delivered twice, the
  copy possibly late), ``delay`` (both ways). The caller sees a lost message as
  :class:`~semaphore.HolderUnavailableError`.
* :class:`TaskAlarmDriver` - fires a client object's alarm as a task, so virtual time can pass
  while the handler waits for a holder round (the runtime runs alarms concurrently with time);
  alarms never overlap; a handler that raises or is cancelled by eviction is retried with backoff
  (and the :class:`~semaphore.testing.AlarmDriver` fault injection hooks apply).
* :class:`ClientSide` - a client object: SemaphoreClient + DurabilityScheduler + SemaphoreQueue
  over its own storage, with :meth:`ClientSide.evict`.

Nothing here mocks the library.
"""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol, runtime_checkable

from ..client import OBJECT_NAME, SemaphoreClient, SemaphoreQueue
from ..errors import HolderUnavailableError
from ..scheduler import DurabilityScheduler
from ._local import AlarmDriver, LocalContext, LocalStorage, VirtualClock
from ._memory_stores import MemoryStores

__all__ = ["SimClock", "Net", "TaskAlarmDriver", "ClientSide", "Holder"]


class SimClock(VirtualClock):
    """A :class:`VirtualClock` whose ``settle`` stops as soon as the event loop has nothing
    ready to run (instead of always yielding 50 times): same semantics, much faster."""

    @staticmethod
    async def settle(rounds: int = 50) -> None:
        """Yield to the event loop until it has had nothing ready twice in a row (at most
        ``rounds`` times)."""
        loop = asyncio.get_running_loop()
        ready = getattr(loop, "_ready", None)  # asyncio's run queue (CPython); else: yield `rounds` times
        idle = 0
        for _ in range(rounds):
            await asyncio.sleep(0)
            if ready is not None and not ready:
                idle += 1
                if idle >= 2:
                    return
            else:
                idle = 0


@runtime_checkable
class Holder(Protocol):
    """What :class:`Net` delivers to: a holder object's RPC method (e.g. a
    :class:`~semaphore.testing.Bed` or :class:`~semaphore.testing.HolderSide`)."""

    async def handle(self, message: Any) -> dict[str, Any]:
        """Answer one wire message."""


class Net:
    """In-memory transport to one holder, with seeded faults (all probabilities default 0).

    ``holder`` is a :class:`Holder` (its ``handle`` is called) or the holder object's RPC
    method itself, an ``async (message) -> reply`` callable. ``stats`` counts what happened,
    ``sent`` keeps a copy of every message, ``enabled = False`` heals the network, and
    ``intercept`` (a callable ``(key, message) -> reply | None``) may answer a call itself."""

    def __init__(
        self,
        holder: Holder | Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
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
        self._handle: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]] = (
            holder.handle if isinstance(holder, Holder) else holder
        )
        self.clock = clock
        self.rng = rng or random.Random(0)
        self.p = {"lose_request": lose_request, "lose_reply": lose_reply, "duplicate": duplicate, "delay": delay}
        self.max_delay_ms = max_delay_ms
        self.enabled = True
        self.sent: list[dict[str, Any]] = []
        self.stats = {"sent": 0, "lost_request": 0, "late": 0, "lost_reply": 0, "duplicated": 0, "delayed": 0}
        self.tasks: set[asyncio.Task[Any]] = set()
        #: Set to a callable (key, message) -> reply | None to intercept one call (tests).
        self.intercept: Callable[[str, dict[str, Any]], Any] | None = None

    def _roll(self, name: str) -> bool:
        return self.enabled and self.rng.random() < self.p[name]

    def _delay(self) -> int:
        return self.rng.randint(1, self.max_delay_ms)

    async def _deliver(self, message: dict[str, Any], delay_ms: int = 0) -> dict[str, Any]:
        if delay_ms:
            await self.clock.sleep(delay_ms)
        return await self._handle(copy.deepcopy(message))

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _lose_request(self, message: dict[str, Any]) -> NoReturn:
        self.stats["lost_request"] += 1
        if self.rng.random() < 0.5:  # delivered later: reordered after newer messages
            self.stats["late"] += 1
            self._spawn(self._deliver(message, self._delay()))
        await self.clock.sleep(self.rng.randint(1, 500))
        raise HolderUnavailableError("request lost (test network)")

    async def __call__(self, key: str, message: dict[str, Any]) -> dict[str, Any]:
        """Send ``message`` to the holder of ``key`` and return its reply (or raise
        :class:`~semaphore.HolderUnavailableError` for a lost message)."""
        self.stats["sent"] += 1
        self.sent.append(copy.deepcopy(message))
        if self.intercept is not None:
            result = self.intercept(key, message)
            if result is not None:
                return result  # type: ignore[no-any-return]
        if self._roll("lose_request"):
            await self._lose_request(message)
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
    """An :class:`AlarmDriver` that runs the alarm handler as a task (see the module
    documentation); retries back off up to 16 s, 10 000 times by default."""

    max_backoff_ms: int | None = 16_000

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("max_retries", 10_000)
        super().__init__(*args, **kwargs)
        #: The running alarm handler, if any.
        self.task: asyncio.Task[Any] | None = None
        self._last_fire_at = -1
        self._same_time = 0

    def _running(self) -> bool:
        return self.task is not None and not self.task.done()

    def due(self) -> int | None:
        """When the alarm will be delivered; ``None`` while a handler still runs."""
        return None if self._running() else super().due()

    async def fire(self) -> None:
        """Deliver the alarm: start the handler as a task. Fails the test (``AssertionError``)
        if the object re-arms its alarm for "now" over 500 times."""
        if self.storage.alarm is None or self._running():
            return
        if self.clock.now == self._last_fire_at:
            self._same_time += 1
            if self._same_time > 500:  # the object re-arms its alarm for "now" forever
                raise AssertionError(f"alarm spins at {self.clock.now}")
        else:
            self._last_fire_at, self._same_time = self.clock.now, 0
        info = await self._deliver()
        if info is not None:
            self.task = asyncio.ensure_future(self._run(info))

    async def _run(self, info: dict[str, Any]) -> None:
        try:
            await self.handler(info)
        except BaseException as exc:  # noqa: BLE001 - cancelled by eviction counts as a failure
            await self._failed(exc)
            return
        self._retry_count = 0
        await self._after_success(info)

    def kill(self) -> None:
        """Cancel the running handler (the object was evicted)."""
        if self._running():
            assert self.task is not None
            self.task.cancel()


class ClientSide:
    """A client object: SemaphoreClient + DurabilityScheduler + SemaphoreQueue over its own
    :class:`LocalStorage`, its alarm fired by a :class:`TaskAlarmDriver`.

    ``transport`` is what the client calls (e.g. a :class:`Net`); ``on_admit`` and
    ``check_running`` (attributes, may be replaced) are called with ``(side, item)``; without
    ``on_admit`` the queue has none (a queue used through ``permit()``, or given ``work=``);
    ``recheck_ms`` and ``label`` go to the client (its label is by default the object's name,
    ``name``), the other keyword options to the queue (``work`` is called with the item
    alone). ``stores="memory"``: the client's rows and the queue's items and marks are kept in
    :attr:`memory` (:class:`MemoryStores`, the SQL stores' twins) instead of SQLite, so a run
    over each can be compared message for message; the scheduler's timers stay in SQLite."""

    def __init__(
        self,
        name: str,
        clock: VirtualClock,
        transport: Callable[[str, dict[str, Any]], Awaitable[Any]],
        *,
        on_admit: Callable[[ClientSide, Any], Any] | None = None,
        check_running: Callable[[ClientSide, Any], Any] | None = None,
        recheck_ms: int = 30_000,
        label: Any = OBJECT_NAME,
        stores: str = "sql",
        **queue_options: Any,
    ) -> None:
        if stores not in ("sql", "memory"):
            raise ValueError(f"stores: expected 'sql' or 'memory', got {stores!r}")
        self.name = name
        self.label = label
        self.clock = clock
        self.transport = transport
        self.storage = LocalStorage()
        self.ctx = LocalContext(self.storage, name=name)
        #: ``stores="memory"``: the client's rows and the queue's items and marks, in memory
        #: (kept in step with :attr:`storage`'s transactions; they survive evictions as it does).
        self.memory: MemoryStores | None = None
        if stores == "memory":
            self.memory = MemoryStores()
            self.storage.keep_in_step(self.memory)
        self.on_admit = on_admit
        self.check_running = check_running
        self.queue_options = queue_options
        self.recheck_ms = recheck_ms
        #: Times the object was evicted.
        self.evictions = 0
        self.tasks: set[asyncio.Task[Any]] = set()
        self.driver = TaskAlarmDriver(clock, self.storage, self.alarm)
        self._start()

    def _start(self) -> None:
        self.scheduler = DurabilityScheduler(self.ctx, clock=self.clock)
        self.client = SemaphoreClient(self.ctx, self.transport, clock=self.clock, client_id=self.name,
                                      recheck_ms=self.recheck_ms, label=self.label)
        options = dict(self.queue_options)
        if self.check_running is not None:
            options["check_running"] = self._check
        if self.on_admit is not None:
            options["on_admit"] = lambda item: self._admit(item)
        self.queue = SemaphoreQueue(client=self.client, scheduler=self.scheduler, **options)
        if self.memory is not None:
            self.memory.use_in(self.queue)

    def _admit(self, item: Any) -> Any:
        assert self.on_admit is not None
        return self.on_admit(self, item)

    def _check(self, item: Any) -> Any:
        assert self.check_running is not None
        return self.check_running(self, item)

    async def alarm(self, info: Any = None) -> None:
        """The client object's ``alarm()``: delegates to the scheduler."""
        await self.scheduler.alarm(info)

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """Run a call into this object as a task (cancelled if the object is evicted)."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def evict(self) -> None:
        """Lose every in-memory thing of the object: running alarm, calls in flight, instances;
        new ones start over the same storage."""
        self.driver.kill()
        for task in list(self.tasks):
            task.cancel()
        self.queue.abandon()  # its callback tasks and background pumps die with the object
        self.evictions += 1
        self._start()
