"""The holder's durable state in ``ctx.storage.sql`` (SPEC §2) and a unit of work over it.

Tables (all created on first use, versioned in ``durability_semaphore_meta``):

``durability_semaphore_grants``
    one row per grant: owner ``client_id``, ``group_name``, ``permits`` (shrinks at reclaim),
    cumulative ``claimed``/``released`` high-water marks, ``issued_at``, ``claim_by``, and
    ``reclaimed`` (the deadline passed and the unclaimed permits were taken back).
``durability_semaphore_leases``
    one row per live or retired lease: ``permits``, ``drawn``/``released`` high-water marks,
    ``stopped`` (the client confirmed its final ``drawn``), ``status`` and ``expires_at``.
``durability_semaphore_groups``
    per-group aggregates maintained incrementally in the same transaction as every change:
    ``outstanding`` (sum of ``permits - released``), ``lease_footprint``, ``live_leases``,
    ``retired_leases``. A round reads only the rows of the groups it touches.
``durability_semaphore_meta``
    ``schema_version``, the same four aggregates in total, ``last_limit``, ``last_round_at`` and
    ``contended`` (the R29 flag of the last committed round, 0 or 1; written by the round's own
    meta upsert only when it changes, so a new instance answers syncs with it after eviction),
    ``lease_epoch`` (the storage epoch, 32 random bits) and, when the holder has no
    ``lease_secret``, ``lease_key_0`` .. ``lease_key_7`` (the per-storage lease-id secret, 32
    random bytes as eight 32-bit words), written once by the meta upsert of the first round that
    issues a lease (SPEC R32: lease ids carry the epoch and an HMAC, see
    ``holder.lease_id_for``; a reset storage gets a new epoch).

Indexes keep a round's reads proportional to the clients in it: grants and leases by client,
grants with unclaimed permits by ``claim_by`` (partial index, for reclaim and the alarm), live
leases by ``expires_at`` (partial index, for TTL retirement).

Lists of ids and rows travel as one JSON binding read with ``json_each(?)`` (SQLite's JSON
functions, available in Durable Object storage), so a round of 1,000 clients runs a handful of
statements instead of one per 99 ids (the 100-binding limit) or per 11 rows.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, fields
from typing import Any, Iterable, Iterator, Sequence

from ..errors import SemaphoreError
from ..runtime import Storage

__all__ = [
    "SCHEMA_VERSION",
    "GRANTS",
    "LEASES",
    "GROUPS",
    "META",
    "TABLES",
    "GrantRow",
    "LeaseRow",
    "UnitOfWork",
    "ensure_schema",
    "drop_schema",
    "read_meta",
]

SCHEMA_VERSION = 1
GRANTS = "durability_semaphore_grants"
LEASES = "durability_semaphore_leases"
GROUPS = "durability_semaphore_groups"
META = "durability_semaphore_meta"
TABLES = (GRANTS, LEASES, GROUPS, META)

AGGREGATES = ("outstanding", "lease_footprint", "live_leases", "retired_leases")

_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {META} (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    f"CREATE TABLE IF NOT EXISTS {GRANTS} ("
    " grant_id TEXT PRIMARY KEY, client_id TEXT NOT NULL, group_name TEXT NOT NULL,"
    " permits INTEGER NOT NULL, claimed INTEGER NOT NULL, released INTEGER NOT NULL,"
    " issued_at INTEGER NOT NULL, claim_by INTEGER NOT NULL, reclaimed INTEGER NOT NULL)",
    f"CREATE INDEX IF NOT EXISTS {GRANTS}_client ON {GRANTS}(client_id)",
    f"CREATE INDEX IF NOT EXISTS {GRANTS}_unclaimed ON {GRANTS}(claim_by) WHERE claimed < permits",
    f"CREATE TABLE IF NOT EXISTS {LEASES} ("
    " lease_id TEXT PRIMARY KEY, client_id TEXT NOT NULL, group_name TEXT NOT NULL,"
    " permits INTEGER NOT NULL, drawn INTEGER NOT NULL, released INTEGER NOT NULL,"
    " stopped INTEGER NOT NULL, status TEXT NOT NULL, issued_at INTEGER NOT NULL,"
    " expires_at INTEGER NOT NULL)",
    f"CREATE INDEX IF NOT EXISTS {LEASES}_client ON {LEASES}(client_id)",
    f"CREATE INDEX IF NOT EXISTS {LEASES}_group ON {LEASES}(group_name)",
    f"CREATE INDEX IF NOT EXISTS {LEASES}_expiry ON {LEASES}(expires_at) WHERE status = 'live'",
    f"CREATE TABLE IF NOT EXISTS {GROUPS} ("
    " group_name TEXT PRIMARY KEY, outstanding INTEGER NOT NULL, lease_footprint INTEGER NOT NULL,"
    " live_leases INTEGER NOT NULL, retired_leases INTEGER NOT NULL)",
    f"CREATE INDEX IF NOT EXISTS {GROUPS}_live ON {GROUPS}(live_leases) WHERE live_leases > 0",
)


def ensure_schema(storage: Storage) -> None:
    """Create the schema if missing; refuse a schema written by a newer release."""
    for statement in _SCHEMA:
        storage.exec(statement)
    row = storage.one(f"SELECT value FROM {META} WHERE key = 'schema_version'")
    if row is None:
        storage.exec(f"INSERT INTO {META}(key, value) VALUES ('schema_version', ?)", SCHEMA_VERSION)
    elif int(row["value"]) > SCHEMA_VERSION:
        raise SemaphoreError(
            f"storage holds semaphore schema v{int(row['value'])}, newer than this release "
            f"(v{SCHEMA_VERSION}); upgrade the library"
        )


def read_meta(storage: Storage) -> dict[str, int]:
    """Every row of ``durability_semaphore_meta`` (schema version, totals, last limit/round,
    last round's ``contended`` flag, lease-id epoch and secret)."""
    return {str(r["key"]): int(r["value"]) for r in storage.exec(f"SELECT key, value FROM {META}")}


def drop_schema(storage: Storage) -> None:
    for table in TABLES:
        storage.exec(f"DROP TABLE IF EXISTS {table}")


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


@dataclass(slots=True)
class GrantRow:
    grant_id: str
    client_id: str
    group_name: str
    permits: int
    claimed: int
    released: int
    issued_at: int
    claim_by: int
    reclaimed: bool

    @property
    def charge(self) -> int:
        """Charged capacity (SPEC R19)."""
        return self.permits - self.released

    @property
    def unclaimed(self) -> int:
        return self.permits - self.claimed

    @classmethod
    def from_row(cls, r: dict[str, Any]) -> "GrantRow":
        return cls(str(r["grant_id"]), str(r["client_id"]), str(r["group_name"]), int(r["permits"]),
                   int(r["claimed"]), int(r["released"]), int(r["issued_at"]), int(r["claim_by"]),
                   bool(r["reclaimed"]))

    def values(self) -> tuple[Any, ...]:
        return (self.grant_id, self.client_id, self.group_name, self.permits, self.claimed,
                self.released, self.issued_at, self.claim_by, int(self.reclaimed))

    def changes(self) -> tuple[Any, ...]:
        """The id and the columns a stored grant may change (:data:`_GRANT_MUTABLE`)."""
        return (self.grant_id, self.permits, self.claimed, self.released, int(self.reclaimed))


@dataclass(slots=True)
class LeaseRow:
    lease_id: str
    client_id: str
    group_name: str
    permits: int
    drawn: int
    released: int
    stopped: bool
    status: str  # 'live' | 'retired'
    issued_at: int
    expires_at: int

    @property
    def footprint(self) -> int:
        """SPEC R30: ``permits - released`` until the client confirmed its final draw count,
        then ``drawn - released``."""
        if self.status == "retired" and self.stopped:
            return self.drawn - self.released
        return self.permits - self.released

    @property
    def undrawn(self) -> int:
        return self.permits - self.drawn if self.status == "live" else 0

    @classmethod
    def from_row(cls, r: dict[str, Any]) -> "LeaseRow":
        return cls(str(r["lease_id"]), str(r["client_id"]), str(r["group_name"]), int(r["permits"]),
                   int(r["drawn"]), int(r["released"]), bool(r["stopped"]), str(r["status"]),
                   int(r["issued_at"]), int(r["expires_at"]))

    def values(self) -> tuple[Any, ...]:
        return (self.lease_id, self.client_id, self.group_name, self.permits, self.drawn,
                self.released, int(self.stopped), self.status, self.issued_at, self.expires_at)

    def changes(self) -> tuple[Any, ...]:
        """The id and the columns a stored lease may change (:data:`_LEASE_MUTABLE`)."""
        return (self.lease_id, self.drawn, self.released, int(self.stopped), self.status, self.expires_at)


_GRANT_COLS = [f.name for f in fields(GrantRow)]
_LEASE_COLS = [f.name for f in fields(LeaseRow)]
#: Columns a stored row may change (reports, reclaim, retirement); owner, group, issue time and
#: deadline never change once written. Changed stored rows are written as an ``UPDATE`` of these
#: columns only: fewer values to encode and extract, and the owner index is left alone.
_GRANT_MUTABLE = ["permits", "claimed", "released", "reclaimed"]
_LEASE_MUTABLE = ["drawn", "released", "stopped", "status", "expires_at"]


class UnitOfWork:
    """Rows loaded and changed by one round, sync or reclaim; :meth:`flush` writes them.

    Every change goes through :meth:`put_grant`/:meth:`delete_grant`/:meth:`put_lease`/
    :meth:`delete_lease`, which keep the per-group and total aggregates in step. Run it inside
    ``Storage.transaction``."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.grants: dict[str, GrantRow] = {}
        self.leases: dict[str, LeaseRow] = {}
        # What the aggregates already account for, per row: grant id -> charge (a grant never
        # changes group), lease id -> (group, footprint, status or ""). Every put/delete adds the
        # difference to `deltas`, so the aggregates of a round cost O(changed rows) once, not a
        # rescan per read.
        self._grant_acc: dict[str, int] = {}
        self._lease_acc: dict[str, tuple[str, int, str]] = {}
        self._grants_in_db: set[str] = set()
        self._leases_in_db: set[str] = set()
        self._dirty_grants: set[str] = set()
        self._dirty_leases: set[str] = set()
        self._deleted_grants: set[str] = set()
        self._deleted_leases: set[str] = set()
        #: Aggregate changes so far: group -> [outstanding, lease_footprint, live, retired].
        self.deltas: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        self._meta: dict[str, int] | None = None
        self._meta_sets: dict[str, int] = {}

    # ------------------------------------------------------------------ loading
    def _load(self, table: str, where: str, params: Sequence[Any]) -> list[dict[str, Any]]:
        return self.storage.exec(f"SELECT * FROM {table} WHERE {where}", *params)

    def _in(self, table: str, column: str, values: Iterable[str], extra: str = "") -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        unique = sorted(set(values))
        for part in chunks(unique, JSON_IDS):
            rows += self._load(table, f"{column} IN (SELECT value FROM json_each(?)){extra}", [json_list(part)])
        return rows

    def _adopt_grants(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            gid = str(r["grant_id"])
            if gid not in self.grants and gid not in self._deleted_grants:
                g = GrantRow.from_row(r)
                self.grants[gid] = g
                self._grant_acc[gid] = g.charge
                self._grants_in_db.add(gid)

    def _adopt_leases(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            lid = str(r["lease_id"])
            if lid not in self.leases and lid not in self._deleted_leases:
                lease = LeaseRow.from_row(r)
                self.leases[lid] = lease
                self._lease_acc[lid] = (lease.group_name, lease.footprint, lease.status)
                self._leases_in_db.add(lid)

    def load_clients(self, client_ids: Iterable[str]) -> None:
        ids = list(client_ids)
        self._adopt_grants(self._in(GRANTS, "client_id", ids))
        self._adopt_leases(self._in(LEASES, "client_id", ids))

    def load_grant_ids(self, grant_ids: Iterable[str]) -> None:
        missing = [g for g in grant_ids if g not in self.grants and g not in self._deleted_grants]
        if missing:
            self._adopt_grants(self._in(GRANTS, "grant_id", missing))

    def load_lease_ids(self, lease_ids: Iterable[str]) -> None:
        missing = [x for x in lease_ids if x not in self.leases and x not in self._deleted_leases]
        if missing:
            self._adopt_leases(self._in(LEASES, "lease_id", missing))

    def load_due_grants(self, now: int) -> list[GrantRow]:
        """Grants past their claim deadline that still have unclaimed permits."""
        self._adopt_grants(self._load(GRANTS, "claim_by <= ? AND claimed < permits", [now]))
        return [g for g in self.grants.values() if g.claim_by <= now and g.claimed < g.permits]

    def load_expired_leases(self, now: int) -> list[LeaseRow]:
        self._adopt_leases(self._load(LEASES, "status = 'live' AND expires_at <= ?", [now]))
        return [x for x in self.leases.values() if x.status == "live" and x.expires_at <= now]

    def load_live_leases(self, groups: Iterable[str] | None = None) -> list[LeaseRow]:
        """Live leases, of the given groups or all of them."""
        if groups is None:
            self._adopt_leases(self._load(LEASES, "status = 'live'", []))
            return [x for x in self.leases.values() if x.status == "live"]
        wanted = set(groups)
        if wanted:
            self._adopt_leases(self._in(LEASES, "group_name", wanted, " AND status = 'live'"))
        return [x for x in self.leases.values() if x.status == "live" and x.group_name in wanted]

    # ------------------------------------------------------------------ changes
    def _account_grant(self, gid: str, group: str, charge: int) -> None:
        before = self._grant_acc.get(gid, 0)
        if charge != before:
            self.deltas[group][0] += charge - before
        self._grant_acc[gid] = charge

    def _account_lease(self, lid: str, group: str, footprint: int, status: str) -> None:
        _, fp_before, status_before = self._lease_acc.get(lid, (group, 0, ""))
        d = self.deltas[group]
        d[1] += footprint - fp_before
        if status_before != status:
            if status_before:
                d[2 if status_before == "live" else 3] -= 1
            if status:
                d[2 if status == "live" else 3] += 1
        self._lease_acc[lid] = (group, footprint, status)

    def put_grant(self, g: GrantRow) -> None:
        """Record a new or changed grant (its aggregates follow)."""
        self.grants[g.grant_id] = g
        self._dirty_grants.add(g.grant_id)
        self._account_grant(g.grant_id, g.group_name, g.charge)

    def delete_grant(self, g: GrantRow) -> None:
        self.grants.pop(g.grant_id, None)
        self._dirty_grants.discard(g.grant_id)
        self._deleted_grants.add(g.grant_id)
        self._account_grant(g.grant_id, g.group_name, 0)

    def put_lease(self, lease: LeaseRow) -> None:
        """Record a new or changed lease (its aggregates follow)."""
        self.leases[lease.lease_id] = lease
        self._dirty_leases.add(lease.lease_id)
        self._account_lease(lease.lease_id, lease.group_name, lease.footprint, lease.status)

    def delete_lease(self, lease: LeaseRow) -> None:
        self.leases.pop(lease.lease_id, None)
        self._dirty_leases.discard(lease.lease_id)
        self._deleted_leases.add(lease.lease_id)
        self._account_lease(lease.lease_id, lease.group_name, 0, "")

    # ------------------------------------------------------------------ aggregates
    def meta(self) -> dict[str, int]:
        if self._meta is None:
            self._meta = read_meta(self.storage)
        return self._meta

    def set_meta(self, key: str, value: int) -> None:
        self._meta_sets[key] = int(value)

    def totals(self) -> dict[str, int]:
        """Totals including the changes made so far in this unit of work."""
        meta = self.meta()
        deltas = self.deltas
        return {
            name: meta.get(name, 0) + sum(d[i] for d in deltas.values())
            for i, name in enumerate(AGGREGATES)
        }

    def group_usage(self, groups: Iterable[str]) -> dict[str, dict[str, int]]:
        """Per-group aggregates (including changes so far) for the given groups."""
        wanted = sorted(set(groups))
        out = {g: dict.fromkeys(AGGREGATES, 0) for g in wanted}
        for r in self._in(GROUPS, "group_name", wanted):
            out[str(r["group_name"])] = {name: int(r[name]) for name in AGGREGATES}
        for group, d in self.deltas.items():
            if group in out:
                for i, name in enumerate(AGGREGATES):
                    out[group][name] += d[i]
        return out

    # ------------------------------------------------------------------ flush
    def _insert_json(self, table: str, cols: Sequence[str], key: str, rows: list[tuple[Any, ...]],
                     assignments: str) -> None:
        """``INSERT ... ON CONFLICT DO UPDATE`` of many rows, each row a JSON array in one binding
        (``WHERE true`` keeps SQLite from reading ``ON CONFLICT`` as a join constraint)."""
        picks = ", ".join(f"json_extract(value, '$[{i}]')" for i in range(len(cols)))
        for part in chunks(rows, JSON_ROWS):
            self.storage.exec(
                f"INSERT INTO {table} ({', '.join(cols)}) SELECT {picks} FROM json_each(?) WHERE true"
                f" ON CONFLICT({key}) DO UPDATE SET {assignments}",
                json_list(part),
            )

    def _upsert(self, table: str, cols: list[str], key: str, rows: list[tuple[Any, ...]]) -> None:
        assignments = ", ".join(f"{c} = excluded.{c}" for c in cols if c != key)
        self._insert_json(table, cols, key, rows, assignments)

    def _update(self, table: str, key: str, cols: Sequence[str], rows: list[tuple[Any, ...]]) -> None:
        """``UPDATE ... FROM json_each(?)`` of stored rows: each row a JSON array ``[key, *cols]``
        (a short row: up to :data:`JSON_IDS` per statement, like a list of ids)."""
        sets = ", ".join(f"{c} = json_extract(j.value, '$[{i + 1}]')" for i, c in enumerate(cols))
        for part in chunks(rows, JSON_IDS):
            self.storage.exec(
                f"UPDATE {table} SET {sets} FROM json_each(?) AS j"
                f" WHERE {key} = json_extract(j.value, '$[0]')",
                json_list(part),
            )

    def _write(self, table: str, cols: list[str], key: str, mutable: list[str],
               rows: dict[str, Any], dirty: set[str], stored: set[str]) -> None:
        """Write the dirty rows: new ones in full, stored ones as an update of their mutable
        columns."""
        ids = sorted(dirty)
        self._upsert(table, cols, key, [rows[i].values() for i in ids if i not in stored])
        self._update(table, key, mutable, [rows[i].changes() for i in ids if i in stored])

    def _add(self, table: str, key: str, rows: list[tuple[Any, ...]], cols: Sequence[str]) -> None:
        """Add deltas to counters, creating rows as needed."""
        assignments = ", ".join(f"{c} = {c} + excluded.{c}" for c in cols)
        self._insert_json(table, [key, *cols], key, rows, assignments)

    def _delete(self, table: str, column: str, ids: Sequence[str]) -> None:
        for part in chunks(sorted(ids), JSON_IDS):
            self.storage.exec(f"DELETE FROM {table} WHERE {column} IN (SELECT value FROM json_each(?))",
                              json_list(part))

    def flush(self) -> None:
        deltas = self.deltas
        self._write(GRANTS, _GRANT_COLS, "grant_id", _GRANT_MUTABLE, self.grants, self._dirty_grants,
                    self._grants_in_db)
        self._delete(GRANTS, "grant_id", [g for g in self._deleted_grants if g in self._grants_in_db])
        self._write(LEASES, _LEASE_COLS, "lease_id", _LEASE_MUTABLE, self.leases, self._dirty_leases,
                    self._leases_in_db)
        self._delete(LEASES, "lease_id", [x for x in self._deleted_leases if x in self._leases_in_db])
        changed = {g: d for g, d in deltas.items() if any(d)}
        if changed:
            self._add(GROUPS, "group_name", [(g, *d) for g, d in sorted(changed.items())], AGGREGATES)
            for part in chunks(sorted(changed), JSON_IDS):
                self.storage.exec(
                    f"DELETE FROM {GROUPS} WHERE group_name IN (SELECT value FROM json_each(?))"
                    " AND outstanding = 0 AND lease_footprint = 0 AND live_leases = 0 AND retired_leases = 0",
                    json_list(part),
                )
            totals = [sum(d[i] for d in changed.values()) for i in range(len(AGGREGATES))]
            self._add(META, "key", [(name, totals[i]) for i, name in enumerate(AGGREGATES) if totals[i]], ["value"])
        if self._meta_sets:
            self._upsert(META, ["key", "value"], "key", sorted(self._meta_sets.items()))
        # Written: later reads of this unit of work see the flushed state, and a second flush
        # writes only what changed after this one.
        if self._meta is not None:
            for i, name in enumerate(AGGREGATES):
                self._meta[name] = self._meta.get(name, 0) + sum(d[i] for d in deltas.values())
            self._meta.update(self._meta_sets)
        self.deltas = defaultdict(lambda: [0, 0, 0, 0])
        self._grants_in_db |= self._dirty_grants
        self._grants_in_db -= self._deleted_grants
        self._leases_in_db |= self._dirty_leases
        self._leases_in_db -= self._deleted_leases
        self._dirty_grants.clear()
        self._dirty_leases.clear()
        self._deleted_grants.clear()
        self._deleted_leases.clear()
        self._meta_sets.clear()
