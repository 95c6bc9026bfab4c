"""The client side: :class:`SemaphoreClient` (the per-key grant and lease ledger of one client
object) and :class:`SemaphoreQueue` (work waiting for permits, on top of a client)."""

from ._client import (
                      CLIENT_TABLES,
                      OBJECT_NAME,
                      AppliedReply,
                      ClientGrant,
                      ClientLease,
                      KeyState,
                      KeyUnit,
                      Reply,
                      SemaphoreClient,
                      Transport,
)
from ._queue import QUEUE_TABLES, ItemState, Permit, PermitKind, QueueItem, SemaphoreQueue

__all__ = [
    "SemaphoreClient", "ClientGrant", "ClientLease", "KeyState", "KeyUnit", "AppliedReply", "Reply", "Transport",
    "CLIENT_TABLES", "OBJECT_NAME",
    "SemaphoreQueue", "QueueItem", "ItemState", "Permit", "PermitKind", "QUEUE_TABLES",
]
