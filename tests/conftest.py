"""Tier-1 test configuration: makes the modules of ``tests/`` importable by name (``from sim
import ...``). The test bed itself is the shipped kit, :mod:`semaphore.testing`."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
