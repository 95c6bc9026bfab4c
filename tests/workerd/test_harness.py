"""Tests of the tier 3 harness itself.

The config generator and the failure classifier run on plain CPython. The rest needs the workerd
binary but no Pyodide bundle: the project's generated config is schema-checked by workerd, a
broken config must give a different error than the missing bundle, a wrong file in the bundle
cache must give a checksum error, and the process control (start, restart on the same storage
and port, kill -9) is exercised on a small JavaScript worker with a SQLite Durable Object.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import pytest

from semaphore.testing.workerd import (
    BUNDLE_FETCH_FAILED,
    ENV_COMPAT_DATE,
    ENV_COMPAT_FLAGS,
    ENV_WORKERD_ARGS,
    EXPERIMENTAL_FLAGS,
    ConfigError,
    PyodideBundleInvalid,
    PyodideBundleUnavailable,
    WorkerdError,
    WorkerdProcess,
    WorkerdStartError,
    classify_startup_failure,
    compat_date,
    generate_config,
    validate_config,
)
from semaphore.testing.workerd._harness import _capnp_text

pytestmark = pytest.mark.workerd

# What workerd 1.20261117.1 printed here (no network, no cache file), verbatim.
MISSING_BUNDLE_OUTPUT = (
    "*** Uncaught exception ***\n"
    "workerd/server/server/bridge.rs:843: failed: Request for Pyodide bundle failed; url = "
    "https://pyodide-capnp-bin.edgeworker.net/pyodide_314.0.6_2026-08-17_11.capnp.bin; "
    "failed to lookup address information: Name or service not known\n"
)
BAD_BUNDLE_OUTPUT = (
    "*** Uncaught exception ***\n"
    "workerd/server/server/bridge.rs:843: failed: Pyodide bundle integrity check failed: the "
    "bundle does not match the expected checksum.; version = 314.0.6_2026-08-17_11; "
    "expectedIntegrity = sha256-NItCLHMj/EjOzDcedzbUDicMYO9n9q0loNUX4scRvbE=; "
    "actualIntegrity = sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=\n"
)
CONFIG_ERROR_AND_MISSING_BUNDLE_OUTPUT = (
    "service main: Worker \"main\"'s binding \"HOLDER\" refers to a Durable Object namespace "
    "named \"Nope\", but no such Durable Object namespace is defined by this Worker.\n"
    + MISSING_BUNDLE_OUTPUT
)

WRANGLER_TOML = """\
name = "harness-test"
main = "src/entry.py"
compatibility_date = "2026-11-01"
compatibility_flags = ["python_workers"]

[vars]
TEXT = "a \\"quoted\\" value\\nwith a newline"
NUMBER = 5

[[durable_objects.bindings]]
name = "HOLDER"
class_name = "Holder"

[[durable_objects.bindings]]
name = "OLD"
class_name = "Legacy"

[[migrations]]
tag = "v1"
new_sqlite_classes = ["Holder"]
new_classes = ["Legacy"]
"""


def make_project(root: Path, wrangler_toml: str = WRANGLER_TOML) -> Path:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "entry.py").write_text("from pkg import X\n")
    (root / "src" / "pkg" / "__init__.py").write_text('X = "\\u00e9\\t"\n')
    (root / "src" / "pkg" / "schema.sql").write_text("CREATE TABLE t (x);\n")
    (root / "src" / "pkg" / "__pycache__").mkdir()
    (root / "src" / "pkg" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (root / "src" / "notes.md").write_text("not a module\n")
    pm = root / "python_modules"
    (pm / "workers").mkdir(parents=True)
    (pm / "workers" / "__init__.py").write_text("import js\n")
    (pm / "workers" / "workflows.js").write_text("export const x = 1;\n")
    (pm / "workers" / "py.typed").write_bytes(b"")
    (pm / "workers" / "__pycache__").mkdir()
    (pm / "workers" / "__pycache__" / "a.pyc").write_bytes(b"\0")
    (pm / "_patch.pth").write_text("import _patch_loader\n")
    (pm / "blob.bin").write_bytes(bytes(range(256)))
    (root / "wrangler.toml").write_text(wrangler_toml)
    return root / "wrangler.toml"


def module_entries(text: str) -> list[tuple[str, str]]:
    text = text.split("compatibilityDate = ", 1)[0]  # the module list comes first
    return re.findall(r'\(name = "([^"]+)", (pythonModule|esModule|data|text|wasm) = ', text)


# --- config generation (no binary) --------------------------------------------------------------


def test_generate_config_modules_bindings_and_storage(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_COMPAT_DATE, raising=False)
    monkeypatch.delenv(ENV_COMPAT_FLAGS, raising=False)
    toml = make_project(tmp_path / "proj")
    cfg = generate_config(toml, tmp_path / "out", storage_dir=tmp_path / "store", port=1234,
                          vars_override={"EXTRA": "x"}, secrets={"TOKEN": "s3cret"})
    text = cfg.read_text()
    modules = module_entries(text)
    assert modules[0] == ("entry.py", "pythonModule"), "main module must come first"
    assert sorted(modules[1:]) == sorted([
        ("pkg/__init__.py", "pythonModule"),
        ("pkg/schema.sql", "text"),
        ("python_modules/_patch.pth", "data"),
        ("python_modules/blob.bin", "data"),
        ("python_modules/workers/__init__.py", "data"),
        ("python_modules/workers/py.typed", "data"),
        ("python_modules/workers/workflows.js", "esModule"),
    ])
    assert 'compatibilityDate = "2026-11-01"' in text
    assert 'compatibilityFlags = ["python_workers"]' in text
    assert '(name = "NUMBER", json = "5")' in text
    assert '(name = "EXTRA", text = "x")' in text
    assert '(name = "TOKEN", text = "s3cret")' in text
    assert _capnp_text('a "quoted" value\nwith a newline') in text
    assert ('(className = "Holder", uniqueKey = "harness-test-Holder", enableSql = true)'
            in text)
    assert ('(className = "Legacy", uniqueKey = "harness-test-Legacy", enableSql = false)'
            in text)
    assert '(name = "HOLDER", durableObjectNamespace = (className = "Holder"))' in text
    assert 'durableObjectStorage = (localDisk = "do-storage")' in text
    assert f'disk = (path = "{(tmp_path / "store").resolve()}", writable = true)' in text
    assert 'address = "127.0.0.1:1234"' in text
    assert (tmp_path / "store").is_dir()


def test_generate_config_env_overrides(tmp_path, monkeypatch):
    toml = make_project(tmp_path / "proj")
    monkeypatch.setenv(ENV_COMPAT_DATE, "2026-09-08")
    monkeypatch.setenv(ENV_COMPAT_FLAGS, " python_workers , extra_flag,,")
    text = generate_config(toml, tmp_path / "out", storage_dir=tmp_path / "s").read_text()
    assert 'compatibilityDate = "2026-09-08"' in text
    assert 'compatibilityFlags = ["python_workers", "extra_flag"]' in text


def test_generate_config_rejects_what_it_cannot_express(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_COMPAT_FLAGS, raising=False)
    no_flag = WRANGLER_TOML.replace('compatibility_flags = ["python_workers"]', "")
    with pytest.raises(ConfigError, match="python_workers"):
        generate_config(make_project(tmp_path / "a", no_flag), tmp_path / "o",
                        storage_dir=tmp_path / "s")
    other_script = WRANGLER_TOML.replace('class_name = "Legacy"',
                                         'class_name = "Legacy"\nscript_name = "other"')
    with pytest.raises(ConfigError, match="another script"):
        generate_config(make_project(tmp_path / "b", other_script), tmp_path / "o",
                        storage_dir=tmp_path / "s")


PROJECT_ROOT = Path(__file__).resolve().parents[2]
#: The module rules of the project's wrangler.toml (empty Text/Data/CompiledWasm rules).
QUIET_RULES = """
[[rules]]
type = "Text"
globs = []
fallthrough = false

[[rules]]
type = "Data"
globs = []
fallthrough = false

[[rules]]
type = "CompiledWasm"
globs = []
fallthrough = false
"""


def src_modules(toml: Path) -> list[tuple[str, str]]:
    from semaphore.testing.workerd import collect_modules

    return sorted((m.name, m.kind) for m in collect_modules(toml.parent, "src/entry.py")
                  if not m.name.startswith("python_modules/"))


def test_collect_modules_follows_wrangler_module_rules(tmp_path):
    # As wrangler's parseRules/matchFiles: a user rule shadows the default rule of its type
    # unless it falls through; globs are matched on the path relative to src/ ("*" stays in one
    # segment, "**/" is any depth); an empty rule of a type uploads nothing of it.
    quiet = make_project(tmp_path / "quiet", WRANGLER_TOML + QUIET_RULES)
    (quiet.parent / "src" / "pkg.egg-info").mkdir()
    (quiet.parent / "src" / "pkg.egg-info" / "SOURCES.txt").write_text("pkg/__init__.py\n")
    assert src_modules(quiet) == [("entry.py", "pythonModule"), ("pkg/__init__.py", "pythonModule")]

    md_only = WRANGLER_TOML + '[[rules]]\ntype = "Text"\nglobs = ["*.md"]\n'
    toml = make_project(tmp_path / "md", md_only)
    (toml.parent / "src" / "pkg" / "deep.md").write_text("not top level\n")
    assert src_modules(toml) == [("entry.py", "pythonModule"), ("notes.md", "text"),
                                 ("pkg/__init__.py", "pythonModule")]

    both = WRANGLER_TOML + '[[rules]]\ntype = "Text"\nglobs = ["**/*.md"]\nfallthrough = true\n'
    toml = make_project(tmp_path / "both", both)
    assert src_modules(toml) == [("entry.py", "pythonModule"), ("notes.md", "text"),
                                 ("pkg/__init__.py", "pythonModule"), ("pkg/schema.sql", "text")]


def test_generate_config_applies_the_module_rules_of_the_toml_it_is_given(tmp_path):
    # generate_config reads ONE toml; its [[rules]] (or, without any, wrangler's defaults) decide
    # the modules, not those of a wrangler.toml that happens to sit beside it.
    def generated(toml_text_beside: str, given_text: str, where: Path) -> list[tuple[str, str]]:
        toml = make_project(where, toml_text_beside)
        given = toml.parent / "other.toml"
        given.write_text(given_text)
        cfg = generate_config(given, where / "out", storage_dir=where / "s")
        return [m for m in module_entries(cfg.read_text()) if not m[0].startswith("python_modules/")]

    assert generated(WRANGLER_TOML, WRANGLER_TOML + QUIET_RULES, tmp_path / "quiet") == [
        ("entry.py", "pythonModule"), ("pkg/__init__.py", "pythonModule")]
    assert sorted(generated(WRANGLER_TOML + QUIET_RULES, WRANGLER_TOML, tmp_path / "defaults")) == [
        ("entry.py", "pythonModule"), ("pkg/__init__.py", "pythonModule"), ("pkg/schema.sql", "text")]


def test_project_modules_leave_build_output_test_kit_and_simulator_out(tmp_path):
    # The project's wrangler.toml on a copy of src/ holding an editable install's egg-info and
    # bytecode: generate_config runs its [build] command (staging build/worker/, its base_dir),
    # and the modules are the entry and the library's .py files but the test kit and the
    # simulator, as wrangler uploads them (tests/test_wrangler.py checks wrangler's side).
    import shutil

    project = tmp_path / "project"
    project.mkdir()
    shutil.copy2(PROJECT_ROOT / "wrangler.toml", project / "wrangler.toml")
    (project / "scripts").mkdir()
    shutil.copy2(PROJECT_ROOT / "scripts" / "stage_worker.py", project / "scripts" / "stage_worker.py")
    shutil.copytree(PROJECT_ROOT / "src", project / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    egg = project / "src" / "durability_semaphore.egg-info"
    egg.mkdir()
    for name in ("SOURCES.txt", "top_level.txt", "PKG-INFO"):
        (egg / name).write_text("x\n")
    (project / "src" / "semaphore" / "__pycache__").mkdir()
    (project / "src" / "semaphore" / "__pycache__" / "wire.cpython-314.pyc").write_bytes(b"\0")
    library = sorted(p.relative_to(project / "src").as_posix()
                     for p in (project / "src" / "semaphore").rglob("*.py") if "__pycache__" not in p.parts)
    kept = [m for m in library if not m.startswith(("semaphore/testing/", "semaphore/simulate/"))]
    assert len(kept) < len(library) and "semaphore/holder/__init__.py" in kept
    worker = sorted(p.name for p in (project / "src").glob("*.py"))  # entry.py and the modules it imports
    assert "entry.py" in worker
    cfg = generate_config(project / "wrangler.toml", tmp_path / "out", storage_dir=tmp_path / "s")
    modules = [m for m in module_entries(cfg.read_text()) if not m[0].startswith("python_modules/")]
    assert modules[0] == ("entry.py", "pythonModule")
    assert sorted(modules) == sorted([(name, "pythonModule") for name in worker + kept])


def test_generate_config_runs_the_build_command_and_reads_base_dir(tmp_path, monkeypatch):
    # As wrangler: [build] command runs first (in the project folder, WRANGLER_COMMAND set), and
    # base_dir is the module root; the main module (outside it) keeps its file name.
    monkeypatch.setenv(ENV_COMPAT_FLAGS, "")
    build = ('\n[build]\ncommand = "mkdir -p staged/pkg && cp src/pkg/__init__.py staged/pkg/ && '
             'echo \\"$WRANGLER_COMMAND\\" > staged/pkg/seen.sql"\n')
    toml = make_project(tmp_path / "p", 'base_dir = "staged"\n' + WRANGLER_TOML + build)
    cfg = generate_config(toml, tmp_path / "o", storage_dir=tmp_path / "s")
    modules = [m for m in module_entries(cfg.read_text()) if not m[0].startswith("python_modules/")]
    assert modules == [("entry.py", "pythonModule"), ("pkg/__init__.py", "pythonModule"),
                       ("pkg/seen.sql", "text")], modules
    assert (toml.parent / "staged" / "pkg" / "seen.sql").read_text() == "dev\n"

    failing = make_project(tmp_path / "f", WRANGLER_TOML + '\n[build]\ncommand = "echo no; exit 3"\n')
    with pytest.raises(ConfigError, match=r"(?s)failed \(3\).*no"):
        generate_config(failing, tmp_path / "o2", storage_dir=tmp_path / "s")
    missing = make_project(tmp_path / "m", 'base_dir = "nowhere"\n' + WRANGLER_TOML)
    with pytest.raises(ConfigError, match="base_dir"):
        generate_config(missing, tmp_path / "o3", storage_dir=tmp_path / "s")


def test_renamed_sqlite_class_keeps_sql():
    from semaphore.testing.workerd._harness import _sqlite_classes

    created, sqlite = _sqlite_classes([
        {"new_sqlite_classes": ["A"], "new_classes": ["B"]},
        {"renamed_classes": [{"from": "A", "to": "A2"}], "deleted_classes": ["B"]},
    ])
    assert created == {"A2"} and sqlite == {"A2"}


# --- classifying workerd's output (no binary) ------------------------------------------------


def test_classify_missing_bundle():
    err = classify_startup_failure(MISSING_BUNDLE_OUTPUT)
    assert isinstance(err, PyodideBundleUnavailable)
    assert err.file_name == "pyodide_314.0.6_2026-08-17_11.capnp.bin"
    assert err.url.endswith("/pyodide_314.0.6_2026-08-17_11.capnp.bin")
    assert BUNDLE_FETCH_FAILED in err.reason and "SEMAPHORE_PYODIDE_CACHE" in err.reason


def test_classify_bad_bundle_is_not_a_skip():
    err = classify_startup_failure(BAD_BUNDLE_OUTPUT, cache_dir=Path("/c"))
    assert isinstance(err, PyodideBundleInvalid)
    assert "pyodide_314.0.6_2026-08-17_11.capnp.bin" in str(err)


def test_classify_config_error_beside_missing_bundle_is_not_a_skip():
    err = classify_startup_failure(CONFIG_ERROR_AND_MISSING_BUNDLE_OUTPUT)
    assert type(err) is WorkerdStartError
    assert "no such Durable Object namespace" in str(err)


def test_classify_other_failure():
    err = classify_startup_failure("x.capnp:3:4: Parse error.\n")
    assert type(err) is WorkerdStartError and "Parse error" in str(err)


def test_experimental_flag_adds_serve_experimental(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_WORKERD_ARGS, raising=False)
    monkeypatch.setenv(ENV_COMPAT_FLAGS, "")
    project = make_project(tmp_path / "p")
    plain = generate_config(project, tmp_path / "o1", storage_dir=tmp_path / "s")
    assert "--experimental" not in WorkerdProcess(plain, binary="/bin/true").command()
    monkeypatch.setenv(ENV_COMPAT_FLAGS, "python_workers_development")
    dev = generate_config(project, tmp_path / "o2", storage_dir=tmp_path / "s")
    assert "python_workers_development" in EXPERIMENTAL_FLAGS
    cmd = WorkerdProcess(dev, binary="/bin/true").command()
    assert cmd.count("--experimental") == 1


def test_workerd_args_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_WORKERD_ARGS, "--verbose --inspector-addr='127.0.0.1:9229'")
    cfg = generate_config(make_project(tmp_path / "p"), tmp_path / "o", storage_dir=tmp_path / "s")
    cmd = WorkerdProcess(cfg, binary="/bin/true", extra_args=["--x"]).command()
    assert cmd[-3:] == ["--x", "--verbose", "--inspector-addr=127.0.0.1:9229"]


def test_hand_written_configs_follow_compat_date(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_COMPAT_DATE, "2026-09-08")
    assert 'compatibilityDate = "2026-09-08"' in js_config(tmp_path).read_text()


# --- with the workerd binary (no Pyodide bundle needed) --------------------------------------


def test_project_config_passes_workerd_schema(workerd_bin, project_wrangler_toml, tmp_path):
    cfg = generate_config(project_wrangler_toml, tmp_path, storage_dir=tmp_path / "s")
    validate_config(cfg, binary=workerd_bin)


def test_schema_error_is_reported(workerd_bin, tmp_path):
    cfg = generate_config(make_project(tmp_path / "p"), tmp_path / "o", storage_dir=tmp_path / "s")
    validate_config(cfg, binary=workerd_bin)
    cfg.write_text(cfg.read_text().replace("enableSql = true", "enableSql = true, bogus = 1"))
    with pytest.raises(WorkerdStartError, match="no field named 'bogus'"):
        validate_config(cfg, binary=workerd_bin)


def _start_or_bundle_error(proc: WorkerdProcess) -> WorkerdError | None:
    try:
        proc.start()
    except WorkerdError as err:
        return err
    return None


def test_broken_config_is_not_taken_for_a_missing_bundle(workerd_bin, tmp_path):
    cfg = generate_config(make_project(tmp_path / "p"), tmp_path / "o", storage_dir=tmp_path / "s")
    cfg.write_text(cfg.read_text().replace(
        'durableObjectNamespace = (className = "Holder")',
        'durableObjectNamespace = (className = "Nope")'))
    proc = WorkerdProcess(cfg, binary=workerd_bin, pyodide_cache=tmp_path / "cache")
    err = _start_or_bundle_error(proc)
    proc.stop()
    assert type(err) is WorkerdStartError, err
    assert 'named "Nope"' in str(err)


def test_wrong_bundle_file_gives_checksum_error(workerd_bin, tmp_path, monkeypatch):
    """Learn the expected file name from workerd (or from a real download), then corrupt it.

    This is about the released-bundle route, so it runs without the development flag even when
    SEMAPHORE_COMPAT_FLAGS names it (a development bundle is never checksum-checked)."""
    flags = [f for f in os.environ.get(ENV_COMPAT_FLAGS, "").split(",")
             if f.strip() and f.strip() not in EXPERIMENTAL_FLAGS]
    monkeypatch.setenv(ENV_COMPAT_FLAGS, ",".join(flags))
    cfg = generate_config(make_project(tmp_path / "p"), tmp_path / "o", storage_dir=tmp_path / "s")
    cache = tmp_path / "cache"
    proc = WorkerdProcess(cfg, binary=workerd_bin, pyodide_cache=cache, log_dir=tmp_path / "l1")
    err = _start_or_bundle_error(proc)
    proc.stop()
    if isinstance(err, PyodideBundleUnavailable):
        name = err.file_name
    else:  # workerd downloaded the bundle (network) and saved it into the cache dir
        files = list(cache.glob("pyodide_*.capnp.bin"))
        assert len(files) == 1, (err, files)
        name = files[0].name
    assert re.fullmatch(r"pyodide_[^/]+\.capnp\.bin", name or ""), name
    (cache / name).write_bytes(b"not a bundle")
    proc = WorkerdProcess(cfg, binary=workerd_bin, pyodide_cache=cache, log_dir=tmp_path / "l2")
    err = _start_or_bundle_error(proc)
    proc.stop()
    assert isinstance(err, PyodideBundleInvalid), err
    assert "expectedIntegrity" in str(err)


JS_WORKER = """\
import { DurableObject } from "cloudflare:workers";
export class Counter extends DurableObject {
  bump() {
    this.ctx.storage.sql.exec("CREATE TABLE IF NOT EXISTS t (n INTEGER)");
    this.ctx.storage.sql.exec("INSERT INTO t VALUES (1)");
    return this.ctx.storage.sql.exec("SELECT count(*) AS c FROM t").one().c;
  }
}
export default {
  async fetch(req, env) {
    if (new URL(req.url).pathname === "/healthz") return new Response("ok " + env.GREETING);
    return new Response(String(await env.COUNTER.getByName("x").bump()));
  },
};
"""


def js_config(tmp_path: Path) -> Path:
    """The same storage/socket layout generate_config emits, around a JavaScript worker."""
    storage = tmp_path / "storage"
    storage.mkdir()
    cfg = tmp_path / "js.capnp"
    cfg.write_text(textwrap.dedent(f"""\
        using Workerd = import "/workerd/workerd.capnp";
        const config :Workerd.Config = (
          services = [
            (name = "main", worker = (
              modules = [(name = "w.js", esModule = {_capnp_text(JS_WORKER)})],
              compatibilityDate = {_capnp_text(compat_date())},
              bindings = [(name = "GREETING", text = "hi"),
                          (name = "COUNTER", durableObjectNamespace = (className = "Counter"))],
              durableObjectNamespaces = [
                (className = "Counter", uniqueKey = "js-Counter", enableSql = true)],
              durableObjectStorage = (localDisk = "do-storage"))),
            (name = "do-storage", disk = (path = {json.dumps(str(storage))}, writable = true)),
          ],
          sockets = [(name = "http", address = "127.0.0.1:0", http = (), service = "main")]
        );
        """))
    return cfg


def test_process_lifecycle_on_js_worker(workerd_bin, tmp_path):
    proc = WorkerdProcess(js_config(tmp_path), binary=workerd_bin, pyodide_cache=None)
    with proc:
        assert proc.request("/healthz") == (200, b"ok hi")
        assert proc.request("/")[1] == b"1"
        port = proc.port
        proc.restart()  # SIGTERM, same storage, same port
        assert proc.port == port
        assert proc.request("/")[1] == b"2"
        proc.restart(hard=True)  # kill -9: committed SQLite writes survive
        assert proc.port == port
        assert proc.request("/")[1] == b"3"
        assert proc.runs == 3
    assert not proc.running()
    assert list((tmp_path / "storage" / "js-Counter").glob("*.sqlite"))


def test_the_project_root_is_found_from_an_installed_copy(tmp_path, monkeypatch):
    # semaphore.testing.workerd installed outside a checkout (a shallow path): the project is
    # SEMAPHORE_PROJECT_ROOT, else the first folder up from the working directory holding a
    # wrangler.toml (it raised IndexError at import when the file sat fewer than 5 folders deep).
    import importlib.util
    import sys

    from semaphore.testing.workerd import _harness

    copy = tmp_path / "h.py"
    copy.write_text(Path(_harness.__file__).read_text())
    project = tmp_path / "proj"
    (project / "sub").mkdir(parents=True)
    (project / "wrangler.toml").write_text('name = "x"\n')
    monkeypatch.delenv("SEMAPHORE_PROJECT_ROOT", raising=False)
    monkeypatch.chdir(project / "sub")
    spec = importlib.util.spec_from_file_location("harness_copy", copy)
    module = importlib.util.module_from_spec(spec)
    sys.modules["harness_copy"] = module
    try:
        spec.loader.exec_module(module)
        assert module.PROJECT_ROOT == project.resolve()
        monkeypatch.setenv("SEMAPHORE_PROJECT_ROOT", str(tmp_path))
        assert module._project_root() == tmp_path.resolve()
    finally:
        del sys.modules["harness_copy"]
