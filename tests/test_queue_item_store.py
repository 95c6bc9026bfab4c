"""The queue's items copy (:class:`semaphore.client._item_store.QueueItems`) over real SQLite:
what the copy answers is what SQL holds, after batched writes and after a rolled back
transaction, and a long payload is read back when asked for."""

from __future__ import annotations

import json

import pytest

from semaphore.client._item_store import COLUMNS, ITEMS, PAYLOAD_KEPT, Add, DonePending, QueueItems
from semaphore.client._queue import SemaphoreQueue
from semaphore.runtime import Storage
from semaphore.testing import LocalContext, LocalStorage


def _row(item_id: str, seq: int, *, key: str = "k", owner: str = "", payload: str = "null") -> dict[str, object]:
    return {**{c: 0 for c in COLUMNS}, "item_id": item_id, "key": key, "group_name": "g", "seq": seq,
            "state": "queued", "permit_kind": "", "permit_id": "", "owner": owner, "error": "", "payload": payload}


@pytest.fixture
def store() -> tuple[Storage, QueueItems]:
    storage = Storage(LocalContext(LocalStorage()))
    SemaphoreQueue.migrate(storage, 1)
    return storage, QueueItems(storage, done_hooks=True)


def _sql_rows(storage: Storage, key: str) -> list[dict[str, object]]:
    rows = storage.exec(f"SELECT {', '.join(COLUMNS)} FROM {ITEMS} WHERE key = ? AND state != 'done'"
                        " OR done_pending = 1 ORDER BY seq", key)
    return [dict(r) for r in rows]


def _copy_rows(items: QueueItems, key: str) -> list[dict[str, object]]:
    return [{c: r[c] for c in COLUMNS} for r in items.rows(key)]


def test_a_batched_update_is_one_statement_and_the_copy_matches_sql(store):
    storage, items = store
    for i in range(5):
        items.insert(_row(f"i{i}", i + 1))
    assert len(items.rows("k")) == 5  # loaded (after the inserts: SQL had them)
    before = storage.statements
    items.update("k", ["i0", "i2", "i4"], {"state": "claiming", "permit_kind": "grant", "permit_id": "g1"},
                 {"slot": [7, 3, 5]})
    items.update("k", ["i1", "i3"], {"attempts": Add(2), "retry_at": 99})
    assert storage.statements - before == 2
    assert _copy_rows(items, "k") == _sql_rows(storage, "k")
    assert [r["slot"] for r in items.rows("k", "claiming")] == [7, 3, 5]
    assert {r["attempts"] for r in items.rows("k", "queued")} == {2}


def test_a_finished_item_leaves_the_copy_unless_its_hook_is_pending(store):
    storage, items = store
    items.insert(_row("cb", 1))
    items.insert(_row("permit", 2, owner="tok"))
    items.rows("k")
    items.update("k", ["cb", "permit"], {"state": "done", "done_pending": DonePending(True)})
    assert [r["item_id"] for r in items.rows("k")] == ["cb"]  # a permit item has no hook
    assert _copy_rows(items, "k") == _sql_rows(storage, "k")
    items.update("k", ["cb"], {"done_pending": 0})
    assert items.rows("k") == [] and items.find("cb") is not None  # still in SQL, finished


def test_a_rolled_back_transaction_forgets_the_copy(store):
    storage, items = store
    items.insert(_row("a", 1))
    items.rows("k")

    def body() -> None:
        items.update("k", ["a"], {"state": "running"})
        raise RuntimeError("fail")

    with pytest.raises(RuntimeError):
        storage.transaction(body)
    assert [r["state"] for r in items.rows("k")] == ["queued"]


def test_a_long_payload_is_read_when_asked_for(store):
    storage, items = store
    long = json.dumps("x" * PAYLOAD_KEPT)
    items.insert(_row("big", 1, payload=long))
    items.insert(_row("small", 2, payload='{"n": 1}'))
    rows = items.rows("k")
    assert [r["payload"] for r in rows] == [None, '{"n": 1}']
    before = storage.statements
    assert [r["payload"] for r in items.payloads(rows)] == [long, '{"n": 1}']
    assert storage.statements - before == 1


def test_insert_new_numbers_the_item_and_refuses_a_known_id_in_one_statement(store):
    storage, items = store
    before = storage.statements
    new = {k: v for k, v in _row("a", 0).items() if k != "seq"}
    assert items.insert_new(new) == {**new, "seq": 1}
    assert storage.statements - before == 1
    items.insert(_row("b", 7))
    assert items.insert_new({**new, "item_id": "c"})["seq"] == 8  # one more than the largest
    before = storage.statements
    assert items.insert_new(new) is None  # a known id: nothing written
    assert storage.statements - before == 1
    assert items.find("a")["seq"] == 1


def test_a_keys_load_reads_its_items_and_the_queues_marks_of_it_in_one_statement():
    # The load of a key's items also reads the queue's marks of that key (since when releases
    # wait, whether a blocked entry is kept, whether a finished permit() item is kept) in the same
    # statement; the rows it gives are those SQL holds, long payloads left out.
    storage = Storage(LocalContext(LocalStorage()))
    SemaphoreQueue.migrate(storage, 1)
    seen: list[tuple[str, int | None, bool, bool]] = []
    writer = QueueItems(storage, done_hooks=True)
    writer.insert(_row("a", 1, payload=json.dumps("x" * PAYLOAD_KEPT)))
    writer.insert(_row("b", 2, payload='{"n": 1}'))
    writer.insert(_row("p", 3, owner="tok"))
    writer.rows("k")
    writer.update("k", ["p"], {"state": "done", "done_pending": DonePending(False)})
    storage.exec("INSERT INTO durability_semaphore_client_pending_releases(key, since) VALUES ('k', 42)")
    storage.exec("INSERT INTO durability_semaphore_client_blocked(key, group_name, reason, waiting, at)"
                 " VALUES ('k', 'g', 'limit', 1, 1)")
    items = QueueItems(storage, done_hooks=True, on_load=lambda *marks: seen.append(marks))
    before = storage.statements
    rows = items.rows("k")
    assert storage.statements - before == 1
    assert seen == [("k", 42, True, True)]
    assert _copy_rows(items, "k") == _sql_rows(storage, "k")
    assert [r["payload"] for r in rows] == [None, '{"n": 1}']
    items.rows("other")
    assert seen[-1] == ("other", None, False, False)


class _NoWalk(dict):
    """A key's kept rows that refuse to be walked: a lookup by id is all an insert may do."""

    def __iter__(self):
        raise AssertionError("walked every kept row of a loaded key")

    def keys(self):
        raise AssertionError("walked every kept row of a loaded key")


def _new(item_id: str, payload: str = "null") -> dict[str, object]:
    row = _row(item_id, 0, payload=payload)
    del row["seq"]
    return row


def test_inserting_new_items_looks_each_id_up_and_never_walks_the_loaded_items(store):
    # An enqueue costs what its own items cost, not what the queue holds: each new id is looked
    # up in every loaded key's copy, never by walking every item kept (a queue of 100,000 items
    # made every enqueue 60 times slower that way).
    storage, items = store
    items.insert_many([_new(f"i{n}") for n in range(3)])
    assert len(items.rows("k")) == 3  # loaded
    items._key("k").rows = _NoWalk(items._key("k").rows)
    new = items.insert_many([_new("i1"), _new("j1"), _new("j2")])
    assert [r["item_id"] for r in new] == ["j1", "j2"]
    assert [r["item_id"] for r in items.insert_many([_new("j3")])] == ["j3"]


def test_a_batch_of_new_items_stays_within_its_binding_bound_whatever_its_ids_escape_to(store):
    # Each statement carries its items' ids and payloads as one JSON binding of at most
    # INSERT_BATCH_BYTES: ids and payloads whose characters JSON escapes (quotes, backslashes)
    # count twice, so the bound holds for them too (a Durable Object's SQLite takes 2 MB per value).
    from semaphore.client._item_store import INSERT_BATCH_BYTES

    storage, items = store
    bindings: list[int] = []
    inner = storage._sql.exec

    def measured(query: str, *args: object) -> object:
        if query.startswith(f"INSERT INTO {ITEMS}") and "json_each" in query:
            bindings.append(len(str(args[-1]).encode()))
        return inner(query, *args)

    storage._sql.exec = measured
    ids = ["\\" * 200 + f"{n}" for n in range(3000)]
    new = items.insert_many([_new(i, json.dumps('"' * 100)) for i in ids])
    assert [r["item_id"] for r in new] == ids
    assert len(bindings) > 1 and max(bindings) <= INSERT_BATCH_BYTES, bindings
    assert [r["item_id"] for r in storage.exec(f"SELECT item_id FROM {ITEMS} ORDER BY seq")] == ids


def test_a_purge_deletes_the_items_finished_before_its_cutoff_and_keeps_pending_hooks_and_the_rest(store):
    # R37 (finished items' purge): strictly before the cutoff; an item whose on_done hook is
    # pending stays until the hook ran or the queue dropped its hooks (a queue without on_done).
    storage, items = store
    for n, (item_id, finished_at, hook) in enumerate((("old", 9, False), ("edge", 10, False),
                                                       ("hooked", 5, True), ("live", 0, False))):
        items.insert(_row(item_id, n + 1))
        if item_id != "live":
            items.update("k", [item_id], {"state": "done", "finished_at": finished_at,
                                          "done_pending": DonePending(hook)})
    items.purge_done(10)
    assert sorted(r["item_id"] for r in items.view("k")) == ["edge", "hooked", "live"]
    items.drop_hooks()
    items.purge_done(10)
    assert sorted(r["item_id"] for r in items.view("k")) == ["edge", "live"]
    assert _copy_rows(items, "k") == _sql_rows(storage, "k")


@pytest.mark.parametrize("twin", [False, True], ids=["sql", "twin"])
def test_the_quick_delete_takes_a_keys_finished_permit_items_that_record_no_release(store, twin: bool):
    # R35, R37: a finished permit() item that records a release waits for the purge, which
    # folds it; a callback item, a live permit item and another key's are not taken either.
    from semaphore.testing import MemoryQueueItems

    storage, items = store
    if twin:
        items = MemoryQueueItems()
    rows = [("p", "k", "tok", "done", 0), ("recorded", "k", "tok", "done", 2), ("callback", "k", "", "done", 0),
            ("live", "k", "tok", "running", 0), ("other", "o", "tok", "done", 0)]
    for item_id, key, owner, state, release_n in rows:
        items.insert_new({**{c: v for c, v in _row(item_id, 0, key=key, owner=owner).items() if c != "seq"},
                          "state": state, "release_n": release_n})
    items.delete_done_permits("k")
    assert sorted(r["item_id"] for r in items.view()) == ["callback", "live", "other", "recorded"]


@pytest.mark.parametrize("twin", [False, True], ids=["sql", "twin"])
def test_a_purge_hands_over_the_highest_release_its_items_record_per_permit(store, twin: bool):
    # R35: before it deletes, the purge hands the client the highest release_n the purged items
    # record per grant or lease (the client folds it into that permit's row); a permit whose
    # purged items record none is not named, nor what items it keeps record.
    from semaphore.testing import MemoryQueueItems

    storage, items = store
    handed: list[object] = []
    if twin:
        items = MemoryQueueItems()
    items.before_delete = handed.append
    rows = [("a", "k", "grant", "g1", 2, 5), ("b", "k", "grant", "g1", 3, 5), ("c", "k", "lease", "g1", 1, 5),
            ("d", "o", "grant", "g2", 0, 5), ("e", "o", "lease", "l2", 4, 5), ("kept", "k", "grant", "g1", 9, 50)]
    for item_id, key, kind, permit_id, release_n, finished_at in rows:
        items.insert_new({**{c: v for c, v in _row(item_id, 0, key=key).items() if c != "seq"}, "state": "done",
                          "permit_kind": kind, "permit_id": permit_id, "release_n": release_n,
                          "finished_at": finished_at})
    items.purge_done(10)
    assert [tuple(r) for h in handed for r in h] == [  # type: ignore[attr-defined]
        ("grant", "k", "g1", 3), ("lease", "k", "g1", 1), ("lease", "o", "l2", 4)]
    assert sorted(r["item_id"] for r in items.view()) == ["kept"]
    handed.clear()
    items.purge_done(10)  # nothing left to purge: nothing handed over
    assert handed == []
