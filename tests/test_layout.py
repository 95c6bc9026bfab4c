"""The library's layout and import rules (docs/ARCHITECTURE.md), checked on the source with ``ast``.

* ``semaphore.core`` is pure: it imports only the standard library (no ``asyncio``, no I/O
  modules), other ``semaphore.core`` modules and ``semaphore.errors``.
* Only ``semaphore.runtime`` touches the runtime (``js``, ``pyodide``, ``workers``).
* The holder and the client side never import each other (both may use core, rpc, scheduler).
* Every public subpackage lists its surface in ``__all__``, and every name there exists.
* Internal modules of the subpackages are underscored (``holder/_store.py``), except ``core``,
  whose modules are its documented surface (one module per concern).
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "src" / "semaphore"
RUNTIME_MODULES = {"js", "pyodide", "workers"}
#: Standard-library modules the pure core must not import: concurrency, I/O, time, storage.
IMPURE_STDLIB = {"asyncio", "sqlite3", "socket", "os", "io", "time", "threading", "subprocess",
                 "urllib", "http", "random"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(LIBRARY.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, package: str | None = None) -> set[str]:
    """Absolute names of every module ``path`` imports (at any depth, ``TYPE_CHECKING`` blocks
    excluded: they never run). ``package``: the package relative imports start from (default:
    the file's own, under ``src/``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    if package is None:
        package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.orelse:
                    visit(stmt)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    name = ".".join(base + ([child.module] if child.module else []))
                else:
                    name = child.module or ""
                found.add(name)
                found.update(f"{name}.{a.name}" for a in child.names)
            visit(child)

    visit(tree)
    return found


def library_modules() -> dict[str, set[str]]:
    return {module_name(p): imports(p) for p in sorted(LIBRARY.rglob("*.py")) if "__pycache__" not in p.parts}


def top(name: str) -> str:
    return name.split(".")[0]


def test_the_layout_is_as_documented():
    names = set(library_modules())
    for package in ("semaphore.core", "semaphore.holder", "semaphore.client", "semaphore.testing"):
        assert package in names, package
    assert {"semaphore.core.rounds", "semaphore.core.ledger", "semaphore.core.allocation",
            "semaphore.core.wire", "semaphore.holder._store", "semaphore.holder._semaphore",
            "semaphore.client._client", "semaphore.client._queue", "semaphore.runtime"} <= names


def test_the_core_is_pure():
    bad = {}
    for name, deps in library_modules().items():
        if not name.startswith("semaphore.core"):
            continue
        wrong = {d for d in deps if top(d) in RUNTIME_MODULES | IMPURE_STDLIB
                 or (top(d) == "semaphore" and not (d.startswith("semaphore.core") or d.startswith("semaphore.errors")))}
        if wrong:
            bad[name] = sorted(wrong)
    assert not bad, f"the core imports the runtime, storage or I/O: {bad}"


def test_only_the_runtime_adapter_touches_the_runtime():
    bad = {name: sorted(d for d in deps if top(d) in RUNTIME_MODULES)
           for name, deps in library_modules().items() if name != "semaphore.runtime"}
    assert not {k: v for k, v in bad.items() if v}


def test_holder_and_client_never_import_each_other():
    bad = []
    for name, deps in library_modules().items():
        for mine, theirs in (("semaphore.holder", "semaphore.client"), ("semaphore.client", "semaphore.holder")):
            if name.startswith(mine) and any(d.startswith(theirs) for d in deps):
                bad.append((name, sorted(d for d in deps if d.startswith(theirs))))
    assert not bad, bad


def test_internal_modules_of_the_sides_are_underscored():
    for package in ("holder", "client", "testing"):
        public = [p.name for p in (LIBRARY / package).glob("*.py") if p.name != "__init__.py" and not p.name.startswith("_")]
        assert not public, f"semaphore.{package}: internal modules must be underscored: {public}"


@pytest.mark.parametrize("package", ["semaphore", "semaphore.core", "semaphore.holder", "semaphore.client",
                                     "semaphore.testing"])
def test_every_package_lists_an_existing_public_surface(package: str):
    sys.path.insert(0, str(LIBRARY.parent))
    module = importlib.import_module(package)
    assert module.__all__, package
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{package}.__all__ names what it lacks: {missing}"


def test_the_checker_sees_nested_and_relative_imports_but_not_type_checking_ones(tmp_path: Path):
    sample = tmp_path / "x.py"
    sample.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import js\n"
        "def f():\n    import asyncio\n    from ..holder import _store\n")
    found = imports(sample, "semaphore.core")
    assert {"asyncio", "semaphore.holder", "semaphore.holder._store"} <= found
    assert "js" not in found


def reaches_into_tests(line: str) -> bool:
    """A script line that puts tests/ on the import path or imports a module of tests/."""
    return ("sys.path" in line and "tests" in line) or bool(
        re.match(r"\s*(from|import)\s+(tests|sim|soak_sim|honest_client|workerd\.harness|test_\w+)\b", line))


def test_the_scripts_check_sees_a_path_insert_and_a_test_import():
    assert reaches_into_tests('sys.path.insert(0, str(ROOT / "tests"))')
    assert reaches_into_tests("from soak_sim import run_one")
    assert reaches_into_tests("from workerd.harness import WorkerdProcess")
    assert not reaches_into_tests('sys.path.insert(0, str(ROOT / "src"))')
    assert not reaches_into_tests("from semaphore.simulate.soak import run_one")


def test_scripts_import_the_package_never_the_tests():
    # scripts/ measure and run the package: they never put tests/ on sys.path nor import a test
    # module (the fault simulation, the soak and the workerd harness live in the package).
    scripts = Path(__file__).resolve().parents[1] / "scripts"
    bad = [f"{path.name}:{n}: {line.strip()}" for path in sorted(scripts.iterdir()) if path.is_file()
           for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if reaches_into_tests(line)]
    assert not bad, "scripts reach into tests/:\n" + "\n".join(bad)
