#!/usr/bin/env python3
"""Mutation check of the rules' home functions: is every small change to a rule's code caught?

For each rule given (``--rules R13,R21``), the home module and functions named in
``docs/ARCHITECTURE.md``'s rule map are mutated one change at a time: a comparison flipped
(``<`` and ``<=``, ``>`` and ``>=``, ``==`` and ``!=``), ``+`` and ``-`` swapped, an integer
constant moved by one, ``min`` and ``max`` swapped, ``and`` and ``or`` swapped, a ``not``
dropped, an ``if`` negated. Each mutant is written into a copy of ``src/`` and the tests that cite
the rule (``# R13`` in ``tests/``, or ``--tests``) run against it. A mutant the tests fail on is
*killed*; one they pass on *survived*: a change to the rule no test notices. It prints one line per
survivor and a table per rule.

    scripts/mutate.py --rules R13,R21                   # the map's homes, the citing tests
    scripts/mutate.py --rules R28 --tests tests/test_allocation.py --max 40
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "ARCHITECTURE.md"
LIBRARY = ROOT / "src" / "semaphore"
ROW = re.compile(r"^\| (R\d+a?|I\d+) \| ([\w/.]+\.py) \| (.*) \|$", re.MULTILINE)

SWAP_COMPARE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                ast.NotEq: ast.Eq}
SWAP_BINOP = {ast.Add: ast.Sub, ast.Sub: ast.Add}


def homes(rule: str) -> list[tuple[str, str]]:
    """``(module, function)`` pairs the rule map names for ``rule`` (functions and methods of the
    home module, and of a module named inside the row before them)."""
    out: list[tuple[str, str]] = []
    for found, home, text in ROW.findall(MAP.read_text(encoding="utf-8")):
        if found != rule:
            continue
        module = home
        for token in re.findall(r"`([^`]+)`", text):
            if re.fullmatch(r"[\w/]+\.py", token):
                module = token
            elif re.fullmatch(r"[A-Za-z_][\w.]*(\(\))?", token):
                out.append((module, token.removesuffix("()")))
    return out


def find_function(tree: ast.Module, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The function (``name``), method (``Class.name``) or, failing those, the method of any
    class called ``name``, in ``tree``."""
    found = _find(tree, name)
    if found is None and "." not in name:
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                found = found or _find(tree, f"{node.name}.{name}")
    return found


def _find(tree: ast.Module, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    parts = name.split(".")
    scope: list[ast.stmt] = tree.body
    for i, part in enumerate(parts):
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == part and i == len(parts) - 1:
                return node
            if isinstance(node, ast.ClassDef) and node.name == part:
                scope = node.body
                break
        else:
            return None
    return None


@dataclass(frozen=True)
class Mutant:
    module: str
    function: str
    line: int
    change: str
    source: str


def mutants(module: str, function: str) -> Iterator[Mutant]:
    """Every one-change mutant of ``function`` in ``module``, as the whole module's new source."""
    text = (LIBRARY / module).read_text(encoding="utf-8")
    tree = ast.parse(text)
    target = find_function(tree, function)
    if target is None:
        return
    points = [n for n in ast.walk(target) if isinstance(n, (ast.Compare, ast.BinOp, ast.Constant, ast.Call,
                                                              ast.BoolOp, ast.UnaryOp, ast.If))]
    for index, point in enumerate(points):
        for change in _changes(point):
            mutated = copy.deepcopy(tree)
            node = [n for n in ast.walk(find_function(mutated, function) or mutated)
                    if isinstance(n, (ast.Compare, ast.BinOp, ast.Constant, ast.Call, ast.BoolOp, ast.UnaryOp,
                                      ast.If))][index]
            description = _apply(node, change)
            if description:
                yield Mutant(module, function, getattr(point, "lineno", 0), description, ast.unparse(mutated))


def _changes(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Compare):
        return [f"op{i}" for i, op in enumerate(node.ops) if type(op) in SWAP_COMPARE]
    if isinstance(node, ast.BinOp) and type(node.op) in SWAP_BINOP:
        return ["binop"]
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return ["+1", "-1"]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
        return ["minmax"]
    if isinstance(node, ast.BoolOp):
        return ["boolop"]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return ["dropnot"]
    if isinstance(node, ast.If):
        return ["negate"]
    return []


def _apply(node: ast.AST, change: str) -> str:
    if isinstance(node, ast.Compare) and change.startswith("op"):
        i = int(change[2:])
        old = type(node.ops[i])
        node.ops[i] = SWAP_COMPARE[old]()
        return f"{old.__name__} -> {type(node.ops[i]).__name__}"
    if isinstance(node, ast.BinOp) and change == "binop":
        old = type(node.op)
        node.op = SWAP_BINOP[old]()
        return f"{old.__name__} -> {type(node.op).__name__}"
    if isinstance(node, ast.Constant) and change in ("+1", "-1"):
        old_value = node.value
        node.value = old_value + (1 if change == "+1" else -1)
        return f"{old_value} -> {node.value}"
    if isinstance(node, ast.Call) and change == "minmax" and isinstance(node.func, ast.Name):
        old_name = node.func.id
        node.func.id = "max" if old_name == "min" else "min"
        return f"{old_name} -> {node.func.id}"
    if isinstance(node, ast.BoolOp) and change == "boolop":
        old_op = type(node.op)
        node.op = ast.Or() if old_op is ast.And else ast.And()
        return f"{old_op.__name__} -> {type(node.op).__name__}"
    if isinstance(node, ast.UnaryOp) and change == "dropnot":
        node.op = ast.UAdd()  # +x of a bool is its int: truthiness kept, the negation dropped
        return "not x -> x"
    if isinstance(node, ast.If) and change == "negate":
        node.test = ast.UnaryOp(op=ast.Not(), operand=node.test)
        return "if c -> if not c"
    return ""


def citing_tests(rule: str) -> list[str]:
    """Test files under ``tests/`` (tier 1) that cite ``rule``."""
    pattern = re.compile(rf"(?<![A-Za-z0-9]){rule}(?![0-9a-z])")
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if pattern.search(p.read_text(encoding="utf-8", errors="replace")))


def run_tests(src: Path, tests: list[str], timeout_s: float) -> bool:
    """Whether ``tests`` pass against the library in ``src`` (a timeout counts as killed)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not slow", *tests]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rules", required=True, help="comma-separated rule ids of docs/SPEC.md, e.g. R13,R21")
    ap.add_argument("--tests", nargs="*", help="test files to run (default: those citing the rule)")
    ap.add_argument("--max", type=int, default=0, help="at most this many mutants per rule (0: all)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="a mutant's test run past this is killed")
    args = ap.parse_args(argv)
    totals: list[tuple[str, int, int, float]] = []
    for rule in args.rules.split(","):
        targets = homes(rule)
        tests = args.tests or citing_tests(rule)
        if not targets or not tests:
            print(f"{rule}: no home function in the map or no citing test", file=sys.stderr)
            continue
        found = [m for module, fn in targets for m in mutants(module, fn)]
        if args.max:
            found = found[:: max(1, len(found) // args.max)][: args.max]
        killed, started = 0, time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "src"
            shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__"))
            if not run_tests(src, tests, args.timeout_s):
                print(f"{rule}: the tests fail on the unmutated code; skipped", file=sys.stderr)
                continue
            for m in found:
                path = src / "semaphore" / m.module
                original = path.read_text(encoding="utf-8")
                path.write_text(m.source, encoding="utf-8")
                try:
                    caught = not run_tests(src, tests, args.timeout_s)
                finally:
                    path.write_text(original, encoding="utf-8")
                killed += caught
                if not caught:
                    print(f"SURVIVED {rule} {m.module}:{m.line} {m.function}: {m.change}")
        totals.append((rule, len(found), killed, time.monotonic() - started))
        print(f"{rule}: {killed}/{len(found)} mutants killed ({', '.join(f for _, f in targets)}; "
              f"tests: {', '.join(tests)})", flush=True)
    print("\n| rule | mutants | killed | survived | wall s |\n| --- | --- | --- | --- | --- |")
    for rule, n, k, wall in totals:
        print(f"| {rule} | {n} | {k} | {n - k} | {wall:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
