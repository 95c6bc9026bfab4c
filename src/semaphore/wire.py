"""Wire format v1 (SPEC §3): validation of incoming messages and typed views of them.

Messages cross RPC as plain JSON-compatible dicts with the reference's camelCase keys. This
module turns a received dict into frozen dataclasses (or raises
:class:`~semaphore.errors.InvalidMessageError` naming the first offending field, SPEC R7), and
turns typed objects back into dicts with :meth:`to_wire`. It never touches storage, so an invalid
message cannot change anything (SPEC I5).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import InvalidMessageError

__all__ = [
    "WIRE_VERSION",
    "MAX_ID_LENGTH",
    "MAX_LIST_LENGTH",
    "MAX_INT",
    "Demand",
    "GrantReport",
    "LeaseReport",
    "PermitRequest",
    "SyncMessage",
    "GrantStatus",
    "LeaseStatus",
    "BlockedReason",
    "GrantState",
    "LeaseState",
    "Blocked",
    "PermitResponse",
    "parse_message",
]

WIRE_VERSION = 1
MAX_ID_LENGTH = 256
MAX_LIST_LENGTH = 1000
#: Integers must stay below 2**53: they travel as JavaScript numbers (doubles).
MAX_INT = 2**53 - 1


class GrantStatus(str, enum.Enum):
    """Status of a grant in a response (SPEC R8, R15)."""

    ACTIVE = "active"
    EXPIRED = "expired"
    NOT_FOUND = "not_found"


class LeaseStatus(str, enum.Enum):
    """Status of a lease in a response (SPEC R8, R30-R32)."""

    LIVE = "live"
    RETIRED = "retired"
    SETTLED = "settled"


class BlockedReason(str, enum.Enum):
    """Why queued demand of a group was not (fully) served in a round (SPEC R23)."""

    NOT_PERMITTED = "not_permitted"
    LIMIT_RESOLUTION_ERROR = "limit_resolution_error"
    GROUP_LIMIT = "group_limit"
    LIMIT = "limit"


# --------------------------------------------------------------------------- validation helpers


def _fail(field_name: str, message: str) -> InvalidMessageError:
    return InvalidMessageError(field_name, message)


def _count(value: Any, name: str) -> int:
    """A non-negative integer below 2**53. Integral floats are accepted (JS numbers)."""
    if isinstance(value, bool):
        raise _fail(name, f"must be an integer, got a boolean ({value!r})")
    if isinstance(value, float):
        if not value.is_integer():
            raise _fail(name, f"must be an integer, got {value!r}")
        value = int(value)
    if not isinstance(value, int):
        raise _fail(name, f"must be an integer, got {type(value).__name__}")
    if value < 0:
        raise _fail(name, f"must not be negative, got {value}")
    if value > MAX_INT:
        raise _fail(name, f"must be below 2**53, got {value}")
    return value


def _ident(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise _fail(name, f"must be a string, got {type(value).__name__}")
    if not value:
        raise _fail(name, "must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise _fail(name, f"must be at most {MAX_ID_LENGTH} characters, got {len(value)}")
    return value


def _boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, f"must be a boolean, got {type(value).__name__}")
    return value


def _entries(message: Mapping[str, Any], key: str, *, required: bool) -> list[Mapping[str, Any]] | None:
    if key not in message or message[key] is None:
        if required:
            raise _fail(key, "is required")
        return None
    value = message[key]
    if not isinstance(value, (list, tuple)):
        raise _fail(key, f"must be a list, got {type(value).__name__}")
    if len(value) > MAX_LIST_LENGTH:
        raise _fail(key, f"must have at most {MAX_LIST_LENGTH} entries, got {len(value)}")
    for index, entry in enumerate(value):
        if not isinstance(entry, Mapping):
            raise _fail(f"{key}[{index}]", f"must be an object, got {type(entry).__name__}")
    return list(value)


def _get(entry: Mapping[str, Any], key: str, name: str) -> Any:
    if key not in entry or entry[key] is None:
        raise _fail(name, "is required")
    return entry[key]


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Demand:
    """Queued, not yet permitted work of one group: ``count`` items, the oldest enqueued at
    ``oldest_at`` (epoch ms)."""

    group: str
    count: int
    oldest_at: int

    def to_wire(self) -> dict[str, Any]:
        return {"group": self.group, "count": self.count, "oldestAt": self.oldest_at}


@dataclass(frozen=True)
class GrantReport:
    """Cumulative claimed/released counts of one grant (high-water marks, SPEC R13)."""

    grant_id: str
    claimed: int
    released: int

    def to_wire(self) -> dict[str, Any]:
        return {"grantId": self.grant_id, "claimed": self.claimed, "released": self.released}


@dataclass(frozen=True)
class LeaseReport:
    """Cumulative drawn/released counts of one lease; ``stopped`` means the client draws no more
    from it and ``drawn`` is final (SPEC R30, R31)."""

    lease_id: str
    drawn: int
    released: int
    stopped: bool = False

    def to_wire(self) -> dict[str, Any]:
        return {
            "leaseId": self.lease_id,
            "drawn": self.drawn,
            "released": self.released,
            "stopped": self.stopped,
        }


@dataclass(frozen=True)
class PermitRequest:
    """``type: "request"``: demand plus reports; waits for the next round (SPEC R9).

    ``leases`` is ``None`` for a client without lease support, a (possibly empty) tuple for one
    with it (SPEC R5)."""

    client_id: str
    demand: tuple[Demand, ...] = ()
    grants: tuple[GrantReport, ...] = ()
    leases: tuple[LeaseReport, ...] | None = None

    type = "request"

    def to_wire(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "type": "request",
            "v": WIRE_VERSION,
            "clientId": self.client_id,
            "demand": [d.to_wire() for d in self.demand],
            "grants": [g.to_wire() for g in self.grants],
        }
        if self.leases is not None:
            message["leases"] = [lease.to_wire() for lease in self.leases]
        return message


@dataclass(frozen=True)
class SyncMessage:
    """``type: "sync"``: reports only, applied and answered at once (SPEC R6)."""

    client_id: str
    grants: tuple[GrantReport, ...] = ()
    leases: tuple[LeaseReport, ...] | None = None

    type = "sync"

    def to_wire(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "type": "sync",
            "v": WIRE_VERSION,
            "clientId": self.client_id,
            "grants": [g.to_wire() for g in self.grants],
        }
        if self.leases is not None:
            message["leases"] = [lease.to_wire() for lease in self.leases]
        return message


def _parse_grants(message: Mapping[str, Any]) -> tuple[GrantReport, ...]:
    reports = []
    seen: set[str] = set()
    for i, entry in enumerate(_entries(message, "grants", required=True) or ()):
        name = f"grants[{i}]"
        grant_id = _ident(_get(entry, "grantId", f"{name}.grantId"), f"{name}.grantId")
        claimed = _count(_get(entry, "claimed", f"{name}.claimed"), f"{name}.claimed")
        released = _count(_get(entry, "released", f"{name}.released"), f"{name}.released")
        if released > claimed:
            raise _fail(f"{name}.released", f"must not exceed claimed ({released} > {claimed})")
        if grant_id in seen:
            raise _fail(f"{name}.grantId", f"duplicate grant id {grant_id!r}")
        seen.add(grant_id)
        reports.append(GrantReport(grant_id, claimed, released))
    return tuple(reports)


def _parse_leases(message: Mapping[str, Any]) -> tuple[LeaseReport, ...] | None:
    entries = _entries(message, "leases", required=False)
    if entries is None:
        return None
    reports = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        name = f"leases[{i}]"
        lease_id = _ident(_get(entry, "leaseId", f"{name}.leaseId"), f"{name}.leaseId")
        drawn = _count(_get(entry, "drawn", f"{name}.drawn"), f"{name}.drawn")
        released = _count(_get(entry, "released", f"{name}.released"), f"{name}.released")
        stopped = _boolean(_get(entry, "stopped", f"{name}.stopped"), f"{name}.stopped")
        if released > drawn:
            raise _fail(f"{name}.released", f"must not exceed drawn ({released} > {drawn})")
        if lease_id in seen:
            raise _fail(f"{name}.leaseId", f"duplicate lease id {lease_id!r}")
        seen.add(lease_id)
        reports.append(LeaseReport(lease_id, drawn, released, stopped))
    return tuple(reports)


def _parse_demand(message: Mapping[str, Any]) -> tuple[Demand, ...]:
    demand = []
    seen: set[str] = set()
    for i, entry in enumerate(_entries(message, "demand", required=True) or ()):
        name = f"demand[{i}]"
        group = _ident(_get(entry, "group", f"{name}.group"), f"{name}.group")
        count = _count(_get(entry, "count", f"{name}.count"), f"{name}.count")
        oldest_at = _count(_get(entry, "oldestAt", f"{name}.oldestAt"), f"{name}.oldestAt")
        if group in seen:
            raise _fail(f"{name}.group", f"duplicate group {group!r}")
        seen.add(group)
        demand.append(Demand(group, count, oldest_at))
    return tuple(demand)


def parse_message(message: Any) -> PermitRequest | SyncMessage:
    """Validate a received message (SPEC R7) and return its typed view.

    Raises :class:`InvalidMessageError` naming the first offending field. Unknown extra keys
    are ignored (forward compatibility)."""
    if not isinstance(message, Mapping):
        raise _fail("", f"message must be an object, got {type(message).__name__}")
    v = message.get("v")
    if isinstance(v, bool) or v != WIRE_VERSION:
        raise _fail("v", f"unsupported wire version {v!r}, expected {WIRE_VERSION}")
    kind = message.get("type")
    if kind not in ("request", "sync"):
        raise _fail("type", f"must be 'request' or 'sync', got {kind!r}")
    client_id = _ident(_get(message, "clientId", "clientId"), "clientId")
    if kind == "request":
        demand = _parse_demand(message)
        return PermitRequest(client_id, demand, _parse_grants(message), _parse_leases(message))
    return SyncMessage(client_id, _parse_grants(message), _parse_leases(message))


# --------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class GrantState:
    """The holder's view of one grant (SPEC R8). ``group``/``claim_by`` are ``None`` when the
    grant is unknown (``status`` ``not_found``)."""

    grant_id: str
    group: str | None
    permits: int
    claimed: int
    released: int
    claim_by: int | None
    status: GrantStatus

    def to_wire(self) -> dict[str, Any]:
        return {
            "grantId": self.grant_id,
            "group": self.group,
            "permits": self.permits,
            "claimed": self.claimed,
            "released": self.released,
            "claimBy": self.claim_by,
            "status": self.status.value,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "GrantState":
        return cls(
            str(d["grantId"]),
            None if d.get("group") is None else str(d["group"]),
            int(d.get("permits") or 0),
            int(d.get("claimed") or 0),
            int(d.get("released") or 0),
            None if d.get("claimBy") is None else int(d["claimBy"]),
            GrantStatus(d["status"]),
        )


@dataclass(frozen=True)
class LeaseState:
    """The holder's view of one lease (SPEC R8). ``group``/``expires_at`` are ``None`` for a
    lease the holder never knew."""

    lease_id: str
    group: str | None
    permits: int
    drawn: int
    released: int
    expires_at: int | None
    status: LeaseStatus

    def to_wire(self) -> dict[str, Any]:
        return {
            "leaseId": self.lease_id,
            "group": self.group,
            "permits": self.permits,
            "drawn": self.drawn,
            "released": self.released,
            "expiresAt": self.expires_at,
            "status": self.status.value,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "LeaseState":
        return cls(
            str(d["leaseId"]),
            None if d.get("group") is None else str(d["group"]),
            int(d.get("permits") or 0),
            int(d.get("drawn") or 0),
            int(d.get("released") or 0),
            None if d.get("expiresAt") is None else int(d["expiresAt"]),
            LeaseStatus(d["status"]),
        )


@dataclass(frozen=True)
class Blocked:
    """Demand of ``group`` left waiting after a round, and the first constraint that stopped
    it (SPEC R23)."""

    group: str
    reason: BlockedReason
    waiting: int

    def to_wire(self) -> dict[str, Any]:
        return {"group": self.group, "reason": self.reason.value, "waiting": self.waiting}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "Blocked":
        return cls(str(d["group"]), BlockedReason(d["reason"]), int(d["waiting"]))


@dataclass(frozen=True)
class PermitResponse:
    """A holder's answer to a request or a sync (SPEC R8)."""

    grants: tuple[GrantState, ...] = ()
    leases: tuple[LeaseState, ...] = ()
    blocked: tuple[Blocked, ...] = ()
    contended: bool = False
    next_request_at: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": WIRE_VERSION,
            "grants": [g.to_wire() for g in self.grants],
            "leases": [lease.to_wire() for lease in self.leases],
            "blocked": [b.to_wire() for b in self.blocked],
            "contended": self.contended,
            "nextRequestAt": self.next_request_at,
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "PermitResponse":
        """Typed view of a response dict. Raises the typed exception of an error reply."""
        from .errors import error_from_reply

        error = error_from_reply(d)
        if error is not None:
            raise error
        return cls(
            tuple(GrantState.from_wire(g) for g in d.get("grants") or ()),
            tuple(LeaseState.from_wire(x) for x in d.get("leases") or ()),
            tuple(Blocked.from_wire(b) for b in d.get("blocked") or ()),
            bool(d.get("contended", False)),
            int(d.get("nextRequestAt") or 0),
        )
