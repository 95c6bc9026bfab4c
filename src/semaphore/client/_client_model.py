"""The client's durable model (SPEC R35): its tables, their upgrades and indexes, and what
applying a reply changed (:class:`AppliedReply`).

Dropped grants and settled leases are kept for a while as tombstones (``status`` ``gone`` /
``settled``) so that a stale reply cannot bring them back. Tombstones cost nothing while they
wait: every read of live rows and the pruning go through partial indexes that leave them out
(``..._live`` over live rows, ``..._gone``/``..._settled`` over tombstones), so a client's work
grows with its live grants and leases only.

**Schema upgrades** happen on first use (:meth:`SemaphoreClient.ensure_schema`, also run by
``migrate(ctx, 1)``): tables of an older release gain the ``report_at`` column (``ALTER TABLE ...
ADD COLUMN``, default 0: such rows are reported first) and the indexes (``CREATE INDEX IF NOT
EXISTS``); nothing else changes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..core.client_state import GONE
from ..core.wire import MAX_LABEL_LENGTH, LeaseStatus, PermitResponse, label_problem
from ..errors import ConfigurationError, SemaphoreError
from ..rpc import Call
from ..runtime import Storage, install_schema, object_id, object_name
from ._store import GRANTS, KEYS, LEASES, mark_holder_released_by_ttl

__all__ = ["AppliedReply", "CLIENT_TABLES", "OBJECT_NAME", "ReplyHook", "Transport"]

#: ``async (key, message) -> reply``: sends one wire message to the holder of ``key``. The same
#: type as :data:`semaphore.rpc.Call` (what ``SemaphoreRpc.transport(env)`` returns).
Transport = Call

#: Tables owned by :class:`SemaphoreClient` (the queue adds its own, same prefix).
CLIENT_TABLES = (GRANTS, LEASES, KEYS)

_SETTLED = LeaseStatus.SETTLED.value

_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {GRANTS} ("
    " key TEXT NOT NULL, grant_id TEXT NOT NULL, group_name TEXT NOT NULL,"
    " permits INTEGER NOT NULL, claimed INTEGER NOT NULL, released INTEGER NOT NULL,"
    " confirmed INTEGER NOT NULL, claim_by INTEGER NOT NULL, status TEXT NOT NULL,"
    " sent_claimed INTEGER NOT NULL, sent_released INTEGER NOT NULL, updated_at INTEGER NOT NULL,"
    " report_at INTEGER NOT NULL DEFAULT 0, holder_released INTEGER NOT NULL DEFAULT 0,"
    " PRIMARY KEY (key, grant_id))",
    f"CREATE TABLE IF NOT EXISTS {LEASES} ("
    " key TEXT NOT NULL, lease_id TEXT NOT NULL, group_name TEXT NOT NULL,"
    " permits INTEGER NOT NULL, drawn INTEGER NOT NULL, released INTEGER NOT NULL,"
    " stopped INTEGER NOT NULL, status TEXT NOT NULL, expires_at INTEGER NOT NULL,"
    " heartbeat_at INTEGER NOT NULL, sent_drawn INTEGER NOT NULL, sent_released INTEGER NOT NULL,"
    " sent_stopped INTEGER NOT NULL, updated_at INTEGER NOT NULL,"
    " report_at INTEGER NOT NULL DEFAULT 0, reusable INTEGER NOT NULL DEFAULT 0,"
    " PRIMARY KEY (key, lease_id))",
    f"CREATE TABLE IF NOT EXISTS {KEYS} ("
    " key TEXT PRIMARY KEY, next_request_at INTEGER NOT NULL, contended INTEGER NOT NULL,"
    " needs_sync INTEGER NOT NULL, check_at INTEGER NOT NULL, updated_at INTEGER NOT NULL)",
)

#: Columns added after the first release: ``(table, column, declaration)``; tables created by an
#: older release gain them on first use (``ALTER TABLE ... ADD COLUMN``).
_ADDED_COLUMNS = (
    (GRANTS, "report_at", "INTEGER NOT NULL DEFAULT 0"),
    (LEASES, "report_at", "INTEGER NOT NULL DEFAULT 0"),
    # the holder's claimTtlMs and when its last reply was applied (claim heartbeats)
    (KEYS, "claim_ttl_ms", "INTEGER NOT NULL DEFAULT 0"),
    (KEYS, "replied_at", "INTEGER NOT NULL DEFAULT 0"),
    # the holder's leaseRecheckMs (R33a)
    (KEYS, "lease_recheck_ms", "INTEGER NOT NULL DEFAULT 0"),
    # the holder's last reply said there is room (SPEC R34a room)
    (KEYS, "room", "INTEGER NOT NULL DEFAULT 0"),
    # when the key's replies turned contended (0: the last was not): the room check's backoff
    (KEYS, "contended_since", "INTEGER NOT NULL DEFAULT 0"),
    # when the key's tombstones were last pruned, or its row first written (SPEC R35 tombstones)
    (KEYS, "pruned_at", "INTEGER NOT NULL DEFAULT 0"),
    # the lease's slots are reusable (SPEC R34a)
    (LEASES, "reusable", "INTEGER NOT NULL DEFAULT 0"),
    # the holder released slots of the grant on its own (its crash expiry; SPEC R15a)
    (GRANTS, "holder_released", "INTEGER NOT NULL DEFAULT 0"),
)

# Partial indexes: live rows (what every read wants, in the order it wants them) apart from
# tombstones (what pruning wants), so neither ever walks the other. The queries that use them
# repeat the index's WHERE term literally (SQLite uses a partial index only then).
_LIVE_GRANTS = f"status <> '{GONE}'"
_LIVE_LEASES = f"status <> '{_SETTLED}'"
_INDEXES = (
    f"CREATE INDEX IF NOT EXISTS {GRANTS}_live ON {GRANTS}(key, claim_by, grant_id) WHERE {_LIVE_GRANTS}",
    f"CREATE INDEX IF NOT EXISTS {GRANTS}_gone ON {GRANTS}(key, updated_at) WHERE status = '{GONE}'",
    f"CREATE INDEX IF NOT EXISTS {LEASES}_live ON {LEASES}(key, expires_at, lease_id) WHERE {_LIVE_LEASES}",
    f"CREATE INDEX IF NOT EXISTS {LEASES}_settled ON {LEASES}(key, updated_at) WHERE status = '{_SETTLED}'",
)


def _install_schema(storage: Storage) -> None:
    """The client tables, their columns added since the first release, and their indexes
    (:func:`~semaphore.runtime.install_schema`). When ``holder_released`` is added to an older
    release's grants, the live grants of keys whose last reply told a ``claimTtlMs`` get it set
    (SPEC R15a): that release switched the completion check on by the TTL, and a crash expiry it
    merged already would show in no later reply."""
    if (GRANTS, "holder_released") in install_schema(storage, _SCHEMA, _ADDED_COLUMNS, _INDEXES):
        mark_holder_released_by_ttl(storage)


@dataclass
class AppliedReply:
    """What applying one reply changed locally (passed to ``on_reply`` hooks).

    :ivar response: the typed reply.
    :ivar dropped: grant ids dropped (``not_found``, or settled).
    :ivar expired: grant ids clamped by an ``expired`` answer.
    :ivar adopted_grants: / :ivar adopted_leases: ids learnt from this reply (R8).
    :ivar retired: lease ids the holder retired (the client stopped drawing from them).
    :ivar settled: lease ids settled (deleted at the holder).
    :ivar more: the message could not carry every grant or lease with something to report (over
        1,000 in a list, SPEC R7): send another message (the next window) soon, e.g. with
        :meth:`SemaphoreClient.flush`.
    """

    key: str
    response: PermitResponse
    now: int
    dropped: list[str] = field(default_factory=list)
    expired: list[str] = field(default_factory=list)
    adopted_grants: list[str] = field(default_factory=list)
    adopted_leases: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    settled: list[str] = field(default_factory=list)
    more: bool = False

    @property
    def contended(self) -> bool:
        """The reply said ``contended`` (SPEC R29): some demand of the round went unserved."""
        return self.response.contended


ReplyHook = Callable[[AppliedReply], None]


def _default_client_id(ctx: Any) -> str:
    ident = object_id(ctx)
    if ident is None:
        raise SemaphoreError("ctx has no id; pass client_id=")
    return ident


class _Label(enum.Enum):
    """The default of ``SemaphoreClient(label=...)``: the object's name (:data:`OBJECT_NAME`)."""

    OBJECT_NAME = "the object's name"


#: ``SemaphoreClient(label=OBJECT_NAME)``, the default: the client's label is the name its
#: Durable Object was reached by (``ctx.id.name``), when the runtime gives one.
OBJECT_NAME: Literal[_Label.OBJECT_NAME] = _Label.OBJECT_NAME


def _client_label(ctx: Any, label: str | None | Literal[_Label.OBJECT_NAME]) -> str | None:
    """The label a client sends (wire ``label``): ``label`` itself (checked with the wire's
    :func:`~semaphore.core.wire.label_problem`: a bad one raises :class:`ConfigurationError`
    naming ``label``), ``None`` for none, or by default the object's name
    (:func:`~semaphore.runtime.object_name`), cut to :data:`MAX_LABEL_LENGTH` characters (a
    name may be up to 1,024 bytes), and none if the name is not in the label alphabet."""
    if label is _Label.OBJECT_NAME:
        name = object_name(ctx)
        if name is None:
            return None
        name = name[:MAX_LABEL_LENGTH]
        return name if label_problem(name) is None else None
    if label is None:
        return None
    problem = label_problem(label)
    if problem is not None:
        raise ConfigurationError(f"label: {problem}", field="label")
    return label
