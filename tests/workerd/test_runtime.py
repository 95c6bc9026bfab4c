"""Tier 3: the project's worker (wrangler.toml, src/, python_modules/) in the real workerd.

Skips here when workerd cannot get the Pyodide bundle (its own "Request for Pyodide bundle
failed" error); set SEMAPHORE_PYODIDE_CACHE to a folder holding pyodide_<version>.capnp.bin to
run it offline.
"""

import pytest

pytestmark = pytest.mark.workerd


def test_healthz(workerd):
    status, body = workerd.request("/healthz")
    assert status == 200, body
    assert body, "empty /healthz body"
