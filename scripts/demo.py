#!/usr/bin/env python3
"""The what-if simulator's default scenario: ``python -m semaphore.simulate`` with the arguments
given (see ``--help``). Prints the summary and writes simulation.csv and simulation.png into
``--out`` (default: the current folder).

    scripts/demo                                  # the default scenario
    scripts/demo --leases strict --out /tmp/sim   # the same traffic with strict leases
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from semaphore.simulate.__main__ import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
