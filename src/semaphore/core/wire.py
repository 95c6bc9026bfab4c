"""Wire format v1 (SPEC §3): validation of incoming messages and typed views of them.

Messages cross RPC as plain JSON-compatible dicts with the reference's camelCase keys. This
module turns a received dict into frozen dataclasses (or raises
:class:`~semaphore.errors.InvalidMessageError` naming the first offending field, SPEC R7), and
turns typed objects back into dicts with :meth:`to_wire`. It never touches storage, so an invalid
message cannot change anything (SPEC I5).

**Ids** (``clientId``, ``demand[i].group``, ``grants[i].grantId``, ``leases[i].leaseId``) share
one alphabet, checked in one place (:func:`id_problem` / :func:`check_id`, for the queue and the
reference Worker to reuse): a ``str`` of 1 to :data:`MAX_ID_LENGTH` (256) characters (Unicode
code points, as Python's ``len``), any Unicode except

* control characters (category ``Cc``: C0 ``U+0000``-``U+001F`` including NUL, ``U+007F`` DEL,
  and C1 ``U+0080``-``U+009F``): the store passes id lists as one JSON binding, and SQLite's
  JSON functions may cut a string at an embedded NUL (CPython's SQLite does), so
  ``"a\\x00evil"`` would be stored as ``"a"`` and charged to another client or group;
* surrogate code points (``U+D800``-``U+DFFF``, i.e. the id must encode as UTF-8 strictly): a
  lone surrogate cannot be bound to SQL from CPython (the whole round of every client would
  fail), and JavaScript's SQLite binding turns it into U+FFFD (two ids would collide).

Everything else is allowed (spaces, ``:``, ``/``, quotes, non-ASCII letters, emoji, ...). Ids
are compared exactly, code point by code point: no trimming, case folding or Unicode
normalisation.

**Hostile shapes.** Validation reads only the fields the format defines, one level at a time
(a JavaScript proxy is converted with ``to_py(depth=1)``, a field at a time), so unknown keys are
never walked: nesting of any depth, in an unknown key or anywhere else, cannot raise
``RecursionError``. Lists are length-checked before their entries are read, and error messages
describe a received value in at most a few dozen ASCII characters (never its ``repr``: a deep
list would recurse, an integer of thousands of digits cannot be printed). Every input thus gets
either a typed message or an :class:`~semaphore.errors.InvalidMessageError`, never another
exception.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from ..errors import InvalidMessageError

__all__ = [
    "WIRE_VERSION",
    "MAX_ID_LENGTH",
    "MAX_LABEL_LENGTH",
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
    "id_problem",
    "check_id",
    "label_problem",
    "count_problem",
    "valid_count",
    "grant_state",
    "lease_state",
    "blocked_entry",
    "permit_response",
]

WIRE_VERSION = 1
MAX_ID_LENGTH = 256
#: Longest client ``label`` (characters): a name for operators, shown beside the client id.
MAX_LABEL_LENGTH = 200
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


def _show(value: Any) -> str:
    """A short ASCII description of a received value for an error message. Never recursive and
    never long: the ``repr`` of a deeply nested list raises ``RecursionError``, and an integer
    of more than 4,300 digits cannot be turned into a string at all."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, int):
        if -(10**15) < value < 10**15:
            return str(int(value))
        sign = "a negative" if value < 0 else "an"
        return f"{sign} integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return repr(float(value))
    if isinstance(value, str):
        text = ascii(str(value[:41]))
        if len(value) <= 40 and len(text) <= 60:
            return text
        return f"{text[:50]}... ({len(value)} characters)"
    return f"a {type(value).__name__}"


def _local(value: Any, name: str) -> Any:
    """One level of a received value as plain Python, leaving what it contains untouched.

    Plain values (what the SDK's RPC conversion hands over: ``dict``/``JsDict``, ``list``, str,
    numbers, None) are returned as they are. A JavaScript proxy is converted one level deep
    (``to_py(depth=1)``), so validation never walks more of a message than the fields it reads;
    JavaScript ``null``/``undefined`` become ``None``. A proxy that cannot be read (a JS getter
    that throws, ...) fails validation of field ``name``."""
    if value is None or isinstance(value, (str, int, float, dict, list, tuple)):
        return value
    if type(value).__name__ in ("JsNull", "JsUndefined"):
        return None
    try:
        to_py = getattr(value, "to_py", None)
        if not callable(to_py):
            return value
        try:
            return to_py(depth=1)
        except TypeError:  # a proxy-like object whose to_py() takes no depth
            return to_py()
    except Exception as exc:
        raise _fail(name, f"could not be read ({type(exc).__name__})") from None


def count_problem(value: Any) -> str | None:
    """Why ``value`` is not a count, or ``None`` if it is one (SPEC R7): a non-negative integer
    below 2**53 (:data:`MAX_INT`); integral floats are accepted (JS numbers), ``bool`` is not.
    The one definition of a count, for messages and resolved limits alike."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        return f"must be an integer, got {_show(value)}"
    if value < 0:
        return f"must not be negative, got {_show(value)}"
    if value > MAX_INT:
        return f"must be below 2**53, got {_show(value)}"
    return None


def valid_count(value: Any) -> int | None:
    """``value`` as an ``int`` if it is a count (:func:`count_problem`), else ``None``."""
    return None if count_problem(value) is not None else int(value)


def _count(value: Any, name: str) -> int:
    problem = count_problem(value)
    if problem is not None:
        raise _fail(name, problem)
    return int(value)


#: What an id may not contain (see the module docstring): control characters (Unicode category
#: Cc: C0 incl. NUL, DEL, C1) and surrogate code points (no strict UTF-8 encoding).
_FORBIDDEN_ID_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def id_problem(value: Any) -> str | None:
    """Why ``value`` is not a valid id, or ``None`` if it is one (SPEC R7).

    The one definition of the id alphabet (module docstring): a ``str`` of 1 to
    :data:`MAX_ID_LENGTH` characters, without control characters (C0 incl. NUL, DEL, C1) or
    surrogate code points. Callers that raise their own error type (the queue's
    ``ConfigurationError``, the Worker's HTTP 400) use this; :func:`check_id` raises
    :class:`InvalidMessageError`."""
    if not isinstance(value, str):
        return f"must be a string, got {_show(value)}"
    if not value:
        return "must not be empty"
    if len(value) > MAX_ID_LENGTH:
        return f"must be at most {MAX_ID_LENGTH} characters, got {len(value)}"
    bad = _FORBIDDEN_ID_CHARS.search(value)
    if bad is not None:
        char = bad.group()
        what = "a surrogate code point" if "\ud800" <= char <= "\udfff" else "a control character"
        return f"must not contain {what} (U+{ord(char):04X} at index {bad.start()})"
    return None


def check_id(value: Any, field_name: str) -> str:
    """``value`` if it is a valid id (:func:`id_problem`), else raise
    :class:`InvalidMessageError` naming ``field_name`` (e.g. ``"demand[0].group"``)."""
    problem = id_problem(value)
    if problem is not None:
        raise _fail(field_name, problem)
    return cast(str, value)  # id_problem found none: value is a str


def label_problem(value: Any) -> str | None:
    """Why ``value`` is not a client label, or ``None`` if it is one: a ``str`` of 1 to
    :data:`MAX_LABEL_LENGTH` characters in the id alphabet (no control characters, no surrogate
    code points: it is stored and shown, so the reasons of :func:`id_problem` hold for it too).
    The one definition, for the wire (``label``) and ``SemaphoreClient(label=...)``."""
    if isinstance(value, str) and len(value) > MAX_LABEL_LENGTH:
        return f"must be at most {MAX_LABEL_LENGTH} characters, got {len(value)}"
    return id_problem(value)


def _label(message: Mapping[str, Any]) -> str | None:
    """A message's optional ``label`` (absent or null: none)."""
    value = _local(message["label"], "label") if "label" in message else None
    if value is None:
        return None
    problem = label_problem(value)
    if problem is not None:
        raise _fail("label", problem)
    return cast(str, value)


def _boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, f"must be a boolean, got {_show(value)}")
    return value


def _entries(message: Mapping[str, Any], key: str, *, required: bool) -> list[Mapping[str, Any]] | None:
    value = _local(message[key], key) if key in message else None
    if value is None:
        if required:
            raise _fail(key, "is required")
        return None
    if not isinstance(value, (list, tuple)):
        raise _fail(key, f"must be a list, got {_show(value)}")
    if len(value) > MAX_LIST_LENGTH:
        raise _fail(key, f"must have at most {MAX_LIST_LENGTH} entries, got {len(value)}")
    entries = []
    for index, entry in enumerate(value):
        name = f"{key}[{index}]"
        entry = _local(entry, name)
        if not isinstance(entry, Mapping):
            raise _fail(name, f"must be an object, got {_show(entry)}")
        entries.append(entry)
    return entries


def _get(entry: Mapping[str, Any], key: str, name: str) -> Any:
    value = _local(entry[key], name) if key in entry else None
    if value is None:
        raise _fail(name, "is required")
    return value


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Demand:
    """Queued, not yet permitted work of one group: ``count`` items, the oldest enqueued at
    ``oldest_at`` (epoch ms)."""

    group: str
    count: int
    oldest_at: int

    def to_wire(self) -> dict[str, Any]:
        """The wire dict: ``{"group", "count", "oldestAt"}``."""
        return {"group": self.group, "count": self.count, "oldestAt": self.oldest_at}


@dataclass(frozen=True)
class GrantReport:
    """Cumulative claimed/released counts of one grant (high-water marks, SPEC R13)."""

    grant_id: str
    claimed: int
    released: int

    def to_wire(self) -> dict[str, Any]:
        """The wire dict: ``{"grantId", "claimed", "released"}``."""
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
        """The wire dict: ``{"leaseId", "drawn", "released", "stopped"}``."""
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
    #: How long the client will wait for the answer when its round serves it nothing (wire key
    #: ``waitMs``, only when above 0): a holder with ``hold_blocked_ms`` keeps such a request
    #: open until a later round serves it, up to the smaller of the two (SPEC R9 decision).
    wait_ms: int = 0
    #: A try (wire key ``noWait``, only when true): the client waits for no later round; the
    #: holder runs its round at once and answers it from that round (SPEC R9b).
    no_wait: bool = False
    #: The client's label for operators (wire key ``label``, only when set; SPEC R38 decision):
    #: shown beside its id by ``holders()``. ``None``: the message carries none.
    label: str | None = None

    type = "request"

    def to_wire(self) -> dict[str, Any]:
        """The wire message (``type: "request"``, ``v: 1``); ``leases`` only when not ``None``,
        ``waitMs`` only when above 0, ``noWait`` only when true, ``label`` only when set."""
        message: dict[str, Any] = {
            "type": "request",
            "v": WIRE_VERSION,
            "clientId": self.client_id,
            "demand": [d.to_wire() for d in self.demand],
            "grants": [g.to_wire() for g in self.grants],
        }
        if self.leases is not None:
            message["leases"] = [lease.to_wire() for lease in self.leases]
        if self.wait_ms > 0:
            message["waitMs"] = self.wait_ms
        if self.no_wait:
            message["noWait"] = True
        if self.label is not None:
            message["label"] = self.label
        return message


@dataclass(frozen=True)
class SyncMessage:
    """``type: "sync"``: reports only, applied and answered at once (SPEC R6)."""

    client_id: str
    grants: tuple[GrantReport, ...] = ()
    leases: tuple[LeaseReport, ...] | None = None
    #: The client's label (wire key ``label``, only when set), as on :class:`PermitRequest`.
    label: str | None = None

    type = "sync"

    def to_wire(self) -> dict[str, Any]:
        """The wire message (``type: "sync"``, ``v: 1``); ``leases`` only when not ``None``,
        ``label`` only when set."""
        message: dict[str, Any] = {
            "type": "sync",
            "v": WIRE_VERSION,
            "clientId": self.client_id,
            "grants": [g.to_wire() for g in self.grants],
        }
        if self.leases is not None:
            message["leases"] = [lease.to_wire() for lease in self.leases]
        if self.label is not None:
            message["label"] = self.label
        return message


def _parse_grants(message: Mapping[str, Any]) -> tuple[GrantReport, ...]:
    reports = []
    seen: set[str] = set()
    for i, entry in enumerate(_entries(message, "grants", required=True) or ()):
        name = f"grants[{i}]"
        grant_id = check_id(_get(entry, "grantId", f"{name}.grantId"), f"{name}.grantId")
        claimed = _count(_get(entry, "claimed", f"{name}.claimed"), f"{name}.claimed")
        released = _count(_get(entry, "released", f"{name}.released"), f"{name}.released")
        if released > claimed:
            raise _fail(f"{name}.released", f"must not exceed claimed ({released} > {claimed})")
        if grant_id in seen:
            raise _fail(f"{name}.grantId", f"duplicate grant id {_show(grant_id)}")
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
        lease_id = check_id(_get(entry, "leaseId", f"{name}.leaseId"), f"{name}.leaseId")
        drawn = _count(_get(entry, "drawn", f"{name}.drawn"), f"{name}.drawn")
        released = _count(_get(entry, "released", f"{name}.released"), f"{name}.released")
        stopped = _boolean(_get(entry, "stopped", f"{name}.stopped"), f"{name}.stopped")
        if released > drawn:
            raise _fail(f"{name}.released", f"must not exceed drawn ({released} > {drawn})")
        if lease_id in seen:
            raise _fail(f"{name}.leaseId", f"duplicate lease id {_show(lease_id)}")
        seen.add(lease_id)
        reports.append(LeaseReport(lease_id, drawn, released, stopped))
    return tuple(reports)


def _parse_demand(message: Mapping[str, Any]) -> tuple[Demand, ...]:
    demand = []
    seen: set[str] = set()
    for i, entry in enumerate(_entries(message, "demand", required=True) or ()):
        name = f"demand[{i}]"
        group = check_id(_get(entry, "group", f"{name}.group"), f"{name}.group")
        count = _count(_get(entry, "count", f"{name}.count"), f"{name}.count")
        oldest_at = _count(_get(entry, "oldestAt", f"{name}.oldestAt"), f"{name}.oldestAt")
        if group in seen:
            raise _fail(f"{name}.group", f"duplicate group {_show(group)}")
        seen.add(group)
        demand.append(Demand(group, count, oldest_at))
    return tuple(demand)


def parse_message(message: Any) -> PermitRequest | SyncMessage:
    """Validate a received message (SPEC R7) and return its typed view.

    Raises :class:`InvalidMessageError` naming the first offending field, and nothing else,
    whatever ``message`` is (module docstring: hostile shapes). Unknown extra keys are ignored
    (forward compatibility) and never read. ``message`` may be a dict (``JsDict``) as the RPC
    conversion delivers it, or a JavaScript proxy (converted one level at a time)."""
    message = _local(message, "")
    if not isinstance(message, Mapping):
        raise _fail("", f"message must be an object, got {_show(message)}")
    v = _local(message["v"], "v") if "v" in message else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != WIRE_VERSION:
        raise _fail("v", f"unsupported wire version {_show(v)}, expected {WIRE_VERSION}")
    kind = _local(message["type"], "type") if "type" in message else None
    if not isinstance(kind, str) or kind not in ("request", "sync"):
        raise _fail("type", f"must be 'request' or 'sync', got {_show(kind)}")
    client_id = check_id(_get(message, "clientId", "clientId"), "clientId")
    label = _label(message)
    if kind == "request":
        demand = _parse_demand(message)
        wait = _local(message["waitMs"], "waitMs") if "waitMs" in message else None
        wait_ms = 0 if wait is None else _count(wait, "waitMs")
        no_wait = _local(message["noWait"], "noWait") if "noWait" in message else False
        if not isinstance(no_wait, bool):
            raise _fail("noWait", f"must be a boolean, got {_show(no_wait)}")
        return PermitRequest(client_id, demand, _parse_grants(message), _parse_leases(message), wait_ms, no_wait,
                             label)
    return SyncMessage(client_id, _parse_grants(message), _parse_leases(message), label)


# --------------------------------------------------------------------------- responses
# The holder answers for every grant and lease of every client in a round, so it builds reply
# dicts directly with these builders; the dataclasses below encode through them too (one
# encoding of each shape, SPEC R8). tests/test_wire.py checks them against the dataclasses.


def grant_state(grant_id: str, group: str | None, permits: int, claimed: int, released: int,
                claim_by: int | None, status: str) -> dict[str, Any]:
    """Wire form of :class:`GrantState` (``status`` a :class:`GrantStatus` value)."""
    return {"grantId": grant_id, "group": group, "permits": permits, "claimed": claimed,
            "released": released, "claimBy": claim_by, "status": status}


def lease_state(lease_id: str, group: str | None, permits: int, drawn: int, released: int,
                expires_at: int | None, status: str, reusable: bool = False) -> dict[str, Any]:
    """Wire form of :class:`LeaseState` (``status`` a :class:`LeaseStatus` value); ``reusable``
    (SPEC R34a) is sent only when true, so a reply without it reads as before."""
    d = {"leaseId": lease_id, "group": group, "permits": permits, "drawn": drawn,
         "released": released, "expiresAt": expires_at, "status": status}
    if reusable:
        d["reusable"] = True
    return d


def blocked_entry(group: str, reason: str, waiting: int) -> dict[str, Any]:
    """Wire form of :class:`Blocked` (``reason`` a :class:`BlockedReason` value)."""
    return {"group": group, "reason": reason, "waiting": waiting}


def permit_response(grants: list[dict[str, Any]], leases: list[dict[str, Any]],
                    blocked: list[dict[str, Any]], contended: bool, next_request_at: int) -> dict[str, Any]:
    """Wire form of :class:`PermitResponse` from wire entries."""
    return {"v": WIRE_VERSION, "grants": grants, "leases": leases, "blocked": blocked,
            "contended": contended, "nextRequestAt": next_request_at}



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
        """The reply entry: ``{"grantId", "group", "permits", "claimed", "released", "claimBy",
        "status"}``."""
        return grant_state(self.grant_id, self.group, self.permits, self.claimed, self.released,
                           self.claim_by, self.status.value)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> GrantState:
        """Typed view of a reply's grant entry."""
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
    #: Its slots are reusable while it lives (SPEC R34a; wire ``reusable``, absent when false).
    reusable: bool = False

    def to_wire(self) -> dict[str, Any]:
        """The reply entry: ``{"leaseId", "group", "permits", "drawn", "released", "expiresAt",
        "status"}``, plus ``"reusable": true`` for a reusable lease."""
        return lease_state(self.lease_id, self.group, self.permits, self.drawn, self.released,
                           self.expires_at, self.status.value, self.reusable)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> LeaseState:
        """Typed view of a reply's lease entry."""
        return cls(
            str(d["leaseId"]),
            None if d.get("group") is None else str(d["group"]),
            int(d.get("permits") or 0),
            int(d.get("drawn") or 0),
            int(d.get("released") or 0),
            None if d.get("expiresAt") is None else int(d["expiresAt"]),
            LeaseStatus(d["status"]),
            bool(d.get("reusable") or False),
        )


@dataclass(frozen=True)
class Blocked:
    """Demand of ``group`` left waiting after a round, and the first constraint that stopped
    it (SPEC R23)."""

    group: str
    reason: BlockedReason
    waiting: int

    def to_wire(self) -> dict[str, Any]:
        """The reply entry: ``{"group", "reason", "waiting"}``."""
        return blocked_entry(self.group, self.reason.value, self.waiting)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Blocked:
        """Typed view of a reply's ``blocked`` entry."""
        return cls(str(d["group"]), BlockedReason(d["reason"]), int(d["waiting"]))


@dataclass(frozen=True)
class PermitResponse:
    """A holder's answer to a request or a sync (SPEC R8)."""

    grants: tuple[GrantState, ...] = ()
    leases: tuple[LeaseState, ...] = ()
    blocked: tuple[Blocked, ...] = ()
    contended: bool = False
    next_request_at: int = 0
    #: The holder's ``claim_ttl_ms`` (reply key ``claimTtlMs``, only when set): claimed permits
    #: of a client that sends no request or sync for this long are released by the holder, so
    #: the client reports at least twice as often while it holds claimed permits.
    claim_ttl_ms: int | None = None
    #: In how many ms from the reply a request joins the round at ``next_request_at`` (reply key
    #: ``joinInMs``, SPEC R11 decision): ``round_wait_ms`` before it, or 0 while a round waits.
    #: ``None`` from a holder that does not send it (the client then waits for
    #: ``next_request_at``).
    join_in_ms: int | None = None
    #: The holder's lease ``recheckMs`` (reply key ``leaseRecheckMs``, SPEC R33a; only when
    #: leases are configured with one): the client draws from a lease only while its last reply
    #: is younger than this. ``None``: no recheck (an older holder, or the option 0).
    lease_recheck_ms: int | None = None
    #: A sync's reply only (reply key ``room``, sent only when true; SPEC R34a room): with
    #: reusable leases, capacity freed since the last round and no request waits at the holder,
    #: so a client whose demand its reusable lease covers asks for it now, not at its heartbeat.
    room: bool = False

    def to_wire(self) -> dict[str, Any]:
        """The reply dict: ``{"v", "grants", "leases", "blocked", "contended", "nextRequestAt"}``
        (and ``"claimTtlMs"``, ``"joinInMs"``, ``"leaseRecheckMs"``, ``"room"`` when set)."""
        reply = permit_response([g.to_wire() for g in self.grants], [x.to_wire() for x in self.leases],
                                [b.to_wire() for b in self.blocked], self.contended, self.next_request_at)
        if self.claim_ttl_ms is not None:
            reply["claimTtlMs"] = self.claim_ttl_ms
        if self.join_in_ms is not None:
            reply["joinInMs"] = self.join_in_ms
        if self.lease_recheck_ms is not None:
            reply["leaseRecheckMs"] = self.lease_recheck_ms
        if self.room:
            reply["room"] = True
        return reply

    def ask_at(self, now: int) -> int:
        """When the client may send its next request, on its own clock reading ``now`` at the
        reply: ``now + join_in_ms`` if the holder sent it, else ``next_request_at`` (R11)."""
        return self.next_request_at if self.join_in_ms is None else now + self.join_in_ms

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> PermitResponse:
        """Typed view of a response dict. Raises the typed exception of an error reply."""
        from ..errors import error_from_reply

        error = error_from_reply(d)
        if error is not None:
            raise error
        return cls(
            tuple(GrantState.from_wire(g) for g in d.get("grants") or ()),
            tuple(LeaseState.from_wire(x) for x in d.get("leases") or ()),
            tuple(Blocked.from_wire(b) for b in d.get("blocked") or ()),
            bool(d.get("contended", False)),
            int(d.get("nextRequestAt") or 0),
            int(d["claimTtlMs"]) if d.get("claimTtlMs") else None,
            int(d["joinInMs"]) if d.get("joinInMs") is not None else None,
            int(d["leaseRecheckMs"]) if d.get("leaseRecheckMs") else None,
            d.get("room") is True,
        )
