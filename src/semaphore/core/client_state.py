"""The client side's copy of its grants, leases and key state, and how a holder reply is merged
into it (SPEC R8, R13, R15, R15a, R17, R30, R31, R33). Pure: no storage, no clock.

:class:`~semaphore.client.SemaphoreClient` persists these rows and applies the merges below;
:mod:`semaphore.core.queue_plan` decides admissions from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .marks import raise_counts
from .wire import MAX_INT, GrantReport, GrantState, GrantStatus, LeaseReport, LeaseState, LeaseStatus

__all__ = [
    "GONE", "ClientGrant", "ClientLease", "KeyState", "GrantMerge", "LeaseMerge",
    "merge_grant", "merge_lease", "contended_since", "ROOM_CHECK_MIN_MS", "COVER_AFTER_MS", "PRUNE_EVERY", "prune_due",
    "ReplyFacts",
]

#: Local grant status of a dropped grant (tombstone).
GONE = "gone"
_ACTIVE = GrantStatus.ACTIVE.value
_LIVE = LeaseStatus.LIVE.value
_RETIRED = LeaseStatus.RETIRED.value
_SETTLED = LeaseStatus.SETTLED.value


@dataclass(frozen=True)
class ClientGrant:
    """The client's copy of one grant.

    :ivar permits: permits of the grant (shrinks to the confirmed claims when it expires).
    :ivar claimed: permits claimed locally (cumulative; reported).
    :ivar released: claimed permits released locally (cumulative; reported).
    :ivar confirmed: claims the holder has confirmed (SPEC R15a); slot ``k`` may run iff
        ``confirmed >= k``.
    :ivar status: ``"active"``, ``"expired"`` or ``"gone"`` (dropped; a tombstone).
    :ivar sent_claimed: / :ivar sent_released: counts the holder has acknowledged receiving.
    :ivar holder_released: the holder has shown more released than the client ever released:
        it released slots on its own (its crash expiry, ``claimTtlMs``, SPEC R18 decision), so
        the grant's running items may hold more slots than it still charges (R15a).
    """

    key: str
    grant_id: str
    group: str
    permits: int
    claimed: int
    released: int
    confirmed: int
    claim_by: int
    status: str
    sent_claimed: int
    sent_released: int
    holder_released: bool = False

    @property
    def unclaimed(self) -> int:
        """Permits not yet claimed (0 unless active)."""
        return max(0, self.permits - self.claimed) if self.status == _ACTIVE else 0

    @property
    def final(self) -> bool:
        """True when no further claim can be confirmed (expired or dropped)."""
        return self.status != _ACTIVE

    @property
    def dirty(self) -> bool:
        """True when local counts have not reached the holder yet."""
        return self.status != GONE and (self.claimed > self.sent_claimed or self.released > self.sent_released)

    @property
    def releasable(self) -> int:
        """Confirmed permits not yet released (R15a). A slot the holder has not confirmed is not
        released: its claim may have reached the holder after ``claimBy`` and been refused (R15),
        and a release reported for it would free a slot that an item runs under (I4)."""
        return max(0, self.confirmed - self.released)

    def report(self) -> GrantReport:
        """The cumulative report of this grant."""
        claimed = min(self.claimed, self.permits) if self.final else self.claimed
        return GrantReport(self.grant_id, claimed, min(self.released, claimed))

    @classmethod
    def _from_row(cls, r: Mapping[str, Any]) -> ClientGrant:
        return cls(str(r["key"]), str(r["grant_id"]), str(r["group_name"]), int(r["permits"]),
                   int(r["claimed"]), int(r["released"]), int(r["confirmed"]), int(r["claim_by"]),
                   str(r["status"]), int(r["sent_claimed"]), int(r["sent_released"]),
                   bool(r["holder_released"]))


@dataclass(frozen=True)
class ClientLease:
    """The client's copy of one lease.

    :ivar drawn: permits drawn (one-shot, SPEC R34); :ivar released: drawn permits released.
    :ivar stopped: the client draws no more from it (its ``drawn`` is final, SPEC R30).
    :ivar status: ``"live"``, ``"retired"`` or ``"settled"`` (a tombstone).
    :ivar heartbeat_at: when to report it again to keep it live (half its lifetime, SPEC R37).
    """

    key: str
    lease_id: str
    group: str
    permits: int
    drawn: int
    released: int
    stopped: bool
    status: str
    expires_at: int
    heartbeat_at: int
    sent_drawn: int
    sent_released: int
    sent_stopped: bool
    #: Its slots are reusable while it lives (SPEC R34a).
    reusable: bool = False

    @property
    def undrawn(self) -> int:
        """Permits that may still be drawn: of a one-shot lease, those not drawn yet (R34); of a
        reusable one, its slots not running now (R34a)."""
        if self.reusable:
            return max(0, self.permits - self.in_use)
        return max(0, self.permits - self.drawn)

    @property
    def used_up(self) -> bool:
        """Nothing left to draw, ever: a one-shot lease drawn in full (a reusable one never is)."""
        return not self.reusable and self.drawn >= self.permits

    @property
    def in_use(self) -> int:
        """Drawn permits not yet released (work running under this lease)."""
        return self.drawn - self.released

    @property
    def active(self) -> bool:
        """Live and not stopped: the client may still draw from it (and heartbeats it, R31)."""
        return self.status == _LIVE and not self.stopped

    def drawable(self, now: int, margin_ms: int = 0) -> bool:
        """True if a permit may be drawn at ``now``: live, not stopped, undrawn permits left and
        not within ``margin_ms`` of its expiry."""
        return self.active and self.undrawn > 0 and now < self.expires_at - margin_ms

    @property
    def dirty(self) -> bool:
        """True when local counts (or the stop) have not reached the holder yet."""
        return self.status != _SETTLED and (
            self.drawn > self.sent_drawn or self.released > self.sent_released or self.unsent_stop)

    @property
    def unsent_stop(self) -> bool:
        """Stopped, and the holder has not acknowledged the stop yet."""
        return self.stopped and not self.sent_stopped

    @property
    def returns_capacity(self) -> bool:
        """Its unreported changes free capacity at the holder: a release or a stop (R19, R30). A
        release of a live reusable lease frees nothing (its footprint is every slot, R30a)."""
        if self.reusable and not self.stopped and self.status == _LIVE:
            return False
        return self.released > self.sent_released or self.unsent_stop

    def report(self) -> LeaseReport:
        """The cumulative report of this lease (drawn, released, stopped)."""
        return LeaseReport(self.lease_id, self.drawn, self.released, self.stopped)

    @classmethod
    def _from_row(cls, r: Mapping[str, Any]) -> ClientLease:
        return cls(str(r["key"]), str(r["lease_id"]), str(r["group_name"]), int(r["permits"]),
                   int(r["drawn"]), int(r["released"]), bool(r["stopped"]), str(r["status"]),
                   int(r["expires_at"]), int(r["heartbeat_at"]), int(r["sent_drawn"]),
                   int(r["sent_released"]), bool(r["sent_stopped"]), bool(r["reusable"]))


#: A key's tombstones are pruned at most this many times per ``tombstone_ms`` (SPEC R35).
PRUNE_EVERY = 16


def prune_due(pruned_at: int, now: int, tombstone_ms: int) -> bool:
    """SPEC R35 decision (tombstones): whether a reply at ``now`` deletes the key's tombstones
    older than ``tombstone_ms``, the key's last prune having run at ``pruned_at`` (or its row
    having been written first then; 0: an older release's row). Only ``tombstone_ms /
    PRUNE_EVERY`` after it: a tombstone lives between ``tombstone_ms`` and about 17/16 of it,
    and most replies delete nothing (a prune is two statements)."""
    return now - pruned_at >= tombstone_ms // PRUNE_EVERY


#: The shortest wait of the room check (SPEC R34a): a key contended a moment ago asks again
#: after this, 2 s (twice the holder's default round period): a contention that other clients'
#: rounds end and restart again and again keeps the key's contention a moment old, and its room
#: checks come this far apart (1 s doubled them in a cold review's case, each then a request in
#: vain).
ROOM_CHECK_MIN_MS = 2000

#: SPEC R34a decision (young demand in a young contention): for this long after the message that
#: first found the key contended, demand a busy reusable lease serves whose oldest item was
#: enqueued less than this long ago is still asked for at each ``nextRequestAt``, as any demand
#: is (:func:`~semaphore.core.queue_plan.young_demand`); demand that has waited, or a contention
#: that lasts, is covered (room checks instead of requests).
COVER_AFTER_MS = 3000


def contended_since(since: int, contended: bool, sent_at: int) -> int:
    """SPEC R34a decision (the room check): the key's ``contended_since`` (``since`` before)
    after a reply to a message sent at ``sent_at``: kept while replies stay contended,
    ``sent_at`` for the first contended one, 0 once one is not."""
    if not contended:
        return 0
    return since or sent_at


@dataclass(frozen=True)
class KeyState:
    """What the client remembers of one key besides its grants and leases.

    :ivar next_request_at: the holder's last ``nextRequestAt`` (SPEC R11, R35).
    :ivar contended: the last reply was ``contended`` (SPEC R29).
    :ivar needs_sync: a ``request`` got no reply yet (it may have created a lease).
    :ivar check_at: when the post-request re-check sync is due (0: none pending).
    :ivar claim_ttl_ms: the holder's ``claimTtlMs`` of its last reply (0: not set).
    :ivar replied_at: when the message of the last reply applied was sent (0: never). Every reply
        lists every lease of the client (R8), so it is also when each was last confirmed live.
    :ivar lease_recheck_ms: the holder's ``leaseRecheckMs`` of its last reply (0: not set): no
        new item is drawn from a lease once ``replied_at`` is that old (R33a).
    :ivar room: the last reply said ``room`` (SPEC R34a room): demand a reusable lease covers is
        asked for now, contended or not.
    :ivar contended_since: when the message of the first of the key's unbroken run of
        ``contended`` replies was sent (0: the last reply was not contended); the room check's
        backoff (:meth:`room_check_at`).
    :ivar pruned_at: when the key's tombstones were last pruned, or its row first written
        (SPEC R35 decision "tombstones"; 0: a row of an older release).
    """

    next_request_at: int = 0
    contended: bool = False
    needs_sync: bool = False
    check_at: int = 0
    claim_ttl_ms: int = 0
    replied_at: int = 0
    lease_recheck_ms: int = 0
    room: bool = False
    contended_since: int = 0
    pruned_at: int = 0

    def after_reply(self, reply: ReplyFacts, *, now: int, sent_at: int, sync: bool, during_request: bool,
                    tombstone_ms: int) -> tuple[dict[str, int], bool]:
        """The key row after a reply to a message sent at ``sent_at`` is applied at ``now``, and
        whether the reply prunes the key's tombstones; ``self`` is the row before (a key never
        used: ``KeyState()`` with ``pruned_at = now``: no tombstone of it exists yet).

        * R11: ``next_request_at`` from the reply's ``nextRequestAt``.
        * A ``sync`` sent or answered while a request of the key waits for its round cannot
          show what that round creates: the request's ``needs_sync`` mark stays (only the
          request's own reply, or a later message, clears it). A sync clears a due re-check.
        * R33a: ``replied_at`` is when the message went, not when its reply came (the return
          leg is not freshness), and a slower reply of an earlier message never moves it back.
        * R34a: ``contended_since`` (:func:`contended_since`); R35: :func:`prune_due`."""
        check_at = self.check_at
        needs_sync = 0
        if sync and during_request:
            needs_sync = int(self.needs_sync)
        elif sync and 0 < check_at <= now:
            check_at = 0
        prune = prune_due(self.pruned_at, now, tombstone_ms)
        return {
            "next_request_at": reply.ask_at, "contended": int(reply.contended), "needs_sync": needs_sync,
            "check_at": check_at, "claim_ttl_ms": reply.claim_ttl_ms,
            "replied_at": max(sent_at, self.replied_at), "lease_recheck_ms": reply.lease_recheck_ms,
            "room": int(reply.room), "contended_since": contended_since(self.contended_since, reply.contended, sent_at),
            "pruned_at": now if prune else self.pruned_at,
        }, prune

    def room_check_at(self) -> int:
        """SPEC R34a decision (the room check): when a key whose demand a busy reusable lease
        covers next asks the holder whether capacity was freed: after its last reply by the
        time the key had been contended then (so the checks of one contention come about 2, 4,
        8, ... s in, doubling; young demand asks at each round instead until
        :data:`COVER_AFTER_MS` in, so a burst's first check comes about 4 s in), at least
        :data:`ROOM_CHECK_MIN_MS` and at most the holder's ``leaseRecheckMs``."""
        age = max(0, self.replied_at - self.contended_since) if self.contended_since else 0
        return self.replied_at + min(self.lease_recheck_ms, max(ROOM_CHECK_MIN_MS, age))

    def contention_young(self, now: int) -> bool:
        """SPEC R34a decision (young demand in a young contention): the key's replies have been
        ``contended`` for less than :data:`COVER_AFTER_MS` (``False`` when not contended, and
        for a row of an older release, which has no ``contended_since``)."""
        return self.contended and self.contended_since > 0 and now - self.contended_since < COVER_AFTER_MS

    def leases_confirmed(self, now: int) -> bool:
        """SPEC R33a: the last reply is recent enough to draw from the leases it showed live."""
        return self.lease_recheck_ms <= 0 or now < self.replied_at + self.lease_recheck_ms

    @classmethod
    def _from_row(cls, r: Mapping[str, Any] | None) -> KeyState:
        if r is None:
            return cls()
        return cls(int(r["next_request_at"]), bool(r["contended"]), bool(r["needs_sync"]), int(r["check_at"]),
                   int(r.get("claim_ttl_ms") or 0), int(r.get("replied_at") or 0),
                   int(r.get("lease_recheck_ms") or 0), bool(r.get("room") or 0),
                   int(r.get("contended_since") or 0), int(r.get("pruned_at") or 0))


@dataclass(frozen=True)
class ReplyFacts:
    """What :meth:`KeyState.after_reply` needs of a reply: its ``nextRequestAt`` as a time
    (``ask_at``), ``contended``, ``claimTtlMs`` and ``leaseRecheckMs`` (0: not set) and
    ``room``."""

    ask_at: int
    contended: bool
    claim_ttl_ms: int
    lease_recheck_ms: int
    room: bool


@dataclass(frozen=True)
class GrantMerge:
    """Merging one grant of a reply: the row to write (``None``: nothing changes) and what
    happened to it (:class:`~semaphore.client.AppliedReply` lists)."""

    row: ClientGrant | None
    dropped: bool = False
    expired: bool = False
    adopted: bool = False


def _adopt_grant(key: str, s: GrantState) -> GrantMerge:
    # SPEC R8: a grant whose reply was lost; adopt it as the holder knows it. The client never
    # released anything of a grant it did not know: what the holder shows released, it released
    # on its own (R15a: e.g. the client's grant rows were lost while its items ran on).
    assert s.group is not None
    settled = s.permits <= 0 or s.released >= s.permits
    g = ClientGrant(key, s.grant_id, s.group, s.permits, s.claimed, s.released, s.claimed,
                    int(s.claim_by or 0), GONE if settled else s.status.value, s.claimed, s.released,
                    s.released > 0)
    return GrantMerge(g, adopted=not settled, expired=s.status is GrantStatus.EXPIRED)


def merge_grant(key: str, local: ClientGrant | None, s: GrantState) -> GrantMerge:
    """Merge the holder's state ``s`` of a grant into the local copy ``local``.

    Counts are high-water marks (R13, :func:`~semaphore.core.marks.raise_counts`); an expired
    grant keeps only what the holder kept (claims beyond its permits were refused, R15); claims
    the holder shows are confirmed (R15a); a grant answered ``not_found`` or fully released
    (settled and deleted at the holder, R17) becomes a tombstone, and a tombstone never comes
    back (a stale reply)."""
    if local is not None and local.status == GONE:
        return GrantMerge(None)
    if s.status is GrantStatus.NOT_FOUND:
        return GrantMerge(None if local is None else replace(local, status=GONE), dropped=local is not None)
    if local is None:
        return GrantMerge(None) if s.group is None else _adopt_grant(key, s)
    expired = local.final or s.status is GrantStatus.EXPIRED
    permits = min(local.permits, s.permits)
    claimed, released = raise_counts(local.claimed, local.released, s.claimed, s.released,
                                     permits if expired else MAX_INT)
    settled = s.released >= s.permits
    g = replace(local, permits=permits, claimed=claimed, released=released,
                confirmed=min(max(local.confirmed, s.claimed), permits),
                claim_by=int(s.claim_by if s.claim_by is not None else local.claim_by),
                status=GONE if settled else (GrantStatus.EXPIRED.value if expired else _ACTIVE),
                sent_claimed=max(local.sent_claimed, s.claimed),
                sent_released=max(local.sent_released, s.released),
                holder_released=local.holder_released or s.released > local.released)
    return GrantMerge(g, dropped=settled, expired=not settled and expired and not local.final)


@dataclass(frozen=True)
class LeaseMerge:
    """Merging one lease of a reply: the row to write (``None``: nothing changes) and what
    happened to it."""

    row: ClientLease | None
    settled: bool = False
    adopted: bool = False
    retired: bool = False


def merge_lease(key: str, local: ClientLease | None, s: LeaseState, now: int) -> LeaseMerge:
    """Merge the holder's state ``s`` of a lease into the local copy ``local`` at ``now``.

    Counts are high-water marks clamped to the lease's permits (R13, R31); a retired lease stops
    drawing at once (R33); a later expiry of a live lease moves its heartbeat to half its new
    lifetime (R37); a settled lease becomes a tombstone that a stale reply cannot revive; a lease
    the client did not know is adopted (its reply was lost, R8)."""
    if local is not None and local.status == _SETTLED:
        return LeaseMerge(None)
    if s.status is LeaseStatus.SETTLED:
        row = None if local is None else replace(local, status=_SETTLED, stopped=True)
        return LeaseMerge(row, settled=True)
    expires_at = int(s.expires_at) if s.expires_at is not None else now
    heartbeat_at = now + max(0, expires_at - now) // 2
    if local is None:
        if s.group is None:
            return LeaseMerge(None)
        retired = s.status is LeaseStatus.RETIRED
        return LeaseMerge(ClientLease(key, s.lease_id, s.group, s.permits, s.drawn, s.released, retired,
                                      s.status.value, expires_at, heartbeat_at, s.drawn, s.released, False,
                                      s.reusable),
                          adopted=True, retired=retired)
    retired = local.status == _RETIRED or s.status is LeaseStatus.RETIRED
    # Never below what is counted here already: a lease that reused slots keeps its counts when
    # its flag drops (R34a: a reply without it), or they could read as released == drawn.
    drawn, released = raise_counts(local.drawn, local.released, s.drawn, s.released,
                                   MAX_INT if local.reusable else max(local.permits, local.drawn))
    if retired or s.expires_at is None or s.expires_at <= local.expires_at:
        expires_at, heartbeat_at = local.expires_at, local.heartbeat_at
        if not retired and heartbeat_at <= now:
            # Heard, not extended (R31a: a reusable lease while a request starves): the next
            # heartbeat at half of what is left (at least 1 s on), never at once again (each
            # would be a sync).
            heartbeat_at = now + max(1000, (expires_at - now) // 2)
    elif local.reusable and now < local.heartbeat_at:
        # R34a: an extension by another message (a recheck sync, R33a) does not postpone the
        # heartbeat that asks again for the demand the lease covers: it comes at least once per
        # half lifetime, so capacity that frees while that demand waits is asked for.
        heartbeat_at = min(heartbeat_at, local.heartbeat_at)
    x = replace(local, drawn=drawn, released=released,
                # R34a: reused only while the holder says so (a holder of an earlier release, or
                # one that does not know the lease, answers without the flag: no slot is reused)
                reusable=local.reusable and s.reusable,
                stopped=local.stopped or retired,  # SPEC R33: a retired lease stops drawing at once
                status=_RETIRED if retired else _LIVE, expires_at=expires_at, heartbeat_at=heartbeat_at,
                sent_drawn=max(local.sent_drawn, s.drawn), sent_released=max(local.sent_released, s.released))
    return LeaseMerge(x, retired=retired and local.status != _RETIRED)
