"""The rows one round, sync or reclaim works on, and the changes it makes (pure: no storage).

A decision runs in three steps: the store loads a :class:`Snapshot` (the rows :class:`Reads`
names, read with indexed queries), the core changes a :class:`Ledger` built over it, and the
store persists :meth:`Ledger.changes` in the same transaction. Every change goes through
:meth:`Ledger.put_grant`/:meth:`~Ledger.delete_grant`/:meth:`~Ledger.put_lease`/
:meth:`~Ledger.delete_lease`, which keep the per-group and total aggregates (SPEC R19, R38) in
step: a round costs O(rows it touches), never a rescan, and the aggregates always equal a
recount of the rows, so once every client has settled the charged capacity is back to zero (I3).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .rows import AGGREGATES, GrantRow, LeaseRow

__all__ = ["Reads", "Snapshot", "Changes", "Ledger", "Rows", "NotLoadedError"]

_Row = TypeVar("_Row")


@dataclass(frozen=True)
class Reads:
    """What a decision needs loaded, besides the meta rows (always loaded first)."""

    #: Every grant and lease of these clients.
    clients: frozenset[str] = frozenset()
    #: These grants and leases (reported ids), if not loaded with their client.
    grant_ids: frozenset[str] = frozenset()
    lease_ids: frozenset[str] = frozenset()
    #: Grants with unclaimed permits whose ``claim_by <= due_at`` (reclaim, R15).
    due_at: int | None = None
    #: Live leases whose ``expires_at <= expired_at`` (TTL retirement, R31).
    expired_at: int | None = None
    #: Every live lease (a lowered limit retires them all, R33) ...
    all_live_leases: bool = False
    #: ... or the live leases of these groups.
    live_lease_groups: frozenset[str] = frozenset()
    #: The aggregate rows of these groups (charged capacity per demanded group, R19).
    groups: frozenset[str] = frozenset()


@dataclass
class Snapshot:
    """Rows as loaded: grants and leases (each once), meta and group aggregates."""

    grants: list[GrantRow] = field(default_factory=list)
    leases: list[LeaseRow] = field(default_factory=list)
    #: ``None`` when the decision does not read meta (a sync, the reclaim alarm: they change
    #: totals only through deltas), so it costs no statement.
    meta: dict[str, int] | None = field(default_factory=dict)
    #: group -> {aggregate name: value}, for the groups :attr:`Reads.groups` named (absent
    #: groups have no row: all zero).
    groups: dict[str, dict[str, int]] = field(default_factory=dict)
    #: What was asked for, so the :class:`Ledger` can refuse a lookup of anything else
    #: (``None``: a hand-built snapshot, looked up without that check).
    reads: Reads | None = None


@dataclass
class Changes:
    """What to write: new rows in full, stored rows' mutable columns, deletions of stored rows,
    aggregate deltas per group (``[outstanding, lease_footprint, live, retired]``, non-zero
    only) and meta rows to set."""

    new_grants: list[GrantRow] = field(default_factory=list)
    changed_grants: list[GrantRow] = field(default_factory=list)
    deleted_grants: list[str] = field(default_factory=list)
    new_leases: list[LeaseRow] = field(default_factory=list)
    changed_leases: list[LeaseRow] = field(default_factory=list)
    deleted_leases: list[str] = field(default_factory=list)
    group_deltas: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)
    meta_sets: dict[str, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        """Nothing to write."""
        return not (self.new_grants or self.changed_grants or self.deleted_grants or self.new_leases
                    or self.changed_leases or self.deleted_leases or self.group_deltas or self.meta_sets)

    def totals(self) -> dict[str, int]:
        """The total aggregates' deltas (non-zero only): the sum of :attr:`group_deltas`."""
        sums = [sum(d[i] for d in self.group_deltas.values()) for i in range(len(AGGREGATES))]
        return {name: sums[i] for i, name in enumerate(AGGREGATES) if sums[i]}


class NotLoadedError(AssertionError):
    """A decision looked up a row its :class:`Reads` did not name: absent, it would read as
    "not found" and the decision would go on silently wrong (a missing prefetch is a bug)."""


class Rows(dict[str, _Row]):
    """The rows of one kind a decision loaded, by id. A lookup (``rows[id]``, ``rows.get(id)``,
    ``id in rows``) of an id that was neither loaded, nor named by the reads (a reported id
    whose row is absent: truly not found), nor written by this decision raises
    :class:`NotLoadedError`. Iterating is free: it only ever sees what was loaded."""

    def __init__(self, kind: str, rows: Iterable[tuple[str, _Row]], named: frozenset[str] | None) -> None:
        super().__init__(rows)
        self._kind = kind
        # None: no check (a snapshot built by hand)
        self._known: set[str] | None = None if named is None else set(self) | named

    def _check(self, key: object) -> None:
        if self._known is not None and key not in self._known:
            raise NotLoadedError(f"{self._kind} {key!r} was looked up but this decision's Reads did not load it")

    def __getitem__(self, key: str) -> _Row:
        self._check(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._check(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._check(key)
        return super().__contains__(key)

    def __setitem__(self, key: str, value: _Row) -> None:
        if self._known is not None:
            self._known.add(key)
        super().__setitem__(key, value)


class Ledger:
    """The rows of one decision, with their changes and the aggregates kept in step. A lookup
    of a row, a group or a selection the snapshot's :class:`Reads` did not cover raises
    :class:`NotLoadedError` (like a database that asserts every key a commit touches was
    prefetched), instead of answering as if it were absent."""

    def __init__(self, snapshot: Snapshot) -> None:
        reads = snapshot.reads
        self._reads = reads
        self.grants: Rows[GrantRow] = Rows("grant", ((g.grant_id, g) for g in snapshot.grants),
                                           None if reads is None else reads.grant_ids)
        self.leases: Rows[LeaseRow] = Rows("lease", ((x.lease_id, x) for x in snapshot.leases),
                                           None if reads is None else reads.lease_ids)
        self._meta = None if snapshot.meta is None else dict(snapshot.meta)
        self._groups = snapshot.groups
        # What the stored aggregates account for, per row: grant id -> charge (a grant never
        # changes group), lease id -> (group, footprint, status or "").
        self._grant_acc = {gid: g.charge for gid, g in self.grants.items()}
        self._lease_acc = {lid: (x.group_name, x.footprint, x.status) for lid, x in self.leases.items()}
        self._stored_grants = set(self.grants)
        self._stored_leases = set(self.leases)
        self._dirty_grants: set[str] = set()
        self._dirty_leases: set[str] = set()
        self._deleted_grants: set[str] = set()
        self._deleted_leases: set[str] = set()
        #: Clients whose grant or lease this decision deleted (they may hold nothing now).
        self.deleted_owners: set[str] = set()
        self.deltas: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        self._meta_sets: dict[str, int] = {}

    # ------------------------------------------------------------------ selections
    def _require(self, covered: bool, what: str) -> None:
        if self._reads is not None and not covered:
            raise NotLoadedError(f"{what} was asked for but this decision's Reads did not load it")

    def due_grants(self, now: int) -> list[GrantRow]:
        """Grants past their claim deadline that still have unclaimed permits (R15)."""
        due_at = None if self._reads is None else self._reads.due_at
        self._require(due_at is not None and now <= due_at, f"grants due at {now}")
        return [g for g in self.grants.values() if g.claim_by <= now and g.claimed < g.permits]

    def expired_leases(self, now: int) -> list[LeaseRow]:
        """Live leases past ``expires_at`` (R31)."""
        expired_at = None if self._reads is None else self._reads.expired_at
        self._require(expired_at is not None and now <= expired_at, f"leases expired at {now}")
        return [x for x in self.leases.values() if x.status == "live" and x.expires_at <= now]

    def live_leases(self, groups: Iterable[str] | None = None) -> list[LeaseRow]:
        """Live leases loaded, of the given groups or all of them."""
        r = self._reads
        if groups is None:
            self._require(r is not None and r.all_live_leases, "every live lease")
            return [x for x in self.leases.values() if x.status == "live"]
        wanted = set(groups)
        self._require(r is not None and (r.all_live_leases or wanted <= r.live_lease_groups),
                      f"the live leases of {sorted(wanted)}")
        return [x for x in self.leases.values() if x.status == "live" and x.group_name in wanted]

    def live_leases_of(self, clients: Iterable[str], groups: Iterable[str]) -> list[LeaseRow]:
        """The live leases of these clients in these groups (every row of a client named by
        :attr:`Reads.clients` is loaded)."""
        owners, wanted = set(clients), set(groups)
        self._require(self._reads is not None and owners <= self._reads.clients,
                      f"the leases of clients {sorted(owners - (self._reads.clients if self._reads else set()))}")
        return [x for x in self.leases.values()
                if x.status == "live" and x.client_id in owners and x.group_name in wanted]

    # ------------------------------------------------------------------ changes
    def _account_grant(self, gid: str, group: str, charge: int) -> None:
        before = self._grant_acc.get(gid, 0)
        if charge != before:
            self.deltas[group][0] += charge - before
        self._grant_acc[gid] = charge

    def _account_lease(self, lid: str, group: str, footprint: int, status: str) -> None:
        _, fp_before, status_before = self._lease_acc.get(lid, (group, 0, ""))
        d = self.deltas[group]
        d[1] += footprint - fp_before
        if status_before != status:
            if status_before:
                d[2 if status_before == "live" else 3] -= 1
            if status:
                d[2 if status == "live" else 3] += 1
        self._lease_acc[lid] = (group, footprint, status)

    def put_grant(self, g: GrantRow) -> None:
        """Record a new or changed grant (its aggregates follow)."""
        self.grants[g.grant_id] = g
        self._dirty_grants.add(g.grant_id)
        self._account_grant(g.grant_id, g.group_name, g.charge)

    def delete_grant(self, g: GrantRow) -> None:
        self.grants.pop(g.grant_id, None)
        self._dirty_grants.discard(g.grant_id)
        self._deleted_grants.add(g.grant_id)
        self.deleted_owners.add(g.client_id)
        self._account_grant(g.grant_id, g.group_name, 0)

    def put_lease(self, lease: LeaseRow) -> None:
        """Record a new or changed lease (its aggregates follow)."""
        self.leases[lease.lease_id] = lease
        self._dirty_leases.add(lease.lease_id)
        self._account_lease(lease.lease_id, lease.group_name, lease.footprint, lease.status)

    def delete_lease(self, lease: LeaseRow) -> None:
        self.leases.pop(lease.lease_id, None)
        self._dirty_leases.discard(lease.lease_id)
        self._deleted_leases.add(lease.lease_id)
        self.deleted_owners.add(lease.client_id)
        self._account_lease(lease.lease_id, lease.group_name, 0, "")

    # ------------------------------------------------------------------ aggregates and meta
    def meta(self) -> Mapping[str, int]:
        """The meta rows as loaded (changes are :meth:`set_meta` writes, seen by :meth:`changes`)."""
        if self._meta is None:
            raise RuntimeError("this decision's snapshot did not load meta")
        return self._meta

    def set_meta(self, key: str, value: int) -> None:
        self._meta_sets[key] = int(value)

    def totals(self) -> dict[str, int]:
        """Total aggregates including the changes made so far."""
        meta = self.meta()
        return {name: meta.get(name, 0) + sum(d[i] for d in self.deltas.values())
                for i, name in enumerate(AGGREGATES)}

    def group_usage(self, groups: Iterable[str]) -> dict[str, dict[str, int]]:
        """Per-group aggregates (including the changes so far) of groups the snapshot loaded."""
        wanted = set(groups)
        self._require(self._reads is not None and wanted <= self._reads.groups,
                      f"the aggregates of {sorted(wanted - (self._reads.groups if self._reads else set()))}")
        out: dict[str, dict[str, int]] = {}
        for g in sorted(wanted):
            row = self._groups.get(g)
            d = self.deltas.get(g)
            out[g] = {name: (row.get(name, 0) if row else 0) + (d[i] if d else 0)
                      for i, name in enumerate(AGGREGATES)}
        return out

    def changes(self) -> Changes:
        """Everything to write, in a deterministic order (sorted by id)."""
        dirty_grants, dirty_leases = sorted(self._dirty_grants), sorted(self._dirty_leases)
        return Changes(
            new_grants=[self.grants[i] for i in dirty_grants if i not in self._stored_grants],
            changed_grants=[self.grants[i] for i in dirty_grants if i in self._stored_grants],
            deleted_grants=sorted(self._deleted_grants & self._stored_grants),
            new_leases=[self.leases[i] for i in dirty_leases if i not in self._stored_leases],
            changed_leases=[self.leases[i] for i in dirty_leases if i in self._stored_leases],
            deleted_leases=sorted(self._deleted_leases & self._stored_leases),
            group_deltas={g: (d[0], d[1], d[2], d[3]) for g, d in sorted(self.deltas.items()) if any(d)},
            meta_sets=dict(sorted(self._meta_sets.items())),
        )
