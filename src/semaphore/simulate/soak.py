"""The soak's engine (``scripts/soak``, tests/test_soak.py): the seeded fault
simulation of ``semaphore.simulate.faults`` run long, with more kinds of fault.

One run = one seed in one mode (``defaults``: the holder as it comes, reusable leases; ``none``: no
leases, with a group limit; ``strict``, ``under``,
``over``: leases). Three client objects enqueue a steady stream of items (some enqueues retried)
to one holder object while the holder handles ``ops`` messages under faults; then every fault
heals (clock skew stays: it is not a fault that heals) and time runs until everything settles.

Faults, all drawn from the run's seed on the virtual clock:

* the network (:class:`~semaphore.testing.Net`): requests lost (half of them delivered late,
  after newer ones: reordered), replies lost, messages duplicated and delayed;
* evictions of the holder and of clients between steps; the admission callback crashing or slow;
  completion notices lost (reconciliation must find them);
* storage: an outermost ``transactionSync`` of the holder or of a client raises
  :class:`~semaphore.testing.StorageFault` after some of its statements ran (rolled back);
* alarms: delivered late, duplicated (the handler runs twice), retried although they succeeded;
* clock skew: every object reads its own clock, a fixed offset within ``+-skew_ms`` of the shared
  virtual clock (:class:`~semaphore.testing.SkewedClock`; its alarm fires on its own clock);
* invalid messages straight to the holder (I5: answered ``invalid_message``, storage unchanged).

Checked after every step: I1 (running items <= ceiling and <= charged at the holder, per group
too; the holder's charged capacity <= the ceiling), I2 (the holder's aggregates equal a recount of
its rows, rows consistent: ``0 <= released <= claimed <= permits``, ``released <= drawn``; and
per row: no more permits released than items finished under it), I4 (no item runs on capacity the
holder has freed: running <= charged in total and per grant or lease; unclaimed grant permits
charged no longer past their ``claimBy`` than :meth:`SoakSim.reclaim_allowance`), I5 (above), no item admitted
under two permits nor a permit used by two items. At the end: I3 (outstanding and lease
footprint 0, no client holds a grant or lease), every item completed exactly once.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import random
from dataclasses import dataclass, field, fields
from typing import Any

from semaphore import ItemState
from semaphore.core.batching import ROUND_PERIOD_MS, ROUND_WAIT_MS
from semaphore.simulate.faults import DEFAULT, KEY, Config, Sim, Stats
from semaphore.testing import T0, AlarmDriver, ClientSide, HolderSide, Net, SimClock, SkewedClock, StorageFault, dump

MODES: dict[str, dict[str, Any]] = {
    # what a user gets who sets only the limit (here with a group limit too): reusable leases
    # sized before grants, 30 min lifetime, recheck 30 s (semaphore.DEFAULT_LEASES)
    "defaults": {"limit": 4, "group_limits": {"a": 1}, "p_enqueue": 0.4, "leases": DEFAULT},
    # no leases (leases=None): every permit a grant
    "none": {"limit": 3, "group_limits": {"a": 1}, "p_enqueue": 0.3},
    # the seed's timing: every round batched (no rounds at once, SPEC R9a off)
    "batched": {"limit": 3, "group_limits": {"a": 1}, "p_enqueue": 0.3, "free_at_once": False},
    "strict": {"limit": 5, "leases": {"provisioning": {"mode": "strict"}, "permitsPerLease": 3, "ttlMs": 10_000}},
    "under": {"limit": 4, "leases": {"provisioning": {"mode": "under", "reserve": 2}, "permitsPerLease": 2,
                                     "ttlMs": 10_000}},
    "over": {"limit": 2, "extra": 3, "leases": {"provisioning": {"mode": "over", "extra": {"count": 3}},
                                                "permitsPerLease": 2, "ttlMs": 10_000}},
    # waiting requests (issue 13): blocked requests held open, short rounds, strict leases too
    "held": {"limit": 3, "group_limits": {"a": 1}, "p_enqueue": 0.4, "hold_blocked_ms": 4000,
             "request_wait_ms": 4000, "round_wait_ms": 200, "round_period_ms": 500,
             "leases": {"provisioning": {"mode": "strict"}, "permitsPerLease": 2, "ttlMs": 10_000}},
    # reusable leases sized before grants (issue 13, SPEC R28a, R30a, R31a, R34a); then with
    # waiting requests too (slots reused beside a held request)
    "reuse": {"limit": 4, "leases": {"provisioning": {"mode": "strict"}, "permitsPerLease": 2, "ttlMs": 10_000,
                                     "reusable": True, "leaseFirst": True}},
    "reuse-held": {"limit": 3, "group_limits": {"a": 1}, "p_enqueue": 0.4, "hold_blocked_ms": 4000,
                   "request_wait_ms": 4000, "round_wait_ms": 200, "round_period_ms": 500,
                   "leases": {"provisioning": {"mode": "strict"}, "permitsPerLease": 2, "ttlMs": 10_000,
                              "reusable": True, "leaseFirst": True, "limitedGroups": "withinGroupLimit"}},
}

#: Violation kinds, in the summary's order.
KINDS = ("I1", "I2", "I3", "I4", "I5", "lost", "twice", "crash")


@dataclass
class SoakConfig(Config):
    mode: str = "none"
    ops: int = 1000  # holder messages handled in the faulty phase
    clients: int = 3
    p_enqueue: float = 0.5  # per step
    skew_ms: int = 200  # each object's clock offset within +-skew_ms
    p_tx_fail: float = 0.01  # per outermost storage transaction
    p_alarm_delay: float = 0.2
    max_alarm_delay_ms: int = 2000
    p_alarm_duplicate: float = 0.1
    p_alarm_retry: float = 0.1
    p_invalid: float = 0.05  # per step
    max_steps: int = 200_000
    p_net: float = 0.08  # each network fault's probability
    offsets: tuple[int, ...] | None = None  # fixed clock offsets (holder, c0, c1, ...) instead of drawn
    # I4's deadline half: unclaimed grant permits may stay charged past their claimBy for the
    # alarm's delivery delay (max_alarm_delay_ms) plus this margin, plus, for each holder
    # transaction that failed since (a reclaim that failed is backed off by the scheduler, 1 s
    # doubling, and its alarm delayed again), that backoff and another delivery delay
    reclaim_margin_ms: int = 1000
    hold_blocked_ms: int = 0  # the holder's (waiting requests) and the queues' request_wait_ms
    request_wait_ms: int = 0
    round_wait_ms: int = ROUND_WAIT_MS
    round_period_ms: int = ROUND_PERIOD_MS
    free_at_once: bool = True  # the holder's (SPEC R9a)
    client_stores: str = "sql"  # where the client objects keep their rows (ClientSide ``stores``)
    # Whether the client objects' transactions fail too (p_tx_fail). Off for comparing the SQL
    # stores with their twins: where an injected fault lands depends on how many statements a
    # transaction runs, which differs between the two.
    client_tx_faults: bool = True

    @classmethod
    def for_mode(cls, seed: int, mode: str, **overrides: Any) -> SoakConfig:
        opts = {k: copy.deepcopy(v) for k, v in MODES[mode].items()}
        opts.update(overrides)
        return cls(seed=seed, mode=mode, **opts)


@dataclass
class SoakStats(Stats):
    ops: int = 0
    items: int = 0
    holder_tx_failed: int = 0
    client_tx_failed: int = 0
    alarm_delays: int = 0
    alarm_duplicates: int = 0
    alarm_retries: int = 0  # spurious (injected) retries
    alarm_failures: int = 0  # deliveries whose handler raised (retried by the runtime)
    skewed_objects: int = 0
    max_skew_ms: int = 0
    invalid_sent: int = 0
    max_unclaimed_late_ms: int = 0  # longest an unclaimed grant permit stayed charged past claimBy
    violations: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))


class Faults:
    """The run's fault switches: one rng, everything off once :attr:`on` is false."""

    def __init__(self, cfg: SoakConfig, rng: random.Random, stats: SoakStats) -> None:
        self.cfg, self.rng, self.stats, self.on = cfg, rng, stats, True

    def tx(self) -> int | None:
        if self.on and self.rng.random() < self.cfg.p_tx_fail:
            return self.rng.randint(0, 32)  # across a whole transaction: reads, then writes (up to ~16)
        return None

    def alarm_delay(self) -> int:
        if self.on and self.rng.random() < self.cfg.p_alarm_delay:
            return self.rng.randint(1, self.cfg.max_alarm_delay_ms)
        return 0

    def alarm_duplicate(self) -> bool:
        return self.on and self.rng.random() < self.cfg.p_alarm_duplicate

    def alarm_retry(self) -> bool:
        return self.on and self.rng.random() < self.cfg.p_alarm_retry


class SoakHolder(HolderSide):
    """The holder with the alarm hooks on every instance's driver, counting the messages handled."""

    def __init__(self, clock: Any, faults: Faults, **options: Any) -> None:
        self.faults = faults
        self.handled = 0
        self.drivers: list[AlarmDriver] = []  # every instance's, so no eviction drops its counts
        super().__init__(clock, **options)

    def _start(self) -> None:
        super()._start()
        self.drivers.append(self.driver)
        self.driver.delay_ms = self.faults.alarm_delay
        self.driver.duplicate = self.faults.alarm_duplicate
        self.driver.spurious_retry = self.faults.alarm_retry

    async def handle(self, message: Any) -> dict[str, Any]:
        self.handled += 1
        return await super().handle(message)


def _charge(kind: str, row: dict[str, Any]) -> int:
    """What a grant or lease row charges at the holder (SPEC R30, R30a for a lease's footprint:
    a reusable lease charges every slot until its final count)."""
    if kind == "lease" and row["status"] == "retired" and row["stopped"]:
        return min(int(row["permits"]), int(row["drawn"]) - int(row["released"]))
    if kind == "lease" and row.get("reusable"):
        return int(row["permits"])
    return int(row["permits"]) - int(row["released"])


def _mutations(message: dict[str, Any], rng: random.Random) -> Any:
    """``message`` made invalid (SPEC R7) in one of several ways."""
    m = copy.deepcopy(message)
    choice = rng.randrange(9)
    if choice == 0:
        m["v"] = 2
    elif choice == 1:
        m["type"] = "grab"
    elif choice == 2:
        m["clientId"] = 7
    elif choice == 3:
        m["clientId"] = "x" * 300
    elif choice == 4:
        m["type"] = "request"
        m["demand"] = [{"group": "a", "count": -1, "oldestAt": 0}]
    elif choice == 5:
        m["grants"] = [{"grantId": "h1", "claimed": -1, "released": 0}]
    elif choice == 6:
        m["grants"] = "all of them"
    elif choice == 7:
        return [m]
    else:
        m.pop("clientId", None)
    return m


class SoakSim(Sim):
    """``semaphore.simulate.faults``' application and checks (:meth:`Sim.on_admit`, :meth:`Sim.check_capacity`)
    over skewed objects with storage and alarm faults; see the module documentation."""

    cfg: SoakConfig
    stats: SoakStats
    holder: SoakHolder

    def __init__(self, cfg: SoakConfig) -> None:  # noqa: PLR0915 - set-up of one run
        self.cfg = cfg
        self.rng = random.Random(f"soak:{cfg.seed}:{cfg.mode}")
        self.stats = SoakStats()
        self.faults = Faults(cfg, random.Random(f"faults:{cfg.seed}:{cfg.mode}"), self.stats)
        self.clock = SimClock(T0)
        self._objects = 0
        opts: dict[str, Any] = {"limit": cfg.limit, "grant_timeout_ms": cfg.grant_timeout_ms,
                                "hold_blocked_ms": cfg.hold_blocked_ms, "round_wait_ms": cfg.round_wait_ms,
                                "round_period_ms": cfg.round_period_ms, "free_at_once": cfg.free_at_once}
        if cfg.leases != DEFAULT:  # None: no leases; DEFAULT: the holder's own default
            opts["leases"] = cfg.leases
        if cfg.group_limits is not None:
            opts["group_limit"] = cfg.group_limits
        self.holder = SoakHolder(self._skewed(), self.faults, **opts)
        self.holder.storage.fail_transaction = self.faults.tx
        p = cfg.p_net
        self.net = Net(self.holder, self.clock, random.Random(f"net:{cfg.seed}:{cfg.mode}"), lose_request=p,
                       lose_reply=p, duplicate=p, delay=p * 2, max_delay_ms=3000)
        self.sides = [self._side(i) for i in range(cfg.clients)]
        self.started: dict[str, tuple[str, str, int]] = {}
        self.permit_owner: dict[tuple[str, str, int], str] = {}
        self.running: dict[str, tuple[str, str]] = {}
        self.finished: set[str] = set()
        self.expected: dict[str, tuple[int, str]] = {}
        self.violations: list[str] = []
        self._seen = 0
        self.found: list[tuple[str, str]] = []  # (kind, detail)
        self._flagged: set[tuple[str, Any]] = set()  # per-row violations already noted
        self._tx_marks: list[tuple[int, int]] = []  # (holder time, holder transactions failed so far)

    def _skewed(self) -> SkewedClock:
        offset = self.rng.randint(-self.cfg.skew_ms, self.cfg.skew_ms) if self.cfg.skew_ms else 0
        if self.cfg.offsets is not None:
            offset = self.cfg.offsets[self._objects]
        self._objects += 1
        if offset:
            self.stats.skewed_objects += 1
            self.stats.max_skew_ms = max(self.stats.max_skew_ms, abs(offset))
        return SkewedClock(self.clock, offset)

    def _side(self, i: int) -> ClientSide:
        side = ClientSide(f"c{i}", self._skewed(), self.net, on_admit=self.on_admit,
                          check_running=self.check_running, reconcile_after_ms=15_000, retry_ms=1000,
                          recheck_ms=10_000, request_wait_ms=self.cfg.request_wait_ms,
                          stores=self.cfg.client_stores)
        side.storage.fail_transaction = self.faults.tx if self.cfg.client_tx_faults else None
        side.driver.delay_ms = self.faults.alarm_delay
        side.driver.duplicate = self.faults.alarm_duplicate
        side.driver.spurious_retry = self.faults.alarm_retry
        return side

    # ------------------------------------------------------------------ checks
    def note(self, kind: str, detail: str) -> None:
        self.stats.violations[kind] += 1
        if len(self.found) < 20:
            self.found.append((kind, f"t={self.clock.now - T0}ms: {detail}"))

    def check_step(self) -> None:
        """Every invariant that holds after every step (module documentation)."""
        self.check_capacity()  # faults.py: running vs ceiling, group limits, charged
        for v in self.violations[self._seen:]:  # also what Sim.on_admit found
            kind = "twice" if "permit" in v else "I4" if "charged" in v else "I1"
            self.note(kind, v)
        self._seen = len(self.violations)
        charged, per_group = self.holder.charged()
        if charged > self.ceiling():
            self.note("I1", f"holder charges {charged} > ceiling {self.ceiling()}")
        for g, n in per_group.items():
            limit = (self.cfg.group_limits or {}).get(g)
            if n < 0 or (limit is not None and n > limit):
                self.note("I1" if n > 0 else "I2", f"group {g} charged {n} (limit {limit})")
        try:
            self.holder.check()
        except AssertionError as exc:
            self.note("I2", str(exc))

    def reclaim_allowance(self, claim_by: int) -> int:
        """How long past ``claim_by`` (holder time) unclaimed permits may stay charged: see
        :attr:`SoakConfig.reclaim_margin_ms`. Counts every holder transaction that failed since
        (rounds and syncs too: conservative)."""
        before = 0
        for at, failed in self._tx_marks:
            if at > claim_by:
                break
            before = failed
        delay = self.cfg.max_alarm_delay_ms
        k = min(8, self.holder.storage.transactions_failed - before)
        return int(delay + self.cfg.reclaim_margin_ms + sum(1000 * 2 ** i + delay for i in range(k)))

    def check_capacity(self) -> None:
        """``semaphore.simulate.faults``' check (after each step and at each admission), and the per-permit
        checks with it."""
        super().check_capacity()
        self.check_permits()

    def check_permits(self) -> None:
        """The per-permit halves of I2 and I4, over the holder's rows:

        * I4: every running item's grant or lease still charges it (running items on a row <= what
          the row charges), and unclaimed grant permits are charged no longer past their
          ``claimBy`` than :meth:`reclaim_allowance`;
        * I2: a row never counts more permits released than items finished under it (a repeated
          or reordered report freeing again shows here even when the totals still add up), plus,
          for a grant, the permits claimed that no item started under: the queue gives those
          back (claimed with no item, released once confirmed, R37's surplus grants), each once."""
        grants, leases = self.holder.grants(), self.holder.leases()
        now = self.holder.clock.now
        failed = self.holder.storage.transactions_failed
        if not self._tx_marks or self._tx_marks[-1][1] != failed:
            self._tx_marks.append((now, failed))
        for gid, g in grants.items():
            if g["claimed"] < g["permits"] and now > g["claim_by"]:
                late = now - g["claim_by"]
                self.stats.max_unclaimed_late_ms = max(self.stats.max_unclaimed_late_ms, late)
                if late > self.reclaim_allowance(g["claim_by"]) and ("late", gid) not in self._flagged:
                    self._flagged.add(("late", gid))
                    self.note("I4", f"grant {gid}: {g['permits'] - g['claimed']} unclaimed permits charged "
                                    f"{late} ms past claimBy")
        rows = {("grant", k): v for k, v in grants.items()} | {("lease", k): v for k, v in leases.items()}
        running = collections.Counter(self.started.get(i, ("unknown", i, 0))[:2] for i in self.running)
        finished = collections.Counter(self.started[i][:2] for i in self.finished if i in self.started)
        for permit, n in running.items():
            row = rows.get(permit)
            charge = 0 if row is None else _charge(permit[0], row)
            if n > charge and ("run", permit) not in self._flagged:
                self._flagged.add(("run", permit))
                self.note("I4", f"{n} items run under {permit[0]} {permit[1]}, which charges {charge}")
        started = collections.Counter(v[:2] for v in self.started.values())
        for permit, row in rows.items():
            given_back = max(0, row["claimed"] - started[permit]) if permit[0] == "grant" else 0
            if row["released"] > finished[permit] + given_back and ("rel", permit) not in self._flagged:
                self._flagged.add(("rel", permit))
                self.note("I2", f"{permit[0]} {permit[1]} counts {row['released']} released, "
                                f"{finished[permit]} items finished under it"
                                + (f" and {given_back} claimed with no item (given back)" if given_back else ""))

    def invalid_message(self) -> None:
        """I5: an invalid message is answered ``invalid_message`` and changes nothing. Driven
        synchronously (nothing else runs meanwhile), so the dump must be equal."""
        template = self.net.sent[-1] if self.net.sent else {"type": "sync", "v": 1, "clientId": "c0", "grants": []}
        message = _mutations(template, self.rng)
        self.stats.invalid_sent += 1
        before = dump(self.holder.storage)
        coro = self.holder.sem.handle(message)
        try:
            coro.send(None)
        except StopIteration as stop:
            reply = stop.value
        else:
            coro.close()
            self.note("I5", f"invalid message {message!r} was taken for a valid one")
            return
        if not (isinstance(reply, dict) and reply.get("error", {}).get("code") == "invalid_message"):
            self.note("I5", f"invalid message {message!r} answered {reply!r}")
        if dump(self.holder.storage) != before:
            self.note("I5", f"invalid message {message!r} changed the holder's storage")

    # ------------------------------------------------------------------ driving
    async def enqueue_now(self, plan: list[tuple[int, int, str, str]]) -> None:
        while plan and T0 + plan[0][0] <= self.clock.now:
            at, side, item_id, group = plan.pop(0)
            try:
                await self.enqueue(side, item_id, group)
            except (asyncio.CancelledError, StorageFault):  # evicted / storage failed: the app retries
                plan.append((self.clock.now - T0 + 1000, side, item_id, group))
                plan.sort()

    def arrivals(self, plan: list[tuple[int, int, str, str]]) -> None:
        if self.rng.random() >= self.cfg.p_enqueue:
            return
        i = self.stats.items
        self.stats.items += 1
        side, group, item_id = self.rng.randrange(self.cfg.clients), self.rng.choice(self.cfg.groups), f"item{i}"
        self.expected[item_id] = (side, group)
        now = self.clock.now - T0
        plan.append((now, side, item_id, group))
        if self.rng.random() < self.cfg.p_retry_enqueue:
            plan.append((now + self.rng.randint(0, 8000), side, item_id, group))
        plan.sort()

    def fault_step(self) -> None:
        if self.rng.random() < self.cfg.p_invalid:
            self.invalid_message()
        if self.rng.random() < self.cfg.p_evict:
            self.evict_one()

    def heal(self) -> None:
        self.net.enabled = False
        self.cfg.faults = False
        self.faults.on = False

    async def run(self) -> SoakStats:
        plan: list[tuple[int, int, str, str]] = []
        settle_until: int | None = None
        last: tuple[int, int] = (-1, -1)
        while self.stats.steps < self.cfg.max_steps:
            self.stats.steps += 1
            if settle_until is None:
                self.arrivals(plan)
            await self.enqueue_now(plan)
            if settle_until is None and self.holder.handled >= self.cfg.ops:
                self.heal()
                settle_until = self.clock.now + self.cfg.settle_ms
            if settle_until is None:
                self.fault_step()
            await self.clock.advance(self.rng.randint(100, 1500))
            self.check_step()
            if settle_until is not None:
                progress = (len(self.finished), len(plan))
                if progress != last:  # a backlog still draining: wait settle_ms past the last change
                    last, settle_until = progress, self.clock.now + self.cfg.settle_ms
                if not plan and (self.done() or self.clock.now >= settle_until):
                    break
        return self.stats

    async def finish(self) -> None:
        """The end-of-run checks (I3, items lost) and the fault counters."""
        s = self.stats
        s.ops = self.holder.handled
        s.net = dict(self.net.stats)
        s.holder_tx_failed = self.holder.storage.transactions_failed
        s.client_tx_failed = sum(side.storage.transactions_failed for side in self.sides)
        drivers = [side.driver for side in self.sides] + self.holder.drivers
        s.alarm_delays = sum(d.delayed for d in drivers)
        s.alarm_duplicates = sum(d.duplicated for d in drivers)
        s.alarm_retries = sum(d.spurious_retries for d in drivers)
        s.alarm_failures = sum(len(d.failures) for d in drivers)
        usage = await self.holder.usage()
        if usage["outstanding"] != 0 or usage["leaseFootprint"] != 0:
            self.note("I3", f"capacity not returned: outstanding {usage['outstanding']}, "
                            f"lease footprint {usage['leaseFootprint']}")
        for side in self.sides:
            if side.client.leases(KEY) or side.client.grants(KEY):
                self.note("I3", f"{side.name} still holds grants or leases")
        for item_id in sorted(set(self.expected) - self.finished, key=lambda x: int(x[4:])):
            self.note("lost", f"{item_id} never completed")
        for side in self.sides:
            for item in side.queue.items():
                if item.state is not ItemState.DONE and item.item_id in self.finished:
                    self.note("lost", f"{side.name}: {item.item_id} ran but is {item.state.value}")


@dataclass
class RunResult:
    seed: int
    mode: str
    stats: SoakStats
    found: list[tuple[str, str]]

    @property
    def failed(self) -> bool:
        return any(self.stats.violations.values())


async def _soak(cfg: SoakConfig) -> RunResult:
    sim = SoakSim(cfg)
    try:
        await sim.run()
        await sim.finish()
    except Exception as exc:  # noqa: BLE001 - a crash of the simulation is a failure of the seed
        sim.note("crash", f"{type(exc).__name__}: {exc}")
    for side in sim.sides:
        side.driver.kill()
    return RunResult(cfg.seed, cfg.mode, sim.stats, sim.found)


def run_one(seed: int, mode: str, **overrides: Any) -> RunResult:
    """One seed in one mode, in a fresh event loop (deterministic from ``seed``)."""
    return asyncio.run(_soak(SoakConfig.for_mode(seed, mode, **overrides)))


#: The summary's fault counters: (label, how to read it from a SoakStats).
FAULTS: tuple[tuple[str, Any], ...] = (
    ("lost requests", lambda s: s.net.get("lost_request", 0)),
    ("lost replies", lambda s: s.net.get("lost_reply", 0)),
    ("duplicated messages", lambda s: s.net.get("duplicated", 0)),
    ("late/reordered messages", lambda s: s.net.get("late", 0)),
    ("delayed messages", lambda s: s.net.get("delayed", 0)),
    ("invalid messages", lambda s: s.invalid_sent),
    ("holder evictions", lambda s: s.holder_evictions),
    ("client evictions", lambda s: s.client_evictions),
    ("holder transactions raised midway", lambda s: s.holder_tx_failed),
    ("client transactions raised midway", lambda s: s.client_tx_failed),
    ("alarms delayed", lambda s: s.alarm_delays),
    ("alarms duplicated", lambda s: s.alarm_duplicates),
    ("alarms retried (injected)", lambda s: s.alarm_retries),
    ("alarm handlers raised (retried)", lambda s: s.alarm_failures),
    ("admission callbacks crashed", lambda s: s.admit_failures),
    ("completion notices lost", lambda s: s.lost_completions),
    ("objects with clock skew", lambda s: s.skewed_objects),
)


def summarize(results: list[RunResult], modes: list[str]) -> dict[str, dict[str, int]]:
    """``{row label: {mode: total}}`` over ``results`` (deterministic: no timings)."""
    table: dict[str, dict[str, int]] = {}

    def add(label: str, mode: str, value: int) -> None:
        table.setdefault(label, dict.fromkeys(modes, 0))[mode] += value

    for r in results:
        s = r.stats
        add("runs (seeds)", r.mode, 1)
        add("operations (holder messages handled)", r.mode, s.ops)
        add("items", r.mode, s.items)
        add("steps", r.mode, s.steps)
        add("lease runs", r.mode, s.lease_runs)
        add("grant runs", r.mode, s.grant_runs)
        for label, read in FAULTS:
            add(f"fault: {label}", r.mode, int(read(s)))
        for label, value in (("fault: max clock skew (ms)", s.max_skew_ms),
                             ("max unclaimed permits charged past claimBy (ms)", s.max_unclaimed_late_ms)):
            row = table.setdefault(label, dict.fromkeys(modes, 0))
            row[r.mode] = max(row[r.mode], value)
        for kind in KINDS:
            add(f"violations: {kind}", r.mode, s.violations[kind])
    return table


def stats_fields() -> list[str]:
    return [f.name for f in fields(SoakStats)]
