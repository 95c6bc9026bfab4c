"""Cold review of issue 13's first step (joinAt, side syncs, contended releases by joinAt).

Each test failed on the reviewed code because of the defect its docstring describes; all five
are fixed: a side sync only for releases of a contended key (not for the request's own
"contact the holder" mark), again while more came due during the previous one, in the
background (complete() never waits for the holder); a sync sent during a request keeps the
key's needs_sync whenever its reply lands; the reply's join time is relative (``joinInMs``), so
a client clock behind the holder's still makes the round. Real holder and client objects on a
virtual clock (``semaphore.testing``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from semaphore import Demand, HolderUnavailableError
from semaphore.testing import T0, ClientSide, HolderSide, Net, SimClock, SkewedClock, async_test

KEY = "acct"
LEASES = {"provisioning": {"mode": "strict"}, "permitsPerLease": 4, "ttlMs": 600_000}

pytestmark = pytest.mark.usefixtures("quiet_logs")  # failures are injected on purpose


def _objects(limit: int, transport_wrap: Any = None, **queue: Any) -> tuple[SimClock, HolderSide, Net, ClientSide,
                                                                           list[tuple[int, str]]]:
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=limit)
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
    clock, holder, net, side, admitted = _objects(10, report_releases_within_ms=60_000)
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
    holder = HolderSide(clock, limit=10, leases=LEASES)
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
