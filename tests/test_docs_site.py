"""The documentation site builds strictly, and every code block of the README and the docs is
run or checked.

The build: ``mkdocs build --strict`` of ``mkdocs.yml`` into a temporary folder, offline (no
plugin of the configuration fetches anything); any ``WARNING`` line fails, also one that
``--strict`` would let through.

The rule for code blocks (README.md and every page under docs/, with ``--8<--`` snippet lines
replaced by the files they include, as MkDocs does):

* ``python``: compiles (top-level ``await`` allowed: some blocks are fragments of a method), and
  every ``from semaphore... import name`` / ``import semaphore...`` in it resolves to a module
  and a name that exist. The blocks ``tests/test_readme.py`` names in ``RUN_BY`` are also run
  there against the test kit.
* ``toml`` and ``json``: parse.
* ``sh``: every command (after shell keywords and ``VAR=value`` prefixes) runs a program of
  :data:`PROGRAMS` or a script of this repository that exists (``scripts/...``); every ``scripts/...`` and ``examples/...`` path it names exists, and
  every ``python -m <module>`` is importable.
* a block without a language, or ``text``: a diagram or a program's output, not checked here
  (a program's output that is a figure is checked by ``tests/test_figures.py``).
* any other language fails: add its rule here first.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$')
#: Programs a shell block may run (besides this repository's scripts/...).
PROGRAMS = {"python", "python3", "pip", "npx", "npm", "uv", "curl", "mkdir", "cd", "echo", "ls", "grep",
            "wait", "export", "chmod", "exec", "shift", "[", "printf", "cp", ".venv/bin/python", ".venv/bin/mkdocs"}
#: Shell words that start or end a compound command rather than run a program.
SHELL_WORDS = {"for", "do", "done", "then", "fi", "if", "while"}


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """``(line, language, body)`` of each fenced block, snippet lines resolved."""
    out, fence, body, start = [], None, [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if fence is None:
            if line.startswith("```"):
                fence, body, start = line[3:].strip(), [], number + 1
        elif line.startswith("```"):
            out.append((start, fence, "".join(body)))
            fence = None
        else:
            match = SNIPPET.match(line)
            body.append((ROOT / match["path"]).read_text(encoding="utf-8") if match else line + "\n")
    return out


def python_problems(body: str) -> list[str]:
    try:
        tree = ast.parse(body)
        compile(body, "<block>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        return [f"does not compile: {exc}"]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "semaphore":
            module = importlib.import_module(node.module)
            out += [f"{node.module}.{a.name} does not exist" for a in node.names if not hasattr(module, a.name)]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "semaphore" and importlib.util.find_spec(alias.name) is None:
                    out.append(f"module {alias.name} does not exist")
    return out


def commands(body: str) -> list[list[str]]:
    """The simple commands of a shell block: words, split at ``;``, ``&``, ``|``, ``&&``."""
    text = re.sub(r"\\\n", " ", body)
    out: list[list[str]] = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in lexer:
            if token and set(token) <= set(";&|"):
                out.append(current)
                current = []
            else:
                current.append(token)
        out.append(current)
    return [c for c in out if c]


def shell_problems(body: str) -> list[str]:
    out = []
    for words in commands(body):
        while words and (words[0] in SHELL_WORDS or re.match(r"\w+=", words[0])):  # keywords, VAR=value
            words = words[1:] if words[0] != "for" else []
        if not words:
            continue
        program = words[0]
        if program.startswith("scripts/"):
            if not (ROOT / program).is_file():
                out.append(f"{program} does not exist")
        elif program not in PROGRAMS:
            out.append(f"runs {program!r}, which is neither a known program nor a script of this repository")
        for word in words[1:]:
            if re.match(r"(scripts|examples)/[\w./-]+$", word) and not (ROOT / word).exists():
                out.append(f"{word} does not exist")
        if program.endswith("python") or program == "python3":
            if "-m" in words[:-1]:
                module = words[words.index("-m") + 1]
                if importlib.util.find_spec(module) is None:
                    out.append(f"python -m {module}: no such module")
    return out


def block_problems(lang: str, body: str) -> list[str]:
    if lang == "python":
        return python_problems(body)
    if lang == "toml":
        try:
            tomllib.loads(body)
        except tomllib.TOMLDecodeError as exc:
            return [f"does not parse: {exc}"]
        return []
    if lang == "json":
        try:
            json.loads(body)
        except json.JSONDecodeError as exc:
            return [f"does not parse: {exc}"]
        return []
    if lang == "sh":
        return shell_problems(body)
    if lang in ("", "text"):
        return []
    return [f"a {lang!r} block: tests/test_docs_site.py has no rule for it"]


def page_problems(page: Path, text: str | None = None) -> list[str]:
    text = page.read_text(encoding="utf-8") if text is None else text
    name = page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else str(page)
    return [f"{name}:{line} ({lang or 'plain'}): {problem}"
            for line, lang, body in code_blocks(text) for problem in block_problems(lang, body)]


# ================================================================== the checks
def test_every_code_block_is_run_or_checked():
    found = [problem for page in pages() for problem in page_problems(page)]
    assert not found, "\n".join(found)
    counted = {lang for page in pages() for _, lang, _ in code_blocks(page.read_text(encoding="utf-8"))}
    assert {"python", "toml", "sh", "json"} <= counted, counted  # the rules above are all exercised


def test_a_broken_block_of_each_kind_fails_the_check(tmp_path):
    page = tmp_path / "page.md"
    text = ("```python\ndef f(:\n```\n\n```python\nfrom semaphore import NoSuchName\n```\n\n"
            "```toml\na = \n```\n\n```json\n{\"a\": }\n```\n\n"
            "```sh\nscripts/no-such-script --x\npython examples/gone.py\nrm -rf /tmp/x   # not a known program\n"
            "python -m semaphore.no_such_module\nfor n in 1 2; do curl -s x & done; wait\n```\n\n"
            "```yaml\na: 1\n```\n\n```\nany diagram\n```\n")
    found = page_problems(page, text)
    expected = ["(python): does not compile", "semaphore.NoSuchName does not exist", "(toml): does not parse",
                "(json): does not parse", "scripts/no-such-script does not exist", "examples/gone.py does not exist",
                "runs 'rm'", "python -m semaphore.no_such_module: no such module", "a 'yaml' block"]
    for part in expected:
        assert any(part in problem for problem in found), (part, found)
    assert len(found) == len(expected), found


def test_a_snippet_line_is_checked_as_the_file_it_includes():
    (block,) = code_blocks('```python\n--8<-- "examples/worker/src/entry.py"\n```\n')
    assert block[2] == (ROOT / "examples" / "worker" / "src" / "entry.py").read_text(encoding="utf-8")


def _mkdocs_env() -> dict[str, str]:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's notice about MkDocs 2 is not ours
    return env


def test_the_site_builds_with_no_warning(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.fail("mkdocs is not installed: run scripts/setup (pyproject.toml's dev dependencies)", pytrace=False)
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=_mkdocs_env(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{output}"
    warnings = [line for line in output.splitlines() if "WARNING" in line]
    assert not warnings, "\n".join(warnings)
    site = tmp_path / "site"
    for page in ("index.html", "tutorial.html", "reference/api.html", "SPEC.html", "ARCHITECTURE.html"):
        assert (site / page).is_file(), f"the site has no {page}"
    api = (site / "reference" / "api.html").read_text(encoding="utf-8")
    assert "SemaphoreQueue" in api and "force_settle" in api  # generated from the docstrings
    import semaphore

    ids = set(re.findall(r'id="([^"]+)"', api))
    undocumented = [name for name in semaphore.__all__ if name != "__version__"
                    and not any(i == f"semaphore.{name}" or i.endswith(f".{name}") for i in ids)]
    assert not undocumented, f"names semaphore exports that docs/reference/api.md does not show: {undocumented}"
    tutorial = re.sub(r"<[^>]+>", "", (site / "tutorial.html").read_text(encoding="utf-8"))
    assert "class Budget(DurableObject)" in tutorial  # the sample's files were included


def test_the_tutorial_and_the_guides_name_no_rules_or_tracker_words():
    rule = re.compile(r"\bR\d+[a-z]?\b|\b[Ii]ssues? \d+|\breview\b|\bI[1-5]\b")
    found = []
    for page in [ROOT / "docs" / "tutorial.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for m in rule.finditer(text):
            found.append(f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}")
    assert not found, "\n".join(found)


def test_the_mkdocs_dependencies_are_pinned_dev_dependencies():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    dev = config["project"]["optional-dependencies"]["dev"]
    pins = {re.split(r"[\[=]", d)[0]: d for d in dev}
    for name in ("mkdocs", "mkdocs-material", "mkdocstrings", "mkdocstrings-python"):
        assert name in pins and "==" in pins[name], f"{name} is not pinned (==) in the dev dependencies: {dev}"
    assert "mkdocstrings[python]" in pins["mkdocstrings"]


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub and MkDocs' ``toc`` make it (for the headings of these pages)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def readme_link_problems(text: str) -> list[str]:
    """Relative links of the README whose file, or whose heading anchor, does not exist."""
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else ROOT / "README.md"
        if not file.exists():
            out.append(f"README.md links to {target}: no such file")
        elif anchor and file.suffix == ".md":
            slugs = {_slug(line.lstrip("#")) for line in file.read_text(encoding="utf-8").splitlines()
                     if line.startswith("#")}
            if anchor not in slugs:
                out.append(f"README.md links to {target}: no such heading")
    return out


def test_the_readmes_links_lead_somewhere():
    # The README is not a page of the site (it links into docs/ for GitHub and PyPI readers),
    # so mkdocs does not check its links: this does.
    assert not readme_link_problems((ROOT / "README.md").read_text(encoding="utf-8"))
    assert readme_link_problems("[a](docs/none.md) [b](docs/tutorial.md#no-such-heading) [c](https://x.y/z)") == [
        "README.md links to docs/none.md: no such file", "README.md links to docs/tutorial.md#no-such-heading: no such heading"]


def wrangler_install_problems(text: str, pin: str) -> list[str]:
    """Where ``text`` installs wrangler other than ``npm install --save-dev --save-exact
    wrangler@<pin>`` (npx does not install it in a fresh folder without asking; a version spec
    without ``--save-exact`` writes ``^x.y.z``), or names a minimum version ("x.y.z or later")."""
    out = []
    for m in re.finditer(r"npm install[^\n`]*wrangler@[\w.^~-]*", text):
        if m.group(0) != f"npm install --save-dev --save-exact wrangler@{pin}":
            out.append(f"{m.group(0)!r}: install exactly wrangler@{pin} with --save-exact")
    out += [f"{m.group(0)!r}: name the tested version" for m in re.finditer(r"wrangler \d[\d.]* or later", text)]
    return out


def test_every_wrangler_install_line_is_the_projects_pin_saved_exactly():
    pin = json.loads((ROOT / "package.json").read_text(encoding="utf-8"))["devDependencies"]["wrangler"]
    found = [f"{page.relative_to(ROOT)}: {problem}"
             for page in [*pages(), ROOT / "examples" / "worker" / "README.md"]
             for problem in wrangler_install_problems(page.read_text(encoding="utf-8"), pin)]
    assert not found, "\n".join(found)
    assert wrangler_install_problems("npm install --save-dev wrangler@1.2.3; wrangler 1.2.3 or later", "1.2.3") == [
        "'npm install --save-dev wrangler@1.2.3': install exactly wrangler@1.2.3 with --save-exact",
        "'wrangler 1.2.3 or later': name the tested version"]


def test_the_python_the_pages_ask_for_is_pyprojects_requires_python():
    minimum = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["requires-python"]
    assert minimum.startswith(">="), minimum
    found = {f"{page.relative_to(ROOT)}: {m.group(0)}"
             for page in pages() for m in re.finditer(r"Python (3\.\d+)(?: or later|\+)", page.read_text(encoding="utf-8"))
             if m.group(1) != minimum[2:]}
    assert not found, f"requires-python is {minimum}:\n" + "\n".join(sorted(found))


def test_every_logging_setup_the_pages_show_writes_to_stdout():
    # A Worker's stderr is console.error, which wrangler dev prints as [ERROR]: the round lines go to stdout.
    calls = [(page, m.group(0)) for page in pages()
             for m in re.finditer(r"logging\.basicConfig\([^)]*\)", page.read_text(encoding="utf-8"))]
    assert calls and all("stream=sys.stdout" in call for _, call in calls), [
        f"{page.relative_to(ROOT)}: {call}" for page, call in calls if "stream=sys.stdout" not in call]
