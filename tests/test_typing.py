"""Static typing guards (architecture issue): ``mypy --strict`` accepts the library, and code
using its public API as the README does type-checks under ``--strict`` too.

Runs mypy in a subprocess of this interpreter (``sys.executable -m mypy``, pinned in
pyproject's dev dependencies) against ``src/`` directly (``MYPYPATH``), with a cache shared by
the tests of this module (a cold run takes a few seconds)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

needs_mypy = pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None,
    reason="mypy is not importable in this interpreter (install the dev dependencies: pip install -e '.[dev]')",
)


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mypy_cache")


def run_mypy(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MYPYPATH=str(SRC))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(cache), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )


@needs_mypy
def test_library_is_mypy_strict_clean(mypy_cache: Path) -> None:
    """``mypy --strict src/semaphore`` finds nothing (exit 0)."""
    result = run_mypy(mypy_cache, "src/semaphore")
    assert result.returncode == 0, f"mypy --strict src/semaphore failed:\n{result.stdout}{result.stderr}"


@needs_mypy
def test_r36_client_helper_type_checks_as_the_readme_uses_it(mypy_cache: Path, tmp_path: Path) -> None:
    """R36: ``DurabilitySemaphore.client(...)`` is declared on the class (not attached from
    another module), so a type checker sees it and its ``SemaphoreRpc`` (``with_``,
    ``transport``, ``request``)."""
    snippet = tmp_path / "uses_client_helper.py"
    snippet.write_text(textwrap.dedent('''
        from typing import Any

        from semaphore import DurabilitySemaphore, SemaphoreRpc, retry, timeout
        from semaphore.client._client import Transport
        from semaphore.rpc import Call


        limits: SemaphoreRpc = DurabilitySemaphore.client(
            binding="X", invoke=lambda stub, message: stub.permits(message))
        by_name = DurabilitySemaphore.client(binding="X", invoke="permits")
        bounded: SemaphoreRpc = limits.with_(timeout(5_000)).with_(retry(3, backoff_ms=100))
        both = by_name.with_(timeout(5_000), retry(3))


        def transport(env: Any) -> Transport:
            return bounded.transport(env)


        def call(env: Any) -> Call:
            return both.call(env)


        async def ask(env: Any, key: str) -> dict[str, Any]:
            return await limits.with_(timeout(5_000)).request(env, key, {"v": 1, "type": "sync"})
    '''))
    # Only the snippet's own errors: the library's are test_library_is_mypy_strict_clean's.
    result = run_mypy(mypy_cache, "--follow-imports=silent", str(snippet))
    assert result.returncode == 0, f"mypy --strict on the README's use of the client helper failed:\n{result.stdout}{result.stderr}"


def test_r36_client_helper_is_declared_on_the_class_with_rpc_clients_signature() -> None:
    """R36: ``DurabilitySemaphore.client`` is a staticmethod of the class itself (the holder
    module alone provides it), delegating to :func:`semaphore.rpc.client`: same signature, same
    documentation, same helper."""
    import inspect

    from semaphore import rpc
    from semaphore.holder._semaphore import DurabilitySemaphore

    assert isinstance(inspect.getattr_static(DurabilitySemaphore, "client"), staticmethod)
    assert "client" in vars(DurabilitySemaphore)
    assert inspect.signature(DurabilitySemaphore.client) == inspect.signature(rpc.client)
    assert inspect.getdoc(DurabilitySemaphore.client) == inspect.getdoc(rpc.client)
    helper = DurabilitySemaphore.client(binding="X", invoke="permits")
    assert helper == rpc.client(binding="X", invoke="permits")
    assert isinstance(helper, rpc.SemaphoreRpc)
