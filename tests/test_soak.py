"""The soak: a few seeds of ``semaphore.simulate.soak`` per mode, its replay is deterministic,
its checks can fail, and the test kit's fault injection hooks (storage transactions that raise
midway, late/duplicated/retried alarms, per-object clock skew) do what they say.

The full soak is ``scripts/soak`` (README "The soak")."""

from __future__ import annotations

import asyncio
import collections
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import semaphore.core.rounds as rounds
from semaphore.core.ledger import Ledger
from semaphore.holder import META
from semaphore.holder._store import SqlStore
from semaphore.simulate.soak import KINDS, MODES, SoakConfig, SoakHolder, SoakSim, run_one, summarize
from semaphore.testing import (
    SEED_TIMING,
    T0,
    AlarmDriver,
    LocalStorage,
    SimClock,
    SkewedClock,
    StorageFault,
    TaskAlarmDriver,
)

ROOT = Path(__file__).resolve().parents[1]
SEEDS = (0, 1)
OPS = 150

pytestmark = pytest.mark.usefixtures("quiet_logs")  # failures are injected on purpose

#: Every other fault off: only what a test sets.
QUIET = {"p_tx_fail": 0.0, "p_alarm_delay": 0.0, "p_alarm_duplicate": 0.0, "p_alarm_retry": 0.0,
         "p_invalid": 0.0, "p_evict": 0.0, "p_lost_completion": 0.0, "p_admit_fail": 0.0, "p_net": 0.0,
         "p_retry_enqueue": 0.0, "skew_ms": 0}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_soak_seeds_have_no_violation(mode: str):
    # I1-I5, items lost or run twice: all 0, with every fault kind injected
    results = [run_one(seed, mode, ops=OPS) for seed in SEEDS]
    failed = [(r.seed, r.found[:3]) for r in results if r.failed]
    assert not failed, failed
    table = summarize(results, [mode])
    assert table["operations (holder messages handled)"][mode] >= OPS * len(SEEDS)
    for label in ("client transactions raised midway", "alarms delayed", "alarms duplicated",
                  "alarms retried (injected)", "objects with clock skew", "invalid messages",
                  "lost requests", "duplicated messages", "client evictions"):
        assert table[f"fault: {label}"][mode] > 0, label
    assert 0 < table["fault: max clock skew (ms)"][mode] <= 200


def test_holder_transactions_raise_midway_too():
    r = run_one(0, "strict", ops=OPS, p_tx_fail=0.2)
    assert r.stats.holder_tx_failed > 0 and r.stats.client_tx_failed > 0
    assert not r.failed, r.found[:3]


def _soak(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "soak.py"), *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_seed_replays_the_same_summary():
    args = ("--seed", "3", "--modes", "strict,over", "--ops-per-run", "120", "--jobs", "1")
    first, second = _soak(*args), _soak(*args)
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout == second.stdout
    assert "violations: I1" in first.stdout and "result: OK" in first.stdout
    assert "operations (holder messages handled)" in first.stdout


def test_the_checks_can_fail():
    async def scenario() -> dict[str, int]:
        sim = SoakSim(SoakConfig.for_mode(0, "none", ops=10))
        sim.running["ghost"] = ("c0", "a")  # work running on nothing charged: I4
        sim.check_step()
        await sim.holder.usage()  # the holder's tables exist
        sim.holder.storage.connection.execute(  # the holder's aggregate disagrees with its rows: I2
            f"INSERT OR REPLACE INTO {META} (key, value) VALUES ('outstanding', 7)")
        sim.check_step()
        sim.violations.append("item1 admitted under two permits (a) and (b)")
        sim.check_step()
        for side in sim.sides:
            side.driver.kill()
        return sim.stats.violations

    violations = asyncio.run(scenario())
    assert violations["I4"] >= 1 and violations["I2"] >= 1 and violations["twice"] == 1
    assert set(violations) == set(KINDS)


def test_an_invalid_message_that_changes_storage_is_caught():
    async def scenario() -> dict[str, int]:
        sim = SoakSim(SoakConfig.for_mode(0, "none", ops=10))

        async def sloppy(message: object) -> dict[str, object]:
            sim.holder.storage.sql.exec("CREATE TABLE IF NOT EXISTS scribble (x INTEGER)")
            return {"v": 1, "error": {"code": "invalid_message", "message": "no"}}

        sim.holder.sem.handle = sloppy  # type: ignore[method-assign]
        sim.invalid_message()
        for side in sim.sides:
            side.driver.kill()
        return sim.stats.violations

    assert asyncio.run(scenario())["I5"] == 1


@pytest.mark.xfail(strict=True, reason=(
    "finding (soak, clock skew): a client whose clock runs ahead of the holder's by more than "
    "grant_timeout_ms - claim_margin_ms (4000 - 500 ms here) takes every grant for expired on "
    "arrival and never claims it: its items never run and the holder keeps re-granting to it "
    "(I3: capacity never returns to 0, items lost). README: the clocks must agree."))
@pytest.mark.parametrize("offset_ms", [3600])
def test_client_clock_ahead_of_the_claim_window(offset_ms: int):
    r = run_one(0, "none", ops=60, clients=1, offsets=(0, offset_ms), **QUIET)
    assert not r.failed, r.found[:3]


def test_skew_within_the_claim_window_is_tolerated():
    for offset in (3400, -5000):
        r = run_one(0, "none", ops=60, clients=1, offsets=(0, offset), **QUIET)
        assert not r.failed, (offset, r.found[:3])


# ---------------------------------------------------------------------------------- the hooks


def test_fail_transaction_raises_after_statements_ran_and_rolls_back():
    storage = LocalStorage()
    storage.sql.exec("CREATE TABLE t (x INTEGER)")
    storage.fail_transaction = lambda: 2

    def body() -> None:
        for i in range(5):
            storage.sql.exec("INSERT INTO t VALUES (?)", i)

    with pytest.raises(StorageFault):
        storage.transactionSync(body)
    assert storage.transactions_failed == 1
    assert storage.sql.exec("SELECT COUNT(*) AS n FROM t").one()["n"] == 0
    storage.fail_transaction = lambda: 9  # more than it runs: fails before the commit
    with pytest.raises(StorageFault):
        storage.transactionSync(body)
    assert storage.sql.exec("SELECT COUNT(*) AS n FROM t").one()["n"] == 0
    storage.fail_transaction = None
    storage.transactionSync(body)
    assert storage.sql.exec("SELECT COUNT(*) AS n FROM t").one()["n"] == 5


def test_alarm_duplicate_and_spurious_retry():
    async def scenario() -> list[dict[str, object]]:
        clock = SimClock(T0)
        storage = LocalStorage()
        calls: list[dict[str, object]] = []

        async def handler(info: dict[str, object]) -> None:
            calls.append(info)

        driver = AlarmDriver(clock, storage, handler)
        driver.duplicate = lambda: driver.duplicated == 0
        driver.spurious_retry = lambda: driver.spurious_retries == 0
        await storage.setAlarm(T0 + 100)
        await clock.advance(10_000)
        assert driver.duplicated == 1 and driver.spurious_retries == 1
        return calls

    calls = asyncio.run(scenario())
    assert [c["isRetry"] for c in calls] == [False, False, True]


def test_skewed_clock_reads_sleeps_and_fires_alarms_on_its_own_time():
    async def scenario() -> None:
        base = SimClock(T0)
        ahead = SkewedClock(base, 200)
        assert ahead() == ahead.now == T0 + 200
        storage = LocalStorage()
        fired: list[int] = []

        async def handler(info: dict[str, object]) -> None:
            fired.append(base.now)

        driver = TaskAlarmDriver(ahead, storage, handler)
        await storage.setAlarm(T0 + 1000)  # the object's time: the shared clock's T0 + 800
        woke: list[int] = []

        async def sleeper() -> None:
            await ahead.sleep_until(T0 + 500)
            woke.append(base.now)

        task = asyncio.ensure_future(sleeper())
        await base.advance(2000)
        await task
        assert woke == [T0 + 300] and fired == [T0 + 800]
        driver.close()

    asyncio.run(scenario())


# --- The soak's own checks: faults after writes, per-permit I2/I4, alarm counters --------------
# The soak, from its cold review (issue 12), each finding fixed: injected transaction failures
# strike after writes too; an eviction during a duplicated alarm delivery is retried; I4's
# deadline half and the per-permit halves of I2 and I4 are checked (a holder bug that reclaims late
# or frees twice is caught although the totals add up); the holder's alarm counters survive its
# evictions; "alarms delayed" counts deliveries that were late.


def _run(cfg: SoakConfig, setup: Any = None, per_step: Any = None) -> SoakSim:
    """One soak run like semaphore.simulate.soak._soak, with hooks to set up the sim and to look after each step."""

    async def go() -> SoakSim:
        sim = SoakSim(cfg)
        if setup is not None:
            setup(sim)
        if per_step is not None:
            check = sim.check_step

            def step() -> None:
                check()
                per_step(sim)

            sim.check_step = step  # type: ignore[method-assign]
        await sim.run()
        await sim.finish()
        for side in sim.sides:
            side.driver.kill()
        return sim

    return asyncio.run(go())


def _violations(sim: SoakSim) -> dict[str, int]:
    return {k: v for k, v in sim.stats.violations.items() if v}


def _running_on_freed_capacity(sim: SoakSim) -> int:
    """Ground truth for "no item runs on capacity the holder has freed", per permit: permits whose
    running items outnumber what the holder still charges for that grant or lease."""
    grants, leases = sim.holder.grants(), sim.holder.leases()
    use = collections.Counter(sim.started[i][:2] for i in sim.running)
    bad = 0
    for (kind, pid), n in use.items():
        if kind == "grant":
            r = grants.get(pid)
            charge = 0 if r is None else r["permits"] - r["released"]
        else:
            r = leases.get(pid)
            if r is None:
                charge = 0
            elif r["status"] == "retired" and r["stopped"]:
                charge = r["drawn"] - r["released"]
            else:
                charge = r["permits"] - r["released"]
        bad += n > charge
    return bad


# ------------------------------------------------------------------------------------------ 1
def test_holder_transaction_faults_strike_after_a_write_was_made(monkeypatch: pytest.MonkeyPatch):
    """"A storage transaction that raises midway ... (rolled back)": Faults.tx draws n in 0..4,
    but a holder round or sync reads for its first 5-8 statements (its first write is statement
    5-9 of 6-16), so the injected holder fault nearly always strikes before the first write and
    the rollback undoes nothing (0 of 40 holder faults over 20 default runs; ~3% at
    p_tx_fail=0.3, only in the few transactions that write early). Fix: draw n over the
    transaction's whole length (e.g. randint(0, 32); the hook already fails at the commit when
    fn runs fewer), so a fault also hits after the grant/lease/aggregate writes."""
    written_before_fault: list[int] = []
    orig = LocalStorage.transactionSync

    def tx(self: LocalStorage, fn: Any) -> Any:
        if self._depth != 0 or id(self) not in holder_storages:
            return orig(self, fn)
        before = self.connection.total_changes  # counts rows written, rolled back or not
        try:
            return orig(self, fn)
        except StorageFault:
            written_before_fault.append(self.connection.total_changes - before)
            raise

    monkeypatch.setattr(LocalStorage, "transactionSync", tx)
    holder_storages: set[int] = set()

    def setup(sim: SoakSim) -> None:
        holder_storages.add(id(sim.holder.storage))  # evictions keep the object's storage

    for mode in ("none", "strict"):
        _run(SoakConfig.for_mode(0, mode, ops=150, p_tx_fail=0.3), setup=setup)
    assert len(written_before_fault) >= 10, written_before_fault  # many holder faults injected
    after_a_write = sum(n > 0 for n in written_before_fault)
    assert after_a_write >= len(written_before_fault) // 5, (
        f"only {after_a_write} of {len(written_before_fault)} holder transaction faults struck after a write")


# ------------------------------------------------------------------------------------------ 2
LATE_MS = 60_000


def _reclaim_late(monkeypatch: pytest.MonkeyPatch, late_ms: int = LATE_MS) -> None:
    """A holder bug: unclaimed grant permits come back ``late_ms`` (a minute) after their
    deadline (the alarm and the due list both shifted)."""
    monkeypatch.setattr(Ledger, "due_grants", lambda self, now: [
        g for g in self.grants.values() if g.claim_by + late_ms <= now and g.claimed < g.permits])
    orig = SqlStore.next_reclaim_due

    def due(self: SqlStore) -> int | None:
        d = orig(self)
        return None if d is None else d + late_ms

    monkeypatch.setattr(SqlStore, "next_reclaim_due", due)


def test_i4_unclaimed_permits_back_by_their_deadline_is_checked(monkeypatch: pytest.MonkeyPatch):
    """SPEC I4: "unclaimed grant permits come back by their deadline (plus alarm delay)". The
    soak's I4 is only running <= charged; a holder that reclaims 60 s late passes (in the correct
    library an unclaimed permit stays charged at most ~1.6 s past claim_by in these runs). Fix:
    after each step, flag a grant with claimed < permits still held well past claim_by (its
    deadline + max alarm delay + retry backoff)."""
    _reclaim_late(monkeypatch)
    showed = 0
    for seed in range(6):  # whether a grant's permits go unclaimed at all depends on the run
        worst: list[int] = [0]

        def per_step(sim: SoakSim, worst: list[int] = worst) -> None:
            now = sim.holder.clock.now
            worst.extend(now - r["claim_by"] for r in sim.holder.grants().values() if r["claimed"] < r["permits"])

        sim = _run(SoakConfig.for_mode(seed, "none", ops=150), per_step=per_step)
        if max(worst) > 30_000:  # the bug showed: permits charged half a minute past their deadline
            showed += 1
            assert sim.stats.violations["I4"] > 0, (seed, _violations(sim))
    assert showed > 0


# ------------------------------------------------------------------------------------------ 3
def test_a_repeated_report_that_frees_capacity_twice_is_caught(monkeypatch: pytest.MonkeyPatch):
    """SPEC I2: "no report, however repeated, ... returns capacity twice". A holder bug: a report
    repeating the stored released count frees one more permit. In this run items do run on
    capacity the holder freed (checked per permit below), yet the soak reports nothing: its I2 is
    aggregates == recount (consistent here) and its I4 is the aggregate running <= charged, which
    other grants' unclaimed permits and lease footprints hide. Fix: check per permit (each
    running item's grant/lease still charges it) and per row (released <= what the application
    actually finished under that grant/lease)."""

    def raise_counts(used: int, released: int, ru: int, rr: int, cap: int) -> tuple[int, int]:
        nu = min(max(used, ru), cap)
        if rr > 0 and rr == released:  # the bug: a repeated report frees again
            return nu, min(released + 1, nu)
        return nu, min(max(released, rr), nu)

    monkeypatch.setattr(rounds, "raise_counts", raise_counts)
    showed = 0
    for seed in range(6):  # whether a report repeats while its item runs depends on the run
        freed_in_use: list[int] = []
        sim = _run(SoakConfig.for_mode(seed, "strict", ops=150),
                   per_step=lambda s, out=freed_in_use: out.append(_running_on_freed_capacity(s)))
        if sum(freed_in_use) > 0:  # the bug showed: an item ran on capacity the holder had freed
            showed += 1
            assert sim.stats.violations["I2"] + sim.stats.violations["I4"] > 0, (seed, _violations(sim))
    assert showed > 0


# ------------------------------------------------------------------------------------------ 4
def test_an_eviction_during_a_duplicated_alarm_delivery_is_retried():
    """TaskAlarmDriver: a handler cancelled by eviction counts as a failure and is retried (like
    the runtime), but _after_success runs the duplicated delivery under ``except Exception``, so
    cancelling it (eviction: CancelledError is a BaseException) records no failure and schedules
    no retry: the interrupted delivery is dropped. Fix: catch BaseException there too (as
    TaskAlarmDriver._run does), or let TaskAlarmDriver run the duplicate through _run."""

    async def scenario(kill_at_ms: int) -> tuple[int, int | None]:
        clock = SimClock(T0)
        storage = LocalStorage()

        async def handler(info: dict[str, Any]) -> None:
            await clock.sleep(1000)

        driver = TaskAlarmDriver(clock, storage, handler)
        driver.duplicate = lambda: driver.duplicated == 0
        await storage.setAlarm(T0 + 100)
        await clock.advance(kill_at_ms)
        driver.kill()  # evicted
        await clock.settle()
        result = (len(driver.failures), storage.alarm)
        driver.close()
        return result

    failures, alarm = asyncio.run(scenario(600))  # during the first delivery: retried
    assert failures == 1 and alarm is not None
    failures, alarm = asyncio.run(scenario(1600))  # during the duplicated delivery
    assert failures == 1 and alarm is not None, (failures, alarm)


# ------------------------------------------------------------------------------------------ 5
def test_holder_alarm_fault_counters_survive_holder_evictions(monkeypatch: pytest.MonkeyPatch):
    """The summary's "alarms duplicated", "alarms retried (injected)" and "alarm handlers raised"
    read self.holder.driver only; Bed.evict makes a new AlarmDriver, so every holder eviction
    drops the holder's counts so far. Fix: accumulate the old driver's counters in
    SoakHolder._start (or count in Faults, as alarm_delay does)."""
    drivers: list[AlarmDriver] = []
    orig = SoakHolder._start

    def start(self: SoakHolder) -> None:
        orig(self)
        drivers.append(self.driver)

    monkeypatch.setattr(SoakHolder, "_start", start)
    sim = _run(SoakConfig.for_mode(0, "strict", ops=250))
    assert sim.stats.holder_evictions > 0
    every = [side.driver for side in sim.sides] + drivers
    assert (sim.stats.alarm_duplicates, sim.stats.alarm_retries, sim.stats.alarm_failures) == (
        sum(d.duplicated for d in every), sum(d.spurious_retries for d in every),
        sum(len(d.failures) for d in every))


# ------------------------------------------------------------------------------------------ 6
def test_alarms_delayed_counts_deliveries_that_were_late(monkeypatch: pytest.MonkeyPatch):
    """"alarms delayed" counts every delay drawn by AlarmDriver.due(), which draws again whenever
    the object re-arms; most of those alarms are re-armed before they come due and are never
    delivered late. The count exceeds even the number of deliveries made after their alarm time
    (for any reason). Fix: count in AlarmDriver._deliver when the delivered alarm carried a delay."""
    late = [0]
    orig = AlarmDriver._deliver

    async def deliver(self: AlarmDriver) -> dict[str, Any] | None:
        alarm = self.storage.alarm
        if alarm is not None and self.clock.now > alarm:
            late[0] += 1
        return await orig(self)

    monkeypatch.setattr(AlarmDriver, "_deliver", deliver)
    sim = _run(SoakConfig.for_mode(0, "strict", ops=250))
    assert sim.stats.alarm_delays <= late[0], (sim.stats.alarm_delays, late[0])


# --- The soak's I4 deadline allowance ----------------------------------------------------------
# Issue 12, second cold review of the soak (its per-permit checks): the deadline half of I4
# allowed a flat 12 s past claimBy, so a holder reclaiming 5 s late, or with no reclaim alarm at
# all (R16), passed with zero violations. Fixed: the allowance is derived (the alarm's delivery
# delay plus a margin, plus a backoff and a delay per holder transaction failed since).


LATE_RECLAIM_MS = 5000  # more than the soak's grant_timeout_ms (4 s) late


def _reclaim_5s_late(monkeypatch: pytest.MonkeyPatch) -> None:
    _reclaim_late(monkeypatch, LATE_RECLAIM_MS)


def _no_reclaim_alarm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Holder bug (SPEC R16 broken): the alarm never follows the earliest claimBy; unclaimed
    permits come back only when some round or sync happens to reclaim them."""
    monkeypatch.setattr(SqlStore, "next_reclaim_due", lambda self: None)


BUGS: dict[str, Any] = {"reclaim_5s_late": _reclaim_5s_late, "no_reclaim_alarm": _no_reclaim_alarm}


@pytest.mark.parametrize(("bug", "mode"), [
    ("reclaim_5s_late", "none"),
    ("no_reclaim_alarm", "over"),
    ("no_reclaim_alarm", "under"),
])
def test_i4_deadline_half_catches_a_holder_that_reclaims_seconds_late(
        monkeypatch: pytest.MonkeyPatch, bug: str, mode: str) -> None:
    """SPEC I4: "unclaimed grant permits come back by their deadline (plus alarm delay)". The
    soak's alarm delay is at most ``max_alarm_delay_ms`` (2 s); the holder's alarm handler never
    raises (the scheduler absorbs a failed reclaim and backs it off 1 s, doubling), so a correct
    holder is late by at most 2 s + (1 s + 2 s) per failed reclaim transaction. Measured: worst
    1.9 s over the README's 400 default runs, 3.8 s over 16 runs at p_tx_fail=0.3. Yet
    ``reclaim_slack_ms`` is 12 s (README: "the alarm's delivery delay plus a retry's backoff",
    which is 2 s + 2 s, not 12 s), three times the soak's 4 s grant timeout. So a holder that
    reclaims 5 s late, or one whose alarm does not follow claimBy at all (R16; 5.7-8.8 s late
    here), passes the soak with zero violations.

    Fixed as suggested: the allowance is derived instead of a flat 12 s: ``max_alarm_delay_ms`` plus, for each
    holder transaction that failed since the grant's claimBy (count
    ``holder.storage.transactions_failed`` at each step), one scheduler backoff
    (1 s doubling) plus another ``max_alarm_delay_ms``; or, exactly, flag a grant still
    unclaimed after a holder alarm delivery at holder time >= claimBy that ran with no holder
    transaction failure. Document the figure in the README."""
    seeds = range(6)  # rounds and syncs reclaim too (R16), so a missing alarm shows in some runs only
    for seed in seeds:
        control = run_one(seed, mode, ops=250, **SEED_TIMING)  # batched: fewer rounds reclaim for it
        assert not control.failed, control.found[:3]
        assert control.stats.max_unclaimed_late_ms <= SoakConfig.max_alarm_delay_ms + 1000  # a tight bound holds

    BUGS[bug](monkeypatch)
    showed = 0
    for seed in seeds:
        r = run_one(seed, mode, ops=250, **SEED_TIMING)
        if r.stats.max_unclaimed_late_ms > 4000:  # the bug showed in this run: the soak must say so
            showed += 1
            assert r.stats.violations["I4"] > 0, (seed, r.stats.max_unclaimed_late_ms, r.found[:3])
    assert showed > 0


def test_grant_permits_given_back_after_claim_by_do_not_free_the_slot_an_item_runs_under():
    # R37 decision (surplus grants), R15, R15a, I4: a give-back whose report reached the holder
    # after the grant's claimBy was refused there, and the release sent with it was counted
    # against the slot an item ran under ("1 items run under grant h41, which charges 0"). Seed 3
    # strict with clock skew +-500 ms (the soak's own replay line) found it.
    r = run_one(3, "strict", ops=250, skew_ms=500)
    assert not r.failed, r.found[:3]


def test_grant_permits_given_back_with_no_item_are_not_taken_for_a_double_release():
    # I2's per-row half allows, for a grant, the permits claimed that no item started under: the
    # queue gives them back at once (R37's surplus grants), each once. Seed 13 "over" (the soak's
    # own replay line) was reported "grant h110 counts 1 released, 0 items finished under it".
    r = run_one(13, "over", ops=714, skew_ms=200)
    assert not r.failed, r.found
