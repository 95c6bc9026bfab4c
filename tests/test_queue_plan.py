"""The queue's planner and the client's reply merge, driven directly: pure functions over plain
snapshots (``semaphore.core.queue_plan``, ``semaphore.core.client_state``), no storage, no
clock, no holder (SPEC R13, R15, R15a, R29, R31, R34, R37)."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

from semaphore.core import queue_plan as plan
from semaphore.core.client_state import (
    COVER_AFTER_MS,
    GONE,
    ClientGrant,
    ClientLease,
    KeyState,
    merge_grant,
    merge_lease,
)
from semaphore.core.queue_plan import (
    ClaimingItem,
    Exchange,
    ItemTimes,
    KeySnapshot,
    PendingReleases,
    QueuedItem,
    QueueOptions,
    Resolve,
)
from semaphore.core.wire import GrantState, GrantStatus, LeaseState, LeaseStatus

NOW = 1_000_000
KEY = "k"
OPTS = QueueOptions()


def grant(gid: str = "g1", group: str = "g", permits: int = 2, claimed: int = 0, released: int = 0,
          confirmed: int = 0, claim_by: int = NOW + 10_000, status: str = "active",
          sent_claimed: int | None = None, sent_released: int | None = None) -> ClientGrant:
    return ClientGrant(KEY, gid, group, permits, claimed, released, confirmed, claim_by, status,
                       claimed if sent_claimed is None else sent_claimed,
                       released if sent_released is None else sent_released)


def lease(lid: str = "l1", group: str = "g", permits: int = 4, drawn: int = 0, released: int = 0,
          stopped: bool = False, status: str = "live", expires_at: int = NOW + 20_000,
          heartbeat_at: int = NOW + 10_000, sent_stopped: bool | None = None) -> ClientLease:
    return ClientLease(KEY, lid, group, permits, drawn, released, stopped, status, expires_at, heartbeat_at,
                       drawn, released, stopped if sent_stopped is None else sent_stopped)


def queued(*ids: str, group: str = "g", start: int = 1) -> tuple[QueuedItem, ...]:
    return tuple(QueuedItem(i, group, start + n) for n, i in enumerate(ids))


# ----------------------------------------------------------------------------- purity
def test_the_planner_is_pure():
    # R37 (architecture): the planner imports no runtime, storage, asyncio, clock or client code
    for module in ("queue_plan.py", "client_state.py", "client_step.py"):
        tree = ast.parse((Path(plan.__file__).parent / module).read_text(encoding="utf-8"))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {("." * n.level) + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        forbidden = {"asyncio", "time", "semaphore.runtime", "..runtime", "..client", "..holder", "..scheduler",
                     "..clock"}
        assert not names & forbidden, (module, names)
        assert all(not n.startswith("..") for n in names), (module, names)


# ----------------------------------------------------------------------------- claims
def test_r15a_claims_resolve_only_on_confirmation_or_refusal():
    # R15a: a confirmed slot starts (or, cancelled, is released); a slot of a grant that can no
    # longer confirm it goes back to the queue (or, cancelled, finishes); others keep waiting
    claiming = (ClaimingItem("a", "g", 1, "ok", 1), ClaimingItem("b", "g", 2, "ok", 2, cancel=True),
                ClaimingItem("c", "g", 3, "ok", 3), ClaimingItem("d", "g", 4, "exp", 1),
                ClaimingItem("e", "g", 5, "gone", 1, cancel=True), ClaimingItem("f", "g", 6, "lost", 1))
    snap = KeySnapshot(NOW, claiming=claiming, claim_grants={
        "ok": grant("ok", permits=3, claimed=3, confirmed=2),
        "exp": grant("exp", permits=0, claimed=1, status="expired"),
        "gone": grant("gone", status=GONE), "lost": None})
    assert [(r.item_id, r.action) for r in plan.resolve_claims(snap)] == [
        ("a", Resolve.START), ("b", Resolve.RELEASE), ("d", Resolve.REQUEUE), ("e", Resolve.FINISH),
        ("f", Resolve.REQUEUE)]


def test_r15a_a_refused_item_is_claimed_again_in_its_original_place():
    # R15a: a refused claim re-queues the item with its enqueue position; it is claimed again
    # (before younger items) from a grant that can still be claimed
    snap = KeySnapshot(NOW, queued=(QueuedItem("young", "g", 5),),
                       claiming=(ClaimingItem("old", "g", 1, "exp", 1),),
                       claim_grants={"exp": grant("exp", permits=0, claimed=1, status="expired")},
                       grants=(grant("fresh", permits=1),))
    step = plan.plan_admission(snap, OPTS)
    assert [(r.item_id, r.action) for r in step.resolutions] == [("old", Resolve.REQUEUE)]
    assert [(c.grant_id, c.slots, c.item_ids) for c in step.claims] == [("fresh", (1,), ("old",))]


def test_r15_no_claim_close_to_claim_by_and_slots_follow_the_claimed_count():
    # R15, R15a: slots continue the grant's claimed count; a grant within claim_margin_ms of its
    # claimBy is left alone (its permits go back at reclaim)
    snap = KeySnapshot(NOW, queued=queued("a", "b", "c"),
                       grants=(grant("late", claim_by=NOW + 400), grant("g1", permits=3, claimed=1)))
    step = plan.plan_admission(snap, replace(OPTS, prefer_leases=False))
    assert [(c.grant_id, c.slots, c.item_ids) for c in step.claims] == [("g1", (2, 3), ("a", "b"))]
    assert not step.draws



def test_r37_surplus_grant_permits_are_given_back_only_where_nothing_can_use_them():
    # R37 decision (surplus grants), R15: a grant whose group has nothing queued or claiming, no
    # claim in this step and no lease is given back in full (its demand went away while the
    # request was on the way); every other grant keeps its permits until claimBy.
    spare = grant("spare", group="a", permits=2, claimed=1, confirmed=1)
    snap = KeySnapshot(NOW, grants=(spare,))
    assert [(b.grant_id, b.count) for b in plan.plan_admission(snap, OPTS).give_backs] == [("spare", 1)]
    assert plan.plan_admission(snap, OPTS, with_claims=False).give_backs == ()  # a give-back is a claim
    kept = {
        "queued": replace(snap, queued=queued("x", group="a")),  # (claimed by this step)
        "queued beyond admit_concurrency": replace(snap, queued=queued("x", group="a"), admit_room=0),
        "claiming": replace(snap, claiming=(ClaimingItem("c", "a", 1, "other", 1),)),
        "lease": replace(snap, leases=(lease(group="a"),)),
        "near claimBy": replace(snap, grants=(replace(spare, claim_by=NOW + OPTS.claim_margin_ms),)),
        "expired": replace(snap, grants=(replace(spare, status="expired"),)),
    }
    for why, case in kept.items():
        assert plan.plan_admission(case, OPTS).give_backs == (), why
    # Another group's items do not keep a grant: only its own group's use counts.
    other = replace(snap, queued=queued("y", group="b"))
    assert [b.grant_id for b in plan.plan_admission(other, OPTS).give_backs] == ["spare"]


def test_r37_r15a_given_back_permits_are_released_only_once_the_holder_confirms_their_claim():
    # R37 decision (surplus grants), R15a, I4: a give-back claims the permits and releases none of
    # them yet: a claim that reaches the holder after claimBy is refused (R15), and a release sent
    # with it would be counted against the slot an item runs under. Once the holder confirms the
    # slots, those no item holds are released.
    running = {"spare": 1}  # slot 1 runs an item
    claimed = grant("spare", group="a", permits=2, claimed=1, confirmed=1)
    step = plan.plan_admission(KeySnapshot(NOW, grants=(claimed,), running=running), OPTS)
    assert [(b.grant_id, b.count) for b in step.give_backs] == [("spare", 1)] and step.idle_slots == ()
    given = replace(claimed, claimed=2)  # slot 2 given back, unconfirmed
    assert plan.plan_admission(KeySnapshot(NOW, grants=(given,), running=running), OPTS).idle_slots == ()
    confirmed = replace(given, confirmed=2)
    step = plan.plan_admission(KeySnapshot(NOW, grants=(confirmed,), running=running), OPTS)
    assert [(b.grant_id, b.count) for b in step.idle_slots] == [("spare", 1)]
    # Refused (the holder reclaimed at claimBy with 1 claimed): the slot is gone, nothing to release.
    refused = replace(given, permits=1, claimed=1, status="expired")
    assert plan.plan_admission(KeySnapshot(NOW, grants=(refused,), running=running), OPTS).idle_slots == ()
    # A confirmed claiming item holds its slot until its resolution starts or releases it.
    claiming = (ClaimingItem("c", "a", 1, "spare", 2, cancel=True),)
    snap = KeySnapshot(NOW, grants=(confirmed,), running=running, claiming=claiming,
                       claim_grants={"spare": confirmed})
    step = plan.plan_admission(snap, OPTS)
    assert step.idle_slots == () and [r.action for r in step.resolutions] == [Resolve.RELEASE]

# ----------------------------------------------------------------------------- leases
def test_r37_prefer_leases_draws_what_fits_and_leaves_grants_unclaimed():
    # R37 (prefer_leases): items that all fit in live leases are drawn, no claim (no round trip)
    snap = KeySnapshot(NOW, queued=queued("a", "b"), grants=(grant(),), leases=(lease(permits=4, drawn=1),))
    step = plan.plan_admission(snap, OPTS)
    assert not step.claims
    assert [(d.lease_id, d.first_slot, d.item_ids) for d in step.draws] == [("l1", 2, ("a", "b"))]
    # prefer_leases off: grants first, the lease takes the rest
    snap = replace(snap, queued=queued("a", "b", "c"))
    step = plan.plan_admission(snap, replace(OPTS, prefer_leases=False))
    assert [(c.grant_id, c.item_ids) for c in step.claims] == [("g1", ("a", "b"))]
    assert [(d.lease_id, d.item_ids) for d in step.draws] == [("l1", ("c",))]


def test_r34_r37_draws_stop_at_the_margin_and_a_drained_lease_is_stopped():
    # R34: a lease gives at most its undrawn permits, never within lease_margin_ms of expiry;
    # R37: a lease with nothing left to draw is stopped (settled) in the same step
    snap = KeySnapshot(NOW, queued=queued("a", "b", "c"),
                       leases=(lease("near", expires_at=NOW + 999), lease("l2", permits=2)))
    step = plan.plan_admission(snap, OPTS)
    assert [(d.lease_id, d.item_ids) for d in step.draws] == [("l2", ("a", "b"))]
    assert step.stops == ("l2",)  # "near" has items queued for it: not idle
    # no items left: "near" is idle shortly before its expiry and is stopped too
    step = plan.plan_admission(replace(snap, queued=()), OPTS)
    assert step.stops == ("near",)


def test_r29_a_contended_reply_stops_leases_of_groups_with_nothing_queued():
    # R29: contended -> return undrawn permits of leases in groups with nothing queued
    snap = KeySnapshot(NOW, queued=queued("a", group="busy"),
                       leases=(lease("idle", group="quiet"), lease("used", group="busy"),
                               lease("stopped", group="quiet", stopped=True)))
    assert plan.plan_reply(snap, OPTS, contended=True).stops == ("idle",)
    assert plan.plan_reply(snap, OPTS, contended=False).stops == ()


def test_r15a_a_finished_claim_wakes_the_key_only_with_a_done_hook():
    # R15a, R37: a cancelled item whose claim resolves finishes; its on_done hook is then due
    snap = KeySnapshot(NOW, claiming=(ClaimingItem("a", "g", 1, "g1", 1, cancel=True),),
                       claim_grants={"g1": grant(claimed=1, confirmed=1)})
    assert plan.plan_reply(snap, OPTS, contended=False).wake_now is False
    step = plan.plan_reply(snap, replace(OPTS, done_hook=True), contended=False)
    assert step.wake_now and [r.action for r in step.resolutions] == [Resolve.RELEASE]


# ----------------------------------------------------------------------------- reports
def test_r37_claims_and_returning_stops_are_reported_at_once():
    # R15a, R29, R37: unsent claims, a stop returning undrawn permits, a lost request: at once
    for snap in (KeySnapshot(NOW, grants=(grant(claimed=1, sent_claimed=0),)),
                 KeySnapshot(NOW, leases=(lease(drawn=1, stopped=True, sent_stopped=False),)),
                 KeySnapshot(NOW, key=KeyState(needs_sync=True))):
        assert plan.report_due(snap, OPTS) == plan.ReportDue(NOW, PendingReleases.KEEP)


def test_r37_releases_wait_up_to_the_bound_unless_contended():
    # R37 (report_releases_within_ms): releases alone wait for another message, up to the bound
    # counted from when they started waiting; a contended key reports them at once (R29)
    g = grant(claimed=1, released=1, confirmed=1, sent_released=0)
    snap = KeySnapshot(NOW, grants=(g,))
    assert plan.report_due(snap, OPTS) == plan.ReportDue(NOW + 10_000, PendingReleases.START)
    assert plan.report_due(replace(snap, pending_since=NOW - 4_000), OPTS).at == NOW + 6_000
    assert plan.report_due(replace(snap, key=KeyState(contended=True)), OPTS).at == NOW
    # a drained lease's stop is a release too
    drained = KeySnapshot(NOW, leases=(lease(permits=1, drawn=1, released=1, stopped=True, sent_stopped=False),))
    assert plan.report_due(drained, OPTS).pending is PendingReleases.START
    # nothing to report: the mark is cleared; the client's re-check waits like a release
    assert plan.report_due(KeySnapshot(NOW), OPTS) == plan.ReportDue(None, PendingReleases.CLEAR)
    assert plan.report_due(KeySnapshot(NOW, key=KeyState(check_at=NOW + 1)), OPTS).at == NOW + 10_001


def test_r31_heartbeat_only_for_leases_in_use():
    # R31, R37: a live lease with work running (or items waiting) is heartbeated at heartbeat_at
    busy = lease(drawn=1, heartbeat_at=NOW)
    assert plan.heartbeat_due(KeySnapshot(NOW, leases=(busy,)))
    assert not plan.heartbeat_due(KeySnapshot(NOW, leases=(lease(heartbeat_at=NOW),)))
    assert plan.heartbeat_due(KeySnapshot(NOW, queued=queued("a"), leases=(lease(heartbeat_at=NOW),)))
    assert not plan.heartbeat_due(KeySnapshot(NOW, leases=(replace(busy, stopped=True),)))


# ----------------------------------------------------------------------------- messages, wake-ups
def test_r11_r15a_which_message_goes_next():
    # R15a: claims awaiting confirmation are synced even when a request is due; R11: a request
    # goes only from nextRequestAt on, and carries due reports itself
    claiming = (ClaimingItem("a", "g", 1, "g1", 1),)
    assert plan.plan_exchange(KeySnapshot(NOW, claiming=claiming), OPTS, demand=True) is Exchange.SYNC
    assert plan.plan_exchange(KeySnapshot(NOW), OPTS, demand=True) is Exchange.REQUEST
    later = KeySnapshot(NOW, key=KeyState(next_request_at=NOW + 1))
    assert plan.plan_exchange(later, OPTS, demand=True) is Exchange.NONE
    reports = KeySnapshot(NOW, key=KeyState(needs_sync=True))
    assert plan.plan_exchange(reports, OPTS, demand=True) is Exchange.REQUEST
    assert plan.plan_exchange(reports, OPTS, demand=False) is Exchange.SYNC
    assert plan.plan_exchange(KeySnapshot(NOW), OPTS, demand=False) is Exchange.NONE


def test_r37_next_wake_is_the_earliest_due_thing():
    # R11, R37: request at nextRequestAt, heartbeat, idle-lease stop, retries; a network backoff
    # delays holder messages but not the on_done retries
    snap = KeySnapshot(NOW, queued=queued("a"), key=KeyState(next_request_at=NOW + 5_000),
                       leases=(lease("idle", group="other", expires_at=NOW + 3_000),))
    assert plan.next_wake(snap, OPTS) == NOW + 2_000  # the idle lease's stop before expiry
    assert plan.next_wake(replace(snap, leases=()), OPTS) == NOW + 5_000
    assert plan.next_wake(replace(snap, leases=()), OPTS, backoff_until=NOW + 7_000) == NOW + 7_000
    times = ItemTimes(admit_retry_at=NOW + 900, done_retry_at=NOW + 100, last_checked_at=NOW)
    assert plan.next_wake(snap, OPTS, items=times) == NOW + 900  # no done hook configured
    assert plan.next_wake(snap, replace(OPTS, done_hook=True), items=times, backoff_until=NOW + 7_000) == NOW + 100
    assert plan.next_wake(snap, replace(OPTS, reconcile_after_ms=50), items=times) == NOW + 50
    assert plan.next_wake(KeySnapshot(NOW), OPTS) is None


# ----------------------------------------------------------------------------- merging replies
def _gs(status: GrantStatus = GrantStatus.ACTIVE, permits: int = 2, claimed: int = 0, released: int = 0,
        group: str | None = "g") -> GrantState:
    return GrantState("g1", group, permits, claimed, released, NOW + 10_000, status)


def test_r13_a_stale_reply_lowers_nothing_and_confirms_what_it_shows():
    # R13, I2: counts are high-water marks; R15a: claims the holder shows are confirmed
    local = grant(claimed=2, released=1, confirmed=0, sent_claimed=0, sent_released=0)
    merged = merge_grant(KEY, local, _gs(claimed=1, released=0)).row
    assert merged is not None
    assert (merged.claimed, merged.released, merged.confirmed) == (2, 1, 1)
    assert (merged.sent_claimed, merged.sent_released) == (1, 0)


def test_r15_an_expired_grant_keeps_only_what_the_holder_kept():
    # R15, R15a: claims beyond the clamped permits were refused and never confirmed
    local = grant(permits=3, claimed=3, released=0, confirmed=1)
    merge = merge_grant(KEY, local, _gs(GrantStatus.EXPIRED, permits=1, claimed=1))
    assert merge.expired and merge.row is not None
    assert (merge.row.permits, merge.row.claimed, merge.row.confirmed, merge.row.status) == (1, 1, 1, "expired")


def test_r14_r17_not_found_and_settled_grants_become_tombstones_that_stay():
    # R14/R15: not_found drops the grant; R17: a fully released grant is settled; a tombstone
    # is never brought back by a stale reply (I2)
    merge = merge_grant(KEY, grant(), _gs(GrantStatus.NOT_FOUND, permits=0, group=None))
    assert merge.dropped and merge.row is not None and merge.row.status == GONE
    settled = merge_grant(KEY, grant(claimed=2, released=2), _gs(claimed=2, released=2))
    assert settled.dropped and settled.row is not None and settled.row.status == GONE
    assert merge_grant(KEY, merge.row, _gs()).row is None
    # R8: an unknown grant is adopted as the holder knows it
    adopted = merge_grant(KEY, None, _gs(claimed=1))
    assert adopted.adopted and adopted.row is not None and adopted.row.confirmed == 1


def test_r31_r33_lease_merge_clamps_retires_and_moves_the_heartbeat():
    # R31: drawn/released are high-water marks clamped to the permits; a later expiry moves
    # the heartbeat to half the new lifetime; R33: a retired lease stops drawing at once
    local = lease(permits=4, drawn=2, released=1)
    live = LeaseState("l1", "g", 4, 9, 0, NOW + 40_000, LeaseStatus.LIVE)
    row = merge_lease(KEY, local, live, NOW).row
    assert row is not None and (row.drawn, row.released, row.expires_at, row.heartbeat_at) == (
        4, 1, NOW + 40_000, NOW + 20_000)
    retired = merge_lease(KEY, local, replace(live, drawn=2, status=LeaseStatus.RETIRED), NOW)
    assert retired.retired and retired.row is not None and retired.row.stopped
    assert retired.row.expires_at == local.expires_at
    settled = merge_lease(KEY, local, replace(live, status=LeaseStatus.SETTLED), NOW)
    assert settled.settled and settled.row is not None and settled.row.status == "settled"
    assert merge_lease(KEY, settled.row, live, NOW).row is None


def test_r34a_an_extension_of_a_reusable_lease_keeps_the_heartbeat_that_is_due_earlier():
    # R34a: the heartbeat of a reusable lease asks again for the demand it covers; an extension
    # heard in another reply (a recheck sync, R33a) does not move it later, only one at or after
    # it does (then half the new lifetime, R37). A one-shot lease moves it as before.
    local = replace(lease(heartbeat_at=NOW + 10_000), reusable=True)
    extended = LeaseState("l1", "g", 4, 1, 0, NOW + 4_000 + 40_000, LeaseStatus.LIVE, reusable=True)
    row = merge_lease(KEY, local, extended, NOW + 4_000).row
    assert row is not None and (row.expires_at, row.heartbeat_at) == (NOW + 44_000, NOW + 10_000)
    row = merge_lease(KEY, local, replace(extended, expires_at=NOW + 50_000), NOW + 10_000).row
    assert row is not None and row.heartbeat_at == NOW + 30_000
    one_shot = merge_lease(KEY, lease(heartbeat_at=NOW + 10_000), replace(extended, reusable=False), NOW + 4_000).row
    assert one_shot is not None and one_shot.heartbeat_at == NOW + 24_000


# ----------------------------------------------------------------------------- admitted items
def item_row(item_id: str, state: str = "running", *, owner: str = "", admitted: int = 0, attempts: int = 0,
             retry_at: int = NOW, checked_at: int = NOW, started_at: int = NOW, cancel: int = 0,
             done_pending: int = 0, done_retry_at: int = 0) -> dict[str, object]:
    return {"item_id": item_id, "state": state, "owner": owner, "admitted": admitted, "attempts": attempts,
            "retry_at": retry_at, "checked_at": checked_at, "started_at": started_at, "cancel": cancel,
            "done_pending": done_pending, "done_retry_at": done_retry_at}


def test_r37_a_callback_retry_waits_for_an_answer_of_the_holder_since_it_came_due():
    # R37: the first call never waits; a retry waits until a reply stamped checked_at at or
    # after its retry_at (a force-settled permit would show in that reply)
    assert not plan.retry_waits_for_holder(0, checked_at=0, retry_at=NOW)
    assert plan.retry_waits_for_holder(1, checked_at=NOW - 1, retry_at=NOW)
    assert not plan.retry_waits_for_holder(1, checked_at=NOW, retry_at=NOW)


def test_r37_a_permit_is_gone_when_its_grant_is_unknown_or_gone_or_its_lease_unknown_or_settled():
    assert plan.permit_gone("grant", None, None) and plan.permit_gone("grant", grant(status=GONE), None)
    assert not plan.permit_gone("grant", grant(status="active"), None)
    assert not plan.permit_gone("grant", grant(status="expired"), None)  # still claimable state known
    assert plan.permit_gone("lease", None, None) and plan.permit_gone("lease", None, lease(status="settled"))
    assert not plan.permit_gone("lease", None, lease(status="live"))
    assert not plan.permit_gone("lease", grant(status=GONE), lease())  # the item's own kind decides


def _item(item_id: str, **values: object) -> dict[str, object]:
    return {"item_id": item_id, "state": "running", "permit_kind": "grant", "permit_id": "g1", "retry_at": NOW,
            "attempts": 0, "checked_at": 0, "owner": "", **values}


def test_r37_each_due_callback_item_is_in_flight_gone_waiting_for_the_holder_or_called():
    looked_up: list[tuple[str, str]] = []
    permits = {("grant", "g1"): (grant(), None), ("lease", "l1"): (None, lease()),
               ("lease", "l2"): (None, lease("l2", status="settled"))}

    def permit(kind: str, permit_id: str) -> tuple[ClientGrant | None, ClientLease | None]:
        looked_up.append((kind, permit_id))
        return permits.get((kind, permit_id), (None, None))

    rows = [_item("later", retry_at=NOW + 1), _item("flying", permit_id="unknown"), _item("first"),
            _item("gone-grant", permit_id="g9"), _item("gone-lease", permit_kind="lease", permit_id="l2"),
            _item("retry", attempts=1, checked_at=NOW - 1), _item("answered", attempts=1, checked_at=NOW),
            _item("leased", permit_kind="lease", permit_id="l1")]
    due = plan.calls_due(rows, now=NOW, in_flight={"flying"}, permit=permit)
    assert due == plan.CallsDue(call=("first", "answered", "leased"), in_flight=("flying",),
                                gone=("gone-grant", "gone-lease"), waiting=("retry",))
    # only the permits of due items not in flight are looked up, each item's own
    assert looked_up == [("grant", "g1"), ("grant", "g9"), ("lease", "l2"), ("grant", "g1"), ("grant", "g1"),
                         ("lease", "l1")]
    assert plan.calls_due(rows[:1], now=NOW, in_flight=(), permit=permit) == plan.CallsDue()
    # a call in flight that is not due yet is left alone (its retry is not moved on every pass)
    assert plan.calls_due(rows[:1], now=NOW, in_flight={"later"}, permit=permit) == plan.CallsDue()


def test_r37_a_chosen_callback_item_is_called_only_if_nothing_changed_it_since():
    row = _item("i", attempts=2, admitted=0)
    assert plan.still_due(row, attempts=2, in_flight=())
    assert not plan.still_due(None, attempts=2, in_flight=())  # purged or deleted meanwhile
    assert not plan.still_due({**row, "state": "done"}, attempts=2, in_flight=())
    assert not plan.still_due({**row, "admitted": 1}, attempts=2, in_flight=())
    assert not plan.still_due({**row, "attempts": 3}, attempts=2, in_flight=())  # another pass chose it
    assert not plan.still_due(row, attempts=2, in_flight={"i"})


def test_r37_a_permit_item_goes_to_its_waiting_caller_unless_its_permit_is_gone():
    looked_up: list[tuple[str, str]] = []

    def permit(kind: str, permit_id: str) -> tuple[ClientGrant | None, ClientLease | None]:
        looked_up.append((kind, permit_id))
        return (grant(), None) if permit_id == "g1" else (None, None)

    rows = [_item("withdrawn", owner="me"), _item("waits", owner="me"), _item("gone", owner="me", permit_id="g9")]
    assert plan.hand_overs(rows, waiting={"waits", "gone"}, permit=permit) == plan.HandOvers(("waits",), ("gone",))
    assert looked_up == [("grant", "g1"), ("grant", "g9")]  # only for items with a waiting caller


def test_r37_a_permit_item_is_an_orphan_when_its_caller_is_gone_and_is_checked_every_period():
    rows = [_item("mine", owner="me"), _item("mine-withdrawn-failed", owner="me"), _item("theirs", owner="dead"),
            _item("finished", owner="dead", state="done")]
    assert plan.orphans(rows, owner="me", callers={"mine"}) == ("mine-withdrawn-failed", "theirs")
    assert plan.orphans(rows, owner="me", callers={"mine", "mine-withdrawn-failed"}) == ("theirs",)
    # a caller of this instance is no caller of another's item of the same id
    assert plan.orphans([_item("x", owner="dead")], owner="me", callers={"x"}) == ("x",)
    checks = [_item("stale", checked_at=NOW - 60_000), _item("fresh", checked_at=NOW - 59_999),
              _item("done", checked_at=0, state="done")]
    assert plan.orphan_checks(checks, now=NOW, orphan_check_ms=60_000) == ("stale",)


def test_r37_after_a_failure_the_holder_waits_out_the_backoff_except_for_a_try():
    assert plan.backing_off(NOW, NOW + 1, trying=False)
    assert not plan.backing_off(NOW, NOW, trying=False)  # the backoff's end: contact again
    assert not plan.backing_off(NOW, NOW + 1, trying=True)  # R9b: a try's caller waits for its answer


def test_r37_a_pause_after_the_exchange_bound_stops_requests_except_a_trys():
    assert plan.requests_paused(NOW, NOW + 1, trying=False)
    assert not plan.requests_paused(NOW, NOW, trying=False)
    assert not plan.requests_paused(NOW, NOW + 1, trying=True)


def test_r37_releases_go_beside_a_waiting_request_only_when_others_wait_for_them():
    snap = KeySnapshot(NOW, key=KeyState(needs_sync=True))
    assert plan.side_release_view(snap, OPTS) is None  # uncontended, requests not held
    for view in (plan.side_release_view(replace(snap, key=KeyState(contended=True, needs_sync=True)), OPTS),
                 plan.side_release_view(snap, replace(OPTS, held_requests=True))):
        # judged as contended, and the request in flight is the "contact the holder" mark's contact
        assert view is not None and view.key.contended and not view.key.needs_sync


def test_r37_work_is_completed_after_its_last_attempt_failed():
    assert not plan.work_exhausted(2, 3) and plan.work_exhausted(3, 3) and plan.work_exhausted(4, 3)
    # a failed call is retried admit_retry_ms later; a work call that was the last completes the
    # item; an on_admit call (no work) is retried whatever its attempts
    assert plan.after_failure(2, now=NOW, admit_retry_ms=500, work=True, work_attempts=3) == (NOW + 500, False)
    assert plan.after_failure(3, now=NOW, admit_retry_ms=500, work=True, work_attempts=3) == (NOW + 500, True)
    assert plan.after_failure(9, now=NOW, admit_retry_ms=500, work=False, work_attempts=3) == (NOW + 500, False)


def test_r37_a_pump_with_work_left_after_its_exchanges_pauses_requests_only_if_it_requested():
    assert plan.MAX_EXCHANGES == 8
    assert plan.pause_after_exchanges(True) is plan.Pause.REQUESTS
    assert plan.pause_after_exchanges(False) is plan.Pause.ALL


def test_r37_item_times_of_callbacks_hooks_reconciliation_and_permit_checks():
    rows = [
        item_row("first", retry_at=NOW + 50),                                  # a first call, due later
        item_row("retry-waits", attempts=1, retry_at=NOW - 5, checked_at=NOW - 10),  # due, waits for the holder
        item_row("retry-later", attempts=1, retry_at=NOW + 30, checked_at=NOW - 10),  # not due yet: its time counts
        item_row("admitted", admitted=1, started_at=NOW - 100, checked_at=NOW - 40),
        item_row("hook", "done", done_pending=1, done_retry_at=NOW + 7),
        item_row("mine", owner="me", checked_at=NOW - 1),
        item_row("mine-withdrawn", owner="me", checked_at=NOW - 90, cancel=1),  # its claim's answer resolves it
        item_row("theirs", owner="other", checked_at=NOW - 99),                 # handled at every pump's start
        item_row("queued", "queued", checked_at=NOW - 80),
    ]
    times = plan.item_times(rows, now=NOW, owner="me", orphan_check_ms=1000, done_hook=True, reconcile=True)
    assert times == ItemTimes(admit_retry_at=NOW + 30, done_retry_at=NOW + 7, last_checked_at=NOW - 40,
                              permit_check_at=NOW - 1 + 1000)
    off = plan.item_times(rows, now=NOW, owner="me", orphan_check_ms=1000, done_hook=False, reconcile=False)
    assert off.done_retry_at is None and off.last_checked_at is None
    assert plan.item_times([], now=NOW, owner="me", orphan_check_ms=1000, done_hook=True,
                           reconcile=True) == ItemTimes()


def test_r37_admit_room_is_the_bound_less_the_busy_callbacks_never_below_zero():
    assert plan.admit_room(None, 5) is None
    assert plan.admit_room(3, 1) == 2 and plan.admit_room(3, 3) == 0 and plan.admit_room(3, 7) == 0


def test_r10_demand_beside_a_held_request_only_when_some_group_asks_for_more():
    assert not plan.demand_grew([("a", 2)], [("a", 2), ("b", 1)])
    assert not plan.demand_grew([("a", 1)], [("a", 2)])  # drawn or finished meanwhile
    assert plan.demand_grew([("a", 3)], [("a", 2)])
    assert plan.demand_grew([("c", 1)], [("a", 2)])  # a new group
    assert not plan.demand_grew([], [])


def test_r37_reconciliation_checks_items_running_and_unchecked_for_the_bound():
    assert plan.reconcile_due(NOW - 100, NOW - 100, now=NOW, reconcile_after_ms=100)
    assert not plan.reconcile_due(NOW - 99, NOW - 100, now=NOW, reconcile_after_ms=100)
    assert not plan.reconcile_due(NOW - 100, NOW - 99, now=NOW, reconcile_after_ms=100)
    rows = [item_row("due", started_at=NOW - 100, checked_at=NOW - 100), item_row("new", started_at=NOW - 99),
            item_row("checked", started_at=NOW - 500, checked_at=NOW - 99), item_row("also", started_at=0, checked_at=0)]
    assert plan.reconcile_checks(rows, now=NOW, reconcile_after_ms=100) == ("due", "also")


def test_r34a_the_room_checks_back_off_from_2_s_to_the_recheck_over_one_contention():
    # R34a decision (the room check): the contention's start is kept over contended replies and
    # forgotten at the first that is not; the next check waits as long as the key had been
    # contended at its last reply, at least 2 s, at most leaseRecheckMs.
    from semaphore.core.client_state import ROOM_CHECK_MIN_MS, KeyState, contended_since
    assert contended_since(0, True, 1000) == 1000  # the first contended reply
    assert contended_since(1000, True, 5000) == 1000 and contended_since(1000, False, 5000) == 0
    first = KeyState(contended=True, contended_since=1000, replied_at=1000, lease_recheck_ms=30_000)
    assert first.room_check_at() == 1000 + ROOM_CHECK_MIN_MS
    assert KeyState(contended=True, contended_since=1000, replied_at=9000, lease_recheck_ms=30_000).room_check_at() \
        == 9000 + 8000
    assert KeyState(contended=True, contended_since=1000, replied_at=90_000, lease_recheck_ms=30_000).room_check_at() \
        == 90_000 + 30_000
    assert KeyState(contended=True, contended_since=1000, replied_at=9000, lease_recheck_ms=1000).room_check_at() \
        == 9000 + 1000


def test_r34a_a_room_check_due_with_a_heartbeat_gives_way_to_the_heartbeats_request():
    # R34a: the covered demand rides on the lease's heartbeat (a request that can grow the key's
    # share); a room check due at the same moment must not turn that request into a sync.
    busy = replace(lease(permits=2, drawn=2), reusable=True)  # every slot busy: covered demand
    key = KeyState(contended=True, contended_since=NOW - 60_000, replied_at=NOW - 40_000, lease_recheck_ms=30_000)
    snap = KeySnapshot(NOW, queued=queued("a", "b"), leases=(busy,), key=key)
    assert plan.room_check_due(snap, OPTS) and not plan.heartbeat_due(snap)
    assert plan.plan_exchange(snap, OPTS, demand=True) is plan.Exchange.SYNC  # the room check
    beating = replace(snap, leases=(replace(busy, heartbeat_at=NOW - 1),))
    assert plan.room_check_due(beating, OPTS) and plan.heartbeat_due(beating)
    assert plan.plan_exchange(beating, OPTS, demand=True) is plan.Exchange.REQUEST  # the heartbeat


def test_r34a_only_an_active_reusable_lease_clear_of_its_expiry_margin_covers_its_group():
    # R34a: while the key is contended, a group is covered by a reusable lease that may still be
    # drawn from: not stopped, not one-shot, and not within lease_margin_ms of its expiry.
    live = replace(lease("r", group="a"), reusable=True)

    def covered(*leases: ClientLease, now: int = NOW) -> set[str]:
        return plan.covered_groups(KeySnapshot(now, leases=leases, key=KeyState(contended=True)), OPTS)

    assert covered(live) == {"a"}
    assert covered(replace(live, stopped=True)) == set()
    assert covered(replace(live, reusable=False)) == set()
    edge = live.expires_at - OPTS.lease_margin_ms
    assert covered(live, now=edge - 1) == {"a"}
    assert covered(live, now=edge) == set()
    assert covered(live, now=live.expires_at - OPTS.lease_margin_ms // 2) == set()


def test_r34a_young_demand_in_a_young_contention_is_not_covered_and_anything_older_is():
    # R34a decision (young demand in a young contention): for COVER_AFTER_MS after the message
    # that first found the key contended, a busy reusable lease does not cover a group whose
    # oldest queued item was enqueued less than COVER_AFTER_MS ago: its demand is asked for at
    # the key's nextRequestAt, as a burst's should be. Demand that has waited, or a contention
    # that lasts, is covered (room checks, no request every round); so is a key whose row has
    # no contended_since (an older release).
    busy = replace(lease("r", permits=2, drawn=2), reusable=True)
    young_at, old_at = NOW - COVER_AFTER_MS + 1, NOW - COVER_AFTER_MS

    def snap(since: int, enqueued: int, *others: int) -> KeySnapshot:
        key = KeyState(contended=True, contended_since=since, replied_at=NOW - 100, lease_recheck_ms=30_000)
        items = tuple(QueuedItem(f"i{n}", "g", n + 1, enqueued_at=at) for n, at in enumerate((enqueued, *others)))
        return KeySnapshot(NOW, queued=items, leases=(busy,), key=key)

    both_young = snap(young_at, young_at)
    assert both_young.key.contention_young(NOW) and not snap(old_at, young_at).key.contention_young(NOW)
    assert plan.young_demand(both_young) == {"g"} and plan.covered_groups(both_young, OPTS) == set()
    assert plan.wants_round(both_young, OPTS)
    assert plan.plan_exchange(both_young, OPTS, demand=True) is plan.Exchange.REQUEST
    for covered in (snap(young_at, old_at), snap(old_at, young_at), snap(0, young_at),
                    snap(young_at, NOW, old_at)):  # the group's oldest item counts, not its newest
        assert plan.young_demand(covered) == set() and plan.covered_groups(covered, OPTS) == {"g"}
        assert not plan.wants_round(covered, OPTS)
        assert plan.plan_exchange(covered, OPTS, demand=True) is not plan.Exchange.REQUEST
    assert not KeyState(contended=False, contended_since=NOW).contention_young(NOW)
    # only admissible items count (R21: an item held back by admit_concurrency lends its age to
    # none): an old callback item waiting for a callback slot, and a new permit() caller
    held_back = replace(snap(young_at, old_at), admit_room=0,
                        queued=(QueuedItem("old", "g", 1, enqueued_at=old_at),
                                QueuedItem("caller", "g", 2, bounded=False, enqueued_at=young_at)))
    assert plan.admissible(held_back) == {"g": ["caller"]}
    assert plan.young_demand(held_back) == {"g"} and plan.covered_groups(held_back, OPTS) == set()


def test_r31a_a_reusable_lease_is_stopped_from_lease_margin_ms_before_its_expiry():
    # R31a: a reusable lease the holder did not extend is stopped before it expires, from
    # lease_margin_ms before (its demand goes to a round again), even with items queued for it.
    live = replace(lease("r", group="a", drawn=1), reusable=True)
    edge = live.expires_at - OPTS.lease_margin_ms
    snap = KeySnapshot(edge, queued=queued("x", group="a"), leases=(live,))
    assert plan.leases_to_stop(replace(snap, now=edge - 1), OPTS, contended=False) == ()
    assert plan.leases_to_stop(snap, OPTS, contended=False) == ("r",)


def test_r29_r37_an_uncontended_reusable_lease_is_stopped_once_nothing_queued_runs_under_it():
    # R29, R37 (the default leases' trade-off): with nothing of its group queued, a reusable lease
    # is stopped when no item runs under it, its slots going back at once, even when the last
    # reply was not contended; while one item or more runs under it, it is kept. A one-shot
    # lease is kept either way until a contended reply (R29).
    snap = KeySnapshot(NOW, leases=())
    for drawn, released, stopped in ((3, 3, True), (3, 2, False), (3, 1, False), (0, 0, True)):
        reusable = replace(lease("r", drawn=drawn, released=released), reusable=True)
        got = plan.leases_to_stop(replace(snap, leases=(reusable,)), OPTS, contended=False)
        assert got == (("r",) if stopped else ()), (drawn, released, got)
        one_shot = lease("o", drawn=drawn, released=released)
        assert plan.leases_to_stop(replace(snap, leases=(one_shot,)), OPTS, contended=False) == ()
    queued_for_it = replace(snap, queued=queued("x"), leases=(replace(lease("r", drawn=3, released=3), reusable=True),))
    assert plan.leases_to_stop(queued_for_it, OPTS, contended=False) == ()  # its group has work queued


def test_r31a_r34a_a_lease_heard_but_not_extended_heartbeats_again_at_half_of_what_is_left():
    # R31a, R34a: a reply that does not extend a live lease (a reusable one while a request
    # starves) moves a heartbeat that is due to half of what is left, at least 1 s on, never at
    # once again; a heartbeat not due yet, or a retired lease's, is left where it is.
    local = replace(lease("r", expires_at=NOW + 20_000, heartbeat_at=NOW - 1), reusable=True)
    heard = LeaseState("r", "g", 4, 0, 0, NOW + 20_000, LeaseStatus.LIVE, reusable=True)
    assert merge_lease(KEY, local, heard, NOW).row.heartbeat_at == NOW + 10_000
    near = replace(local, expires_at=NOW + 1_500)
    assert merge_lease(KEY, near, replace(heard, expires_at=NOW + 1_500), NOW).row.heartbeat_at == NOW + 1_000
    due_now = replace(local, heartbeat_at=NOW)  # due at this very moment: moved, not sent again at once
    assert merge_lease(KEY, due_now, heard, NOW).row.heartbeat_at == NOW + 10_000
    later = replace(local, heartbeat_at=NOW + 5_000)
    assert merge_lease(KEY, later, heard, NOW).row.heartbeat_at == NOW + 5_000
    retired = merge_lease(KEY, later, replace(heard, status=LeaseStatus.RETIRED), NOW).row
    assert retired.heartbeat_at == NOW + 5_000 and retired.stopped


def test_r13_a_stale_lease_reply_never_lowers_what_was_acknowledged():
    # R13 (high-water marks), R34a: a reply carrying older counts than the client has already
    # had acknowledged (a late reply) keeps the acknowledged counts: nothing reads as unreported.
    local = replace(lease("r", drawn=3, released=2), reusable=True)
    stale = LeaseState("r", "g", 4, 1, 0, local.expires_at, LeaseStatus.LIVE, reusable=True)
    row = merge_lease(KEY, local, stale, NOW).row
    assert (row.drawn, row.released, row.sent_drawn, row.sent_released) == (3, 2, 3, 2)
    assert not row.dirty


def test_r9b_a_tries_answer_admission_first_then_a_claim_being_confirmed_then_the_failure():
    # R9b: what a try's caller gets once the holder answered. An admission wins over a failed
    # request (the lease served it before the request went); a claim being confirmed was served;
    # a failed request raises its error; anything else is refused. Only timeout 0 is a try.
    answer = plan.try_answer
    assert answer(admitted=True, state="running", failed=True) is plan.TryAnswer.ADMITTED
    assert answer(admitted=False, state="claiming", failed=True) is plan.TryAnswer.CONFIRMING
    assert answer(admitted=False, state="queued", failed=True) is plan.TryAnswer.FAILED
    assert answer(admitted=False, state=None, failed=False) is plan.TryAnswer.REFUSED
    assert answer(admitted=False, state="queued", failed=False) is plan.TryAnswer.REFUSED
    assert plan.is_try(0) and not plan.is_try(None) and not plan.is_try(1)


def test_r23_a_refused_permit_says_why_the_holder_left_its_group_waiting():
    from semaphore.core.wire import Blocked, BlockedReason

    blocked = Blocked("g", BlockedReason.LIMIT, 3)
    assert plan.refusal("k", "g", blocked, 0) == "no permit free now for key 'k', group 'g' (holder: limit, 3 waiting)"
    assert plan.refusal("k", "g", None, 0) == "no permit free now for key 'k', group 'g'"
    assert plan.refusal("k", "g", blocked, 250) == \
        "no permit for key 'k', group 'g' within 250 ms (holder: limit, 3 waiting)"


def test_a_purge_of_finished_items_waits_for_a_sixteenth_of_the_retention_beyond_its_cutoff():
    # R37 (finished items' purge): kept at least retention_ms, purged once the earliest
    # finished item is 1/16 of the retention older than the cutoff.
    from semaphore.core.queue_plan import purge_due_before

    assert purge_due_before(100_000, 16_000) == 100_000 - 16_000 - 1_000
    assert purge_due_before(100_000, 86_400_000) == 100_000 - 86_400_000 - 5_400_000


def test_r37_r35_a_completion_cancels_a_claim_finishes_a_waiting_item_and_releases_a_running_ones_permit():
    # R37: completing is idempotent (an unknown or finished item: nothing); a claiming item is
    # only marked cancelled (its claim is resolved first); a queued item, or a running one
    # under no permit, finishes with nothing to release; a running item's permit is released,
    # recorded in its own row for a callback item (R35), in the permit's row for a permit()
    # item (its row is deleted soon after).
    C = plan.Completion
    assert plan.completion(None, "", "") is C.NOTHING
    assert plan.completion("done", "", "grant") is C.NOTHING
    assert plan.completion("claiming", "", "grant") is C.CANCEL
    assert plan.completion("claiming", "tok", "grant") is C.CANCEL
    assert plan.completion("queued", "", "") is C.FINISH
    assert plan.completion("queued", "tok", "") is C.FINISH
    assert plan.completion("running", "", "") is C.FINISH
    assert plan.completion("running", "", "grant") is C.RECORD
    assert plan.completion("running", "", "lease") is C.RECORD
    assert plan.completion("running", "tok", "lease") is C.RELEASE
    assert plan.completion("running", "tok", "grant") is C.RELEASE


def test_completion_writes_group_a_batch_per_key_and_permit_with_each_permits_highest_release():
    # R35, R37 (complete_many): per key one write of cancels and one of unrecorded finishes;
    # per permit one write of recorded ones, each at that permit's own highest count.
    C = plan.Completion
    writes = plan.completion_writes([
        plan.Completed("a", "k1", C.RECORD, "lease", "L", 3),
        plan.Completed("b", "k1", C.FINISH, "", "", 0),
        plan.Completed("c", "k1", C.RECORD, "grant", "L", 7),   # another kind, same id: its own write
        plan.Completed("d", "k1", C.RECORD, "lease", "L", 5),
        plan.Completed("e", "k1", C.CANCEL, "grant", "G", 0),
        plan.Completed("f", "k2", C.RELEASE, "grant", "G", 0),  # released in the permit's row: nothing to record
        plan.Completed("g", "k1", C.RECORD, "lease", "M", 1),
        plan.Completed("h", "k2", C.CANCEL, "grant", "H", 0),
        plan.Completed("i", "k1", C.FINISH, "", "", 0),
        plan.Completed("j", "k1", C.RECORD, "lease", "L", 4),
    ])
    assert writes.cancels == {"k1": ["e"], "k2": ["h"]}
    assert writes.finishes == [("k1", ["a", "d", "j"], 5, False), ("k1", ["b", "i"], 0, False),
                               ("k1", ["c"], 7, False), ("k2", ["f"], 0, False), ("k1", ["g"], 1, False)]
    # a permit() item among a write's items says so (its row is deleted soon after)
    permit_item = plan.Completed("p", "k1", C.FINISH, "", "", 0, permit_item=True)
    assert plan.completion_writes([plan.Completed("b", "k1", C.FINISH, "", "", 0), permit_item]).finishes == [
        ("k1", ["b", "p"], 0, True)]
    assert plan.completion_writes([]) == plan.CompletionWrites({}, [])


def test_a_lease_returns_capacity_only_when_a_release_or_stop_is_unreported():
    # R19, R30, R34a: a one-shot lease whose new draws are unreported frees nothing at the
    # holder (so no report is hurried for them); an unreported release or stop does; a live
    # reusable lease's release frees nothing (its footprint is every slot).
    drawn = replace(lease(drawn=1, released=1), drawn=3)  # two more drawn, nothing more released
    assert drawn.dirty and not drawn.returns_capacity
    assert replace(lease(drawn=3, released=1), released=2).returns_capacity
    assert replace(lease(drawn=3, released=3), stopped=True).returns_capacity
    assert not replace(lease(drawn=3, released=1), released=2, reusable=True).returns_capacity
    assert replace(lease(drawn=3, released=1), released=2, reusable=True, stopped=True).returns_capacity


def test_r31_r33_r34a_a_lease_merge_keeps_what_the_reply_does_not_change():
    # R31: a reply that does not extend the lease (the same expiry) keeps its heartbeat; R33:
    # only a lease retired by this reply is reported newly retired; R34a: its slots are reused
    # only while the holder says so (a reply without the flag ends the reuse).
    local = replace(lease(permits=4, drawn=2, released=1, heartbeat_at=NOW + 5_000), reusable=True)
    same = LeaseState("l1", "g", 4, 2, 1, local.expires_at, LeaseStatus.LIVE, reusable=True)
    merged = merge_lease(KEY, local, same, NOW)
    assert merged.row is not None and merged.row.heartbeat_at == NOW + 5_000 and merged.row.reusable
    assert not merged.retired
    one_shot = merge_lease(KEY, replace(local, reusable=False), replace(same, reusable=False), NOW).row
    assert one_shot is not None and one_shot.heartbeat_at == NOW + 5_000
    flagless = merge_lease(KEY, local, replace(same, reusable=False), NOW).row
    assert flagless is not None and not flagless.reusable
    once = merge_lease(KEY, local, replace(same, status=LeaseStatus.RETIRED), NOW)
    assert once.retired and once.row is not None
    assert not merge_lease(KEY, once.row, replace(same, status=LeaseStatus.RETIRED), NOW).retired
