"""Test bed: a Durable Object ``ctx`` on real SQLite, a virtual clock and an alarm driver.

Nothing here mocks the library. :class:`LocalStorage` is a real SQLite database (stdlib
:mod:`sqlite3`) shaped exactly like the runtime's ``ctx.storage`` (camelCase names, cursors with
``toArray()``/``one()``/iteration/``columnNames``, awaitable alarm calls) and it *enforces* the
Durable Object rules, so code that passes here does not rely on anything the runtime forbids:

* ``BEGIN``/``COMMIT``/``SAVEPOINT``/``ROLLBACK``/``RELEASE`` are rejected inside ``sql.exec``;
  use ``transactionSync(fn)``, which rolls back when ``fn`` raises;
* at most 100 bound parameters, and bindings limited to ``str``, ``int`` (below 2**53 in
  magnitude), ``float``, ``bytes`` and ``None`` (``bool`` is rejected, as in the runtime);
* statements of at most 100 KB.

Rows come back as ``JsDict``-like dict subclasses that also allow ``row.col`` (SDK >= 1.9), or,
with ``row_mode="attr"``, as objects that only allow attribute access (the runtime's built-in SDK).

It is shipped in the library so applications can test their own holder and client classes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import re
import secrets
import sqlite3
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol, runtime_checkable

from ..core.wire import MAX_INT

__all__ = [
    "T0",
    "VirtualClock",
    "LocalStorage",
    "LocalContext",
    "AlarmDriver",
    "AlarmSource",
    "SkewedClock",
    "DurableObjectRuleError",
    "StorageFault",
]

#: The default start of a :class:`VirtualClock` (epoch milliseconds, November 2023).
T0 = 1_700_000_000_000

_MAX_INT = MAX_INT + 1  # 2**53: the first integer a JavaScript number cannot hold exactly
#: The largest string or blob value (and row) Durable Object SQLite storage accepts: 2 MB.
_MAX_VALUE_BYTES = 2_000_000
_FORBIDDEN = re.compile(r"^\s*(BEGIN|COMMIT|END|SAVEPOINT|ROLLBACK|RELEASE)\b", re.IGNORECASE)
_LEADING_COMMENTS = re.compile(r"^(\s*(--[^\n]*\n|/\*.*?\*/))*", re.DOTALL)


class DurableObjectRuleError(Exception):
    """Raised where the real runtime would reject a storage call."""


class StorageFault(Exception):
    """An injected storage failure (see :attr:`LocalStorage.fail_transaction`)."""


@runtime_checkable
class AlarmSource(Protocol):
    """What a :class:`VirtualClock` fires as time passes (an :class:`AlarmDriver`)."""

    def due(self) -> int | None:
        """When the next delivery is due (clock time), if any."""

    async def fire(self) -> None:
        """Deliver it now."""


# ---------------------------------------------------------------------------------- clock


class VirtualClock:
    """Deterministic time in epoch milliseconds.

    ``clock()`` returns the current virtual time. ``await clock.sleep_until(t)`` suspends until
    :meth:`advance`/:meth:`advance_to` reach ``t``. Alarm drivers registered with
    :meth:`add_source` fire in time order while time advances. :meth:`set` moves time without
    waking or firing anything (for driving an object's ``alarm()`` by hand)."""

    def __init__(self, start_ms: int = T0) -> None:
        self._now = int(start_ms)
        self._sleepers: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._sources: list[AlarmSource] = []

    def __call__(self) -> int:
        """The current virtual time (epoch milliseconds): the clock is a ``clock`` callable."""
        return self._now

    @property
    def now(self) -> int:
        """The current virtual time (epoch milliseconds)."""
        return self._now

    def set(self, at_ms: int) -> None:
        """Put the clock at ``at_ms`` at once, waking no sleeper and firing no alarm.

        For driving an object by hand (calling ``scheduler.alarm()`` yourself at a chosen time,
        or a time that passed while the object was not running). Time may even go back (clock
        skew). To let time pass *with* its sleepers and alarms, use :meth:`advance_to`."""
        self._now = int(at_ms)

    async def sleep_until(self, at_ms: int) -> None:
        """Suspend until virtual time reaches ``at_ms`` (at once, after one yield, if it has)."""
        if at_ms <= self._now:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (int(at_ms), next(self._seq), future))
        await future

    async def sleep(self, ms: int) -> None:
        """Suspend for ``ms`` virtual milliseconds."""
        await self.sleep_until(self._now + int(ms))

    def add_source(self, driver: AlarmSource) -> None:
        """Fire ``driver``'s alarm as time advances (an :class:`AlarmDriver` registers itself)."""
        self._sources.append(driver)

    def remove_source(self, driver: AlarmSource) -> None:
        """Stop firing ``driver``'s alarm (see :meth:`AlarmDriver.close`)."""
        if driver in self._sources:
            self._sources.remove(driver)

    def next_event(self) -> int | None:
        """The earliest pending sleeper or alarm time, if any."""
        times = [t for t, _, f in self._sleepers if not f.done()]
        times += [t for t in (s.due() for s in self._sources) if t is not None]
        return min(times) if times else None

    @staticmethod
    async def settle(rounds: int = 50) -> None:
        """Let every task that can run, run (yield to the event loop repeatedly)."""
        for _ in range(rounds):
            await asyncio.sleep(0)

    async def advance(self, ms: int) -> None:
        """Let ``ms`` virtual milliseconds pass (see :meth:`advance_to`)."""
        await self.advance_to(self._now + int(ms))

    async def advance_to(self, target_ms: int) -> None:
        """Move time forward to ``target_ms``, waking sleepers and firing alarms in order."""
        await self.settle()
        while True:
            while self._sleepers and self._sleepers[0][2].done():
                heapq.heappop(self._sleepers)
            t_sleep = self._sleepers[0][0] if self._sleepers else None
            due_sources = [(s.due(), i, s) for i, s in enumerate(self._sources)]
            due_sources = [x for x in due_sources if x[0] is not None]
            t_alarm = min(due_sources)[0] if due_sources else None
            candidates = [t for t in (t_sleep, t_alarm) if t is not None and t <= target_ms]
            if not candidates:
                break
            t = min(candidates)
            self._now = max(self._now, t)
            if t_sleep is not None and t_sleep == t:
                _, _, future = heapq.heappop(self._sleepers)
                if not future.done():
                    future.set_result(None)
            else:
                source = min(due_sources)[2]
                await source.fire()
            await self.settle()
        self._now = max(self._now, int(target_ms))
        await self.settle()

    async def run_until_idle(self, limit_ms: int = 24 * 3600 * 1000) -> None:
        """Advance to each next event until none is left (or ``limit_ms`` have passed)."""
        end = self._now + limit_ms
        while True:
            t = self.next_event()
            if t is None or t > end:
                return
            await self.advance_to(t)


class _ShiftedSource:
    """An object's alarm source seen on the shared clock: due ``offset_ms`` earlier."""

    def __init__(self, source: AlarmSource, offset_ms: int) -> None:
        self.source = source
        self.offset_ms = offset_ms

    def due(self) -> int | None:
        """The source's due time on the shared clock."""
        due = self.source.due()
        return None if due is None else due - self.offset_ms

    async def fire(self) -> None:
        """Deliver the source's alarm."""
        await self.source.fire()


class SkewedClock(VirtualClock):
    """One object's view of a shared :class:`VirtualClock`, ``offset_ms`` ahead of it (behind
    when negative): clock skew between objects (fault injection; off unless used).

    Reading it gives ``base.now + offset_ms``; sleeping until ``t`` wakes when the shared clock
    reaches ``t - offset_ms``; an alarm driver registered on it fires when the object's own
    clock reaches the alarm (an object's alarm runs on its own machine's clock). Time is driven
    on the shared clock (``advance``/``advance_to`` here take this object's times)."""

    def __init__(self, base: VirtualClock, offset_ms: int = 0) -> None:  # noqa: D107
        self.base = base
        self.offset_ms = int(offset_ms)
        self._shifted: dict[int, _ShiftedSource] = {}

    def __call__(self) -> int:
        """This object's current time (epoch milliseconds)."""
        return self.base.now + self.offset_ms

    @property
    def now(self) -> int:
        """This object's current time (epoch milliseconds)."""
        return self.base.now + self.offset_ms

    def set(self, at_ms: int) -> None:
        """Put the shared clock where this object reads ``at_ms`` (see :meth:`VirtualClock.set`)."""
        self.base.set(int(at_ms) - self.offset_ms)

    async def sleep_until(self, at_ms: int) -> None:
        """Suspend until this object's clock reaches ``at_ms``."""
        await self.base.sleep_until(int(at_ms) - self.offset_ms)

    async def sleep(self, ms: int) -> None:
        """Suspend for ``ms`` virtual milliseconds."""
        await self.base.sleep(ms)

    def add_source(self, driver: AlarmSource) -> None:
        """Fire ``driver``'s alarm when this object's clock reaches it."""
        shifted = _ShiftedSource(driver, self.offset_ms)
        self._shifted[id(driver)] = shifted
        self.base.add_source(shifted)

    def remove_source(self, driver: AlarmSource) -> None:
        """Stop firing ``driver``'s alarm."""
        shifted = self._shifted.pop(id(driver), None)
        if shifted is not None:
            self.base.remove_source(shifted)

    def next_event(self) -> int | None:
        """The shared clock's next event, in this object's time."""
        t = self.base.next_event()
        return None if t is None else t + self.offset_ms

    async def settle(self, rounds: int = 50) -> None:  # type: ignore[override]
        """The shared clock's ``settle``."""
        await self.base.settle(rounds)

    async def advance(self, ms: int) -> None:
        """Let ``ms`` milliseconds pass on the shared clock."""
        await self.base.advance(ms)

    async def advance_to(self, target_ms: int) -> None:
        """Advance the shared clock until this object's clock reads ``target_ms``."""
        await self.base.advance_to(int(target_ms) - self.offset_ms)

    async def run_until_idle(self, limit_ms: int = 24 * 3600 * 1000) -> None:
        """The shared clock's :meth:`VirtualClock.run_until_idle`."""
        await self.base.run_until_idle(limit_ms)


# ---------------------------------------------------------------------------------- storage


class _JsDictRow(dict[str, Any]):
    """Like the SDK's JsDict: a dict that also allows ``row.col``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _AttrRow:
    """Like a JsProxy of a JS object: attribute access only."""

    __slots__ = ("_values",)

    def __init__(self, values: dict[str, Any]) -> None:
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None


class LocalCursor:
    """Shaped like the runtime's ``SqlStorageCursor``."""

    def __init__(self, rows: list[Any], column_names: list[str], rows_written: int) -> None:
        self._rows = rows
        self._pos = 0
        self.columnNames = column_names
        self.rowsRead = len(rows)
        self.rowsWritten = rows_written

    def toArray(self) -> list[Any]:
        """The rows not read yet, as a list."""
        rest = self._rows[self._pos:]
        self._pos = len(self._rows)
        return rest

    def one(self) -> Any:
        """The only row left; raises unless exactly one is."""
        rest = self.toArray()
        if len(rest) != 1:
            raise DurableObjectRuleError(
                f"Expected exactly one result from SQL query, but got {len(rest)}."
            )
        return rest[0]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.toArray())

    def raw(self) -> Iterator[list[Any]]:
        """The rows not read yet, as lists of values in column order."""
        for row in self.toArray():
            values = row if isinstance(row, dict) else row._values
            yield [values[n] for n in self.columnNames]


class LocalSql:
    """``ctx.storage.sql`` on a real SQLite connection."""

    def __init__(self, storage: LocalStorage) -> None:
        self._storage = storage

    @property
    def databaseSize(self) -> int:
        """Size of the database in bytes."""
        conn = self._storage.connection
        page_count = conn.execute("PRAGMA page_count").fetchone()[0]
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        return int(page_count * page_size)

    def exec(self, query: str, *bindings: Any) -> LocalCursor:
        """Run one statement with its bindings, enforcing the runtime's rules."""
        storage = self._storage
        if storage.fail_next_exec is not None:
            exc, storage.fail_next_exec = storage.fail_next_exec, None
            raise exc
        storage._count_down()
        body = _LEADING_COMMENTS.sub("", query)
        if _FORBIDDEN.match(body):
            raise DurableObjectRuleError(
                "To execute a transaction, please use the state.storage.transaction() or "
                "state.storage.transactionSync() APIs instead of the SQL BEGIN TRANSACTION or "
                "SAVEPOINT statements."
            )
        if len(query.encode()) > 100_000:
            raise DurableObjectRuleError("SQL statement too long (over 100 KB)")
        if len(bindings) > 100:
            raise DurableObjectRuleError(f"too many SQL variables: {len(bindings)} > 100")
        for i, value in enumerate(bindings):
            if isinstance(value, bool) or not (
                value is None or isinstance(value, (str, int, float, bytes))
            ):
                raise DurableObjectRuleError(
                    f"binding {i}: unsupported type {type(value).__name__} "
                    "(use str, int, float, bytes or None)"
                )
            if isinstance(value, int) and abs(value) >= _MAX_INT:
                raise DurableObjectRuleError(
                    f"binding {i}: integer {value} does not fit in a JavaScript number"
                )
            size = len(value.encode("utf-8", "surrogatepass")) if isinstance(value, str) else \
                len(value) if isinstance(value, bytes) else 0
            if size > _MAX_VALUE_BYTES:
                raise DurableObjectRuleError(
                    f"binding {i}: a value of {size} bytes is over the 2 MB a row or value may hold")
        storage.statements += 1
        conn = storage.connection
        before = conn.total_changes
        try:
            cur = conn.execute(query, bindings)
        except sqlite3.Error as exc:
            raise DurableObjectRuleError(f"SQL error: {exc}: {query}") from exc
        names = [d[0] for d in cur.description] if cur.description else []
        fetched = cur.fetchall()
        written = conn.total_changes - before
        for row in fetched:
            for value in row:
                if type(value) is int and not -_MAX_INT < value < _MAX_INT:
                    raise DurableObjectRuleError(
                        f"integer {value} read from SQL loses precision in JavaScript"
                    )
        if storage.row_mode == "dict":
            rows: list[Any] = [_JsDictRow(zip(names, row)) for row in fetched]
        else:
            rows = [_AttrRow(dict(zip(names, row))) for row in fetched]
        return LocalCursor(rows, names, written)


class LocalStorage:
    """``ctx.storage`` on a real SQLite database (a file path or ``":memory:"``).

    The same ``LocalStorage`` can be handed to successive object instances to simulate eviction
    and restart: the database and the alarm survive, in-memory state does not."""

    def __init__(self, path: str = ":memory:", *, row_mode: str = "dict") -> None:
        if row_mode not in ("dict", "attr"):
            raise ValueError("row_mode must be 'dict' or 'attr'")
        self.connection = sqlite3.connect(path, isolation_level=None)
        self.row_mode = row_mode
        self.sql = LocalSql(self)
        self._alarm: int | None = None
        self._depth = 0
        self._savepoints = itertools.count()
        #: Statements executed so far (benchmarks read it).
        self.statements = 0
        #: Set to an exception to make the next ``sql.exec`` raise it (fault injection).
        self.fail_next_exec: Exception | None = None
        #: Fault injection (off by default): called as each outermost ``transactionSync`` opens;
        #: returning ``n`` (an int) makes that transaction raise :class:`StorageFault` after ``n``
        #: of its statements ran (at its ``n + 1``-th ``sql.exec``, or when ``fn`` returns if it
        #: runs fewer), so the rollback undoes what it wrote; ``None``: no fault.
        self.fail_transaction: Callable[[], int | None] | None = None
        #: Transactions :attr:`fail_transaction` made raise.
        self.transactions_failed = 0
        self._fail_in: int | None = None
        #: Objects kept in step with this database's transactions (:meth:`keep_in_step`).
        self._in_step: list[Any] = []

    def keep_in_step(self, twin: Any) -> None:
        """Keep ``twin`` (in-memory state with ``snapshot()`` and ``restore(state)``, such as
        :class:`~semaphore.testing.MemoryStores`) in step with this database's transactions:
        it is snapshotted as each transaction or savepoint opens and restored to that snapshot
        if it rolls back (a test helper, not part of the runtime's API)."""
        self._in_step.append(twin)

    def _count_down(self) -> None:
        """Raise the :attr:`fail_transaction` fault when its statement comes."""
        if self._fail_in is None or self._depth == 0:
            return
        if self._fail_in <= 0:
            self._fail_in = None
            self.transactions_failed += 1
            raise StorageFault("injected storage failure inside a transaction")
        self._fail_in -= 1

    def transactionSync(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` in a transaction (nested: a savepoint); roll back if it raises."""
        name = f"tx{next(self._savepoints)}"
        conn = self.connection
        if self._depth == 0 and self.fail_transaction is not None:
            self._fail_in = self.fail_transaction()
        conn.execute(f"SAVEPOINT {name}")
        self._depth += 1
        saved = [(twin, twin.snapshot()) for twin in self._in_step]
        try:
            result = fn()
            if self._depth == 1 and self._fail_in is not None:
                self._fail_in = 0
                self._count_down()  # fewer statements than asked for: fail before the commit
        except BaseException:
            conn.execute(f"ROLLBACK TO {name}")
            conn.execute(f"RELEASE {name}")
            for twin, state in saved:
                twin.restore(state)
            raise
        else:
            conn.execute(f"RELEASE {name}")
            return result
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._fail_in = None

    async def getAlarm(self) -> int | None:
        """The alarm's time, or ``None``."""
        return self._alarm

    async def setAlarm(self, scheduled_time: int | float) -> None:
        """Set (or move) the alarm to ``scheduled_time`` epoch milliseconds."""
        if isinstance(scheduled_time, bool) or not isinstance(scheduled_time, (int, float)):
            raise DurableObjectRuleError("setAlarm() takes a number of epoch milliseconds")
        self._alarm = int(scheduled_time)

    async def deleteAlarm(self) -> None:
        """Clear the alarm (the runtime also clears it just before delivering it)."""
        self._alarm = None

    # test helpers (not part of the runtime's API)
    @property
    def alarm(self) -> int | None:
        """The alarm's time, or ``None`` (synchronous :meth:`getAlarm`, for tests)."""
        return self._alarm

    def close(self) -> None:
        """Close the SQLite connection."""
        self.connection.close()


class _Id:
    """A Durable Object id as the runtime hands it to the object: ``toString()``, and ``name``,
    the name it was reached by (``getByName``/``idFromName``), or ``None`` for an object without
    one (``newUniqueId``), as workerd's ``ctx.id.name``."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self._text = f"id:{name}" if name is not None else secrets.token_hex(32)

    def toString(self) -> str:
        """``id:<name>`` (64 random hex digits without a name, like a Durable Object id's string
        form)."""
        return self._text

    def __str__(self) -> str:
        return self.toString()


class LocalContext:
    """``ctx`` of a Durable Object: ``storage``, ``id`` and ``blockConcurrencyWhile``. ``name``:
    the name the object was reached by (``ctx.id.name``); ``None``, an object without a name
    (a ``newUniqueId`` id: ``ctx.id.name`` is ``None``, its string a random one)."""

    def __init__(self, storage: LocalStorage | None = None, *, name: str | None = "object") -> None:
        self.storage = storage if storage is not None else LocalStorage()
        self.id = _Id(name)

    async def blockConcurrencyWhile(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``fn()`` (one object instance runs one call at a time here anyway)."""
        return await fn()


# ---------------------------------------------------------------------------------- alarms


class AlarmDriver:
    """Fires a storage's alarm through a handler as virtual time passes it.

    Like the runtime: the alarm is cleared before the handler runs; a handler that raises is
    retried with exponential backoff (2 s, 4 s, ... up to ``max_retries``) unless it set a new
    alarm. ``delay_ms`` (an int or a callable returning one) models late alarm delivery
    (deliveries made late are counted in :attr:`delayed`).

    Fault injection (off by default): :attr:`duplicate` and :attr:`spurious_retry`, callables
    asked after each successful delivery. ``duplicate()`` true: the handler runs again at once
    with the same ``alarmInfo`` (a duplicated delivery; counted in :attr:`duplicated`).
    ``spurious_retry()`` true: the runtime takes the delivery for failed and retries it like a
    raising handler (backoff, ``isRetry``; counted in :attr:`spurious_retries`)."""

    #: Asked after each successful delivery: deliver it again at once (fault injection).
    duplicate: Callable[[], bool] | None = None
    #: Asked after each successful delivery: retry it as if it had failed (fault injection).
    spurious_retry: Callable[[], bool] | None = None

    def __init__(
        self,
        clock: VirtualClock,
        storage: LocalStorage,
        handler: Callable[[dict[str, Any]], Awaitable[Any]],
        *,
        delay_ms: int | Callable[[], int] = 0,
        max_retries: int = 6,
    ) -> None:
        self.clock = clock
        self.storage = storage
        self.handler = handler
        self.delay_ms = delay_ms
        self.max_retries = max_retries
        self.fired = 0
        #: Deliveries duplicated and retried by the fault injection hooks.
        self.duplicated = 0
        self.spurious_retries = 0
        #: Deliveries made later than their alarm time because of ``delay_ms``.
        self.delayed = 0
        self.failures: list[BaseException] = []
        self._retry_count = 0
        self._delayed_for: tuple[int, int] | None = None
        clock.add_source(self)

    def close(self) -> None:
        """Stop firing this storage's alarm (the object is gone; another driver may take over)."""
        self.clock.remove_source(self)

    def due(self) -> int | None:
        """When the alarm will be delivered (its time plus the delivery delay), if one is set."""
        alarm = self.storage.alarm
        if alarm is None:
            return None
        if self._delayed_for is None or self._delayed_for[0] != alarm:
            delay = self.delay_ms() if callable(self.delay_ms) else self.delay_ms
            self._delayed_for = (alarm, alarm + max(0, int(delay)))
        return self._delayed_for[1]

    async def fire(self) -> None:
        """Deliver the alarm now: clear it, run the handler, retry (backoff) if it raises."""
        info = await self._deliver()
        if info is None:
            return
        try:
            await self.handler(info)
        except Exception as exc:  # the runtime logs and retries
            await self._failed(exc)
            return
        self._retry_count = 0
        await self._after_success(info)

    async def _after_success(self, info: dict[str, Any]) -> None:
        """The fault injection hooks after a delivery succeeded (see the class documentation)."""
        if self.duplicate is not None and self.duplicate():
            self.duplicated += 1
            try:
                await self.handler(info)
            except BaseException as exc:  # noqa: BLE001 - as for the first delivery (an eviction's
                await self._failed(exc)    # cancellation too: the delivery is retried, at least once)
                return
        if self.spurious_retry is not None and self.spurious_retry():
            self.spurious_retries += 1
            if self.storage.alarm is None:
                await self._retry()
            else:  # the object set a new alarm: that delivery comes as the retry
                self._retry_count += 1

    #: Longest retry backoff in milliseconds (``None``: doubling without a cap).
    max_backoff_ms: int | None = None

    async def _deliver(self) -> dict[str, Any] | None:
        """Clear the alarm as the runtime does before delivering it; the ``alarmInfo`` to pass,
        or ``None`` when no alarm is set."""
        alarm = self.storage.alarm
        if alarm is None:
            return None
        if self._delayed_for is not None and self._delayed_for[0] == alarm and self._delayed_for[1] > alarm:
            self.delayed += 1
        await self.storage.deleteAlarm()
        self._delayed_for = None
        self.fired += 1
        return {"retryCount": self._retry_count, "isRetry": self._retry_count > 0}

    async def _failed(self, exc: BaseException) -> None:
        """Record a failed delivery and, unless the handler set a new alarm, schedule a retry."""
        self.failures.append(exc)
        await self._retry()

    async def _retry(self) -> None:
        """Schedule a retry with backoff, unless the handler set a new alarm."""
        if self.storage.alarm is None and self._retry_count < self.max_retries:
            self._retry_count += 1
            backoff = 2000 * 2 ** (self._retry_count - 1)
            if self.max_backoff_ms is not None:
                backoff = min(backoff, self.max_backoff_ms)
            await self.storage.setAlarm(self.clock.now + backoff)
