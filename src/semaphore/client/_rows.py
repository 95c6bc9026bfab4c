"""The client's rows and what any store of them must do (SPEC R13, R35): the table and column
names, the pure functions of a row's changes (a local count set, a delivery, a merged reply, a
key row touched) and of the next report's window, and :class:`ClientStore`, the store's
interface. :class:`~semaphore.client._store.ClientRows` is the store over SQL (with a copy per
key); :class:`semaphore.testing.MemoryClientRows` is its in-memory twin; both change rows only
through the functions here, and ``tests/test_client_store_contract.py`` runs the same
operations over both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from ..core.client_state import GONE, ClientGrant, ClientLease
from ..core.wire import LeaseStatus

__all__ = ["ClientStore", "GONE_GRANT", "SETTLED_LEASE", "GRANTS", "LEASES", "KEYS", "KEY_COLUMNS",
           "GRANT_COLUMNS", "LEASE_COLUMNS",
           "grant_dirty", "lease_dirty", "lease_due", "changed_row", "recorded_row", "delivered_row", "grant_row_of",
           "lease_row_of", "touched_key", "report_order", "reports_waiting", "RecordedRelease", "folded_row"]


GRANTS = "durability_semaphore_client_grants"
LEASES = "durability_semaphore_client_leases"
KEYS = "durability_semaphore_client_keys"

#: The status of a grant's tombstone (everything under it released and acknowledged) and of a
#: lease's (settled): neither is loaded with a key's live rows.
GONE_GRANT = GONE
SETTLED_LEASE = LeaseStatus.SETTLED.value
_LIVE = LeaseStatus.LIVE.value
#: The key row's columns besides ``key`` and ``updated_at``, with their defaults.
KEY_COLUMNS = {"next_request_at": 0, "contended": 0, "needs_sync": 0, "check_at": 0, "claim_ttl_ms": 0,
               "replied_at": 0, "lease_recheck_ms": 0, "room": 0, "contended_since": 0, "pruned_at": 0}
GRANT_COLUMNS = ("key", "grant_id", "group_name", "permits", "claimed", "released", "confirmed", "claim_by",
                 "status", "sent_claimed", "sent_released", "updated_at", "report_at", "holder_released")
LEASE_COLUMNS = ("key", "lease_id", "group_name", "permits", "drawn", "released", "stopped", "status",
                 "expires_at", "heartbeat_at", "sent_drawn", "sent_released", "sent_stopped", "updated_at",
                 "report_at", "reusable")


def grant_dirty(r: dict[str, Any]) -> bool:
    """Something to report (unacknowledged claims or releases)."""
    return bool(r["claimed"] > r["sent_claimed"] or r["released"] > r["sent_released"])


def lease_dirty(r: dict[str, Any]) -> bool:
    """Something to report (unacknowledged draws, releases or stop)."""
    return bool(r["drawn"] > r["sent_drawn"] or r["released"] > r["sent_released"]
                or (r["stopped"] != 0 and r["sent_stopped"] == 0))


def lease_due(r: dict[str, Any], now: int) -> bool:
    """:func:`lease_dirty`, or a live lease's heartbeat is due (R31)."""
    return lease_dirty(r) or (r["status"] == _LIVE and r["stopped"] == 0 and r["heartbeat_at"] <= now)


def changed_row(r: dict[str, Any], kind: str, column: str, value: int, now: int) -> dict[str, Any]:
    """``r`` with one count set (:meth:`ClientStore.change`): a clean row that turns dirty has
    had something to report since ``now`` (report order)."""
    dirty = grant_dirty(r) if kind == "grant" else lease_dirty(r)
    return {**r, column: value, "updated_at": now, "report_at": r["report_at"] if dirty else now}


def recorded_row(r: dict[str, Any], kind: str, released: int) -> dict[str, Any] | None:
    """``r`` with its ``released`` count raised to ``released`` by a release the caller records
    in a row of its own (:meth:`ClientStore.record_release`: the queue's finished item), or
    ``None`` when the row must be written instead: it has nothing to report yet (turning dirty
    moves its report time, which only a write of the row keeps), or the count would not rise.
    Nothing else of the row changes (``updated_at`` is when the row was last written)."""
    dirty = grant_dirty(r) if kind == "grant" else lease_dirty(r)
    if not dirty or released <= int(r["released"]):
        return None
    return {**r, "released": released}


class RecordedRelease(NamedTuple):
    """The highest release that records about to be deleted hold for one grant or lease
    (:meth:`ClientStore.fold_releases`)."""

    kind: str  # "grant" or "lease"
    key: str
    permit_id: str
    n: int


def folded_row(r: dict[str, Any], kind: str, n: int) -> dict[str, Any]:
    """``r`` with a recorded release ``n`` folded in (SPEC R35): counts only rise (R13), so the
    higher of the two, and never above the row's claimed or drawn count."""
    used = int(r["claimed"] if kind == "grant" else r["drawn"])
    return {**r, "released": max(int(r["released"]), min(used, n))}


def delivered_row(r: dict[str, Any], sent: dict[str, int], stamp: int) -> dict[str, Any]:
    """``r`` after the holder applied a report of it (:meth:`ClientStore.delivered`): its
    acknowledged counts raised to ``sent``, behind every entry still waiting (``report_at``)."""
    return {**r, **{c: max(int(r[c]), v) for c, v in sent.items()}, "report_at": stamp}


def grant_row_of(g: ClientGrant, old: dict[str, Any] | None, now: int) -> dict[str, Any]:
    """The row of a grant merged from a reply (a new row reports from ``now``)."""
    return {"key": g.key, "grant_id": g.grant_id, "group_name": g.group, "permits": g.permits,
            "claimed": g.claimed, "released": g.released, "confirmed": g.confirmed, "claim_by": g.claim_by,
            "status": g.status, "sent_claimed": g.sent_claimed, "sent_released": g.sent_released,
            "updated_at": now, "report_at": now if old is None else old["report_at"],
            "holder_released": int(g.holder_released)}


def lease_row_of(x: ClientLease, old: dict[str, Any] | None, now: int) -> dict[str, Any]:
    """The row of a lease merged from a reply (a new row reports from ``now``)."""
    return {"key": x.key, "lease_id": x.lease_id, "group_name": x.group, "permits": x.permits, "drawn": x.drawn,
            "released": x.released, "stopped": int(x.stopped), "status": x.status, "expires_at": x.expires_at,
            "heartbeat_at": x.heartbeat_at, "sent_drawn": x.sent_drawn, "sent_released": x.sent_released,
            "sent_stopped": int(x.sent_stopped), "updated_at": now,
            "report_at": now if old is None else old["report_at"], "reusable": int(x.reusable)}


def touched_key(row: dict[str, Any] | None, key: str, now: int, values: dict[str, int]) -> dict[str, Any] | None:
    """The key row after :meth:`ClientStore.touch_key` sets ``values`` (others kept, or their
    defaults for a new row), or ``None`` when nothing changes (``updated_at`` is when the row
    last changed)."""
    current = dict(KEY_COLUMNS)
    if row is not None:
        current.update({c: int(row.get(c) or 0) for c in KEY_COLUMNS})
    else:  # no tombstone of the key exists before its row: as if pruned now (SPEC R35)
        current["pruned_at"] = now
    current.update(values)
    if row is not None and all(int(row.get(c) or 0) == current[c] for c in KEY_COLUMNS):
        return None
    return {"key": key, **current, "updated_at": now}


class ClientStore(Protocol):
    """What the client (:class:`~semaphore.client.SemaphoreClient` and its per-key unit) asks of
    the store of its grant, lease and key rows: :class:`~semaphore.client._store.ClientRows`
    over SQL, and its in-memory twin :class:`semaphore.testing.MemoryClientRows`;
    ``tests/test_client_store_contract.py`` runs the same operations over both and checks every
    read. Rows are dicts of
    :data:`GRANT_COLUMNS`, :data:`LEASE_COLUMNS`, or the key row's ``key``,
    :data:`KEY_COLUMNS` and ``updated_at``. A change happens inside the caller's storage
    transaction; :meth:`flush` is called before it ends. A row read may be the store's own (the
    SQL store lends its copy's dicts, so reads cost no copying): callers never change one."""

    def forget(self) -> None:
        """A transaction rolled back: drop whatever is not in storage."""

    def grant_rows(self, key: str) -> list[dict[str, Any]]:
        """The live grant rows of ``key``, earliest claim deadline first."""

    def lease_rows(self, key: str) -> list[dict[str, Any]]:
        """The live lease rows of ``key``, earliest expiry first."""

    def grant_row(self, key: str, grant_id: str) -> dict[str, Any] | None:
        """One grant row, a tombstone included, or ``None``."""

    def lease_row(self, key: str, lease_id: str) -> dict[str, Any] | None:
        """One lease row, a tombstone included, or ``None``."""

    def grants(self, key: str) -> list[ClientGrant]:
        """:meth:`grant_rows` as rows of the core."""

    def leases(self, key: str) -> list[ClientLease]:
        """:meth:`lease_rows` as rows of the core."""

    def key_row(self, key: str) -> dict[str, Any] | None:
        """The key row (``None``: never written)."""

    def every_grant(self, key: str) -> list[ClientGrant]:
        """Every grant of ``key``, tombstones included, oldest claim deadline first."""

    def every_lease(self, key: str) -> list[ClientLease]:
        """Every lease of ``key``, tombstones included, earliest expiry first."""

    def every_key(self) -> list[str]:
        """Every key with a key row, a live grant or a live lease, sorted."""

    def change(self, kind: str, key: str, row_id: str, column: str, value: int, now: int) -> None:
        """Set one count of a grant or lease row (``kind``), a local change (SPEC R13)."""

    def record_release(self, kind: str, key: str, row_id: str, released: int, now: int) -> bool:
        """Raise a row's ``released`` count to ``released`` (a local change, SPEC R13) for a
        caller that records it durably itself, in the same transaction, in the table named to
        :meth:`records_releases_in` (the queue: ``release_n`` of the finished item). True when
        only that record holds it (:func:`recorded_row`: the row stays unwritten); False when
        the row was written instead (:meth:`change`), so the caller need record nothing."""

    def records_releases_in(self, table: str) -> None:
        """Releases are recorded in ``table`` too (its ``key``, ``permit_kind``, ``permit_id``,
        ``release_n``): a row's ``released`` read from storage is at least the highest
        ``release_n`` recorded for it, never above its claimed (drawn) count."""

    def fold_releases(self, recorded: Sequence[RecordedRelease]) -> None:
        """Write into their rows the highest releases ``recorded`` for them by records the
        caller is about to delete (:func:`folded_row`; a permit named twice takes the highest
        of the two), so the counts outlive the records."""

    def delivered(self, kind: str, key: str, row_id: str, sent: dict[str, int], stamp: int) -> None:
        """The holder applied a report of the row: its acknowledged counts raised to ``sent``."""

    def flush(self) -> None:
        """Write what the transaction changed and has not written yet."""

    def write_grant(self, g: ClientGrant, now: int) -> None:
        """Insert or update a grant as merged from a reply."""

    def write_lease(self, x: ClientLease, now: int) -> None:
        """Insert or update a lease as merged from a reply."""

    def touch_key(self, key: str, now: int, **values: int) -> None:
        """Set columns of the key row (others kept, or their defaults for a new row)."""

    def prune(self, key: str, cutoff: int) -> None:
        """Delete the key's tombstones last changed before ``cutoff``."""

    def window(self, key: str, now: int, limit: int, *, leases: bool) -> tuple[
            list[dict[str, Any]], bool, list[dict[str, Any]], bool]:
        """The rows of the key's next report, and whether each list was cut."""

    def waiting(self, key: str, now: int, *, leases: bool) -> int:
        """The most entries of one list with something to report."""


def report_order(grants: list[dict[str, Any]], leases: list[dict[str, Any]], now: int, limit: int) -> tuple[
        list[dict[str, Any]], bool, list[dict[str, Any]], bool]:
    """:meth:`ClientStore.window` over the live rows ``grants`` and ``leases`` (empty when the
    report carries no leases): per list, the rows with something to report first (longest
    waiting first, by ``report_at``), then the least recently reported others, at most
    ``limit`` each, and whether a row with something to report did not fit."""
    g = sorted(grants, key=lambda r: (not grant_dirty(r), r["report_at"], r["claim_by"], r["grant_id"]))
    x = sorted(leases, key=lambda r: (not lease_due(r, now), r["report_at"], r["expires_at"], r["lease_id"]))
    return (g[:limit], len(g) > limit and grant_dirty(g[limit]),
            x[:limit], len(x) > limit and lease_due(x[limit], now))


def reports_waiting(grants: list[dict[str, Any]], leases: list[dict[str, Any]], now: int) -> int:
    """:meth:`ClientStore.waiting` over the live rows ``grants`` and ``leases``."""
    return max(sum(1 for r in grants if grant_dirty(r)), sum(1 for r in leases if lease_due(r, now)))


