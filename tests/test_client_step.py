"""One step of a queue's key, driven directly (``semaphore.core.client_step``): the rows' new
values that a local admission or a holder reply writes, decided over a plain snapshot with no
storage, and the queue's shell that persists them without deciding (SPEC R15a, R29, R30, R34,
R37)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from dataclasses import replace
from typing import Any

import pytest
from tests.test_queue_plan import NOW, OPTS, grant, lease, queued

from semaphore import HolderUnavailableError, ItemState
from semaphore.client._queue_pump import _QueuePump
from semaphore.core import client_step
from semaphore.core import queue_plan as plan
from semaphore.core.client_state import merge_grant
from semaphore.core.client_step import KeyChanges, _Rows
from semaphore.core.queue_plan import ClaimingItem, KeySnapshot, Resolve
from semaphore.core.wire import GrantState, GrantStatus
from semaphore.testing import T0, ClientSide, HolderSide, Net, SimClock, async_test

pytestmark = pytest.mark.usefixtures("quiet_logs")  # the holder is made unreachable on purpose


def claiming(item_id: str, slot: int, *, gid: str = "g1", cancel: bool = False, bounded: bool = True,
             seq: int = 100) -> ClaimingItem:
    return ClaimingItem(item_id, "g", seq, gid, slot, cancel, bounded)


def test_r15a_an_admission_claims_slots_that_follow_the_grants_claimed_count():
    # R15a: items claim the next slots of a grant (claiming, pending confirmation)
    g = grant(permits=3, claimed=1, confirmed=1)
    out = client_step.admission(KeySnapshot(NOW, queued("a", "b"), grants=(g,), running={"g1": 1}), OPTS)
    assert [(c.grant_id, c.slots, c.item_ids) for c in out.claims] == [("g1", (2, 3), ("a", "b"))]
    assert out.grants == {"g1": {"claimed": 3}}
    assert out.start == out.requeue == out.finish == () and not out.draws


def test_r30_r34_an_admission_draws_from_the_leases_next_slots_and_stops_what_is_drawn_in_full():
    # R30, R34: a draw needs no confirmation (its items run at once); a one-shot lease drawn in
    # full is stopped in the same step, one write per count
    x = lease(permits=2, drawn=1)
    snap = KeySnapshot(NOW, queued("a", "b"), leases=(x,))
    out = client_step.admission(snap, OPTS)
    assert [(d.lease_id, d.first_slot, d.item_ids) for d in out.draws] == [("l1", 2, ("a",))]
    assert out.leases == {"l1": {"drawn": 2, "stopped": 1}}
    assert not out.claims and not out.grants


def test_r15a_a_cancelled_claim_and_the_idle_slots_of_one_grant_compose_into_one_count():
    # R15a, R37 (surplus grants): a confirmed slot of a cancelled item is released by its
    # resolution, and the confirmed slots no item holds after it by the idle release: the
    # step tracks the grant through both, so the row gets the sum, never past what is
    # releasable, and the holder hears it at once
    g = grant(permits=3, claimed=3, confirmed=3)
    snap = KeySnapshot(NOW, claiming=(claiming("a", 1, cancel=True),), grants=(g,), claim_grants={"g1": g})
    out = client_step.admission(snap, OPTS)
    assert out.finish == ("a",) and out.grants == {"g1": {"released": 3}} and out.ask_holder
    assert not out.finish_permits


def test_r15a_resolutions_start_requeue_and_finish_and_name_permit_items():
    # R15a: confirmed slots start, refused ones go back to the queue, cancelled refused ones end
    g = grant(permits=2, claimed=2, confirmed=1, claim_by=NOW - 1, status="expired")
    items = (claiming("a", 1), claiming("b", 2), claiming("c", 2, cancel=True, bounded=False))
    out = client_step.after_reply(KeySnapshot(NOW, claiming=items, claim_grants={"g1": g}), OPTS,
                                  contended=False, more=False)
    assert (out.start, out.requeue, out.finish) == (("a",), ("b",), ("c",))
    assert out.finish_permits and out.clear_pending
    assert not out.grants and not out.claims and not out.draws


def test_r37_a_reply_checks_the_unstarted_callback_items_and_keeps_a_requests_blocked_words():
    # R37: a retry of a callback waits for a reply since it came due (the reply checks its
    # permit); a request's reply replaces the key's blocked entries, a sync's keeps them
    words = (("g", "limit", 3),)
    assert client_step.after_reply(KeySnapshot(NOW), OPTS, contended=True, more=False, unstarted=("a", "b"),
                                   blocked=words) == KeyChanges(clear_pending=True, checked=("a", "b"), blocked=words)
    assert client_step.after_reply(KeySnapshot(NOW), OPTS, contended=False, more=False).blocked is None


def test_r15a_a_cancelled_claim_whose_slot_the_holder_released_already_finishes_with_nothing_released():
    # R15a: the reply that confirms a cancelled item's claim may also show its slot released at
    # the holder (a crash expiry raised released to claimed, claimTtlMs, while the confirming
    # reply was lost), or the grant dropped (a tombstone): the item is finished, nothing is
    # released (a release would free a slot that another item holds, or none at all). g3: two
    # cancelled items and one slot left: one releases it, the other finishes. g4: the slot
    # left is held by an item that starts now, and g5's by a running item: nothing to release.
    expired = grant(permits=2, claimed=1, released=1, confirmed=1)
    gone = grant("g2", permits=1, claimed=1, confirmed=1, status="gone")
    two = grant("g3", permits=3, claimed=3, released=1, confirmed=2)
    starts = grant("g4", permits=2, claimed=2, released=1, confirmed=2)
    runs = grant("g5", permits=2, claimed=2, released=1, confirmed=2)
    items = (claiming("a", 1, cancel=True), claiming("b", 1, gid="g2", cancel=True),
             claiming("c", 1, gid="g3", cancel=True), claiming("d", 2, gid="g3", cancel=True),
             claiming("e", 1, gid="g4", cancel=True), claiming("f", 2, gid="g4"), claiming("h", 1, gid="g5", cancel=True))
    snap = KeySnapshot(NOW, claiming=items, grants=(expired, two, starts, runs), running={"g5": 1},
                       claim_grants={"g1": expired, "g2": gone, "g3": two, "g4": starts, "g5": runs})
    assert [(r.item_id, r.action) for r in plan.resolve_claims(snap)] == [
        ("a", Resolve.FINISH), ("b", Resolve.FINISH), ("c", Resolve.RELEASE), ("d", Resolve.FINISH),
        ("e", Resolve.FINISH), ("f", Resolve.START), ("h", Resolve.FINISH)]
    reply = client_step.after_reply(snap, OPTS, contended=False, more=False)
    assert reply.finish == ("a", "b", "c", "d", "e", "h") and reply.start == ("f",)
    assert reply.grants == {"g3": {"released": 2}}
    # an admission resolves alike, and gives g1's unclaimed permit back (R37, surplus grants)
    admission = client_step.admission(snap, OPTS)
    assert (admission.finish, admission.start) == (reply.finish, reply.start)
    assert admission.grants == {"g3": {"released": 2}, "g1": {"claimed": 2}}


def test_r15a_a_confirmed_claim_starts_only_under_a_slot_no_running_item_holds():
    # R15a, I4: the holder's crash expiry released a slot while the client was cut off, and
    # the reply confirms two claims: only the oldest item starts (the other goes back to the
    # queue in its place, for a fresh admission), and a cancelled one releases nothing
    g = grant(permits=3, claimed=3, released=1, confirmed=3)
    items = (claiming("a", 1, seq=1), claiming("b", 2, seq=2), claiming("x", 3, cancel=True, seq=3))
    snap = KeySnapshot(NOW, claiming=items, grants=(g,), claim_grants={"g1": g}, running={"g1": 1})
    assert [(r.item_id, r.action) for r in plan.resolve_claims(snap)] == [
        ("a", Resolve.START), ("b", Resolve.REQUEUE), ("x", Resolve.FINISH)]


async def _charged(holder: HolderSide) -> list[tuple[int, int]]:
    return [(g["claimed"], g["released"]) for x in (await holder.sem.holders())["holders"] for g in x["grants"]]


async def _expired_while_cut_off(clock: SimClock, *, cancel: bool = True, newcomer: bool = False
                                 ) -> tuple[HolderSide, ClientSide, dict[str, bool]]:
    """A queue whose holder has claimTtlMs 5 s: items "a" and "b" are asked for and "b" is
    completed while the request is on its way, so the grant of two keeps a permit unclaimed;
    "a" claims a slot, its confirming reply is lost and the network goes down (``state["down"]``
    until the test heals it); "a" is cancelled meanwhile (a permit() timeout; not if ``cancel``
    is false) and the holder's crash expiry releases its slot. With ``newcomer``, a new item "c"
    is enqueued then, and claims the grant's unclaimed permit before any reply comes."""
    holder = HolderSide(clock, limit=3, leases=None, claim_ttl_ms=5_000, grant_timeout_ms=600_000)
    state = {"down": False, "lose": True, "withdrawn": False}

    async def handle(message: dict[str, Any]) -> Any:
        if state["down"]:
            raise HolderUnavailableError("the network is down (test)")
        if message["type"] == "request" and not state["withdrawn"]:
            state["withdrawn"] = True
            await side.queue.complete("b")  # its demand goes away while the request is on its way
        reply = await holder.handle(message)
        if message["type"] == "sync" and state["lose"] and any(g.get("claimed", 0) for g in message["grants"]):
            state["lose"] = False
            state["down"] = True  # the confirming reply is lost, then the network is down
            raise HolderUnavailableError("the reply is lost (test)")
        return reply

    side = ClientSide("c1", clock, Net(handle, clock), on_admit=lambda side, item: None)
    await side.queue.enqueue("acct", "g", "a")
    await side.queue.enqueue("acct", "g", "b")
    for _ in range(20):
        await clock.advance(100)
    assert side.queue.item("a").state == "claiming"  # type: ignore[union-attr]
    if cancel:
        await side.queue.complete("a")
    await clock.advance(15_000)  # the holder's crash expiry releases the claim
    assert await _charged(holder) == [(1, 1)]
    if newcomer:
        await side.queue.enqueue("acct", "g", "c")
        await clock.advance(100)
    return holder, side, state


@async_test
async def test_r15a_a_cancelled_claim_the_holder_expired_is_finished_when_the_network_heals():
    # R15a with claimTtlMs (R18 decision): the claiming item is cancelled while the client is cut
    # off (a permit() timeout) and the holder's crash expiry releases its slot (the grant lives
    # on: one permit is unclaimed). When the network heals, the reply confirms the slot and
    # shows it released: the queue finishes the item. (A step that released the slot again
    # failed the key's pump on every retry, so nothing of the key ran until claimBy.)
    clock = SimClock(T0)
    holder, side, state = await _expired_while_cut_off(clock)
    state["down"] = False
    for _ in range(10):
        await clock.advance(1_000)
    assert side.queue.item("a").state == "done"  # type: ignore[union-attr]
    side.driver.kill()


@async_test
async def test_r15a_i4_a_slot_the_holder_expired_is_not_released_again_under_an_item_that_runs():
    # R15a, I4: as above, but a new item "c" claims the grant's unclaimed permit before the
    # reply comes. The reply confirms both slots and shows one released (the expired one, "a"'s):
    # "c" runs under the other, so "a" is finished with nothing released, and the holder keeps
    # one permit charged while "c" runs. (Releasing "a"'s slot again reported the grant free
    # while "c" ran under it: above the limit.)
    clock = SimClock(T0)
    holder, side, state = await _expired_while_cut_off(clock, newcomer=True)
    q = side.queue
    state["down"] = False
    for _ in range(10):
        await clock.advance(1_000)
    assert q.item("a").state == "done" and q.item("c").state == "running"  # type: ignore[union-attr]
    assert await _charged(holder) == [(2, 1)]
    side.driver.kill()


@async_test
async def test_r15a_i4_a_claim_the_holder_expired_does_not_start_a_second_item_uncharged():
    # R15a, I4: as above, but "a" is not cancelled: the reply confirms "a"'s slot and "c"'s and
    # shows one of them released (the expired one). One slot is charged, so one item starts
    # ("a", the older) and "c" goes back to the queue for a fresh admission; at every step the
    # holder charges at least what runs. (Both started before, one of them uncharged.)
    clock = SimClock(T0)
    holder, side, state = await _expired_while_cut_off(clock, cancel=False, newcomer=True)
    q = side.queue
    state["down"] = False
    for _ in range(30):
        await clock.advance(500)
        running = len(q.items("acct", ItemState.RUNNING))
        assert sum(c - r for c, r in await _charged(holder)) >= running
    assert q.item("a").state == "running" and q.item("c").state == "running"  # type: ignore[union-attr]
    side.driver.kill()


async def _completion_after_crash_expiry(*, ttl_turned_off: bool = False, batch: bool = False) -> None:
    """"a" and "b" run under a grant of three (a third item was completed while the request was
    on its way); "c", enqueued meanwhile, claims the third permit, but that claim's sync is lost
    and the client is cut off for longer than the TTL: the holder's crash expiry releases "a"'s
    and "b"'s slots (with ``ttl_turned_off``, the holder is then redeployed without
    ``claim_ttl_ms``). When the network heals, the reply confirms "c"'s claim and shows two
    released: one slot charged, two items running, so "c" goes back to the queue. When "a"
    completes, its release would free that one slot while "b" still runs: it releases nothing,
    and the grant stays charged until "b" completes. With ``batch``, both complete in one
    ``complete_many()``: two items, one slot to release."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=3, leases=None, claim_ttl_ms=5_000, grant_timeout_ms=600_000)
    state = {"down": False, "withdrawn": False, "third": False, "lost": False}

    async def handle(message: dict[str, Any]) -> Any:
        if state["down"]:
            raise HolderUnavailableError("the network is down (test)")
        claimed = [g.get("claimed", 0) for g in message.get("grants", [])]
        if message["type"] == "request" and not state["withdrawn"]:
            state["withdrawn"] = True
            await side.queue.complete("x")  # its demand goes away while the request is on its way
        elif message["type"] == "sync" and 2 in claimed and not state["third"]:
            state["third"] = True
            await side.queue.enqueue("acct", "g", "c")  # claims the third permit next
        elif message["type"] == "sync" and 3 in claimed and not state["lost"]:
            state["lost"] = state["down"] = True  # "c"'s claim is lost, then the network is down
            raise HolderUnavailableError("the sync is lost (test)")
        return await holder.handle(message)

    side = ClientSide("c1", clock, Net(handle, clock), on_admit=lambda side, item: None)
    q = side.queue
    for item_id in ("a", "b", "x"):
        await q.enqueue("acct", "g", item_id)
    for _ in range(20):
        await clock.advance(100)
    assert [q.item(i).state for i in "abc"] == ["running", "running", "claiming"]  # type: ignore[union-attr]
    await clock.advance(15_000)  # the holder's crash expiry releases "a"'s and "b"'s slots
    assert await _charged(holder) == [(2, 2)]
    if ttl_turned_off:
        holder.evict(claim_ttl_ms=None)  # its replies carry no claimTtlMs from now on
    state["down"] = False
    for _ in range(5):
        await clock.advance(1_000)
    assert (3, 2) in await _charged(holder)  # one slot of the grant charged ("c" runs under another)
    if batch:
        assert await q.complete_many(["a", "b"]) == [True, True]
        assert [(g.claimed, g.released) for g in side.client.grants("acct") if g.permits == 3] == [(3, 3)]
        for _ in range(25):
            await clock.advance(1_000)
        assert (3, 2) not in await _charged(holder)
        side.driver.kill()
        return
    await q.complete("a")
    assert [(g.claimed, g.released) for g in side.client.grants("acct") if g.permits == 3] == [(3, 2)]
    for _ in range(30):  # past the report wait (10 s): a release would have reached the holder
        await clock.advance(500)
        assert (3, 2) in await _charged(holder)  # "b" runs: the grant's slot stays charged
    await q.complete("b")  # nothing runs under the grant now: its completion releases the slot
    assert [(g.claimed, g.released) for g in side.client.grants("acct") if g.permits == 3] == [(3, 3)]
    for _ in range(25):
        await clock.advance(1_000)
    assert (3, 2) not in await _charged(holder)  # released once nothing runs under it
    side.driver.kill()


@async_test
async def test_r15a_i4_a_completion_releases_no_slot_that_an_item_still_running_needs():
    # R15a, I4 with claimTtlMs (_completion_after_crash_expiry). (The release reported the
    # grant free while "b" ran.)
    await _completion_after_crash_expiry(ttl_turned_off=False)


@async_test
async def test_r15a_i4_a_batch_of_completions_releases_the_one_slot_still_charged_once():
    # R15a, I4: as above, "a" and "b" completed in one complete_many(): nothing runs under the
    # grant after the batch, so its one charged slot is released (a batch counts what its own
    # items leave held, not each item alone)
    await _completion_after_crash_expiry(batch=True)


@async_test
async def test_r15a_i4_the_completion_check_holds_when_the_holder_turned_its_ttl_off_meanwhile():
    # R15a, I4: as above, but the holder is redeployed without claim_ttl_ms while the client is
    # cut off, so the reply that shows the expired slots carries no claimTtlMs. The client knows
    # from the grant itself that the holder released slots on its own (more released than it
    # ever released: ClientGrant.holder_released). (Checking only where the last reply told a
    # claimTtlMs released "a"'s slot while "b" ran.)
    await _completion_after_crash_expiry(ttl_turned_off=True)


def test_r15a_completions_release_only_the_slots_no_running_item_or_confirmed_claim_holds():
    # R15a: in normal operation one slot per completed item; fewer once the holder released
    # slots on its own; none of a dropped grant
    g = grant(permits=3, claimed=3, released=2, confirmed=3)
    assert plan.completion_releases(g, held_after=0) == 1
    assert plan.completion_releases(g, held_after=1) == 0
    assert plan.completion_releases(grant(permits=3, claimed=3, confirmed=3), held_after=1) == 2
    assert plan.completion_releases(replace(g, status="gone"), held_after=0) == 0
    # held: running items, and claiming items whose slot the holder confirmed
    claims = (claiming("c", 3), claiming("d", 4), claiming("e", 1, gid="g2"))
    assert plan.held_slots({"g1": 2}, claims, {"g1": g, "g2": None}) == {"g1": 3}


def running_item(item_id: str, *, gid: str = "g1", kind: str = "grant", owner: str = "", key: str = "k",
                 state: str = "running") -> client_step.CompletingItem:
    return client_step.CompletingItem(item_id, key, state, owner, kind, gid)


def _released(steps: tuple[client_step.Completing, ...]) -> dict[str, bool]:
    return {c.item.item_id: c.release for c in steps}


def test_r37_completions_finish_cancel_and_release_each_item_by_its_state():
    # R37: unknown and finished items do nothing; a claiming item's claim is cancelled; a queued
    # item is finished with nothing released; a running item releases a slot of its permit
    # (recorded in its row if it is a callback item, R35; a permit() item's is written)
    g = grant(permits=3, claimed=2, confirmed=2)
    items = (running_item("a"), running_item("b", owner="inst"), running_item("c", kind="lease", gid="L"),
             running_item("q", kind="", gid="", state="queued"), running_item("x", state="claiming"),
             running_item("d", state="done"))
    steps = client_step.completions(client_step.CompletionLoad(items, {("k", "g1"): g}))
    assert [(c.item.item_id, c.action, c.release, c.record) for c in steps] == [
        ("a", plan.Completion.RECORD, True, True), ("b", plan.Completion.RELEASE, True, False),
        ("c", plan.Completion.RECORD, True, True), ("q", plan.Completion.FINISH, False, False),
        ("x", plan.Completion.CANCEL, False, False)]
    writes = client_step.completion_writes(steps, {"a": 1, "c": 4})
    assert writes.cancels == {"k": ["x"]}
    assert writes.finishes == [("k", ["a"], 1, False), ("k", ["b", "q"], 0, True), ("k", ["c"], 4, False)]


def test_r15a_completions_release_no_slot_of_a_grant_forgotten_dropped_or_released_in_full():
    # R15a: a slot is released only where the client has one confirmed and unreleased
    items = (running_item("a", gid="gone"), running_item("b", gid="lost"), running_item("c", gid="full"))
    grants = {("k", "gone"): replace(grant("gone", permits=1, claimed=1, confirmed=1), status="gone"),
              ("k", "lost"): None, ("k", "full"): grant("full", permits=1, claimed=1, released=1, confirmed=1)}
    assert _released(client_step.completions(client_step.CompletionLoad(items, grants))) == {
        "a": False, "b": False, "c": False}


def test_r15a_a_batch_of_completions_releases_only_the_slots_the_holder_still_charges():
    # R15a, I4: the holder released two of a grant's four slots on its own (holder_released):
    # three items run under it and one confirmed claim holds a slot, four holders of the two
    # slots still charged. Completing "a" and "b" in one batch leaves "c" and the claim holding
    # both: no release. Completing all three leaves the claim holding one: one release (the
    # first item's). Without the claim, two.
    g = replace(grant(permits=4, claimed=4, released=2, confirmed=4), holder_released=True)
    items = tuple(running_item(i) for i in "abc")
    load = client_step.CompletionLoad(items[:2], {("k", "g1"): g}, {"k": {"g1": 3}}, {"k": (claiming("d", 4),)})
    assert _released(client_step.completions(load)) == {"a": False, "b": False}
    load = replace(load, items=items)
    assert _released(client_step.completions(load)) == {"a": True, "b": False, "c": False}
    load = replace(load, claiming={"k": ()})
    assert _released(client_step.completions(load)) == {"a": True, "b": True, "c": False}
    # a claiming item in the batch (only cancelled) frees no slot: "a" and "c" completed, "b"
    # still runs under the one slot still charged (two confirmed, one released by the holder;
    # "c"'s slot not confirmed), so "a" releases nothing
    one_left = replace(grant(permits=3, claimed=3, released=1, confirmed=2), holder_released=True)
    load = client_step.CompletionLoad((running_item("a"), running_item("c", state="claiming")),
                                      {("k", "g1"): one_left}, {"k": {"g1": 2}}, {"k": (claiming("c", 3),)})
    assert _released(client_step.completions(load)) == {"a": False, "c": False}
    # the same grant, never released by its holder: one slot per completed item, nothing counted
    plain = replace(g, released=0, holder_released=False)
    assert not client_step.checks_completions(plain) and client_step.checks_completions(g)
    load = client_step.CompletionLoad(items, {("k", "g1"): plain})
    assert _released(client_step.completions(load)) == {"a": True, "b": True, "c": True}


def test_r15a_a_grant_learns_from_a_reply_that_its_holder_released_slots_on_its_own():
    # R15a: a reply showing more released than the client ever released marks the grant (and
    # the mark stays); one showing what the client reported does not
    local = grant(permits=3, claimed=3, released=1, confirmed=3)
    shown = GrantState("g1", "g", permits=3, claimed=3, released=1, claim_by=NOW + 10_000, status=GrantStatus.ACTIVE)
    assert merge_grant("k", local, shown).row.holder_released is False  # type: ignore[union-attr]
    expired = merge_grant("k", local, replace(shown, released=2)).row
    assert expired is not None and expired.holder_released and expired.released == 2
    assert merge_grant("k", expired, shown).row.holder_released  # type: ignore[union-attr]
    # adopted (R8): the client released nothing of a grant it did not know, so what the holder
    # shows released it released on its own (the client's grant rows lost while items ran on)
    adopted = merge_grant("k", None, replace(shown, released=1)).row
    assert adopted is not None and adopted.holder_released
    assert not merge_grant("k", None, replace(shown, claimed=0, released=0)).row.holder_released  # type: ignore[union-attr]


def test_r37_a_callback_pass_calls_moves_requeues_and_asks_in_one_change():
    # R37: of the due callback items, those called have their attempt written with a retry
    # admit_retry_ms on; a call in flight here moves orphan_check_ms on; an item whose permit
    # is not live (a tombstone, or unknown) goes back to the queue and the key wakes now; a
    # retry waiting for the holder asks it
    permits = client_step.Permits.of([grant(), replace(grant("dead"), status="gone")], [lease()])
    rows = [_item_row("call"), _item_row("fly"), _item_row("dead", permit_id="dead"),
            _item_row("unknown", permit_kind="lease", permit_id="nowhere"),
            _item_row("retry", attempts=1, checked_at=NOW - 1), _item_row("later", retry_at=NOW + 1)]
    changes = client_step.callbacks(rows, permits, now=NOW, in_flight={"fly"}, admit_retry_ms=3_000,
                                    orphan_check_ms=60_000)
    assert (changes.calls, changes.calls_retry_at, changes.flying, changes.flying_retry_at) == (
        ("call",), NOW + 3_000, ("fly",), NOW + 60_000)
    assert changes.gone == ("dead", "unknown") and changes.wake_now and changes.ask_holder
    quiet = client_step.callbacks(rows[:1], permits, now=NOW, in_flight=(), admit_retry_ms=3_000,
                                  orphan_check_ms=60_000)
    assert quiet.gone == () and not quiet.wake_now and not quiet.ask_holder


def test_r37_an_expired_grant_and_a_retired_lease_are_still_an_admitted_items_permit():
    # R37: only a grant gone (or unknown) and a lease settled (or unknown) are gone; an item
    # under a grant past its claimBy (expired) or a lease the holder retired is called, and
    # handed over, under it (queuing it again would admit it twice)
    permits = client_step.Permits.of([grant(status="expired")], [lease(status="retired")])
    rows = [_item_row("g"), _item_row("l", permit_kind="lease", permit_id="l1")]
    changes = client_step.callbacks(rows, permits, now=NOW, in_flight=(), admit_retry_ms=1, orphan_check_ms=1)
    assert (changes.calls, changes.gone) == (("g", "l"), ())
    mine = [{**r, "owner": "me"} for r in rows]
    assert client_step.handing_over(mine, permits, waiting={"g", "l"}).admitted == ("g", "l")


def test_r37_permit_items_go_to_their_waiting_callers_or_back_to_the_queue_in_one_change():
    # R37 (permit items): an item whose caller waits is handed over, unless its permit is not
    # live (back to the queue, the key woken now); one whose caller went is left alone
    permits = client_step.Permits.of([grant()], [])
    rows = [_item_row("waits", owner="me"), _item_row("gone", owner="me", permit_id="g9"),
            _item_row("withdrawn", owner="me")]
    changes = client_step.handing_over(rows, permits, waiting={"waits", "gone"})
    assert (changes.admitted, changes.gone, changes.wake_now) == (("waits",), ("gone",), True)


def test_r37_orphans_are_completed_and_the_callers_of_the_others_checked_in_one_step():
    # R37 (permit items): another instance's items, and this one's with no caller, are completed
    # (a withdrawn one is not: its claim is released once the holder answers); this instance's
    # items whose caller lives are checked every orphan_check_ms; an item completed here is not
    # also marked checked
    rows = [_item_row("theirs", owner="dead", cancel=0), _item_row("withdrawn", owner="dead", cancel=1),
            _item_row("mine", owner="me", cancel=0, checked_at=NOW - 60_000),
            _item_row("fresh", owner="me", cancel=0, checked_at=NOW - 1),
            _item_row("lost", owner="me", cancel=0, checked_at=0)]
    found = client_step.orphans(rows, owner="me", callers={"mine", "fresh"}, now=NOW, orphan_check_ms=60_000)
    assert found == client_step.Orphans(complete=("theirs", "lost"), checked=("mine",))


def test_a_step_that_changed_nothing_is_empty_and_any_change_is_not():
    # the shell skips the transaction of an empty step: every field a step may set must make
    # it non-empty (a field the property forgot would be silently dropped), a retry time alone
    # (with no items) must not
    assert KeyChanges().empty and KeyChanges(calls_retry_at=5, flying_retry_at=7).empty
    samples = {bool: True, int: 1}
    for f in dataclasses.fields(KeyChanges):
        if f.name in ("calls_retry_at", "flying_retry_at"):
            continue
        value = samples.get(type(getattr(KeyChanges(), f.name)), ("x",))
        if f.name in ("grants", "leases"):
            value = {"x": {"claimed": 1}}
        elif f.name in ("claims",):
            value = (plan.Claim("g1", (1,), ("x",)),)
        elif f.name in ("draws",):
            value = (plan.Draw("L", 1, ("x",)),)
        elif f.name in ("purge_done_before", "purge_due_before", "blocked"):
            value = 1 if f.name != "blocked" else ()
        assert not replace(KeyChanges(), **{f.name: value}).empty, f.name
    assert client_step.Orphans((), ()).empty and not client_step.Orphans(("a",), ()).empty
    assert not client_step.Orphans((), ("a",)).empty


@async_test
async def test_r37_a_pass_over_admitted_items_with_nothing_to_write_opens_no_transaction():
    # R37 (cost): the callback pass, the hand-overs and the orphan check run at every pump; with
    # nothing due they open no storage transaction (each is a call into the runtime). (Their
    # first version as steps opened one each, every pump.)
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=5)
    calls: list[str] = []
    side = ClientSide("c1", clock, Net(holder, clock), on_admit=lambda side, item: calls.append(item.item_id))
    await side.queue.enqueue("acct", "g", "a")
    for _ in range(10):
        await clock.advance(100)
    assert calls == ["a"]
    storage = side.storage
    original = storage.transactionSync
    opened: list[int] = []

    def counted(fn: Any) -> Any:
        opened.append(1)
        return original(fn)

    storage.transactionSync = counted
    q, now = side.queue, clock.now
    assert q._calls_due("acct", now) == []
    q._hand_over("acct")
    q._release_orphans("acct", now)
    assert opened == []
    storage.transactionSync = original
    side.driver.kill()


def test_r37_a_returned_callback_admits_only_items_still_running():
    # R37: a callback that returned admits its item, unless it finished meanwhile (completed
    # during its own callback) or is no longer kept
    rows = [_item_row("runs"), _item_row("done", state="done"), None]
    assert client_step.callbacks_returned(rows) == KeyChanges(admitted=("runs",))


def _item_row(item_id: str, **values: object) -> dict[str, object]:
    return {"item_id": item_id, "state": "running", "permit_kind": "grant", "permit_id": "g1", "retry_at": NOW,
            "attempts": 0, "checked_at": 0, "owner": "", **values}


def test_r37_a_give_back_and_the_idle_slots_of_one_grant_make_one_change_of_each_count():
    # R37 (surplus grants): a grant whose group has nothing queued, claiming or running gives
    # back its unclaimed permits (claimed now) and releases its confirmed slots no item holds,
    # in one step: the row gets both counts
    g = grant(permits=3, claimed=1, confirmed=1)
    out = client_step.admission(KeySnapshot(NOW, grants=(g,)), OPTS)
    assert out.grants == {"g1": {"claimed": 3, "released": 1}} and out.ask_holder
    assert out.delete_done_permits  # an admission tidies finished permit items; a reply does not
    assert not client_step.after_reply(KeySnapshot(NOW), OPTS, contended=False, more=False).delete_done_permits


def test_r7_a_reply_that_could_not_carry_every_report_keeps_the_pending_mark():
    # R7, R37: over 1,000 reports, the rest stays due since the same time
    out = client_step.after_reply(KeySnapshot(NOW), OPTS, contended=False, more=True)
    assert out == KeyChanges()


def test_r29_a_contended_reply_stops_only_leases_not_stopped_yet():
    # R29: a contended reply stops the leases of groups with nothing queued; one stopped already
    # is not written again
    snap = KeySnapshot(NOW, leases=(lease("l1"), lease("l2", stopped=True)))
    out = client_step.after_reply(snap, OPTS, contended=True, more=False)
    assert out.leases == {"l1": {"stopped": 1}}


def _tree(fn: object) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(fn)))  # type: ignore[arg-type]


def _calls(fn: object) -> set[str]:
    out = set()
    for node in ast.walk(_tree(fn)):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return out


def test_the_shell_loads_steps_and_persists_without_deciding():
    # R37 (architecture): a local admission and a reply are load → step → persist: the shell
    # calls no planner and no step but the one it persists, computes no count (no arithmetic,
    # no min or max) and compares none
    shell = (_QueuePump._persist, _QueuePump._admit_locally, _QueuePump._apply_reply)
    for fn in shell:
        calls = _calls(fn)
        assert not calls & {"plan_admission", "plan_reply", "resolve_claims", "leases_to_stop", "claim", "release",
                            "draw_many", "stop_lease", "min", "max", "len"}, (fn, calls)
        nodes = list(ast.walk(_tree(fn)))
        assert not [n for n in nodes if isinstance(n, ast.BinOp)], fn
        assert not [n for n in nodes if isinstance(n, ast.Compare) and not all(
            isinstance(op, (ast.Is, ast.IsNot)) for op in n.ops)], fn  # only "is None" checks
    assert _calls(_QueuePump._admit_locally) == {"_persist", "admission", "_snapshot", "_options"}
    # a batch of completions: load → step → the permits' releases (each the store's, R35) → write
    calls = _calls(_QueuePump._complete_keys)
    assert not calls & {"completion", "completion_releases", "held_slots", "min", "max", "len", "release",
                        "release_lease"}, calls
    body = _tree(_QueuePump._complete_keys).body[0].body  # type: ignore[attr-defined]
    nodes = [n for statement in body for n in ast.walk(statement)]  # not the annotations' "str | None"
    assert not [n for n in nodes if isinstance(n, (ast.BinOp, ast.IfExp)) and not (
        isinstance(n, ast.IfExp) and isinstance(n.test, ast.Compare) and isinstance(n.test.ops[0], ast.Is))]
    assert not [n for n in nodes if isinstance(n, ast.Compare) and not all(
        isinstance(op, (ast.Is, ast.IsNot)) for op in n.ops)]
    assert {"completions", "completion_writes", "_completion_load", "_found"} <= calls
    # a callback pass and the hand-overs: load → step → persist, then the effects
    for fn, step in ((_QueuePump._calls_due, "callbacks"), (_QueuePump._hand_over, "handing_over"),
                     (_QueuePump._release_orphans, "orphans"), (_QueuePump._admitted, "callbacks_returned")):
        calls = _calls(fn)
        assert step in calls and "_persist" in calls, (fn, calls)
        assert not calls & {"calls_due", "hand_overs", "permit_gone", "retry_waits_for_holder", "orphan_checks",
                            "_requeue", "_complete", "update", "min", "max", "len"}, (fn, calls)
        body = _tree(fn).body[0].body  # type: ignore[attr-defined]
        nodes = [n for statement in body for n in ast.walk(statement)]
        assert not [n for n in nodes if isinstance(n, ast.BinOp)], fn
        assert not [n for n in nodes if isinstance(n, ast.Compare) and not all(
            isinstance(op, (ast.Is, ast.IsNot)) for op in n.ops)], fn
    # (the reply's blocked entries and the unstarted items' ids are read into tuples: the
    # event's facts, not a decision)
    assert _calls(_QueuePump._apply_reply) == {"_persist", "after_reply", "_snapshot", "_options", "tuple", "str",
                                               "_live"}


def test_a_step_asserts_on_a_row_it_did_not_load_and_on_a_count_the_plan_never_gives():
    # (architecture) the step decides only over the rows its snapshot loaded: naming another one
    # is a bug of the step, not an absent row; and it writes no count the client's own changes
    # would refuse (R15a, R34: the planner keeps within them, the step checks it)
    rows = _Rows(KeySnapshot(NOW, grants=(grant(permits=2, claimed=1, confirmed=1),),
                             leases=(lease(permits=2, drawn=1), lease("l2", stopped=True))))
    rows.claim("g1", 1)
    rows.draw("l1", 1, NOW, 0)
    assert rows.grant_counts == {"g1": {"claimed": 2}} and rows.lease_counts == {"l1": {"drawn": 2}}
    for call, words in ((lambda: rows.claim("g9", 1), "was not loaded"),
                        (lambda: rows.release("g9", 1), "was not loaded"),
                        (lambda: rows.draw("l9", 1, NOW, 0), "was not loaded"),
                        (lambda: rows.stop("l9"), "was not loaded"),
                        (lambda: rows.claim("g1", 1), "0 unclaimed"),
                        (lambda: rows.release("g1", 2), "1 releasable"),
                        (lambda: rows.draw("l1", 1, NOW, 0), "0 undrawn"),
                        (lambda: rows.stop("l2"), "not active")):
        with pytest.raises(AssertionError, match=words):
            call()
