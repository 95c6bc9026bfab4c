"""Lease configuration (SPEC §7): parsing and validation of the ``leases=`` option.

Both the reference's camelCase spelling and Pythonic snake_case are accepted::

    {"provisioning": {"mode": "strict"}, "permitsPerLease": 64, "ttlMs": 1_800_000,
     "limitedGroups": "exclude"}
    {"provisioning": {"mode": "under", "reserve": 20}, "permits_per_lease": 16}
    {"provisioning": {"mode": "over", "extra": {"ratio": 0.5}}, "ttl_ms": 600_000,
     "limited_groups": "withinGroupLimit"}
    {"provisioning": {"mode": "strict"}, "permitsPerLease": 8, "ttlMs": 60_000,
     "reusable": True, "leaseFirst": True}

or a :class:`LeaseConfig` built directly.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError

__all__ = ["Provisioning", "LimitedGroups", "LeaseConfig", "DEFAULT_LEASES", "holder_leases", "option_int"]


class Provisioning(str, enum.Enum):
    """Where lease capacity comes from (SPEC R25)."""

    STRICT = "strict"
    UNDER = "under"
    OVER = "over"


class LimitedGroups(str, enum.Enum):
    """Whether groups with their own limit get leases (SPEC R27)."""

    EXCLUDE = "exclude"
    WITHIN_GROUP_LIMIT = "withinGroupLimit"


@dataclass(frozen=True)
class LeaseConfig:
    """Validated lease options.

    :ivar mode: ``strict``, ``under`` or ``over``.
    :ivar reserve: ``under`` only: permits of ``limit`` kept for leases.
    :ivar extra_ratio: ``over`` only: extra budget is ``floor(limit * extra_ratio)``.
    :ivar extra_count: ``over`` only: extra budget is this many permits.
    :ivar permits_per_lease: most permits one lease carries (>= 1).
    :ivar ttl_ms: a lease unreported for this long is retired (>= 1).
    :ivar limited_groups: ``exclude`` or ``withinGroupLimit``.
    :ivar reusable: the leases issued hold reusable slots (SPEC R34a): while a lease is live, a
        released item's slot may be drawn again, so a lease of N permits runs up to N items at a
        time for as long as it lives, and its footprint stays N until the client stops it (R30a).
        A report extends such a lease only while no request waits unserved (R31a). Off by
        default: a drawn permit is one-shot (R34).
    :ivar lease_first: in a round, lease candidates are sized (R28, each at most its need) before
        grants are served, so a lease-capable client takes its share as a lease rather than as
        a grant (R28a). Off by default: grants first (R25).
    :ivar recheck_ms: a client draws a new item from a lease (a one-shot permit or a reused
        slot) only while the holder's last reply to it is younger than this; else it sends a
        ``sync`` first and draws only if the reply still shows the lease live (SPEC R33a). Told
        to clients in replies (``leaseRecheckMs``). It bounds how long a lowered limit or group
        limit takes to stop new admissions from leases, at one ``sync`` per drawing client and
        key per ``recheck_ms``. ``0``: no recheck (a lease is drawn until a reply says otherwise,
        at the latest at its heartbeat). Default 4000.
    """

    mode: Provisioning = Provisioning.STRICT
    reserve: int = 0
    extra_ratio: float | None = None
    extra_count: int | None = None
    permits_per_lease: int = 64
    ttl_ms: int = 1_800_000
    limited_groups: LimitedGroups = LimitedGroups.EXCLUDE
    reusable: bool = False
    lease_first: bool = False
    recheck_ms: int = 4000

    def __post_init__(self) -> None:
        # Built directly with plain strings ("over", "withinGroupLimit"), the enums must still be
        # honoured: the allocation compares them by identity.
        try:
            object.__setattr__(self, "mode", Provisioning(self.mode))
        except ValueError:
            raise ConfigurationError(
                f"leases.provisioning.mode: must be 'strict', 'under' or 'over', got {self.mode!r}",
                field="leases.provisioning.mode",
            ) from None
        try:
            object.__setattr__(self, "limited_groups", LimitedGroups(self.limited_groups))
        except ValueError:
            raise ConfigurationError(
                "leases.limitedGroups: must be 'exclude' or 'withinGroupLimit', "
                f"got {self.limited_groups!r}",
                field="leases.limitedGroups",
            ) from None
        option_int(self.permits_per_lease, "leases.permitsPerLease", 1)
        for name, flag in (("leases.reusable", self.reusable), ("leases.leaseFirst", self.lease_first)):
            if not isinstance(flag, bool):
                raise ConfigurationError(f"{name}: must be true or false, got {flag!r}", field=name)
        option_int(self.ttl_ms, "leases.ttlMs", 1)
        option_int(self.recheck_ms, "leases.recheckMs", 0)
        option_int(self.reserve, "leases.provisioning.reserve", 0)
        if self.mode is Provisioning.OVER:
            if (self.extra_ratio is None) == (self.extra_count is None):
                raise ConfigurationError(
                    "leases.provisioning.extra: give exactly one of {'ratio': r} or {'count': n}",
                    field="leases.provisioning.extra",
                )
            if self.extra_ratio is not None:
                r = self.extra_ratio
                if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
                    raise ConfigurationError(
                        f"leases.provisioning.extra.ratio: must be a finite number >= 0, got {r!r}",
                        field="leases.provisioning.extra.ratio",
                    )
            if self.extra_count is not None:
                option_int(self.extra_count, "leases.provisioning.extra.count", 0)
        if self.mode is not Provisioning.OVER and (self.extra_ratio is not None or self.extra_count is not None):
            raise ConfigurationError(
                "leases.provisioning.extra: only the 'over' mode takes an extra budget",
                field="leases.provisioning.extra",
            )
        if self.mode is not Provisioning.UNDER and self.reserve:
            raise ConfigurationError(
                "leases.provisioning.reserve: only the 'under' mode takes a reserve",
                field="leases.provisioning.reserve",
            )

    def extra(self, limit: int) -> int:
        """The ``over`` budget above ``limit`` (0 in other modes)."""
        if self.mode is not Provisioning.OVER:
            return 0
        if self.extra_count is not None:
            return self.extra_count
        return int(math.floor(limit * float(self.extra_ratio or 0)))

    @classmethod
    def parse(cls, value: LeaseConfig | Mapping[str, Any] | None) -> LeaseConfig | None:
        """Accept a :class:`LeaseConfig`, a camelCase or snake_case mapping, or ``None``."""
        if value is None or isinstance(value, LeaseConfig):
            return value
        if not isinstance(value, Mapping):
            raise ConfigurationError(
                f"leases: expected a mapping or LeaseConfig, got {type(value).__name__}",
                field="leases",
            )
        unknown = sorted(set(value) - _OPTIONS)
        if unknown:
            raise ConfigurationError(f"leases: unknown option(s) {unknown}", field="leases")
        kwargs = _parse_provisioning(value.get("provisioning", {"mode": "strict"}))
        for camel, snake in (("permitsPerLease", "permits_per_lease"), ("ttlMs", "ttl_ms"),
                             ("reusable", "reusable"), ("leaseFirst", "lease_first"),
                             ("recheckMs", "recheck_ms")):
            if camel == snake:
                if camel in value:
                    kwargs[snake] = value[camel]
                continue
            if camel in value and snake in value:
                raise ConfigurationError(f"leases: give {camel} or {snake}, not both", field=f"leases.{camel}")
            if camel in value or snake in value:
                kwargs[snake] = value.get(camel, value.get(snake))
        kwargs["limited_groups"] = _parse_limited_groups(value)
        return cls(**kwargs)


#: Every option of the ``leases=`` mapping, in both spellings.
_OPTIONS = {"provisioning", "permitsPerLease", "permits_per_lease", "ttlMs", "ttl_ms",
            "limitedGroups", "limited_groups", "reusable", "leaseFirst", "lease_first", "recheckMs",
            "recheck_ms"}


def _parse_provisioning(prov: Any) -> dict[str, Any]:
    """SPEC R25: the ``provisioning`` mapping as :class:`LeaseConfig` keyword arguments: a mode,
    the ``reserve`` that ``under`` requires (and only it takes), the ``extra`` (``{"ratio": r}``
    or ``{"count": n}``) that ``over`` requires (and only it takes). Values are validated by
    :class:`LeaseConfig` itself."""
    if not isinstance(prov, Mapping):
        raise ConfigurationError("leases.provisioning: expected a mapping like {'mode': 'strict'}",
                                 field="leases.provisioning")
    try:
        mode = Provisioning(prov.get("mode"))
    except ValueError:
        raise ConfigurationError(
            f"leases.provisioning.mode: must be 'strict', 'under' or 'over', got {prov.get('mode')!r}",
            field="leases.provisioning.mode",
        ) from None
    stray = sorted(set(prov) - {"mode", "reserve", "extra"})
    if stray:
        raise ConfigurationError(f"leases.provisioning: unknown option(s) {stray}",
                                 field="leases.provisioning")
    if "extra" in prov and mode is not Provisioning.OVER:
        raise ConfigurationError("leases.provisioning.extra: only the 'over' mode takes an extra budget",
                                 field="leases.provisioning.extra")
    kwargs: dict[str, Any] = {"mode": mode}
    if mode is Provisioning.UNDER:
        if "reserve" not in prov:
            raise ConfigurationError("leases.provisioning.reserve: required for mode 'under'",
                                     field="leases.provisioning.reserve")
        kwargs["reserve"] = prov["reserve"]
    elif "reserve" in prov:
        kwargs["reserve"] = prov["reserve"]
    if mode is Provisioning.OVER:
        extra = prov.get("extra")
        if not isinstance(extra, Mapping) or len(extra) != 1 or not ({"ratio", "count"} & set(extra)):
            raise ConfigurationError(
                "leases.provisioning.extra: required for mode 'over', as {'ratio': r} or {'count': n}",
                field="leases.provisioning.extra",
            )
        kwargs["extra_ratio"] = extra.get("ratio")
        kwargs["extra_count"] = extra.get("count")
    return kwargs


#: ``limitedGroups`` values, in both spellings.
_LIMITED_GROUPS = {"exclude": "exclude", "withinGroupLimit": "withinGroupLimit",
                   "within_group_limit": "withinGroupLimit"}


def _parse_limited_groups(value: Mapping[str, Any]) -> LimitedGroups:
    """SPEC R27: ``limitedGroups`` (or ``limited_groups``, not both): ``exclude`` (default) or
    ``withinGroupLimit`` (or ``within_group_limit``)."""
    if "limitedGroups" in value and "limited_groups" in value:
        raise ConfigurationError("leases: give limitedGroups or limited_groups, not both",
                                 field="leases.limitedGroups")
    lg = value.get("limitedGroups", value.get("limited_groups", "exclude"))
    if not isinstance(lg, str) or lg not in _LIMITED_GROUPS:
        raise ConfigurationError(
            f"leases.limitedGroups: must be 'exclude' or 'withinGroupLimit', got {lg!r}",
            field="leases.limitedGroups",
        )
    return LimitedGroups(_LIMITED_GROUPS[lg])


def option_int(value: Any, name: str, minimum: int) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) of at least ``minimum``, else raise
    :class:`ConfigurationError` naming the option ``name``: the one check of every integer
    option (the holder's, the queue's, the lease config's)."""
    # isinstance(value, int) first: it is what narrows ``value`` to int for the return.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigurationError(f"{name}: must be an integer >= {minimum}, got {value!r}", field=name)
    return value


#: The holder's ``leases=`` when it is not given (SPEC §7, decision "the default leases"):
#: strict provisioning, reusable slots sized before grants, the lease lifetime and size of the
#: original, and a lease recheck every 30 s. A mapping or :class:`LeaseConfig` given instead
#: starts from :class:`LeaseConfig`'s own defaults (the original's one-shot leases, grants
#: first, recheck 4 s); ``leases=None`` issues no leases (the original's default).
DEFAULT_LEASES = LeaseConfig(reusable=True, lease_first=True, recheck_ms=30_000)


def holder_leases(leases: LeaseConfig | Mapping[str, Any] | None, claim_ttl_ms: int | None) -> LeaseConfig | None:
    """SPEC §7 decision "the default leases": the holder's lease configuration from its
    ``leases=`` and ``claim_ttl_ms`` options. :data:`DEFAULT_LEASES` (the option's default) is
    kept unless ``claim_ttl_ms`` is set: crash expiry frees claimed grant permits, never lease
    slots, so a holder that asks for crash expiry and names no leases issues none (every
    permit a grant, which crash expiry covers). Anything else is parsed as given."""
    if leases is DEFAULT_LEASES and claim_ttl_ms is not None:
        return None
    return LeaseConfig.parse(leases)
