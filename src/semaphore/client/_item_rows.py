"""The queue's item rows and what any store of them must do (SPEC R37): the columns, which rows a
key's copy keeps, which finished rows a purge deletes, how a long payload is left out of a read,
and :class:`QueueItemStore`, the store's interface. No I/O.

:class:`~semaphore.client._item_store.QueueItems` is the store over SQL (with a copy per key);
:class:`semaphore.testing.MemoryQueueItems` is its in-memory twin; the queue asks only this
interface, and ``tests/test_queue_item_store_contract.py`` runs the same operations over both.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from ._rows import RecordedRelease

__all__ = ["QueueItemStore", "COLUMNS", "PAYLOAD_KEPT", "INSERT_BATCH_BYTES", "kept", "purgeable",
           "deletable_permit", "kept_payload", "batches", "recorded_releases"]

#: The columns of an item row besides ``payload`` (in the table's order).
COLUMNS = ("item_id", "key", "group_name", "enqueued_at", "seq", "state", "permit_kind", "permit_id", "slot",
           "started_at", "admitted", "attempts", "retry_at", "checked_at", "finished_at", "cancel",
           "done_pending", "done_attempts", "done_retry_at", "owner", "error", "release_n")
#: Longest payload (bytes of JSON text) kept in a key's copy; a longer one is read when needed.
PAYLOAD_KEPT = 1024
#: Most bytes of new items (their ids and payloads as one JSON binding) one statement of
#: :meth:`QueueItemStore.insert_many` carries: well under the 2 MB a Durable Object's SQLite takes
#: in one value. An item larger than this alone goes in a statement of its own, its payload bound
#: as it is.
INSERT_BATCH_BYTES = 512 * 1024


def kept(row: Mapping[str, Any]) -> bool:
    """Whether a key's copy keeps ``row``: a live item, or a finished one whose hook is pending."""
    return row["state"] != "done" or bool(row["done_pending"])


def purgeable(row: Mapping[str, Any]) -> bool:
    """Whether a purge may delete ``row``: finished, and its ``on_done`` hook not pending (a
    queue without a hook drops the pending ones first: :meth:`QueueItemStore.drop_hooks`)."""
    return row["state"] == "done" and not row["done_pending"]


def deletable_permit(row: Mapping[str, Any]) -> bool:
    """Whether :meth:`QueueItemStore.delete_done_permits` deletes ``row``: a finished
    ``permit()`` item (``owner`` set) that records no release (``release_n`` 0: nothing to fold)."""
    return row["state"] == "done" and row["owner"] != "" and not int(row["release_n"])


def recorded_releases(rows: Iterable[Mapping[str, Any]]) -> list[RecordedRelease]:
    """The highest release ``rows`` record per grant or lease (``release_n`` above 0), as
    :meth:`QueueItemStore.purge_done` hands them to be folded before it deletes ``rows``; in
    ``(key, kind, permit id)`` order."""
    out: dict[tuple[str, str, str], int] = {}
    for r in rows:
        if int(r["release_n"]) > 0:
            at = (str(r["key"]), str(r["permit_kind"]), str(r["permit_id"]))
            out[at] = max(out.get(at, 0), int(r["release_n"]))
    return [RecordedRelease(kind, key, permit_id, n) for (key, kind, permit_id), n in sorted(out.items())]


def kept_payload(text: str) -> str | None:
    """``text`` as a read of the kept rows gives it: ``None`` when longer than
    :data:`PAYLOAD_KEPT` bytes (:meth:`QueueItemStore.payloads` reads it)."""
    return text if len(text.encode()) <= PAYLOAD_KEPT else None


def batches(rows: Sequence[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """``rows`` in order, cut so each part's ids and payloads stay within
    :data:`INSERT_BATCH_BYTES` (a larger row alone)."""
    part: list[dict[str, Any]] = []
    size = 0
    for r in rows:
        # its JSON: the id and the payload as strings (an escape doubles a byte at most), 8 more
        n = 2 * (len(str(r["item_id"]).encode()) + len(str(r["payload"]).encode())) + 8
        if part and size + n > INSERT_BATCH_BYTES:
            yield part
            part, size = [], 0
        part.append(r)
        size += n
    if part:
        yield part


class QueueItemStore(Protocol):
    """What the queue asks of the store of its items: :class:`~._item_store.QueueItems` over
    SQL and its twin :class:`semaphore.testing.MemoryQueueItems`. Rows are dicts of
    :data:`COLUMNS` and ``payload`` (JSON text; ``None`` in a read of the kept rows when longer
    than :data:`PAYLOAD_KEPT`). Item ids are unique across keys. A change happens inside the
    caller's storage transaction. Reads return copies."""

    def forget(self) -> None:
        """A transaction rolled back: drop whatever is not in storage."""

    def rows(self, key: str, state: str | None = None) -> list[dict[str, Any]]:
        """The kept rows of ``key`` (:func:`kept`; in ``state``), in enqueue order (``seq``)."""

    def row(self, key: str, item_id: str) -> dict[str, Any] | None:
        """The kept row of ``item_id`` of ``key``, or ``None`` (finished, or unknown)."""

    def find(self, item_id: str) -> dict[str, Any] | None:
        """The row of ``item_id`` of any key, finished or not (its payload left out when long)."""

    def find_many(self, item_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The rows of ``item_ids`` that exist (as :meth:`find`), by id."""

    def payloads(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``rows`` with their payloads (those left out read)."""

    def view(self, key: str | None = None, state: str | None = None, item_id: str | None = None
             ) -> list[dict[str, Any]]:
        """Every row (finished too, payloads whole), with the holder's ``blocked`` entry of a
        queued item's group where the store knows it, in enqueue order: of ``key``, in
        ``state``, of ``item_id`` (each ``None``: any)."""

    def insert_new(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """Insert ``row`` (every column but ``seq``) as the newest item, its ``seq`` one more than
        the largest, unless an item of its id exists. Returns the row inserted (its payload
        whole), or ``None``."""

    def insert_many(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """:meth:`insert_new` for each of ``rows`` (distinct ids; the same values but ``item_id``
        and ``payload``), newest last, numbered on from the largest ``seq`` without gaps (an id
        that exists takes no number). Returns the rows inserted (payloads whole)."""

    def update(self, key: str, item_ids: Iterable[str], values: Mapping[str, Any],
               each: Mapping[str, Sequence[Any]] | None = None) -> None:
        """Set ``values`` (the same for every item; a value may be an ``Add`` or a
        ``DonePending``) and ``each`` (a value per item, in the order of ``item_ids``) on the
        items ``item_ids`` (distinct, of ``key``; finished ones too; unknown ones are skipped).
        An update never brings a finished item that is not :func:`kept` back into the kept rows
        (the SQL store's copy does not hold it)."""

    def drop_hooks(self) -> int:
        """The queue has no ``on_done`` hook (any more: an earlier deployment had one): no
        finished item waits for one, so the purge takes them (``done_pending`` cleared).
        Returns how many hooks were pending."""

    def purge_done(self, before: int) -> None:
        """Delete the :func:`purgeable` items of every key finished before ``before``; first
        hand what they record (:func:`recorded_releases`) to the store's ``before_delete``,
        which folds it into the client's rows."""

    def delete_done_permits(self, key: str) -> None:
        """Delete the :func:`deletable_permit` items of ``key`` (one that records a release waits
        for :meth:`purge_done`, which folds it)."""
