"""Issue 12, second cold review of the soak (its per-permit checks): the deadline half of I4
allowed a flat 12 s past claimBy, so a holder reclaiming 5 s late, or with no reclaim alarm at
all (R16), passed with zero violations. Fixed: the allowance is derived (the alarm's delivery
delay plus a margin, plus a backoff and a delay per holder transaction failed since)."""

from __future__ import annotations

from typing import Any

import pytest

from semaphore.holder._store import SqlStore
from soak_sim import SoakConfig, run_one
from test_soak_review import _reclaim_late

pytestmark = pytest.mark.usefixtures("quiet_logs")  # failures are injected on purpose

LATE_MS = 5000  # more than the soak's grant_timeout_ms (4 s) late


def _reclaim_5s_late(monkeypatch: pytest.MonkeyPatch) -> None:
    _reclaim_late(monkeypatch, LATE_MS)


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
        control = run_one(seed, mode, ops=250)
        assert not control.failed, control.found[:3]
        assert control.stats.max_unclaimed_late_ms <= SoakConfig.max_alarm_delay_ms + 1000  # a tight bound holds

    BUGS[bug](monkeypatch)
    showed = 0
    for seed in seeds:
        r = run_one(seed, mode, ops=250)
        if r.stats.max_unclaimed_late_ms > 4000:  # the bug showed in this run: the soak must say so
            showed += 1
            assert r.stats.violations["I4"] > 0, (seed, r.stats.max_unclaimed_late_ms, r.found[:3])
    assert showed > 0
