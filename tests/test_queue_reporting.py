"""SemaphoreQueue call-saving policy: delayed release reports (``report_releases_within_ms``) and
drawing from leases before claiming grants (``prefer_leases``). SPEC R15, R15a, R19, R29, R30,
R37; I3. Real holder and real queue over the in-memory transport (``semaphore.testing``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from semaphore import (
    ConfigurationError,
    Demand,
    HolderUnavailableError,
    ItemState,
    PermitKind,
    QueueItem,
    SemaphoreQueue,
)
from semaphore.testing import (
    SEED_ROUNDS,
    SEED_TIMING,
    T0,
    ClientSide,
    HolderSide,
    Net,
    SimClock,
    SkewedClock,
    async_test,
)

KEY = "acct"
LEASES = {"provisioning": {"mode": "strict"}, "permitsPerLease": 4, "ttlMs": 600_000}


pytestmark = pytest.mark.usefixtures("quiet_logs")  # failures are injected on purpose


class Setup:
    def __init__(self, limit: int = 10, *, recheck_ms: int = 0, queue: dict | None = None, **holder: Any) -> None:
        self.clock = SimClock(T0)
        self.holder = HolderSide(self.clock, limit=limit, **{"leases": None, **holder})  # grants: these tests are of the grant path (the default leases: test_reusable_leases.py)
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
    s = Setup(limit=2, queue={"report_releases_within_ms": 60_000}, **SEED_ROUNDS)  # the original's round timing
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


# --- Releases and the next round: side syncs, needs_sync, relative join time -------------------
# Cold review of issue 13's first step (joinAt, side syncs, contended releases by joinAt).
#
# Each test failed on the reviewed code because of the defect its docstring describes; all five
# are fixed: a side sync only for releases of a contended key (not for the request's own
# "contact the holder" mark), again while more came due during the previous one, in the
# background (complete() never waits for the holder); a sync sent during a request keeps the
# key's needs_sync whenever its reply lands; the reply's join time is relative (``joinInMs``), so
# a client clock behind the holder's still makes the round. Real holder and client objects on a
# virtual clock (``semaphore.testing``).


pytestmark = pytest.mark.usefixtures("quiet_logs")  # failures are injected on purpose


def _objects(limit: int, transport_wrap: Any = None, *, holder_options: Any = None, **queue: Any) -> tuple[SimClock, HolderSide, Net, ClientSide,
                                                                           list[tuple[int, str]]]:
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=limit, **(holder_options or {}), leases=None)  # grants: a request waits for its round
    net = Net(holder, clock)
    admitted: list[tuple[int, str]] = []
    transport = net if transport_wrap is None else transport_wrap(clock, net)
    side = ClientSide("c1", clock, transport, on_admit=lambda s, i: admitted.append((clock.now - T0, i.item_id)),
                      recheck_ms=0, **queue)
    return clock, holder, net, side, admitted


@async_test
async def test_a_side_sync_is_sent_for_a_release_that_is_not_due():
    """Defect (cost, R37 ``report_releases_within_ms``): ``SemaphoreQueue._side_sync`` decides
    with ``report_due``, whose ``_urgent`` is true whenever ``needs_sync`` is set, and
    ``SemaphoreClient.request()`` sets ``needs_sync`` for as long as its request is in flight.
    So while the key's request waits for its round, EVERY completion (even uncontended, with a
    60 s release bound, even the cancel of a queued item that frees nothing) sends a sync at
    once, and since a sync answered meanwhile keeps ``needs_sync``, the next completion does
    again: one holder call per completion, the opposite of issue 13's "few holder calls" and of
    R37 (releases ride on the next message within the bound; only contended ones go at once).

    Fix: the side sync must look only at what it is for: capacity-returning reports
    (dirty grant releases / lease releases or stops) of a key whose last reply was contended,
    e.g. compute ``report_due`` on a snapshot with ``needs_sync`` cleared (``replace(snap,
    key=replace(snap.key, needs_sync=False))``), or test ``releases and snap.key.contended``."""
    clock, holder, net, side, admitted = _objects(10, report_releases_within_ms=60_000, holder_options=SEED_TIMING)  # staged on batched rounds (R9), not R9a's rounds at once
    await side.queue.enqueue(KEY, "g", "a")
    await clock.advance(1500)
    assert [i for _, i in admitted] == ["a"] and not side.client.contended(KEY)
    await clock.advance(3000)
    await side.queue.enqueue(KEY, "g", "b")
    await side.queue.enqueue(KEY, "g", "c")
    await clock.advance(100)  # b's and c's request waits for its round
    assert net.sent[-1]["type"] == "request"
    sent = len(net.sent)
    await side.queue.complete("c")  # a cancel: frees nothing at the holder
    await side.queue.complete("a")  # uncontended release, 60 s bound
    await clock.advance(1)
    assert [m["type"] for m in net.sent[sent:]] == [], \
        "syncs sent for reports that are not due: " + repr([(m["type"], m["grants"]) for m in net.sent[sent:]])


def _slow_syncs(ms: int, when: dict[str, bool] | None = None) -> Any:
    def wrap(clock: SimClock, net: Net) -> Any:
        async def transport(key: str, message: dict[str, Any]) -> Any:
            if message["type"] == "sync" and (when is None or when["on"]):
                await clock.sleep(ms)  # the RPC round trip of a sync
            return await net(key, message)
        return transport
    return wrap


@async_test
async def test_a_release_made_while_a_side_sync_is_in_flight_misses_the_round():
    """Defect (utilization, the R37 decision's promise): ``_side_sync`` sends at most one sync
    per key at a time and simply returns when one is in flight. A release made during that
    sync's round trip is then sent by nobody until the key's request is answered (the pump's
    next exchange), i.e. after the round the request waits for: the waiting item pays a whole
    extra round period, exactly the issue-13 gap the change is meant to close. Here limit 2,
    a and b run, c and d wait (contended); a ends, its side sync takes 50 ms; b ends 10 ms
    later; the round 900 ms later counts only a's release: d is admitted 2 s after c.

    Fix: after the in-flight side sync returns, while the key is still ``_requesting`` and
    capacity-returning reports are dirty (and due as contended), send again (a loop in
    ``_side_sync``, or a per-key "again" flag set by the skipped caller). With the first
    finding's fix the loop cannot spin on ``needs_sync``."""
    clock, holder, net, side, admitted = _objects(2, _slow_syncs(50), report_releases_within_ms=60_000)
    for item in "abcd":
        await side.queue.enqueue(KEY, "g", item)
    await clock.advance(1500)
    assert [i for _, i in admitted] == ["a", "b"] and side.client.contended(KEY)
    await clock.advance(side.client.not_before(KEY) - clock.now + 100)  # c+d's request waits
    assert net.sent[-1]["type"] == "request"
    first = asyncio.ensure_future(side.queue.complete("a"))
    await clock.advance(10)
    second = asyncio.ensure_future(side.queue.complete("b"))
    await clock.advance(6000)
    assert first.done() and second.done()
    at = dict((i, t) for t, i in admitted)
    assert at["d"] - at["c"] < 500, f"d admitted {at['d'] - at['c']} ms after c: b's release missed c's round"


@async_test
async def test_complete_waits_for_a_holder_round_trip():
    """Defect (API behaviour): ``_complete_item`` now awaits ``_side_sync`` inline, so
    ``complete()`` (and the exit of ``async with queue.permit()``, and the end of a ``work=``
    item) blocks for a holder round trip whenever the key's request waits for its round. A
    slow, overloaded or hung holder (a DO RPC has no timeout of its own) makes ``complete()``
    slow or hang, though its item is already done and its docstring says the release is
    "reported with the next sync". A non-SemaphoreError raised while applying the reply would
    also surface from ``complete()`` after the item was finished.

    Fix: start the side sync as a background task of the queue (kept in a set like
    ``_kicks``, cancelled by ``abandon()``, exceptions logged), not awaited by the caller."""
    slow = {"on": False}
    clock, holder, net, side, admitted = _objects(1, _slow_syncs(20_000, slow), report_releases_within_ms=60_000)
    await side.queue.enqueue(KEY, "g", "a")
    await side.queue.enqueue(KEY, "g", "b")
    await clock.advance(1500)
    assert [i for _, i in admitted] == ["a"] and side.client.contended(KEY)
    await clock.advance(side.client.not_before(KEY) - clock.now + 100)  # b's request waits
    assert net.sent[-1]["type"] == "request"
    slow["on"] = True  # from now on the holder takes 20 s to answer a sync
    done = asyncio.ensure_future(side.queue.complete("a"))
    await clock.advance(100)
    finished = done.done()
    await clock.advance(30_000)
    assert finished, "complete() still waiting for the holder 100 ms later"


@async_test
async def test_a_sync_sent_during_a_request_and_answered_after_its_failure_clears_needs_sync():
    """Defect (I3, a lease created by a round but never learned of): ``_apply`` keeps
    ``needs_sync`` for a sync reply only if a request of the key is in flight *when the reply
    is applied*. A side sync sent while the request waits, answered by the holder before the
    round (so its reply cannot list what the round creates) but delivered after the request
    failed (its reply lost after the round committed a lease), finds no request in flight and
    clears ``needs_sync``: the client forgets that it must contact the holder, and the lease's
    footprint (4 permits here) stays charged with no client report ever coming (with
    ``recheck_ms=0``, which the client documents as allowed; with the default 30 s recheck the
    permits idle for ~40 s instead of being recovered by the next pump).

    Fix: decide at *send* time: ``sync()`` notes whether a request of the key was in flight
    (or a per-key request sequence number) when it built its message, and ``_apply`` keeps
    ``needs_sync`` if one was in flight then or is now."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=10, leases=LEASES, **SEED_TIMING)  # staged on batched rounds (R9), not R9a's rounds at once
    net = Net(holder, clock)

    async def transport(key: str, message: dict[str, Any]) -> Any:
        reply = await net(key, message)
        if message["type"] == "request":
            raise HolderUnavailableError("reply lost (test)")
        await clock.sleep(2000)  # the sync's reply is slow to come back
        return reply

    side = ClientSide("c1", clock, transport, recheck_ms=0)
    client = side.client
    request = asyncio.ensure_future(client.request(KEY, [Demand("g", 1, T0)], force=True))
    await clock.advance(10)
    sync = asyncio.ensure_future(client.sync(KEY))  # sent while the request waits
    await clock.advance(3000)
    assert isinstance(request.exception(), HolderUnavailableError) and sync.done() and sync.exception() is None
    assert [x["client_id"] for x in holder.leases().values()] == ["c1"] and client.leases(KEY) == []
    assert client.key_state(KEY).needs_sync, "the client no longer knows it must contact the holder"


@async_test
async def test_a_contended_release_waits_for_the_holders_clock():
    """Defect (R29/R37 under clock skew; joinAt is holder time): the contended release is now
    held back until the stored ``joinAt``, compared with the *client's* clock. A client whose
    clock is behind the holder's by more than ``round_wait_ms`` sends it after the round it
    was meant for (before the change: at once, independent of clocks), so the waiting client
    pays a round period. Requests already depended on ``nextRequestAt`` this way; releases did
    not. Here the releasing object is 1.5 s behind: the waiter gets the permit 2 s late.

    Fix: make the wait relative: the holder also sends its ``now`` (or ``joinInMs``) and the
    client stores ``client_now + (joinAt - holder_now)``; or keep contended releases at once
    when the key has no request coming (the one-message saving only matters when a request
    carries them)."""
    base = SimClock(T0)
    holder = HolderSide(base, limit=1)
    net = Net(holder, base)
    got: dict[str, int] = {}
    behind = SkewedClock(base, -1500)
    releaser = ClientSide("c1", behind, net, on_admit=lambda s, i: got.setdefault(i.item_id, base.now - T0),
                          recheck_ms=0, report_releases_within_ms=60_000)
    waiter = ClientSide("c2", base, net, on_admit=lambda s, i: got.setdefault(i.item_id, base.now - T0),
                        recheck_ms=0, report_releases_within_ms=60_000)
    await releaser.queue.enqueue(KEY, "g", "a")
    await base.advance(1500)
    assert "a" in got
    await waiter.queue.enqueue(KEY, "g", "b")
    await base.advance(2000)  # b's round (holder time 3000): blocked, contended
    assert "b" not in got
    await releaser.client.sync(KEY)  # the releaser hears the contended flag (e.g. a heartbeat)
    assert releaser.client.contended(KEY)
    left = base.now - T0
    await releaser.queue.complete("a")
    await base.advance(8000)
    assert got["b"] - left <= 2600, f"b admitted {got['b'] - left} ms after a's release"
