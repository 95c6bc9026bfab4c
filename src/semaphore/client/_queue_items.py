"""The queue's item transitions (SPEC R37): insert, start, requeue, finish (with its
``on_done`` hook recorded, run and retried), the permit release of a completed item, and the
reads the pump decides over (queued items, callback room), all through the key's copy of its
items (:class:`~._item_store.QueueItems`)."""

from __future__ import annotations

import inspect
import logging
from typing import Any

from ..core import client_step
from ..core import queue_plan as plan
from ..core.client_step import KeyChanges
from ..core.queue_plan import ClaimingItem, QueuedItem
from ..core.wire import Demand
from ..errors import ConfigurationError
from ..scheduler import DurabilityScheduler
from ._item_store import Add, DonePending
from ._queue_base import _QueueBase
from ._queue_model import ItemState, PermitKind, QueueItem

log = logging.getLogger("semaphore.queue")


def _new_row(key: str, group: str, item_id: str, payload: str, now: int, owner: str) -> dict[str, Any]:
    """A queued item's row (every column but ``seq``)."""
    return {"item_id": item_id, "key": key, "group_name": group, "payload": payload, "enqueued_at": now,
            "state": ItemState.QUEUED.value, "permit_kind": "", "permit_id": "", "slot": 0, "started_at": 0,
            "admitted": 0, "attempts": 0, "retry_at": 0, "checked_at": now, "finished_at": 0, "cancel": 0,
            "done_pending": 0, "done_attempts": 0, "done_retry_at": 0, "owner": owner, "error": "", "release_n": 0}


class _QueueItemsPart(_QueueBase):
    """Item transitions and reads (see the module documentation)."""

    def _insert(self, key: str, group: str, item_id: str, payload: str, now: int, *, owner: str,
                wake_at: int | None = None) -> QueueItem:
        """Queue a new item (or return the existing one of ``item_id``) and wake its key (its
        durable wake-up ``wake_at``, default ``now``, at the latest)."""
        row = self._items.insert_new(_new_row(key, group, item_id, payload, now, owner))
        if row is None:  # known already: returned unchanged
            existing = self._items.find(item_id)
            assert existing is not None
            return self._item_of(existing)
        self._set_wake(key, now if wake_at is None else wake_at, earlier_only=True)
        return QueueItem._from_row(row)

    def _insert_many(self, key: str, group: str, entries: list[tuple[str, str]], now: int,
                     wake_at: int) -> list[QueueItem]:
        """:meth:`_insert` of callback items ``(item id, payload)`` of ``(key, group)``, in their
        order, with one wake-up (:meth:`QueueItems.insert_many`: one statement per batch)."""
        new = {str(r["item_id"]): r for r in self._items.insert_many(
            [_new_row(key, group, item_id, payload, now, "") for item_id, payload in entries])}
        if new:
            self._set_wake(key, wake_at, earlier_only=True)
        known = self._items.find_many([item_id for item_id, _ in entries if item_id not in new])
        rows = self._items.payloads(list(known.values()))  # an existing item returned unchanged
        existing = {str(r["item_id"]): QueueItem._from_row(r) for r in rows}
        return [QueueItem._from_row(new[i]) if i in new else existing[i] for i, _ in entries]

    def _item_of(self, row: dict[str, Any]) -> QueueItem:
        """The item of a row of :attr:`_items` (its payload read if the copy does not keep it)."""
        return QueueItem._from_row(self._items.payloads([row])[0])

    def _release_permit(self, item: client_step.CompletingItem, *, record: bool = False) -> int:
        """Release a slot of the item's permit. ``record``: the caller records the release in
        the item's row (``release_n``, the value returned; 0: nothing to record), so the
        permit's row need not be written for it (SPEC R35)."""
        unit = self.client.unit(item.key)
        if record:
            return unit.release_recorded(item.permit_kind, item.permit_id)
        if item.permit_kind == PermitKind.GRANT.value:
            unit.release(item.permit_id, 1)
        else:
            unit.release_lease(item.permit_id, 1)
        return 0

    def _complete(self, item_id: str, now: int) -> bool:
        return self._complete_key(item_id, now) is not None

    def _complete_key(self, item_id: str, now: int, wake_at: int | None = None) -> str | None:
        """Complete ``item_id`` (see :meth:`complete`); its key, or ``None`` when it is unknown
        or finished already. The key's durable wake-up is ``wake_at`` (default ``now``) at the
        latest. A callback item's release is recorded in its own row, written anyway, when its
        permit's row has something to report already (:meth:`_release_permit`); a
        :meth:`permit` item's row is deleted soon after, so its permit's row is written."""
        return self._complete_keys([item_id], now, wake_at)[0]

    def _complete_keys(self, item_ids: list[str], now: int, wake_at: int | None = None) -> list[str | None]:
        """:meth:`_complete_key` for each of ``item_ids`` (distinct), in the caller's transaction:
        load → step (:func:`~semaphore.core.client_step.completions`) → write. Their rows are
        read together and their finishes written together: per key, one write for the items
        that record no release (and one for the claims it cancels), and one per permit for those
        that do, each recording the highest release of its permit (what a purge folds into the
        permit's row, SPEC R35, is the highest an item of the permit records: the last of them,
        had each been completed on its own)."""
        steps = client_step.completions(self._completion_load(self._found(item_ids)))
        recorded = {c.item.item_id: self._release_permit(c.item, record=c.record) for c in steps if c.release}
        writes = client_step.completion_writes(steps, recorded)
        for key, ids in writes.cancels.items():
            self._items.update(key, ids, {"cancel": 1})
        for f in writes.finishes:
            self._finish(f.key, f.item_ids, now, release_n=f.release_n, permits=f.permits)
        keys = {c.item.item_id: c.item.key for c in steps}
        for key in dict.fromkeys(keys.values()):
            self._set_wake(key, now if wake_at is None else wake_at, earlier_only=True)
        return [keys.get(i) for i in item_ids]

    def _found(self, item_ids: list[str]) -> list[dict[str, Any]]:
        """The rows of the known ones of ``item_ids``, in their order: one read for a batch,
        not one per item (one item: a point read, its own statement)."""
        found = self._items.find_many(item_ids) if len(item_ids) > 1 else \
            {i: r for i in item_ids[:1] if (r := self._items.find(i)) is not None}
        return [found[i] for i in item_ids if i in found]

    def _completion_load(self, rows: list[dict[str, Any]]) -> client_step.CompletionLoad:
        """What completing the items of ``rows`` decides over (:class:`~semaphore.core.client_step.
        CompletionLoad`): their running grant items' grants, and for a grant that
        :func:`~semaphore.core.client_step.checks_completions` names, its key's running and
        claiming items."""
        items = tuple(client_step.CompletingItem(str(r["item_id"]), str(r["key"]), str(r["state"]), str(r["owner"]),
                                                 str(r["permit_kind"]), str(r["permit_id"])) for r in rows)
        grants = {(i.key, i.permit_id): self.client.unit(i.key).grant(i.permit_id) for i in items
                  if i.permit_kind == PermitKind.GRANT.value and i.state == ItemState.RUNNING.value}
        checked = dict.fromkeys(key for (key, _), g in grants.items() if client_step.checks_completions(g))
        return client_step.CompletionLoad(items, grants, {key: self._running_grant_slots(key) for key in checked},
                                          {key: self._claiming(key) for key in checked})

    def _running_grant_slots(self, key: str) -> dict[str, int]:
        """Per grant id, how many of ``key``'s running items hold a slot of it."""
        out: dict[str, int] = {}
        for r in self._live(key, ItemState.RUNNING, permit_kind=PermitKind.GRANT.value):
            out[str(r["permit_id"])] = out.get(str(r["permit_id"]), 0) + 1
        return out

    def _claiming(self, key: str) -> tuple[ClaimingItem, ...]:
        """``key``'s claiming items, in enqueue order."""
        return tuple(ClaimingItem(str(r["item_id"]), str(r["group_name"]), int(r["seq"]), str(r["permit_id"]),
                                  int(r["slot"]), bool(r["cancel"]), not r["owner"], int(r["enqueued_at"]))
                     for r in self._live(key, ItemState.CLAIMING))

    def _finish(self, key: str, item_ids: list[str], now: int, *, release_n: int = 0, permits: bool) -> None:
        """Mark the items done (inside the caller's transaction; the caller wakes the key). With
        ``on_done`` their hooks are only recorded as pending, due at once: each runs later in a
        transaction of its own (:meth:`_run_done_hook`), never in this shared step, so a failing
        hook cannot roll back the key's admissions or replies. ``release_n``: the released count
        of their (one) permit that they record (:meth:`_release_permit`). ``permits``: whether
        :meth:`permit` items are among them."""
        if not item_ids:
            return
        recorded = {"release_n": release_n} if release_n else {}
        self._items.update(key, item_ids, {  # a permit() item's caller knows when it is done: no hook for it
            "state": ItemState.DONE.value, "finished_at": now, "done_pending": DonePending(self.on_done is not None),
            "done_attempts": 0, "done_retry_at": now, **recorded})
        self.marks.finished(key, now, permits=permits)

    def _persist(self, key: str, changes: KeyChanges, now: int) -> None:
        """Write one step's changes (:mod:`~semaphore.core.client_step`) in the caller's
        transaction, in this order: a request's ``blocked`` words, the items a reply checked,
        the counts of the key's grants and leases, the items that start, go back, finish, claim
        and draw, the admitted items whose permit is gone, the callback calls and the
        hand-overs, the marks, and a purge. It decides nothing but what the stores' own hints
        allow it to skip (``purge_due``, ``permits_done``: whether a purge or a delete of
        finished permit items may find anything)."""
        if changes.blocked is not None:  # one statement; replaces the previous reply's
            self.marks.keep_blocked(key, [list(b) for b in changes.blocked], now)
        # The holder has answered: admitted items still to be (re)started have their permit
        # checked by this reply (a retry waits for one, see _run_callbacks).
        self._items.update(key, list(changes.checked), {"checked_at": now})
        unit = self.client.unit(key)
        for kind, counts in (("grant", changes.grants), ("lease", changes.leases)):
            for row_id, values in counts.items():
                for column, value in values.items():
                    unit._set_count(kind, row_id, column, value)
        if changes.clear_pending:
            self.marks.clear_pending(key)
        self._start(key, list(changes.start), now)
        self._requeue(key, list(changes.requeue))
        self._finish(key, list(changes.finish), now, permits=changes.finish_permits)
        if changes.wake_now:  # a hook is due, or an item was queued again: even if this instance dies
            self._set_wake(key, now, earlier_only=True)
        for claim in changes.claims:
            self._items.update(key, claim.item_ids, {
                "state": ItemState.CLAIMING.value, "permit_kind": PermitKind.GRANT.value, "permit_id": claim.grant_id},
                {"slot": list(claim.slots)})
        for draw in changes.draws:
            self._start(key, list(draw.item_ids), now, permit_kind=PermitKind.LEASE.value, permit_id=draw.lease_id,
                        slot=list(draw.slots))
        # a fresh admission: the failed calls under the gone permit do not count (work_attempts)
        self._requeue(key, list(changes.gone), attempts=0)
        self._items.update(key, list(changes.flying), {"retry_at": changes.flying_retry_at})
        self._items.update(key, list(changes.calls), {"attempts": Add(1), "retry_at": changes.calls_retry_at})
        self._items.update(key, list(changes.admitted), {"admitted": 1})
        if changes.ask_holder:  # the next exchange goes at once (idle slots released, a retry waiting for it)
            unit.ask_holder()
        if changes.purge_done_before is not None and changes.purge_due_before is not None \
                and self.marks.purge_due(changes.purge_due_before):
            self._items.purge_done(changes.purge_done_before)
            self.marks.purged()
        # A finished permit() item is never enqueued again (its id is random): nothing to keep.
        if changes.delete_done_permits and self.marks.permits_done(key):
            self._items.delete_done_permits(key)
            self.marks.permits_deleted(key)

    def _run_done_hooks(self, key: str) -> None:
        """Call the pending ``on_done`` hooks of ``key`` that are due (each on its own)."""
        if self.on_done is None:
            return
        now = self._now()
        rows = [r for r in self._items.rows(key) if r["done_pending"] and int(r["done_retry_at"]) <= now]
        rows.sort(key=lambda r: (int(r["done_retry_at"]), int(r["seq"])))
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
            r = self._items.find(item_id)
            if r is None or not r["done_pending"]:
                return  # not pending (any more)
            result = hook(self._item_of(r))
            if inspect.isawaitable(result):
                if inspect.iscoroutine(result):
                    result.close()  # never awaited: say so here instead of a RuntimeWarning
                raise ConfigurationError("on_done: returned an awaitable; it must be synchronous"
                                         " (it runs inside a storage transaction)", field="on_done")
            self._items.update(str(r["key"]), [item_id], {"done_pending": 0})
            # purgeable from now on: a purge's earliest finished time counts it (read while
            # its hook was pending, that time left it out)
            self.marks.finished(str(r["key"]), int(r["finished_at"]), permits=False)

        try:
            self.storage.transaction(body)
        except Exception as exc:  # noqa: BLE001 - any hook failure only delays this item
            self._done_hook_failed(item_id, exc)
            if raise_misuse and isinstance(exc, ConfigurationError):
                raise

    def _done_hook_failed(self, item_id: str, exc: Exception) -> None:
        now = self._now()

        def body() -> tuple[int, int]:
            r = self._items.find(item_id)
            if r is None:  # gone meanwhile (migrated away): nothing to retry
                return 0, 0
            attempts = int(r["done_attempts"]) + 1
            delay = DurabilityScheduler.backoff_ms(attempts)
            self._items.update(str(r["key"]), [item_id], {"done_attempts": attempts, "done_retry_at": now + delay})
            self._set_wake(str(r["key"]), now + delay, earlier_only=True)
            return attempts, delay

        attempts, delay = self.storage.transaction(body)
        log.warning("on_done failed for item %r (attempt %d): %r; the item is done, its hook is"
                    " retried in %d ms", item_id, attempts, exc, delay, exc_info=exc)

    def _start(self, key: str, item_ids: list[str], now: int, **permit: Any) -> None:
        """The items run from ``now`` (under ``permit``: columns set with them, ``slot`` a list
        of one slot per item)."""
        slots = permit.pop("slot", None)
        self._items.update(key, item_ids, {**permit, "state": ItemState.RUNNING.value, "started_at": now,
                                           "admitted": 0, "retry_at": now, "checked_at": now},
                           None if slots is None else {"slot": slots})

    def _requeue(self, key: str, item_ids: list[str], **also: Any) -> None:
        self._items.update(key, item_ids, {"state": ItemState.QUEUED.value, "permit_kind": "", "permit_id": "",
                                           "slot": 0, **also})

    def _live(self, key: str, state: ItemState | None = None, **where: Any) -> list[dict[str, Any]]:
        """The key's kept items (in ``state``) whose columns equal ``where`` (``owner=True``:
        any owner but none), in enqueue order."""
        rows = self._items.rows(key, None if state is None else state.value)
        for column, value in where.items():
            if value is True:
                rows = [r for r in rows if r[column]]
            else:
                rows = [r for r in rows if r[column] == value]
        return rows

    def _demand(self, queued: tuple[QueuedItem, ...], room: int | None) -> list[Demand]:
        return [Demand(group, count, oldest) for group, count, oldest in plan.demand_of(queued, room)]

    def _queued(self, key: str) -> tuple[QueuedItem, ...]:
        return tuple(QueuedItem(str(r["item_id"]), str(r["group_name"]), int(r["seq"]), not r["owner"],
                                int(r["enqueued_at"])) for r in self._live(key, ItemState.QUEUED))

    def _admit_room(self, key: str) -> int | None:
        """How many more callback items of ``key`` may be admitted (``admit_concurrency``)."""
        if self.admit_concurrency is None:
            return None
        busy = len(self._live(key, ItemState.CLAIMING, owner="")) \
            + len(self._live(key, ItemState.RUNNING, owner="", admitted=0))
        return plan.admit_room(self.admit_concurrency, busy)
