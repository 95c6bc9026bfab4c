"""The state every part of :class:`~semaphore.client.SemaphoreQueue` shares (SPEC R37): its
options, its collaborators (client, scheduler, storage), its in-memory copies of rows
(:class:`~._queue_store.QueueMarks`, :class:`~._item_store.QueueItems`) and its per-instance
memory; the queue is assembled from layers over it, each below the next
(:mod:`._queue_items`, :mod:`._queue_callbacks`, :mod:`._queue_pump`, :mod:`._queue_permits`,
:mod:`._queue`)."""

from __future__ import annotations

import abc
import asyncio
import logging
import secrets
from collections.abc import Callable

from ..core import queue_plan as plan
from ..core.wire import Blocked, Demand
from ..runtime import Storage, TableWatch
from ..scheduler import DurabilityScheduler
from ._client import SemaphoreClient
from ._item_rows import QueueItemStore
from ._item_store import ITEMS, QueueItems
from ._mark_rows import QueueMarkStore
from ._queue_model import AdmitCallback, CheckCallback, DoneCallback, QueueItem, WorkCallback, _install_schema
from ._queue_store import QueueMarks
from ._rows import ClientStore
from ._tries import Tries

log = logging.getLogger("semaphore.queue")


class _QueueBase(abc.ABC):
    """What the queue's layers share: set by :meth:`SemaphoreQueue.__init__`."""

    #: The queue's participant in the scheduler's alarm (the name of its backoff row while it
    #: fails; an earlier release kept a timer row of this name in step with the wake times).
    TIMER = "durability_semaphore_queue:wake"
    #: A wake-up pumps the due keys at most this many times over: a key that comes due again
    #: meanwhile is pumped again in the same wake-up (see the module documentation).
    WAKE_PASSES = 4

    client: SemaphoreClient
    scheduler: DurabilityScheduler
    storage: Storage
    on_admit: AdmitCallback | None
    on_done: DoneCallback | None
    work: WorkCallback | None
    work_attempts: int
    admit_concurrency: int | None
    orphan_check_ms: int
    leases: bool
    clock: Callable[[], int]
    retry_ms: int
    claim_margin_ms: int
    lease_margin_ms: int
    admit_retry_ms: int
    reconcile_after_ms: int | None
    check_running: CheckCallback | None
    retention_ms: int
    report_releases_within_ms: int
    prefer_leases: bool
    request_wait_ms: int
    marks: QueueMarkStore
    _items: QueueItemStore
    _ready: bool
    _wakeups: TableWatch

    def _copies(self, client: SemaphoreClient, done_hooks: bool) -> None:
        """The in-memory copies of the queue's rows (its marks, its items); a rollback of the
        queue's or the client's storage forgets every copy (theirs and the client's rows)."""
        marks = QueueMarks(self.storage)
        self._use_stores(client.rows, QueueItems(self.storage, done_hooks=done_hooks, on_load=marks.loaded,
                                                 before_delete=self.client.rows.fold_releases), marks)
        if self.storage is not client.storage:
            self.storage.on_rollback(client.rows.forget)
            client.storage.on_rollback(self.marks.forget)
            client.storage.on_rollback(self._items.forget)

    def _use_stores(self, rows: ClientStore, items: QueueItemStore, marks: QueueMarkStore) -> None:
        """Keep the client's rows, the queue's items and its marks in these stores: the SQL ones
        (:meth:`_copies`), or their in-memory twins (:class:`semaphore.testing.MemoryStores`,
        which the test kit's client objects can run over, so that a run over each can be
        compared message for message). Only before the queue's first use (its schema step tells
        the client's rows where releases are recorded)."""
        self.client.rows = rows
        self._items = items
        self.marks = marks

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
        #: Tries (``permit(timeout_ms=0)``, SPEC R9b): see :class:`~semaphore.client._tries.Tries`.
        self._tries = Tries()
        #: Background pumps (kicked by permit() and by returning callbacks), per key; a key in
        #: ``_rekick`` is pumped again once its running kick ends.
        self._kicks: dict[str, asyncio.Task[None]] = {}
        self._rekick: set[str] = set()
        #: Per key, a pump kicked while the key's kick waits for its request (its round, maybe
        #: held): it does beside that request what must not wait for the answer (SPEC R37).
        self._besides: dict[str, asyncio.Task[None]] = {}
        self._dead = False

    def ensure_schema(self) -> None:
        """Create the queue tables (and the client's) if missing; done automatically."""
        if self._ready:
            return
        self.client.ensure_schema()
        _install_schema(self.storage)
        if self.on_done is None:  # hooks left pending by a deployment that had one never run
            dropped = self._items.drop_hooks()
            self.marks.purged()  # those items may be purged now (a hint read before is stale)
            if dropped:
                log.warning("%d finished item(s) had an on_done hook pending, and this queue has no on_done:"
                            " their hooks are dropped (never run), the items purged after retention_ms", dropped)
        self.client.rows.records_releases_in(ITEMS)  # a finished item's release_n
        self._wakeups.created()
        self._ready = True

    def _pumps(self) -> list[asyncio.Task[None]]:
        """This instance's background pumps and side traffic (not its callbacks' tasks)."""
        return [*self._kicks.values(), *self._besides.values(), *self._side_syncs.values(),
                *self._side_requests.values()]

    def _now(self) -> int:
        return int(self.clock())

    def _alive(self) -> None:
        """Raise :class:`asyncio.CancelledError` on an abandoned instance (:meth:`abandon`):
        whatever of it still runs (a cancellation a callback or a failed cleanup turned into an
        ordinary exception) stops before it admits or writes over its stale copies."""
        if self._dead:
            raise asyncio.CancelledError()

    def _set_wake(self, key: str, at: int | None, *, earlier_only: bool = False) -> None:
        self.marks.set_wake(key, at, earlier_only=earlier_only)

    # The queue is the shell of :mod:`semaphore.core.queue_plan` and :mod:`semaphore.core.client_step`:
    # load a snapshot of the key, let them decide, persist what they decided.
    def _options(self) -> plan.QueueOptions:
        return plan.QueueOptions(
            claim_margin_ms=self.claim_margin_ms, lease_margin_ms=self.lease_margin_ms,
            report_releases_within_ms=self.report_releases_within_ms, prefer_leases=self.prefer_leases,
            retention_ms=self.retention_ms, reconcile_after_ms=self.reconcile_after_ms,
            done_hook=self.on_done is not None, held_requests=self.request_wait_ms > 0)

    # ------------------------------------------------------------------ layers above
    @abc.abstractmethod
    async def complete(self, item_id: str) -> bool:
        """:meth:`SemaphoreQueue.complete`."""

    @abc.abstractmethod
    def item(self, item_id: str) -> QueueItem | None:
        """:meth:`SemaphoreQueue.item`."""

    @abc.abstractmethod
    def blocked(self, key: str) -> dict[str, Blocked]:
        """:meth:`SemaphoreQueue.blocked`."""

    @abc.abstractmethod
    def _kick(self, key: str) -> None:
        """:meth:`~._queue_pump._QueuePump._kick`."""
