"""A test kit for code built on the semaphore, on CPython with real SQLite.

Applications use it to test their own holder and client objects; the library's tests and
benchmarks use nothing else. Nothing in it mocks the library.

Storage and time (:mod:`._local`):

* :class:`LocalStorage`, :class:`LocalContext` - ``ctx.storage`` and ``ctx`` on real SQLite,
  enforcing the Durable Object rules (:class:`DurableObjectRuleError` where the runtime rejects).
* :class:`VirtualClock` - deterministic time; :class:`AlarmDriver` fires an object's alarm when
  the virtual clock reaches it (an :class:`AlarmSource`). :data:`T0` is the clock's default start.
* Fault injection (all off by default): :class:`SkewedClock` (one object's clock offset from the
  shared virtual clock), ``LocalStorage.fail_transaction`` (a ``transactionSync`` that raises
  :class:`StorageFault` midway, rolled back), ``AlarmDriver.delay_ms``/``duplicate``/
  ``spurious_retry`` (late, duplicated and retried alarm deliveries).

Objects (:mod:`._bed`, :mod:`._harness`):

* :class:`Bed` - a holder object (scheduler + DurabilitySemaphore + alarm) with
  :meth:`Bed.evict` and :meth:`Bed.reset`; :class:`HolderSide` - the same with the client-side
  tests' defaults.
* :class:`ClientSide` - a client object (SemaphoreClient + scheduler + SemaphoreQueue) with
  eviction; :class:`TaskAlarmDriver` fires its alarm as a task.
* :class:`Net` - a faulty in-memory network (loss, duplication, delay, reorder) to a holder.
* :class:`SimClock` - a virtual clock that settles faster.
* :class:`ObjectTasks` - the tasks one object instance started, so an eviction ends them.
* :class:`Namespace` - a Durable Object namespace binding (``getByName``) over in-process objects.

Messages and storage inspection (:mod:`._messages`, :mod:`._inspect`):

* :func:`request`, :func:`sync` build wire messages; :func:`by_id`, :func:`blocked` read replies.
* :func:`dump`, :func:`tables`, :func:`rows`, :func:`grant_rows`, :func:`lease_rows`,
  :func:`timers`, :func:`query` read storage; :func:`check_aggregates` recounts the holder's
  aggregates. :data:`RECLAIM_TIMER`, :data:`TIMERS`, :data:`AGGREGATES` name what they read.

Running (:mod:`._runner`): :func:`run`, :func:`async_test` (``async def`` tests without a plugin).

The holder's decisions without SQLite (:mod:`._memory_store`): :class:`MemoryStore` (the SQL
store's interface over dicts), :func:`run_round`, :func:`run_sync`, :func:`run_reclaim` (the
holder's own load -> decide -> persist) and :func:`resolve_limits` (its limit resolution for
plain synchronous sources).

The client's rows without SQLite (:mod:`._memory_client_store`): :class:`MemoryClientRows`, the
twin of the client's SQL store (its interface, ``semaphore.client._rows.ClientStore``, over
dicts).

The queue's items and marks without SQLite (:mod:`._memory_queue_items`,
:mod:`._memory_queue_marks`): :class:`MemoryQueueItems`, the twin of the queue's SQL item store
(its interface, ``semaphore.client._item_rows.QueueItemStore``, over a dict), and
:class:`MemoryQueueMarks`, the twin of its SQL mark store (``semaphore.client._mark_rows.QueueMarkStore``);
:class:`MemoryStores` (:mod:`._memory_stores`) holds the three twins of one client object, for a
:class:`ClientSide` made with ``stores="memory"`` to run its queue over.
"""

from ..core.batching import SEED_ROUND_PERIOD_MS, SEED_ROUND_WAIT_MS
from ._bed import Bed, HolderSide
from ._harness import ClientSide, Holder, Net, SimClock, TaskAlarmDriver
from ._inspect import (
    AGGREGATES,
    RECLAIM_TIMER,
    TIMERS,
    check_aggregates,
    dump,
    grant_rows,
    lease_rows,
    query,
    rows,
    tables,
    timers,
)
from ._local import (
    T0,
    AlarmDriver,
    AlarmSource,
    DurableObjectRuleError,
    LocalContext,
    LocalStorage,
    SkewedClock,
    StorageFault,
    VirtualClock,
)
from ._memory_client_store import MemoryClientRows
from ._memory_queue_items import MemoryQueueItems
from ._memory_queue_marks import MemoryQueueMarks
from ._memory_store import (
    MemoryStore,
    Store,
    StoreState,
    resolve_limits,
    resolve_sync_limits,
    run_reclaim,
    run_round,
    run_sync,
)
from ._memory_stores import MemoryStores
from ._messages import blocked, by_id, request, sync
from ._namespace import Namespace
from ._runner import async_test, run
from ._tasks import ObjectTasks

#: The holder options of the original's batched round timing (SPEC R9 decision "round timing"):
#: a batched round 1,000 ms after its first waiting request, at most one every 2,000 ms. Rounds
#: still run at once while nothing competes (R9a).
SEED_ROUNDS: dict[str, int] = {"round_wait_ms": SEED_ROUND_WAIT_MS, "round_period_ms": SEED_ROUND_PERIOD_MS}
#: The original's timing whole (SPEC R9, R9a): every round batched, as :data:`SEED_ROUNDS`. For
#: tests staged on batched rounds: ``HolderSide(clock, limit=2, **SEED_TIMING)``.
SEED_TIMING: dict[str, int | bool] = {"free_at_once": False, **SEED_ROUNDS}

__all__ = [
    # storage and time
    "T0", "VirtualClock", "LocalStorage", "LocalContext", "AlarmDriver", "DurableObjectRuleError",
    # fault injection
    "SkewedClock", "StorageFault", "AlarmSource",
    # objects
    "Bed", "HolderSide", "ClientSide", "TaskAlarmDriver", "Net", "Holder", "SimClock", "ObjectTasks", "Namespace",
    # timing
    "SEED_TIMING", "SEED_ROUNDS",
    # messages
    "request", "sync", "by_id", "blocked",
    # storage inspection
    "query", "tables", "dump", "rows", "grant_rows", "lease_rows", "timers", "check_aggregates",
    "RECLAIM_TIMER", "TIMERS", "AGGREGATES",
    # running
    "run", "async_test",
    # the holder's decisions over an in-memory store
    "MemoryStore", "Store", "StoreState", "resolve_limits", "resolve_sync_limits", "run_round", "run_sync",
    "run_reclaim",
    # the client's rows and the queue's items and marks in memory
    "MemoryClientRows", "MemoryQueueItems", "MemoryQueueMarks", "MemoryStores",
]
