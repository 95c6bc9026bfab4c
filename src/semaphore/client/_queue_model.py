"""The queue's durable model: its tables and indexes, the item's states and view
(:class:`QueueItem`), the callback types and the checks of its options and inputs (SPEC R37).
No I/O besides the schema's installation (:func:`_install_schema`)."""

from __future__ import annotations

import enum
import inspect
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ..core.config import option_int
from ..core.wire import Blocked, BlockedReason, id_problem
from ..errors import ConfigurationError
from ..runtime import Storage, install_schema
from ._item_store import ITEMS
from ._queue_store import BLOCKED, PENDING, WAKEUPS

__all__ = ["ItemState", "PermitKind", "Permit", "QueueItem", "QUEUE_TABLES", "MAX_PAYLOAD_BYTES", "MAX_BATCH_ITEMS",
           "MAX_BATCH_BYTES"]

#: Tables owned by :class:`SemaphoreQueue`.
QUEUE_TABLES = (ITEMS, WAKEUPS, PENDING, BLOCKED)

_SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {ITEMS} ("
    " item_id TEXT PRIMARY KEY, key TEXT NOT NULL, group_name TEXT NOT NULL, payload TEXT NOT NULL,"
    " enqueued_at INTEGER NOT NULL, seq INTEGER NOT NULL, state TEXT NOT NULL,"
    " permit_kind TEXT NOT NULL, permit_id TEXT NOT NULL, slot INTEGER NOT NULL,"
    " started_at INTEGER NOT NULL, admitted INTEGER NOT NULL, attempts INTEGER NOT NULL,"
    " retry_at INTEGER NOT NULL, checked_at INTEGER NOT NULL, finished_at INTEGER NOT NULL,"
    " cancel INTEGER NOT NULL, done_pending INTEGER NOT NULL DEFAULT 0,"
    " done_attempts INTEGER NOT NULL DEFAULT 0, done_retry_at INTEGER NOT NULL DEFAULT 0)",
    f"CREATE INDEX IF NOT EXISTS {ITEMS}_state ON {ITEMS}(key, state, group_name, seq)",
    f"CREATE INDEX IF NOT EXISTS {ITEMS}_done ON {ITEMS}(finished_at) WHERE state = 'done'",
    f"CREATE TABLE IF NOT EXISTS {WAKEUPS} (key TEXT PRIMARY KEY, wake_at INTEGER NOT NULL)",
    f"CREATE TABLE IF NOT EXISTS {PENDING} (key TEXT PRIMARY KEY, since INTEGER NOT NULL)",
    f"CREATE TABLE IF NOT EXISTS {BLOCKED} (key TEXT NOT NULL, group_name TEXT NOT NULL, reason TEXT NOT NULL,"
    " waiting INTEGER NOT NULL, at INTEGER NOT NULL, PRIMARY KEY (key, group_name))",
)

#: Columns added after the first release: ``(table, column, declaration)``; tables created by an
#: older release gain them on first use (``ALTER TABLE ... ADD COLUMN``). ``done_pending``: the
#: item is done and its ``on_done`` hook has not run yet; ``done_attempts`` / ``done_retry_at``:
#: failed calls of the hook and when to call it again; ``owner``: for an item of
#: :meth:`SemaphoreQueue.permit`, the queue instance whose caller waits for it or holds it (empty
#: for callback items); ``error``: the last failure of the item's ``on_admit`` / ``work``;
#: ``release_n``: a finished callback item's release of its permit, recorded here instead of in
#: the permit's row (the permit's ``released`` count after it; 0: none recorded; SPEC R35).
_ADDED_COLUMNS = (
    (ITEMS, "done_pending", "INTEGER NOT NULL DEFAULT 0"),
    (ITEMS, "done_attempts", "INTEGER NOT NULL DEFAULT 0"),
    (ITEMS, "done_retry_at", "INTEGER NOT NULL DEFAULT 0"),
    (ITEMS, "owner", "TEXT NOT NULL DEFAULT ''"),
    (ITEMS, "error", "TEXT NOT NULL DEFAULT ''"),
    (ITEMS, "release_n", "INTEGER NOT NULL DEFAULT 0"),
)

# Created after the added columns (they index them). Partial: the pump finds pending hooks
# without walking done items; queries repeat the WHERE term literally (SQLite needs that).
_INDEXES = (
    f"CREATE INDEX IF NOT EXISTS {ITEMS}_done_pending ON {ITEMS}(key, done_retry_at) WHERE done_pending = 1",
    f"CREATE INDEX IF NOT EXISTS {ITEMS}_permits ON {ITEMS}(key, checked_at) WHERE owner != '' AND state != 'done'",
    f"CREATE INDEX IF NOT EXISTS {ITEMS}_permits_done ON {ITEMS}(key) WHERE state = 'done' AND owner != ''",
    f"CREATE INDEX IF NOT EXISTS {ITEMS}_seq ON {ITEMS}(seq)",  # MAX(seq) at every insert
    # a permit's highest recorded release, read with the client's rows (ClientRows)
    f"CREATE INDEX IF NOT EXISTS {ITEMS}_released ON {ITEMS}(key, permit_kind, permit_id, release_n)"
    " WHERE release_n > 0",
    # the earliest wake times (QueueMarks), and the keys due at a wake-up
    f"CREATE INDEX IF NOT EXISTS {WAKEUPS}_at ON {WAKEUPS}(wake_at, key)",
)


def _install_schema(storage: Storage) -> None:
    """The queue tables, their columns added since the first release, and their indexes
    (:func:`~semaphore.runtime.install_schema`)."""
    install_schema(storage, _SCHEMA, _ADDED_COLUMNS, _INDEXES)


class ItemState(str, enum.Enum):
    """Where an item is in its life (see the module documentation)."""

    QUEUED = "queued"
    CLAIMING = "claiming"
    RUNNING = "running"
    DONE = "done"


class PermitKind(str, enum.Enum):
    """What admitted an item: a confirmed grant claim or a lease draw."""

    GRANT = "grant"
    LEASE = "lease"


@dataclass(frozen=True)
class Permit:
    """The one permit an item runs (or will run) under: slot ``slot`` of grant or lease ``id``."""

    kind: PermitKind
    id: str
    slot: int


@dataclass(frozen=True)
class QueueItem:
    """A durable work item.

    :ivar payload: the JSON-compatible value given to :meth:`SemaphoreQueue.enqueue`.
    :ivar permit: set once the item claimed or drew a permit.
    :ivar attempts: how many times ``on_admit`` (or ``work``) has been called for it.
    :ivar admitted: ``on_admit`` returned for it (the application has the work); for an item of
        :meth:`SemaphoreQueue.permit`: its caller holds the permit.
    :ivar blocked: while the item is queued, why its group waits: the holder's latest ``blocked``
        entry for ``(key, group)`` (reason ``limit``, ``group_limit``, ``not_permitted`` or
        ``limit_resolution_error``, and how many of the key's items of the group it left
        waiting), from the last reply to a request; ``None`` when the holder has not said (no
        round yet, or the last round served the group in full).
    :ivar blocked_at: when that reply was applied (epoch ms), or ``None``.
    :ivar error: the last failure of ``on_admit`` / ``work`` for the item (``repr`` of the
        exception), or ``None``.
    :ivar is_permit: the item of a :meth:`SemaphoreQueue.permit` call (no callback runs for it).
    """

    item_id: str
    key: str
    group: str
    payload: Any
    enqueued_at: int
    state: ItemState
    permit: Permit | None
    started_at: int
    attempts: int
    admitted: bool
    finished_at: int
    blocked: Blocked | None = None
    blocked_at: int | None = None
    error: str | None = None
    is_permit: bool = False

    @classmethod
    def _from_row(cls, r: dict[str, Any]) -> QueueItem:
        permit = None
        if r["permit_kind"]:
            permit = Permit(PermitKind(str(r["permit_kind"])), str(r["permit_id"]), int(r["slot"]))
        blocked, blocked_at = None, None
        if r.get("blocked_reason") is not None:
            blocked = Blocked(str(r["group_name"]), BlockedReason(str(r["blocked_reason"])),
                              int(r["blocked_waiting"]))
            blocked_at = int(r["blocked_at"])
        return cls(str(r["item_id"]), str(r["key"]), str(r["group_name"]), json.loads(str(r["payload"])),
                   int(r["enqueued_at"]), ItemState(str(r["state"])), permit, int(r["started_at"]),
                   int(r["attempts"]), bool(r["admitted"]), int(r["finished_at"]), blocked, blocked_at,
                   str(r.get("error") or "") or None, bool(r.get("owner")))


AdmitCallback = Callable[[QueueItem], Awaitable[Any] | Any]
WorkCallback = Callable[[QueueItem], Awaitable[Any]]
DoneCallback = Callable[[QueueItem], Any]
CheckCallback = Callable[[QueueItem], Awaitable[bool] | bool]


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


def _check_done_hook(on_done: Any) -> None:
    """``on_done`` runs inside a storage transaction, so it must be a plain function: a coroutine
    function would only create a coroutine that never runs."""
    if on_done is None:
        return
    if not callable(on_done):
        raise ConfigurationError("on_done: must be callable or None", field="on_done")
    if inspect.iscoroutinefunction(on_done) or inspect.isasyncgenfunction(on_done) \
            or inspect.iscoroutinefunction(getattr(on_done, "__call__", None)):  # noqa: B004 (an async __call__)
        raise ConfigurationError("on_done: must be synchronous (it runs inside a storage transaction);"
                                 " an async def would never run", field="on_done")


def _check_options(o: dict[str, Any]) -> None:
    """Raise :class:`ConfigurationError` naming the first invalid option of the queue."""
    on_admit, work, on_done = o["on_admit"], o["work"], o["on_done"]
    report_releases_within_ms, reconcile_after_ms = o["report_releases_within_ms"], o["reconcile_after_ms"]
    if on_admit is not None and not callable(on_admit):
        raise ConfigurationError("on_admit: must be callable or None", field="on_admit")
    if work is not None and not callable(work):
        raise ConfigurationError("work: must be an async callable or None", field="work")
    if work is not None and on_admit is not None:
        raise ConfigurationError("work: give on_admit or work, not both", field="work")
    option_int(o["work_attempts"], "work_attempts", 1)
    option_int(o["orphan_check_ms"], "orphan_check_ms", 1)
    if o["admit_concurrency"] is not None:
        option_int(o["admit_concurrency"], "admit_concurrency", 1)
    _check_done_hook(on_done)
    if isinstance(report_releases_within_ms, bool) or not isinstance(report_releases_within_ms, int) \
            or report_releases_within_ms < 0:
        raise ConfigurationError("report_releases_within_ms: must be a non-negative integer",
                                 field="report_releases_within_ms")
    for name, minimum in (("retry_ms", 1), ("admit_retry_ms", 1), ("claim_margin_ms", 0),
                          ("lease_margin_ms", 0), ("retention_ms", 0), ("request_wait_ms", 0)):
        option_int(o[name], name, minimum)  # a retry of 0 ms would keep the wake-up due
    if reconcile_after_ms is not None:
        option_int(reconcile_after_ms, "reconcile_after_ms", 1)
    if (reconcile_after_ms is None) != (o["check_running"] is None):
        raise ConfigurationError("reconcile_after_ms and check_running go together", field="check_running")


#: Most bytes of an item's payload as stored (JSON, UTF-8): a row of Durable Object SQL holds
#: at most 2 MB, and the item's other columns need room too.
MAX_PAYLOAD_BYTES = 1_000_000
#: Most items one :meth:`~semaphore.client.SemaphoreQueue.enqueue_many` call takes, and most bytes
#: of their payloads (JSON, UTF-8): the batch is written in one transaction, held in memory
#: meanwhile (an isolate has 128 MB), and 10,000 small items take a few tenths of a second of
#: CPU. Split a larger batch into several calls.
MAX_BATCH_ITEMS = 10_000
MAX_BATCH_BYTES = 16_000_000


def _payload_text(payload: Any, field: str = "payload") -> str:
    """``payload`` as the queue stores it: strict JSON (no NaN or Infinity, which no JSON
    reader takes back) of at most :data:`MAX_PAYLOAD_BYTES`; else :class:`ConfigurationError`
    (naming ``field``), before anything is written."""
    try:
        text = json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"{field}: not strict JSON ({exc})", field=field) from None
    size = len(text.encode("utf-8"))
    if size > MAX_PAYLOAD_BYTES:
        raise ConfigurationError(f"{field}: {size} bytes of JSON, over the {MAX_PAYLOAD_BYTES} a queued item "
                                 "may carry (a Durable Object SQL row holds 2 MB)", field=field)
    return text


def _check_id(value: Any, name: str) -> str:
    """``value`` if it is in the wire's id alphabet (:func:`semaphore.wire.id_problem`, R7), so
    a queued group can never make the holder refuse the queue's whole request."""
    problem = id_problem(value)
    if problem is not None:
        raise ConfigurationError(f"{name}: {problem}", field=name)
    return cast(str, value)  # id_problem found none: value is a str


def _id_list(item_ids: Any) -> None:
    """Refuse ``item_ids`` that is not a list of at most :data:`MAX_BATCH_ITEMS` (a string
    included: it is not a list of ids)."""
    if isinstance(item_ids, (str, bytes)) or not isinstance(item_ids, Sequence):
        raise ConfigurationError(f"item_ids: expected a list of item ids, got {type(item_ids).__name__}",
                                 field="item_ids")
    if len(item_ids) > MAX_BATCH_ITEMS:
        raise ConfigurationError(f"item_ids: {len(item_ids)} items, over the {MAX_BATCH_ITEMS} one call"
                                 " takes; split the batch", field="item_ids")


def _distinct_id(item_id: Any, n: int, seen: set[str]) -> None:
    """Check ``item_ids[n]``: a valid id, not in ``seen`` (then added to it)."""
    _check_id(item_id, f"item_ids[{n}]")
    if item_id in seen:
        raise ConfigurationError(f"item_ids[{n}]: {item_id!r} is given twice", field=f"item_ids[{n}]")
    seen.add(item_id)


def _distinct_ids(item_ids: Sequence[str]) -> list[str]:
    """The ids of a checked :func:`_id_list`, each checked, none given twice."""
    seen: set[str] = set()
    for n, item_id in enumerate(item_ids):
        _distinct_id(item_id, n, seen)
    return list(item_ids)


def _batch_entries(item_ids: Sequence[str], payloads: Sequence[Any] | None) -> list[tuple[str, str]]:
    """:meth:`SemaphoreQueue.enqueue_many`'s ``(item id, payload text)`` entries, each id and
    payload checked, no id twice, at most :data:`MAX_BATCH_BYTES` of payloads."""
    seen: set[str] = set()
    entries: list[tuple[str, str]] = []
    size = 0
    for n, item_id in enumerate(item_ids):  # each id, then its payload (the first fault is named)
        _distinct_id(item_id, n, seen)
        text = _payload_text(None if payloads is None else payloads[n], f"payloads[{n}]")
        size += len(text.encode("utf-8"))
        if size > MAX_BATCH_BYTES:
            raise ConfigurationError(f"payloads[{n}]: the batch's payloads pass {MAX_BATCH_BYTES} bytes of JSON,"
                                     " the most one call takes; split the batch", field="payloads")
        entries.append((item_id, text))
    return entries
