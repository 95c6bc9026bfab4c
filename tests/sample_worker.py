"""The sample Worker (``examples/worker/``, shown in the tutorial's "A fuller sample"), built the
way a user builds it.

Shared by ``tests/test_sample_worker.py`` (tier 1: the tutorial's blocks are ``examples/worker/``'s
files, and ``wrangler deploy --dry-run`` bundles the sample) and
``tests/workerd/test_sample_worker.py`` (tier 3: the sample runs on workerd):

* :func:`readme_files` reads the sample's files out of that section of ``docs/tutorial.md``
  (each block that includes ``examples/worker/<path>`` of :data:`README_FILES` with a ``--8<--``
  snippet line, resolved as MkDocs does, or whose first line is ``# <path>``);
  ``examples/worker/`` is the source;
* :func:`built_wheel` builds the distribution's wheel once per session, offline, from a copy of
  the project (the venv's setuptools, no build isolation, no index: as
  ``tests/test_packaging.py`` does);
* :func:`create_sample` copies ``examples/worker/`` into a FRESH, empty folder (outside the
  checkout, so neither wrangler nor the workerd harness can see the project's ``src/``) and
  vendors it with the README's offline route: ``pip install --target python_modules --no-deps``
  of the wheel and of the pinned Workers SDK (``scripts/setup``'s ``SDK_PIN``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The page that shows the sample's files, and the guide that gives both install routes.
TUTORIAL = ROOT / "docs" / "tutorial.md"
DEPLOYING = ROOT / "docs" / "guides" / "deploying.md"
EXAMPLE = ROOT / "examples" / "worker"
SECTION = "## A fuller sample"
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$')
#: The sample's files the tutorial shows, each a block that includes the file (or starts ``# <path>``).
README_FILES = ("wrangler.toml", "pyproject.toml", "src/entry.py")
#: Every file of the sample (``examples/worker/``): the README's, the pinned npm tooling, the one
#: command that runs it (``dev``) and its notes.
SAMPLE_FILES = (*README_FILES, "package.json", "package-lock.json", "dev", "README.md")
#: What the sample's ``[python_modules] exclude`` keeps out of the upload: the library's test kit
#: and simulator, which a Worker never imports.
NOT_UPLOADED = ("semaphore/testing/", "semaphore/simulate/")


def sdk_pin() -> str:
    """The Workers SDK requirement ``scripts/setup`` vendors (``workers-runtime-sdk==X.Y.Z``)."""
    match = re.search(r'^SDK_PIN="([^"]+)"$', (ROOT / "scripts" / "setup").read_text(), re.MULTILINE)
    assert match, "no SDK_PIN in scripts/setup"
    return match.group(1)


def readme_section() -> str:
    """The text of the tutorial's "A fuller sample" section (up to the next ``## `` heading)."""
    text = TUTORIAL.read_text(encoding="utf-8")
    start = text.find("\n" + SECTION + "\n")
    assert start >= 0, f"docs/tutorial.md has no {SECTION!r} section"
    end = text.find("\n## ", start + 1)
    return text[start + 1:end if end >= 0 else len(text)]


def deploying_guide() -> str:
    """The text of the deploying guide (both install routes, the import-name check)."""
    return DEPLOYING.read_text(encoding="utf-8")


def included(body: str) -> str:
    """A block's text with its ``--8<-- "path"`` snippet lines replaced by the files (paths from
    the project root, as ``mkdocs.yml``'s ``pymdownx.snippets`` reads them)."""
    out = []
    for line in body.splitlines(keepends=True):
        match = SNIPPET.match(line.rstrip("\n"))
        out.append((ROOT / match["path"]).read_text(encoding="utf-8") if match else line)
    return "".join(out)


def readme_files() -> dict[str, str]:
    """``{path: content}`` of the section's blocks that include ``examples/worker/<path>`` or start
    with ``# <path>`` (a sample file)."""
    found: dict[str, str] = {}
    prefix = EXAMPLE.relative_to(ROOT).as_posix() + "/"
    for match in re.finditer(r"^```[a-z]*\n(.*?)^```$", readme_section(), re.MULTILINE | re.DOTALL):
        body = match.group(1)
        first = body.split("\n", 1)[0]
        snippet = SNIPPET.match(first)
        if snippet and snippet["path"].startswith(prefix) and snippet["path"][len(prefix):] in README_FILES:
            path, body = snippet["path"][len(prefix):], included(body)
        elif first.startswith("# ") and first[2:].strip() in README_FILES:
            path = first[2:].strip()
        else:
            continue
        assert path not in found, f"two blocks for {path}"
        found[path] = body
    return found


def _run(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300)
    if check:
        assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stdout}{proc.stderr}"
    return proc


_WHEEL: list[Path] = []


def built_wheel() -> Path:
    """The ``durability-semaphore`` wheel, built offline once per process (in a temporary folder
    removed at exit) from a copy of the files a build reads."""
    if _WHEEL:
        return _WHEEL[0]
    tmp = Path(tempfile.mkdtemp(prefix="sample-wheel-"))
    import atexit

    atexit.register(shutil.rmtree, tmp, True)
    project = tmp / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, project / name)
    shutil.copytree(ROOT / "src" / "semaphore", project / "src" / "semaphore",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-w", str(tmp / "dist"), str(project), cwd=tmp)
    (wheel,) = (tmp / "dist").glob("durability_semaphore-*-py3-none-any.whl")
    _WHEEL.append(wheel)
    return wheel


def wheel_modules(wheel: Path) -> dict[str, bytes]:
    """``{path: content}`` of the wheel's package files (``semaphore/...``, no dist-info)."""
    with zipfile.ZipFile(wheel) as zf:
        return {n: zf.read(n) for n in zf.namelist() if n.startswith("semaphore/")}


def uploaded_library(wheel: Path) -> dict[str, bytes]:
    """The wheel's package files the sample uploads: all but :data:`NOT_UPLOADED`."""
    return {n: c for n, c in wheel_modules(wheel).items() if not n.startswith(NOT_UPLOADED)}


@dataclass(frozen=True)
class Sample:
    root: Path
    wheel: Path
    #: how the SDK got into python_modules/: the README's pip command, or (without network)
    #: a copy of the project's python_modules/ SDK, vendored by scripts/setup with that command.
    sdk_source: str
    pip_output: str

    @property
    def wrangler_toml(self) -> Path:
        return self.root / "wrangler.toml"


def _copy_project_sdk(target: Path) -> None:
    """The SDK files of the project's python_modules/ (its dist-info RECORD), into ``target``."""
    source = ROOT / "python_modules"
    (record,) = source.glob("workers_runtime_sdk-*.dist-info/RECORD")
    for line in record.read_text(encoding="utf-8").splitlines():
        name = line.rsplit(",", 2)[0].strip()
        if not name or name.endswith(".pyc") or "__pycache__" in name.split("/") or name.startswith(".."):
            continue
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / name, target / name)


def copy_sample(dest: Path) -> Path:
    """``examples/worker/``'s files (:data:`SAMPLE_FILES`, modes kept) into the empty (or absent)
    folder ``dest`` outside the checkout, as a user copies the sample; returns ``dest``."""
    dest = dest.resolve()
    assert not dest.is_relative_to(ROOT), f"{dest} is inside the project"
    dest.mkdir(parents=True, exist_ok=True)
    assert not any(dest.iterdir()), f"{dest} is not empty"
    for path in SAMPLE_FILES:
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(EXAMPLE / path, dest / path)
    return dest


def write_files(dest: Path, files: dict[str, str]) -> Path:
    """``files`` (``{path: content}``, e.g. the README's Worker) into the empty (or absent) folder
    ``dest`` outside the checkout; returns ``dest``."""
    dest = dest.resolve()
    assert not dest.is_relative_to(ROOT), f"{dest} is inside the project"
    dest.mkdir(parents=True, exist_ok=True)
    assert not any(dest.iterdir()), f"{dest} is not empty"
    for path, content in files.items():
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_text(content, encoding="utf-8")
    return dest


def create_sample(dest: Path, wheel: Path, files: dict[str, str] | None = None) -> Sample:
    """A fresh sample project in the empty (or absent) folder ``dest``: ``examples/worker/``'s
    files (or ``files``: ``{path: content}``, e.g. the README's Worker), vendored the offline way
    (``pip install --target python_modules``). ``dest`` must be outside the checkout."""
    dest = copy_sample(dest) if files is None else write_files(dest, files)
    pip = (sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-compile",
           "--target", "python_modules", "--no-deps")
    # The offline route: the wheel and the pinned SDK, into python_modules/ (PyPI for the SDK).
    proc = _run(*pip, str(wheel), sdk_pin(), cwd=dest, check=False)
    sdk_source = f"pip install {sdk_pin()}"
    if proc.returncode != 0:  # no index reachable: the wheel alone, the SDK from the project's copy
        shutil.rmtree(dest / "python_modules", ignore_errors=True)
        failed = proc.stdout + proc.stderr
        proc = _run(*pip, "--no-index", str(wheel), cwd=dest)
        _copy_project_sdk(dest / "python_modules")
        sdk_source = f"copied from {ROOT / 'python_modules'} (pip could not fetch {sdk_pin()}: {failed.strip()[-300:]})"
    shutil.rmtree(dest / "python_modules" / "bin", ignore_errors=True)
    return Sample(dest, wheel, sdk_source, proc.stdout + proc.stderr)
