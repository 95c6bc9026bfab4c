"""Running ``async def`` tests without a plugin: :func:`run` and :func:`async_test`."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["run", "async_test"]

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion on a fresh event loop (``asyncio.run``)."""
    return asyncio.run(coro)


def async_test(fn: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., T]:
    """Decorator: an ``async def test_...`` becomes a plain test function that runs it on a
    fresh event loop (for test runners without an asyncio plugin). Every test gets its own
    loop, so kit objects (which must be created inside the loop that drives them) are created
    inside the test."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        return asyncio.run(fn(*args, **kwargs))

    return wrapper
