"""A shared, durable concurrency budget for Cloudflare Python Workers.

One holder Durable Object per key owns a limit (:class:`DurabilitySemaphore`), with optional
per-group ceilings; many client Durable Objects get permits from it in batched allocation rounds
or as leases. See ``docs/SPEC.md`` for the contract and the README for a tour.
"""

from .core.allocation import LIMIT_ERROR, Allocation, Entry, Usage, allocate
from .clock import system_clock
from .core.config import LeaseConfig, LimitedGroups, Provisioning
from .errors import (
    ConfigurationError,
    HolderUnavailableError,
    InvalidMessageError,
    RoundFailedError,
    SemaphoreError,
    SemaphoreTimeoutError,
    error_from_reply,
)
from .holder import DurabilitySemaphore
from .scheduler import DurabilityScheduler
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
    SemaphoreClient,
    SemaphoreQueue,
    Transport,
)
from .rpc import SemaphoreRpc, get_by_name, retry, timeout
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

__all__ = [
    "DurabilitySemaphore",
    "DurabilityScheduler",
    "SemaphoreClient",
    "ClientGrant",
    "ClientLease",
    "AppliedReply",
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
    "ConfigurationError",
    "error_from_reply",
    "allocate",
    "Entry",
    "Usage",
    "Allocation",
    "LIMIT_ERROR",
    "system_clock",
]
