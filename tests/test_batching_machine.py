"""Tier 1: a Hypothesis state machine over the holder's batching shell (SPEC R4, R9, R9a, R9b,
R10, I1; the R9 decisions "waiting requests" and "limits that rise").

``test_core_machine.py`` drives the pure decisions; ``test_lease_properties.py`` the holder on
SQLite through whole rounds, one call at a time. This one drives what lies between: calls that
wait for rounds and are held open, on the real holder (:class:`~semaphore.testing.Bed`, SQLite,
a virtual clock), with requests sent without waiting for their answer, so several of one client
wait together (R10), tries among them (R9b), rounds run at once and declined (R9a), batched
rounds (R9), held requests (``hold_blocked_ms``, ``waitMs``) freed by releases, deadlines and a
callable limit that moves (up: the held requests' round starts by itself; down), and evictions
while calls wait (R4).

Checked after every step:

* R4 and the R9 bound: no call waits for ever. An eviction answers every waiting call at once
  (``round_failed``); otherwise a call is answered within its hold (``waitMs`` capped by
  ``hold_blocked_ms``; a call of a client that asked with ``waitMs`` may join its held request,
  R10, and wait with it) plus a round's wait and two round periods (the round its deadline
  allows, and one it may have just missed).
* The R9 decision "limits that rise": while requests are held and the limit is above the one
  the last committed round resolved, a round comes within ``limit_check_ms`` plus a round
  period and a round's wait (the ``wait_behind`` step builds held requests, which random steps
  seldom do; the claim step keeps capacity charged, so a hold that ignored its deadline shows).
* R10: calls of one client answered at the same instant by one round carry the same answer.
* I1: a committed round that admitted anything leaves charged capacity within its limit.
* The aggregates equal a recount of the rows (:meth:`~semaphore.testing.Bed.check`).

At teardown every client releases what it holds and charged capacity returns to zero (I3).

Examples: ``BATCHING_MACHINE_EXAMPLES`` (default 100), 40 steps each; derandomized.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from semaphore.testing import Bed, request, sync

CLIENTS = ("a", "b", "c")
HOLD = 20_000  # longer than a risen limit may take to reach a held request
WAIT = 1_000
PERIOD = 2_000

SETTINGS = settings(
    max_examples=int(os.environ.get("BATCHING_MACHINE_EXAMPLES", "100")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,
)


@dataclass
class Call:
    client: str
    task: asyncio.Task[dict[str, Any]]
    sent_at: int
    hold_ms: int
    #: Evictions before it was sent.
    epoch: int
    answered_at: int | None = None
    #: Its answer's grants were noted.
    seen: bool = False


@dataclass
class Holdings:
    """One client's grants (grant id -> permits): each is claimed and released in one report."""

    grants: dict[str, int] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)

    def reports(self) -> list[tuple[str, int, int]]:
        return [(gid, n, n if gid in self.released else 0) for gid, n in sorted(self.grants.items())]


class BatchingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.box = {"limit": 2}
        self.records: list[Any] = []

        async def make() -> Bed:
            return Bed(limit=lambda: self.box["limit"], leases=None, hold_blocked_ms=HOLD, round_wait_ms=WAIT,
                       round_period_ms=PERIOD, on_round=self.records.append)

        self.bed = self.loop.run_until_complete(make())
        self.clients = {c: Holdings() for c in CLIENTS}
        self.calls: list[Call] = []
        #: Since when requests are held while the limit is above the last committed round's.
        self.rose_since: int | None = None

    def teardown(self) -> None:
        try:
            self._run(self._drain())
        finally:
            self.bed.driver.close()
            self.bed.tasks.cancel()

            async def cancel_the_rest() -> None:
                rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in rest:
                    task.cancel()
                await asyncio.gather(*rest, return_exceptions=True)

            self.loop.run_until_complete(cancel_the_rest())
            self.loop.close()

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def _advance(self, ms: int) -> None:
        await self.bed.clock.advance(ms)
        self._collect()

    def _answered(self, call: Call) -> None:
        """A call's answer came: when (the virtual instant, not the end of the step)."""
        if call.answered_at is None:
            call.answered_at = self.bed.now

    def _collect(self) -> None:
        """Note the grants each answer that came tells its client of."""
        for call in self.calls:
            if call.task.done() and not call.seen:
                call.seen = True
                self._answered(call)
                reply = call.task.result()
                for g in reply.get("grants") or ():
                    if g.get("status") == "active":
                        self.clients[call.client].grants.setdefault(g["grantId"], int(g["permits"]))

    # ------------------------------------------------------------------ steps
    @rule(client=st.sampled_from(CLIENTS), n=st.integers(1, 3), kind=st.sampled_from(["wait", "wait", "plain", "try"]))
    def ask(self, client: str, n: int, kind: str) -> None:
        """R9/R9a/R9b/R10: a request sent without waiting for its answer."""
        message = request(client, {"g": n}, grants=self.clients[client].reports())
        hold_ms = 0
        if kind == "wait":
            message["waitMs"] = hold_ms = HOLD
        elif kind == "try":
            message["noWait"] = True
        call = Call(client, None, self.bed.now, hold_ms, self.bed.evictions)  # type: ignore[arg-type]

        async def send() -> None:
            call.task = self.bed.send(message)
            call.task.add_done_callback(lambda _: self._answered(call))
            await self._advance(0)

        self.calls.append(call)
        self._run(send())
        self._collect()

    @rule(waiter=st.sampled_from(CLIENTS), n=st.integers(1, 5), rise=st.booleans())
    def wait_behind(self, waiter: str, n: int, rise: bool) -> None:
        """A held request, the state a rise needs (random steps seldom build it, and seldom
        raise the limit then): another client takes ``n`` permits and claims them, ``waiter``
        asks with ``waitMs``, and time runs to its batched round; with ``rise`` the limit then
        rises by one and time runs past the bound of :meth:`a_limit_that_rose_reaches_the_held_requests`."""
        other = next(c for c in CLIENTS if c != waiter)
        self.ask(other, n, "plain")
        self.claim(other)
        self.ask(waiter, 1, "wait")
        self._run(self._advance(WAIT + PERIOD))
        if rise:
            self.set_limit(1)
            self.a_limit_that_rose_reaches_the_held_requests()
            self._run(self._advance(self.bed.sem.limit_check_ms + PERIOD + WAIT + 1))

    @rule(client=st.sampled_from(CLIENTS))
    def claim(self, client: str) -> None:
        """A sync that claims every grant the client knows (R15a) and releases none: the
        capacity stays charged, so held requests wait for their deadline or a rise."""
        self._run(self.bed.one(sync(client, grants=self.clients[client].reports())))
        self._collect()

    @rule(client=st.sampled_from(CLIENTS))
    def release(self, client: str) -> None:
        """A sync that claims and releases everything the client holds (it frees capacity: a
        held request's round starts, R9 decision)."""
        holdings = self.clients[client]
        holdings.released |= set(holdings.grants)
        self._run(self.bed.one(sync(client, grants=holdings.reports())))
        self._collect()

    @rule(ms=st.sampled_from([1, 100, 999, 1_000, 2_000, 5_000, 10_000]))
    def advance(self, ms: int) -> None:
        self._run(self._advance(ms))

    @rule(step=st.sampled_from([-2, -1, 1, 1, 2]))
    def set_limit(self, step: int) -> None:
        """The application's limit moves (0 to 5); nobody is told (R9 decision "limits that rise")."""
        self.box["limit"] = min(5, max(0, self.box["limit"] + step))

    @rule()
    def evict(self) -> None:
        """R4: the instance is lost while calls wait."""
        self.bed.evict()
        self._run(self._advance(0))

    # ------------------------------------------------------------------ checks
    @invariant()
    def no_call_waits_for_ever(self) -> None:
        now = self.bed.now
        for call in self.calls:
            if call.answered_at is not None:
                continue
            assert call.epoch == self.bed.evictions, "an eviction left a call waiting (R4)"
            # a call joins its client's held request (R10), whose latest waitMs holds it too
            joined = any(c.client == call.client and c.hold_ms and c.epoch == call.epoch for c in self.calls)
            bound = call.sent_at + (HOLD if joined else call.hold_ms) + WAIT + 2 * PERIOD
            assert now <= bound, f"a call of {call.client} sent at {call.sent_at} still waits at {now} (R9)"

    @invariant()
    def a_limit_that_rose_reaches_the_held_requests(self) -> None:
        """R9 decision (limits that rise): while requests are held and the limit is above the
        one the last committed round resolved, a round comes within a check period, a round
        period, and a round's wait (a batched round timer already waiting)."""
        sem = self.bed.sem
        committed = [r for r in self.records if not r.failed]
        last = committed[-1].limit if committed else None
        if not (sem._held and isinstance(last, int) and self.box["limit"] > last):
            self.rose_since = None
            return
        if self.rose_since is None:
            self.rose_since = self.bed.now
        waited = self.bed.now - self.rose_since
        assert waited <= sem.limit_check_ms + PERIOD + WAIT, f"held requests missed a risen limit for {waited} ms"

    @invariant()
    def calls_answered_together_agree(self) -> None:
        answered: dict[tuple[str, int], list[dict[str, Any]]] = {}
        for call in self.calls:
            if call.answered_at is not None and call.sent_at < call.answered_at:
                answered.setdefault((call.client, call.answered_at), []).append(call.task.result())
        for (client, at), replies in answered.items():
            # one round's answer for the client (R10), each call's copy with its own joinInMs;
            # two rounds at one instant (one run at once, then the next) may answer two calls apart
            answers = {json.dumps({k: r.get(k) for k in ("grants", "leases", "blocked")}, sort_keys=True)
                       for r in replies if "error" not in r}
            assert len(answers) <= 2, f"{client} got {len(answers)} different answers at {at}"

    @invariant()
    def rounds_admit_within_their_limit(self) -> None:
        for r in self.records:
            if not r.failed and r.admitted and isinstance(r.limit, int):
                assert r.charged is not None and r.charged <= r.limit, f"I1: a round admitted past its limit: {r}"

    @invariant()
    def aggregates_match(self) -> None:
        self.bed.check()

    async def _drain(self) -> None:
        for _ in range(4):
            await self._advance(HOLD + WAIT + 2 * PERIOD)
            for client, holdings in self.clients.items():
                holdings.released |= set(holdings.grants)
                await self.bed.one(sync(client, grants=holdings.reports()))
            self._collect()
        await self._advance(HOLD + WAIT + 2 * PERIOD)
        assert all(call.answered_at is not None for call in self.calls)
        for client, holdings in self.clients.items():  # grants the last answers told of
            holdings.released |= set(holdings.grants)
            await self.bed.one(sync(client, grants=holdings.reports()))
        await self._advance(20_000)  # grants never told of (lost to an eviction) are reclaimed (R15)
        assert self.bed.charged()[0] == 0, "charged capacity did not return to zero (I3)"
        self.bed.check()


BatchingMachine.TestCase.settings = SETTINGS
test_batching_machine = BatchingMachine.TestCase
