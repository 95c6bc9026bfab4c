"""Counting a test-kit object's SQL statements of one kind while a block runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def statements(side: Any, prefix: str) -> Iterator[list[str]]:
    """The statements starting with ``prefix`` (any case, e.g. ``"UPDATE
    durability_semaphore_client_items"``) that ``side``'s storage (a ``ClientSide``) runs
    meanwhile."""
    found: list[str] = []
    sql = side.storage.sql
    inner = sql.exec
    wanted = prefix.upper()

    def counted(query: str, *bindings: Any) -> Any:
        if query.lstrip().upper().startswith(wanted):
            found.append(query)
        return inner(query, *bindings)

    sql.exec = counted
    try:
        yield found
    finally:
        sql.exec = inner
