"""The queue's items in memory: :class:`MemoryQueueItems`, the twin of the queue's SQL item store.

:class:`~semaphore.client._item_store.QueueItems` keeps a queue's items in SQLite (with an
in-memory copy per key); :class:`MemoryQueueItems` keeps every row in one dict, behind the same
interface (:class:`~semaphore.client._item_rows.QueueItemStore`), deciding what a read shows with
the same pure functions (:func:`~semaphore.client._item_rows.kept`,
:func:`~semaphore.client._item_rows.purgeable`, :func:`~semaphore.client._item_rows.kept_payload`).
It is the specification the SQL store is held to: ``tests/test_queue_item_store_contract.py``
runs the same operations over both and checks that every read answers the same, and that a fresh
SQL store loading what SQL holds answers the same too.

It has no transactions of its own: :meth:`MemoryQueueItems.snapshot` and
:meth:`MemoryQueueItems.restore` let a caller roll it back; :meth:`~MemoryQueueItems.forget`
does nothing (its dict is the truth, not a copy of it). It knows no ``blocked`` entries (the
queue's marks): its :meth:`~MemoryQueueItems.view` gives ``None`` for them, as SQL does for an
item whose group has none.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..client._item_rows import COLUMNS, batches, deletable_permit, kept, kept_payload, purgeable, recorded_releases
from ..client._item_store import Add, DonePending
from ..client._rows import RecordedRelease

__all__ = ["MemoryQueueItems"]

_BLOCKED = {"blocked_reason": None, "blocked_waiting": None, "blocked_at": None}


class MemoryQueueItems:
    """A :class:`~semaphore.client._item_rows.QueueItemStore` over a dict (see the module
    documentation). Reads return copies, so a caller never changes a row behind the store's back."""

    def __init__(self, *, before_delete: Callable[[list[RecordedRelease]], None] | None = None) -> None:
        self._rows: dict[str, dict[str, Any]] = {}
        #: As :class:`~semaphore.client._item_store.QueueItems`'s: what a purge's items record.
        self.before_delete = before_delete

    # ------------------------------------------------------------------ rollback (for callers)
    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every row (a deep copy), for :meth:`restore`."""
        return copy.deepcopy(self._rows)

    def restore(self, state: dict[str, dict[str, Any]]) -> None:
        """Back to a :meth:`snapshot` (a transaction rolled back)."""
        self._rows = copy.deepcopy(state)

    def forget(self) -> None:
        """Nothing to forget: this dict holds the rows themselves, not a copy of storage."""

    # ------------------------------------------------------------------ reads
    @staticmethod
    def _read(r: Mapping[str, Any]) -> dict[str, Any]:
        return {**r, "payload": kept_payload(str(r["payload"]))}

    def rows(self, key: str, state: str | None = None) -> list[dict[str, Any]]:
        """The kept rows of ``key`` (in ``state``), in enqueue order."""
        out = [self._read(r) for r in self._rows.values()
               if r["key"] == key and kept(r) and (state is None or r["state"] == state)]
        return sorted(out, key=lambda r: int(r["seq"]))

    def row(self, key: str, item_id: str) -> dict[str, Any] | None:
        """The kept row of ``item_id`` of ``key``, or ``None``."""
        r = self._rows.get(item_id)
        return None if r is None or r["key"] != key or not kept(r) else self._read(r)

    def find(self, item_id: str) -> dict[str, Any] | None:
        """The row of ``item_id``, finished or not (its payload left out when long)."""
        r = self._rows.get(item_id)
        return None if r is None else self._read(r)

    def find_many(self, item_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The rows of ``item_ids`` that exist, by id."""
        return {i: self._read(self._rows[i]) for i in item_ids if i in self._rows}

    def payloads(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``rows`` with their payloads (an item that no longer exists: ``"null"``)."""
        return [dict(r) if r["payload"] is not None
                else {**r, "payload": str(self._rows[str(r["item_id"])]["payload"])
                      if str(r["item_id"]) in self._rows else "null"} for r in rows]

    def view(self, key: str | None = None, state: str | None = None, item_id: str | None = None
             ) -> list[dict[str, Any]]:
        """Every row matching (finished too, payloads whole), in enqueue order."""
        out = [{**r, **_BLOCKED} for r in self._rows.values()
               if (key is None or r["key"] == key) and (state is None or r["state"] == state)
               and (item_id is None or r["item_id"] == item_id)]
        return sorted(out, key=lambda r: int(r["seq"]))

    # ------------------------------------------------------------------ writes
    def _next_seq(self) -> int:
        return max((int(r["seq"]) for r in self._rows.values()), default=0) + 1

    def insert_new(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """Insert ``row`` as the newest item, unless its id exists."""
        if str(row["item_id"]) in self._rows:
            return None
        new = {**row, "seq": self._next_seq()}
        self._rows[str(row["item_id"])] = {c: new[c] for c in (*COLUMNS, "payload")}
        return new

    def insert_many(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """:meth:`insert_new` for each of ``rows``, in the parts the SQL store writes them in."""
        out: list[dict[str, Any]] = []
        for part in batches(list(rows)):
            shared = [c for c in COLUMNS if c not in ("item_id", "seq")]
            assert all(r[c] == part[0][c] for r in part for c in shared)
            out += [new for new in (self.insert_new(r) for r in part) if new is not None]
        return out

    def update(self, key: str, item_ids: Iterable[str], values: Mapping[str, Any],
               each: Mapping[str, Sequence[Any]] | None = None) -> None:
        """Set ``values`` and ``each`` on the items ``item_ids`` (unknown ones skipped)."""
        ids = list(item_ids)
        each = dict(each or {})
        assert len(set(ids)) == len(ids) and all(len(v) == len(ids) for v in each.values())
        for i, item_id in enumerate(ids):
            r = self._rows.get(item_id)
            if r is None:
                continue
            assert r["key"] == key, f"item {item_id!r} is not of key {key!r}"
            was_kept = kept(r)
            for column, value in values.items():
                r[column] = value.apply(r, column) if isinstance(value, (Add, DonePending)) else value
            for column, per in each.items():
                r[column] = per[i]
            assert was_kept or not kept(r), f"an update brought finished item {item_id!r} back"

    def drop_hooks(self) -> int:
        """No finished item waits for a hook any more; how many did."""
        pending = [r for r in self._rows.values() if r["done_pending"]]
        for r in pending:
            r["done_pending"] = 0
        return len(pending)

    def purge_done(self, before: int) -> None:
        """Delete the purgeable items finished before ``before``."""
        gone = [i for i, r in self._rows.items() if purgeable(r) and int(r["finished_at"]) < before]
        recorded = recorded_releases(self._rows[i] for i in gone)
        if recorded and self.before_delete is not None:
            self.before_delete(recorded)
        for item_id in gone:
            del self._rows[item_id]

    def delete_done_permits(self, key: str) -> None:
        """Delete the finished permit items of ``key`` that record no release."""
        for item_id in [i for i, r in self._rows.items() if r["key"] == key and deletable_permit(r)]:
            del self._rows[item_id]
