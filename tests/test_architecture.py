"""``docs/ARCHITECTURE.md`` maps every rule of ``docs/SPEC.md`` to the one module that decides
it: every rule and invariant is listed exactly once, the module exists, and its source names the
rule (so the map cannot drift from the code)."""

from __future__ import annotations

import re
from pathlib import Path

from test_spec_coverage import SPEC, spec_rules

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "ARCHITECTURE.md"
LIBRARY = ROOT / "src" / "semaphore"
ROW = re.compile(r"^\| (R\d+a?|I\d+) \| ([\w/.]+\.py) \|", re.MULTILINE)


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


def test_the_map_parser_reads_rows():
    assert ("R13", "core/marks.py") in rule_map()
