#!/usr/bin/env python3
"""Wire traffic of seeded runs, one digest per seed: to show that a refactoring of the client
changes no message (issue 20: identical traffic old vs new over at least 60 seeds).

Per seed it runs

* ``faults/<config>``: the seeded fault simulation (:mod:`semaphore.simulate.faults`) in the
  four configurations of its test (grants only with a group limit; strict, under and over
  leases), and
* ``soak/<mode>``: the soak (:mod:`semaphore.simulate.soak`) with ``ops`` holder messages, its
  client-side storage faults off (``fail_transaction`` of a client's storage: where a fault
  lands depends on how many statements and transactions the client runs, which a refactoring
  may change without changing behaviour; the holder's stay on),

and prints one line per run: ``<run> <seed> <sha256 of every message the clients sent, in order,
and the holder's final rows>``. ``--compare FILE`` reruns what FILE lists and reports how many
digests are identical (exit status 1 if any differs). ``--stores memory`` runs the client objects
over the in-memory twins of their stores (:class:`semaphore.testing.MemoryStores`) instead of
SQLite: compared with a run over SQL, it shows that each store answers as its twin does.

    .venv/bin/python scripts/traffic_digest.py --seeds 60 > .tmp/traffic-baseline.txt
    .venv/bin/python scripts/traffic_digest.py --compare .tmp/traffic-baseline.txt
    .venv/bin/python scripts/traffic_digest.py --compare .tmp/traffic-baseline.txt --stores memory
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import logging
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from semaphore.simulate.faults import FAULT_CONFIGS, Sim  # noqa: E402
from semaphore.simulate.soak import SoakConfig, SoakSim  # noqa: E402
from semaphore.testing import dump  # noqa: E402

SOAK_MODES = ("none", "strict", "held", "reuse", "reuse-held")


def _digest(sent: list[dict[str, Any]], holder_rows: Any) -> str:
    text = json.dumps({"sent": sent, "holder": holder_rows}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


async def _faults(config: str, seed: int, stores: str) -> str:
    sim = Sim(dataclasses.replace(FAULT_CONFIGS[config](seed), client_stores=stores))
    await sim.run()
    await sim.final_checks()
    for side in sim.sides:
        side.driver.kill()
    return _digest(sim.net.sent, dump(sim.holder.storage))


async def _soak(mode: str, seed: int, ops: int, stores: str) -> str:
    sim = SoakSim(SoakConfig.for_mode(seed, mode, ops=ops, client_stores=stores, client_tx_faults=False))
    try:
        await sim.run()
        await sim.finish()
    except Exception as exc:  # noqa: BLE001 - a crash is part of the run's outcome
        sim.net.sent.append({"crash": f"{type(exc).__name__}: {exc}"})
    for side in sim.sides:
        side.driver.kill()
    return _digest(sim.net.sent, dump(sim.holder.storage))


def digest(run: str, seed: int, ops: int, stores: str = "sql") -> str:
    """The digest of one run (``faults/<config>`` or ``soak/<mode>``) and seed, its client
    objects over ``stores`` (``"sql"`` or ``"memory"``)."""
    kind, name = run.split("/", 1)
    if kind == "faults":
        return asyncio.run(_faults(name, seed, stores))
    return asyncio.run(_soak(name, seed, ops, stores))


def runs(seeds: int) -> Iterable[tuple[str, int]]:
    for config in FAULT_CONFIGS:
        for seed in range(seeds):
            yield f"faults/{config}", seed
    for mode in SOAK_MODES:
        for seed in range(seeds):
            yield f"soak/{mode}", seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=60)
    parser.add_argument("--ops", type=int, default=200, help="holder messages of a soak run's faulty phase")
    parser.add_argument("--only", default="", help="run names starting with this (e.g. faults/)")
    parser.add_argument("--compare", type=Path, help="a file this script printed: rerun it and compare")
    parser.add_argument("--stores", choices=("sql", "memory"), default="sql",
                        help="where the client objects keep their rows: SQLite, or the stores' in-memory twins")
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)  # faults are injected on purpose
    if args.compare is None:
        for run, seed in runs(args.seeds):
            if run.startswith(args.only):
                print(run, seed, digest(run, seed, args.ops, args.stores), flush=True)
        return
    same, differ = 0, []
    for line in args.compare.read_text().splitlines():
        run, seed, old = line.split()
        if not run.startswith(args.only):
            continue
        new = digest(run, int(seed), args.ops, args.stores)
        if new == old:
            same += 1
        else:
            differ.append(f"{run} {seed}")
    print(f"identical: {same} of {same + len(differ)}")
    for d in differ:
        print("differs:", d)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
