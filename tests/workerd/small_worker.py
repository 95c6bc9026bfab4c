"""A small Python Worker for one tier-3 check: its ``wrangler.toml`` and ``src/entry.py`` written
into a temporary folder beside this checkout's ``semaphore`` (without the test kit and the
simulator) and the vendored Workers SDK, served by the real workerd."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from sample_worker import ROOT, _copy_project_sdk
from semaphore.testing.workerd import WorkerdError, WorkerdProcess, generate_config


@contextlib.contextmanager
def small_worker(base: Path, wrangler_toml: str, entry: str, workerd_bin: str) -> Iterator[WorkerdProcess]:
    """The Worker of ``wrangler_toml`` and ``entry`` under ``base``, started (a failed start fails
    the test with workerd's output); its last output is printed when it stops."""
    project = base / "project"
    (project / "src").mkdir(parents=True)
    (project / "wrangler.toml").write_text(wrangler_toml, encoding="utf-8")
    (project / "src" / "entry.py").write_text(entry, encoding="utf-8")
    shutil.copytree(ROOT / "src" / "semaphore", project / "src" / "semaphore",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "testing", "simulate"))
    _copy_project_sdk(project / "python_modules")
    config = generate_config(project / "wrangler.toml", base / "config", storage_dir=base / "storage", port=0)
    with started(WorkerdProcess(config, binary=workerd_bin, log_dir=base / "logs")) as proc:
        yield proc


@contextlib.contextmanager
def started(proc: WorkerdProcess, *, log_chars: int = 8000) -> Iterator[WorkerdProcess]:
    """``proc`` started (a failed start fails the test with workerd's output), stopped at the
    end with its last ``log_chars`` of output printed."""
    try:
        proc.start()
    except WorkerdError as err:
        pytest.fail(f"{err}\n--- workerd output ---\n{err.output}", pytrace=False)
    try:
        yield proc
    finally:
        print(f"--- workerd output ---\n{proc.logs[-log_chars:]}")
        proc.stop()
