"""The soak (issue 12): a few seeds of tests/soak_sim.py per mode, its replay is deterministic,
its checks can fail, and the test kit's fault injection hooks (storage transactions that raise
midway, late/duplicated/retried alarms, per-object clock skew) do what they say.

The full soak is ``scripts/soak`` (README "The soak")."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from semaphore.holder import META
from semaphore.testing import T0, AlarmDriver, LocalStorage, SimClock, SkewedClock, StorageFault, TaskAlarmDriver
from soak_sim import KINDS, MODES, SoakConfig, SoakSim, run_one, summarize

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
