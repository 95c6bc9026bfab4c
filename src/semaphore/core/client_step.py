"""One step of a queue's key (SPEC R37): every row a local admission or a holder reply changes,
decided by a pure function over the key's loaded :class:`~.queue_plan.KeySnapshot`; and what a
batch of completions does (:func:`completions`), over the items and grants loaded for it.

The queue loads the snapshot, calls :func:`admission` (claims resolved, claims, draws, stops,
give-backs, idle slots) or :func:`after_reply` (claims resolved, stops), and persists the
returned :class:`KeyChanges` in the same transaction, deciding nothing itself: load → step →
persist. The planner (:mod:`.queue_plan`) says what to do; this module turns it into the rows'
new values, tracking each row through the step so that two changes of one row compose (one
write per count), and asserts what the planner guarantees (a claim never past a grant's
unclaimed permits, a draw never past a lease's undrawn ones, a release never past what is
releasable, R15a, R34; only an active lease stopped): a step never writes a count the client's
own changes would refuse.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from .client_state import GONE, ClientGrant, ClientLease
from .queue_plan import (
    AdmissionPlan,
    Claim,
    ClaimingItem,
    Completed,
    Completion,
    CompletionWrites,
    Draw,
    KeySnapshot,
    QueueOptions,
    ReplyPlan,
    Resolve,
    completion,
    completion_releases,
    held_slots,
    plan_admission,
    plan_reply,
)
from .queue_plan import completion_writes as plan_completion_writes

__all__ = ["KeyChanges", "admission", "after_reply", "CompletingItem", "CompletionLoad", "Completing",
           "checks_completions", "completions", "completion_writes"]

@dataclass(frozen=True)
class KeyChanges:
    """What one step writes for a key, in the order the queue persists it.

    :ivar grants: / :ivar leases: per grant (lease) id, the new value of each count the step
        changed (``claimed``, ``released``; ``drawn``, ``stopped``).
    :ivar start: / :ivar requeue: / :ivar finish: claiming items that run from now (their slot
        confirmed), go back to the queue (never confirmed, or no slot of the grant left to run
        under), or are done (cancelled), as :func:`~.queue_plan.resolve_claims` resolves them.
    :ivar finish_permits: a :meth:`~semaphore.client.SemaphoreQueue.permit` item is among
        ``finish`` (its row is deleted soon after).
    :ivar claims: / :ivar draws: items that claim grant slots (claiming, pending confirmation,
        R15a) or draw lease slots (running at once, R30), with their slots (``Draw.slots``).
    :ivar wake_now: an item finished and its ``on_done`` hook is due now.
    :ivar ask_holder: the next exchange goes at once (idle grant slots were released).
    :ivar clear_pending: the key's "releases waiting since" mark is cleared (a reply carried them).
    :ivar checked: running callback items whose permit a reply has just checked (``checked_at``).
    :ivar blocked: a request's reply's ``blocked`` entries ``(group, reason, waiting)``, kept as
        the key's latest word on why its groups wait (``None``: kept as they are).
    :ivar purge_done_before: / :ivar purge_due_before: as in
        :class:`~.queue_plan.AdmissionPlan` (``None``: no purge).
    :ivar delete_done_permits: finished ``permit()`` items are deleted (their ids are random:
        never enqueued again, so nothing needs them kept).
    """

    grants: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    leases: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    start: tuple[str, ...] = ()
    requeue: tuple[str, ...] = ()
    finish: tuple[str, ...] = ()
    finish_permits: bool = False
    claims: tuple[Claim, ...] = ()
    draws: tuple[Draw, ...] = ()
    wake_now: bool = False
    ask_holder: bool = False
    clear_pending: bool = False
    checked: tuple[str, ...] = ()
    blocked: tuple[tuple[str, str, int], ...] | None = None
    purge_done_before: int | None = None
    purge_due_before: int | None = None
    delete_done_permits: bool = False


class _Rows:
    """The key's grants and leases as the step changes them (the snapshot's, tombstones of
    claiming items included), and the counts changed so far. A lookup of a row the snapshot
    did not load is a bug of the step (it would decide over a row it never saw): it asserts."""

    def __init__(self, snap: KeySnapshot) -> None:
        #: The rows as the step has changed them so far (loaded: the snapshot's).
        self._grant_rows = {g.grant_id: g for g in snap.claim_grants.values() if g is not None}
        self._grant_rows.update((g.grant_id, g) for g in snap.grants)
        self._lease_rows = {x.lease_id: x for x in snap.leases}
        #: Per row id, the new value of each count the step changed.
        self.grant_counts: dict[str, dict[str, int]] = {}
        self.lease_counts: dict[str, dict[str, int]] = {}

    def _set_grant(self, new: ClientGrant, column: str, value: int) -> None:
        self._grant_rows[new.grant_id] = new
        self.grant_counts.setdefault(new.grant_id, {})[column] = value

    def _set_lease(self, new: ClientLease, column: str, value: int) -> None:
        self._lease_rows[new.lease_id] = new
        self.lease_counts.setdefault(new.lease_id, {})[column] = value

    def _grant(self, grant_id: str) -> ClientGrant:
        assert grant_id in self._grant_rows, f"grant {grant_id!r} was not loaded for this step"
        return self._grant_rows[grant_id]

    def _lease(self, lease_id: str) -> ClientLease:
        assert lease_id in self._lease_rows, f"lease {lease_id!r} was not loaded for this step"
        return self._lease_rows[lease_id]

    def claim(self, grant_id: str, count: int) -> None:
        """Claim ``count`` unclaimed permits of the grant (R15a)."""
        g = self._grant(grant_id)
        assert 0 < count <= g.unclaimed, f"the plan claims {count} of grant {grant_id!r}, {g.unclaimed} unclaimed"
        self._set_grant(replace(g, claimed=g.claimed + count), "claimed", g.claimed + count)

    def release(self, grant_id: str, count: int) -> None:
        """Release ``count`` confirmed, unreleased permits of the grant (R15a)."""
        g = self._grant(grant_id)
        assert g.status != GONE, f"the plan releases {count} of grant {grant_id!r}, a dropped grant"
        assert 0 < count <= g.releasable, f"the plan releases {count} of grant {grant_id!r}, {g.releasable} releasable"
        self._set_grant(replace(g, released=g.released + count), "released", g.released + count)

    def draw(self, lease_id: str, count: int, now: int, margin_ms: int) -> None:
        """Draw ``count`` permits of the lease (R30, R34)."""
        x = self._lease(lease_id)
        assert x.drawable(now, margin_ms) and 0 < count <= x.undrawn, \
            f"the plan draws {count} of lease {lease_id!r}, {x.undrawn} undrawn"
        self._set_lease(replace(x, drawn=x.drawn + count), "drawn", x.drawn + count)

    def stop(self, lease_id: str) -> None:
        """Stop the lease (R29, R37)."""
        x = self._lease(lease_id)
        assert x.active, f"the plan stops lease {lease_id!r}, not active"
        self._set_lease(replace(x, stopped=True), "stopped", 1)


def _resolved(snap: KeySnapshot, rows: _Rows, p: AdmissionPlan | ReplyPlan) -> KeyChanges:
    """The claim resolutions' changes (R15a): a confirmed slot of a cancelled item released."""
    for r in p.resolutions:
        if r.action is Resolve.RELEASE:
            rows.release(r.grant_id, 1)
    finish = tuple(r.item_id for r in p.resolutions if r.action not in (Resolve.START, Resolve.REQUEUE))
    permit_items = {c.item_id for c in snap.claiming if not c.bounded}
    return KeyChanges(start=tuple(r.item_id for r in p.resolutions if r.action is Resolve.START),
                      requeue=tuple(r.item_id for r in p.resolutions if r.action is Resolve.REQUEUE),
                      finish=finish, finish_permits=any(i in permit_items for i in finish), wake_now=p.wake_now)


def admission(snap: KeySnapshot, opts: QueueOptions, *, with_claims: bool = True) -> KeyChanges:
    """One local admission of the key (:func:`~.queue_plan.plan_admission`): resolve claims,
    claim from grants (not if ``with_claims`` is false), draw from leases, stop leases, give
    back grant permits nothing can use (claimed now, released once confirmed) and release
    confirmed slots no item holds, which the holder hears at once."""
    p = plan_admission(snap, opts, with_claims=with_claims)
    rows = _Rows(snap)
    resolved = _resolved(snap, rows, p)
    for c in p.claims:
        rows.claim(c.grant_id, len(c.item_ids))
    for d in p.draws:
        rows.draw(d.lease_id, len(d.item_ids), snap.now, opts.lease_margin_ms)
    for lease_id in p.stops:
        rows.stop(lease_id)
    for give_back in p.give_backs:  # no item runs under them: released once confirmed
        rows.claim(give_back.grant_id, give_back.count)
    for idle in p.idle_slots:
        rows.release(idle.grant_id, idle.count)
    return replace(resolved, grants=rows.grant_counts, leases=rows.lease_counts, claims=p.claims, draws=p.draws,
                   ask_holder=bool(p.idle_slots), purge_done_before=p.purge_done_before,
                   purge_due_before=p.purge_due_before, delete_done_permits=True)


def after_reply(snap: KeySnapshot, opts: QueueOptions, *, contended: bool, more: bool,
                unstarted: tuple[str, ...] = (), blocked: tuple[tuple[str, str, int], ...] | None = None) -> KeyChanges:
    """What a holder reply changes in the key's items and leases (:func:`~.queue_plan.plan_reply`):
    the running callback items whose callback has not returned yet (``unstarted``) checked by
    it (a retry of one waits for such a reply, R37), claims resolved, leases stopped,
    a request's ``blocked`` entries kept (``blocked``, ``None`` for a sync); the "releases
    waiting since" mark cleared unless the reply could not carry every report (``more``, over
    1,000, R7: the rest stays due since then)."""
    p = plan_reply(snap, opts, contended=contended)
    rows = _Rows(snap)
    resolved = _resolved(snap, rows, p)
    for lease_id in p.stops:
        rows.stop(lease_id)
    return replace(resolved, grants=rows.grant_counts, leases=rows.lease_counts, clear_pending=not more,
                   checked=unstarted, blocked=blocked)


# ============================================================================ completions
class CompletingItem(NamedTuple):
    """An item named by :meth:`~semaphore.client.SemaphoreQueue.complete`, as loaded: its
    ``state`` (``queued``, ``claiming``, ``running``, ``done``), ``owner`` (a ``permit()``
    caller's instance, or ``""``) and permit (``permit_kind`` ``"grant"``/``"lease"``/``""``)."""

    item_id: str
    key: str
    state: str
    owner: str
    permit_kind: str
    permit_id: str


@dataclass(frozen=True)
class CompletionLoad:
    """What a batch of completions decides over.

    :ivar items: the items found, in the batch's order (an unknown id is left out).
    :ivar grants: per ``(key, grant id)`` of a running grant item, the client's grant (``None``:
        forgotten).
    :ivar running: / :ivar claiming: for each key with a grant :func:`checks_completions`
        names: per grant id, how many of the key's running items hold a slot of it; the key's
        claiming items.
    """

    items: tuple[CompletingItem, ...]
    grants: Mapping[tuple[str, str], ClientGrant | None] = field(default_factory=dict)
    running: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    claiming: Mapping[str, tuple[ClaimingItem, ...]] = field(default_factory=dict)


class Completing(NamedTuple):
    """What completing one item does: its ``action`` (never ``NOTHING``), whether its permit
    releases a slot (``release``) and whether that release may be recorded in the item's own
    row (``record``, R35: :attr:`~.queue_plan.Completion.RECORD`)."""

    item: CompletingItem
    action: Completion
    release: bool = False
    record: bool = False


def checks_completions(g: ClientGrant | None) -> bool:
    """Whether completions under grant ``g`` count the slots its items still hold before they
    release one (R15a): only once the holder released slots of it on its own
    (``g.holder_released``); else every confirmed slot is held by one item or idle, so a
    running item's completion always has its own slot to release."""
    return g is not None and g.holder_released and g.status != GONE


def completions(load: CompletionLoad) -> tuple[Completing, ...]:
    """A batch of completions (R37; R15a): each found item's action
    (:func:`~.queue_plan.completion`; unknown or finished items do nothing and are left out),
    and, for a running item, whether its permit releases a slot: always a lease's (its row
    clamps, R34); a grant's while it has a confirmed, unreleased slot that no item outside the
    batch holds (:func:`~.queue_plan.completion_releases`, counted for the grants
    :func:`checks_completions` names, else one per item), none of a grant forgotten or
    dropped."""
    room: dict[tuple[str, str], int] = {}
    out = []
    for item in load.items:
        action = completion(item.state, item.owner, item.permit_kind)
        if action is Completion.NOTHING:
            continue
        release = action in (Completion.RELEASE, Completion.RECORD)
        if release and item.permit_kind == "grant":
            at = (item.key, item.permit_id)
            if at not in room:
                room[at] = _completion_room(load, at)
            room[at] -= 1
            release = room[at] >= 0
        out.append(Completing(item, action, release, release and action is Completion.RECORD))
    return tuple(out)


def completion_writes(steps: Iterable[Completing], recorded: Mapping[str, int]) -> CompletionWrites:
    """The writes of a batch of completions (:func:`~.queue_plan.completion_writes`), once the
    permits' releases are done: ``recorded``, per item id, the released count its row records
    (SPEC R35: the client's store chose to record it there; absent or 0: nothing recorded)."""
    return plan_completion_writes([
        Completed(c.item.item_id, c.item.key, c.action, c.item.permit_kind, c.item.permit_id,
                  recorded.get(c.item.item_id, 0), bool(c.item.owner)) for c in steps])


def _completion_room(load: CompletionLoad, at: tuple[str, str]) -> int:
    """How many slots of grant ``at`` the batch's completions release (see :func:`completions`)."""
    key, grant_id = at
    g = load.grants.get(at)
    if g is None or g.status == GONE:
        return 0
    if not checks_completions(g):
        return g.releasable
    in_batch = sum(1 for i in load.items
                   if (i.key, i.permit_kind, i.permit_id, i.state) == (key, "grant", grant_id, "running"))
    grants = {c.grant_id: g for c in load.claiming[key] if c.grant_id == grant_id}
    held = held_slots(load.running[key], load.claiming[key], grants).get(grant_id, 0)
    return completion_releases(g, held_after=held - in_batch)
