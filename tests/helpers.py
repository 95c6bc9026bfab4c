"""Shared helpers for holder tests (tier 1, CPython on the SQLite test bed).

* :class:`Bed` builds VirtualClock + LocalContext + DurabilityScheduler + DurabilitySemaphore +
  AlarmDriver, with deterministic ids (``id1``, ``id2``, ...) and an :meth:`Bed.evict` that
  replaces the in-memory objects over the same storage.
* :func:`request` / :func:`sync` build wire messages.
* :func:`dump` snapshots every table (``sqlite_master`` included) to prove "nothing was written".
* :func:`check_aggregates` recomputes the per-group and total aggregates from the grant and lease
  tables by full scan and compares them with ``durability_semaphore_groups`` and ``_meta``.
* :func:`run` runs a coroutine on a fresh event loop (pytest-asyncio is not used).

Everything runs on a real SQLite database; nothing here mocks the library.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
from typing import Any, Awaitable, Callable, Iterable, Mapping

from semaphore import DurabilityScheduler, DurabilitySemaphore
from semaphore.runtime import Storage
from semaphore.testing import AlarmDriver, LocalContext, LocalStorage, VirtualClock

T0 = 1_700_000_000_000  # VirtualClock's default start

GRANTS = "durability_semaphore_grants"
LEASES = "durability_semaphore_leases"
GROUPS = "durability_semaphore_groups"
META = "durability_semaphore_meta"
TIMERS = "durability_scheduler_timers"
RECLAIM_TIMER = "durability_semaphore:reclaim"


def run(coro: Awaitable[Any]) -> Any:
    """Run a coroutine to completion on a fresh event loop."""
    return asyncio.run(coro)  # type: ignore[arg-type]


def async_test(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    """Decorator: an ``async def test_...`` becomes a plain test run with :func:`run`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return run(fn(*args, **kwargs))

    return wrapper


# ----------------------------------------------------------------------------- messages


def _demand(demand: Any, oldest_at: int) -> list[dict[str, Any]]:
    if isinstance(demand, Mapping):
        return [{"group": g, "count": c, "oldestAt": oldest_at} for g, c in demand.items()]
    out = []
    for d in demand:
        if isinstance(d, Mapping):
            out.append(dict(d))
        elif len(d) == 2:
            out.append({"group": d[0], "count": d[1], "oldestAt": oldest_at})
        else:
            out.append({"group": d[0], "count": d[1], "oldestAt": d[2]})
    return out


def _grants(grants: Iterable[Any]) -> list[dict[str, Any]]:
    return [
        dict(g) if isinstance(g, Mapping) else {"grantId": g[0], "claimed": g[1], "released": g[2]}
        for g in grants
    ]


def _leases(leases: Iterable[Any] | None) -> list[dict[str, Any]] | None:
    if leases is None:
        return None
    return [
        dict(x) if isinstance(x, Mapping)
        else {"leaseId": x[0], "drawn": x[1], "released": x[2], "stopped": x[3] if len(x) > 3 else False}
        for x in leases
    ]


def request(
    client_id: str,
    demand: Mapping[str, int] | Iterable[Any] = (),
    grants: Iterable[Any] = (),
    leases: Iterable[Any] | None = None,
    *,
    oldest_at: int = 0,
) -> dict[str, Any]:
    """A ``request`` message. ``demand`` is ``{group: count}`` (all at ``oldest_at``) or a list of
    ``(group, count)``, ``(group, count, oldestAt)`` or dicts; ``grants`` a list of
    ``(grantId, claimed, released)`` or dicts; ``leases`` ``None`` (no lease support) or a list of
    ``(leaseId, drawn, released[, stopped])`` or dicts."""
    message: dict[str, Any] = {
        "type": "request",
        "v": 1,
        "clientId": client_id,
        "demand": _demand(demand, oldest_at),
        "grants": _grants(grants),
    }
    lease_list = _leases(leases)
    if lease_list is not None:
        message["leases"] = lease_list
    return message


def sync(client_id: str, grants: Iterable[Any] = (), leases: Iterable[Any] | None = None) -> dict[str, Any]:
    """A ``sync`` message (reports only)."""
    message: dict[str, Any] = {"type": "sync", "v": 1, "clientId": client_id, "grants": _grants(grants)}
    lease_list = _leases(leases)
    if lease_list is not None:
        message["leases"] = lease_list
    return message


def by_id(reply: Mapping[str, Any], kind: str = "grants") -> dict[str, dict[str, Any]]:
    """``reply["grants"]`` (or ``"leases"``) keyed by id."""
    key = "grantId" if kind == "grants" else "leaseId"
    return {x[key]: x for x in reply[kind]}


def blocked(reply: Mapping[str, Any]) -> dict[str, tuple[str, int]]:
    """``{group: (reason, waiting)}`` of a reply."""
    return {b["group"]: (b["reason"], b["waiting"]) for b in reply["blocked"]}


# ----------------------------------------------------------------------------- storage access


def _query(storage: Any, query: str, *args: Any) -> list[dict[str, Any]]:
    """Read without going through the library's adapter when possible (so fault injection and
    statement counters of the test bed are not disturbed)."""
    if isinstance(storage, LocalContext):
        storage = storage.storage
    if isinstance(storage, Storage):
        return storage.exec(query, *args)
    if isinstance(storage, LocalStorage):
        cur = storage.connection.execute(query, args)
        names = [d[0] for d in cur.description] if cur.description else []
        return [dict(zip(names, row)) for row in cur.fetchall()]
    return Storage(storage).exec(query, *args)


def tables(storage: Any) -> set[str]:
    return {r["name"] for r in _query(storage, "SELECT name FROM sqlite_master WHERE type = 'table'")}


def dump(storage: Any) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, ``sqlite_master`` included, in a canonical order."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    master = _query(storage, "SELECT type, name, tbl_name, sql FROM sqlite_master")
    out["sqlite_master"] = sorted(tuple(str(v) for v in r.values()) for r in master)
    for name in sorted(r["name"] for r in master if r["type"] == "table"):
        rows = _query(storage, f'SELECT * FROM "{name}"')
        out[name] = sorted(tuple(r.items()) for r in rows)
    return out


def rows(storage: Any, table: str, key: str) -> dict[str, dict[str, Any]]:
    """Rows of ``table`` keyed by column ``key`` (empty if the table does not exist)."""
    if table not in tables(storage):
        return {}
    return {str(r[key]): r for r in _query(storage, f"SELECT * FROM {table}")}


def grant_rows(storage: Any) -> dict[str, dict[str, Any]]:
    return rows(storage, GRANTS, "grant_id")


def lease_rows(storage: Any) -> dict[str, dict[str, Any]]:
    return rows(storage, LEASES, "lease_id")


def timers(storage: Any) -> dict[str, int]:
    return {k: int(r["due_at"]) for k, r in rows(storage, TIMERS, "name").items()}


AGGREGATES = ("outstanding", "lease_footprint", "live_leases", "retired_leases")


def check_aggregates(storage: Any) -> dict[str, Any]:
    """Recompute the aggregates from ``durability_semaphore_grants``/``_leases`` by full scan and
    assert they equal ``durability_semaphore_groups`` (per group) and ``_meta`` (totals).

    Also checks every row's own consistency (``0 <= released <= claimed <= permits`` for grants,
    ``0 <= released <= drawn <= permits`` and a known status for leases). A group row whose
    aggregates are all zero is treated like an absent one. Returns
    ``{"groups": {group: {aggregate: value}}, "total": {aggregate: value}}``.
    Works on a :class:`LocalStorage`, a ``LocalContext`` or a ``semaphore.runtime.Storage``."""
    names = tables(storage)
    groups: dict[str, dict[str, int]] = {}

    def acc(group: str) -> dict[str, int]:
        return groups.setdefault(group, dict.fromkeys(AGGREGATES, 0))

    if GRANTS in names:
        for g in _query(storage, f"SELECT * FROM {GRANTS}"):
            assert 0 <= g["released"] <= g["claimed"] <= g["permits"], f"inconsistent grant row {g}"
            assert g["claim_by"] >= g["issued_at"], f"inconsistent grant row {g}"
            acc(g["group_name"])["outstanding"] += g["permits"] - g["released"]
    if LEASES in names:
        for x in _query(storage, f"SELECT * FROM {LEASES}"):
            assert 0 <= x["released"] <= x["drawn"] <= x["permits"], f"inconsistent lease row {x}"
            assert x["status"] in ("live", "retired"), f"unknown lease status {x}"
            a = acc(x["group_name"])
            if x["status"] == "retired" and x["stopped"]:
                a["lease_footprint"] += x["drawn"] - x["released"]
            else:
                a["lease_footprint"] += x["permits"] - x["released"]
            a["live_leases" if x["status"] == "live" else "retired_leases"] += 1
    stored: dict[str, dict[str, int]] = {}
    if GROUPS in names:
        for r in _query(storage, f"SELECT * FROM {GROUPS}"):
            stored[str(r["group_name"])] = {a: int(r[a]) for a in AGGREGATES}
    zero = dict.fromkeys(AGGREGATES, 0)
    for group in sorted(set(groups) | set(stored)):
        expected, actual = groups.get(group, zero), stored.get(group, zero)
        assert expected == actual, f"group {group!r}: recomputed {expected} != stored {actual}"
    total = {a: sum(g[a] for g in groups.values()) for a in AGGREGATES}
    meta: dict[str, int] = {}
    if META in names:
        meta = {str(r["key"]): int(r["value"]) for r in _query(storage, f"SELECT key, value FROM {META}")}
    stored_total = {a: meta.get(a, 0) for a in AGGREGATES}
    assert total == stored_total, f"totals: recomputed {total} != stored {stored_total}"
    return {"groups": {g: v for g, v in groups.items() if any(v.values())}, "total": total}


# ----------------------------------------------------------------------------- the bed


def _secret_option(factory: Callable[[], bytes]) -> dict[str, Any]:
    """``secret_factory=`` for holders that take it (so the suite also runs against an older
    ``src``, e.g. to show that a new test fails there)."""
    import inspect

    if "secret_factory" in inspect.signature(DurabilitySemaphore).parameters:
        return {"secret_factory": factory}
    return {}


def _supported(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` without ``lease_secret`` for a holder that does not take it (an older ``src``:
    a new test then fails on its assertions, not on a TypeError)."""
    import inspect

    if "lease_secret" in options and "lease_secret" not in inspect.signature(DurabilitySemaphore).parameters:
        return {k: v for k, v in options.items() if k != "lease_secret"}
    return options


class Bed:
    """A holder object on the test bed.

    ``Bed(limit=5, group_limit=..., ...)`` passes its keyword options to
    :class:`DurabilitySemaphore`. Ids are ``id1``, ``id2``, ... (never repeated, even across
    :meth:`evict` and :meth:`reset`; a lease id is that id followed by ``.<epoch>.<permits>.<mac>``,
    R32). The ``secret_factory`` bytes (per-storage lease-id secret and storage epoch) are
    deterministic (two beds fed the same rounds store the same rows) but differ at every call,
    so a secret or epoch re-created instead of read back (e.g. after :meth:`evict`) would show.
    ``alarm_delay_ms`` models late alarm delivery; ``name`` is the object's name (its ``ctx.id``
    reads ``id:<name>``). Create it inside the event
    loop that uses it (inside the test's coroutine)."""

    def __init__(
        self,
        limit: Any = 5,
        *,
        storage: LocalStorage | None = None,
        clock: VirtualClock | None = None,
        alarm_delay_ms: int = 0,
        name: str = "object",
        **options: Any,
    ) -> None:
        self.clock = clock if clock is not None else VirtualClock(T0)
        self.t0 = self.clock.now
        self.storage = storage if storage is not None else LocalStorage()
        self.name = name
        self.ctx = LocalContext(self.storage, name=name)
        self.options = {"limit": limit, **options}
        self.alarm_delay_ms = alarm_delay_ms
        self._ids = itertools.count(1)
        self._secrets = itertools.count(1)
        #: Times the holder drew its lease-id secret and epoch (R32: once per storage).
        self.secrets_made = 0
        self._alarm_at: int | None = None
        self._alarm_fires = 0
        #: Times the alarm loop guard tripped (see :meth:`_alarm`); :meth:`check` asserts 0.
        self.alarm_loops = 0
        self._start()

    def _start(self) -> None:
        self.scheduler = DurabilityScheduler(self.ctx, clock=self.clock)
        self.sem = DurabilitySemaphore(
            scheduler=self.scheduler,
            clock=self.clock,
            id_factory=lambda: f"id{next(self._ids)}",
            **_secret_option(self._secret),
            **_supported(self.options),
        )
        self.driver = AlarmDriver(self.clock, self.storage, self._alarm, delay_ms=self.alarm_delay_ms)

    def _secret(self) -> bytes:
        self.secrets_made += 1
        return hashlib.sha256(f"bed secret {next(self._secrets)}".encode()).digest()

    async def _alarm(self, info: Any) -> None:
        """The holder object's ``alarm()``: delegates to the scheduler. Guards the virtual clock
        against an alarm that keeps re-arming at the same instant (it would hang the test):
        after 100 fires at one instant it raises, so the driver backs off and time moves on."""
        now = self.clock.now
        self._alarm_fires = self._alarm_fires + 1 if self._alarm_at == now else 1
        self._alarm_at = now
        if self._alarm_fires > 100:
            self.alarm_loops += 1
            raise RuntimeError(f"alarm re-armed at the same instant {now} over 100 times")
        await self.scheduler.alarm(info)

    @property
    def now(self) -> int:
        return self.clock.now

    def evict(self, **options: Any) -> None:
        """Lose the in-memory instance (its round timer and waiting calls) and start a new
        scheduler + semaphore over the same storage, optionally with changed options."""
        task = self.sem._round_task
        if task is not None and not task.done():
            task.cancel()
        self.driver.close()
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

    def send(self, message: Any) -> "asyncio.Task[dict[str, Any]]":
        """Start ``handle(message)`` as a task (a request waits for its round)."""
        return asyncio.ensure_future(self.sem.handle(message))

    async def settle(self) -> None:
        await self.clock.settle()

    async def finish(self, *tasks: "asyncio.Future[Any]", within_ms: int = 60_000) -> list[Any]:
        """Advance virtual time event by event until every task is done; return their results."""
        end = self.clock.now + within_ms
        await self.clock.settle()
        while not all(t.done() for t in tasks):
            t = self.clock.next_event()
            assert t is not None and t <= end, "tasks did not finish (nothing left to wait for)"
            await self.clock.advance_to(t)
        return [t.result() for t in tasks]

    async def round(self, *messages: Any) -> list[dict[str, Any]]:
        """Send messages together and run time until all are answered."""
        tasks = [self.send(m) for m in messages]
        return await self.finish(*tasks)

    async def one(self, message: Any) -> dict[str, Any]:
        return (await self.round(message))[0]

    async def usage(self) -> dict[str, Any]:
        return await self.sem.usage()

    def grants(self) -> dict[str, dict[str, Any]]:
        return grant_rows(self.storage)

    def leases(self) -> dict[str, dict[str, Any]]:
        return lease_rows(self.storage)

    def dump(self) -> dict[str, list[tuple[Any, ...]]]:
        return dump(self.storage)

    def check(self) -> dict[str, Any]:
        """:func:`check_aggregates` on this bed's storage, and no alarm loop happened."""
        assert self.alarm_loops == 0, "the alarm kept re-arming at the same instant"
        return check_aggregates(self.storage)
