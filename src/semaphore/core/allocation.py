"""The pure allocation of one round (SPEC §6 and the issuance part of §7).

No storage, no clock, no callbacks: usage, limits and demand entries in; grants, leases and
blocked reasons out. The holder resolves limits and reads usage, calls :func:`allocate`, and
writes what it returns, all inside the round's transaction.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from operator import attrgetter

from .config import LeaseConfig, LimitedGroups, Provisioning
from .wire import BlockedReason

__all__ = ["LIMIT_ERROR", "lease_candidate", "Entry", "Usage", "Allocation", "allocate", "grant_ceiling", "ceiling"]


class _LimitError:
    """Marker for a limit whose resolution raised (or returned an invalid value)."""

    def __repr__(self) -> str:
        return "LIMIT_ERROR"


#: Stands for a limit or group limit that could not be resolved this round (SPEC R12).
LIMIT_ERROR = _LimitError()

Key = tuple[str, str]  # (client_id, group)


def lease_candidate(reports_leases: bool, count: int, undrawn: int) -> bool:
    """SPEC R26: a ``(client, group)`` entry is a lease candidate if its client reports leases
    (R5), its count is above zero and it holds no live lease with undrawn permits in the group.
    (Whether its group may have leases at all is R27, decided by :func:`allocate`.)"""
    return reports_leases and count > 0 and undrawn == 0


@dataclass(slots=True)
class Entry:
    """One ``(client, group)`` demand of the round.

    :ivar need: demand count minus unclaimed grant permits minus undrawn live-lease permits the
        client already holds in the group, never below zero (SPEC R20).
    :ivar arrival: arrival order of the client's request in this round (tie-break, SPEC R21).
    :ivar permitted: ``canGrant(client, group)`` (SPEC R22).
    :ivar lease_candidate: :func:`lease_candidate` (SPEC R26). Eligibility by group limits
        (R27) and ``canGrant`` (R22) is decided by :func:`allocate`.
    """

    client_id: str
    group: str
    count: int
    oldest_at: int
    arrival: int
    need: int
    permitted: bool = True
    lease_candidate: bool = False

    @property
    def key(self) -> Key:
        """``(client_id, group)``."""
        return (self.client_id, self.group)


@dataclass
class Usage:
    """Charged capacity before allocation (SPEC R19).

    :ivar grants: total ``permits - released`` over all grants (after reclaim).
    :ivar leases: total lease footprint (SPEC R30), including this round's charge for reports of
        unknown leases (SPEC R32; the holder charges only reports whose lease id verifies for
        the reporting client and was issued before a storage reset, at most the id's permits,
        ``permitsPerLease`` per client and the :func:`ceiling` in total, and nothing when
        leases are not configured).
    :ivar groups: per group, grants plus lease footprint charged against it.
    """

    grants: int = 0
    leases: int = 0
    groups: dict[str, int] = field(default_factory=dict)


@dataclass
class Allocation:
    """What :func:`allocate` decided for one round.

    :ivar grants: permits of the new grant per ``(client_id, group)`` (SPEC R21).
    :ivar leases: permits of the new lease per ``(client_id, group)`` (SPEC R26-R28).
    :ivar blocked: ``(client_id, group, reason, waiting)`` of every entry left with need (SPEC R23).
    """

    grants: dict[Key, int] = field(default_factory=dict)
    leases: dict[Key, int] = field(default_factory=dict)
    blocked: list[tuple[str, str, BlockedReason, int]] = field(default_factory=list)

    @property
    def contended(self) -> bool:
        """SPEC R29: some need was left unserved."""
        return bool(self.blocked)


def grant_ceiling(limit: int, config: LeaseConfig | None) -> int:
    """Most grant charge the mode allows: ``limit``, or ``limit - reserve`` under ``under``,
    keeping at least one permit for grants when ``limit >= 1`` (SPEC R25)."""
    if config is not None and config.mode is Provisioning.UNDER:
        return max(limit - config.reserve, 1 if limit >= 1 else 0)
    return limit


def ceiling(limit: int, config: LeaseConfig | None) -> int:
    """Most total charge the mode admits up to: ``limit``, or ``limit + extra`` under ``over``
    (SPEC R25, I1). Also bounds a round's charge for reports of unknown leases (SPEC R32)."""
    if config is not None and config.mode is Provisioning.OVER:
        return limit + config.extra(limit)
    return limit


def _grant_room(limit: int, usage: Usage, config: LeaseConfig | None) -> int:
    if config is not None and config.mode is Provisioning.OVER:
        # Leases live in their own budget of `extra`; only what overflows it eats the limit.
        overflow = max(0, usage.leases - config.extra(limit))
        return limit - usage.grants - overflow
    room = limit - usage.grants - usage.leases
    return min(room, grant_ceiling(limit, config) - usage.grants)


def _lease_room(limit: int, granted: int, usage: Usage, config: LeaseConfig) -> int:
    charged = usage.grants + granted + usage.leases
    if config.mode is Provisioning.OVER:
        extra = config.extra(limit)
        return min(extra - usage.leases, limit + extra - charged)
    return limit - charged


#: SPEC R21: entries are served oldest demand first, ``(oldest_at, arrival, client_id)``: ties go
#: to the request that arrived first in the round (R10), then by client id (evaluated in C).
_ORDER = attrgetter("oldest_at", "arrival", "client_id")


def allocate(
    entries: list[Entry],
    *,
    limit: int | _LimitError,
    group_limits: Mapping[str, int | None | _LimitError],
    usage: Usage,
    leases: LeaseConfig | None = None,
) -> Allocation:
    """Allocate one round.

    Entries are served oldest first (``oldest_at``, then arrival, then client id); each gets
    ``min(need, room under limit, room under its group limit)`` as one grant (SPEC R21). Leases
    are then issued from what the provisioning mode leaves (SPEC R25-R28), or first with
    ``leaseFirst`` (R28a, :func:`_lease_first`). Every entry left with need is reported with the
    first constraint that stopped it (SPEC R23).

    Room is what the round's current limits leave above the charged ``usage`` (I1): confirmed
    claims stay charged until released and nothing here takes back a grant or a lease (R18), so
    a lowered limit only stops new admissions until usage falls below it (R24)."""
    result = Allocation()
    ordered = sorted(entries, key=_ORDER)
    group_charged = dict(usage.groups)
    if leases is not None and leases.lease_first and not isinstance(limit, _LimitError):
        _lease_first(ordered, limit, usage, leases, group_limits, group_charged, result)
        return result
    room = 0 if isinstance(limit, _LimitError) else max(0, _grant_room(limit, usage, leases))
    left, reasons, granted_total = _serve_grants(
        ordered, room, isinstance(limit, _LimitError), group_limits, group_charged, result)
    if leases is not None and not isinstance(limit, _LimitError):
        _issue_leases(ordered, limit, granted_total, usage, leases, group_limits, group_charged, result)
        for key, permits in result.leases.items():
            if key in left:
                left[key] = max(0, left[key] - permits)
    _report_blocked(ordered, left, reasons, result)
    return result


def _serve_grants(
    ordered: list[Entry],
    room: int,
    limit_failed: bool,
    group_limits: Mapping[str, int | None | _LimitError],
    group_charged: dict[str, int],
    result: Allocation,
) -> tuple[dict[Key, int], dict[Key, BlockedReason], int]:
    """SPEC R21-R23: serve ``ordered`` (oldest first) from ``room``, each entry by
    :func:`_grant_one`. Returns what each entry left with need still needs, its reason, and the
    permits granted."""
    granted_total = 0
    reasons: dict[Key, BlockedReason] = {}
    left: dict[Key, int] = {}
    for e in ordered:
        give = _grant_one(e, room, limit_failed, group_limits, group_charged, result, left, reasons)
        room -= give
        granted_total += give
    return left, reasons, granted_total


def _grant_one(
    e: Entry,
    room: int,
    limit_failed: bool,
    group_limits: Mapping[str, int | None | _LimitError],
    group_charged: dict[str, int],
    result: Allocation,
    left: dict[Key, int],
    reasons: dict[Key, BlockedReason],
) -> int:
    """SPEC R21-R23: an entry with need gets ``min(need, room, room under its group limit)`` as
    one grant in ``result.grants`` (``group_charged`` grows by it); returns the permits given.
    Left with need, it goes in ``left`` with the first constraint that stopped it:
    ``not_permitted`` (R22), ``limit_resolution_error`` (R12), then whichever of its group's
    room and the account's ``room`` ran out first: ``group_limit`` when the group's room is no
    more than the account's (so a group that is full reports ``group_limit``), else ``limit``
    (a group with room for 2 under an account with room for 0 was stopped by the limit)."""
    if e.need <= 0:
        return 0
    key = e.key
    gl = group_limits.get(e.group)
    if not e.permitted:
        reasons[key], left[key] = BlockedReason.NOT_PERMITTED, e.need
        return 0
    if limit_failed or isinstance(gl, _LimitError):
        reasons[key], left[key] = BlockedReason.LIMIT_RESOLUTION_ERROR, e.need
        return 0
    g_room = None if gl is None else max(0, gl - group_charged.get(e.group, 0))
    give = min(e.need, room) if g_room is None else min(e.need, room, g_room)
    if give > 0:
        result.grants[key] = result.grants.get(key, 0) + give
        group_charged[e.group] = group_charged.get(e.group, 0) + give
    if give < e.need:
        left[key] = e.need - give
        reasons[key] = BlockedReason.GROUP_LIMIT if g_room is not None and g_room <= room else BlockedReason.LIMIT
    return give


def _report_blocked(
    ordered: list[Entry], left: dict[Key, int], reasons: dict[Key, BlockedReason], result: Allocation
) -> None:
    """SPEC R23: every entry still waiting once grants and leases are issued is reported in
    ``result.blocked`` (in service order) with its reason and how many permits it waits for."""
    for e in ordered:
        waiting = left.get(e.key, 0)
        if waiting > 0:
            result.blocked.append((e.client_id, e.group, reasons[e.key], waiting))


def _lease_eligible(e: Entry, config: LeaseConfig, group_limits: Mapping[str, int | None | _LimitError]) -> bool:
    """Whether an entry may take a lease this round: a candidate (R26) that ``canGrant``
    permits (R22) in a group whose limit resolved and admits leases (R27)."""
    if not (e.lease_candidate and e.permitted):
        return False
    gl = group_limits.get(e.group)
    if isinstance(gl, _LimitError):
        return False
    return gl is None or config.limited_groups is LimitedGroups.WITHIN_GROUP_LIMIT


def _lease_plan(candidates: list[Entry], budget: int, config: LeaseConfig) -> dict[Key, int]:
    """SPEC R28: each candidate's share of the lease ``budget`` (in ``oldestAt`` order):
    ``min(permitsPerLease, floor(budget / candidates))``, or one each for the oldest ``budget``
    candidates when that is zero."""
    if not candidates or budget <= 0:
        return {}
    share = min(config.permits_per_lease, budget // len(candidates))
    if share == 0:  # fewer permits than candidates: the oldest get one each (SPEC R28)
        return {e.key: 1 for e in candidates[:budget]}
    return {e.key: share for e in candidates}


def _issue_lease(e: Entry, permits: int, group_limits: Mapping[str, int | None | _LimitError],
                 group_charged: dict[str, int], result: Allocation) -> int:
    """Issue ``e`` a lease of ``permits``, at most its group's room where lease footprint counts
    against the group limit (``withinGroupLimit``, R27); returns the permits issued."""
    gl = group_limits.get(e.group)
    if isinstance(gl, int):
        permits = min(permits, max(0, gl - group_charged.get(e.group, 0)))
    if permits <= 0:
        return 0
    result.leases[e.key] = permits
    group_charged[e.group] = group_charged.get(e.group, 0) + permits
    return permits


def _issue_leases(
    ordered: list[Entry],
    limit: int,
    granted_total: int,
    usage: Usage,
    config: LeaseConfig,
    group_limits: Mapping[str, int | None | _LimitError],
    group_charged: dict[str, int],
    result: Allocation,
) -> None:
    """SPEC R26-R28: the round's new leases in ``result.leases`` from the budget the mode leaves
    once the round's grants are served."""
    candidates = [e for e in ordered if _lease_eligible(e, config, group_limits)]
    plan = _lease_plan(candidates, max(0, _lease_room(limit, granted_total, usage, config)), config)
    for e in candidates:
        if e.key in plan:
            _issue_lease(e, plan[e.key], group_limits, group_charged, result)


def _lease_first(
    ordered: list[Entry],
    limit: int,
    usage: Usage,
    config: LeaseConfig,
    group_limits: Mapping[str, int | None | _LimitError],
    group_charged: dict[str, int],
    result: Allocation,
) -> None:
    """SPEC R28a: leases sized before grants, each its R28 share of the lease room computed
    without the round's grants and at most its need, but a lease takes only what older entries
    leave: walking the entries oldest first up to the last planned lease, an entry with need that
    cannot take a lease (R5, R22, R26, R27) is served its grant (R21) at its turn, and each
    planned lease is at most the lease room left at its turn. The entries' remaining need is then
    served by grants, oldest first, from what is left; every entry left with need is reported
    (R23)."""
    candidates = [e for e in ordered if e.need > 0 and _lease_eligible(e, config, group_limits)]
    plan = _lease_plan(candidates, max(0, _lease_room(limit, 0, usage, config)), config)
    left: dict[Key, int] = {}
    reasons: dict[Key, BlockedReason] = {}
    served_early: set[Key] = set()
    granted = leased = 0
    to_plan = len(plan)
    for e in ordered:
        if not to_plan:
            break
        now = Usage(grants=usage.grants + granted, leases=usage.leases + leased)
        if e.key in plan:
            to_plan -= 1
            room = max(0, _lease_room(limit, 0, now, config))
            leased += _issue_lease(e, min(plan[e.key], e.need, room), group_limits, group_charged, result)
        elif e.need > 0 and not _lease_eligible(e, config, group_limits):
            served_early.add(e.key)
            room = max(0, _grant_room(limit, now, config))
            granted += _grant_one(e, room, False, group_limits, group_charged, result, left, reasons)
    rest = [replace(e, need=e.need - result.leases.get(e.key, 0)) if e.key in result.leases else e
            for e in ordered if e.key not in served_early]
    room = max(0, _grant_room(limit, Usage(grants=usage.grants + granted, leases=usage.leases + leased), config))
    more_left, more_reasons, _ = _serve_grants(rest, room, False, group_limits, group_charged, result)
    left.update(more_left)
    reasons.update(more_reasons)
    _report_blocked(ordered, left, reasons, result)
