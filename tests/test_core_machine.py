"""Tier 1: Hypothesis state-machine tests over the holder's pure core (SPEC §4-§7, I1-I5; issue 9).

The machines of ``test_lease_properties.py`` drive the whole holder (asyncio, rounds, SQLite).
These drive the decisions themselves: :func:`~semaphore.core.rounds.decide_round`,
:func:`~semaphore.core.rounds.decide_sync` and :func:`~semaphore.core.rounds.decide_reclaim` over
a :class:`~semaphore.testing._memory_store.MemoryStore` (``tests/test_store_contract.py`` shows it
interchangeable with the SQL store), with the holder shell's limit resolution
(:func:`~semaphore.testing._memory_store.resolve_limits`). No SQLite, no asyncio, no clock, and
no stateful engine: each test draws a whole program of steps at once and runs it on a plain
:class:`Model` (see "The driver" below), so they run ten times the examples of those machines, at
the same depth, in about the same time.

One test per provisioning mode (none, strict, under, over by ratio and by count, strict within
group limits) and one switching leases on and off. Honest clients modelled as in
``test_lease_properties.py`` (queue items, claim grant permits and start only the confirmed
claims, R15a; draw lease permits one-shot, R34; stop retired leases, R33; return idle lease
permits when contended, R29; report cumulatively, R13, R31), and steps for: rounds of several
clients whose replies may be lost (R8, I4), two requests of one client in a round, duplicated or
with a stale snapshot before or after (R10, I2), reports of another client's grants and leases
and of ids nobody issued (R14, R32), counts inflated past what was issued (R13, R30), stale snapshots replayed by sync (I2), the same two
snapshots delivered in both orders (I2), time advancing past claim deadlines and lease TTLs with
the reclaim alarm firing or not (R15, R16, R31, I4), the limit and group limits moving or failing
to resolve (R12, R24, R33), ``canGrant`` flips (R22, R33), and invalid messages (R7, I5).

Checked after every round: I1 as SPEC states it (what the round admitted never takes the total
above the mode's ceiling, nor a group above its limit, nor grants past the ``under`` ceiling or
``over`` leases past ``extra``), nothing admitted under an unresolved limit (R12), nothing for a
refused pair (R22), R27/R33 retirements, R29 (one ``contended`` flag), R8 (every row the client
holds is in its reply). After every step: I1 in its standing form (while no ceiling was lowered
below what is charged, charged capacity stays under it), I2 in its strong form (the holder
charges every grant and lease at least what its client runs under it), the aggregates equal a
recount of the rows (R19, R38, the totals I3 is measured by), rows consistent (R13, R30). At
teardown every client drains and settles and charged capacity must return to zero (I3).

The driver. A :class:`~hypothesis.stateful.RuleBasedStateMachine` costs ~0.25 ms of engine time
per step (a machine with these rule shapes and empty rules: ~3 s for 400 examples of 30 steps),
about four times what the core's decisions and the checks cost; ``@given(st.lists(st.one_of(
st.builds(...))))`` still costs ~30 us per drawn field, twice the steps' own time. So each step
kind is a small frozen dataclass (its fields' domains beside it, its action a :class:`Model`
method) and a program is spelt by one fixed-size byte string, drawn in a single choice and
decoded (:func:`programs`, :func:`decode`): random bytes all but never spell the all-zero "no
step", so every example runs the full ``CORE_MACHINE_STEPS``, as a machine's do; one byte per
kind does the machine's swarm testing (each example leaves a random share of the kinds out);
the shrinker, lowering bytes from the front, turns kinds back on, simplifies steps and zeroes
the ones it does not need, so a failure prints as a short list of steps (the reply-order bug it
found, unknown leases answered by whichever report came last, shrank to 4 steps here, to 14 as a
machine; the holder now merges such reports, R32). Every step runs the same
action and the same checks after it as the machine rules did; the I3 drain ends early once the
store and every client hold nothing (the passes left would sync empty reports to an empty store).

Measured on the development container (2 CPUs, shared with other work; ``pytest`` wall time of
the whole file, the two files one after the other, twice), 30 steps per example:

* ``test_lease_properties.py`` (the whole holder on SQLite, six machines): 40 examples each
  (240 in all) in 6.1-6.5 s;
* this file (the pure core over ``MemoryStore``, seven programs): 400 examples each (2,800 in
  all) in 7.6-8.1 s; as seven state machines (this file before: 400 examples of 20 steps, one step
  kind fewer) 20.6-25 s, and 25-31 s at 30 steps.

So ten times the examples at the same depth take about 1.2 times the time (~2.7 ms an example,
about three quarters of it the steps' own decisions and checks, the I3 drain included).

Examples per test: ``CORE_MACHINE_EXAMPLES`` (default 400); steps: ``CORE_MACHINE_STEPS``
(default 30); derandomized, so a run is reproducible.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from honest_client import GROUPS, Client, Reports
from semaphore.core.allocation import LIMIT_ERROR, ceiling, grant_ceiling
from semaphore.core.config import LeaseConfig, LimitedGroups, Provisioning
from semaphore.core.rounds import Pending, Policy, RoundOutcome, stored_share
from semaphore.core.rows import GrantRow, LeaseRow
from semaphore.core.wire import (
    Demand,
    GrantReport,
    LeaseReport,
    PermitRequest,
    SyncMessage,
    parse_message,
)
from semaphore.errors import InvalidMessageError
from semaphore.testing._memory_store import (
    MemoryStore,
    resolve_limits,
    resolve_sync_limits,
    run_reclaim,
    run_round,
    run_sync,
)

T0 = 1_700_000_000_000
CLIENTS = ("c0", "c1", "c2", "c3")  # c3 has no lease support
TTL = 20_000
GRANT_TIMEOUT = 10_000
PERIOD = 2_000

STEPS = int(os.environ.get("CORE_MACHINE_STEPS", "30"))
SETTINGS = settings(
    max_examples=int(os.environ.get("CORE_MACHINE_EXAMPLES", "400")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,
)



def request_of(c: Client, reports: Reports, demand: tuple[Demand, ...]) -> PermitRequest:
    grants, leases = reports
    return PermitRequest(c.cid, demand, tuple(GrantReport(*g) for g in grants),
                         tuple(LeaseReport(*x) for x in leases) if c.lease_capable else None)


def sync_of(c: Client, reports: Reports) -> SyncMessage:
    grants, leases = reports
    return SyncMessage(c.cid, tuple(GrantReport(*g) for g in grants),
                       tuple(LeaseReport(*x) for x in leases) if c.lease_capable else None)


def normal_reply(reply: dict[str, Any]) -> dict[str, Any]:
    out = dict(reply)
    out["grants"] = sorted(reply["grants"], key=lambda g: g["grantId"])
    out["leases"] = sorted(reply["leases"], key=lambda x: x["leaseId"])
    return out


def lease_charge(x: LeaseRow) -> int:
    """What SPEC R30/R30a say a lease charges, spelt out here (not the row's own ``footprint``):
    its final ``drawn - released`` once stopped and retired; before that ``permits - released``,
    or every slot (``permits``) of a reusable lease (R34a: ``released`` says nothing of what
    runs now)."""
    if x.status == "retired" and x.stopped:
        return min(x.permits, x.drawn - x.released)
    return x.permits if x.reusable else x.permits - x.released


def charged(store: MemoryStore, group: str | None = None) -> int:
    """SPEC R19: grants' ``permits - released`` plus lease footprint (R30), of one group or all."""
    return (sum(g.charge for g in store.grants.values() if group is None or g.group_name == group)
            + sum(x.footprint for x in store.leases.values() if group is None or x.group_name == group))


# ============================================================================ the machine
class Ids:
    """A deterministic id factory that can be copied (to run a decision twice alike)."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def __call__(self) -> str:
        self.n += 1
        return f"id{self.n}"

    def copy(self) -> Ids:
        return Ids(self.n)


class Model:
    """The pure core over a :class:`MemoryStore`, with honest (and some hostile) clients: one
    method per kind of step (the ``rules`` sections; each step dataclass below calls one) and
    the checks: per round inside :meth:`run_round`, after every step :meth:`standing_invariants`,
    at the end :meth:`drain`."""

    def __init__(self, leases: dict[str, Any] | None, toggle: bool = False) -> None:
        self.store = MemoryStore()
        self.config = LeaseConfig.parse(leases)
        #: Switch the lease configuration on and off (``leases`` must then be ``strict``).
        self.toggle = toggle
        self.leases_on = True
        self.now = T0
        self.limit = 6
        self.limit_fails = False
        self.group_limits: dict[str, int] = {}
        self.group_fails: set[str] = set()
        self.denied: set[tuple[str, str]] = set()
        self.ids = Ids()
        self.new_secret = lambda: bytes(range(32))  # called once per storage (R32)
        self.clients = {c: Client(c, lease_capable=(c != "c3")) for c in CLIENTS}
        self.last_round_limit: int | None = None
        self.last_round_at: int | None = None
        #: I1 (standing form): charged <= ceiling since the last time a ceiling moved.
        self.tight = True
        self.tight_groups: set[str] = set()

    # ------------------------------------------------------------------ plumbing
    @property
    def lease_config(self) -> LeaseConfig | None:
        return self.config if self.leases_on else None

    def policy(self) -> Policy:
        return Policy(leases=self.lease_config, grant_timeout_ms=GRANT_TIMEOUT, round_period_ms=PERIOD,
                      new_id=self.ids, new_secret=self.new_secret)

    def ceiling(self) -> int:
        return ceiling(self.limit, self.lease_config)

    def limits(self, clients: list[Pending]) -> Any:
        return resolve_limits(
            self.store, clients, limit=LIMIT_ERROR if self.limit_fails else self.limit,
            group_limit=lambda g: LIMIT_ERROR if g in self.group_fails else self.group_limits.get(g),
            can_grant=lambda c, g: (c, g) not in self.denied, leases_configured=self.lease_config is not None)

    def starving(self) -> int:
        """R31a: the last round's count, as the holder keeps it (meta ``starving``)."""
        return int(self.store.meta().get("starving", 0))

    def share(self) -> int | None:
        """R31b: the last round's fair share, as the holder keeps it (meta ``lease_share``)."""
        return stored_share(self.store.meta())

    def next_request_at(self) -> int:
        return self.now if self.last_round_at is None else max(self.now, self.last_round_at + PERIOD)

    def sync_limits(self, message: SyncMessage) -> tuple[Any, bool]:
        """R33a: what the holder resolves for a sync (the limit, its client's lease groups')."""
        return resolve_sync_limits(
            self.store, message, limit=LIMIT_ERROR if self.limit_fails else self.limit,
            group_limit=lambda g: LIMIT_ERROR if g in self.group_fails else self.group_limits.get(g),
            leases_configured=self.lease_config is not None, can_grant=lambda c, g: (c, g) not in self.denied)

    def sync(self, c: Client, message: SyncMessage | None = None,
             limits: tuple[Any, bool] | None = None) -> dict[str, Any]:
        """A sync (R6) of ``c``'s reports, answered with the last round's flag (R29), retiring
        what a lowered limit makes ineligible (R33a; ``limits``: as resolved for it) and
        reusable leases above the last round's fair share (R31b)."""
        message = message or sync_of(c, c.reports())
        contended = bool(self.store.meta().get("contended", 0))
        resolved, lowered = self.sync_limits(message) if limits is None else limits
        reply = run_sync(self.store, self.now, message, self.policy(), contended, self.next_request_at(),
                         self.starving(), resolved, lowered, share=self.share()).reply
        self.check_reply_lists_everything(c.cid, reply)
        c.absorb(reply)
        c.confirm(reply)
        return reply

    def after_reply(self, c: Client) -> None:
        c.draw()
        if c.claims_to_make():
            self.sync(c)
        c.draw()

    def run_round(self, clients: list[Pending]) -> RoundOutcome:
        """One round with every per-round check (I1, R12, R22, R27, R29, R33, R8)."""
        before_grants, before_leases = set(self.store.grants), set(self.store.leases)
        limits = self.limits(clients)
        outcome = run_round(self.store, self.now, clients, limits, self.policy())
        new_g = [g for i, g in self.store.grants.items() if i not in before_grants]
        new_l = [x for i, x in self.store.leases.items() if i not in before_leases]
        self.check_i1(new_g, new_l)
        self.check_r12_r22(new_g, new_l, outcome)
        self.check_r33(before_leases)
        for cid, reply in outcome.replies.items():
            assert reply["contended"] == outcome.contended  # R29: every reply of the round
            self.check_reply_lists_everything(cid, reply)
        self.last_round_at = self.now
        if not self.limit_fails:
            self.last_round_limit = self.limit
        return outcome

    def pending(self, cid: str, arrival: int, variant: str) -> Pending:
        """R10: the client's request, alone, twice, or with a stale snapshot before or after
        (the latest demand wins; every report is applied)."""
        c = self.clients[cid]
        demand = c.demand()
        stale = c.history[0] if c.history else None
        current = request_of(c, c.reports(), demand)
        if variant == "twice":
            return Pending(cid, arrival, [current, current])
        if variant == "stale first" and stale is not None:
            return Pending(cid, arrival, [request_of(c, stale, demand), current])
        if variant == "stale last" and stale is not None:
            return Pending(cid, arrival, [current, request_of(c, stale, demand)])
        return Pending(cid, arrival, [current])

    # ------------------------------------------------------------------ rules: clients
    def add_items(self, client: str, group: str, n: int) -> None:
        c = self.clients[client]
        c.queue[group] += [self.now] * n
        c.draw()  # R34: lease draws need no round trip

    def round(self, mask: int, group: str, add: int, variant: str, lose: bool) -> None:
        # R8-R33 in one round; a lost reply (I4) is healed by the client's next contact (R8).
        # ``mask`` picks the members (one draw instead of a list's), each of which first queues
        # ``add`` items in ``group`` (so most rounds have demand).
        members = [cid for i, cid in enumerate(CLIENTS) if mask >> i & 1]
        if mask % 3 == 0:
            members.reverse()  # arrival order matters for ties (R21)
        for cid in members:
            if add:
                self.add_items(cid, group, add)
        clients = [self.pending(cid, i, variant if i == 0 else "once") for i, cid in enumerate(members)]
        outcome = self.run_round(clients)
        for i, cid in enumerate(members):
            if lose and i == 0:
                continue  # the reply is lost: nothing learnt until the next contact (R8, I4)
            c = self.clients[cid]
            c.absorb(outcome.replies[cid])
            self.after_reply(c)

    def heartbeat(self, client: str, finish: str | None) -> None:
        # R6, R31: a sync of the client's reports; with ``finish``, every running item of that
        # kind completes first (and leases are stopped, R30).
        c = self.clients[client]
        if finish is not None:
            self.finish_work(c, finish)
        self.sync(c)
        self.after_reply(c)

    def release(self, client: str, pick: int) -> None:
        c = self.clients[client]
        busy = sorted(k for k, n in c.running.items() if n > 0)
        if busy:
            kind, ident = busy[pick % len(busy)]
            c.running[(kind, ident)] -= 1
            (c.grants if kind == "grant" else c.leases)[ident]["released"] += 1

    @staticmethod
    def finish_work(c: Client, kind: str) -> None:
        for (k, ident), n in list(c.running.items()):
            if k == kind and n > 0:
                (c.grants if kind == "grant" else c.leases)[ident]["released"] += n
                c.running[(k, ident)] = 0
        if kind == "lease":
            for x in c.leases.values():
                x["stopped"] = True

    # ------------------------------------------------------------------ rules: hostile reports
    def late_reports(self, client: str, both_orders: bool, pick: int, pick2: int) -> None:
        # I2: late, repeated or reordered reports (by sync, or in a round in both orders).
        if both_orders:
            self.reports_in_both_orders(client, pick, pick2)
        else:
            self.replay_stale_report(client, pick)

    def replay_stale_report(self, client: str, pick: int) -> None:
        # I2, R13: an old snapshot re-sent late changes nothing an empty sync would not,
        # but the heartbeat of the live leases it names (R31).
        c = self.clients[client]
        if not c.history:
            return
        stale = c.history[pick % len(c.history)]
        reference = self.store.clone()
        contended = bool(self.store.meta().get("contended", 0))
        message = sync_of(c, stale)
        limits = self.sync_limits(message)  # the same limits for both (R33a retires alike)
        run_sync(reference, self.now, sync_of(c, ((), ())), self.policy(), contended, self.next_request_at(),
                 self.starving(), *limits, share=self.share())
        reply = self.sync(c, message, limits)
        heartbeats = {lid for lid, *_ in stale[1]}
        # R31b: a replay reports leases an empty sync does not, so it may retire a live
        # reusable one above the fair share; that frees nothing (R30a), all else is the same
        now, then = self.store.state(), reference.state()
        trimmed = {lid for lid in heartbeats if lid in now["leases"] and lid in then["leases"]
                   and now["leases"][lid].reusable and not now["leases"][lid].stopped
                   and (then["leases"][lid].status, now["leases"][lid].status) == ("live", "retired")}
        assert strip(as_live(now, trimmed), heartbeats) == strip(as_live(then, trimmed), heartbeats), \
            "I2: a replay changed state"
        for s in reply["grants"]:  # R13: answered with the holder's marks, never the stale ones
            row = self.store.grants.get(s["grantId"])
            if row is not None:
                assert (s["claimed"], s["released"]) == (row.claimed, row.released)

    def reports_in_both_orders(self, client: str, pick: int, pick2: int) -> None:
        # I2: two delivered snapshots, in a round in either order, leave the same state as the
        # newer alone: reordered reports never free capacity twice.
        c = self.clients[client]
        if len(c.history) < 2:
            return
        i, j = pick % len(c.history), pick2 % (len(c.history) - 1)  # two distinct snapshots
        i, j = sorted((i, j + (j >= i)))
        older, newer = (request_of(c, c.history[k], ()) for k in (i, j))
        limits = self.limits([Pending(c.cid, 0, [newer])])
        results = []
        for messages in ([older, newer], [newer, older], [newer]):
            store = self.store.clone()
            outcome = run_round(store, self.now, [Pending(c.cid, 0, list(messages))], limits, self.policy())
            results.append((store, outcome))
        assert results[0][0].state() == results[1][0].state() == results[2][0].state(), "I2: order mattered"
        # The replies agree too, also for leases the holder does not know (group None): their
        # reports in one round merge as high-water marks (R13, R32), whatever the order.
        replies = [normal_reply(results[k][1].replies[c.cid]) for k in (0, 1)]
        assert replies[0] == replies[1], "I2: the reply depended on the order"
        self.store = results[1][0]
        self.last_round_at = self.now
        c.absorb(results[1][1].replies[c.cid])

    def foreign_and_unknown_ids(self, member: str, in_round: bool, n: int) -> None:
        # R14: a report of another client's grant is not applied and answered not_found; R32:
        # one of another client's lease or of a made-up id is answered as unknown (group None),
        # charged nothing (its id does not verify for the reporter) and applied to nothing. So
        # the round or sync leaves exactly the state the honest reports alone would.
        c = self.clients[member]
        grants, leases = c.reports()
        foreign_g = sorted((g for g in self.store.grants.values() if g.client_id != member),
                           key=lambda g: g.grant_id)[:2]
        foreign_l = sorted((x for x in self.store.leases.values() if x.client_id != member),
                           key=lambda x: x.lease_id)[:2]
        hostile: Reports = (
            grants + tuple((g.grant_id, n, n) for g in foreign_g) + (("ghost", n, 0),),
            leases + tuple((x.lease_id, n, 0, False) for x in foreign_l) + (("ghost.0.1.0", n, 0, n % 2 == 0),))
        reference, ids = self.store.clone(), self.ids.copy()
        policy = Policy(leases=self.lease_config, grant_timeout_ms=GRANT_TIMEOUT, round_period_ms=PERIOD,
                        new_id=ids, new_secret=self.new_secret)
        if in_round:
            demand = c.demand()
            honest = [Pending(member, 0, [request_of(c, (grants, leases), demand)])]
            run_round(reference, self.now, honest, self.limits(honest), policy)
            reply = self.run_round([Pending(member, 0, [request_of(c, hostile, demand)])]).replies[member]
        else:
            contended = bool(self.store.meta().get("contended", 0))
            message = sync_of(c, hostile)
            limits = self.sync_limits(message)
            run_sync(reference, self.now, sync_of(c, (grants, leases)), policy, contended, self.next_request_at(),
                     self.starving(), *limits, share=self.share())
            reply = self.sync(c, message, limits)
        assert self.store.state() == reference.state(), "R14/R32: a foreign or unknown report changed state"
        answers = {s["grantId"]: s for s in reply["grants"]}
        for gid in [g.grant_id for g in foreign_g] + ["ghost"]:
            assert answers[gid]["status"] == "not_found" and answers[gid]["group"] is None  # R14
        if c.lease_capable:
            lease_answers = {s["leaseId"]: s for s in reply["leases"]}
            for lid in [x.lease_id for x in foreign_l] + ["ghost.0.1.0"]:
                assert lease_answers[lid]["group"] is None and lease_answers[lid]["status"] != "live"  # R32
        if in_round:
            c.absorb(reply)
        self.after_reply(c)

    def over_report(self, client: str, by: int) -> None:
        # R13, R30: counts reported past what was issued are clamped (claimed to the grant's
        # permits; drawn to the lease's permits, or to its final drawn once stopped; a live
        # reusable lease's drawn has no cap, R34a, so it is not inflated here). Inflated
        # where the client has nothing left to claim or draw, a sync changes exactly what the
        # honest one would (the same leases heartbeat, R31).
        c = self.clients[client]
        grants, leases = c.reports(record=False)
        rows = self.store.leases
        inflated: Reports = (
            tuple((gid, cl + by if cl >= c.grants[gid]["permits"] else cl, rl) for gid, cl, rl in grants),
            tuple((lid, d + by if ((d >= c.leases[lid]["permits"] and not c.leases[lid]["reusable"])
                                   or (lid in rows and rows[lid].stopped)) else d, rl, st_)
                  for lid, d, rl, st_ in leases))  # a live reusable lease's drawn is not capped (R34a)
        if inflated == (grants, leases):
            return
        reference = self.store.clone()
        policy = Policy(leases=self.lease_config, grant_timeout_ms=GRANT_TIMEOUT, round_period_ms=PERIOD,
                        new_id=self.ids.copy(), new_secret=self.new_secret)
        contended = bool(self.store.meta().get("contended", 0))
        message = sync_of(c, inflated)
        limits = self.sync_limits(message)
        run_sync(reference, self.now, sync_of(c, (grants, leases)), policy, contended, self.next_request_at(),
                 self.starving(), *limits, share=self.share())
        self.sync(c, message, limits)
        assert self.store.state() == reference.state(), "R13/R30: an inflated report was not clamped"
        self.after_reply(c)

    # ------------------------------------------------------------------ rules: time and limits
    def advance(self, ms: int, alarm: bool) -> None:
        # R15, R16, R31: time passes; the reclaim alarm fires at each due time, or is delayed.
        target = self.now + ms
        if alarm:
            due = self.store.next_reclaim_due()
            while due is not None and due <= target:
                self.now = max(self.now, due)
                run_reclaim(self.store, self.now)
                due = self.store.next_reclaim_due()
                assert due is None or due > self.now, f"R15/R16: the alarm at {self.now} left a grant due"
        self.now = target
        if alarm:  # I4: unclaimed grant permits came back by their deadline
            late = [g for g in self.store.grants.values() if g.claimed < g.permits and g.claim_by <= self.now]
            assert not late, f"I4: unclaimed permits past their deadline {late}"

    def set_limit(self, limit: int, toggle_leases: bool) -> None:
        # R24: limits are live; R33: a lowered limit retires live leases; -1: the limit fails
        # to resolve (R12) until set again. ``toggle_leases`` (models with ``toggle``): leases
        # off, no new ones, those live still count and retire (R25, R33); or on again.
        self.limit_fails = limit < 0
        self.limit = self.limit if limit < 0 else limit
        if self.toggle and toggle_leases:
            self.leases_on = not self.leases_on
        self.retighten()

    def set_group_limit(self, group: str, gl: int | None, fails: bool) -> None:
        if gl is None:
            self.group_limits.pop(group, None)
        else:
            self.group_limits[group] = gl
        (self.group_fails.add if fails else self.group_fails.discard)(group)  # R12: fails closed
        self.retighten()

    def can_grant(self, client: str, group: str, allowed: bool) -> None:
        (self.denied.discard if allowed else self.denied.add)((client, group))  # R22, R33

    def invalid_message(self, client: str, mutation: str) -> None:
        # R7, I5: an invalid message is refused naming its field, and changes nothing.
        c = self.clients[client]
        message = request_of(c, c.reports(record=False), c.demand()).to_wire()
        assert isinstance(parse_message(message), PermitRequest)
        bad, field_name = mutate(message, mutation)
        before = self.store.state()
        with pytest.raises(InvalidMessageError) as refused:
            parse_message(bad)
        assert refused.value.field == field_name, (refused.value.field, field_name)
        assert self.store.state() == before

    def retighten(self) -> None:
        """I1 standing form: a ceiling that moved holds from now on if charged is under it."""
        self.tight = charged(self.store) <= self.ceiling()
        self.tight_groups = {g for g, gl in self.group_limits.items() if charged(self.store, g) <= gl}

    # ------------------------------------------------------------------ per-round checks
    def check_i1(self, new_g: list[GrantRow], new_l: list[LeaseRow]) -> None:
        """I1 as SPEC states it, for the round just run."""
        config, limit = self.lease_config, self.limit
        outstanding = sum(g.charge for g in self.store.grants.values())
        lease_fp = sum(x.footprint for x in self.store.leases.values())
        if config is None:
            assert not new_l, "R25: no leases without lease config"
        extra = config.extra(limit) if config else 0
        if new_g or new_l:
            assert outstanding + lease_fp <= limit + extra, f"I1: {outstanding}+{lease_fp} > {limit}+{extra}"
        if new_g:
            if config is not None and config.mode is Provisioning.UNDER:
                assert outstanding <= grant_ceiling(limit, config), "I1: grants past the under ceiling"
            assert outstanding + max(0, lease_fp - extra) <= limit, "I1: grants past the limit"
        if new_l and config is not None and config.mode is Provisioning.OVER:
            assert lease_fp <= extra, "I1: over leases past extra"
        for group in {x.group_name for x in [*new_g, *new_l]}:
            gl = self.group_limits.get(group)
            if gl is not None:
                assert charged(self.store, group) <= gl, f"I1: group {group} above {gl} after admitting"
                if config is None or config.limited_groups is LimitedGroups.EXCLUDE:
                    assert not [x for x in new_l if x.group_name == group], "R27: lease in a limited group"

    def check_r12_r22(self, new_g: list[GrantRow], new_l: list[LeaseRow], outcome: RoundOutcome) -> None:
        """R12: an unresolved limit admits nothing, an unresolved group limit nothing in its
        group; R22: nothing for a refused pair, which waits with ``not_permitted`` (R23)."""
        rows: list[GrantRow | LeaseRow] = [*new_g, *new_l]
        if self.limit_fails:
            assert not rows, "R12: admitted under an unresolved limit"
        assert not [r for r in rows if r.group_name in self.group_fails], "R12: admitted in a failed group"
        assert not [r for r in rows if (r.client_id, r.group_name) in self.denied], "R22: admitted a refused pair"
        for cid, reply in outcome.replies.items():
            for b in reply["blocked"]:
                if (cid, b["group"]) in self.denied:
                    assert b["reason"] == "not_permitted", b  # R23: the first constraint
                elif self.limit_fails or b["group"] in self.group_fails:
                    assert b["reason"] == "limit_resolution_error", b

    def check_r33(self, before_leases: set[str]) -> None:
        """R33: lowering the limit retires every live lease; R27/R33 (``exclude``): no live lease
        in a limited group; R33: none of a pair ``canGrant`` refuses."""
        live = [x for x in self.store.leases.values() if x.status == "live"]
        if (self.last_round_limit is not None and not self.limit_fails and self.limit < self.last_round_limit):
            assert not [x for x in live if x.lease_id in before_leases], "R33: live leases survived a lowered limit"
        config = self.lease_config
        if config is None or config.limited_groups is LimitedGroups.EXCLUDE:
            assert not [x for x in live if x.group_name in self.group_limits
                        and x.group_name not in self.group_fails], "R27/R33: live lease in a limited group"
        assert not [x for x in live if (x.client_id, x.group_name) in self.denied], "R33: live lease refused"

    def check_reply_lists_everything(self, cid: str, reply: dict[str, Any]) -> None:
        """R8 (and I4: a lost reply heals at the next contact): every grant and lease the client
        holds is in its reply."""
        assert "error" not in reply, reply
        grants = {s["grantId"] for s in reply["grants"] if s["status"] != "not_found"}
        leases = {s["leaseId"] for s in reply["leases"] if s["status"] != "settled"}
        assert {g.grant_id for g in self.store.grants.values() if g.client_id == cid} <= grants, "R8: grant missing"
        assert {x.lease_id for x in self.store.leases.values() if x.client_id == cid} <= leases, "R8: lease missing"

    # ------------------------------------------------------------------ invariants
    def standing_invariants(self) -> None:
        """After every step (and before the first): I1, I2, R19/R38."""
        self.i1_charged_stays_under_a_ceiling_that_did_not_drop()
        self.i2_holder_charges_at_least_what_runs()
        self.aggregates_equal_a_recount()

    def i1_charged_stays_under_a_ceiling_that_did_not_drop(self) -> None:
        # I1: admissions stop at the ceiling and nothing else raises a charge, so while no
        # ceiling was lowered below what is charged, charged capacity stays under it.
        if self.tight:
            assert charged(self.store) <= self.ceiling(), f"I1: {charged(self.store)} > {self.ceiling()}"
        for group in self.tight_groups:
            assert charged(self.store, group) <= self.group_limits[group], f"I1: group {group}"

    def i2_holder_charges_at_least_what_runs(self) -> None:
        # I2 (strong form): nothing a client is running has been handed back.
        for c in self.clients.values():
            for (kind, ident), n in c.running.items():
                if n > 0:
                    row = (self.store.grants if kind == "grant" else self.store.leases).get(ident)
                    assert row is not None, f"I2: {kind} {ident} gone while {n} items run"
                    assert (row.charge if isinstance(row, GrantRow) else lease_charge(row)) >= n, f"I2: {kind} {ident}"

    def aggregates_equal_a_recount(self) -> None:
        # R19, R38 (what I3 is measured by): group rows and meta totals equal a recount; rows
        # are consistent (R13, R30) and settled rows are gone (R15, R17, R30).
        recount = self.store.recount()
        assert self.store.groups == recount, (self.store.groups, recount)
        totals = self.store.totals()
        assert totals == {a: sum(r[a] for r in recount.values()) for a in totals}
        for g in self.store.grants.values():
            assert 0 <= g.released <= g.claimed <= g.permits and g.claim_by >= g.issued_at, g
            # R17: a fully released grant is deleted; R15: so is one reclaimed with nothing claimed
            assert g.released < g.permits, f"R15/R17: settled grant kept {g}"
        for x in self.store.leases.values():
            assert 0 <= x.released <= x.drawn and (x.reusable or x.drawn <= x.permits), x  # R30, R34a
            assert x.status in ("live", "retired"), x
            assert not (x.stopped and x.released >= x.drawn), f"R30: settled lease kept {x}"
            assert not (x.stopped and x.status == "live"), f"R30: stopped lease still live {x}"

    # ------------------------------------------------------------------ I3 at the end
    def drain(self) -> None:
        # I3: once every client releases, stops and reports, and deadlines pass, nothing is charged.
        for _ in range(6):
            for c in self.clients.values():
                c.wind_down()
                self.sync(c)
            self.advance(GRANT_TIMEOUT + 1_000, alarm=True)
            if not (self.store.grants or self.store.leases
                    or any(c.grants or c.leases for c in self.clients.values())):
                break  # drained, and known to be: the passes left would sync empty reports
        assert charged(self.store) == 0 and self.store.totals()["lease_footprint"] == 0, f"I3: {self.store.totals()}"
        assert not self.store.grants and not self.store.leases and not self.store.groups


def as_live(state: dict[str, dict[str, Any]], lease_ids: set[str]) -> dict[str, dict[str, Any]]:
    """``state`` with the named leases live, and without the live/retired lease counts they
    move (R31b: a retirement that charges what it did, R30a)."""
    if not lease_ids:
        return state
    out = dict(state)
    out["leases"] = {i: replace(x, status="live") if i in lease_ids else x for i, x in state["leases"].items()}
    counts = ("live_leases", "retired_leases")
    out["groups"] = {g: {k: v for k, v in row.items() if k not in counts} for g, row in state["groups"].items()}
    out["meta"] = {k: v for k, v in state["meta"].items() if k not in counts}
    return out


def strip(state: dict[str, dict[str, Any]], lease_ids: set[str]) -> dict[str, dict[str, Any]]:
    """``state`` without the ``expires_at`` of the named leases (a heartbeat moves it, R31)."""
    out = dict(state)
    out["leases"] = {i: (x.lease_id, x.drawn, x.released, x.stopped, x.status) if i in lease_ids else x
                     for i, x in state["leases"].items()}
    return out


def mutate(message: dict[str, Any], mutation: str) -> tuple[dict[str, Any], str]:
    """One invalid change to a valid request (R7) and the field its error must name."""
    m = {**message, "demand": [dict(d) for d in message["demand"]], "grants": [dict(g) for g in message["grants"]]}
    if mutation == "released>claimed":
        m["grants"].append({"grantId": "x", "claimed": 1, "released": 2})
        return m, f"grants[{len(m['grants']) - 1}].released"
    if mutation == "v":
        return {**m, "v": 2}, "v"
    if mutation == "type":
        return {**m, "type": "Request"}, "type"
    if mutation == "client id":
        return {**m, "clientId": "c" * 257}, "clientId"
    if mutation == "count":
        m["demand"].append({"group": "fresh", "count": -1, "oldestAt": 0})
        return m, f"demand[{len(m['demand']) - 1}].count"
    if mutation == "duplicate group":
        m["demand"] += [{"group": "dup", "count": 1, "oldestAt": 0}] * 2
        return m, f"demand[{len(m['demand']) - 1}].group"
    m["leases"] = [{"leaseId": "dup", "drawn": 0, "released": 0, "stopped": False}] * 2
    return m, "leases[1].leaseId"


# ============================================================================ the steps
# One frozen dataclass per kind of step, naming the model action it runs, with the domain of
# each of its fields (``DOMAINS``, in field order; a value listed twice is drawn twice as often).
# A failing example prints, and shrinks to, the list of steps, e.g. ``[AddItems(client='c0',
# group='g0', n=2), Round(mask=1, group='g0', add=0, variant='once', lose=False)]``. ``pick``
# fields choose among what the state offers when the step runs (a running item, a report
# snapshot): ``pick % len(choices)``.
_BYTE = range(256)


@dataclass(frozen=True)
class AddItems:
    client: str
    group: str
    n: int
    DOMAINS = (CLIENTS, GROUPS, range(1, 6))

    def apply(self, m: Model) -> None:
        m.add_items(self.client, self.group, self.n)


@dataclass(frozen=True)
class Round:
    mask: int
    group: str
    add: int
    variant: str
    lose: bool
    DOMAINS = (range(1, 2 ** len(CLIENTS)), GROUPS, range(5),
               ("once", "once", "twice", "stale first", "stale last"), (False, True))

    def apply(self, m: Model) -> None:
        m.round(self.mask, self.group, self.add, self.variant, self.lose)


@dataclass(frozen=True)
class Heartbeat:
    client: str
    finish: str | None
    DOMAINS = (CLIENTS, (None, None, "grant", "lease"))

    def apply(self, m: Model) -> None:
        m.heartbeat(self.client, self.finish)


@dataclass(frozen=True)
class Release:
    client: str
    pick: int
    DOMAINS = (CLIENTS, _BYTE)

    def apply(self, m: Model) -> None:
        m.release(self.client, self.pick)


@dataclass(frozen=True)
class LateReports:
    client: str
    both_orders: bool
    pick: int
    pick2: int
    DOMAINS = (CLIENTS, (False, True), _BYTE, _BYTE)

    def apply(self, m: Model) -> None:
        m.late_reports(self.client, self.both_orders, self.pick, self.pick2)


@dataclass(frozen=True)
class ForeignIds:
    member: str
    in_round: bool
    n: int
    DOMAINS = (CLIENTS, (False, True), range(9))

    def apply(self, m: Model) -> None:
        m.foreign_and_unknown_ids(self.member, self.in_round, self.n)


@dataclass(frozen=True)
class OverReport:
    client: str
    by: int
    DOMAINS = (CLIENTS, range(1, 4))

    def apply(self, m: Model) -> None:
        m.over_report(self.client, self.by)


@dataclass(frozen=True)
class Advance:
    ms: int
    alarm: bool
    DOMAINS = ((500, 2_000, 6_000, 11_000, TTL // 2, TTL), (False, True))

    def apply(self, m: Model) -> None:
        m.advance(self.ms, self.alarm)


@dataclass(frozen=True)
class SetLimit:
    limit: int
    toggle_leases: bool
    DOMAINS = (range(-1, 11), (False, True))

    def apply(self, m: Model) -> None:
        m.set_limit(self.limit, self.toggle_leases)


@dataclass(frozen=True)
class SetGroupLimit:
    group: str
    gl: int | None
    fails: bool
    DOMAINS = (GROUPS, (None,) * 7 + tuple(range(7)), (False, False, False, True))  # None half the time

    def apply(self, m: Model) -> None:
        m.set_group_limit(self.group, self.gl, self.fails)


@dataclass(frozen=True)
class CanGrant:
    client: str
    group: str
    allowed: bool
    DOMAINS = (CLIENTS, GROUPS, (False, True))

    def apply(self, m: Model) -> None:
        m.can_grant(self.client, self.group, self.allowed)


@dataclass(frozen=True)
class InvalidMessage:
    client: str
    mutation: str
    DOMAINS = (CLIENTS, ("released>claimed", "v", "count", "duplicate group", "duplicate lease",
                         "client id", "type"))

    def apply(self, m: Model) -> None:
        m.invalid_message(self.client, self.mutation)


KINDS: tuple[Any, ...] = (AddItems, Round, Heartbeat, Release, LateReports, ForeignIds, OverReport, Advance,
                          SetLimit, SetGroupLimit, CanGrant, InvalidMessage)
STEP_BYTES = 4  # one to choose the kind, three for its fields (2**24 is a multiple of, or far above, each size)
_SIZES = {k: math.prod(len(d) for d in k.DOMAINS) for k in KINDS}


def decode(raw: bytes) -> list[Any]:
    """The program a byte string spells (the encoding is explained in :func:`programs`)."""
    header, body = raw[:1 + len(KINDS)], raw[1 + len(KINDS):]
    p, marks = header[0], header[1:]  # swarm: a kind is left out if its mark is below p (none if p is 0)
    enabled = ([k for k, u in zip(KINDS, marks) if u >= p]
               or [KINDS[marks.index(max(marks))]])  # at least one (the one marked highest)
    steps = []
    for i in range(0, len(body) - STEP_BYTES + 1, STEP_BYTES):
        chunk = body[i:i + STEP_BYTES]
        if not any(chunk):
            continue  # an all-zero step is no step: what the shrinker deletes a step to
        kind = enabled[chunk[0] % len(enabled)]
        index = int.from_bytes(chunk[1:], "big") % _SIZES[kind]
        values = []
        for domain in reversed(kind.DOMAINS):  # the first field is the most significant digit
            index, r = divmod(index, len(domain))
            values.append(domain[r])
        steps.append(kind(*reversed(values)))
    return steps


def programs(max_steps: int = STEPS) -> st.SearchStrategy[list[Any]]:
    """Programs of ``max_steps`` steps (each of the kinds above, among those this example
    enables), spelt by one fixed-size byte string: Hypothesis draws it in one choice, where one
    draw per field (``st.lists(st.one_of(st.builds(...)))``) costs ~30 us a draw, ~5x the time
    the steps themselves take; random bytes almost never spell an all-zero step, so every
    example runs at full depth, as a state machine's do. The first byte and one per kind are
    swarm testing as a state machine does it (``FeatureFlags``: an example leaves each kind out
    with one probability drawn per example; shrinking enables them all); then ``STEP_BYTES`` per
    step: the kind among those enabled, then its fields' digits. Shrinking lowers bytes from the
    front: kinds back on, then each step towards the first kind, its first values, and none."""
    size = 1 + len(KINDS) + max_steps * STEP_BYTES
    return st.binary(min_size=size, max_size=size).map(decode)


def run_program(leases: dict[str, Any] | None, steps: list[Any], toggle: bool = False) -> None:
    m = Model(leases, toggle)
    m.standing_invariants()
    for step in steps:
        step.apply(m)
        m.standing_invariants()
    m.drain()


# ============================================================================ the configurations
NO_LEASES = None
STRICT = {"provisioning": {"mode": "strict"}, "permitsPerLease": 3, "ttlMs": TTL}
UNDER = {"provisioning": {"mode": "under", "reserve": 4}, "permitsPerLease": 3, "ttlMs": TTL}
OVER_RATIO = {"provisioning": {"mode": "over", "extra": {"ratio": 0.5}}, "permitsPerLease": 3, "ttlMs": TTL}
OVER_COUNT = {"provisioning": {"mode": "over", "extra": {"count": 3}}, "permitsPerLease": 2, "ttlMs": TTL,
              "limitedGroups": "withinGroupLimit"}
STRICT_WITHIN = {"provisioning": {"mode": "strict"}, "permitsPerLease": 4, "ttlMs": TTL,
                 "limitedGroups": "withinGroupLimit"}
ON_OFF = {"provisioning": {"mode": "strict"}, "permitsPerLease": 2, "ttlMs": TTL}  # toggled
# SPEC R28a, R30a, R31a, R34a: reusable slots, sized before grants
REUSABLE = {"provisioning": {"mode": "strict"}, "permitsPerLease": 3, "ttlMs": TTL, "reusable": True,
            "leaseFirst": True}
REUSABLE_OVER = {"provisioning": {"mode": "over", "extra": {"count": 3}}, "permitsPerLease": 2, "ttlMs": TTL,
                 "limitedGroups": "withinGroupLimit", "reusable": True, "leaseFirst": True}


@SETTINGS
@given(steps=programs())
def test_no_leases(steps: list[Any]) -> None:
    run_program(NO_LEASES, steps)


@SETTINGS
@given(steps=programs())
def test_strict(steps: list[Any]) -> None:
    run_program(STRICT, steps)


@SETTINGS
@given(steps=programs())
def test_under(steps: list[Any]) -> None:
    run_program(UNDER, steps)


@SETTINGS
@given(steps=programs())
def test_over_ratio(steps: list[Any]) -> None:
    run_program(OVER_RATIO, steps)


@SETTINGS
@given(steps=programs())
def test_over_count(steps: list[Any]) -> None:
    run_program(OVER_COUNT, steps)


@SETTINGS
@given(steps=programs())
def test_strict_within(steps: list[Any]) -> None:
    run_program(STRICT_WITHIN, steps)


@SETTINGS
@given(steps=programs())
def test_leases_on_off(steps: list[Any]) -> None:
    run_program(ON_OFF, steps, toggle=True)


@SETTINGS
@given(steps=programs())
def test_strict_reusable_lease_first(steps: list[Any]) -> None:
    run_program(REUSABLE, steps)


@SETTINGS
@given(steps=programs())
def test_over_reusable_within_group_limits(steps: list[Any]) -> None:
    run_program(REUSABLE_OVER, steps)
