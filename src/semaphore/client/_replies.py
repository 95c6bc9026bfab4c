"""A holder's reply, checked and then applied to the client's rows (SPEC R8, R13, R15, R17, R31,
R33).

:meth:`SemaphoreClient.send_request` and :meth:`~SemaphoreClient.send_sync` return a
:class:`Reply`: the holder's answer, checked (an error reply raised as its typed exception) but
not applied. :meth:`SemaphoreClient.apply` applies it inside the CALLER's storage transaction, so
the caller commits its own changes beside it: the queue applies a reply and its own step over
the key's items in one transaction it opens itself, and the client never calls back into it.
:meth:`~SemaphoreClient.request` and :meth:`~SemaphoreClient.sync` are the send and the apply in
one call (the apply in a transaction of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.client_state import KeyState, ReplyFacts, merge_grant, merge_lease
from ..core.wire import GrantState, LeaseState, PermitRequest, PermitResponse, SyncMessage
from ._client_model import AppliedReply

if TYPE_CHECKING:
    from ._client import SemaphoreClient

__all__ = ["Reply", "apply_reply"]


@dataclass(frozen=True)
class Reply:
    """The holder's answer to one message of ``key``, not applied yet
    (:meth:`SemaphoreClient.apply` applies it).

    :ivar key: the semaphore key the message went to.
    :ivar message: the message sent (its reports are marked delivered when applied).
    :ivar response: the typed answer.
    :ivar sent_at: the client's clock when it was sent (the answer shows the holder as of no
        earlier than this, R33a).
    :ivar more: the message could not carry every report with something to report (R7).
    :ivar during_request: a request of the key was in flight when the answer came (a sync's
        answer then cannot show what that request's round creates).
    """

    key: str
    message: PermitRequest | SyncMessage
    response: PermitResponse
    sent_at: int
    more: bool
    during_request: bool


def apply_reply(client: SemaphoreClient, reply: Reply, now: int) -> AppliedReply:
    """Apply ``reply`` to ``client``'s rows at ``now``, in the caller's transaction: its reports
    delivered (fair rotation, R7), every grant and lease the reply lists merged (R8), the key's
    row moved on (:meth:`KeyState.after_reply`), tombstones pruned when due."""
    key, message, response = reply.key, reply.message, reply.response
    rows = client.rows
    applied = AppliedReply(key, response, now, more=reply.more)
    # The holder applied every report of the message: mark them delivered, and move them
    # behind every entry still waiting to be reported (fair rotation, R7). The stamp is
    # ``now``, or one more than the previous one: two messages within one millisecond must
    # still rotate.
    stamp = client._last_report_stamp = max(now, client._last_report_stamp + 1)
    for r in message.grants:
        rows.delivered("grant", key, r.grant_id, {"sent_claimed": r.claimed, "sent_released": r.released}, stamp)
    for lr in message.leases or ():
        rows.delivered("lease", key, lr.lease_id, {"sent_drawn": lr.drawn, "sent_released": lr.released,
                                                    "sent_stopped": int(lr.stopped)}, stamp)
    # Reported or not: the reply lists every grant and lease the holder has for us (R8), and
    # each is merged the same way (an unreported one keeps its own report_at and its claims
    # the holder does not show yet stay unconfirmed, R15a).
    for grant_state in response.grants:
        _apply_grant(client, key, grant_state, now, applied)
    for lease_state in response.leases:
        _apply_lease(client, key, lease_state, now, applied)
    rows.flush()  # deliveries no merge wrote
    row = client._key_row(key)
    before = KeyState(pruned_at=now) if row is None else KeyState._from_row(row)
    values, prune = before.after_reply(
        ReplyFacts(response.ask_at(now), response.contended, response.claim_ttl_ms or 0,
                   response.lease_recheck_ms or 0, response.room),
        now=now, sent_at=reply.sent_at, sync=isinstance(message, SyncMessage),
        during_request=reply.during_request, tombstone_ms=client.tombstone_ms)
    client._touch_key(key, now, **values)
    if prune:
        rows.prune(key, now - client.tombstone_ms)
    return applied


def _apply_grant(client: SemaphoreClient, key: str, s: GrantState, now: int, applied: AppliedReply) -> None:
    merge = merge_grant(key, client.grant(key, s.grant_id), s)  # R8, R13, R15, R17
    _merged(merge.row, client.rows.write_grant, now, s.grant_id, (
        (merge.dropped, applied.dropped), (merge.adopted, applied.adopted_grants), (merge.expired, applied.expired)))


def _apply_lease(client: SemaphoreClient, key: str, s: LeaseState, now: int, applied: AppliedReply) -> None:
    merge = merge_lease(key, client.lease(key, s.lease_id), s, now)  # R8, R13, R31, R33
    _merged(merge.row, client.rows.write_lease, now, s.lease_id, (
        (merge.settled, applied.settled), (merge.adopted, applied.adopted_leases), (merge.retired, applied.retired)))


def _merged(row: Any, write: Callable[[Any, int], None], now: int, entry_id: str,
            happened: Iterable[tuple[bool, list[str]]]) -> None:
    """Write a merge's ``row`` (``None``: nothing changed) and list ``entry_id`` under each of
    the :class:`AppliedReply` lists whose flag the merge set."""
    if row is not None:
        write(row, now)
    for flag, ids in happened:
        if flag:
            ids.append(entry_id)
