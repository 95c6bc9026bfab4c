"""SemaphoreQueue call-saving policy: delayed release reports (``report_releases_within_ms``) and
drawing from leases before claiming grants (``prefer_leases``). SPEC R15, R15a, R19, R29, R30,
R37; I3. Real holder and real queue over the in-memory transport (``semaphore.testing``)."""

from __future__ import annotations

from typing import Any

import pytest

from semaphore import ConfigurationError, ItemState, PermitKind, QueueItem, SemaphoreQueue
from semaphore.testing import T0, ClientSide, HolderSide, Net, SimClock, async_test

KEY = "acct"
LEASES = {"provisioning": {"mode": "strict"}, "permitsPerLease": 4, "ttlMs": 600_000}


pytestmark = pytest.mark.usefixtures("quiet_logs")  # failures are injected on purpose


class Setup:
    def __init__(self, limit: int = 10, *, recheck_ms: int = 0, queue: dict | None = None, **holder: Any) -> None:
        self.clock = SimClock(T0)
        self.holder = HolderSide(self.clock, limit=limit, **holder)
        self.net = Net(self.holder, self.clock)
        self.admitted: list[QueueItem] = []
        self.side = ClientSide("c1", self.clock, self.net, on_admit=lambda side, item: self.admitted.append(item),
                               recheck_ms=recheck_ms, **(queue or {}))

    @property
    def queue(self) -> SemaphoreQueue:
        return self.side.queue

    def messages(self, since: int = 0) -> list[dict]:
        return self.net.sent[since:]

    def outstanding(self) -> int:
        charged, _ = self.holder.charged()
        return charged


def released_in(messages: list[dict]) -> int:
    return max((g["released"] for m in messages for g in m["grants"]), default=0)


@async_test
async def test_releases_wait_for_the_bound_then_go_in_one_sync():
    # R37 + report_releases_within_ms: completions are not reported one sync each; the oldest
    # waits at most the bound, and everything pending goes in that one report (R19: then freed)
    s = Setup(queue={"report_releases_within_ms": 5000})
    for i in range(3):
        await s.queue.enqueue(KEY, "g", f"i{i}")
    await s.clock.advance(1500)  # round (grant 3), claim + confirming sync
    assert len(s.admitted) == 3 and all(i.permit.kind is PermitKind.GRANT for i in s.admitted)
    sent = len(s.net.sent)
    await s.queue.complete("i0")
    await s.clock.advance(1000)
    await s.queue.complete("i1")
    await s.clock.advance(3900)  # 4.9 s after the first release: nothing sent yet
    assert s.messages(sent) == []
    assert s.outstanding() == 3
    await s.clock.advance(200)  # the bound passes: one sync with both releases
    (m,) = s.messages(sent)
    assert m["type"] == "sync" and released_in([m]) == 2
    assert s.outstanding() == 1
    await s.queue.complete("i2")
    await s.clock.advance(6000)
    assert s.outstanding() == 0  # I3


@async_test
async def test_zero_bound_reports_every_release_at_once():
    # R37: report_releases_within_ms=0: the previous behaviour, a sync right after each completion
    s = Setup(queue={"report_releases_within_ms": 0})
    await s.queue.enqueue(KEY, "g", "a")
    await s.clock.advance(1500)
    sent = len(s.net.sent)
    await s.queue.complete("a")
    await s.clock.advance(1)
    (m,) = s.messages(sent)
    assert m["type"] == "sync" and released_in([m]) == 1 and s.outstanding() == 0


@async_test
async def test_pending_releases_ride_on_the_next_request():
    # R5/R13: a request carries the cumulative reports, so releases due later go with it and
    # no separate sync is sent for them
    s = Setup(queue={"report_releases_within_ms": 60_000})
    await s.queue.enqueue(KEY, "g", "a")
    await s.clock.advance(1500)
    await s.queue.complete("a")
    await s.clock.advance(3000)
    sent = len(s.net.sent)
    await s.queue.enqueue(KEY, "g", "b")  # new demand: a request
    await s.clock.advance(1500)
    kinds = [m["type"] for m in s.messages(sent)]
    assert kinds[0] == "request" and released_in(s.messages(sent)[:1]) == 1
    assert s.queue.item("b").state is ItemState.RUNNING


@async_test
async def test_post_request_recheck_rides_on_a_release_report():
    # the client's re-check after a request (a lease a duplicated request may have created is
    # listed in any reply, R8) waits up to the bound and is satisfied by the release report
    s = Setup(recheck_ms=2000, queue={"report_releases_within_ms": 5000})
    await s.queue.enqueue(KEY, "g", "a")
    await s.clock.advance(1500)  # request at 0, claim sync at ~1000
    sent = len(s.net.sent)
    await s.queue.complete("a")  # release pending from 1500, due 6500; re-check due 2000 + 5000
    await s.clock.advance(4900)
    assert s.messages(sent) == []
    await s.clock.advance(200)
    assert [m["type"] for m in s.messages(sent)] == ["sync"]
    assert s.side.client.check_at(KEY) is None and not s.side.client.needs_sync(KEY)
    await s.clock.advance(20_000)
    assert len(s.messages(sent)) == 1  # nothing else to say


@async_test
async def test_stop_returning_undrawn_permits_is_not_delayed():
    # R29: a contended reply stops a lease with undrawn permits in a group with nothing queued;
    # that stop is sent at once (not held like a release) even with a long release bound
    s = Setup(limit=10, queue={"report_releases_within_ms": 600_000}, leases=LEASES,
              can_grant=lambda client, group: group != "blocked")
    log: list[tuple[int, dict]] = []
    s.net.intercept = lambda key, m: log.append((s.clock.now, m))
    await s.queue.enqueue(KEY, "idle", "a")
    await s.clock.advance(1500)
    (lease,) = s.side.client.leases(KEY)
    assert s.queue.item("a").permit.kind is PermitKind.LEASE and lease.undrawn > 0
    await s.queue.complete("a")
    await s.clock.advance(1000)
    await s.queue.enqueue(KEY, "blocked", "b")  # not_permitted: need left, the round is contended
    await s.clock.advance(1500)
    (req_at, req), (stop_at, stop) = log[1], log[2]
    assert req["type"] == "request" and stop["type"] == "sync"
    assert [x["stopped"] for x in stop["leases"] if x["leaseId"] == lease.lease_id] == [True]
    assert stop_at - req_at <= 1000  # right after the reply (the round), not at the next request
    assert s.side.client.lease(KEY, lease.lease_id).status == "settled"


@async_test
async def test_items_that_fit_in_a_lease_are_drawn_and_the_grant_goes_back_at_claim_by():
    # prefer_leases (default): a request answered with a grant and a lease admits the items from
    # the lease with no confirming sync (R15a is not needed for draws, R30); the unclaimed grant
    # permits are reclaimed at claimBy (R15) and everything returns to zero (I3)
    s = Setup(leases=LEASES, grant_timeout_ms=5000, queue={"report_releases_within_ms": 1000})
    await s.queue.enqueue(KEY, "g", "a")
    await s.queue.enqueue(KEY, "g", "b")
    await s.clock.advance(1100)
    assert [m["type"] for m in s.net.sent] == ["request"]
    assert [i.permit.kind for i in s.admitted] == [PermitKind.LEASE, PermitKind.LEASE]
    (g,) = s.side.client.grants(KEY)
    assert g.permits == 2 and g.claimed == 0
    assert (await s.holder.usage())["outstanding"] == 2
    await s.clock.advance(5000)  # past claimBy: reclaimed by the holder's alarm
    assert (await s.holder.usage())["outstanding"] == 0
    for i in ("a", "b"):
        await s.queue.complete(i)
    await s.clock.advance(700_000)  # idle lease stopped before expiry and settled
    assert s.outstanding() == 0


@async_test
async def test_items_beyond_the_lease_claim_the_grant_first():
    # prefer_leases: when the queued items do not fit in the lease, grant permits are claimed
    # (and confirmed, R15a) first and the lease covers the rest
    s = Setup(leases={**LEASES, "permitsPerLease": 2})
    for i in range(3):
        await s.queue.enqueue(KEY, "g", f"i{i}")
    await s.clock.advance(1500)
    kinds = sorted(i.permit.kind.value for i in s.admitted)
    assert kinds == ["grant", "grant", "grant"]
    assert [m["type"] for m in s.net.sent] == ["request", "sync"]
    (lease,) = s.side.client.leases(KEY)
    assert lease.drawn == 0  # kept for later arrivals


@async_test
async def test_prefer_leases_off_claims_grants_first():
    # R37, R15a: prefer_leases=False: the grant is claimed (with a confirming sync) even if a lease could serve
    s = Setup(leases=LEASES, queue={"prefer_leases": False})
    await s.queue.enqueue(KEY, "g", "a")
    await s.clock.advance(1500)
    assert [i.permit.kind for i in s.admitted] == [PermitKind.GRANT]
    assert [m["type"] for m in s.net.sent] == ["request", "sync"]


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True, None])
def test_report_releases_within_ms_is_validated(bad):
    # R37: an invalid bound is refused at construction
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=1)
    with pytest.raises(ConfigurationError):
        ClientSide("c", clock, Net(holder, clock), on_admit=lambda side, item: None,
                   report_releases_within_ms=bad)


@async_test
async def test_releases_are_reported_by_the_next_round_when_the_last_reply_was_contended():
    # R29, R37 decision: a contended reply means other work waits for capacity; holding a
    # release back past the next round only idles permits, so whatever the bound it is reported
    # by the reply's joinInMs (a request sent then joins that round), here on b's own request:
    # one message, no sync of its own
    s = Setup(limit=1, queue={"report_releases_within_ms": 60_000})
    await s.queue.enqueue(KEY, "g", "a")
    await s.queue.enqueue(KEY, "g", "b")  # limit 1: b waits, the round is contended
    await s.clock.advance(1500)
    assert [i.item_id for i in s.admitted] == ["a"] and s.side.client.contended(KEY)
    sent = len(s.net.sent)
    await s.queue.complete("a")
    join_at = s.side.client.not_before(KEY)
    assert s.clock.now < join_at
    await s.clock.advance(join_at - s.clock.now)
    assert released_in(s.messages(sent)) == 1
    assert [m["type"] for m in s.messages(sent)] == ["request"]  # the release rode on b's request
    await s.clock.advance(1000)  # b's round applies the release first, then grants it to b
    assert s.outstanding() == 1 and [i.item_id for i in s.admitted] == ["a", "b"]


@async_test
async def test_a_contended_release_while_the_keys_request_waits_for_its_round_goes_in_a_sync_of_its_own():
    # R37 decision: the key's request holds the pump while it waits for its round; a release
    # due then (contended) does not wait behind it: a sync carries it, so that round counts it
    s = Setup(limit=2, queue={"report_releases_within_ms": 60_000})
    for item in ("a", "b", "c"):
        await s.queue.enqueue(KEY, "g", item)
    await s.clock.advance(1500)
    assert [i.item_id for i in s.admitted] == ["a", "b"] and s.side.client.contended(KEY)
    join_at = s.side.client.not_before(KEY)
    await s.clock.advance(join_at - s.clock.now + 100)  # c's request went and waits for its round
    assert s.net.sent[-1]["type"] == "request"
    sent = len(s.net.sent)
    await s.queue.complete("a")  # returns at once: the sync goes in the background
    assert s.messages(sent) == []
    await s.clock.advance(1)
    assert [m["type"] for m in s.messages(sent)] == ["sync"] and s.outstanding() == 1
    await s.clock.advance(1000)  # that round: c is granted a's permit at once
    assert [i.item_id for i in s.admitted] == ["a", "b", "c"]


@async_test
async def test_the_release_bound_survives_evictions():
    # report_releases_within_ms counts from the first unreported release, kept in SQL: an
    # object evicted more often than the bound still reports within it (I3)
    s = Setup(queue={"report_releases_within_ms": 5000})
    await s.queue.enqueue(KEY, "g", "a")
    await s.clock.advance(1500)
    await s.queue.complete("a")
    sent = len(s.net.sent)
    for _ in range(4):  # evicted every 2 s: an in-memory timer would restart each time
        await s.clock.advance(2000)
        s.side.evict()
        await s.side.queue.pump(KEY)
    assert released_in(s.messages(sent)) == 1 and s.outstanding() == 0
