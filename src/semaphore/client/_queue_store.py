"""The queue's per-key marks in SQL, with an in-memory copy (as :mod:`._store` for the client).

:class:`QueueMarks` reads and writes the queue's small per-key tables: the wake time
(``durability_semaphore_client_wakeups``), since when releases wait to be reported
(``..._pending_releases``) and whether the holder's ``blocked`` entries are kept
(``..._blocked``). A key's mark is read once (with the key's items, or a point read) and then
answered from memory; a
write that would change nothing (a wake time set no earlier, a mark set that is set, a mark
cleared that is clear) is not sent. A rolled back transaction forgets the copy
(:meth:`QueueMarks.forget`, hooked to the storage's rollbacks).

The wake-up participant's ``next_due`` (the earliest wake time of every key) is answered from a
copy of the :data:`WAKES_KEPT` earliest wake times (one statement through the wake-time index,
then kept by every wake-time write), so arming the alarm reads nothing and a first read costs
the same with any number of keys. A wake-up reads its due keys from SQL on its first pass, and
forgets the copy when they differ from it (the table dropped, or dropped and created again, by
``migrate`` while an instance lives); its later passes read the copy.

It also knows when a purge of finished items would delete nothing (the earliest finished item
is younger than the cutoff; no permit item of the key finished since the last delete), so the
admission step sends no such statement.
"""

from __future__ import annotations

import json
from typing import Any

from ..runtime import Storage
from ._item_store import BLOCKED, ITEMS, PENDING, PURGEABLE, WAKEUPS

__all__ = ["QueueMarks", "WAKEUPS", "PENDING", "BLOCKED"]


_UNREAD: Any = object()
#: How many of the earliest wake times the copy keeps: every key's for an object of up to this
#: many keys; with more, a first read costs no more, and the later ones are read as they come.
WAKES_KEPT = 64


class QueueMarks:  # a QueueMarkStore
    """Wake times, pending-release marks and kept ``blocked`` entries per key (the
    :class:`~._mark_rows.QueueMarkStore` over SQL)."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        #: The copy of the wake times: ``_near`` holds every key whose ``(wake time, key)`` is
        #: before ``_horizon`` (``None``: every key's; unread until first needed), ``_far`` the
        #: point reads of keys past it.
        self._near: dict[str, int] = {}
        self._horizon: Any = _UNREAD
        self._far: dict[str, int | None] = {}
        self._pending: dict[str, int | None] = {}
        self._blocked: dict[str, bool] = {}
        #: The earliest ``finished_at`` of a done item (any key; ``None``: none), and the keys
        #: that may have finished permit items not yet deleted.
        self._done_min: Any = _UNREAD
        self._permits_done: dict[str, bool] = {}
        storage.on_rollback(self.forget)

    def forget(self) -> None:
        """Drop every copy (a transaction rolled back)."""
        self._near.clear()
        self._horizon = _UNREAD
        self._far.clear()
        self._pending.clear()
        self._blocked.clear()
        self._done_min = _UNREAD
        self._permits_done.clear()

    # ------------------------------------------------------------------ wake times
    def _read_wakes(self) -> None:
        """The :data:`WAKES_KEPT` earliest wake times (and the earliest finished item, if not
        known: :meth:`purge_due`), in one statement through the wake-time index."""
        rows = self.storage.exec(
            f"SELECT key, wake_at FROM (SELECT key, wake_at FROM {WAKEUPS} ORDER BY wake_at, key LIMIT ?)"
            f" UNION ALL SELECT NULL, MIN(finished_at) FROM {ITEMS} WHERE {PURGEABLE}", WAKES_KEPT + 1)
        wakes = sorted((int(r["wake_at"]), str(r["key"])) for r in rows if r["key"] is not None)
        self._horizon = wakes[WAKES_KEPT] if len(wakes) > WAKES_KEPT else None
        self._near = {k: w for w, k in wakes[:WAKES_KEPT]}
        self._far.clear()
        if self._done_min is _UNREAD:
            done = next(r["wake_at"] for r in rows if r["key"] is None)
            self._done_min = None if done is None else int(done)

    def _beyond(self, key: str, at: int) -> bool:
        """``(at, key)`` is past what the copy keeps (its wake time is not in ``_near``)."""
        return self._horizon is not None and (at, key) >= self._horizon

    def wake(self, key: str) -> int | None:
        """When the queue next wants to work on ``key`` (``None``: no row)."""
        if self._horizon is _UNREAD:
            self._read_wakes()
        if key in self._near:
            return self._near[key]
        if self._horizon is None:
            return None
        if key not in self._far:
            row = self.storage.one(f"SELECT wake_at FROM {WAKEUPS} WHERE key = ?", key)
            self._far[key] = None if row is None else int(row["wake_at"])
        return self._far[key]

    def earliest_wake(self) -> int | None:
        """The earliest wake time of any key (``None``: none): read once, then the copy (read
        again when every wake time it kept has moved past what it keeps)."""
        if self._horizon is _UNREAD or (not self._near and self._horizon is not None):
            self._read_wakes()
        return min(self._near.values(), default=None)

    def stored_due_keys(self, at: int) -> list[str]:
        """The keys whose stored wake time is ``at`` or earlier, earliest first (from SQL: it
        fails if the table is gone)."""
        return [str(r["key"]) for r in self.storage.exec(
            f"SELECT key FROM {WAKEUPS} WHERE wake_at <= ? ORDER BY wake_at, key", at)]

    def due_keys(self, at: int) -> list[str]:
        """The keys whose wake time is ``at`` or earlier, earliest first (from the copy, unless
        ``at`` reaches past what it keeps)."""
        self.earliest_wake()
        if self._horizon is not None and at >= self._horizon[0]:
            return self.stored_due_keys(at)
        return [k for w, k in sorted((w, k) for k, w in self._near.items() if w <= at)]

    def set_wake(self, key: str, at: int | None, *, earlier_only: bool = False) -> None:
        """Set (``earlier_only``: lower) the key's wake time; ``None`` removes it."""
        current = self.wake(key)
        if at is None:
            if current is not None:
                self.storage.exec(f"DELETE FROM {WAKEUPS} WHERE key = ?", key)
            self._near.pop(key, None)
            self._far[key] = None
            return
        at = int(at)
        new = min(current, at) if earlier_only and current is not None else at
        if new != current:
            self.storage.exec(
                f"INSERT INTO {WAKEUPS}(key, wake_at) VALUES (?, ?)"
                " ON CONFLICT(key) DO UPDATE SET wake_at = excluded.wake_at", key, new)
        if self._beyond(key, new):
            self._near.pop(key, None)
            self._far[key] = new
        else:
            self._near[key] = new
            self._far.pop(key, None)

    def loaded(self, key: str, pending: int | None, blocked: bool, permits_done: bool) -> None:
        """What the load of the key's items read of its marks (:class:`QueueItems` ``on_load``);
        a mark this copy knows already stays."""
        self._pending.setdefault(key, pending)
        self._blocked.setdefault(key, blocked)
        self._permits_done.setdefault(key, permits_done)

    # ------------------------------------------------------------------ pending releases
    def pending(self, key: str) -> int | None:
        """Since when the key's releases wait to be reported (``None``: none)."""
        since = self._pending.get(key, _UNREAD)
        if since is _UNREAD:
            row = self.storage.one(f"SELECT since FROM {PENDING} WHERE key = ?", key)
            since = self._pending[key] = None if row is None else int(row["since"])
        return since  # type: ignore[no-any-return]

    def start_pending(self, key: str, now: int) -> None:
        """Releases wait from ``now`` on, unless they waited already."""
        if self.pending(key) is None:
            self.storage.exec(f"INSERT INTO {PENDING}(key, since) VALUES (?, ?) ON CONFLICT(key) DO NOTHING",
                              key, now)
            self._pending[key] = now

    def clear_pending(self, key: str) -> None:
        """No release waits any more."""
        if self.pending(key) is not None:
            self.storage.exec(f"DELETE FROM {PENDING} WHERE key = ?", key)
        self._pending[key] = None

    # ------------------------------------------------------------------ blocked entries
    def has_blocked(self, key: str) -> bool:
        """Some ``blocked`` entry of the holder is kept for ``key``."""
        kept = self._blocked.get(key)
        if kept is None:
            kept = self._blocked[key] = self.storage.one(
                f"SELECT 1 AS x FROM {BLOCKED} WHERE key = ? LIMIT 1", key) is not None
        return kept

    def keep_blocked(self, key: str, entries: list[list[Any]], now: int) -> None:
        """The holder's ``blocked`` entries ``[group, reason, waiting]`` of a reply at ``now``
        replace the key's (none: none are kept); one statement each way, none when nothing is
        kept and nothing comes."""
        if self.has_blocked(key):
            self.storage.exec(f"DELETE FROM {BLOCKED} WHERE key = ?", key)
        if entries:
            self.storage.exec(
                f"INSERT OR REPLACE INTO {BLOCKED}(key, group_name, reason, waiting, at)"
                " SELECT ?, json_extract(value, '$[0]'), json_extract(value, '$[1]'), json_extract(value, '$[2]'), ?"
                " FROM json_each(?)", key, now, json.dumps(entries))
        self._blocked[key] = bool(entries)

    def blocked_entries(self, key: str) -> list[dict[str, Any]]:
        """The key's kept ``blocked`` entries, by group (from SQL: a view)."""
        return self.storage.exec(f"SELECT group_name, reason, waiting FROM {BLOCKED} WHERE key = ?"
                                 " ORDER BY group_name", key)

    def stored_wake(self, key: str) -> int | None:
        """The key's wake time as stored (from SQL, not the copy: a view)."""
        row = self.storage.one(f"SELECT wake_at FROM {WAKEUPS} WHERE key = ?", key)
        return None if row is None else int(row["wake_at"])

    # ------------------------------------------------------------------ finished items
    def purge_due(self, cutoff: int) -> bool:
        """Some done item finished before ``cutoff`` (a purge would delete something): one read
        of the done items' index (or read with the wake times), then known until the next purge.
        An item whose ``on_done`` hook is pending is not counted: the purge keeps it, and counting
        it would make every pump purge while its hook keeps failing."""
        if self._done_min is _UNREAD:
            row = self.storage.one(f"SELECT MIN(finished_at) AS at FROM {ITEMS} WHERE {PURGEABLE}")
            self._done_min = None if row is None or row["at"] is None else int(row["at"])
        return self._done_min is not None and bool(self._done_min < cutoff)

    def purged(self) -> None:
        """A purge ran: the earliest finished item is read again when next needed."""
        self._done_min = _UNREAD

    def finished(self, key: str, now: int, *, permits: bool = True) -> None:
        """Items of ``key`` turned done at ``now``, or an item finished at ``now`` became
        purgeable (its ``on_done`` hook ran); ``permits``: ``permit()`` items among them."""
        if self._done_min is not _UNREAD:
            self._done_min = now if self._done_min is None else min(self._done_min, now)
        if permits:
            self._permits_done[key] = True

    def permits_done(self, key: str) -> bool:
        """Finished permit items of ``key`` may wait to be deleted (unknown: yes)."""
        return self._permits_done.get(key, True)

    def permits_deleted(self, key: str) -> None:
        """The key's finished permit items were deleted."""
        self._permits_done[key] = False
