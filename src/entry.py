"""Reference Worker: one account-wide concurrency budget, queues that run jobs under it.

* ``AccountLimit`` (binding ``ACCOUNT_LIMIT``, one per account id) is the holder: it wraps
  :class:`semaphore.DurabilitySemaphore` and exposes the RPC method ``permits(message)``. It also
  keeps the account's job directory (job id -> queue), so a job can be completed by id alone.
* ``JobQueue`` (binding ``JOB_QUEUE``, one per (account, queue), named ``["account", "queue"]``) is a client: a
  :class:`semaphore.SemaphoreQueue` whose items are the queue's jobs, admitted under the
  account's budget through the client helper (``ACCOUNT_LIMIT`` by name, RPC ``permits``).
* ``AccountIndex`` (binding ``ACCOUNT_INDEX``, one object named ``accounts``) lists the accounts
  the Worker has seen, for ``GET /metrics`` (Prometheus text, admin): each ``AccountLimit`` adds
  itself after its first storage-creating write; its round counters (``app_round_metrics``) are
  written by the semaphore's ``on_round`` hook.
* ``Default`` is the HTTP front (JSON in and out; ``/metrics`` Prometheus text).

A job's work is external: admission marks it ``running`` (its permit is held), and
``POST /accounts/{account}/jobs/{id}/complete`` releases the permit. A job whose payload is an
object with an integer ``"workMs"`` (1 to ``MAX_WORK_MS``) is instead run by its ``JobQueue``
itself (a stand-in for real work, used by ``scripts/chaos``): admitted, it waits that long and
completes itself, and every attempt leaves a durable run record (``app_job_runs``: attempt,
permit, start, end), read by the admin route ``GET .../queues/{queue}/runs``.

What the routes expose and create (docs/reference/http.md):

* Every route that writes needs the admin token (secret ``ADMIN_TOKEN``, sent as
  ``Authorization: Bearer ...``). Only they create storage.
* The operator's reading routes (``GET /metrics``, ``.../holders``, ``.../audit``,
  ``.../scheduler``, ``.../queues/{queue}/runs``, ``.../ping``) need the read token (secret
  ``READ_TOKEN``) or the admin token; the read token is refused (403) on every route that
  writes. With neither secret set they answer 401 saying which secret to set.
* The reading routes (``GET .../usage``, ``GET .../queues/{queue}``) need no token and never
  create storage: an object without the tables of its part answers the empty state (default
  limit, nothing outstanding, no jobs) without a ``CREATE TABLE``, an alarm or a write, so
  unauthenticated reads of arbitrary names leave nothing behind.
* Job payloads are shown only to the admin token: the public queue view omits ``payload``. A
  request that sends an ``Authorization`` header must send the right token (401 otherwise).
* Every error value, from the HTTP front or from an RPC method, carries ``"v": 1``:
  ``{"v": 1, "error": {"code", "message", "field"?}}``.
* JSON in is JSON proper: a body that is malformed, holds ``NaN``/``Infinity`` (or a number
  that overflows to one) or nests deeper than ``MAX_JSON_DEPTH`` is a 400 ``invalid_json``; a
  job payload over ``MAX_PAYLOAD_BYTES`` of JSON is a 413 ``payload_too_large``, and so is a body
  over ``MAX_BODY_BYTES`` (twice that), before it is scanned or parsed. JSON out is strict
  (``allow_nan=False``).
* The public queue view's payloads never cross the RPC (``JobQueue.status(with_payloads=False)``);
  the admin view carries at most ``MAX_VIEW_PAYLOAD_BYTES`` of them in all.
* ``ADMIN_TOKEN`` and ``READ_TOKEN`` are read without surrounding whitespace; blank means not
  configured.
* The job directory (job id -> queue, in the account's holder) forgets a job
  ``JOB_RETENTION_MS`` after its completion (by a scheduler timer on the holder's alarm), the
  least time the queue keeps the finished job, so it holds only live and recently finished jobs. The
  job's ``JobQueue`` is the directory's only writer for its jobs: it registers a job before it
  creates it (and withdraws the entry if creating it then fails and the job does not exist;
  a failure after the job's insert answers it queued, with a ``warning``), and tells the directory of
  every job that turns ``done`` (however it does: a claim cancelled while ``claiming`` turns
  ``done`` later, in the queue's pump) through a durable outbox, sent until the holder
  acknowledges it (see :class:`JobQueue`).

Configuration (``[vars]`` in wrangler.toml, all optional): ``ACCOUNT_CONCURRENCY`` (default limit
per account, 10), ``GRANT_TIMEOUT_MS``, ``ROUND_WAIT_MS``, ``ROUND_PERIOD_MS``,
``FREE_AT_ONCE`` (the holder's ``free_at_once``, ``true`` by default; ``false``: every round
batched, the seed's timing), ``JOB_RETENTION_MS`` (how long finished jobs are remembered,
default one day), ``LEASES`` (empty or absent: the holder's default leases,
:data:`semaphore.DEFAULT_LEASES`; ``off``: no leases, every permit a grant; else JSON text of the
holder's ``leases=`` options, as :meth:`semaphore.LeaseConfig.parse` takes them),
``HOLD_BLOCKED_MS`` and ``REQUEST_WAIT_MS`` (waiting requests: the
holder's ``hold_blocked_ms`` and each JobQueue's ``request_wait_ms``; ``0``, the default, is off;
requests are held only when both are above 0), ``ORPHAN_CHECK_MS`` (each JobQueue's
``orphan_check_ms``: how soon an admission callback cut short by an eviction is called again,
default 60000). Integers must be below 2**53. An invalid var
never crashes an object's constructor: every route (and every RPC method of the objects)
answers the error value ``{"v": 1, "error": {"code": "configuration_error", "field": <the var>,
"message"}}``, the front with status 500. Secret ``ADMIN_TOKEN`` guards every request that changes
state; secret ``READ_TOKEN`` (optional) opens the operator's reading routes without it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse

from workers import DurableObject, Response, WorkerEntrypoint

import dashboard
from semaphore import (
    DEFAULT_LEASES,
    ConfigurationError,
    DurabilityScheduler,
    DurabilitySemaphore,
    InvalidMessageError,
    ItemState,
    LeaseConfig,
    QueueItem,
    SemaphoreClient,
    SemaphoreQueue,
    SemaphoreUsage,
    timeout,
)
from semaphore.client._queue import QUEUE_TABLES
from semaphore.core import json_text
from semaphore.core.batching import ROUND_PERIOD_MS, ROUND_WAIT_MS
from semaphore.core.wire import MAX_INT, id_problem
from semaphore.holder._observe import RoundRecord
from semaphore.holder._store import TABLES as HOLDER_TABLES
from semaphore.runtime import Storage, plain

__all__ = ["AccountLimit", "JobQueue", "AccountIndex", "Default"]

DEFAULT_CONCURRENCY = 10
SETTINGS = "app_account_settings"
JOBS = "app_job_directory"
RPC_TIMEOUT_MS = 5_000
#: How long a finished job is remembered, by its queue (``SemaphoreQueue(retention_ms=...)``, so a
#: retried enqueue does not run it again) and by the account's job directory (``JOB_RETENTION_MS``).
DEFAULT_JOB_RETENTION_MS = 86_400_000
#: The holder's scheduler participant that prunes the job directory: its due time is read from the
#: directory itself (the earliest ``done_at`` plus the retention), so no timer row mirrors it.
JOB_PRUNE_TIMER = "app:prune_job_directory"
#: A JobQueue's outbox: its finished jobs (and ids it does not know that the directory named)
#: the account's job directory has not acknowledged yet (``finish_job``).
FINISHED = "app_finished_jobs"
#: A JobQueue's own settings: its queue name (``queue``), as the front names it.
QUEUE_SETTINGS = "app_queue_settings"
#: The JobQueue's scheduler timer that sends the outbox; a failed send raises, so the scheduler
#: retries it with its backoff (1 s doubling to 5 min) until the holder acknowledges.
ANNOUNCE_TIMER = "app:announce_finished_jobs"
#: Outbox rows sent per run of the timer (one ``finish_job`` RPC each); more run again at once.
ANNOUNCE_BATCH = 100
#: The ``v`` of every error value (the wire format's version, SPEC R7).
ERROR_VERSION = 1
#: The error code of an invalid ``[vars]`` entry (answered with HTTP status 500 by the front).
CONFIG_ERROR = "configuration_error"
#: The account registry (``AccountIndex``, binding ``ACCOUNT_INDEX``): one object of this name.
ACCOUNT_INDEX_NAME = "accounts"
#: The registry's table (``account`` primary key), created by its first ``add``.
ACCOUNTS = "app_accounts"
#: A holder's round counters (``name`` -> ``value``: ``rounds``, ``failed_rounds``, ``admitted``,
#: ``blocked:<reason>``), written by the semaphore's ``on_round`` hook after each round.
ROUND_METRICS = "app_round_metrics"
#: ``GET /metrics`` lists at most this many accounts (the first by name; ``semaphore_accounts``
#: says how many the registry has), asking their holders this many at a time.
METRICS_MAX_ACCOUNTS = 100
METRICS_CONCURRENCY = 10
#: A holder whose registration failed tries again after this long (ms), not at every write.
INDEX_RETRY_MS = 60_000
#: A JobQueue's run records of its in-Worker jobs (payload ``{"workMs": n}``): one row per call
#: of the admission callback (``attempt``), with the permit, the start and (once the work
#: returned, written in the step that completes the job) the end, epoch ms.
RUNS = "app_job_runs"
#: The longest in-Worker job (``workMs``) a payload may ask for.
MAX_WORK_MS = 60_000
#: The queue's default ``orphan_check_ms`` (``ORPHAN_CHECK_MS``), the library's.
DEFAULT_ORPHAN_CHECK_MS = 60_000
#: The timer table of every object's scheduler (``GET .../scheduler`` reads it only if present).
SCHEDULER_TABLE = "durability_scheduler_timers"
#: The ``permits`` message types :meth:`AccountLimit.ping` tallies (anything else: ``other``).
MESSAGE_TYPES = ("request", "sync")
#: The deepest nesting of arrays and objects a request body (and a job payload) may have: deeper
#: is refused (400 ``invalid_json``), long before the parser's recursion limit.
MAX_JSON_DEPTH = 64
#: The most a job's payload may take as the JSON text the queue stores (bytes; ``json.dumps``,
#: ASCII). A Durable Object SQL row holds at most 2 MB: a larger payload is refused (413
#: ``payload_too_large``, field ``payload``) before the job is registered.
MAX_PAYLOAD_BYTES = 1_000_000
#: The longest request body the front takes (characters): twice :data:`MAX_PAYLOAD_BYTES`, room
#: for a payload at the limit and its ids and whitespace. A longer one is read, then refused (413
#: ``payload_too_large``) before it is scanned or parsed.
MAX_BODY_BYTES = 2 * MAX_PAYLOAD_BYTES
#: The admin queue view (``JobQueue.status(with_payloads=True)``) carries job payloads up to this
#: many bytes of JSON in all, in enqueue order (eight at the size limit, well inside the 32 MiB
#: of a Workers RPC message); a job past it is listed without ``payload``, ``payloadOmitted``
#: true. The public view carries none (they never cross the RPC).
MAX_VIEW_PAYLOAD_BYTES = 8 * MAX_PAYLOAD_BYTES

log = logging.getLogger("entry")


class StdoutHandler(logging.Handler):
    """Writes each record's message as one line to the current ``sys.stdout``."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stdout, flush=True)
        except Exception:
            self.handleError(record)


def log_rounds() -> None:
    """Print the holder's round records (one JSON line per round, logger ``semaphore.round``,
    ``INFO``) to stdout, which the runtime sends to ``console.log`` (Workers Logs with
    ``[observability]``). Only when nothing configured a handler for that logger already."""
    rounds = logging.getLogger("semaphore.round")
    if rounds.handlers:
        return
    rounds.addHandler(StdoutHandler())
    rounds.setLevel(logging.INFO)


log_rounds()

#: How client objects reach an account's holder (SPEC R36): env.ACCOUNT_LIMIT.getByName(account),
#: RPC method ``permits``, each call bounded by a timeout.
limits = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke=lambda stub, message: stub.permits(message))


def has_tables(storage: Storage, names: tuple[str, ...] | list[str]) -> bool:
    """Whether any of the tables ``names`` exists (a read of ``sqlite_master``: creates nothing)."""
    marks = ", ".join("?" for _ in names)
    row = storage.one(f"SELECT name FROM sqlite_master WHERE type = 'table' AND name IN ({marks}) LIMIT 1",
                      *names)
    return row is not None


def message_type(message: Any) -> str:
    """A ``permits`` message's ``type`` if it is one of :data:`MESSAGE_TYPES`, else ``"other"``
    (a dict, or the runtime's proxy of a JavaScript object; nothing is converted)."""
    try:
        kind = message.get("type") if isinstance(message, dict) else getattr(message, "type", None)
    except Exception:  # noqa: BLE001 - a hostile value is the semaphore's to reject
        kind = None
    return kind if isinstance(kind, str) and kind in MESSAGE_TYPES else "other"


def account_name(ctx: Any) -> str | None:
    """The name the object was reached by (``ctx.id.name``, set for ``getByName`` / ``idFromName``
    ids), or ``None`` where the runtime does not give it."""
    name = plain(getattr(getattr(ctx, "id", None), "name", None))
    return name if isinstance(name, str) and name else None


def work_ms(payload: Any) -> int | None:
    """The ``workMs`` of an in-Worker job's payload (an int from 1 to :data:`MAX_WORK_MS` under
    the key ``"workMs"`` of an object payload), else ``None``: the job's work is external."""
    value = payload.get("workMs") if isinstance(payload, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORK_MS:
        return None
    return value


async def scheduler_view(storage: Storage, scheduler: DurabilityScheduler) -> dict[str, Any]:
    """An object's alarm as its scheduler sees it (``GET .../scheduler``, a diagnostics aid):
    ``{"alarm": the runtime's alarm (epoch ms) or None, "due": {timer or participant: due time}
    (:meth:`DurabilityScheduler.due_times`), "now": the object's clock}``. Read only: an object
    whose scheduler never ran (no timer table) answers ``"due": {}`` and creates nothing."""
    due = scheduler.due_times() if has_tables(storage, [SCHEDULER_TABLE]) else {}
    return {"alarm": await storage.get_alarm(), "due": due, "now": int(scheduler.clock())}


def error_value(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    """An error value (``{"v": 1, "error": {...}}``), as RPC methods and the front return them."""
    error: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        error["field"] = field
    return {"v": ERROR_VERSION, "error": error}


class VarError(ValueError):
    """An invalid ``[vars]`` entry ``field``. Objects answer it as an error value (code
    ``configuration_error``) instead of failing their constructor; the front with status 500."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message

    def value(self) -> dict[str, Any]:
        return error_value(CONFIG_ERROR, self.message, self.field)


def env_flag(env: Any, name: str, default: bool) -> bool:
    """Read a boolean ``[vars]`` entry (``true``/``false``, any case; a TOML boolean too); a
    missing one gives ``default``; anything else raises :class:`VarError` naming it."""
    raw = getattr(env, name, None)
    if raw is None or str(raw).strip() == "":
        return default
    text = str(raw).strip().lower()
    if text not in ("true", "false"):
        raise VarError(name, f"{name} must be true or false, got {raw!r}")
    return text == "true"


def env_int(env: Any, name: str, default: int, minimum: int = 0, maximum: int = MAX_INT) -> int:
    """Read an integer ``[vars]`` entry; a missing one gives ``default``; a malformed one, or one
    outside ``minimum`` .. ``maximum`` (by default below 2**53, the wire's bound: the same as
    ``set_limit``'s), raises :class:`VarError` naming it."""
    raw = getattr(env, name, None)
    if raw is None or str(raw).strip() == "":
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise VarError(name, f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise VarError(name, f"{name} must be >= {minimum}, got {value}")
    if value > maximum:
        raise VarError(name, f"{name} must be <= {maximum} (below 2**53), got {value}")
    return value


#: Text that :func:`parse_json` refuses; ``str()`` says why.
JsonError = json_text.JsonTextError


def json_depth(value: Any) -> int:
    """How deeply ``value`` nests arrays and objects (a scalar 0, ``[]`` 1, ``[{}]`` 2), counted
    without recursion; counting stops past :data:`MAX_JSON_DEPTH` (which it then exceeds)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, (list, tuple)) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            break
        # Containers only: a scalar adds no depth, and a (node, depth) tuple per scalar made a flat
        # array of n items cost n tuples (a 2 MB '[0,0,...]' peaked at 64 MB).
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return deepest


def text_too_deep(text: str) -> bool:
    """Whether the JSON ``text`` nests arrays and objects deeper than :data:`MAX_JSON_DEPTH`
    (:func:`semaphore.core.json_text.too_deep`: read from its brackets outside string literals,
    before any parser sees it; in Pyodide a deep enough text overflows the WebAssembly stack in
    ``json.loads``, a fatal error of the whole isolate)."""
    return json_text.too_deep(text, MAX_JSON_DEPTH)


def parse_json(text: str) -> Any:
    """``text`` as JSON proper, or :class:`JsonError` saying why not (the library's
    :func:`semaphore.core.json_text.decode` with :data:`MAX_JSON_DEPTH`): nesting deeper than
    that (:func:`text_too_deep`, checked before parsing), malformed text, ``NaN``, ``Infinity``
    or a number that overflows to infinity (``1e999``), which ``json.loads`` would accept and
    JSON cannot carry."""
    return json_text.decode(text, MAX_JSON_DEPTH)


def to_json(value: Any) -> str:
    """The Worker's JSON text of ``value``: strict (``allow_nan=False``: a non-finite number raises
    ``ValueError`` instead of writing a bare ``NaN``, which no JSON parser reads)."""
    return json.dumps(value, allow_nan=False)


def payload_problem(payload: Any) -> dict[str, Any] | None:
    """The error value of a job payload the queue cannot keep (field ``payload``), else ``None``:
    ``invalid_request`` for one that is not JSON (a non-finite number, a value JSON has no type
    for, nesting deeper than :data:`MAX_JSON_DEPTH`), ``payload_too_large`` for one whose JSON
    text (as the queue stores it) is over :data:`MAX_PAYLOAD_BYTES`."""
    if json_depth(payload) > MAX_JSON_DEPTH:
        return error_value("invalid_request", f"payload is nested deeper than {MAX_JSON_DEPTH} levels", "payload")
    try:
        text = to_json(payload)
    except (TypeError, ValueError) as exc:
        return error_value("invalid_request", f"payload must be JSON (no NaN or Infinity): {exc}", "payload")
    size = len(text.encode("utf-8"))
    if size > MAX_PAYLOAD_BYTES:
        return error_value("payload_too_large", f"payload is {size} bytes of JSON, over the {MAX_PAYLOAD_BYTES}"
                           " a job may carry (a Durable Object SQL row holds at most 2 MB)", "payload")
    return None


def enqueue_problem(account: str, job_id: str, group: str, payload: Any) -> dict[str, Any] | None:
    """The error value of a job :meth:`JobQueue.enqueue` must refuse before registering it
    (``invalid_request`` naming ``account``, ``id`` or ``group``, or :func:`payload_problem`'s),
    else ``None``."""
    for value, name in ((account, "account"), (job_id, "id"), (group, "group")):
        problem = id_problem(value)
        if problem is not None:
            return error_value("invalid_request", f"{name} {problem}", name)
    return payload_problem(payload)


def env_leases(env: Any) -> LeaseConfig | None:
    """The ``LEASES`` var: empty or absent, the holder's default (:data:`DEFAULT_LEASES`);
    ``off``: ``None`` (no leases); else JSON text of the holder's ``leases=`` options (e.g.
    ``{"provisioning": {"mode": "strict"}, "permitsPerLease": 2, "ttlMs": 4000}``), checked by
    :meth:`LeaseConfig.parse`."""
    raw = getattr(env, "LEASES", None)
    if raw is None:
        return DEFAULT_LEASES
    if isinstance(raw, str):
        if raw.strip() == "":
            return DEFAULT_LEASES
        if raw.strip() == "off":
            return None
        try:
            value = parse_json(raw)
        except JsonError as exc:
            raise VarError("LEASES", f"LEASES must be JSON text of the lease options, e.g. "
                                     f"'{{\"provisioning\": {{\"mode\": \"strict\"}}}}': {exc}") from None
    else:  # a JSON (not text) binding: already parsed by the runtime
        value = plain(raw)
    if not isinstance(value, dict):
        raise VarError("LEASES", f"LEASES must be a JSON object of lease options, got {value!r}")
    try:
        return LeaseConfig.parse(value)
    except ConfigurationError as exc:
        raise VarError("LEASES", f"LEASES: {exc.message}") from None


@dataclass(frozen=True)
class Settings:
    """Every ``[vars]`` entry of the Worker, validated (:func:`read_settings`)."""

    default_limit: int
    grant_timeout_ms: int
    round_wait_ms: int
    round_period_ms: int
    job_retention_ms: int
    leases: LeaseConfig | None
    hold_blocked_ms: int = 0
    free_at_once: bool = True
    request_wait_ms: int = 0
    orphan_check_ms: int = DEFAULT_ORPHAN_CHECK_MS

    @property
    def request_timeout_ms(self) -> int:
        """The JobQueue's RPC timeout to the holder (every ``permits`` message): ``RPC_TIMEOUT_MS``,
        plus, with waiting requests (``REQUEST_WAIT_MS`` > 0), ``REQUEST_WAIT_MS`` and the longest a
        round can take to come (``max(ROUND_WAIT_MS, ROUND_PERIOD_MS)``): a held request is answered
        at the latest by the first round at or after its deadline, and the transport's timeout
        must exceed ``request_wait_ms + round_period_ms`` (``SemaphoreQueue``'s docs)."""
        if self.request_wait_ms <= 0:
            return RPC_TIMEOUT_MS
        return RPC_TIMEOUT_MS + self.request_wait_ms + max(self.round_wait_ms, self.round_period_ms)


def read_settings(env: Any) -> Settings:
    """Parse the ``[vars]``; the first invalid one raises :class:`VarError`."""
    settings = Settings(
        default_limit=env_int(env, "ACCOUNT_CONCURRENCY", DEFAULT_CONCURRENCY),
        grant_timeout_ms=env_int(env, "GRANT_TIMEOUT_MS", 10_000, 1),
        round_wait_ms=env_int(env, "ROUND_WAIT_MS", ROUND_WAIT_MS),
        round_period_ms=env_int(env, "ROUND_PERIOD_MS", ROUND_PERIOD_MS),
        job_retention_ms=env_int(env, "JOB_RETENTION_MS", DEFAULT_JOB_RETENTION_MS, 1),
        leases=env_leases(env),
        hold_blocked_ms=env_int(env, "HOLD_BLOCKED_MS", 0),
        free_at_once=env_flag(env, "FREE_AT_ONCE", True),
        request_wait_ms=env_int(env, "REQUEST_WAIT_MS", 0),
        orphan_check_ms=env_int(env, "ORPHAN_CHECK_MS", DEFAULT_ORPHAN_CHECK_MS, 1),
    )
    leases = settings.leases
    if leases is not None and settings.request_wait_ms * 2 >= leases.ttl_ms:
        # A held request delays the key's lease heartbeats (SemaphoreQueue's request_wait_ms).
        raise VarError("REQUEST_WAIT_MS", f"REQUEST_WAIT_MS must be below half the lease ttlMs "
                                          f"({leases.ttl_ms}), got {settings.request_wait_ms}")
    return settings


class AccountLimit(DurableObject):
    """Holder of one account's concurrency budget (one object per account id).

    Storage: the semaphore's tables, ``app_account_settings`` (the limit override, written only by
    :meth:`set_limit`) and ``app_job_directory`` (job id -> queue, written only by
    :meth:`register_job` / :meth:`finish_job`, and :meth:`forget_job` for a job its queue
    registered and could not create). The reading methods (:meth:`usage`,
    :meth:`find_job`) never create any of them: an account never written to keeps no storage.

    The ``[vars]`` are read once, here (``LEASES`` turns the semaphore's leases on). An invalid
    one does not fail the constructor: :attr:`config_error` holds its error value (code
    ``configuration_error``), which every RPC method answers, and the alarm handler raises."""

    def __init__(self, ctx: Any, env: Any) -> None:
        super().__init__(ctx, env)
        self.storage = Storage(ctx)
        self._override: int | None = None
        self._override_loaded = False
        self._jobs_ready = False
        self._jobs_absent = False  # known absent (no schema read at each arm) until _jobs_table()
        self.scheduler = DurabilityScheduler(ctx)
        self.scheduler.participate(JOB_PRUNE_TIMER, self._prune_due, self._prune_jobs)
        self.config_error: dict[str, Any] | None = None
        try:
            settings = read_settings(env)
        except VarError as exc:
            log.error("AccountLimit: invalid configuration: %s", exc.message)
            self.config_error = exc.value()
            settings = None
        self.default_limit = DEFAULT_CONCURRENCY if settings is None else settings.default_limit
        self.job_retention_ms = DEFAULT_JOB_RETENTION_MS if settings is None else settings.job_retention_ms
        self.semaphore: DurabilitySemaphore | None = None if settings is None else DurabilitySemaphore(
            scheduler=self.scheduler,
            limit=self.current_limit,
            grant_timeout_ms=settings.grant_timeout_ms,
            round_wait_ms=settings.round_wait_ms,
            round_period_ms=settings.round_period_ms,
            leases=settings.leases,
            on_round=self._count_round,
            hold_blocked_ms=settings.hold_blocked_ms,
            free_at_once=settings.free_at_once,
        )
        # ping()'s tally of the permits messages this instance handled (memory only).
        self._started_at = int(self.scheduler.clock())
        self._messages = dict.fromkeys((*MESSAGE_TYPES, "other"), 0)
        self._index_env = env
        self._indexed = False  # registered in the AccountIndex (per instance: one add() per instance)
        self._index_retry_at = 0
        self._metrics_ready = False

    # -- configuration -------------------------------------------------------------------
    def _settings(self) -> None:
        """Load the stored override once per instance (read only: no table, no override)."""
        if self._override_loaded:
            return
        row = None
        if has_tables(self.storage, [SETTINGS]):
            row = self.storage.one(f"SELECT value FROM {SETTINGS} WHERE key = 'limit'")
        self._override = None if row is None else int(row["value"])
        self._override_loaded = True

    def current_limit(self) -> int:
        """The account's limit: the stored override, else ``ACCOUNT_CONCURRENCY``."""
        self._settings()
        return self.default_limit if self._override is None else self._override

    # -- RPC methods -----------------------------------------------------------------------
    async def permits(self, message: Any) -> dict[str, Any] | str:
        """The semaphore's wire endpoint (requests and syncs from client objects, and the
        front's ``POST .../permits``): a message as JSON text (what the client helper and the
        front send) is answered with the JSON text of the reply (SPEC R7 "JSON text"), a dict
        with a dict."""
        reply = self.config_error if self.config_error is not None else await self._permits(message)
        return json_text.encode(reply) if isinstance(message, str) else reply

    async def _permits(self, message: Any) -> dict[str, Any]:
        if isinstance(message, str):  # decoded here (as handle() would) so the tally reads its type
            try:
                message = json_text.decode_message(message)
            except InvalidMessageError as exc:
                self._messages["other"] += 1
                return exc.to_wire()
        self._messages[message_type(message)] += 1
        reply = await self.semaphore.handle(message)
        if "error" not in reply:
            await self._register()
        return reply

    async def ping(self) -> dict[str, Any]:
        """A benchmark and diagnostics aid (``GET /accounts/{account}/ping``): one RPC that reads
        and writes no storage (so it creates nothing) and runs no round. Answers ``{"ok": True,
        "instance": {"startedAt", "messages": {"request", "sync", "other"}}}``: the ``permits``
        messages this instance handled by type (``other``: not a request or sync, e.g. invalid)
        since it started (``startedAt``, epoch ms). Memory only: a new instance (an eviction)
        starts again at 0."""
        if self.config_error is not None:
            return self.config_error
        return {"ok": True, "instance": {"startedAt": self._started_at, "messages": dict(self._messages)}}

    async def scheduler_state(self) -> dict[str, Any]:
        """The holder's alarm and what is due on it (:func:`scheduler_view`; read only)."""
        if self.config_error is not None:
            return self.config_error
        return await scheduler_view(self.storage, self.scheduler)

    async def usage(self) -> dict[str, Any]:
        """The semaphore's ``usage()`` (SPEC R38) plus ``defaultLimit`` and ``limitOverride``.
        Read only: a holder whose semaphore never ran (no tables) answers the empty usage under
        its current limit without creating its schema or arming an alarm (a limit that cannot be
        resolved, e.g. a corrupt stored override, is ``None`` there too, as in the semaphore's):
        the same keys, ``charged`` 0 and ``available`` the whole grant room (``limit`` itself
        unless the ``under`` reserve keeps part of it for leases)."""
        if self.config_error is not None:
            return self.config_error
        if has_tables(self.storage, HOLDER_TABLES):
            usage = await self.semaphore.usage()
        else:
            try:
                limit: int | None = self.current_limit()
            except Exception:
                log.exception("AccountLimit: the limit cannot be resolved")
                limit = None
            # The same keys as the semaphore's (charged 0, available the empty grant room).
            usage = SemaphoreUsage.empty(limit, self.semaphore.leases).to_wire()
        usage["defaultLimit"] = self.default_limit
        usage["limitOverride"] = self._override
        return usage

    async def set_limit(self, limit: Any) -> dict[str, Any]:
        """Set (an int >= 0) or clear (``None``) this account's limit override. Takes effect at
        the next round; lowering it never revokes running work (SPEC R24). An invalid limit is
        answered with the error value ``{"v": 1, "error": {"code": "invalid_limit", ...}}`` and
        changes nothing; clearing an override that was never set creates nothing. The stored
        override is overwritten without being read, so a corrupt one can be repaired. Requests
        held open (``HOLD_BLOCKED_MS``) get a round at once (as ``round_period_ms`` allows), so a
        raised limit serves them without waiting for their deadline."""
        if self.config_error is not None:
            return self.config_error
        limit = plain(limit)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or not 0 <= limit <= MAX_INT):
            return error_value("invalid_limit", "limit must be an integer from 0 to 2**53 - 1, or null", "limit")
        if limit is None:
            if has_tables(self.storage, [SETTINGS]):
                self.storage.exec(f"DELETE FROM {SETTINGS} WHERE key = 'limit'")
        else:
            self.storage.exec(f"CREATE TABLE IF NOT EXISTS {SETTINGS} (key TEXT PRIMARY KEY, value INTEGER NOT NULL)")
            self.storage.exec(
                f"INSERT INTO {SETTINGS}(key, value) VALUES ('limit', ?)"
                " ON CONFLICT(key) DO UPDATE SET value = excluded.value", limit)
        self._override, self._override_loaded = limit, True
        # A raised limit may serve requests held open (HOLD_BLOCKED_MS): the holder finds it by
        # itself within about two round periods (SPEC R9 decision "limits that rise"); this
        # serves them at once. Does nothing while nothing is held.
        if self.semaphore is not None:
            self.semaphore.start_round()
        if limit is not None:
            await self._register()
        return {"limit": self.current_limit(), "override": limit, "defaultLimit": self.default_limit}

    # -- operations (issue 11): who holds what, an audited force-settle ---------------------
    async def holders(self, cursor: Any = None, limit: Any = 100) -> dict[str, Any]:
        """One page of the clients holding grants or leases (the semaphore's ``holders()``:
        ``{"holders": [{"clientId", "label", "lastReportAt", "charged", "grants", "leases"}], "cursor"}``;
        a queue object's ``label`` is its name, the JSON ``[account, queue]`` it is reached by).
        Read only: a holder without its tables answers ``{"holders": [], "cursor": None}`` and
        creates nothing. A bad ``cursor``/``limit`` is answered ``invalid_request`` naming it."""
        if self.config_error is not None:
            return self.config_error
        cursor, limit = plain(cursor), plain(limit)
        problem = page_problem(cursor, limit, int_cursor=False)
        if problem is not None:
            return problem
        if not has_tables(self.storage, HOLDER_TABLES):
            return {"holders": [], "cursor": None}
        try:
            return await self.semaphore.holders(cursor, limit)
        except ConfigurationError as exc:
            return error_value("invalid_request", exc.message, exc.field)

    async def audit(self, cursor: Any = None, limit: Any = 100) -> dict[str, Any]:
        """One page of the holder's audit records, newest first (the semaphore's ``audit()``:
        ``{"records": [...], "cursor": int | None}``). Read only, like :meth:`holders`."""
        if self.config_error is not None:
            return self.config_error
        cursor, limit = plain(cursor), plain(limit)
        problem = page_problem(cursor, limit, int_cursor=True)
        if problem is not None:
            return problem
        if not has_tables(self.storage, HOLDER_TABLES):
            return {"records": [], "cursor": None}
        try:
            return await self.semaphore.audit(cursor, limit)
        except ConfigurationError as exc:
            return error_value("invalid_request", exc.message, exc.field)

    async def force_settle(self, client_id: Any, reason: Any, actor: Any = None) -> dict[str, Any]:
        """Free everything ``client_id`` holds, recorded in the audit log (the semaphore's
        ``force_settle()``); answers the audit record. A holder that has no state answers the
        error value ``not_found`` and creates nothing; a bad ``reason``/``actor``
        ``invalid_request`` naming it."""
        if self.config_error is not None:
            return self.config_error
        client_id, reason, actor = plain(client_id), plain(reason), plain(actor)
        if not has_tables(self.storage, HOLDER_TABLES):
            return error_value("not_found", "this account's holder has no state: nothing to settle")
        try:
            return await self.semaphore.force_settle(client_id, reason, actor=actor)
        except ConfigurationError as exc:
            return error_value("invalid_request", exc.message, exc.field)

    async def register_job(self, job_id: Any, queue: Any) -> dict[str, Any]:
        """Record that ``job_id`` lives in ``queue`` (idempotent). Answers the queue the job is
        registered to, which differs from ``queue`` when the id is already taken elsewhere.
        Called by the ``JobQueue`` of ``queue`` before it creates the job.

        Registering a job of the same queue again clears its completion mark: the job is live
        again (or its queue knows it finished, and announces it again with :meth:`finish_job`),
        so the directory never forgets a job its queue may still run."""
        if self.config_error is not None:
            return self.config_error
        job_id, queue = str(plain(job_id)), str(plain(queue))
        self._jobs_table()
        self.storage.exec(
            f"INSERT INTO {JOBS}(job_id, queue) VALUES (?, ?)"
            " ON CONFLICT(job_id) DO UPDATE SET done_at = NULL WHERE queue = excluded.queue",
            job_id, queue)
        row = self.storage.one(f"SELECT queue FROM {JOBS} WHERE job_id = ?", job_id)
        await self._register()
        return {"jobId": job_id, "queue": str(row["queue"]) if row else queue}

    async def find_job(self, job_id: Any) -> dict[str, Any]:
        """The queue holding ``job_id``: ``{"queue": name}`` or ``{"queue": None}`` (read only)."""
        if self.config_error is not None:
            return self.config_error
        if not has_tables(self.storage, [JOBS]):
            return {"queue": None}
        row = self.storage.one(f"SELECT queue FROM {JOBS} WHERE job_id = ?", str(plain(job_id)))
        return {"queue": str(row["queue"]) if row else None}

    async def forget_job(self, job_id: Any, queue: Any) -> dict[str, Any]:
        """Drop ``job_id``'s entry if it belongs to ``queue``: that queue registered the job and
        then could not create it (:meth:`JobQueue.enqueue`), so no such job exists. Idempotent;
        an entry of another queue is left as it is; creates nothing. Answers ``{"jobId",
        "forgotten": bool}``."""
        if self.config_error is not None:
            return self.config_error
        job_id, queue = str(plain(job_id)), str(plain(queue))
        if not has_tables(self.storage, [JOBS]):
            return {"jobId": job_id, "forgotten": False}

        def body() -> bool:
            found = self.storage.one(f"SELECT 1 AS one FROM {JOBS} WHERE job_id = ? AND queue = ?", job_id, queue)
            self.storage.exec(f"DELETE FROM {JOBS} WHERE job_id = ? AND queue = ?", job_id, queue)
            return found is not None

        return {"jobId": job_id, "forgotten": self.storage.transaction(body)}

    async def finish_job(self, job_id: Any, queue: Any = None) -> dict[str, Any]:
        """``job_id`` is finished in its queue (or that queue does not know it): the directory
        forgets it ``JOB_RETENTION_MS`` after the first such call (the holder's scheduler
        participant ``app:prune_job_directory``, due at :meth:`_next_prune_at`). Sent by the
        job's ``JobQueue`` from its outbox until acknowledged, so idempotent; an unknown id, or
        (with ``queue``) an id registered to another queue, changes nothing. Answers
        ``{"jobId", "pruneAt"}`` (``pruneAt``: when the entry goes, ``None`` if there is none),
        which acknowledges it."""
        if self.config_error is not None:
            return self.config_error
        job_id = str(plain(job_id))
        queue = plain(queue)
        queue = None if queue is None else str(queue)
        if not has_tables(self.storage, [JOBS]):
            return {"jobId": job_id, "pruneAt": None}
        self._jobs_table()
        now = int(self.scheduler.clock())

        def body() -> int | None:
            self.storage.exec(f"UPDATE {JOBS} SET done_at = ? WHERE job_id = ? AND done_at IS NULL"
                              " AND (? IS NULL OR queue = ?)", now, job_id, queue, queue)
            row = self.storage.one(f"SELECT done_at, queue FROM {JOBS} WHERE job_id = ?", job_id)
            if row is None or row["done_at"] is None or (queue is not None and str(row["queue"]) != queue):
                return None
            return int(row["done_at"]) + self.job_retention_ms

        prune_at = self.storage.transaction(body)
        await self.scheduler.arm()
        return {"jobId": job_id, "pruneAt": prune_at}

    def _next_prune_at(self) -> int | None:
        row = self.storage.one(f"SELECT MIN(done_at) AS done FROM {JOBS} WHERE done_at IS NOT NULL")
        return None if row is None or row["done"] is None else int(row["done"]) + self.job_retention_ms

    def _prune_due(self) -> int | None:
        """The prune participant's ``next_due``: :meth:`_next_prune_at` (one read). ``None`` when
        there is no job directory (an account never written to), or one of an earlier version
        (no ``done_at`` yet: nothing finished to forget); nothing is created."""
        if not self._jobs_ready:  # one schema read per instance until it has (or made) the directory
            if self._jobs_absent:  # only this instance creates it (_jobs_table)
                return None
            row = self.storage.one("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", JOBS)
            if row is None or not re.search(r"\bdone_at\b", str(row["sql"] or "")):
                self._jobs_absent = True
                return None
            self._jobs_table()  # present and current: its index too, then no more schema reads
        try:
            return self._next_prune_at()
        except Exception:
            if not has_tables(self.storage, [JOBS]):  # removed meanwhile (an uninstall)
                self._jobs_ready, self._jobs_absent = False, True
                return None
            raise

    def _prune_jobs(self, name: str, due_at: int) -> None:
        """The prune participant's run: drop directory entries of jobs finished
        ``JOB_RETENTION_MS`` ago (the next due time follows from the entries left; the scheduler
        re-arms the alarm)."""
        if not has_tables(self.storage, [JOBS]):
            return
        self._jobs_table()
        now = int(self.scheduler.clock())
        self.storage.exec(f"DELETE FROM {JOBS} WHERE done_at IS NOT NULL AND done_at <= ?",
                          now - self.job_retention_ms)

    def _jobs_table(self) -> None:
        """Create the job directory, or add ``done_at`` to one created by an earlier version."""
        if self._jobs_ready:
            return
        row = self.storage.one("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = ?", JOBS)
        if row is None:
            self.storage.exec(f"CREATE TABLE IF NOT EXISTS {JOBS} (job_id TEXT PRIMARY KEY, queue TEXT NOT NULL,"
                              " done_at INTEGER)")
        elif not re.search(r"\bdone_at\b", str(row["sql"] or "")):
            self.storage.exec(f"ALTER TABLE {JOBS} ADD COLUMN done_at INTEGER")
        self.storage.exec(f"CREATE INDEX IF NOT EXISTS {JOBS}_done ON {JOBS}(done_at) WHERE done_at IS NOT NULL")
        self._jobs_ready, self._jobs_absent = True, False

    # -- metrics (GET /metrics) ------------------------------------------------------------
    async def metrics(self) -> dict[str, Any]:
        """What ``GET /metrics`` shows of this account: ``{"usage": <usage()>, "counters":
        {"rounds", "failed_rounds", "admitted", "blocked:<reason>": int}}`` (counters never
        written are absent). Read only, like :meth:`usage`: creates nothing."""
        if self.config_error is not None:
            return self.config_error
        usage = await self.usage()
        counters: dict[str, int] = {}
        if has_tables(self.storage, [ROUND_METRICS]):
            counters = {str(r["name"]): int(r["value"])
                        for r in self.storage.exec(f"SELECT name, value FROM {ROUND_METRICS}")}
        return {"usage": usage, "counters": counters}

    def _count_round(self, record: RoundRecord) -> None:
        """The semaphore's ``on_round`` hook: add the round to the durable counters (one upsert,
        after the round's commit: a round whose instance dies right after it goes uncounted)."""
        rows = [("failed_rounds" if record.failed else "rounds", 1)]
        if record.admitted:
            rows.append(("admitted", record.admitted))
        rows += [(f"blocked:{reason}", n) for reason, n in sorted(record.blocked.items()) if n]
        if not self._metrics_ready:
            self.storage.exec(f"CREATE TABLE IF NOT EXISTS {ROUND_METRICS} (name TEXT PRIMARY KEY,"
                              " value INTEGER NOT NULL)")
            self._metrics_ready = True
        self.storage.exec(
            f"INSERT INTO {ROUND_METRICS}(name, value) VALUES {', '.join('(?, ?)' for _ in rows)}"
            " ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
            *(x for row in rows for x in row))

    async def _register(self) -> None:
        """Make sure the ``AccountIndex`` lists this account (its name is ``ctx.id.name``): called
        after the writes that create the holder's storage (``set_limit`` of a value,
        ``register_job``, a ``permits`` message answered without an error), once per instance.
        A failure is logged and retried after ``INDEX_RETRY_MS``; it never fails the write."""
        if self._indexed:
            return
        index = getattr(self._index_env, "ACCOUNT_INDEX", None)
        name = account_name(self.ctx)
        if index is None or name is None:  # no registry bound, or a runtime without ctx.id.name
            if index is not None:
                log.warning("AccountLimit: ctx.id.name is not available; the account is not indexed")
            self._indexed = True
            return
        now = int(self.scheduler.clock())
        if now < self._index_retry_at:
            return
        try:
            reply = plain(await asyncio.wait_for(index.getByName(ACCOUNT_INDEX_NAME).add(name), RPC_TIMEOUT_MS / 1000))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # TimeoutError, JsException
            reply = error_value("unavailable", str(exc) or type(exc).__name__)
        if isinstance(reply, dict) and "error" in reply:
            log.warning("AccountLimit: registering account %r in the AccountIndex failed: %s", name, reply)
            self._index_retry_at = now + INDEX_RETRY_MS
            return
        self._indexed = True

    async def alarm(self, alarm_info: Any = None) -> None:
        if self.config_error is not None:  # fails (retried by the runtime) until the vars are fixed
            raise VarError(self.config_error["error"]["field"], self.config_error["error"]["message"])
        await self.scheduler.alarm(alarm_info)


def job_view(item: QueueItem) -> dict[str, Any]:
    """JSON view of a queued job (the HTTP front drops ``payload`` from the public view).
    ``blocked``: while the job is queued, the holder's latest word on why its group waits
    (``{"reason", "waiting", "at"}``, from :attr:`QueueItem.blocked` / ``blocked_at``), else
    ``None``."""
    blocked = item.blocked
    return {
        "id": item.item_id,
        "group": item.group,
        "state": item.state.value,
        "payload": item.payload,
        "enqueuedAt": item.enqueued_at,
        "startedAt": item.started_at or None,
        "finishedAt": item.finished_at or None,
        "permit": None if item.permit is None else {"kind": item.permit.kind.value, "id": item.permit.id},
        "blocked": None if blocked is None else {"reason": blocked.reason.value, "waiting": blocked.waiting,
                                                 "at": item.blocked_at},
    }


class DirectoryError(Exception):
    """A ``register_job`` / ``finish_job`` RPC from a JobQueue to the account's holder failed
    (unreachable, timed out, or an error value): the outbox row stays and is sent again."""


class JobQueue(DurableObject):
    """A queue of jobs of one account (one object per (account, queue)).

    Jobs are items of a :class:`SemaphoreQueue` keyed by the account id: they wait for permits of
    the account's ``AccountLimit`` (rounds, or draws from leases), run while they hold one, and
    release it on completion. Everything is in this object's SQLite storage, so eviction loses
    nothing; the object's alarm drives the queue. Finished jobs are kept ``JOB_RETENTION_MS``
    (default one day). With ``REQUEST_WAIT_MS`` (waiting requests) each request tells the holder
    the queue waits that long for its answer, and the RPC timeout to the holder is
    :attr:`Settings.request_timeout_ms` (above ``REQUEST_WAIT_MS + ROUND_PERIOD_MS``).
    :meth:`status` is read only: a queue never written to keeps no storage. An invalid ``[vars]``
    entry is answered as the error value ``configuration_error`` by every RPC method (the
    constructor does not fail).

    The account's job directory (``AccountLimit.register_job`` / ``finish_job``) is written by
    this object only, for its jobs:

    * :meth:`enqueue` registers the job before it creates it (a ``conflict`` error value when the
      id belongs to another queue; ``unavailable`` when the holder does not answer; the job is
      not created then). What can be refused is refused before registering (ids, a payload
      that is not JSON or over ``MAX_PAYLOAD_BYTES``); a failure creating the job after
      registering it withdraws the entry (``forget_job``; if that is not answered, the outbox
      announces the id finished) and answers ``internal_error`` when the job does not exist:
      the directory never keeps an entry for a job that does not exist. A failure after the
      job's insert committed (arming its alarm) keeps the entry and answers the job as queued
      with a ``warning`` (:meth:`_queued_anyway`, which arms the wake-up again).
    * Every job that turns ``done`` is written to the outbox table ``app_finished_jobs`` by the
      queue's ``on_done`` hook, in the transaction that clears the job's pending-hook flag (the
      queue calls it right after the transition, or, after an eviction or a failure, from a
      later pump), whichever way it turns ``done``: a job completed while ``claiming`` turns
      ``done`` only when the pump resolves its claim. So are
      ids :meth:`complete` is asked for that this queue does not know (never created here, or
      forgotten after the retention), and finished jobs enqueued again (registering them
      cleared their completion mark). The outbox is sent with ``finish_job`` at once and by the
      scheduler timer ``app:announce_finished_jobs`` (retried with the scheduler's backoff until
      the holder acknowledges); a row is deleted only once acknowledged.
    * Registering and sending take one lock, and creating a job drops the outbox row of an
      earlier job with the same id in the same step, so an announcement of an earlier job does
      not mark a new one finished (short of an RPC that timed out and still reaches the holder).
    * No age-based sweep of unfinished directory entries: a job may wait here for any time, and
      only this queue can say it is gone (it does, when asked to complete an id it does not know)."""

    def __init__(self, ctx: Any, env: Any) -> None:
        super().__init__(ctx, env)
        self.env = env
        self.scheduler = DurabilityScheduler(ctx)
        self.storage = self.scheduler.storage
        self.config_error: dict[str, Any] | None = None
        try:
            settings = read_settings(env)
            retention_ms, request_wait_ms = settings.job_retention_ms, settings.request_wait_ms
            #: The RPC timeout of every permits message to the holder (ms).
            self.request_timeout_ms = settings.request_timeout_ms
        except VarError as exc:
            log.error("JobQueue: invalid configuration: %s", exc.message)
            self.config_error, retention_ms, request_wait_ms = exc.value(), DEFAULT_JOB_RETENTION_MS, 0
            self.request_timeout_ms = RPC_TIMEOUT_MS
        orphan_check_ms = DEFAULT_ORPHAN_CHECK_MS if self.config_error is not None else settings.orphan_check_ms
        self.client = SemaphoreClient(ctx, limits.with_(timeout(self.request_timeout_ms)).transport(env))
        self._outbox_ready = False
        self._queue_name: str | None = None
        self._directory_lock = asyncio.Lock()
        self._runs_ready = False
        #: How an in-Worker job waits out its ``workMs`` (seconds; tests give an event-driven one).
        self.sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep
        self.scheduler.on(ANNOUNCE_TIMER, self._announce_due)
        self.queue = SemaphoreQueue(client=self.client, scheduler=self.scheduler, on_admit=self.start_job,
                                    on_done=self._job_done, retention_ms=retention_ms,
                                    request_wait_ms=request_wait_ms, orphan_check_ms=orphan_check_ms)

    def start_job(self, item: QueueItem) -> Awaitable[None] | None:
        """Admission callback. The reference app's work is external: holding the permit while the
        job is ``running`` is the whole effect, so there is nothing to start here (and calling
        it twice for the same job, as the queue may after an eviction, is harmless). A job whose
        payload asks for ``workMs`` (:func:`work_ms`) is run here: the returned coroutine is
        the queue's task for it (:meth:`_run_job`)."""
        ms = work_ms(item.payload)
        return None if ms is None else self._run_job(item, ms)

    async def _run_job(self, item: QueueItem, ms: int) -> None:
        """An in-Worker job: record the attempt's start (row ``(job id, attempt)`` of
        ``app_job_runs``, with the permit), wait ``ms``, then write its end and complete the job
        (release its permit) in one synchronous step, with no await between them, so the
        runtime commits the two together: a run with an end is a job completed by it. An
        eviction (or a killed process) during the wait leaves the run without an end, and the
        queue calls this again under the same permit (R37): a new attempt, a new row."""
        if not self._runs_ready:
            self.storage.exec(f"CREATE TABLE IF NOT EXISTS {RUNS} (job_id TEXT NOT NULL, attempt INTEGER NOT NULL,"
                              " permit TEXT NOT NULL, started_at INTEGER NOT NULL, ended_at INTEGER,"
                              " PRIMARY KEY (job_id, attempt))")
            self._runs_ready = True
        permit = "" if item.permit is None else f"{item.permit.kind.value}:{item.permit.id}:{item.permit.slot}"
        self.storage.exec(f"INSERT INTO {RUNS}(job_id, attempt, permit, started_at) VALUES (?, ?, ?, ?)"
                          " ON CONFLICT(job_id, attempt) DO NOTHING",
                          item.item_id, item.attempts, permit, int(self.scheduler.clock()))
        await self.sleep(ms / 1000)
        self.storage.exec(f"UPDATE {RUNS} SET ended_at = ? WHERE job_id = ? AND attempt = ?",
                          int(self.scheduler.clock()), item.item_id, item.attempts)
        await self.queue.complete(item.item_id)  # its transaction runs before its first await
        await self._flush()

    async def runs(self, account: Any) -> dict[str, Any]:
        """The run records of this queue's in-Worker jobs and its alarm (admin route
        ``GET .../queues/{queue}/runs``): ``{"runs": [{"jobId", "attempt", "permit",
        "startedAt", "endedAt"}], "scheduler": <scheduler_view>}``. ``permit`` is
        ``"<grant|lease>:<id>:<slot>"``; ``endedAt`` is ``None`` for a run cut short (an eviction)
        or still going. Read only: creates nothing."""
        if self.config_error is not None:
            return self.config_error
        rows = []
        if has_tables(self.storage, [RUNS]):
            rows = [{"jobId": str(r["job_id"]), "attempt": int(r["attempt"]), "permit": str(r["permit"]),
                     "startedAt": int(r["started_at"]),
                     "endedAt": None if r["ended_at"] is None else int(r["ended_at"])}
                    for r in self.storage.exec(f"SELECT * FROM {RUNS} ORDER BY started_at, job_id, attempt")]
        return {"runs": rows, "scheduler": await scheduler_view(self.storage, self.scheduler)}

    async def enqueue(self, account: Any, job_id: Any, group: Any, payload: Any = None,
                      queue: Any = None) -> dict[str, Any]:
        """Queue a job (idempotent on ``job_id``). With ``queue`` (this object's queue name, as
        the front sends it) the job is first registered in the account's job directory: an id
        that belongs to another queue answers the error value ``conflict``, a holder that does
        not answer ``unavailable``; neither creates the job."""
        if self.config_error is not None:
            return self.config_error
        account, job_id, group = str(plain(account)), str(plain(job_id)), str(plain(group))
        queue = plain(queue)
        payload = plain(payload)
        problem = enqueue_problem(account, job_id, group, payload)
        if problem is not None:  # before the job is registered: nothing to undo
            return problem
        if queue is None:
            return await self._enqueue(account, job_id, group, payload, None)
        queue = str(queue)
        failed: dict[str, Any] | None = None
        async with self._directory_lock:  # no announcement is in flight while the job is registered
            try:
                reply = await self._holder_call(account, "register_job", job_id, queue)
            except DirectoryError as exc:
                # It may have been registered all the same (a lost reply): unless the job is
                # live here, tell the directory it is finished, so such an entry is forgotten.
                log.warning("JobQueue: registering job %r failed: %s", job_id, exc)
                self._ready(queue)
                item = self.queue.item(job_id)
                if item is None or item.state is ItemState.DONE:
                    self._announce_later(job_id, account, queue)
                return error_value("unavailable", f"the account's job directory did not answer: {exc}")
            owner = str(reply.get("queue"))
            if owner != queue:
                return error_value("conflict", f"job {job_id!r} already belongs to queue {owner!r}", "id")
            existed: bool | None = None
            try:
                self._ready(queue)
                existed = self.queue.item(job_id) is not None
                result = await self._enqueue(account, job_id, group, payload, queue)
            except Exception as exc:  # noqa: BLE001 - answered as an error value, the entry undone
                log.exception("JobQueue: creating job %r failed after its registration", job_id)
                checked_item, item = await self._withdraw(account, job_id, queue)
                reason = f"{type(exc).__name__}: {exc}"
                if item is not None:  # the failure came after the insert: the job is queued
                    result = await self._queued_anyway(item, existed is False, reason)
                elif checked_item:
                    failed = error_value("internal_error", f"job {job_id!r} could not be created "
                                                           f"({reason}); nothing was queued")
                else:
                    failed = error_value("internal_error", f"job {job_id!r} could not be created ({reason});"
                                                           " whether it was queued is unknown")
        if failed is not None:
            try:
                await self._flush()  # a notice the withdrawal left in the outbox
            except Exception:  # noqa: BLE001 - the timer sends it later; the answer stays a value
                log.exception("JobQueue: sending the outbox after a failed enqueue failed")
            return failed
        if result["job"]["state"] == ItemState.DONE.value:
            await self._flush()  # registering it again cleared its mark: announced again
        return result

    async def _withdraw(self, account: str, job_id: str, queue: str) -> tuple[bool, QueueItem | None]:
        """Creating ``job_id`` failed after it was registered (called under the directory lock):
        undo the registration so the directory never lists a job that does not exist. A job this
        queue does not have is dropped from the directory (:meth:`AccountLimit.forget_job`), or,
        if the holder does not answer that, announced finished through the outbox (so forgotten
        after the retention); a job it has (the failure came after its insert, or it was known)
        keeps its entry, announced again if it is ``done`` (registering cleared its mark).
        Answers ``(whether the queue could be read, the job if it exists)``."""
        try:
            item = self.queue.item(job_id)
        except Exception:  # noqa: BLE001 - storage unusable: nothing durable can be done here
            log.exception("JobQueue: cannot tell whether job %r exists; its directory entry stays", job_id)
            return False, None
        if item is not None:
            if item.state is ItemState.DONE:
                self._try_announce(job_id, account, queue)
            return True, item
        try:
            await self._holder_call(account, "forget_job", job_id, queue)
        except DirectoryError as exc:
            log.warning("JobQueue: withdrawing job %r failed: %s; announced finished instead", job_id, exc)
            self._try_announce(job_id, account, queue)
        return True, None

    async def _queued_anyway(self, item: QueueItem, created: bool, reason: str) -> dict[str, Any]:
        """The answer to an enqueue that failed after the job's insert committed (e.g. arming the
        alarm, :meth:`SemaphoreQueue.enqueue`'s last step): the job is queued and keeps its
        directory entry, so it is answered as created (a caller must not submit it again under
        another id: it would run twice), with a ``warning``. Its wake-up is armed again here; if
        that fails too, the wake-up stays stored and the next arm (any later write to this queue,
        or its alarm) schedules it."""
        try:
            await self.scheduler.arm()
            wake = "its wake-up was armed again"
        except Exception as exc:  # noqa: BLE001 - the wake stays stored for the next arm
            log.exception("JobQueue: arming the wake-up of job %r failed again", item.item_id)
            wake = (f"arming its wake-up failed again ({type(exc).__name__}: {exc}); it is retried at the"
                    " queue's next write or alarm")
        return {"job": job_view(item), "created": created,
                "warning": f"job {item.item_id!r} is queued, but a step after its insert failed ({reason}); {wake}"}

    def _try_announce(self, job_id: str, account: str, queue: str) -> None:
        try:
            self._announce_later(job_id, account, queue)
        except Exception:  # noqa: BLE001 - logged: the storage that failed the job fails this too
            log.exception("JobQueue: cannot put job %r in the outbox", job_id)

    async def _enqueue(self, account: str, job_id: str, group: str, payload: Any,
                       queue: str | None) -> dict[str, Any]:
        # No await from the check to the insert: the job is created in this step, together with
        # dropping any outbox row of an earlier job with the same id (one this queue forgot).
        known = self.queue.item(job_id)
        if known is None:
            self._drop_announcement(job_id)
        elif known.state is ItemState.DONE and queue is not None:
            self._announce_later(job_id, account, queue)
        item = await self.queue.enqueue(account, group, job_id, payload)
        return {"job": job_view(item), "created": known is None}

    async def complete(self, job_id: Any, account: Any = None, queue: Any = None) -> dict[str, Any]:
        """The job's work finished: release its permit (or cancel it if still queued). The
        account's job directory learns of it through the outbox once the job is ``done`` (at
        once, or, for a job still ``claiming``, when the pump resolves its claim). A job this
        queue does not know (``{"job": None}``), or one finished before, is announced again with
        ``account`` (the front sends it), so a directory entry the queue cannot finish any more is
        forgotten after the retention too."""
        if self.config_error is not None:
            return self.config_error
        job_id = str(plain(job_id))
        account, queue = plain(account), plain(queue)
        self._ready(None if queue is None else str(queue))
        changed = await self.queue.complete(job_id)
        item = self.queue.item(job_id)
        if item is not None and item.state is ItemState.DONE and not changed:
            self._announce_later(job_id, item.key, self._name())
        elif item is None and account is not None:
            self._announce_later(job_id, str(account), self._name())
        await self._flush()
        return {"job": None if item is None else job_view(item), "changed": changed}

    async def status(self, account: Any, with_payloads: Any = False) -> dict[str, Any]:
        """Every job of this queue (of ``account``) with its state. Payloads only
        ``with_payloads`` (the admin view; the public view's answer carries none over the RPC),
        and then at most :data:`MAX_VIEW_PAYLOAD_BYTES` of them in all: a job past that is
        listed without ``payload`` and with ``payloadOmitted`` true, and ``payloadsOmitted``
        counts them. Read only: a queue without its tables answers no jobs and creates nothing."""
        if self.config_error is not None:
            return self.config_error
        with_payloads = plain(with_payloads) is True
        empty: dict[str, Any] = {"jobs": [], "payloadsOmitted": 0} if with_payloads else {"jobs": []}
        if not has_tables(self.storage, QUEUE_TABLES):
            return empty
        jobs, room, omitted = [], MAX_VIEW_PAYLOAD_BYTES, 0
        for item in self.queue.items(key=str(plain(account))):
            view = job_view(item)
            payload = view.pop("payload")
            if with_payloads:
                size = len(json.dumps(payload))  # as stored (a NaN of an earlier version: the front's 500)
                if size <= room:
                    view["payload"], room = payload, room - size
                else:
                    view["payloadOmitted"], omitted = True, omitted + 1
            jobs.append(view)
        return {"jobs": jobs, "payloadsOmitted": omitted} if with_payloads else {"jobs": jobs}

    async def alarm(self, alarm_info: Any = None) -> None:
        if self.config_error is not None:
            raise VarError(self.config_error["error"]["field"], self.config_error["error"]["message"])
        if not self._outbox_ready and has_tables(self.storage, QUEUE_TABLES):
            self._ready(None)  # before the pump runs on_done (the outbox is written in a transaction)
        await self.scheduler.alarm(alarm_info)

    # -- the job directory's outbox ------------------------------------------------------
    def _ready(self, queue: str | None) -> None:
        """Create the outbox and settings tables (called outside any transaction, so the
        instance may remember they exist) and remember this object's queue name when the front
        gives it."""
        if not self._outbox_ready:
            self._create_tables()
            self._outbox_ready = True
        if queue is not None and self._name() != queue:
            self.storage.exec(f"INSERT INTO {QUEUE_SETTINGS}(key, value) VALUES ('queue', ?)"
                              " ON CONFLICT(key) DO UPDATE SET value = excluded.value", queue)
            self._queue_name = queue

    def _create_tables(self) -> None:
        self.storage.exec(f"CREATE TABLE IF NOT EXISTS {FINISHED} (job_id TEXT PRIMARY KEY,"
                          " account TEXT NOT NULL, queue TEXT, version INTEGER NOT NULL)")
        self.storage.exec(f"CREATE TABLE IF NOT EXISTS {QUEUE_SETTINGS} (key TEXT PRIMARY KEY,"
                          " value TEXT NOT NULL)")

    def _name(self) -> str | None:
        """This object's queue name (``None`` until the front named it, e.g. an earlier version's)."""
        if self._queue_name is None and has_tables(self.storage, [QUEUE_SETTINGS]):
            row = self.storage.one(f"SELECT value FROM {QUEUE_SETTINGS} WHERE key = 'queue'")
            self._queue_name = None if row is None else str(row["value"])
        return self._queue_name

    def _job_done(self, item: QueueItem) -> None:
        """The queue's ``on_done`` hook (in the queue's transaction that marks the hook as run):
        the job turned ``done``. The outbox row is durable once this returned."""
        self._announce_later(item.item_id, item.key, self._name())

    def _announce_later(self, job_id: str, account: str, queue: str | None) -> None:
        """Put ``job_id`` in the outbox (synchronous SQL, so it commits with the caller's
        transaction) and make sure the timer will send it. A row already there gets a new
        version, so an acknowledgement of an earlier send does not delete it."""
        if not self._outbox_ready:  # perhaps inside a transaction that may roll back: no flag
            self._create_tables()
        self.storage.exec(
            f"INSERT INTO {FINISHED}(job_id, account, queue, version) VALUES (?, ?, ?, 1)"
            " ON CONFLICT(job_id) DO UPDATE SET account = excluded.account, queue = excluded.queue,"
            " version = version + 1", job_id, account, queue)
        if self.scheduler.timer(ANNOUNCE_TIMER) is None:  # keep a backed-off retry as it is
            self.scheduler.set_timer(ANNOUNCE_TIMER, int(self.scheduler.clock()))

    def _drop_announcement(self, job_id: str) -> None:
        if has_tables(self.storage, [FINISHED]):
            self.storage.exec(f"DELETE FROM {FINISHED} WHERE job_id = ?", job_id)

    async def _announce(self) -> None:
        """Send the outbox (``finish_job``, oldest first, at most ``ANNOUNCE_BATCH``), deleting
        each row the holder acknowledges. Raises :class:`DirectoryError` at the first failure
        (the rest stays for the retry)."""
        if not has_tables(self.storage, [FINISHED]):
            return
        try:
            async with self._directory_lock:
                rows = self.storage.exec(f"SELECT job_id, account, queue, version FROM {FINISHED}"
                                         " ORDER BY rowid LIMIT ?", ANNOUNCE_BATCH)
                for r in rows:
                    job_id, queue = str(r["job_id"]), None if r["queue"] is None else str(r["queue"])
                    await self._holder_call(str(r["account"]), "finish_job", job_id, queue)
                    self.storage.exec(f"DELETE FROM {FINISHED} WHERE job_id = ? AND version = ?",
                                      job_id, int(r["version"]))
                if self.storage.one(f"SELECT job_id FROM {FINISHED} LIMIT 1") is None:
                    self.scheduler.clear_timer(ANNOUNCE_TIMER)
                else:  # the next batch, or rows written meanwhile
                    self.scheduler.set_timer(ANNOUNCE_TIMER, int(self.scheduler.clock()))
        finally:
            await self.scheduler.arm()

    async def _announce_due(self, name: str, due_at: int) -> None:
        """Timer handler: a failure raises, so the scheduler retries with its backoff."""
        await self._announce()

    async def _flush(self) -> None:
        """Send the outbox now; on failure it stays for the timer (already set)."""
        try:
            await self._announce()
        except DirectoryError as exc:
            log.warning("JobQueue: the job directory did not acknowledge: %s; retrying", exc)

    async def _holder_call(self, account: str, method: str, *args: Any) -> dict[str, Any]:
        """``method(*args)`` on the account's holder, bounded by ``RPC_TIMEOUT_MS``; anything but
        a plain answer (a failure, a timeout, an error value) raises :class:`DirectoryError`."""
        stub = holder(self.env, account)

        async def call() -> Any:
            return await getattr(stub, method)(*args)

        try:
            reply = plain(await asyncio.wait_for(call(), RPC_TIMEOUT_MS / 1000))
        except asyncio.CancelledError:
            raise
        except TimeoutError:  # asyncio.TimeoutError since Python 3.11
            raise DirectoryError(f"{method} to holder {account!r}: no answer within {RPC_TIMEOUT_MS} ms") from None
        except Exception as exc:  # JsException in the runtime
            raise DirectoryError(f"{method} to holder {account!r} failed: {exc}") from exc
        if not isinstance(reply, dict) or "error" in reply:
            raise DirectoryError(f"{method} to holder {account!r} answered {reply!r}")
        return reply


class AccountIndex(DurableObject):
    """The registry of accounts the Worker has seen, for ``GET /metrics`` (binding
    ``ACCOUNT_INDEX``, one object named ``accounts``).

    Written only by an account's ``AccountLimit``, once per holder instance, after a write that
    creates the holder's storage (:meth:`AccountLimit._register`): so only accounts some admin
    write reached are listed, and reads (``/usage``, ``/metrics``) never add one. Its table
    ``app_accounts`` is created by the first :meth:`add`; :meth:`accounts` creates nothing."""

    def __init__(self, ctx: Any, env: Any) -> None:
        super().__init__(ctx, env)
        self.storage = Storage(ctx)
        self._ready = False

    async def add(self, account: Any) -> dict[str, Any]:
        """List ``account`` (idempotent); an id outside the wire alphabet is the error value
        ``invalid_request``. Answers ``{"account"}``."""
        account = plain(account)
        problem = id_problem(account)
        if problem is not None:
            return error_value("invalid_request", f"account {problem}", "account")
        if not self._ready:
            self.storage.exec(f"CREATE TABLE IF NOT EXISTS {ACCOUNTS} (account TEXT PRIMARY KEY) WITHOUT ROWID")
            self._ready = True
        self.storage.exec(f"INSERT INTO {ACCOUNTS}(account) VALUES (?) ON CONFLICT(account) DO NOTHING", account)
        return {"account": account}

    async def accounts(self, limit: Any = METRICS_MAX_ACCOUNTS) -> dict[str, Any]:
        """The first ``limit`` accounts by name and how many there are: ``{"accounts": [...],
        "total": int}``. Read only."""
        if not has_tables(self.storage, [ACCOUNTS]):
            return {"accounts": [], "total": 0}
        count = max(0, min(int(plain(limit)), METRICS_MAX_ACCOUNTS))
        rows = self.storage.exec(f"SELECT account FROM {ACCOUNTS} ORDER BY account LIMIT ?", count)
        total = self.storage.one(f"SELECT COUNT(*) AS n FROM {ACCOUNTS}")
        return {"accounts": [str(r["account"]) for r in rows], "total": int(total["n"]) if total else 0}


# ------------------------------------------------------------------------------- HTTP front
class HttpError(Exception):
    """An HTTP error answer: ``status`` with the error value ``{"v": 1, "error": {...}}``."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field


def json_response(data: Any, status: int = 200) -> Response:
    """``data`` as strict JSON (:func:`to_json`). An answer JSON cannot carry (a non-finite
    number, e.g. in a payload an earlier version stored) is the JSON 500 ``internal_error``
    instead, never a body no JSON parser reads."""
    try:
        text = to_json(data)
    except (TypeError, ValueError) as exc:
        log.error("front: an answer is not JSON (%s)", exc)
        text, status = to_json(error_value(
            "internal_error", f"the answer holds a value JSON cannot carry (NaN or Infinity?): {exc}")), 500
    return Response(text, status=status, headers={"content-type": "application/json"})


def secret_token(env: Any, name: str) -> str:
    """The secret ``name`` (``ADMIN_TOKEN`` or ``READ_TOKEN``) without surrounding whitespace (a
    secret set with a stray newline is the token without it); ``""`` when absent or blank: not
    configured."""
    token = getattr(env, name, None)
    return "" if token is None else str(token).strip()


def admin_token(env: Any) -> str:
    """The secret ``ADMIN_TOKEN`` as :func:`secret_token` reads it."""
    return secret_token(env, "ADMIN_TOKEN")


def bearer(request: Any) -> bytes:
    """The request's ``Authorization`` header without its own surrounding whitespace (as HTTP
    does), as bytes for a constant-time comparison."""
    return (request.headers.get("authorization") or "").strip().encode()


def sends_token(request: Any, token: str) -> bool:
    """Whether the request carries ``Authorization: Bearer <token>`` (never for a blank token)."""
    return bool(token) and hmac.compare_digest(bearer(request), f"Bearer {token}".encode())


def require_admin(request: Any, env: Any) -> None:
    """401 unless the request carries ``Authorization: Bearer <ADMIN_TOKEN>`` (the token as
    :func:`admin_token` reads it); 403 for the read token, which changes nothing."""
    token = admin_token(env)
    if not token:
        raise HttpError(401, "unauthorized", "ADMIN_TOKEN is not configured; state changes are disabled")
    if sends_token(request, token):
        return
    if sends_token(request, secret_token(env, "READ_TOKEN")):
        raise HttpError(403, "forbidden", "READ_TOKEN allows reads only; this route needs ADMIN_TOKEN")
    raise HttpError(401, "unauthorized", "missing or wrong Authorization: Bearer token")


def require_reader(request: Any, env: Any) -> None:
    """For the operator's reading routes (holders, audit, metrics, scheduler, runs, ping): 401
    unless the request carries ``Authorization: Bearer`` the read token (secret ``READ_TOKEN``)
    or the admin token. With neither configured the answer says which secret to set."""
    admin, reader = admin_token(env), secret_token(env, "READ_TOKEN")
    if not admin and not reader:
        raise HttpError(401, "unauthorized", "no token is configured for this read: set the secret READ_TOKEN "
                        "(reads only) or ADMIN_TOKEN (reads and state changes), e.g. in .dev.vars under wrangler dev")
    if not (sends_token(request, admin) or sends_token(request, reader)):
        raise HttpError(401, "unauthorized", "missing or wrong Authorization: Bearer token "
                        "(READ_TOKEN or ADMIN_TOKEN)")


def is_admin(request: Any, env: Any) -> bool:
    """For public reading routes: ``False`` without an ``Authorization`` header (the public
    view) or with the read token, ``True`` with the right admin token, 401 with any other header
    value."""
    if not request.headers.get("authorization"):
        return False
    if sends_token(request, secret_token(env, "READ_TOKEN")):
        return False
    require_admin(request, env)
    return True


async def read_json(request: Any) -> dict[str, Any]:
    """The request's body, a JSON object (empty: ``{}``). A body over :data:`MAX_BODY_BYTES` is
    413 ``payload_too_large``, before any scan or parse. It is read first, even when its
    ``Content-Length`` already says it is too long: an answer sent before the body was read
    cuts the client off while it still sends (a "broken pipe" instead of the 413, seen on a
    loaded machine in workerd). Anything :func:`parse_json` refuses (malformed,
    ``NaN``/``Infinity``, nested deeper than :data:`MAX_JSON_DEPTH`) is 400 ``invalid_json``
    saying why; so is a body that is not an object."""
    over = f"over the {MAX_BODY_BYTES} the Worker reads (twice the {MAX_PAYLOAD_BYTES} of a job's payload)"
    text = await request.text()
    if not text:
        return {}
    if len(text) > MAX_BODY_BYTES:
        raise HttpError(413, "payload_too_large", f"request body is {len(text)} characters, {over}")
    try:
        body = parse_json(text)
    except JsonError as exc:
        raise HttpError(400, "invalid_json", f"request body: {exc}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "invalid_json", "request body must be a JSON object")
    return body


def checked(reply: Any) -> Any:
    """An RPC method's answer as plain Python; an object's ``configuration_error`` value becomes
    the front's 500 answer carrying it."""
    reply = plain(reply)
    error = reply.get("error") if isinstance(reply, dict) else None
    if isinstance(error, dict) and error.get("code") == CONFIG_ERROR:
        raise HttpError(500, CONFIG_ERROR, str(error.get("message", "")), error.get("field"))
    return reply


#: Most entries one page of ``holders``/``audit`` may ask for (the semaphore's bound).
MAX_PAGE = 1000


def page_problem(cursor: Any, limit: Any, *, int_cursor: bool) -> dict[str, Any] | None:
    """The ``invalid_request`` error value of a bad page request, else ``None``: ``limit`` an
    int from 1 to ``MAX_PAGE``; ``cursor`` ``None`` or the previous page's (a positive int for
    the audit log, an id for the holders)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
        return error_value("invalid_request", f"limit must be an integer from 1 to {MAX_PAGE}", "limit")
    if cursor is None:
        return None
    bad = (isinstance(cursor, bool) or not isinstance(cursor, int) or not 1 <= cursor < 2**53) if int_cursor \
        else id_problem(cursor) is not None
    if bad:
        return error_value("invalid_request", "cursor must be the cursor of the previous page", "cursor")
    return None


def page_query(request: Any, *, int_cursor: bool) -> tuple[Any, Any]:
    """``(cursor, limit)`` from the query string (``?cursor=...&limit=...``; defaults ``None``,
    100); a malformed number is HTTP 400 naming it (the rest is checked by :func:`page_problem`)."""
    query = parse_qs(urlparse(request.url).query)

    def one(name: str) -> str | None:
        values = query.get(name)
        return None if not values else values[-1]

    raw_limit, cursor = one("limit"), one("cursor")
    try:
        limit = 100 if raw_limit is None else int(raw_limit)
    except ValueError:
        raise HttpError(400, "invalid_request", f"limit must be an integer from 1 to {MAX_PAGE}", "limit") from None
    if cursor is not None and int_cursor:
        try:
            return int(cursor), limit
        except ValueError:
            raise HttpError(400, "invalid_request", "cursor must be the cursor of the previous page",
                            "cursor") from None
    return cursor, limit


def holder(env: Any, account: str) -> Any:
    return env.ACCOUNT_LIMIT.getByName(account)


def job_queue(env: Any, account: str, queue: str) -> Any:
    # An unambiguous name: "a:b" + "c" and "a" + "b:c" must be different objects.
    return env.JOB_QUEUE.getByName(to_json([account, queue]))


#: ``GET /metrics``'s content type (the Prometheus text exposition format).
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: The metric families of ``GET /metrics``: (name, type, help, labels beyond ``account``).
METRIC_FAMILIES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("semaphore_up", "gauge", "1 if the account's holder answered this scrape, else 0.", ()),
    ("semaphore_charged", "gauge", "Charged capacity: outstanding grant permits plus lease footprint.", ()),
    ("semaphore_limit", "gauge", "The account's limit (absent when it cannot be resolved).", ()),
    ("semaphore_available", "gauge", "What one new grant request could get now (absent if unknown).", ()),
    ("semaphore_group_charged", "gauge", "Charged capacity per group.", ("group",)),
    ("semaphore_rounds_total", "counter", "Allocation rounds committed by the account's holder.", ()),
    ("semaphore_failed_rounds_total", "counter", "Allocation rounds that failed (nothing written).", ()),
    ("semaphore_admitted_total", "counter", "Permits granted in new grants, over all rounds.", ()),
    ("semaphore_blocked_total", "counter",
     "Permits left waiting per round, by blocked reason, summed over rounds.", ("reason",)),
)


def label_value(value: str) -> str:
    """A Prometheus label value, escaped (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _metric_samples(account: str, answer: dict[str, Any] | None) -> dict[str, list[tuple[tuple[str, ...], Any]]]:
    """One account's samples per family: ``{family: [(extra label values, value)]}``."""
    out: dict[str, list[tuple[tuple[str, ...], Any]]] = {"semaphore_up": [((), 0 if answer is None else 1)]}
    if answer is None:
        return out
    usage, counters = answer.get("usage") or {}, answer.get("counters") or {}
    for family, key in (("semaphore_charged", "charged"), ("semaphore_limit", "limit"),
                        ("semaphore_available", "available")):
        if isinstance(usage.get(key), int):
            out[family] = [((), usage[key])]
    groups = usage.get("groups") or {}
    out["semaphore_group_charged"] = [((g,), groups[g].get("charged", 0)) for g in sorted(groups)]
    for family, key in (("semaphore_rounds_total", "rounds"), ("semaphore_failed_rounds_total", "failed_rounds"),
                        ("semaphore_admitted_total", "admitted")):
        out[family] = [((), counters.get(key, 0))]
    out["semaphore_blocked_total"] = [((name[len("blocked:"):],), n) for name, n in sorted(counters.items())
                                      if name.startswith("blocked:")]
    return out


def render_metrics(total: int, answers: list[tuple[str, dict[str, Any] | None]]) -> str:
    """The Prometheus text of ``GET /metrics``: ``semaphore_accounts`` (accounts in the registry),
    then every family of :data:`METRIC_FAMILIES` for each ``(account, metrics() answer or None
    when the holder did not answer)``, each family with its ``HELP`` and ``TYPE`` lines."""
    lines = ["# HELP semaphore_accounts Accounts the Worker has seen (the AccountIndex); "
             f"at most {METRICS_MAX_ACCOUNTS} are listed.", "# TYPE semaphore_accounts gauge",
             f"semaphore_accounts {int(total)}"]
    samples = [(account, _metric_samples(account, answer)) for account, answer in answers]
    for family, kind, help_text, labels in METRIC_FAMILIES:
        lines += [f"# HELP {family} {help_text}", f"# TYPE {family} {kind}"]
        for account, per_family in samples:
            for values, value in per_family.get(family, []):
                pairs = [("account", account), *zip(labels, values)]
                rendered = ",".join(f'{k}="{label_value(str(v))}"' for k, v in pairs)
                lines.append(f"{family}{{{rendered}}} {int(value)}")
    return "\n".join(lines) + "\n"


async def account_metrics(env: Any, accounts: list[str]) -> list[tuple[str, dict[str, Any] | None]]:
    """Each account's holder ``metrics()``, ``METRICS_CONCURRENCY`` at a time, each bounded by
    ``RPC_TIMEOUT_MS``; ``None`` for a holder that failed, timed out or answered an error."""

    async def one(account: str) -> dict[str, Any] | None:
        try:
            reply = plain(await asyncio.wait_for(holder(env, account).metrics(), RPC_TIMEOUT_MS / 1000))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("metrics: holder %r did not answer", account)
            return None
        return reply if isinstance(reply, dict) and "error" not in reply else None

    out: list[tuple[str, dict[str, Any] | None]] = []
    for i in range(0, len(accounts), METRICS_CONCURRENCY):
        chunk = accounts[i:i + METRICS_CONCURRENCY]
        out += zip(chunk, await asyncio.gather(*(one(a) for a in chunk)))
    return out


def identifier(value: Any, name: str) -> str:
    """``value`` if it is in the wire's id alphabet (``semaphore.wire.id_problem``: 1 to 256
    characters, no control characters or surrogates), else HTTP 400 naming ``name``."""
    problem = id_problem(value)
    if problem is not None:
        raise HttpError(400, "invalid_request", f"{name} {problem}")
    return value


#: ``POST .../jobs``: the HTTP status of each error value code ``JobQueue.enqueue`` answers
#: (any other, e.g. ``unavailable``: 503).
ENQUEUE_STATUS = {"conflict": 409, "invalid_request": 400, "payload_too_large": 413, "internal_error": 500}

ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(r"^/healthz$"), "healthz"),
    ("GET", re.compile(r"^/metrics$"), "metrics"),
    ("GET", re.compile(r"^/$"), "dashboard"),
    ("GET", re.compile(r"^/accounts/([^/]+)/usage$"), "usage"),
    ("GET", re.compile(r"^/accounts/([^/]+)/ping$"), "ping"),
    ("PUT", re.compile(r"^/accounts/([^/]+)/limit$"), "set_limit"),
    ("POST", re.compile(r"^/accounts/([^/]+)/queues/([^/]+)/jobs$"), "enqueue"),
    ("GET", re.compile(r"^/accounts/([^/]+)/queues/([^/]+)$"), "queue_status"),
    ("GET", re.compile(r"^/accounts/([^/]+)/queues/([^/]+)/runs$"), "queue_runs"),
    ("GET", re.compile(r"^/accounts/([^/]+)/scheduler$"), "scheduler"),
    ("POST", re.compile(r"^/accounts/([^/]+)/jobs/([^/]+)/complete$"), "complete"),
    ("POST", re.compile(r"^/accounts/([^/]+)/permits$"), "permits"),
    ("GET", re.compile(r"^/accounts/([^/]+)/holders$"), "holders"),
    ("POST", re.compile(r"^/accounts/([^/]+)/holders/([^/]+)/settle$"), "settle"),
    ("GET", re.compile(r"^/accounts/([^/]+)/audit$"), "audit"),
]


class Default(WorkerEntrypoint):
    """HTTP front. Every answer is JSON; errors are ``{"v": 1, "error": {"code", "message"}}``.

    Routes that write need the admin token; the reading routes (usage, queue status) need none,
    create no storage, and show job payloads only to the admin token. With an invalid
    ``[vars]`` entry every request (``/healthz`` too) is answered 500 with the error value
    ``configuration_error`` naming it, before any object is reached."""

    async def fetch(self, request: Any) -> Response:
        path = urlparse(request.url).path
        method = str(request.method).upper()
        try:
            read_settings(self.env)
        except VarError as exc:
            return json_response(exc.value(), 500)
        try:
            for route_method, pattern, name in ROUTES:
                match = pattern.match(path)
                if match:
                    if route_method != method:
                        continue
                    params = [identifier(unquote(p), "path segment") for p in match.groups()]
                    return await getattr(self, f"route_{name}")(request, *params)
            if any(p.match(path) for _, p, _ in ROUTES):
                raise HttpError(405, "method_not_allowed", f"{method} is not allowed on {path}")
            raise HttpError(404, "not_found", f"no route for {path}")
        except HttpError as exc:
            return json_response(error_value(exc.code, exc.message, exc.field), exc.status)

    async def route_healthz(self, request: Any) -> Response:
        return json_response({"ok": True})

    async def route_metrics(self, request: Any) -> Response:
        """Read token or admin (it names every account): Prometheus text of the accounts the ``AccountIndex``
        lists, at most ``METRICS_MAX_ACCOUNTS`` (:func:`render_metrics`). Creates no storage."""
        require_reader(request, self.env)
        index = getattr(self.env, "ACCOUNT_INDEX", None)
        listed = {"accounts": [], "total": 0}
        if index is not None:
            listed = checked(await index.getByName(ACCOUNT_INDEX_NAME).accounts(METRICS_MAX_ACCOUNTS))
        answers = await account_metrics(self.env, [str(a) for a in listed["accounts"]])
        return Response(render_metrics(int(listed["total"]), answers), status=200,
                        headers={"content-type": PROMETHEUS_CONTENT_TYPE})

    async def route_dashboard(self, request: Any) -> Response:
        """Public: the operations page (``src/dashboard.py``: one HTML page, inline CSS and JS, no
        external resources). It reads the JSON routes itself; the admin token it may send is typed
        into the page and kept in the tab's ``sessionStorage``, never in the URL."""
        return Response(dashboard.PAGE, status=200, headers=dict(dashboard.HEADERS))

    async def route_holders(self, request: Any, account: str) -> Response:
        """Read token or admin: one page of the account's holders (``?cursor=&limit=``). Creates no storage."""
        require_reader(request, self.env)
        cursor, limit = page_query(request, int_cursor=False)
        result = checked(await holder(self.env, account).holders(cursor, limit))
        return json_response(result, 400 if "error" in result else 200)

    async def route_audit(self, request: Any, account: str) -> Response:
        """Read token or admin: one page of the account's audit log, newest first. Creates no storage."""
        require_reader(request, self.env)
        cursor, limit = page_query(request, int_cursor=True)
        result = checked(await holder(self.env, account).audit(cursor, limit))
        return json_response(result, 400 if "error" in result else 200)

    async def route_settle(self, request: Any, account: str, client_id: str) -> Response:
        """Admin: force-settle one client (body ``{"reason": str, "actor"?: str}``); answers the
        audit record. 404 (nothing created) when the account's holder has no state."""
        require_admin(request, self.env)
        body = await read_json(request)
        result = checked(await holder(self.env, account).force_settle(client_id, body.get("reason"),
                                                                      body.get("actor")))
        error = result.get("error")
        if isinstance(error, dict):
            return json_response(result, 404 if error.get("code") == "not_found" else 400)
        return json_response(result)

    async def route_ping(self, request: Any, account: str) -> Response:
        """Read token or admin, a benchmark and diagnostics aid: one no-op RPC to the account's holder
        (:meth:`AccountLimit.ping`: no storage read or written, nothing created), answering its
        instance's tally of ``permits`` messages. ``scripts/bench_runtime.py`` measures against it."""
        require_reader(request, self.env)
        return json_response(checked(await holder(self.env, account).ping()))

    async def route_usage(self, request: Any, account: str) -> Response:
        """Public: the holder's usage (counts, limits, group names). Creates no storage."""
        return json_response(checked(await holder(self.env, account).usage()))

    async def route_set_limit(self, request: Any, account: str) -> Response:
        require_admin(request, self.env)
        body = await read_json(request)
        if "limit" not in body:
            raise HttpError(400, "invalid_limit", "body must be {\"limit\": int >= 0 | null}", "limit")
        result = checked(await holder(self.env, account).set_limit(body["limit"]))
        if "error" in result:
            return json_response(result, 400)
        return json_response(result)

    async def route_enqueue(self, request: Any, account: str, queue: str) -> Response:
        require_admin(request, self.env)
        body = await read_json(request)
        job_id = identifier(body.get("id"), "id")
        group = identifier(body.get("group", "default"), "group")
        payload = body.get("payload")
        problem = payload_problem(payload)  # before any object is reached
        if problem is not None:
            return json_response(problem, ENQUEUE_STATUS[problem["error"]["code"]])
        # The queue registers the job in the account's directory itself (409 if the id belongs to
        # another queue, 503 if the holder does not answer), then creates it (a failure there:
        # 500, the registration undone).
        result = checked(await job_queue(self.env, account, queue).enqueue(account, job_id, group, payload, queue))
        error = result.get("error")
        if isinstance(error, dict):
            return json_response(result, ENQUEUE_STATUS.get(str(error.get("code")), 503))
        return json_response(result, 201 if result["created"] else 200)

    async def route_complete(self, request: Any, account: str, job_id: str) -> Response:
        require_admin(request, self.env)
        found = checked(await holder(self.env, account).find_job(job_id))
        if found["queue"] is None:
            raise HttpError(404, "not_found", f"no job {job_id!r} in account {account!r}")
        # The queue tells the directory once the job is done (also when it turns done later, in
        # its pump, or when the queue does not know it: the entry is forgotten after the retention).
        result = checked(await job_queue(self.env, account, found["queue"]).complete(job_id, account, found["queue"]))
        if result["job"] is None:
            raise HttpError(404, "not_found", f"no job {job_id!r} in queue {found['queue']!r}")
        return json_response(result)

    async def route_queue_status(self, request: Any, account: str, queue: str) -> Response:
        """Public: the queue's jobs without their payloads; with the admin token, with them (at
        most :data:`MAX_VIEW_PAYLOAD_BYTES` in all, :meth:`JobQueue.status`). Creates no storage
        (a queue never written to answers no jobs)."""
        admin = is_admin(request, self.env)
        # The public view asks for no payloads, so none crosses the RPC (the admin's: capped).
        result = checked(await job_queue(self.env, account, queue).status(account, admin))
        if not admin:
            for job in result["jobs"]:
                job.pop("payload", None)
        return json_response({"account": account, "queue": queue, **result})

    async def route_queue_runs(self, request: Any, account: str, queue: str) -> Response:
        """Read token or admin: the queue's run records of in-Worker jobs and its alarm (:meth:`JobQueue.runs`).
        Creates no storage."""
        require_reader(request, self.env)
        return json_response(checked(await job_queue(self.env, account, queue).runs(account)))

    async def route_scheduler(self, request: Any, account: str) -> Response:
        """Read token or admin, a diagnostics aid: the account's holder's alarm and what is due on it
        (:meth:`AccountLimit.scheduler_state`). Creates no storage."""
        require_reader(request, self.env)
        return json_response(checked(await holder(self.env, account).scheduler_state()))

    async def route_permits(self, request: Any, account: str) -> Response:
        """Operator endpoint: one wire message straight to the account's holder (SPEC §3), e.g.
        to inspect a client's grants with a ``sync``. Admin only."""
        require_admin(request, self.env)
        body = await read_json(request)
        # As JSON text both ways (SPEC R7 "JSON text"): one string each way across the RPC, and
        # the reply's text is the response body as it came.
        answer = plain(await holder(self.env, account).permits(json_text.encode(body)))
        # An object from a holder that takes only objects (an earlier release mid-deployment) is
        # the reply itself; its refusal of the text is answered as any invalid_message.
        result = checked(json_text.decode(answer) if isinstance(answer, str) else answer)
        error = result.get("error") if isinstance(result, dict) else None
        if isinstance(error, dict):  # an error value (SPEC R7): not a 200
            return json_response(result, 400 if error.get("code") == "invalid_message" else 503)
        if isinstance(answer, str):
            return Response(answer, status=200, headers={"content-type": "application/json"})
        return json_response(result)
