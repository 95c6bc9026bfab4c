"""The what-if simulator: your limit, client objects and traffic through the REAL holder,
client and queue code on a virtual clock (``python -m semaphore.simulate --help``).

Each object runs on its own real SQLite storage (the test kit, :mod:`semaphore.testing`): one
holder (:class:`~semaphore.testing.HolderSide`, the real ``DurabilitySemaphore``), and
``clients`` client objects (:class:`~semaphore.testing.ClientSide`: ``SemaphoreClient`` +
``DurabilityScheduler`` + ``SemaphoreQueue``) whose ``on_admit`` starts a job that completes its
item when its virtual duration ends, over a :class:`~semaphore.testing.Net` with optional faults.
Deterministic per seed. The command line and scenario files are the same options
(:class:`Scenario`).

The engine API (what ``scripts/bench_protocol.py`` reuses to run one workload and seed in
several modes)::

    from dataclasses import replace
    from semaphore.simulate import Scenario, run_scenario, load_scenario

    base = Scenario(limit=20, clients=8, arrivals=["backlog"], seed=3)     # or load_scenario("x.toml")
    for mode in ("off", "strict", "under", "over"):
        r = run_scenario(replace(base, leases=mode, reserve=5),
                         on_message=lambda m: None)                        # sees every Message
        print(mode, r.utilization, r.latency_ms.get("p95"), r.per_item(r.calls), r.max_charged_over)

* :class:`Scenario` - every option (fields documented in ``--help``); ``Scenario.from_mapping``,
  ``to_mapping``, ``lease_options()`` (the holder's ``leases=``), ``validate()`` (the one check
  of files, flags and code: :class:`ScenarioError` naming the option and its valid values),
  ``warnings()`` (options set without effect); :func:`load_scenario` /
  :func:`save_scenario` read and write TOML or JSON files of the same keys.
* :func:`run_scenario` ``(scenario, *, on_message=None, progress=None, quiet=True) -> Result``
  on a fresh event loop; ``await`` :func:`simulate` (same arguments) inside one; or
  :class:`Simulation` (``await Simulation(s).run()``) to reach the objects (``.holder``,
  ``.sides``, ``.net``, ``.clock``) while it runs.
* ``on_message``: a callable (or a list) called with a :class:`Message` (``t_ms``, ``client``,
  ``kind`` ``request``/``sync``, ``reason`` - ``request``, or for a sync ``claim``,
  ``stop-return``, ``release``, ``recheck``, ``heartbeat``, see :func:`sync_reason` - and the
  wire ``message``) for every message a client object sends to the holder, before the network.
* :class:`Result` - plain numbers: ``utilization`` (running / limit averaged over the run),
  ``utilization_backlog`` (over the time some item was queued), ``latency_ms`` (enqueue to
  start) and ``free_to_start_ms`` (a permit freed while items waited, to the next start), each
  ``{"p50", "p95", "p99", "mean", "max"}``; ``max_running``/``max_charged`` and
  ``max_running_over``/``max_charged_over`` (minus the limit); ``requests``, ``syncs``,
  ``sync_reasons``, ``calls``, ``per_item(n)``; ``blocked_ms`` (queued item-ms by the holder's
  blocked reason, ``none`` while it has not said); ``net`` (the network's fault counters),
  evictions, ``samples`` (the :class:`Sample` time series) and ``problems`` (an item running
  without charged capacity: must stay empty).
* :func:`plan_arrivals` (the open-loop arrivals of a scenario, the same list in every mode) and
  :func:`job_duration` (an item's duration from the seed and its id), for drivers of other
  semaphores (a naive baseline) that must see the very same workload.
* :mod:`semaphore.simulate.report`: ``summary(result)`` (the table), ``write_csv``, ``figures``
  (JSON-compatible); :mod:`semaphore.simulate.plot`: ``plot(result, path)`` (needs matplotlib:
  the ``simulate`` extra; imported only when plotting).
"""

import sys as _sys

if getattr(_sys.modules.get(__name__.rpartition(".")[0]), "__distribution__", None) != "durability-semaphore":
    raise ImportError(
        "semaphore/__init__.py is not durability-semaphore's: another distribution installed a top-level "
        "'semaphore' package into the same folder (python_modules/ or site-packages) and overwrote it. "
        "Uninstall it, or install durability-semaphore into a folder of its own "
        "(docs/guides/deploying.md: 'The import name semaphore').")

from .engine import (
    KEY,
    Arrival,
    Message,
    Result,
    Sample,
    Simulation,
    job_duration,
    percentiles,
    plan_arrivals,
    run_scenario,
    simulate,
    sync_reason,
)
from .scenario import Scenario, ScenarioError, load_scenario, save_scenario

__all__ = [
    "Scenario", "ScenarioError", "load_scenario", "save_scenario",
    "run_scenario", "simulate", "Simulation", "Result", "Sample", "Message", "Arrival",
    "plan_arrivals", "job_duration", "sync_reason", "percentiles", "KEY",
]
