"""The queue's pump (SPEC R37): per key, load a snapshot, let
:mod:`semaphore.core.queue_plan` decide, carry the plan out (claims, draws, resolutions, lease
stops), and exchange with the holder (at most 8 exchanges a pump, then a pause); beside a
request that waits for its round, the side syncs and side requests that must not wait behind
it; the wake-up participant of the scheduler's alarm, and the key's next wake time."""

from __future__ import annotations

import asyncio
import logging

from ..core import client_step
from ..core import queue_plan as plan
from ..core.queue_plan import Exchange, KeySnapshot, PendingReleases
from ..core.wire import Demand
from ..errors import ConfigurationError, SemaphoreError
from ._client import AppliedReply
from ._queue_callbacks import _QueueCallbacks
from ._queue_model import ItemState

log = logging.getLogger("semaphore.queue")

#: How long after an enqueue or a completion that this instance pumps itself the key's durable
#: wake-up is set (SPEC R37 wake-ups): longer than the pump's exchange with the holder (a request
#: waits for its round, within ``round_period_ms`` + ``round_wait_ms``, 1.1 s by default), so the
#: alarm does not fire beside a pump that is running; the longest an instance's death delays the
#: work it had not pumped yet.
KICK_FALLBACK_MS = 10_000


class _QueuePump(_QueueCallbacks):
    """The pump, its side traffic and the wake-ups (see the module documentation)."""

    async def pump(self, key: str) -> None:
        """Do everything that is due for ``key`` now: resolve claims, draw from leases, claim
        from grants (and confirm with a sync), start admitted items, heartbeat/stop leases,
        reconcile, and ask for permits when ``nextRequestAt`` has come (this waits for the
        holder's round). Then schedule the next wake-up. Called by the wake-up (the scheduler's
        alarm); may be called directly. An instance that was abandoned pumps nothing (its copies
        are stale once another instance works on the same storage)."""
        if self._dead:
            return
        self.ensure_schema()
        lock = self._locks.setdefault(key, asyncio.Lock())
        if lock.locked() and key in self._requesting:
            # The key's pump waits for its request's round (or holds it, request_wait_ms): do
            # beside it what needs no holder and leave the rest to that pump, which schedules
            # the key's next wake-up once answered; waiting for it here would hold up the
            # wake-up run, and so every other key of this object, for as long.
            if self.request_wait_ms > 0 or self._tries.unsent(key):
                self._start_side_request(key)  # new demand (a try) must not wait out a held request
            await self._draw_beside_request(key)
            # Looks again then, should that pump die with its instance (its answer comes by then).
            at = self._now() + self.request_wait_ms + self.retry_ms
            self.storage.transaction(lambda: self._set_wake(key, at))
            await self.scheduler.arm()
            return
        async with lock:
            try:
                await self._pump(key)
            finally:
                if not self._dead:  # an abandoned instance writes nothing (its copies are stale)
                    now = self._now()
                    self.storage.transaction(lambda: self._after_pump(key, now))
                    await self.scheduler.arm()

    def _after_pump(self, key: str, now: int) -> None:
        """Schedule the key's next wake-up, and forget the holder's ``blocked`` word on it once
        nothing of the key is queued (nothing waits: the reason is stale)."""
        self._set_wake(key, self._next_wake(key, now))
        if self.marks.has_blocked(key) and not self._live(key, ItemState.QUEUED):
            self.marks.keep_blocked(key, [], now)

    async def _complete_item(self, item_id: str) -> bool:
        return (await self._complete_items([item_id]))[0]

    async def _complete_items(self, item_ids: list[str]) -> list[bool]:
        """Complete the (distinct) items in one transaction; per item, whether it was completed."""
        self.ensure_schema()
        now = self._now()
        # R37 (wake-ups): this instance pumps the key itself, in the background, not through
        # the object's alarm (each invocation is a billed request); the durable wake-up only
        # covers an instance that dies before that pump has run.
        kick = not self._dead
        wake_at = self._kick_wake(now)
        keys = self.storage.transaction(lambda: self._complete_keys(item_ids, now, wake_at))
        done = [(item_id, key) for item_id, key in zip(item_ids, keys) if key is not None]
        if not done:
            return [False] * len(item_ids)
        for key in dict.fromkeys(key for _, key in done):
            # A release ends the key's request pause: the next request is no longer one of the
            # identical ones the pause stops, and a waiter may take the freed permit.
            self._paused.pop(key, None)
            if key in self._requesting:
                self._start_side_sync(key)
            # The key is pumped in the background (even if a hook or the arming below fails): a
            # freed lease slot is drawn at once (R34a), beside the key's own request if one is in
            # flight; never inline, where a synchronous callback's own complete() would re-enter.
            if kick:
                self._kick(key)
        try:
            if self.on_done is not None:
                failed: ConfigurationError | None = None
                for item_id, _ in done:  # each hook in its own transaction, every one tried
                    try:
                        self._run_done_hook(item_id, raise_misuse=True)
                    except ConfigurationError as exc:
                        failed = failed or exc
                if failed is not None:
                    raise failed
        finally:
            await self.scheduler.arm()
        return [key is not None for key in keys]

    def _start_side_sync(self, key: str) -> None:
        """Start :meth:`_side_syncs_of` for ``key`` in the background (the caller, e.g.
        :meth:`complete`, never waits for the holder) unless one runs (it looks again after its
        sync)."""
        if self._dead:
            return
        task = self._side_syncs.get(key)
        if task is None or task.done():  # a running one looks again after its sync
            self._side_syncs[key] = asyncio.ensure_future(self._side_syncs_of(key))

    def _start_side_request(self, key: str) -> None:
        """While the key's request may be held at the holder (``request_wait_ms``), demand that
        changed since it was sent (a new item, e.g. a :meth:`permit` of another group) goes in
        a request of its own in the background: the holder joins it to the held one (R10:
        both calls get the next round's answer), so it does not wait out the hold."""
        if self._dead or key not in self._requesting:
            return
        task = self._side_requests.get(key)
        if task is not None and not task.done():
            return
        snap = self._snapshot(key, self._now())
        demand = self._demand(snap.queued, snap.admit_room)
        trying = self._tries.unsent(key)  # R9b: a try makes it urgent: the holder answers both at once
        if not trying and not plan.demand_grew(((d.group, d.count) for d in demand),
                                               ((d.group, d.count) for d in self._sent_demand.get(key, ()))):
            return  # nothing new: items drawn or finished meanwhile need no request of their own
        self._sent_demand[key] = demand
        self._side_requests[key] = asyncio.ensure_future(self._side_request(key, demand, trying))

    async def _side_request(self, key: str, demand: list[Demand], trying: set[str]) -> None:
        try:
            await self._request(key, demand, trying)
            self._tries.sent(key, trying)
        except SemaphoreError as exc:
            self._tries.sent(key, trying, exc)
            log.warning("holder %r: %s; the demand goes with the next request", key, exc)
        except Exception:  # noqa: BLE001 - the pump asks again; never an unretrieved error
            self._failed("side request", key)
        finally:
            self._side_requests.pop(key, None)
        self._kick(key)  # admit what the answer brought

    def _side_release_due(self, key: str) -> bool:
        """Releases of a contended key due now (R29, R37), judged without the request's own
        "contact the holder" mark (it is in flight: that is the request itself)."""
        now = self._now()
        if plan.backing_off(now, self._backoff.get(key, 0), trying=False):
            return False
        view = plan.side_release_view(self._snapshot(key, now), self._options())
        if view is None:
            return False
        due = self.storage.transaction(lambda: self._report_due(key, view))
        return due.at is not None and due.at <= now

    async def _side_syncs_of(self, key: str) -> None:
        """SPEC R37 decision: while the key's request waits for its round (the pump holds the
        key's lock meanwhile), releases due then (the last reply was contended) go in a
        ``sync`` of their own instead of waiting behind the request, so the round that request
        waits for already counts the capacity they free; again while more came due during the
        previous one (one in flight per key). A failure leaves them to the pump (logged)."""
        try:
            while key in self._requesting and not self._dead:
                recheck = plan.recheck_due(self._snapshot(key, self._now()), self._options())
                if not (recheck or self._side_release_due(key)):
                    return
                try:
                    await self._sync(key)
                except SemaphoreError as exc:
                    log.warning("holder %r: %s; the releases go after the waiting request", key, exc)
                    return
                if recheck:
                    self._kick(key)  # R33a: draw what the confirmed leases hold beside the request
        except Exception:  # noqa: BLE001 - the pump sends them later; never an unretrieved error
            self._failed("side sync", key)
        finally:
            self._side_syncs.pop(key, None)

    def _wake_due(self) -> int | None:
        """The wake-up participant's ``next_due`` (SPEC R37): the earliest per-key wake time (read
        once, then the marks' copy: :meth:`QueueMarks.earliest_wake`); ``None`` when there is no
        wake-up table (not created yet, or removed by :meth:`migrate` ``(ctx, None)``: nothing to
        wake, and nothing re-created)."""
        return self._wakeups.read(self.marks.earliest_wake)

    async def _on_wake(self, name: str, due_at: int) -> None:
        """The wake-up participant's run: pump every key due at the time of the run (never before
        ``due_at``), again while keys are due by then (at most :attr:`WAKE_PASSES` passes: a pump
        may leave its key due at once), so that no key is left due at the time this run is for
        (the scheduler's no-progress rule). A pump that raises retries its key after
        ``retry_ms``. A queue migrated away since the alarm listed its work creates nothing."""
        if not self._ready and not self._wakeups.exists(fresh=True):
            return  # migrated away (only a row left by an earlier release is due): create nothing
        self.ensure_schema()
        # One bound for every pass: what is due at the time of this run (never before the time
        # the scheduler ran it for); keys that come due later get the next alarm.
        at = max(self._now(), int(due_at))
        # The first pass reads the due keys from SQL (so a table dropped by migrate(ctx, None)
        # while this instance lives is seen, and the copy of the wake times forgotten); the
        # passes after it read the copy, which every wake-time write keeps.
        keys = self._wakeups.read(lambda: self.marks.stored_due_keys(at))
        if keys is None or keys != self.marks.due_keys(at):
            # migrated away (or away and back) while this instance lives: its copies are stale
            self.marks.forget()
            if keys is None:
                return
        for _ in range(self.WAKE_PASSES):
            if not keys:
                return
            for key in keys:
                await self._wake_key(key)
            keys = self.marks.due_keys(at)

    async def _wake_key(self, key: str) -> None:
        try:
            await self.pump(key)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._dead:  # what replaced its cancellation (a callback's failed cleanup): it still is one
                raise asyncio.CancelledError() from exc
            if self._failed("queue pump", key):
                return
            retry_at = self._now() + self.retry_ms
            self.storage.transaction(lambda: self._set_wake(key, retry_at))

    def _failed(self, what: str, key: str) -> bool:
        """Log a failure of ``what`` (a background task of ``key``), inside its ``except``: at
        INFO, and True, when ``migrate(ctx, None)`` dropped the queue's tables meanwhile (R3:
        nothing is left to do), else at ERROR with the traceback."""
        try:
            gone = not self._wakeups.exists(fresh=True)
        except Exception:  # noqa: BLE001 - the storage itself fails: log the first error as it is
            gone = False
        if gone:
            log.info("%s for key %r stops: the queue's tables are gone (migrate(ctx, None))", what, key)
            return True
        log.exception("%s for key %r failed", what, key)
        return False

    def _kick_wake(self, now: int) -> int:
        """The durable wake-up of a key this instance is about to pump itself (:meth:`_kick`,
        SPEC R37 wake-ups): :data:`KICK_FALLBACK_MS` (plus ``request_wait_ms``) later, past that
        pump's exchange with the holder, so that the object's alarm (each invocation a billed
        request) fires only if the instance dies before its pump is done; ``now`` on an
        instance that is closed (it pumps nothing)."""
        return now if self._dead else now + self.request_wait_ms + KICK_FALLBACK_MS

    def _kick(self, key: str) -> None:
        """Pump ``key`` soon in the background (once more if a kicked pump is running already)."""
        if self._dead:
            return
        task = self._kicks.get(key)
        if task is not None and not task.done():
            self._rekick.add(key)
            beside = self._besides.get(key)
            if key in self._requesting and (beside is None or beside.done()):
                # That kick waits for the key's request: new demand (a permit of another group, a
                # try) goes beside it now, not after its answer (pump's locked path).
                self._besides[key] = asyncio.ensure_future(self._wake_key(key))
            return
        self._kicks[key] = asyncio.ensure_future(self._kick_loop(key))

    async def _kick_loop(self, key: str) -> None:
        while not self._dead:  # abandoned: even if a failure in a cleanup swallowed its cancellation
            self._rekick.discard(key)
            await self._wake_key(key)
            if key not in self._rekick:
                return

    def _snapshot(self, key: str, now: int) -> KeySnapshot:
        """What the planner decides over for ``key`` at ``now`` (live rows only)."""
        unit = self.client.unit(key)
        queued = self._queued(key)
        claiming = self._claiming(key)
        pending = self.marks.pending(key)
        return KeySnapshot(
            now, queued, claiming, tuple(unit.grants()), {c.grant_id: unit.grant(c.grant_id) for c in claiming},
            tuple(unit.leases()), unit.state(), pending,
            self._admit_room(key), self._running_grant_slots(key))

    async def _sync(self, key: str) -> None:
        """A ``sync`` of ``key``; its reply applied (:meth:`SemaphoreClient.apply`) and the
        key's items moved on it (:meth:`_apply_reply`) in one transaction of the queue's own."""
        reply = await self.client.send_sync(key, leases=self.leases)
        self.storage.transaction(lambda: self._apply_reply(self.client.apply(reply)))

    async def _request(self, key: str, demand: list[Demand], trying: set[str]) -> None:
        """A ``request`` of ``key`` with ``demand`` (a try if ``trying``, R9b), applied as by
        :meth:`_sync`, its reply's ``blocked`` words kept as the key's latest word on why its
        groups wait."""
        reply = await self.client.send_request(key, demand, leases=self.leases, force=True,
                                               wait_ms=self.request_wait_ms, no_wait=bool(trying))
        self.storage.transaction(lambda: self._apply_reply(self.client.apply(reply), request=True))

    def _apply_reply(self, applied: AppliedReply, *, request: bool = False) -> None:
        """Load the key, let :func:`~semaphore.core.client_step.after_reply` decide, persist."""
        blocked = tuple((b.group, b.reason.value, b.waiting) for b in applied.response.blocked) if request else None
        unstarted = tuple(str(r["item_id"]) for r in self._live(applied.key, ItemState.RUNNING, admitted=0, owner=""))
        changes = client_step.after_reply(self._snapshot(applied.key, applied.now), self._options(),
                                          contended=applied.contended, more=applied.more, unstarted=unstarted,
                                          blocked=blocked)
        self._persist(applied.key, changes, applied.now)

    def _admit_locally(self, key: str, now: int, *, claims: bool = True) -> None:
        """One local admission (:func:`~semaphore.core.client_step.admission`): load the key,
        decide, persist. Claims are made unless ``claims`` is false."""
        self._persist(key, client_step.admission(self._snapshot(key, now), self._options(), with_claims=claims), now)

    def _report_due(self, key: str, snap: KeySnapshot) -> plan.ReportDue:
        """:func:`~semaphore.core.queue_plan.report_due`, keeping the key's "releases waiting
        since" mark (durable, so evictions do not restart the wait)."""
        due = plan.report_due(snap, self._options())
        if due.pending is PendingReleases.START and snap.pending_since is None:
            self.marks.start_pending(key, snap.now)
        elif due.pending is PendingReleases.CLEAR and snap.pending_since is not None:
            self.marks.clear_pending(key)
        return due

    async def _pump(self, key: str) -> None:
        before = self._tries.waiting(key)  # tries made before this pump: its end answers them (R9b)
        try:
            await self._pump_exchanges(key)
        finally:
            self._tries.signal_replied(key)
            self._tries.signal(key, before)

    async def _pump_exchanges(self, key: str) -> None:
        self._release_orphans(key, self._now())
        requested = False
        for _ in range(plan.MAX_EXCHANGES):
            self._alive()
            now = await self._admit_and_call(key)
            self._tries.signal_replied(key)  # what their answer brought is admitted now (R9b)
            await self._reconcile(key, now)
            self._alive()
            self._run_done_hooks(key)  # no holder message is ever sent for them
            trying = self._tries.unsent(key)  # R9b: a try's request goes at once, unpaced
            if plan.backing_off(now, self._backoff.get(key, 0), trying=bool(trying)):
                return
            snap = self._snapshot(key, now)
            demand = self._demand(snap.queued, snap.admit_room)
            paused = plan.requests_paused(now, self._paused.get(key, 0), trying=bool(trying))
            exchange = plan.plan_exchange(snap, self._options(), demand=bool(demand) and not paused,
                                          due=self._report_due(key, snap), urgent=bool(trying))
            requested = requested or exchange is Exchange.REQUEST
            try:
                if exchange is Exchange.SYNC:
                    await self._sync(key)
                elif exchange is Exchange.REQUEST:
                    self._sent_demand[key] = demand
                    self._requesting.add(key)
                    try:
                        await self._request(key, demand, trying)
                    finally:
                        self._requesting.discard(key)
                    self._tries.sent(key, trying)
                else:
                    return
            except SemaphoreError as exc:
                self._tries.sent(key, trying if exchange is Exchange.REQUEST else set(), exc)
                if isinstance(exc, ConfigurationError):  # a wrong binding or holder class: not down
                    log.error("holder %r: %s; its waiting permit() calls fail with it", key, exc)
                    self._fail_waiters(key, exc)
                else:
                    log.warning("holder %r: %s; retrying in %d ms", key, exc, self.retry_ms)
                self._backoff[key] = self._now() + self.retry_ms
                return
            self._backoff.pop(key, None)
        # Still work left after MAX_EXCHANGES exchanges: pause instead of spinning
        # (plan.pause_after_exchanges). What the last reply confirmed is still handed over and
        # started now (a permit caller would otherwise wait for an unrelated wake-up).
        await self._admit_and_call(key)
        self._run_done_hooks(key)  # items the last reply finished
        if plan.pause_after_exchanges(requested) is plan.Pause.REQUESTS:
            self._paused[key] = self._now() + self.retry_ms
        else:
            self._backoff[key] = self._now() + self.retry_ms

    def _fail_waiters(self, key: str, exc: ConfigurationError) -> None:
        """Fail the waiting ``permit()`` calls of ``key`` with its holder's ConfigurationError
        (R12): a permit waiting on another key, whose holder answers fine, is not its concern."""
        mine = {str(r["item_id"]) for r in self._items.rows(key)}
        for item_id, fut in list(self._waiters.items()):
            if item_id in mine and not fut.done():
                fut.set_exception(exc)

    async def _draw_beside_request(self, key: str) -> None:
        """While the key's request waits for its round (or is held, ``request_wait_ms``), draw
        queued items from its live leases and start them: a draw needs no holder (R30), so
        it does not wait behind the request (a released slot of a reusable lease, R34a, is
        reused at once). Claims wait for the pump: a claim needs a confirming sync (R15a)."""
        now = self._now()
        self.storage.transaction(lambda: self._admit_locally(key, now, claims=False))
        await self._run_callbacks(key, now)
        if plan.recheck_due(self._snapshot(key, self._now()), self._options()):
            self._start_side_sync(key)  # R33a: the leases are confirmed live by a sync, then drawn

    async def _admit_and_call(self, key: str) -> int:
        """Admit locally (resolve claims, claim, draw) and start the due callbacks and hand-overs;
        again while a synchronous callback returned and so freed an ``admit_concurrency`` slot
        (it would otherwise wait for the next request period). Returns the time of the last
        step."""
        while True:
            self._alive()
            now = self._now()
            self.storage.transaction(lambda: self._admit_locally(key, now))  # noqa: B023 (run at once)
            freed = await self._run_callbacks(key, now)
            if not freed or self.admit_concurrency is None:
                return now

    def _next_wake(self, key: str, now: int) -> int | None:
        snap = self._snapshot(key, now)
        times = plan.item_times(self._items.rows(key), now=now, owner=self._token,
                                orphan_check_ms=self.orphan_check_ms, done_hook=self.on_done is not None,
                                reconcile=self.reconcile_after_ms is not None)
        return plan.next_wake(snap, self._options(), backoff_until=self._backoff.get(key, 0), items=times,
                              requests_from=self._paused.get(key, 0),
                              due=self._report_due(key, snap))
