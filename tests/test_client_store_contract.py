"""Tier 1: the client's SQL store and its in-memory twin answer the same (SPEC R13, R35).

One Hypothesis state machine runs the same operations against
:class:`semaphore.client._store.ClientRows` over real SQLite (each step inside
``Storage.transaction`` with the store's ``flush`` before it ends, as the client runs them) and
against :class:`semaphore.testing.MemoryClientRows`:

* replies merged into grants and leases (new rows, rows changed, tombstones: ``gone`` grants,
  ``settled`` leases, rows brought back from a tombstone), of two keys (one non-ASCII);
* local count changes (claimed, released, confirmed; drawn, released, stopped) of live rows,
  tombstones and ids never written;
* deliveries, flushed at the transaction's end or written by a merge of the same row in the
  same transaction;
* key rows touched (changing and not changing anything), tombstones pruned;
* releases recorded by the caller in a table of its own (as the queue records a finished
  item's, ``release_n``): the SQL store may leave the row unwritten, and then reads it back
  from SQL with the recorded count; records folded into the rows and deleted. Counts only
  rise in a client (SPEC R13), so a local change never sets ``released`` (nor ``claimed``,
  ``drawn``) below what was recorded for the row, and a merge raises ``released`` to it but
  never above the merged claimed (drawn) count, as ``raise_counts`` does (a clamp below the
  record);
* any of these in a transaction that raises after it (SQL rolls back and the store forgets its
  copy and its unwritten deliveries; the twin is restored);
* the SQL store's copy dropped (as a new object instance starts).

Checked after every step, per key: the live rows, every row (tombstones included), single rows
of every id used (tombstones and unknown ids too), the key row, every key, the report window
(with and without leases, cut at 2) and the number of entries waiting to be reported. The same
reads from a fresh SQL store (a new instance loading what SQL holds) answer the same too: the
SQL store's copy never drifts from its tables.

Examples: ``CLIENT_STORE_CONTRACT_EXAMPLES`` (default 60, 40 steps), derandomized.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from semaphore.client._client_model import _install_schema
from semaphore.client._item_rows import recorded_releases
from semaphore.client._rows import GRANT_COLUMNS, LEASE_COLUMNS, ClientStore
from semaphore.client._store import ClientRows
from semaphore.core.client_state import GONE, ClientGrant, ClientLease
from semaphore.runtime import Storage
from semaphore.testing import LocalContext, LocalStorage, MemoryClientRows
from twins import on_both

KEYS = ("k", "κλειδί")
GRANT_IDS = ("g1", "g2", "γ3")
LEASE_IDS = ("l1", "l2", "λ3")
counts = st.integers(0, 6)
#: Few distinct times, so rows often tie on their sort key (claim deadline, expiry, report time)
#: and the order between them is the id's.
times = st.integers(0, 2)


def _norm(row: dict[str, Any] | None, columns: tuple[str, ...]) -> dict[str, Any] | None:
    return None if row is None else {c: row[c] for c in columns}


def _reads(store: ClientStore, now: int) -> dict[str, Any]:
    """Everything a client reads of a store, as plain values."""
    out: dict[str, Any] = {"every_key": store.every_key()}
    for key in KEYS:
        window = store.window(key, now, 2, leases=True)
        grants_only = store.window(key, now, 2, leases=False)
        key_row = store.key_row(key)
        out[key] = {
            "grant_rows": [_norm(r, GRANT_COLUMNS) for r in store.grant_rows(key)],
            "lease_rows": [_norm(r, LEASE_COLUMNS) for r in store.lease_rows(key)],
            "grants": store.grants(key), "leases": store.leases(key),
            "every_grant": store.every_grant(key), "every_lease": store.every_lease(key),
            "grant": {g: _norm(store.grant_row(key, g), GRANT_COLUMNS) for g in GRANT_IDS},
            "lease": {x: _norm(store.lease_row(key, x), LEASE_COLUMNS) for x in LEASE_IDS},
            "key_row": None if key_row is None else dict(key_row),
            "window": ([_norm(r, GRANT_COLUMNS) for r in window[0]], window[1],
                       [_norm(r, LEASE_COLUMNS) for r in window[2]], window[3]),
            "window_grants": ([_norm(r, GRANT_COLUMNS) for r in grants_only[0]], grants_only[1], grants_only[2]),
            "waiting": (store.waiting(key, now, leases=True), store.waiting(key, now, leases=False)),
        }
    return out


grants = st.builds(
    lambda key, gid, permits, claimed, released, confirmed, claim_by, gone, sent_c, sent_r, expired: ClientGrant(
        key, gid, "a", permits, claimed, released, confirmed, claim_by, GONE if gone else "active", sent_c, sent_r,
        expired),
    st.sampled_from(KEYS), st.sampled_from(GRANT_IDS), counts, counts, counts, counts,
    times, st.sampled_from([False, False, True]), counts, counts, st.booleans())
leases = st.builds(
    lambda key, lid, permits, drawn, released, stopped, status, expires, beat, sent_d, sent_r, sent_s, reusable:
    ClientLease(key, lid, "a", permits, drawn, released, stopped, status, expires, beat, sent_d, sent_r, sent_s,
                reusable),
    st.sampled_from(KEYS), st.sampled_from(LEASE_IDS), counts, counts, counts, st.booleans(),
    st.sampled_from(["live", "live", "retired", "settled"]), times, times, counts, counts,
    st.booleans(), st.booleans())
kinds_ids = st.one_of(st.tuples(st.just("grant"), st.sampled_from(GRANT_IDS)),
                      st.tuples(st.just("lease"), st.sampled_from(LEASE_IDS)))
COLUMNS = {"grant": ("claimed", "released", "confirmed"), "lease": ("drawn", "released", "stopped")}
SENT = {"grant": ("sent_claimed", "sent_released"), "lease": ("sent_drawn", "sent_released", "sent_stopped")}


#: The caller's table of recorded releases (the queue's items table, reduced to what the
#: store reads of it, with the same partial index).
RECORDS = "recorded_releases"
_RECORDS_SCHEMA = (
    f"CREATE TABLE {RECORDS} (n INTEGER PRIMARY KEY, key TEXT NOT NULL, permit_kind TEXT NOT NULL,"
    " permit_id TEXT NOT NULL, release_n INTEGER NOT NULL)",
    f"CREATE INDEX {RECORDS}_released ON {RECORDS}(key, permit_kind, permit_id, release_n) WHERE release_n > 0",
)


def _sql_store(local: LocalStorage) -> ClientRows:
    store = ClientRows(Storage(LocalContext(local)))
    store.records_releases_in(RECORDS)
    return store


class ClientStoreContract(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.local = LocalStorage()
        self.storage = Storage(LocalContext(self.local))
        _install_schema(self.storage)
        for statement in _RECORDS_SCHEMA:
            self.storage.exec(statement)
        self.sql = ClientRows(self.storage)
        self.sql.records_releases_in(RECORDS)
        self.mem = MemoryClientRows()
        self.mem.records_releases_in(RECORDS)
        self.now = 10
        #: The highest release recorded per row: no step sets ``released`` below it.
        self.floor: dict[tuple[str, str, str], int] = {}

    def _floor(self, kind: str, key: str, row_id: str) -> int:
        return self.floor.get((kind, key, row_id), 0)

    def _both(self, op: Callable[[ClientStore], None], *, fail: bool = False) -> None:
        """``op`` on both stores: on SQL in one transaction that flushes before it ends (or
        raises after ``op``, rolled back), on the twin in place (restored when it failed)."""
        self.now += 1

        def on_sql() -> None:
            op(self.sql)
            self.sql.flush()

        on_both(self.storage, on_sql, lambda: op(self.mem), self.mem.snapshot, self.mem.restore, fail=fail)

    def _raised(self, row: ClientGrant | ClientLease) -> Any:
        # As a reply's merge does (core.marks.raise_counts): released only rises, but never
        # above the merged claimed (drawn) count, which may clamp it below a record.
        grant = isinstance(row, ClientGrant)
        floor = self._floor("grant" if grant else "lease", row.key, row.grant_id if grant else row.lease_id)
        if floor == 0:
            return row
        used = row.claimed if grant else row.drawn
        return dataclasses.replace(row, released=min(max(row.released, floor), used))

    @rule(g=grants, fail=st.booleans())
    def merge_grant(self, g: ClientGrant, fail: bool) -> None:
        g = self._raised(g)
        self._both(lambda s: s.write_grant(g, self.now), fail=fail)

    @rule(x=leases, fail=st.booleans())
    def merge_lease(self, x: ClientLease, fail: bool) -> None:
        x = self._raised(x)
        self._both(lambda s: s.write_lease(x, self.now), fail=fail)

    @rule(data=st.data(), fail=st.booleans())
    def record_release(self, data: st.DataObject, fail: bool) -> None:
        # One more release of a row with a permit to release (the unit releases only what it
        # claimed or drew), which the caller records in its own table in the same transaction
        # when the store leaves the row unwritten (both stores decide alike).
        releasable = [(kind, key, row_id) for key in KEYS
                      for kind, ids in (("grant", GRANT_IDS), ("lease", LEASE_IDS)) for row_id in ids
                      if (r := (self.mem.grant_row if kind == "grant" else self.mem.lease_row)(key, row_id))
                      and int(r["released"]) < int(r["claimed" if kind == "grant" else "drawn"])]
        if not releasable:
            return
        kind, key, row_id = data.draw(st.sampled_from(releasable))
        row = self.mem.grant_row(key, row_id) if kind == "grant" else self.mem.lease_row(key, row_id)
        assert row is not None
        released = int(row["released"]) + 1
        answers: list[bool] = []

        def op(s: ClientStore) -> None:
            answers.append(s.record_release(kind, key, row_id, released, self.now))
            if answers[-1] and s is self.sql:
                self.storage.exec(f"INSERT INTO {RECORDS}(key, permit_kind, permit_id, release_n) VALUES (?, ?, ?, ?)",
                                  key, kind, row_id, released)

        self._both(op, fail=fail)
        assert answers[0] == answers[1]
        if answers[0] and not fail:
            self.floor[(kind, key, row_id)] = max(released, self._floor(kind, key, row_id))

    @rule(key=st.sampled_from(KEYS), fail=st.booleans())
    def fold_records(self, key: str, fail: bool) -> None:
        # The caller deletes the key's records, folding what they record into the rows first.
        recorded = recorded_releases(self.storage.exec(
            f"SELECT key, permit_kind, permit_id, release_n FROM {RECORDS} WHERE key = ?", key))

        def op(s: ClientStore) -> None:
            s.fold_releases(recorded)
            if s is self.sql:
                self.storage.exec(f"DELETE FROM {RECORDS} WHERE key = ?", key)

        self._both(op, fail=fail)

    @rule(key=st.sampled_from(KEYS), kind_id=kinds_ids, data=st.data(), fail=st.booleans())
    def change(self, key: str, kind_id: tuple[str, str], data: st.DataObject, fail: bool) -> None:
        kind, row_id = kind_id
        column = data.draw(st.sampled_from(COLUMNS[kind]))
        value = data.draw(st.integers(0, 1) if column == "stopped" else counts)
        if column in ("released", "claimed", "drawn"):
            value = max(value, self._floor(kind, key, row_id))
        self._both(lambda s: s.change(kind, key, row_id, column, value, self.now), fail=fail)

    @rule(key=st.sampled_from(KEYS), kind_id=kinds_ids, data=st.data(), merged=st.one_of(st.none(), grants, leases),
          fail=st.booleans())
    def deliver(self, key: str, kind_id: tuple[str, str], data: st.DataObject,
                merged: ClientGrant | ClientLease | None, fail: bool) -> None:
        # A delivery, maybe followed in the same transaction by a merge of some row (the same
        # row's merge writes the delivery with it; the flush writes the others).
        kind, row_id = kind_id
        sent = {c: data.draw(st.integers(0, 1) if c == "sent_stopped" else counts) for c in SENT[kind]}
        stamp = self.now + 1

        def op(s: ClientStore) -> None:
            s.delivered(kind, key, row_id, sent, stamp)
            if isinstance(merged, ClientGrant):
                s.write_grant(merged, self.now)
            elif isinstance(merged, ClientLease):
                s.write_lease(merged, self.now)

        self._both(op, fail=fail)

    @rule(key=st.sampled_from(KEYS), values=st.dictionaries(
        st.sampled_from(["next_request_at", "contended", "needs_sync", "room", "pruned_at"]), st.integers(0, 3)),
        fail=st.booleans())
    def touch_key(self, key: str, values: dict[str, int], fail: bool) -> None:
        self._both(lambda s: s.touch_key(key, self.now, **values), fail=fail)

    @rule(key=st.sampled_from(KEYS), back=st.integers(0, 30), fail=st.booleans())
    def prune(self, key: str, back: int, fail: bool) -> None:
        cutoff = self.now - back
        self._both(lambda s: s.prune(key, cutoff), fail=fail)

    @rule()
    def new_instance(self) -> None:
        self.sql.forget()

    @invariant()
    def both_answer_the_same(self) -> None:
        mem = _reads(self.mem, self.now)
        assert _reads(self.sql, self.now) == mem
        assert _reads(_sql_store(self.local), self.now) == mem  # a new instance


ClientStoreContract.TestCase.settings = settings(
    max_examples=int(os.environ.get("CLIENT_STORE_CONTRACT_EXAMPLES", "60")), stateful_step_count=40,
    derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestClientStoreContract = ClientStoreContract.TestCase
