"""The client's copy of its grant, lease and key rows (:class:`semaphore.client._store.ClientRows`)
over real SQLite: a key's load is one statement and gives the rows SQL holds, and a delivery is
written with its merge, or by the flush, so SQL ends as the copy says."""

from __future__ import annotations

import pytest

from semaphore.client._client_model import _install_schema
from semaphore.client._store import GRANT_COLUMNS, GRANTS, KEY_COLUMNS, KEYS, LEASE_COLUMNS, LEASES, ClientRows
from semaphore.core.client_state import GONE, ClientGrant, ClientLease
from semaphore.runtime import Storage
from semaphore.testing import LocalContext, LocalStorage


def _storage() -> Storage:
    storage = Storage(LocalContext(LocalStorage()))
    _install_schema(storage)
    return storage


def _sql(storage: Storage, key: str) -> tuple[dict, dict, dict | None]:
    grants = {r["grant_id"]: {c: r[c] for c in GRANT_COLUMNS} for r in storage.exec(
        f"SELECT * FROM {GRANTS} WHERE key = ? AND status <> 'gone'", key)}
    leases = {r["lease_id"]: {c: r[c] for c in LEASE_COLUMNS} for r in storage.exec(
        f"SELECT * FROM {LEASES} WHERE key = ? AND status <> 'settled'", key)}
    row = storage.one(f"SELECT * FROM {KEYS} WHERE key = ?", key)
    return grants, leases, row


def _fill(storage: Storage) -> None:
    writer = ClientRows(storage)
    writer.write_grant(ClientGrant("k", "g1", "a", 3, 2, 1, 2, 500, "live", 1, 0), 100)
    writer.write_grant(ClientGrant("k", "g0", "a", 1, 1, 1, 1, 400, GONE, 1, 1), 90)
    writer.write_lease(ClientLease("k", "l1", "a", 64, 5, 2, False, "live", 9000, 4000, 5, 2, False, True), 110)
    writer.write_lease(ClientLease("k", "l0", "a", 64, 5, 5, True, "settled", 9000, 4000, 5, 5, True, False), 80)
    writer.touch_key("k", 120, next_request_at=130, contended=1, room=1)
    writer.write_grant(ClientGrant("other", "g9", "a", 1, 0, 0, 0, 500, "live", 0, 0), 100)


def test_a_keys_load_is_one_statement_and_gives_the_rows_sql_holds():
    storage = _storage()
    _fill(storage)
    rows = ClientRows(storage)
    before = storage.statements
    grants = {r["grant_id"]: r for r in rows.grant_rows("k")}
    leases = {r["lease_id"]: r for r in rows.lease_rows("k")}
    key_row = rows.key_row("k")
    assert storage.statements - before == 1
    sql_grants, sql_leases, sql_key = _sql(storage, "k")
    assert grants == sql_grants and set(grants) == {"g1"}
    assert leases == sql_leases and set(leases) == {"l1"}
    assert key_row is not None and sql_key is not None
    assert {c: key_row[c] for c in (*KEY_COLUMNS, "updated_at")} == {c: sql_key[c] for c in (*KEY_COLUMNS, "updated_at")}
    assert rows.key_row("none") is None and rows.grant_rows("none") == []


def test_a_delivery_is_written_with_its_merge_or_by_the_flush():
    storage = _storage()
    _fill(storage)
    rows = ClientRows(storage)
    rows.grant_rows("k")
    before = storage.statements
    rows.delivered("grant", "k", "g1", {"sent_claimed": 2, "sent_released": 1}, 150)
    rows.delivered("lease", "k", "l1", {"sent_drawn": 5, "sent_released": 2, "sent_stopped": 0}, 151)
    assert storage.statements == before  # in the copy only, so far
    g = rows.grants("k")[0]
    rows.write_grant(ClientGrant("k", "g1", "a", 3, 2, 1, 2, 500, "live", g.sent_claimed, g.sent_released), 150)
    rows.flush()  # the lease's delivery, which no merge wrote
    assert storage.statements - before == 2
    fresh = ClientRows(storage)
    assert fresh.grant_rows("k") == rows.grant_rows("k") and fresh.grant_rows("k")[0]["report_at"] == 150
    assert fresh.lease_rows("k") == rows.lease_rows("k") and fresh.lease_rows("k")[0]["report_at"] == 151
    before = storage.statements
    rows.flush()
    assert storage.statements == before


def test_a_rows_changes_keep_its_place_in_the_report_order_while_it_has_something_to_report():
    # R13, R7 (fair rotation): the pure changes both stores make (client/_rows.py). A row that
    # turns dirty has waited since now; one already dirty keeps the time it has waited since; a
    # delivery raises the acknowledged counts (never lowers them) and sends the row behind every
    # entry still waiting.
    from semaphore.client._rows import changed_row, delivered_row, report_order, reports_waiting, touched_key

    clean = {"claimed": 1, "released": 0, "sent_claimed": 1, "sent_released": 0, "report_at": 5, "updated_at": 5,
             "claim_by": 9, "grant_id": "g1"}
    dirty = changed_row(clean, "grant", "released", 1, 20)
    assert (dirty["released"], dirty["report_at"], dirty["updated_at"]) == (1, 20, 20)
    again = changed_row({**dirty, "claimed": 2}, "grant", "released", 2, 30)
    assert (again["report_at"], again["updated_at"]) == (20, 30)
    acked = delivered_row(again, {"sent_claimed": 2, "sent_released": 1}, 40)
    assert (acked["sent_claimed"], acked["sent_released"], acked["report_at"]) == (2, 1, 40)
    assert delivered_row(acked, {"sent_claimed": 1, "sent_released": 0}, 41)["sent_claimed"] == 2
    # The report window: rows with something to report first, longest waiting first; "cut" only
    # when one of those did not fit; the grant-only window counts no lease.
    a = {**clean, "grant_id": "a", "released": 1, "report_at": 30}
    b = {**clean, "grant_id": "b", "released": 1, "report_at": 10}
    c = {**clean, "grant_id": "c", "report_at": 0}
    assert [r["grant_id"] for r in report_order([c, a, b], [], 0, 2)[0]] == ["b", "a"]
    assert report_order([c, a, b], [], 0, 2)[1] is False and report_order([c, a, b], [], 0, 1)[1] is True
    assert reports_waiting([a, b, c], [], 0) == 2
    # A key row: a change writes it (a new one as if pruned now); no change writes nothing.
    row = touched_key(None, "k", 50, {"room": 1})
    assert row is not None and (row["room"], row["pruned_at"], row["updated_at"]) == (1, 50, 50)
    assert touched_key(row, "k", 60, {"room": 1}) is None
    later = touched_key(row, "k", 70, {"contended": 1})
    assert later is not None and (later["room"], later["contended"], later["pruned_at"]) == (1, 1, 50)


def test_a_delivery_rolled_back_leaves_nothing_to_write_after_its_row_is_pruned():
    # A transaction that raises rolls back a delivery it made: the copy forgets it, its pending
    # write included, so a later prune of that (tombstone) row and any later transaction's
    # flush still work; a write left behind would wedge every later transaction of the client.
    storage = _storage()
    rows = ClientRows(storage)
    storage.transaction(lambda: (rows.write_grant(ClientGrant("k", "g1", "a", 1, 1, 1, 1, 0, GONE, 1, 1), 10),
                                 rows.flush()))

    def delivered_then_failed() -> None:
        rows.delivered("grant", "k", "g1", {"sent_claimed": 1, "sent_released": 1}, 11)
        raise RuntimeError("the reply's transaction failed")

    with pytest.raises(RuntimeError):
        storage.transaction(delivered_then_failed)
    storage.transaction(lambda: (rows.prune("k", 100), rows.flush()))
    storage.transaction(lambda: (rows.touch_key("k", 50, room=1), rows.flush()))
    assert rows.grant_row("k", "g1") is None and rows.key_row("k")["room"] == 1


def _released(storage: Storage) -> dict[tuple[str, str, str], int]:
    return {**{("grant", r["key"], r["grant_id"]): r["released"] for r in storage.exec(f"SELECT * FROM {GRANTS}")},
            **{("lease", r["key"], r["lease_id"]): r["released"] for r in storage.exec(f"SELECT * FROM {LEASES}")}}


@pytest.mark.parametrize("batch", [500, 1], ids=["one-statement", "a-statement-each"])
def test_folded_releases_go_to_their_own_kinds_row_the_highest_of_each_clamped_to_its_use(monkeypatch, batch):
    # R35: a grant and a lease may share an id: each recorded release goes to its own kind's
    # row; a permit named twice takes the highest; never above the claimed (drawn) count, never
    # below what the row holds (R13); in batches of JSON_ROWS.
    from semaphore.client import _store
    from semaphore.client._rows import RecordedRelease

    monkeypatch.setattr(_store, "JSON_ROWS", batch)
    storage = _storage()
    writer = ClientRows(storage)
    writer.write_grant(ClientGrant("k", "x", "a", 5, 4, 1, 4, 500, "live", 4, 1), 100)
    writer.write_lease(ClientLease("k", "x", "a", 64, 6, 2, False, "live", 9000, 4000, 6, 2, False, True), 100)
    writer.write_grant(ClientGrant("k", "high", "a", 5, 3, 2, 3, 500, "live", 3, 2), 100)
    writer.write_grant(ClientGrant("o", "x", "a", 5, 4, 3, 4, 500, "live", 4, 3), 100)
    writer.fold_releases([RecordedRelease("grant", "k", "x", 3), RecordedRelease("lease", "k", "x", 5),
                          RecordedRelease("grant", "k", "x", 2), RecordedRelease("grant", "k", "high", 9),
                          RecordedRelease("grant", "o", "x", 1)])
    assert _released(storage) == {("grant", "k", "x"): 3, ("lease", "k", "x"): 5, ("grant", "k", "high"): 3,
                                  ("grant", "o", "x"): 3}  # never lowered


def test_a_full_batch_of_the_longest_ids_folds_within_the_runtimes_value_limit():
    # R35: 500 recorded releases whose key and permit id are 256 four-byte characters each go
    # in one binding below the 2 MB value limit the test kit enforces as the runtime does.
    from semaphore.client._rows import RecordedRelease

    storage = _storage()
    writer = ClientRows(storage)
    key = "😀" * 256
    ids = ["😀" * 253 + f"{i:03d}" for i in range(500)]
    for grant_id in ids[:3]:
        writer.write_grant(ClientGrant(key, grant_id, "a", 2, 2, 0, 2, 500, "live", 2, 0), 100)
    writer.fold_releases([RecordedRelease("grant", key, grant_id, 1) for grant_id in ids])
    assert [r["released"] for r in storage.exec(f"SELECT released FROM {GRANTS}")] == [1, 1, 1]


def test_r15a_a_grants_table_of_an_older_release_gains_holder_released_and_each_table_is_read_once():
    # R15a: the grants table gains holder_released in place (a row of an older release reads
    # False), and installing the schema reads each table's columns once, not once per added
    # column (it runs at every object's first use: each read is a statement, a JS crossing).
    raw = LocalStorage()
    raw.connection.execute(
        f"CREATE TABLE {GRANTS} (key TEXT NOT NULL, grant_id TEXT NOT NULL, group_name TEXT NOT NULL,"
        " permits INTEGER NOT NULL, claimed INTEGER NOT NULL, released INTEGER NOT NULL,"
        " confirmed INTEGER NOT NULL, claim_by INTEGER NOT NULL, status TEXT NOT NULL,"
        " sent_claimed INTEGER NOT NULL, sent_released INTEGER NOT NULL, updated_at INTEGER NOT NULL,"
        " PRIMARY KEY (key, grant_id))")
    raw.connection.execute(f"INSERT INTO {GRANTS} VALUES ('k', 'g1', 'a', 2, 1, 0, 1, 500, 'active', 1, 0, 100)")
    storage = Storage(LocalContext(raw))
    seen: list[str] = []
    inner = raw.sql.exec

    def counted(query: str, *bindings: object) -> object:
        seen.append(query)
        return inner(query, *bindings)

    raw.sql.exec = counted  # type: ignore[method-assign]
    _install_schema(storage)
    raw.sql.exec = inner  # type: ignore[method-assign]
    reads = [q for q in seen if q.startswith("PRAGMA table_info")]
    assert sorted(reads) == sorted(set(reads)) and len(reads) == 3, reads  # grants, leases, keys
    [g] = ClientRows(storage).grants("k")
    assert g.holder_released is False and g.claimed == 1


def test_r15a_an_upgrade_marks_the_live_grants_of_keys_whose_last_reply_told_a_ttl():
    # R15a: the release before holder_released switched the completion check on by the key's
    # last reply's claimTtlMs; a crash expiry it merged already shows in no later reply. So
    # when the column is added, the live grants of keys with a claimTtlMs get it (not a
    # tombstone, not another key's), and a second install changes nothing.
    raw = LocalStorage()
    storage = Storage(LocalContext(raw))
    _install_schema(storage)
    raw.connection.execute(f"ALTER TABLE {GRANTS} DROP COLUMN holder_released")
    for key, gid, status in (("ttl", "g1", "active"), ("ttl", "g0", GONE), ("plain", "g2", "active")):
        raw.connection.execute(f"INSERT INTO {GRANTS} (key, grant_id, group_name, permits, claimed, released,"
                               " confirmed, claim_by, status, sent_claimed, sent_released, updated_at)"
                               f" VALUES (?, ?, 'a', 2, 2, 1, 2, 500, ?, 2, 1, 100)", (key, gid, status))
    for key, ttl in (("ttl", 5000), ("plain", 0)):
        raw.connection.execute(f"INSERT INTO {KEYS} (key, next_request_at, contended, needs_sync, check_at,"
                               " updated_at, claim_ttl_ms) VALUES (?, 0, 0, 0, 0, 0, ?)", (key, ttl))
    _install_schema(Storage(LocalContext(raw)))
    marked = dict(raw.connection.execute(f"SELECT grant_id, holder_released FROM {GRANTS}").fetchall())
    assert marked == {"g1": 1, "g0": 0, "g2": 0}
    raw.connection.execute(f"UPDATE {GRANTS} SET holder_released = 0")
    _install_schema(Storage(LocalContext(raw)))  # the column exists: nothing is marked again
    assert {r[0] for r in raw.connection.execute(f"SELECT holder_released FROM {GRANTS}")} == {0}
