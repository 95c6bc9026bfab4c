"""Seeded fault simulation of holder + queue clients (``tests/test_fault_sim.py``, and the soak).

Clients enqueue items (some enqueues retried), an application runs admitted items for a random
time and reports completion (some completion notices lost: reconciliation finds them), the
admission callback sometimes fails after starting the work or takes virtual time (so eviction can
hit it), the network loses/duplicates/delays/reorders messages, and either side is evicted
between steps. After the faulty phase the network heals and time runs on until everything
settles. Invariants are checked after every step; see :meth:`Sim.check`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from semaphore import ItemState, QueueItem
from semaphore.testing import T0, ClientSide, HolderSide, Net, SimClock

KEY = "acct"
#: A :class:`Config` whose ``leases`` is this gives the holder no ``leases=``: its default.
DEFAULT = "default"


@dataclass
class Config:
    seed: int
    #: The holder's ``leases=``: ``None`` (no leases), a mapping, or :data:`DEFAULT` (not given:
    #: the library's default, :data:`semaphore.DEFAULT_LEASES`).
    leases: dict[str, Any] | str | None = None
    limit: int = 3
    extra: int = 0  # "over" budget
    grant_timeout_ms: int = 4000  # short, so late replies and retries meet claim deadlines
    group_limits: dict[str, int] | None = None
    clients: int = 2
    items: int = 8
    groups: tuple[str, ...] = ("a", "b")
    faults: bool = True
    p_evict: float = 0.04
    p_lost_completion: float = 0.08
    p_admit_fail: float = 0.1
    p_retry_enqueue: float = 0.3
    enqueue_window_ms: int = 15_000
    fault_phase_ms: int = 30_000
    settle_ms: int = 200_000
    #: Where the client objects keep their rows (:class:`~semaphore.testing.ClientSide` ``stores``).
    client_stores: str = "sql"
    #: The queues' ``retention_ms`` (``None``: the queue's default, a day: nothing is purged).
    retention_ms: int | None = None
    #: Completions that arrive at one client object within 2 s of the first of them go in one
    #: ``complete_many()`` call (an eviction meanwhile loses them, counted as lost completions).
    batch_completions: bool = False


@dataclass
class Stats:
    steps: int = 0
    holder_evictions: int = 0
    client_evictions: int = 0
    lost_completions: int = 0
    admit_failures: int = 0
    max_running: int = 0
    lease_runs: int = 0
    grant_runs: int = 0
    #: ``batch_completions``: ``complete_many()`` calls, and those of more than one item.
    batches: int = 0
    multi_item_batches: int = 0
    net: dict[str, int] = field(default_factory=dict)


def _named(limit: int, **opts: Any) -> Callable[[int], Config]:
    return lambda seed: Config(seed=seed, limit=limit, **opts)


#: The fault simulation's named configurations, one per provisioning mode (``Config`` factories
#: by seed): what ``tests/test_fault_sim.py`` runs, and ``scripts/traffic_digest.py`` and the
#: twin comparison (``tests/test_memory_stores.py``) compare. Build a fresh ``Config`` per run: a
#: run changes its own (``cfg.faults`` turns off when the network heals).
FAULT_CONFIGS: dict[str, Callable[[int], Config]] = {
    # no leases, plus a group limit on "a"
    "grants-only": _named(3, group_limits={"a": 1}),
    "strict": _named(5, leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 3, "ttlMs": 10_000}),
    "under": _named(4, leases={"provisioning": {"mode": "under", "reserve": 2}, "permitsPerLease": 2,
                               "ttlMs": 10_000}),
    "over": _named(2, extra=3, leases={"provisioning": {"mode": "over", "extra": {"count": 3}},
                                       "permitsPerLease": 2, "ttlMs": 10_000}),
}


class Sim:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.clock = SimClock(T0)
        opts: dict[str, Any] = {"limit": cfg.limit, "grant_timeout_ms": cfg.grant_timeout_ms}
        if cfg.leases != DEFAULT:  # None: no leases; DEFAULT: the holder's own default
            opts["leases"] = cfg.leases
        if cfg.group_limits is not None:
            opts["group_limit"] = cfg.group_limits
        self.holder = HolderSide(self.clock, **opts)
        p = 0.08 if cfg.faults else 0.0
        self.net = Net(self.holder, self.clock, random.Random(cfg.seed * 7 + 1), lose_request=p,
                       lose_reply=p, duplicate=p, delay=p * 2, max_delay_ms=3000)
        self.sides = [
            ClientSide(f"c{i}", self.clock, self.net, on_admit=self.on_admit, check_running=self.check_running,
                       reconcile_after_ms=15_000, retry_ms=1000, recheck_ms=10_000,
                       stores=cfg.client_stores,
                       **({} if cfg.retention_ms is None else {"retention_ms": cfg.retention_ms}))
            for i in range(cfg.clients)
        ]
        # application state
        self.started: dict[str, tuple[str, str, int]] = {}  # item -> permit
        self.permit_owner: dict[tuple[str, str, int], str] = {}
        self.running: dict[str, tuple[str, str]] = {}  # item -> (side, group)
        self.finished: set[str] = set()
        self.expected: dict[str, tuple[int, str]] = {}  # item -> (side index, group)
        self.stats = Stats()
        self.violations: list[str] = []
        self._batches: dict[str, list[str]] = {}  # per client object: completions to send together

    # ------------------------------------------------------------------ application
    async def on_admit(self, side: ClientSide, item: QueueItem) -> None:
        assert item.permit is not None
        permit = (item.permit.kind.value, item.permit.id, item.permit.slot)
        if item.item_id in self.started:
            # a retried admission: same item, same permit, the work is not started twice
            if self.started[item.item_id] != permit:
                self.violations.append(f"{item.item_id} admitted under two permits "
                                       f"{self.started[item.item_id]} and {permit}")
        else:
            owner = self.permit_owner.get(permit)
            if owner is not None and owner != item.item_id:
                self.violations.append(f"permit {permit} used by {owner} and {item.item_id}")
            self.permit_owner[permit] = item.item_id
            self.started[item.item_id] = permit
            self.running[item.item_id] = (side.name, item.group)
            if item.permit.kind.value == "lease":
                self.stats.lease_runs += 1
            else:
                self.stats.grant_runs += 1
            self.check_capacity()
            asyncio.ensure_future(self.work(item.item_id, side.name))
        if self.cfg.faults and self.rng.random() < 0.2:
            await self.clock.sleep(self.rng.randint(1, 300))  # eviction may hit here
        if self.cfg.faults and self.rng.random() < self.cfg.p_admit_fail:
            self.stats.admit_failures += 1
            raise RuntimeError("admission callback crashed after starting the work")

    async def work(self, item_id: str, side_name: str) -> None:
        await self.clock.sleep(self.rng.randint(200, 6000))
        self.running.pop(item_id, None)
        self.finished.add(item_id)
        if self.cfg.faults and self.rng.random() < self.cfg.p_lost_completion:
            self.stats.lost_completions += 1
            return  # the completion notice never arrives: reconciliation must find it
        side = next(s for s in self.sides if s.name == side_name)
        side.spawn(self._complete(side, item_id))

    async def _complete(self, side: ClientSide, item_id: str) -> None:
        if not self.cfg.batch_completions:
            await side.queue.complete(item_id)
            return
        batch = self._batches.setdefault(side.name, [])
        batch.append(item_id)
        if len(batch) > 1:
            return  # the batch's first completion sends it
        try:
            await self.clock.sleep(2000)
        except asyncio.CancelledError:  # evicted: the batch is lost (reconciliation finds its items)
            self._batches[side.name] = []
            self.stats.lost_completions += len(batch)
            raise
        self._batches[side.name] = []
        live = [i for i in batch if (item := side.queue.item(i)) is not None and item.state is not ItemState.DONE]
        done = await side.queue.complete_many(batch)
        self.stats.batches += 1
        self.stats.multi_item_batches += len(batch) > 1
        refused = [i for i, ok in zip(batch, done) if i in live and not ok]
        if refused:  # read and completed in one step: nothing could finish them in between
            self.violations.append(f"complete_many refused items that were not done: {refused}")

    def evict_one(self) -> None:
        """Evict the holder (40%) or a client object, counted in the stats."""
        if self.rng.random() < 0.4:
            self.holder.evict()
            self.stats.holder_evictions += 1
        else:
            self.rng.choice(self.sides).evict()
            self.stats.client_evictions += 1

    def check_running(self, side: ClientSide, item: QueueItem) -> bool:
        return item.item_id in self.running

    # ------------------------------------------------------------------ invariants
    def ceiling(self) -> int:
        return self.cfg.limit + self.cfg.extra

    def check_capacity(self) -> None:
        """I1: never more running items than the ceiling (or a group limit); and no item runs
        without charged capacity at the holder (its permit is counted there)."""
        n = len(self.running)
        self.stats.max_running = max(self.stats.max_running, n)
        if n > self.ceiling():
            self.violations.append(f"{n} items running > ceiling {self.ceiling()} at {self.clock.now - T0}")
        charged, per_group = self.holder.charged()
        if n > charged:
            self.violations.append(f"{n} running but only {charged} charged at the holder at {self.clock.now - T0}")
        by_group: dict[str, int] = {}
        for _, g in self.running.values():
            by_group[g] = by_group.get(g, 0) + 1
        for g, k in by_group.items():
            if k > per_group.get(g, 0):
                self.violations.append(f"group {g}: {k} running > {per_group.get(g, 0)} charged")
            gl = (self.cfg.group_limits or {}).get(g)
            if gl is not None and k > gl:
                self.violations.append(f"group {g}: {k} running > group limit {gl}")

    # ------------------------------------------------------------------ driving
    async def enqueue(self, side_index: int, item_id: str, group: str) -> None:
        side = self.sides[side_index]
        await side.spawn(side.queue.enqueue(KEY, group, item_id, {"n": item_id}))

    async def run(self) -> Stats:
        cfg = self.cfg
        plan = []
        for i in range(cfg.items):
            side = self.rng.randrange(cfg.clients)
            group = self.rng.choice(cfg.groups)
            at = self.rng.randint(0, cfg.enqueue_window_ms)
            item_id = f"item{i}"
            self.expected[item_id] = (side, group)
            plan.append((at, side, item_id, group))
            if self.rng.random() < cfg.p_retry_enqueue:  # a retried enqueue
                plan.append((at + self.rng.randint(0, 8000), side, item_id, group))
        plan.sort()
        end_faults = T0 + cfg.fault_phase_ms
        end = end_faults + cfg.settle_ms
        while self.clock.now < end:
            self.stats.steps += 1
            while plan and T0 + plan[0][0] <= self.clock.now:
                _, side, item_id, group = plan.pop(0)
                try:
                    await self.enqueue(side, item_id, group)
                except asyncio.CancelledError:
                    plan.insert(0, (self.clock.now - T0, side, item_id, group))
            if self.clock.now >= end_faults and self.net.enabled:
                self.net.enabled = False
                self.cfg.faults = False
            if cfg.faults and self.rng.random() < cfg.p_evict:
                self.evict_one()
            await self.clock.advance(self.rng.randint(100, 1500))
            self.check_capacity()
            if not plan and self.clock.now >= end_faults and self.done():
                break
        self.stats.net = dict(self.net.stats)
        return self.stats

    def done(self) -> bool:
        if set(self.expected) != self.finished:
            return False
        for s in self.sides:
            if any(i.state is not ItemState.DONE for i in s.queue.items()):
                return False
            if s.client.leases(KEY) or s.client.grants(KEY):
                return False
        charged, _ = self.holder.charged()
        return charged == 0

    async def final_checks(self) -> dict[str, Any]:
        usage = await self.holder.usage()
        problems = list(self.violations)
        missing = set(self.expected) - self.finished
        if missing:
            problems.append(f"items never ran: {sorted(missing)}")
        if usage["outstanding"] != 0 or usage["leaseFootprint"] != 0:  # I3
            problems.append(f"capacity not returned: {usage}")
        for s in self.sides:
            stuck = [(i.item_id, i.state.value) for i in s.queue.items() if i.state is not ItemState.DONE]
            if stuck:
                problems.append(f"{s.name}: items not done {stuck}")
            for i in s.queue.items():
                if self.expected[i.item_id][0] != int(s.name[1:]):
                    problems.append(f"{i.item_id} in the wrong client")
        ran = {i.item_id for s in self.sides for i in s.queue.items()}
        if ran != set(self.expected):
            problems.append(f"queued items {sorted(ran)} != enqueued {sorted(self.expected)}")
        return {"problems": problems, "usage": usage}


async def simulate(cfg: Config) -> tuple[Stats, list[str]]:
    sim = Sim(cfg)
    stats = await sim.run()
    result = await sim.final_checks()
    # stop background tasks of this loop
    for s in sim.sides:
        s.driver.kill()
    return stats, result["problems"]
