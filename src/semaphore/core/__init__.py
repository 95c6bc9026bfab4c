"""The pure core of the semaphore: every decision of the protocol, with no I/O.

Nothing in this package imports the runtime adapter (:mod:`semaphore.runtime`), storage, asyncio
or a clock: its functions take the state they decide over (loaded rows, resolved limits, the
messages, the time) and return what to change and what to answer. The holder
(:mod:`semaphore.holder`) and the client side (:mod:`semaphore.client`) load that state, call the
core and persist its result. ``tests/test_layout.py`` enforces the import rules; see
``docs/ARCHITECTURE.md`` for the map from each SPEC rule to the module that implements it.
"""

from .allocation import LIMIT_ERROR, Allocation, Entry, Usage, allocate, ceiling, grant_ceiling, lease_candidate
from .config import LeaseConfig, LimitedGroups, Provisioning
from .wire import (
    MAX_ID_LENGTH,
    MAX_INT,
    MAX_LIST_LENGTH,
    WIRE_VERSION,
    Blocked,
    BlockedReason,
    Demand,
    GrantReport,
    GrantState,
    GrantStatus,
    LeaseReport,
    LeaseState,
    LeaseStatus,
    PermitRequest,
    PermitResponse,
    SyncMessage,
    check_id,
    id_problem,
    parse_message,
)

__all__ = [
    "LIMIT_ERROR", "Allocation", "Entry", "Usage", "allocate", "ceiling", "grant_ceiling", "lease_candidate",
    "LeaseConfig", "LimitedGroups", "Provisioning",
    "MAX_ID_LENGTH", "MAX_INT", "MAX_LIST_LENGTH", "WIRE_VERSION",
    "Blocked", "BlockedReason", "Demand", "GrantReport", "GrantState", "GrantStatus", "LeaseReport",
    "LeaseState", "LeaseStatus", "PermitRequest", "PermitResponse", "SyncMessage",
    "check_id", "id_problem", "parse_message",
]
