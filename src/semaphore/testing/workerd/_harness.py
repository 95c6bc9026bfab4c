"""Run a project's Worker in the real ``workerd`` binary (tier 3 of the tests, ``scripts/bench_runtime.py``).

``wrangler.toml`` is the one source of truth. :func:`generate_config` reads it with
``tomllib`` and writes a workerd Cap'n Proto text config that declares the worker the way
``wrangler dev`` (miniflare) hands it to workerd:

* the main module (``main``) first, as ``pythonModule``, named by its file name
  (``entry.py``); every other file under the module root (``base_dir``, else the main's folder;
  a ``[build] command`` runs first, as under wrangler) that wrangler's module rules pick up
  (``**/*.py`` as ``pythonModule``, ``*.txt``/``*.html``/``*.sql`` as ``text``, ``*.bin`` as
  ``data``, ``*.wasm`` as ``wasm``), named by its path relative to that folder
  (``semaphore/__init__.py``);
* every file of ``python_modules/`` (the vendored packages, including the
  ``workers-runtime-sdk`` SDK) except ``*.pyc`` as a ``data`` module named
  ``python_modules/<relative path>``, except the SDK's own ``workers/*.js`` / ``workers/*.mjs``
  files, which are ``esModule`` (wrangler's ``getVendoredModuleType``);
* ``compatibility_date`` / ``compatibility_flags``;
* one ``durableObjectNamespaces`` entry per ``[[durable_objects.bindings]]`` class, with
  ``enableSql = true`` for classes created by ``new_sqlite_classes`` migrations, ``uniqueKey``
  ``<worker name>-<class name>`` (what miniflare uses), stored on a ``disk`` service through
  ``durableObjectStorage = (localDisk = ...)``;
* ``[vars]`` as ``text`` (strings) or ``json`` (anything else) bindings, plus overrides and
  secrets given by the caller.

Module contents are written inline as Cap'n Proto literals, so the config is one self-contained
file that does not depend on the working directory or on ``embed`` path rules.

Environment variables (read by :func:`workerd_binary`, :func:`generate_config` and
:class:`WorkerdProcess`; ``scripts/dev --workerd`` honours the same ones):

``SEMAPHORE_WORKERD``
    path of the workerd binary (default: ``node_modules/workerd/bin/workerd`` of the project, as
    pinned by ``package.json``).
``SEMAPHORE_PYODIDE_CACHE``
    a folder passed as ``--pyodide-bundle-disk-cache-dir``. workerd looks there for
    ``pyodide_<version>.capnp.bin`` before it tries to download the bundle, and saves a
    downloaded bundle there. The file is checksum-verified for released versions.
``SEMAPHORE_PYODIDE_PACKAGE_CACHE``
    a folder passed as ``--pyodide-package-disk-cache-dir`` (Pyodide's own packages; this
    project vendors only pure-Python wheels, so it is normally not needed).
``SEMAPHORE_COMPAT_DATE``
    overrides ``compatibility_date``.
``SEMAPHORE_COMPAT_FLAGS``
    comma-separated compatibility flags added to wrangler.toml's. ``scripts/test`` sets
    ``python_workers_development`` here when it built the development Pyodide bundle
    (``../shared/devbundle``); that flag is experimental, so :class:`WorkerdProcess` then runs
    ``workerd serve --experimental`` (see :data:`EXPERIMENTAL_FLAGS`).
``SEMAPHORE_WORKERD_SKIP``
    set by ``scripts/test`` to the development-bundle builder's reason when it cannot build a
    bundle for this workerd (its exit 2): tier 3 then skips with that reason.
``SEMAPHORE_WORKERD_ARGS``
    extra arguments for ``workerd serve``, split like a shell would (``shlex``), appended after
    the harness's own (e.g. ``--verbose``).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _project_root() -> Path:
    """The project whose Worker runs: ``SEMAPHORE_PROJECT_ROOT``, else this source checkout
    (``src/semaphore/testing/workerd/`` four levels below a ``wrangler.toml``), else the first
    folder from the working directory up that holds a ``wrangler.toml``, else the working
    directory."""
    env = os.environ.get("SEMAPHORE_PROJECT_ROOT")
    if env:
        return Path(env).resolve()
    parents = Path(__file__).resolve().parents
    if len(parents) > 4 and (parents[4] / "wrangler.toml").is_file():
        return parents[4]
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "wrangler.toml").is_file():
            return folder
    return here


#: The project root: see :func:`_project_root`.
PROJECT_ROOT = _project_root()
DEFAULT_WRANGLER_TOML = PROJECT_ROOT / "wrangler.toml"

ENV_WORKERD = "SEMAPHORE_WORKERD"
ENV_PYODIDE_CACHE = "SEMAPHORE_PYODIDE_CACHE"
ENV_PYODIDE_PACKAGE_CACHE = "SEMAPHORE_PYODIDE_PACKAGE_CACHE"
ENV_COMPAT_DATE = "SEMAPHORE_COMPAT_DATE"
ENV_COMPAT_FLAGS = "SEMAPHORE_COMPAT_FLAGS"
ENV_WORKERD_ARGS = "SEMAPHORE_WORKERD_ARGS"
ENV_WORKERD_SKIP = "SEMAPHORE_WORKERD_SKIP"

#: Compatibility flags workerd accepts only with ``serve --experimental``. A generated config
#: that names one of them makes :class:`WorkerdProcess` pass that switch.
EXPERIMENTAL_FLAGS = frozenset({"python_workers_development"})

#: The compatibility date a hand-written test config uses when SEMAPHORE_COMPAT_DATE is unset.
DEFAULT_COMPAT_DATE = "2026-11-01"

SOCKET_NAME = "http"
WORKER_SERVICE = "main"
STORAGE_SERVICE = "do-storage"

# wrangler's default ``python_modules.exclude``.
_DEFAULT_PYTHON_MODULES_EXCLUDE = ("**/*.pyc",)
_VENDORED_JS_EXTENSIONS = (".js", ".mjs")


# ---------------------------------------------------------------------------------------------
# Config generation
# ---------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """wrangler.toml holds something this harness cannot express for workerd."""


def _capnp_text(value: str) -> str:
    """A Cap'n Proto text literal (UTF-8, C-style escapes)."""
    out = ['"']
    for ch in value:
        code = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif ch == '"':
            out.append('\\"')
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\x{code:02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _capnp_data(value: bytes) -> str:
    """A Cap'n Proto data literal (``0x""`` is a parse error, so empty data is ``""``)."""
    if not value:
        return '""'
    return '0x"' + value.hex() + '"'


def _glob_match(rel: str, pattern: str) -> bool:
    """Match a ``/``-separated relative path against a wrangler-style glob (``**`` = any depth)."""
    if pattern.startswith("**/"):
        tail = pattern[3:]
        return fnmatch.fnmatchcase(rel, tail) or fnmatch.fnmatchcase(rel, "*/" + tail) or any(
            fnmatch.fnmatchcase(rel.split("/", i)[-1], tail) for i in range(1, rel.count("/") + 1)
        )
    return fnmatch.fnmatchcase(rel, pattern)


def _walk_files(root: Path, *, skip_dirs: Iterable[Path] = ()) -> list[Path]:
    skip = {p.resolve() for p in skip_dirs}
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if (here / d).resolve() not in skip)
        for name in sorted(filenames):
            found.append(here / name)
    return found


@dataclass(frozen=True)
class Module:
    name: str
    kind: str  # pythonModule | text | data | wasm | esModule
    content: bytes

    def render(self) -> str:
        if self.kind in ("data", "wasm"):
            literal = _capnp_data(self.content)
        else:
            literal = _capnp_text(self.content.decode("utf-8"))
        return f"(name = {_capnp_text(self.name)}, {self.kind} = {literal})"


def _module_kind(project_root: Path, rules: Iterable[Mapping[str, Any]] | None) -> Callable[[str], str | None]:
    """wrangler 4's module rules (see :func:`collect_modules`) as ``relative path -> module
    kind`` (``None``: not a module)."""
    if rules is None:
        toml_path = project_root / "wrangler.toml"
        rules = []
        if toml_path.is_file():
            with toml_path.open("rb") as fh:
                rules = tomllib.load(fh).get("rules", [])
    kinds = {"PythonModule": "pythonModule", "Text": "text", "Data": "data",
             "CompiledWasm": "wasm", "ESModule": "esModule", "CommonJS": "commonJsModule"}
    all_rules = [dict(r) for r in rules]
    if not any(r.get("type") == "PythonModule" for r in all_rules):
        all_rules.append({"type": "PythonModule", "globs": ["**/*.py"]})
    all_rules += [{"type": "Text", "globs": ["**/*.txt", "**/*.html", "**/*.sql"]},
                  {"type": "Data", "globs": ["**/*.bin"]},
                  {"type": "CompiledWasm", "globs": ["**/*.wasm", "**/*.wasm?module"]}]

    def glob_regex(glob: str) -> re.Pattern[str]:
        out, i = [], 0
        while i < len(glob):
            if glob[i] != "*":
                out.append(re.escape(glob[i]))
                i += 1
                continue
            start = i
            while i + 1 < len(glob) and glob[i + 1] == "*":
                i += 1
            prev = glob[start - 1] if start else None
            nxt = glob[i + 1] if i + 1 < len(glob) else None
            if i > start and prev in (None, "/") and nxt in (None, "/"):
                out.append("((?:[^/]*(?:/|$))*)")
                i += 1  # the "/" after "**" is part of the globstar
            else:
                out.append("([^/]*)")
            i += 1
        return re.compile("^" + "".join(out) + "$")

    matchers: list[tuple[str, list[re.Pattern[str]]]] = []
    completed: set[str] = set()
    for rule in all_rules:
        rtype = rule.get("type")
        if rtype not in kinds:
            raise ConfigError(f"module rule type {rtype!r} is not supported by this harness")
        if rtype in completed:
            continue
        if rule.get("fallthrough") is not True:
            completed.add(rtype)
        matchers.append((kinds[rtype], [glob_regex(g) for g in rule.get("globs", [])]))

    def kind_of(rel: str) -> str | None:
        for kind, regexes in matchers:
            if any(rx.match(rel) for rx in regexes):
                return kind
        return None

    return kind_of


def collect_modules(
    project_root: Path, main: str, python_modules_exclude: Iterable[str] | None = None,
    rules: Iterable[Mapping[str, Any]] | None = None, *, base_dir: str | None = None,
) -> list[Module]:
    """The modules wrangler would upload for a Python worker, main module first.

    The main module is named by its file name (wrangler: ``path.basename`` of the entry). Files
    under the module root (``base_dir`` relative to ``project_root`` when given, else the main
    module's folder) are matched against wrangler's module rules as
    wrangler 4 does (``parseRules`` / ``matchFiles``): the user's ``rules`` (``None``: the
    ``rules`` of ``project_root/wrangler.toml``), then the ``PythonModule`` rule ``**/*.py`` it
    adds for a ``.py`` main (unless the user gave one), then its defaults (``Text``:
    ``**/*.txt``, ``**/*.html``, ``**/*.sql``; ``Data``: ``**/*.bin``; ``CompiledWasm``:
    ``**/*.wasm``). A rule whose type an earlier rule without ``fallthrough = true`` already
    has is dropped (so an empty ``Text`` rule with ``fallthrough = false`` uploads no text
    modules); the first rule and glob matching the path relative to that folder (glob-to-regexp
    with globstar: ``*`` within one segment, ``**/`` any depth) gives the module's type."""
    kind_of = _module_kind(project_root, rules)
    main_path = (project_root / main).resolve()
    if main_path.suffix != ".py":
        raise ConfigError(f"main = {main!r} is not a Python module")
    if not main_path.is_file():
        raise ConfigError(f"main module {main_path} does not exist")
    module_root = (project_root / base_dir).resolve() if base_dir else main_path.parent
    if not module_root.is_dir():
        raise ConfigError(f"base_dir {module_root} is not a folder (has the [build] command run?)")
    python_modules_dir = project_root / "python_modules"
    if (module_root / "python_modules").exists() and module_root != project_root.resolve():
        raise ConfigError("python_modules/ must be at the project root, not in the module root")

    modules = [Module(main_path.name, "pythonModule", main_path.read_bytes())]
    skip = [project_root / ".wrangler", python_modules_dir, project_root / "node_modules",
            project_root / ".venv", project_root / ".git"]
    for path in _walk_files(module_root, skip_dirs=skip):
        if path.resolve() == main_path:
            continue
        rel = path.relative_to(module_root).as_posix()
        if path.name == "wrangler.toml" and path.parent == project_root:
            continue
        kind = kind_of(rel)
        if kind is None:
            continue
        modules.append(Module(rel, kind, path.read_bytes()))

    return modules + _vendored_modules(python_modules_dir, python_modules_exclude)


def _vendored_modules(python_modules_dir: Path, python_modules_exclude: Iterable[str] | None) -> list[Module]:
    """Every file of ``python_modules/`` but the excluded (``data``; the SDK's own JS files
    ``esModule``), as wrangler uploads them."""
    excludes = list(_DEFAULT_PYTHON_MODULES_EXCLUDE if python_modules_exclude is None
                    else python_modules_exclude)
    modules: list[Module] = []
    if python_modules_dir.is_dir():
        for path in _walk_files(python_modules_dir):
            rel = path.relative_to(python_modules_dir).as_posix()
            if any(_glob_match(rel, pattern) for pattern in excludes):
                continue
            kind = "data"
            if rel.startswith("workers/") and path.suffix in _VENDORED_JS_EXTENSIONS:
                kind = "esModule"
            modules.append(Module(f"python_modules/{rel}", kind, path.read_bytes()))
    return modules


def _sqlite_classes(migrations: list[dict[str, Any]]) -> tuple[set[str], set[str]]:
    """(all classes created by migrations, the SQLite-backed ones), following renames."""
    created: set[str] = set()
    sqlite: set[str] = set()
    for migration in migrations:
        for cls in migration.get("new_classes", []):
            created.add(cls)
        for cls in migration.get("new_sqlite_classes", []):
            created.add(cls)
            sqlite.add(cls)
        for rename in migration.get("renamed_classes", []):
            old, new = rename["from"], rename["to"]
            if old in created:
                created.discard(old)
                created.add(new)
            if old in sqlite:
                sqlite.discard(old)
                sqlite.add(new)
        for cls in migration.get("deleted_classes", []):
            created.discard(cls)
            sqlite.discard(cls)
    return created, sqlite


def _binding(name: str, value: Any) -> str:
    if isinstance(value, str):
        return f"(name = {_capnp_text(name)}, text = {_capnp_text(value)})"
    return f"(name = {_capnp_text(name)}, json = {_capnp_text(json.dumps(value))})"


def effective_compat(wrangler: Mapping[str, Any]) -> tuple[str, list[str]]:
    """Compatibility date and flags after SEMAPHORE_COMPAT_DATE / SEMAPHORE_COMPAT_FLAGS."""
    date = os.environ.get(ENV_COMPAT_DATE) or wrangler.get("compatibility_date")
    if not date:
        raise ConfigError("no compatibility_date in wrangler.toml (or SEMAPHORE_COMPAT_DATE)")
    flags = list(wrangler.get("compatibility_flags", []))
    for flag in os.environ.get(ENV_COMPAT_FLAGS, "").split(","):
        flag = flag.strip()
        if flag and flag not in flags:
            flags.append(flag)
    if "python_workers" not in flags:
        raise ConfigError("the python_workers compatibility flag is required for a Python main")
    return date, flags


def compat_date() -> str:
    """SEMAPHORE_COMPAT_DATE, else :data:`DEFAULT_COMPAT_DATE` (for configs written by hand)."""
    return os.environ.get(ENV_COMPAT_DATE) or DEFAULT_COMPAT_DATE


def extra_serve_args() -> list[str]:
    """The arguments SEMAPHORE_WORKERD_ARGS adds to ``workerd serve``."""
    return shlex.split(os.environ.get(ENV_WORKERD_ARGS, ""))


def uses_experimental_flag(config_path: str | os.PathLike[str]) -> bool:
    """Whether the config at ``config_path`` names a flag of :data:`EXPERIMENTAL_FLAGS`."""
    try:
        text = Path(config_path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return any(f'"{flag}"' in text for flag in EXPERIMENTAL_FLAGS)


def _bindings(wrangler: Mapping[str, Any], name: str, vars_override: Mapping[str, Any] | None,
              secrets: Mapping[str, str] | None) -> tuple[list[str], list[str]]:
    """The worker's bindings (vars, secrets, Durable Object namespaces) and its
    ``durableObjectNamespaces`` entries, as Cap'n Proto text."""
    bindings: list[str] = []
    all_vars: dict[str, Any] = dict(wrangler.get("vars", {}))
    all_vars.update(vars_override or {})
    for key, value in all_vars.items():
        bindings.append(_binding(key, value))
    for key, value in (secrets or {}).items():
        bindings.append(_binding(key, str(value)))

    created, sqlite = _sqlite_classes(wrangler.get("migrations", []))
    namespaces: list[str] = []
    seen_classes: set[str] = set()
    for do in wrangler.get("durable_objects", {}).get("bindings", []):
        if do.get("script_name"):
            raise ConfigError(f"durable object binding {do['name']} names another script")
        cls = do["class_name"]
        bindings.append(
            f"(name = {_capnp_text(do['name'])}, durableObjectNamespace = "
            f"(className = {_capnp_text(cls)}))"
        )
        if cls in seen_classes:
            continue
        seen_classes.add(cls)
        namespaces.append(
            f"(className = {_capnp_text(cls)}, uniqueKey = {_capnp_text(f'{name}-{cls}')}, "
            f"enableSql = {'true' if cls in sqlite else 'false'})"
        )
    unmigrated = seen_classes - created
    if wrangler.get("migrations") and unmigrated:
        raise ConfigError(f"durable object classes without a migration: {sorted(unmigrated)}")

    return bindings, namespaces


def _render_config(toml_path: Path, modules: list[Module], date: str, flags: Iterable[str], bindings: list[str],
                   namespaces: list[str], storage: Path, address: str, port: int) -> str:
    """The text of ``workerd.capnp``: the worker service, its storage service, the socket."""
    nl = ",\n      "
    worker = [
        "modules = [\n      " + nl.join(m.render() for m in modules) + "\n    ]",
        f"compatibilityDate = {_capnp_text(date)}",
        "compatibilityFlags = [" + ", ".join(_capnp_text(f) for f in flags) + "]",
        "bindings = [\n      " + nl.join(bindings) + "\n    ]",
    ]
    if namespaces:
        worker.append("durableObjectNamespaces = [\n      " + nl.join(namespaces) + "\n    ]")
        worker.append(f"durableObjectStorage = (localDisk = {_capnp_text(STORAGE_SERVICE)})")

    services = [
        f"(name = {_capnp_text(WORKER_SERVICE)}, worker = (\n    " + ",\n    ".join(worker)
        + "\n  ))",
    ]
    if namespaces:
        services.append(
            f"(name = {_capnp_text(STORAGE_SERVICE)}, disk = (path = {_capnp_text(str(storage))},"
            " writable = true))"
        )

    text = (
        "# Generated from " + str(toml_path) + " by semaphore.testing.workerd. Do not edit.\n"
        'using Workerd = import "/workerd/workerd.capnp";\n\n'
        "const config :Workerd.Config = (\n"
        "  services = [\n  " + ",\n  ".join(services) + "\n  ],\n"
        f"  sockets = [(name = {_capnp_text(SOCKET_NAME)}, "
        f"address = {_capnp_text(f'{address}:{int(port)}')}, http = (), "
        f"service = {_capnp_text(WORKER_SERVICE)})]\n"
        ");\n"
    )
    return text


def _run_custom_build(wrangler: Mapping[str, Any], project_root: Path) -> None:
    """Run ``[build] command`` as wrangler's ``runCustomBuild`` does before ``dev``, ``deploy``
    and ``versions upload``: through the shell, with ``WRANGLER_COMMAND=dev`` in the
    environment, in ``[build] cwd`` (relative to ``project_root``) or else ``project_root``
    (wrangler uses its own working directory: the project root when run from there). A failing
    command raises :class:`ConfigError` with its output."""
    build = wrangler.get("build")
    if not isinstance(build, dict) or not build.get("command"):
        return
    command = str(build["command"])
    cwd = project_root / str(build["cwd"]) if build.get("cwd") else project_root
    proc = subprocess.run(command, shell=True, cwd=cwd, env={**os.environ, "WRANGLER_COMMAND": "dev"},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ConfigError(f"[build] command {command!r} failed ({proc.returncode}) in {cwd}:\n"
                          f"{proc.stdout}{proc.stderr}")


def generate_config(
    wrangler_toml_path: str | os.PathLike[str] = DEFAULT_WRANGLER_TOML,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    storage_dir: str | os.PathLike[str],
    port: int = 0,
    vars_override: Mapping[str, Any] | None = None,
    secrets: Mapping[str, str] | None = None,
    address: str = "127.0.0.1",
) -> Path:
    """Write ``workerd.capnp`` for the worker described by ``wrangler.toml``; return its path.

    ``port`` 0 lets the kernel choose (read it back with :class:`WorkerdProcess`, which asks
    workerd through ``--control-fd``). ``vars_override`` replaces or adds ``[vars]`` entries;
    ``secrets`` are added as text bindings (what ``.dev.vars`` does under ``wrangler dev``).
    The config constant is named ``config``. A ``[build] command`` runs first, as wrangler
    runs it before ``dev`` and ``deploy`` (:func:`_run_custom_build`), and ``base_dir`` is the
    module root, as for wrangler.
    """
    toml_path = Path(wrangler_toml_path).resolve()
    project_root = toml_path.parent
    with toml_path.open("rb") as fh:
        wrangler = tomllib.load(fh)

    main = wrangler.get("main")
    if not main:
        raise ConfigError("wrangler.toml has no main")
    if wrangler.get("find_additional_modules") is False:
        raise ConfigError("find_additional_modules = false is not supported by this harness")
    name = wrangler.get("name") or "worker"
    date, flags = effective_compat(wrangler)
    _run_custom_build(wrangler, project_root)

    python_modules_exclude = None
    if isinstance(wrangler.get("python_modules"), dict) and "exclude" in wrangler["python_modules"]:
        python_modules_exclude = wrangler["python_modules"]["exclude"]
    # The module rules of THIS file (none: wrangler's defaults), not of a wrangler.toml beside it.
    modules = collect_modules(project_root, main, python_modules_exclude, rules=wrangler.get("rules") or [],
                              base_dir=wrangler.get("base_dir"))

    bindings, namespaces = _bindings(wrangler, name, vars_override, secrets)
    storage = Path(storage_dir).resolve()
    storage.mkdir(parents=True, exist_ok=True)

    text = _render_config(toml_path, modules, date, flags, bindings, namespaces, storage, address, port)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="workerd-cfg-"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "workerd.capnp"
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# Locating workerd and the Pyodide cache
# ---------------------------------------------------------------------------------------------


def workerd_binary() -> Path | None:
    """SEMAPHORE_WORKERD, else the project's npm-pinned ``workerd`` (None if neither exists)."""
    override = os.environ.get(ENV_WORKERD)
    if override:
        return Path(override)
    for candidate in (
        PROJECT_ROOT / "node_modules" / "workerd" / "bin" / "workerd",
        PROJECT_ROOT / "node_modules" / ".bin" / "workerd",
    ):
        if candidate.exists():
            return candidate
    return None


def pyodide_bundle_cache_dir() -> Path | None:
    value = os.environ.get(ENV_PYODIDE_CACHE)
    return Path(value).resolve() if value else None


def pyodide_package_cache_dir() -> Path | None:
    value = os.environ.get(ENV_PYODIDE_PACKAGE_CACHE)
    return Path(value).resolve() if value else None


# ---------------------------------------------------------------------------------------------
# Reading workerd's startup failures
# ---------------------------------------------------------------------------------------------
#
# Seen with workerd 1.20261117.1 (the version wrangler 4.164.0 pins), no network, no cache file:
#
#   *** Uncaught exception ***
#   workerd/server/server/bridge.rs:843: failed: Request for Pyodide bundle failed; url =
#   https://pyodide-capnp-bin.edgeworker.net/pyodide_314.0.6_2026-08-17_11.capnp.bin;
#   failed to lookup address information: Name or service not known
#
# (one line; exit status 1; nothing listens). With a wrong file of that name in the
# --pyodide-bundle-disk-cache-dir:
#
#   ...: failed: Pyodide bundle integrity check failed: the bundle does not match the expected
#   checksum.; version = 314.0.6_2026-08-17_11; expectedIntegrity = sha256-...; actualIntegrity = ...
#
# Older builds (C++ server, src/workerd/server/pyodide.c++) raise the same
# "Request for Pyodide bundle failed" text from a KJ_ASSERT on the HTTP status.

BUNDLE_FETCH_FAILED = "Request for Pyodide bundle failed"
BUNDLE_INTEGRITY_FAILED = "Pyodide bundle integrity check failed"
_BUNDLE_URL_RE = re.compile(r"url = (\S*?/(pyodide_[^/;\s]+\.capnp\.bin))")
_BUNDLE_VERSION_RE = re.compile(r"version = ([^;\s]+)")
_BENIGN_LINE_RE = re.compile(r"^\s*$|^\*\*\* Uncaught exception \*\*\*$|: info: ")


class WorkerdError(RuntimeError):
    """workerd did not come up. ``output`` is everything it printed."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


class PyodideBundleUnavailable(WorkerdError):
    """workerd could not obtain the Pyodide bundle, and said so (and nothing else went wrong).

    ``reason`` is a one-paragraph skip reason quoting workerd; ``file_name`` is the file workerd
    looks for in ``--pyodide-bundle-disk-cache-dir``.
    """

    def __init__(self, reason: str, output: str, file_name: str | None, url: str | None) -> None:
        super().__init__(reason, output)
        self.reason = reason
        self.file_name = file_name
        self.url = url


class PyodideBundleInvalid(WorkerdError):
    """A bundle file was found in the cache dir but failed workerd's checksum."""


class WorkerdStartError(WorkerdError):
    """Any other start-up failure: a config error, a crash, a time-out."""


def _error_lines(output: str, *, ignore: str) -> list[str]:
    lines = []
    for line in output.splitlines():
        if _BENIGN_LINE_RE.search(line) or ignore in line:
            continue
        lines.append(line)
    return lines


def classify_startup_failure(output: str, *, cache_dir: Path | None = None) -> WorkerdError:
    """Turn what a workerd that exited during start-up printed into the matching exception.

    Only workerd's own words decide: the bundle case needs its "Request for Pyodide bundle
    failed" line AND no other error line (a config error printed beside it wins, so a broken
    config is never skipped as "no bundle").
    """
    if BUNDLE_FETCH_FAILED in output:
        others = _error_lines(output, ignore=BUNDLE_FETCH_FAILED)
        fetch_line = next(line for line in output.splitlines() if BUNDLE_FETCH_FAILED in line)
        if others:
            return WorkerdStartError(
                "workerd reported errors besides the missing Pyodide bundle:\n"
                + "\n".join(others), output)
        match = _BUNDLE_URL_RE.search(fetch_line)
        url, file_name = (match.group(1), match.group(2)) if match else (None, None)
        detail = fetch_line.split(f"failed: {BUNDLE_FETCH_FAILED}", 1)[-1].strip("; ")
        where = (f"no {file_name} in {ENV_PYODIDE_CACHE}={cache_dir}" if cache_dir
                 else f"{ENV_PYODIDE_CACHE} is not set")
        reason = (
            f"workerd could not get the Pyodide bundle ({where}): "
            f"{BUNDLE_FETCH_FAILED}; {detail}. Put {file_name or 'the bundle file'} in a folder "
            f"and set {ENV_PYODIDE_CACHE} to it, or run where that URL is reachable."
        )
        return PyodideBundleUnavailable(reason, output, file_name, url)
    if BUNDLE_INTEGRITY_FAILED in output:
        line = next(line for line in output.splitlines() if BUNDLE_INTEGRITY_FAILED in line)
        version = _BUNDLE_VERSION_RE.search(line)
        name = f"pyodide_{version.group(1)}.capnp.bin" if version else "the bundle file"
        return PyodideBundleInvalid(
            f"the Pyodide bundle in {cache_dir} is not the one workerd expects "
            f"(delete or replace {name}): {line.split('failed: ', 1)[-1]}", output)
    lines = _error_lines(output, ignore="\0")
    return WorkerdStartError("workerd failed to start:\n" + "\n".join(lines[-40:]), output)


# ---------------------------------------------------------------------------------------------
# Running workerd
# ---------------------------------------------------------------------------------------------


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


class WorkerdProcess:
    """One ``workerd serve`` of a generated config, restartable on the same storage.

    ``start()`` returns once workerd reports (through ``--control-fd``) that the socket listens,
    or raises :class:`PyodideBundleUnavailable`, :class:`PyodideBundleInvalid` or
    :class:`WorkerdStartError`. After the first start the port is kept: ``restart()`` and later
    ``start()`` calls bind the same one (``--socket-addr``). ``logs`` holds everything every run
    printed; ``run_logs`` the current (or last) run only.
    """

    def __init__(
        self,
        config_path: str | os.PathLike[str],
        *,
        binary: str | os.PathLike[str] | None = None,
        pyodide_cache: str | os.PathLike[str] | None = None,
        pyodide_package_cache: str | os.PathLike[str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        start_timeout: float = 120.0,
        extra_args: Iterable[str] = (),
        address: str = "127.0.0.1",
    ) -> None:
        self.config_path = Path(config_path)
        found = Path(binary) if binary else workerd_binary()
        if found is None:
            raise FileNotFoundError(
                "no workerd binary: run scripts/setup (npm-pinned workerd) or set "
                f"{ENV_WORKERD}")
        self.binary = found
        self.pyodide_cache = (Path(pyodide_cache) if pyodide_cache is not None
                              else pyodide_bundle_cache_dir())
        self.pyodide_package_cache = (Path(pyodide_package_cache)
                                      if pyodide_package_cache is not None
                                      else pyodide_package_cache_dir())
        self.log_dir = Path(log_dir) if log_dir else self.config_path.parent
        self.start_timeout = start_timeout
        self.extra_args = list(extra_args) + extra_serve_args()
        self.address = address
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0
        self._log_path: Path | None = None
        self._log_parts: list[str] = []

    # -- introspection ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("workerd has not started")
        return f"http://{self.address}:{self.port}"

    @property
    def run_logs(self) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        return self._log_path.read_text(encoding="utf-8", errors="replace")

    @property
    def logs(self) -> str:
        return "".join(self._log_parts) + self.run_logs

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self, control_fd: int | None = None) -> list[str]:
        cmd = [str(self.binary), "serve", str(self.config_path), "config"]
        if control_fd is not None:
            cmd.append(f"--control-fd={control_fd}")
        if self.port is not None:
            cmd.append(f"--socket-addr={SOCKET_NAME}={self.address}:{self.port}")
        if self.pyodide_cache is not None:
            self.pyodide_cache.mkdir(parents=True, exist_ok=True)
            cmd.append(f"--pyodide-bundle-disk-cache-dir={self.pyodide_cache}")
        if self.pyodide_package_cache is not None:
            self.pyodide_package_cache.mkdir(parents=True, exist_ok=True)
            cmd.append(f"--pyodide-package-disk-cache-dir={self.pyodide_package_cache}")
        if "--experimental" not in self.extra_args and uses_experimental_flag(self.config_path):
            cmd.append("--experimental")
        cmd.extend(self.extra_args)
        return cmd

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> WorkerdProcess:
        if self.running():
            raise RuntimeError("workerd is already running")
        if self._log_path is not None:
            self._log_parts.append(self.run_logs)
        self.runs += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log_path = self.log_dir / f"workerd-run{self.runs}.log"
        read_fd, write_fd = os.pipe()
        try:
            with self._log_path.open("wb") as log:
                self.proc = subprocess.Popen(
                    self.command(write_fd),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(write_fd,),
                    start_new_session=True,  # our own process group, for stop()/kill()
                )
        finally:
            os.close(write_fd)
        port = self._wait_listening(read_fd)
        if port is None:
            self._reap()
            raise classify_startup_failure(self.run_logs, cache_dir=self.pyodide_cache)
        self.port = port
        return self

    def _wait_listening(self, read_fd: int) -> int | None:
        """Port from workerd's control messages; None when workerd exits or times out."""
        assert self.proc is not None
        result: dict[str, int] = {}
        done = threading.Event()

        def reader() -> None:
            buf = b""
            with os.fdopen(read_fd, "rb", buffering=0) as pipe:
                while True:
                    chunk = pipe.read(4096)
                    if not chunk:
                        break
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        try:
                            msg = json.loads(line)
                        except ValueError:
                            continue
                        if msg.get("event") == "listen" and msg.get("socket") == SOCKET_NAME:
                            result["port"] = int(msg["port"])
                            done.set()
            done.set()  # workerd closed the pipe: it exited

        threading.Thread(target=reader, name="workerd-control", daemon=True).start()
        deadline = time.monotonic() + self.start_timeout
        while not done.wait(0.05):
            if self.proc.poll() is not None:
                done.wait(1.0)  # let the reader drain
                break
            if time.monotonic() > deadline:
                self._signal(signal.SIGKILL)
                self.proc.wait()
                raise WorkerdStartError(
                    f"workerd did not listen within {self.start_timeout:.0f}s:\n"
                    + self.run_logs[-4000:], self.run_logs)
        return result.get("port")

    def _signal(self, sig: int) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # the group start_new_session made for this child
        except ProcessLookupError:
            pass

    def _reap(self, timeout: float = 10.0) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            return self.proc.wait()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (graceful), then SIGKILL after ``timeout``. Returns the exit status."""
        self._signal(signal.SIGTERM)
        return self._reap(timeout)

    def kill(self) -> int | None:
        """``kill -9``: no chance to flush or clean up, like a crashed host."""
        self._signal(signal.SIGKILL)
        return self._reap()

    def restart(self, *, hard: bool = False) -> WorkerdProcess:
        """Stop (or ``kill -9`` with ``hard``) and start again on the same storage and port."""
        if hard:
            self.kill()
        else:
            self.stop()
        return self.start()

    def __enter__(self) -> WorkerdProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- HTTP ------------------------------------------------------------------------------

    def request(self, path: str, *, method: str = "GET", body: bytes | None = None,
                headers: Mapping[str, str] | None = None, timeout: float = 30.0
                ) -> tuple[int, bytes]:
        """(status, body) of one request to the worker; HTTP errors are returned, not raised."""
        import urllib.error
        import urllib.request

        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers=dict(headers or {}))
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()


def validate_config(config_path: str | os.PathLike[str],
                    binary: str | os.PathLike[str] | None = None) -> None:
    """Schema check without running anything: ``workerd compile --config-only``.

    Catches unknown fields, wrong types and bad literals (it needs no Pyodide bundle); references
    between services are only checked by ``serve``. Raises :class:`WorkerdStartError`.
    """
    found = Path(binary) if binary else workerd_binary()
    if found is None:
        raise FileNotFoundError(f"no workerd binary: run scripts/setup or set {ENV_WORKERD}")
    proc = subprocess.run(
        [str(found), "compile", "--config-only", str(config_path), "config"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=120,
    )
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace")
        raise WorkerdStartError(f"workerd rejected {config_path}:\n{err}", err)


# ---------------------------------------------------------------------------------------------
# Command line (used by scripts/dev --workerd)
# ---------------------------------------------------------------------------------------------


def _main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("generate", "serve"):
        p = sub.add_parser(name)
        p.add_argument("--wrangler-toml", default=str(DEFAULT_WRANGLER_TOML))
        p.add_argument("--out-dir", default=str(PROJECT_ROOT / ".tmp" / "workerd"))
        p.add_argument("--storage-dir", default=str(PROJECT_ROOT / ".tmp" / "workerd" / "storage"))
        p.add_argument("--port", type=int, default=8787)
        p.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                       help="override a [vars] entry (text)")
    args = parser.parse_args(argv)
    overrides = dict(v.split("=", 1) for v in args.var)
    try:
        config = generate_config(args.wrangler_toml, args.out_dir, storage_dir=args.storage_dir,
                                 port=args.port, vars_override=overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.cmd == "generate":
        print(config)
        return 0
    proc = WorkerdProcess(config, log_dir=args.out_dir)
    try:
        proc.start()
    except PyodideBundleUnavailable as err:
        print(f"\n{err.output.strip()}\n", file=sys.stderr)
        print("The Pyodide bundle is missing. workerd needs "
              f"{err.file_name or 'pyodide_<version>.capnp.bin'}"
              + (f" (from {err.url})" if err.url else "")
              + f". Put that file in a folder and run again with {ENV_PYODIDE_CACHE}=<folder>"
              " (passed as --pyodide-bundle-disk-cache-dir), or run where that URL is reachable"
              " (workerd then saves it into that folder).", file=sys.stderr)
        return 3
    except WorkerdError as err:
        print(str(err), file=sys.stderr)
        return 1
    print(f"workerd serving {args.wrangler_toml} on {proc.url} (config {config}); Ctrl-C stops",
          file=sys.stderr)
    try:
        with open(proc._log_path or os.devnull, "rb") as log:  # follow workerd's output
            while proc.running():
                chunk = log.read()
                if chunk:
                    sys.stderr.buffer.write(chunk)
                    sys.stderr.flush()
                else:
                    time.sleep(0.2)
            sys.stderr.buffer.write(log.read())
    except KeyboardInterrupt:
        pass
    finally:
        status = proc.stop()
    return 0 if status in (0, None, -signal.SIGTERM) else 1

