"""What ``usage()`` reports (SPEC R38): charged and available capacity, and its typed view.

Pure: the holder reads its aggregate rows (never the grant or lease tables) and resolves the
limits; :func:`measure` turns them into a :class:`SemaphoreUsage`, whose :meth:`~SemaphoreUsage.
to_wire` is the dict ``DurabilitySemaphore.usage()`` returns (camelCase keys, like the wire).

Definitions (docs/reference/holder.md explains them for users):

* ``charged`` = ``outstanding + leaseFootprint``: grant permits not yet released (``permits -
  released``, claimed or not) plus the footprint of live and retired leases (SPEC R19, R30), in
  total and per group.
* ``available`` = what one new grant request could be granted now: the grant room of the
  provisioning mode (SPEC R25, :func:`grant_room`) under the limit, and per group also under the
  group's limit (a group's lease footprint always counts against it, SPEC R27). Never below 0
  (a lowered limit leaves charged above it, R24); ``None`` when the limit, or the group's, could
  not be resolved (a round would admit nothing there: ``limit_resolution_error``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .allocation import LIMIT_ERROR, grant_ceiling
from .config import LeaseConfig, Provisioning

__all__ = ["GroupUsage", "SemaphoreUsage", "grant_room", "group_available", "measure"]


def grant_room(limit: int, outstanding: int, lease_footprint: int, leases: LeaseConfig | None) -> int:
    """Permits one new grant request could get under ``limit`` now (SPEC R25), never below 0.

    * no leases or ``strict``: ``limit - outstanding - leaseFootprint``;
    * ``under``: that, and at most ``ceiling - outstanding`` with ``ceiling = max(limit - reserve,
      1 if limit >= 1 else 0)`` (the reserve is kept for leases);
    * ``over``: ``limit - outstanding - max(0, leaseFootprint - extra)`` (leases live in their own
      budget of ``extra`` above the limit; only what overflows it takes grant room).

    The same room a round's allocation serves grants from (:func:`~semaphore.core.allocation.
    allocate`), before that round's reports, reclaims and unknown-lease charge (R32)."""
    if leases is not None and leases.mode is Provisioning.OVER:
        room = limit - outstanding - max(0, lease_footprint - leases.extra(limit))
    else:
        room = min(limit - outstanding - lease_footprint, grant_ceiling(limit, leases) - outstanding)
    return max(0, room)


def group_available(top: int | None, group_limit: Any, charged: int) -> int | None:
    """A group's ``available``: ``min(top, max(0, group_limit - charged))`` when the group has a
    limit, ``top`` when it has none (``group_limit`` ``None``), ``None`` when ``top`` is ``None``
    or the group's limit could not be resolved (``LIMIT_ERROR``, SPEC R12)."""
    if top is None or group_limit is LIMIT_ERROR:
        return None
    if group_limit is None:
        return top
    return min(top, max(0, int(group_limit) - charged))


def _int(d: Mapping[str, Any], key: str) -> int:
    value = d.get(key)
    return 0 if value is None else int(value)


def _opt(d: Mapping[str, Any], key: str) -> int | None:
    value = d.get(key)
    return None if value is None else int(value)


@dataclass(frozen=True)
class GroupUsage:
    """One group's usage (SPEC R38), the typed view of an entry of ``usage()["groups"]``.

    :ivar outstanding: grant permits not yet released (``permits - released``) in the group.
    :ivar lease_footprint: footprint of the group's live and retired leases (SPEC R30).
    :ivar live_leases: live leases in the group.
    :ivar retired_leases: retired leases not yet settled in the group.
    :ivar limit: the group's limit; ``None`` when it has none or it could not be resolved.
    :ivar charged: ``outstanding + lease_footprint`` (SPEC R19).
    :ivar available: what a new grant request in the group could get now (see the module
        docstring): at most the top-level ``available``; ``None`` when the limit or the group's
        limit could not be resolved.
    """

    outstanding: int = 0
    lease_footprint: int = 0
    live_leases: int = 0
    retired_leases: int = 0
    limit: int | None = None
    charged: int = 0
    available: int | None = None

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict ``usage()`` returns for the group."""
        return {"outstanding": self.outstanding, "leaseFootprint": self.lease_footprint,
                "liveLeases": self.live_leases, "retiredLeases": self.retired_leases,
                "limit": self.limit, "charged": self.charged, "available": self.available}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> GroupUsage:
        """Read a group entry of ``usage()`` (unknown keys ignored). Without ``charged`` (a
        holder of an earlier release) it is derived; without ``available`` it is ``None``."""
        outstanding, footprint = _int(d, "outstanding"), _int(d, "leaseFootprint")
        charged = _opt(d, "charged")
        return cls(outstanding, footprint, _int(d, "liveLeases"), _int(d, "retiredLeases"),
                   _opt(d, "limit"), outstanding + footprint if charged is None else charged,
                   _opt(d, "available"))


@dataclass(frozen=True)
class SemaphoreUsage:
    """The holder's usage (SPEC R38), the typed view of ``DurabilitySemaphore.usage()``:
    ``SemaphoreUsage.from_wire(await sem.usage())``.

    It is what the holder knows as of its last committed round, sync or reclaim: an upper bound
    of what is really running, which may lag (see docs/reference/holder.md, "Why usage may lag").

    :ivar limit: the limit; ``None`` when it could not be resolved (SPEC R12).
    :ivar outstanding: grant permits not yet released (``permits - released``, claimed or not).
    :ivar lease_footprint: footprint of live and retired leases (SPEC R30).
    :ivar live_leases: live leases.
    :ivar retired_leases: retired leases not yet settled.
    :ivar charged: ``outstanding + lease_footprint`` (SPEC R19); above ``limit`` under ``over``
        provisioning (up to ``limit + extra``) or after the limit was lowered (R24).
    :ivar available: what one new grant request could get now (:func:`grant_room`); ``None``
        when ``limit`` is ``None``.
    :ivar groups: every group with something charged or a lease, by name (a group not listed
        has nothing charged).
    """

    limit: int | None = None
    outstanding: int = 0
    lease_footprint: int = 0
    live_leases: int = 0
    retired_leases: int = 0
    charged: int = 0
    available: int | None = None
    groups: Mapping[str, GroupUsage] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict ``DurabilitySemaphore.usage()`` returns."""
        return {"limit": self.limit, "outstanding": self.outstanding, "leaseFootprint": self.lease_footprint,
                "liveLeases": self.live_leases, "retiredLeases": self.retired_leases,
                "charged": self.charged, "available": self.available,
                "groups": {name: g.to_wire() for name, g in self.groups.items()}}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> SemaphoreUsage:
        """Read the dict ``usage()`` returns. Unknown keys (e.g. the reference Worker's
        ``defaultLimit``) are ignored; without ``charged`` (a holder of an earlier release) it
        is derived, without ``available`` it is ``None``."""
        outstanding, footprint = _int(d, "outstanding"), _int(d, "leaseFootprint")
        charged = _opt(d, "charged")
        groups = d.get("groups") or {}
        return cls(_opt(d, "limit"), outstanding, footprint, _int(d, "liveLeases"), _int(d, "retiredLeases"),
                   outstanding + footprint if charged is None else charged, _opt(d, "available"),
                   {str(name): GroupUsage.from_wire(g) for name, g in groups.items()})

    @classmethod
    def empty(cls, limit: int | None, leases: LeaseConfig | None = None) -> SemaphoreUsage:
        """The usage of a holder with nothing charged under ``limit`` (``None``: unresolved), e.g.
        one whose tables do not exist yet."""
        return measure(LIMIT_ERROR if limit is None else limit, {}, {}, leases)


def measure(limit: Any, totals: Mapping[str, int], groups: Mapping[str, tuple[Mapping[str, Any], Any]],
            leases: LeaseConfig | None) -> SemaphoreUsage:
    """SPEC R38: the usage from the aggregates.

    :param limit: the resolved limit, an ``int`` or ``LIMIT_ERROR``.
    :param totals: the total aggregates (``outstanding``, ``lease_footprint``, ``live_leases``,
        ``retired_leases``; missing ones are 0), e.g. the meta rows.
    :param groups: per group, its aggregate row (same names) and its resolved limit (``int``,
        ``None`` for none, or ``LIMIT_ERROR``).
    :param leases: the holder's lease configuration (the provisioning mode decides the room)."""
    outstanding, footprint = int(totals.get("outstanding", 0)), int(totals.get("lease_footprint", 0))
    top_limit = limit if isinstance(limit, int) else None
    top = None if top_limit is None else grant_room(top_limit, outstanding, footprint, leases)
    per_group: dict[str, GroupUsage] = {}
    for name, (row, group_limit) in groups.items():
        g_out, g_fp = int(row.get("outstanding", 0)), int(row.get("lease_footprint", 0))
        per_group[name] = GroupUsage(
            g_out, g_fp, int(row.get("live_leases", 0)), int(row.get("retired_leases", 0)),
            group_limit if isinstance(group_limit, int) else None, g_out + g_fp,
            group_available(top, group_limit, g_out + g_fp))
    return SemaphoreUsage(top_limit, outstanding, footprint, int(totals.get("live_leases", 0)),
                          int(totals.get("retired_leases", 0)), outstanding + footprint, top, per_group)
