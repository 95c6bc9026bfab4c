"""An in-memory holder store: the pure core (:mod:`semaphore.core.rounds`) without SQLite.

:class:`MemoryStore` has the interface of the holder's SQL store
(:class:`semaphore.holder._store.SqlStore`): :meth:`~MemoryStore.meta`,
:meth:`~MemoryStore.load`, :meth:`~MemoryStore.persist`, :meth:`~MemoryStore.next_reclaim_due`,
:meth:`~MemoryStore.live_lease_pairs`, :meth:`~MemoryStore.groups_with_live_leases` and
:meth:`~MemoryStore.group_rows`, over Python dicts. It selects the rows a
:class:`~semaphore.core.ledger.Reads` names exactly as the SQL store does and keeps the group
aggregates and meta totals the way the SQL store's ``persist`` does (group rows back at all-zero
are deleted; total rows, once created, stay), so a decision run over either store gives the same
replies and the same state (``tests/test_store_contract.py`` checks it). It is not transactional
by itself, but it never lends out its rows: :meth:`~MemoryStore.load` returns copies, so a
decision that raises before :meth:`~MemoryStore.persist` leaves the store as it was.

The order of rows in a :class:`~semaphore.core.ledger.Snapshot` is not part of the contract (the
SQL store returns what SQLite's plan returns; this one sorts by id within each read): it decides
only the order of the "other grants and leases" listed in a reply (SPEC R8), never the state.

:func:`resolve_limits` is the holder shell's limit resolution (SPEC R12, R22, R33) for plain,
synchronous sources, and :func:`run_round`, :func:`run_sync` and :func:`run_reclaim` are the
shell's load -> decide -> persist of one round, sync or reclaim alarm over any :class:`Store`
(for the SQL store, call them inside ``Storage.transaction``). With them a test drives the
holder's decisions directly: no SQLite, no asyncio, no clock.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..core.ledger import Changes, Reads, Snapshot
from ..core.rounds import Limits, Pending, limit_lowered
from ..core.rows import AGGREGATES, GRANT_MUTABLE, LEASE_MUTABLE, GrantRow, LeaseRow
from ..core.seen import ClientSeen
from ..core.wire import SyncMessage
from ..holder._steps import Store, lease_scope, run_reclaim, run_round, run_sync, sync_scope
from ..holder._store import SCHEMA_VERSION

__all__ = ["Store", "MemoryStore", "StoreState", "resolve_limits", "run_round", "run_sync", "run_reclaim"]

# Store and run_* are the holder's own (semaphore.holder._steps), re-exported for tests.

#: ``{"grants": {id: GrantRow}, "leases": {id: LeaseRow}, "groups": {group: {aggregate: value}},
#: "meta": {key: value}}``: a store's whole state, comparable with ``==``.
StoreState = dict[str, dict[str, Any]]


def _zero() -> dict[str, int]:
    return dict.fromkeys(AGGREGATES, 0)


class MemoryStore:
    """The holder's four tables as dicts: grants and leases by id, group aggregates by group
    name, meta rows by key (a fresh store holds ``schema_version`` only, as a fresh SQL schema
    does)."""

    def __init__(self, meta: Mapping[str, int] | None = None) -> None:
        self.grants: dict[str, GrantRow] = {}
        self.leases: dict[str, LeaseRow] = {}
        self.groups: dict[str, dict[str, int]] = {}
        self.meta_rows: dict[str, int] = dict(meta) if meta is not None else {"schema_version": SCHEMA_VERSION}
        #: client id -> when it last reported (the SQL store's ``durability_semaphore_clients``).
        self.last_report_at: dict[str, int] = {}
        #: Per client holding something: its label (the SQL store's ``label`` column).
        self.labels: dict[str, str] = {}
        #: Per client holding something: whether it holds claimed, unreleased permits, and when
        #: those may expire (the ``claims`` and ``expires_at`` columns).
        self.claims: dict[str, tuple[bool, int | None]] = {}

    # ------------------------------------------------------------------ reads
    def meta(self) -> dict[str, int]:
        """Every meta row (a copy)."""
        return dict(self.meta_rows)

    def load(self, reads: Reads, meta: dict[str, int] | None) -> Snapshot:
        """The rows ``reads`` names, each once, as copies, in the SQL store's order of reads:
        grants due by ``reads.due_at``, live leases expired by ``reads.expired_at``, every grant
        and lease of ``reads.clients``, the reported ids not loaded yet, every live lease (or
        those of ``reads.live_lease_groups``), and the aggregate rows of ``reads.groups`` that
        exist; ``meta`` as read by :meth:`meta`."""
        grants: dict[str, GrantRow] = {}
        leases: dict[str, LeaseRow] = {}

        def take_grants(found: Iterable[GrantRow]) -> None:
            for g in sorted(found, key=lambda g: g.grant_id):
                grants.setdefault(g.grant_id, replace(g))

        def take_leases(found: Iterable[LeaseRow]) -> None:
            for x in sorted(found, key=lambda x: x.lease_id):
                leases.setdefault(x.lease_id, replace(x))

        if reads.due_at is not None:
            due_at = reads.due_at
            take_grants(g for g in self.grants.values() if g.claim_by <= due_at and g.claimed < g.permits)
        if reads.expired_at is not None:
            expired_at = reads.expired_at
            take_leases(x for x in self.leases.values() if x.status == "live" and x.expires_at <= expired_at)
        take_grants(g for g in self.grants.values() if g.client_id in reads.clients)
        take_leases(x for x in self.leases.values() if x.client_id in reads.clients)
        take_grants(self.grants[i] for i in reads.grant_ids - grants.keys() if i in self.grants)
        take_leases(self.leases[i] for i in reads.lease_ids - leases.keys() if i in self.leases)
        if reads.all_live_leases:
            take_leases(x for x in self.leases.values() if x.status == "live")
        elif reads.live_lease_groups:
            take_leases(x for x in self.leases.values()
                        if x.status == "live" and x.group_name in reads.live_lease_groups)
        groups = {g: dict(self.groups[g]) for g in sorted(reads.groups) if g in self.groups}
        return Snapshot(list(grants.values()), list(leases.values()), meta, groups, reads)

    def next_reclaim_due(self) -> int | None:
        """The earliest deadline of a grant with unclaimed permits (SPEC R16), if any."""
        return min((g.claim_by for g in self.grants.values() if g.claimed < g.permits), default=None)

    def live_lease_pairs(self, client_ids: Iterable[str] | None) -> set[tuple[str, str]]:
        """``(client, group)`` pairs holding a live lease: of the given clients, or all."""
        wanted = None if client_ids is None else set(client_ids)
        return {(x.client_id, x.group_name) for x in self.leases.values()
                if x.status == "live" and (wanted is None or x.client_id in wanted)}

    def groups_with_live_leases(self) -> set[str]:
        """Groups whose aggregate row counts a live lease."""
        return {g for g, row in self.groups.items() if row["live_leases"] > 0}

    def forget_idle(self, client_ids: Sequence[str]) -> None:
        """Forget the last report time of these clients if they hold no grant and no lease."""
        holding = {g.client_id for g in self.grants.values()} | {x.client_id for x in self.leases.values()}
        for client_id in client_ids:
            if client_id not in holding:
                self.last_report_at.pop(client_id, None)
                self.labels.pop(client_id, None)
                self.claims.pop(client_id, None)

    def seen(self, holding: Sequence[str], idle: Sequence[str], now: int,
             claiming: frozenset[str] = frozenset(), claim_ttl_ms: int | None = None,
             labels: Mapping[str, str] | None = None) -> None:
        """Record that these clients reported at ``now``, with their ``labels`` (a client
        without one keeps its own); ``idle`` ones hold nothing: forgotten."""
        for client_id in holding:
            self.last_report_at[client_id] = now
            self.claims[client_id] = (client_id in claiming, None if claim_ttl_ms is None else now + claim_ttl_ms)
            if labels and client_id in labels:
                self.labels[client_id] = labels[client_id]
        for client_id in idle:
            self.last_report_at.pop(client_id, None)
            self.labels.pop(client_id, None)
            self.claims.pop(client_id, None)

    def seen_rows(self, client_ids: Iterable[str]) -> dict[str, ClientSeen]:
        """The stored rows of these clients (those that have one)."""
        return {c: ClientSeen(self.last_report_at[c], *self.claims.get(c, (False, None)), self.labels.get(c))
                for c in client_ids if c in self.last_report_at}

    def group_rows(self) -> list[dict[str, Any]]:
        """Every group's aggregates, by name (``group_name`` plus the aggregates, as the SQL
        store's rows; for ``usage()``, SPEC R38)."""
        return [{"group_name": g, **self.groups[g]} for g in sorted(self.groups)]

    # ------------------------------------------------------------------ writes
    def persist(self, changes: Changes) -> None:
        """Write ``changes`` in the SQL store's order: new rows in full (an upsert), stored
        rows' mutable columns only (rows no longer stored are skipped, as an ``UPDATE``
        would), deletions; then the group deltas (rows created as needed, rows of the changed
        groups back at all-zero deleted), the total deltas into meta, and the meta sets."""
        for g in changes.new_grants:
            self.grants[g.grant_id] = replace(g)
        self._update(self.grants, changes.changed_grants, GRANT_MUTABLE, "grant_id")
        for gid in changes.deleted_grants:
            self.grants.pop(gid, None)
        for x in changes.new_leases:
            self.leases[x.lease_id] = replace(x)
        self._update(self.leases, changes.changed_leases, LEASE_MUTABLE, "lease_id")
        for lid in changes.deleted_leases:
            self.leases.pop(lid, None)
        if changes.group_deltas:
            for group, delta in changes.group_deltas.items():
                row = self.groups.setdefault(group, _zero())
                for name, d in zip(AGGREGATES, delta):
                    row[name] += d
            for group in changes.group_deltas:
                if not any(self.groups[group].values()):
                    del self.groups[group]
            for name, d in changes.totals().items():
                self.meta_rows[name] = self.meta_rows.get(name, 0) + d
        self.meta_rows.update(changes.meta_sets)

    @staticmethod
    def _update(table: dict[str, Any], rows: Sequence[Any], columns: Sequence[str], key: str) -> None:
        for row in rows:
            stored = table.get(getattr(row, key))
            if stored is not None:
                for column in columns:
                    setattr(stored, column, getattr(row, column))

    # ------------------------------------------------------------------ inspection
    def state(self) -> StoreState:
        """The whole state (copies), comparable with ``==`` and with the SQL store's tables read
        into the same shape."""
        return {
            "grants": {i: replace(g) for i, g in sorted(self.grants.items())},
            "leases": {i: replace(x) for i, x in sorted(self.leases.items())},
            "groups": {g: dict(row) for g, row in sorted(self.groups.items())},
            "meta": dict(sorted(self.meta_rows.items())),
        }

    def recount(self) -> dict[str, dict[str, int]]:
        """Per-group aggregates recomputed from the rows (SPEC R19, R30, R38), groups with
        anything counted only: what :attr:`groups` must equal."""
        groups: dict[str, dict[str, int]] = {}
        for g in self.grants.values():
            groups.setdefault(g.group_name, _zero())["outstanding"] += g.charge
        for x in self.leases.values():
            row = groups.setdefault(x.group_name, _zero())
            row["lease_footprint"] += x.footprint
            row["live_leases" if x.status == "live" else "retired_leases"] += 1
        return {g: row for g, row in sorted(groups.items()) if any(row.values())}

    def totals(self) -> dict[str, int]:
        """The total aggregates as stored in meta (absent rows are zero)."""
        return {name: self.meta_rows.get(name, 0) for name in AGGREGATES}

    def clone(self) -> MemoryStore:
        """An independent copy (to run a decision two ways and compare)."""
        return copy.deepcopy(self)


# ====================================================================== the shell's steps
def resolve_limits(store: Store, clients: Sequence[Pending], *, limit: Any,
                   group_limit: Callable[[str], Any] = lambda group: None,
                   can_grant: Callable[[str, str], bool] | bool | None = None,
                   leases_configured: bool = False) -> Limits:
    """The round's :class:`~semaphore.core.rounds.Limits` as the holder shell resolves them
    (``DurabilitySemaphore._resolve``, SPEC R12, R22, R33), from plain synchronous sources:
    ``limit`` an ``int`` or :data:`~semaphore.core.allocation.LIMIT_ERROR`; ``group_limit(g)``
    an ``int``, ``None`` or ``LIMIT_ERROR``, asked for every demanded group and every group
    holding live leases; ``can_grant`` ``None``, a ``bool`` or ``(client, group) -> bool``,
    asked for every demanded pair and (when callable: every, else the round's clients') live
    lease pair. Live leases are looked at when leases are configured or any is live."""
    demand_pairs, lease_pairs, groups = lease_scope(store, clients, leases_configured=leases_configured,
                                                    every_lease=can_grant is not None)
    group_limits = {g: group_limit(g) for g in sorted(groups)}
    pairs = sorted(demand_pairs | lease_pairs)
    if callable(can_grant):
        permitted = {pair: bool(can_grant(*pair)) for pair in pairs}
    else:
        permitted = dict.fromkeys(pairs, can_grant is None or bool(can_grant))
    return Limits(limit, group_limits, permitted)


def resolve_sync_limits(store: Store, message: SyncMessage, *, limit: Any,
                        group_limit: Callable[[str], Any] = lambda group: None, group_limits: bool = True,
                        leases_configured: bool = False,
                        can_grant: Callable[[str, str], Any] | None = None) -> tuple[Limits | None, bool]:
    """A sync's ``(limits, lowered)`` for :func:`run_sync` as the holder shell resolves them
    (``DurabilitySemaphore._sync_limits``, SPEC R33a), from plain synchronous sources:
    ``None`` when the sync resolves nothing; ``lowered`` compares ``limit`` with meta
    ``last_limit``; ``can_grant`` is asked for each of the client's live-lease pairs."""
    scope = sync_scope(store, message, leases_configured=leases_configured, group_limits=group_limits,
                       every_pair=can_grant is not None)
    if scope is None:
        return None, False
    last = store.meta().get("last_limit")
    groups = {g for _, g in scope} if group_limits else set()
    permitted = {pair: bool(can_grant(*pair)) for pair in sorted(scope)} if can_grant is not None else {}
    return Limits(limit, {g: group_limit(g) for g in sorted(groups)}, permitted), limit_lowered(last, limit)
