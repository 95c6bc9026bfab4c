"""What any store of the queue's per-key marks must do (SPEC R37): :class:`QueueMarkStore`, the
interface. No I/O.

:class:`~semaphore.client._queue_store.QueueMarks` is the store over SQL (with an in-memory
copy); :class:`semaphore.testing.MemoryQueueMarks` is its in-memory twin; the queue asks only this
interface, and ``tests/test_queue_mark_store_contract.py`` runs the same operations over both.

Two of its answers are hints that spare the queue a statement: :meth:`QueueMarkStore.purge_due`
and :meth:`QueueMarkStore.permits_done` may say yes when the purge (the delete) would find
nothing, never no when it would find something. The twin answers them exactly.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["QueueMarkStore"]


class QueueMarkStore(Protocol):
    """The queue's wake time, pending-release mark and ``blocked`` entries per key, and the two
    purge hints (see the module documentation). A change happens inside the caller's storage
    transaction."""

    def forget(self) -> None:
        """A transaction rolled back: drop whatever is not in storage."""

    # ------------------------------------------------------------------ wake times
    def wake(self, key: str) -> int | None:
        """When the queue next wants to work on ``key`` (``None``: never)."""

    def earliest_wake(self) -> int | None:
        """The earliest wake time of any key (``None``: none)."""

    def due_keys(self, at: int) -> list[str]:
        """The keys whose wake time is ``at`` or earlier, earliest first (ties by key)."""

    def stored_due_keys(self, at: int) -> list[str]:
        """:meth:`due_keys` as storage holds them (fails if the table is gone)."""

    def stored_wake(self, key: str) -> int | None:
        """:meth:`wake` as storage holds it (a view)."""

    def set_wake(self, key: str, at: int | None, *, earlier_only: bool = False) -> None:
        """Set (``earlier_only``: lower) the key's wake time; ``None`` removes it."""

    def loaded(self, key: str, pending: int | None, blocked: bool, permits_done: bool) -> None:
        """What the load of the key's items read of its marks (a store that reads it otherwise
        may ignore it)."""

    # ------------------------------------------------------------------ pending releases
    def pending(self, key: str) -> int | None:
        """Since when the key's releases wait to be reported (``None``: none)."""

    def start_pending(self, key: str, now: int) -> None:
        """Releases wait from ``now`` on, unless they waited already."""

    def clear_pending(self, key: str) -> None:
        """No release waits any more."""

    # ------------------------------------------------------------------ blocked entries
    def has_blocked(self, key: str) -> bool:
        """Some ``blocked`` entry of the holder is kept for ``key``."""

    def keep_blocked(self, key: str, entries: list[list[Any]], now: int) -> None:
        """The holder's ``blocked`` entries ``[group, reason, waiting]`` of a reply at ``now``
        replace the key's (the last of a group wins)."""

    def blocked_entries(self, key: str) -> list[dict[str, Any]]:
        """The key's kept entries (``group_name``, ``reason``, ``waiting``), by group."""

    # ------------------------------------------------------------------ finished items (hints)
    def purge_due(self, cutoff: int) -> bool:
        """A purge of the items finished before ``cutoff`` may delete something (a hint:
        never false when it would)."""

    def purged(self) -> None:
        """A purge ran."""

    def finished(self, key: str, now: int, *, permits: bool = True) -> None:
        """Items of ``key`` turned done at ``now``, or an item finished at ``now`` became
        purgeable (its ``on_done`` hook ran); ``permits``: ``permit()`` items among them."""

    def permits_done(self, key: str) -> bool:
        """Finished ``permit()`` items of ``key`` may wait to be deleted (a hint: never false
        when some do)."""

    def permits_deleted(self, key: str) -> None:
        """The key's finished ``permit()`` items were deleted."""
