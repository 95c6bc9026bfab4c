"""The distribution: ``durability-semaphore`` builds as a wheel and an sdist (offline: the venv's
setuptools, no build isolation) holding every subpackage and the ``py.typed`` marker, with SPDX
license metadata; installed with ``pip install --target`` (the offline route into a Worker's
``python_modules/``) it imports from there; another distribution's top-level ``semaphore`` package
over it is refused with a clear error; ``ruff`` is clean on the whole tree."""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "src" / "semaphore"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
VERSION = PYPROJECT["project"]["version"]


def _project_copy(tmp: Path) -> Path:
    """The files a build reads, copied (a build writes build/ and metadata next to them)."""
    project = tmp / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, project / name)
    shutil.copytree(LIBRARY, project / "src" / "semaphore", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(ROOT / "src" / "entry.py", project / "src" / "entry.py")  # must stay out of the wheel
    return project


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(wheel, sdist)`` built from a copy of the project, without network."""
    tmp = tmp_path_factory.mktemp("build")
    project = _project_copy(tmp)
    out = tmp / "dist"
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-w", str(out), str(project), cwd=tmp)
    _run(sys.executable, "-c", f"from setuptools import build_meta as b; b.build_sdist({str(out)!r})", cwd=project)
    (wheel,) = out.glob("durability_semaphore-*.whl")
    (sdist,) = out.glob("durability_semaphore-*.tar.gz")
    return wheel, sdist


def library_files() -> set[str]:
    return {p.relative_to(LIBRARY.parent).as_posix() for p in LIBRARY.rglob("*.py") if "__pycache__" not in p.parts}


def test_the_wheel_holds_every_subpackage_and_py_typed_and_nothing_else(built):
    wheel, _ = built
    assert wheel.name == f"durability_semaphore-{VERSION}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {n for n in names if not n.startswith("durability_semaphore-")}
    assert modules == library_files() | {"semaphore/py.typed"}, sorted(modules ^ (library_files() | {"semaphore/py.typed"}))
    assert "entry.py" not in names  # the reference Worker is not part of the library


def test_the_wheel_metadata_is_complete(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as zf:
        metadata = email.message_from_bytes(zf.read(f"durability_semaphore-{VERSION}.dist-info/METADATA"))
        names = zf.namelist()
    assert metadata["Name"] == "durability-semaphore" and metadata["Version"] == VERSION
    assert metadata["License-Expression"] == "MIT"
    assert metadata["Requires-Python"] == ">=3.11"
    classifiers = metadata.get_all("Classifier")
    assert "Typing :: Typed" in classifiers and "Programming Language :: Python :: 3.14" in classifiers
    assert f"durability_semaphore-{VERSION}.dist-info/licenses/LICENSE" in names
    # no runtime dependency: every requirement belongs to the "dev" extra
    # No runtime dependency: only the optional extras (dev, and simulate: the simulator's plots).
    assert all('extra == "dev"' in r or 'extra == "simulate"' in r
               for r in metadata.get_all("Requires-Dist") or []), metadata.get_all("Requires-Dist")


def test_the_sdist_holds_the_sources_license_and_marker(built):
    _, sdist = built
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "LICENSE", "src/semaphore/py.typed"} <= names
    assert {f"src/{m}" for m in library_files()} <= names


def test_the_offline_route_installs_into_a_folder_of_its_own_and_imports_from_it(built, tmp_path):
    # README "Use it in your Worker": pip install --target python_modules --no-deps <wheel>.
    wheel, _ = built
    target = tmp_path / "python_modules"
    _run(sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
         "--target", str(target), str(wheel), cwd=tmp_path)
    code = ("import semaphore, semaphore.holder, semaphore.client, semaphore.core, semaphore.testing;"
            "print(semaphore.__version__, semaphore.__file__)")
    proc = _run(sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(target)!r}); {code}", cwd=tmp_path)
    version, where = proc.stdout.split()
    assert version == VERSION and Path(where).is_relative_to(target)
    assert (target / "semaphore" / "py.typed").is_file()


def test_the_version_is_the_distributions():
    import semaphore

    assert semaphore.__version__ == VERSION and "__version__" in semaphore.__all__
    assert semaphore.__distribution__ == PYPROJECT["project"]["name"]


def test_another_distributions_semaphore_package_over_this_one_is_refused_clearly(tmp_path):
    # README: a top-level `semaphore` package of another distribution installed into the same
    # folder overwrites semaphore/__init__.py; importing this library's subpackages then fails
    # with an ImportError that says so, instead of running the other package's code silently.
    shutil.copytree(LIBRARY, tmp_path / "semaphore", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (tmp_path / "semaphore" / "__init__.py").write_text('"""Some other semaphore library."""\nVALUE = 1\n')
    proc = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import semaphore.holder"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "not durability-semaphore's" in proc.stderr, proc.stderr


def test_ruff_is_clean_on_the_whole_tree():
    # pyproject [tool.ruff]: pyflakes, pycodestyle, import order, bugbear, pyupgrade (py311)
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_uv_builds_the_same_wheel_and_sdist_contents(built, tmp_path):
    # "builds as a wheel and an sdist (pip and uv)": uv's frontend (offline, the venv's
    # setuptools) gives the same files as pip's.
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv is None:
        pytest.skip("uv is not installed in this environment (pip install -e '.[dev]' installs it)")
    project = _project_copy(tmp_path)
    out = tmp_path / "uvdist"
    _run(uv, "build", "--offline", "--no-build-isolation", "--python", sys.executable, "--out-dir", str(out),
         cwd=project)
    (wheel,) = out.glob("durability_semaphore-*.whl")
    (sdist,) = out.glob("durability_semaphore-*.tar.gz")

    def wheel_names(path: Path) -> set[str]:
        return {n for n in zipfile.ZipFile(path).namelist() if not n.endswith("RECORD")}

    def sdist_names(path: Path) -> set[str]:
        with tarfile.open(path) as tar:
            return {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}

    assert wheel.name == built[0].name and wheel_names(wheel) == wheel_names(built[0])
    assert sdist_names(sdist) == sdist_names(built[1])
