"""The examples run and still show their point (issue 10).

Each of ``examples/*.py`` runs as the docs say (``python examples/<file>.py``: in a subprocess
of this interpreter, from the project root, with a timeout) and must exit 0 AND print the lines
that make its point, so an example that silently stops showing it fails. The README and the
testing guide (``docs/guides/testing.md``, its "Examples" list) name every example, and every
example here is named in them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

#: example -> regular expressions its output must match (in this order).
EXPECTED: dict[str, list[str]] = {
    "account_concurrency.py": [
        r"submit job-1\.\.job-4 \(limit 2\)",
        r"admit job-2 under (grant|lease) .* \(attempt 1\): started",
        r"admit job-2 under (grant|lease) .* \(attempt 2\): already running, not started again",
        r"job-1 finished, but its completion notice is lost",
        r"reconcile job-1: gone -> release its permit",
        r"all done: starts per job \{'job-1': 1, 'job-2': 1, 'job-3': 1, 'job-4': 1\}, most running at once 2",
        r"holder usage: outstanding 0, lease footprint 0",
    ],
    "permit_in_a_client_object.py": [
        r"job-a: permit \((grant|lease)\), running for 4 s",
        r"job-b: permit \((grant|lease)\), running for 2 s; running now: \['job-a', 'job-b'\]",
        r"job-b: raised RuntimeError \(the export failed\); leaving the block released its permit",
        r"job-d: PermitTimeoutError after 2500 ms \(blocked: limit, 2 waiting\); nothing stays charged",
        r"job-c: permit \((grant|lease)\), running for 3 s",
        r"most running at once: 2 \(limit 2\)",
        r"holder usage at the end: outstanding 0, charged 0, available 2",
        r"results: \{'job-a': 'done', 'job-b': 'raised', 'job-c': 'done', 'job-d': 'timeout'\}",
    ],
    "group_limited_tenants.py": [
        r"account limit 6; tenant ceilings \{'tenant-a': 2, 'tenant-b': 2, 'tenant-c': None\}",
        r"running 6 of 6; account charged 6, available 0",
        r"tenant-a: running 2, limit 2, charged 2, available 0; \d waiting: group_limit x\d",
        r"tenant-b: running 2, limit 2, charged 2, available 0; \d waiting: group_limit x\d",
        r"tenant-c: running 2, limit None, charged 2, available 0; 3 waiting: limit x3",
        r"all jobs done",
        r"running 0 of 6; account charged 0, available 6",
        r"most running at once: tenant-a 2 \(ceiling 2\), tenant-b 2 \(ceiling 2\), tenant-c \d \(ceiling None\),"
        r" account 6 \(limit 6\)",
    ],
}


def test_every_example_is_checked_and_named_in_the_readme_and_the_testing_guide():
    on_disk = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert on_disk == sorted(EXPECTED), f"examples/*.py {on_disk}: add each to EXPECTED"
    for page in ("README.md", "docs/guides/testing.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        for name in EXPECTED:
            assert f"python examples/{name}" in text, f"{page} does not say how to run examples/{name}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_example_runs_and_shows_its_point(name: str) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=ROOT, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"examples/{name} failed:\n{proc.stdout}{proc.stderr}"
    assert not proc.stderr, f"examples/{name} wrote to stderr:\n{proc.stderr}"
    position = 0
    for pattern in EXPECTED[name]:
        match = re.compile(pattern).search(proc.stdout, position)
        assert match, f"examples/{name}: no line matching {pattern!r} after the ones before it:\n{proc.stdout}"
        position = match.end()
