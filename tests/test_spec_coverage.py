"""The specification is the test plan: every rule and invariant numbered in ``docs/SPEC.md``
(``- R12.``, ``- R15a.``, ``- I3.``) is named by at least one test function (in its name, e.g.
``test_r12_...``, its docstring or a comment inside it, e.g. ``# R12``), in any tier."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "SPEC.md"
RULE_HEADING = re.compile(r"^- ((?:R\d+[a-z]?)|(?:I\d+))\.", re.MULTILINE)


def spec_rules(text: str) -> list[str]:
    """The rule and invariant numbers the specification defines, in order."""
    return RULE_HEADING.findall(text)


def _mentions(rule: str) -> re.Pattern[str]:
    # R1 must not match R10 or R15a; R15a must not match R15.
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(rule)}(?![0-9a-zA-Z])", re.IGNORECASE)


def function_texts(root: Path = ROOT / "tests") -> list[tuple[str, str]]:
    """``(where, text)`` of every test function: its name (``_`` read as a separator), its
    docstring and its source lines, comments included."""
    found = []
    for path in sorted(root.rglob("test_*.py")):
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                body = "\n".join(lines[node.lineno - 1:node.end_lineno])
                found.append((f"{path.relative_to(root)}::{node.name}",
                              node.name.replace("_", " ") + "\n" + body))
    return found


def uncovered(rules: list[str], texts: list[tuple[str, str]]) -> list[str]:
    return [rule for rule in rules if not any(_mentions(rule).search(text) for _, text in texts)]




def test_every_rule_of_the_spec_has_a_test_naming_it():
    rules = spec_rules(SPEC.read_text(encoding="utf-8"))
    assert len(rules) == 52 and rules[:2] == ["R1", "R2"] and "R15a" in rules and rules[-1] == "I5", rules
    assert uncovered(rules, function_texts()) == []


def test_the_coverage_check_tells_rules_apart():
    texts = [("a::test_r15a_x", "test r15a x\n    # R10, I3"), ("b::test_y", "test y\n    pass  # R2")]
    assert uncovered(["R1", "R10", "R15", "R15a", "R2", "I3", "I4", "R99"], texts) == ["R1", "R15", "I4", "R99"]
