"""The tutorial's fuller sample, tier 1: the sample Worker a user writes from the docs bundles.

* The tutorial's blocks ARE ``examples/worker/``'s files (``wrangler.toml``, ``pyproject.toml``,
  ``src/entry.py``, included with ``--8<--`` snippet lines), and the deploying guide names both
  routes (``pywrangler sync``; ``pip install --target python_modules --no-deps`` with the SDK
  pin of ``scripts/setup``).
* A fresh sample is created from those blocks in an empty folder outside the checkout, vendored
  with route 2 from the wheel built offline (``tests/sample_worker.py``), and
  ``wrangler deploy --dry-run --outdir`` bundles it: the upload is the sample's ``entry.py``,
  the library's modules under ``python_modules/semaphore/`` byte for byte from the wheel
  (nothing from this checkout's ``src/``) and the Workers SDK.
* The sample imports only names the library exports, makes ONE ``SemaphoreQueue`` (with
  ``work=``) that serves both ``permit()`` and ``enqueue()``, and the deploying guide's check of the import name
  (``semaphore.__distribution__``) answers ``durability-semaphore`` from its ``python_modules/``.

Needs ``scripts/setup`` (wrangler, the venv's Node 24); the tier-3 twin is
``tests/workerd/test_sample_worker.py``.
"""

from __future__ import annotations

import ast
import importlib
import shlex
import subprocess
import sys

import pytest

from sample_worker import (
    EXAMPLE,
    ROOT,
    SAMPLE_FILES,
    built_wheel,
    create_sample,
    deploying_guide,
    readme_files,
    sdk_pin,
    wheel_modules,
)
from test_wrangler import _run_dry_run, _setup_problem, _uploaded


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return create_sample(tmp_path_factory.mktemp("sample-worker") / "project", built_wheel())


@pytest.fixture(scope="module")
def dry_run(sample, tmp_path_factory):
    problem = _setup_problem()
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    return _run_dry_run(sample.root, tmp_path_factory.mktemp("sample-wrangler"))


def test_the_readme_blocks_are_the_example_files():
    blocks = readme_files()
    assert sorted(blocks) == sorted(SAMPLE_FILES), f"docs/tutorial.md blocks found: {sorted(blocks)}"
    for path in SAMPLE_FILES:
        assert blocks[path] == (EXAMPLE / path).read_text(encoding="utf-8"), (
            f"docs/tutorial.md block {path} differs from examples/worker/{path}")
    on_disk = {p.relative_to(EXAMPLE).as_posix() for p in EXAMPLE.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert on_disk == set(SAMPLE_FILES), sorted(on_disk)


def test_the_deploying_guide_gives_both_routes():
    text = " ".join(deploying_guide().split())
    for step in ('dependencies = ["durability-semaphore"]', "uv add durability-semaphore",
                 "uv run pywrangler sync", "uv run pywrangler deploy",
                 "pip install --target python_modules --no-deps", sdk_pin(),
                 "semaphore.__distribution__"):
        assert step in text, f"{step!r} not in docs/guides/deploying.md"


def test_the_sample_uses_the_permit_api_and_only_exported_names():
    import semaphore

    tree = ast.parse((EXAMPLE / "src" / "entry.py").read_text(encoding="utf-8"))
    imported = {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    top = {name for module, name in imported if module == "semaphore"}
    assert {"DurabilitySemaphore", "SemaphoreQueue", "PermitTimeoutError"} <= top, top
    missing = top - set(semaphore.__all__)
    assert not missing, f"the sample imports names semaphore does not export: {sorted(missing)}"
    for module, name in imported:
        if module and module.startswith("semaphore."):
            assert hasattr(importlib.import_module(module), name), f"{module}.{name} does not exist"
    calls = {node.func.attr for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert {"permit", "enqueue"} <= calls, "the sample's client object must use queue.permit(...) and enqueue()"
    # One queue per object serves both permit() and work=: exactly one SemaphoreQueue(...), given work=.
    queues = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Name) and node.func.id == "SemaphoreQueue"]
    assert len(queues) == 1, f"the sample makes {len(queues)} SemaphoreQueues; one serves both"
    assert "work" in {kw.arg for kw in queues[0].keywords}, "the sample's queue must run jobs with work="


def test_the_fresh_sample_holds_the_wheel_not_the_checkout(sample):
    assert not sample.root.is_relative_to(ROOT)
    assert not (sample.root / "src" / "semaphore").exists()
    files = {p.relative_to(sample.root).as_posix() for p in sample.root.rglob("*") if p.is_file()}
    assert {f for f in files if not f.startswith("python_modules/")} == set(SAMPLE_FILES), sorted(files)
    for name, content in wheel_modules(sample.wheel).items():
        assert (sample.root / "python_modules" / name).read_bytes() == content, name
    assert (sample.root / "python_modules" / "workers" / "__init__.py").is_file()
    print(f"\nsample {sample.root}: wheel {sample.wheel.name}; SDK {sample.sdk_source}")


def test_the_deploying_guides_import_name_check_answers_this_distribution(sample):
    # docs/guides/deploying.md "The import name semaphore": its command, run in the project folder, names this
    # distribution and the vendored file; only this distribution's RECORD lists semaphore/.
    (command,) = [line for line in deploying_guide().splitlines() if line.startswith('python -I -c "')]
    argv = shlex.split(command)
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=sample.root, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    distribution, version, where = proc.stdout.split()
    assert (distribution, version) == ("durability-semaphore", sample.wheel.name.split("-")[1])
    assert where == str(sample.root / "python_modules" / "semaphore" / "__init__.py")
    owners = [r.parent.name for r in (sample.root / "python_modules").glob("*.dist-info/RECORD")
              if any(line.startswith("semaphore/") for line in r.read_text(encoding="utf-8").splitlines())]
    assert owners == [f"durability_semaphore-{version}.dist-info"], owners


def test_wrangler_bundles_the_sample(sample, dry_run):
    proc, outdir = dry_run
    assert proc.returncode == 0, f"wrangler deploy --dry-run failed\n{proc.stdout}\n{proc.stderr}"
    assert "--dry-run: exiting now." in proc.stdout, proc.stdout
    for line in ("env.BUDGET (Budget)", "env.JOBS (Jobs)", 'env.LIMIT ("2")'):
        assert line in proc.stdout, f"{line!r} not in wrangler's output:\n{proc.stdout}"
    uploaded = _uploaded(outdir)
    assert (outdir / "entry.py").read_text(encoding="utf-8") == readme_files()["src/entry.py"]
    library = wheel_modules(sample.wheel)
    assert {f"python_modules/{n}" for n in library} <= uploaded, sorted(uploaded)
    for name, content in library.items():
        assert (outdir / "python_modules" / name).read_bytes() == content, name
    assert "python_modules/workers/__init__.py" in uploaded
    # Nothing but the entry outside python_modules/: no semaphore/ of this checkout's src/.
    assert {f for f in uploaded if not f.startswith("python_modules/")} == {"entry.py"}, sorted(uploaded)
    assert not any(f.endswith(".pyc") for f in uploaded)
    print(f"\nwrangler bundled {len(uploaded)} files: entry.py, {len(library)} library files, "
          f"{len(uploaded) - len(library) - 1} SDK/dist-info files")
