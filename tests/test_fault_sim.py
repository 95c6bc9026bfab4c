"""Seeded fault simulation: real holder + SemaphoreQueue clients over a faulty in-memory network
(SPEC R15a, R29-R37, I1-I5). See ``semaphore.simulate.faults`` for the model.

Per seed: 2 client objects, 8 items over 2 groups (about a third enqueued twice), an admission
callback that sometimes crashes after starting the work or is slow, completion notices sometimes
lost (found by reconciliation), messages lost (requests, some delivered late = reordered) and
replies lost, duplicated, delayed; the holder or a client evicted between steps. Then the network
heals and time runs until everything settles. Checked after every step and at the end:

* I1 - never more running items than ``limit`` (no leases, strict, under) or ``limit + extra``
  (over), nor a group above its group limit;
* no item runs without charged capacity at the holder (running <= charged, in total and per
  group) - i.e. no item runs without a confirmed claim or a lease draw (R15a);
* no permit is used by two items, no item is admitted under two permits (retried enqueue and
  retried admission are safe);
* every item runs exactly once; I3 - the holder's outstanding and lease footprint are 0 at the end
  (I2/I4: duplicated, reordered and lost messages never return capacity twice nor leak it).
"""

from __future__ import annotations

import asyncio

import pytest

from semaphore.simulate.faults import FAULT_CONFIGS, Config, Sim, simulate

SEEDS = 60


pytestmark = pytest.mark.usefixtures("quiet_logs")  # failures are injected on purpose


@pytest.mark.parametrize("name", sorted(FAULT_CONFIGS))
def test_fault_simulation(name: str):
    # I1, I2, I3, I4, R15a, R29-R37
    failures = []
    totals = {"lease_runs": 0, "grant_runs": 0, "holder_evictions": 0, "client_evictions": 0,
              "lost_completions": 0, "admit_failures": 0}
    for seed in range(SEEDS):
        stats, problems = asyncio.run(simulate(FAULT_CONFIGS[name](seed)))
        if problems:
            failures.append((seed, problems[:3]))
        for k in totals:
            totals[k] += getattr(stats, k)
    assert not failures, failures
    # the simulation really exercised what it claims to
    assert totals["holder_evictions"] > 10 and totals["client_evictions"] > 10
    assert totals["lost_completions"] > 10 and totals["admit_failures"] > 10
    if name == "grants-only":
        assert totals["lease_runs"] == 0
    else:
        assert totals["lease_runs"] > 50 and totals["grant_runs"] > 50


def test_the_checker_catches_unpermitted_running_work():
    # the invariant check itself can fail: work running with nothing charged at the holder
    async def scenario():
        sim = Sim(Config(seed=1))
        sim.running["ghost"] = ("c0", "a")
        sim.check_capacity()
        return sim.violations

    violations = asyncio.run(scenario())
    assert any("charged" in v for v in violations)
