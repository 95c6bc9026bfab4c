"""Tier 3: storage written by the previous release, opened by this one, in the real workerd.

This release adds a ``reusable`` column to the holder's and the client's lease tables (SPEC
R34a), added to tables of an older release on first use (``PRAGMA table_info`` then ``ALTER
TABLE ... ADD COLUMN``, ``semaphore.runtime.install_schema``). Whether Durable Object SQL allows
those statements, and whether the rows written before read back as one-shot leases, only the
real runtime decides. The previous release is the project at :data:`PREVIOUS` (the last commit
before the column, taken with ``git archive`` from this clone); both run the same worker name,
so workerd gives them the same Durable Object storage.

The scenario: the previous release admits two jobs (strict leases, one-shot) and stops with
them running; this release starts on the same storage, sees the lease and its two running jobs,
finishes them, admits the queued ones, and ends with nothing charged; then, with reusable leases
on, it issues a reusable lease from the upgraded tables.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from semaphore.testing.workerd import WorkerdProcess, generate_config

from .test_app import APP_SECRETS, App, by_state, wait_for

pytestmark = pytest.mark.workerd

#: The last commit before the ``reusable`` lease column (issue 12's end).
PREVIOUS = "316f025422dfbce57f9965377a3bea496db0e783"
ROOT = Path(__file__).resolve().parents[2]
ACCOUNT = "upgrade-acct"
QUEUE = "qa"
LEASES = {"provisioning": {"mode": "strict"}, "permitsPerLease": 2, "ttlMs": 60_000}
VARS = {"ACCOUNT_CONCURRENCY": "2", "ROUND_WAIT_MS": "100", "ROUND_PERIOD_MS": "500",
        "LEASES": json.dumps(LEASES)}


def previous_release(tmp_path: Path) -> Path:
    """The project at :data:`PREVIOUS`, with this clone's vendored ``python_modules/``."""
    out = tmp_path / "previous"
    out.mkdir()
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{PREVIOUS}^{{commit}}"],
                           capture_output=True, check=False) if shutil.which("git") else None
    if known is None or known.returncode != 0:
        pytest.skip(f"needs the previous release, commit {PREVIOUS}, in this clone's history "
                    "(a shallow clone or an unpacked archive has none)")
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", PREVIOUS], check=True,
                                 capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.fail(f"git archive {PREVIOUS} failed (a clone with history is needed): {exc}")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    shutil.copytree(ROOT / "python_modules", out / "python_modules")
    return out


def leases_of(app: App) -> list[dict[str, Any]]:
    holders = app.ok("GET", f"/accounts/{ACCOUNT}/holders")["holders"]
    return [x for h in holders for x in h["leases"]]


def test_storage_of_the_previous_release_gains_the_reusable_column_and_keeps_working(
        workerd_factory: Callable[..., WorkerdProcess], workerd_bin: Path, tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    old_root = previous_release(tmp_path)
    config = generate_config(old_root / "wrangler.toml", tmp_path / "old-config", storage_dir=storage,
                             vars_override=VARS, secrets=APP_SECRETS)
    old = WorkerdProcess(config, binary=workerd_bin, log_dir=tmp_path / "old-logs")
    old.start()
    try:
        app = App(old)
        # j0 alone first, so that its round has room left after its grant and issues a lease
        # (strict, grants first); had all four come in one round, grants would take the limit.
        app.enqueue(ACCOUNT, QUEUE, "j0")
        wait_for(lambda: list(by_state(app.jobs(ACCOUNT, QUEUE), "running")) == ["j0"], "j0 running (old)")
        for job_id in ("j1", "j2", "j3"):
            app.enqueue(ACCOUNT, QUEUE, job_id)
        wait_for(lambda: len(by_state(app.jobs(ACCOUNT, QUEUE), "running")) == 2, "two jobs running (old)")
        old_leases = leases_of(app)  # a grant and a lease, or a lease
        assert old_leases and all("reusable" not in x for x in old_leases), old_leases
    finally:
        old.stop()

    new = workerd_factory(vars_override=VARS, storage_dir=storage, secrets=APP_SECRETS)
    app = App(new)
    jobs = app.jobs(ACCOUNT, QUEUE)
    running = sorted(by_state(jobs, "running"))
    assert len(running) == 2 and len(by_state(jobs, "queued")) == 2, jobs
    # The old lease rows read back one-shot (column default 0): charged as before the upgrade.
    assert [(x["leaseId"], x["reusable"], x["charged"]) for x in leases_of(app)] == \
        [(x["leaseId"], False, x["charged"]) for x in old_leases]
    assert app.usage(ACCOUNT)["charged"] == 2
    for job_id in running:
        app.complete(ACCOUNT, job_id)
    wait_for(lambda: len(by_state(app.jobs(ACCOUNT, QUEUE), "running")) == 2, "the queued jobs running (new)")
    for job_id in sorted(by_state(app.jobs(ACCOUNT, QUEUE), "running")):
        app.complete(ACCOUNT, job_id)
    wait_for(lambda: app.usage(ACCOUNT)["charged"] == 0, "nothing charged")
    assert all(j["state"] == "done" for j in app.jobs(ACCOUNT, QUEUE).values())
    assert "Traceback" not in new.logs, new.logs[-5000:]
    new.stop()

    # The upgraded tables take reusable leases (the column exists on both sides).
    reusable = workerd_factory(vars_override={**VARS, "LEASES": json.dumps({**LEASES, "reusable": True})},
                               storage_dir=storage, secrets=APP_SECRETS)
    app = App(reusable)
    app.enqueue(ACCOUNT, QUEUE, "j4")
    wait_for(lambda: app.jobs(ACCOUNT, QUEUE)["j4"]["state"] == "running", "j4 running under a reusable lease")
    assert app.jobs(ACCOUNT, QUEUE)["j4"]["permit"]["kind"] == "lease"
    assert [x.get("reusable") for x in leases_of(app)] == [True], leases_of(app)
    assert "Traceback" not in reusable.logs, reusable.logs[-5000:]
