"""When the holder runs its next round: pure decisions over what the holder's shell knows.

SPEC R9 (batched rounds), R9a (free means now) and R11 (``nextRequestAt``). The shell
(:class:`~semaphore.DurabilitySemaphore`) keeps the waiting requests and the timers; every
choice of *when* is made here, from plain values, so it can be tested and reasoned about apart
from asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .allocation import LIMIT_ERROR
from .wire import MAX_LIST_LENGTH, PermitRequest

if TYPE_CHECKING:  # core.rounds imports this module
    from .rounds import Limits

__all__ = ["ROUND_WAIT_MS", "ROUND_PERIOD_MS", "SEED_ROUND_WAIT_MS", "SEED_ROUND_PERIOD_MS", "Timing", "hold_open",
           "limits_can_change", "limits_rose", "next_request_at", "reply_has_news", "round_may_commit", "round_start",
           "sync_room"]


#: SPEC R9 decision (round timing, issue 22): the holder's default ``round_wait_ms`` and
#: ``round_period_ms``. They only time batched rounds, which run only under contention (R9a).
ROUND_WAIT_MS = 100
ROUND_PERIOD_MS = 1000
#: The original's defaults (``roundWaitMs``, ``roundPeriodMs``): the seed's timing.
SEED_ROUND_WAIT_MS = 1000
SEED_ROUND_PERIOD_MS = 2000


@dataclass(frozen=True)
class Timing:
    """The holder options that decide when rounds run (see
    :class:`~semaphore.DurabilitySemaphore`: ``round_wait_ms``, ``round_period_ms``,
    ``free_at_once``)."""

    round_wait_ms: int = ROUND_WAIT_MS
    round_period_ms: int = ROUND_PERIOD_MS
    free_at_once: bool = True

    def immediate(self, contended: bool) -> bool:
        """SPEC R9a: whether the next round runs at once: ``free_at_once`` and no contention
        seen (the last committed round left no need unserved, and no round since was declined)."""
        return self.free_at_once and not contended


def round_start(timing: Timing, now: int, *, first_since: int, last_batched_at: int | None,
                contended: bool, running: bool, urgent: bool = False) -> int | None:
    """When the round for the waiting requests starts, once no round timer waits for them.

    SPEC R9a: free means now. Without contention (:meth:`Timing.immediate`) the round runs at
    ``now``, or, while another round runs, as soon as that one ends (``None``: its end starts
    it; immediate rounds never overlap, so each decides on what the previous committed).
    SPEC R9b: a waiting try (``urgent``) starts its round the same way, whatever the contention.
    SPEC R9: otherwise it is batched, ``round_wait_ms`` after the first waiting request
    arrived (``first_since``) but never sooner than ``round_period_ms`` after the previous
    batched round began (``last_batched_at``: rounds run at once do not space them), and never
    before ``now``."""
    if urgent or timing.immediate(contended):
        return None if running else now
    at = first_since + timing.round_wait_ms
    if last_batched_at is not None:
        at = max(at, last_batched_at + timing.round_period_ms)
    return max(at, now)


def round_may_commit(timing: Timing, *, immediate: bool, unserved: bool, urgent: bool = False) -> bool:
    """SPEC R9a: a round run at once commits only if it leaves no need unserved (every demand of
    its batch fits). One that would leave some need unserved writes nothing: its requests wait
    for a batched round (R9), where oldest demand first decides among everything that arrived
    meanwhile. A batched round always commits, and so does a round with a try in it (``urgent``,
    R9b: it is answered by this round, served or not)."""
    return urgent or not (immediate and unserved)


def next_request_at(timing: Timing, now: int, *, last_round_at: int | None, contended: bool,
                    round_at: int | None) -> int:
    """SPEC R11: the earliest time the next round can run: a waiting round timer's time; ``now``
    while rounds run at once (R9a); else ``round_period_ms`` after the last round began, not
    before ``now``."""
    if round_at is not None:
        return round_at
    if timing.immediate(contended) or last_round_at is None:
        return now
    return max(now, last_round_at + timing.round_period_ms)


def sync_room(*, freed: bool, waiting: bool) -> bool:
    """SPEC R34a (room): whether a sync's reply says ``room``: with reusable leases, capacity
    freed since the last committed round (``freed``: a report released some, a
    reclaim, a crash expiry or a force-settle freed some, or the limit rose) while no request
    waits at the holder (``waiting``: held, waiting for its round, or in a running round). A
    client whose demand its reusable lease covers then asks for it now, instead of at the
    lease's heartbeat (half its lifetime); every other behaviour of the reply (``contended``,
    R29) is unchanged. Requests that wait already take the freed capacity in their round."""
    return freed and not waiting


def room_after_round(*, reusable: bool, charged: int, ceiling: int | None, unserved: bool) -> bool:
    """SPEC R34a decision (room): whether syncs say ``room`` after a committed round: with
    reusable leases, when the round served every need it was asked for (``unserved`` false)
    and left capacity free (``charged`` below the ``ceiling`` leases may fill: the limit, plus
    the ``over`` extra). What is left is then free for demand that reusable leases cover and
    that went to no round, which asks for it once a sync tells it. A round that left need
    unserved (a group at its ceiling, a refusal of ``can_grant``) says nothing: its free
    capacity is what that need may not use, and a covered client told ``room`` would ask in
    vain at every room check. Before, a committed round always cleared the flag: capacity it
    left free reached a covered client only at its lease's heartbeat."""
    return reusable and isinstance(ceiling, int) and charged < ceiling and not unserved


def reply_has_news(reply: Mapping[str, Any], request: PermitRequest) -> bool:
    """SPEC R9 decisions (waiting requests; a lost reply is not held): a reply the client must
    hear at once even if the round served it nothing: a lease no longer live (retired, R33: it
    stops drawing at once; settled), a grant no longer plain active (expired, not found), or a
    grant or lease the request did not report (the client does not know it: the reply of the
    round that issued it was lost, e.g. the process died after the commit; held, it would stay
    charged unused until the deadline). A report list at the wire's bound (R7) may leave known
    entries out, so it says nothing of them."""
    leases, grants = reply.get("leases") or (), reply.get("grants") or ()
    if any(x.get("status") != "live" for x in leases) or any(g.get("status") != "active" for g in grants):
        return True
    if len(request.grants) < MAX_LIST_LENGTH:
        known = {r.grant_id for r in request.grants}
        if any(g.get("grantId") not in known for g in grants):
            return True
    reported = request.leases or ()
    if len(reported) < MAX_LIST_LENGTH:
        known = {r.lease_id for r in reported}
        return any(x.get("leaseId") not in known for x in leases)
    return False


def hold_open(*, hold_ms: int, is_try: bool, served: bool, blocked: bool, now: int, hold_until: int,
              answered: bool, news: Callable[[], bool]) -> bool:
    """SPEC R9 decision (waiting requests): whether a request is held open instead of answered
    by its round: holding is on (``hold_ms`` > 0), it is no try (R9b), the round served its
    client nothing (``served`` false) and left it ``blocked``, its deadline (``hold_until``) has
    not come, some call still waits for it (``answered`` false: every call gave up), and its
    reply carries no news (``news()``, :func:`reply_has_news`: asked last, and only then, since
    it reads the whole reply; with holding off, the default, never)."""
    return (hold_ms > 0 and not is_try and not served and blocked and now < hold_until and not answered
            and not news())


def limits_can_change(limit: Any, group_limit: Any, can_grant: Any) -> bool:
    """SPEC R9 decision (limits that rise): whether the holder's limit options can resolve to
    something else later: a callable ``limit``, ``group_limit`` or ``can_grant``, or a
    ``group_limit`` mapping (the application may change it in place). Plain values cannot: the
    holder never re-reads them."""
    return callable(limit) or callable(group_limit) or isinstance(group_limit, Mapping) or callable(can_grant)


def _rose(before: Any, after: Any, *, none_is_unlimited: bool) -> bool:
    """One resolved limit rose: a larger count, a count where resolution failed, or (a group
    limit) none where there was one."""
    if after is LIMIT_ERROR or after == before:
        return False
    if before is LIMIT_ERROR:
        return True
    if after is None:
        return none_is_unlimited and before is not None
    return isinstance(before, int) and isinstance(after, int) and after > before


def limits_rose(before: Limits, after: Limits) -> bool:
    """SPEC R9 decision (limits that rise): whether limits resolved again while requests are
    held (``after``) let a round serve more than the round that held them (``before``): the
    limit rose, a group limit of a group both resolved rose (or no longer applies), or
    ``can_grant`` now allows a ``(client, group)`` pair it refused. A lowered limit starts
    nothing: it can serve nobody more."""
    if _rose(before.limit, after.limit, none_is_unlimited=False):
        return True
    if any(_rose(before.group_limits[g], gl, none_is_unlimited=True)
           for g, gl in after.group_limits.items() if g in before.group_limits):
        return True
    return any(ok and before.permitted.get(pair) is False for pair, ok in after.permitted.items())
