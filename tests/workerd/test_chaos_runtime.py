"""Tier 3: a short chaos run on the real runtime (``scripts/chaos.py``, issue 21).

The reference Worker in workerd with the development bundle, one account under one limit and a
few JobQueue client objects running in-Worker jobs (payload ``{"workMs": n}``), workerd killed
with SIGKILL a few times at seeded random moments and restarted on the same storage while the
load goes on. Then, from what the objects stored (the run records of ``GET .../runs``, the
queues, the holder's usage and holders, every object's alarm): no job lost, none completed
twice or run under two permits (R37: a run cut short by a kill is called again under the same
permit, counted as a re-attempt), never more running than the limit (I1), the charge back to 0
(I3) and no object left with something due and no alarm (R16). The script's full run
(``scripts/chaos``: 1,000 jobs, 25 kills) is the long version of this.

Driven by events and polling with generous timeouts: every request retries through the
restarts, the run stops when every job is seen done, and the settle waits for the charge to
return to 0; no fixed sleep is an assertion.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.workerd

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "chaos.py"


def load_chaos() -> Any:
    spec = importlib.util.spec_from_file_location("chaos_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("setting", ["defaults", "reuse-held"])
def test_a_short_chaos_run_loses_nothing_runs_nothing_twice_and_stays_under_the_limit(
        workerd_runtime: dict[str, Any], setting: str) -> None:
    if workerd_runtime["skip"]:
        pytest.skip(workerd_runtime["skip"])
    chaos = load_chaos()
    # Jobs longer than the full run's (0.4-1.2 s), so that a kill is likely to cut some short.
    opts = chaos.Options(setting=setting, jobs=36, kills=3, queues=4, limit=4, seed=21, work_ms=(400, 1200),
                         kill_after=(1.5, 4.0), timeout=150.0, settle=120.0, quiet=True)
    try:
        report = chaos.run_chaos(opts)
    except chaos.ChaosError as exc:
        pytest.fail(str(exc), pytrace=False)
    print(chaos.render(report, opts))
    assert report.violations == [], "\n".join(report.violations)
    assert len(report.kills) == 3 and report.jobs == 36
    assert report.lost == [] and report.twice == []
    assert report.completed_runs == 36  # each job completed exactly once
    assert report.runs == 36 + report.reattempts and report.cut_short == report.reattempts
    assert 0 < report.max_running <= 4
    assert report.final_usage["charged"] == 0 and report.holders_left == 0
