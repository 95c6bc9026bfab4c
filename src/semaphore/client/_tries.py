"""The queue's tries (``permit(timeout_ms=0)``, SPEC R9b): which tries of a key wait, which went
in a ``noWait`` request, which answers are due to their callers, and the error of a request
that failed. In memory: a try lives only as long as its caller."""

from __future__ import annotations

import asyncio


class Tries:
    """Per key: the waiting tries (item id -> the event their caller waits for), the ones sent
    in a ``noWait`` request, the ones whose request was answered (signalled once the pump has
    admitted what the answer brought), and a failed request's error per try."""

    def __init__(self) -> None:
        self._events: dict[str, dict[str, asyncio.Event]] = {}
        self._sent: set[str] = set()
        self._replied: dict[str, set[str]] = {}
        self._errors: dict[str, BaseException] = {}

    def add(self, key: str, item_id: str) -> asyncio.Event:
        """A new try of ``key``: the event set once the holder's answer to it is known."""
        event = self._events.setdefault(key, {})[item_id] = asyncio.Event()
        return event

    def remove(self, key: str, item_id: str) -> None:
        self._events.get(key, {}).pop(item_id, None)
        self._sent.discard(item_id)
        self._errors.pop(item_id, None)

    def waiting(self, key: str) -> set[str]:
        """The key's tries still waiting for an answer."""
        return set(self._events.get(key, ()))

    def unsent(self, key: str) -> set[str]:
        """The key's tries no ``noWait`` request has carried yet (they make the next request
        urgent; one request per try, never one per pump pass)."""
        return {i for i in self._events.get(key, ()) if i not in self._sent}

    def sent(self, key: str, item_ids: set[str], error: BaseException | None = None) -> None:
        """A ``noWait`` request carried ``item_ids``: answered (or failed with ``error``)."""
        self._sent |= item_ids
        self._replied.setdefault(key, set()).update(item_ids)
        if error is not None:
            for item_id in item_ids:
                self._errors[item_id] = error

    def signal_replied(self, key: str) -> None:
        """Tell the callers whose request was answered (after the pump admitted its answer)."""
        events = self._events.get(key, {})
        for item_id in self._replied.pop(key, set()):
            event = events.get(item_id)
            if event is not None:
                event.set()

    def signal(self, key: str, item_ids: set[str]) -> None:
        """Tell these callers the answer is known (a pump that began after them ended)."""
        events = self._events.get(key, {})
        for item_id in item_ids:
            event = events.get(item_id)
            if event is not None:
                event.set()

    def error(self, item_id: str) -> BaseException | None:
        """The error of the failed request that carried this try, if any."""
        return self._errors.get(item_id)
