"""The holder's decisions (SPEC §4-§7): rounds, syncs and the reclaim alarm, over a :class:`Ledger`.

Pure and synchronous: no SQL, no asyncio, no clock reads. The holder resolves the limits, then in
one transaction asks :func:`round_reads` what to load, loads it, calls :func:`decide_round` (or
:func:`decide_sync`, :func:`decide_reclaim`) on a :class:`~semaphore.core.ledger.Ledger` over the
snapshot, and persists :meth:`Ledger.changes`. Randomness (new ids, the lease-id seed) comes in
through :class:`Policy`'s factories.

Order within a round (each step one function below): reclaim due grants (R15), retire expired
leases (R31), apply every report of every message in order (R13, R14, R17, R30-R32), retire
leases no longer eligible (R33), charge capacity (R19, R32), build the entries (R10, R20, R22,
R26), allocate (R18-R28, :mod:`semaphore.core.allocation`), issue the grants and leases (R15,
R31, R32), write meta (R9, R29, R33), answer every client (R8, R11, R23, R29).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from .allocation import Allocation, Entry, Usage, allocate, ceiling, lease_candidate
from .batching import ROUND_PERIOD_MS, Timing, next_request_at
from .config import LeaseConfig, LimitedGroups
from .lease_ids import issuing_key, new_lease_id, unknown_lease_charge
from .ledger import Ledger, Reads
from .marks import raise_counts
from .rows import GrantRow, LeaseRow
from .wire import (
    MAX_INT,
    BlockedReason,
    GrantReport,
    GrantStatus,
    LeaseReport,
    LeaseStatus,
    PermitRequest,
    SyncMessage,
    blocked_entry,
    grant_state,
    lease_state,
    permit_response,
)

__all__ = ["Policy", "Pending", "Limits", "RoundOutcome", "View", "round_reads", "sync_reads",
           "reclaim_reads", "decide_round", "decide_sync", "decide_reclaim", "limit_lowered"]

Message = PermitRequest | SyncMessage
_DEFAULT_TTL_MS = LeaseConfig().ttl_ms
#: The storage schema version written with the first reusable lease (SPEC R34a): releases that
#: know only version 1 refuse the storage from then on (fail closed, never undercharge).
REUSABLE_SCHEMA = 2


@dataclass(frozen=True, kw_only=True)
class Policy:
    """The holder options the decisions read (see :class:`~semaphore.DurabilitySemaphore`)."""

    #: A fresh unique id for a grant, or a lease's nonce (required: no default could be unique).
    new_id: Callable[[], str]
    #: 32 random bytes, called at most once per storage (R32).
    new_secret: Callable[[], bytes]
    leases: LeaseConfig | None = None
    grant_timeout_ms: int = 10_000
    round_period_ms: int = ROUND_PERIOD_MS
    #: SPEC R9a: rounds run at once while there is no contention (the holder's ``free_at_once``).
    free_at_once: bool = False
    #: The holder's MAC key under ``lease_secret`` (``None``: the per-storage secret).
    app_secret: bytes | None = None
    #: Crash expiry of claimed permits (``None``: off; see ``DurabilitySemaphore``).
    claim_ttl_ms: int | None = None

    @property
    def timing(self) -> Timing:
        """What the replies' ``nextRequestAt`` reads of the round timing (R11, R9a)."""
        return Timing(round_period_ms=self.round_period_ms, free_at_once=self.free_at_once)

    @property
    def ttl_ms(self) -> int:
        """Lease lifetime; leases may outlive a config that had them: the default lifetime then."""
        return _DEFAULT_TTL_MS if self.leases is None else self.leases.ttl_ms


@dataclass
class Pending:
    """One client's requests in a round (R10: latest demand wins, every report is applied)."""

    client_id: str
    arrival: int
    messages: list[PermitRequest] = field(default_factory=list)

    @property
    def latest(self) -> PermitRequest:
        return self.messages[-1]


@dataclass(frozen=True)
class Limits:
    """The round's resolved limits (R12): ``limit`` and each group's an ``int``, ``None`` (a
    group without one) or ``LIMIT_ERROR``; ``permitted`` the ``canGrant`` answer per
    ``(client, group)`` of the round's demand and of live leases (R22, R33)."""

    limit: Any
    group_limits: Mapping[str, Any] = field(default_factory=dict)
    permitted: Mapping[tuple[str, str], bool] = field(default_factory=dict)


@dataclass
class View:
    """What one client is told about the grants and leases it reported (then issued)."""

    grants: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> wire GrantState
    leases: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> wire LeaseState
    #: Reports of leases the holder does not know (R32), merged so far this round:
    #: id -> ``(drawn, released, stopped)``.
    unknown_reports: dict[str, tuple[int, int, bool]] = field(default_factory=dict)

    def unknown_footprints(self) -> dict[str, tuple[int, int, bool]]:
        """The merged reports of the unknown leases not settled by them (stopped with
        ``released == drawn``): id -> ``(drawn, released, stopped)``, for the R32 charge."""
        return {lid: (d, r, stopped) for lid, (d, r, stopped) in self.unknown_reports.items()
                if not (stopped and r == d)}


@dataclass(frozen=True)
class RoundOutcome:
    """Each client's reply and the round's R29 ``contended`` flag, with what the round did
    (read from the decision itself, no extra reads; the holder's round record reports them)."""

    replies: dict[str, dict[str, Any]]
    contended: bool
    #: The round left need unserved (R29's first cause; a round run at once then commits
    #: nothing, R9a). ``contended`` is also true when it left no permit free (R29 decision).
    unserved: bool = False
    #: A round run at once that would leave need unserved: decided no further, nothing to
    #: persist, nobody to answer (R9a).
    declined: bool = False
    #: Clients in the round (each with its latest demand, R10).
    requests: int = 0
    #: Permits granted in the round's new grants, and how many grants.
    admitted: int = 0
    grants_issued: int = 0
    #: New leases and their permits.
    leases_issued: int = 0
    lease_permits_issued: int = 0
    #: Leases that stopped being live in the round (TTL R31, R33, stopped by a report R30),
    #: settled ones included.
    leases_retired: int = 0
    #: SPEC R31b: the fair share while entries starve (:func:`fair_share`; ``None``: no bound).
    share: int | None = None
    #: Blocked reason -> permits left waiting (the sum of the round's ``blocked`` entries, R23).
    blocked: Mapping[str, int] = field(default_factory=dict)
    #: Charged capacity after the round (``outstanding + leaseFootprint``, R19), and the limit
    #: the round ran under (``None`` when not resolved, R12).
    charged: int = 0
    limit: int | None = None
    #: Clients the round gave a new grant or lease (a waiting request of anyone else may stay
    #: open, R9 decision).
    served: frozenset[str] = frozenset()
    #: Entries the round left unserved that hold no live lease in their group (R31a).
    starving: int = 0


# ====================================================================== what to load
def _report_reads(now: int, messages: Mapping[str, Sequence[Message]]) -> Reads:
    return Reads(
        clients=frozenset(messages),
        grant_ids=frozenset(r.grant_id for ms in messages.values() for m in ms for r in m.grants),
        lease_ids=frozenset(r.lease_id for ms in messages.values() for m in ms for r in m.leases or ()),
        due_at=now,
        expired_at=now,
    )


def _denied(limits: Limits) -> set[tuple[str, str]]:
    return {pair for pair, ok in limits.permitted.items() if not ok}


def _exclude_limited(policy: Policy) -> bool:
    return policy.leases is None or policy.leases.limited_groups is LimitedGroups.EXCLUDE


def _limit_lowered(meta: Mapping[str, int], limit: Any) -> bool:
    return limit_lowered(meta.get("last_limit"), limit)


def limit_lowered(last_limit: int | None, limit: Any) -> bool:
    """SPEC R33: ``limit`` (resolved, R12) is below the last round's (``None``: no round yet)."""
    return isinstance(limit, int) and last_limit is not None and limit < last_limit


def _capped_groups(limits: Limits) -> set[str]:
    """The groups of the resolved ``limits`` that have a limit of their own (an ``int``)."""
    return {g for g, gl in limits.group_limits.items() if isinstance(gl, int) and not isinstance(gl, bool)}


def _retire_groups(limits: Limits, policy: Policy) -> set[str]:
    """Groups whose live leases R33 may retire: those that have a limit under ``exclude`` and
    those of a ``(client, group)`` that ``canGrant`` now refuses."""
    groups = {g for g, gl in limits.group_limits.items() if isinstance(gl, int)} if _exclude_limited(policy) else set()
    return groups | {g for _, g in _denied(limits)}


def round_reads(meta: Mapping[str, int], now: int, clients: Sequence[Pending], limits: Limits,
                policy: Policy) -> Reads:
    """The rows a round needs (``meta`` already loaded): the clients' rows, every reported id,
    due grants and expired leases, the live leases R33 may retire and the demanded groups'
    aggregates."""
    base = _report_reads(now, {p.client_id: p.messages for p in clients})
    return Reads(
        clients=base.clients, grant_ids=base.grant_ids, lease_ids=base.lease_ids,
        due_at=now, expired_at=now,
        all_live_leases=_limit_lowered(meta, limits.limit),
        live_lease_groups=frozenset(_retire_groups(limits, policy)),
        groups=frozenset(d.group for p in clients for d in p.latest.demand) | _charge_groups(limits, policy),
    )


def _charge_groups(limits: Limits | None, policy: Policy) -> frozenset[str]:
    """Under ``withinGroupLimit``, the capped groups whose charge R33 compares with their limit
    (one aggregate row each)."""
    if limits is None or _exclude_limited(policy):
        return frozenset()
    return frozenset(_capped_groups(limits))


def sync_reads(now: int, message: SyncMessage, limits: Limits | None = None, lowered: bool = False,
               policy: Policy | None = None) -> Reads:
    """The rows a sync needs: the client's, every reported id, due grants and expired leases;
    with ``limits`` (resolved for a sync reporting leases, R33a) every live lease when the limit
    was ``lowered`` and the aggregates of the capped groups (``withinGroupLimit``)."""
    base = _report_reads(now, {message.client_id: [message]})
    if limits is None or policy is None:
        return base
    return Reads(clients=base.clients, grant_ids=base.grant_ids, lease_ids=base.lease_ids, due_at=now,
                 expired_at=now, all_live_leases=lowered, groups=_charge_groups(limits, policy))


def reclaim_reads(now: int) -> Reads:
    """The rows the reclaim alarm needs: the grants due (R16)."""
    return Reads(due_at=now)


# ====================================================================== state changes
def decide_reclaim(ledger: Ledger, now: int) -> None:
    """SPEC R15, R16: past ``claim_by``, a grant shrinks to its claimed count; with nothing
    claimed (or everything released) it is deleted. So permits whose reply was lost stay
    charged until their deadline, then come back (I4)."""
    for g in ledger.due_grants(now):
        g.permits = g.claimed
        g.reclaimed = True
        if g.released >= g.permits:  # every claimed permit released (none claimed: none to wait for)
            ledger.delete_grant(g)
        else:
            ledger.put_grant(g)


def _retire_expired(ledger: Ledger, now: int) -> None:
    """SPEC R31: a lease unreported for ``ttlMs`` is retired (never forgotten)."""
    for lease in ledger.expired_leases(now):
        lease.status = "retired"
        ledger.put_lease(lease)


def _retire_ineligible(ledger: Ledger, limits: Limits, policy: Policy, owners: Iterable[str], *,
                       lowered: bool | None = None) -> None:
    """SPEC R33: a lowered limit retires every live lease; a group that gained a limit under
    ``exclude`` retires its live leases; under ``withinGroupLimit`` a group charged above its
    limit (a lowered group limit) retires the live leases of ``owners`` there (the clients whose
    messages these are, R33a: a report of another client's lease id changes nothing, R14, R32);
    ``canGrant`` turning false retires the live leases of that ``(client, group)``
    (``limits.permitted`` holds the answer for every live lease's pair at a round, for the
    client's at a sync, R33a). ``lowered``: the round compares with meta ``last_limit``; a sync
    is told (R33a)."""
    to_retire: list[LeaseRow] = []
    if _limit_lowered(ledger.meta(), limits.limit) if lowered is None else lowered:
        to_retire += ledger.live_leases()
    capped, mine = _capped_groups(limits), set(owners)
    if _exclude_limited(policy):
        # a round loaded every live lease of these groups; a sync only its client's (and
        # reported ids, which must change nothing of another client's, R14, R32)
        to_retire += ledger.live_leases(capped) if lowered is None else ledger.live_leases_of(mine, capped)
    elif capped:
        usage = ledger.group_usage(capped)
        over = {g for g in capped if usage[g]["outstanding"] + usage[g]["lease_footprint"] > limits.group_limits[g]}
        to_retire += ledger.live_leases_of(mine, over)
    denied = _denied(limits)
    if denied:
        groups = {g for _, g in denied}
        # a sync loaded only its client's live leases: select them so (R33a)
        live = ledger.live_leases(groups) if lowered is None else ledger.live_leases_of(mine, groups)
        to_retire += [x for x in live if (x.client_id, x.group_name) in denied]
    for lease in to_retire:
        if lease.status == "live":
            lease.status = "retired"
            ledger.put_lease(lease)


def _open(ledger: Ledger, now: int, messages: Mapping[str, Sequence[Message]], policy: Policy,
          starving: int, share: int | None = None) -> dict[str, View]:
    """The start of every round and sync: reclaim (R15) and retire (R31) what is due, then
    apply every client's reports in order (``starving``: the last round's count, R31a;
    ``share``: its fair share, above which a reusable lease is retired, R31b); returns each
    client's view."""
    decide_reclaim(ledger, now)
    _retire_expired(ledger, now)
    return {client_id: _apply_reports(ledger, client_id, ms, now, policy, not starving, share)
            for client_id, ms in messages.items()}


def fair_share(limit: Any, live_leases: int, starving: int) -> int | None:
    """SPEC R31b: while ``starving`` entries wait that the account's limit blocked (R31a), the
    most permits a client's live reusable leases in one group may hold:
    ``max(1, floor(limit / (live_leases + starving)))``, every live lease and every such entry
    counted once. ``None`` (no bound) while none starves or the limit is not a resolved
    integer. A round decides it and stores it (meta ``lease_share``, :func:`stored_share`)."""
    if not starving or type(limit) is not int:
        return None
    return max(1, limit // (live_leases + starving))


def stored_share(meta: Mapping[str, int]) -> int | None:
    """SPEC R31b: the last committed round's fair share (meta ``lease_share``; 0: no bound)."""
    return meta.get("lease_share", 0) or None


def above_share(leases: Iterable[LeaseRow], share: int | None) -> set[str]:
    """SPEC R31b: of one client's live reusable leases (those its message reports), the ones
    to retire so that what stays in each group holds at most ``share`` permits: the largest
    first (ties: the later issued, then the lower id), so the fewest leases end."""
    if share is None:
        return set()
    by_group: dict[str, list[LeaseRow]] = {}
    for lease in leases:
        if lease.status == "live" and lease.reusable and not lease.stopped:
            by_group.setdefault(lease.group_name, []).append(lease)
    out: set[str] = set()
    for group_leases in by_group.values():
        total = sum(x.permits for x in group_leases)
        for lease in sorted(group_leases, key=lambda x: (-x.permits, -x.issued_at, x.lease_id)):
            if total <= share:
                break
            out.add(lease.lease_id)
            total -= lease.permits
    return out


def _reported_leases(ledger: Ledger, client_id: str, reports: Iterable[LeaseReport]) -> list[LeaseRow]:
    """The client's own leases a message reports, each once, leaving out those it stops (a
    stop ends the lease anyway): one lookup per report, never a scan (R31b)."""
    ids = {r.lease_id for r in reports if not r.stopped}
    rows = (ledger.leases.get(lease_id) for lease_id in sorted(ids))
    return [x for x in rows if x is not None and x.client_id == client_id]


def _apply_reports(ledger: Ledger, client_id: str, messages: Sequence[Message], now: int,
                   policy: Policy, extend_reusable: bool, share: int | None = None) -> View:
    """Apply every grant and lease report of a client's messages, in order (SPEC R13, R14,
    R30-R32; a report extends a reusable lease only if ``extend_reusable``: no request waited
    unserved in the last round, R31a; a reusable lease above ``share`` is retired, R31b), and
    return what the client is told about them."""
    view = View()
    for message in messages:
        _apply_grant_reports(ledger, client_id, message.grants, view)
        reports = message.leases or ()
        trim = above_share(_reported_leases(ledger, client_id, reports), share)
        _apply_lease_reports(ledger, client_id, reports, view, now, policy.ttl_ms, extend_reusable, trim)
    return view


def _apply_grant_reports(ledger: Ledger, client_id: str, reports: Iterable[GrantReport], view: View) -> None:
    """SPEC R13: a grant report raises ``claimed`` (clamped to ``permits``) and ``released``
    (clamped to ``claimed``) as high-water marks; a grant unknown or another client's is
    answered ``not_found`` (R14, R15); a fully released grant is settled and deleted (R17)."""
    for r in reports:
        g = ledger.grants.get(r.grant_id)
        if g is None or g.client_id != client_id:  # SPEC R14, R15
            view.grants[r.grant_id] = grant_state(r.grant_id, None, 0, 0, 0, None, GrantStatus.NOT_FOUND.value)
            continue
        claimed, released = raise_counts(g.claimed, g.released, r.claimed, r.released, g.permits)
        if claimed != g.claimed or released != g.released:
            g.claimed, g.released = claimed, released
            ledger.put_grant(g)
        view.grants[r.grant_id] = _grant_wire(g)
        if g.released >= g.permits:  # SPEC R17: settled
            ledger.delete_grant(g)


def _unknown_lease(r: LeaseReport, view: View) -> None:
    """SPEC R32: a lease the holder does not know (or another client's) is answered ``retired``
    (``settled`` if stopped with ``released == drawn``); nothing is stored, and its
    ``drawn - released`` is kept for the round's charge. Several reports of one such lease in a
    round merge as high-water marks (R13: ``drawn`` and ``released`` only rise, ``stopped``
    stays), so the answer and the charge do not depend on the order they arrived in."""
    drawn, released, stopped = r.drawn, r.released, r.stopped
    seen = view.unknown_reports.get(r.lease_id)
    if seen is not None:
        drawn, released = raise_counts(seen[0], seen[1], drawn, released, max(seen[0], drawn))
        stopped = stopped or seen[2]
    view.unknown_reports[r.lease_id] = (drawn, released, stopped)
    status = LeaseStatus.SETTLED if stopped and released == drawn else LeaseStatus.RETIRED
    view.leases[r.lease_id] = lease_state(r.lease_id, None, drawn, drawn, released, None, status.value)


def _apply_lease_reports(ledger: Ledger, client_id: str, reports: Iterable[LeaseReport], view: View,
                         now: int, ttl_ms: int, extend_reusable: bool, trim: Set[str] = frozenset()) -> None:
    """SPEC R30-R32: a lease report raises ``drawn`` (clamped to ``permits``, or unbounded for a
    reusable lease, R34a; final once stopped, R30) and ``released`` (clamped to ``drawn``),
    heartbeats a live lease (R31; a reusable one only if ``extend_reusable``, R31a), retires
    the live leases in ``trim`` (above the fair share, R31b) and settles a stopped, fully
    released one (R30)."""
    for r in reports:
        lease = ledger.leases.get(r.lease_id)
        if lease is None or lease.client_id != client_id:  # SPEC R32
            _unknown_lease(r, view)
            continue
        # R30: after the stop, drawn is final (the cap is what the holder already has).
        cap = lease.drawn if lease.stopped else (MAX_INT if lease.reusable else lease.permits)
        lease.drawn, lease.released = raise_counts(lease.drawn, lease.released, r.drawn, r.released, cap)
        if lease.status == "live" and (extend_reusable or not lease.reusable):
            lease.expires_at = now + ttl_ms
        if lease.lease_id in trim and lease.status == "live":
            lease.status = "retired"  # SPEC R31b: above the fair share while requests starve
        if r.stopped:
            lease.stopped = True
            lease.status = "retired"
        ledger.put_lease(lease)
        if lease.stopped and lease.released >= lease.drawn:  # SPEC R30: settled
            view.leases[r.lease_id] = _lease_wire(lease, LeaseStatus.SETTLED)
            ledger.delete_lease(lease)
        else:
            view.leases[r.lease_id] = _lease_wire(lease)


# ====================================================================== allocation
def _usage(ledger: Ledger, views: Mapping[str, View], limits: Limits, policy: Policy,
           demand_groups: set[str]) -> Usage:
    """SPEC R19: charged capacity before allocation, in total and per demanded group (grants'
    ``permits - released`` plus lease footprint), with the round's transient R32 charge for
    reports of unknown leases issued before a storage reset added to the lease footprint."""
    totals = ledger.totals()
    per_group = ledger.group_usage(demand_groups)
    limit = limits.limit
    unknown = unknown_lease_charge({c: v.unknown_footprints() for c, v in views.items()}, ledger.meta(),
                                   policy.app_secret, policy.leases,
                                   ceiling(limit, policy.leases) if isinstance(limit, int) and policy.leases else None)
    return Usage(
        grants=totals["outstanding"],
        leases=totals["lease_footprint"] + unknown,
        groups={g: u["outstanding"] + u["lease_footprint"] for g, u in per_group.items()},
    )


def _entries(ledger: Ledger, clients: Sequence[Pending], permitted: Mapping[tuple[str, str], bool]) -> list[Entry]:
    """One :class:`Entry` per ``(client, group)`` of the round's latest demands (R10): its
    need is the count minus unclaimed grant permits and undrawn live-lease permits the
    client holds in the group (SPEC R20); its lease candidacy is
    :func:`~semaphore.core.allocation.lease_candidate` (R26); ``permitted`` is the round's
    ``canGrant`` answer (SPEC R22)."""
    held_unclaimed: dict[tuple[str, str], int] = {}  # R20
    for g in ledger.grants.values():
        if g.claimed < g.permits:
            key = (g.client_id, g.group_name)
            held_unclaimed[key] = held_unclaimed.get(key, 0) + g.unclaimed
    undrawn: dict[tuple[str, str], int] = {}
    for lease in ledger.leases.values():
        if lease.status == "live":
            key = (lease.client_id, lease.group_name)
            undrawn[key] = undrawn.get(key, 0) + lease.undrawn
    entries = []
    for p in clients:
        latest = p.latest
        for d in latest.demand:
            key = (p.client_id, d.group)
            need = max(0, d.count - held_unclaimed.get(key, 0) - undrawn.get(key, 0))
            # Entry(client_id, group, count, oldest_at, arrival, need, permitted, lease_candidate)
            entries.append(Entry(
                p.client_id, d.group, d.count, d.oldest_at, p.arrival, need,
                permitted.get(key, True),
                lease_candidate(latest.leases is not None, d.count, undrawn.get(key, 0)),
            ))
    return entries


def _issue(ledger: Ledger, views: dict[str, View], result: Allocation, now: int, policy: Policy) -> None:
    """The round's new grants (R15 deadline) and leases (R32 verifiable ids, R31 ``expiresAt``),
    each put first in its client's view."""
    for (client_id, group), permits in result.grants.items():
        row = GrantRow(policy.new_id(), client_id, group, permits, 0, 0, now, now + policy.grant_timeout_ms, False)
        ledger.put_grant(row)
        views[client_id].grants = {row.grant_id: _grant_wire(row), **views[client_id].grants}
    if not result.leases:
        return
    assert policy.leases is not None
    secret, epoch, writes = issuing_key(ledger.meta(), policy.app_secret, policy.new_secret)
    for k, v in writes.items():
        ledger.set_meta(k, v)
    _mark_reusable_schema(ledger, policy.leases)
    for (client_id, group), permits in result.leases.items():
        lease_id = new_lease_id(policy.new_id(), (secret, epoch), client_id, permits, policy.leases.reusable)
        lease = LeaseRow(lease_id, client_id, group, permits, 0, 0, False, "live", now, now + policy.leases.ttl_ms,
                         policy.leases.reusable)
        ledger.put_lease(lease)
        views[client_id].leases = {lease.lease_id: _lease_wire(lease), **views[client_id].leases}


def _mark_reusable_schema(ledger: Ledger, leases: LeaseConfig) -> None:
    """SPEC R34a: a release before reusable leases would read them as one-shot and charge too
    little; from the first one stored, it refuses this storage (a newer schema version)."""
    if leases.reusable and ledger.meta().get("schema_version", 1) < REUSABLE_SCHEMA:
        ledger.set_meta("schema_version", REUSABLE_SCHEMA)


def _starving(ledger: Ledger, result: Allocation, policy: Policy) -> tuple[int, int]:
    """SPEC R31a: the round's entries left with need that it served nothing and that hold no
    live lease in their group (a client drawing from a lease is served, if not in full), blocked
    by capacity leases may hold: ``limit``, or ``group_limit`` where lease footprint counts
    against group limits (``withinGroupLimit``). Not an entry ``can_grant`` refuses, whose limit
    failed to resolve, or whose group limit no lease shares: no lease's end would serve it.
    Second, how many of them the account's limit blocked (``limit``): those R31b's fair share
    is for (a lease in another group ending would not serve an entry its own group limit
    blocks)."""
    if not result.blocked:  # the common uncontended round: no scan of its leases
        return 0, 0
    capacity = {BlockedReason.LIMIT}
    if not _exclude_limited(policy):
        capacity.add(BlockedReason.GROUP_LIMIT)
    leased = {(x.client_id, x.group_name) for x in ledger.leases.values() if x.status == "live"}
    served = set(result.grants) | set(result.leases)
    starving = [reason for c, g, reason, _w in result.blocked
                if reason in capacity and (c, g) not in served and (c, g) not in leased]
    return len(starving), sum(1 for reason in starving if reason is BlockedReason.LIMIT)


def _write_meta(ledger: Ledger, limit: Any, now: int, contended: bool, starving: int,
                share: int | None) -> None:
    """Meta ``last_limit`` (R33), ``last_round_at`` (R9), ``contended`` (R29), ``starving``
    (R31a) and ``lease_share`` (R31b, 0 for no bound; the last three only when they change),
    in the round's one meta upsert."""
    if isinstance(limit, int):
        ledger.set_meta("last_limit", limit)
    ledger.set_meta("last_round_at", now)
    if contended != bool(ledger.meta().get("contended", 0)):
        ledger.set_meta("contended", int(contended))
    if starving != ledger.meta().get("starving", 0):
        ledger.set_meta("starving", starving)
    if (share or 0) != ledger.meta().get("lease_share", 0):
        ledger.set_meta("lease_share", share or 0)


def decide_round(ledger: Ledger, now: int, clients: Sequence[Pending], limits: Limits,
                 policy: Policy, *, must_fit: bool = False) -> RoundOutcome:
    """One allocation round (SPEC §4-§7) over the ledger ``round_reads`` loaded: every change
    goes into ``ledger``; returns each client's reply, the round's ``contended`` flag and what
    the round did (:class:`RoundOutcome`)."""
    live_before = [lid for lid, x in ledger.leases.items() if x.status == "live"]
    views = _open(ledger, now, {p.client_id: p.messages for p in clients}, policy,
                  ledger.meta().get("starving", 0), stored_share(ledger.meta()))
    _retire_ineligible(ledger, limits, policy, [p.client_id for p in clients])
    usage = _usage(ledger, views, limits, policy, {d.group for p in clients for d in p.latest.demand})
    entries = _entries(ledger, clients, limits.permitted)
    result = allocate(entries, limit=limits.limit, group_limits=limits.group_limits, usage=usage,
                      leases=policy.leases)
    if must_fit and result.contended:  # R9a: declined before anything is issued (no lease-id secret)
        return RoundOutcome({}, True, unserved=True, declined=True)
    _issue(ledger, views, result, now, policy)
    starving, by_limit = _starving(ledger, result, policy)
    share = fair_share(limits.limit, ledger.totals()["live_leases"], by_limit)
    contended = result.contended or (policy.free_at_once and _left_full(ledger, limits))
    _write_meta(ledger, limits.limit, now, contended, starving, share)
    # R11: this round just began; a round leaving only "full" (R29 decision) does not stop the
    # next one running at once (R9a)
    next_at = next_request_at(policy.timing, now, last_round_at=now, contended=result.contended, round_at=None)
    replies = _round_replies(ledger, clients, views, result, next_at, contended)
    return _outcome(ledger, replies, result, limits, live_before, starving, share, contended)


def _left_full(ledger: Ledger, limits: Limits) -> bool:
    """SPEC R29 decision (free means now, R9a): the round's grants left no permit of an integer
    limit free (outstanding grant permits at or above it). Lease footprint does not count: a
    lease filling the rest of the limit is the usual state with leases, and a contended flag
    would stop every idle lease (R31)."""
    if type(limits.limit) is not int:
        return False
    return ledger.totals()["outstanding"] >= limits.limit


def _outcome(ledger: Ledger, replies: dict[str, dict[str, Any]], result: Allocation, limits: Limits,
             live_before: Iterable[str], starving: int, share: int | None, contended: bool) -> RoundOutcome:
    """The round's :class:`RoundOutcome`: its replies and what it did, from the allocation and
    the ledger (the leases live before it that are not any more, the totals after it)."""
    blocked: dict[str, int] = {}
    for _client, _group, reason, waiting in result.blocked:
        blocked[reason.value] = blocked.get(reason.value, 0) + waiting
    totals = ledger.totals()
    leases = ledger.leases
    retired = sum(1 for lid in live_before if lid not in leases or leases[lid].status != "live")
    return RoundOutcome(
        replies, contended, unserved=result.contended, requests=len(replies),
        admitted=sum(result.grants.values()), grants_issued=len(result.grants),
        leases_issued=len(result.leases), lease_permits_issued=sum(result.leases.values()),
        leases_retired=retired, blocked=blocked,
        charged=totals["outstanding"] + totals["lease_footprint"],
        limit=limits.limit if type(limits.limit) is int else None,
        served=frozenset(c for c, _ in result.grants) | frozenset(c for c, _ in result.leases),
        starving=starving, share=share,
    )


def decide_sync(ledger: Ledger, now: int, message: SyncMessage, policy: Policy, contended: bool,
                next_request_at: int, starving: int, limits: Limits | None = None,
                lowered: bool = False, *, share: int | None = None) -> dict[str, Any]:
    """SPEC R6: apply a sync's reports and answer at once, with the ``contended`` flag of the
    last committed round (R29) and ``nextRequestAt`` (R11); ``starving``: the last committed
    round's count (R31a), ``share`` its fair share (R31b: :attr:`RoundOutcome.share`). With
    ``limits`` (resolved by the holder for a sync that reports leases, R33a) the sync retires
    what R33 would at the next round: every live lease if the limit was ``lowered`` below the
    last round's (then meta ``last_limit`` follows), and the client's leases in groups R33
    makes ineligible or of pairs ``canGrant`` refuses."""
    views = _open(ledger, now, {message.client_id: [message]}, policy, starving, share)
    if limits is not None:
        _retire_ineligible(ledger, limits, policy, [message.client_id], lowered=lowered)
        if lowered:
            ledger.set_meta("last_limit", limits.limit)
    return _reply(_held_by_client(ledger), message.client_id, views[message.client_id], [], contended,
                  next_request_at)


# ====================================================================== replies (R8)
def _grant_wire(g: GrantRow) -> dict[str, Any]:
    return grant_state(g.grant_id, g.group_name, g.permits, g.claimed, g.released, g.claim_by,
                       "expired" if g.reclaimed else "active")


def _lease_wire(lease: LeaseRow, status: LeaseStatus | None = None) -> dict[str, Any]:
    if status is None:
        status = LeaseStatus.LIVE if lease.status == "live" else LeaseStatus.RETIRED
    return lease_state(lease.lease_id, lease.group_name, lease.permits, lease.drawn, lease.released,
                       lease.expires_at, status.value, lease.reusable)


def _held_by_client(ledger: Ledger) -> dict[str, tuple[list[GrantRow], list[LeaseRow]]]:
    held: dict[str, tuple[list[GrantRow], list[LeaseRow]]] = {}
    for g in ledger.grants.values():
        held.setdefault(g.client_id, ([], []))[0].append(g)
    for lease in ledger.leases.values():
        held.setdefault(lease.client_id, ([], []))[1].append(lease)
    return held


def _reply(held: Mapping[str, tuple[list[GrantRow], list[LeaseRow]]], client_id: str, view: View,
           blocked: list[dict[str, Any]], contended: bool, next_request_at: int) -> dict[str, Any]:
    """SPEC R8: new and reported grants and leases, plus every other grant and live or retired
    lease of the client (so a lost reply heals at the next request)."""
    own_grants, own_leases = held.get(client_id, ([], []))
    grants = dict(view.grants)
    for g in own_grants:
        if g.grant_id not in grants:
            grants[g.grant_id] = _grant_wire(g)
    leases = dict(view.leases)
    for lease in own_leases:
        # Also re-render reported leases: the round may have retired them after their report
        # was applied (R33), and the client must stop drawing at once.
        if lease.lease_id not in leases or leases[lease.lease_id]["status"] != LeaseStatus.SETTLED.value:
            leases[lease.lease_id] = _lease_wire(lease)
    return permit_response(list(grants.values()), list(leases.values()), blocked, contended, next_request_at)


def _round_replies(ledger: Ledger, clients: Sequence[Pending], views: Mapping[str, View], result: Allocation,
                   next_at: int, contended: bool) -> dict[str, dict[str, Any]]:
    """Each client's reply to the round (SPEC R8): its grants and leases, its ``blocked``
    entries (R23), the round's ``contended`` flag (R29) and ``nextRequestAt`` (R11: one period
    after this round)."""
    blocked: dict[str, list[dict[str, Any]]] = {}
    for client_id, group, reason, waiting in result.blocked:
        blocked.setdefault(client_id, []).append(blocked_entry(group, reason.value, waiting))
    held = _held_by_client(ledger)
    return {p.client_id: _reply(held, p.client_id, views[p.client_id], blocked.get(p.client_id, []),
                                contended, next_at) for p in clients}
