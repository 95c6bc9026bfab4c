"""Waiting requests at the holder (issue 13; SPEC R9 decision): ``hold_blocked_ms`` on the
holder, ``waitMs`` on the request (``SemaphoreQueue(request_wait_ms=...)``). A request its round
cannot serve is held open instead of answered ``blocked``, every later round takes it again,
and a report that frees capacity starts the next round as soon as ``round_period_ms`` allows.
Real holder on the SQLite test bed, real queue and client objects on a virtual clock."""

from __future__ import annotations

import pytest

from semaphore.errors import ConfigurationError
from semaphore.testing import T0, Bed, ClientSide, HolderSide, Net, SimClock, async_test, request, sync

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
    bed = Bed(limit=1, hold_blocked_ms=HOLD, round_wait_ms=100, round_period_ms=3000)
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
    await bed.clock.advance(2001)
    assert b.done()
    reply = b.result()
    assert reply["grants"] == [] and reply["blocked"] == [{"group": "g", "reason": "limit", "waiting": 2}]
    assert bed.now - start <= 4000 + 2000  # its deadline, then the next round the period allows


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
    assert answered_at is not None and answered_at - start <= HOLD + 2000 + 3000
    assert calls[0].result()["blocked"] == [{"group": "g", "reason": "limit", "waiting": 1}]
    assert all(c.done() for c in calls[:4])  # the calls that joined it got the same answer


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
