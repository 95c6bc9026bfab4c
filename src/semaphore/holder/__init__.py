"""The holder side: :class:`DurabilitySemaphore` (batching, the round timer, limit resolution)
over its SQL store. Every decision it applies is made by :mod:`semaphore.core`."""

from ._observe import RoundRecord
from ._semaphore import CanGrantOption, DurabilitySemaphore, GroupLimitOption, LimitOption
from ._store import AUDIT, CLIENTS, GRANTS, GROUPS, LEASES, META, SCHEMA_VERSION, TABLES

__all__ = [
    "DurabilitySemaphore", "LimitOption", "GroupLimitOption", "CanGrantOption", "RoundRecord",
    "GRANTS", "LEASES", "GROUPS", "META", "CLIENTS", "AUDIT", "TABLES", "SCHEMA_VERSION",
]
