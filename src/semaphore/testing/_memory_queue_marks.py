"""The queue's per-key marks in memory: :class:`MemoryQueueMarks`, the twin of the queue's SQL
mark store.

:class:`~semaphore.client._queue_store.QueueMarks` keeps a queue's wake times, pending-release
marks and ``blocked`` entries in SQLite (with an in-memory copy), and answers two hints about
finished items; :class:`MemoryQueueMarks` keeps the marks in dicts, behind the same interface
(:class:`~semaphore.client._mark_rows.QueueMarkStore`), and answers the hints exactly from the
items of a :class:`~semaphore.testing.MemoryQueueItems`. It is the specification the SQL store is
held to: ``tests/test_queue_mark_store_contract.py`` runs the same operations over both and
checks that every mark answers the same and that the SQL store's hints are never false where the
twin's are true.

It has no transactions of its own: :meth:`MemoryQueueMarks.snapshot` and
:meth:`MemoryQueueMarks.restore` let a caller roll it back.
"""

from __future__ import annotations

import copy
from typing import Any

from ..client._item_rows import deletable_permit, purgeable
from ._memory_queue_items import MemoryQueueItems

__all__ = ["MemoryQueueMarks"]

_State = tuple[dict[str, int], dict[str, int], dict[str, dict[str, dict[str, Any]]]]


class MemoryQueueMarks:
    """A :class:`~semaphore.client._mark_rows.QueueMarkStore` over dicts (see the module
    documentation); ``items``: the queue's items, which the hints read."""

    def __init__(self, items: MemoryQueueItems) -> None:
        self.items = items
        self._wakes: dict[str, int] = {}
        self._pending: dict[str, int] = {}
        self._blocked: dict[str, dict[str, dict[str, Any]]] = {}

    # ------------------------------------------------------------------ rollback (for callers)
    def snapshot(self) -> _State:
        """Every mark (a deep copy), for :meth:`restore`."""
        return copy.deepcopy((self._wakes, self._pending, self._blocked))

    def restore(self, state: _State) -> None:
        """Back to a :meth:`snapshot` (a transaction rolled back)."""
        self._wakes, self._pending, self._blocked = copy.deepcopy(state)

    def forget(self) -> None:
        """Nothing to forget: these dicts are the marks themselves."""

    # ------------------------------------------------------------------ wake times
    def wake(self, key: str) -> int | None:
        """The key's wake time."""
        return self._wakes.get(key)

    def earliest_wake(self) -> int | None:
        """The earliest wake time of any key."""
        return min(self._wakes.values(), default=None)

    def due_keys(self, at: int) -> list[str]:
        """The keys due at ``at``, earliest first (ties by key)."""
        return [k for w, k in sorted((w, k) for k, w in self._wakes.items() if w <= at)]

    def stored_due_keys(self, at: int) -> list[str]:
        """:meth:`due_keys`."""
        return self.due_keys(at)

    def stored_wake(self, key: str) -> int | None:
        """:meth:`wake`."""
        return self.wake(key)

    def set_wake(self, key: str, at: int | None, *, earlier_only: bool = False) -> None:
        """Set (``earlier_only``: lower) the key's wake time; ``None`` removes it."""
        if at is None:
            self._wakes.pop(key, None)
        elif earlier_only and key in self._wakes:
            self._wakes[key] = min(self._wakes[key], int(at))
        else:
            self._wakes[key] = int(at)

    def loaded(self, key: str, pending: int | None, blocked: bool, permits_done: bool) -> None:
        """Nothing to take: these dicts are the marks themselves."""

    # ------------------------------------------------------------------ pending releases
    def pending(self, key: str) -> int | None:
        """Since when the key's releases wait."""
        return self._pending.get(key)

    def start_pending(self, key: str, now: int) -> None:
        """Releases wait from ``now`` on, unless they waited already."""
        self._pending.setdefault(key, now)

    def clear_pending(self, key: str) -> None:
        """No release waits any more."""
        self._pending.pop(key, None)

    # ------------------------------------------------------------------ blocked entries
    def has_blocked(self, key: str) -> bool:
        """Some entry is kept for ``key``."""
        return bool(self._blocked.get(key))

    def keep_blocked(self, key: str, entries: list[list[Any]], now: int) -> None:
        """Replace the key's entries (the last of a group wins)."""
        self._blocked[key] = {str(g): {"group_name": str(g), "reason": reason, "waiting": waiting}
                              for g, reason, waiting in entries}

    def blocked_entries(self, key: str) -> list[dict[str, Any]]:
        """The key's entries, by group."""
        return [dict(e) for _, e in sorted(self._blocked.get(key, {}).items())]

    # ------------------------------------------------------------------ finished items (exact)
    def purge_due(self, cutoff: int) -> bool:
        """Some purgeable item finished before ``cutoff``."""
        return any(purgeable(r) and int(r["finished_at"]) < cutoff for r in self.items.view())

    def purged(self) -> None:
        """Nothing to note: :meth:`purge_due` reads the items."""

    def finished(self, key: str, now: int, *, permits: bool = True) -> None:
        """Nothing to note: the hints read the items."""

    def permits_done(self, key: str) -> bool:
        """Some finished permit item of ``key`` records no release (what the delete takes)."""
        return any(map(deletable_permit, self.items.view(key)))

    def permits_deleted(self, key: str) -> None:
        """Nothing to note: :meth:`permits_done` reads the items."""
