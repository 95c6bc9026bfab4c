"""DurabilityScheduler: named timers multiplexed over a Durable Object's single alarm.

Timers are rows of ``durability_scheduler_timers`` (name, due time), so they survive eviction.
The object's alarm always points at the earliest timer; the object's ``alarm()`` handler
delegates to :meth:`DurabilityScheduler.alarm`, which runs the handlers of the timers that are
due and re-arms the alarm at the earliest remaining one.

Handlers are registered in memory with :meth:`on` (do it in the object's constructor, before any
alarm can run). A due timer whose name has no handler is dropped (logged), so a renamed handler
cannot keep the alarm firing forever.

A handler that raises never stops the other timers (SPEC R16: the holder's reclaim must not
depend on an unrelated timer). :meth:`DurabilityScheduler.alarm` logs the failure (ERROR, with
the timer's name and attempt), records it in the timer's row (``attempts``: consecutive failed
runs), moves that timer back by an exponential backoff (``BACKOFF_BASE_MS`` = 1 s, doubling per
attempt, capped at ``BACKOFF_MAX_MS`` = 5 min), still runs the other due timers, re-arms the alarm
at the earliest remaining due time and returns normally: it never relies on the runtime's alarm
retries, which are limited (once they are spent no alarm would be left). A run that returns
resets ``attempts`` to 0.

Schema (``durability_scheduler_timers``): ``name`` (primary key), ``due_at`` (epoch ms) and
``attempts``. A table created by an earlier release (without ``attempts``) gets the column added
(``DEFAULT 0``) when an instance first uses it; rows written by an earlier release read as 0.
The table is shared by every user of the object's scheduler (the holder, a queue, the
application); a component's ``migrate(ctx, None)`` removes only its own timers and leaves the
table (a live scheduler instance keeps using it). :meth:`DurabilityScheduler.migrate` with
``None`` drops the table itself (every timer), for a full uninstall.

Participants (:meth:`DurabilityScheduler.participate`) are the other kind of alarm user: one
that already keeps its own due time in its own tables (the holder's reclaim: the earliest
``claimBy`` of a grant with unclaimed permits, SPEC R16) reports it through a synchronous
``next_due()`` (SQL reads only) instead of mirroring it into a timer row by hand. :meth:`arm`
points the alarm at the minimum over the timers and every participant's *effective* due time:
its ``next_due()``; while it runs, its run lease (in memory); while it is failing, its retry
time. :meth:`alarm` runs every participant whose effective due time has come, with the same
guarantees as a timer: never twice at once in an instance, a failure logged (ERROR), counted and
backed off (same backoff) and never thrown to the runtime, and the alarm always re-armed. A run
that returns must move ``next_due()`` past the due time it was given (or to ``None``); one that
does not is counted as a failure, so a participant making no progress cannot keep the alarm
firing in a loop. A run cut short by the death of the instance needs no lease row: the
participant's own state still says it is due, so the re-delivered alarm runs it again.

A participant has a row in the timer table only while it is failing: ``(name, retry time,
attempts >= 1)``, so its backoff survives eviction; the row is deleted by the first run that
returns (and, with the component's timers, by its ``migrate(ctx, None)``). A row with
``attempts = 0`` under a participant's name is a timer row of an earlier release (which kept a
mirror, e.g. ``durability_semaphore:reclaim``): it arms the alarm at its time at the latest
(never later than ``next_due()``), and is deleted by the participant's next run.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .clock import system_clock
from .errors import ConfigurationError
from .runtime import Storage, install_schema

__all__ = ["DurabilityScheduler", "TimerHandler", "NextDue"]

log = logging.getLogger("semaphore.scheduler")

TimerHandler = Callable[[str, int], Awaitable[None] | None]
#: A participant's own earliest due time (epoch ms), or ``None`` when nothing is due; synchronous
#: SQL reads only (it is called by every :meth:`DurabilityScheduler.arm`).
NextDue = Callable[[], int | None]

TABLE = "durability_scheduler_timers"


@dataclass(frozen=True)
class _Participant:
    next_due: NextDue
    run: TimerHandler


class _NoProgress(Exception):
    """A participant's run returned but left ``next_due()`` at or before the time it ran for."""


class DurabilityScheduler:
    """Named, persisted timers over one alarm.

    :param ctx: the Durable Object's ``ctx`` (SQLite-backed), as the runtime hands it over.
    :param clock: callable returning epoch milliseconds (default: wall clock).
    """

    #: While a handler runs, its timer is moved this far ahead instead of being deleted, so an
    #: instance that dies mid-handler (process killed, eviction) runs it again once the runtime
    #: re-delivers the alarm (alarms are at-least-once); it is deleted when the handler returns.
    RUN_LEASE_MS = 2000
    #: A timer whose handler raised is retried after ``BACKOFF_BASE_MS * 2 ** (attempts - 1)``
    #: (1 s, 2 s, 4 s, ...) capped at ``BACKOFF_MAX_MS`` (5 min); ``attempts`` (persisted in its
    #: row) counts its consecutive failed runs and is reset when a run returns.
    BACKOFF_BASE_MS = 1000
    BACKOFF_MAX_MS = 300_000

    def __init__(self, ctx: Any, *, clock: Callable[[], int] | None = None) -> None:
        self.ctx = ctx
        self.storage = ctx if isinstance(ctx, Storage) else Storage(ctx)
        self.clock: Callable[[], int] = clock or system_clock
        self._handlers: dict[str, TimerHandler] = {}
        self._running: dict[str, int] = {}  # timer name -> its lease while its handler runs
        self._rerun: set[str] = set()  # running timers that came due again meanwhile
        self._touched: set[str] = set()  # running timers set or cleared meanwhile
        self._participants: dict[str, _Participant] = {}
        self._leases: dict[str, int] = {}  # participant name -> its lease while it runs
        #: participant name -> (retry time, attempts) of a failure whose row could not be written
        self._unrecorded: dict[str, tuple[int, int]] = {}
        #: What :meth:`_participant_rows` last read, until this instance next writes its table
        #: (:meth:`_write`), a transaction rolls back, or an alarm runs: :meth:`arm`, called after
        #: every change, then costs no SQL (the table has no other writer while the instance
        #: lives, but the static ``migrate`` methods, after which instances are discarded).
        self._rows: tuple[int | None, dict[str, dict[str, Any]]] | None = None
        self.storage.on_rollback(self._forget_rows)
        self._ready = False

    # ------------------------------------------------------------------ schema
    def ensure_schema(self) -> None:
        """Create the timer table if missing, or add the ``attempts`` column to a table created
        by an earlier release (done automatically on first use)."""
        if self._ready:
            return
        _migrate_schema(self.storage)
        self._ready = True

    @staticmethod
    def migrate(ctx: Any, to_version: int | None) -> None:
        """``1`` creates (or upgrades) the timer table; ``None`` drops it with every timer in it
        (whoever set them), for a full uninstall after the components using the scheduler have
        been migrated away. Discard any live :class:`DurabilityScheduler` instance afterwards; an
        alarm that still fires finds no table and deletes itself (:meth:`alarm`)."""
        storage = ctx if isinstance(ctx, Storage) else Storage(ctx)
        if to_version is None:
            storage.exec(f"DROP TABLE IF EXISTS {TABLE}")
        elif to_version == 1:
            _migrate_schema(storage)
        else:
            raise ConfigurationError(f"migrate: unknown scheduler schema version {to_version!r}",
                                     field="to_version")

    @staticmethod
    def remove_timers(ctx: Any, prefix: str) -> None:
        """Delete every timer row whose name starts with ``prefix`` from the object's table, if
        it has one (for a component's ``migrate(ctx, None)``: its timers go, the table stays;
        discard live instances afterwards)."""
        storage = ctx if isinstance(ctx, Storage) else Storage(ctx)
        if storage.one("SELECT name FROM sqlite_master WHERE type = 'table' AND name = ?", TABLE):
            storage.exec(f"DELETE FROM {TABLE} WHERE substr(name, 1, ?) = ?", len(prefix), prefix)

    @classmethod
    def backoff_ms(cls, attempts: int) -> int:
        """Delay before the retry of a timer whose handler has failed ``attempts`` times in a row."""
        return min(cls.BACKOFF_MAX_MS, cls.BACKOFF_BASE_MS * (1 << min(max(attempts, 1) - 1, 30)))

    def attempts(self, name: str) -> int:
        """Consecutive failed runs of timer ``name`` (0 when it never failed, or is not set)."""
        self.ensure_schema()
        row = self.storage.one(f"SELECT attempts FROM {TABLE} WHERE name = ?", name)
        return 0 if row is None or row["attempts"] is None else int(row["attempts"])

    # ------------------------------------------------------------------ timers
    def on(self, name: str, handler: TimerHandler) -> None:
        """Register the handler run when timer ``name`` is due: ``handler(name, due_at)``,
        sync or async. A handler that raises keeps its timer, retried with backoff (see the
        module documentation); the exception never reaches the runtime."""
        if name in self._participants:
            raise ConfigurationError(f"on: {name!r} is a participant", field="name")
        self._handlers[name] = handler

    def set_timer(self, name: str, due_at: int) -> None:
        """Persist timer ``name`` at ``due_at`` (replacing any earlier time; its failure count,
        ``attempts``, is kept). Synchronous SQL only, so it can run inside a storage
        transaction; call :meth:`arm` afterwards."""
        self.ensure_schema()
        if name in self._running:
            self._touched.add(name)
        self._write(
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
        self._write(f"DELETE FROM {TABLE} WHERE name = ?", name)

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
        self._write(
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
        """The earliest due time among the timer rows, or ``None`` (participants not included:
        see :meth:`due_times`)."""
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

    # ------------------------------------------------------------------ participants
    def participate(self, name: str, next_due: NextDue, run: TimerHandler) -> None:
        """Register participant ``name`` (do it in the object's constructor, like :meth:`on`).

        ``next_due()`` returns the participant's own earliest due time (epoch ms) read from its
        own state, or ``None``; synchronous, SQL reads only, it is called by every :meth:`arm`
        (so a change of that state is picked up by the next :meth:`arm`, with no timer write).
        ``run(name, due_at)`` (sync or async) is called by :meth:`alarm` once the participant's
        effective due time has come; it must move ``next_due()`` past ``due_at``. A run that
        raises (or makes no progress), or a ``next_due()`` that raises, is logged, counted in
        :meth:`attempts` and backed off like a timer (see the module documentation)."""
        if name in self._handlers:
            raise ConfigurationError(f"participate: {name!r} is a timer with a handler", field="name")
        self._participants[name] = _Participant(next_due, run)
        self._rows = None  # what was read split the rows by the participants known then

    @property
    def participants(self) -> tuple[str, ...]:
        """Names of the registered participants, in registration order."""
        return tuple(self._participants)

    def due_times(self) -> dict[str, int]:
        """Everything that will fire the alarm: ``{name: due time}`` of every timer and the
        effective due time of every participant that has one (for tests and diagnostics)."""
        self.ensure_schema()
        every = self.storage.exec(f"SELECT name, due_at, attempts FROM {TABLE}")
        rows = {str(r["name"]): r for r in every if str(r["name"]) in self._participants}
        out = {str(r["name"]): int(r["due_at"]) for r in every if str(r["name"]) not in rows}
        for name, p in self._participants.items():
            due = self._effective_due(name, p, rows.get(name), int(self.clock()))
            if due is not None:
                out[name] = due
        return out

    def _forget_rows(self) -> None:
        self._rows = None

    def _write(self, query: str, *bindings: Any) -> list[dict[str, Any]]:
        """Every write of the timer table: it drops the copy :meth:`_participant_rows` keeps."""
        self._rows = None
        return self.storage.exec(query, *bindings)

    def _participant_rows(self) -> tuple[int | None, dict[str, dict[str, Any]]]:
        """The earliest timer that is not a participant's, and the participants' rows (a failing
        one's backoff, or a timer row an earlier release left under its name): one statement,
        then the copy of it until the table is next written (:attr:`_rows`)."""
        if self._rows is None:
            self._rows = self._read_participant_rows()
        return self._rows

    def _read_participant_rows(self) -> tuple[int | None, dict[str, dict[str, Any]]]:
        names = json.dumps(sorted(self._participants))
        rows = self.storage.exec(
            f"SELECT name, due_at, attempts FROM {TABLE} WHERE name IN (SELECT value FROM json_each(?))"
            f" UNION ALL SELECT NULL, MIN(due_at), NULL FROM {TABLE}"
            " WHERE name NOT IN (SELECT value FROM json_each(?))", names, names)
        earliest = next((r["due_at"] for r in rows if r["name"] is None), None)
        found = {str(r["name"]): r for r in rows if r["name"] is not None}
        return (None if earliest is None else int(earliest)), found

    def _backoff(self, name: str, row: dict[str, Any] | None) -> tuple[int, int] | None:
        """``(retry time, attempts)`` of a failing participant: its row (``attempts >= 1``), or
        a failure whose row could not be written (kept in memory); ``None`` when not failing."""
        if row is not None and row["attempts"]:
            return int(row["due_at"]), int(row["attempts"])
        return self._unrecorded.get(name)

    @staticmethod
    def _with_stale_row(due: int | None, row: dict[str, Any] | None) -> int | None:
        """``next_due()``, or earlier the time of a timer row an earlier release left under the
        participant's name (``attempts = 0``; deleted by the participant's next run)."""
        if row is None:
            return None if due is None else int(due)
        return int(row["due_at"]) if due is None else min(int(due), int(row["due_at"]))

    def _effective_due(self, name: str, p: _Participant, row: dict[str, Any] | None, now: int) -> int | None:
        """When participant ``name`` fires the alarm: its run lease while it runs, its retry time
        while it is failing, else ``next_due()`` (a ``next_due()`` that raises: ``now``, so that
        :meth:`alarm` records the failure and backs it off)."""
        if name in self._leases:
            return self._leases[name]
        backoff = self._backoff(name, row)
        if backoff is not None:
            return backoff[0]
        try:
            due = p.next_due()
        except Exception:
            log.exception("next_due() of participant %r raised", name)
            return now
        return self._with_stale_row(due, row)

    def _earliest_due(self) -> int | None:
        """The earliest time at which something is due: the timers and every participant."""
        if not self._participants:
            return self.earliest()
        self.ensure_schema()
        earliest, rows = self._participant_rows()
        now = int(self.clock())
        dues = [self._effective_due(n, p, rows.get(n), now) for n, p in self._participants.items()]
        return min((d for d in [earliest, *dues] if d is not None), default=None)

    # ------------------------------------------------------------------ the alarm
    async def arm(self) -> None:
        """Point the object's alarm at the earliest timer or participant due time (or delete it
        if there is none).

        Idempotent and cheap (the timer rows, read once and kept until the table is next written
        through this instance, each participant's ``next_due()`` (the queue's answers from its
        copy, the holder's is one read) and the runtime's ``getAlarm``); call it
        after any change to the timers or to a participant's state (after the commit), and once
        when an instance starts (it repairs an alarm lost between a commit and a ``setAlarm``).
        A ``next_due()`` that raises is logged and arms the alarm now (:meth:`alarm` backs it
        off): it never makes :meth:`arm` raise."""
        earliest = self._earliest_due()
        current = await self.storage.get_alarm()
        if earliest is None:
            if current is not None:
                await self.storage.delete_alarm()
            return
        if current != earliest:
            await self.storage.set_alarm(earliest)

    async def alarm(self, alarm_info: Any = None) -> None:
        """The object's ``alarm()`` handler delegates here: runs every due timer and participant
        (earliest first), then re-arms the alarm at the earliest remaining one.

        A handler that raises does not stop the others, and its exception is not re-raised: it
        is logged (ERROR, with the timer's name and attempt), the timer's ``attempts`` is
        incremented and the timer moved to ``now + backoff_ms(attempts)`` (or later, if the
        handler set it later before raising). Participants likewise (see :meth:`participate`).
        So the runtime's limited alarm retries are never needed, and the alarm stays set while
        anything is due (SPEC R16). Only a failure of the scheduler's own storage calls
        propagates (then the runtime retries the alarm).

        After :meth:`migrate` ``(ctx, None)`` (no timer table) there is nothing to run: the alarm
        is deleted and nothing is created, on this instance or a fresh one (R3)."""
        self._rows = None  # read afresh at every alarm
        if not self.storage.exec(
                "SELECT 1 AS x FROM sqlite_master WHERE type = 'table' AND name = ?", TABLE):
            self._ready = False
            await self.storage.delete_alarm()
            return
        self.ensure_schema()
        now = int(self.clock())
        rows = self.storage.exec(
            f"SELECT name, due_at, attempts FROM {TABLE} WHERE due_at <= ?"
            " OR name IN (SELECT value FROM json_each(?)) ORDER BY due_at, name",
            now, json.dumps(sorted(self._participants)))
        mine = {str(r["name"]): r for r in rows if str(r["name"]) in self._participants}
        work: list[tuple[int, str, dict[str, Any] | None]] = [
            (int(r["due_at"]), str(r["name"]), r) for r in rows if str(r["name"]) not in mine]
        runs: dict[str, int] = {}  # due participant -> its attempts so far
        for name, p in self._participants.items():
            due = self._alarm_due(name, p, mine.get(name), now)
            if due is not None and due[0] <= now:
                work.append((due[0], name, None))
                runs[name] = due[1]
        for due_at, name, row in sorted(work, key=lambda w: (w[0], w[1])):
            if row is not None:
                await self._run_due_timer(name, due_at, now)
            else:
                await self._run_participant(name, self._participants[name], mine.get(name),
                                            due_at, runs[name], now)
        await self.arm()

    async def _run_due_timer(self, name: str, due_at: int, now: int) -> None:
        """A due timer of :meth:`alarm`: dropped without a handler, deferred while it still runs,
        else leased and run."""
        handler = self._handlers.get(name)
        if handler is None:
            log.warning("dropping due timer %r: no handler registered", name)
            self._write(f"DELETE FROM {TABLE} WHERE name = ? AND due_at = ?", name, due_at)
            return
        if name in self._running:
            self._defer_rerun(name, now)
            return
        attempts = self._lease_timer(name, due_at, now)
        if attempts is not None:
            await self._run_timer(name, due_at, handler, attempts, now + self.RUN_LEASE_MS)

    def _alarm_due(self, name: str, p: _Participant, row: dict[str, Any] | None, now: int) -> tuple[int, int] | None:
        """``(due time, attempts)`` of a participant for :meth:`alarm`. Still running from an
        earlier alarm of this instance: never run twice at once; its lease is extended instead
        (the alarm stays set, and not due: R16). A ``next_due()`` that raises counts as a failed
        run."""
        if name in self._leases:
            self._leases[name] = now + self.RUN_LEASE_MS
            return None
        backoff = self._backoff(name, row)
        if backoff is not None:
            return backoff
        try:
            due = p.next_due()
        except Exception:
            self._participant_failed(name, 1, "next_due() raised")
            return None
        due = self._with_stale_row(due, row)
        return None if due is None else (due, 0)

    async def _run_participant(self, name: str, p: _Participant, row: dict[str, Any] | None,
                               due_at: int, attempts: int, now: int) -> None:
        """Run a due participant under an in-memory lease (its own state says it is due, so a
        run cut short by the death of the instance happens again on the re-delivered alarm). It
        raised, or left ``next_due()`` at or before ``due_at``: backed off. It returned: its row
        (a backoff, or a stale timer row) is deleted, which resets ``attempts``."""
        self._leases[name] = now + self.RUN_LEASE_MS
        try:
            result = p.run(name, due_at)
            if inspect.isawaitable(result):
                await result
            after = p.next_due()
            if after is not None and int(after) <= due_at:
                raise _NoProgress(f"next_due() is still {after} after the run for {due_at}")
        except Exception:  # backed off; never stop the other timers and participants
            if self._nothing_due(p):  # e.g. migrated away mid-run: nothing left to retry
                log.warning("participant %r failed, but has nothing due any more", name, exc_info=True)
                self._clear_participant(name, row)
            else:
                self._participant_failed(name, attempts + 1, "failed")
        else:
            self._clear_participant(name, row)
        finally:
            self._leases.pop(name, None)

    @staticmethod
    def _nothing_due(p: _Participant) -> bool:
        """Whether the participant's own state says nothing is due (``next_due()`` is ``None``)."""
        try:
            return p.next_due() is None
        except Exception:
            return False

    def _clear_participant(self, name: str, row: dict[str, Any] | None) -> None:
        """A run that returned (or failed with nothing left due): forget its failures, deleting
        its row (a backoff, or a stale timer row), which resets ``attempts``."""
        self._unrecorded.pop(name, None)
        if row is not None:
            self._write(f"DELETE FROM {TABLE} WHERE name = ?", name)

    def _participant_failed(self, name: str, attempts: int, what: str) -> None:
        """Log the current exception and back the participant off: its row ``(name, retry time,
        attempts)`` survives eviction. Called from an ``except`` block; never raises (if the
        write fails too, the backoff is kept in memory for this instance)."""
        delay = self.backoff_ms(attempts)
        retry_at = int(self.clock()) + delay
        log.error("participant %r %s (attempt %d); retrying in %d ms", name, what, attempts, delay,
                  exc_info=True)
        self._unrecorded[name] = (retry_at, attempts)
        try:
            self._write(
                f"INSERT INTO {TABLE}(name, due_at, attempts) VALUES (?, ?, ?)"
                " ON CONFLICT(name) DO UPDATE SET due_at = excluded.due_at, attempts = excluded.attempts",
                name, retry_at, attempts)
        except Exception:
            log.exception("could not record the failure of participant %r", name)
        else:
            self._unrecorded.pop(name, None)

    def _defer_rerun(self, name: str, now: int) -> None:
        """A due timer still running from an earlier alarm of this instance (a long run outlived
        its lease, or the timer was set again meanwhile): never run it twice at once, nor leave it
        due (the alarm would fire in a loop); its lease is extended and it runs again after this
        run (SPEC R16: the alarm stays set while a timer is left)."""
        self._running[name] = now + self.RUN_LEASE_MS
        self._rerun.add(name)
        self._write(f"UPDATE {TABLE} SET due_at = ? WHERE name = ?", self._running[name], name)

    def _lease_timer(self, name: str, due_at: int, now: int) -> int | None:
        """Lease a due timer for its run (``now + RUN_LEASE_MS``) rather than delete it, so a run
        cut short by the death of the instance happens again (alarms are at-least-once). Only if
        unchanged since the due list was read: an earlier handler of this alarm (or a request
        meanwhile) may have rescheduled or cancelled it; then ``None``, else its ``attempts``."""
        leased = self._write(
            f"UPDATE {TABLE} SET due_at = ? WHERE name = ? AND due_at = ? RETURNING attempts",
            now + self.RUN_LEASE_MS, name, due_at)
        if not leased:
            return None
        return int(leased[0]["attempts"] or 0)

    async def _run_timer(self, name: str, due_at: int, handler: TimerHandler, attempts: int, lease: int) -> None:
        """Run a leased timer's handler (SPEC R16: one that raises never stops the others). It
        raised: backed off (:meth:`_record_failure`). It returned: run once more if it came due
        again meanwhile, else deleted unless it set or cleared itself (then its time stands and
        ``attempts`` is reset)."""
        self._running[name] = lease
        self._touched.discard(name)
        try:
            result = handler(name, due_at)
            if inspect.isawaitable(result):
                await result
        except Exception:  # keep the timer, backed off; never stop the other timers
            self._record_failure(name, attempts + 1, lease)
        else:
            if name in self._rerun:  # came due again during the run: run it once more
                self._write(f"UPDATE {TABLE} SET due_at = ?, attempts = 0 WHERE name = ?",
                                  int(self.clock()), name)
            elif name not in self._touched:
                self._write(f"DELETE FROM {TABLE} WHERE name = ?", name)
            elif attempts:  # the handler re-scheduled itself: keep its time, reset the count
                self._write(f"UPDATE {TABLE} SET attempts = 0 WHERE name = ?", name)
        finally:
            self._running.pop(name, None)
            self._rerun.discard(name)
            self._touched.discard(name)

    def _record_failure(self, name: str, attempts: int, lease: int) -> None:
        """Log the current exception, count the failed run and back the timer off. Called from
        an ``except`` block; never raises (if the write fails too, the run lease left in the
        row retries the timer after ``RUN_LEASE_MS``)."""
        delay = self.backoff_ms(attempts)
        retry_at = int(self.clock()) + delay
        log.error("timer %r failed (attempt %d); retrying in %d ms", name, attempts, delay,
                  exc_info=True)
        try:
            if name in self._touched:  # set (or cleared) by the handler before it raised
                row = self.storage.one(f"SELECT due_at FROM {TABLE} WHERE name = ?", name)
                if row is not None and int(row["due_at"]) != lease:
                    retry_at = max(retry_at, int(row["due_at"]))  # a later time it chose wins
                self._write(
                    f"INSERT INTO {TABLE}(name, due_at, attempts) VALUES (?, ?, ?)"
                    " ON CONFLICT(name) DO UPDATE SET due_at = excluded.due_at, attempts = excluded.attempts",
                    name, retry_at, attempts)
            else:  # its row still holds the run lease, unless a migrate removed it: then it stays gone
                self._write(f"UPDATE {TABLE} SET due_at = ?, attempts = ? WHERE name = ?",
                                  retry_at, attempts, name)
        except Exception:
            log.exception("could not record the failure of timer %r", name)


def _migrate_schema(storage: Storage) -> None:
    """Create the timer table, or bring one created by an earlier release up to date: add the
    ``attempts`` column (``NOT NULL DEFAULT 0``, so older rows, and rows an older release would
    still write, read as 0). Idempotent (:func:`~semaphore.runtime.install_schema`)."""
    install_schema(
        storage,
        [f"CREATE TABLE IF NOT EXISTS {TABLE} (name TEXT PRIMARY KEY, due_at INTEGER NOT NULL,"
         " attempts INTEGER NOT NULL DEFAULT 0)"],
        [(TABLE, "attempts", "INTEGER NOT NULL DEFAULT 0")],
        [f"CREATE INDEX IF NOT EXISTS {TABLE}_due ON {TABLE}(due_at)"])
