"""The holder's rows as the core sees them (SPEC §2): a grant and a lease, with the charges
they put on the limit (R19, R30). The SQL store (``semaphore.holder._store``) reads and writes
them in these column orders."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["GrantRow", "LeaseRow", "AGGREGATES", "GRANT_COLUMNS", "LEASE_COLUMNS", "GRANT_MUTABLE",
           "LEASE_MUTABLE"]

#: Per-group and total aggregates the holder keeps (SPEC R19, R38), in this order everywhere.
AGGREGATES = ("outstanding", "lease_footprint", "live_leases", "retired_leases")


@dataclass(slots=True)
class GrantRow:
    grant_id: str
    client_id: str
    group_name: str
    permits: int
    claimed: int
    released: int
    issued_at: int
    claim_by: int
    reclaimed: bool

    @property
    def charge(self) -> int:
        """Charged capacity (SPEC R19)."""
        return self.permits - self.released

    @property
    def unclaimed(self) -> int:
        return self.permits - self.claimed

    @classmethod
    def from_row(cls, r: Mapping[str, Any]) -> GrantRow:
        return cls(str(r["grant_id"]), str(r["client_id"]), str(r["group_name"]), int(r["permits"]),
                   int(r["claimed"]), int(r["released"]), int(r["issued_at"]), int(r["claim_by"]),
                   bool(r["reclaimed"]))

    def values(self) -> tuple[Any, ...]:
        return (self.grant_id, self.client_id, self.group_name, self.permits, self.claimed,
                self.released, self.issued_at, self.claim_by, int(self.reclaimed))

    def changes(self) -> tuple[Any, ...]:
        """The id and the columns a stored grant may change (:data:`GRANT_MUTABLE`)."""
        return (self.grant_id, self.permits, self.claimed, self.released, int(self.reclaimed))


@dataclass(slots=True)
class LeaseRow:
    lease_id: str
    client_id: str
    group_name: str
    permits: int
    drawn: int
    released: int
    stopped: bool
    status: str  # 'live' | 'retired'
    issued_at: int
    expires_at: int
    #: Slots reusable while the lease lives (SPEC R34a); fixed at issue.
    reusable: bool = False

    @property
    def footprint(self) -> int:
        """SPEC R30: ``permits - released`` until the client confirmed its final draw count,
        then ``drawn - released``. A reusable lease (R30a) charges ``permits`` until then: its
        ``released`` says nothing of how many of its slots run now."""
        if self.status == "retired" and self.stopped:
            return min(self.permits, self.drawn - self.released)
        return self.permits if self.reusable else self.permits - self.released

    @property
    def undrawn(self) -> int:
        """Permits a live lease may still have drawn (R20, R26): of a reusable one (R34a), its
        slots not running as far as the holder knows."""
        if self.status != "live":
            return 0
        return max(0, self.permits - (self.drawn - self.released)) if self.reusable else self.permits - self.drawn

    @classmethod
    def from_row(cls, r: Mapping[str, Any]) -> LeaseRow:
        return cls(str(r["lease_id"]), str(r["client_id"]), str(r["group_name"]), int(r["permits"]),
                   int(r["drawn"]), int(r["released"]), bool(r["stopped"]), str(r["status"]),
                   int(r["issued_at"]), int(r["expires_at"]), bool(r["reusable"]))

    def values(self) -> tuple[Any, ...]:
        return (self.lease_id, self.client_id, self.group_name, self.permits, self.drawn,
                self.released, int(self.stopped), self.status, self.issued_at, self.expires_at,
                int(self.reusable))

    def changes(self) -> tuple[Any, ...]:
        """The id and the columns a stored lease may change (:data:`LEASE_MUTABLE`)."""
        return (self.lease_id, self.drawn, self.released, int(self.stopped), self.status, self.expires_at)


GRANT_COLUMNS = [f.name for f in fields(GrantRow)]
LEASE_COLUMNS = [f.name for f in fields(LeaseRow)]
#: Columns a stored row may change (reports, reclaim, retirement); owner, group, issue time,
#: deadline and a lease's ``reusable`` never change once written. Changed stored rows are
#: written as an ``UPDATE`` of these columns only: fewer values to encode and extract, and the
#: owner index is left alone.
GRANT_MUTABLE = ["permits", "claimed", "released", "reclaimed"]
LEASE_MUTABLE = ["drawn", "released", "stopped", "status", "expires_at"]
