"""One step of a queue's key, driven directly (``semaphore.core.client_step``): the rows' new
values that a local admission or a holder reply writes, decided over a plain snapshot with no
storage, and the queue's shell that persists them without deciding (SPEC R15a, R29, R30, R34,
R37)."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
from tests.test_queue_plan import NOW, OPTS, grant, lease, queued

from semaphore.client._queue_pump import _QueuePump
from semaphore.core import client_step
from semaphore.core.client_step import KeyChanges, _Rows
from semaphore.core.queue_plan import ClaimingItem, KeySnapshot, QueueOptions


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
    snap = KeySnapshot(NOW, unstarted=("a", "b"))
    words = (("g", "limit", 3),)
    assert client_step.after_reply(snap, OPTS, contended=True, more=False, blocked=words) == \
        KeyChanges(clear_pending=True, checked=("a", "b"), blocked=words)
    assert client_step.after_reply(snap, OPTS, contended=False, more=False).blocked is None


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


def test_the_step_is_pure_and_the_same_snapshot_gives_the_same_changes():
    g = grant(permits=2)
    snap = KeySnapshot(NOW, queued("a", "b", "c"), grants=(g,))
    first = client_step.admission(snap, QueueOptions())
    assert first == client_step.admission(snap, QueueOptions())
    assert snap.grants == (g,)  # the snapshot is not changed


def _calls(fn: object) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))  # type: ignore[arg-type]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            out.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return out


def test_the_shell_loads_steps_and_persists_without_deciding():
    # R37 (architecture): a local admission and a reply are load → step → persist: the shell's
    # persist calls no planner and no step, and the admission and reply call nothing but the
    # load, the step and the persist
    persist = _calls(_QueuePump._persist)
    assert not persist & {"plan_admission", "plan_reply", "admission", "after_reply", "resolve_claims",
                          "leases_to_stop", "claim", "release", "draw_many", "stop_lease"}, persist
    assert _calls(_QueuePump._admit_locally) == {"_persist", "admission", "_snapshot", "_options"}
    # (the reply's blocked entries are turned into plain tuples: the event, not a decision)
    assert _calls(_QueuePump._apply_reply) == {"_persist", "after_reply", "_snapshot", "_options", "tuple"}


def test_a_step_asserts_on_a_row_it_did_not_load_and_on_a_count_the_plan_never_gives():
    # (architecture) the step decides only over the rows its snapshot loaded: naming another one
    # is a bug of the step, not an absent row; and it writes no count the client's own changes
    # would refuse (R15a, R34: the planner keeps within them, the step checks it)
    rows = _Rows(KeySnapshot(NOW, grants=(grant(permits=2, claimed=1, confirmed=1),),
                             leases=(lease(permits=2, drawn=1), lease("l2", stopped=True))))
    rows.claim("g1", 1)
    rows.draw("l1", 1, NOW, 0)
    assert rows.grants == {"g1": {"claimed": 2}} and rows.leases == {"l1": {"drawn": 2}}
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
