"""What the contract tests of a SQL store and its in-memory twin share: one operation run on both,
on SQL inside a storage transaction (rolled back when the step is to fail), on the twin in place
(restored when it failed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from semaphore.runtime import Storage

T = TypeVar("T")


class Boom(Exception):
    """Raised inside a transaction to roll it back."""


def on_both(storage: Storage, on_sql: Callable[[], Any], on_twin: Callable[[], Any], snapshot: Callable[[], T],
            restore: Callable[[T], None], *, fail: bool) -> tuple[Any, Any]:
    """``on_sql()`` inside one transaction of ``storage`` (which raises after it when ``fail``:
    rolled back, and every store hooked to its rollbacks forgets its copy), then ``on_twin()``,
    the twin put back as ``snapshot()`` had it when ``fail``. Returns both answers."""
    answers: list[Any] = []

    def body() -> None:
        answers.append(on_sql())
        if fail:
            raise Boom

    before = snapshot()
    try:
        storage.transaction(body)
    except Boom:
        pass
    answers.append(on_twin())
    if fail:
        restore(before)
    return answers[0], answers[1]
