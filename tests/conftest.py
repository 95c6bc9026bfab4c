"""Tier-1 test configuration: makes the modules of ``tests/`` importable by name (``from sim
import ...``). The test bed itself is the shipped kit, :mod:`semaphore.testing`."""

from __future__ import annotations

import ast
import gc
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

_parse = ast.parse


def _parse_without_collection(*args: Any, **kwargs: Any) -> Any:
    """``ast.parse`` with the cyclic collector off while it builds the tree. CPython 3.11's AST
    constructor keeps its recursion depth in module state: a finalizer that runs inside it (an
    asyncio task of an earlier test, collected and logging "exception was never retrieved") formats a
    traceback, whose caret anchors call ``ast.parse`` again, and the outer call fails with
    ``SystemError: AST constructor recursion depth mismatch``. The suite's code-reading tests parse
    hundreds of files, so a stray task of any earlier test could fail one of them."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _parse(*args, **kwargs)
    finally:
        if enabled:
            gc.enable()


ast.parse = _parse_without_collection


@pytest.fixture
def quiet_logs() -> Iterator[None]:
    """Silence logging for a test that injects failures on purpose (use with
    ``pytestmark = pytest.mark.usefixtures("quiet_logs")``)."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)
