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


@needs_mypy
def test_permit_queue_and_usage_api_type_check_as_the_readme_uses_them(mypy_cache: Path, tmp_path: Path) -> None:
    """Issue 10: the three-line permit call, the queue with ``work=``, the item view, the typed
    usage and the permit timeout type-check under ``--strict`` from the public package alone."""
    snippet = tmp_path / "uses_permits.py"
    snippet.write_text(textwrap.dedent('''
        from typing import Any

        from semaphore import (Blocked, BlockedReason, DurabilityScheduler, DurabilitySemaphore, PermitTimeoutError,
                               QueueItem, SemaphoreClient, SemaphoreQueue, SemaphoreUsage, Transport, timeout)

        limits = DurabilitySemaphore.client(binding="LIMIT", invoke=lambda stub, message: stub.permits(message))


        class Jobs:
            def __init__(self, ctx: Any, env: Any) -> None:
                transport: Transport = limits.with_(timeout(5_000)).transport(env)
                # one queue per object: it serves permit() and the work= items
                self.queue = SemaphoreQueue(client=SemaphoreClient(ctx, transport), scheduler=DurabilityScheduler(ctx),
                                            work=self.run, work_attempts=2, admit_concurrency=8)

            async def run(self, item: QueueItem) -> None:
                print(item.item_id, item.payload)

            async def export(self, account: str) -> str | None:
                try:
                    async with self.queue.permit(account, group="exports", timeout_ms=30_000) as item:
                        return item.item_id
                except PermitTimeoutError as err:
                    why: Blocked | None = err.blocked
                    return None if why is None else why.reason.value

            def why_waiting(self, item_id: str) -> BlockedReason | None:
                item = self.queue.item(item_id)
                return None if item is None or item.blocked is None else item.blocked.reason


        async def available(sem: DurabilitySemaphore) -> int | None:
            usage = SemaphoreUsage.from_wire(await sem.usage())
            return usage.available
    '''))
    result = run_mypy(mypy_cache, "--follow-imports=silent", str(snippet))
    assert result.returncode == 0, f"mypy --strict on the permit API failed:\n{result.stdout}{result.stderr}"
