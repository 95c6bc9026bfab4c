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
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ..core.config import option_int
from ..core.wire import Blocked, BlockedReason, Demand
from ..errors import ConfigurationError
from ..runtime import Storage, TableWatch, migrate_tables
from ..scheduler import DurabilityScheduler
from ._client import SemaphoreClient
from ._queue_model import (
    _SCHEMA,
    QUEUE_TABLES,
    AdmitCallback,
    CheckCallback,
    DoneCallback,
    ItemState,
    Permit,
    PermitKind,
    QueueItem,
    WorkCallback,
    _batch_entries,
    _check_id,
    _check_options,
    _distinct_ids,
    _id_list,
    _install_schema,
    _payload_text,
)
from ._queue_permits import _QueuePermits
from ._queue_store import WAKEUPS

__all__ = ["ItemState", "PermitKind", "Permit", "QueueItem", "SemaphoreQueue", "QUEUE_TABLES"]

log = logging.getLogger("semaphore.queue")


class SemaphoreQueue(_QueuePermits):
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
        self._copies(client, on_done is not None)
        if self.TIMER in scheduler.participants:
            raise ConfigurationError(
                "scheduler: it already has a SemaphoreQueue; make one queue per object (one queue serves"
                " permit() and its callbacks, for every key) and keep it for the object's life", field="scheduler")
        scheduler.participate(self.TIMER, self._wake_due, self._on_wake)

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
        storage = ctx if isinstance(ctx, Storage) else Storage(ctx)
        SemaphoreClient.migrate(storage, to_version)
        if to_version is None:
            migrate_tables(storage, None, QUEUE_TABLES, _SCHEMA)
            DurabilityScheduler.remove_timers(storage, SemaphoreQueue.TIMER.rsplit(":", 1)[0] + ":")
        else:
            _install_schema(storage)

    async def enqueue(self, key: str, group: str, item_id: str, payload: Any = None) -> QueueItem:
        """Queue ``item_id`` for ``(key, group)`` and schedule a wake-up. Idempotent: an item id
        already known (queued, running or recently finished) is returned unchanged.
        ``payload`` must be strict JSON (no NaN or Infinity) of at most 1,000,000 bytes
        (:data:`MAX_PAYLOAD_BYTES`), else :class:`ConfigurationError` (field ``payload``)."""
        self._enqueue_checks(key, group)
        _check_id(item_id, "item_id")
        return (await self._enqueue(key, group, [(item_id, _payload_text(payload))]))[0]

    async def enqueue_many(self, key: str, group: str, item_ids: Sequence[str],
                           payloads: Sequence[Any] | None = None) -> list[QueueItem]:
        """Queue several items of ``(key, group)`` at once, oldest first in the order given: as
        :meth:`enqueue` for each (an id already known is returned unchanged), but in one storage
        transaction with one wake-up, and one SQL statement per batch of new items (about
        512 KB of ids and payloads each) instead of one per item. Returns the items in the
        order of ``item_ids``.

        :param payloads: one payload per id (``None``: every payload ``None``), each as
            :meth:`enqueue` takes it.

        At most :data:`MAX_BATCH_ITEMS` (10,000) items and :data:`MAX_BATCH_BYTES` (16 MB) of
        payloads per call. Everything is checked before anything is written;
        :class:`ConfigurationError` names the field (``item_ids[3]``, ``payloads[3]``): an id
        given twice, a string instead of a list of ids, payloads of another length or a batch
        over those bounds are refused."""
        self._enqueue_checks(key, group)
        _id_list(item_ids)
        if payloads is not None and (isinstance(payloads, (str, bytes)) or not isinstance(payloads, Sequence)):
            raise ConfigurationError(f"payloads: expected a list of payloads, one per item id, got"
                                     f" {type(payloads).__name__}", field="payloads")
        if payloads is not None and len(payloads) != len(item_ids):
            raise ConfigurationError(f"payloads: expected one payload per item id ({len(item_ids)}), got"
                                     f" {len(payloads)} payloads", field="payloads")
        return await self._enqueue(key, group, _batch_entries(item_ids, payloads))

    def _enqueue_checks(self, key: str, group: str) -> None:
        if self.on_admit is None and self.work is None:
            raise ConfigurationError("enqueue: this queue has neither on_admit nor work, so nothing would run"
                                     " the item; use permit() or give the queue a callback", field="on_admit")
        _check_id(key, "key")
        _check_id(group, "group")

    async def _enqueue(self, key: str, group: str, entries: list[tuple[str, str]]) -> list[QueueItem]:
        """:meth:`enqueue_many` of checked ``(item id, payload text)`` entries."""
        if not entries:
            return []
        self.ensure_schema()
        now = self._now()
        wake_at = self._kick_wake(now)
        items = self.storage.transaction(lambda: self._insert_many(key, group, entries, now, wake_at))
        # Pumped by this instance at once, in the background (also beside a request in flight,
        # maybe held, request_wait_ms, that the wake-up run may be waiting for), even if arming
        # the alarm fails.
        self._kick(key)
        await self.scheduler.arm()
        return items

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
            it takes; ``0``: a try, see below): raises :class:`~semaphore.errors.PermitTimeoutError` (with the holder's
            latest ``blocked`` entry) and withdraws the request, leaving nothing charged (a
            claim already sent is released as soon as the holder answers it; a grant answering
            a request already on its way is given back at once). Measured on the
            queue's clock (a :class:`~semaphore.testing.VirtualClock` drives it in tests).
        :param payload: JSON-compatible value stored with the item (shown in :meth:`items`).

        ``timeout_ms=0`` is a try, like ``asyncio.Semaphore`` with no waiting or Redisson's
        ``tryAcquire()``: a live lease serves it at once, else one request goes to the holder
        at once (``noWait``, SPEC R9b), which answers it from a round run at once; if that
        round serves it, the block runs (after the claim's confirming sync), else
        :class:`~semaphore.errors.PermitTimeoutError` is raised with the holder's ``blocked``
        entry. It never waits for a later round.

        Durable across eviction: the item belongs to this queue instance; if the object is
        evicted while the caller waits for or holds the permit, the next instance completes
        the item at its first pump of the key (at the latest ``orphan_check_ms`` later, by the
        alarm), so the permit is released and nothing is charged for a caller that is gone. A
        cancelled caller withdraws like a timeout. Needs no ``on_admit``."""
        text = self._permit_arguments(key, group, timeout_ms, payload)
        self.ensure_schema()
        now = self._now()
        item_id = f"permit:{self._token}:{secrets.token_hex(8)}"
        fut: asyncio.Future[QueueItem] = asyncio.get_running_loop().create_future()
        self._waiters[item_id] = fut
        self._permits.add(item_id)
        try:
            item = await self._acquire(fut, key, group, item_id, text, now, timeout_ms)
        except BaseException:
            self._waiters.pop(item_id, None)
            self._tries.remove(key, item_id)
            await self._withdraw(item_id)
            raise
        self._waiters.pop(item_id, None)
        self._tries.remove(key, item_id)
        try:
            yield item
        finally:
            await self._withdraw(item_id)

    def _permit_arguments(self, key: str, group: str, timeout_ms: int | None, payload: Any) -> str:
        """:meth:`permit`'s arguments checked (:class:`ConfigurationError` names the field; an
        abandoned instance, which admits nothing, R37, refuses at once rather than wait for
        ever); the payload's JSON text."""
        _check_id(key, "key")
        _check_id(group, "group")
        if timeout_ms is not None:
            option_int(timeout_ms, "timeout_ms", 0)
        if self._dead:
            raise ConfigurationError("permit: this queue instance was abandoned (abandon(), the object's "
                                     "eviction); ask the object's new instance")
        return _payload_text(payload)

    def blocked(self, key: str) -> dict[str, Blocked]:
        """Why ``key``'s queued items wait, per group: the holder's ``blocked`` entries of the
        last reply to a request of the key (SPEC R23). Empty when the holder served everything
        asked for (or was not asked yet)."""
        self.ensure_schema()
        return {str(r["group_name"]): Blocked(str(r["group_name"]), BlockedReason(str(r["reason"])),
                                              int(r["waiting"]))
                for r in self.marks.blocked_entries(key)}

    async def drain(self) -> None:
        """Wait until every callback task (``on_admit`` / ``work``) and background pump this
        instance started has finished (e.g. before a test looks at the result, or at shutdown)."""
        while True:
            tasks = [t for t in (*self._inflight.values(), *self._pumps()) if not t.done()]
            if not tasks:
                return
            await asyncio.gather(*tasks, return_exceptions=True)

    def abandon(self) -> None:
        """Cancel this instance's callback tasks, background pumps and waiting :meth:`permit`
        callers without writing anything, as the death of the object would (the test kit's
        eviction uses it). The durable state is left for the next instance; whatever of this one
        still runs (a cancellation a failed cleanup write swallowed) pumps nothing, and a later
        :meth:`permit` on it raises :class:`ConfigurationError` at once."""
        self._dead = True
        for task in (*self._inflight.values(), *self._pumps()):
            task.cancel()
        for fut in self._waiters.values():
            fut.cancel()
        self._inflight.clear()
        self._kicks.clear()
        self._rekick.clear()
        self._besides.clear()
        self._side_syncs.clear()
        self._side_requests.clear()
        self._waiters.clear()

    async def complete(self, item_id: str) -> bool:
        """The work of ``item_id`` finished: release its permit's slot (reported with the next
        sync) and mark it done (after the holder's crash expiry released slots of its grant on
        its own, only a slot no item still running holds, SPEC R15a). Before admission it
        cancels the item instead. Idempotent: returns False for an unknown or already finished
        item. An item still ``claiming`` (its claim sent, not
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

    async def complete_many(self, item_ids: Sequence[str]) -> list[bool]:
        """:meth:`complete` each item, in one storage transaction, with the items' rows read
        together and their completions written together: per key, one write for the items
        whose release needs no record (and one for the claims it cancels), and one per permit
        for the others, instead of one per item. Returns, per id in order, what
        :meth:`complete` would have for a valid id: False for an unknown or already finished
        item.

        Everything is checked before anything is written: at most :data:`MAX_BATCH_ITEMS` ids,
        each a valid id (:meth:`complete` answers False for an id no item can have; here it is
        refused), none given twice, none of a waiting or running :meth:`permit` call
        (:class:`ConfigurationError` names the field, ``item_ids[3]``).

        Then each item's ``on_done`` hook runs in its own transaction, as :meth:`complete`
        runs it: a hook that raises is logged and retried by the pump; every hook is tried,
        and if one returned an awaitable, its :class:`ConfigurationError` is raised after all
        of them (the items are completed all the same, so the list is not returned)."""
        _id_list(item_ids)
        ids = _distinct_ids(item_ids)
        for n, item_id in enumerate(ids):
            if item_id in self._permits:
                raise ConfigurationError(f"item_ids[{n}]: item {item_id!r} belongs to a waiting or running"
                                         " permit() call; it is completed when its caller leaves the block",
                                         field=f"item_ids[{n}]")
        return await self._complete_items(ids) if ids else []

    def item(self, item_id: str) -> QueueItem | None:
        """One item, or ``None``."""
        self.ensure_schema()
        rows = self._items.view(item_id=item_id)
        return QueueItem._from_row(rows[0]) if rows else None

    def items(self, key: str | None = None, state: ItemState | None = None) -> list[QueueItem]:
        """Items (of ``key``, in ``state``), in enqueue order."""
        self.ensure_schema()
        return [QueueItem._from_row(r)
                for r in self._items.view(key, None if state is None else ItemState(state).value)]

    def demand(self, key: str) -> list[Demand]:
        """What the queue asks the holder for, for ``key``, per group (``count``, ``oldestAt``):
        the queued items it may admit now (callback items only up to ``admit_concurrency``,
        oldest first; every :meth:`permit` item), :func:`~semaphore.core.queue_plan.demand_of`.

        At most the :data:`~semaphore.wire.MAX_LIST_LENGTH` (1,000) groups with the oldest
        queued item: a request may carry no more (R7), and the holder serves oldest demand
        first anyway (R21); the other groups are asked for once these are served."""
        self.ensure_schema()
        return self._demand(self._queued(key), self._admit_room(key))

    def wake_at(self, key: str) -> int | None:
        """When the queue next wants to work on ``key``, if at all."""
        self.ensure_schema()
        return self.marks.stored_wake(key)  # what is stored, not the instance's copy
