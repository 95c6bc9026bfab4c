"""No hand-written figures: every figure of the README and the docs is written by
``scripts/figures.py`` and is current.

* Every figures region names a known figure and carries the hash of that figure's sources as
  they are now: a region made before the code it measures last changed fails (whatever kind the
  figure is: deterministic or a timing).
* The cheap deterministic figures (SQL statements of a round, a round log line) are regenerated
  here and compared with the committed ones (the round log line's wall time masked).
* Figure-shaped text (a simulator summary line, a count of tests or of SQL statements, a
  benchmark or soak table, a round log line, a wall time) outside a region fails: it was typed.
* The slow deterministic figures (the simulator's default scenario, the soak, the protocol
  benchmark) are checked by their sources' hash; that is enough only because the simulator is
  deterministic, which :func:`test_the_simulator_is_deterministic_across_processes` checks on a
  short run in two processes with different hash seeds.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import figures  # noqa: E402  (scripts/figures.py)


def test_every_figure_is_written_by_the_script_and_current():
    problems = figures.check()
    assert not problems, "\n".join(problems)


def test_the_pages_carry_the_figures():
    found = {(r.page.relative_to(ROOT).as_posix(), r.name) for page in figures.pages() for r in figures.regions(page)}
    for where in [("README.md", "demo-plot"), ("docs/explanation/benchmarks.md", "demo"),
                  ("docs/explanation/benchmarks.md", "bench-protocol"), ("docs/explanation/benchmarks.md", "round-sql"),
                  ("docs/explanation/soak.md", "soak"), ("docs/reference/metrics.md", "round-log"),
                  ("docs/explanation/testing.md", "tests")]:
        assert where in found, f"{where[0]} has no {where[1]!r} figure"
    assert {name for _, name in found} == set(figures.FIGURES), "a figure no page shows, or one the script lacks"


def _page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    return page


def test_a_stale_or_altered_figure_fails(tmp_path):
    current = figures.FIGURES["round-sql"].stamp()
    body = figures.FIGURES["round-sql"].make(tmp_path / "page.md")
    page = _page(tmp_path, f"<!-- figures:round-sql sources={current} -->\n{body}<!-- /figures -->\n\n"
                           f"<!-- figures:round-sql sources=0123456789ab -->\n{body}<!-- /figures -->\n\n"
                           f"<!-- figures:round-sql sources={current} -->\n{body.replace('|', '| 1', 1)}<!-- /figures -->\n\n"
                           f"<!-- figures:no-such sources={current} -->\nx\n<!-- /figures -->\n\n"
                           "<!-- figures:demo -->\n")
    problems = figures.check([page])
    assert len(problems) == 4, problems
    assert "malformed figures region" in problems[0]
    assert "figure 'round-sql' is older than its sources" in problems[1]
    assert "figure 'round-sql' differs from what the code produces" in problems[2]
    assert "unknown figure 'no-such'" in problems[3]


def test_a_round_log_line_differs_only_by_its_wall_time():
    figure = figures.FIGURES["round-log"]
    made = figure.make(ROOT / "docs" / "reference" / "metrics.md")
    assert '"durationMs":' in made
    assert figure.normalize(made) == figure.normalize(made.replace('"durationMs":', '"durationMs":9', 1))
    assert figure.normalize(made) != figure.normalize(made.replace('"requests":1', '"requests":2'))


def test_figures_typed_by_hand_fail(tmp_path):
    """Lines of the README before the figures script (the demo table, the test count, the SQL count)."""
    typed = ("  utilization (running / limit, whole run)                    72.6%\n"
             "them pytest: 903 tests at 9807448; tier 3 runs in full here\n"
             "a round runs 19 SQL statements whatever its size\n"
             "violations: I1                                        0       0\n"
             '{"at":1796135969967,"durationMs":5.0,"sqlStatements":12}\n'
             "| mode | utilization | ... while waiting |\n"
             "(5.7 s of wall time)\n")
    problems = figures.hand_written(_page(tmp_path, typed))
    kinds = [p.split(": ", 1)[1].split(" outside a figures region", 1)[0] for p in problems]
    assert kinds == ["the simulator's summary", "a count of SQL statements", "a count of tests", "a benchmark table",
                     "the soak's table", "a round log line", "a wall time"], problems
    inside = _page(tmp_path, f"<!-- figures:demo sources=0 -->\n{typed}<!-- /figures -->\n")
    assert figures.hand_written(inside) == []


def test_a_docstring_or_comment_edit_does_not_age_a_figure(tmp_path):
    a, b, c = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    a.write_text('"""Doc."""\n\n# a comment\ndef f():\n    """Doc."""\n    return 1\n')
    b.write_text('"""Another doc,\nlonger."""\ndef f():\n    return 1  \n')
    c.write_text('"""Doc."""\ndef f():\n    return 2\n')
    assert figures._normalized(a) == figures._normalized(b) != figures._normalized(c)


def _short_runs(hash_seeds: list[str], out: Path) -> list[str]:
    """The summary of a short default-scenario run per hash seed, the runs side by side."""
    procs = []
    for seed in hash_seeds:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONHASHSEED=seed)
        (out / seed).mkdir()
        procs.append(subprocess.Popen([sys.executable, "-m", "semaphore.simulate", "--run-s", "45", "--no-plot",
                                       "--no-progress", "--out", str(out / seed)], cwd=out / seed, env=env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    outputs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stdout + stderr
        outputs.append(figures.WALL_TIME.sub("", stdout))
    return outputs


def test_the_simulator_is_deterministic_across_processes(tmp_path):
    """Why the default scenario may be checked by its sources' hash: the same code and seed give
    the same figures, number for number, in processes with different hash seeds."""
    first, second = _short_runs(["1", "2"], tmp_path)
    assert "utilization" in first and "holder calls" in first
    assert first == second
