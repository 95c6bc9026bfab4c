"""SemaphoreQueue: durable work items admitted under a shared semaphore (SPEC R37).

The queue lives in a client Durable Object next to a :class:`~semaphore.client.SemaphoreClient`
and the object's :class:`~semaphore.scheduler.DurabilityScheduler`::

    self.scheduler = DurabilityScheduler(ctx)
    self.client = SemaphoreClient(ctx, limits.with_(timeout(5_000)).transport(env))
    self.queue = SemaphoreQueue(client=self.client, scheduler=self.scheduler,
                                on_admit=self.start_job)

    async def alarm(self, info):                   # the object's alarm delegates
        await self.scheduler.alarm(info)

Life of an item (table ``durability_semaphore_client_items``)::

    queued --claim (grant)--> claiming --confirmed--> running --complete()--> done
       |  \\                      \\--refused (expired / not_found): back to queued
       |   \\--draw (lease)-------------------------> running
       \\--complete() before admission: done (cancelled)

* :meth:`SemaphoreQueue.enqueue` is idempotent on ``item_id``: enqueueing the same id again
  (a retried enqueue) returns the existing item and queues nothing.
* Demand per ``(key, group)`` is computed from the queued items (``count``, ``oldestAt``).
* **Grants** are admitted only after the claim is confirmed (SPEC R15a): the queue claims slots
  locally, sends a ``sync`` carrying the claim, and starts exactly the items whose slot the reply
  shows claimed with status ``active`` (or confirmed before an ``expired`` clamp). Items whose
  claim was refused go back to the queue with their original ``enqueued_at``.
* **Leases** are drawn locally with no round trip, one permit per item (one-shot, SPEC R34); a
  lease the holder retired stops drawing at once (SPEC R33), and the queue never draws within
  ``lease_margin_ms`` of a lease's expiry.
* **Admission** calls ``on_admit(item)`` (sync or async) *after* the item and its permit are
  persisted as ``running``. If the callback raises, or the object is evicted before it returns,
  the callback is called again later **for the same item under the same permit**, never under a
  second permit. The application makes ``on_admit`` idempotent per ``item.item_id`` (e.g. start a
  job whose id is the item id).
* **Finishing**: with ``on_done``, ``on_done(item)`` is called once for every item that turns
  ``done``, whichever way (``complete()`` of a queued or running item, a claim cancelled by
  ``complete()`` that the pump resolves later, reconciliation). Never inside a shared step: the
  step that marks the item ``done`` (and releases its permit) only records that its hook is
  pending (column ``done_pending``); ``complete()`` and the pump then call the hook in a storage
  transaction of its own that also clears the flag, so an outbox row written there commits with
  "hook ran" (and is durable once the hook returned). A hook that raises is logged, leaves only
  its item pending, and is retried by later pumps with backoff (1 s doubling to 5 min), without
  contacting the holder; no other item of the key waits for it.
* **Completion** comes back through :meth:`SemaphoreQueue.complete`, which releases the permit;
  the release rides on the next message to the holder, and a ``sync`` is sent just for releases
  only once the oldest has waited ``report_releases_within_ms`` (default 10 s). A message
  carries at most 1,000 reports per list (R7); when more are due, the pump sends the next window
  at once (``AppliedReply.more``), one message per 1,000, oldest first.
* **Leases first**: items of a group that all fit in its live leases are drawn from them (no
  round trip) even when a grant has unclaimed permits; those go back at ``claimBy`` (R15).
* **Surplus grants**: the unclaimed permits of a grant whose group has nothing queued or
  claiming and no lease (demand that went away while its request was on the way) are claimed
  and released at once, so they are not charged until ``claimBy``.
* **Leases in use** are heartbeated at half their lifetime even when nothing else happens; leases
  with nothing left to draw are stopped; when a reply is ``contended``, leases in groups with
  nothing queued are stopped (their undrawn permits go back, SPEC R29); idle leases are stopped
  shortly before they expire. A stopped lease is reported until the holder answers ``settled``.
* **Reconciliation** (optional): with ``reconcile_after_ms`` and ``check_running``, an item
  running longer than the bound is checked with ``check_running(item)`` (sync or async); if it
  returns False (the work is gone, its completion notice was lost) the item is completed.
* **Wake-ups**: per-key wake times in ``durability_semaphore_client_wakeups`` (request again at
  ``nextRequestAt``, retry after failures, claim confirmations, heartbeats, idle lease stops,
  admission retries, pending ``on_done`` hooks and reconciliation checks). The queue takes part
  in the scheduler's alarm as the participant ``durability_semaphore_queue:wake``, whose due time
  is read from that table (the earliest ``wake_at``): no timer row is kept in step with it; the
  scheduler has a row of that name only while the wake-up is failing (its backoff). A wake-up
  pumps every key that is due, and again any key that came due meanwhile (an enqueue during the
  wake-up, or work left due "right away"), so it leaves no key due at the time it ran for (the
  scheduler counts that as no progress, and backs it off). Everything lives in SQL, so a new
  instance after eviction continues where the old one stopped.

**Plan, then execute.** Every decision above (which claims resolve, what to claim and draw, which
leases to stop, when reports are due, which message to send, when to wake) is a pure function of
:mod:`semaphore.core.queue_plan` over a :class:`~semaphore.core.queue_plan.KeySnapshot` of the
key. This class only loads the snapshot, calls the planner and carries the plan out against its
own tables and the client's per-key unit of work (:meth:`SemaphoreClient.unit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

from ..core import queue_plan as plan
from ..core.config import option_int
from ..core.queue_plan import ClaimingItem, Exchange, KeySnapshot, PendingReleases, QueuedItem, Resolve
from ..core.wire import Blocked, BlockedReason, Demand, id_problem
from ..errors import ConfigurationError, PermitTimeoutError, SemaphoreError
from ..runtime import Storage, TableWatch, install_schema, migrate_tables
from ..scheduler import DurabilityScheduler
from ._client import AppliedReply, KeyUnit, SemaphoreClient
from ._queue_store import BLOCKED, PENDING, WAKEUPS, QueueMarks

__all__ = ["ItemState", "PermitKind", "Permit", "QueueItem", "SemaphoreQueue", "QUEUE_TABLES"]

log = logging.getLogger("semaphore.queue")

ITEMS = "durability_semaphore_client_items"
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
#: for callback items); ``error``: the last failure of the item's ``on_admit`` / ``work``.
_ADDED_COLUMNS = (
    (ITEMS, "done_pending", "INTEGER NOT NULL DEFAULT 0"),
    (ITEMS, "done_attempts", "INTEGER NOT NULL DEFAULT 0"),
    (ITEMS, "done_retry_at", "INTEGER NOT NULL DEFAULT 0"),
    (ITEMS, "owner", "TEXT NOT NULL DEFAULT ''"),
    (ITEMS, "error", "TEXT NOT NULL DEFAULT ''"),
)

# Created after the added columns (they index them). Partial: the pump finds pending hooks
# without walking done items; queries repeat the WHERE term literally (SQLite needs that).
_INDEXES = (
    f"CREATE INDEX IF NOT EXISTS {ITEMS}_done_pending ON {ITEMS}(key, done_retry_at) WHERE done_pending = 1",
    f"CREATE INDEX IF NOT EXISTS {ITEMS}_permits ON {ITEMS}(key, checked_at) WHERE owner != '' AND state != 'done'",
    f"CREATE INDEX IF NOT EXISTS {ITEMS}_permits_done ON {ITEMS}(key) WHERE state = 'done' AND owner != ''",
    f"CREATE INDEX IF NOT EXISTS {ITEMS}_seq ON {ITEMS}(seq)",  # MAX(seq) at every insert
)

#: The public item view: each item with its key's latest ``blocked`` entry for its group while
#: it is queued.
_VIEW = (f"SELECT i.*, b.reason AS blocked_reason, b.waiting AS blocked_waiting, b.at AS blocked_at"
         f" FROM {ITEMS} i LEFT JOIN {BLOCKED} b"
         " ON i.state = 'queued' AND b.key = i.key AND b.group_name = i.group_name")


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


def _payload_text(payload: Any) -> str:
    """``payload`` as the queue stores it: strict JSON (no NaN or Infinity, which no JSON
    reader takes back) of at most :data:`MAX_PAYLOAD_BYTES`; else :class:`ConfigurationError`
    (field ``payload``), before anything is written."""
    try:
        text = json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"payload: not strict JSON ({exc})", field="payload") from None
    size = len(text.encode("utf-8"))
    if size > MAX_PAYLOAD_BYTES:
        raise ConfigurationError(f"payload: {size} bytes of JSON, over the {MAX_PAYLOAD_BYTES} a queued item "
                                 "may carry (a Durable Object SQL row holds 2 MB)", field="payload")
    return text


def _check_id(value: Any, name: str) -> str:
    """``value`` if it is in the wire's id alphabet (:func:`semaphore.wire.id_problem`, R7), so
    a queued group can never make the holder refuse the queue's whole request."""
    problem = id_problem(value)
    if problem is not None:
        raise ConfigurationError(f"{name}: {problem}", field=name)
    return cast(str, value)  # id_problem found none: value is a str


class SemaphoreQueue:
    """Durable work items per ``(key, group)`` admitted under the semaphore of ``key``
    (SPEC R37). See the module documentation for the life of an item.

    One queue per object: make it in the object's constructor with the object's one scheduler
    (a second queue on the same scheduler raises :class:`ConfigurationError`); it serves
    :meth:`permit` and its callbacks for every key.

    :param client: the object's :class:`SemaphoreClient` (its storage must be this object's).
    :param scheduler: the object's :class:`DurabilityScheduler`; the object's ``alarm()`` must
        delegate to ``scheduler.alarm``. The queue takes part in it as the participant
        ``durability_semaphore_queue:wake`` (its due time: the earliest per-key wake time).
    :param on_admit: ``on_admit(item)`` (sync or async) starts the work of an admitted item;
        called at least once per admitted item, always under the item's one permit. An async
        callback (or one returning an awaitable) runs as a task of its own: the pump does not
        wait for it, so a slow callback holds up neither the key's other admitted items nor its
        heartbeats and syncs. ``None`` (the default) for a queue used only through
        :meth:`permit` (then :meth:`enqueue` refuses items). At most one of ``on_admit`` and
        ``work``.
    :param work: ``async work(item)`` (a plain function is done when it returns): the item's
        whole work, run as a task once the item holds its permit; when it returns the item is
        completed (its permit released), when it raises it is called again after
        ``admit_retry_ms`` under the same permit, up to ``work_attempts`` failed calls in all, and
        then the item is completed anyway (its permit released) with the error
        logged (ERROR) and kept in :attr:`QueueItem.error`. An eviction during it calls it again
        (at-least-once, like ``on_admit``: make it idempotent per ``item.item_id``). A call that
        never returns holds its permit as long as the object lives: bound its awaits.
    :param work_attempts: how many failed calls of ``work`` an item gets (default 3, at least 1);
        a call cut short by an eviction does not count.
    :param admit_concurrency: at most this many items of one key are admitted and waiting for
        their callback (``on_admit`` or ``work``) to return, claims awaiting confirmation
        included (default 1,000; ``None``: no bound). Further items stay queued, and the queue asks
        the holder for no more than it may admit, so no permit waits idle for a callback slot;
        when a callback returns, the key is pumped again. Items of :meth:`permit` are not
        bounded by it (each has its caller waiting).
    :param request_wait_ms: waiting requests (issue 13), ``0`` (default: off). Above 0, each
        request says the queue will wait this long for its answer (``waitMs``): a holder with
        ``hold_blocked_ms`` keeps a request its round cannot serve open until a later round
        serves it (at most the smaller of the two, then the next round the period allows), so
        the queue does not ask again every round. Meanwhile releases go at once (a sync of their
        own) and new demand in a request of its own, which the holder joins to the held one
        (R10); the key's other messages (lease heartbeats, idle lease stops) wait for the
        answer: keep it well below half the lease ``ttlMs`` and ``claim_ttl_ms``, and the
        transport's timeout above ``request_wait_ms + round_period_ms``.
    :param orphan_check_ms: how often the queue checks, while it lives, for work whose owner may
        be gone with an earlier instance (the object was evicted): a live :meth:`permit` item
        whose caller is gone is completed (its permit released), and an ``on_admit`` / ``work``
        call still running here has its retry moved this far on, so that if this instance dies
        the next one calls it again within this time (a call that dies within
        ``admit_retry_ms`` of its start is retried after ``admit_retry_ms``, as before). The
        check runs at every pump of the key and at least this often while such work lives
        (default 60 s: one local wake-up, no holder message).
    """

    #: The queue's participant in the scheduler's alarm (the name of its backoff row while it
    #: fails; an earlier release kept a timer row of this name in step with the wake times).
    TIMER = "durability_semaphore_queue:wake"
    #: A wake-up pumps the due keys at most this many times over: a key that comes due again
    #: meanwhile is pumped again in the same wake-up (see the module documentation).
    WAKE_PASSES = 4

    def __init__(
        self,
        *,
        client: SemaphoreClient,
        scheduler: DurabilityScheduler,
        on_admit: AdmitCallback | None = None,
        on_done: DoneCallback | None = None,
        work: WorkCallback | None = None,
        work_attempts: int = 3,
        admit_concurrency: int | None = 1000,
        orphan_check_ms: int = 60_000,
        leases: bool = True,
        clock: Callable[[], int] | None = None,
        retry_ms: int = 1000,
        claim_margin_ms: int = 500,
        lease_margin_ms: int = 1000,
        admit_retry_ms: int = 1000,
        reconcile_after_ms: int | None = None,
        check_running: CheckCallback | None = None,
        retention_ms: int = 86_400_000,
        report_releases_within_ms: int = 10_000,
        prefer_leases: bool = True,
        request_wait_ms: int = 0,
    ) -> None:
        _check_options(locals())
        self.client = client
        self.scheduler = scheduler
        self.storage: Storage = scheduler.storage
        self.on_admit = on_admit
        self.on_done = on_done
        self.work = work
        self.work_attempts = work_attempts
        self.admit_concurrency = admit_concurrency
        self.orphan_check_ms = orphan_check_ms
        self.leases = leases
        # The alarm's time: the queue's wake times are compared with the scheduler's clock (its
        # participant rule), so the queue reads the same clock (the client's must agree).
        self.clock: Callable[[], int] = clock or scheduler.clock
        self.retry_ms = retry_ms
        self.claim_margin_ms = claim_margin_ms
        self.lease_margin_ms = lease_margin_ms
        self.admit_retry_ms = admit_retry_ms
        self.reconcile_after_ms = reconcile_after_ms
        self.check_running = check_running
        self.retention_ms = retention_ms
        self.report_releases_within_ms = report_releases_within_ms
        self.prefer_leases = prefer_leases
        self.request_wait_ms = request_wait_ms
        self._init_memory()
        self._ready = False
        self._wakeups = TableWatch(self.storage, WAKEUPS)  # for the wake-up's next_due
        self.marks = QueueMarks(self.storage)
        if self.storage is not client.storage:  # a rollback of either forgets both copies
            self.storage.on_rollback(client.rows.forget)
            client.storage.on_rollback(self.marks.forget)
        if self.TIMER in scheduler.participants:
            raise ConfigurationError(
                "scheduler: it already has a SemaphoreQueue; make one queue per object (one queue serves"
                " permit() and its callbacks, for every key) and keep it for the object's life", field="scheduler")
        scheduler.participate(self.TIMER, self._wake_due, self._on_wake)

    def _init_memory(self) -> None:
        """The instance's in-memory state (lost with the object; nothing here must survive)."""
        #: per key: the pump's lock, and until when the holder is not asked again after a failure.
        self._locks: dict[str, asyncio.Lock] = {}
        self._backoff: dict[str, int] = {}
        #: per key: until when no request is sent (a pump that made 8 exchanges pauses them)
        self._paused: dict[str, int] = {}
        #: The owner of this instance's permit() items, and those whose caller waits or holds the
        #: permit; an item of another owner belongs to a dead instance of the object (the queue
        #: is one per object: one per scheduler) and is released.
        self._token = secrets.token_hex(12)
        self._permits: set[str] = set()
        #: keys whose request waits for its round now, and per key the background side syncs
        #: (:meth:`_side_syncs_of`)
        self._requesting: set[str] = set()
        self._side_syncs: dict[str, asyncio.Task[None]] = {}
        #: per key: the demand of the request in flight, and a background request sent while it
        #: may be held (:meth:`_start_side_request`)
        self._sent_demand: dict[str, list[Demand]] = {}
        self._side_requests: dict[str, asyncio.Task[None]] = {}
        #: Callback tasks in flight, per item id (strong references; never two for one item).
        self._inflight: dict[str, asyncio.Task[None]] = {}
        #: permit() callers waiting for their item's admission, per item id.
        self._waiters: dict[str, asyncio.Future[QueueItem]] = {}
        #: Background pumps (kicked by permit() and by returning callbacks), per key; a key in
        #: ``_rekick`` is pumped again once its running kick ends.
        self._kicks: dict[str, asyncio.Task[None]] = {}
        self._rekick: set[str] = set()
        self._dead = False

    # ================================================================== schema
    def ensure_schema(self) -> None:
        """Create the queue tables (and the client's) if missing; done automatically."""
        if self._ready:
            return
        self.client.ensure_schema()
        _install_schema(self.storage)
        self._wakeups.created()
        self._ready = True

    @staticmethod
    def migrate(ctx: Any, to_version: int | None) -> None:
        """``None`` removes the queue's schema: its tables, the client's tables, and the queue's
        rows in the scheduler's table (names starting ``durability_semaphore_queue:``: the
        wake-up's backoff, or a timer row of an earlier release; SPEC R3 for the client side), so
        a later alarm does not run a wake-up over dropped tables (with no wake-up table, the
        wake-up is never due). Other timers and the scheduler's table itself stay (it is shared
        with the holder and the application, and a live scheduler instance keeps using it;
        :meth:`DurabilityScheduler.migrate` drops it).
        The object's alarm is left as it is: when it fires the scheduler finds nothing of the
        queue's and re-arms for whatever timers are left. ``1`` creates the schema (done
        automatically on first use). Discard any live queue and client instances afterwards."""
        from ..scheduler import TABLE as SCHEDULER_TABLE

        storage = ctx if isinstance(ctx, Storage) else Storage(ctx)
        SemaphoreClient.migrate(storage, to_version)
        if to_version is None:
            migrate_tables(storage, None, QUEUE_TABLES, _SCHEMA)
        else:
            _install_schema(storage)
        if to_version is None and storage.one(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name = ?", SCHEDULER_TABLE):
            prefix = SemaphoreQueue.TIMER.rsplit(":", 1)[0] + ":"
            storage.exec(f"DELETE FROM {SCHEDULER_TABLE} WHERE substr(name, 1, ?) = ?", len(prefix), prefix)

    def _now(self) -> int:
        return int(self.clock())

    # ================================================================== public API
    async def enqueue(self, key: str, group: str, item_id: str, payload: Any = None) -> QueueItem:
        """Queue ``item_id`` for ``(key, group)`` and schedule a wake-up. Idempotent: an item id
        already known (queued, running or recently finished) is returned unchanged.
        ``payload`` must be strict JSON (no NaN or Infinity) of at most 1,000,000 bytes
        (:data:`MAX_PAYLOAD_BYTES`), else :class:`ConfigurationError` (field ``payload``)."""
        if self.on_admit is None and self.work is None:
            raise ConfigurationError("enqueue: this queue has neither on_admit nor work, so nothing would run"
                                     " the item; use permit() or give the queue a callback", field="on_admit")
        _check_id(key, "key")
        _check_id(group, "group")
        _check_id(item_id, "item_id")
        text = _payload_text(payload)
        self.ensure_schema()
        now = self._now()
        item = self.storage.transaction(lambda: self._insert(key, group, item_id, text, now, owner=""))
        await self.scheduler.arm()
        if self._requesting:
            # A request in flight (maybe held, request_wait_ms) may be the wake-up run's own:
            # pump this key directly, as permit() does, rather than after that run.
            self._kick(key)
        return item

    def _insert(self, key: str, group: str, item_id: str, payload: str, now: int, *, owner: str) -> QueueItem:
        """Queue a new item (or return the existing one of ``item_id``) and wake its key."""
        existing = self._item(item_id)
        if existing is not None:
            return existing
        row = self.storage.one(f"SELECT COALESCE(MAX(seq), 0) + 1 AS seq FROM {ITEMS}")
        seq = int(row["seq"]) if row else 1
        self.storage.exec(
            f"INSERT INTO {ITEMS}(item_id, key, group_name, payload, enqueued_at, seq, state, permit_kind,"
            " permit_id, slot, started_at, admitted, attempts, retry_at, checked_at, finished_at, cancel, owner)"
            " VALUES (?, ?, ?, ?, ?, ?, 'queued', '', '', 0, 0, 0, 0, 0, ?, 0, 0, ?)",
            item_id, key, group, payload, now, seq, now, owner)
        self._set_wake(key, now, earlier_only=True)
        item = self._item(item_id)
        assert item is not None
        return item

    @contextlib.asynccontextmanager
    async def permit(self, key: str, group: str = "default", *, timeout_ms: int | None = None,
                     payload: Any = None) -> AsyncIterator[QueueItem]:
        """Hold one permit of ``(key, group)`` for the body of an ``async with``::

            async with self.queue.permit(account, group="exports", timeout_ms=30_000):
                await export(job)

        Acquires one permit on the queue's own durable state: from a live lease of the group at
        once (no holder call, R34), else through the holder's next round and a confirmed claim
        (R15a), oldest first among the key's queued items. Yields the item (a
        :class:`QueueItem` with ``is_permit`` set and its :attr:`~QueueItem.permit`). Leaving
        the block, normally or by an exception, completes the item: its permit is released
        durably (the release rides on the next message to the holder, see
        ``report_releases_within_ms``).

        :param timeout_ms: give up after this long without a permit (``None``: wait as long as
            it takes): raises :class:`~semaphore.errors.PermitTimeoutError` (with the holder's
            latest ``blocked`` entry) and withdraws the request, leaving nothing charged (a
            claim already sent is released as soon as the holder answers it; a grant answering
            a request already on its way is given back at once). Measured on the
            queue's clock (a :class:`~semaphore.testing.VirtualClock` drives it in tests).
        :param payload: JSON-compatible value stored with the item (shown in :meth:`items`).

        Durable across eviction: the item belongs to this queue instance; if the object is
        evicted while the caller waits for or holds the permit, the next instance completes
        the item at its first pump of the key (at the latest ``orphan_check_ms`` later, by the
        alarm), so the permit is released and nothing is charged for a caller that is gone. A
        cancelled caller withdraws like a timeout. Needs no ``on_admit``."""
        _check_id(key, "key")
        _check_id(group, "group")
        if timeout_ms is not None:
            option_int(timeout_ms, "timeout_ms", 0)
        text = _payload_text(payload)
        self.ensure_schema()
        now = self._now()
        item_id = f"permit:{self._token}:{secrets.token_hex(8)}"
        fut: asyncio.Future[QueueItem] = asyncio.get_running_loop().create_future()
        self._waiters[item_id] = fut
        self._permits.add(item_id)
        try:
            self.storage.transaction(lambda: self._insert(key, group, item_id, text, now, owner=self._token))
            self.storage.transaction(lambda: self._admit_locally(key, now))  # a live lease serves it at once
            self._hand_over(key)
            await self.scheduler.arm()  # the item's wake-ups (its orphan check, a lease heartbeat)
            if not fut.done():
                self._kick(key)
            item = await self._await_permit(fut, key, group, now, timeout_ms)
        except BaseException:
            self._waiters.pop(item_id, None)
            await self._withdraw(item_id)
            raise
        self._waiters.pop(item_id, None)
        try:
            yield item
        finally:
            await self._withdraw(item_id)

    async def _await_permit(self, fut: asyncio.Future[QueueItem], key: str, group: str, now: int,
                            timeout_ms: int | None) -> QueueItem:
        if timeout_ms is None:
            return await fut
        sleep_until = getattr(self.clock, "sleep_until", None)
        timer: asyncio.Future[Any] = asyncio.ensure_future(
            sleep_until(now + timeout_ms) if sleep_until is not None else asyncio.sleep(timeout_ms / 1000))
        try:
            await asyncio.wait({fut, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
        if fut.done():
            return fut.result()
        blocked = self.blocked(key).get(group)
        why = "" if blocked is None else f" (holder: {blocked.reason.value}, {blocked.waiting} waiting)"
        raise PermitTimeoutError(f"no permit for key {key!r}, group {group!r} within {timeout_ms} ms{why}",
                                 blocked=blocked)

    async def _withdraw(self, item_id: str) -> None:
        """Complete a permit item (cancel it, or release its permit); never raises over the
        caller's own outcome (a failure is logged: the next instance or check releases it)."""
        if self._dead:
            return  # abandoned: a dead object writes nothing
        try:
            await self._complete_item(item_id)
        except Exception:  # noqa: BLE001 - the caller's exception (or result) wins
            log.exception("could not complete permit item %r; it is released by a later pump", item_id)
        finally:
            self._permits.discard(item_id)

    def blocked(self, key: str) -> dict[str, Blocked]:
        """Why ``key``'s queued items wait, per group: the holder's ``blocked`` entries of the
        last reply to a request of the key (SPEC R23). Empty when the holder served everything
        asked for (or was not asked yet)."""
        self.ensure_schema()
        return {str(r["group_name"]): Blocked(str(r["group_name"]), BlockedReason(str(r["reason"])),
                                              int(r["waiting"]))
                for r in self.storage.exec(f"SELECT group_name, reason, waiting FROM {BLOCKED} WHERE key = ?"
                                           " ORDER BY group_name", key)}

    async def drain(self) -> None:
        """Wait until every callback task (``on_admit`` / ``work``) and background pump this
        instance started has finished (e.g. before a test looks at the result, or at shutdown)."""
        while True:
            tasks = [t for t in (*self._inflight.values(), *self._kicks.values(), *self._side_syncs.values(),
                                 *self._side_requests.values()) if not t.done()]
            if not tasks:
                return
            await asyncio.gather(*tasks, return_exceptions=True)

    def abandon(self) -> None:
        """Cancel this instance's callback tasks, background pumps and waiting :meth:`permit`
        callers without writing anything, as the death of the object would (the test kit's
        eviction uses it). The durable state is left for the next instance."""
        self._dead = True
        for task in (*self._inflight.values(), *self._kicks.values(), *self._side_syncs.values(),
                     *self._side_requests.values()):
            task.cancel()
        for fut in self._waiters.values():
            fut.cancel()
        self._inflight.clear()
        self._kicks.clear()
        self._side_syncs.clear()
        self._side_requests.clear()
        self._waiters.clear()

    async def complete(self, item_id: str) -> bool:
        """The work of ``item_id`` finished: release its permit (reported with the next sync) and
        mark it done. Before admission it cancels the item instead. Idempotent: returns False
        for an unknown or already finished item. An item still ``claiming`` (its claim sent, not
        yet confirmed) is only marked cancelled: it stays ``claiming`` until the pump resolves
        the claim, and turns ``done`` then (``on_done`` is called there, not here). For an item
        it marks ``done``, ``on_done`` is called here, after the transition committed, in a
        transaction of its own; a hook that raises is logged and left to the pump (the item is
        done all the same); one that returns an awaitable raises :class:`ConfigurationError`.
        An item of a :meth:`permit` call that is still waiting or running is refused
        (:class:`ConfigurationError`): it is completed when its caller leaves the block."""
        if item_id in self._permits:
            raise ConfigurationError(
                f"complete: item {item_id!r} belongs to a waiting or running permit() call; it is completed"
                " when its caller leaves the block", field="item_id")
        return await self._complete_item(item_id)

    async def _complete_item(self, item_id: str) -> bool:
        self.ensure_schema()
        now = self._now()
        done = self.storage.transaction(lambda: self._complete(item_id, now))
        try:
            if done and self.on_done is not None:
                self._run_done_hook(item_id, raise_misuse=True)
        finally:
            if done:
                await self.scheduler.arm()
        if done and (self._requesting or self._paused):
            item = self._item(item_id)
            if item is not None:
                # A release ends the key's request pause: the next request is no longer one of
                # the identical ones the pause stops, and a waiter may take the freed permit.
                self._paused.pop(item.key, None)
                if item.key in self._requesting:
                    self._start_side_sync(item.key)
                # The key is pumped in the background: a freed lease slot is drawn beside its own
                # request (R34a), another key's admission does not wait for the wake-up run a
                # request in flight may hold; never inline, where a synchronous callback's own
                # complete() would re-enter.
                if self._requesting:
                    self._kick(item.key)
        return done

    def _start_side_sync(self, key: str) -> None:
        """Start :meth:`_side_syncs_of` for ``key`` in the background (the caller, e.g.
        :meth:`complete`, never waits for the holder) unless one runs (it looks again after its
        sync)."""
        if self._dead:
            return
        task = self._side_syncs.get(key)
        if task is None or task.done():  # a running one looks again after its sync
            self._side_syncs[key] = asyncio.ensure_future(self._side_syncs_of(key))

    def _start_side_request(self, key: str) -> None:
        """While the key's request may be held at the holder (``request_wait_ms``), demand that
        changed since it was sent (a new item, e.g. a :meth:`permit` of another group) goes in
        a request of its own in the background: the holder joins it to the held one (R10:
        both calls get the next round's answer), so it does not wait out the hold."""
        if self._dead or key not in self._requesting:
            return
        task = self._side_requests.get(key)
        if task is not None and not task.done():
            return
        snap = self._snapshot(key, self._now())
        demand = self._demand(snap.queued, snap.admit_room)
        sent = {d.group: d.count for d in self._sent_demand.get(key, ())}
        if all(d.count <= sent.get(d.group, 0) for d in demand):
            return  # nothing new: items drawn or finished meanwhile need no request of their own
        self._sent_demand[key] = demand
        self._side_requests[key] = asyncio.ensure_future(self._side_request(key, demand))

    async def _side_request(self, key: str, demand: list[Demand]) -> None:
        try:
            await self.client.request(key, demand, leases=self.leases, force=True,
                                      on_reply=self._on_request_reply, wait_ms=self.request_wait_ms)
        except SemaphoreError as exc:
            log.warning("holder %r: %s; the demand goes with the next request", key, exc)
        except Exception:  # noqa: BLE001 - the pump asks again; never an unretrieved error
            log.exception("side request for key %r failed", key)
        finally:
            self._side_requests.pop(key, None)
        self._kick(key)  # admit what the answer brought

    def _side_release_due(self, key: str) -> bool:
        """Releases of a contended key due now (R29, R37), judged without the request's own
        "contact the holder" mark (it is in flight: that is the request itself)."""
        now = self._now()
        if self._backoff.get(key, 0) > now:
            return False
        snap = self._snapshot(key, now)
        if not snap.key.contended and self.request_wait_ms <= 0:
            return False
        # A request that may be held waits because the key is blocked: treat it as contended.
        snap = replace(snap, key=replace(snap.key, needs_sync=False, contended=True))
        due = self.storage.transaction(lambda: self._report_due(key, snap))
        return due.at is not None and due.at <= now

    async def _side_syncs_of(self, key: str) -> None:
        """SPEC R37 decision: while the key's request waits for its round (the pump holds the
        key's lock meanwhile), releases due then (the last reply was contended) go in a
        ``sync`` of their own instead of waiting behind the request, so the round that request
        waits for already counts the capacity they free; again while more came due during the
        previous one (one in flight per key). A failure leaves them to the pump (logged)."""
        try:
            while key in self._requesting and not self._dead:
                recheck = plan.recheck_due(self._snapshot(key, self._now()), self._options())
                if not (recheck or self._side_release_due(key)):
                    return
                try:
                    await self.client.sync(key, leases=self.leases, on_reply=self._on_reply)
                except SemaphoreError as exc:
                    log.warning("holder %r: %s; the releases go after the waiting request", key, exc)
                    return
                if recheck:
                    self._kick(key)  # R33a: draw what the confirmed leases hold beside the request
        except Exception:  # noqa: BLE001 - the pump sends them later; never an unretrieved error
            log.exception("side sync for key %r failed", key)
        finally:
            self._side_syncs.pop(key, None)

    def item(self, item_id: str) -> QueueItem | None:
        """One item, or ``None``."""
        self.ensure_schema()
        r = self.storage.one(f"{_VIEW} WHERE i.item_id = ?", item_id)
        return None if r is None else QueueItem._from_row(r)

    def items(self, key: str | None = None, state: ItemState | None = None) -> list[QueueItem]:
        """Items (of ``key``, in ``state``), in enqueue order."""
        self.ensure_schema()
        query, args = f"{_VIEW} WHERE 1 = 1", []
        if key is not None:
            query += " AND i.key = ?"
            args.append(key)
        if state is not None:
            query += " AND i.state = ?"
            args.append(ItemState(state).value)
        return [QueueItem._from_row(r) for r in self.storage.exec(query + " ORDER BY i.seq", *args)]

    def demand(self, key: str) -> list[Demand]:
        """What the queue asks the holder for, for ``key``, per group (``count``, ``oldestAt``):
        the queued items it may admit now (callback items only up to ``admit_concurrency``,
        oldest first; every :meth:`permit` item), :func:`~semaphore.core.queue_plan.demand_of`.

        At most the :data:`~semaphore.wire.MAX_LIST_LENGTH` (1,000) groups with the oldest
        queued item: a request may carry no more (R7), and the holder serves oldest demand
        first anyway (R21); the other groups are asked for once these are served."""
        self.ensure_schema()
        return self._demand(self._queued(key), self._admit_room(key))

    def _demand(self, queued: tuple[QueuedItem, ...], room: int | None) -> list[Demand]:
        return [Demand(group, count, oldest) for group, count, oldest in plan.demand_of(queued, room)]

    def _queued(self, key: str) -> tuple[QueuedItem, ...]:
        return tuple(QueuedItem(str(r["item_id"]), str(r["group_name"]), int(r["seq"]), not r["owner"],
                                int(r["enqueued_at"]))
                     for r in self._rows_in(key, "queued", "item_id, group_name, seq, owner, enqueued_at"))

    def _admit_room(self, key: str) -> int | None:
        """How many more callback items of ``key`` may be admitted (``admit_concurrency``)."""
        if self.admit_concurrency is None:
            return None
        row = self.storage.one(
            f"SELECT COUNT(*) AS n FROM {ITEMS} WHERE key = ? AND owner = ''"
            " AND (state = 'claiming' OR (state = 'running' AND admitted = 0))", key)
        return max(0, self.admit_concurrency - (int(row["n"]) if row else 0))

    def wake_at(self, key: str) -> int | None:
        """When the queue next wants to work on ``key``, if at all."""
        self.ensure_schema()  # read from SQL: what is stored, not the instance's copy
        row = self.storage.one(f"SELECT wake_at FROM {WAKEUPS} WHERE key = ?", key)
        return None if row is None else int(row["wake_at"])

    async def pump(self, key: str) -> None:
        """Do everything that is due for ``key`` now: resolve claims, draw from leases, claim
        from grants (and confirm with a sync), start admitted items, heartbeat/stop leases,
        reconcile, and ask for permits when ``nextRequestAt`` has come (this waits for the
        holder's round). Then schedule the next wake-up. Called by the wake-up (the scheduler's
        alarm); may be called directly."""
        self.ensure_schema()
        lock = self._locks.setdefault(key, asyncio.Lock())
        if lock.locked() and key in self._requesting:
            # The key's pump waits for its request's round (or holds it, request_wait_ms): do
            # beside it what needs no holder and leave the rest to that pump, which schedules
            # the key's next wake-up once answered; waiting for it here would hold up the
            # wake-up run, and so every other key of this object, for as long.
            if self.request_wait_ms > 0:
                self._start_side_request(key)  # new demand must not wait out a held request
            await self._draw_beside_request(key)
            # Looks again then, should that pump die with its instance (its answer comes by then).
            at = self._now() + self.request_wait_ms + self.retry_ms
            self.storage.transaction(lambda: self._set_wake(key, at))
            await self.scheduler.arm()
            return
        async with lock:
            try:
                await self._pump(key)
            finally:
                now = self._now()
                self.storage.transaction(lambda: self._after_pump(key, now))
                await self.scheduler.arm()

    def _after_pump(self, key: str, now: int) -> None:
        """Schedule the key's next wake-up, and forget the holder's ``blocked`` word on it once
        nothing of the key is queued (nothing waits: the reason is stale)."""
        self._set_wake(key, self._next_wake(key, now))
        if self.marks.has_blocked(key) and self.storage.one(
                f"SELECT 1 AS x FROM {ITEMS} WHERE key = ? AND state = 'queued' LIMIT 1", key) is None:
            self.storage.exec(f"DELETE FROM {BLOCKED} WHERE key = ?", key)
            self.marks.set_blocked(key, False)

    # ================================================================== wake-ups
    def _wake_due(self) -> int | None:
        """The wake-up participant's ``next_due`` (SPEC R37): the earliest per-key wake time, one
        read; ``None`` when there is no wake-up table (not created yet, or removed by
        :meth:`migrate` ``(ctx, None)``: nothing to wake, and nothing re-created)."""
        row = self._wakeups.read(lambda: self.storage.one(f"SELECT MIN(wake_at) AS at FROM {WAKEUPS}"))
        return None if row is None or row["at"] is None else int(row["at"])

    async def _on_wake(self, name: str, due_at: int) -> None:
        """The wake-up participant's run: pump every key due at the time of the run (never before
        ``due_at``), again while keys are due by then (at most :attr:`WAKE_PASSES` passes: a pump
        may leave its key due at once), so that no key is left due at the time this run is for
        (the scheduler's no-progress rule). A pump that raises retries its key after
        ``retry_ms``. A queue migrated away since the alarm listed its work creates nothing."""
        if not self._ready and not self._wakeups.exists(fresh=True):
            return  # migrated away (only a row left by an earlier release is due): create nothing
        self.ensure_schema()
        # One bound for every pass: what is due at the time of this run (never before the time
        # the scheduler ran it for); keys that come due later get the next alarm.
        at = max(self._now(), int(due_at))
        for _ in range(self.WAKE_PASSES):
            keys = [str(r["key"]) for r in self.storage.exec(
                f"SELECT key FROM {WAKEUPS} WHERE wake_at <= ? ORDER BY wake_at, key", at)]
            if not keys:
                return
            for key in keys:
                await self._wake_key(key)

    async def _wake_key(self, key: str) -> None:
        try:
            await self.pump(key)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("queue pump for key %r failed", key)
            retry_at = self._now() + self.retry_ms
            self.storage.transaction(lambda: self._set_wake(key, retry_at))

    def _set_wake(self, key: str, at: int | None, *, earlier_only: bool = False) -> None:
        self.marks.set_wake(key, at, earlier_only=earlier_only)

    # ================================================================== items
    def _item(self, item_id: str) -> QueueItem | None:
        r = self.storage.one(f"SELECT * FROM {ITEMS} WHERE item_id = ?", item_id)
        return None if r is None else QueueItem._from_row(r)

    def _release_permit(self, item: QueueItem) -> None:
        p = item.permit
        if p is None:
            return
        unit = self.client.unit(item.key)
        if p.kind is PermitKind.GRANT:
            unit.release(p.id, 1)
        else:
            unit.release_lease(p.id, 1)

    def _complete(self, item_id: str, now: int) -> bool:
        item = self._item(item_id)
        if item is None or item.state is ItemState.DONE:
            return False
        if item.state is ItemState.CLAIMING:
            # The claim may be confirmed: resolve it first, then release at once.
            self.storage.exec(f"UPDATE {ITEMS} SET cancel = 1 WHERE item_id = ?", item_id)
        else:
            if item.state is ItemState.RUNNING:
                self._release_permit(item)
            self._finish(item.key, item.item_id, now)
        self._set_wake(item.key, now, earlier_only=True)
        return True

    def _finish(self, key: str, item_id: str, now: int) -> None:
        """Mark ``item`` done (inside the caller's transaction; the caller wakes the key). With
        ``on_done`` its hook is only recorded as pending, due at once: it runs later in a
        transaction of its own (:meth:`_run_done_hook`), never in this shared step, so a failing
        hook cannot roll back the key's admissions or replies."""
        self.storage.exec(  # a permit() item's caller knows when it is done: no hook for it
            f"UPDATE {ITEMS} SET state = 'done', finished_at = ?, done_pending = (owner = '' AND ?), done_attempts = 0,"
            " done_retry_at = ? WHERE item_id = ?", now, 0 if self.on_done is None else 1, now, item_id)
        self.marks.finished(key, now)

    def _run_done_hooks(self, key: str) -> None:
        """Call the pending ``on_done`` hooks of ``key`` that are due (each on its own)."""
        if self.on_done is None:
            return
        rows = self.storage.exec(
            f"SELECT item_id FROM {ITEMS} WHERE key = ? AND done_pending = 1 AND done_retry_at <= ?"
            " ORDER BY done_retry_at, seq", key, self._now())
        for r in rows:
            self._run_done_hook(str(r["item_id"]), raise_misuse=False)

    def _run_done_hook(self, item_id: str, *, raise_misuse: bool) -> None:
        """``on_done(item)`` for ``item_id`` if its hook is pending, in one transaction with
        clearing the flag. A failure rolls back the hook's writes, is logged and backed off; a
        hook returning an awaitable (:class:`ConfigurationError`) is re-raised if
        ``raise_misuse``."""
        hook = self.on_done
        assert hook is not None

        def body() -> None:
            r = self.storage.one(f"SELECT * FROM {ITEMS} WHERE item_id = ? AND done_pending = 1", item_id)
            if r is None:
                return  # not pending (any more)
            result = hook(QueueItem._from_row(r))
            if inspect.isawaitable(result):
                if inspect.iscoroutine(result):
                    result.close()  # never awaited: say so here instead of a RuntimeWarning
                raise ConfigurationError("on_done: returned an awaitable; it must be synchronous"
                                         " (it runs inside a storage transaction)", field="on_done")
            self.storage.exec(f"UPDATE {ITEMS} SET done_pending = 0 WHERE item_id = ?", item_id)

        try:
            self.storage.transaction(body)
        except Exception as exc:  # noqa: BLE001 - any hook failure only delays this item
            self._done_hook_failed(item_id, exc)
            if raise_misuse and isinstance(exc, ConfigurationError):
                raise

    def _done_hook_failed(self, item_id: str, exc: Exception) -> None:
        now = self._now()

        def body() -> tuple[int, int]:
            r = self.storage.one(f"SELECT key, done_attempts FROM {ITEMS} WHERE item_id = ?", item_id)
            if r is None:  # gone meanwhile (migrated away): nothing to retry
                return 0, 0
            attempts = int(r["done_attempts"]) + 1
            delay = DurabilityScheduler.backoff_ms(attempts)
            self.storage.exec(f"UPDATE {ITEMS} SET done_attempts = ?, done_retry_at = ? WHERE item_id = ?",
                              attempts, now + delay, item_id)
            self._set_wake(str(r["key"]), now + delay, earlier_only=True)
            return attempts, delay

        attempts, delay = self.storage.transaction(body)
        log.warning("on_done failed for item %r (attempt %d): %r; the item is done, its hook is"
                    " retried in %d ms", item_id, attempts, exc, delay, exc_info=exc)

    def _start(self, item_id: str, now: int) -> None:
        self.storage.exec(
            f"UPDATE {ITEMS} SET state = 'running', started_at = ?, admitted = 0, retry_at = ?, checked_at = ?"
            " WHERE item_id = ?", now, now, now, item_id)

    def _requeue(self, item_id: str) -> None:
        self.storage.exec(
            f"UPDATE {ITEMS} SET state = 'queued', permit_kind = '', permit_id = '', slot = 0 WHERE item_id = ?",
            item_id)

    # ================================================================== the pump
    # Executor of :mod:`semaphore.core.queue_plan`: load a snapshot of the key, let the planner
    # decide, carry the plan out against the queue's rows and the client's unit of work.
    def _options(self) -> plan.QueueOptions:
        return plan.QueueOptions(
            claim_margin_ms=self.claim_margin_ms, lease_margin_ms=self.lease_margin_ms,
            report_releases_within_ms=self.report_releases_within_ms, prefer_leases=self.prefer_leases,
            retention_ms=self.retention_ms, reconcile_after_ms=self.reconcile_after_ms,
            done_hook=self.on_done is not None, held_requests=self.request_wait_ms > 0)

    def _snapshot(self, key: str, now: int) -> KeySnapshot:
        """What the planner decides over for ``key`` at ``now`` (live rows only)."""
        unit = self.client.unit(key)
        queued = self._queued(key)
        claiming = tuple(ClaimingItem(str(r["item_id"]), str(r["group_name"]), int(r["seq"]), str(r["permit_id"]),
                                      int(r["slot"]), bool(r["cancel"]), not r["owner"], int(r["enqueued_at"]))
                         for r in self._rows_in(key, "claiming", "item_id, group_name, seq, permit_id, slot,"
                                                " cancel, owner, enqueued_at"))
        pending = self.marks.pending(key)
        return KeySnapshot(
            now, queued, claiming, tuple(unit.grants()), {c.grant_id: unit.grant(c.grant_id) for c in claiming},
            tuple(unit.leases()), unit.state(), pending,
            self._admit_room(key))

    def _rows_in(self, key: str, state: str, columns: str) -> list[dict[str, Any]]:
        return self.storage.exec(f"SELECT {columns} FROM {ITEMS} WHERE key = ? AND state = ? ORDER BY seq", key, state)

    def _resolve(self, unit: KeyUnit, resolutions: tuple[plan.Resolution, ...], wake_now: bool, now: int) -> None:
        """Carry out claim resolutions (SPEC R15a)."""
        for r in resolutions:
            if r.action is Resolve.START:
                self._start(r.item_id, now)
            elif r.action is Resolve.REQUEUE:
                self._requeue(r.item_id)
            else:
                if r.action is Resolve.RELEASE:
                    unit.release(r.grant_id, 1)
                self._finish(unit.key, r.item_id, now)
        if wake_now:
            self._set_wake(unit.key, now, earlier_only=True)  # a hook is due, even if this instance dies

    def _on_reply(self, applied: AppliedReply) -> None:
        # The holder has answered: admitted items still to be (re)started have their permit
        # checked by this reply (a retry waits for one, see _run_callbacks).
        self.storage.exec(f"UPDATE {ITEMS} SET checked_at = ? WHERE key = ? AND state = 'running' AND admitted = 0"
                          " AND owner = ''", applied.now, applied.key)
        self._apply_reply(applied)

    def _apply_reply(self, applied: AppliedReply) -> None:
        # What was pending went with this message, unless it could not carry every report (over
        # 1,000, R7): then the rest stays due since the same time, so the pump's next exchange
        # sends the next window at once (claims are due at once anyway: items stay claiming).
        if not applied.more:
            self.marks.clear_pending(applied.key)
        unit = self.client.unit(applied.key)
        step = plan.plan_reply(self._snapshot(applied.key, applied.now), self._options(),
                               contended=applied.contended)
        self._resolve(unit, step.resolutions, step.wake_now, applied.now)
        for lease_id in step.stops:
            unit.stop_lease(lease_id)

    def _on_request_reply(self, applied: AppliedReply) -> None:
        """A reply to a request: keep its ``blocked`` entries as the key's latest word on why
        its groups wait (one statement; replaces the previous reply's), then as any reply."""
        if self.marks.has_blocked(applied.key):
            self.storage.exec(f"DELETE FROM {BLOCKED} WHERE key = ?", applied.key)
        entries = [[b.group, b.reason.value, b.waiting] for b in applied.response.blocked]
        self.marks.set_blocked(applied.key, bool(entries))
        if entries:
            self.storage.exec(
                f"INSERT OR REPLACE INTO {BLOCKED}(key, group_name, reason, waiting, at)"
                " SELECT ?, json_extract(value, '$[0]'), json_extract(value, '$[1]'), json_extract(value, '$[2]'), ?"
                " FROM json_each(?)", applied.key, applied.now, json.dumps(entries))
        self._on_reply(applied)

    def _admit_locally(self, key: str, now: int, *, claims: bool = True) -> None:
        """Resolve claims, claim from grants (pending confirmation; not if ``claims`` is false),
        draw from leases, stop leases, give back grant permits nothing can use
        (:func:`~semaphore.core.queue_plan.plan_admission`)."""
        step = plan.plan_admission(self._snapshot(key, now), self._options(), with_claims=claims)
        unit = self.client.unit(key)
        self._resolve(unit, step.resolutions, step.wake_now, now)
        for claim in step.claims:
            for slot, item_id in zip(unit.claim(claim.grant_id, len(claim.item_ids)), claim.item_ids):
                self.storage.exec(
                    f"UPDATE {ITEMS} SET state = 'claiming', permit_kind = 'grant', permit_id = ?, slot = ?"
                    " WHERE item_id = ?", claim.grant_id, slot, item_id)
        for draw in step.draws:
            for item_id in draw.item_ids:
                drawn = unit.draw(draw.lease_id, margin_ms=self.lease_margin_ms, now=now)
                if drawn is None:
                    break
                self.storage.exec(
                    f"UPDATE {ITEMS} SET permit_kind = 'lease', permit_id = ?, slot = ? WHERE item_id = ?",
                    draw.lease_id, drawn, item_id)
                self._start(item_id, now)
        for lease_id in step.stops:
            unit.stop_lease(lease_id)
        for give_back in step.give_backs:  # no item runs under them: claimed to be released at once
            unit.release(give_back.grant_id, len(unit.claim(give_back.grant_id, give_back.count)))
        if step.purge_done_before is not None and self.marks.purge_due(ITEMS, step.purge_done_before):
            kept = "" if self.on_done is None else " AND done_pending = 0"  # its hook has not run yet
            self.storage.exec(f"DELETE FROM {ITEMS} WHERE state = 'done' AND finished_at < ?{kept}",
                              step.purge_done_before)
            self.marks.purged()
        # A finished permit() item is never enqueued again (its id is random): nothing to keep.
        if self.marks.permits_done(key):
            self.storage.exec(f"DELETE FROM {ITEMS} WHERE key = ? AND state = 'done' AND owner != ''", key)
            self.marks.permits_deleted(key)

    def _report_due(self, key: str, snap: KeySnapshot) -> plan.ReportDue:
        """:func:`~semaphore.core.queue_plan.report_due`, keeping the key's "releases waiting
        since" mark (durable, so evictions do not restart the wait)."""
        due = plan.report_due(snap, self._options())
        if due.pending is PendingReleases.START and snap.pending_since is None:
            self.marks.start_pending(key, snap.now)
        elif due.pending is PendingReleases.CLEAR and snap.pending_since is not None:
            self.marks.clear_pending(key)
        return due

    async def _pump(self, key: str) -> None:
        self._release_orphans(key, self._now())
        requested = False
        for _ in range(8):
            now = await self._admit_and_call(key)
            await self._reconcile(key, now)
            self._run_done_hooks(key)  # no holder message is ever sent for them
            if self._backoff.get(key, 0) > now:
                return
            snap = self._snapshot(key, now)
            demand = self._demand(snap.queued, snap.admit_room)
            paused = self._paused.get(key, 0) > now  # requests only: due reports still go
            exchange = plan.plan_exchange(snap, self._options(), demand=bool(demand) and not paused,
                                          due=self._report_due(key, snap))
            requested = requested or exchange is Exchange.REQUEST
            try:
                if exchange is Exchange.SYNC:
                    await self.client.sync(key, leases=self.leases, on_reply=self._on_reply)
                elif exchange is Exchange.REQUEST:
                    self._sent_demand[key] = demand
                    self._requesting.add(key)
                    try:
                        await self.client.request(key, demand, leases=self.leases, force=True,
                                                  on_reply=self._on_request_reply, wait_ms=self.request_wait_ms)
                    finally:
                        self._requesting.discard(key)
                else:
                    return
            except SemaphoreError as exc:
                if isinstance(exc, ConfigurationError):  # a wrong binding or holder class: not down
                    log.error("holder %r: %s; waiting permit() calls fail with it", key, exc)
                    for fut in [f for f in self._waiters.values() if not f.done()]:
                        fut.set_exception(exc)
                else:
                    log.warning("holder %r: %s; retrying in %d ms", key, exc, self.retry_ms)
                self._backoff[key] = self._now() + self.retry_ms
                return
            self._backoff.pop(key, None)
        # Still work left after 8 exchanges: pause instead of spinning. What the last reply
        # confirmed is still handed over and started now (a permit caller would otherwise wait
        # for an unrelated wake-up). Requests among them: pause only requests, so a report due
        # meanwhile (a contended release) still goes at once; syncs alone: pause everything.
        await self._admit_and_call(key)
        self._run_done_hooks(key)  # items the last reply finished
        if requested:
            self._paused[key] = self._now() + self.retry_ms
        else:
            self._backoff[key] = self._now() + self.retry_ms

    def _still_due(self, r: Mapping[str, Any]) -> bool:
        """The callback row ``r`` (read at the start of a pass) is still as read: running, not
        admitted, the same attempts. A pass that awaited (a failing callback's hook) may find
        an item another pass has started or finished meanwhile: it must not call it again."""
        now = self.storage.one(f"SELECT state, admitted, attempts FROM {ITEMS} WHERE item_id = ?", r["item_id"])
        return now is not None and str(now["state"]) == "running" and not now["admitted"] \
            and int(now["attempts"]) == int(r["attempts"])

    async def _draw_beside_request(self, key: str) -> None:
        """While the key's request waits for its round (or is held, ``request_wait_ms``), draw
        queued items from its live leases and start them: a draw needs no holder (R30), so
        it does not wait behind the request (a released slot of a reusable lease, R34a, is
        reused at once). Claims wait for the pump: a claim needs a confirming sync (R15a)."""
        now = self._now()
        self.storage.transaction(lambda: self._admit_locally(key, now, claims=False))
        await self._run_callbacks(key, now)
        if plan.recheck_due(self._snapshot(key, self._now()), self._options()):
            self._start_side_sync(key)  # R33a: the leases are confirmed live by a sync, then drawn

    async def _admit_and_call(self, key: str) -> int:
        """Admit locally (resolve claims, claim, draw) and start the due callbacks and hand-overs;
        again while a synchronous callback returned and so freed an ``admit_concurrency`` slot
        (it would otherwise wait for the next request period). Returns the time of the last
        step."""
        while True:
            now = self._now()
            self.storage.transaction(lambda: self._admit_locally(key, now))  # noqa: B023 (run at once)
            freed = await self._run_callbacks(key, now)
            if not freed or self.admit_concurrency is None:
                return now

    # ================================================================== callbacks and permits
    async def _run_callbacks(self, key: str, now: int) -> bool:
        """Hand admitted permit items to their callers, and start the callback (``on_admit`` or
        ``work``) of every admitted item of ``key`` whose call is due and not in flight: a sync
        ``on_admit`` runs here, an awaitable (any ``work``) as a task of its own that this pump
        does not wait for (it writes the outcome itself). The attempt is persisted first, so an
        eviction during the callback retries it after ``admit_retry_ms``, under the same
        permit. Returns whether a callback returned here (synchronously), freeing its slot."""
        self._hand_over(key)
        if self.on_admit is None and self.work is None:
            return False
        rows = self.storage.exec(
            f"SELECT * FROM {ITEMS} WHERE key = ? AND state = 'running' AND admitted = 0 AND owner = ''"
            " AND retry_at <= ? ORDER BY seq", key, now)
        spawned = freed = False
        for r in rows:
            item_id = str(r["item_id"])
            if item_id not in self._inflight and not self._still_due(r):
                continue  # changed since it was read (another pass started or finished it)
            if item_id not in self._inflight and self._requeue_if_gone(r):
                continue
            if item_id not in self._inflight and int(r["attempts"]) > 0 and int(r["checked_at"]) < int(r["retry_at"]):
                # A retry starts only once the holder has answered since it came due: if the
                # permit is gone meanwhile (an operator's force-settle), that answer says so and
                # the item goes back to the queue instead of starting under it.
                self.client.ask_holder(key)
                continue
            if item_id in self._inflight:  # still running here: due again only if this instance dies
                self.storage.exec(f"UPDATE {ITEMS} SET retry_at = ? WHERE item_id = ?", now + self.orphan_check_ms,
                                  item_id)
                continue
            self.storage.exec(f"UPDATE {ITEMS} SET attempts = attempts + 1, retry_at = ? WHERE item_id = ?",
                              now + self.admit_retry_ms, item_id)
            item = self._item(item_id) or QueueItem._from_row(r)
            try:
                result = self.work(item) if self.work is not None else cast(AdmitCallback, self.on_admit)(item)
            except Exception as exc:  # noqa: BLE001 - a failing callback only delays its item
                await self._callback_failed(item, exc)
                continue
            if inspect.isawaitable(result):
                self._inflight[item_id] = asyncio.ensure_future(self._await_callback(item, result))
                spawned = True
            else:
                self.storage.exec(f"UPDATE {ITEMS} SET admitted = 1 WHERE item_id = ? AND state = 'running'",
                                  item_id)
                if self.work is not None:  # a synchronous work function: it is done when it returns
                    await self._complete_logged(item_id)
                freed = True
        if spawned:
            await asyncio.sleep(0)  # let the new tasks take their first step (a quick one is done)
        return freed

    async def _await_callback(self, item: QueueItem, awaitable: Awaitable[Any]) -> None:
        """The task of one awaitable callback: on return the item counts as admitted (with
        ``work``: it is completed, its permit released); on failure it is retried later (or,
        with ``work``, completed after ``work_attempts`` calls). Then the key is pumped again:
        its callback slot is free."""
        try:
            try:
                await awaitable
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a failing callback only delays its item
                await self._callback_failed(item, exc)
            else:
                self.storage.exec(f"UPDATE {ITEMS} SET admitted = 1 WHERE item_id = ? AND state = 'running'",
                                  item.item_id)
                if self.work is not None:
                    await self._complete_logged(item.item_id)
        finally:
            if self._inflight.get(item.item_id) is asyncio.current_task():
                del self._inflight[item.item_id]
        self._kick(item.key)

    async def _callback_failed(self, item: QueueItem, exc: Exception) -> None:
        retry_at = self._now() + self.admit_retry_ms
        self.storage.exec(f"UPDATE {ITEMS} SET error = ?, retry_at = ? WHERE item_id = ?", repr(exc)[:1000], retry_at,
                          item.item_id)
        if self.work is not None and item.attempts >= self.work_attempts:
            log.error("work failed for item %r (attempt %d of %d): %r; completing it, its permit is released",
                      item.item_id, item.attempts, self.work_attempts, exc, exc_info=exc)
            await self._complete_logged(item.item_id)
            return
        what = "work" if self.work is not None else "on_admit"
        log.error("%s failed for item %r (attempt %d): %r; retrying in %d ms under the same permit",
                  what, item.item_id, item.attempts, exc, self.admit_retry_ms, exc_info=exc)
        self.storage.transaction(lambda: self._set_wake(item.key, retry_at, earlier_only=True))
        await self.scheduler.arm()

    async def _complete_logged(self, item_id: str) -> None:
        try:
            await self.complete(item_id)
        except Exception:  # noqa: BLE001 - e.g. an on_done that returned an awaitable: logged, left to the pump
            log.exception("completing item %r after its work failed; the pump retries its hook", item_id)

    def _requeue_if_gone(self, r: dict[str, Any]) -> bool:
        """An admitted item whose work has not started yet (its callback never returned, or its
        permit caller was not handed it) while its permit is gone at the holder (the grant
        answered ``not_found``, the lease ``settled``: an operator's force-settle, or a lost
        holder storage): back to the queue for a fresh admission, with its original age. Normal
        operation never gets here (a grant or lease is gone only once everything under it was
        released)."""
        unit = self.client.unit(str(r["key"]))
        if r["permit_kind"] == PermitKind.GRANT.value:
            grant = unit.grant(str(r["permit_id"]))
            gone = grant is None or grant.status == "gone"
        else:
            lease = unit.lease(str(r["permit_id"]))
            gone = lease is None or lease.status == "settled"
        if not gone:
            return False
        log.warning("the %s permit of item %r is gone at the holder (force-settled?); the item is queued again"
                    " for a fresh admission", r["permit_kind"], str(r["item_id"]))
        def body() -> None:
            self._requeue(str(r["item_id"]))
            # a fresh admission: the failed calls under the gone permit do not count (work_attempts)
            self.storage.exec(f"UPDATE {ITEMS} SET attempts = 0 WHERE item_id = ?", str(r["item_id"]))
            self._set_wake(str(r["key"]), self._now(), earlier_only=True)

        self.storage.transaction(body)
        return True

    def _hand_over(self, key: str) -> None:
        """Give every admitted permit item of this instance to its waiting caller."""
        rows = self.storage.exec(
            f"SELECT * FROM {ITEMS} WHERE key = ? AND owner = ? AND owner != '' AND state = 'running'"
            " AND admitted = 0", key, self._token)
        for r in rows:
            fut = self._waiters.get(str(r["item_id"]))
            if fut is None or fut.done():
                continue  # withdrawn meanwhile: its caller completes it
            if self._requeue_if_gone(r):
                continue
            self.storage.exec(f"UPDATE {ITEMS} SET admitted = 1 WHERE item_id = ?", str(r["item_id"]))
            fut.set_result(self._item(str(r["item_id"])) or QueueItem._from_row(r))

    def _release_orphans(self, key: str, now: int) -> None:
        """Complete the live permit items of ``key`` whose caller is gone: items of another
        (dead) instance of this queue, and items of this one with no caller (a withdrawal that
        failed). Their permits are released, nothing stays charged for them. Items of live
        callers are marked checked (the next check is ``orphan_check_ms`` later)."""
        rows = self.storage.exec(
            f"SELECT item_id, owner FROM {ITEMS} WHERE key = ? AND owner != '' AND state != 'done' AND cancel = 0",
            key)  # a cancelled one was withdrawn already: its claim is released once the holder answers
        for r in rows:
            item_id = str(r["item_id"])
            if r["owner"] == self._token and item_id in self._permits:
                continue
            log.warning("permit item %r has no caller any more (evicted); releasing it", item_id)
            self.storage.transaction(lambda: self._complete(item_id, now))  # noqa: B023 (run at once)
        self.storage.exec(
            f"UPDATE {ITEMS} SET checked_at = ? WHERE key = ? AND owner != '' AND state != 'done'"
            " AND owner = ? AND checked_at <= ?", now, key, self._token, now - self.orphan_check_ms)

    def _kick(self, key: str) -> None:
        """Pump ``key`` soon in the background (once more if a kicked pump is running already)."""
        if self._dead:
            return
        task = self._kicks.get(key)
        if task is not None and not task.done():
            self._rekick.add(key)
            return
        self._kicks[key] = asyncio.ensure_future(self._kick_loop(key))

    async def _kick_loop(self, key: str) -> None:
        while True:
            self._rekick.discard(key)
            await self._wake_key(key)
            if key not in self._rekick:
                return

    async def _reconcile(self, key: str, now: int) -> None:
        if self.reconcile_after_ms is None or self.check_running is None:
            return
        bound = self.reconcile_after_ms
        rows = self.storage.exec(
            f"SELECT * FROM {ITEMS} WHERE key = ? AND state = 'running' AND admitted = 1 AND owner = ''"
            " AND started_at <= ? AND checked_at <= ? ORDER BY seq", key, now - bound, now - bound)
        for r in rows:
            item = QueueItem._from_row(r)
            try:
                running = bool(await _call(self.check_running, item))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("check_running failed for item %r", item.item_id)
                running = True
            at = self._now()
            if running:
                self.storage.exec(f"UPDATE {ITEMS} SET checked_at = ? WHERE item_id = ?", at, item.item_id)
            else:
                log.warning("item %r is no longer running (completion notice lost); releasing it", item.item_id)
                self.storage.transaction(lambda: self._complete(item.item_id, at))  # noqa: B023 (run at once)

    def _min(self, column: str, where: str, key: str, *args: Any) -> int | None:
        row = self.storage.one(f"SELECT MIN({column}) AS at FROM {ITEMS} WHERE key = ? AND {where}", key, *args)
        return None if row is None or row["at"] is None else int(row["at"])

    def _next_wake(self, key: str, now: int) -> int | None:
        snap = self._snapshot(key, now)
        # Only this instance's live permit items need a check; another owner's are handled at
        # every pump's start (completed, or cancelled with a claim in flight, which the claim's
        # own network-paced wake-up resolves).
        checked = self._min("checked_at", "owner != '' AND state != 'done' AND owner = ? AND cancel = 0", key,
                            self._token)
        times = plan.ItemTimes(
            # a callback in flight is due at its retry_at too: if this instance died, the next one
            # calls it again; while it lives, each such wake-up moves retry_at orphan_check_ms on
            # (a due retry waiting for the holder's answer is woken by that exchange, network-paced)
            admit_retry_at=self._min("retry_at", "state = 'running' AND admitted = 0 AND owner = ''"
                                     " AND (attempts = 0 OR checked_at >= retry_at OR retry_at > ?)", key, now),
            done_retry_at=None if self.on_done is None else self._min("done_retry_at", "done_pending = 1", key),
            last_checked_at=None if self.reconcile_after_ms is None else self._min(
                "MAX(started_at, checked_at)", "state = 'running' AND admitted = 1 AND owner = ''", key),
            permit_check_at=None if checked is None else checked + self.orphan_check_ms)
        return plan.next_wake(snap, self._options(), backoff_until=self._backoff.get(key, 0), items=times,
                              requests_from=self._paused.get(key, 0),
                              due=self._report_due(key, snap))
