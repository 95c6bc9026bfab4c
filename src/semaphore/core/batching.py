"""When the holder runs its next round: pure decisions over what the holder's shell knows.

SPEC R9 (batched rounds), R9a (free means now) and R11 (``nextRequestAt``). The shell
(:class:`~semaphore.DurabilitySemaphore`) keeps the waiting requests and the timers; every
choice of *when* is made here, from plain values, so it can be tested and reasoned about apart
from asyncio.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Timing", "next_request_at", "round_may_commit", "round_start", "sync_room"]


@dataclass(frozen=True)
class Timing:
    """The holder options that decide when rounds run (see
    :class:`~semaphore.DurabilitySemaphore`: ``round_wait_ms``, ``round_period_ms``,
    ``free_at_once``)."""

    round_wait_ms: int = 1000
    round_period_ms: int = 2000
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
