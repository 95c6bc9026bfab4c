"""One step of a queue's key (SPEC R37): every row a local admission or a holder reply changes,
decided by a pure function over the key's loaded :class:`~.queue_plan.KeySnapshot`; what a
batch of completions does (:func:`completions`), over the items and grants loaded for it; and
the pump's passes over admitted items (:func:`callbacks`, :func:`handing_over`,
:func:`orphans`), over the key's rows and live permits (:class:`Permits`).

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

from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

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
    calls_due,
    completion,
    completion_releases,
    hand_overs,
    held_slots,
    orphan_checks,
    plan_admission,
    plan_reply,
)
from .queue_plan import completion_writes as plan_completion_writes
from .queue_plan import orphans as plan_orphans

__all__ = ["KeyChanges", "admission", "after_reply",
           "Permits", "callbacks", "handing_over", "callbacks_returned", "Orphans", "orphans",
           "CompletingItem", "CompletionLoad", "Completing", "checks_completions", "completions", "completion_writes"]

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
    :ivar wake_now: the key is woken now (an item finished and its ``on_done`` hook is due, or
        an item went back to the queue).
    :ivar ask_holder: the next exchange goes at once (idle grant slots were released, or a
        callback's retry waits for the holder's answer).
    :ivar clear_pending: the key's "releases waiting since" mark is cleared (a reply carried them).
    :ivar checked: running callback items whose permit a reply has just checked (``checked_at``).
    :ivar blocked: a request's reply's ``blocked`` entries ``(group, reason, waiting)``, kept as
        the key's latest word on why its groups wait (``None``: kept as they are).
    :ivar gone: admitted items whose permit is gone at the holder (:func:`~.queue_plan.permit_gone`):
        back to the queue for a fresh admission (their failed calls no longer count), the key
        woken now.
    :ivar calls: / :ivar calls_retry_at: callback items called now, their attempt written first
        (retried at ``calls_retry_at`` if this instance dies meanwhile).
    :ivar flying: / :ivar flying_retry_at: callback items whose call still runs here: due again
        (at ``flying_retry_at``) only if this instance dies.
    :ivar admitted: items admitted: their callback returned (:func:`callbacks_returned`), or
        ``permit()`` items handed to their waiting callers (:func:`handing_over`).
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
    gone: tuple[str, ...] = ()
    calls: tuple[str, ...] = ()
    calls_retry_at: int = 0
    flying: tuple[str, ...] = ()
    flying_retry_at: int = 0
    admitted: tuple[str, ...] = ()
    purge_done_before: int | None = None
    purge_due_before: int | None = None
    delete_done_permits: bool = False

    @property
    def empty(self) -> bool:
        """Persisting these changes writes nothing: every field as a step that changed nothing
        leaves it (a retry time alone, without its items, is nothing)."""
        return replace(self, calls_retry_at=0, flying_retry_at=0) == _NO_CHANGES


_NO_CHANGES = KeyChanges()


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


# ============================================================================ callbacks (R37)
@dataclass(frozen=True)
class Permits:
    """The key's live grants and leases by id, for what an admitted item's permit is (a grant or
    lease not among them is gone at the holder, or unknown: :func:`~.queue_plan.permit_gone`)."""

    grants: Mapping[str, ClientGrant] = field(default_factory=dict)
    leases: Mapping[str, ClientLease] = field(default_factory=dict)

    @classmethod
    def of(cls, grants: Iterable[ClientGrant], leases: Iterable[ClientLease]) -> Permits:
        """The permits of the key's live ``grants`` and ``leases``."""
        return cls({g.grant_id: g for g in grants}, {x.lease_id: x for x in leases})

    def lookup(self, kind: str, permit_id: str) -> tuple[ClientGrant | None, ClientLease | None]:
        """The grant (``kind`` ``"grant"``) or lease of that id, ``None`` if not live."""
        if kind == "grant":
            return self.grants.get(permit_id), None
        return None, self.leases.get(permit_id)


def callbacks(rows: Sequence[Mapping[str, Any]], permits: Permits, *, now: int, in_flight: Container[str],
              admit_retry_ms: int, orphan_check_ms: int) -> KeyChanges:
    """A pass over the key's running callback items not yet admitted (``rows``, in enqueue
    order; :func:`~.queue_plan.calls_due`): the items whose call is due are called (their
    attempt written first, retried ``admit_retry_ms`` later should this instance die during the
    call); a call still ``in_flight`` here is due again only if this instance dies
    (``orphan_check_ms`` on); an item whose permit is gone goes back to the queue; a retry that
    waits for the holder's answer asks the holder."""
    due = calls_due(rows, now=now, in_flight=in_flight, permit=permits.lookup)
    return KeyChanges(gone=due.gone, wake_now=bool(due.gone), ask_holder=bool(due.waiting), calls=due.call,
                      calls_retry_at=now + admit_retry_ms, flying=due.in_flight, flying_retry_at=now + orphan_check_ms)


def handing_over(rows: Sequence[Mapping[str, Any]], permits: Permits, *, waiting: Container[str]) -> KeyChanges:
    """This instance's running ``permit()`` items not yet handed over (``rows``, in enqueue
    order; :func:`~.queue_plan.hand_overs`): those whose caller still ``waiting`` are handed
    over, unless their permit is gone (back to the queue)."""
    plan = hand_overs(rows, waiting=waiting, permit=permits.lookup)
    return KeyChanges(gone=plan.gone, wake_now=bool(plan.gone), admitted=plan.hand)


def callbacks_returned(rows: Iterable[Mapping[str, Any] | None]) -> KeyChanges:
    """The callbacks of these items returned (``rows``: their kept rows, ``None`` if no longer
    kept): those still running count as admitted (R37; one finished meanwhile stays as it is)."""
    return KeyChanges(admitted=tuple(str(r["item_id"]) for r in rows if r is not None and r["state"] == "running"))


class Orphans(NamedTuple):
    """A key's ``permit()`` items whose caller is gone (``complete``: completed as
    :meth:`~semaphore.client.SemaphoreQueue.complete` does) and this instance's that are due for
    their check (``checked``: marked checked now)."""

    complete: tuple[str, ...]
    checked: tuple[str, ...]

    @property
    def empty(self) -> bool:
        """Nothing to complete and nothing to mark checked."""
        return not self.complete and not self.checked


def orphans(rows: Sequence[Mapping[str, Any]], *, owner: str, callers: Container[str], now: int,
            orphan_check_ms: int) -> Orphans:
    """The key's live ``permit()`` items (``rows``, in enqueue order): those not withdrawn whose
    caller is gone are completed (:func:`~.queue_plan.orphans`: another instance's, or this
    one's with no caller); this instance's others whose caller was last checked
    ``orphan_check_ms`` ago are marked checked (:func:`~.queue_plan.orphan_checks`; a withdrawn
    one's claim is released once the holder answers)."""
    complete = plan_orphans([r for r in rows if not r["cancel"]], owner=owner, callers=callers)
    gone = set(complete)
    mine = [r for r in rows if r["owner"] == owner and str(r["item_id"]) not in gone]
    return Orphans(complete, orphan_checks(mine, now=now, orphan_check_ms=orphan_check_ms))


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
    assert at in load.grants, f"grant {grant_id!r} of key {key!r} was not loaded for its completions"
    g = load.grants[at]
    if g is None or g.status == GONE:
        return 0
    if not checks_completions(g):
        return g.releasable
    in_batch = sum(1 for i in load.items
                   if (i.key, i.permit_kind, i.permit_id, i.state) == (key, "grant", grant_id, "running"))
    grants = {c.grant_id: g for c in load.claiming[key] if c.grant_id == grant_id}
    held = held_slots(load.running[key], load.claiming[key], grants).get(grant_id, 0)
    return completion_releases(g, held_after=held - in_batch)
