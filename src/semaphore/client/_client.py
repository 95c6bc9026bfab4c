"""SemaphoreClient: the client side's durable copy of its grants and leases (SPEC R35).

A client Durable Object talks to one holder per semaphore *key*. The client:

* persists every grant and lease it knows of in its own ``ctx.storage.sql`` (tables
  ``durability_semaphore_client_grants``, ``..._leases`` and ``..._keys``), so it survives
  eviction: a new instance over the same storage carries on where the old one stopped;
* builds cumulative reports (``claimed``/``released`` per grant, ``drawn``/``released``/``stopped``
  per lease) from them, so a lost, repeated or reordered message never matters (SPEC R13, I2);
* remembers each key's ``nextRequestAt`` and does not send a ``request`` before it: by default
  :meth:`SemaphoreClient.request` *waits* until then (``force=True`` sends at once), and
  :meth:`SemaphoreClient.not_before` tells a caller that prefers to schedule a wake-up instead;
* turns error replies into typed exceptions (:mod:`semaphore.errors`), drops grants answered
  ``not_found``, applies ``expired`` clamps, and adopts grants and leases a reply mentions that it
  did not know (their original reply was lost, SPEC R8).

The transport is any coroutine function ``(key, message_dict) -> reply_dict`` (:mod:`semaphore.rpc`).

**Per-key unit of work:** :meth:`SemaphoreClient.unit` (:mod:`._key_unit`); the schema and
:class:`AppliedReply`: :mod:`._client_model`.

Claims are *local* until confirmed (SPEC R15a): :meth:`SemaphoreClient.claim` records the claim
and returns the claimed slot numbers; a slot ``k`` of a grant is confirmed once
:attr:`ClientGrant.confirmed` ``>= k`` (a reply showed the holder recorded it). A slot above
``confirmed`` of a grant that is no longer active (expired or dropped) will never be confirmed.

Dropped grants and settled leases are kept for a while as tombstones (``status`` ``gone`` /
``settled``) so that a stale reply cannot bring them back (:mod:`._client_model`).

**Loaded once per key.** The rows live in :class:`~semaphore.client._store.ClientRows`: a key's
live grants, live leases and key row are read once per instance (one statement), then
answered from memory; every change is written through to SQL in the caller's transaction (a
delivered report with the reply's merge of its row, or when the reply is applied; a release a
queue records in its finished item's row, ``release_n``, counted when read), and a rolled
back transaction makes the copy forget (the next read loads again).

**Reports beyond the wire limit.** A message carries at most 1,000 grant and 1,000 lease reports
(SPEC R7). Each message takes, per list, first every entry with *something to report* (counts the
holder has not acknowledged: claims, releases, draws, a stop; and live leases whose heartbeat is
due, R31), oldest first, then fills the rest of the window with the least recently reported
entries. Every row keeps ``report_at``: since when it has had something to report, or else when
it was last reported. A delivered report resets it, so no entry is starved: with ``n`` entries to
report, ``ceil(n / 1000)`` delivered messages carry them all (R13, R15a). A reply whose message
could not carry every such entry has :attr:`AppliedReply.more` set; :meth:`SemaphoreClient.flush`
(and the queue) then send the next window at once. Replies list every grant of the client (R8),
reported or not; an unreported grant's state is merged like a reported one (claims beyond what
the holder shows are never confirmed by it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from ..clock import sleep_until, system_clock
from ..core.client_state import ClientGrant, ClientLease, KeyState
from ..core.wire import (
    MAX_LIST_LENGTH,
    Demand,
    GrantReport,
    LeaseReport,
    PermitRequest,
    PermitResponse,
    SyncMessage,
)
from ..errors import HolderUnavailableError, SemaphoreError, error_from_reply
from ..runtime import Storage, migrate_tables, plain
from ._client_model import (
    _SCHEMA,
    CLIENT_TABLES,
    OBJECT_NAME,
    AppliedReply,
    ReplyHook,
    Transport,
    _client_label,
    _default_client_id,
    _install_schema,
    _Label,
)
from ._key_unit import KeyUnit
from ._replies import Reply, apply_reply
from ._rows import ClientStore
from ._store import ClientRows, releases_recorded_in

__all__ = [
    "Transport",
    "ClientGrant",
    "ClientLease",
    "KeyState",
    "KeyUnit",
    "AppliedReply",
    "Reply",
    "SemaphoreClient",
    "CLIENT_TABLES",
    "OBJECT_NAME",
]

log = logging.getLogger("semaphore.client")

class SemaphoreClient:
    """Durable client state for any number of semaphore keys (SPEC R35).

    :param ctx: the client Durable Object's ``ctx`` (SQLite-backed) or a :class:`Storage`.
    :param transport: ``async (key, message) -> reply``; an exception from it becomes
        :class:`HolderUnavailableError` (unless it already is a :class:`SemaphoreError`).
    :param clock: callable returning epoch ms (default: wall clock); a clock with
        ``sleep_until`` (e.g. ``VirtualClock``) is used for waiting until ``nextRequestAt``.
    :param client_id: the id reported to the holder (default: ``str(ctx.id)``).
    :param tombstone_ms: how long dropped grants and settled leases are remembered so that a
        stale reply cannot resurrect them (default 1 hour; deleted by a reply up to 1/16 of it
        later).
    :param recheck_ms: after every ``request`` (answered or not), send one ``sync`` this much
        later, so that a lease issued to a duplicated or late-delivered request whose reply never
        arrived is adopted and settled rather than leaked (default 30 s; 0 disables).
    """

    def __init__(
        self,
        ctx: Any,
        transport: Transport,
        *,
        clock: Callable[[], int] | None = None,
        client_id: str | None = None,
        tombstone_ms: int = 3_600_000,
        recheck_ms: int = 30_000,
        label: str | None | Literal[_Label.OBJECT_NAME] = OBJECT_NAME,
    ) -> None:
        #: The label every message carries (``None``: none); see the ``label`` parameter.
        self.label = _client_label(ctx, label)
        self.storage = ctx if isinstance(ctx, Storage) else Storage(ctx)
        self.transport = transport
        self.clock: Callable[[], int] = clock or system_clock
        self.client_id = client_id if client_id is not None else _default_client_id(ctx)
        self.tombstone_ms = tombstone_ms
        #: per key: requests sent and not yet answered (a sync reply then keeps needs_sync)
        self._requests_in_flight: dict[str, int] = {}
        self.recheck_ms = recheck_ms
        self._ready = False
        self._last_report_stamp = 0
        #: The rows of every key used so far, loaded once per key (:mod:`._store`).
        self.rows: ClientStore = ClientRows(self.storage)

    # ================================================================== schema
    def ensure_schema(self) -> None:
        """Create the client tables if missing, or bring tables of an older release up to date
        (added columns, indexes); done automatically, once per instance."""
        if self._ready:
            return
        _install_schema(self.storage)
        if (records := releases_recorded_in(self.storage)) is not None:  # a queue's items, SPEC R35
            self.rows.records_releases_in(records)
        self._ready = True

    @staticmethod
    def migrate(ctx: Any, to_version: int | None) -> None:
        """``None`` drops the client tables (their indexes go with them); ``1`` creates them, or
        upgrades tables of an older release (see the module documentation)."""
        if to_version is None:
            migrate_tables(ctx, None, CLIENT_TABLES, _SCHEMA)
        else:
            _install_schema(ctx if isinstance(ctx, Storage) else Storage(ctx))

    def _now(self) -> int:
        return int(self.clock())

    # ================================================================== reads
    def grants(self, key: str, *, include_gone: bool = False) -> list[ClientGrant]:
        """The grants known for ``key``, oldest claim deadline first. Tombstones are left out in
        SQL, through the ``_live`` partial index (they are never read), unless ``include_gone``."""
        self.ensure_schema()
        return self.rows.every_grant(key) if include_gone else self.rows.grants(key)

    def grant(self, key: str, grant_id: str) -> ClientGrant | None:
        """One grant (tombstones included), or ``None``."""
        self.ensure_schema()
        r = self.rows.grant_row(key, grant_id)
        return None if r is None else ClientGrant._from_row(r)

    def leases(self, key: str, *, include_settled: bool = False) -> list[ClientLease]:
        """The leases known for ``key``, earliest expiry first. Tombstones are left out in SQL,
        through the ``_live`` partial index, unless ``include_settled``."""
        self.ensure_schema()
        return self.rows.every_lease(key) if include_settled else self.rows.leases(key)

    def lease(self, key: str, lease_id: str) -> ClientLease | None:
        """One lease (tombstones included), or ``None``."""
        self.ensure_schema()
        r = self.rows.lease_row(key, lease_id)
        return None if r is None else ClientLease._from_row(r)

    def keys(self) -> list[str]:
        """Every key this client has talked to (or holds state for)."""
        self.ensure_schema()
        return self.rows.every_key()

    def _key_row(self, key: str) -> dict[str, Any] | None:
        self.ensure_schema()
        return self.rows.key_row(key)

    def key_state(self, key: str) -> KeyState:
        """What the client remembers of ``key`` (``nextRequestAt``, ``contended``, a pending
        re-check); defaults for a key never used."""
        return KeyState._from_row(self._key_row(key))

    def not_before(self, key: str) -> int:
        """The holder's last ``nextRequestAt`` for ``key`` (0 if never asked): the client does
        not send a ``request`` before it unless forced (SPEC R11, R35)."""
        row = self._key_row(key)
        return 0 if row is None else int(row["next_request_at"])

    def contended(self, key: str) -> bool:
        """Whether the last reply for ``key`` was marked ``contended`` (SPEC R29)."""
        row = self._key_row(key)
        return bool(row and row["contended"])

    def needs_sync(self, key: str, now: int | None = None) -> bool:
        """True when the client should contact the holder even without anything to report:
        a ``request`` failed (its reply, possibly carrying a new lease, was lost), or the
        post-request re-check (``recheck_ms``) is due."""
        row = self._key_row(key)
        if row is None:
            return False
        now = self._now() if now is None else now
        return bool(row["needs_sync"]) or 0 < int(row["check_at"]) <= now

    def ask_holder(self, key: str) -> None:
        """Make :meth:`needs_sync` true for ``key`` until the next reply: the key's owner (the
        queue) then contacts the holder at once, e.g. to learn whether the permits of items it
        has not started yet are still there before calling their work again."""
        now = self._now()
        self.storage.transaction(lambda: self._touch_key(key, now, needs_sync=1))

    def check_at(self, key: str) -> int | None:
        """When the post-request re-check sync is due, if one is pending."""
        row = self._key_row(key)
        return None if row is None or int(row["check_at"]) <= 0 else int(row["check_at"])

    def dirty(self, key: str, *, draws: bool = True) -> bool:
        """True when some grant or lease of ``key`` has counts the holder has not received.
        ``draws=False`` ignores undelivered lease draws alone (they need no confirmation: the
        holder counts a live lease's undrawn permits anyway, SPEC R30)."""
        if any(g.dirty for g in self.grants(key)):
            return True
        for x in self.leases(key):
            if x.dirty and (draws or x.returns_capacity):
                return True
        return False

    # ================================================================== local changes
    def unit(self, key: str) -> KeyUnit:
        """The per-key unit of work of ``key``: local changes (claim, draw, release, stop) and
        reads that run inside the caller's storage transaction, so a caller can commit them
        together with its own rows (the queue does). Each one-call method below (:meth:`claim`,
        ...) is the same change in a transaction of its own."""
        self.ensure_schema()
        return KeyUnit(self, key)

    def claim(self, key: str, grant_id: str, count: int = 1) -> list[int]:
        """Claim up to ``count`` unclaimed permits of an active grant locally and return the
        claimed slot numbers (1-based). Start work for slot ``k`` only once
        :attr:`ClientGrant.confirmed` ``>= k`` (send the claim with :meth:`sync`, SPEC R15a)."""
        return self.storage.transaction(lambda: self.unit(key).claim(grant_id, count))

    def release(self, key: str, grant_id: str, count: int = 1) -> int:
        """Release ``count`` claimed permits of a grant (clamped to what the holder has confirmed
        and is not yet released, SPEC R15a: an unconfirmed claim may be refused, and releasing
        it would free a slot another claim holds); returns how many were released. Reported with
        the next message. A claim given up before it is confirmed is released by a call after
        the reply that confirms it (:meth:`sync`, then ``grant(...).confirmed``); if that reply
        shows the grant expired without it, the holder refused it and there is nothing to
        release. The queue does this for you."""
        return self.storage.transaction(lambda: self.unit(key).release(grant_id, count))

    def draw(self, key: str, lease_id: str, *, margin_ms: int = 0) -> int | None:
        """Draw one permit from a live lease (no round trip, SPEC R30). Returns the drawn
        slot (1-based), or ``None`` if the lease cannot be drawn from (stopped, retired, used up,
        or within ``margin_ms`` of its expiry). A drawn permit is one-shot (SPEC R34), unless the
        lease is reusable: then a slot released may be drawn again while the lease lives (R34a)."""
        return self.storage.transaction(lambda: self.unit(key).draw(lease_id, margin_ms=margin_ms))

    def release_lease(self, key: str, lease_id: str, count: int = 1) -> int:
        """Release ``count`` drawn permits of a lease (returns footprint; the permits never become
        drawable again, SPEC R34, except the slots of a reusable lease, R34a). Returns how many
        were released."""
        return self.storage.transaction(lambda: self.unit(key).release_lease(lease_id, count))

    def stop_lease(self, key: str, lease_id: str) -> bool:
        """Stop drawing from a lease: its undrawn permits go back to the holder with the next
        report, which carries ``stopped: true`` until the holder answers ``settled`` (SPEC R29,
        R37). Returns False if it was already stopped or unknown."""
        return self.storage.transaction(lambda: self.unit(key).stop_lease(lease_id))

    def _change_grant(self, key: str, grant_id: str, column: str, value: int) -> None:
        self.rows.change("grant", key, grant_id, column, value, self._now())

    def _change_lease(self, key: str, lease_id: str, column: str, value: int) -> None:
        self.rows.change("lease", key, lease_id, column, value, self._now())

    # ================================================================== messages
    def reports(self, key: str, now: int | None = None) -> tuple[tuple[GrantReport, ...], tuple[LeaseReport, ...]]:
        """The cumulative reports the next message for ``key`` carries (tombstones excluded):
        at most 1,000 grants and 1,000 leases (the wire limit, SPEC R7), chosen by
        :meth:`_window` (entries with something to report first, oldest first)."""
        grants, leases, _ = self._window(key, self._now() if now is None else now)
        return grants, leases

    def _window(self, key: str, now: int, *, leases: bool = True
                ) -> tuple[tuple[GrantReport, ...], tuple[LeaseReport, ...], bool]:
        """``(grant reports, lease reports, more)`` for the next message of ``key``.

        Per list, first the entries with something to report (unacknowledged claims/releases,
        draws/releases/stop, a due lease heartbeat, R31), longest waiting first (``report_at``),
        then the least recently reported others, up to 1,000 (R7). ``more``: some entry with
        something to report did not fit (the next message carries it: a delivered report moves
        an entry behind every waiting one, so ``ceil(n / 1000)`` messages carry ``n``, R13)."""
        self.ensure_schema()
        grant_rows, grants_cut, lease_rows, leases_cut = self.rows.window(key, now, MAX_LIST_LENGTH, leases=leases)
        grants = tuple(ClientGrant._from_row(r).report() for r in grant_rows)
        lease_reports = tuple(ClientLease._from_row(r).report() for r in lease_rows)
        return grants, lease_reports, grants_cut or leases_cut

    async def request(
        self,
        key: str,
        demand: Iterable[Demand | Mapping[str, Any]],
        *,
        leases: bool = True,
        force: bool = False,
        on_reply: ReplyHook | None = None,
        wait_ms: int = 0,
        no_wait: bool = False,
    ) -> AppliedReply:
        """Send a ``request`` with ``demand`` plus cumulative reports and apply the reply
        (:meth:`send_request`, then :meth:`apply` in a transaction of its own; ``on_reply``, if
        given, runs inside that transaction with what it changed)."""
        reply = await self.send_request(key, demand, leases=leases, force=force, wait_ms=wait_ms, no_wait=no_wait)
        return self.storage.transaction(lambda: self._applied(reply, on_reply))

    async def send_request(self, key: str, demand: Iterable[Demand | Mapping[str, Any]], *, leases: bool = True,
                           force: bool = False, wait_ms: int = 0, no_wait: bool = False) -> Reply:
        """Send a ``request`` with ``demand`` plus cumulative reports; the holder's answer,
        checked, is returned unapplied: apply it with :meth:`apply` inside your transaction
        (``client.storage.transaction(fn)``, before your next ``await``), beside your own
        changes.
        ``wait_ms`` > 0 tells the holder how long the caller waits for an answer its round
        cannot give at once (``waitMs``: a holder with ``hold_blocked_ms`` holds it open);
        ``no_wait`` makes it a try (``noWait``, SPEC R9b: answered by a round run at once).

        Waits until :meth:`not_before` first unless ``force`` (SPEC R35). ``leases=True``
        announces lease support (SPEC R5). Raises the typed exception of an error reply, or
        :class:`HolderUnavailableError` when the transport fails."""
        self.ensure_schema()
        if not force:
            at = self.not_before(key)
            if at > self._now():
                await sleep_until(self.clock, at)
        items = tuple(d if isinstance(d, Demand) else Demand(str(d["group"]), int(d["count"]), int(d["oldestAt"]))
                      for d in demand)
        now = self._now()
        grants, lease_reports, more = self._window(key, now, leases=leases)
        message = PermitRequest(self.client_id, items, grants, lease_reports if leases else None, int(wait_ms),
                                bool(no_wait), self.label)
        # A request may create a lease: until some reply arrives, we must contact the holder.
        self.storage.transaction(lambda: self._touch_key(key, now, needs_sync=1,
                                                         check_at=now + self.recheck_ms if self.recheck_ms else 0))
        self._requests_in_flight[key] = self._requests_in_flight.get(key, 0) + 1
        try:
            return await self._send(key, message, more)
        finally:
            left = self._requests_in_flight.pop(key) - 1
            if left:
                self._requests_in_flight[key] = left

    async def sync(self, key: str, *, leases: bool = True, on_reply: ReplyHook | None = None) -> AppliedReply:
        """Send a ``sync`` and apply the reply (:meth:`send_sync`, then :meth:`apply` in a
        transaction of its own; ``on_reply`` as for :meth:`request`)."""
        reply = await self.send_sync(key, leases=leases)
        return self.storage.transaction(lambda: self._applied(reply, on_reply))

    async def send_sync(self, key: str, *, leases: bool = True) -> Reply:
        """Send a ``sync`` (reports only; answered at once, SPEC R6); the answer is returned
        unapplied, as by :meth:`send_request`. It carries at most 1,000 reports per list (R7);
        :attr:`Reply.more` says whether entries with something to report were left for the
        next message (see :meth:`flush`)."""
        self.ensure_schema()
        grants, lease_reports, more = self._window(key, self._now(), leases=leases)
        message = SyncMessage(self.client_id, grants, lease_reports if leases else None, self.label)
        # Sent while a request of the key waits for its round: its reply cannot show what that
        # round creates, even if the request has failed by the time it is applied.
        during_request = bool(self._requests_in_flight.get(key))
        return await self._send(key, message, more, during_request=during_request)

    async def flush(self, key: str, *, leases: bool = True, on_reply: ReplyHook | None = None) -> list[AppliedReply]:
        """Send ``sync`` messages until every grant and lease of ``key`` with something to report
        has been carried (R13, R15a): one message per 1,000 such entries (R7), so at most
        ``ceil(n / 1000)`` for ``n`` entries (one more if entries turn dirty meanwhile; never
        more than ``ceil(n / 1000) + 1``). Returns the applied replies; a failure raises as in
        :meth:`sync` (what was delivered before stays delivered)."""
        self.ensure_schema()
        waiting = self.rows.waiting(key, self._now(), leases=leases)
        bound = -(-waiting // MAX_LIST_LENGTH) + 1
        replies: list[AppliedReply] = []
        for _ in range(max(1, bound)):
            applied = await self.sync(key, leases=leases, on_reply=on_reply)
            replies.append(applied)
            if not applied.more:
                break
        return replies

    async def _send(self, key: str, message: PermitRequest | SyncMessage, more: bool = False, *,
                    during_request: bool = False) -> Reply:
        wire = message.to_wire()
        sent_at = self._now()  # the reply shows the holder as of no earlier than this (R33a)
        try:
            raw = await self.transport(key, wire)
        except SemaphoreError:
            raise
        except Exception as exc:
            raise HolderUnavailableError(f"holder {key!r} unreachable: {exc}") from exc
        reply = plain(raw)
        if not isinstance(reply, dict):
            raise HolderUnavailableError(f"holder {key!r} answered a non-object: {type(reply).__name__}")
        error = error_from_reply(reply)
        if error is not None:
            raise error
        try:
            response = PermitResponse.from_wire(reply)
        except (KeyError, ValueError, TypeError) as exc:
            raise SemaphoreError(f"malformed reply from holder {key!r}: {exc}") from exc
        return Reply(key, message, response, sent_at, more, during_request or bool(self._requests_in_flight.get(key)))

    # ================================================================== applying replies
    def apply(self, reply: Reply) -> AppliedReply:
        """Apply a :class:`Reply` of :meth:`send_request` or :meth:`send_sync` (SPEC R8, R13,
        R15, R17, R31, R33: :func:`~._replies.apply_reply`) inside the caller's storage
        transaction, so the caller commits its own changes in the same one. Apply it before
        the caller next awaits (a reply applied late could undo what happened meanwhile).
        It runs in a transaction of its own, a savepoint of the caller's, so a failure part
        way applies nothing (and the client's copy forgets what it held), whether or not the
        caller opened one. Open yours with ``client.storage.transaction(fn)``: a rollback of a
        transaction opened on ``ctx.storage.transactionSync`` itself is not seen, and the
        client's copy would keep what it rolled back."""
        self.ensure_schema()
        return self.storage.transaction(lambda: apply_reply(self, reply, self._now()))

    def _applied(self, reply: Reply, on_reply: ReplyHook | None) -> AppliedReply:
        applied = self.apply(reply)
        if on_reply is not None:
            on_reply(applied)
        return applied

    def _touch_key(self, key: str, now: int, **values: int) -> None:
        self.ensure_schema()
        self.rows.touch_key(key, now, **values)
