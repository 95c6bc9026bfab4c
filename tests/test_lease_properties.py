"""Stateful property tests of leases on the holder (SPEC §7 with I1, I2, I3, I5).

One Hypothesis state machine per provisioning mode (and one without leases) drives the real
holder on the SQLite test bed with a few honest clients modelled here:

* a client queues items per group and asks with its demand and cumulative reports (R8, R13, R31);
* grant permits are claimed in a ``sync`` and only the claims the reply confirms run (R15a);
* lease permits are drawn locally, one per item, one-shot (R34); a lease the holder calls retired
  stops drawing at once and is reported ``stopped`` until ``settled`` (R30, R33, R37); a
  ``contended`` reply stops live leases of groups with nothing queued (R29);
* replies may be lost (the client learns its grants and leases at its next contact, R8), stale
  report snapshots are replayed (I2), invalid messages are sent (I5), time advances past claim
  deadlines and lease TTLs (R15, R31), and the limit and group limits move up and down (R24, R33).

After every round: I1 (what the round admitted never takes the total above the mode's ceiling,
nor a group above its limit, nor grants past the ``under`` ceiling or ``over`` leases past
``extra``); after every step: I2 in its strong form (the holder charges every grant and lease at
least what its client is running under it) and the aggregate tables equal a full recomputation
(``semaphore.testing.check_aggregates``). At teardown every client drains and settles and charged capacity
must return to zero (I3).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from honest_client import GROUPS, Client
from semaphore import LeaseConfig
from semaphore.core.allocation import grant_ceiling
from semaphore.testing import Bed, check_aggregates, dump, request, sync

CLIENTS = ("c0", "c1", "c2", "c3")  # c3 has no lease support
TTL = 20_000

SETTINGS = settings(
    max_examples=int(os.environ.get("LEASE_PROPERTY_EXAMPLES", "40")),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,
)


def footprint(row: dict[str, Any]) -> int:
    """SPEC R30, R30a, spelt out: a reusable lease charges every slot until its final count."""
    if row["status"] == "retired" and row["stopped"]:
        return min(row["permits"], row["drawn"] - row["released"])
    return row["permits"] if row["reusable"] else row["permits"] - row["released"]


class LeaseMachine(RuleBasedStateMachine):
    LEASES: dict[str, Any] | None = None

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.limit = 6
        self.group_limits: dict[str, int] = {}
        self.config = LeaseConfig.parse(self.LEASES)

        async def make() -> Bed:
            return Bed(lambda: self.limit, group_limit=lambda g: self.group_limits.get(g),
                       leases=self.LEASES)

        self.bed = self.loop.run_until_complete(make())
        self.clients = {c: Client(c, lease_capable=(c != "c3")) for c in CLIENTS}
        self.last_round_limit: int | None = None

    def teardown(self) -> None:
        try:
            self.loop.run_until_complete(self._drain())
        finally:
            self.loop.close()

    # ------------------------------------------------------------------ plumbing
    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def _sync(self, client: Client) -> dict[str, Any]:
        grants, leases = client.reports()
        reply = await self.bed.sem.handle(sync(client.cid, grants, leases if client.lease_capable else None))
        client.absorb(reply)
        client.confirm(reply)
        return reply

    async def _after_reply(self, client: Client) -> None:
        client.draw()
        if client.claims_to_make():
            await self._sync(client)
        client.draw()

    def _ceiling(self) -> int:
        return self.limit + (self.config.extra(self.limit) if self.config else 0)

    # ------------------------------------------------------------------ rules
    @rule(client=st.sampled_from(CLIENTS), group=st.sampled_from(GROUPS), n=st.integers(1, 5))
    def add_items(self, client: str, group: str, n: int) -> None:
        c = self.clients[client]
        c.queue[group] += [self.bed.now] * n
        c.draw()  # lease draws need no round trip

    @rule(data=st.data(), lose=st.booleans())
    def round(self, data: st.DataObject, lose: bool) -> None:
        members = data.draw(st.lists(st.sampled_from(CLIENTS), min_size=1, max_size=4, unique=True))
        before_grants, before_leases = set(self.bed.grants()), set(self.bed.leases())
        messages = []
        for cid in members:
            c = self.clients[cid]
            grants, leases = c.reports()
            demand = [(d.group, d.count, d.oldest_at) for d in c.demand()]
            messages.append(request(cid, demand, grants, leases if c.lease_capable else None))
        limit, group_limits = self.limit, dict(self.group_limits)
        replies = self._run(self.bed.round(*messages))
        self._check_i1(limit, group_limits, before_grants, before_leases)
        self._check_r33(limit, group_limits, before_leases)
        self.last_round_limit = limit
        for i, (cid, reply) in enumerate(zip(members, replies)):
            assert "error" not in reply, reply
            assert reply["contended"] == replies[0]["contended"]  # R29: every reply of the round
            if lose and i == 0:
                continue  # the reply is lost: nothing learnt until the next contact (R8)
            c = self.clients[cid]
            c.absorb(reply)
            self._run(self._after_reply(c))

    @rule(client=st.sampled_from(CLIENTS))
    def heartbeat(self, client: str) -> None:
        c = self.clients[client]
        self._run(self._sync(c))
        self._run(self._after_reply(c))

    @rule(client=st.sampled_from(CLIENTS), data=st.data())
    def release(self, client: str, data: st.DataObject) -> None:
        c = self.clients[client]
        busy = sorted(k for k, n in c.running.items() if n > 0)
        if not busy:
            return
        kind, ident = data.draw(st.sampled_from(busy))
        c.running[(kind, ident)] -= 1
        (c.grants if kind == "grant" else c.leases)[ident]["released"] += 1

    @rule(client=st.sampled_from(CLIENTS), kind=st.sampled_from(["grant", "lease"]))
    def finish_work(self, client: str, kind: str) -> None:
        # every running item of one kind completes; leases are stopped and all is reported
        c = self.clients[client]
        for (k, ident), n in list(c.running.items()):
            if k == kind and n > 0:
                (c.grants if kind == "grant" else c.leases)[ident]["released"] += n
                c.running[(k, ident)] = 0
        if kind == "lease":
            for x in c.leases.values():
                x["stopped"] = True
        self._run(self._sync(c))

    @rule(client=st.sampled_from(CLIENTS), data=st.data())
    def replay_stale_report(self, client: str, data: st.DataObject) -> None:
        # I2: an old snapshot of cumulative reports, re-sent late, returns nothing twice.
        c = self.clients[client]
        if not c.history:
            return
        grants, leases = data.draw(st.sampled_from(c.history))
        reply = self._run(self.bed.sem.handle(sync(c.cid, grants, leases if c.lease_capable else None)))
        assert "error" not in reply
        c.absorb(reply)

    @rule(ms=st.sampled_from([500, 2_000, 6_000, 11_000, TTL // 2, TTL]))
    def advance(self, ms: int) -> None:
        self._run(self.bed.clock.advance(ms))

    @rule(limit=st.integers(0, 10))
    def set_limit(self, limit: int) -> None:
        self.limit = limit

    @rule(group=st.sampled_from(GROUPS), gl=st.one_of(st.none(), st.integers(0, 6)))
    def set_group_limit(self, group: str, gl: int | None) -> None:
        if gl is None:
            self.group_limits.pop(group, None)
        else:
            self.group_limits[group] = gl

    @rule(bad=st.sampled_from([
        {"type": "request", "v": 1, "clientId": "c0", "demand": [{"group": "g0", "count": -1, "oldestAt": 0}], "grants": []},
        {"type": "sync", "v": 1, "clientId": "c0", "grants": [], "leases": [{"leaseId": "x", "drawn": 1, "released": 2, "stopped": False}]},
        {"type": "request", "v": 2, "clientId": "c0", "demand": [], "grants": []},
        {"type": "sync", "v": 1, "clientId": "", "grants": []},
    ]))
    def invalid_message(self, bad: dict[str, Any]) -> None:
        before = dump(self.bed.storage)  # I5
        reply = self._run(self.bed.sem.handle(bad))
        assert reply["error"]["code"] == "invalid_message"
        assert dump(self.bed.storage) == before

    # ------------------------------------------------------------------ checks
    def _check_i1(self, limit: int, group_limits: dict[str, int], before_g: set[str], before_l: set[str]) -> None:
        grants, leases = self.bed.grants(), self.bed.leases()
        new_g = [g for gid, g in grants.items() if gid not in before_g]
        new_l = [x for lid, x in leases.items() if lid not in before_l]
        outstanding = sum(g["permits"] - g["released"] for g in grants.values())
        lease_fp = sum(footprint(x) for x in leases.values())
        if self.config is None:
            assert not new_l, "no leases without lease config"
        extra = self.config.extra(limit) if self.config else 0
        if new_g or new_l:
            assert outstanding + lease_fp <= limit + extra, (
                f"I1: total {outstanding}+{lease_fp} > {limit}+{extra} after admitting")
        if new_g:
            if self.config is not None and self.config.mode.value == "under":
                assert outstanding <= grant_ceiling(limit, self.config), "I1: grants past the under ceiling"
            assert outstanding + max(0, lease_fp - extra) <= limit, "I1: grants past the limit"
        if new_l and self.config.mode.value == "over":
            assert lease_fp <= extra, "I1: over leases past extra"
        for group in {x["group_name"] for x in new_g + new_l}:
            gl = group_limits.get(group)
            if gl is None:
                continue
            charged = sum(g["permits"] - g["released"] for g in grants.values() if g["group_name"] == group)
            charged += sum(footprint(x) for x in leases.values() if x["group_name"] == group)
            assert charged <= gl, f"I1: group {group} at {charged} > {gl} after admitting"
            if self.config is None or self.config.limited_groups.value == "exclude":
                assert not [x for x in new_l if x["group_name"] == group], "R27: lease in a limited group"

    def _check_r33(self, limit: int, group_limits: dict[str, int], before_l: set[str]) -> None:
        leases = self.bed.leases()
        if self.last_round_limit is not None and limit < self.last_round_limit:
            still = [lid for lid in before_l if lid in leases and leases[lid]["status"] == "live"]
            assert not still, f"R33: live leases {still} survived lowering the limit"
        if self.config is not None and self.config.limited_groups.value == "exclude":
            live = [x for x in leases.values() if x["status"] == "live" and x["group_name"] in group_limits]
            assert not live, f"R27/R33: live leases in limited groups {live}"

    @invariant()
    def holder_charges_at_least_what_runs(self) -> None:
        # I2 (strong form): nothing a client is running has been handed back.
        grants, leases = self.bed.grants(), self.bed.leases()
        for c in self.clients.values():
            for (kind, ident), n in c.running.items():
                if n <= 0:
                    continue
                row = (grants if kind == "grant" else leases).get(ident)
                assert row is not None, f"I2: {kind} {ident} gone while {n} items run"
                charge = row["permits"] - row["released"] if kind == "grant" else footprint(row)
                assert charge >= n, f"I2: {kind} {ident} charges {charge} < {n} running"

    @invariant()
    def aggregates_match_recomputation(self) -> None:
        check_aggregates(self.bed.storage)

    # ------------------------------------------------------------------ I3 at the end
    async def _drain(self) -> None:
        for _ in range(6):
            for c in self.clients.values():
                c.wind_down()
                await self._sync(c)
            await self.bed.clock.advance(11_000)
        u = await self.bed.usage()
        assert u["outstanding"] == 0 and u["leaseFootprint"] == 0, f"I3: {u}"
        check_aggregates(self.bed.storage)


class NoLeases(LeaseMachine):
    LEASES = None


class Strict(LeaseMachine):
    LEASES = {"provisioning": {"mode": "strict"}, "permitsPerLease": 3, "ttlMs": TTL}


class Under(LeaseMachine):
    LEASES = {"provisioning": {"mode": "under", "reserve": 4}, "permitsPerLease": 3, "ttlMs": TTL}


class OverRatio(LeaseMachine):
    LEASES = {"provisioning": {"mode": "over", "extra": {"ratio": 0.5}}, "permitsPerLease": 3, "ttlMs": TTL}


class OverCount(LeaseMachine):
    LEASES = {"provisioning": {"mode": "over", "extra": {"count": 3}}, "permitsPerLease": 2, "ttlMs": TTL,
              "limitedGroups": "withinGroupLimit"}


class StrictWithin(LeaseMachine):
    LEASES = {"provisioning": {"mode": "strict"}, "permitsPerLease": 4, "ttlMs": TTL,
              "limitedGroups": "withinGroupLimit"}


class StrictReusable(LeaseMachine):  # SPEC R28a, R30a, R31a, R34a
    LEASES = {"provisioning": {"mode": "strict"}, "permitsPerLease": 3, "ttlMs": TTL, "reusable": True,
              "leaseFirst": True}


class UnderReusable(LeaseMachine):
    LEASES = {"provisioning": {"mode": "under", "reserve": 4}, "permitsPerLease": 3, "ttlMs": TTL,
              "reusable": True, "leaseFirst": True}


TestNoLeases = NoLeases.TestCase
TestStrictReusable = StrictReusable.TestCase
TestUnderReusable = UnderReusable.TestCase
TestStrict = Strict.TestCase
TestUnder = Under.TestCase
TestOverRatio = OverRatio.TestCase
TestOverCount = OverCount.TestCase
TestStrictWithin = StrictWithin.TestCase
for _machine in (NoLeases, Strict, Under, OverRatio, OverCount, StrictWithin, StrictReusable, UnderReusable):
    _machine.TestCase.settings = SETTINGS
del _machine
