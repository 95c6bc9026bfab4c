"""Tier 1: the checks of ``scripts/chaos.py`` (the chaos run on the real runtime) on made-up
stored state, so that each one is seen to fail: a job lost, completed twice, re-attempted with
no kill in between or under a second permit, more runs at once than the limit (a run cut short
ends at the kill after it), a hung run, and an object with something due and no alarm.
No workerd is started here; tests/workerd/test_chaos_runtime.py runs the script for real."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "chaos.py"


@pytest.fixture(scope="module")
def chaos() -> Any:
    spec = importlib.util.spec_from_file_location("chaos_script_checks", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make(chaos: Any, tmp_path: Path, limit: int = 2, kills: tuple[tuple[int, int], ...] = ()) -> Any:
    c = chaos.Chaos(chaos.Options(jobs=0, kills=len(kills), queues=1, limit=limit, quiet=True), tmp_path)
    c.report.kills = [chaos.Kill(at_ms=a, dead_ms=d, up_ms=d + 1) for a, d in kills]
    return c


def run(job: str, attempt: int, start: int, end: int | None, permit: str = "grant:g:0") -> dict[str, Any]:
    return {"jobId": job, "attempt": attempt, "permit": permit, "startedAt": start, "endedAt": end, "queue": "q0"}


def done(*ids: str) -> dict[str, dict[str, Any]]:
    return {i: {"id": i, "state": "done", "queue": "q0"} for i in ids}


def test_every_job_completed_once_passes_and_a_cut_short_run_is_a_reattempt(chaos, tmp_path):
    c = make(chaos, tmp_path, kills=((150, 160),))
    c.acknowledged = {"a": "q0", "b": "q0"}
    runs = {"a": [run("a", 1, 100, None), run("a", 2, 300, 400)], "b": [run("b", 1, 100, 120)]}
    c.check_jobs(done("a", "b"), runs)
    c.check_concurrency(runs)
    rep = c.report
    assert rep.violations == [] and (rep.reattempts, rep.cut_short, rep.completed_runs) == (1, 1, 2)
    assert rep.max_running == 2  # a's first run lasts until the kill (160): b ran beside it


@pytest.mark.parametrize("case, runs, states, expect", [
    ("lost: not done", {"a": [run("a", 1, 100, 200)]}, {"a": "running"}, "lost"),
    ("lost: done without a completed run", {"a": [run("a", 1, 100, None)]}, {"a": "done"}, "lost"),
    ("completed twice", {"a": [run("a", 1, 100, 200), run("a", 2, 300, 400)]}, {"a": "done"}, "run twice"),
    ("two permits", {"a": [run("a", 1, 100, None), run("a", 2, 300, 400, "lease:l:0")]}, {"a": "done"}, "permits"),
    ("a re-attempt with no kill", {"a": [run("a", 1, 200, None), run("a", 2, 300, 400)]}, {"a": "done"}, "no kill"),
])
def test_each_job_check_fails_on_what_it_guards(chaos, tmp_path, case, runs, states, expect):
    c = make(chaos, tmp_path, kills=((150, 160),))  # a kill at 150-160: after a run started at 100
    c.acknowledged = {"a": "q0"}
    c.check_jobs({j: {"id": j, "state": s, "queue": "q0"} for j, s in states.items()}, runs)
    assert any(expect in v for v in c.report.violations), (case, c.report.violations)


def test_more_runs_at_once_than_the_limit_and_a_hung_run_are_violations(chaos, tmp_path):
    c = make(chaos, tmp_path, limit=2, kills=((500, 510),))
    runs = {"a": [run("a", 1, 100, 300)], "b": [run("b", 1, 200, None)],  # b ends at the kill (510)
            "c": [run("c", 1, 250, 260)], "d": [run("d", 1, 300, 400)], "e": [run("e", 1, 600, None)]}
    c.check_concurrency(runs)
    assert c.report.max_running == 3, c.report  # a, b and c at 250
    assert any("3 jobs ran at once under a limit of 2" in v for v in c.report.violations)
    assert any("hung" in v and "job e" in v for v in c.report.violations)  # no end, no kill after it
    ok = make(chaos, tmp_path, limit=2)
    ok.check_concurrency({"a": [run("a", 1, 100, 200)], "b": [run("b", 1, 200, 300)]})  # end, then start
    assert ok.report.max_running == 1 and ok.report.violations == []


def test_an_object_with_something_due_and_no_alarm_is_stuck(chaos, tmp_path):
    now = 1_000_000
    views = {"fine": {"alarm": now + 10, "due": {"x": now + 10}, "now": now},
             "idle": {"alarm": None, "due": {}, "now": now},
             "no alarm": {"alarm": None, "due": {"x": now + 10}, "now": now},
             "late alarm": {"alarm": now + 50, "due": {"x": now + 10}, "now": now},
             "overdue": {"alarm": now - 60_000, "due": {"x": now - 60_000}, "now": now}}
    c = make(chaos, tmp_path)
    c.check_alarms(views, done("a"))
    stuck = c.report.alarms["stuck"]
    assert [s.split(":")[0] for s in stuck] == ["no alarm", "late alarm", "overdue"], stuck
    c = make(chaos, tmp_path)
    c.check_alarms({"fine": views["fine"]}, {"a": {"id": "a", "state": "queued"}})
    assert c.report.violations == ["jobs left not done: {'queued': 1}"]
