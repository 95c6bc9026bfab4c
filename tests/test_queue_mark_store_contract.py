"""Tier 1: the queue's SQL mark store and its in-memory twin answer the same (SPEC R37).

One Hypothesis state machine drives, as the queue does, the SQL stores
(:class:`semaphore.client._queue_store.QueueMarks` and the items' ``QueueItems`` whose key loads
feed it, over real SQLite, each step inside ``Storage.transaction``) and the twins
(:class:`semaphore.testing.MemoryQueueMarks` over :class:`semaphore.testing.MemoryQueueItems`):

* wake times set, lowered (``earlier_only``) and removed, for more keys than the SQL store keeps
  in its copy of the earliest (its bound lowered to 2 here), so keys past it are read one by one;
* pending-release marks started and cleared; the holder's ``blocked`` entries replaced;
* items enqueued (callback and ``permit()`` items), finished (with or without a pending
  ``on_done`` hook, a release recorded or not), their hooks run; purges and deletions of
  finished permit items run when the SQL store's hints say so, as the pump runs them; pending
  hooks dropped, as a queue without ``on_done`` starts;
* any of these in a transaction that raises after it (SQL rolls back and the stores forget
  their copies; the twins are restored);
* the SQL stores replaced by new ones (a new object instance, with nothing read).

Checked: every mark answers the same (wake times, the earliest, due keys, pending marks,
``blocked`` entries) from a fresh SQL store after every step, and from the SQL store in use as a
step of its own (so the steps between meet marks it has not read); and the SQL store's two hints are never false
where the twin's exact answers are true (a false "nothing to purge" keeps finished items past
their retention: an item whose hook ran late was kept so, until another item finished).

Examples: ``QUEUE_MARK_STORE_CONTRACT_EXAMPLES`` (default 150, 50 steps), derandomized.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from semaphore.client import _queue_store
from semaphore.client._item_rows import COLUMNS
from semaphore.client._item_store import DonePending, QueueItems
from semaphore.client._queue import SemaphoreQueue
from semaphore.client._queue_store import QueueMarks
from semaphore.runtime import Storage
from semaphore.testing import LocalContext, LocalStorage, MemoryQueueItems, MemoryQueueMarks
from twins import on_both

KEYS = ("k0", "k1", "k2", "κ3", "k4")
#: The keys items are enqueued under (few, so items meet each other's steps often).
ITEM_KEYS = KEYS[:2]
times = st.integers(0, 6)
#: A step rolled back one time in five (a rollback makes the SQL store forget what it read).
fails = st.integers(0, 4).map(lambda n: n == 0)


class Stores:
    """A queue's item and mark stores (the SQL pair, or the twins)."""

    def __init__(self, items: Any, marks: Any) -> None:
        self.items, self.marks = items, marks


def _sql_stores(storage: Storage) -> Stores:
    marks = QueueMarks(storage)
    return Stores(QueueItems(storage, done_hooks=True, on_load=marks.loaded), marks)


def _marks(m: Any) -> dict[str, Any]:
    """Every mark a queue reads, as plain values."""
    out: dict[str, Any] = {"earliest": m.earliest_wake(),
                           "due": {at: m.due_keys(at) for at in (0, 3, 6)},
                           "stored_due": m.stored_due_keys(6)}
    for key in KEYS:
        out[key] = (m.wake(key), m.stored_wake(key), m.pending(key), m.has_blocked(key),
                    [dict(e) for e in m.blocked_entries(key)])
    return out


@pytest.fixture(autouse=True)
def _few_wakes_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_queue_store, "WAKES_KEPT", 2)


class QueueMarkStoreContract(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.local = LocalStorage()
        self.storage = Storage(LocalContext(self.local))
        SemaphoreQueue.migrate(self.storage, 1)
        self.sql = _sql_stores(self.storage)
        items = MemoryQueueItems()
        self.mem = Stores(items, MemoryQueueMarks(items))
        self.now = 10
        self.ids = 0

    def _both(self, op: Callable[[Stores], None], *, fail: bool = False) -> None:
        """``op`` on both pairs: on SQL in one transaction (or one that raises after ``op``,
        rolled back), on the twins in place (restored when it failed)."""
        def snapshot() -> Any:
            return self.mem.items.snapshot(), self.mem.marks.snapshot()

        def restore(before: Any) -> None:
            self.mem.items.restore(before[0])
            self.mem.marks.restore(before[1])

        on_both(self.storage, lambda: op(self.sql), lambda: op(self.mem), snapshot, restore, fail=fail)

    @rule(key=st.sampled_from(KEYS), at=st.one_of(st.none(), times), earlier_only=st.booleans(), fail=fails)
    def set_wake(self, key: str, at: int | None, earlier_only: bool, fail: bool) -> None:
        self._both(lambda s: s.marks.set_wake(key, at, earlier_only=earlier_only), fail=fail)

    @rule(key=st.sampled_from(KEYS), start=st.booleans(), now=times, fail=fails)
    def pending(self, key: str, start: bool, now: int, fail: bool) -> None:
        self._both(lambda s: s.marks.start_pending(key, now) if start else s.marks.clear_pending(key), fail=fail)

    @rule(key=st.sampled_from(KEYS), entries=st.lists(st.tuples(st.sampled_from(["g", "h", "ü"]),
                                                                  st.sampled_from(["limit", "group_limit"]),
                                                                  st.integers(0, 3)), max_size=3),
          fail=fails)
    def keep_blocked(self, key: str, entries: list[tuple[str, str, int]], fail: bool) -> None:
        self._both(lambda s: s.marks.keep_blocked(key, [list(e) for e in entries], self.now), fail=fail)

    @rule(key=st.sampled_from(ITEM_KEYS), owners=st.lists(st.sampled_from(["", "tok"]), min_size=1, max_size=3),
          fail=fails)
    def enqueue(self, key: str, owners: list[str], fail: bool) -> None:
        rows = []
        for owner in owners:
            self.ids += 1
            rows.append({**{c: 0 for c in COLUMNS if c != "seq"}, "item_id": f"i{self.ids}", "key": key,
                         "group_name": "g", "state": "queued", "permit_kind": "", "permit_id": "", "owner": owner,
                         "error": "", "payload": "null"})
        self._both(lambda s: [s.items.insert_new(dict(row)) for row in rows], fail=fail)

    @precondition(lambda self: any(r["state"] != "done" for r in self.mem.items.view()))
    @rule(data=st.data(), hook=st.booleans(), release_n=st.integers(0, 1), at=times, fail=fails)
    def finish(self, data: st.DataObject, hook: bool, release_n: int, at: int, fail: bool) -> None:
        # as the queue's completion: the items done, then the marks told (permit items among them)
        key = data.draw(st.sampled_from(sorted({r["key"] for r in self.mem.items.view() if r["state"] != "done"})))
        live = [r for r in self.mem.items.rows(key) if r["state"] != "done"]
        rows = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique_by=lambda r: r["item_id"]))
        ids = [r["item_id"] for r in rows]

        def op(s: Stores) -> None:
            s.items.update(key, ids, {"state": "done", "finished_at": at, "done_pending": DonePending(hook),
                                      "release_n": release_n})
            s.marks.finished(key, at, permits=any(r["owner"] for r in rows))

        self._both(op, fail=fail)

    @rule(key=st.sampled_from(ITEM_KEYS), fail=fails)
    def hooks_ran(self, key: str, fail: bool) -> None:
        # as the queue's on_done runs: each pending hook cleared, its item purgeable from then on
        rows = [r for r in self.mem.items.rows(key) if r["state"] == "done"]

        def op(s: Stores) -> None:
            for r in rows:
                s.items.update(key, [r["item_id"]], {"done_pending": 0})
                s.marks.finished(key, int(r["finished_at"]), permits=False)

        self._both(op, fail=fail)

    @rule(cutoff=st.integers(0, 7), fail=fails)
    def purge(self, cutoff: int, fail: bool) -> None:
        # as the pump: only when the SQL store's hint says a purge is due
        if not self.sql.marks.purge_due(cutoff):
            return

        def op(s: Stores) -> None:
            s.items.purge_done(cutoff)
            s.marks.purged()

        self._both(op, fail=fail)

    @rule(key=st.sampled_from(ITEM_KEYS), fail=fails)
    def delete_done_permits(self, key: str, fail: bool) -> None:
        if not self.sql.marks.permits_done(key):
            return

        def op(s: Stores) -> None:
            s.items.delete_done_permits(key)
            s.marks.permits_deleted(key)

        self._both(op, fail=fail)

    @rule(fail=fails)
    def drop_hooks(self, fail: bool) -> None:
        # as a queue without on_done starts: pending hooks dropped, the purge hint read again
        def op(s: Stores) -> None:
            s.items.drop_hooks()
            s.marks.purged()

        self._both(op, fail=fail)

    @rule(load_items=st.booleans())
    def new_instance(self, load_items: bool) -> None:
        self.sql = _sql_stores(self.storage)
        if load_items:  # a key's items loaded first: its marks come with them
            self.sql.items.rows(KEYS[0])

    @rule()
    def marks_answer_the_same(self) -> None:
        assert _marks(self.sql.marks) == _marks(self.mem.marks)

    @invariant()
    def what_sql_holds_is_what_the_twin_holds(self) -> None:
        assert _marks(_sql_stores(self.storage).marks) == _marks(self.mem.marks)  # a new instance

    @rule()
    def hints_are_never_false_where_something_waits(self) -> None:
        for cutoff in range(8):
            assert self.sql.marks.purge_due(cutoff) or not self.mem.marks.purge_due(cutoff), cutoff
        for key in KEYS:
            assert self.sql.marks.permits_done(key) or not self.mem.marks.permits_done(key), key


QueueMarkStoreContract.TestCase.settings = settings(
    max_examples=int(os.environ.get("QUEUE_MARK_STORE_CONTRACT_EXAMPLES", "150")), stateful_step_count=50,
    derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestQueueMarkStoreContract = QueueMarkStoreContract.TestCase
