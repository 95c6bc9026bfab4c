"""The queue's ``permit()`` calls (SPEC R9b, R37): an item queued and admitted for its caller
(at once from a live lease, else when the holder's answer serves it), the wait for it with a
timeout or as a try, and its withdrawal when the caller leaves or gives up. What a try's caller
gets, what is a try and the words of a refusal are decided in :mod:`semaphore.core.queue_plan`
(:func:`~semaphore.core.queue_plan.try_answer`, :func:`~semaphore.core.queue_plan.is_try`,
:func:`~semaphore.core.queue_plan.refusal`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..core import queue_plan as plan
from ..errors import PermitTimeoutError
from ._queue_model import QueueItem
from ._queue_pump import _QueuePump

log = logging.getLogger("semaphore.queue")


class _QueuePermits(_QueuePump):
    """``permit()``'s acquisition, waiting and withdrawal (see the module documentation)."""

    async def _acquire(self, fut: asyncio.Future[QueueItem], key: str, group: str, item_id: str, text: str,
                       now: int, timeout_ms: int | None) -> QueueItem:
        """:meth:`permit`'s item, queued and admitted: at once from a live lease, else when the
        holder's answer serves it (a try: its one answer, R9b)."""
        answered = self._tries.add(key, item_id) if plan.is_try(timeout_ms) else None
        wake_at = self._kick_wake(now)
        self.storage.transaction(lambda: self._insert(key, group, item_id, text, now, owner=self._token,
                                                      wake_at=wake_at))
        self.storage.transaction(lambda: self._admit_locally(key, now))  # a live lease serves it at once
        self._hand_over(key)
        self._kick(key)  # schedules the item's next wake-up (its orphan check, a lease heartbeat)
        await self.scheduler.arm()
        if not fut.done() and answered is not None:
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
        item = None if fut.done() else self.item(item_id)  # admitted: no need to read its state
        error = self._tries.error(item_id)
        answer = plan.try_answer(admitted=fut.done(), state=None if item is None else item.state.value,
                                 failed=error is not None)
        if answer is plan.TryAnswer.ADMITTED:
            return fut.result()
        if answer is plan.TryAnswer.CONFIRMING:
            return await fut  # served: its claim is being confirmed (R15a)
        if answer is plan.TryAnswer.FAILED:
            assert error is not None
            raise error
        blocked = self.blocked(key).get(group)
        raise PermitTimeoutError(plan.refusal(key, group, blocked, 0), blocked=blocked)

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
        raise PermitTimeoutError(plan.refusal(key, group, blocked, timeout_ms), blocked=blocked)

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

