"""How a :meth:`~semaphore.client.SemaphoreQueue.permit` call gets its permit (SPEC R37): its
item queued and admitted (at once from a live lease, else through the holder), waited for with
its timeout or, for a try (``timeout_ms=0``, SPEC R9b), for the holder's one answer; the
holder's latest word on why it waits (:meth:`blocked`), and the withdrawal that completes the
item when its caller leaves (or gives up)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..core.wire import Blocked, BlockedReason
from ..errors import PermitTimeoutError
from ._queue_model import ItemState, QueueItem
from ._queue_pump import _QueuePump
from ._queue_store import BLOCKED

log = logging.getLogger("semaphore.queue")


class _QueuePermits(_QueuePump):
    """The waiting of :meth:`permit` calls (see the module documentation)."""

    async def _acquire(self, fut: asyncio.Future[QueueItem], key: str, group: str, item_id: str, text: str,
                       now: int, timeout_ms: int | None) -> QueueItem:
        """:meth:`permit`'s item, queued and admitted: at once from a live lease, else when the
        holder's answer serves it (a try: its one answer, R9b)."""
        answered = self._tries.add(key, item_id) if timeout_ms == 0 else None
        self.storage.transaction(lambda: self._insert(key, group, item_id, text, now, owner=self._token))
        self.storage.transaction(lambda: self._admit_locally(key, now))  # a live lease serves it at once
        self._hand_over(key)
        await self.scheduler.arm()  # the item's wake-ups (its orphan check, a lease heartbeat)
        if not fut.done():
            self._kick(key)
            if answered is not None:
                self._start_side_request(key)  # a request in flight: the try must not wait for it
        if answered is not None:
            return await self._await_try(fut, answered, key, item_id, group)
        return await self._await_permit(fut, key, group, now, timeout_ms)

    async def _await_try(self, fut: asyncio.Future[QueueItem], answered: asyncio.Event, key: str,
                         item_id: str, group: str) -> QueueItem:
        """A try (R9b): the item's admission, or the holder's answer to the try's request
        without it (then :class:`PermitTimeoutError` with the ``blocked`` entry, or the error of
        the request). An answer that gave the item a grant waits for its confirming sync."""
        waiter: asyncio.Future[Any] = asyncio.ensure_future(answered.wait())
        try:
            await asyncio.wait({fut, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if fut.done():
            return fut.result()
        row = self._items.find(item_id)
        if row is not None and row["state"] == ItemState.CLAIMING.value:
            return await fut  # served: its claim is being confirmed (R15a)
        error = self._tries.error(item_id)
        if error is not None:
            raise error
        blocked = self.blocked(key).get(group)
        why = "" if blocked is None else f" (holder: {blocked.reason.value}, {blocked.waiting} waiting)"
        raise PermitTimeoutError(f"no permit free now for key {key!r}, group {group!r}{why}", blocked=blocked)

    def blocked(self, key: str) -> dict[str, Blocked]:
        """Why ``key``'s queued items wait, per group: the holder's ``blocked`` entries of the
        last reply to a request of the key (SPEC R23). Empty when the holder served everything
        asked for (or was not asked yet)."""
        self.ensure_schema()
        return {str(r["group_name"]): Blocked(str(r["group_name"]), BlockedReason(str(r["reason"])),
                                              int(r["waiting"]))
                for r in self.storage.exec(f"SELECT group_name, reason, waiting FROM {BLOCKED} WHERE key = ?"
                                           " ORDER BY group_name", key)}

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
