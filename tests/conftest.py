"""Tier-1 test configuration: makes ``tests/helpers.py`` importable (``from helpers import Bed``)
and offers a few fixtures over it. See ``helpers.py`` for the test bed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from helpers import check_aggregates, dump, run  # noqa: E402

__all__ = ["run", "dump", "check_aggregates"]


@pytest.fixture
def aggregates_checker():
    """The :func:`helpers.check_aggregates` function (for tests that prefer a fixture)."""
    return check_aggregates
