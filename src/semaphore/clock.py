"""Time for the semaphore: a callable returning integer epoch milliseconds.

A clock may also offer ``async sleep_until(ms)``; the holder's in-memory round timer uses it when
present, so a :class:`~semaphore.testing.VirtualClock` drives rounds deterministically. A plain
callable clock sleeps with :func:`asyncio.sleep` for the difference.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "SleepingClock", "system_clock", "sleep_until", "now_ms"]


@runtime_checkable
class Clock(Protocol):
    def __call__(self) -> int: ...


@runtime_checkable
class SleepingClock(Protocol):
    def __call__(self) -> int: ...

    async def sleep_until(self, at_ms: int) -> None: ...


def system_clock() -> int:
    """Wall-clock epoch milliseconds (what ``Date.now()`` returns in the runtime)."""
    return int(time.time() * 1000)


def now_ms(clock: Callable[[], int | float]) -> int:
    return int(clock())


async def sleep_until(clock: Callable[[], int | float], at_ms: int) -> None:
    """Sleep until ``clock()`` reaches ``at_ms``, using the clock's own ``sleep_until`` if any."""
    own = getattr(clock, "sleep_until", None)
    if own is not None:
        await own(at_ms)
        return
    delay = at_ms - now_ms(clock)
    if delay > 0:
        await asyncio.sleep(delay / 1000)
