"""Fixtures for tier 3 (real workerd).

The tier skips as a whole only when workerd itself says it could not get the Pyodide bundle
(``PyodideBundleUnavailable``, detected from workerd's own "Request for Pyodide bundle failed"
line), or when ``scripts/test`` says why it could not build the development bundle
(``SEMAPHORE_WORKERD_SKIP``, the builder's own one-line reason). Anything else that stops workerd (a config error, a bad bundle file in the cache, a crash)
fails the tests, with workerd's output in the message.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from semaphore.testing.workerd import (
    DEFAULT_WRANGLER_TOML,
    ENV_WORKERD,
    ENV_WORKERD_SKIP,
    PyodideBundleUnavailable,
    WorkerdError,
    WorkerdProcess,
    generate_config,
    workerd_binary,
)


@pytest.fixture(scope="session")
def workerd_bin() -> Path:
    found = workerd_binary()
    if found is None or not found.exists():
        pytest.fail(f"no workerd binary: run scripts/setup, or set {ENV_WORKERD}")
    return found


@pytest.fixture(scope="session")
def project_wrangler_toml() -> Path:
    if not DEFAULT_WRANGLER_TOML.exists():
        pytest.skip(f"{DEFAULT_WRANGLER_TOML} does not exist")
    main = tomllib.loads(DEFAULT_WRANGLER_TOML.read_text()).get("main", "")
    if main and not (DEFAULT_WRANGLER_TOML.parent / main).exists():
        pytest.skip(f"the worker's main module {main} does not exist")
    return DEFAULT_WRANGLER_TOML


@pytest.fixture(scope="session")
def workerd_runtime(workerd_bin: Path, project_wrangler_toml: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Start the project's worker once to learn whether this machine can run it at all.

    Returns ``{"skip": reason}`` when workerd could not get the Pyodide bundle, else
    ``{"skip": None}``. Other start-up failures raise (and so fail every test that needs it).
    """
    if os.environ.get(ENV_WORKERD_SKIP):
        return {"skip": os.environ[ENV_WORKERD_SKIP]}
    base = tmp_path_factory.mktemp("workerd-probe")
    config = generate_config(project_wrangler_toml, base / "config",
                             storage_dir=base / "storage", port=0)
    proc = WorkerdProcess(config, binary=workerd_bin, log_dir=base / "logs")
    try:
        proc.start()
    except PyodideBundleUnavailable as err:
        return {"skip": err.reason}
    except WorkerdError as err:
        pytest.fail(f"{err}\n--- workerd output ---\n{err.output}", pytrace=False)
    finally:
        proc.stop()
    return {"skip": None}


@pytest.fixture
def workerd_factory(workerd_runtime: dict[str, Any], workerd_bin: Path,
                    project_wrangler_toml: Path, tmp_path: Path
                    ) -> Iterator[Callable[..., WorkerdProcess]]:
    """``make(vars_override=None, storage_dir=None, start=True, secrets=None)`` -> a
    WorkerdProcess of the project's config (fresh storage in tmp_path unless given; ``secrets``
    become text bindings, as ``.dev.vars`` under ``wrangler dev``). All are stopped at
    teardown."""
    if workerd_runtime["skip"]:
        pytest.skip(workerd_runtime["skip"])
    made: list[WorkerdProcess] = []

    def make(vars_override: dict[str, Any] | None = None, storage_dir: os.PathLike[str] | None = None,
             start: bool = True, secrets: dict[str, str] | None = None) -> WorkerdProcess:
        n = len(made)
        config = generate_config(project_wrangler_toml, tmp_path / f"config{n}",
                                 storage_dir=storage_dir or tmp_path / f"storage{n}", port=0,
                                 vars_override=vars_override, secrets=secrets)
        proc = WorkerdProcess(config, binary=workerd_bin, log_dir=tmp_path / f"logs{n}")
        made.append(proc)
        if start:
            try:
                proc.start()
            except WorkerdError as err:
                pytest.fail(f"{err}\n--- workerd output ---\n{err.output}", pytrace=False)
        return proc

    yield make
    for proc in made:
        proc.stop()


@pytest.fixture
def workerd(workerd_factory: Callable[..., WorkerdProcess]) -> WorkerdProcess:
    """The project's worker running in workerd on fresh storage."""
    return workerd_factory()
