"""The queue's callbacks and permit hand-overs (SPEC R37): ``on_admit`` / ``work`` of each
admitted item (at least once, always under its one permit, retried after a failure or an
eviction), the hand-over of admitted :meth:`~semaphore.client.SemaphoreQueue.permit` items to
their waiting callers, the release of permit items whose caller is gone, reconciliation
(``check_running``), and an admitted item whose permit is gone going back to the queue."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable
from typing import Any, cast

from ..core import client_step
from ..core import queue_plan as plan
from ..core.client_step import KeyChanges
from ._queue_items import _QueueItemsPart
from ._queue_model import AdmitCallback, ItemState, QueueItem, _call

log = logging.getLogger("semaphore.queue")


class _QueueCallbacks(_QueueItemsPart):
    """Callbacks, hand-overs, orphans and reconciliation (see the module documentation)."""

    def _calls_due(self, key: str, now: int) -> list[QueueItem]:
        """The admitted callback items of ``key`` whose call is due now and not in flight, their
        attempt persisted (one write for all of them, before any is called, so an eviction
        during a call retries it after ``admit_retry_ms`` under the same permit): load →
        :func:`~semaphore.core.client_step.callbacks` → persist, in one transaction. On the way:
        a call still in flight here is due again only if this instance dies (its retry moved
        ``orphan_check_ms`` on); an item whose permit is gone goes back to the queue; a retry
        waits for an answer of the holder since it came due (if the permit is gone meanwhile,
        an operator's force-settle, that answer says so and the item is queued again instead
        of starting under it)."""
        # Loaded and decided at once, with no await between (nothing else runs meanwhile in the
        # object); written in one transaction only when there is something to write, so a pass
        # with nothing due costs no transaction.
        rows = self._live(key, ItemState.RUNNING, admitted=0, owner="")
        if not rows:  # nothing to look at: the key's permits are not even indexed (every pump passes here)
            return []
        changes = client_step.callbacks(rows, self._permits_of(key), now=now, in_flight=self._inflight,
                                        admit_retry_ms=self.admit_retry_ms, orphan_check_ms=self.orphan_check_ms)
        if not changes.empty:
            self.storage.transaction(lambda: self._persist(key, changes, now))
        self._log_gone(key, changes.gone)
        called = [r for r in (self._items.row(key, item_id) for item_id in changes.calls) if r is not None]
        return [QueueItem._from_row(r) for r in self._items.payloads(called)]

    def _permits_of(self, key: str) -> client_step.Permits:
        """The key's live grants and leases (what an admitted item's permit is)."""
        unit = self.client.unit(key)
        return client_step.Permits.of(unit.grants(), unit.leases())

    def _log_gone(self, key: str, item_ids: tuple[str, ...]) -> None:
        """Log the admitted items a step queued again because their permit is gone at the holder
        (the grant answered ``not_found``, the lease ``settled``: an operator's force-settle, or
        a lost holder storage). Normal operation never gets here (a grant or lease is gone only
        once everything under it was released)."""
        for item_id in item_ids:
            log.warning("the permit of item %r of key %r is gone at the holder (force-settled?); the item is"
                        " queued again for a fresh admission", item_id, key)

    def _admitted(self, key: str, items: list[QueueItem]) -> None:
        """The callbacks of ``items`` (of ``key``) returned: they count as admitted (those that
        still run), one write for all of them."""
        # one write (at most): atomic by itself, so no transaction of its own
        changes = client_step.callbacks_returned([self._items.row(key, item.item_id) for item in items])
        if not changes.empty:
            self._persist(key, changes, self._now())
        items.clear()

    async def _run_callbacks(self, key: str, now: int) -> bool:
        """Hand admitted permit items to their callers, and start the callback (``on_admit`` or
        ``work``) of every admitted item of ``key`` whose call is due and not in flight
        (:meth:`_calls_due`): a sync ``on_admit`` runs here, an awaitable (any ``work``) as a
        task of its own that this pump does not wait for (it writes the outcome itself).
        Returns whether a callback returned here (synchronously), freeing its slot."""
        self._hand_over(key)
        if self.on_admit is None and self.work is None:
            return False
        spawned = freed = False
        returned: list[QueueItem] = []  # admitted, written together before this pass next awaits
        try:
            for item in self._calls_due(key, now):
                if not plan.still_due(self._items.row(key, item.item_id), attempts=item.attempts,
                                      in_flight=self._inflight):
                    continue  # changed since (another pass started or finished it)
                try:
                    result = self.work(item) if self.work is not None else cast(AdmitCallback, self.on_admit)(item)
                except Exception as exc:  # noqa: BLE001 - a failing callback only delays its item
                    self._admitted(key, returned)
                    await self._callback_failed(item, exc)
                    continue
                if inspect.isawaitable(result):
                    self._inflight[item.item_id] = asyncio.ensure_future(self._await_callback(item, result))
                    spawned = True
                else:
                    returned.append(item)
                    if self.work is not None:  # a synchronous work function: it is done when it returns
                        self._admitted(key, returned)
                        await self._complete_logged(item.item_id)
                    freed = True
        finally:  # also when a callback raised what is not an Exception: those that returned count
            self._admitted(key, returned)
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
                self._alive()  # (an abandoned instance: the call was cut short, it does not count)
                await self._callback_failed(item, exc)
            else:
                self._alive()
                self._admitted(item.key, [item])
                if self.work is not None:
                    await self._complete_logged(item.item_id)
        finally:
            if self._inflight.get(item.item_id) is asyncio.current_task():
                del self._inflight[item.item_id]
        self._kick(item.key)

    async def _callback_failed(self, item: QueueItem, exc: Exception) -> None:
        """The callback of ``item`` raised ``exc``: its error kept, and it is called again later
        under the same permit, or (with ``work``, its calls used up) completed
        (:func:`~semaphore.core.queue_plan.after_failure`)."""
        failure = plan.after_failure(item.attempts, now=self._now(), admit_retry_ms=self.admit_retry_ms,
                                     work=self.work is not None, work_attempts=self.work_attempts)
        retry_at = failure.retry_at
        self._items.update(item.key, [item.item_id], {"error": repr(exc)[:1000], "retry_at": retry_at})
        if failure.complete:
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

    def _hand_over(self, key: str) -> None:
        """Give every admitted permit item of this instance to its waiting caller: load →
        :func:`~semaphore.core.client_step.handing_over` → persist, in one transaction that also
        reads the items handed over (so a read that fails admits none of them); then each caller
        gets its item."""
        waiting = {item_id for item_id, fut in self._waiters.items() if not fut.done()}
        now = self._now()
        rows = {str(r["item_id"]): r for r in self._live(key, ItemState.RUNNING, owner=self._token, admitted=0)}
        if not rows:  # as in _calls_due
            return
        changes = client_step.handing_over(list(rows.values()), self._permits_of(key), waiting=waiting)
        if changes.empty:  # as in _calls_due: no transaction for nothing
            return

        def body() -> list[QueueItem]:
            self._persist(key, changes, now)
            return [self._item_of({**rows[item_id], "admitted": 1}) for item_id in changes.admitted]

        handed = self.storage.transaction(body)
        self._log_gone(key, changes.gone)
        for item in handed:
            self._waiters[item.item_id].set_result(item)

    def _release_orphans(self, key: str, now: int) -> None:
        """Complete the live permit items of ``key`` whose caller is gone: items of another
        (dead) instance of this queue, and items of this one with no caller (a withdrawal that
        failed). Each is completed as :meth:`complete` does (its permit's slot released), so
        nothing stays charged for it. Items of live callers are marked checked (the next check
        is ``orphan_check_ms`` later). One transaction: load →
        :func:`~semaphore.core.client_step.orphans` → the completions' step → persist."""
        found = client_step.orphans(self._live(key, owner=True), owner=self._token, callers=self._permits,
                                    now=now, orphan_check_ms=self.orphan_check_ms)
        if found.empty:  # as in _calls_due: no transaction for nothing
            return

        def body() -> None:
            self._complete_keys(list(found.complete), now)
            self._persist(key, KeyChanges(checked=found.checked), now)

        self.storage.transaction(body)
        for item_id in found.complete:
            log.warning("permit item %r has no caller any more (evicted); releasing it", item_id)

    async def _reconcile(self, key: str, now: int) -> None:
        if self.reconcile_after_ms is None or self.check_running is None:
            return
        due = plan.reconcile_checks(self._live(key, ItemState.RUNNING, admitted=1, owner=""), now=now,
                                    reconcile_after_ms=self.reconcile_after_ms)
        rows = [r for r in (self._items.row(key, item_id) for item_id in due) if r is not None]
        for item in [QueueItem._from_row(r) for r in self._items.payloads(rows)]:
            try:
                running = bool(await _call(self.check_running, item))
            except asyncio.CancelledError:
                raise
            except Exception:
                self._alive()
                log.exception("check_running failed for item %r", item.item_id)
                running = True
            at = self._now()
            if running:
                self._items.update(key, [item.item_id], {"checked_at": at})
            else:
                log.warning("item %r is no longer running (completion notice lost); releasing it", item.item_id)
                self.storage.transaction(lambda: self._complete(item.item_id, at))  # noqa: B023 (run at once)
