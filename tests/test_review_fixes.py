"""Cold review of the fixes to the reusable-lease findings (tests/test_review_reusable.py).

One test per finding; each FAILS on the reviewed snapshot and says in its docstring what is
wrong and why it matters. Only the public test kit is used (real holder, client and queue
objects on a virtual clock; nothing of the library is mocked or patched).
"""

from __future__ import annotations

from typing import Any

from semaphore.testing import T0, ClientSide, HolderSide, Net, SimClock, async_test

SECRET = "app-secret-0123456789abcdef"


def _stop(*sides: ClientSide) -> None:
    for side in sides:
        side.driver.kill()


# ====================================================================== 1. flag flip then clamp
@async_test
async def test_a_reused_lease_unknown_after_a_reset_stays_charged_while_its_work_runs():
    """MEDIUM (I1, over-admission; needs a holder storage reset under ``lease_secret``, the
    configuration in which R32 promises to keep charging work still running under leases
    issued before the reset). New in the fix: ``merge_lease`` sets ``reusable`` to False
    when a reply lacks the flag, and the R32 reply to an unknown lease never carries it. The
    count clamp of THAT merge still uses the old flag (unbounded), but every later merge
    clamps ``drawn``/``released`` to ``permits`` (the lease is one-shot now). A reused lease
    routinely has ``drawn > permits``: here permits 2, drawn 4, released 2 (2 items run).
    Second reply after the reset: ``raise_counts(4, 2, 4, 2, cap=2)`` -> drawn 2, released
    2, so the client's next (stopped) report is ``released == drawn``: answered ``settled``,
    charged 0 (R32), the lease becomes a tombstone while its 2 items still run. The holder
    then admits a full limit on top: 6 run under a limit of 4, although c1 reports in every
    round. (With the clamp kept at ``max(permits, local.drawn)`` the same run stays at 4.)
    Suggested fix: never clamp a local count below what it already is (cap
    ``max(cap, local.drawn)``), or keep the unbounded cap for a lease that was ever
    reusable (e.g. when ``drawn > permits``)."""
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=4, leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 2,
                                                "ttlMs": 60_000, "reusable": True, "leaseFirst": True},
                        lease_secret=SECRET, group_limit=lambda g: 0 if g == "h" else None)
    net = Net(holder, clock)
    running: set[str] = set()
    c1 = ClientSide("c1", clock, net, on_admit=lambda s, i: running.add(i.item_id))
    c2 = ClientSide("c2", clock, net, on_admit=lambda s, i: running.add(i.item_id))
    await c1.queue.enqueue("acct", "g", "a0")
    await c1.queue.enqueue("acct", "g", "a1")
    await clock.advance(1500)  # a reusable lease of 2, both slots busy
    for n, old in ((2, "a0"), (3, "a1")):  # each slot reused once: drawn 4, released 2
        await c1.queue.complete(old)
        running.discard(old)
        await c1.queue.enqueue("acct", "g", f"a{n}")
        await clock.advance(50)
    (lease,) = c1.client.leases("acct")
    assert lease.reusable and (lease.permits, lease.drawn, lease.released) == (2, 4, 2)
    assert running == {"a2", "a3"}
    holder.reset()  # migrate(None): the lease is unknown now; lease_secret keeps its id verifiable
    await c1.queue.enqueue("acct", "h", "h0")  # group h (limit 0): c1 is in every round from now on
    await clock.advance(6000)
    leases = [(x.status, x.drawn, x.released) for x in c1.client.leases("acct")]  # settled: not listed
    for i in range(4):
        await c2.queue.enqueue("acct", "g", f"c{i}")
    await clock.advance(6000)
    assert len(running) <= 4, (f"{sorted(running)} run at once under a limit of 4 (c1's lease after the"
                               f" reset, while a2 and a3 ran: {leases or 'settled'})")
    _stop(c1, c2)


# ====================================================================== 2. other keys behind a held request
@async_test
async def test_a_new_item_of_another_key_is_not_held_up_by_held_requests():
    """LOW-MEDIUM (liveness; documentation contradicted). README (``request_wait_ms`` row,
    "Known limit") says that while one key's request is held, the alarm's wake-ups of the
    object's other keys wait "up to ``request_wait_ms``" and that "a new item of such a key
    still pumps it at once"; the changelog of this change says a wake-up no longer waits for
    a key's answer, "which held up the wake-up run, and so every other key of the object".
    But the early return only helps a SECOND pump of the requesting key: the pump that sent
    the held request was itself started by the alarm's wake-up run, which awaits it, and
    ``enqueue()`` only re-arms the alarm (no kick, unlike ``permit()``). So a new item of
    another key waits until every held key's pump in that run has returned: measured here
    with 2 blocked keys (request_wait_ms 15 s): about 29 s; with 3: 44 s (n x
    request_wait_ms, not "up to request_wait_ms", not "at once"); ``permit()`` on the same
    key: 1 s. Suggested fix: let ``enqueue()`` kick its key like ``permit()`` does, and/or
    run the request of a pump started by the wake-up run in a background task (the early
    return then covers the rest), or correct the README."""
    clock = SimClock(T0)
    holders = {f"A{i}": HolderSide(clock, name=f"hA{i}", limit=0, hold_blocked_ms=20_000) for i in range(2)}
    holders["B"] = HolderSide(clock, name="hB", limit=5, hold_blocked_ms=20_000)

    async def transport(key: str, message: dict[str, Any]) -> dict[str, Any]:
        return await holders[key].handle(message)

    started: dict[str, int] = {}
    c = ClientSide("c1", clock, transport, on_admit=lambda s, i: started.setdefault(i.item_id, clock.now),
                   request_wait_ms=15_000)
    for i in range(2):
        await c.queue.enqueue(f"A{i}", "g", f"a{i}")  # keys whose holder has no capacity: held requests
    await clock.advance(2000)
    t = clock.now
    await c.queue.enqueue("B", "g", "b0")  # a key whose holder has room
    await clock.advance(60_000)
    assert "b0" in started
    assert started["b0"] - t <= 3000, f"b0 of key B started {started['b0'] - t} ms after its enqueue"
    _stop(c)
