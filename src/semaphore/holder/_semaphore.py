"""DurabilitySemaphore: the holder side of the shared concurrency budget (SPEC §2-§7, §9)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import itertools
import logging
import re
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable, Mapping, NamedTuple, Union

from ..core.allocation import LIMIT_ERROR, Allocation, Entry, Usage, allocate, ceiling
from ..clock import sleep_until
from ..core.config import LeaseConfig, LimitedGroups
from ..errors import ConfigurationError, InvalidMessageError, RoundFailedError
from ..runtime import Storage, object_id
from ..scheduler import DurabilityScheduler
from ._store import (
    GROUPS,
    JSON_IDS,
    SCHEMA_VERSION,
    GrantRow,
    LeaseRow,
    UnitOfWork,
    chunks,
    drop_schema,
    ensure_schema,
    read_meta,
    json_list,
)
from ..core.wire import (
    GrantReport,
    GrantState,
    GrantStatus,
    LeaseReport,
    LeaseState,
    LeaseStatus,
    MAX_ID_LENGTH,
    MAX_INT,
    WIRE_VERSION,
    PermitRequest,
    SyncMessage,
    id_problem,
    parse_message,
)

if TYPE_CHECKING:  # rpc is the client side: the holder module does not import it at run time
    from ..rpc import Invoke, SemaphoreRpc, Transform

__all__ = ["DurabilitySemaphore", "LimitOption", "GroupLimitOption", "CanGrantOption"]

log = logging.getLogger("semaphore.holder")

LimitOption = Union[int, Callable[[], Union[int, Awaitable[int]]]]
GroupLimitOption = Union[
    None, int, Mapping[str, int], Callable[[str], Union[int, None, Awaitable[Union[int, None]]]]
]
CanGrantOption = Union[None, bool, Callable[[str, str], Union[bool, Awaitable[bool]]]]

RECLAIM_TIMER = "durability_semaphore:reclaim"
TIMER_PREFIX = "durability_semaphore:"

# ---------------------------------------------------------------- verifiable lease ids (R32)
#: Meta rows holding the holder's per-storage lease-id secret (used when no ``lease_secret`` is
#: configured): 8 words of 32 bits (32 random bytes). Meta values are integers, and 32-bit words
#: cross the JavaScript boundary of Durable Object SQL exactly (a JS number holds integers below
#: 2**53 only).
LEASE_KEY_PREFIX = "lease_key_"
LEASE_KEY_WORDS = 8
#: Meta row holding the storage epoch: a random 32-bit number drawn with the storage's lease-id
#: state (first lease-issuing round), so a fresh or reset storage gets a new one. Every lease id
#: carries the epoch it was issued in: a verified unknown id of the current epoch is a lease this
#: storage settled, one of another epoch was issued before a storage reset (SPEC R32).
LEASE_EPOCH_KEY = "lease_epoch"
LEASE_EPOCH_CHARS = 8  # 32 bits, lower-case hex
#: Hex characters of the truncated HMAC-SHA256 that ends every lease id (128 bits).
LEASE_MAC_CHARS = 32
#: Decimal digits of the permits field: a lease carries fewer than 2**53 permits (R7).
LEASE_PERMITS_CHARS = 16
#: Longest nonce ``id_factory`` may return for a lease: the holder appends
#: ``"." + epoch + "." + permits + "." + mac`` (at most 59 characters) and the id must stay
#: within the wire's 256 characters (R7).
LEASE_NONCE_MAX = MAX_ID_LENGTH - (3 + LEASE_EPOCH_CHARS + LEASE_PERMITS_CHARS + LEASE_MAC_CHARS)
#: Fewest bytes (UTF-8 for a ``str``) a configured ``lease_secret`` must have.
LEASE_SECRET_MIN_BYTES = 16
_LEASE_MAC_DOMAIN = b"durability-semaphore/lease-id/v2\0"
_EPOCH_DOMAIN = b"durability-semaphore/storage-epoch/v1\0"
_EPOCH_FIELD = re.compile(r"[0-9a-f]{8}")
_PERMITS_FIELD = re.compile(r"[1-9][0-9]{0,15}")
_MAC_FIELD = re.compile(r"[0-9a-f]{32}")


class LeaseIdParts(NamedTuple):
    """The fields of a lease id (SPEC R32): ``<nonce>.<epoch>.<permits>.<mac>``."""

    nonce: str
    epoch: int
    permits: int


def _lease_secret(meta: Mapping[str, int]) -> bytes | None:
    """The per-storage lease-id secret stored in ``meta`` (the rows already loaded by the round),
    or ``None`` if this storage never issued a lease without ``lease_secret`` (or was reset)."""
    words: list[int] = []
    for i in range(LEASE_KEY_WORDS):
        w = meta.get(f"{LEASE_KEY_PREFIX}{i}")
        if w is None or not 0 <= w < 2**32:
            return None
        words.append(w)
    return b"".join(int(w).to_bytes(4, "big") for w in words)


def _lease_epoch(meta: Mapping[str, int]) -> int | None:
    """The storage epoch stored in ``meta``, or ``None`` if this storage never issued a lease."""
    epoch = meta.get(LEASE_EPOCH_KEY)
    return epoch if epoch is not None and 0 <= epoch < 2**32 else None


def _epoch_from(seed: bytes) -> int:
    # One-way: the epoch is public (in every id) and may come from the same seed as the secret.
    return int.from_bytes(hashlib.sha256(_EPOCH_DOMAIN + seed).digest()[:4], "big")


def _holder_key(secret: bytes | None, ctx: Any) -> bytes | None:
    """The MAC key of this holder under the application's ``lease_secret``: HMAC of the holder
    object's id (``ctx.id``), so holders sharing one secret (one per key) never accept each
    other's lease ids, while a holder whose storage was reset (same id) still does (R32)."""
    if secret is None:
        return None
    ident = object_id(ctx)
    if ident is None:
        raise ConfigurationError("lease_secret: needs the holder object's ctx (with an id), "
                                 "not a bare Storage", field="lease_secret")
    return hmac.new(secret, b"durability-semaphore lease key\0" + ident.encode("utf-8"),
                    hashlib.sha256).digest()


def _configured_secret(value: Any) -> bytes | None:
    """The ``lease_secret`` option as bytes (``str`` as UTF-8), validated."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            key = value.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigurationError("lease_secret: must encode as UTF-8", field="lease_secret") from None
    elif isinstance(value, bytes):
        key = value
    else:
        raise ConfigurationError("lease_secret: expected a str, bytes or None", field="lease_secret")
    if len(key) < LEASE_SECRET_MIN_BYTES:
        raise ConfigurationError(
            f"lease_secret: must have at least {LEASE_SECRET_MIN_BYTES} bytes (use a random "
            f"application secret, e.g. a Worker secret binding)", field="lease_secret")
    return key


def _lease_mac(secret: bytes, client_id: str, nonce: str, epoch: str, permits: str) -> str:
    # Client ids and nonces cannot contain NUL (wire.id_problem), epoch and permits are hex and
    # decimal digits: the NUL-separated message is unambiguous.
    fields = (client_id, nonce, epoch, permits)
    message = _LEASE_MAC_DOMAIN + b"\0".join(f.encode("utf-8", "surrogatepass") for f in fields)
    return hmac.new(secret, message, hashlib.sha256).hexdigest()[:LEASE_MAC_CHARS]


def lease_id_for(secret: bytes, client_id: str, nonce: str, epoch: int, permits: int) -> str:
    """The lease id the holder issues to ``client_id``: ``<nonce>.<epoch>.<permits>.<mac>``, with
    ``epoch`` the storage epoch in 8 hex digits, ``permits`` the lease's permits in decimal and
    ``mac`` the first 32 hex digits of HMAC-SHA256(secret, domain + clientId, nonce, epoch and
    permits, NUL-separated) (SPEC R32)."""
    e, p = f"{epoch:08x}", str(permits)
    return f"{nonce}.{e}.{p}.{_lease_mac(secret, client_id, nonce, e, p)}"


def _split_lease_id(lease_id: str) -> tuple[str, str, str, str] | None:
    """``(nonce, epoch, permits, mac)`` of an id of the lease-id shape, else ``None``."""
    parts = lease_id.rsplit(".", 3)
    if len(parts) != 4:
        return None
    nonce, epoch, permits, mac = parts
    if not (nonce and _EPOCH_FIELD.fullmatch(epoch) and _PERMITS_FIELD.fullmatch(permits)
            and _MAC_FIELD.fullmatch(mac)):
        return None
    return nonce, epoch, permits, mac


def _mac_matches(secret: bytes, client_id: str, fields: tuple[str, str, str, str]) -> bool:
    nonce, epoch, permits, mac = fields  # constant-time comparison of the mac
    expected = _lease_mac(secret, client_id, nonce, epoch, permits)
    return hmac.compare_digest(expected.encode("ascii"), mac.encode("ascii"))


def verified_lease_id(secret: bytes, client_id: str, lease_id: str) -> LeaseIdParts | None:
    """The fields of ``lease_id`` if it is one issued under ``secret`` to ``client_id``, else
    ``None``: a fabricated id, another client's id, or one issued under another secret (a
    per-storage secret before a reset) or in an earlier format does not verify."""
    fields = _split_lease_id(lease_id)
    if fields is None or not _mac_matches(secret, client_id, fields):
        return None
    return LeaseIdParts(fields[0], int(fields[1], 16), int(fields[2]))


def _pre_reset_permits(secret: bytes, client_id: str, lease_id: str, epoch: int | None) -> int:
    """SPEC R32: the permits of ``lease_id`` if it verifies for ``client_id`` and was issued in
    another epoch than ``epoch`` (the storage's, ``None`` before its first lease), else 0. The
    epoch is compared before the mac is computed: a replayed id of this storage costs no HMAC."""
    fields = _split_lease_id(lease_id)
    if fields is None or (epoch is not None and int(fields[1], 16) == epoch):
        return 0
    return int(fields[2]) if _mac_matches(secret, client_id, fields) else 0


def lease_id_verifies(secret: bytes, client_id: str, lease_id: str) -> bool:
    """Whether ``lease_id`` is one issued under ``secret`` to ``client_id``
    (:func:`verified_lease_id`)."""
    return verified_lease_id(secret, client_id, lease_id) is not None


@dataclass
class _Pending:
    """One client's requests waiting for the next round (SPEC R10: latest demand wins, every
    report is applied, every call gets the round's answer)."""

    client_id: str
    arrival: int
    messages: list[PermitRequest] = field(default_factory=list)
    futures: list[asyncio.Future[dict[str, Any]]] = field(default_factory=list)

    @property
    def latest(self) -> PermitRequest:
        return self.messages[-1]


@dataclass
class _View:
    """What one client is told about its grants and leases, built during a transaction."""

    grants: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> wire GrantState
    leases: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> wire LeaseState
    #: Reports of leases the holder does not know (R32): id -> the report's ``drawn - released``
    #: (the round charges those whose id verifies for the client and carries another storage
    #: epoch, see _unknown_lease_charge).
    unknown_leases: dict[str, int] = field(default_factory=dict)


def _valid_count(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and 0 <= value <= MAX_INT:
        return value
    return None


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


def _option_int(value: Any, name: str, minimum: int) -> int:
    # isinstance(value, int) first: it is what narrows ``value`` to int for the return.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigurationError(f"{name}: must be an integer >= {minimum}, got {value!r}", field=name)
    return value


class DurabilitySemaphore:
    """The holder of one shared concurrency budget, inside an application's Durable Object.

    :param scheduler: the object's :class:`DurabilityScheduler` (its ``alarm()`` must delegate to
        ``scheduler.alarm``). The semaphore uses the scheduler's storage and registers its reclaim
        timer ``durability_semaphore:reclaim`` on it.
    :param limit: the shared limit: an ``int`` >= 0, or a callable (sync or async) returning one,
        resolved once per round (SPEC R12). If it raises or returns something else, the round
        admits nothing (``limit_resolution_error``) but still applies reports.
    :param group_limit: per-group ceilings under the limit: ``None`` (no group limits), an ``int``
        for every group, a mapping ``{group: limit}`` (groups absent have none), or a callable
        ``group -> int | None`` (sync or async), resolved once per group per round. A group whose
        limit raises fails closed for that round (``limit_resolution_error``).
    :param can_grant: ``None`` (everything permitted), a ``bool``, or a callable
        ``(client_id, group) -> bool`` (sync or async) resolved once per ``(client, group)`` per
        round; ``False`` blocks the entry with ``not_permitted`` (SPEC R22). A callable that
        raises counts as ``False`` (fails closed) and is logged.
    :param round_wait_ms: a round runs this long after the first request waiting for it arrived
        (default 1000, SPEC R9).
    :param round_period_ms: ... but never sooner than this after the previous round began
        (default 2000, SPEC R9).
    :param grant_timeout_ms: unclaimed grant permits are reclaimed this long after issue
        (default 10000, SPEC R15).
    :param leases: lease options (SPEC §7), see :class:`~semaphore.config.LeaseConfig`;
        ``None`` (default) issues no leases.
    :param clock: callable returning epoch milliseconds (default: wall clock). A clock with an
        ``async sleep_until(ms)`` method (e.g. :class:`~semaphore.testing.VirtualClock`) also
        drives the round timer.
    :param id_factory: callable returning a fresh unique id for grants and leases (default:
        96 random bits in hex). Ids must never repeat, even across :meth:`migrate`. For a lease
        it is the nonce of the id ``<nonce>.<epoch>.<permits>.<mac>`` (SPEC R32, see
        :meth:`_unknown_lease_charge`), so it must be a valid wire id (:func:`~semaphore.wire.id_problem`)
        of at most :data:`LEASE_NONCE_MAX` (197) characters; anything else fails the round with
        a :class:`~semaphore.errors.ConfigurationError` (``round_failed``, nothing written).
    :param lease_secret: an application secret (``str`` or ``bytes``, at least 16 bytes, e.g. a
        Worker secret binding such as ``env.LEASE_SECRET``) under which lease ids are
        authenticated. It lives outside the holder's storage, so lease ids issued before a
        storage reset (``migrate(ctx, None)``, ``deleteAll()``, a re-created holder) still
        verify afterwards, and the work their clients still run under them is charged (R32).
        ``None`` (default): a random secret created per storage (meta rows) is used instead;
        after a reset old ids cannot verify and are charged nothing, so until those clients
        settle the holder may admit up to a full limit on top of work still running. Keep it
        unchanged across resets: ids issued under an earlier secret no longer verify.
    :param secret_factory: callable returning 32 random bytes, called at most once per storage
        (inside a round's transaction) when the holder creates its lease-id state: the
        per-storage secret (kept only when ``lease_secret`` is ``None``) and the storage epoch
        (derived one-way from them). Default: ``secrets.token_bytes(32)``. For deterministic
        tests only; anything predictable lets clients forge lease ids.

    Lease ids are verifiable: every lease id is ``<id_factory()>.<epoch>.<permits>.<mac>``, the
    mac the first 32 hex digits of HMAC-SHA256 over the client id, nonce, storage epoch (8 hex
    digits) and permits (decimal) under ``lease_secret`` or the per-storage secret. The meta
    table keeps the storage epoch (row ``lease_epoch``, 32 random bits) and, without
    ``lease_secret``, the secret (rows ``lease_key_0`` .. ``lease_key_7``, 32 bits each), both
    created inside the transaction of the first round that issues a lease (never at import
    time) and kept across evictions; a reset storage gets new ones. A report of an unknown
    lease is charged only if its id verifies for the reporting client and carries another
    epoch (a lease issued before a storage reset), at most the id's permits (SPEC R32).
    """

    RECLAIM_TIMER = RECLAIM_TIMER

    def __init__(
        self,
        *,
        scheduler: DurabilityScheduler,
        limit: LimitOption,
        group_limit: GroupLimitOption = None,
        can_grant: CanGrantOption = None,
        round_wait_ms: int = 1000,
        round_period_ms: int = 2000,
        grant_timeout_ms: int = 10_000,
        leases: LeaseConfig | Mapping[str, Any] | None = None,
        clock: Callable[[], int] | None = None,
        id_factory: Callable[[], str] | None = None,
        lease_secret: str | bytes | None = None,
        secret_factory: Callable[[], bytes] | None = None,
    ) -> None:
        if not isinstance(scheduler, DurabilityScheduler):
            raise ConfigurationError("scheduler: expected a DurabilityScheduler", field="scheduler")
        if not callable(limit):
            _option_int(limit, "limit", 0)
        if not (group_limit is None or callable(group_limit) or isinstance(group_limit, Mapping)):
            _option_int(group_limit, "group_limit", 0)
        if isinstance(group_limit, Mapping):
            for g, gl in group_limit.items():
                _option_int(gl, f"group_limit[{g!r}]", 0)
        if not (can_grant is None or isinstance(can_grant, bool) or callable(can_grant)):
            raise ConfigurationError("can_grant: expected None, a bool or a callable", field="can_grant")
        self.scheduler = scheduler
        self.storage: Storage = scheduler.storage
        self.limit = limit
        self.group_limit = group_limit
        self.can_grant = can_grant
        self.round_wait_ms = _option_int(round_wait_ms, "round_wait_ms", 0)
        self.round_period_ms = _option_int(round_period_ms, "round_period_ms", 0)
        self.grant_timeout_ms = _option_int(grant_timeout_ms, "grant_timeout_ms", 1)
        self.leases = LeaseConfig.parse(leases)
        self.clock: Callable[[], int] = clock or scheduler.clock  # the scheduler's defaults to system_clock
        self._new_id = id_factory or (lambda: secrets.token_hex(12))
        self._app_secret = _holder_key(_configured_secret(lease_secret), scheduler.ctx)
        self._new_secret = secret_factory or (lambda: secrets.token_bytes(4 * LEASE_KEY_WORDS))
        self._pending: dict[str, _Pending] = {}
        self._arrivals = itertools.count()
        #: The round timer waiting to run the next round (``None`` once it took its batch).
        self._round_task: asyncio.Task[None] | None = None
        #: Strong references to every round task not yet done: the event loop keeps only weak
        #: ones, and a round awaiting a callback must not be garbage-collected mid-round (R4).
        self._round_tasks: set[asyncio.Task[None]] = set()
        self._round_at: int | None = None
        self._last_round_at: int | None = None
        #: R29 flag of the last committed round (durable in meta ``contended``; loaded by
        #: :meth:`_ensure_ready`, updated only after a round's commit). Syncs answer it.
        self._last_contended = False
        self._ready = False
        scheduler.on(RECLAIM_TIMER, self._on_reclaim_timer)

    # ================================================================== public API
    async def handle(self, message: Any) -> dict[str, Any]:
        """Handle one wire message and return the wire reply (SPEC §3).

        A ``request`` waits for its round (SPEC R9); a ``sync`` is applied and answered at once
        (SPEC R6). An invalid message is answered with an ``invalid_message`` error value and
        changes nothing (SPEC R7, I5); a round that cannot be committed is answered with a
        ``round_failed`` error value (SPEC R2). Typed :class:`PermitRequest`/:class:`SyncMessage`
        objects are accepted too."""
        if isinstance(message, (PermitRequest, SyncMessage)):
            message = message.to_wire()
        try:
            parsed = parse_message(message)  # reads only known fields (wire.py): no deep copy
        except InvalidMessageError as exc:
            return exc.to_wire()
        try:
            await self._ensure_ready()
        except Exception as exc:  # storage unusable: nothing was written
            log.exception("semaphore storage is not usable")
            return RoundFailedError(f"storage error: {exc}").to_wire()
        if isinstance(parsed, SyncMessage):
            return await self._sync(parsed)
        return await self._enqueue(parsed)

    async def usage(self) -> dict[str, Any]:
        """Current usage (SPEC R38)::

            {"limit": int | None, "outstanding": int, "leaseFootprint": int,
             "liveLeases": int, "retiredLeases": int,
             "groups": {group: {"outstanding", "leaseFootprint", "liveLeases",
                                "retiredLeases", "limit"}}}

        ``outstanding`` is the sum of ``permits - released`` over grants; ``limit`` is ``None``
        when the limit (or a group's limit) is not set or could not be resolved."""
        await self._ensure_ready()
        limit = await self._resolve_limit()
        meta = read_meta(self.storage)
        groups: dict[str, Any] = {}
        for r in self.storage.exec(f"SELECT * FROM {GROUPS} ORDER BY group_name"):
            name = str(r["group_name"])
            gl = await self._resolve_group_limit(name)
            groups[name] = {
                "outstanding": int(r["outstanding"]),
                "leaseFootprint": int(r["lease_footprint"]),
                "liveLeases": int(r["live_leases"]),
                "retiredLeases": int(r["retired_leases"]),
                "limit": gl if isinstance(gl, int) else None,
            }
        return {
            "limit": limit if isinstance(limit, int) else None,
            "outstanding": meta.get("outstanding", 0),
            "leaseFootprint": meta.get("lease_footprint", 0),
            "liveLeases": meta.get("live_leases", 0),
            "retiredLeases": meta.get("retired_leases", 0),
            "groups": groups,
        }

    @staticmethod
    def client(
        binding: str | None = None,
        *,
        invoke: Invoke,
        namespace: Any = None,
        transforms: tuple[Transform, ...] = (),
    ) -> SemaphoreRpc:
        """``DurabilitySemaphore.client(binding=..., invoke=...)``: the client helper (SPEC R36).

        :param binding: name of the holder class's Durable Object binding in ``env``.
        :param invoke: ``(stub, message) -> awaitable reply`` calling the holder's RPC method, or the
            method's name (``"permits"``).
        :param namespace: escape hatch instead of ``binding``: the namespace object itself, or a
            callable ``env -> namespace``.
        :param transforms: initial transforms (see :meth:`SemaphoreRpc.with_`).
        """
        from ..rpc import client  # at call time: the holder module stays free of the client side

        return client(binding, invoke=invoke, namespace=namespace, transforms=transforms)

    @staticmethod
    def migrate(ctx: Any, to_version: int | None) -> None:
        """Migrate the semaphore's schema in ``ctx.storage.sql``.

        ``None`` removes it: the grant, lease, group and meta tables and the semaphore's
        scheduler timers (SPEC R3). ``1`` creates the current schema (done automatically on
        first use). Discard any live :class:`DurabilitySemaphore` instance afterwards."""
        storage = ctx if isinstance(ctx, Storage) else Storage(ctx)
        if to_version is None:
            drop_schema(storage)
            timers = storage.one(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'durability_scheduler_timers'"
            )
            if timers is not None:
                storage.exec(
                    "DELETE FROM durability_scheduler_timers WHERE substr(name, 1, ?) = ?",
                    len(TIMER_PREFIX),
                    TIMER_PREFIX,
                )
            return
        if to_version != SCHEMA_VERSION:
            raise ConfigurationError(
                f"migrate: unknown schema version {to_version!r} (this release has {SCHEMA_VERSION})",
                field="to_version",
            )
        ensure_schema(storage)

    def next_request_at(self) -> int:
        """Earliest time the next round can run (SPEC R11)."""
        if self._round_at is not None:
            return self._round_at
        now = int(self.clock())
        if self._last_round_at is None:
            return now
        return max(now, self._last_round_at + self.round_period_ms)

    # ================================================================== lifecycle
    async def _ensure_ready(self) -> None:
        if self._ready:
            return
        ensure_schema(self.storage)
        meta = read_meta(self.storage)
        last_round_at = meta.get("last_round_at")
        if last_round_at is not None and self._last_round_at is None:
            self._last_round_at = last_round_at
        # R29: the last committed round's flag survives eviction (one read per instance).
        self._last_contended = bool(meta.get("contended", 0))
        self._ready = True
        # Repairs an alarm lost between a commit and its setAlarm (e.g. an eviction).
        await self.scheduler.arm()

    # ================================================================== rounds
    async def _enqueue(self, request: PermitRequest) -> dict[str, Any]:
        """Queue a request for the next round, starting the round timer if none is waiting.

        SPEC R4: a round timer that ended without running its round (cancelled, even before its
        first step, when its coroutine never ran) fails the calls that waited for it with
        ``round_failed`` (they ask again) and is replaced: it never leaves later requests
        waiting for a round that will not come."""
        stale = self._round_task
        if stale is not None and stale.done():  # its done callback may not have run yet
            self._round_ended(stale)
        pending = self._pending.get(request.client_id)
        if pending is None:
            pending = _Pending(request.client_id, next(self._arrivals))
            self._pending[request.client_id] = pending
        pending.messages.append(request)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        pending.futures.append(future)
        if self._round_task is None:
            now = int(self.clock())
            at = now + self.round_wait_ms
            if self._last_round_at is not None:
                at = max(at, self._last_round_at + self.round_period_ms)
            self._round_at = at
            task = asyncio.get_running_loop().create_task(self._round_after(at))
            self._round_task = task
            self._round_tasks.add(task)
            task.add_done_callback(self._round_ended)
        return await future

    def _round_ended(self, task: "asyncio.Task[None]") -> None:
        """Done callback of every round task (also called by :meth:`_enqueue` for a done timer):
        drops the strong reference and, if the task is still the waiting round timer (it ended
        without taking its batch, e.g. cancelled before its first step), fails the waiting calls
        and clears the timer so the next request starts a new one (SPEC R4)."""
        self._round_tasks.discard(task)
        if self._round_task is not task:
            return
        self._round_task = None
        self._round_at = None
        batch, self._pending = self._pending, {}
        if task.cancelled():
            reason = "the round timer was cancelled; ask again"
        else:
            exc = task.exception()
            reason = f"the round timer ended without running: {exc}" if exc else "the round timer ended"
        self._fail(batch, reason)

    @staticmethod
    def _fail(batch: dict[str, _Pending], reason: str) -> None:
        failure = RoundFailedError(f"round failed: {reason}").to_wire()
        for pending in batch.values():
            for f in pending.futures:
                if not f.done():
                    f.set_result(failure)

    async def _round_after(self, at: int) -> None:
        batch: dict[str, _Pending] = {}
        try:
            await sleep_until(self.clock, at)
            batch, self._pending = self._pending, {}
            self._round_task = None
            self._round_at = None
            await self._run_round(batch)
        except BaseException as exc:  # never leave a caller hanging
            log.exception("round failed")
            if not batch and self._round_task is asyncio.current_task():
                # failed while waiting: the waiting calls were this round's
                batch, self._pending = self._pending, {}
                self._round_task = None
                self._round_at = None
            self._fail(batch, str(exc) or type(exc).__name__)
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _run_round(self, batch: dict[str, _Pending]) -> None:
        now = int(self.clock())
        self._last_round_at = now
        clients = list(batch.values())
        limit = await self._resolve_limit()

        demand_pairs = {(p.client_id, d.group) for p in clients for d in p.latest.demand}
        groups = {g for _, g in demand_pairs}
        lease_pairs: set[tuple[str, str]] = set()
        lease_groups: set[str] = set()
        if self.leases is not None or self._has_live_leases():
            # R33: a can_grant that may say no is checked for every live lease, not only those
            # of the clients in this round (a client drawing from its lease may never request).
            everyone = self.can_grant is not None
            lease_pairs = self._live_lease_pairs(None if everyone else [p.client_id for p in clients])
            lease_groups = self._groups_with_live_leases()
        group_limits = {g: await self._resolve_group_limit(g) for g in sorted(groups | lease_groups)}
        if callable(self.can_grant):
            permitted = {pair: await self._resolve_can_grant(*pair) for pair in sorted(demand_pairs | lease_pairs)}
        else:  # None or a bool: the same answer for every pair, no call per pair
            permitted = dict.fromkeys(demand_pairs | lease_pairs, self.can_grant is None or bool(self.can_grant))

        try:
            replies, contended = self.storage.transaction(
                lambda: self._round_transaction(clients, now, limit, group_limits, permitted)
            )
        except Exception as exc:
            log.exception("round transaction failed; nothing was written")
            failure = RoundFailedError(f"round failed, nothing was written: {exc}").to_wire()
            replies = {p.client_id: failure for p in clients}
        else:
            self._last_contended = contended  # R29: only a committed round changes the flag
            try:
                await self.scheduler.arm()
            except Exception:  # the commit stands; the next instance start re-arms
                log.exception("could not arm the alarm after a round")
        for p in clients:
            for f in p.futures:
                if not f.done():
                    f.set_result(replies[p.client_id])

    def _round_transaction(
        self,
        clients: list[_Pending],
        now: int,
        limit: Any,
        group_limits: dict[str, Any],
        permitted: dict[tuple[str, str], bool],
    ) -> tuple[dict[str, dict[str, Any]], bool]:
        """The round's transaction body: returns each client's reply and the round's R29
        ``contended`` flag, written to meta ``contended`` in the same flush (the holder's
        in-memory copy is updated only once the transaction committed)."""
        uow, views = self._open(now, {p.client_id: p.messages for p in clients})
        self._retire_ineligible(uow, now, limit, group_limits, permitted)
        usage = self._usage(uow, views, limit, {d.group for p in clients for d in p.latest.demand})
        entries = self._entries(uow, clients, permitted)
        result = allocate(entries, limit=limit, group_limits=group_limits, usage=usage, leases=self.leases)
        self._write_allocation(uow, views, result, now, limit)
        return self._round_replies(uow, clients, views, result, now), result.contended

    def _usage(self, uow: UnitOfWork, views: dict[str, _View], limit: Any, demand_groups: set[str]) -> Usage:
        """SPEC R19: charged capacity before allocation, in total and per demanded group (grants'
        ``permits - released`` plus lease footprint), with the round's transient R32 charge for
        reports of unknown leases issued before a storage reset added to the lease footprint."""
        totals = uow.totals()
        per_group = uow.group_usage(demand_groups)
        unknown_charge = self._unknown_lease_charge(uow, views, limit)
        return Usage(
            grants=totals["outstanding"],
            leases=totals["lease_footprint"] + unknown_charge,
            groups={g: u["outstanding"] + u["lease_footprint"] for g, u in per_group.items()},
        )

    @staticmethod
    def _entries(
        uow: UnitOfWork, clients: list[_Pending], permitted: dict[tuple[str, str], bool]
    ) -> list[Entry]:
        """One :class:`Entry` per ``(client, group)`` of the round's latest demands (R10): its
        need is the count minus unclaimed grant permits and undrawn live-lease permits the
        client holds in the group (SPEC R20); it is a lease candidate if the client reports
        leases, the count is above zero and it holds no live lease with undrawn permits there
        (SPEC R26); ``permitted`` is the round's ``canGrant`` answer (SPEC R22)."""
        held_unclaimed: dict[tuple[str, str], int] = {}
        for g in uow.grants.values():
            if g.claimed < g.permits:
                key = (g.client_id, g.group_name)
                held_unclaimed[key] = held_unclaimed.get(key, 0) + g.unclaimed
        undrawn: dict[tuple[str, str], int] = {}
        for lease in uow.leases.values():
            if lease.status == "live":
                key = (lease.client_id, lease.group_name)
                undrawn[key] = undrawn.get(key, 0) + lease.undrawn
        entries = []
        for p in clients:
            latest = p.latest
            lease_capable = latest.leases is not None
            for d in latest.demand:
                key = (p.client_id, d.group)
                need = max(0, d.count - held_unclaimed.get(key, 0) - undrawn.get(key, 0))
                # Entry(client_id, group, count, oldest_at, arrival, need, permitted,
                # lease_candidate), positional: one per (client, group) of the round
                entries.append(Entry(
                    p.client_id, d.group, d.count, d.oldest_at, p.arrival, need,
                    permitted.get(key, True),
                    lease_capable and d.count > 0 and undrawn.get(key, 0) == 0,
                ))
        return entries

    def _write_allocation(
        self, uow: UnitOfWork, views: dict[str, _View], result: Allocation, now: int, limit: Any
    ) -> None:
        """SPEC R2: the round's writes, all in one flush inside its transaction: the new grants
        (R15 deadline) and leases (R32 verifiable ids, R31 ``expiresAt``), each put first in its
        client's view, then meta ``last_limit`` (R33), ``last_round_at`` (R9) and ``contended``
        (R29, only when it changes); then the reclaim timer follows the earliest deadline (R16)."""
        for (client_id, group), permits in result.grants.items():
            row = GrantRow(self._new_id(), client_id, group, permits, 0, 0, now,
                           now + self.grant_timeout_ms, False)
            uow.put_grant(row)
            views[client_id].grants = {row.grant_id: self._grant_wire(row), **views[client_id].grants}
        key = self._issuing_key(uow) if result.leases else None
        for (client_id, group), permits in result.leases.items():
            assert self.leases is not None and key is not None
            lease = LeaseRow(self._new_lease_id(key, client_id, permits), client_id, group, permits, 0, 0,
                             False, "live", now, now + self.leases.ttl_ms)
            uow.put_lease(lease)
            views[client_id].leases = {lease.lease_id: self._lease_wire(lease), **views[client_id].leases}
        if isinstance(limit, int):
            uow.set_meta("last_limit", limit)
        uow.set_meta("last_round_at", now)
        if result.contended != bool(uow.meta().get("contended", 0)):  # R29, same meta upsert
            uow.set_meta("contended", int(result.contended))
        uow.flush()
        self._schedule_reclaim()

    def _round_replies(
        self, uow: UnitOfWork, clients: list[_Pending], views: dict[str, _View], result: Allocation, now: int
    ) -> dict[str, dict[str, Any]]:
        """Each client's reply to the round (SPEC R8): its grants and leases, its ``blocked``
        entries in wire form (R23), the round's ``contended`` flag (R29) and ``nextRequestAt``
        (R11: one period after this round)."""
        next_at = now + self.round_period_ms
        blocked: dict[str, list[dict[str, Any]]] = {}
        for client_id, group, reason, waiting in result.blocked:  # wire form of Blocked
            blocked.setdefault(client_id, []).append({"group": group, "reason": reason.value, "waiting": waiting})
        held = self._held_by_client(uow)
        return {
            p.client_id: self._reply(held, p.client_id, views[p.client_id], blocked.get(p.client_id, []),
                                     result.contended, next_at)
            for p in clients
        }

    # ================================================================== lease ids (R32)
    def _issuing_key(self, uow: UnitOfWork) -> tuple[bytes, int]:
        """The lease-id secret and storage epoch, created on first use (SPEC R32): one call of
        ``secret_factory`` (32 random bytes) inside the round's transaction (randomness at
        import time is forbidden in Workers) gives the per-storage secret (kept only without
        ``lease_secret``) and the epoch, written as meta rows ``lease_key_0..7`` and
        ``lease_epoch`` by the round's own meta upsert (no extra statement; a round that fails
        writes none, and its leases are not written either). Call once per round."""
        meta = uow.meta()
        secret, epoch = self._app_secret or _lease_secret(meta), _lease_epoch(meta)
        if secret is not None and epoch is not None:
            return secret, epoch
        seed = self._new_secret()
        if not isinstance(seed, bytes) or len(seed) != 4 * LEASE_KEY_WORDS:
            raise ConfigurationError(f"secret_factory: must return {4 * LEASE_KEY_WORDS} bytes",
                                     field="secret_factory")
        if secret is None:
            secret = seed
            for i in range(LEASE_KEY_WORDS):
                uow.set_meta(f"{LEASE_KEY_PREFIX}{i}", int.from_bytes(seed[4 * i:4 * i + 4], "big"))
        if epoch is None:
            epoch = _epoch_from(seed)
            uow.set_meta(LEASE_EPOCH_KEY, epoch)
        return secret, epoch

    def _new_lease_id(self, key: tuple[bytes, int], client_id: str, permits: int) -> str:
        """A new lease id (SPEC R32, R7): ``id_factory()`` as its nonce, which must be a wire id
        of at most :data:`LEASE_NONCE_MAX` characters (else :class:`ConfigurationError`)."""
        nonce = self._new_id()
        problem = id_problem(nonce)
        if problem is None and len(nonce) > LEASE_NONCE_MAX:
            problem = f"must be at most {LEASE_NONCE_MAX} characters, got {len(nonce)}"
        if problem is not None:
            raise ConfigurationError(
                f"id_factory: a lease id's nonce {problem} (the holder appends the epoch, permits "
                f"and mac, at most {MAX_ID_LENGTH - LEASE_NONCE_MAX} characters)", field="id_factory")
        lease_id = lease_id_for(key[0], client_id, nonce, key[1], permits)
        if len(lease_id) > MAX_ID_LENGTH:  # only a lease of 2**53 permits or more (R7 forbids it)
            raise ConfigurationError(f"leases: a lease of {permits} permits cannot be issued", field="leases")
        return lease_id

    def _unknown_lease_charge(self, uow: UnitOfWork, views: dict[str, _View], limit: Any) -> int:
        """SPEC R32: this round's transient charge for reports of leases the holder does not know.

        Charged: a report whose id verifies for the reporting client and carries an epoch other
        than this storage's (a lease issued before a storage reset, under ``lease_secret``; its
        client may still run its work): ``min(drawn - released, the id's permits)``. Not
        charged: an id of the current epoch (a lease this storage issued and settled, its work
        released: a replay of it would withhold capacity forever and protect nothing), a
        fabricated id, another client's id, or one under another secret (the per-storage secret
        of a reset storage, an earlier format). Bounds (decision): at most ``permitsPerLease``
        per client per round, the ceiling in total, and nothing when leases are not configured.
        Reads only the meta rows the round has loaded anyway: no statement."""
        if self.leases is None or not any(v.unknown_leases for v in views.values()):
            return 0
        meta = uow.meta()
        secret = self._app_secret or _lease_secret(meta)
        if secret is None:  # no lease_secret and this storage never issued a lease
            return 0
        epoch = _lease_epoch(meta)  # None: no lease issued since this storage was created
        cap = self.leases.permits_per_lease
        total = 0
        for client_id, view in views.items():
            charge = 0
            for lease_id, footprint in view.unknown_leases.items():
                if charge >= cap:  # no more macs to check for this client (at most 1,000 ids)
                    break
                if footprint > 0:
                    charge += min(footprint, _pre_reset_permits(secret, client_id, lease_id, epoch))
            total += min(charge, cap)
        if isinstance(limit, int):
            total = min(total, ceiling(limit, self.leases))
        return total

    # ================================================================== sync and alarm
    async def _sync(self, message: SyncMessage) -> dict[str, Any]:
        """SPEC R6: apply a sync's reports in their own transaction and answer at once, with the
        ``contended`` flag of the last committed round (R29; durable, so it survives eviction)."""
        now = int(self.clock())

        def body() -> dict[str, Any]:
            uow, views = self._open(now, {message.client_id: [message]})
            view = views[message.client_id]
            uow.flush()
            self._schedule_reclaim()
            return self._reply(self._held_by_client(uow), message.client_id, view, [],
                               self._last_contended, self.next_request_at())

        try:
            reply = self.storage.transaction(body)
        except Exception as exc:
            log.exception("sync transaction failed; nothing was written")
            return RoundFailedError(f"sync failed, nothing was written: {exc}").to_wire()
        await self.scheduler.arm()
        return reply

    def _open(self, now: int, messages: dict[str, list[Any]]) -> tuple[UnitOfWork, dict[str, _View]]:
        """The start of every round and sync (inside its transaction): reclaim (R15) and retire
        (R31) what is due, load the clients' rows and every reported id (one query each for all
        clients), and apply the reports; returns the unit of work and each client's view."""
        uow = UnitOfWork(self.storage)
        self._reclaim(uow, now)
        self._retire_expired(uow, now)
        uow.load_clients(messages)
        uow.load_grant_ids(r.grant_id for ms in messages.values() for m in ms for r in m.grants)
        uow.load_lease_ids(r.lease_id for ms in messages.values() for m in ms for r in m.leases or ())
        return uow, {client_id: self._apply_reports(uow, client_id, ms, now) for client_id, ms in messages.items()}

    def _on_reclaim_timer(self, name: str, due_at: int) -> None:
        """Alarm: reclaim unclaimed permits past their deadline (SPEC R16)."""
        if not self._ready:  # an alarm can be the first call an instance gets
            ensure_schema(self.storage)
        now = int(self.clock())

        def body() -> None:
            uow = UnitOfWork(self.storage)
            self._reclaim(uow, now)
            uow.flush()
            self._schedule_reclaim()

        self.storage.transaction(body)

    def _schedule_reclaim(self) -> None:
        """Point the reclaim timer at the earliest deadline of a grant with unclaimed permits."""
        row = self.storage.one(
            "SELECT MIN(claim_by) AS due FROM durability_semaphore_grants WHERE claimed < permits"
        )
        self.scheduler.point_timer(RECLAIM_TIMER, None if row is None or row["due"] is None else int(row["due"]))

    # ================================================================== state changes
    def _reclaim(self, uow: UnitOfWork, now: int) -> None:
        """SPEC R15: past ``claim_by``, a grant shrinks to its claimed count; with nothing
        claimed (or everything released) it is deleted."""
        for g in uow.load_due_grants(now):
            g.permits = g.claimed
            g.reclaimed = True
            if g.claimed == 0 or g.released >= g.permits:
                uow.delete_grant(g)
            else:
                uow.put_grant(g)

    def _retire_expired(self, uow: UnitOfWork, now: int) -> None:
        """SPEC R31: a lease unreported for ``ttlMs`` is retired (never forgotten)."""
        for lease in uow.load_expired_leases(now):
            lease.status = "retired"
            uow.put_lease(lease)

    def _retire_ineligible(
        self,
        uow: UnitOfWork,
        now: int,
        limit: Any,
        group_limits: dict[str, Any],
        permitted: dict[tuple[str, str], bool],
    ) -> None:
        """SPEC R33: a lowered limit retires every live lease; a group that gained a limit under
        ``exclude`` retires its live leases; ``canGrant`` turning false retires the live leases of
        that ``(client, group)`` (``permitted`` holds the answer for every live lease's pair)."""
        to_retire: list[LeaseRow] = []
        last_limit = uow.meta().get("last_limit")
        if isinstance(limit, int) and last_limit is not None and limit < last_limit:
            to_retire += uow.load_live_leases()
        exclude = self.leases is None or self.leases.limited_groups is LimitedGroups.EXCLUDE
        if exclude:
            limited = [g for g, gl in group_limits.items() if isinstance(gl, int)]
            to_retire += uow.load_live_leases(limited)
        denied = {pair for pair, ok in permitted.items() if not ok}
        if denied:
            to_retire += [lease for lease in uow.load_live_leases({g for _, g in denied})
                          if (lease.client_id, lease.group_name) in denied]
        for lease in to_retire:
            if lease.status == "live":
                lease.status = "retired"
                uow.put_lease(lease)

    def _apply_reports(
        self, uow: UnitOfWork, client_id: str, messages: list[Any], now: int
    ) -> _View:
        """Apply every grant and lease report of a client's messages, in order (SPEC R13, R14,
        R30-R32), and return what the client is told about them. :meth:`_open` has loaded the
        client's rows and every reported id into ``uow``.

        Leases: ``drawn`` and ``released`` are high-water marks clamped like R13 (``drawn`` to
        the lease's permits, ``released`` to ``drawn``). Once a report with ``stopped: true`` was
        applied, ``drawn`` is final (R30): later reports can still raise ``released`` (up to the
        final ``drawn``) but never ``drawn``, so a stopped lease's footprint only shrinks.

        A report of a lease the holder does not know (or of another client's lease) is answered
        ``retired`` (``settled`` if stopped with ``released == drawn``) and nothing is stored
        (R32). Its ``drawn - released`` is kept in the view; a round charges it only if the id
        verifies for this client and was issued before a storage reset, within the bounds of
        :meth:`_unknown_lease_charge` (a sync allocates nothing, so it charges nothing either)."""
        view = _View()
        for message in messages:
            self._apply_grant_reports(uow, client_id, message.grants, view)
            self._apply_lease_reports(uow, client_id, message.leases or (), view, now)
        return view

    def _apply_grant_reports(
        self, uow: UnitOfWork, client_id: str, reports: Iterable[GrantReport], view: _View
    ) -> None:
        """SPEC R13: a grant report raises ``claimed`` (clamped to ``permits``) and ``released``
        (clamped to ``claimed``) as high-water marks; a grant unknown or another client's is
        answered ``not_found`` (R14, R15); a fully released grant is settled and deleted (R17)."""
        for r in reports:
            g = uow.grants.get(r.grant_id)
            if g is None or g.client_id != client_id:  # SPEC R14, R15
                view.grants[r.grant_id] = GrantState(
                    r.grant_id, None, 0, 0, 0, None, GrantStatus.NOT_FOUND).to_wire()
                continue
            claimed = max(g.claimed, min(r.claimed, g.permits))
            released = max(g.released, min(r.released, claimed))
            if claimed != g.claimed or released != g.released:
                g.claimed, g.released = claimed, released
                uow.put_grant(g)
            view.grants[r.grant_id] = self._grant_wire(g)
            if g.released >= g.permits:  # SPEC R17: settled
                uow.delete_grant(g)

    def _apply_lease_reports(
        self, uow: UnitOfWork, client_id: str, reports: Iterable[LeaseReport], view: _View, now: int
    ) -> None:
        """SPEC R30-R32: a lease report raises ``drawn`` (clamped to ``permits``, final once
        stopped, R30) and ``released`` (clamped to ``drawn``), heartbeats a live lease (R31) and
        settles a stopped, fully released one (R30). A lease unknown or another client's is
        answered ``retired`` (``settled`` if stopped with ``released == drawn``), nothing is
        stored, and its ``drawn - released`` is kept in ``view.unknown_leases`` (R32)."""
        unknown = view.unknown_leases
        for r in reports:
            lease = uow.leases.get(r.lease_id)
            if lease is None or lease.client_id != client_id:  # SPEC R32
                if r.stopped and r.released == r.drawn:
                    status = LeaseStatus.SETTLED
                    unknown.pop(r.lease_id, None)
                else:
                    status = LeaseStatus.RETIRED
                    unknown[r.lease_id] = max(0, r.drawn - r.released)
                view.leases[r.lease_id] = LeaseState(
                    r.lease_id, None, r.drawn, r.drawn, r.released, None, status).to_wire()
                continue
            if not lease.stopped:  # R30: after the stop, drawn is final
                lease.drawn = max(lease.drawn, min(r.drawn, lease.permits))
            lease.released = max(lease.released, min(r.released, lease.drawn))
            if lease.status == "live":
                lease.expires_at = now + self._ttl_ms()
            if r.stopped:
                lease.stopped = True
                lease.status = "retired"
            uow.put_lease(lease)
            if lease.stopped and lease.released >= lease.drawn:  # SPEC R30: settled
                view.leases[r.lease_id] = self._lease_wire(lease, LeaseStatus.SETTLED)
                uow.delete_lease(lease)
            else:
                view.leases[r.lease_id] = self._lease_wire(lease)

    def _ttl_ms(self) -> int:
        # Leases may outlive a config that had them: heartbeat with the default lifetime then.
        return (self.leases or LeaseConfig()).ttl_ms

    # ================================================================== replies
    @staticmethod
    def _grant_wire(g: GrantRow) -> dict[str, Any]:
        """Wire form of :class:`GrantState` for a stored grant (built directly: a round answers
        for every grant of every client in it)."""
        return {"grantId": g.grant_id, "group": g.group_name, "permits": g.permits,
                "claimed": g.claimed, "released": g.released, "claimBy": g.claim_by,
                "status": "expired" if g.reclaimed else "active"}

    @staticmethod
    def _lease_wire(lease: LeaseRow, status: LeaseStatus | None = None) -> dict[str, Any]:
        """Wire form of :class:`LeaseState` for a stored lease."""
        if status is None:
            status = LeaseStatus.LIVE if lease.status == "live" else LeaseStatus.RETIRED
        return {"leaseId": lease.lease_id, "group": lease.group_name, "permits": lease.permits,
                "drawn": lease.drawn, "released": lease.released, "expiresAt": lease.expires_at,
                "status": status.value}

    @staticmethod
    def _held_by_client(uow: UnitOfWork) -> dict[str, tuple[list[GrantRow], list[LeaseRow]]]:
        held: dict[str, tuple[list[GrantRow], list[LeaseRow]]] = {}
        for g in uow.grants.values():
            held.setdefault(g.client_id, ([], []))[0].append(g)
        for lease in uow.leases.values():
            held.setdefault(lease.client_id, ([], []))[1].append(lease)
        return held

    def _reply(
        self,
        held: dict[str, tuple[list[GrantRow], list[LeaseRow]]],
        client_id: str,
        view: _View,
        blocked: list[dict[str, Any]],
        contended: bool,
        next_request_at: int,
    ) -> dict[str, Any]:
        """SPEC R8: new and reported grants and leases, plus every other grant and live or
        retired lease of the client (so a lost reply heals at the next request)."""
        own_grants, own_leases = held.get(client_id, ([], []))
        grants = dict(view.grants)
        for g in own_grants:
            if g.grant_id not in grants:
                grants[g.grant_id] = self._grant_wire(g)
        leases = dict(view.leases)
        for lease in own_leases:
            # Also re-render reported leases: the round may have retired them after their
            # report was applied (R33), and the client must stop drawing at once.
            if lease.lease_id not in leases or leases[lease.lease_id]["status"] != LeaseStatus.SETTLED.value:
                leases[lease.lease_id] = self._lease_wire(lease)
        return {
            "v": WIRE_VERSION,
            "grants": list(grants.values()),
            "leases": list(leases.values()),
            "blocked": blocked,
            "contended": contended,
            "nextRequestAt": next_request_at,
        }

    # ================================================================== limits (SPEC R12)
    async def _resolve_limit(self) -> Any:
        try:
            value = await _call(self.limit) if callable(self.limit) else self.limit
        except Exception:
            log.exception("limit callback raised")
            return LIMIT_ERROR
        count = _valid_count(value)
        if count is None:
            log.error("limit resolved to an invalid value %r", value)
            return LIMIT_ERROR
        return count

    async def _resolve_group_limit(self, group: str) -> Any:
        source = self.group_limit
        try:
            if source is None:
                return None
            if callable(source):
                value = await _call(source, group)
            elif isinstance(source, Mapping):
                value = source.get(group)
            else:
                value = source
        except Exception:
            log.exception("group_limit callback raised for group %r", group)
            return LIMIT_ERROR
        if value is None:
            return None
        count = _valid_count(value)
        if count is None:
            log.error("group_limit(%r) resolved to an invalid value %r", group, value)
            return LIMIT_ERROR
        return count

    async def _resolve_can_grant(self, client_id: str, group: str) -> bool:
        source = self.can_grant
        if source is None:
            return True
        if not callable(source):
            return bool(source)
        try:
            return bool(await _call(source, client_id, group))
        except Exception:
            log.exception("can_grant callback raised for (%r, %r); not permitted", client_id, group)
            return False

    def _has_live_leases(self) -> bool:
        return read_meta(self.storage).get("live_leases", 0) > 0

    def _live_lease_pairs(self, client_ids: list[str] | None) -> set[tuple[str, str]]:
        """``(client, group)`` pairs holding a live lease: of the given clients, or all."""
        if client_ids is None:
            rows = self.storage.exec(
                "SELECT DISTINCT client_id, group_name FROM durability_semaphore_leases WHERE status = 'live'")
            return {(str(r["client_id"]), str(r["group_name"])) for r in rows}
        pairs: set[tuple[str, str]] = set()
        for part in chunks(sorted(set(client_ids)), JSON_IDS):
            rows = self.storage.exec(
                "SELECT DISTINCT client_id, group_name FROM durability_semaphore_leases"
                " WHERE status = 'live' AND client_id IN (SELECT value FROM json_each(?))",
                json_list(part),
            )
            pairs |= {(str(r["client_id"]), str(r["group_name"])) for r in rows}
        return pairs

    def _groups_with_live_leases(self) -> set[str]:
        return {str(r["group_name"]) for r in self.storage.exec(
            f"SELECT group_name FROM {GROUPS} WHERE live_leases > 0")}
