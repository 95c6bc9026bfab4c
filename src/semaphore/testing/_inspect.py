"""Read an object's storage in tests: every table (:func:`dump`, to prove "nothing was written"),
rows by key (:func:`grant_rows`, :func:`lease_rows`, :func:`timers`, :func:`rows`) and a full
recount of the holder's aggregates (:func:`check_aggregates`).

Every function takes a :class:`~semaphore.testing.LocalStorage`, a
:class:`~semaphore.testing.LocalContext` or the library's :class:`semaphore.runtime.Storage`
adapter (so it also reads a real Durable Object's storage through a ``ctx``). On a
``LocalStorage`` it reads the SQLite connection directly, so fault injection
(``fail_next_exec``) and the statement counter are left alone.
"""

from __future__ import annotations

from typing import Any

from ..holder import GRANTS, GROUPS, LEASES, META, DurabilitySemaphore
from ..runtime import Storage
from ..scheduler import TABLE as TIMERS
from ._local import LocalContext, LocalStorage

__all__ = [
    "RECLAIM_TIMER", "TIMERS", "AGGREGATES", "query", "tables", "dump", "rows", "grant_rows",
    "lease_rows", "timers", "check_aggregates",
]

#: Name of the holder's reclaim participant: a key of ``scheduler.due_times()`` (of :func:`timers`
#: only while the reclaim is failing and backed off).
RECLAIM_TIMER: str = DurabilitySemaphore.RECLAIM_TIMER
#: The per-group aggregates the holder keeps in ``durability_semaphore_groups`` (and totals in
#: ``durability_semaphore_meta``).
AGGREGATES = ("outstanding", "lease_footprint", "live_leases", "retired_leases")


def query(storage: Any, sql: str, *args: Any) -> list[dict[str, Any]]:
    """Run one statement ``sql`` with its bindings on ``storage``; every row as a dict."""
    if isinstance(storage, LocalContext):
        storage = storage.storage
    if isinstance(storage, Storage):
        return storage.exec(sql, *args)
    if isinstance(storage, LocalStorage):
        cur = storage.connection.execute(sql, args)
        names = [d[0] for d in cur.description] if cur.description else []
        return [dict(zip(names, row)) for row in cur.fetchall()]
    ctx = storage if hasattr(storage, "storage") else LocalContext(storage)  # a ctx, or a bare storage
    return Storage(ctx).exec(sql, *args)


def tables(storage: Any) -> set[str]:
    """Names of the tables in ``storage``."""
    return {r["name"] for r in query(storage, "SELECT name FROM sqlite_master WHERE type = 'table'")}


def dump(storage: Any) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, ``sqlite_master`` included, in a canonical order: two dumps
    are equal exactly when nothing was written in between."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    master = query(storage, "SELECT type, name, tbl_name, sql FROM sqlite_master")
    out["sqlite_master"] = sorted(tuple(str(v) for v in r.values()) for r in master)
    for name in sorted(r["name"] for r in master if r["type"] == "table"):
        found = query(storage, f'SELECT * FROM "{name}"')
        out[name] = sorted(tuple(r.items()) for r in found)
    return out


def rows(storage: Any, table: str, key: str) -> dict[str, dict[str, Any]]:
    """Rows of ``table`` keyed by column ``key`` (empty if the table does not exist)."""
    if table not in tables(storage):
        return {}
    return {str(r[key]): r for r in query(storage, f'SELECT * FROM "{table}"')}


def grant_rows(storage: Any) -> dict[str, dict[str, Any]]:
    """The holder's grant rows keyed by grant id."""
    return rows(storage, GRANTS, "grant_id")


def lease_rows(storage: Any) -> dict[str, dict[str, Any]]:
    """The holder's lease rows keyed by lease id."""
    return rows(storage, LEASES, "lease_id")


def timers(storage: Any) -> dict[str, int]:
    """The scheduler's timers: ``{name: due time}``."""
    return {k: int(r["due_at"]) for k, r in rows(storage, TIMERS, "name").items()}


def _recount(storage: Any, names: set[str]) -> dict[str, dict[str, int]]:
    """Per-group aggregates recomputed from the grant and lease rows, each row checked."""
    groups: dict[str, dict[str, int]] = {}

    def acc(group: str) -> dict[str, int]:
        return groups.setdefault(group, dict.fromkeys(AGGREGATES, 0))

    if GRANTS in names:
        for g in query(storage, f"SELECT * FROM {GRANTS}"):
            assert 0 <= g["released"] <= g["claimed"] <= g["permits"], f"inconsistent grant row {g}"
            assert g["claim_by"] >= g["issued_at"], f"inconsistent grant row {g}"
            acc(g["group_name"])["outstanding"] += g["permits"] - g["released"]
    if LEASES in names:
        for x in query(storage, f"SELECT * FROM {LEASES}"):
            reusable = bool(x.get("reusable"))  # SPEC R34a: drawn may pass permits
            assert 0 <= x["released"] <= x["drawn"] and (reusable or x["drawn"] <= x["permits"]), \
                f"inconsistent lease row {x}"
            assert x["status"] in ("live", "retired"), f"unknown lease status {x}"
            a = acc(x["group_name"])
            if x["status"] == "retired" and x["stopped"]:  # R30
                a["lease_footprint"] += min(x["permits"], x["drawn"] - x["released"])
            else:  # R30a: a reusable lease charges all its slots until its final draw count
                a["lease_footprint"] += x["permits"] if reusable else x["permits"] - x["released"]
            a["live_leases" if x["status"] == "live" else "retired_leases"] += 1
    return groups


def check_aggregates(storage: Any) -> dict[str, Any]:
    """Recompute the holder's aggregates from its grant and lease tables by full scan and assert
    they equal ``durability_semaphore_groups`` (per group) and ``durability_semaphore_meta``
    (totals).

    Also checks every row's own consistency (``0 <= released <= claimed <= permits`` for grants,
    ``0 <= released <= drawn <= permits``, of a reusable lease ``0 <= released <= drawn``, and a
    known status for leases). A group row whose
    aggregates are all zero counts as an absent one. Returns
    ``{"groups": {group: {aggregate: value}}, "total": {aggregate: value}}`` (groups with
    anything charged only)."""
    names = tables(storage)
    groups = _recount(storage, names)
    stored: dict[str, dict[str, int]] = {}
    if GROUPS in names:
        for r in query(storage, f"SELECT * FROM {GROUPS}"):
            stored[str(r["group_name"])] = {a: int(r[a]) for a in AGGREGATES}
    zero = dict.fromkeys(AGGREGATES, 0)
    for group in sorted(set(groups) | set(stored)):
        expected, actual = groups.get(group, zero), stored.get(group, zero)
        assert expected == actual, f"group {group!r}: recomputed {expected} != stored {actual}"
    total = {a: sum(g[a] for g in groups.values()) for a in AGGREGATES}
    meta: dict[str, int] = {}
    if META in names:
        found = query(storage, f"SELECT key, value FROM {META}")
        meta = {str(r["key"]): int(r["value"]) for r in found if r["key"] in AGGREGATES}
    stored_total = {a: meta.get(a, 0) for a in AGGREGATES}
    assert total == stored_total, f"totals: recomputed {total} != stored {stored_total}"
    return {"groups": {g: v for g, v in groups.items() if any(v.values())}, "total": total}
