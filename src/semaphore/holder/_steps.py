"""The holder's transaction bodies (a round, a sync, the reclaim, a force-settle), each load ->
decide -> persist, over any :class:`Store`.

The holder shell (:mod:`semaphore.holder._semaphore`) runs them over its
:class:`~semaphore.holder._store.SqlStore` inside ``Storage.transaction`` (SPEC R2); the test
kit runs them over :class:`semaphore.testing.MemoryStore` (no SQLite, no asyncio). Each loads
what the core's ``*_reads`` names, lets :mod:`semaphore.core.rounds` decide over a
:class:`~semaphore.core.ledger.Ledger`, and persists :meth:`~semaphore.core.ledger.Ledger.changes`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from ..core.batching import round_may_commit
from ..core.ledger import Changes, Ledger, Reads, Snapshot
from ..core.rounds import (
    Limits,
    Pending,
    Policy,
    RoundOutcome,
    decide_reclaim,
    decide_round,
    decide_sync,
    reclaim_reads,
    round_reads,
    sync_reads,
)
from ..core.seen import ClientSeen, clients_to_record
from ..core.settle import Settlement, decide_claim_expiry, decide_force_settle
from ..core.wire import SyncMessage

__all__ = ["Store", "LeaseScope", "SyncResult", "lease_scope", "sync_scope", "run_round", "run_sync", "run_reclaim",
           "run_force_settle", "run_claim_expiry"]


class Store(Protocol):
    """What the holder needs of a store: the SQL store and the test kit's in-memory one."""

    def meta(self) -> dict[str, int]:
        """Every meta row."""

    def load(self, reads: Reads, meta: dict[str, int] | None) -> Snapshot:
        """The rows ``reads`` names, each once, with ``meta`` (``None``: not read)."""

    def persist(self, changes: Changes) -> None:
        """Write a decision's changes."""

    def next_reclaim_due(self) -> int | None:
        """The earliest ``claim_by`` of a grant with unclaimed permits."""

    def live_lease_pairs(self, client_ids: Iterable[str] | None) -> set[tuple[str, str]]:
        """``(client, group)`` pairs holding a live lease: of these clients, or all."""

    def groups_with_live_leases(self) -> set[str]:
        """Groups whose aggregate row counts a live lease."""

    def forget_idle(self, client_ids: Sequence[str]) -> None:
        """Forget the last report time of these clients if they hold no grant and no lease."""

    def seen_rows(self, client_ids: Iterable[str]) -> dict[str, ClientSeen]:
        """The stored rows of these clients (those that have one)."""

    def seen(self, holding: Sequence[str], idle: Sequence[str], now: int,
             claiming: frozenset[str] = frozenset(), claim_ttl_ms: int | None = None,
             labels: Mapping[str, str] | None = None) -> None:
        """Record that these clients reported at ``now``: ``holding`` hold a grant or a lease
        (their time is kept, with whether they are ``claiming``, i.e. hold claimed, unreleased
        permits, and, with crash expiry, ``claim_ttl_ms``; and the ``labels`` their messages
        carried, in the same write: a client without one keeps its stored label), ``idle`` hold
        nothing (forgotten)."""


class SqlStoreLike(Store, Protocol):
    """A store that also knows when clients last reported (crash expiry)."""

    def stale_clients(self, now: int) -> list[str]:
        """Clients whose claims crash expiry may release at ``now``."""

    def claims_released(self, client_ids: Sequence[str]) -> None:
        """These clients hold no claimed, unreleased permit any more."""


class LeaseScope(NamedTuple):
    """What a round resolves limits and ``can_grant`` for (see :func:`lease_scope`)."""

    demand_pairs: set[tuple[str, str]]
    lease_pairs: set[tuple[str, str]]
    groups: set[str]


def lease_scope(store: Store, clients: Sequence[Pending], *, leases_configured: bool,
                every_lease: bool) -> LeaseScope:
    """What a round must resolve before its transaction (SPEC R12, R22, R33): the demanded
    ``(client, group)`` pairs, the pairs holding a live lease (of every client when
    ``every_lease``: a ``can_grant`` that may say no is asked for every live lease, since a client
    drawing from its lease may never request; else of the round's clients), and every group
    demanded or holding live leases. Live leases are looked at only when leases are configured
    or any is live (one meta read)."""
    demand_pairs = {(p.client_id, d.group) for p in clients for d in p.latest.demand}
    lease_pairs: set[tuple[str, str]] = set()
    lease_groups: set[str] = set()
    if leases_configured or store.meta().get("live_leases", 0) > 0:
        lease_pairs = store.live_lease_pairs(None if every_lease else [p.client_id for p in clients])
        lease_groups = store.groups_with_live_leases()
    return LeaseScope(demand_pairs, lease_pairs, {g for _, g in demand_pairs} | lease_groups)


def sync_scope(store: Store, message: SyncMessage, *, leases_configured: bool, group_limits: bool,
               every_pair: bool = False) -> set[tuple[str, str]] | None:
    """What a sync must resolve before its transaction (SPEC R33a): ``None`` when nothing (the
    sync reports no lease, or leases are not configured and none is live: one meta read), else
    the ``(client, group)`` pairs of the client's live leases (read only when ``group_limits``
    are configured, for their groups' limits, or ``every_pair``: a ``can_grant`` that may say no
    is asked for each) besides the limit itself."""
    if not message.leases:
        return None
    if not leases_configured and store.meta().get("live_leases", 0) <= 0:
        return None
    if not (group_limits or every_pair):
        return set()
    return set(store.live_lease_pairs([message.client_id]))


def run_round(store: Store, now: int, clients: Sequence[Pending], limits: Limits,
              policy: Policy, *, immediate: bool = False, urgent: bool = False) -> RoundOutcome | None:
    """One round's transaction body (SPEC R2): load what
    :func:`~semaphore.core.rounds.round_reads` names, decide, persist the changes. A round run
    at once (``immediate``, R9a) that would leave need unserved persists nothing and returns
    ``None`` (:func:`~semaphore.core.batching.round_may_commit`), unless a try is in it
    (``urgent``, R9b)."""
    meta = store.meta()
    ledger = Ledger(store.load(round_reads(meta, now, clients, limits, policy), meta))
    must_fit = not round_may_commit(policy.timing, immediate=immediate, unserved=True, urgent=urgent)
    outcome = decide_round(ledger, now, clients, limits, policy, must_fit=must_fit)
    if outcome.declined:
        return None
    store.persist(ledger.changes())
    _seen(store, ledger, [p.client_id for p in clients], now, policy.claim_ttl_ms, _labels(clients),
          skip_unchanged=False)
    return outcome


class SyncResult(NamedTuple):
    """What :func:`run_sync` returns: the reply, how much the sync changed the charged capacity
    (``outstanding + lease_footprint``, R19: below 0, it freed some), and whether it wrote
    anything (R38 decision "last seen": a sync that wrote nothing moved no deadline, so the
    alarm needs no re-arming)."""

    reply: dict[str, Any]
    charge_change: int
    wrote: bool


def run_sync(store: Store, now: int, message: SyncMessage, policy: Policy, contended: bool,
             next_request_at: int, starving: int, limits: Limits | None = None,
             lowered: bool = False, *, share: int | None = None) -> SyncResult:
    """One sync's transaction body (SPEC R6; with ``limits``, R33a: ``lowered`` says the limit
    is below the last round's). Reads no meta row."""
    ledger = Ledger(store.load(sync_reads(now, message, limits, lowered, policy), None))
    reply = decide_sync(ledger, now, message, policy, contended, next_request_at, starving, limits, lowered,
                        share=share)
    changes = ledger.changes()
    store.persist(changes)
    labels = {} if message.label is None else {message.client_id: message.label}
    recorded = _seen(store, ledger, [message.client_id], now, policy.claim_ttl_ms, labels, skip_unchanged=True)
    return SyncResult(reply, _charge_change(changes), recorded or not changes.empty)


def run_reclaim(store: Store, now: int) -> int:
    """The reclaim alarm's transaction body (SPEC R15, R16). Reads no meta row. Returns how much
    it changed the charged capacity (below 0: it freed some)."""
    ledger = Ledger(store.load(reclaim_reads(now), None))
    decide_reclaim(ledger, now)
    changes = ledger.changes()
    store.persist(changes)
    _forget(store, ledger)
    return _charge_change(changes)


def _charge_change(changes: Changes) -> int:
    """How much ``changes`` move the charged capacity (``outstanding + lease_footprint``, R19)."""
    totals = changes.totals()
    return int(totals.get("outstanding", 0) + totals.get("lease_footprint", 0))


def _labels(clients: Sequence[Pending]) -> dict[str, str]:
    """The label of each client of a round: its latest message's that carries one (R10)."""
    labels: dict[str, str] = {}
    for p in clients:
        label = next((m.label for m in reversed(p.messages) if m.label is not None), None)
        if label is not None:
            labels[p.client_id] = label
    return labels


def _seen(store: Store, ledger: Ledger, client_ids: Sequence[str], now: int, claim_ttl_ms: int | None,
          labels: Mapping[str, str], *, skip_unchanged: bool) -> bool:
    """The last report time of the clients of a round or sync, kept only for clients that hold
    something after it (a made-up client id leaves no row behind), with whether they hold
    claimed, unreleased permits (crash expiry; the ledger has every row of these clients) and
    the labels their messages carried (R38 decision: written by the same statement). With
    ``skip_unchanged`` (a sync), a row is written only when what it records changes (R38 decision
    "last seen", :func:`~semaphore.core.seen.clients_to_record`, over one read of the rows); a
    round writes them all (it commits anyway, and on the runtime reading a row per client costs
    more than one write of them all). Whether it wrote anything."""
    owners = {g.client_id for g in ledger.grants.values()} | {x.client_id for x in ledger.leases.values()}
    claiming = frozenset(g.client_id for g in ledger.grants.values() if g.claimed > g.released)
    holding, idle = [c for c in client_ids if c in owners], [c for c in client_ids if c not in owners]
    if skip_unchanged:
        holding, idle = clients_to_record(store.seen_rows(client_ids), holding, idle, claiming, now, claim_ttl_ms,
                                          labels)
    if holding or idle:
        store.seen(holding, idle, now, claiming, claim_ttl_ms, labels)
    return _forget(store, ledger, exclude=set(client_ids)) or bool(holding or idle)


def _forget(store: Store, ledger: Ledger, exclude: Iterable[str] = ()) -> bool:
    """Forget the last report time of other clients whose rows this decision deleted (a reclaim
    of a grant never claimed, a settle) once they hold nothing at all (one statement, only when
    something was deleted). Whether it ran."""
    others = sorted(ledger.deleted_owners - set(exclude))
    if others:
        store.forget_idle(others)
    return bool(others)


def run_force_settle(store: Store, client_id: str) -> Settlement:
    """A force-settle's decision over every grant and lease of ``client_id`` (issue 11,
    :mod:`semaphore.core.settle`); the caller writes the audit record in the same transaction."""
    ledger = Ledger(store.load(Reads(clients=frozenset({client_id})), None))
    settlement = decide_force_settle(ledger, client_id)
    store.persist(ledger.changes())
    return settlement


def run_claim_expiry(store: SqlStoreLike, now: int) -> tuple[tuple[str, str, int], ...]:
    """Crash expiry's transaction body (``claim_ttl_ms``): release the claimed permits of the
    clients unheard of since their reply told them the TTL, for that long
    (:func:`~semaphore.core.settle.decide_claim_expiry`); at most 1,000 clients per run (the
    next alarm takes the rest)."""
    stale = frozenset(store.stale_clients(now))
    if not stale:
        return ()
    ledger = Ledger(store.load(Reads(clients=stale), None))
    freed = decide_claim_expiry(ledger, stale)
    store.persist(ledger.changes())
    store.claims_released(sorted(stale))
    _forget(store, ledger)
    return freed
