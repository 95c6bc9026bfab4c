"""The client's grant, lease and key rows in SQL, with an in-memory copy per key (SPEC R35).

:class:`ClientRows` is the only code that reads or writes the client's tables
(``durability_semaphore_client_grants``, ``..._leases``, ``..._keys``). The first use of a key
loads its live grants, its live leases and its key row (one statement: a ``UNION ALL`` of the
three indexed reads, each row as a JSON object); from then on every read of the key is answered
from memory, and every change is written through to SQL at once (in the caller's storage
transaction) and to the copy, but a delivered report (:meth:`ClientRows.delivered`): it is
written with the reply's merge of its row, or by :meth:`ClientRows.flush` before the reply's
transaction ends. A tombstone (a dropped grant, a settled
lease) is read only when a reply names it (a point read, remembered), so tombstones cost
nothing while they wait.

The copy is only ever a copy: the object is the only writer of its storage, so what SQL holds
and what the copy holds are the same rows, as long as

* every write of these tables goes through this class (the client's, and the queue's through
  the client's per-key unit of work), and
* a storage transaction that raises (rolled back) forgets the copy: :meth:`ClientRows.forget`
  is hooked to every rollback of the object's storage adapters (:meth:`Storage.on_rollback`),
  and the next read loads again.

A new object instance (after eviction) starts with no copy.

**Recorded releases** (SPEC R35). A queue completing a callback item may record the release of
its permit in the item's own row (``release_n``, the permit's ``released`` count after it)
instead of writing the permit's row (:meth:`ClientRows.record_release`, when the row has
something to report already, :func:`~._rows.recorded_row`). Every read of a grant or lease from
SQL (the key's load, a tombstone's point read, the views) therefore takes ``released`` as at
least the highest count recorded for the row, never above its claimed (drawn) count, through the
items' partial index; before finished items are deleted, :meth:`ClientRows.fold_releases` writes
their recorded releases into the rows. Counts only rise (R13), so the highest is the count.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.client_state import GONE, ClientGrant, ClientLease
from ..core.wire import LeaseStatus
from ..runtime import JSON_ROWS, Storage, chunks, json_list
from ._item_store import ITEMS
from ._rows import (
    GRANT_COLUMNS,
    GRANTS,
    KEY_COLUMNS,
    KEYS,
    LEASE_COLUMNS,
    LEASES,
    ClientStore,
    RecordedRelease,
    changed_row,
    delivered_row,
    grant_row_of,
    lease_row_of,
    recorded_row,
    report_order,
    reports_waiting,
    touched_key,
)

__all__ = ["ClientStore", "ClientRows", "releases_recorded_in", "mark_holder_released_by_ttl",
           "GRANTS", "LEASES", "KEYS", "KEY_COLUMNS", "GRANT_COLUMNS", "LEASE_COLUMNS"]

_SETTLED = LeaseStatus.SETTLED.value


def releases_recorded_in(storage: Storage) -> str | None:
    """The table a queue over ``storage`` records permit releases in (its items, with their
    ``release_n`` column; :meth:`ClientRows.records_releases_in`), or ``None``: no such table
    yet (a queue adds the column, then names the table itself)."""
    present = {str(r["name"]) for r in storage.exec(f"PRAGMA table_info({ITEMS})")}
    return ITEMS if "release_n" in present else None


def _json_row(columns: tuple[str, ...] | list[str]) -> str:
    return "json_object(" + ", ".join(f"'{c}', {c}" for c in columns) + ")"


def _released_sql(released: str, used: str, recorded: str) -> str:
    """SQL of a grant's or lease's ``released`` count given the highest release ``recorded`` for
    it (SPEC R35): counts only rise (R13), so the higher of the two, and never above the row's
    claimed or drawn count ``used`` (the read and the fold share this one clamp)."""
    return f"MAX({released}, MIN({used}, {recorded}))"


def mark_holder_released_by_ttl(storage: Storage) -> None:
    """Set ``holder_released`` on the live grants of keys whose last reply told a
    ``claimTtlMs`` (SPEC R15a): what an upgrade does when it adds the column to an older
    release's grants (see :func:`~._client_model._install_schema`). Runs before any copy is
    loaded (the schema's installation comes first)."""
    storage.exec(f"UPDATE {GRANTS} SET holder_released = 1 WHERE status <> '{GONE}'"
                 f" AND key IN (SELECT key FROM {KEYS} WHERE claim_ttl_ms > 0)")


def _select(kind: str, records: str | None) -> list[tuple[str, str]]:
    """``(column, SQL)`` of a grant or lease row read through the alias ``r``: ``released`` is
    at least the highest release ``records`` holds for the row (:meth:`ClientRows.record_release`;
    never above the row's claimed or drawn count), through that table's partial index."""
    used, id_column = ("claimed", "grant_id") if kind == "grant" else ("drawn", "lease_id")
    out = []
    for c in GRANT_COLUMNS if kind == "grant" else LEASE_COLUMNS:
        sql = f"r.{c}"
        if c == "released" and records is not None:
            recorded = (f"(SELECT MAX(release_n) FROM {records} WHERE release_n > 0 AND key = r.key"
                        f" AND permit_kind = '{kind}' AND permit_id = r.{id_column})")
            sql = _released_sql("r.released", f"r.{used}", f"COALESCE({recorded}, 0)")
        out.append((c, sql))
    return out


def _columns(kind: str, records: str | None) -> str:
    return ", ".join(f"{sql} AS {c}" for c, sql in _select(kind, records))


def _load(records: str | None) -> str:
    """A key's live grants, live leases and key row, in one statement (each branch through its
    table's index), every row as a JSON object tagged with its table."""
    def json_row(kind: str) -> str:
        return "json_object(" + ", ".join(f"'{c}', {sql}" for c, sql in _select(kind, records)) + ")"

    return (f"SELECT 'g' AS t, {json_row('grant')} AS r FROM {GRANTS} r WHERE r.key = ? AND r.status <> '{GONE}'"
            f" UNION ALL SELECT 'l', {json_row('lease')} FROM {LEASES} r"
            f" WHERE r.key = ? AND r.status <> '{LeaseStatus.SETTLED.value}'"
            f" UNION ALL SELECT 'k', {_json_row(['key', *KEY_COLUMNS, 'updated_at'])} FROM {KEYS} WHERE key = ?")


@dataclass
class _Key:
    """The copy of one key: live rows by id, tombstones (or absence) read so far, the key row."""

    grants: dict[str, dict[str, Any]]
    leases: dict[str, dict[str, Any]]
    row: dict[str, Any] | None
    grant_tombs: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    lease_tombs: dict[str, dict[str, Any] | None] = field(default_factory=dict)


class ClientRows:
    """The client's rows of every key it has used, over ``storage`` (see the module
    documentation)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._keys: dict[str, _Key] = {}
        #: Rows whose delivery (:meth:`delivered`) is in the copy only, until written with the
        #: reply's merge (:meth:`write_grant`, :meth:`write_lease`) or by :meth:`flush`.
        self._unwritten: dict[tuple[str, str, str], tuple[str, ...]] = {}
        #: The table that records releases too (:meth:`records_releases_in`), if any.
        self._records: str | None = None
        self._load_sql = _load(None)
        storage.on_rollback(self.forget)

    def records_releases_in(self, table: str) -> None:
        """Releases are recorded in ``table`` too (the queue's items: ``key``, ``permit_kind``,
        ``permit_id``, ``release_n``, indexed where ``release_n > 0``): from now on every read of
        a row from SQL counts them (:meth:`record_release`)."""
        if table == self._records:
            return
        assert not self._unwritten, "records_releases_in inside a transaction that delivered reports"
        self._records = table
        self._load_sql = _load(table)
        self._keys.clear()  # a key loaded before did not count them

    def forget(self) -> None:
        """Drop the copy of every key (a transaction rolled back; the next read loads again)."""
        self._keys.clear()
        self._unwritten.clear()

    def _key(self, key: str) -> _Key:
        k = self._keys.get(key)
        if k is None:
            k = _Key({}, {}, None)
            for loaded in self.storage.exec(self._load_sql, key, key, key):
                r = json.loads(loaded["r"])
                if loaded["t"] == "g":
                    k.grants[str(r["grant_id"])] = r
                elif loaded["t"] == "l":
                    k.leases[str(r["lease_id"])] = r
                else:
                    k.row = {**KEY_COLUMNS, **{c: v for c, v in r.items() if v is not None}}
            self._keys[key] = k
        return k

    # ------------------------------------------------------------------ reads
    def grant_rows(self, key: str) -> list[dict[str, Any]]:
        """The live grant rows of ``key``, earliest claim deadline first."""
        return sorted(self._key(key).grants.values(), key=lambda r: (r["claim_by"], r["grant_id"]))

    def lease_rows(self, key: str) -> list[dict[str, Any]]:
        """The live lease rows of ``key``, earliest expiry first."""
        return sorted(self._key(key).leases.values(), key=lambda r: (r["expires_at"], r["lease_id"]))

    def grant_row(self, key: str, grant_id: str) -> dict[str, Any] | None:
        """One grant row (a tombstone included: read once from SQL), or ``None``."""
        k = self._key(key)
        r = k.grants.get(grant_id)
        if r is not None:
            return r
        if grant_id not in k.grant_tombs:
            k.grant_tombs[grant_id] = self.storage.one(
                f"SELECT {_columns('grant', self._records)} FROM {GRANTS} r WHERE r.key = ? AND r.grant_id = ?",
                key, grant_id)
        return k.grant_tombs[grant_id]

    def lease_row(self, key: str, lease_id: str) -> dict[str, Any] | None:
        """One lease row (a tombstone included: read once from SQL), or ``None``."""
        k = self._key(key)
        r = k.leases.get(lease_id)
        if r is not None:
            return r
        if lease_id not in k.lease_tombs:
            k.lease_tombs[lease_id] = self.storage.one(
                f"SELECT {_columns('lease', self._records)} FROM {LEASES} r WHERE r.key = ? AND r.lease_id = ?",
                key, lease_id)
        return k.lease_tombs[lease_id]

    def grants(self, key: str) -> list[ClientGrant]:
        """The live grants of ``key`` (:meth:`grant_rows` as rows of the core)."""
        return [ClientGrant._from_row(r) for r in self.grant_rows(key)]

    def leases(self, key: str) -> list[ClientLease]:
        """The live leases of ``key`` (:meth:`lease_rows` as rows of the core)."""
        return [ClientLease._from_row(r) for r in self.lease_rows(key)]

    def key_row(self, key: str) -> dict[str, Any] | None:
        """The key row (``None``: never written)."""
        return self._key(key).row

    def every_grant(self, key: str) -> list[ClientGrant]:
        """Every grant row of ``key``, tombstones included, from SQL (a view; the copy keeps
        live rows only), oldest claim deadline first."""
        return [ClientGrant._from_row(r) for r in self.storage.exec(
            f"SELECT {_columns('grant', self._records)} FROM {GRANTS} r WHERE r.key = ?"
            " ORDER BY r.claim_by, r.grant_id", key)]

    def every_lease(self, key: str) -> list[ClientLease]:
        """Every lease row of ``key``, tombstones included, from SQL, earliest expiry first."""
        return [ClientLease._from_row(r) for r in self.storage.exec(
            f"SELECT {_columns('lease', self._records)} FROM {LEASES} r WHERE r.key = ?"
            " ORDER BY r.expires_at, r.lease_id", key)]

    def every_key(self) -> list[str]:
        """Every key with a key row, a live grant or a live lease, from SQL."""
        return [str(r["key"]) for r in self.storage.exec(
            f"SELECT key FROM {KEYS} UNION SELECT key FROM {GRANTS} WHERE status <> '{GONE}'"
            f" UNION SELECT key FROM {LEASES} WHERE status <> '{_SETTLED}' ORDER BY key")]

    # ------------------------------------------------------------------ writes
    def _put(self, kind: str, key: str, row_id: str, row: dict[str, Any]) -> None:
        k = self._key(key)
        live, tombs, gone = (k.grants, k.grant_tombs, GONE) if kind == "grant" else (k.leases, k.lease_tombs, _SETTLED)
        if row["status"] == gone:
            live.pop(row_id, None)
            tombs[row_id] = row
        else:
            tombs.pop(row_id, None)
            live[row_id] = row

    def change(self, kind: str, key: str, row_id: str, column: str, value: int, now: int) -> None:
        """Set one count of a row (a local change, SPEC R13): a clean row that turns dirty has
        had something to report since ``now`` (report order, :func:`changed_row`)."""
        r = self.grant_row(key, row_id) if kind == "grant" else self.lease_row(key, row_id)
        if r is None:
            return  # no such row (the SQL UPDATE would match none)
        new = changed_row(r, kind, column, value, now)
        table, id_column = (GRANTS, "grant_id") if kind == "grant" else (LEASES, "lease_id")
        self.storage.exec(f"UPDATE {table} SET {column} = ?, updated_at = ?, report_at = ?"
                          f" WHERE key = ? AND {id_column} = ?", value, now, new["report_at"], key, row_id)
        self._put(kind, key, row_id, new)

    def record_release(self, kind: str, key: str, row_id: str, released: int, now: int) -> bool:
        """Raise a row's ``released`` to ``released`` for a caller that records it in the table
        named to :meth:`records_releases_in`, in this transaction: in the copy only, when the
        row has something to report already (:func:`recorded_row`), and True; else written as
        :meth:`change` does, and False (the caller need record nothing)."""
        r = self.grant_row(key, row_id) if kind == "grant" else self.lease_row(key, row_id)
        new = None if r is None or self._records is None else recorded_row(r, kind, released)
        if new is None:
            self.change(kind, key, row_id, "released", released, now)
            return False
        self._put(kind, key, row_id, new)
        return True

    def fold_releases(self, recorded: Sequence[RecordedRelease]) -> None:
        """Write into the grant and lease rows the releases ``recorded`` (SPEC R35: the clamp of
        :func:`_released_sql`, which the read shares; a permit named twice takes the highest),
        before the caller deletes the records that hold them: one statement per kind and
        :data:`~..runtime.JSON_ROWS` of them. The copy holds these counts already."""
        for kind, table, id_column, used in (("grant", GRANTS, "grant_id", "claimed"),
                                             ("lease", LEASES, "lease_id", "drawn")):
            rows = [[r.key, r.permit_id, r.n] for r in recorded if r.kind == kind]
            for part in chunks(rows, JSON_ROWS):
                self.storage.exec(
                    f"UPDATE {table} SET released = {_released_sql('released', used, 'x.n')}"
                    " FROM (SELECT json_extract(value, '$[0]') AS key, json_extract(value, '$[1]') AS permit_id,"
                    " MAX(json_extract(value, '$[2]')) AS n FROM json_each(?) GROUP BY 1, 2) AS x"
                    f" WHERE {table}.key = x.key AND {table}.{id_column} = x.permit_id"
                    f" AND {table}.released < MIN({table}.{used}, x.n)",
                    json_list(part))

    def delivered(self, kind: str, key: str, row_id: str, sent: dict[str, int], stamp: int) -> None:
        """The holder applied a report of the row: raise its acknowledged counts to ``sent``
        and move it behind every entry still waiting to be reported (``report_at = stamp``).
        In the copy at once; in SQL with the row's merge from the same reply, or by
        :meth:`flush` (the caller's transaction calls it before it ends): one write per row."""
        r = self.grant_row(key, row_id) if kind == "grant" else self.lease_row(key, row_id)
        if r is None:
            return  # the SQL UPDATE would match no row
        self._put(kind, key, row_id, delivered_row(r, sent, stamp))
        self._unwritten[(kind, key, row_id)] = tuple(sent)

    def flush(self) -> None:
        """Write the deliveries no merge wrote (:meth:`delivered`)."""
        for (kind, key, row_id), columns in self._unwritten.items():
            r = self.grant_row(key, row_id) if kind == "grant" else self.lease_row(key, row_id)
            assert r is not None
            table, id_column = (GRANTS, "grant_id") if kind == "grant" else (LEASES, "lease_id")
            sets = ", ".join(f"{c} = ?" for c in columns)
            self.storage.exec(f"UPDATE {table} SET {sets}, report_at = ? WHERE key = ? AND {id_column} = ?",
                              *(r[c] for c in columns), r["report_at"], key, row_id)
        self._unwritten.clear()

    def write_grant(self, g: ClientGrant, now: int) -> None:
        """Insert or update a grant as merged from a reply (a new row reports from ``now``)."""
        row = grant_row_of(g, self.grant_row(g.key, g.grant_id), now)
        self.storage.exec(
            f"INSERT INTO {GRANTS}({', '.join(GRANT_COLUMNS)}) VALUES ({', '.join('?' for _ in GRANT_COLUMNS)})"
            " ON CONFLICT(key, grant_id) DO UPDATE SET "
            + ", ".join(f"{c} = excluded.{c}" for c in GRANT_COLUMNS[2:]),
            *(row[c] for c in GRANT_COLUMNS))
        self._unwritten.pop(("grant", g.key, g.grant_id), None)
        self._put("grant", g.key, g.grant_id, row)

    def write_lease(self, x: ClientLease, now: int) -> None:
        """Insert or update a lease as merged from a reply (a new row reports from ``now``)."""
        row = lease_row_of(x, self.lease_row(x.key, x.lease_id), now)
        self.storage.exec(
            f"INSERT INTO {LEASES}({', '.join(LEASE_COLUMNS)}) VALUES ({', '.join('?' for _ in LEASE_COLUMNS)})"
            " ON CONFLICT(key, lease_id) DO UPDATE SET "
            + ", ".join(f"{c} = excluded.{c}" for c in LEASE_COLUMNS[2:]),
            *(row[c] for c in LEASE_COLUMNS))
        self._unwritten.pop(("lease", x.key, x.lease_id), None)
        self._put("lease", x.key, x.lease_id, row)

    def touch_key(self, key: str, now: int, **values: int) -> None:
        """Set columns of the key row (others kept, or their defaults for a new row; no write
        when nothing changes, :func:`touched_key`)."""
        row = touched_key(self.key_row(key), key, now, values)
        if row is None:
            return
        self.storage.exec(
            f"INSERT INTO {KEYS}(key, {', '.join(KEY_COLUMNS)}, updated_at)"
            f" VALUES (?, {', '.join('?' for _ in KEY_COLUMNS)}, ?) ON CONFLICT(key) DO UPDATE SET "
            + ", ".join(f"{c} = excluded.{c}" for c in (*KEY_COLUMNS, "updated_at")),
            key, *(row[c] for c in KEY_COLUMNS), now)
        self._key(key).row = row

    def prune(self, key: str, cutoff: int) -> None:
        """Delete the key's tombstones last changed before ``cutoff`` (through the tombstone
        indexes: literal status, so SQLite uses the partial index)."""
        k = self._key(key)
        self.storage.exec(f"DELETE FROM {GRANTS} WHERE key = ? AND status = '{GONE}' AND updated_at < ?", key, cutoff)
        self.storage.exec(f"DELETE FROM {LEASES} WHERE key = ? AND status = '{_SETTLED}' AND updated_at < ?",
                          key, cutoff)
        for tombs in (k.grant_tombs, k.lease_tombs):
            for row_id in [i for i, r in tombs.items() if r is not None and r["updated_at"] < cutoff]:
                tombs[row_id] = None

    # ------------------------------------------------------------------ report windows
    def window(self, key: str, now: int, limit: int, *, leases: bool) -> tuple[
            list[dict[str, Any]], bool, list[dict[str, Any]], bool]:
        """Per list, the rows with something to report first (longest waiting first, by
        ``report_at``), then the least recently reported others: ``(grants, grants cut,
        leases, leases cut)`` of at most ``limit`` each; "cut": a row with something to
        report did not fit (:func:`report_order`)."""
        k = self._key(key)
        return report_order(list(k.grants.values()), list(k.leases.values()) if leases else [], now, limit)

    def waiting(self, key: str, now: int, *, leases: bool) -> int:
        """The most entries of one list with something to report (:meth:`window`)."""
        k = self._key(key)
        return reports_waiting(list(k.grants.values()), list(k.leases.values()) if leases else [], now)
