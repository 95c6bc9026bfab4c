"""``docs/ARCHITECTURE.md`` maps every rule of ``docs/SPEC.md`` to the one module that decides
it: every rule and invariant is listed exactly once, the module exists, its source names the
rule, and every function, class or attribute the row names exists in the module it is named for
(read with ``ast``), so the map cannot drift from the code."""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from pathlib import Path

from test_spec_coverage import SPEC, spec_rules

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "ARCHITECTURE.md"
LIBRARY = ROOT / "src" / "semaphore"
ROW = re.compile(r"^\| (R\d+[a-z]?|I\d+) \| ([\w/.]+\.py) \|", re.MULTILINE)
FULL_ROW = re.compile(r"^\| (R\d+[a-z]?|I\d+) \| ([\w/.]+\.py) \| (.*) \|$", re.MULTILINE)
#: A module named inside a row (``core/queue_plan.py``) or dotted (``core.rounds.Pending``).
MODULE_TOKEN = re.compile(r"^[\w/]+\.py$")


def rule_map() -> list[tuple[str, str]]:
    return ROW.findall(MAP.read_text(encoding="utf-8"))


def test_every_rule_has_exactly_one_home():
    listed = [rule for rule, _ in rule_map()]
    rules = spec_rules(SPEC.read_text(encoding="utf-8"))
    assert sorted(listed) == sorted(rules), (
        f"missing: {sorted(set(rules) - set(listed))}, not in SPEC: {sorted(set(listed) - set(rules))}")
    assert len(listed) == len(set(listed)), "a rule is listed twice"


def test_each_home_exists_and_names_its_rule():
    wrong = []
    for rule, module in rule_map():
        path = LIBRARY / module
        if not path.exists():
            wrong.append(f"{rule}: {module} does not exist")
        elif not re.search(rf"(?<![A-Za-z0-9]){rule}(?![0-9a-z])", path.read_text(encoding="utf-8")):
            wrong.append(f"{rule}: {module} never mentions it")
    assert not wrong, "\n".join(wrong)


@cache
def defined_names(module: str) -> tuple[frozenset[str], dict[str, frozenset[str]], frozenset[str]]:
    """What ``module`` (a path under ``src/semaphore``) defines: module-level names (functions,
    classes, assignments), each class's member names, and its string constants (meta keys,
    option names)."""
    tree = ast.parse((LIBRARY / module).read_text(encoding="utf-8"))
    top: set[str] = set()
    members: dict[str, frozenset[str]] = {}

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [node.name]
        if isinstance(node, ast.Assign):
            return [x.id for x in node.targets if isinstance(x, ast.Name)]
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            return [node.target.id]
        return []

    for node in tree.body:
        top.update(targets(node))
        if isinstance(node, ast.ClassDef):
            members[node.name] = frozenset(n for child in node.body for n in targets(child))
    strings = frozenset(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return frozenset(top), members, strings


def named_in(module: str, token: str) -> bool:
    """Whether ``token`` (``name``, ``name()``, ``Class.member`` or ``pkg.module.Name``) is
    defined in ``module``: a function, class, class member or module-level name, or failing
    those a string constant of the module (a meta key or an option's wire name)."""
    token = token.removesuffix("()")
    top, members, strings = defined_names(module)
    if "." in token:
        head, _, name = token.rpartition(".")
        if head in members:
            return name in members[head]
        path = head.removeprefix("semaphore.").replace(".", "/") + ".py"
        return (LIBRARY / path).exists() and named_in(path, name)
    return token in top or any(token in m for m in members.values()) or token in strings


def named_tokens() -> list[tuple[str, str, str]]:
    """``(rule, module, token)`` for every backticked name of the map, each with the module it is
    named for: the row's home, or the module named last before it in the row."""
    out = []
    for rule, home, text in FULL_ROW.findall(MAP.read_text(encoding="utf-8")):
        module = home
        for token in re.findall(r"`([^`]+)`", text):
            if MODULE_TOKEN.match(token):
                module = token
            elif re.fullmatch(r"[A-Za-z_][\w.]*(\(\))?", token):
                out.append((rule, module, token))
    return out


def test_every_name_the_map_gives_exists_where_it_says():
    missing = [f"{rule}: `{token}` is not in {module}" for rule, module, token in named_tokens()
               if not named_in(module, token)]
    assert not missing, "\n".join(missing)


def test_the_name_check_reads_members_and_refuses_made_up_names():
    assert named_in("core/allocation.py", "_ORDER") and named_in("core/rows.py", "LeaseRow.footprint")
    assert named_in("holder/_semaphore.py", "core.rounds.Pending")
    assert not named_in("core/allocation.py", "Entry.order")  # deleted: it was dead code, R21 is _ORDER's
    assert not named_in("core/rounds.py", "_no_such_function")
    assert ("R31a", "core/queue_plan.py", "covered_groups") in named_tokens()


def test_the_map_parser_reads_rows():
    assert ("R13", "core/marks.py") in rule_map()


def _mutate_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_mutation_script_mutates_the_homes_the_map_names():
    # scripts/mutate.py: a rule's home functions come from this map; each mutant changes exactly
    # one thing and is still a module (the script runs the citing tests against each).
    mutate = _mutate_script()
    assert mutate.homes("R13") == [("core/marks.py", "raise_counts")]
    original = ast.unparse(ast.parse((LIBRARY / "core" / "marks.py").read_text(encoding="utf-8")))
    found = list(mutate.mutants("core/marks.py", "raise_counts"))
    assert found and len({m.source for m in found}) == len(found)
    for m in found:
        assert m.source != original and ast.parse(m.source) and m.change
    assert mutate.citing_tests("R13") and all(t.startswith("tests/test_") for t in mutate.citing_tests("R13"))
