"""The pure core of the semaphore: every decision of the protocol, with no I/O.

Nothing in this package imports the runtime adapter (:mod:`semaphore.runtime`), storage, asyncio
or a clock: its functions take the state they decide over (loaded rows, resolved limits, the
messages, the time) and return what to change and what to answer. The holder
(:mod:`semaphore.holder`) and the client side (:mod:`semaphore.client`) load that state, call the
core and persist its result. ``tests/test_layout.py`` enforces the import rules; see
``docs/ARCHITECTURE.md`` for the map from each SPEC rule to the module that implements it.
"""

import sys as _sys

# The package in front of this one must be durability-semaphore's own (semaphore/__init__.py):
# another distribution's top-level `semaphore` package, installed into the same folder, replaces
# that file and would shadow this library silently.
if getattr(_sys.modules.get(__name__.rpartition(".")[0]), "__distribution__", None) != "durability-semaphore":
    raise ImportError(
        "semaphore/__init__.py is not durability-semaphore's: another distribution installed a top-level "
        "'semaphore' package into the same folder (python_modules/ or site-packages) and overwrote it. "
        "Uninstall it, or install durability-semaphore into a folder of its own "
        "(docs/guides/deploying.md: 'The import name semaphore').")

from .allocation import LIMIT_ERROR, Allocation, Entry, Usage, allocate, ceiling, grant_ceiling, lease_candidate
from .config import LeaseConfig, LimitedGroups, Provisioning
from .wire import (
    MAX_ID_LENGTH,
    MAX_INT,
    MAX_LABEL_LENGTH,
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
    label_problem,
    parse_message,
)

__all__ = [
    "LIMIT_ERROR", "Allocation", "Entry", "Usage", "allocate", "ceiling", "grant_ceiling", "lease_candidate",
    "LeaseConfig", "LimitedGroups", "Provisioning",
    "MAX_ID_LENGTH", "MAX_INT", "MAX_LABEL_LENGTH", "MAX_LIST_LENGTH", "WIRE_VERSION",
    "Blocked", "BlockedReason", "Demand", "GrantReport", "GrantState", "GrantStatus", "LeaseReport",
    "LeaseState", "LeaseStatus", "PermitRequest", "PermitResponse", "SyncMessage",
    "check_id", "id_problem", "label_problem", "parse_message",
]
