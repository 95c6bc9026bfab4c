"""The one module that adapts the Durable Object runtime objects to the pure core.

Everything else in this package talks to :class:`Storage`, a narrow view of ``ctx.storage``
(``sql.exec``, ``transactionSync``, ``getAlarm``/``setAlarm``/``deleteAlarm``), and never imports
``js``, ``pyodide`` or ``workers``. This module only *duck-types* what the runtime hands over, so
it runs unchanged on CPython (against :mod:`semaphore.testing`) and inside Pyodide:

* rows may be plain dicts, ``JsDict`` (a ``dict`` subclass, SDK >= 1.9), objects that only allow
  attribute access (the runtime's built-in SDK), or ``JsProxy`` objects with ``to_py()``;
* JavaScript ``null`` may arrive as ``None`` or as Pyodide's ``jsnull``; integral numbers as
  ``int`` or ``float``;
* storage calls may return awaitables (JS promises) or plain values.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import chain, repeat
from typing import Any, TypeVar

from .errors import ConfigurationError

__all__ = ["Storage", "plain", "MAX_BINDINGS", "migrate_tables", "install_schema", "object_id", "object_name",
           "TableWatch", "env_int",
           "json_list", "chunks", "JSON_IDS", "JSON_ROWS"]

T = TypeVar("T")

#: Durable Object SQL allows at most 100 bound parameters per statement.
MAX_BINDINGS = 100
#: What workerd answers ``ctx.storage.sql.exec`` of a class that is not SQLite-backed (its
#: migration lists it under ``new_classes``, or under none).
SQL_NOT_ENABLED = "SQL is not enabled for this Durable Object class"
#: The :class:`ConfigurationError` of a Durable Object class without SQLite storage, when the
#: class is not known (:func:`not_sqlite` names it when it is).
NOT_SQLITE = ("this Durable Object class has no SQLite storage: list it under new_sqlite_classes in a "
              "[[migrations]] entry of wrangler.toml (a class already deployed under new_classes cannot be "
              "changed; add a new class)")
#: :data:`NOT_SQLITE` naming the class.
NOT_SQLITE_NAMED = ("the Durable Object class {name} has no SQLite storage: list {name} under new_sqlite_classes "
                    "in a [[migrations]] entry of wrangler.toml (a class already deployed under new_classes cannot "
                    "be changed; add a new class)")


def not_sqlite(ctx: Any) -> str:
    """The message of the :class:`ConfigurationError` for ``ctx``'s storage without SQLite:
    :data:`NOT_SQLITE_NAMED` with the Durable Object class whose ``ctx`` it is, else
    :data:`NOT_SQLITE`. The runtime's ``ctx`` does not name its class, so the class is that of
    the first caller up the stack (a method of the object: its constructor, ``permits``,
    ``alarm``) whose ``self.ctx`` is ``ctx`` and that is not one of this library's objects.
    Only looked up for this error."""
    frame = inspect.currentframe()
    for _ in range(64):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        try:
            owns = owner is not None and vars(owner).get("ctx") is ctx
        except TypeError:  # no __dict__
            owns = False
        if owns and type(owner).__module__.partition(".")[0] != __name__.partition(".")[0]:
            return NOT_SQLITE_NAMED.format(name=type(owner).__name__)
        frame = frame.f_back
    return NOT_SQLITE


def _is_js_null(value: Any) -> bool:
    return type(value).__name__ in ("JsNull", "JsUndefined")


def env_int(env: Any, name: str, *, minimum: int = 0) -> int:
    """The integer ``[vars]`` entry ``name`` of the Worker's ``env`` (a text var such as ``"2"``).

    A var that is missing, not an integer or below ``minimum`` raises
    :class:`~semaphore.errors.ConfigurationError` naming it (``field`` = ``name``). Read a
    holder's limit with it, ``limit=lambda: env_int(env, "EXPORTS_PER_ACCOUNT")``: the holder
    then answers every waiting request with that error at once, and ``permit()`` raises it,
    instead of the round failing closed until the request times out (SPEC R12 decision)."""
    raw = getattr(env, name, None)
    if raw is None or _is_js_null(raw):
        raise ConfigurationError(f"env has no var {name!r}: set it under [vars] in wrangler.toml", field=name)
    text = str(raw).strip()
    try:
        value = int(text)
    except ValueError:
        raise ConfigurationError(f"var {name} must be an integer, got {text[:40]!r}", field=name) from None
    if value < minimum:
        raise ConfigurationError(f"var {name} must be at least {minimum}, got {value}", field=name)
    return value


#: The Workers SDK's Python wrappers of env bindings (``workers-runtime-sdk``, ``workers/rpc.py``)
#: by the JS class of what they wrap. A ``_FetcherWrapper`` (a service binding) or another
#: ``_BindingWrapper`` answers every attribute with something callable, so it cannot be
#: told from a namespace by its attributes.
_SDK_WRAPPERS = {"_DurableObjectNamespaceWrapper": "DurableObjectNamespace", "_FetcherWrapper": "Fetcher"}


def binding_kind(value: Any) -> str | None:
    """The runtime's class name of an env binding (``"DurableObjectNamespace"``, ``"Fetcher"``
    for a service binding, ``"KvNamespace"``, ...), read from the Workers SDK's wrapper or the
    JS object's ``constructor.name``; ``None`` for a plain Python object (a test's stand-in),
    whose kind only its attributes tell."""
    kind = _SDK_WRAPPERS.get(type(value).__name__)
    if kind is not None:
        return kind
    inner = value.__dict__.get("_binding") if hasattr(value, "__dict__") else None
    js = inner if inner is not None else value
    if not _is_js_proxy(js):
        return None
    try:
        name = js.constructor.name
    except Exception:  # noqa: BLE001 - a JS object without a constructor: unknown
        return None
    return name if isinstance(name, str) else None


def _is_js_proxy(value: Any) -> bool:
    """Whether ``value`` is a Pyodide ``JsProxy`` (duck-typed: this module never imports
    ``pyodide``): its class is ``JsProxy`` or one of Pyodide's subclasses of it."""
    return any(cls.__name__.startswith("JsProxy") or cls.__name__ == "JsProxy" for cls in type(value).__mro__) \
        or type(value).__module__.startswith("pyodide")


def plain(value: Any) -> Any:
    """Convert a value received from the runtime (RPC argument, row) into plain Python:
    dicts, lists, str, int, float, bool, bytes and None. JS proxies are converted with their
    ``to_py()``; integral floats stay floats (the wire validator decides what is an integer)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if _is_js_null(value):
        return None
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    to_py = getattr(value, "to_py", None)
    if callable(to_py):
        return plain(to_py())
    return value


_PLAIN_CELLS = frozenset((str, int, float, type(None)))
_STR_KEYS = frozenset((str,))


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float)):
        return value
    if _is_js_null(value):
        return None
    if isinstance(value, memoryview):
        return bytes(value)
    return value


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


try:  # pragma: no cover - only inside Pyodide
    from pyodide.ffi import (  # type: ignore[import-not-found]
        create_once_callable as _create_once_callable,
    )
    from pyodide.ffi import jsnull as _JS_NULL
    from pyodide.ffi import to_js as _to_js
except ImportError:  # CPython (tests): looked up once here, not at every transaction
    _create_once_callable = _JS_NULL = _to_js = None


def _sdk_inner(storage: Any) -> Any:
    """The JavaScript ``ctx.storage`` that the Workers SDK's ``_BindingWrapper`` holds
    (``workers-runtime-sdk``, ``workers/rpc.py``: the SDK wraps ``ctx.storage`` because its JS
    class is ``DurableObjectStorage``), or ``None`` for anything else (a test's stand-in, the
    runtime's own object). Through the wrapper, every SQL call converts each argument and its
    cursor with the SDK's RPC converters (deep copies and checks meant for RPC); :class:`Storage`
    calls the JS object directly instead (``scripts/bench_runtime.py`` measures a sync, a
    request and a job's life on the real runtime)."""
    if type(storage).__name__ != "_BindingWrapper":
        return None
    inner = vars(storage).get("_binding")
    if inner is None or _to_js is None:  # pragma: no cover - an SDK that no longer keeps it there
        return None
    try:  # pragma: no cover - only inside Pyodide
        usable = callable(getattr(inner.sql, "exec", None)) and callable(getattr(inner, "transactionSync", None))
    except Exception:  # noqa: BLE001 - not the storage object we know: keep the wrapper (slower, correct)
        return None
    return inner if usable else None  # pragma: no cover


#: The largest integer (either way) a direct SQL call binds: JavaScript's largest safe integer
#: (the wire's ``MAX_INT``; a number beyond it reads back as a float). CPython binds 64 bits.
MAX_BOUND_INTEGER = 2**53 - 1
#: Pyodide passes an int as a JavaScript number below this (either way), else as a BigInt.
_PYODIDE_NUMBERS = 2**53 - 1


def _js_binding(value: Any) -> Any:  # pragma: no cover - only inside Pyodide
    """A bound SQL parameter for a direct JS call, bound as CPython's ``sqlite3`` binds it:
    ``None`` as JavaScript ``null`` (Pyodide would pass ``undefined``), bytes as a
    ``Uint8Array`` (a BLOB), a bool as 0 or 1 (JavaScript ``true`` would be bound as the text
    ``'true'``); str, float and int convert implicitly, but Pyodide passes an int from
    ``2**53 - 1`` either way as a BigInt, which workerd refuses ("Cannot convert a BigInt value
    to a number"): ``±(2**53 - 1)`` (:data:`MAX_BOUND_INTEGER`) is passed as the number it
    equals exactly, beyond that it raises ``OverflowError`` (CPython's ``sqlite3`` raises it
    beyond 64 bits). Anything else raises ``TypeError``, as through the SDK's converters
    (workerd would bind a list as its text)."""
    if value is None:
        return _JS_NULL
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and not -_PYODIDE_NUMBERS < value < _PYODIDE_NUMBERS:
        if not -MAX_BOUND_INTEGER <= value <= MAX_BOUND_INTEGER:
            raise OverflowError(f"cannot bind {value} as an SQL parameter: the Workers runtime binds integers"
                                f" only up to {MAX_BOUND_INTEGER} either way")
        return float(value)  # exact: a JS number, bound as the integer it is
    if isinstance(value, (str, int, float)):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _to_js(bytes(value))
    raise TypeError(f"cannot bind a {type(value).__name__} as an SQL parameter")


def _once_callable(fn: Callable[[], Any]) -> Any:
    """Wrap a Python callable handed to JavaScript so Pyodide frees its proxy after one call.
    Outside Pyodide the callable is returned as is."""
    if _create_once_callable is None:
        return fn
    return _create_once_callable(fn)  # pragma: no cover


class Storage:
    """Narrow, Pythonic view of a Durable Object's ``ctx.storage``.

    ``exec`` always consumes its cursor (so DDL never finds a table locked) and returns rows as
    dicts keyed by column name with plain cells (a row that already is one, such as the SDK's
    ``JsDict``, is returned as it is)."""

    def __init__(self, ctx: Any) -> None:
        storage = getattr(ctx, "storage", None)
        if storage is None:
            raise TypeError("expected a Durable Object ctx with a .storage attribute")
        sql = getattr(storage, "sql", None)
        if sql is None:
            raise ConfigurationError(not_sqlite(ctx), field="migrations")
        self._ctx = ctx
        self._storage = storage
        inner = _sdk_inner(storage)
        #: SQL and transactions go to the JS object itself when the SDK wraps it (_sdk_inner).
        self._direct = inner is not None
        self._sql = inner.sql if inner is not None else sql
        self._inner = inner
        #: Number of SQL statements executed through this adapter (for benchmarks).
        self.statements = 0
        self._rollback_hooks: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ SQL
    def exec(self, query: str, *bindings: Any) -> list[dict[str, Any]]:
        """Run one statement and return all its rows as dicts."""
        if len(bindings) > MAX_BINDINGS:
            raise ValueError(f"{len(bindings)} bound parameters exceed the limit of {MAX_BINDINGS}")
        self.statements += 1
        if self._direct:  # pragma: no cover - only inside Pyodide
            bindings = tuple(map(_js_binding, bindings))
        try:
            cursor = self._sql.exec(query, *bindings)
        except Exception as exc:
            if SQL_NOT_ENABLED in str(exc):  # a class without its new_sqlite_classes migration
                raise ConfigurationError(not_sqlite(self._ctx), field="migrations") from exc
            raise
        return self._rows(cursor)

    def one(self, query: str, *bindings: Any) -> dict[str, Any] | None:
        """Run one statement and return its first row, or ``None``."""
        rows = self.exec(query, *bindings)
        return rows[0] if rows else None

    @staticmethod
    def _rows(cursor: Any) -> list[dict[str, Any]]:
        to_array = getattr(cursor, "toArray", None)
        raw: Any = to_array() if callable(to_array) else cursor
        to_py = getattr(raw, "to_py", None)  # a JS array (a direct call): converted in one step
        rows = list(to_py() if callable(to_py) else raw)
        if not rows:
            return []
        # Fast path (the common case): dicts or JsDicts with str keys (the rows of one statement
        # share their column names) and plain cells are used as they are: no copy, and the type
        # checks run in C over all cells at once.
        if (all(map(isinstance, rows, repeat(dict)))
                and _STR_KEYS.issuperset(map(type, rows[0]))
                and _PLAIN_CELLS.issuperset(map(type, chain.from_iterable(map(dict.values, rows))))):
            return rows
        names: list[str] | None = None
        out: list[dict[str, Any]] = []
        for row in rows:
            if isinstance(row, dict):
                out.append({str(k): _cell(v) for k, v in row.items()})
                continue
            to_py = getattr(row, "to_py", None)
            if callable(to_py):
                converted = to_py()
                if isinstance(converted, dict):
                    out.append({str(k): _cell(v) for k, v in converted.items()})
                    continue
            if names is None:
                names = [str(n) for n in cursor.columnNames]
            out.append({n: _cell(getattr(row, n)) for n in names})
        return out

    def transaction(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (synchronous) in one storage transaction; an exception rolls it back and
        propagates. Returns ``fn``'s result (kept on the Python side, never converted). Inside
        another transaction it is a savepoint of that one (workerd's ``transactionSync`` nests
        so, as the test kit's does): its writes commit or roll back with the outer one."""
        box: list[T] = []

        def body() -> None:
            box.append(fn())

        try:
            # looked up at each call (a test may wrap ctx.storage.transactionSync to inject faults)
            (self._storage if self._inner is None else self._inner).transactionSync(_once_callable(body))
        except BaseException:
            for hook in self._rollback_hooks:
                hook()
            raise
        return box[0]

    def on_rollback(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` whenever a :meth:`transaction` of this adapter raises (its writes
        were rolled back): an in-memory copy of rows (the client's) forgets what it holds."""
        self._rollback_hooks.append(hook)

    # ------------------------------------------------------------------ alarm
    async def get_alarm(self) -> int | None:
        value = _cell(await _maybe_await(self._storage.getAlarm()))
        return None if value is None else int(value)

    async def set_alarm(self, at_ms: int) -> None:
        await _maybe_await(self._storage.setAlarm(int(at_ms)))

    async def delete_alarm(self) -> None:
        await _maybe_await(self._storage.deleteAlarm())


def object_id(ctx: Any) -> str | None:
    """``str(ctx.id)`` of a Durable Object (``ctx.id.toString()`` through the runtime's proxy),
    or ``None`` when ``ctx`` has no id (a bare :class:`Storage`)."""
    ident = getattr(ctx, "id", None)
    if ident is None:
        return None
    to_string = getattr(ident, "toString", None)
    return str(to_string()) if callable(to_string) else str(ident)


def object_name(ctx: Any) -> str | None:
    """The name a Durable Object was reached by: ``ctx.id.name``, which workerd sets inside the
    object for ids made with ``idFromName``/``getByName`` (Cloudflare's changelog of 2026-03-15,
    "Access Durable Object name via ctx.id.name"; workerd PR 6421 for local development). ``None``
    where the runtime gives none: ``newUniqueId``/``idFromString`` ids, names over 1,024 bytes,
    an older runtime, JavaScript ``undefined``/``null``, an empty name, or ``ctx`` without an id
    (a bare :class:`Storage`)."""
    ident = getattr(ctx, "id", None)
    if ident is None:
        return None
    try:
        name = getattr(ident, "name", None)
    except Exception:  # noqa: BLE001 - a JS getter that throws: no name
        return None
    if name is None or _is_js_null(name):
        return None
    return name if isinstance(name, str) and name else None


def install_schema(storage: Storage, schema: Iterable[str],
                   added_columns: Iterable[tuple[str, str, str]], indexes: Iterable[str]) -> list[tuple[str, str]]:
    """Create a component's tables (``schema``: ``CREATE TABLE IF NOT EXISTS``), add the
    ``(table, column, declaration)`` columns missing from tables of an older release
    (``ALTER TABLE ... ADD COLUMN``; ``PRAGMA table_info`` is allowed in Durable Object SQL),
    then create the ``indexes`` (after the columns they may cover). Every step is idempotent, so
    a step cut short is completed on the next use; no transaction of its own, since first use
    may happen inside the caller's. Returns the ``(table, column)`` pairs it added (a caller may
    fill a new column of existing rows)."""
    for statement in schema:
        storage.exec(statement)
    present: dict[str, set[str]] = {}  # one read of each table's columns
    added: list[tuple[str, str]] = []
    for table, column, declaration in added_columns:
        if table not in present:
            present[table] = {str(r["name"]) for r in storage.exec(f"PRAGMA table_info({table})")}
        if column not in present[table]:
            storage.exec(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
            present[table].add(column)
            added.append((table, column))
    for statement in indexes:
        storage.exec(statement)
    return added


def migrate_tables(ctx: Any, to_version: int | None, tables: Iterable[str], schema: Iterable[str]) -> None:
    """The ``migrate(ctx, to_version)`` of a component owning ``tables``: ``None`` drops them,
    ``1`` runs its ``schema`` statements (``CREATE ... IF NOT EXISTS``)."""
    storage = ctx if isinstance(ctx, Storage) else Storage(ctx)
    if to_version is None:
        for table in tables:
            storage.exec(f"DROP TABLE IF EXISTS {table}")
    else:
        for statement in schema:
            storage.exec(statement)


class TableWatch:
    """Whether a table one component owns exists, for a scheduler participant's ``next_due()``.

    ``next_due()`` runs at every ``arm()`` (after each round and sync): it must create nothing
    (a component never used, or migrated away, stays without tables) and should cost no failing
    read. Only "present" is remembered (tables come and go through the static ``migrate``, which
    no instance hears of): while a table is absent each check is one schema read; once present,
    none, until a read fails because it went away meanwhile (``migrate(ctx, None)``), which
    forgets it. Code that would create tables checks afresh (``exists(fresh=True)``)."""

    def __init__(self, storage: Storage, table: str) -> None:
        self.storage = storage
        self.table = table
        self._known = False

    def exists(self, *, fresh: bool = False) -> bool:
        """Whether the table exists (``fresh``: read the schema even if it was seen present)."""
        if fresh or not self._known:
            self._known = self.storage.one(
                "SELECT 1 AS x FROM sqlite_master WHERE type = 'table' AND name = ?", self.table) is not None
        return self._known

    def created(self) -> None:
        """This instance created (or found) the table."""
        self._known = True

    def read(self, fn: Callable[[], T]) -> T | None:
        """``fn()`` if the table exists, else ``None`` (nothing is read or created)."""
        if not self.exists():
            return None
        try:
            return fn()
        except Exception:
            if not self.exists(fresh=True):  # removed meanwhile
                return None
            raise


#: Rows or ids per statement when a list travels as one JSON binding (``json_each``): one
#: statement per round instead of one per 99 ids or 11 rows, while a worst-case binding
#: (1,000 ids of 256 characters, or 500 rows) stays far below the runtime's 2 MB value limit.
JSON_IDS = 1000
JSON_ROWS = 500


def json_list(values: Sequence[Any]) -> str:
    """One binding carrying a list, read in SQL with ``json_each(?)``."""
    return json.dumps(list(values), separators=(",", ":"), ensure_ascii=False)


def chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]
