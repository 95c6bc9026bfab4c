"""Waiting requests at the holder (issue 13; SPEC R9 decision): ``hold_blocked_ms`` on the
holder, ``waitMs`` on the request (``SemaphoreQueue(request_wait_ms=...)``). A request its round
cannot serve is held open instead of answered ``blocked``, every later round takes it again,
and a report that frees capacity starts the next round as soon as ``round_period_ms`` allows.
Real holder on the SQLite test bed, real queue and client objects on a virtual clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from semaphore.core.batching import ROUND_PERIOD_MS
from semaphore.errors import ConfigurationError, PermitTimeoutError
from semaphore.testing import SEED_TIMING, T0, Bed, ClientSide, HolderSide, Net, SimClock, async_test, request, sync

pytestmark = pytest.mark.usefixtures("quiet_logs")

HOLD = 10_000


def held_request(client: str, demand: dict[str, int], wait_ms: int = HOLD, **kw) -> dict:
    message = request(client, demand, **kw)
    message["waitMs"] = wait_ms
    return message


@async_test
async def test_r9_a_blocked_request_is_held_until_a_release_frees_capacity_then_served_at_once():
    # R9 decision: b's request is not answered blocked; a's release (a sync) starts the next
    # round at once (the period since the last round has passed), and that round serves b.
    bed = Bed(limit=1, hold_blocked_ms=HOLD)
    [ra] = await bed.round(request("a", {"g": 1}))
    (ga,) = ra["grants"]
    await bed.one(sync("a", grants=[(ga["grantId"], 1, 0)]))  # a claims (R15a)
    b = bed.send(held_request("b", {"g": 1}))
    await bed.clock.advance(5000)  # b's round (and later ones) found nothing free
    assert not b.done()
    await bed.one(sync("a", grants=[(ga["grantId"], 1, 1)]))  # a releases
    t = bed.now
    await bed.clock.advance(0)
    await bed.clock.advance(1)
    assert b.done() and bed.now <= t + 1
    (gb,) = [g for g in b.result()["grants"] if g["permits"] == 1]
    assert gb["group"] == "g" and not b.result()["blocked"]
    bed.check()


@async_test
async def test_r9_the_round_a_release_starts_keeps_round_period_ms_from_the_previous_one():
    # batched rounds (R9): rounds run at once (R9a) do not space the batched ones
    bed = Bed(limit=1, hold_blocked_ms=HOLD, round_wait_ms=100, round_period_ms=3000, free_at_once=False)
    [ra] = await bed.round(request("a", {"g": 1}))
    (ga,) = ra["grants"]
    first_round = bed.now
    await bed.one(sync("a", grants=[(ga["grantId"], 1, 0)]))
    b = bed.send(held_request("b", {"g": 1}))
    await bed.clock.advance(1)
    await bed.one(sync("a", grants=[(ga["grantId"], 1, 1)]))  # frees at once...
    await bed.clock.advance(first_round + 3000 - bed.now - 1)
    assert not b.done()  # ... but the next round waits for the period
    await bed.clock.advance(1)
    assert b.done() and [g["permits"] for g in b.result()["grants"]] == [1]


@async_test
async def test_r9_a_held_request_is_answered_blocked_at_its_deadline():
    # The smaller of hold_blocked_ms and waitMs bounds the hold; the answer then is blocked.
    bed = Bed(limit=0, hold_blocked_ms=HOLD)
    b = bed.send(held_request("b", {"g": 2}, wait_ms=4000))
    start = bed.now
    await bed.clock.advance(3999)
    assert not b.done()
    await bed.clock.advance(1 + ROUND_PERIOD_MS)
    assert b.done()
    reply = b.result()
    assert reply["grants"] == [] and reply["blocked"] == [{"group": "g", "reason": "limit", "waiting": 2}]
    assert bed.now - start <= 4000 + ROUND_PERIOD_MS  # its deadline, then the next round the period allows


@async_test
async def test_r9_without_wait_ms_or_without_the_option_nothing_is_held():
    # An older client (no waitMs) and a holder without hold_blocked_ms answer each round (R9).
    for holder_option, message in ((HOLD, request("b", {"g": 1})), (0, held_request("b", {"g": 1}))):
        bed = Bed(limit=0, hold_blocked_ms=holder_option)
        b = bed.send(message)
        await bed.clock.advance(1000)
        assert b.done() and b.result()["blocked"]


@async_test
async def test_r10_a_held_clients_new_request_joins_it_and_both_calls_get_the_answer():
    bed = Bed(limit=0, hold_blocked_ms=HOLD)
    first = bed.send(held_request("b", {"g": 1}))
    await bed.clock.advance(3000)
    assert not first.done()
    second = bed.send(request("b", {"g": 2}))  # no waitMs: answered by its round
    await bed.clock.advance(2000)
    assert first.done() and second.done() and first.result() == second.result()
    assert first.result()["blocked"] == [{"group": "g", "reason": "limit", "waiting": 2}]


@async_test
async def test_r4_an_eviction_fails_held_requests_so_their_clients_ask_again():
    bed = Bed(limit=0, hold_blocked_ms=HOLD)
    b = bed.send(held_request("b", {"g": 1}))
    await bed.clock.advance(3000)
    assert not b.done()
    bed.evict()
    await bed.clock.advance(1)
    assert b.done() and b.result()["error"]["code"] == "round_failed"


@async_test
async def test_r7_wait_ms_is_validated_and_the_option_too():
    bed = Bed(limit=1, hold_blocked_ms=HOLD)
    reply = await bed.one(held_request("b", {"g": 1}, wait_ms=-1))
    assert reply["error"]["code"] == "invalid_message" and reply["error"]["field"] == "waitMs"
    with pytest.raises(ConfigurationError) as info:
        Bed(limit=1, hold_blocked_ms=-5)
    assert info.value.field == "hold_blocked_ms"


@async_test
async def test_a_queue_with_request_wait_ms_asks_once_and_is_served_when_capacity_frees():
    # End to end: the queue's request is held; releases by another client object free the
    # permit; the held request is served without the queue asking again each round.
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=1, hold_blocked_ms=HOLD)
    net = Net(holder, clock)
    admitted: list[tuple[str, str]] = []
    sides = [ClientSide(name, clock, net, on_admit=lambda s, i: admitted.append((s.name, i.item_id)),
                        request_wait_ms=HOLD, report_releases_within_ms=0) for name in ("c1", "c2")]
    await sides[0].queue.enqueue("acct", "g", "a")
    await clock.advance(1500)
    assert admitted == [("c1", "a")]
    await sides[1].queue.enqueue("acct", "g", "b")
    await clock.advance(8000)  # four rounds' worth of periods: b is held, not re-asked
    requests_of_c2 = [m for m in net.sent if m["type"] == "request" and m["clientId"] == "c2"]
    assert len(requests_of_c2) == 1 and requests_of_c2[0]["waitMs"] == HOLD
    freed_at = clock.now
    await sides[0].queue.complete("a")
    await clock.advance(1500)
    assert admitted == [("c1", "a"), ("c2", "b")]
    started = [m for m in net.sent if m["clientId"] == "c2"]
    assert len([m for m in started if m["type"] == "request"]) == 1  # still one request
    assert clock.now - freed_at <= 1500
    for side in sides:
        side.driver.kill()


@async_test
async def test_r9_a_client_asking_again_before_its_wait_ms_still_gets_an_answer_by_the_first_deadline():
    # A transport that gives up before waitMs (or a client that re-sends) joins the held request
    # (R10); the deadline counts from the first call, so re-sending every 3 s never postpones the
    # answer forever (it did: each new call restarted the hold).
    bed = Bed(limit=0, hold_blocked_ms=HOLD)
    start = bed.now
    calls = [bed.send(held_request("b", {"g": 1}))]
    answered_at = None
    for _ in range(8):
        await bed.clock.advance(3000)
        if answered_at is None and calls[0].done():
            answered_at = bed.now
        calls.append(bed.send(held_request("b", {"g": 1})))
    assert answered_at is not None and answered_at - start <= HOLD + ROUND_PERIOD_MS + 3000
    assert calls[0].result()["blocked"] == [{"group": "g", "reason": "limit", "waiting": 1}]
    assert all(c.done() for c in calls[:4])  # the calls that joined it got the same answer


# --- Held requests: joins during a round, news not held, what starts a round -------------------
# Cold review of issue 13's waiting requests (holder ``hold_blocked_ms``, request ``waitMs``,
# queue ``request_wait_ms``; SPEC R9 decision).
#
# Each test failed on the reviewed code because of the defect its docstring describes; all are
# fixed: a request arriving while a round that holds its client runs joins the held call (it was
# dropped, never answered); a reply with a retired lease or an expired grant is not held; only a
# sync that lowered the charged capacity starts a round; new demand of a held key goes in a
# background request (it joins the held one, R10); releases behind a possibly held request go at
# once. Real holder and client objects on a virtual clock (``semaphore.testing``), nothing
# mocked.


KEY = "acct"
LEASES = {"provisioning": {"mode": "strict"}, "permitsPerLease": 4, "ttlMs": 600_000}

pytestmark = pytest.mark.usefixtures("quiet_logs")


# ------------------------------------------------------------------------------------------ 1
@async_test
async def test_a_request_arriving_while_its_clients_request_is_in_a_running_round_orphans_the_held_call():
    """Defect (hang, "never leave a caller hanging", R10): a round takes its batch out of
    ``_pending``/``_held`` before it awaits (the limit callbacks in ``_resolve``, the
    ``scheduler.arm()`` after the commit). A request of a client whose request is in that
    running round finds neither (``_pending`` and ``_held`` are empty for it) and gets a new
    ``_Waiting`` in ``_pending``. The running round then *holds* the old one
    (``self._held[client] = p``): the client is now in ``_held`` and in ``_pending`` at once,
    and the next round's ``_take_batch`` (``{**self._held, **self._pending}``) keeps only the
    new one. The old ``_Waiting`` is referenced nowhere: its call is never answered, not at its
    deadline, not at an eviction (``_hold_ended`` / ``_round_after`` only fail what is in the
    dicts). Before the change the old call was simply answered by its own round.

    Here the limit is read by an async callable (100 ms, e.g. another object's RPC); ``b``'s
    first request is in the round when its second arrives (a client that retried after a
    transport timeout, or a direct ``SemaphoreClient.request``).

    Fix: when a round holds ``p`` and ``p.client_id`` already has a newer ``_Waiting`` in
    ``_pending``, merge ``p`` into it (its futures first, its arrival, ``messages`` appended
    behind) instead of putting it in ``_held``; or make ``_take_batch`` merge a client present
    in both dicts."""
    clock = SimClock(T0)

    async def limit() -> int:
        await clock.sleep(100)  # the round awaits the limit for 100 ms
        return 0

    bed = Bed(limit=limit, clock=clock, hold_blocked_ms=HOLD)
    first = bed.send(held_request("b", {"g": 1}))
    await clock.advance(1050)  # b's round began at +1000 and still resolves its limit
    second = bed.send(held_request("b", {"g": 2}))
    await clock.advance(40_000)  # far past every deadline
    assert second.done() and second.result()["blocked"]
    assert first.done(), "b's first call was never answered (held and dropped by the next round)"


# ------------------------------------------------------------------------------------------ 2
@async_test
async def test_a_held_request_whose_round_retires_its_lease_is_not_told_so():
    """Defect (R33 "a retired lease stops drawing at once on the client", R24): ``_hold`` holds a
    request whenever its round created no grant or lease for the client and left it blocked,
    whatever else the reply says. When that round retires one of the client's live leases (the
    limit was lowered, ``can_grant`` turned false, the group gained a limit), the reply saying
    ``retired`` is withheld for up to ``hold_blocked_ms``: the client keeps drawing new items
    from the retired lease locally (R34 needs no round trip) for that long, although the
    operator just lowered the limit to stop new work. Before the change the round's reply told
    it at once.

    Here ``b`` holds a live lease in group ``a`` and waits for group ``c`` (group limit 0); the
    limit is lowered; the next round retires ``b``'s lease, yet ``b``'s request stays open.

    Fix: in ``_hold``, answer (do not hold) when the reply changes something the client acts on:
    a lease whose status is not ``live`` (retired/settled) or a grant whose status is not
    ``active`` (expired/not_found), e.g. compare with what the request reported."""
    value = {"limit": 8}
    bed = Bed(limit=lambda: value["limit"], leases=LEASES, group_limit={"c": 0}, hold_blocked_ms=HOLD)
    [first] = await bed.round(request("b", {"a": 4}, leases=[]))
    (lease,) = [x for x in first["leases"] if x["status"] == "live"]
    known = [(g["grantId"], 0, 0) for g in first["grants"]]  # b reports all it holds (R9: else answered at once)
    b = bed.send(held_request("b", {"c": 1}, grants=known, leases=[(lease["leaseId"], 1, 0)]))
    await bed.clock.advance(3000)  # b's round: blocked (group_limit), held
    assert not b.done()
    value["limit"] = 2  # lowered: the next round retires every live lease (R33)
    await bed.round(request("x", {"a": 1}))
    assert bed.leases()[lease["leaseId"]]["status"] == "retired"  # that round retired b's lease
    await bed.clock.advance(1)
    assert b.done(), "b's lease was retired by that round, but b's held request was not answered"
    (reported,) = [x for x in b.result()["leases"] if x["leaseId"] == lease["leaseId"]]
    assert reported["status"] == "retired"


# ------------------------------------------------------------------------------------------ 3
@async_test
async def test_a_heartbeat_sync_that_frees_nothing_starts_a_round_for_the_held_requests():
    """Defect (cost, "rounds triggered too often"): ``_sync`` starts a round for the held
    requests when any report carries ``released > 0`` or a lease ``stopped``: but reports are
    cumulative high-water marks, so every heartbeat of a partly released grant (the
    ``claim_ttl_ms`` heartbeat at half the TTL) or of a lease that ever released a permit, and
    every repeated report, "carries a release" although it frees nothing. Each such sync starts
    a round (spaced only by ``round_period_ms``; with ``round_period_ms=0`` one per sync) that
    re-reads, re-resolves (``can_grant`` per pair) and re-answers nothing for every held
    client: the busy holder runs a round per heartbeat.

    Fix: start the round only when the sync's transaction actually freed capacity, e.g. compare
    the meta ``outstanding + lease_footprint`` before and after ``run_sync`` (or have
    ``run_sync`` return the permits it freed)."""
    rounds: list[Any] = []
    bed = Bed(limit=4, group_limit={"h": 0}, hold_blocked_ms=HOLD, on_round=rounds.append)
    [ra] = await bed.round(request("a", {"g": 2}))
    (ga,) = ra["grants"]
    await bed.one(sync("a", grants=[(ga["grantId"], 2, 1)]))  # claims 2, releases 1: holds 1
    b = bed.send(held_request("b", {"h": 1}))
    await bed.clock.advance(3000)  # b's round: blocked (group_limit), held until +10 s
    assert not b.done()
    before = len(rounds)
    for _ in range(3):  # the same cumulative report again (a heartbeat): frees nothing
        await bed.clock.advance(2100)
        await bed.one(sync("a", grants=[(ga["grantId"], 2, 1)]))
        await bed.clock.advance(10)
    assert not b.done()
    assert len(rounds) == before, f"{len(rounds) - before} rounds started by syncs that freed nothing"


# ------------------------------------------------------------------------------------------ 4
@async_test
async def test_a_permit_of_another_group_times_out_behind_a_held_request_though_capacity_is_free():
    """Defect (liveness/latency, R37 permits, R10 unused): while a key's request is held
    (``request_wait_ms``), the pump holds the key's lock, and new demand of the key can only go
    in the next request, after that answer. A request blocked in one group (here a group limit
    of 0: it may stay blocked for good, likewise ``not_permitted``) thus delays every new item
    of every other group of that key by up to ``request_wait_ms`` (+ a round period), even
    though the holder has free capacity for them; a ``permit(timeout_ms=3000)`` of a free
    group raises :class:`PermitTimeoutError`. Without held requests it is admitted by the next
    round (about 2 s). The queue docstring mentions "new demand waits", but not that it waits
    with capacity free, and the holder's design already offers the cure (R10: a held client's
    new request joins it).

    Fix: when new demand arrives for a key whose request is held (``key in _requesting``), send
    the key's updated request in the background (it joins the held one at the holder, R10: both
    calls get the next round's answer; the pump applies it), or do not hold a request whose
    client has demand the round could not see; at least document it in SPEC R9/R37."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=10, group_limit={"b": 0}, hold_blocked_ms=HOLD)
    net = Net(holder, clock)
    side = ClientSide("c1", clock, net, on_admit=lambda s, i: None, recheck_ms=0, request_wait_ms=HOLD)
    await side.queue.enqueue(KEY, "b", "stuck")
    await clock.advance(1500)  # its request is held: group b's limit is 0
    assert net.sent[-1]["type"] == "request" and "waitMs" in net.sent[-1]
    got: dict[str, Any] = {}

    async def caller() -> None:
        try:
            async with side.queue.permit(KEY, "a", timeout_ms=3000):
                got["at"] = clock.now
        except PermitTimeoutError as exc:
            got["error"] = exc

    task = asyncio.ensure_future(caller())
    await clock.advance(20_000)
    assert task.done()
    assert "error" not in got, f"permit of a free group timed out: {got.get('error')}"


# ------------------------------------------------------------------------------------------ 5
@async_test
async def test_a_release_behind_a_held_request_of_an_uncontended_key_waits_out_the_hold():
    """Defect (throughput, R37 decision's side syncs vs R9 holds): a release made while the
    key's request waits goes in a side sync only if the key's *last reply* was contended
    (``_side_release_due``); otherwise it waits behind the request. With waiting requests the
    request that would tell the client "contended" is exactly the one being held, so the client
    never learns it while it waits: its own releases, the very capacity the held request (its
    own, or another client's) waits for, stay unsent until the hold ends. The item then waits
    ``request_wait_ms`` (+ a round) instead of one round: ten seconds here instead of ~2 s
    without waiting requests (the f5 limit, "pays one round period", becomes "pays the whole
    hold"). Several clients in this state hold each other up the same way.

    Here limit 1: ``a`` runs (its reply was not contended), ``b``'s request is held, ``a``
    ends 1 s later.

    Fix: while a request carrying ``waitMs`` is in flight, treat the key as contended for the
    side sync (a held request means its round was contended): e.g. in ``_side_release_due``
    use ``snap.key.contended or (key in self._requesting and self.request_wait_ms > 0)``."""
    clock = SimClock(T0)
    # the seed's timing: with free_at_once a round leaving no permit free says contended (R29)
    holder = HolderSide(clock, limit=1, hold_blocked_ms=HOLD, **SEED_TIMING)
    net = Net(holder, clock)
    admitted: dict[str, int] = {}
    side = ClientSide("c1", clock, net, on_admit=lambda s, i: admitted.setdefault(i.item_id, clock.now),
                      recheck_ms=0, request_wait_ms=HOLD)
    await side.queue.enqueue(KEY, "g", "a")
    await clock.advance(1500)
    assert "a" in admitted and not side.client.contended(KEY)
    await side.queue.enqueue(KEY, "g", "b")
    await clock.advance(side.client.not_before(KEY) - clock.now + 1500)  # b's request is held
    assert "b" not in admitted and net.sent[-1]["type"] == "request"
    left = clock.now
    await side.queue.complete("a")
    await clock.advance(20_000)
    assert admitted["b"] - left <= 3000, f"b admitted {admitted['b'] - left} ms after a's release"


@async_test
async def test_r9_r18_a_force_settle_starts_a_round_for_held_requests():
    # R9 decision, R18 decision (force-settle): the capacity a force-settle frees reaches a held
    # request by the next round the period allows, like a releasing sync, not at its deadline.
    bed = Bed(limit=1, hold_blocked_ms=HOLD)
    [ra] = await bed.round(request("a", {"g": 1}))
    (ga,) = ra["grants"]
    await bed.one(sync("a", grants=[(ga["grantId"], 1, 0)]))  # a claims (R15a)
    b = bed.send(held_request("b", {"g": 1}))
    await bed.clock.advance(5000)
    assert not b.done()
    await bed.sem.force_settle("a", "gone for good")
    t = bed.now
    await bed.clock.advance(0)
    await bed.clock.advance(1)
    assert b.done() and bed.now <= t + 1  # the period since the last round has passed
    assert [g["permits"] for g in b.result()["grants"]] == [1]
    bed.check()


@async_test
async def test_r9_r33a_a_sync_reporting_a_lease_that_finds_the_limit_raised_starts_a_round_for_held_requests():
    # R33a: a sync reporting leases resolves the limit; above the last round's, it starts the
    # next round (R9: at once, the period since the last round has passed), so a held request
    # is served by the raise rather than at its deadline.
    box = {"limit": 2}
    bed = Bed(limit=lambda: box["limit"], hold_blocked_ms=HOLD,
              leases={"provisioning": {"mode": "strict"}, "leaseFirst": True})
    [ra] = await bed.round(request("a", {"g": 2}, leases=[]))
    (lease,) = ra["leases"]
    b = bed.send(held_request("b", {"g": 1}))
    await bed.clock.advance(5000)
    assert not b.done()
    box["limit"] = 3
    await bed.one(sync("a", leases=[(lease["leaseId"], 1, 0, False)]))
    t = bed.now
    await bed.clock.advance(0)
    await bed.clock.advance(1)
    assert b.done() and bed.now <= t + 1
    assert [g["permits"] for g in b.result()["grants"]] == [1]
    bed.check()


@async_test
async def test_r9_a_request_that_does_not_report_its_live_grant_or_lease_is_answered_at_once():
    # R9 decision: the reply of the round that issued a's grant (or lease) was lost (found by
    # scripts/chaos: workerd killed after the round's commit, before its reply reached the
    # queue). a's next request does not report it, so a does not know it: holding that request
    # would keep the permits charged and unused until its deadline. The round answers it.
    from semaphore import LeaseConfig

    reuse = LeaseConfig(mode="strict", reusable=True, lease_first=True, ttl_ms=60_000)
    for options, leases, entries in (({"limit": 1, "grant_timeout_ms": 60_000}, None, "grants"),
                                     ({"limit": 2, "leases": reuse}, [], "leases")):
        bed = Bed(hold_blocked_ms=HOLD, **options)
        [lost] = await bed.round(held_request("a", {"g": 4}, leases=leases))
        [issued] = lost[entries]
        again = bed.send(held_request("a", {"g": 4}, leases=leases))  # reports nothing: a never heard
        await bed.clock.advance(3000)  # its round (and a second one), well before the 10 s deadline
        assert again.done(), entries
        reply = again.result()
        assert [x["status"] for x in reply[entries]] == ["active" if entries == "grants" else "live"]
        assert reply[entries][0]["permits"] == issued["permits"] and reply["blocked"], reply
        # Once a reports it, a request its round cannot serve is held as before.
        ids = reply[entries][0]["grantId" if entries == "grants" else "leaseId"]
        known = dict(grants=[(ids, 0, 0)]) if entries == "grants" else dict(leases=[(ids, 0, 0)])
        if entries == "grants":
            known["leases"] = leases
        held = bed.send(held_request("a", {"g": 4}, **known))
        await bed.clock.advance(3000)
        assert not held.done(), entries
        bed.check()


# ---------------------------------------------------------------- limits that rise (R9 decision)
def _rounds_of(records: list) -> int:
    return sum(1 for r in records if not r.failed)


@async_test
async def test_r9_a_limit_that_rises_serves_a_held_request_by_itself_within_the_check_period():
    # R9 decision (limits that rise): the application raises its limit and calls nothing; the
    # holder resolves the limit again every limit_check_ms while b is held and starts the round
    # that serves it. Before, b waited for its deadline (10 s) unless the app called start_round().
    box = {"limit": 1}
    records: list = []
    bed = Bed(limit=lambda: box["limit"], hold_blocked_ms=HOLD, leases=None, on_round=records.append)
    [ra] = await bed.round(request("a", {"g": 1}))
    await bed.one(sync("a", grants=[(ra["grants"][0]["grantId"], 1, 0)]))
    b = bed.send(held_request("b", {"g": 1}))
    await bed.clock.advance(3000)
    assert not b.done() and _rounds_of(records) >= 2  # b's batched round held it
    box["limit"] = 2
    raised = bed.now
    check = bed.sem.limit_check_ms
    while not b.done() and bed.now - raised < HOLD:
        await bed.clock.advance(100)
    assert b.done() and bed.now - raised <= check + bed.sem.round_period_ms
    assert [g["permits"] for g in b.result()["grants"]] == [1] and not b.result()["blocked"]
    assert bed.sem._watch_task is None  # nothing held: no check is left pending
    bed.check()


@async_test
async def test_r9_a_group_limit_raised_in_its_mapping_or_a_can_grant_that_turns_allowing_serves_a_held_request():
    # R9 decision (limits that rise): a group_limit mapping changed in place, or can_grant
    # turning allowing for the refused pair, is found the same way.
    limits = {"g": 0}
    bed = Bed(limit=5, group_limit=limits, hold_blocked_ms=HOLD, leases=None)
    b = bed.send(held_request("b", {"g": 1}))
    await bed.clock.advance(3000)
    assert not b.done()
    limits["g"] = 1
    await bed.clock.advance(bed.sem.limit_check_ms + bed.sem.round_period_ms)
    assert b.done() and [g["permits"] for g in b.result()["grants"]] == [1]

    allowed: set[str] = set()
    bed2 = Bed(limit=5, can_grant=lambda client, group: client in allowed, hold_blocked_ms=HOLD, leases=None)
    c = bed2.send(held_request("c", {"g": 1}))
    await bed2.clock.advance(3000)
    assert not c.done()
    allowed.add("c")
    await bed2.clock.advance(bed2.sem.limit_check_ms + bed2.sem.round_period_ms)
    assert c.done() and [g["permits"] for g in c.result()["grants"]] == [1]


@async_test
async def test_r9_limits_that_stay_or_fall_start_no_round_and_are_not_resolved_once_nothing_is_held():
    # R9 decision (limits that rise): the checks resolve the limit between rounds but start no
    # round of their own while it stays or falls (the held request is answered at its deadline,
    # by the round it would have had anyway); once nothing is held no check is left pending.
    box = {"limit": 1, "calls": 0}

    def limit() -> int:
        box["calls"] += 1
        return box["limit"]

    records: list = []
    bed = Bed(limit=limit, hold_blocked_ms=HOLD, leases=None, on_round=records.append)
    [ra] = await bed.round(request("a", {"g": 1}))
    await bed.one(sync("a", grants=[(ra["grants"][0]["grantId"], 1, 0)]))
    b = bed.send(held_request("b", {"g": 1}))
    await bed.clock.advance(2000)
    assert not b.done()
    rounds, calls = _rounds_of(records), box["calls"]
    box["limit"] = 0  # lowered: serves nobody more
    check = bed.sem.limit_check_ms
    await bed.clock.advance(3 * check)
    assert _rounds_of(records) == rounds  # no round in this window ...
    assert box["calls"] - calls >= 2  # ... but the checks resolved the limit
    await bed.clock.advance(HOLD - 2000 - 3 * check - 1)
    assert not b.done() and _rounds_of(records) == rounds
    await bed.clock.advance(bed.sem.round_period_ms + 1)
    assert b.done() and b.result()["blocked"]
    assert bed.sem._watch_task is None  # nothing held: the check is not left pending
    calls = box["calls"]
    await bed.clock.advance(10 * check)
    assert box["calls"] == calls


@async_test
async def test_r9_the_checks_resolve_only_what_the_held_requests_wait_on():
    # R9 decision (limits that rise): a group or pair of a client that is not held is not
    # resolved by the checks (a callable group_limit per lease group, every period, before).
    seen: list[str] = []
    gl = {"g": 1, "h": 0}

    def group_limit(group: str) -> int:
        seen.append(group)
        return gl[group]

    bed = Bed(limit=5, group_limit=group_limit, hold_blocked_ms=HOLD, leases=None)
    [ra] = await bed.round(request("a", {"g": 1}))
    await bed.one(sync("a", grants=[(ra["grants"][0]["grantId"], 1, 0)]))
    b = bed.send(held_request("b", {"g": 1}))
    c = bed.send(request("c", {"h": 1}))  # answered blocked by b's round: not held
    await bed.clock.advance(3000)
    assert not b.done() and c.done()
    seen.clear()
    await bed.clock.advance(3 * bed.sem.limit_check_ms)
    assert "g" in seen and "h" not in seen


@async_test
async def test_r9_a_limit_that_keeps_failing_is_not_logged_at_every_check(caplog: Any):
    # R9 decision (limits that rise): the checks repeat every period; a failing limit is
    # logged by the rounds (ERROR), the checks log it at DEBUG only.
    import logging

    box = {"limit": 1, "fail": False}

    def limit() -> int:
        if box["fail"]:
            raise RuntimeError("the limit's store is down")
        return box["limit"]

    bed = Bed(limit=limit, hold_blocked_ms=HOLD, leases=None)
    [ra] = await bed.round(request("a", {"g": 1}))
    await bed.one(sync("a", grants=[(ra["grants"][0]["grantId"], 1, 0)]))
    b = bed.send(held_request("b", {"g": 1}))
    await bed.clock.advance(3000)
    assert not b.done()
    logging.disable(logging.NOTSET)
    box["fail"] = True
    with caplog.at_level(logging.DEBUG, logger="semaphore"):
        await bed.clock.advance(3 * bed.sem.limit_check_ms)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors and any("limit callback raised" in r.getMessage() for r in caplog.records)


def test_r9_limits_rose_compares_what_both_resolutions_have():
    # R9 decision (limits that rise), the pure decision: more room anywhere the held requests
    # were refused, never a fall, a failed resolution or a group only one side resolved.
    from semaphore.core.allocation import LIMIT_ERROR
    from semaphore.core.batching import limits_can_change, limits_rose
    from semaphore.core.rounds import Limits

    base = Limits(3, {"g": 2, "h": None}, {("c", "g"): False, ("c", "h"): True})
    assert not limits_rose(base, base)
    assert limits_rose(base, Limits(4, {}, {}))
    assert not limits_rose(base, Limits(2, {}, {}))
    assert not limits_rose(base, Limits(LIMIT_ERROR, {}, {}))
    assert limits_rose(Limits(LIMIT_ERROR), Limits(0))
    assert limits_rose(base, Limits(3, {"g": 3}, {}))
    assert limits_rose(base, Limits(3, {"g": None}, {}))  # no group limit any more
    assert not limits_rose(base, Limits(3, {"g": 1, "h": 5}, {}))  # h had none: 5 is lower
    assert not limits_rose(base, Limits(3, {"x": 9}, {}))  # not resolved before
    assert limits_rose(Limits(3, {"g": LIMIT_ERROR}), Limits(3, {"g": 0}))
    assert limits_rose(base, Limits(3, {}, {("c", "g"): True}))
    assert not limits_rose(base, Limits(3, {}, {("c", "h"): True, ("d", "g"): True}))
    assert not limits_can_change(5, None, None) and not limits_can_change(5, 2, True)
    assert limits_can_change(lambda: 5, None, None) and limits_can_change(5, {"g": 1}, None)
    assert limits_can_change(5, lambda g: 1, None) and limits_can_change(5, None, lambda c, g: True)


def test_r9_the_hold_decision_reads_the_reply_for_news_last_and_only_when_it_would_hold():
    # R9 (waiting requests): whether a request is held is decided by one pure function; its
    # costliest input, whether the reply carries news (a look through every entry of the reply),
    # is asked only when everything else says hold: never with holding off, the default.
    from semaphore.core.batching import hold_open

    asked: list[int] = []

    def news(answer: bool) -> Any:
        return lambda: asked.append(1) or answer

    hold = dict(hold_ms=10_000, is_try=False, served=False, blocked=True, now=0, hold_until=5, answered=False)
    assert hold_open(**hold, news=news(False)) and len(asked) == 1
    assert not hold_open(**hold, news=news(True)) and len(asked) == 2
    for change in ({"hold_ms": 0}, {"is_try": True}, {"served": True}, {"blocked": False}, {"now": 5},
                   {"answered": True}):
        assert not hold_open(**{**hold, **change}, news=news(False)), change
    assert len(asked) == 2
