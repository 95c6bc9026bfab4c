"""A client object's stores in memory: :class:`MemoryStores`, the twins of its three SQL stores
(the client's rows, the queue's items, the queue's marks), for a queue to run over.

A :class:`~semaphore.testing.ClientSide` made with ``stores="memory"`` keeps its client's rows
and its queue's items and marks here instead of in SQLite (the scheduler's timers stay in
SQLite: they have no twin), so one seeded run over the SQL stores and one over their twins can
be compared message for message (``scripts/traffic_digest.py --stores memory``,
``tests/test_memory_stores.py``): the twins are the specification the SQL stores are held to,
and a difference in what the clients send is a difference between a store and its twin.

The twins have no transactions of their own. Registered with a
:class:`~semaphore.testing.LocalStorage` (:meth:`LocalStorage.keep_in_step`), they are
snapshotted as each of its transactions (or savepoints) opens and restored if it rolls back, so
they commit and roll back with the object's SQL as the SQL stores do.
"""

from __future__ import annotations

from typing import Any

from ._memory_client_store import MemoryClientRows
from ._memory_queue_items import MemoryQueueItems
from ._memory_queue_marks import MemoryQueueMarks

__all__ = ["MemoryStores"]


class MemoryStores:
    """The client's rows (:class:`MemoryClientRows`), the queue's items
    (:class:`MemoryQueueItems`) and its marks (:class:`MemoryQueueMarks`) of one client object,
    wired as the queue wires its SQL stores (a purge folds the releases its items record into
    the client's rows). They outlive the object's instances, as its storage does: give the same
    one to every queue an eviction starts (:meth:`use_in`)."""

    def __init__(self) -> None:
        self.rows = MemoryClientRows()
        self.items = MemoryQueueItems(before_delete=self.rows.fold_releases)
        self.marks = MemoryQueueMarks(self.items)

    def use_in(self, queue: Any) -> None:
        """Make ``queue`` (a :class:`~semaphore.SemaphoreQueue` not used yet) and its client
        keep their rows here. Both must be new: used already, their schema step has told the
        SQL stores where releases are recorded, and would not tell these (``RuntimeError``)."""
        if queue._ready or queue.client._ready:
            raise RuntimeError("MemoryStores.use_in: the queue or its client was used already; give the stores"
                               " to a new one")
        queue._use_stores(self.rows, self.items, self.marks)

    def snapshot(self) -> tuple[Any, Any, Any]:
        """Everything the three stores hold (deep copies), for :meth:`restore`."""
        return self.rows.snapshot(), self.items.snapshot(), self.marks.snapshot()

    def restore(self, state: tuple[Any, Any, Any]) -> None:
        """Back to a :meth:`snapshot` (a transaction rolled back)."""
        rows, items, marks = state
        self.rows.restore(rows)
        self.items.restore(items)
        self.marks.restore(marks)
