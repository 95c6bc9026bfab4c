"""The holder's durable state in ``ctx.storage.sql`` (SPEC §2): schema, loads and writes.

Tables (all created on first use, versioned in ``durability_semaphore_meta``):

``durability_semaphore_grants``
    one row per grant: owner ``client_id``, ``group_name``, ``permits`` (shrinks at reclaim),
    cumulative ``claimed``/``released`` high-water marks, ``issued_at``, ``claim_by``, and
    ``reclaimed`` (the deadline passed and the unclaimed permits were taken back).
``durability_semaphore_leases``
    one row per live or retired lease: ``permits``, ``drawn``/``released`` high-water marks,
    ``stopped`` (the client confirmed its final ``drawn``), ``status``, ``expires_at`` and
    ``reusable`` (its slots are reusable, SPEC R34a).
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
    ``semaphore.core.lease_ids``; a reset storage gets a new epoch).

Indexes keep a round's reads proportional to the clients in it: grants and leases by client,
grants with unclaimed permits by ``claim_by`` (partial index, for reclaim and the alarm), live
leases by ``expires_at`` (partial index, for TTL retirement).

Lists of ids and rows travel as one JSON binding read with ``json_each(?)`` (SQLite's JSON
functions, available in Durable Object storage), so a round of 1,000 clients runs a handful of
statements instead of one per 99 ids (the 100-binding limit) or per 11 rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..core.ledger import Changes, Reads, Snapshot
from ..core.rows import AGGREGATES, GRANT_COLUMNS, GRANT_MUTABLE, LEASE_COLUMNS, LEASE_MUTABLE, GrantRow, LeaseRow
from ..core.seen import ClientSeen
from ..errors import SemaphoreError
from ..runtime import JSON_IDS, JSON_ROWS, Storage, chunks, install_schema, json_list

__all__ = [
    "SCHEMA_VERSION",
    "GRANTS",
    "LEASES",
    "GROUPS",
    "META",
    "TABLES",
    "SqlStore",
    "ensure_schema",
    "drop_schema",
    "read_meta",
]

SCHEMA_VERSION = 1
#: The newest storage schema this release reads: 2 once a reusable lease was stored (SPEC R34a;
#: written by the round that stores it, ``semaphore.core.rounds.REUSABLE_SCHEMA``).
NEWEST_SCHEMA = 2
GRANTS = "durability_semaphore_grants"
LEASES = "durability_semaphore_leases"
GROUPS = "durability_semaphore_groups"
META = "durability_semaphore_meta"
#: Per client: when it last sent a request or a sync (for :meth:`DurabilitySemaphore.holders`).
CLIENTS = "durability_semaphore_clients"
#: One row per force-settle: who, when, why and what it freed (never deleted by the library).
AUDIT = "durability_semaphore_audit"
TABLES = (GRANTS, LEASES, GROUPS, META, CLIENTS, AUDIT)

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
    " expires_at INTEGER NOT NULL, reusable INTEGER NOT NULL DEFAULT 0)",
    f"CREATE INDEX IF NOT EXISTS {LEASES}_client ON {LEASES}(client_id)",
    f"CREATE INDEX IF NOT EXISTS {LEASES}_group ON {LEASES}(group_name)",
    f"CREATE INDEX IF NOT EXISTS {LEASES}_expiry ON {LEASES}(expires_at) WHERE status = 'live'",
    f"CREATE TABLE IF NOT EXISTS {GROUPS} ("
    " group_name TEXT PRIMARY KEY, outstanding INTEGER NOT NULL, lease_footprint INTEGER NOT NULL,"
    " live_leases INTEGER NOT NULL, retired_leases INTEGER NOT NULL)",
    f"CREATE INDEX IF NOT EXISTS {GROUPS}_live ON {GROUPS}(live_leases) WHERE live_leases > 0",
    # claims: the client holds claimed, unreleased permits; expires_at: when crash expiry may
    # release them (its last report plus the claim_ttl_ms its reply told it; NULL: never told);
    # label: the client's label for operators (its messages' ``label``; NULL: none)
    f"CREATE TABLE IF NOT EXISTS {CLIENTS} (client_id TEXT PRIMARY KEY, last_report_at INTEGER NOT NULL,"
    " claims INTEGER NOT NULL DEFAULT 0, expires_at INTEGER, label TEXT)",
    f"CREATE INDEX IF NOT EXISTS {CLIENTS}_expiry ON {CLIENTS}(expires_at) WHERE claims = 1",
    f"CREATE TABLE IF NOT EXISTS {AUDIT} ("
    " audit_id INTEGER PRIMARY KEY AUTOINCREMENT, at INTEGER NOT NULL, action TEXT NOT NULL,"
    " client_id TEXT NOT NULL, reason TEXT NOT NULL, actor TEXT, grant_permits INTEGER NOT NULL,"
    " lease_permits INTEGER NOT NULL, detail TEXT NOT NULL)",
)


#: Columns added after the first release: ``(table, column, declaration)``; tables created by an
#: older release gain them on first use (``ALTER TABLE ... ADD COLUMN``). ``reusable``: a lease's
#: slots are reusable (SPEC R34a; 0 for every lease issued before). ``label``: a client's label
#: (SPEC R38 decision; NULL, no label, for every client seen before).
_ADDED_COLUMNS = ((LEASES, "reusable", "INTEGER NOT NULL DEFAULT 0"), (CLIENTS, "label", "TEXT"))


def ensure_schema(storage: Storage) -> None:
    """Create the schema if missing (and add the columns of :data:`_ADDED_COLUMNS` to tables of
    an older release), versioned in meta ``schema_version`` (SPEC R1); refuse a schema written
    by a newer release."""
    install_schema(storage, _SCHEMA, _ADDED_COLUMNS, ())
    row = storage.one(f"SELECT value FROM {META} WHERE key = 'schema_version'")
    if row is None:
        storage.exec(f"INSERT INTO {META}(key, value) VALUES ('schema_version', ?)", SCHEMA_VERSION)
    elif int(row["value"]) > NEWEST_SCHEMA:
        raise SemaphoreError(
            f"storage holds semaphore schema v{int(row['value'])}, newer than this release "
            f"(v{NEWEST_SCHEMA}); upgrade the library"
        )


def read_meta(storage: Storage) -> dict[str, int]:
    """Every row of ``durability_semaphore_meta`` (schema version, totals, last limit/round,
    last round's ``contended`` flag, lease-id epoch and secret)."""
    return {str(r["key"]): int(r["value"]) for r in storage.exec(f"SELECT key, value FROM {META}")}


def drop_schema(storage: Storage) -> None:
    for table in TABLES:
        storage.exec(f"DROP TABLE IF EXISTS {table}")


class SqlStore:
    """The holder's rows in ``ctx.storage.sql``: loads the :class:`Snapshot` a decision needs
    (:meth:`load`, indexed reads only) and persists its :class:`Changes` (:meth:`persist`, a
    handful of statements whatever the number of rows). Run both inside ``Storage.transaction``."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    # ------------------------------------------------------------------ reads
    def meta(self) -> dict[str, int]:
        return read_meta(self.storage)

    def _load(self, table: str, where: str, params: Sequence[Any]) -> list[dict[str, Any]]:
        return self.storage.exec(f"SELECT * FROM {table} WHERE {where}", *params)

    def _in(self, table: str, column: str, values: Iterable[str], extra: str = "") -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for part in chunks(sorted(set(values)), JSON_IDS):
            rows += self._load(table, f"{column} IN (SELECT value FROM json_each(?)){extra}", [json_list(part)])
        return rows

    def _either(self, table: str, first: tuple[str, list[Any]] | None, column: str,
                values: Iterable[str]) -> list[dict[str, Any]]:
        """The rows matching ``first`` (a where clause and its parameters; ``None``: none) or whose
        ``column`` is in ``values``, with duplicates: the first chunk of ``values`` goes in the
        same statement (``UNION ALL`` of the two index reads), so a sync reads each table once."""
        if first is None:
            return self._in(table, column, values)
        parts = list(chunks(sorted(set(values)), JSON_IDS))
        if not parts:
            return self._load(table, *first)
        where, params = first
        rows = self.storage.exec(
            f"SELECT * FROM {table} WHERE {where} UNION ALL"
            f" SELECT * FROM {table} WHERE {column} IN (SELECT value FROM json_each(?))", *params, json_list(parts[0]))
        return rows + [r for part in parts[1:] for r in self._in(table, column, part)]

    def load(self, reads: Reads, meta: dict[str, int] | None) -> Snapshot:
        """The rows ``reads`` names (each once), with ``meta`` as read by :meth:`meta` (``None``
        for a decision that does not read it)."""
        grants: dict[str, GrantRow] = {}
        leases: dict[str, LeaseRow] = {}

        def grant_rows(rows: list[dict[str, Any]]) -> None:
            for r in rows:
                if str(r["grant_id"]) not in grants:
                    grants[str(r["grant_id"])] = GrantRow.from_row(r)

        def lease_rows(rows: list[dict[str, Any]]) -> None:
            for r in rows:
                if str(r["lease_id"]) not in leases:
                    leases[str(r["lease_id"])] = LeaseRow.from_row(r)

        due = None if reads.due_at is None else ("claim_by <= ? AND claimed < permits", [reads.due_at])
        expired = None if reads.expired_at is None else ("status = 'live' AND expires_at <= ?", [reads.expired_at])
        grant_rows(self._either(GRANTS, due, "client_id", reads.clients))
        lease_rows(self._either(LEASES, expired, "client_id", reads.clients))
        grant_rows(self._in(GRANTS, "grant_id", reads.grant_ids - grants.keys()))
        lease_rows(self._in(LEASES, "lease_id", reads.lease_ids - leases.keys()))
        if reads.all_live_leases:
            lease_rows(self._load(LEASES, "status = 'live'", []))
        elif reads.live_lease_groups:
            lease_rows(self._in(LEASES, "group_name", reads.live_lease_groups, " AND status = 'live'"))
        groups = {str(r["group_name"]): {name: int(r[name]) for name in AGGREGATES}
                  for r in self._in(GROUPS, "group_name", reads.groups)}
        return Snapshot(list(grants.values()), list(leases.values()), meta, groups, reads)

    # ------------------------------------------------------------------ operations (issue 11)
    def seen_rows(self, client_ids: Iterable[str]) -> dict[str, ClientSeen]:
        """The stored rows of these clients (those that have one): one statement per 1,000."""
        return {str(r["client_id"]): ClientSeen(int(r["last_report_at"]), bool(r["claims"]),
                                                None if r["expires_at"] is None else int(r["expires_at"]),
                                                None if r["label"] is None else str(r["label"]))
                for r in self._in(CLIENTS, "client_id", client_ids)}

    def seen(self, holding: Sequence[str], idle: Sequence[str], now: int,
             claiming: frozenset[str] = frozenset(), claim_ttl_ms: int | None = None,
             labels: Mapping[str, str] | None = None) -> None:
        """Record that these clients reported at ``now``: one statement for those ``holding``
        a grant or lease (with whether they hold claimed, unreleased permits, and, with crash
        expiry, when those may expire: ``now + claim_ttl_ms``, the value their reply tells
        them; and their ``labels``, in the same statement: a client without one keeps the label
        stored, so a label costs no statement of its own), one to forget those ``idle`` (holding
        nothing: no row is kept for them, so made-up client ids leave nothing behind)."""
        if holding:
            labels = labels or {}
            rows = [[c, int(c in claiming), labels.get(c)] for c in sorted(set(holding))]
            expires = None if claim_ttl_ms is None else now + claim_ttl_ms
            self.storage.exec(
                f"INSERT INTO {CLIENTS}(client_id, last_report_at, claims, expires_at, label)"
                " SELECT json_extract(value, '$[0]'), ?, json_extract(value, '$[1]'), ?, json_extract(value, '$[2]')"
                " FROM json_each(?) WHERE true"
                " ON CONFLICT(client_id) DO UPDATE SET last_report_at = excluded.last_report_at,"
                " claims = excluded.claims, expires_at = excluded.expires_at,"
                f" label = COALESCE(excluded.label, {CLIENTS}.label)",
                now, expires, json.dumps(rows, separators=(",", ":"), ensure_ascii=False))
        if idle:
            self.storage.exec(f"DELETE FROM {CLIENTS} WHERE client_id IN (SELECT value FROM json_each(?))",
                              json_list(sorted(set(idle))))

    def forget_idle(self, client_ids: Sequence[str]) -> None:
        """Forget the last report time of these clients if they hold no grant and no lease
        (one statement; both owner indexes answer the checks)."""
        self.storage.exec(
            f"DELETE FROM {CLIENTS} WHERE client_id IN (SELECT value FROM json_each(?))"
            f" AND NOT EXISTS (SELECT 1 FROM {GRANTS} g WHERE g.client_id = {CLIENTS}.client_id)"
            f" AND NOT EXISTS (SELECT 1 FROM {LEASES} x WHERE x.client_id = {CLIENTS}.client_id)",
            json_list(sorted(set(client_ids))))

    def holder_page(self, after: str | None, limit: int) -> tuple[list[str], list[dict[str, Any]],
                                                                  list[dict[str, Any]], dict[str, dict[str, Any]]]:
        """Up to ``limit`` clients holding a grant or a lease, in id order after ``after``, with
        their grant rows, lease rows and client rows (``last_report_at``, ``label``) by id:
        reads proportional to the page (a merge of the two owner indexes that stops at
        ``limit``)."""
        start = "" if after is None else after
        ids = [str(r["client_id"]) for r in self.storage.exec(
            f"SELECT client_id FROM {GRANTS} WHERE client_id > ? UNION"
            f" SELECT client_id FROM {LEASES} WHERE client_id > ? ORDER BY 1 LIMIT ?", start, start, limit)]
        if not ids:
            return [], [], [], {}
        grants = self._in(GRANTS, "client_id", ids)
        leases = self._in(LEASES, "client_id", ids)
        seen = {str(r["client_id"]): r for r in self._in(CLIENTS, "client_id", ids)}
        return ids, grants, leases, seen

    def claim_expiry_due(self) -> int | None:
        """When crash expiry next may release claims: the earliest ``expires_at`` of a client
        holding claimed, unreleased permits (one partial-index lookup)."""
        row = self.storage.one(f"SELECT MIN(expires_at) AS at FROM {CLIENTS} WHERE claims = 1")
        return None if row is None or row["at"] is None else int(row["at"])

    def stale_clients(self, now: int) -> list[str]:
        """Clients whose claims may be released at ``now`` (at most 1,000, earliest first)."""
        return [str(r["client_id"]) for r in self.storage.exec(
            f"SELECT client_id FROM {CLIENTS} WHERE claims = 1 AND expires_at <= ? ORDER BY expires_at LIMIT ?",
            now, JSON_IDS)]

    def claims_released(self, client_ids: Sequence[str]) -> None:
        """These clients hold no claimed, unreleased permit any more (crash expiry ran)."""
        self.storage.exec(f"UPDATE {CLIENTS} SET claims = 0 WHERE client_id IN (SELECT value FROM json_each(?))",
                          json_list(sorted(set(client_ids))))

    def write_audit(self, at: int, action: str, client_id: str, reason: str, actor: str | None,
                    grant_permits: int, lease_permits: int, detail: dict[str, Any]) -> int:
        """Append an audit record; returns its id."""
        self.storage.exec(
            f"INSERT INTO {AUDIT}(at, action, client_id, reason, actor, grant_permits, lease_permits, detail)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)", at, action, client_id, reason, actor, grant_permits, lease_permits,
            json.dumps(detail, separators=(",", ":"), ensure_ascii=False))
        row = self.storage.one(f"SELECT MAX(audit_id) AS id FROM {AUDIT}")
        assert row is not None
        self.storage.exec(f"DELETE FROM {CLIENTS} WHERE client_id = ?", client_id)
        return int(row["id"])

    def audit_page(self, before: int | None, limit: int) -> list[dict[str, Any]]:
        """Up to ``limit`` audit rows, newest first, with ids below ``before``."""
        if before is None:  # no sentinel bound: Pyodide passes ints from 2**53 - 1 up as BigInt
            return self.storage.exec(f"SELECT * FROM {AUDIT} ORDER BY audit_id DESC LIMIT ?", limit)
        return self.storage.exec(f"SELECT * FROM {AUDIT} WHERE audit_id < ? ORDER BY audit_id DESC LIMIT ?",
                                 before, limit)

    def next_reclaim_due(self) -> int | None:
        """The earliest deadline of a grant with unclaimed permits (R16), if any."""
        row = self.storage.one(f"SELECT MIN(claim_by) AS due FROM {GRANTS} WHERE claimed < permits")
        return None if row is None or row["due"] is None else int(row["due"])

    def live_lease_pairs(self, client_ids: Iterable[str] | None) -> set[tuple[str, str]]:
        """``(client, group)`` pairs holding a live lease: of the given clients, or all."""
        query = f"SELECT DISTINCT client_id, group_name FROM {LEASES} WHERE status = 'live'"
        if client_ids is None:
            rows = self.storage.exec(query)
        else:
            rows = []
            for part in chunks(sorted(set(client_ids)), JSON_IDS):
                rows += self.storage.exec(query + " AND client_id IN (SELECT value FROM json_each(?))",
                                          json_list(part))
        return {(str(r["client_id"]), str(r["group_name"])) for r in rows}

    def groups_with_live_leases(self) -> set[str]:
        return {str(r["group_name"]) for r in self.storage.exec(
            f"SELECT group_name FROM {GROUPS} WHERE live_leases > 0")}

    def group_rows(self) -> list[dict[str, Any]]:
        """Every group's aggregates, by name (for ``usage()``, R38)."""
        return self.storage.exec(f"SELECT * FROM {GROUPS} ORDER BY group_name")

    # ------------------------------------------------------------------ writes
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

    def _upsert(self, table: str, cols: Sequence[str], key: str, rows: list[tuple[Any, ...]]) -> None:
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

    def _add(self, table: str, key: str, rows: list[tuple[Any, ...]], cols: Sequence[str]) -> None:
        """Add deltas to counters, creating rows as needed."""
        assignments = ", ".join(f"{c} = {c} + excluded.{c}" for c in cols)
        self._insert_json(table, [key, *cols], key, rows, assignments)

    def _delete(self, table: str, column: str, ids: Sequence[str], extra: str = "") -> None:
        for part in chunks(sorted(ids), JSON_IDS):
            self.storage.exec(f"DELETE FROM {table} WHERE {column} IN (SELECT value FROM json_each(?)){extra}",
                              json_list(part))

    def persist(self, changes: Changes) -> None:
        """Write ``changes``: rows (new ones in full, stored ones as an update of their mutable
        columns, deletions), the group aggregates (rows back at zero are deleted), the total
        aggregates and the meta rows."""
        self._upsert(GRANTS, GRANT_COLUMNS, "grant_id", [g.values() for g in changes.new_grants])
        self._update(GRANTS, "grant_id", GRANT_MUTABLE, [g.changes() for g in changes.changed_grants])
        self._delete(GRANTS, "grant_id", changes.deleted_grants)
        self._upsert(LEASES, LEASE_COLUMNS, "lease_id", [x.values() for x in changes.new_leases])
        self._update(LEASES, "lease_id", LEASE_MUTABLE, [x.changes() for x in changes.changed_leases])
        self._delete(LEASES, "lease_id", changes.deleted_leases)
        deltas = changes.group_deltas
        if deltas:
            self._add(GROUPS, "group_name", [(g, *d) for g, d in deltas.items()], AGGREGATES)
            self._delete(GROUPS, "group_name", list(deltas), " AND outstanding = 0 AND lease_footprint = 0"
                         " AND live_leases = 0 AND retired_leases = 0")
            totals = changes.totals()
            self._add(META, "key", list(totals.items()), ["value"])
        if changes.meta_sets:
            self._upsert(META, ["key", "value"], "key", list(changes.meta_sets.items()))
