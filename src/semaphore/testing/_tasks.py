"""Which asyncio tasks belong to one object instance, so an eviction can end them.

In the runtime an evicted object loses everything in memory: its timers and every task it
started. :class:`ObjectTasks` gives a test object the same fate without knowing anything about
the code it runs: code run through :meth:`ObjectTasks.call` belongs to the instance, and so does
every task that code starts (and every task those start). :meth:`ObjectTasks.cancel` cancels
them. Attribution goes through a context variable, read by a task factory installed on the
running loop (chained to a factory already installed there).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable
from typing import Any, TypeVar

__all__ = ["ObjectTasks"]

T = TypeVar("T")

_OWNER: contextvars.ContextVar[ObjectTasks | None] = contextvars.ContextVar(
    "semaphore_testing_object", default=None
)
_MARK = "semaphore_testing_tracks_tasks"


def _install(loop: asyncio.AbstractEventLoop) -> None:
    """Make ``loop`` report every new task to the :class:`ObjectTasks` whose code creates it."""
    previous = loop.get_task_factory()
    if getattr(previous, _MARK, False):
        return

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future[Any]:
        if previous is not None:
            task: asyncio.Future[Any] = previous(loop, coro, **kwargs)
        else:
            task = asyncio.Task(coro, loop=loop, **kwargs)
        owner = _OWNER.get()
        if owner is not None:
            owner.add(task)
        return task

    setattr(factory, _MARK, True)
    loop.set_task_factory(factory)


class ObjectTasks:
    """The not yet finished tasks started by the code of one object instance."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def add(self, task: asyncio.Future[Any]) -> None:
        """Count ``task`` as the instance's (until it is done)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def call(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable`` as the instance's code: every task it starts is the instance's.
        The calling task itself is not (an eviction fails the call the way the object's code
        reacts to losing its tasks, it does not cancel the caller)."""
        _install(asyncio.get_running_loop())
        token = _OWNER.set(self)
        try:
            return await awaitable
        finally:
            _OWNER.reset(token)

    def pending(self) -> int:
        """How many of the instance's tasks are not done."""
        return sum(1 for t in self._tasks if not t.done())

    def cancel(self) -> None:
        """Cancel every task of the instance (it was evicted)."""
        tasks, self._tasks = self._tasks, set()
        for task in tasks:
            if not task.done():
                task.cancel()
