"""Tier 1: the queue's SQL item store and its in-memory twin answer the same (SPEC R37).

One Hypothesis state machine runs the same operations against
:class:`semaphore.client._item_store.QueueItems` over real SQLite (each step inside
``Storage.transaction``, as the queue runs them) and against
:class:`semaphore.testing.MemoryQueueItems`:

* new items, one by one (``insert_new``) and in batches (``insert_many``), of two keys (one
  non-ASCII), with short and long payloads, some of ids that exist already (live, finished, of the
  other key, loaded or not);
* updates of several items in one call (values shared, values per item, ``Add``,
  ``DonePending``): items moving between states, finishing with and without a pending hook,
  finished items' own columns, unknown ids;
* purges of finished items, deletions of a key's finished ``permit()`` items, and the pending
  hooks dropped (a queue started without ``on_done``);
* any of these in a transaction that raises after it (SQL rolls back and the store forgets its
  copy; the twin is restored);
* the SQL store replaced by a new one (a new object instance, with nothing loaded).

Checked: every read the queue makes (kept rows per key and state, single rows, finds, payloads,
views) answers the same from both, as a step of its own (so the steps between meet keys the SQL
store has not loaded); after every step, a fresh SQL store loading what SQL holds answers the
same, and so do the SQL store's loaded copies (the copy never drifts from the table). Statements
cut their ids every 2 here (every 1,000 in production), so the cuts are met.

Examples: ``QUEUE_ITEM_STORE_CONTRACT_EXAMPLES`` (default 60, 40 steps), derandomized.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from semaphore.client import _item_store
from semaphore.client._item_rows import COLUMNS, PAYLOAD_KEPT, QueueItemStore, kept
from semaphore.client._item_store import Add, DonePending, QueueItems
from semaphore.client._queue import SemaphoreQueue
from semaphore.runtime import Storage
from semaphore.testing import LocalContext, LocalStorage, MemoryQueueItems
from twins import on_both

KEYS = ("k", "κλειδί")
IDS = ("a", "b", "c", "d", "e", "f", "g", "ε")
UNKNOWN = "never"
STATES = ("queued", "claiming", "running", "done")
#: Payloads around the longest kept (in bytes of JSON text, not characters): at it and one past.
payloads = st.sampled_from(['{"n": 1}', "null", json.dumps("x" * (PAYLOAD_KEPT - 2)), json.dumps("x" * (PAYLOAD_KEPT - 1)),
                            json.dumps("é" * (PAYLOAD_KEPT // 2 - 1), ensure_ascii=False),
                            json.dumps("é" * (PAYLOAD_KEPT // 2 - 1) + "x", ensure_ascii=False)])
small = st.integers(0, 3)
#: Columns an update may set on any item, finished ones too (they never make an item kept).
ANY_ROW = {"attempts": st.builds(Add, st.integers(1, 2)), "retry_at": small, "finished_at": small,
           "error": st.sampled_from(["", "boom"]), "release_n": small, "done_attempts": st.builds(Add, st.just(1)),
           "checked_at": small}
#: Columns an update may set on a kept item only.
KEPT_ONLY = {"state": st.sampled_from(STATES), "done_pending": st.one_of(st.builds(DonePending, st.booleans()), small),
             "permit_kind": st.sampled_from(["", "grant", "lease"]), "permit_id": st.sampled_from(["", "p1"]),
             "admitted": st.integers(0, 1), "cancel": st.integers(0, 1)}


def _new(key: str, item_id: str, payload: str, *, owner: str, group: str, now: int) -> dict[str, Any]:
    row = {c: 0 for c in COLUMNS if c != "seq"}
    return {**row, "item_id": item_id, "key": key, "group_name": group, "enqueued_at": now, "state": "queued",
            "permit_kind": "", "permit_id": "", "owner": owner, "error": "", "payload": payload}


def _norm(row: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if row is None else {c: row[c] for c in (*COLUMNS, "payload")}


def _reads(store: QueueItemStore) -> dict[str, Any]:
    """Everything the queue reads of an item store, as plain values."""
    out: dict[str, Any] = {
        "find": {i: _norm(store.find(i)) for i in (*IDS, UNKNOWN)},
        "find_many": {i: _norm(r) for i, r in store.find_many([*IDS, UNKNOWN]).items()},
        "view": [_norm(r) | {"b": r["blocked_reason"]} for r in store.view()],
        "view_done": [_norm(r) for r in store.view(state="done")],
        "view_id": {i: [_norm(r) for r in store.view(item_id=i)] for i in IDS},
    }
    for key in KEYS:
        rows = store.rows(key)
        out[key] = {
            "rows": [_norm(r) for r in rows],
            "by_state": {s: [_norm(r) for r in store.rows(key, s)] for s in STATES},
            "row": {i: _norm(store.row(key, i)) for i in (*IDS, UNKNOWN)},
            "payloads": [_norm(r) for r in store.payloads(rows)],
            "view": [_norm(r) for r in store.view(key)],
        }
    return out


def _sql_store(storage: Storage, *, load_with_marks: bool) -> QueueItems:
    """A store as the queue builds it (its load reads the queue's marks too), or the plain one."""
    return QueueItems(storage, done_hooks=True,
                      on_load=(lambda *marks: None) if load_with_marks else None)


class QueueItemStoreContract(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.local = LocalStorage()
        self.storage = Storage(LocalContext(self.local))
        SemaphoreQueue.migrate(self.storage, 1)
        self.sql = _sql_store(self.storage, load_with_marks=True)
        self.mem = MemoryQueueItems()
        #: What each store hands to be folded before a purge deletes (the client's rows fold it).
        self.folded: dict[str, list[Any]] = {"sql": [], "mem": []}
        self.sql.before_delete = self.folded["sql"].append
        self.mem.before_delete = self.folded["mem"].append
        self.now = 10

    def _both(self, op: Callable[[QueueItemStore], Any], *, fail: bool = False) -> None:
        """``op`` on both stores: on SQL in one transaction (or one that raises after ``op``,
        rolled back), on the twin in place (restored when it failed); both answer the same."""
        self.now += 1
        sql, twin = on_both(self.storage, lambda: op(self.sql), lambda: op(self.mem), self.mem.snapshot,
                            self.mem.restore, fail=fail)
        assert sql == twin

    @rule(key=st.sampled_from(KEYS), item_id=st.sampled_from(IDS), payload=payloads, owner=st.sampled_from(["", "t"]),
          fail=st.booleans())
    def insert_new(self, key: str, item_id: str, payload: str, owner: str, fail: bool) -> None:
        row = _new(key, item_id, payload, owner=owner, group="g", now=self.now)
        self._both(lambda s: s.insert_new(dict(row)), fail=fail)

    @rule(key=st.sampled_from(KEYS), ids=st.lists(st.sampled_from(IDS), min_size=1, max_size=4, unique=True),
          payload=payloads, group=st.sampled_from(["g", "h"]), fail=st.booleans())
    def insert_many(self, key: str, ids: list[str], payload: str, group: str, fail: bool) -> None:
        rows = [_new(key, i, payload, owner="", group=group, now=self.now) for i in ids]
        self._both(lambda s: s.insert_many([dict(r) for r in rows]), fail=fail)

    @rule(key=st.sampled_from(KEYS), data=st.data(), fail=st.booleans())
    def update(self, key: str, data: st.DataObject, fail: bool) -> None:
        # Items of the key (kept or finished) and an unknown id; an update never brings a
        # finished item back (the store's precondition).
        mine = [r["item_id"] for r in self.mem.view(key)] + [UNKNOWN]
        ids = data.draw(st.lists(st.sampled_from(mine), min_size=1, max_size=4, unique=True))
        all_kept = all(r is None or kept(r) for r in (self.mem.find(i) for i in ids))
        columns = {**ANY_ROW, **(KEPT_ONLY if all_kept else {})}
        chosen = data.draw(st.lists(st.sampled_from(sorted(columns)), min_size=1, max_size=3, unique=True))
        per_item = {c for c in chosen if c in ("retry_at", "error") and data.draw(st.booleans())}
        values = {c: data.draw(columns[c]) for c in chosen if c not in per_item}
        each = {c: [data.draw(columns[c]) for _ in ids] for c in per_item}
        if data.draw(st.booleans()):
            each["slot"] = [data.draw(small) for _ in ids]
        self._both(lambda s: s.update(key, ids, values, each), fail=fail)

    @rule(key=st.sampled_from(KEYS), data=st.data(), hook=st.booleans(), release_n=small, at=small,
          fail=st.booleans())
    def finish(self, key: str, data: st.DataObject, hook: bool, release_n: int, at: int, fail: bool) -> None:
        # Live items finishing, as the queue's completion writes them (a callback item's hook
        # pending when the queue has one; a release recorded or not).
        live = [r["item_id"] for r in self.mem.rows(key) if r["state"] != "done"]
        if not live:
            return
        ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        values = {"state": "done", "finished_at": at, "done_pending": DonePending(hook), "release_n": release_n}
        self._both(lambda s: s.update(key, ids, values), fail=fail)

    @rule(key=st.sampled_from(KEYS), fail=st.booleans())
    def hooks_ran(self, key: str, fail: bool) -> None:
        ids = [r["item_id"] for r in self.mem.rows(key, "done")]
        self._both(lambda s: s.update(key, ids, {"done_pending": 0}), fail=fail)

    @rule(fail=st.booleans())
    def drop_hooks(self, fail: bool) -> None:
        # the queue started without on_done: hooks left pending are dropped
        self._both(lambda s: s.drop_hooks(), fail=fail)

    @rule(before=st.integers(0, 4), fail=st.booleans())
    def purge(self, before: int, fail: bool) -> None:
        # finished_at values are small (0 to 3): any cut-off, from none to every one
        self._both(lambda s: s.purge_done(before), fail=fail)
        # both hand over the same releases: the highest each purged permit's items record
        assert self.folded["sql"] == self.folded["mem"]

    @rule(key=st.sampled_from(KEYS), fail=st.booleans())
    def delete_done_permits(self, key: str, fail: bool) -> None:
        self._both(lambda s: s.delete_done_permits(key), fail=fail)

    @rule(load_with_marks=st.booleans())
    def new_instance(self, load_with_marks: bool) -> None:
        self.sql = _sql_store(self.storage, load_with_marks=load_with_marks)
        self.sql.before_delete = self.folded["sql"].append

    @rule()
    def reads_answer_the_same(self) -> None:
        # A rule, not an invariant: reading every key loads it, and the steps between reads
        # also meet keys this store has not loaded (after a new instance).
        assert _reads(self.sql) == _reads(self.mem)

    @invariant()
    def what_sql_holds_is_what_the_twin_holds(self) -> None:
        assert _reads(_sql_store(self.storage, load_with_marks=False)) == _reads(self.mem)  # a new instance
        for key in list(self.sql._keys):  # the copies loaded so far, without loading any other
            assert [_norm(r) for r in self.sql.rows(key)] == [_norm(r) for r in self.mem.rows(key)], key


@pytest.fixture(autouse=True)
def _small_id_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    # a statement's ids (and a find's) cut every 2, not every 1,000: the cut is reached
    monkeypatch.setattr(_item_store, "JSON_IDS", 2)


QueueItemStoreContract.TestCase.settings = settings(
    max_examples=int(os.environ.get("QUEUE_ITEM_STORE_CONTRACT_EXAMPLES", "60")), stateful_step_count=40,
    derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestQueueItemStoreContract = QueueItemStoreContract.TestCase
