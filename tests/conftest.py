"""Tier-1 test configuration: makes the modules of ``tests/`` importable by name (``from sim
import ...``). The test bed itself is the shipped kit, :mod:`semaphore.testing`."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def quiet_logs() -> Iterator[None]:
    """Silence logging for a test that injects failures on purpose (use with
    ``pytestmark = pytest.mark.usefixtures("quiet_logs")``)."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)
