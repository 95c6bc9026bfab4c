"""The queue's items in SQL, with an in-memory copy per key (as :mod:`._store` for the client).

:class:`QueueItems` is the only code of the queue's pump that reads or writes its items table
(``durability_semaphore_client_items``; the public views :meth:`SemaphoreQueue.item` and
:meth:`SemaphoreQueue.items` still read SQL, which every write reaches at once). The first use
of a key loads its live items (queued, claiming or running) and its finished items whose
``on_done`` hook is still pending, with the queue's marks of the key (``on_load``), in one
statement; from then on the pump's reads of
the key are answered from memory, and every change is written through to SQL at once (in the
caller's storage transaction, if any) and to the copy: one statement per change of a step,
whatever the number of items it changes (their ids travel as one JSON binding read with
``json_each``, per-item values likewise).

Payloads are kept in the copy only up to :data:`PAYLOAD_KEPT` bytes of JSON; a longer one is
read when an item is handed to a callback (:meth:`QueueItems.payloads`, one read for all the
items of a step), so a long queue of large payloads is not held in memory.

The copy is only a copy: the object is the only writer of its storage, so it holds what SQL
holds as long as every write of the items goes through this class and a storage transaction
that raises forgets the copy (:meth:`QueueItems.forget`, hooked to the storage's rollbacks;
the queue hooks it to the client's storage too). A new object instance starts with no copy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..runtime import JSON_IDS, Storage, chunks, json_list
from ._item_rows import COLUMNS, INSERT_BATCH_BYTES, PAYLOAD_KEPT, batches, kept, kept_payload
from ._rows import RecordedRelease

__all__ = ["QueueItems", "ITEMS", "WAKEUPS", "PENDING", "BLOCKED", "PURGEABLE", "COLUMNS", "PAYLOAD_KEPT",
           "INSERT_BATCH_BYTES", "Add", "DonePending"]

ITEMS = "durability_semaphore_client_items"
WAKEUPS = "durability_semaphore_client_wakeups"
#: Per key, since when releases wait to be reported (``report_releases_within_ms``). Durable, so
#: an object evicted more often than the bound still reports them on time.
PENDING = "durability_semaphore_client_pending_releases"
#: Per ``(key, group)``: the holder's latest ``blocked`` entry (why its queued items wait, R23).
BLOCKED = "durability_semaphore_client_blocked"
#: The finished items a purge may delete, in SQL (:func:`~._item_rows.purgeable`).
PURGEABLE = "state = 'done' AND done_pending = 0"

_PAYLOAD = f"CASE WHEN length(CAST(payload AS BLOB)) <= {PAYLOAD_KEPT} THEN payload END"
_SELECT = ", ".join(COLUMNS) + f", {_PAYLOAD} AS payload"
#: Item rows with the ``blocked`` entry of a queued item's group (the public views).
_VIEW = (f"SELECT i.*, b.reason AS blocked_reason, b.waiting AS blocked_waiting, b.at AS blocked_at"
         f" FROM {ITEMS} i LEFT JOIN {BLOCKED} b"
         " ON i.state = 'queued' AND b.key = i.key AND b.group_name = i.group_name")
#: An item row as one JSON object (the key's load reads rows of several tables in one statement).
_JSON = "json_object(" + ", ".join(f"'{c}', {c}" for c in COLUMNS) + f", 'payload', {_PAYLOAD})"
_LIVE = "state IN ('queued', 'claiming', 'running')"
#: Called with what a key's load read besides its items: ``(key, pending since or None, some
#: blocked entry kept, some finished permit() item kept)`` (the queue's marks).
OnLoad = Callable[[str, "int | None", bool, bool], None]


@dataclass
class _Key:
    """The copy of one key: its kept rows by item id (insertion order is not relied on)."""

    rows: dict[str, dict[str, Any]] = field(default_factory=dict)


class QueueItems:  # a QueueItemStore
    """The items of every key the queue has used, over ``storage`` (see the module
    documentation). ``done_hooks``: the queue has an ``on_done`` hook (finished items whose
    hook is pending are kept too)."""

    def __init__(self, storage: Storage, *, done_hooks: bool, on_load: OnLoad | None = None,
                 before_delete: Callable[[list[RecordedRelease]], None] | None = None) -> None:
        self.storage = storage
        #: Called with the highest release (``release_n``) the items :meth:`purge_done` is about
        #: to delete record per permit, when they record any: the client folds them into its
        #: own rows (:meth:`~._rows.ClientStore.fold_releases`).
        self.before_delete = before_delete
        self.done_hooks = done_hooks
        self.on_load = on_load
        self._keys: dict[str, _Key] = {}
        storage.on_rollback(self.forget)

    def forget(self) -> None:
        """Drop the copy of every key (a transaction rolled back; the next read loads again)."""
        self._keys.clear()

    def _key(self, key: str) -> _Key:
        k = self._keys.get(key)
        if k is None:
            k = _Key()
            if self.on_load is None:
                rows = self.storage.exec(f"SELECT {_SELECT} FROM {ITEMS} WHERE key = ? AND {_LIVE}", key)
                if self.done_hooks:  # the partial index of pending hooks
                    rows += self.storage.exec(f"SELECT {_SELECT} FROM {ITEMS} WHERE key = ? AND done_pending = 1", key)
                k.rows = {str(r["item_id"]): dict(r) for r in rows}
            else:
                self._load(key, k, self.on_load)
            self._keys[key] = k
        return k

    def _load(self, key: str, k: _Key, on_load: OnLoad) -> None:
        """The key's kept items and the queue's marks of it, in one statement (each part through
        its index)."""
        hooks = f" UNION ALL SELECT 'i', {_JSON} FROM {ITEMS} WHERE key = ? AND done_pending = 1" \
            if self.done_hooks else ""
        loaded = self.storage.exec(
            f"SELECT 'i' AS t, {_JSON} AS r FROM {ITEMS} WHERE key = ? AND {_LIVE}{hooks}"
            f" UNION ALL SELECT 'p', since FROM {PENDING} WHERE key = ?"
            f" UNION ALL SELECT 'b', 1 WHERE EXISTS (SELECT 1 FROM {BLOCKED} WHERE key = ?)"
            f" UNION ALL SELECT 'd', 1 WHERE EXISTS"
            f" (SELECT 1 FROM {ITEMS} WHERE key = ? AND state = 'done' AND owner != '')",
            *([key] * (5 if self.done_hooks else 4)))
        pending: int | None = None
        blocked = permits_done = False
        for row in loaded:
            if row["t"] == "i":
                r = json.loads(row["r"])
                k.rows[str(r["item_id"])] = r
            elif row["t"] == "p":
                pending = int(row["r"])
            elif row["t"] == "b":
                blocked = True
            else:
                permits_done = True
        on_load(key, pending, blocked, permits_done)

    # ------------------------------------------------------------------ reads
    def rows(self, key: str, state: str | None = None) -> list[dict[str, Any]]:
        """The kept rows of ``key`` (in ``state``), in enqueue order (copies: a caller may
        compare them with a later read)."""
        rows = [dict(r) for r in self._key(key).rows.values() if state is None or r["state"] == state]
        rows.sort(key=lambda r: int(r["seq"]))
        return rows

    def row(self, key: str, item_id: str) -> dict[str, Any] | None:
        """The kept row of ``item_id`` of ``key`` (a copy), or ``None`` (finished, or unknown)."""
        r = self._key(key).rows.get(item_id)
        return None if r is None else dict(r)

    def find(self, item_id: str) -> dict[str, Any] | None:
        """The row of ``item_id`` of any key, finished or not: from a loaded copy, else one point
        read (its payload left out when long)."""
        for k in self._keys.values():
            r = k.rows.get(item_id)
            if r is not None:
                return dict(r)
        return self.storage.one(f"SELECT {_SELECT} FROM {ITEMS} WHERE item_id = ?", item_id)

    def payloads(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``rows`` with their payloads: those the copy does not keep are read, one statement
        for all of them."""
        missing = [str(r["item_id"]) for r in rows if r["payload"] is None]
        texts: dict[str, str] = {}
        for part in chunks(missing, JSON_IDS):
            texts.update((str(r["item_id"]), str(r["payload"])) for r in self.storage.exec(
                f"SELECT item_id, payload FROM {ITEMS} WHERE item_id IN (SELECT value FROM json_each(?))",
                json_list(part)))
        return [dict(r) if r["payload"] is not None else {**r, "payload": texts.get(str(r["item_id"]), "null")}
                for r in rows]

    def view(self, key: str | None = None, state: str | None = None, item_id: str | None = None
             ) -> list[dict[str, Any]]:
        """Item rows from SQL (a view: finished items too), with the holder's ``blocked``
        entry of a queued item's group, in enqueue order: of ``key``, in ``state``, of
        ``item_id`` (each ``None``: any)."""
        query, args = f"{_VIEW} WHERE 1 = 1", []
        for column, value in (("key", key), ("state", state), ("item_id", item_id)):
            if value is not None:
                query += f" AND i.{column} = ?"
                args.append(value)
        return self.storage.exec(query + " ORDER BY i.seq", *args)

    # ------------------------------------------------------------------ writes
    def insert_new(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """Insert ``row`` (every column but ``seq``, ``payload`` included) as the newest item,
        its ``seq`` one more than the largest, unless an item of its id exists: one statement.
        Returns the row inserted, or ``None`` (the id exists: :meth:`find` it)."""
        if any(str(row["item_id"]) in k.rows for k in self._keys.values()):
            return None
        cols = [c for c in (*COLUMNS, "payload") if c != "seq"]
        done = self.storage.exec(
            f"INSERT INTO {ITEMS}({', '.join(cols)}, seq) SELECT {', '.join('?' for _ in cols)},"
            f" COALESCE(MAX(seq), 0) + 1 FROM {ITEMS} WHERE true ON CONFLICT(item_id) DO NOTHING RETURNING seq",
            *(row[c] for c in cols))
        if not done:
            return None
        new = {**row, "seq": int(done[0]["seq"])}
        self._keep(new)
        return new

    def insert_many(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """:meth:`insert_new` for each of ``rows`` (distinct ids; every column but ``seq``, and
        the same values but ``item_id`` and ``payload``), newest last: one statement per
        :data:`INSERT_BATCH_BYTES` of ids and payloads. The rows inserted are numbered on from
        the largest ``seq`` without gaps: an id that exists (in a loaded copy or only in SQL)
        takes no number, so the numbers do not depend on what the copy holds. Returns the rows
        inserted (an id that exists is left out: :meth:`find_many` it)."""
        fresh = [r for r in rows if not any(str(r["item_id"]) in k.rows for k in self._keys.values())]
        out: list[dict[str, Any]] = []
        for part in batches(fresh):
            if len(part) == 1:
                new = self.insert_new(part[0])
                out += [] if new is None else [new]
                continue
            shared = [c for c in COLUMNS if c not in ("item_id", "seq")]
            assert all(r[c] == part[0][c] for r in part for c in shared)
            seqs = {str(r["item_id"]): int(r["seq"]) for r in self.storage.exec(
                f"INSERT INTO {ITEMS}(item_id, payload, {', '.join(shared)}, seq)"
                f" SELECT json_extract(j.value, '$[0]'), json_extract(j.value, '$[1]'),"
                f" {', '.join('?' for _ in shared)},"
                f" (SELECT COALESCE(MAX(seq), 0) FROM {ITEMS}) + row_number() OVER (ORDER BY j.key)"
                f" FROM json_each(?) AS j WHERE NOT EXISTS"
                f" (SELECT 1 FROM {ITEMS} AS i WHERE i.item_id = json_extract(j.value, '$[0]'))"
                " ON CONFLICT(item_id) DO NOTHING RETURNING item_id, seq",
                *(part[0][c] for c in shared), json_list([[r["item_id"], r["payload"]] for r in part]))}
            for r in part:
                if str(r["item_id"]) in seqs:
                    new = {**r, "seq": seqs[str(r["item_id"])]}
                    self._keep(new)
                    out.append(new)
        return out

    def find_many(self, item_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The rows of ``item_ids`` that exist (as :meth:`find`): from the loaded copies, the
        others in one read per 1,000."""
        found: dict[str, dict[str, Any]] = {}
        for k in self._keys.values():
            found.update((i, dict(k.rows[i])) for i in item_ids if i in k.rows)
        missing = [i for i in item_ids if i not in found]
        for part in chunks(missing, JSON_IDS):
            found.update((str(r["item_id"]), r) for r in self.storage.exec(
                f"SELECT {_SELECT} FROM {ITEMS} WHERE item_id IN (SELECT value FROM json_each(?))", json_list(part)))
        return found

    def insert(self, row: dict[str, Any]) -> None:
        """A new item (``row`` holds every column, ``payload`` included)."""
        cols = (*COLUMNS, "payload")
        self.storage.exec(f"INSERT INTO {ITEMS}({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
                          *(row[c] for c in cols))
        self._keep(row)

    def _keep(self, row: dict[str, Any]) -> None:
        """A new row joins its key's copy (if the key is loaded)."""
        k = self._keys.get(str(row["key"]))
        if k is not None:
            k.rows[str(row["item_id"])] = {**row, "payload": kept_payload(str(row["payload"]))}

    def update(self, key: str, item_ids: Iterable[str], values: Mapping[str, Any],
               each: Mapping[str, Sequence[Any]] | None = None) -> None:
        """Set ``values`` (the same for every item) and ``each`` (a value per item, in the order
        of ``item_ids``) on the items ``item_ids`` of ``key``: one statement (per 1,000 items).
        A value may be a :class:`Add` (``column = column + n``) or :class:`DonePending`."""
        ids = list(item_ids)
        if not ids:
            return
        each = dict(each or {})
        assert len(set(ids)) == len(ids) and all(len(v) == len(ids) for v in each.values())
        k = self._key(key)
        for start in range(0, len(ids), JSON_IDS):
            part = ids[start:start + JSON_IDS]
            per_item = {c: list(v[start:start + JSON_IDS]) for c, v in each.items()}
            self._write(part, values, per_item)
        for i, item_id in enumerate(ids):
            r = k.rows.get(item_id)
            if r is None:
                continue  # finished (or unknown): only SQL had it
            for column, value in values.items():
                r[column] = value.apply(r, column) if isinstance(value, (Add, DonePending)) else value
            for column, per in each.items():
                r[column] = per[i]
            if not kept(r):
                del k.rows[item_id]

    def _write(self, ids: list[str], values: Mapping[str, Any], each: Mapping[str, list[Any]]) -> None:
        sets: list[str] = []
        args: list[Any] = []
        for column, value in values.items():
            if isinstance(value, (Add, DonePending)):
                sets.append(f"{column} = {value.sql(column)}")
                args.extend(value.args())
            else:
                sets.append(f"{column} = ?")
                args.append(value)
        if len(ids) == 1:
            sets += [f"{column} = ?" for column in each]
            args += [v[0] for v in each.values()]
            self.storage.exec(f"UPDATE {ITEMS} SET {', '.join(sets)} WHERE item_id = ?", *args, ids[0])
            return
        rows = json_list([[item_id, *(each[c][i] for c in each)] for i, item_id in enumerate(ids)])
        for n, column in enumerate(each, start=1):
            sets.append(f"{column} = (SELECT json_extract(value, '$[{n}]') FROM json_each(?)"
                        " WHERE json_extract(value, '$[0]') = item_id)")
            args.append(rows)
        self.storage.exec(f"UPDATE {ITEMS} SET {', '.join(sets)}"
                          " WHERE item_id IN (SELECT json_extract(value, '$[0]') FROM json_each(?))", *args, rows)

    def drop_hooks(self) -> int:
        """:meth:`~._item_rows.QueueItemStore.drop_hooks`: one statement (through the pending
        hooks' partial index); the copy drops those items."""
        dropped = len(self.storage.exec(f"UPDATE {ITEMS} SET done_pending = 0 WHERE done_pending = 1"
                                        " RETURNING item_id"))
        for k in self._keys.values():
            for item_id in [i for i, r in k.rows.items() if r["done_pending"]]:
                r = k.rows[item_id]
                r["done_pending"] = 0
                if not kept(r):
                    del k.rows[item_id]
        return dropped

    def purge_done(self, before: int) -> None:
        """:meth:`~._item_rows.QueueItemStore.purge_done`: the releases recorded in those rows
        are folded into the client's rows first (:attr:`before_delete`), then one delete
        through the finished items' index. The copy keeps none of them."""
        where = f"{PURGEABLE} AND finished_at < ?"
        if self.before_delete is not None:
            # the unary + keeps SQLite off the recorded releases' partial index, which would
            # walk every record kept: the finished items' index picks the purged ones
            recorded = [RecordedRelease(str(r["permit_kind"]), str(r["key"]), str(r["permit_id"]), int(r["n"]))
                        for r in self.storage.exec(
                            f"SELECT permit_kind, key, permit_id, MAX(release_n) AS n FROM {ITEMS}"
                            f" WHERE +release_n > 0 AND {where} GROUP BY key, permit_kind, permit_id"
                            " ORDER BY key, permit_kind, permit_id", before)]
            if recorded:
                self.before_delete(recorded)
        self.storage.exec(f"DELETE FROM {ITEMS} WHERE {where}", before)

    def delete_done_permits(self, key: str) -> None:
        """:meth:`~._item_rows.QueueItemStore.delete_done_permits` (nothing to fold): one
        delete (through the items' key and state index) of :func:`~._item_rows.deletable_permit`
        rows."""
        self.storage.exec(f"DELETE FROM {ITEMS} WHERE state = 'done' AND owner != '' AND release_n = 0 AND key = ?",
                          key)


@dataclass(frozen=True)
class Add:
    """``column = column + n`` in :meth:`QueueItems.update`."""

    n: int

    def sql(self, column: str) -> str:
        return f"{column} + ?"

    def args(self) -> list[Any]:
        return [self.n]

    def apply(self, row: Mapping[str, Any], column: str) -> int:
        return int(row[column]) + self.n


@dataclass(frozen=True)
class DonePending:
    """``done_pending``: ``1`` for a callback item (no ``owner``) when the queue has a hook."""

    hook: bool

    def sql(self, column: str) -> str:
        return "(owner = '' AND ?)"

    def args(self) -> list[Any]:
        return [1 if self.hook else 0]

    def apply(self, row: Mapping[str, Any], column: str) -> int:
        return int(not row["owner"] and self.hook)
