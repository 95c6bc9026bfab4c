"""A shared, durable concurrency budget for Cloudflare Python Workers.

One holder Durable Object per key owns a limit (:class:`DurabilitySemaphore`), with optional
per-group ceilings; many client Durable Objects get permits from it in batched allocation rounds
or as leases. See ``docs/SPEC.md`` for the contract and the docs site (``docs/``) for a tour.

The import name ``semaphore`` is short and other distributions on PyPI install a top-level
``semaphore`` package too; installed into the same ``python_modules/`` one overwrites the other's
files. ``__distribution__`` marks this one: every subpackage checks it on import and raises a
clear :class:`ImportError` when the ``semaphore/__init__.py`` in front of it is another
distribution's (see docs/guides/deploying.md, "The import name semaphore").
"""

#: The distribution this package belongs to (checked by every subpackage on import).
__distribution__ = "durability-semaphore"
#: The release (kept equal to ``pyproject.toml``'s version; tests/test_packaging.py checks it).
__version__ = "0.1.0"

from .client import (
    AppliedReply,
    ClientGrant,
    ClientLease,
    ItemState,
    KeyState,
    KeyUnit,
    Permit,
    PermitKind,
    QueueItem,
    Reply,
    SemaphoreClient,
    SemaphoreQueue,
    Transport,
)
from .clock import system_clock
from .core.allocation import LIMIT_ERROR, Allocation, Entry, Usage, allocate
from .core.config import DEFAULT_LEASES, LeaseConfig, LimitedGroups, Provisioning
from .core.usage import GroupUsage, SemaphoreUsage
from .core.wire import (
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
    parse_message,
)
from .errors import (
    ConfigurationError,
    HolderUnavailableError,
    InvalidMessageError,
    PermitTimeoutError,
    RoundFailedError,
    SemaphoreError,
    SemaphoreTimeoutError,
    error_from_reply,
)
from .holder import DurabilitySemaphore, RoundRecord
from .rpc import SemaphoreRpc, get_by_name, retry, timeout
from .scheduler import DurabilityScheduler

__all__ = [
    "__version__",
    "DurabilitySemaphore",
    "RoundRecord",
    "DurabilityScheduler",
    "SemaphoreClient",
    "ClientGrant",
    "ClientLease",
    "AppliedReply",
    "Reply",
    "KeyUnit",
    "KeyState",
    "Transport",
    "SemaphoreQueue",
    "QueueItem",
    "ItemState",
    "Permit",
    "PermitKind",
    "SemaphoreRpc",
    "get_by_name",
    "timeout",
    "retry",
    "LeaseConfig",
    "DEFAULT_LEASES",
    "Provisioning",
    "LimitedGroups",
    "Demand",
    "GrantReport",
    "LeaseReport",
    "PermitRequest",
    "SyncMessage",
    "PermitResponse",
    "GrantState",
    "LeaseState",
    "Blocked",
    "GrantStatus",
    "LeaseStatus",
    "BlockedReason",
    "parse_message",
    "SemaphoreError",
    "InvalidMessageError",
    "RoundFailedError",
    "HolderUnavailableError",
    "SemaphoreTimeoutError",
    "PermitTimeoutError",
    "ConfigurationError",
    "error_from_reply",
    "allocate",
    "Entry",
    "Usage",
    "Allocation",
    "LIMIT_ERROR",
    "SemaphoreUsage",
    "GroupUsage",
    "system_clock",
]
