"""The client's rows in memory: :class:`MemoryClientRows`, the twin of the client's SQL store.

:class:`~semaphore.client._store.ClientRows` keeps a client object's grant, lease and key rows
in SQLite (with an in-memory copy per key); :class:`MemoryClientRows` keeps the same rows in
plain dicts, behind the same interface (:class:`~semaphore.client._rows.ClientStore`), changing
them through the same pure functions of :mod:`semaphore.client._rows`. It is the specification
the SQL store is held to: ``tests/test_client_store_contract.py`` runs the same operations over
both and checks that every read answers the same, and that a fresh SQL store loading what SQL
holds answers the same too (the SQL store's copy never drifts from its tables).

It has no transactions of its own: :meth:`MemoryClientRows.snapshot` and
:meth:`MemoryClientRows.restore` let a caller roll it back; :meth:`~MemoryClientRows.forget`
does nothing (its dicts are the truth, not a copy of it); :meth:`~MemoryClientRows.flush` does
nothing (every change is in place at once).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from ..client._rows import (
    GONE_GRANT,
    SETTLED_LEASE,
    RecordedRelease,
    changed_row,
    delivered_row,
    folded_row,
    grant_row_of,
    lease_row_of,
    recorded_row,
    report_order,
    reports_waiting,
    touched_key,
)
from ..core.client_state import ClientGrant, ClientLease

__all__ = ["MemoryClientRows"]

_State = tuple[dict[tuple[str, str], dict[str, Any]], dict[tuple[str, str], dict[str, Any]], dict[str, dict[str, Any]]]


class MemoryClientRows:
    """A :class:`~semaphore.client._rows.ClientStore` over dicts (see the module documentation).
    Reads return copies, so a caller never changes a row behind the store's back."""

    def __init__(self) -> None:
        self._grants: dict[tuple[str, str], dict[str, Any]] = {}
        self._leases: dict[tuple[str, str], dict[str, Any]] = {}
        self._keys: dict[str, dict[str, Any]] = {}
        self._records: str | None = None

    def records_releases_in(self, table: str) -> None:
        """Releases are recorded in ``table`` too (:meth:`record_release` may keep a row
        unwritten, as the SQL store does)."""
        self._records = table

    def fold_releases(self, recorded: Sequence[RecordedRelease]) -> None:
        """Each recorded release folded into its row (:func:`folded_row`; a release recorded
        here is in its row already, so this changes nothing the twin recorded itself)."""
        for r in recorded:
            rows = self._grants if r.kind == "grant" else self._leases
            row = rows.get((r.key, r.permit_id))
            if row is not None:
                rows[(r.key, r.permit_id)] = folded_row(row, r.kind, r.n)

    # ------------------------------------------------------------------ rollback (for callers)
    def snapshot(self) -> _State:
        """Everything the store holds (a deep copy), for :meth:`restore`."""
        return copy.deepcopy((self._grants, self._leases, self._keys))

    def restore(self, state: _State) -> None:
        """Back to a :meth:`snapshot` (a transaction rolled back)."""
        self._grants, self._leases, self._keys = copy.deepcopy(state)

    def forget(self) -> None:
        """Nothing to forget: these dicts are the rows themselves, not a copy of storage."""

    # ------------------------------------------------------------------ reads
    def _live(self, rows: dict[tuple[str, str], dict[str, Any]], key: str, gone: str) -> list[dict[str, Any]]:
        return [dict(r) for (k, _), r in rows.items() if k == key and r["status"] != gone]

    def grant_rows(self, key: str) -> list[dict[str, Any]]:
        """The live grant rows of ``key``, earliest claim deadline first."""
        return sorted(self._live(self._grants, key, GONE_GRANT), key=lambda r: (r["claim_by"], r["grant_id"]))

    def lease_rows(self, key: str) -> list[dict[str, Any]]:
        """The live lease rows of ``key``, earliest expiry first."""
        return sorted(self._live(self._leases, key, SETTLED_LEASE), key=lambda r: (r["expires_at"], r["lease_id"]))

    def grant_row(self, key: str, grant_id: str) -> dict[str, Any] | None:
        """One grant row (a tombstone included), or ``None``."""
        r = self._grants.get((key, grant_id))
        return None if r is None else dict(r)

    def lease_row(self, key: str, lease_id: str) -> dict[str, Any] | None:
        """One lease row (a tombstone included), or ``None``."""
        r = self._leases.get((key, lease_id))
        return None if r is None else dict(r)

    def grants(self, key: str) -> list[ClientGrant]:
        """:meth:`grant_rows` as rows of the core."""
        return [ClientGrant._from_row(r) for r in self.grant_rows(key)]

    def leases(self, key: str) -> list[ClientLease]:
        """:meth:`lease_rows` as rows of the core."""
        return [ClientLease._from_row(r) for r in self.lease_rows(key)]

    def key_row(self, key: str) -> dict[str, Any] | None:
        """The key row (``None``: never written)."""
        r = self._keys.get(key)
        return None if r is None else dict(r)

    def every_grant(self, key: str) -> list[ClientGrant]:
        """Every grant of ``key``, tombstones included, oldest claim deadline first."""
        rows = sorted((r for (k, _), r in self._grants.items() if k == key),
                      key=lambda r: (r["claim_by"], r["grant_id"]))
        return [ClientGrant._from_row(r) for r in rows]

    def every_lease(self, key: str) -> list[ClientLease]:
        """Every lease of ``key``, tombstones included, earliest expiry first."""
        rows = sorted((r for (k, _), r in self._leases.items() if k == key),
                      key=lambda r: (r["expires_at"], r["lease_id"]))
        return [ClientLease._from_row(r) for r in rows]

    def every_key(self) -> list[str]:
        """Every key with a key row, a live grant or a live lease, sorted."""
        keys = set(self._keys)
        keys.update(k for (k, _), r in self._grants.items() if r["status"] != GONE_GRANT)
        keys.update(k for (k, _), r in self._leases.items() if r["status"] != SETTLED_LEASE)
        return sorted(keys)

    # ------------------------------------------------------------------ writes
    def _rows(self, kind: str) -> dict[tuple[str, str], dict[str, Any]]:
        return self._grants if kind == "grant" else self._leases

    def change(self, kind: str, key: str, row_id: str, column: str, value: int, now: int) -> None:
        """Set one count of a row (:func:`~semaphore.client._rows.changed_row`); none: nothing."""
        r = self._rows(kind).get((key, row_id))
        if r is not None:
            self._rows(kind)[(key, row_id)] = changed_row(r, kind, column, value, now)

    def record_release(self, kind: str, key: str, row_id: str, released: int, now: int) -> bool:
        """Raise a row's ``released`` (:func:`~semaphore.client._rows.recorded_row`, else as
        :meth:`change`); True when the caller's record holds it."""
        r = self._rows(kind).get((key, row_id))
        new = None if r is None or self._records is None else recorded_row(r, kind, released)
        if new is None:
            self.change(kind, key, row_id, "released", released, now)
            return False
        self._rows(kind)[(key, row_id)] = new
        return True

    def delivered(self, kind: str, key: str, row_id: str, sent: dict[str, int], stamp: int) -> None:
        """Raise the row's acknowledged counts (:func:`~semaphore.client._rows.delivered_row`)."""
        r = self._rows(kind).get((key, row_id))
        if r is not None:
            self._rows(kind)[(key, row_id)] = delivered_row(r, sent, stamp)

    def flush(self) -> None:
        """Nothing to write: every change is in place at once."""

    def write_grant(self, g: ClientGrant, now: int) -> None:
        """Insert or update a grant as merged from a reply."""
        self._grants[(g.key, g.grant_id)] = grant_row_of(g, self._grants.get((g.key, g.grant_id)), now)

    def write_lease(self, x: ClientLease, now: int) -> None:
        """Insert or update a lease as merged from a reply."""
        self._leases[(x.key, x.lease_id)] = lease_row_of(x, self._leases.get((x.key, x.lease_id)), now)

    def touch_key(self, key: str, now: int, **values: int) -> None:
        """Set columns of the key row (:func:`~semaphore.client._rows.touched_key`)."""
        row = touched_key(self._keys.get(key), key, now, values)
        if row is not None:
            self._keys[key] = row

    def prune(self, key: str, cutoff: int) -> None:
        """Delete the key's tombstones last changed before ``cutoff``."""
        for rows, gone in ((self._grants, GONE_GRANT), (self._leases, SETTLED_LEASE)):
            for row_key in [rk for rk, r in rows.items()
                            if rk[0] == key and r["status"] == gone and r["updated_at"] < cutoff]:
                del rows[row_key]

    # ------------------------------------------------------------------ report windows
    def window(self, key: str, now: int, limit: int, *, leases: bool) -> tuple[
            list[dict[str, Any]], bool, list[dict[str, Any]], bool]:
        """The rows of the key's next report (:func:`~semaphore.client._rows.report_order`)."""
        return report_order(self.grant_rows(key), self.lease_rows(key) if leases else [], now, limit)

    def waiting(self, key: str, now: int, *, leases: bool) -> int:
        """The most entries of one list with something to report."""
        return reports_waiting(self.grant_rows(key), self.lease_rows(key) if leases else [], now)
