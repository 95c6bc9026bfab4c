"""The queue's decisions (SPEC R15, R15a, R29, R31, R34, R37), as pure functions.

:class:`~semaphore.client.SemaphoreQueue` is their shell: for one key it loads a
:class:`KeySnapshot` (its items, the client's grants, leases and key state, the time), asks a
planner below what to do, lets :mod:`semaphore.core.client_step` turn an admission's or a
reply's plan into the rows' new values, and persists them. Nothing here reads a clock, touches
storage or awaits:

* :func:`plan_admission`: resolve confirmed or refused claims (R15a), claim grant slots and draw
  lease permits for queued items (R34; leases first when everything fits, ``prefer_leases``),
  stop leases with nothing left to give (R29, R37), give back grant permits nothing queued can
  use (R37 decision), purge old finished items.
* :func:`plan_reply`: what a reply changes (claims resolved, leases stopped when contended, R29).
* :func:`plan_exchange`: whether to send a ``sync``, a ``request`` (with which demand), or nothing.
* :func:`report_due`: when the key's reports need a message of their own (R37 decision).
* :func:`next_wake`: when the queue next wants to work on the key (its items' times:
  :func:`item_times`).
* Admitted items: a callback's retry waits for the holder (:func:`retry_waits_for_holder`), a
  permit gone at the holder (:func:`permit_gone`), ``work`` attempts used up
  (:func:`work_exhausted`), the pause after :data:`MAX_EXCHANGES` exchanges
  (:func:`pause_after_exchanges`).
* A :meth:`~semaphore.client.SemaphoreQueue.permit` call: whether it is a try
  (:func:`is_try`), what a try's caller gets once the holder answered (:func:`try_answer`), and
  the words of a permit refused (:func:`refusal`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from .client_state import COVER_AFTER_MS, GONE, ClientGrant, ClientLease, KeyState
from .wire import MAX_LIST_LENGTH, Blocked

__all__ = [
    "QueueOptions", "QueuedItem", "ClaimingItem", "KeySnapshot",
    "Resolution", "Resolve", "Claim", "Draw", "GiveBack", "AdmissionPlan", "ReplyPlan",
    "PendingReleases", "ReportDue", "Exchange", "ItemTimes",
    "resolve_claims", "held_slots", "completion_releases", "admissible", "demand_of", "leases_to_stop",
    "plan_admission", "plan_reply", "report_due",
    "heartbeat_due", "plan_exchange", "next_wake", "covered_groups", "young_demand", "wants_round", "recheck_due",
    "room_check_due", "room_check_pending",
    "MAX_EXCHANGES", "Pause", "pause_after_exchanges", "retry_waits_for_holder", "permit_gone", "records_release",
    "Completion", "completion", "Completed", "Finish", "CompletionWrites", "completion_writes", "work_exhausted",
    "Failure", "after_failure",
    "item_times", "admit_room", "demand_grew", "reconcile_due", "reconcile_checks",
    "TryAnswer", "is_try", "try_answer", "refusal", "purge_due_before",
]


@dataclass(frozen=True)
class QueueOptions:
    """The queue's options the planner reads (see :class:`~semaphore.client.SemaphoreQueue`)."""

    claim_margin_ms: int = 500
    lease_margin_ms: int = 1000
    report_releases_within_ms: int = 10_000
    prefer_leases: bool = True
    retention_ms: int = 86_400_000
    reconcile_after_ms: int | None = None
    done_hook: bool = False
    #: Requests carry ``waitMs`` (``request_wait_ms``): the holder may hold them open.
    held_requests: bool = False


@dataclass(frozen=True)
class QueuedItem:
    """An item waiting for a permit (state ``queued``); ``bounded``: its work runs in a callback
    (``on_admit`` / ``work``), so its admission counts against ``admit_concurrency``; a permit
    (:meth:`~semaphore.client.SemaphoreQueue.permit`) has a caller waiting and is not bounded."""

    item_id: str
    group: str
    seq: int
    bounded: bool = True
    enqueued_at: int = 0


@dataclass(frozen=True)
class ClaimingItem:
    """An item whose claim of slot ``slot`` of grant ``grant_id`` awaits confirmation (R15a);
    ``cancel``: :meth:`~semaphore.client.SemaphoreQueue.complete` was called meanwhile."""

    item_id: str
    group: str
    seq: int
    grant_id: str
    slot: int
    cancel: bool = False
    bounded: bool = True
    enqueued_at: int = 0


@dataclass(frozen=True)
class KeySnapshot:
    """Everything the planner decides over for one key, at ``now``.

    :ivar queued: / :ivar claiming: the key's items in those states, in enqueue order.
    :ivar grants: the client's live grants of the key, earliest ``claimBy`` first.
    :ivar claim_grants: the grant (tombstones included) each claiming item names, ``None`` if
        the client forgot it.
    :ivar leases: the client's live (not settled) leases of the key, earliest expiry first.
    :ivar pending_since: since when releases have waited to be reported (``None``: none).
    :ivar admit_room: how many more bounded items may be admitted now (``admit_concurrency``
        minus the key's claiming items and running items whose callback has not returned);
        ``None``: no bound.
    :ivar running: per grant id, how many running items hold a slot of it.
    """

    now: int
    queued: tuple[QueuedItem, ...] = ()
    claiming: tuple[ClaimingItem, ...] = ()
    grants: tuple[ClientGrant, ...] = ()
    claim_grants: Mapping[str, ClientGrant | None] = field(default_factory=dict)
    leases: tuple[ClientLease, ...] = ()
    key: KeyState = field(default_factory=KeyState)
    pending_since: int | None = None
    admit_room: int | None = None
    running: Mapping[str, int] = field(default_factory=dict)

    def queued_groups(self) -> dict[str, list[str]]:
        """Queued item ids per group, in enqueue order."""
        out: dict[str, list[str]] = {}
        for item in self.queued:
            out.setdefault(item.group, []).append(item.item_id)
        return out


# ============================================================================ claims (R15a)
class Resolve(str, enum.Enum):
    """What becomes of a claiming item."""

    START = "start"  #: confirmed: run it
    RELEASE = "release"  #: confirmed but cancelled: release a slot of its grant, finish the item
    #: refused and cancelled, or confirmed and cancelled with no slot of its grant to release
    #: (:func:`resolve_claims`): finish it, nothing released
    FINISH = "finish"
    #: refused, or confirmed with no slot of its grant to run under (:func:`resolve_claims`):
    #: back to the queue, original position
    REQUEUE = "requeue"


@dataclass(frozen=True)
class Resolution:
    item_id: str
    action: Resolve
    grant_id: str


def _resolve(item: ClaimingItem, g: ClientGrant | None) -> Resolve | None:
    if g is not None and g.confirmed >= item.slot:
        return Resolve.RELEASE if item.cancel else Resolve.START
    if g is None or g.final:  # never confirmed now: expired clamp or dropped
        return Resolve.FINISH if item.cancel else Resolve.REQUEUE
    return None  # still waiting for the holder


def _room(g: ClientGrant, running: Mapping[str, int]) -> int:
    """How many of the grant's confirmed, unreleased slots no running item holds: the slots a
    claim's resolution may start an item under or release (none of a dropped grant)."""
    return 0 if g.status == GONE else g.releasable - running.get(g.grant_id, 0)


def resolve_claims(snap: KeySnapshot) -> tuple[Resolution, ...]:
    """SPEC R15a: start the claiming items whose slot the holder confirmed; put back (or, if
    cancelled, finish) those whose grant will never confirm them; leave the rest waiting.

    Slots are counted, not named, so a confirmed slot is used only while the grant has one
    that no running item holds (:func:`_room`): first by the items that start (in enqueue
    order), then by the cancelled items that release theirs. An item that finds none goes back
    to the queue, a cancelled one is finished with nothing released. In normal operation every
    confirmed slot is held by one item or idle, so there is always room; the holder may have
    released slots on its own, though: its crash expiry (``claim_ttl_ms``, R18 decision) raises
    ``released`` to ``claimed`` while the client is cut off, and the reply that then confirms
    a claim shows both. Starting or releasing past the room would run an item uncharged (I4).
    A dropped grant (a tombstone) has no room."""
    resolved = [(item, snap.claim_grants.get(item.grant_id)) for item in snap.claiming]
    actions = [_resolve(item, g) for item, g in resolved]
    room: dict[str, int] = {}
    for wanted, short in ((Resolve.START, Resolve.REQUEUE), (Resolve.RELEASE, Resolve.FINISH)):
        for n, (_, g) in enumerate(resolved):
            if actions[n] is wanted and g is not None:
                left = room[g.grant_id] = room.get(g.grant_id, _room(g, snap.running)) - 1
                actions[n] = wanted if left >= 0 else short
    return tuple(Resolution(item.item_id, action, item.grant_id)
                 for (item, _), action in zip(resolved, actions) if action is not None)


def held_slots(running: Mapping[str, int], claiming: Iterable[ClaimingItem],
               grants: Mapping[str, ClientGrant | None]) -> dict[str, int]:
    """Per grant id, how many of its confirmed slots items hold (R15a): its ``running`` items'
    and those of its ``claiming`` items whose slot the holder confirmed (each starts, or its
    resolution releases the slot, :func:`resolve_claims`); ``grants``: the claims' grants."""
    held = dict(running)
    for c in claiming:
        g = grants.get(c.grant_id)
        if g is not None and c.slot <= g.confirmed:
            held[c.grant_id] = held.get(c.grant_id, 0) + 1
    return held


def completion_releases(g: ClientGrant, *, held_after: int) -> int:
    """SPEC R15a decision (a confirmed slot is used only where the holder still charges one),
    at completions: how many slots of grant ``g`` the completions of its running items release,
    ``held_after`` of its slots still held then (:func:`held_slots`: items still running, claims
    confirmed). In normal operation that is one per completed item; fewer once the holder
    released slots on its own (its crash expiry, ``claim_ttl_ms``; ``g.holder_released``): a
    release past them would leave an item that still runs uncharged (I4). None of a dropped
    grant."""
    return max(0, _room(g, {g.grant_id: held_after}))


def _after_resolutions(snap: KeySnapshot, resolutions: tuple[Resolution, ...]) -> KeySnapshot:
    """``snap`` with requeued items back in the queue (in enqueue order) and resolved items no
    longer claiming."""
    resolved = {r.item_id for r in resolutions}
    back = {r.item_id for r in resolutions if r.action is Resolve.REQUEUE}
    queued = list(snap.queued) + [QueuedItem(c.item_id, c.group, c.seq, c.bounded, c.enqueued_at)
                                  for c in snap.claiming if c.item_id in back]
    room = snap.admit_room
    if room is not None:  # a claim that ended without starting its item frees its callback slot
        started = {r.item_id for r in resolutions if r.action is Resolve.START}
        room += sum(1 for c in snap.claiming if c.bounded and c.item_id in resolved and c.item_id not in started)
    return replace(snap, queued=tuple(sorted(queued, key=lambda i: i.seq)),
                   claiming=tuple(c for c in snap.claiming if c.item_id not in resolved), admit_room=room)


# ============================================================================ leases (R29, R37)
def leases_to_stop(snap: KeySnapshot, opts: QueueOptions, *, contended: bool) -> tuple[str, ...]:
    """Leases to stop: those with nothing left to draw (settle them), and those in groups with
    nothing queued when the reply was ``contended`` (R29) or shortly before they expire."""
    queued = snap.queued_groups()
    out = []
    for lease in snap.leases:
        if not lease.active:
            continue
        expiring = snap.now >= lease.expires_at - opts.lease_margin_ms
        # R29 (for a reusable lease also after the reply: its idle slots are charged whole, R30a)
        idle = not queued.get(lease.group) and (
            contended or expiring or (lease.reusable and (snap.key.contended or lease.in_use == 0)))
        # R31a: a reusable lease the holder did not extend is stopped before it expires (its
        # free slots go back at once; its demand goes to a round again).
        if lease.used_up or idle or (lease.reusable and expiring):
            out.append(lease.lease_id)
    return tuple(out)


def covered_groups(snap: KeySnapshot, opts: QueueOptions) -> set[str]:
    """SPEC R34a: groups served by an active reusable lease (busy or not, not within
    ``lease_margin_ms`` of its expiry) while the key's last reply was
    ``contended`` (R29: there is no room to grow it): their demand is not asked for again before
    the lease's heartbeat, which then goes as a request carrying it (a round can still grow
    the key's share when room frees); meanwhile :func:`room_check_due` syncs, backing off up to
    ``leaseRecheckMs``, to hear of room. Without contention every demand is asked for, and so it
    is when requests may be held at the holder (``request_wait_ms``): a held request costs one
    call per hold and is answered by the first round that frees room. Nor is it when the last
    reply said ``room`` (a sync's, R34a room: capacity freed since the last round, nobody waits
    at the holder): the demand is asked for now, and the round that takes it answers without.
    Nor is :func:`young_demand` (R34a decision "young demand in a young contention"): a burst's
    contention is short and capacity frees within it, so its new demand is asked for at each
    round; demand that has waited, or a contention that lasts, is covered."""
    if not snap.key.contended or snap.key.room or opts.held_requests:
        return set()
    young = young_demand(snap)
    return {x.group for x in snap.leases
            if x.reusable and x.active and snap.now < x.expires_at - opts.lease_margin_ms and x.group not in young}


def young_demand(snap: KeySnapshot) -> set[str]:
    """SPEC R34a decision (young demand in a young contention): while the key's contention is
    younger than :data:`~semaphore.core.client_state.COVER_AFTER_MS`
    (:meth:`~semaphore.core.client_state.KeyState.contention_young`), the groups whose oldest
    admissible queued item (:func:`admissible`: the items its demand is made of, R21) was
    enqueued less than that long ago: no reusable lease covers them (their demand goes to
    each round). Both must be young: a contention that other clients' rounds end and restart
    again and again leaves demand that has waited covered, and a lasting one leaves every
    demand covered."""
    if not snap.key.contention_young(snap.now):
        return set()
    admit = {item_id for ids in admissible(snap).values() for item_id in ids}
    oldest: dict[str, int] = {}
    for item in snap.queued:
        if item.item_id in admit:
            oldest[item.group] = min(oldest.get(item.group, item.enqueued_at), item.enqueued_at)
    return {group for group, at in oldest.items() if snap.now - at < COVER_AFTER_MS}


def wants_round(snap: KeySnapshot, opts: QueueOptions) -> bool:
    """Some admissible item's group is not :func:`covered_groups`: its demand needs a round."""
    admit = admissible(snap)
    return bool(admit) and not _all_covered(admit, snap, opts)


def _all_covered(admit: Mapping[str, object], snap: KeySnapshot, opts: QueueOptions) -> bool:
    covered = covered_groups(snap, opts)
    return bool(covered) and all(group in covered for group in admit)


# ============================================================================ admission
@dataclass(frozen=True)
class Claim:
    """Claim ``slots`` of grant ``grant_id`` for ``item_ids`` (pairwise; pending confirmation)."""

    grant_id: str
    slots: tuple[int, ...]
    item_ids: tuple[str, ...]


@dataclass(frozen=True)
class Draw:
    """Draw one permit of lease ``lease_id`` per item of ``item_ids``, in order (slots
    ``first_slot``, ``first_slot + 1``, ...; no confirmation needed, R30)."""

    lease_id: str
    first_slot: int
    item_ids: tuple[str, ...]

    @property
    def slots(self) -> tuple[int, ...]:
        """The slots drawn, one per item of ``item_ids``, in order."""
        return tuple(range(self.first_slot, self.first_slot + len(self.item_ids)))


@dataclass(frozen=True)
class GiveBack:
    """Grant ``grant_id``'s ``count`` permits that no item will run under. As a give-back: claim
    them (the report goes at once: an unsent claim is due at once); as idle slots: release that
    many of its confirmed slots that no item holds (:func:`_idle_slots`)."""

    grant_id: str
    count: int


@dataclass(frozen=True)
class AdmissionPlan:
    """What one local admission step does, in this order: resolutions, claims, draws, stops,
    give-backs (claimed), idle slots (released, and reported at once, as the stop of a lease
    that returns undrawn permits, R29: nothing used them and others may wait); ``wake_now``: an
    item finished (its ``on_done`` hook is due);
    ``purge_done_before``: delete finished items older than this (``None``: keep them), once
    the earliest finished item is older than ``purge_due_before`` (:func:`purge_due_before`)."""

    resolutions: tuple[Resolution, ...] = ()
    claims: tuple[Claim, ...] = ()
    draws: tuple[Draw, ...] = ()
    stops: tuple[str, ...] = ()
    give_backs: tuple[GiveBack, ...] = ()
    idle_slots: tuple[GiveBack, ...] = ()
    wake_now: bool = False
    purge_done_before: int | None = None
    purge_due_before: int | None = None


def purge_due_before(now: int, retention_ms: int) -> int:
    """SPEC R37 (finished items kept ``retention_ms``): a purge of finished items runs once the
    earliest of them finished before this, 1/16 of the retention beyond its cutoff, so one
    purge deletes what finished over that 1/16 instead of each pump deleting the few items
    that have just aged out (and folding their recorded releases, R35). A finished item is
    kept between ``retention_ms`` and about 17/16 of it."""
    return now - retention_ms - retention_ms // 16


def admissible(snap: KeySnapshot) -> dict[str, list[str]]:
    """The queued items that may be admitted now, per group in enqueue order: every permit item,
    and the oldest bounded items up to ``admit_room`` (``admit_concurrency``: a callback's item is
    not admitted while the callbacks of that many others are still running, so no permit waits
    idle for a callback slot)."""
    return _admissible(snap.queued, snap.admit_room)


def _admissible(queued: tuple[QueuedItem, ...], room: int | None) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in queued:
        if item.bounded and room is not None:
            if room <= 0:
                continue
            room -= 1
        out.setdefault(item.group, []).append(item.item_id)
    return out


def demand_of(queued: tuple[QueuedItem, ...], room: int | None) -> list[tuple[str, int, int]]:
    """The demand to ask the holder for, ``(group, count, oldestAt)``: per group, exactly the
    items :func:`admissible` would admit (asking for more would get grant permits that wait
    unclaimed until ``claimBy`` while others need them), with the oldest of those items as its
    age (R21: an item held back by ``admit_concurrency`` lends its age to no other); oldest group
    first, at most :data:`~semaphore.core.wire.MAX_LIST_LENGTH` groups (R7: the others are asked
    for once these are served)."""
    admit = _admissible(queued, room)
    admitted = {i for ids in admit.values() for i in ids}
    oldest: dict[str, int] = {}
    for item in queued:
        if item.item_id in admitted:
            oldest[item.group] = min(oldest.get(item.group, item.enqueued_at), item.enqueued_at)
    rows = sorted(((g, len(ids), oldest[g]) for g, ids in admit.items()), key=lambda r: (r[2], r[0]))
    return rows[:MAX_LIST_LENGTH]


def _lease_only_groups(snap: KeySnapshot, opts: QueueOptions, queued: dict[str, list[str]]) -> set[str]:
    """Groups whose queued items all fit in live leases: drawn (no round trip) rather than
    claimed (a claim costs a confirming sync, R15a); grant permits go back at claimBy (R15)."""
    if not opts.prefer_leases:
        return set()
    room: dict[str, int] = {}
    for lease in snap.leases:
        if lease.drawable(snap.now, opts.lease_margin_ms):
            room[lease.group] = room.get(lease.group, 0) + lease.undrawn
    return {group for group, items in queued.items() if len(items) <= room.get(group, 0)}


def _claims(snap: KeySnapshot, opts: QueueOptions, queued: dict[str, list[str]]) -> tuple[Claim, ...]:
    lease_only = _lease_only_groups(snap, opts, queued)
    out = []
    for g in snap.grants:
        items = queued.get(g.group)
        if not items or g.group in lease_only or g.unclaimed <= 0 \
                or snap.now >= g.claim_by - opts.claim_margin_ms:
            continue
        n = min(len(items), g.unclaimed)
        out.append(Claim(g.grant_id, tuple(range(g.claimed + 1, g.claimed + n + 1)), tuple(items[:n])))
        del items[:n]
    return tuple(out)


def recheck_due(snap: KeySnapshot, opts: QueueOptions) -> bool:
    """SPEC R33a: an admissible item waits for a lease that has room to draw it, but the key's
    last reply is older than the holder's ``leaseRecheckMs``: a ``sync`` must confirm the lease
    live before the draw (a lowered limit retires it at the holder, R33)."""
    if snap.key.leases_confirmed(snap.now):
        return False
    groups = {x.group for x in snap.leases if x.drawable(snap.now, opts.lease_margin_ms)}
    return bool(groups) and any(g in groups for g in admissible(snap))


def room_check_due(snap: KeySnapshot, opts: QueueOptions) -> bool:
    """SPEC R34a decision (the room check): demand that :func:`covered_groups` keeps from a
    round waits for its lease's heartbeat, but not without news: at the key's
    :meth:`~semaphore.core.client_state.KeyState.room_check_at` (2 s, 4 s, 8 s, ... into the
    contention, at most the holder's ``leaseRecheckMs`` apart, R33a) a ``sync`` asks whether
    capacity was freed meanwhile (its reply's ``room``; the demand then goes in a request) and
    confirms the lease live."""
    return room_check_pending(snap, opts) and snap.now >= snap.key.room_check_at()


def room_check_pending(snap: KeySnapshot, opts: QueueOptions) -> bool:
    """The key has demand that a busy reusable lease covers, and room checks are on (the
    holder tells a ``leaseRecheckMs``): :func:`room_check_due` comes at its time."""
    return snap.key.lease_recheck_ms > 0 and bool(admissible(snap)) and not wants_round(snap, opts) \
        and bool(covered_groups(snap, opts))


def _draws(snap: KeySnapshot, opts: QueueOptions, queued: dict[str, list[str]]) -> tuple[Draw, ...]:
    if not snap.key.leases_confirmed(snap.now):  # R33a: confirm the leases live first
        return ()
    out = []
    for lease in snap.leases:
        items = queued.get(lease.group)
        if not items or not lease.drawable(snap.now, opts.lease_margin_ms):
            continue
        n = min(len(items), lease.undrawn)
        out.append(Draw(lease.lease_id, lease.drawn + 1, tuple(items[:n])))
        del items[:n]
    return tuple(out)


def _give_backs(snap: KeySnapshot, opts: QueueOptions, claims: tuple[Claim, ...]) -> tuple[GiveBack, ...]:
    """Grant permits nothing can use (R37 decision, surplus grants), to claim now and release once
    the holder confirms them (:func:`_idle_slots`): the unclaimed permits of an
    active grant whose group has no item queued or claiming (``snap``: after this step's claims
    and draws), no claim made by this step (``claims``) and no lease. A grant answering demand
    that went away while its request was on the way (a withdrawn permit, an item completed
    before admission) would otherwise stay charged until its claimBy (R15) while others may
    wait for it. A group with a lease keeps its grant until claimBy as before (leases first:
    its items are drawn, the grant goes back at reclaim); a grant within ``claim_margin_ms`` of
    its claimBy is left to the holder's reclaim."""
    claimed = {c.grant_id for c in claims}
    busy = {i.group for i in snap.queued} | {c.group for c in snap.claiming} | {x.group for x in snap.leases} \
        | {g.group for g in snap.grants if g.grant_id in claimed}
    return tuple(GiveBack(g.grant_id, g.unclaimed) for g in snap.grants
                 if g.unclaimed > 0 and g.group not in busy and snap.now < g.claim_by - opts.claim_margin_ms)


def _idle_slots(snap: KeySnapshot) -> tuple[GiveBack, ...]:
    """Confirmed grant slots that no item holds, to release (R37 decision, surplus grants; R15a):
    the given-back ones, once the holder has confirmed their claim. Only a confirmed slot is
    released: a claim that reached the holder after ``claimBy`` was refused (R15), so a release
    reported for it would be counted against a slot an item runs under (I4). ``snap`` is before
    this step's resolutions: a confirmed claiming item still holds its slot (it starts, or its
    resolution releases it)."""
    held = held_slots(snap.running, snap.claiming, snap.claim_grants)
    idle = ((g.grant_id, g.releasable - held.get(g.grant_id, 0)) for g in snap.grants)
    return tuple(GiveBack(grant_id, n) for grant_id, n in idle if n > 0)


def _after_admission(snap: KeySnapshot, claims: tuple[Claim, ...], draws: tuple[Draw, ...]) -> KeySnapshot:
    """``snap`` once the claims and draws are done (for the stop decisions)."""
    taken = {i for c in claims for i in c.item_ids} | {i for d in draws for i in d.item_ids}
    drawn = {d.lease_id: len(d.item_ids) for d in draws}
    leases = tuple(replace(x, drawn=x.drawn + drawn[x.lease_id]) if x.lease_id in drawn else x
                   for x in snap.leases)
    return replace(snap, queued=tuple(i for i in snap.queued if i.item_id not in taken), leases=leases)


def plan_admission(snap: KeySnapshot, opts: QueueOptions, *, with_claims: bool = True) -> AdmissionPlan:
    """Resolve claims, claim from grants (pending confirmation, R15a; none if ``with_claims`` is
    false), draw from leases (R34, R34a), stop leases with nothing left to draw or idle before
    expiry (R37), give back grant permits nothing can use (:func:`_give_backs`; only with
    ``with_claims``: giving back is a claim too), release confirmed slots no item holds
    (:func:`_idle_slots`)."""
    idle = _idle_slots(snap)
    resolutions = resolve_claims(snap)
    snap = _after_resolutions(snap, resolutions)
    queued = admissible(snap)
    claims = _claims(snap, opts, queued) if with_claims else ()
    draws = _draws(snap, opts, queued)
    after = _after_admission(snap, claims, draws)
    stops = leases_to_stop(after, opts, contended=False)
    give_backs = _give_backs(after, opts, claims) if with_claims else ()
    finished = any(r.action in (Resolve.RELEASE, Resolve.FINISH) for r in resolutions)
    return AdmissionPlan(resolutions, claims, draws, stops, give_backs, idle, wake_now=finished and opts.done_hook,
                         purge_done_before=snap.now - opts.retention_ms if opts.retention_ms else None,
                         purge_due_before=purge_due_before(snap.now, opts.retention_ms) if opts.retention_ms else None)


@dataclass(frozen=True)
class ReplyPlan:
    """What a reply changes: claims resolved and leases stopped (``wake_now`` as in
    :class:`AdmissionPlan`)."""

    resolutions: tuple[Resolution, ...] = ()
    stops: tuple[str, ...] = ()
    wake_now: bool = False


def plan_reply(snap: KeySnapshot, opts: QueueOptions, *, contended: bool) -> ReplyPlan:
    """After a reply (R15a, R29): resolve claims, then stop leases with nothing left to draw and
    those of groups with nothing queued if the reply was ``contended``."""
    resolutions = resolve_claims(snap)
    stops = leases_to_stop(_after_resolutions(snap, resolutions), opts, contended=contended)
    finished = any(r.action in (Resolve.RELEASE, Resolve.FINISH) for r in resolutions)
    return ReplyPlan(resolutions, stops, wake_now=finished and opts.done_hook)


# ============================================================================ reports (R37)
class PendingReleases(str, enum.Enum):
    """What becomes of the key's "releases waiting since" mark."""

    KEEP = "keep"  #: unchanged
    START = "start"  #: releases wait: keep the mark, or set it to ``now`` if there is none
    CLEAR = "clear"  #: nothing waits: remove it


@dataclass(frozen=True)
class ReportDue:
    """:ivar at: when the reports need a message of their own (``None``: not at all)."""

    at: int | None
    pending: PendingReleases = PendingReleases.KEEP


def _urgent(snap: KeySnapshot) -> bool:
    """Reports that cannot wait: a request whose reply was lost, claims not yet sent (R15a), a
    stop that returns undrawn lease permits (R29)."""
    return snap.key.needs_sync \
        or any(g.claimed > g.sent_claimed and not g.final for g in snap.grants) \
        or any(x.unsent_stop and x.undrawn > 0 for x in snap.leases)


def report_due(snap: KeySnapshot, opts: QueueOptions) -> ReportDue:
    """When the reports of the key need a message of their own.

    At once for :func:`_urgent` reports. Releases alone (grant or lease permits, the stop of a
    lease with nothing left to draw) wait up to ``report_releases_within_ms`` for another
    message to carry them; when the last reply was contended (R29: others wait for that
    capacity) no later than the time a request joins the next round (its ``joinInMs``, kept as
    the key's ``next_request_at``), so the next
    round counts them, and at once after it. So does the client's post-request re-check (any
    reply lists what it looks for, R8)."""
    now, within = snap.now, opts.report_releases_within_ms
    if _urgent(snap):
        return ReportDue(now)
    releases = any(g.dirty for g in snap.grants) or any(x.dirty and x.returns_capacity for x in snap.leases)
    due = ((snap.pending_since if snap.pending_since is not None else now) + within) if releases else None
    if due is not None and snap.key.contended:
        # R29: others wait for this capacity, and the next round counts it if it arrives by the
        # time a request joins that round (joinInMs): releases until then go in one message (the
        # key's coming request when it has demand), the ones after it at once.
        due = max(now, min(due, snap.key.next_request_at))
        if due == now:
            return ReportDue(now)
    if snap.key.check_at > 0:
        recheck = snap.key.check_at + within
        due = recheck if due is None else min(due, recheck)
    return ReportDue(due, PendingReleases.START if releases else PendingReleases.CLEAR)


def _heartbeats(snap: KeySnapshot) -> list[ClientLease]:
    """Leases to keep live: active ones with work running or items waiting for them (R31, R37)."""
    queued = snap.queued_groups()
    return [x for x in snap.leases if x.active and (x.in_use > 0 or bool(queued.get(x.group)))]


def claim_heartbeat_at(snap: KeySnapshot) -> int | None:
    """With the holder's ``claim_ttl_ms`` (crash expiry, off by default): while the key holds
    claimed permits not yet released, the holder must hear from the client at least every
    ``claim_ttl_ms``; the queue speaks up at half of it after the last reply."""
    ttl = snap.key.claim_ttl_ms
    if ttl <= 0 or not any(g.claimed > g.released and g.status != "gone" for g in snap.grants):
        return None
    return snap.key.replied_at + ttl // 2


def heartbeat_due(snap: KeySnapshot) -> bool:
    """A lease in use (R31, R37), or claimed permits under ``claim_ttl_ms``, are due for their
    heartbeat."""
    claims = claim_heartbeat_at(snap)
    return any(x.heartbeat_at <= snap.now for x in _heartbeats(snap)) or (claims is not None and claims <= snap.now)


# ============================================================================ messages
class Exchange(str, enum.Enum):
    """The message the queue sends next for a key."""

    NONE = "none"
    SYNC = "sync"
    REQUEST = "request"


def plan_exchange(snap: KeySnapshot, opts: QueueOptions, *, demand: bool,
                  due: ReportDue | None = None, urgent: bool = False) -> Exchange:
    """A ``sync`` while claims await confirmation (R15a) or a lease draw its recheck (R33a), or
    when reports or a heartbeat are due and no request may go yet; a ``request`` for the queued
    ``demand`` once ``nextRequestAt`` has come (R11: it carries the reports too); else nothing.
    ``due``: :func:`report_due` of ``snap`` if already computed. ``urgent``: a try is queued
    (R9b): its request goes now, whatever ``nextRequestAt`` and the leases covering it say."""
    beat = heartbeat_due(snap)
    # R33a, R34a: a sync, not a round, confirms; a heartbeat due goes as the request that
    # carries the covered demand rather than as a room check
    claiming = bool(snap.claiming) or recheck_due(snap, opts) or (not beat and room_check_due(snap, opts))
    # R34a: demand covered by reusable leases waits for their heartbeat (then goes with it).
    request_due = demand and (urgent or (snap.now >= snap.key.next_request_at
                                         and (beat or not _all_covered(admissible(snap), snap, opts))))
    due = report_due(snap, opts) if due is None else due
    must_sync = claiming or (due.at is not None and due.at <= snap.now) or beat
    if must_sync and (claiming or not request_due):
        return Exchange.SYNC
    return Exchange.REQUEST if request_due else Exchange.NONE


@dataclass(frozen=True)
class ItemTimes:
    """Earliest item times of the key (``None``: no such item).

    :ivar admit_retry_at: earliest ``on_admit`` retry of a running, not yet admitted item.
    :ivar done_retry_at: earliest retry of a pending ``on_done`` hook.
    :ivar last_checked_at: earliest ``max(started_at, checked_at)`` of an admitted running item
        (reconciliation).
    :ivar permit_check_at: when a live permit item is next checked for an owner that is gone
        (evicted: its permit is then released)."""

    admit_retry_at: int | None = None
    done_retry_at: int | None = None
    last_checked_at: int | None = None
    permit_check_at: int | None = None


def next_wake(snap: KeySnapshot, opts: QueueOptions, *, backoff_until: int = 0,
              items: ItemTimes = ItemTimes(), due: ReportDue | None = None, requests_from: int = 0) -> int | None:
    """When the queue next wants to work on the key (``None``: nothing to do): request again at
    ``nextRequestAt``, confirm claims, send due reports and heartbeats (not before
    ``backoff_until`` after a failure; requests not before ``requests_from``, a pause after a
    busy pump), stop idle leases before expiry, retry ``on_admit`` and ``on_done``, reconcile."""
    now = snap.now
    network_at = max(now, backoff_until)
    times: list[int] = []
    if wants_round(snap, opts):  # items beyond admit_room wait for a callback to return (it pumps the key)
        times.append(max(snap.key.next_request_at, network_at, requests_from))
    if snap.claiming or recheck_due(snap, opts):
        times.append(network_at)
    elif room_check_pending(snap, opts):  # R34a: the room check
        times.append(max(snap.key.room_check_at(), network_at))
    due = report_due(snap, opts) if due is None else due
    if due.at is not None:
        times.append(max(due.at, network_at))
    claims = claim_heartbeat_at(snap)
    if claims is not None:
        times.append(max(claims, network_at))
    beating = {x.lease_id for x in _heartbeats(snap)}
    for x in snap.leases:
        if x.lease_id in beating:
            times.append(max(x.heartbeat_at, network_at))
        elif x.active:
            times.append(max(now, x.expires_at - opts.lease_margin_ms))
    if items.admit_retry_at is not None:
        times.append(max(now, items.admit_retry_at))
    if opts.done_hook and items.done_retry_at is not None:  # no network, so no network backoff
        times.append(max(now, items.done_retry_at))
    if opts.reconcile_after_ms is not None and items.last_checked_at is not None:
        times.append(max(now, items.last_checked_at + opts.reconcile_after_ms))
    if items.permit_check_at is not None:
        times.append(max(now, items.permit_check_at))
    return min(times) if times else None


# ---------------------------------------------------------------------- admitted items (R37)
#: Most holder exchanges one pump makes for a key; with work still left after them the pump
#: pauses (:func:`pause_after_exchanges`) instead of spinning.
MAX_EXCHANGES = 8


class Pause(str, enum.Enum):
    """What a pump that made :data:`MAX_EXCHANGES` exchanges pauses for ``retry_ms``."""

    #: Requests were among them: only requests pause, so a report due meanwhile (a contended
    #: release) still goes at once.
    REQUESTS = "requests"
    #: Syncs alone: every exchange pauses (the key's network backoff).
    ALL = "all"


def backing_off(now: int, backoff_until: int, *, trying: bool) -> bool:
    """SPEC R37 decision (retry gating): after a failed exchange with the key's holder (or a
    pump that made :data:`MAX_EXCHANGES` exchanges of syncs alone) nothing is sent to it
    before ``backoff_until`` (``retry_ms`` later), except a try's request (R9b: its caller
    waits for this one answer)."""
    return backoff_until > now and not trying


def requests_paused(now: int, paused_until: int, *, trying: bool) -> bool:
    """SPEC R37 decision: after a pump that made :data:`MAX_EXCHANGES` exchanges with requests
    among them (:func:`pause_after_exchanges`), no request goes before ``paused_until``, except
    a try's (R9b); reports due meanwhile still go."""
    return paused_until > now and not trying


def side_release_view(snap: KeySnapshot, opts: QueueOptions) -> KeySnapshot | None:
    """SPEC R37 decision (side syncs): while the key's request waits for its round, releases go
    in a ``sync`` of their own only when others wait for them: the last reply was contended
    (R29), or the request may be held (``held_requests``: it waits because the key is blocked,
    so treat it as contended). Returns the snapshot to judge them by (:func:`report_due`):
    contended, without the request's own "contact the holder" mark (the request in flight is
    that contact); ``None`` when no release goes beside the request."""
    if not snap.key.contended and not opts.held_requests:
        return None
    return replace(snap, key=replace(snap.key, needs_sync=False, contended=True))


def pause_after_exchanges(requested: bool) -> Pause:
    """SPEC R37 decision: what a pump with work left after :data:`MAX_EXCHANGES` exchanges
    pauses."""
    return Pause.REQUESTS if requested else Pause.ALL


def retry_waits_for_holder(attempts: int, checked_at: int, retry_at: int) -> bool:
    """SPEC R37 decision: a retry of an item's callback (an earlier call was made) starts only
    once the holder has answered since it came due (``checked_at``, stamped by every reply, at
    or after ``retry_at``): if the item's permit is gone meanwhile (an operator's force-settle)
    that answer says so, and the item goes back to the queue instead of starting under it."""
    return attempts > 0 and checked_at < retry_at


def permit_gone(kind: str, grant: ClientGrant | None, lease: ClientLease | None) -> bool:
    """SPEC R37 decision: the permit an admitted item holds (``kind`` ``grant`` or ``lease``)
    is gone at the holder: its grant is unknown or ``gone`` (``not_found``), its lease unknown
    or ``settled``. Normal operation never gets here (a grant or lease is gone only once
    everything under it was released); the item is queued again for a fresh admission."""
    if kind == "grant":
        return grant is None or grant.status == "gone"
    return lease is None or lease.status == "settled"


@dataclass(frozen=True)
class CallsDue:
    """What a pass over a key's admitted callback items does (:func:`calls_due`).

    :ivar call: items whose callback is called now (their attempt written first, one write for
        all of them, so an eviction during a call retries it after ``admit_retry_ms``).
    :ivar in_flight: items whose call still runs in this instance: due again only if it dies
        (their retry moved ``orphan_check_ms`` on).
    :ivar gone: items whose permit is gone at the holder (:func:`permit_gone`): queued again.
    :ivar waiting: items whose retry waits for the holder's answer since it came due
        (:func:`retry_waits_for_holder`): the key must hear from the holder."""

    call: tuple[str, ...] = ()
    in_flight: tuple[str, ...] = ()
    gone: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()


#: The grant and the lease an admitted item's permit (kind, id) is, as the client knows them.
PermitLookup = Callable[[str, str], "tuple[ClientGrant | None, ClientLease | None]"]


def calls_due(rows: Iterable[Mapping[str, Any]], *, now: int, in_flight: Container[str],
              permit: PermitLookup) -> CallsDue:
    """SPEC R37: of a key's running callback items not yet admitted (``rows``: columns of
    ``durability_semaphore_client_items``, in order), those whose call is due at ``now``
    (``retry_at``), each exactly one of: still in flight here, its permit gone, its retry
    waiting for the holder, or called now. ``permit`` looks up the item's own permit only."""
    call: list[str] = []
    flying: list[str] = []
    gone: list[str] = []
    waiting: list[str] = []
    for r in rows:
        if int(r["retry_at"]) > now:
            continue
        item_id = str(r["item_id"])
        if item_id in in_flight:
            flying.append(item_id)
        elif permit_gone(str(r["permit_kind"]), *permit(str(r["permit_kind"]), str(r["permit_id"]))):
            gone.append(item_id)
        elif retry_waits_for_holder(int(r["attempts"]), int(r["checked_at"]), int(r["retry_at"])):
            waiting.append(item_id)
        else:
            call.append(item_id)
    return CallsDue(tuple(call), tuple(flying), tuple(gone), tuple(waiting))


def still_due(row: Mapping[str, Any] | None, *, attempts: int, in_flight: Container[str]) -> bool:
    """SPEC R37: a callback item chosen by :func:`calls_due` (its attempt ``attempts``
    written) is still to be called: running, not admitted, the same attempts, no call in
    flight. A pass that awaited (a failing callback's hook) may find an item another pass has
    started or finished meanwhile: it must not call it again."""
    return row is not None and row["state"] == "running" and not row["admitted"] \
        and int(row["attempts"]) == attempts and str(row["item_id"]) not in in_flight


@dataclass(frozen=True)
class HandOvers:
    """Which admitted ``permit()`` items go to their callers now (:func:`hand_overs`).

    :ivar hand: items handed to their waiting caller (marked admitted).
    :ivar gone: items whose permit is gone at the holder (:func:`permit_gone`): queued again."""

    hand: tuple[str, ...] = ()
    gone: tuple[str, ...] = ()


def hand_overs(rows: Iterable[Mapping[str, Any]], *, waiting: Container[str], permit: PermitLookup) -> HandOvers:
    """SPEC R37 (permit items): of this instance's running ``permit()`` items not yet handed
    over (``rows``, in order), those whose caller still waits (``waiting``; one withdrawn
    meanwhile is completed by its caller): handed over, unless their permit is gone (queued
    again). ``permit`` looks up the item's own permit only, for items with a waiting caller."""
    hand: list[str] = []
    gone: list[str] = []
    for r in rows:
        item_id = str(r["item_id"])
        if item_id not in waiting:
            continue
        kind = str(r["permit_kind"])
        (gone if permit_gone(kind, *permit(kind, str(r["permit_id"]))) else hand).append(item_id)
    return HandOvers(tuple(hand), tuple(gone))


def orphans(rows: Iterable[Mapping[str, Any]], *, owner: str, callers: Container[str]) -> tuple[str, ...]:
    """SPEC R37 (permit items): of a key's live ``permit()`` items not withdrawn (``rows``),
    those whose caller is gone, to be completed (their permits released): items of another
    instance of the queue (``owner`` is this one's token; the other died with its callers),
    and items of this one with no caller waiting or holding them (``callers``: a withdrawal
    that failed)."""
    return tuple(str(r["item_id"]) for r in rows
                 if r["state"] != "done" and not (r["owner"] == owner and str(r["item_id"]) in callers))


def orphan_checks(rows: Iterable[Mapping[str, Any]], *, now: int, orphan_check_ms: int) -> tuple[str, ...]:
    """SPEC R37 (permit items): of this instance's live ``permit()`` items (``rows``), those
    whose caller was last checked ``orphan_check_ms`` or more ago: marked checked now, so the
    next check of the key is that much later."""
    return tuple(str(r["item_id"]) for r in rows
                 if r["state"] != "done" and int(r["checked_at"]) <= now - orphan_check_ms)


def records_release(owner: str) -> bool:
    """SPEC R35 decision: whether a completed item may record its permit's release in its own
    row (``release_n``) instead of writing the permit's row: a callback item (no ``owner``)
    may; a :meth:`~semaphore.client.SemaphoreQueue.permit` item (owned by its caller's
    instance) may not, its row is deleted soon after it finishes, so its permit's row is
    written. Whether the permit's row needs a write anyway is the client's
    (:func:`semaphore.client._rows.recorded_row`)."""
    return not owner


class Completion(str, enum.Enum):
    """What completing an item does (:func:`completion`)."""

    #: Unknown, or finished already: nothing (a completion is idempotent).
    NOTHING = "nothing"
    #: Claiming (its claim sent, not confirmed): only marked cancelled; the pump resolves the
    #: claim first, and finishes the item then, its slot released at once (if the holder has
    #: not released it already, :func:`resolve_claims`).
    CANCEL = "cancel"
    #: Queued (withdrawn before admission), or running under no permit: done, nothing released.
    FINISH = "finish"
    #: Running under a permit: done, a slot of the permit released (written to its row) if the
    #: client still holds one for it (:func:`completion_releases`).
    RELEASE = "release"
    #: Running under a permit, a callback item: as ``RELEASE``, the release recorded in the
    #: item's own row when the permit's row has something to report already
    #: (:func:`records_release`).
    RECORD = "record"


def completion(state: str | None, owner: str, permit_kind: str) -> Completion:
    """SPEC R37 decision: what :meth:`~semaphore.client.SemaphoreQueue.complete` does to an item
    in ``state`` (``None``: unknown) owned by ``owner`` (a ``permit()`` caller's instance, or
    ``""``) under a permit of ``permit_kind`` (``""``: none)."""
    if state is None or state == "done":
        return Completion.NOTHING
    if state == "claiming":
        return Completion.CANCEL
    if state != "running" or not permit_kind:
        return Completion.FINISH
    return Completion.RECORD if records_release(owner) else Completion.RELEASE


class Completed(NamedTuple):
    """One completed item, as :func:`completion_writes` groups it: its ``action``
    (:class:`Completion`, not ``NOTHING``), its permit (``kind``, ``permit_id``; empty for none),
    the release it records (``release_n``; 0: none) and whether it is a
    :meth:`~semaphore.client.SemaphoreQueue.permit` item (``permit_item``)."""

    item_id: str
    key: str
    action: Completion
    kind: str
    permit_id: str
    release_n: int
    permit_item: bool = False


class Finish(NamedTuple):
    """One write of finished items: ``(key, item ids, release_n, permits)``, ``permits``: a
    :meth:`~semaphore.client.SemaphoreQueue.permit` item is among them."""

    key: str
    item_ids: list[str]
    release_n: int
    permits: bool = False


class CompletionWrites(NamedTuple):
    """The writes of a batch of completions (:func:`completion_writes`): per key, the items
    whose claim is cancelled; and the finishes (:class:`Finish`)."""

    cancels: dict[str, list[str]]
    finishes: list[Finish]


def completion_writes(completed: Iterable[Completed]) -> CompletionWrites:
    """SPEC R35, R37 decision (a batch of completions, ``complete_many``): the items are
    written together, in order of first appearance. Per key, the cancelled claims in one
    write, and the finished items that record no release in one; those that record one, per
    permit in one, each recording the highest release of its permit in the batch (every read
    and purge takes a permit's highest recorded count, the one its last item would have
    recorded had each been completed alone; a permit's count never goes on another's items)."""
    cancels: dict[str, list[str]] = {}
    finishes: dict[tuple[str, str, str], Finish] = {}
    for c in completed:
        if c.action is Completion.CANCEL:
            cancels.setdefault(c.key, []).append(c.item_id)
        elif c.action is not Completion.NOTHING:
            group = (c.key, c.kind, c.permit_id) if c.release_n else (c.key, "", "")
            f = finishes.get(group, Finish(c.key, [], 0))
            finishes[group] = Finish(c.key, [*f.item_ids, c.item_id], max(f.release_n, c.release_n),
                                     f.permits or c.permit_item)
    return CompletionWrites(cancels, list(finishes.values()))


def work_exhausted(attempts: int, work_attempts: int) -> bool:
    """SPEC R37 decision: a failed ``work`` call that was the item's ``work_attempts``-th (or
    later) call completes the item anyway (its permit released) instead of retrying it."""
    return attempts >= work_attempts


class Failure(NamedTuple):
    """What a failed callback call leads to (:func:`after_failure`): called again at
    ``retry_at`` under the same permit, or, if ``complete``, the item is completed."""

    retry_at: int
    complete: bool


def after_failure(attempts: int, *, now: int, admit_retry_ms: int, work: bool, work_attempts: int) -> Failure:
    """SPEC R37: a callback call (the item's ``attempts``-th) raised at ``now``: it is retried
    ``admit_retry_ms`` later under the same permit; a ``work`` call (``work``) that was the
    item's last (:func:`work_exhausted`) completes the item instead."""
    return Failure(now + admit_retry_ms, work and work_exhausted(attempts, work_attempts))


def item_times(rows: Iterable[Mapping[str, Any]], *, now: int, owner: str, orphan_check_ms: int,
               done_hook: bool, reconcile: bool) -> ItemTimes:
    """The key's :class:`ItemTimes` from its kept item rows (live items and pending hooks;
    columns of ``durability_semaphore_client_items``); ``owner``: this queue instance's token.

    * ``admit_retry_at``: a callback item (no owner) running and not admitted is due at its
      ``retry_at`` (a call in flight too: if this instance died, the next one calls it again),
      except a retry waiting for the holder's answer (:func:`retry_waits_for_holder`) that is due
      already: the exchange that answers it wakes the key.
    * ``done_retry_at``: the earliest retry of a pending ``on_done`` hook (with a hook).
    * ``last_checked_at``: reconciliation's clock of admitted callback items (with it).
    * ``permit_check_at``: this instance's live, not withdrawn permit items are checked
      ``orphan_check_ms`` after their last check (another owner's are handled at every pump's
      start)."""
    admit, done, checked, mine = [], [], [], []
    for r in rows:
        state, attempts, retry_at, checked_at = r["state"], int(r["attempts"]), int(r["retry_at"]), int(r["checked_at"])
        if state == "running" and not r["owner"]:
            if not r["admitted"]:
                if not retry_waits_for_holder(attempts, checked_at, retry_at) or retry_at > now:
                    admit.append(retry_at)
            else:
                checked.append(max(int(r["started_at"]), checked_at))
        if r["done_pending"]:
            done.append(int(r["done_retry_at"]))
        if r["owner"] and r["owner"] == owner and state != "done" and not r["cancel"]:
            mine.append(checked_at)
    return ItemTimes(
        admit_retry_at=min(admit, default=None),
        done_retry_at=min(done, default=None) if done_hook else None,
        last_checked_at=min(checked, default=None) if reconcile else None,
        permit_check_at=None if not mine else min(mine) + orphan_check_ms)


def admit_room(admit_concurrency: int | None, busy: int) -> int | None:
    """SPEC R37 decision (``admit_concurrency``): how many more callback items of a key may be
    admitted while ``busy`` of them are claiming or running with their callback not returned
    (``None``: no bound)."""
    return None if admit_concurrency is None else max(0, admit_concurrency - busy)


def demand_grew(demand: Iterable[tuple[str, int]], sent: Iterable[tuple[str, int]]) -> bool:
    """SPEC R37, R10: the key's demand ``(group, count)`` asks for more in some group than the
    request in flight (``sent``), so it goes in a request of its own beside a held one (items
    drawn or finished meanwhile need none)."""
    asked = dict(sent)
    return any(count > asked.get(group, 0) for group, count in demand)


def reconcile_due(started_at: int, checked_at: int, *, now: int, reconcile_after_ms: int) -> bool:
    """SPEC R37 decision (reconciliation): an admitted item running for ``reconcile_after_ms``
    and not checked for as long is checked with ``check_running``."""
    return started_at <= now - reconcile_after_ms and checked_at <= now - reconcile_after_ms


def reconcile_checks(rows: Iterable[Mapping[str, Any]], *, now: int, reconcile_after_ms: int) -> tuple[str, ...]:
    """SPEC R37 decision (reconciliation): of a key's admitted callback items still running
    (``rows``, in enqueue order), those due for a ``check_running`` call (:func:`reconcile_due`)."""
    return tuple(str(r["item_id"]) for r in rows if reconcile_due(int(r["started_at"]), int(r["checked_at"]),
                                                                   now=now, reconcile_after_ms=reconcile_after_ms))


# ---------------------------------------------------------------------- permit() calls (R9b, R37)
def is_try(timeout_ms: int | None) -> bool:
    """SPEC R9b: ``permit(timeout_ms=0)`` is a try (one ``noWait`` request, its one answer);
    any other timeout (or none) waits for the rounds."""
    return timeout_ms == 0


class TryAnswer(str, enum.Enum):
    """What a try's caller gets once the holder's answer to its request is known (R9b)."""

    #: The item was admitted (from a lease, or a grant's confirmed claim): the block runs.
    ADMITTED = "admitted"
    #: The answer served it: its claim waits for the confirming sync (R15a), then the block runs.
    CONFIRMING = "confirming"
    #: The request that carried the try failed: its error is raised.
    FAILED = "failed"
    #: The answer did not serve it: :class:`~semaphore.errors.PermitTimeoutError`, with the
    #: holder's ``blocked`` entry.
    REFUSED = "refused"


def try_answer(*, admitted: bool, state: str | None, failed: bool) -> TryAnswer:
    """SPEC R9b decision: a try whose answer is known, its item ``admitted`` or in ``state``
    (``None``: gone), its request ``failed`` or not. An admission wins over everything; a claim
    being confirmed was served (a failed confirming sync is the claim's business, R15a)."""
    if admitted:
        return TryAnswer.ADMITTED
    if state == "claiming":
        return TryAnswer.CONFIRMING
    if failed:
        return TryAnswer.FAILED
    return TryAnswer.REFUSED


def refusal(key: str, group: str, blocked: Blocked | None, timeout_ms: int | None) -> str:
    """The message of a permit refused (a try, ``timeout_ms`` 0, or a timeout), with why the
    holder left the group waiting when it said so (R23)."""
    why = "" if blocked is None else f" (holder: {blocked.reason.value}, {blocked.waiting} waiting)"
    if not timeout_ms:
        return f"no permit free now for key {key!r}, group {group!r}{why}"
    return f"no permit for key {key!r}, group {group!r} within {timeout_ms} ms{why}"
