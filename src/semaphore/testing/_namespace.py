"""A stand-in for a Durable Object namespace binding (``env.ACCOUNT_LIMIT``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Namespace"]

T = TypeVar("T")


class Namespace(Generic[T]):
    """Stands in for a Durable Object namespace (``env.<BINDING>``): ``getByName(name)`` returns
    the one object of that name, made by ``make(name)`` on first use (e.g.
    ``Namespace(lambda name: AccountLimit(LocalContext(name=name), env))``). Pass it as the client
    helper's ``namespace=`` (:func:`semaphore.rpc.client`) to reach holder objects in-process.

    :ivar objects: the objects made so far, by name."""

    def __init__(self, make: Callable[[str], T]) -> None:
        self.make = make
        self.objects: dict[str, T] = {}

    def getByName(self, name: str) -> T:  # noqa: N802 - the runtime's method name
        """The object named ``name`` (made on first use), as ``namespace.getByName`` gives a stub."""
        if name not in self.objects:
            self.objects[name] = self.make(name)
        return self.objects[name]
