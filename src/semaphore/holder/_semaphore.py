"""DurabilitySemaphore: the holder side of the shared concurrency budget (SPEC §2-§7, §9).

The holder shell: it batches requests into rounds (R9, R10), runs the round timer (R4), resolves
the limits (R12, R22) and runs each decision of :mod:`semaphore.core.rounds` in one transaction
over its :class:`~semaphore.holder._store.SqlStore` (load, decide, persist; R2).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, overload

from ..clock import sleep_until
from ..core import json_text
from ..core.allocation import LIMIT_ERROR, ceiling
from ..core.batching import (
    ROUND_PERIOD_MS,
    ROUND_WAIT_MS,
    Timing,
    hold_open,
    limits_can_change,
    limits_rose,
    next_request_at,
    reply_has_news,
    room_after_round,
    round_start,
    sync_room,
)
from ..core.config import DEFAULT_LEASES, LeaseConfig, holder_leases, option_int
from ..core.lease_ids import LEASE_KEY_WORDS, configured_secret, holder_key
from ..core.rounds import Limits, Pending, Policy, limit_lowered, stored_share
from ..core.usage import measure
from ..core.wire import LeaseStatus, PermitRequest, SyncMessage, parse_message, valid_count
from ..errors import ConfigurationError, InvalidMessageError, RoundFailedError
from ..rpc import client as rpc_client
from ..runtime import Storage, TableWatch, object_id
from ..scheduler import DurabilityScheduler
from . import _operations
from ._observe import OnRound, emit, failed_record, round_record
from ._steps import lease_scope, run_claim_expiry, run_reclaim, run_round, run_sync, sync_scope
from ._store import GRANTS, SCHEMA_VERSION, SqlStore, drop_schema, ensure_schema, read_meta

__all__ = ["DurabilitySemaphore", "LimitOption", "GroupLimitOption", "CanGrantOption"]

log = logging.getLogger("semaphore.holder")

LimitOption = int | Callable[[], int | Awaitable[int]]
GroupLimitOption = None | int | Mapping[str, int] | Callable[[str], int | None | Awaitable[int | None]]
CanGrantOption = None | bool | Callable[[str, str], bool | Awaitable[bool]]

RECLAIM_TIMER = "durability_semaphore:reclaim"
TIMER_PREFIX = "durability_semaphore:"


def _holder_key(secret: bytes | None, ctx: Any) -> bytes | None:
    """The MAC key of this holder under the application's ``lease_secret`` (R32, see
    :func:`~semaphore.core.lease_ids.holder_key`): needs the holder object's id."""
    if secret is None:
        return None
    ident = object_id(ctx)
    if ident is None:
        raise ConfigurationError("lease_secret: needs the holder object's ctx (with an id), "
                                 "not a bare Storage", field="lease_secret")
    return holder_key(secret, ident)


@dataclass
class _Waiting(Pending):
    """A client's requests waiting for the next round, with the calls waiting for its answer;
    ``since``: when the first of them arrived (a held request's deadline counts from it, so
    calls joining it never move it later)."""

    futures: list[asyncio.Future[dict[str, Any]]] = field(default_factory=list)
    since: int = 0

    def hold_until(self, hold_ms: int) -> int:
        """Until when the request may stay open unserved: ``hold_ms`` capped by its ``waitMs``."""
        return self.since + min(hold_ms, self.latest.wait_ms)


def _is_try(p: Pending) -> bool:
    """R9b: one of the client's waiting requests is a try (``noWait``); a later request of the
    same client joined to it (R10) does not make it wait."""
    return any(m.no_wait for m in p.messages)


def _merged(older: _Waiting, newer: _Waiting) -> _Waiting:
    """One client's held and new requests as one (R10): the older arrival position, every call,
    the messages in order (the latest demand wins), the older ``since`` (the deadline never
    moves later)."""
    return _Waiting(older.client_id, min(older.arrival, newer.arrival), [*older.messages, *newer.messages],
                    [*older.futures, *newer.futures], min(older.since, newer.since))




async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result



def _check_sources(scheduler: Any, limit: Any, group_limit: Any, can_grant: Any) -> None:
    """Validate the options that are not plain integers (:class:`ConfigurationError` names the
    field)."""
    if not isinstance(scheduler, DurabilityScheduler):
        raise ConfigurationError("scheduler: expected a DurabilityScheduler", field="scheduler")
    if not callable(limit):
        option_int(limit, "limit", 0)
    if not (group_limit is None or callable(group_limit) or isinstance(group_limit, Mapping)):
        option_int(group_limit, "group_limit", 0)
    if isinstance(group_limit, Mapping):
        for g, gl in group_limit.items():
            option_int(gl, f"group_limit[{g!r}]", 0)
    if not (can_grant is None or isinstance(can_grant, bool) or callable(can_grant)):
        raise ConfigurationError("can_grant: expected None, a bool or a callable", field="can_grant")


class DurabilitySemaphore:
    """The holder of one shared concurrency budget, inside an application's Durable Object.

    :param scheduler: the object's :class:`DurabilityScheduler` (its ``alarm()`` must delegate to
        ``scheduler.alarm``). The semaphore uses the scheduler's storage and takes part in its
        alarm as the participant ``durability_semaphore:reclaim`` (SPEC R16): its due time is read
        from the grant table (the earliest ``claimBy`` of a grant with unclaimed permits), so no
        timer row is kept in step with it; the scheduler has a row of that name only while the
        reclaim is failing (its backoff).
    :param limit: the shared limit: an ``int`` >= 0, or a callable (sync or async) returning one,
        resolved once per round (SPEC R12), and every :attr:`limit_check_ms` while requests are
        held (R9 decision "limits that rise"). If it raises or returns something else, the round
        admits nothing (``limit_resolution_error``) but still applies reports.
    :param group_limit: per-group ceilings under the limit: ``None`` (no group limits), an ``int``
        for every group, a mapping ``{group: limit}`` (groups absent have none), or a callable
        ``group -> int | None`` (sync or async), resolved once per group per round (and for
        held requests' groups every :attr:`limit_check_ms`). A group whose
        limit raises fails closed for that round (``limit_resolution_error``).
    :param can_grant: ``None`` (everything permitted), a ``bool``, or a callable
        ``(client_id, group) -> bool`` (sync or async) resolved once per ``(client, group)`` per
        round, and at a sync reporting leases once per live-lease group of its client (SPEC
        R33a: a refusal retires that client's leases there); ``False`` blocks the entry with
        ``not_permitted`` (SPEC R22). A callable that raises counts as ``False`` (fails closed)
        and is logged.
    :param round_wait_ms: a batched round (one that runs under contention, SPEC R9a) runs this
        long after the first request waiting for it arrived (default 100, SPEC R9; the
        original's is 1000).
    :param round_period_ms: ... but never sooner than this after the previous batched round
        began (default 1000, SPEC R9; the original's is 2000). A blocked client asks again at
        about this period, so it is also how soon freed capacity reaches waiting demand.
    :param grant_timeout_ms: unclaimed grant permits are reclaimed this long after issue
        (default 10000, SPEC R15).
    :param leases: lease options (SPEC §7), see :class:`~semaphore.config.LeaseConfig`. The
        default, :data:`~semaphore.DEFAULT_LEASES`, issues strict reusable leases sized before
        grants (a client's freed slot is drawn again with no holder call) with a recheck every
        30 s, except with ``claim_ttl_ms``: crash expiry frees claimed grant permits, not lease
        slots, so a holder given ``claim_ttl_ms`` and no ``leases=`` (or ``DEFAULT_LEASES``
        itself) issues no leases. ``None``
        issues no leases (the original's default: every permit a grant). To change one option
        of the default: ``dataclasses.replace(DEFAULT_LEASES, ttl_ms=60_000)`` (a mapping starts
        from :class:`~semaphore.LeaseConfig`'s own defaults: one-shot leases, grants first).
    :param clock: callable returning epoch milliseconds (default: wall clock). A clock with an
        ``async sleep_until(ms)`` method (e.g. :class:`~semaphore.testing.VirtualClock`) also
        drives the round timer.
    :param id_factory: callable returning a fresh unique id for grants and leases (default:
        96 random bits in hex). Ids must never repeat, even across :meth:`migrate`. For a lease
        it is the nonce of the id ``<nonce>.<epoch>.<permits>.<mac>`` (SPEC R32, see
        :func:`semaphore.core.lease_ids.unknown_lease_charge`), so it must be a valid wire id
        (:func:`~semaphore.core.wire.id_problem`) of at most
        :data:`~semaphore.core.lease_ids.LEASE_NONCE_MAX` (197) characters; anything else fails the round with
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
    :param on_round: ``None`` (default) or a synchronous callable receiving the
        :class:`~semaphore.holder._observe.RoundRecord` of every round, committed or failed
        (requests, permits admitted, grants and leases issued, leases retired, ``blocked``
        {reason: waiting}, SQL statements, duration, charged and limit after the round,
        ``contended``, ``failed``/``error``), called after the round's replies are set. The same
        record is logged as one JSON line on the logger ``semaphore.round`` (``INFO``; a failed
        round ``WARNING``). An exception from ``on_round`` is logged and never affects the round.
    :param hold_blocked_ms: waiting requests (issue 13), ``0`` (default: off, the seed's
        contract: every request is answered by its round). Above 0: a request carrying
        ``waitMs`` whose round serves it nothing is held open instead of answered ``blocked``
        (unless its reply carries a lease no longer live, a grant no longer active, or a grant
        or lease the request did not report: its client never heard of it), for at most the
        smaller of the two (then the next round the period allows answers it), and
        every later round takes it again; a report that frees capacity (a sync that lowers the
        charged capacity, a reclaim) starts the next round as soon as ``round_period_ms``
        allows, and so does a limit option that can change (a callable, a ``group_limit``
        mapping) found risen by the checks run every ``max(round_period_ms, 100)`` ms while
        requests are held. So blocked clients need not ask again each
        round: freed capacity reaches them with no client message, and a short
        ``round_period_ms`` costs no extra holder calls. The reply comes from the round that
        serves the client, or the first round at or after its deadline (``blocked``). Held
        requests live in memory: an eviction fails them like any waiting request
        (``round_failed``, the client asks again).
    :param free_at_once: free means now (SPEC R9a), ``True`` by default: while the holder knows
        of no contention (its last committed round left no need unserved, none was declined
        since, none is held), a request that finds no round waiting is served by a round run at
        once instead of after ``round_wait_ms``; such a round commits only if it leaves no need
        unserved, else it writes nothing and its requests wait for a batched round. A try
        (``noWait``, R9b: the queue's ``permit(..., timeout_ms=0)``) always gets a round at
        once. ``False`` keeps the seed's timing: every round batched (R9).
    :param claim_ttl_ms: crash expiry of claimed permits, ``None`` (the default: off, the seed's
        contract: claimed permits stay charged until released, R18). With a value, the claimed,
        unreleased permits of a client that sends no request or sync for this long after a reply
        told it the TTL are released by the holder's alarm, like Redisson's lease time (a client
        never told one, e.g. just after the option was turned on, never expires); replies carry
        ``claimTtlMs`` and the queue then reports at least every ``claim_ttl_ms / 2`` while it
        holds claimed permits (a heartbeat ``sync``). It frees grant permits only: given with it,
        ``leases`` defaults to ``None``. **Risk:** work that is still running on a client that cannot
        reach the holder for that long loses its permit (it runs uncharged, so the limit can be
        exceeded by it); choose a value well above any outage you expect.

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
        round_wait_ms: int = ROUND_WAIT_MS,
        round_period_ms: int = ROUND_PERIOD_MS,
        grant_timeout_ms: int = 10_000,
        leases: LeaseConfig | Mapping[str, Any] | None = DEFAULT_LEASES,
        clock: Callable[[], int] | None = None,
        id_factory: Callable[[], str] | None = None,
        lease_secret: str | bytes | None = None,
        secret_factory: Callable[[], bytes] | None = None,
        on_round: OnRound | None = None,
        claim_ttl_ms: int | None = None,
        hold_blocked_ms: int = 0,
        free_at_once: bool = True,
    ) -> None:
        _check_sources(scheduler, limit, group_limit, can_grant)
        self.scheduler = scheduler
        self.storage: Storage = scheduler.storage
        self.limit = limit
        self.group_limit = group_limit
        self.can_grant = can_grant
        self.round_wait_ms = option_int(round_wait_ms, "round_wait_ms", 0)
        self.round_period_ms = option_int(round_period_ms, "round_period_ms", 0)
        self.grant_timeout_ms = option_int(grant_timeout_ms, "grant_timeout_ms", 1)
        if on_round is not None and not callable(on_round):
            raise ConfigurationError("on_round: expected None or a callable", field="on_round")
        #: The round hook (see the ``on_round`` option).
        self.on_round = on_round
        self.claim_ttl_ms = None if claim_ttl_ms is None else option_int(claim_ttl_ms, "claim_ttl_ms", 1)
        self.leases = holder_leases(leases, self.claim_ttl_ms)
        self.hold_blocked_ms = option_int(hold_blocked_ms, "hold_blocked_ms", 0)
        if not isinstance(free_at_once, bool):
            raise ConfigurationError(f"free_at_once: expected a bool, got {free_at_once!r}", field="free_at_once")
        #: When rounds run (SPEC R9, R9a): read by :mod:`semaphore.core.batching`.
        self.timing = Timing(self.round_wait_ms, self.round_period_ms, free_at_once)
        self.clock: Callable[[], int] = clock or scheduler.clock  # the scheduler's defaults to system_clock
        self.store = SqlStore(self.storage)
        self._grants_table = TableWatch(self.storage, GRANTS)  # for the reclaim's next_due
        #: What the core's decisions read of these options (SPEC R15, R31, R32, §7).
        self.policy = Policy(
            leases=self.leases,
            grant_timeout_ms=self.grant_timeout_ms,
            round_period_ms=self.round_period_ms,
            free_at_once=free_at_once,
            new_id=id_factory or (lambda: secrets.token_hex(12)),
            app_secret=_holder_key(configured_secret(lease_secret), scheduler.ctx),
            new_secret=secret_factory or (lambda: secrets.token_bytes(4 * LEASE_KEY_WORDS)),
            claim_ttl_ms=self.claim_ttl_ms,
        )
        self._init_memory()
        scheduler.participate(RECLAIM_TIMER, self._reclaim_due, self._on_reclaim_timer)

    def _init_memory(self) -> None:
        """The instance's in-memory state (lost with the object: rounds, held requests)."""
        self._pending: dict[str, _Waiting] = {}
        #: Requests held open unserved (``hold_blocked_ms``): every later round takes them again.
        self._held: dict[str, _Waiting] = {}
        #: Wakes at the earliest held request's deadline (its round answers it).
        self._hold_task: asyncio.Task[None] | None = None
        #: The limits the last committed round resolved: what its held requests were refused under.
        self._round_limits: Limits | None = None
        #: Re-resolves the limits while requests are held (R9 decision "limits that rise").
        self._watch_task: asyncio.Task[None] | None = None
        self._arrivals = itertools.count()
        #: The round timer waiting to run the next round (``None`` once it took its batch).
        self._round_task: asyncio.Task[None] | None = None
        #: Strong references to every round task not yet done: the event loop keeps only weak
        #: ones, and a round awaiting a callback must not be garbage-collected mid-round (R4).
        self._round_tasks: set[asyncio.Task[None]] = set()
        self._round_at: int | None = None
        self._last_round_at: int | None = None
        #: When the last batched round began: ``round_period_ms`` spaces batched rounds (R9);
        #: rounds run at once (R9a) do not delay the next batched one.
        self._last_batched_at: int | None = None
        #: Rounds that took their batch and have not ended: a round run at once waits for
        #: them (R9a: immediate rounds never overlap).
        self._running = 0
        #: A round run at once was declined since the last commit (R9a): contention is known.
        self._declined = False
        #: R29 flag of the last committed round (durable in meta ``contended``; loaded by
        #: :meth:`_ensure_ready`, updated only after a round's commit). Syncs answer it.
        self._last_contended = False
        #: The last committed round left need unserved (R29's first cause, without R29's
        #: "full" decision): what R9a counts as contention.
        self._last_unserved = False
        #: Capacity left free by the last committed round or freed since, with reusable leases
        #: (R34a room). In memory only, so an instance that has committed no round yet (a new
        #: one, after an eviction) assumes there is some: a covered client that hears it asks
        #: once, and the first committed round sets it from what it leaves free.
        self._room = self._reusable_leases
        #: An arm() of the alarm failed (or is under way): the next sync arms even if it writes
        #: nothing (R16: an alarm lost between a commit and its setAlarm is repaired by the
        #: next call, as before a sync skipped arming, R38 decision "last seen").
        self._arm_owed = False
        #: R31a count of the last committed round (durable in meta ``starving``, like the flag).
        self._last_starving = 0
        #: R31b fair share of that round (``None``: no bound; durable in meta ``lease_share``).
        self._last_share: int | None = None
        #: The last committed round's resolved limit (durable in meta ``last_limit``): a sync
        #: retires leases when the limit is now below it (R33a).
        self._last_limit: int | None = None
        self._ready = False

    # ================================================================== public API
    @overload
    async def handle(self, message: str) -> str: ...

    @overload
    async def handle(self, message: PermitRequest | SyncMessage | Mapping[str, Any] | Any) -> dict[str, Any]: ...

    async def handle(self, message: Any) -> dict[str, Any] | str:
        """Handle one wire message and return the wire reply (SPEC §3).

        A ``request`` waits for its round (SPEC R9); a ``sync`` is applied and answered at once
        (SPEC R6). An invalid message is answered with an ``invalid_message`` error value and
        changes nothing (SPEC R7, I5); a round that cannot be committed is answered with a
        ``round_failed`` error value (SPEC R2). Typed :class:`PermitRequest`/:class:`SyncMessage`
        objects are accepted too.

        A message given as JSON text (a ``str``, as the client helper sends it: SPEC R7 "JSON
        text") is answered with the JSON text of the reply (or of the error value: text that is
        not JSON, or nests deeper than 64 levels, is an ``invalid_message`` of field ``""``), so
        neither crosses the RPC as an object converted field by field."""
        if isinstance(message, str):
            try:
                decoded = json_text.decode_message(message)
            except InvalidMessageError as exc:
                return json_text.encode(exc.to_wire())
            return json_text.encode(await self._handle(decoded))
        return await self._handle(message)

    async def _handle(self, message: Any) -> dict[str, Any]:
        if isinstance(message, (PermitRequest, SyncMessage)):
            message = message.to_wire()
        try:
            parsed = parse_message(message)  # reads only known fields (wire.py): no deep copy
        except InvalidMessageError as exc:
            return exc.to_wire()
        try:
            await self._ensure_ready()
        except ConfigurationError as exc:  # e.g. no SQLite storage: the client raises it, never retries
            log.error("semaphore storage is not usable: %s", exc)
            return exc.to_wire()
        except Exception as exc:  # storage unusable: nothing was written
            log.exception("semaphore storage is not usable")
            return RoundFailedError(f"storage error: {exc}").to_wire()
        reply = await (self._sync(parsed) if isinstance(parsed, SyncMessage) else self._enqueue(parsed))
        if "error" not in reply:
            reply = dict(reply)  # a round's reply dict may be shared by several calls (R10)
            reply["joinInMs"] = self._join_in_ms(int(reply["nextRequestAt"]))
            if self.claim_ttl_ms is not None:
                reply["claimTtlMs"] = self.claim_ttl_ms  # the client heartbeats its claims (R18 decision)
            recheck_ms = self._recheck_ms(reply)
            if recheck_ms > 0:
                reply["leaseRecheckMs"] = recheck_ms  # the client rechecks leases (R33a)
        return reply

    def _recheck_ms(self, reply: Mapping[str, Any]) -> int:
        """SPEC R33a: the ``leaseRecheckMs`` to tell: the lease option's; with leases not
        configured, the default while the reply lists a live lease of the client (one that
        outlived the option: it keeps the bound until it ends), else 0 (not told)."""
        if self.leases is not None:
            return self.leases.recheck_ms
        live = any(x.get("status") == LeaseStatus.LIVE.value for x in reply.get("leases") or ())
        return LeaseConfig.recheck_ms if live else 0  # the option's default

    def _join_in_ms(self, next_request_at: int) -> int:
        """SPEC R11 decision: in how many ms from now a request joins the round that runs at
        ``next_request_at``: 0 while a round is waiting, else ``round_wait_ms`` before it (a
        request starts the round timer at ``max(arrival + round_wait_ms, last round +
        round_period_ms)``, R9), never negative. Relative, so the client's clock need not agree
        with the holder's."""
        if self._round_at is not None:
            return 0
        return max(0, next_request_at - self.round_wait_ms - int(self.clock()))

    async def usage(self) -> dict[str, Any]:
        """Current usage (SPEC R38), computed by :func:`semaphore.core.usage.measure`::

            {"limit": int | None, "outstanding": int, "leaseFootprint": int,
             "liveLeases": int, "retiredLeases": int, "charged": int, "available": int | None,
             "groups": {group: {"outstanding", "leaseFootprint", "liveLeases",
                                "retiredLeases", "limit", "charged", "available"}}}

        ``outstanding`` is the sum of ``permits - released`` over grants; ``charged`` is
        ``outstanding + leaseFootprint``; ``available`` is what one new grant request could get
        now: the grant room of the provisioning mode under the limit (and, in a group, under the
        group's limit too), never below 0. ``limit`` is ``None`` when the limit (or a group's
        limit) is not set or could not be resolved; ``available`` is ``None`` when the limit or
        the group's could not be resolved. :class:`~semaphore.SemaphoreUsage` is the typed view.
        Reads the aggregate rows only (meta and groups), never the grant or lease tables."""
        await self._ensure_ready()
        limit = await self._resolve_limit(misconfigured=False)
        meta = read_meta(self.storage)
        groups: dict[str, tuple[dict[str, Any], Any]] = {}
        for r in self.store.group_rows():
            name = str(r["group_name"])
            groups[name] = (r, await self._resolve_group_limit(name))
        return measure(limit, meta, groups, self.leases).to_wire()

    # ================================================================== operations (issue 11)
    async def holders(self, cursor: str | None = None, limit: int = 100) -> dict[str, Any]:
        """Who holds what: one page of the clients holding grants or leases, in client id order::

            {"holders": [{"clientId", "label", "lastReportAt", "charged",
                          "grants": [{"grantId", "group", "permits", "claimed", "released",
                                      "issuedAt", "claimBy", "status", "charged"}],
                          "leases": [{"leaseId", "group", "permits", "drawn", "released",
                                      "stopped", "issuedAt", "expiresAt", "status", "reusable",
                                      "charged"}]}],
             "cursor": str | None}

        Pass ``cursor`` back for the next page (``None``: this was the last). ``limit``: 1 to
        1,000 clients per page. ``label``: the readable name its messages carry (wire ``label``;
        by default the client object's name), ``None`` if none did. ``lastReportAt``: when the
        client last sent a request or a sync (epoch ms, to within 60 s: a sync that changes
        nothing rewrites it once it is that old; ``None`` if not since this release recorded it).
        ``charged``: what each row charges (R19, R30; every slot of a live
        ``reusable`` lease, R30a). The reads are proportional to the page, not to all state. A
        bad option raises
        :class:`ConfigurationError` naming it."""
        await self._ensure_ready()
        return _operations.holders_page(self.store, cursor, limit)

    async def force_settle(self, client_id: str, reason: str, *, actor: str | None = None) -> dict[str, Any]:
        """Declare ``client_id`` gone for good and free everything it holds: the one explicit
        exception to "never revoke". Its grants are deleted (their ``permits - released``
        freed; its later reports of them are answered ``not_found`` and never applied, R14) and
        its leases stopped at their released count (footprint 0; its next report of each is
        answered ``settled``), so no report of that client can free anything twice (I2). If the
        client is alive after all, its queue stops using those permits: items not yet started
        under them go back to the queue for a fresh admission; work already running is not
        stopped (it runs uncharged). Writes who (``actor``), when and why (``reason``, required)
        to the audit table ``durability_semaphore_audit`` in the same transaction, and returns
        that record (see :meth:`audit`). Idempotent in effect: a second call frees nothing and
        records that."""
        await self._ensure_ready()
        record = _operations.force_settle(self.storage, self.store, int(self.clock()), client_id, reason, actor)
        log.warning("force-settled client %r (%s): %d grant permits and %d lease permits freed; audit %d",
                    record["clientId"], record["reason"], record["grantPermits"], record["leasePermits"],
                    record["auditId"])
        # R18 decision, R9: a force-settle frees capacity, like a releasing sync: a held request
        # is served by the next round the period allows, not at its own deadline.
        if record["grantPermits"] or record["leasePermits"]:
            self._freed()
        try:
            await self._arm()
        except Exception:  # the commit stands; the next instance start re-arms
            log.exception("could not arm the alarm after a force-settle")
        return record

    async def audit(self, cursor: int | None = None, limit: int = 100) -> dict[str, Any]:
        """The audit records, newest first: ``{"records": [{"auditId", "at", "action",
        "clientId", "reason", "actor", "grantPermits", "leasePermits", "grants": [{"grantId",
        "group", "permits"}], "leases": [...]}], "cursor": int | None}`` (pass ``cursor`` back
        for older records). Only :meth:`migrate` ``(ctx, None)`` removes them."""
        await self._ensure_ready()
        return _operations.audit_page(self.store, cursor, limit)

    #: ``DurabilitySemaphore.client(binding=..., invoke=...)``: the client helper (SPEC R36),
    #: :func:`semaphore.rpc.client` itself (same signature and documentation).
    client = staticmethod(rpc_client)

    @staticmethod
    def migrate(ctx: Any, to_version: int | None) -> None:
        """Migrate the semaphore's schema in ``ctx.storage.sql``.

        ``None`` removes it: the grant, lease, group and meta tables and the semaphore's
        scheduler timers (SPEC R3). ``1`` creates the current schema (done automatically on
        first use). Discard any live :class:`DurabilitySemaphore` instance afterwards."""
        storage = ctx if isinstance(ctx, Storage) else Storage(ctx)
        if to_version is None:
            drop_schema(storage)
            DurabilityScheduler.remove_timers(storage, TIMER_PREFIX)
            return
        if to_version != SCHEMA_VERSION:
            raise ConfigurationError(
                f"migrate: unknown schema version {to_version!r} (this release has {SCHEMA_VERSION})",
                field="to_version",
            )
        ensure_schema(storage)

    def next_request_at(self) -> int:
        """Earliest time the next round can run (SPEC R11, R9a)."""
        return next_request_at(self.timing, int(self.clock()), last_round_at=self._last_batched_at,
                               contended=self._contention, round_at=self._round_at)

    @property
    def _reusable_leases(self) -> bool:
        """The holder issues reusable leases (R34a)."""
        return self.leases is not None and self.leases.reusable

    @property
    def _contention(self) -> bool:
        """Contention the holder knows of (R9a): the last committed round left need unserved
        (R29), a round run at once was declined since, or requests are held."""
        return self._last_unserved or self._declined or bool(self._held)

    # ================================================================== lifecycle
    async def _ensure_ready(self) -> None:
        if self._ready:
            return
        ensure_schema(self.storage)
        self._grants_table.created()
        meta = read_meta(self.storage)
        last_round_at = meta.get("last_round_at")
        if last_round_at is not None and self._last_round_at is None:
            self._last_round_at = last_round_at
            self._last_batched_at = last_round_at  # not known: as if it were batched
        # R29: the last committed round's flag survives eviction (one read per instance).
        self._last_contended = bool(meta.get("contended", 0))
        self._last_unserved = self._last_contended  # not stored apart: as if unserved
        self._last_starving = int(meta.get("starving", 0))
        last_limit = meta.get("last_limit")
        self._last_limit = None if last_limit is None else int(last_limit)
        self._last_share = stored_share(meta)
        self._ready = True
        # Repairs an alarm lost between a commit and its setAlarm (e.g. an eviction).
        await self._arm()
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
            # R10: a held client's new request joins it (its calls get the same answer)
            pending = self._held.pop(request.client_id, None) or _Waiting(request.client_id, next(self._arrivals))
            self._pending[request.client_id] = pending
        pending.messages.append(request)
        # A held request's deadline counts from the first of its calls: a client whose transport
        # gives up before waitMs and asks again must still get an answer by then.
        pending.since = pending.since or int(self.clock())
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        pending.futures.append(future)
        if request.no_wait:
            self._hasten()
        self._start_pending()
        return await future

    def _hasten(self) -> None:
        """R9b: a try does not wait for a batched round timer: the timer is dropped (its
        requests stay waiting, nobody is failed) and :meth:`_start_pending` starts the round at
        once."""
        task = self._round_task
        if task is not None and not task.done():
            self._round_task, self._round_at = None, None  # _round_ended: no longer the timer
            task.cancel()

    def _start_pending(self) -> None:
        """Start the round timer for the waiting requests if none waits, at the time
        :func:`~semaphore.core.batching.round_start` gives (R9, R9a, R9b); none while a round
        runs and rounds run at once (that round's end calls this again)."""
        if self._round_task is not None or not self._pending:
            return
        contended = self._contention
        urgent = any(_is_try(p) for p in self._pending.values())
        at = round_start(self.timing, int(self.clock()), first_since=min(p.since for p in self._pending.values()),
                         last_batched_at=self._last_batched_at, contended=contended, running=self._running > 0,
                         urgent=urgent)
        if at is not None:
            self._start_timer(at, immediate=urgent or self.timing.immediate(contended))

    def _start_timer(self, at: int, *, immediate: bool) -> None:
        self._round_at = at
        task = asyncio.get_running_loop().create_task(self._round_after(at, immediate))
        self._round_task = task
        self._round_tasks.add(task)
        task.add_done_callback(self._round_ended)

    def _round_ended(self, task: asyncio.Task[None]) -> None:
        """Done callback of every round task (also called by :meth:`_enqueue` for a done timer):
        drops the strong reference and, if the task is still the waiting round timer (it ended
        without taking its batch, e.g. cancelled before its first step), fails the waiting calls
        and clears the timer so the next request starts a new one (SPEC R4)."""
        self._round_tasks.discard(task)
        if self._round_task is not task:
            return
        self._round_task = None
        self._round_at = None
        batch, self._pending = self._take_batch()
        if task.cancelled():
            reason = "the round timer was cancelled; ask again"
        else:
            exc = task.exception()
            reason = f"the round timer ended without running: {exc}" if exc else "the round timer ended"
        self._fail(batch, reason)

    @staticmethod
    def _fail(batch: dict[str, _Waiting], reason: str, failure: dict[str, Any] | None = None) -> None:
        failure = failure or RoundFailedError(f"round failed: {reason}").to_wire()
        for pending in batch.values():
            for f in pending.futures:
                if not f.done():
                    f.set_result(failure)

    async def _round_after(self, at: int, immediate: bool = False) -> None:
        batch: dict[str, _Waiting] = {}
        try:
            await sleep_until(self.clock, at)
            batch, self._pending = self._take_batch()
            self._round_task = None
            self._round_at = None
            self._running += 1
            try:
                await self._run_round(batch, immediate)
            finally:
                self._running -= 1
            self._start_pending()  # requests that came while it ran (R9a), or a declined batch
        except BaseException as exc:  # never leave a caller hanging
            if isinstance(exc, asyncio.CancelledError) and not batch and self._round_task is not asyncio.current_task():
                raise  # a timer a try replaced (R9b): its requests wait for the round it starts
            log.exception("round failed")
            if not batch and self._round_task is asyncio.current_task():
                # failed while waiting: the waiting calls were this round's
                batch, self._pending = self._take_batch()
                self._round_task = None
                self._round_at = None
            # a misconfigured limit (R12 decision) is answered as such: the client never retries it
            self._fail(batch, str(exc) or type(exc).__name__,
                       exc.to_wire() if isinstance(exc, ConfigurationError) else None)
            if isinstance(exc, asyncio.CancelledError):
                if batch and self._round_task is None and self._running == 0:
                    # requests that waited for this round's end (R9a) would wait for ever (R4)
                    waiting, self._pending = self._pending, {}
                    self._fail(waiting, "the round they waited for was cancelled; ask again")
                raise
            self._start_pending()

    async def _run_round(self, batch: dict[str, _Waiting], immediate: bool = False) -> None:
        """Run one round over ``batch`` (R2, R12, R29) and answer its calls; then its
        :class:`~semaphore.holder._observe.RoundRecord` goes to the log and ``on_round``. A
        round run at once (``immediate``) that would leave need unserved is declined (R9a):
        nothing is written or answered, and its requests wait for a batched round."""
        now = int(self.clock())
        last_round_at, self._last_round_at = self._last_round_at, now
        if not immediate:
            self._last_batched_at = now
        clients = list(batch.values())
        started = time.perf_counter()
        try:
            limits = await self._resolve(clients)
        except Exception as exc:  # _round_after fails the calls
            emit(failed_record(now, (time.perf_counter() - started) * 1000, 0, len(clients), None, exc),
                 self.on_round)
            raise
        statements = self.storage.statements
        served: frozenset[str] | None = None  # a failed round holds nobody: it answers everyone
        try:  # load -> decide -> persist, in one transaction (R2)
            outcome = self.storage.transaction(
                lambda: run_round(self.store, now, clients, limits, self.policy, immediate=immediate,
                                  urgent=any(_is_try(p) for p in clients)))
            if outcome is None:
                self._decline(batch, last_round_at)
                return
        except Exception as exc:
            log.exception("round transaction failed; nothing was written")
            failure = RoundFailedError(f"round failed, nothing was written: {exc}").to_wire()
            replies = {p.client_id: failure for p in clients}
            record = failed_record(now, (time.perf_counter() - started) * 1000,
                                   self.storage.statements - statements, len(clients), limits.limit, exc)
        else:
            record = round_record(now, (time.perf_counter() - started) * 1000,
                                  self.storage.statements - statements, outcome)
            replies, served = outcome.replies, outcome.served
            self._last_contended = outcome.contended  # R29: only a committed round changes the flag
            self._room = room_after_round(
                reusable=self._reusable_leases, charged=outcome.charged,
                ceiling=None if outcome.limit is None else ceiling(outcome.limit, self.leases),
                unserved=outcome.unserved)
            self._last_unserved = outcome.unserved
            self._declined = False
            self._last_starving = outcome.starving
            self._last_share = outcome.share
            if outcome.limit is not None:
                self._last_limit = outcome.limit  # meta last_limit (R33, R33a)
            self._round_limits = limits
            try:
                await self._arm()
            except Exception:  # the commit stands; the next instance start re-arms
                log.exception("could not arm the alarm after a round")
        self._answer(clients, replies, served, now)
        emit(record, self.on_round)

    def _decline(self, batch: dict[str, _Waiting], last_round_at: int | None) -> None:
        """R9a: a round run at once found contention and wrote nothing: its requests wait again
        (before any that came meanwhile, R10) for the batched round the caller starts; it does
        not count as a round for ``round_period_ms``."""
        self._last_round_at = last_round_at
        self._declined = True
        for client_id, p in self._pending.items():
            older = batch.get(client_id)
            batch[client_id] = p if older is None else _merged(older, p)
        self._pending = batch
        log.debug("a round run at once found contention; its %d requests wait for a batched round", len(batch))

    def _answer(self, clients: list[_Waiting], replies: dict[str, dict[str, Any]],
                served: frozenset[str] | None, now: int) -> None:
        """Set each client's calls to its reply, unless its request is held open (``served``
        is ``None`` after a failed round: everyone is answered)."""
        for p in clients:
            if served is not None and self._hold(p, replies[p.client_id], served, now):
                continue
            for f in p.futures:
                if not f.done():
                    f.set_result(replies[p.client_id])
        self._arm_hold()

    # ================================================================== held requests
    def _take_batch(self) -> tuple[dict[str, _Waiting], dict[str, _Waiting]]:
        """The next round's clients: the held requests and the pending ones (both emptied);
        returns ``(batch, new pending)``."""
        batch = dict(self._held)
        for client_id, p in self._pending.items():
            held = batch.get(client_id)
            batch[client_id] = p if held is None else _merged(held, p)
        self._held = {}
        return batch, {}

    def _hold(self, p: _Waiting, reply: dict[str, Any], served: frozenset[str], now: int) -> bool:
        """Hold ``p`` open instead of answering it (``hold_blocked_ms``): the round served it
        nothing, it is blocked, and its deadline has not come. Its reports are applied: the next
        round re-reads only its latest request."""
        if not hold_open(hold_ms=self.hold_blocked_ms, is_try=_is_try(p), served=p.client_id in served,
                         blocked=bool(reply.get("blocked")), now=now, hold_until=p.hold_until(self.hold_blocked_ms),
                         answered=all(f.done() for f in p.futures), news=lambda: reply_has_news(reply, p.latest)):
            return False
        del p.messages[:-1]
        newer = self._pending.get(p.client_id)
        if newer is not None:  # a new request of the client came while this round ran: join it (R10)
            self._pending[p.client_id] = _merged(p, newer)
            return True
        self._held[p.client_id] = p
        return True

    def _arm_hold(self) -> None:
        """Keep one task waiting for the earliest held deadline (its round answers it); a
        cancelled one (eviction) fails the held calls like a round timer's (R4)."""
        task = self._hold_task
        if task is not None and not task.done():
            task.cancel()
        self._hold_task = None
        if not self._held:
            watch, self._watch_task = self._watch_task, None
            if watch is not None:
                watch.cancel()  # nothing held: no check is left pending
            return
        at = min(p.hold_until(self.hold_blocked_ms) for p in self._held.values())
        self._hold_task = asyncio.get_running_loop().create_task(self._hold_until(at))
        self._hold_task.add_done_callback(self._hold_ended)
        self._watch_limits()

    @property
    def limit_check_ms(self) -> int:
        """How often the holder resolves its limits again while requests are held and a limit
        option can change (SPEC R9 decision "limits that rise"): ``round_period_ms`` (a round
        started by a check cannot run sooner after the previous round anyway), but at least
        100 ms, so a period of 0 does not call a callable limit at every turn of the loop."""
        return max(self.round_period_ms, 100)

    def _watch_limits(self) -> None:
        """SPEC R9 decision (limits that rise): while requests are held and ``limit``,
        ``group_limit`` or ``can_grant`` can change (:func:`~semaphore.core.batching.limits_can_change`),
        one task resolves them again every :attr:`limit_check_ms` and starts the round when they
        rose (:func:`~semaphore.core.batching.limits_rose`), so the application need not call
        :meth:`start_round`. It stops once nothing is held."""
        task = self._watch_task
        if (not self._held or self._round_limits is None or (task is not None and not task.done())
                or not limits_can_change(self.limit, self.group_limit, self.can_grant)):
            return
        self._watch_task = asyncio.get_running_loop().create_task(self._limits_watch())

    async def _limits_watch(self) -> None:
        while self._held:
            await sleep_until(self.clock, int(self.clock()) + self.limit_check_ms)
            before = self._round_limits
            if not self._held or before is None or self._round_task is not None or self._running:
                continue  # a round is on its way: it resolves the limits itself
            try:
                after = await self._resolve_again(before, self._held.values())
            except Exception:  # the resolvers log and fail closed; never let the watch die
                log.exception("resolving the limits again while requests are held failed")
                continue
            # a round that committed meanwhile resolved them itself: compare with nothing stale
            if self._held and self._round_limits is before and limits_rose(before, after):
                self.start_round()

    async def _resolve_again(self, before: Limits, held: Iterable[_Waiting]) -> Limits:
        """What of ``before`` the ``held`` requests wait on, resolved now (R12's resolvers,
        failures logged at DEBUG: a check repeats every period): the limit, the group limits of
        the groups they demand, ``can_grant`` of their pairs it refused (only a refused pair can
        turn allowing). Groups and pairs of clients not held are left out: a rise there serves
        no held request."""
        pairs = {(p.client_id, d.group) for p in held for d in p.latest.demand}
        limit = await self._resolve_limit(misconfigured=False, quiet=True)
        groups = sorted({g for _, g in pairs} & set(before.group_limits))
        group_limits = {g: await self._resolve_group_limit(g, quiet=True) for g in groups}
        refused = sorted(pair for pair in pairs if before.permitted.get(pair) is False)
        permitted = {pair: await self._resolve_can_grant(*pair, quiet=True) for pair in refused}
        return Limits(limit, group_limits, permitted)

    async def _hold_until(self, at: int) -> None:
        await sleep_until(self.clock, at)
        self._hold_task = None
        self.start_round()

    def _hold_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() and self._hold_task is task:  # not replaced: the instance stopped
            self._hold_task = None
            if self._round_task is None and self._held:  # nothing will run their round
                held, self._held = self._held, {}
                self._fail(held, "the instance stopped while the request was held; ask again")

    def start_round(self) -> None:
        """Start the round timer for the held requests, if none is waiting: at once, but no
        sooner than ``round_period_ms`` after the previous round (R9). Called when capacity
        frees (a releasing sync, a reclaim, a force-settle), at a held request's deadline, and
        when limits resolved again while requests are held rose (R9 decision "limits that rise",
        every :attr:`limit_check_ms`); does nothing while nothing is held. Call it after raising
        ``limit`` or a group limit, or after ``can_grant`` starts allowing, to serve held
        requests at once rather than at the next check."""
        if not self._held or self._round_task is not None:
            return
        self._start_timer(next_request_at(self.timing, int(self.clock()), last_round_at=self._last_batched_at,
                                          contended=True, round_at=None), immediate=False)

    async def _resolve(self, clients: list[_Waiting]) -> Limits:
        """The round's limits (R12): the limit, every demanded group's limit and every group
        holding live leases' (R33), and ``can_grant`` for every demanded ``(client, group)`` and
        every live lease's pair (R22, R33), resolved before the transaction opens."""
        limit = await self._resolve_limit()
        demand_pairs, lease_pairs, groups = lease_scope(
            self.store, clients, leases_configured=self.leases is not None, every_lease=self.can_grant is not None)
        group_limits = {g: await self._resolve_group_limit(g) for g in sorted(groups)}
        if callable(self.can_grant):
            permitted = {pair: await self._resolve_can_grant(*pair) for pair in sorted(demand_pairs | lease_pairs)}
        else:  # None or a bool: the same answer for every pair, no call per pair
            permitted = dict.fromkeys(demand_pairs | lease_pairs, self.can_grant is None or bool(self.can_grant))
        return Limits(limit, group_limits, permitted)

    # ================================================================== sync and alarm
    async def _sync(self, message: SyncMessage) -> dict[str, Any]:
        """SPEC R6: apply a sync's reports in their own transaction and answer at once, with the
        ``contended`` flag of the last committed round (R29; durable, so it survives eviction)."""
        try:
            limits = await self._sync_limits(message)
        except ConfigurationError as exc:  # a misconfigured limit (R12 decision): nothing written
            return exc.to_wire()
        now = int(self.clock())
        lowered = limits is not None and limit_lowered(self._last_limit, limits.limit)
        contended, next_at, starving = self._last_contended, self.next_request_at(), self._last_starving
        share = self._last_share
        try:
            reply, charge_change, wrote = self.storage.transaction(
                lambda: run_sync(self.store, now, message, self.policy, contended, next_at, starving, limits,
                                 lowered, share=share))
        except Exception as exc:
            log.exception("sync transaction failed; nothing was written")
            return RoundFailedError(f"sync failed, nothing was written: {exc}").to_wire()
        if lowered and limits is not None:
            self._last_limit = limits.limit  # the sync wrote meta last_limit (R33a)
        if charge_change < 0 or (limits is not None and isinstance(limits.limit, int)
                                 and self._last_limit is not None and limits.limit > self._last_limit):
            # it freed capacity, or the limit rose since the last round: a held request may
            # wait for it (none held: no-op)
            self._freed()
        if "contended" in reply and self._sync_room():  # R34a room: ask for what is free now
            reply["room"] = True
        if wrote or self._arm_owed:  # a sync that wrote nothing moved no deadline (R38 decision "last seen")
            await self._arm()
        return reply

    async def _arm(self) -> None:
        """Arm the object's alarm (:meth:`DurabilityScheduler.arm`); owed until it succeeds."""
        self._arm_owed = True
        await self.scheduler.arm()
        self._arm_owed = False

    def _freed(self, room: bool = True) -> None:
        """Capacity freed (or the limit rose): a held request may wait for it (R9, R18), and
        with reusable leases the syncs that follow say there is room (R34a)."""
        if room and self._reusable_leases:
            self._room = True
        self.start_round()

    def _sync_room(self) -> bool:
        """Whether a sync's reply says ``room`` (:func:`~semaphore.core.batching.sync_room`)."""
        waiting = bool(self._held or self._pending or self._round_task is not None or self._running)
        return sync_room(freed=self._room, waiting=waiting)

    async def _sync_limits(self, message: SyncMessage) -> Limits | None:
        """SPEC R33a: for a sync that reports leases, the limit, the group limits of the client's
        live-lease groups and, when ``can_grant`` is callable, its answer for each of the
        client's live-lease ``(client, group)`` pairs, resolved before its transaction (R12), so
        the sync retires what the next round would (``None``: nothing reported, or leases not
        configured and no lease live: nothing to retire, nothing resolved)."""
        scope = sync_scope(self.store, message, leases_configured=self.leases is not None,
                           group_limits=self.group_limit is not None, every_pair=callable(self.can_grant))
        if scope is None:
            return None
        limit = await self._resolve_limit()
        groups = {g for _, g in scope} if self.group_limit is not None else set()
        group_limits = {g: await self._resolve_group_limit(g) for g in sorted(groups)}
        permitted = ({pair: await self._resolve_can_grant(*pair) for pair in sorted(scope)}
                     if callable(self.can_grant) else {})
        return Limits(limit, group_limits, permitted)

    def _reclaim_due(self) -> int | None:
        """The reclaim participant's ``next_due`` (SPEC R16): the earliest deadline of a grant with
        unclaimed permits, one read; ``None`` when there is no grant table (not created yet, or
        removed by :meth:`migrate` ``(ctx, None)``: nothing to reclaim, and nothing re-created)."""
        due = self._grants_table.read(self.store.next_reclaim_due)
        if self.claim_ttl_ms is None:
            return due
        expiry = self._grants_table.read(self.store.claim_expiry_due)
        return expiry if due is None else due if expiry is None else min(due, expiry)

    def _on_reclaim_timer(self, name: str, due_at: int) -> None:
        """Alarm (the reclaim participant's run, once :meth:`_reclaim_due` has come): reclaim
        unclaimed permits past their deadline (SPEC R16)."""
        if not self._ready:  # an alarm can be the first call an instance gets
            if not self._grants_table.exists(fresh=True):
                return  # migrated away since the alarm listed its work: create nothing (R3)
            ensure_schema(self.storage)
            self._grants_table.created()
        # Never before the time the scheduler ran it for (a holder clock behind the scheduler's
        # would reclaim nothing and count as no progress).
        now = max(int(self.clock()), int(due_at))
        # The reclaim's next due time follows from the grants written: the scheduler's arm()
        # after the run reads it (_reclaim_due).
        change = self.storage.transaction(lambda: run_reclaim(self.store, now))
        self._freed(room=change < 0)  # reclaimed permits may serve a held request
        if self.claim_ttl_ms is not None:
            freed = self.storage.transaction(lambda: run_claim_expiry(self.store, now))
            if freed:
                self._freed()
                log.warning("claim_ttl_ms: released %d claimed permits of %d grants (first: %r): their clients"
                            " sent nothing for %d ms; work still running under them is no longer charged",
                            sum(n for _, _, n in freed), len(freed), freed[0][0], self.claim_ttl_ms)

    # ================================================================== limits (SPEC R12)
    async def _resolve_limit(self, *, misconfigured: bool = True, quiet: bool = False) -> Any:
        """The limit (R12), or LIMIT_ERROR when it cannot be resolved. A ConfigurationError the
        callable raises (the application says it is misconfigured: a var the Worker does not
        set, see :func:`semaphore.runtime.env_int`) is raised on (R12 decision) unless
        ``misconfigured`` is false (a read: it shows the limit as unresolved). ``quiet``: failures
        are logged at DEBUG (the checks of held requests' limits repeat them every period)."""
        report = log.debug if quiet else log.error
        try:
            value = await _call(self.limit) if callable(self.limit) else self.limit
        except ConfigurationError as exc:
            report("limit: %s", exc.message)
            if misconfigured:
                raise
            return LIMIT_ERROR
        except Exception:
            report("limit callback raised", exc_info=True)
            return LIMIT_ERROR
        count = valid_count(value)
        if count is None:
            report("limit resolved to an invalid value %r", value)
            return LIMIT_ERROR
        return count

    async def _resolve_group_limit(self, group: str, *, quiet: bool = False) -> Any:
        source = self.group_limit
        report = log.debug if quiet else log.error
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
            report("group_limit callback raised for group %r", group, exc_info=True)
            return LIMIT_ERROR
        if value is None:
            return None
        count = valid_count(value)
        if count is None:
            report("group_limit(%r) resolved to an invalid value %r", group, value)
            return LIMIT_ERROR
        return count

    async def _resolve_can_grant(self, client_id: str, group: str, *, quiet: bool = False) -> bool:
        source = self.can_grant
        if source is None:
            return True
        if not callable(source):
            return bool(source)
        try:
            return bool(await _call(source, client_id, group))
        except Exception:
            report = log.debug if quiet else log.error
            report("can_grant callback raised for (%r, %r); not permitted", client_id, group, exc_info=True)
            return False
