"""No test writes a private attribute of a library object (issue 9).

A test that sets ``obj._x`` depends on internals a refactor may rename (the test then tests
nothing, silently) and drives the object into states its public API cannot reach. The kit
(:mod:`semaphore.testing`) offers public ways instead: ``VirtualClock.set(ms)``,
``await storage.deleteAlarm()``, ``Bed.evict()``, ``ClientSide.on_admit``/``alarm`` and so on.

This parses every ``tests/**/*.py`` and fails on an assignment (``=``, ``+=``, annotated,
tuple targets, ``setattr(obj, "_x", ...)``) to an attribute named with a single leading
underscore, unless it is ``self._x`` inside a method of a class the test file defines itself
(a test's own helper class may keep private state)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        found = [node.target]
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        found = [node.optional_vars]
    elif isinstance(node, ast.NamedExpr):
        found = [node.target]
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            flat.append(target)
    return flat


def _setattr_write(node: ast.AST) -> tuple[ast.expr, str] | None:
    """``(object, name)`` of ``setattr(object, "_name", value)``."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)):
        return node.args[0], node.args[1].value
    return None


def private_writes(path: Path, root: Path = TESTS.parent) -> list[str]:
    """``path:line: target`` of every write to a private attribute of an object that is not the
    ``self`` of a method of a class defined in ``path`` (``path`` shown relative to ``root``)."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, filename=str(path))
    found: list[str] = []

    def is_own_self(obj: ast.expr, in_method: bool) -> bool:
        return in_method and isinstance(obj, ast.Name) and obj.id == "self"

    def visit(node: ast.AST, in_class: bool, in_method: bool) -> None:
        writes = [(t.value, t.attr, t) for t in _targets(node) if isinstance(t, ast.Attribute)]
        call = _setattr_write(node)
        if call is not None:
            writes.append((call[0], call[1], node))
        for obj, name, where in writes:
            if _private(name) and not is_own_self(obj, in_method):
                line = getattr(where, "lineno", 0)
                found.append(f"{path.relative_to(root)}:{line}: {ast.unparse(where)}")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, True, False)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False, in_class or in_method)
            else:
                visit(child, in_class, in_method)

    visit(tree, False, False)
    return found


def test_no_test_writes_a_private_attribute():
    offenders = [w for path in sorted(TESTS.rglob("*.py")) for w in private_writes(path)]
    assert not offenders, (
        "tests write private attributes (use the public API or semaphore.testing instead):\n"
        + "\n".join(offenders)
    )


def test_the_check_finds_private_writes_and_allows_own_self(tmp_path: Path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "class Mine:\n"
        "    def __init__(self):\n"
        "        self._ok = 1\n"
        "        self._n += 1\n"
        "        self.__dict__ = {}\n"
        "        other._bad = 1\n"
        "        helper = lambda: setattr(self, '_ok', 2)\n"
        "def f(self, clock, bed):\n"
        "    self._bad = 1\n"
        "    clock._now += 5\n"
        "    a, bed.sem._ready = 1, True\n"
        "    setattr(bed, '_x', 1)\n"
        "    bed.public = clock._now\n"
    )
    found = private_writes(sample, tmp_path)
    assert found == [
        "sample.py:6: other._bad",
        "sample.py:9: self._bad",
        "sample.py:10: clock._now",
        "sample.py:11: bed.sem._ready",
        "sample.py:12: setattr(bed, '_x', 1)",
    ], found
