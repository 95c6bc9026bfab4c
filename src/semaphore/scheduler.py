"""DurabilityScheduler: named timers multiplexed over a Durable Object's single alarm.

Timers are rows of ``durability_scheduler_timers`` (name, due time), so they survive eviction.
The object's alarm always points at the earliest timer; the object's ``alarm()`` handler
delegates to :meth:`DurabilityScheduler.alarm`, which runs the handlers of the timers that are
due and re-arms the alarm at the earliest remaining one.

Handlers are registered in memory with :meth:`on` (do it in the object's constructor, before any
alarm can run). A due timer whose name has no handler is dropped (logged), so a renamed handler
cannot keep the alarm firing forever.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Awaitable, Callable, Union

from .clock import system_clock
from .runtime import Storage

__all__ = ["DurabilityScheduler", "TimerHandler"]

log = logging.getLogger("semaphore.scheduler")

TimerHandler = Callable[[str, int], Union[Awaitable[None], None]]

TABLE = "durability_scheduler_timers"


class DurabilityScheduler:
    """Named, persisted timers over one alarm.

    :param ctx: the Durable Object's ``ctx`` (SQLite-backed), as the runtime hands it over.
    :param clock: callable returning epoch milliseconds (default: wall clock).
    """

    #: While a handler runs, its timer is moved this far ahead instead of being deleted, so an
    #: instance that dies mid-handler (process killed, eviction) runs it again once the runtime
    #: re-delivers the alarm (alarms are at-least-once); it is deleted when the handler returns.
    RUN_LEASE_MS = 2000

    def __init__(self, ctx: Any, *, clock: Callable[[], int] | None = None) -> None:
        self.ctx = ctx
        self.storage = ctx if isinstance(ctx, Storage) else Storage(ctx)
        self.clock: Callable[[], int] = clock or system_clock
        self._handlers: dict[str, TimerHandler] = {}
        self._running: dict[str, int] = {}  # timer name -> its lease while its handler runs
        self._rerun: set[str] = set()  # running timers that came due again meanwhile
        self._touched: set[str] = set()  # running timers set or cleared meanwhile
        self._ready = False

    # ------------------------------------------------------------------ schema
    def ensure_schema(self) -> None:
        if self._ready:
            return
        self.storage.exec(
            f"CREATE TABLE IF NOT EXISTS {TABLE} ("
            " name TEXT PRIMARY KEY,"
            " due_at INTEGER NOT NULL)"
        )
        self.storage.exec(f"CREATE INDEX IF NOT EXISTS {TABLE}_due ON {TABLE}(due_at)")
        self._ready = True

    # ------------------------------------------------------------------ timers
    def on(self, name: str, handler: TimerHandler) -> None:
        """Register the handler run when timer ``name`` is due: ``handler(name, due_at)``,
        sync or async. A handler that raises keeps its timer, and the alarm is retried."""
        self._handlers[name] = handler

    def set_timer(self, name: str, due_at: int) -> None:
        """Persist timer ``name`` at ``due_at`` (replacing any earlier time). Synchronous SQL
        only, so it can run inside a storage transaction; call :meth:`arm` afterwards."""
        self.ensure_schema()
        if name in self._running:
            self._touched.add(name)
        self.storage.exec(
            f"INSERT INTO {TABLE}(name, due_at) VALUES (?, ?)"
            " ON CONFLICT(name) DO UPDATE SET due_at = excluded.due_at",
            name,
            int(due_at),
        )

    def clear_timer(self, name: str) -> None:
        """Remove timer ``name`` (synchronous SQL; call :meth:`arm` afterwards)."""
        self.ensure_schema()
        if name in self._running:
            self._touched.add(name)
        self.storage.exec(f"DELETE FROM {TABLE} WHERE name = ?", name)

    def point_timer(self, name: str, due_at: int | None) -> None:
        """Keep timer ``name`` at ``due_at``, or remove it when ``None``; writes nothing when it is
        already so (synchronous SQL; call :meth:`arm` afterwards)."""
        if due_at is None:
            self.clear_timer(name)
        elif self.timer(name) != due_at:
            self.set_timer(name, due_at)

    def clear_prefix(self, prefix: str) -> None:
        """Remove every timer whose name starts with ``prefix``."""
        self.ensure_schema()
        self._touched.update(n for n in self._running if n.startswith(prefix))
        self.storage.exec(
            f"DELETE FROM {TABLE} WHERE substr(name, 1, ?) = ?", len(prefix), prefix
        )

    def timer(self, name: str) -> int | None:
        """Due time of timer ``name``, or ``None``. While its handler runs a timer is not
        scheduled (its run lease is internal) until it is set again."""
        self.ensure_schema()
        if name in self._running and name not in self._touched:
            return None
        row = self.storage.one(f"SELECT due_at FROM {TABLE} WHERE name = ?", name)
        return None if row is None else int(row["due_at"])

    def earliest(self) -> int | None:
        self.ensure_schema()
        row = self.storage.one(f"SELECT MIN(due_at) AS due FROM {TABLE}")
        return None if row is None or row["due"] is None else int(row["due"])

    async def schedule(self, name: str, due_at: int) -> None:
        """Persist timer ``name`` at ``due_at`` and re-arm the alarm."""
        self.set_timer(name, due_at)
        await self.arm()

    async def cancel(self, name: str) -> None:
        """Remove timer ``name`` and re-arm the alarm."""
        self.clear_timer(name)
        await self.arm()

    async def arm(self) -> None:
        """Point the object's alarm at the earliest timer (or delete it if there is none).

        Idempotent and cheap; call it after any change to the timers, and once when an instance
        starts (it repairs an alarm lost between a commit and a ``setAlarm``)."""
        earliest = self.earliest()
        current = await self.storage.get_alarm()
        if earliest is None:
            if current is not None:
                await self.storage.delete_alarm()
            return
        if current != earliest:
            await self.storage.set_alarm(earliest)

    async def alarm(self, alarm_info: Any = None) -> None:
        """The object's ``alarm()`` handler delegates here: runs every due timer (earliest
        first), then re-arms. If a handler raises, its timer stays, the rest still run, and the
        first error is re-raised so the runtime retries the alarm with backoff."""
        self.ensure_schema()
        now = int(self.clock())
        due = self.storage.exec(
            f"SELECT name, due_at FROM {TABLE} WHERE due_at <= ? ORDER BY due_at, name", now
        )
        first_error: BaseException | None = None
        for row in due:
            name, due_at = str(row["name"]), int(row["due_at"])
            handler = self._handlers.get(name)
            if handler is None:
                log.warning("dropping due timer %r: no handler registered", name)
                self.storage.exec(f"DELETE FROM {TABLE} WHERE name = ? AND due_at = ?", name, due_at)
                continue
            if name in self._running:
                # Still running from an earlier alarm of this instance (a long run outlived its
                # lease, or the timer was set again meanwhile): never run it twice at once, nor
                # leave it due (the alarm would fire in a loop); run it again after this run.
                self._running[name] = now + self.RUN_LEASE_MS
                self._rerun.add(name)
                self.storage.exec(f"UPDATE {TABLE} SET due_at = ? WHERE name = ?",
                                  self._running[name], name)
                continue
            # Lease the timer rather than delete it, so a run cut short by the death of the
            # instance happens again; after the run it is deleted unless set or cleared
            # meanwhile, so a handler can still re-schedule or clear itself.
            # Only if unchanged since the due list was read: an earlier handler of this loop (or
            # a request meanwhile) may have rescheduled or cancelled it.
            leased = self.storage.exec(
                f"UPDATE {TABLE} SET due_at = ? WHERE name = ? AND due_at = ? RETURNING name",
                now + self.RUN_LEASE_MS, name, due_at)
            if not leased:
                continue
            self._running[name] = now + self.RUN_LEASE_MS
            self._touched.discard(name)
            try:
                result = handler(name, due_at)
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:  # keep the timer for the retry
                log.exception("timer %r failed", name)
                if name not in self._touched or self.timer(name) is None:
                    self.set_timer(name, due_at)
                if first_error is None:
                    first_error = exc
            else:
                if name in self._rerun:  # came due again during the run: run it once more
                    self.storage.exec(f"UPDATE {TABLE} SET due_at = ? WHERE name = ?",
                                      int(self.clock()), name)
                elif name not in self._touched:
                    self.storage.exec(f"DELETE FROM {TABLE} WHERE name = ?", name)
            finally:
                self._running.pop(name, None)
                self._rerun.discard(name)
                self._touched.discard(name)
        if first_error is not None:
            # Leave the alarm to the runtime's retry (with backoff); re-arming at a due time
            # would fire again at once.
            raise first_error
        await self.arm()
