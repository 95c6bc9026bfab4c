"""A test kit for code built on the semaphore, on CPython with real SQLite.

:class:`LocalStorage` and :class:`LocalContext` stand in for ``ctx.storage`` and ``ctx`` (real
SQLite, enforcing the Durable Object rules), :class:`VirtualClock` drives time deterministically,
:class:`AlarmDriver` fires an object's alarm when the virtual clock reaches it.
"""

from ._local import AlarmDriver, DurableObjectRuleError, LocalContext, LocalStorage, VirtualClock

__all__ = ["VirtualClock", "LocalStorage", "LocalContext", "AlarmDriver", "DurableObjectRuleError"]
