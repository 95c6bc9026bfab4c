"""The simulation engine: the real holder, client and queue code on one virtual clock.

:func:`run_scenario` (or ``await`` :func:`simulate` inside a running loop) builds one holder
object (:class:`~semaphore.testing.HolderSide`: ``DurabilitySemaphore`` + scheduler + alarm on
its own SQLite) and ``scenario.clients`` client objects (:class:`~semaphore.testing.ClientSide`:
``SemaphoreClient`` + scheduler + ``SemaphoreQueue``, each on its own SQLite), connected by a
:class:`~semaphore.testing.Net` (seeded faults) through a counting transport. Arrivals are
enqueued with ``queue.enqueue``; the queue's ``on_admit`` starts the job, whose virtual
duration ends with ``queue.complete``. Nothing is modelled: every claim, draw, request, sync and
reclaim is the library's. The same scenario and seed give the same :class:`Result`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.config import LeaseConfig
from ..testing import T0, ClientSide, HolderSide, Net, SimClock
from .cost import ActiveTime, Usage
from .scenario import Scenario, read_arrivals_csv

__all__ = ["KEY", "Arrival", "Message", "Sample", "Result", "Simulation", "plan_arrivals", "job_duration",
           "run_scenario", "simulate", "percentiles", "sync_reason"]

#: The one key (holder object) every client object asks.
KEY = "sim"

#: A hook called with every message a client object sends to the holder.
MessageHook = Callable[["Message"], None]
#: A progress hook: ``(virtual fraction done, wall seconds so far)``.
ProgressHook = Callable[[float, float], None]


@dataclass(frozen=True)
class Arrival:
    """One planned item: ``at_ms`` after the start, for client object ``client`` (an index) in
    ``group``; ``duration_ms`` ``None`` draws it from the scenario's job durations."""

    at_ms: int
    client: int
    group: str
    duration_ms: int | None = None


@dataclass(frozen=True)
class Message:
    """One message a client object sent to the holder: ``kind`` ``request`` or ``sync``;
    ``reason`` is ``request`` for a request, else why the queue sent the sync
    (:func:`sync_reason`); ``t_ms`` virtual ms since the start; ``message`` the wire dict."""

    t_ms: int
    client: str
    kind: str
    reason: str
    message: dict[str, Any]


@dataclass(frozen=True)
class Sample:
    """One row of the time series, taken every ``sample_ms``: items running, capacity charged
    at the holder (outstanding grant permits + lease footprint), the limit and ceiling, items
    queued (enqueued, not started), and items admitted and completed since the previous row."""

    t_ms: int
    running: int
    charged: int
    limit: int
    ceiling: int
    queued: int
    admitted: int
    completed: int


@dataclass
class Result:
    """What a run measured. Latencies are ``{"p50", "p95", "p99", "mean", "max"}`` in ms (empty
    when nothing was measured); utilizations are fractions (``None`` when undefined)."""

    scenario: Scenario
    ceiling: int
    run_ms: int
    utilization: float | None
    utilization_backlog: float | None
    backlog_ms: int
    enqueued: int
    admitted: int
    completed: int
    by_lease: int
    latency_ms: dict[str, float]
    free_to_start_ms: dict[str, float]
    max_running: int
    max_charged: int
    requests: int
    syncs: int
    sync_reasons: dict[str, int]
    blocked_ms: dict[str, int]
    net: dict[str, int]
    client_evictions: int
    holder_evictions: int
    samples: list[Sample] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    #: What the run used as Cloudflare bills it (:mod:`semaphore.simulate.cost`).
    usage: Usage | None = None

    @property
    def max_running_over(self) -> int:
        """Worst ``running - limit`` (negative: never reached the limit)."""
        return self.max_running - self.scenario.limit

    @property
    def max_charged_over(self) -> int:
        """Worst ``charged - limit`` at the holder."""
        return self.max_charged - self.scenario.limit

    @property
    def calls(self) -> int:
        """Holder calls: requests plus syncs sent by the client objects."""
        return self.requests + self.syncs

    def per_item(self, n: int) -> float | None:
        """``n`` per admitted item (``None`` if nothing was admitted)."""
        return n / self.admitted if self.admitted else None


def percentiles(values: list[int]) -> dict[str, float]:
    """p50/p95/p99 (nearest rank), mean and max of ``values``; ``{}`` for none."""
    if not values:
        return {}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return float(ordered[max(0, math.ceil(p * len(ordered)) - 1)])

    return {"p50": rank(0.50), "p95": rank(0.95), "p99": rank(0.99),
            "mean": sum(ordered) / len(ordered), "max": float(ordered[-1])}


def job_duration(scenario: Scenario, item_id: str) -> int:
    """The virtual duration (ms) of item ``item_id``'s job, drawn from the scenario's job
    durations with a generator seeded by the seed and the item id (the same in every mode)."""
    rng = random.Random(f"{scenario.seed}:job:{item_id}")
    if scenario.job_duration == "fixed":
        value = scenario.job_ms
    elif scenario.job_duration == "exponential":
        value = rng.expovariate(1 / scenario.job_ms)
    else:
        value = rng.lognormvariate(scenario.job_mu, scenario.job_sigma)
    return max(1, round(value))


# ---------------------------------------------------------------------------------- arrivals
def plan_arrivals(scenario: Scenario) -> list[Arrival]:
    """Every open-loop arrival of the run (steady, bursty, diurnal, csv), in time order. The
    backlog pattern is closed-loop (a new item when one starts) and is not in the list."""
    run_ms = int(scenario.run_s * 1000)
    out: list[Arrival] = []
    for i in range(scenario.clients):
        groups = scenario.client_groups(i)
        for pattern in scenario.arrivals:
            rng = random.Random(f"{scenario.seed}:{pattern}:{i}")
            times = _PATTERNS[pattern](scenario, rng, run_ms) if pattern in _PATTERNS else []
            out += [Arrival(t, i, rng.choice(groups)) for t in times]
    if "csv" in scenario.arrivals:
        out += read_arrivals(scenario)
    out.sort(key=lambda a: (a.at_ms, a.client))
    return [a for a in out if a.at_ms < run_ms]


def _steady(s: Scenario, rng: random.Random, run_ms: int) -> list[int]:
    return _poisson(rng, run_ms, s.rate_per_s, lambda t: 1.0)


def _diurnal(s: Scenario, rng: random.Random, run_ms: int) -> list[int]:
    def shape(t: float) -> float:
        return (1 + s.diurnal_amplitude * math.sin(2 * math.pi * t / (s.diurnal_period_s * 1000))) / (
            1 + s.diurnal_amplitude)

    return _poisson(rng, run_ms, s.rate_per_s * (1 + s.diurnal_amplitude), shape)


def _poisson(rng: random.Random, run_ms: int, peak_per_s: float, shape: Callable[[float], float]) -> list[int]:
    """A Poisson process of rate ``peak * shape(t)`` (thinning)."""
    out: list[int] = []
    if peak_per_s <= 0:
        return out
    t = 0.0
    while True:
        t += rng.expovariate(peak_per_s / 1000)
        if t >= run_ms:
            return out
        if rng.random() < shape(t):
            out.append(int(t))


def _bursty(s: Scenario, rng: random.Random, run_ms: int) -> list[int]:
    every = s.burst_every_s * 1000
    start = rng.uniform(0, every)
    out: list[int] = []
    while start < run_ms:
        out += [int(start + rng.uniform(0, s.burst_span_ms)) for _ in range(s.burst_size)]
        start += every
    return sorted(out)


_PATTERNS: dict[str, Callable[[Scenario, random.Random, int], list[int]]] = {
    "steady": _steady, "bursty": _bursty, "diurnal": _diurnal}


def read_arrivals(scenario: Scenario) -> list[Arrival]:
    """The arrivals of ``scenario.arrivals_csv`` (:func:`~semaphore.simulate.scenario.read_arrivals_csv`:
    columns ``at_ms,client`` and optionally ``group,duration_ms``). Raises its ``ScenarioError``
    for a bad header or row."""
    return [Arrival(*row) for row in read_arrivals_csv(scenario)]


def sync_reason(side: ClientSide, key: str = KEY) -> str:
    """Why the queue of ``side`` is sending a sync now, read from its client's state (first
    match): ``claim`` (a claim to confirm, R15a), ``stop-return`` (a stop returning undrawn
    lease permits), ``release`` (releases or stops of used-up leases), ``recheck`` (the
    post-request re-check), else ``heartbeat``."""
    client = side.client
    grants, leases = client.grants(key), client.leases(key)
    if any(g.claimed > g.sent_claimed and not g.final for g in grants):
        return "claim"
    if any(x.stopped and not x.sent_stopped and x.undrawn > 0 for x in leases):
        return "stop-return"
    if any(g.dirty for g in grants) or any(
            x.released > x.sent_released or (x.stopped and not x.sent_stopped) for x in leases):
        return "release"
    if client.check_at(key) is not None:
        return "recheck"
    return "heartbeat"


# ---------------------------------------------------------------------------------- the run
class RunningTime:
    """Integrates running items over virtual time (utilization, overall and while items wait),
    the one definition the simulator and ``scripts/bench_protocol.py``'s naive baseline share.
    The subclass keeps ``clock``, ``running`` and ``queued`` current; call :meth:`_account`
    before each change of them."""

    clock: SimClock
    running: int
    queued: int
    area: float = 0.0
    area_backlog: float = 0.0
    backlog_ms: int = 0
    last_t: int = 0

    def _account(self) -> None:
        """Integrate running items over time up to now (overall and while items wait)."""
        now = self.clock.now
        dt = now - self.last_t
        if dt > 0:
            self.area += self.running * dt
            if self.queued > 0:
                self.area_backlog += self.running * dt
                self.backlog_ms += dt
        self.last_t = now


class Simulation(RunningTime):
    """One run of a scenario (create it inside the event loop that runs it; then ``await
    run()``). ``on_message`` hooks see every message the client objects send; ``progress`` is
    called about every virtual ``sample_ms``."""

    def __init__(self, scenario: Scenario, *, on_message: list[MessageHook] | MessageHook | None = None,
                 progress: ProgressHook | None = None) -> None:
        scenario.validate()
        self.s = scenario
        self.hooks = on_message if isinstance(on_message, list) else [on_message] if on_message else []
        self.progress = progress
        self.clock = SimClock(T0)
        self.t0 = self.clock.now
        self.run_ms = int(scenario.run_s * 1000)
        leases = scenario.lease_options()
        config = LeaseConfig.parse(leases)
        self.ceiling = scenario.limit + (config.extra(scenario.limit) if config else 0)
        self.holder = HolderSide(self.clock, **self._holder_options(leases))
        self.net = Net(self._holder_call, self.clock, random.Random(f"{scenario.seed}:net"),
                       lose_request=scenario.lose_request, lose_reply=scenario.lose_reply,
                       duplicate=scenario.duplicate, delay=scenario.delay, max_delay_ms=scenario.max_delay_ms)
        self.sides = [ClientSide(f"c{i}", self.clock, self.transport, on_admit=self.on_admit,
                                 leases=leases is not None, **self._queue_options())
                      for i in range(scenario.clients)]
        self.side_of = {side.name: side for side in self.sides}
        self._init_accounting()

    def _holder_options(self, leases: dict[str, Any] | None) -> dict[str, Any]:
        s = self.s
        return {"limit": s.limit, "group_limit": dict(s.group_limits) or None, "leases": leases,
                "round_wait_ms": s.round_wait_ms, "round_period_ms": s.round_period_ms,
                "grant_timeout_ms": s.grant_timeout_ms, "hold_blocked_ms": s.hold_blocked_ms,
                "free_at_once": s.free_at_once}

    def _queue_options(self) -> dict[str, Any]:
        s = self.s
        return {"report_releases_within_ms": s.report_releases_within_ms, "prefer_leases": s.prefer_leases,
                "admit_concurrency": s.admit_concurrency, "retry_ms": s.retry_ms,
                "claim_margin_ms": s.claim_margin_ms, "lease_margin_ms": s.lease_margin_ms,
                "request_wait_ms": s.request_wait_ms}

    def _init_accounting(self) -> None:
        self.rng = random.Random(f"{self.s.seed}:faults")
        self.enqueued_at: dict[str, int] = {}
        self.durations: dict[str, int | None] = {}
        self.item_where: dict[str, tuple[str, str]] = {}
        self.backlog_items: set[str] = set()
        self.started: set[str] = set()
        self.counters: dict[str, int] = {}
        self.queued_by: dict[tuple[str, str], int] = {}
        self.queued = self.running = self.enqueued = self.admitted = self.completed = self.by_lease = 0
        self.interval = [0, 0]  # admitted, completed since the last sample
        self.area = self.area_backlog = 0.0
        self.backlog_ms = 0
        self.last_t = self.t0
        self.latencies: list[int] = []
        self.free_latencies: list[int] = []
        self.frees: deque[int] = deque()
        self.max_running = self.max_charged = 0
        self.requests = self.syncs = 0
        self.sync_reasons: dict[str, int] = {}
        self.blocked_ms: dict[str, int] = {}
        #: queued items per blocked reason at the last sample, and its time (blocked time is
        #: counted for the interval that follows a sample, up to the next one or the end)
        self._blocked_now: dict[str, int] = {}
        self._last_sample: int | None = None
        self.samples: list[Sample] = []
        self.problems: list[str] = []
        self.tasks: set[asyncio.Task[Any]] = set()
        self.client_evictions = self.holder_evictions = 0
        #: Active time (cost): the holder's (a call in progress), each client object's (a holder
        #: call awaited), and alarm invocations of holder instances evicted since.
        self.holder_active = ActiveTime()
        self.client_active: dict[str, ActiveTime] = {}
        self.holder_calls = 0
        self._holder_alarms_gone = 0
        self._usage: Usage | None = None  # taken at the end of the run, before the objects stop
        self.wall0 = time.perf_counter()

    @property
    def now(self) -> int:
        """Virtual ms since the start."""
        return self.clock.now - self.t0

    # ------------------------------------------------------------------ transport
    async def transport(self, key: str, message: dict[str, Any]) -> dict[str, Any]:
        """What every client object calls: counts and classifies the message, calls the hooks,
        sends it through the :class:`~semaphore.testing.Net`."""
        client = str(message.get("clientId"))
        if message.get("type") == "request":
            kind = reason = "request"
            self.requests += 1
        else:
            kind, reason = "sync", sync_reason(self.side_of[client], key)
            self.syncs += 1
            self.sync_reasons[reason] = self.sync_reasons.get(reason, 0) + 1
        for hook in self.hooks:
            hook(Message(self.now, client, kind, reason, message))
        active = self.client_active.setdefault(client, ActiveTime())
        active.begin(self.clock.now)
        try:
            reply = await self.net(key, message)
        finally:
            active.end(self.clock.now)
        self._sample_charged()
        return reply

    async def _holder_call(self, message: dict[str, Any]) -> dict[str, Any]:
        """A message delivered to the holder object: one billed call, active until answered."""
        self.holder_calls += 1
        self.holder_active.begin(self.clock.now)
        try:
            return await self.holder.handle(message)
        finally:
            self.holder_active.end(self.clock.now)

    def usage(self) -> Usage:
        """What the run used so far, as Cloudflare bills it (:class:`~semaphore.simulate.cost.Usage`)."""
        now = self.clock.now
        return Usage(holder_calls=self.holder_calls,
                     holder_alarms=self._holder_alarms_gone + self.holder.driver.fired,
                     client_alarms=sum(side.driver.fired for side in self.sides),
                     holder_active_s=self.holder_active.total_ms(now) / 1000,
                     client_active_s=sum(a.total_ms(now) for a in self.client_active.values()) / 1000)

    def _sample_charged(self) -> int:
        charged, _ = self.holder.charged()
        self.max_charged = max(self.max_charged, charged)
        return charged

    # ------------------------------------------------------------------ accounting
    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _call(self, name: str, fn: Callable[[ClientSide], Awaitable[Any]]) -> None:
        """Call into client object ``name`` until a call completes (an eviction cancels it:
        the caller, outside the object, tries again on the new instance)."""
        while True:
            side = self.side_of[name]
            task = side.spawn(fn(side))
            await asyncio.wait({task})
            if not task.cancelled():
                if task.exception() is not None:
                    self.problems.append(f"{name}: {task.exception()!r}")
                return
            await asyncio.sleep(0)

    def enqueue(self, client: int, group: str, duration_ms: int | None = None, *, backlog: bool = False) -> str:
        """Enqueue one item now for client object ``client``; returns its id."""
        name = self.sides[client].name
        n = self.counters.get(name, 0)
        self.counters[name] = n + 1
        item_id = f"{name}-{n}"
        self._account()
        self.queued += 1
        self.enqueued += 1
        self.queued_by[(name, group)] = self.queued_by.get((name, group), 0) + 1
        self.enqueued_at[item_id] = self.now
        self.durations[item_id] = duration_ms
        self.item_where[item_id] = (name, group)
        if backlog:
            self.backlog_items.add(item_id)
        self._spawn(self._call(name, lambda side: side.queue.enqueue(KEY, group, item_id)))
        return item_id

    # ------------------------------------------------------------------ the application
    def on_admit(self, side: ClientSide, item: Any) -> None:
        """The queue's ``on_admit``: start the item's job (once per item: a retried admission
        after an eviction finds it running)."""
        if item.item_id in self.started or item.item_id not in self.enqueued_at:
            return
        self.started.add(item.item_id)
        self._account()
        self.queued -= 1
        where = self.item_where[item.item_id]
        self.queued_by[where] -= 1
        self.running += 1
        self.admitted += 1
        self.interval[0] += 1
        self.latencies.append(self.now - self.enqueued_at[item.item_id])
        if self.frees:
            self.free_latencies.append(self.now - self.frees.popleft())
        if self.queued == 0:
            self.frees.clear()
        if item.permit is not None and item.permit.kind.value == "lease":
            self.by_lease += 1
        self.max_running = max(self.max_running, self.running)
        charged = self._sample_charged()
        if self.running > charged:
            self.problems.append(f"{self.running} running > {charged} charged at {self.now} ms")
        duration = self.durations[item.item_id] or job_duration(self.s, item.item_id)
        self._spawn(self._job(side.name, item.item_id, duration))
        if item.item_id in self.backlog_items and self.now < self.run_ms:
            self.enqueue(int(side.name[1:]), where[1], backlog=True)

    async def _job(self, name: str, item_id: str, duration_ms: int) -> None:
        await self.clock.sleep(duration_ms)
        self._account()
        self.running -= 1
        self.completed += 1
        self.interval[1] += 1
        if self.queued > 0:
            self.frees.append(self.now)
        await self._call(name, lambda side: side.queue.complete(item_id))

    # ------------------------------------------------------------------ drivers
    async def _arrivals(self, plan: list[Arrival]) -> None:
        for a in plan:
            await self.clock.sleep_until(self.t0 + a.at_ms)
            self.enqueue(a.client, a.group, a.duration_ms)

    def _start_backlog(self) -> None:
        if "backlog" not in self.s.arrivals:
            return
        n = self.s.backlog_clients or self.s.clients
        for i in range(min(n, self.s.clients)):
            rng = random.Random(f"{self.s.seed}:backlog:{i}")
            for _ in range(self.s.backlog):
                self.enqueue(i, rng.choice(self.s.client_groups(i)), backlog=True)

    async def _sampler(self) -> None:
        while self.now < self.run_ms:
            self.sample()
            await self.clock.sleep(self.s.sample_ms)

    def _count_blocked(self) -> None:
        """Add the time since the last sample to the blocked time of the items queued then, by
        the reason the holder had given for their group (``none``: not said)."""
        if self._last_sample is not None:
            dt = self.now - self._last_sample
            for reason, n in self._blocked_now.items():
                self.blocked_ms[reason] = self.blocked_ms.get(reason, 0) + n * dt
        self._last_sample = self.now
        self._blocked_now = {}
        for side in self.sides:
            waiting = {g: n for (name, g), n in self.queued_by.items() if name == side.name and n > 0}
            if not waiting:
                continue
            reasons = side.queue.blocked(KEY)
            for group, n in waiting.items():
                blocked = reasons.get(group)
                reason = blocked.reason.value if blocked is not None else "none"
                self._blocked_now[reason] = self._blocked_now.get(reason, 0) + n

    def sample(self) -> None:
        """Append one :class:`Sample` (and count the blocked time since the previous one)."""
        self._account()
        self._count_blocked()
        self.samples.append(Sample(self.now, self.running, self._sample_charged(), self.s.limit, self.ceiling,
                                   self.queued, *self.interval))
        self.interval = [0, 0]
        if self.progress is not None:
            self.progress(min(1.0, self.now / self.run_ms), time.perf_counter() - self.wall0)

    async def _faults(self) -> None:
        s = self.s
        if not (s.evict_client_p or s.evict_holder_p):
            return
        while True:
            await self.clock.sleep(s.fault_interval_ms)
            if self.rng.random() < s.evict_client_p:
                self.rng.choice(self.sides).evict()
                self.client_evictions += 1
            if self.rng.random() < s.evict_holder_p:
                self._holder_alarms_gone += self.holder.driver.fired  # evict() replaces the driver
                self.holder.evict()
                self.holder_evictions += 1

    async def run(self, *, quiet: bool = True) -> Result:
        """Run the scenario for ``run_s`` virtual seconds and return its :class:`Result`.
        ``quiet``: the library's log records (up to ``ERROR``: lost messages, cancelled rounds
        at the end) are silenced during the run (``logging.disable``, restored after)."""
        previous = logging.root.manager.disable
        if quiet:
            logging.disable(logging.ERROR)
        try:
            return await self._run()
        finally:
            logging.disable(previous)

    async def _run(self) -> Result:
        drivers = [asyncio.ensure_future(c) for c in (
            self._arrivals(plan_arrivals(self.s)), self._sampler(), self._faults())]
        self._start_backlog()
        await self.clock.advance_to(self.t0 + self.run_ms)
        self._account()
        self._usage = self.usage()
        if self.samples and self.samples[-1].t_ms == self.now:
            self._count_blocked()  # the last interval's blocked time; its row is there already
        else:
            self.sample()
        for task in drivers + list(self.tasks) + list(self.net.tasks):
            task.cancel()
        for side in self.sides:
            side.driver.kill()
            side.queue.abandon()
            for task in list(side.tasks):
                task.cancel()
        self.holder.tasks.cancel()
        self.holder.driver.close()
        await self.clock.settle()
        return self.result()

    def result(self) -> Result:
        """The :class:`Result` of what was measured so far."""
        limit_ms = self.s.limit * self.run_ms
        backlog = self.s.limit * self.backlog_ms
        return Result(
            scenario=self.s, ceiling=self.ceiling, run_ms=self.run_ms,
            utilization=self.area / limit_ms if limit_ms else None,
            utilization_backlog=self.area_backlog / backlog if backlog else None,
            backlog_ms=self.backlog_ms, enqueued=self.enqueued, admitted=self.admitted,
            completed=self.completed, by_lease=self.by_lease, latency_ms=percentiles(self.latencies),
            free_to_start_ms=percentiles(self.free_latencies), max_running=self.max_running,
            max_charged=self.max_charged, requests=self.requests, syncs=self.syncs,
            sync_reasons=dict(sorted(self.sync_reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
            blocked_ms=dict(sorted(self.blocked_ms.items(), key=lambda kv: (-kv[1], kv[0]))),
            net=dict(self.net.stats), client_evictions=self.client_evictions,
            holder_evictions=self.holder_evictions, samples=list(self.samples),
            problems=list(self.problems), wall_s=time.perf_counter() - self.wall0,
            usage=self._usage or self.usage())


async def simulate(scenario: Scenario, *, on_message: list[MessageHook] | MessageHook | None = None,
                   progress: ProgressHook | None = None, quiet: bool = True) -> Result:
    """Run ``scenario`` inside the running event loop (see :func:`run_scenario`)."""
    return await Simulation(scenario, on_message=on_message, progress=progress).run(quiet=quiet)


def run_scenario(scenario: Scenario, *, on_message: list[MessageHook] | MessageHook | None = None,
                 progress: ProgressHook | None = None, quiet: bool = True) -> Result:
    """Run ``scenario`` on a fresh event loop and return its :class:`Result` (deterministic per
    ``scenario.seed``). ``on_message`` (a callable or a list of them) is called with a
    :class:`Message` for every message a client object sends to the holder; ``progress`` with
    ``(virtual fraction done, wall seconds)`` at every sample; ``quiet`` silences the library's
    log records during the run (see :meth:`Simulation.run`)."""
    return asyncio.run(simulate(scenario, on_message=on_message, progress=progress, quiet=quiet))
