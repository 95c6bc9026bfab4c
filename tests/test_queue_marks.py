"""The queue's per-key marks (:class:`semaphore.client._queue_store.QueueMarks`) over real SQLite:
the copy of the wake times answers what SQL holds, with more keys than it keeps, after every
kind of write and after a rolled back transaction, and a first read costs one statement
whatever the number of keys."""

from __future__ import annotations

import random

import pytest

from semaphore.client._queue import SemaphoreQueue
from semaphore.client._queue_store import WAKES_KEPT, QueueMarks
from semaphore.runtime import Storage
from semaphore.testing import LocalContext, LocalStorage


def _store() -> tuple[Storage, QueueMarks]:
    storage = Storage(LocalContext(LocalStorage()))
    SemaphoreQueue.migrate(storage, 1)
    return storage, QueueMarks(storage)


def _sql_wakes(storage: Storage) -> dict[str, int]:
    return {str(r["key"]): int(r["wake_at"])
            for r in storage.exec("SELECT key, wake_at FROM durability_semaphore_client_wakeups")}


def _agree(storage: Storage, marks: QueueMarks, keys: list[str], at: int) -> None:
    truth = _sql_wakes(storage)
    assert marks.earliest_wake() == min(truth.values(), default=None)
    assert marks.due_keys(at) == [k for w, k in sorted((w, k) for k, w in truth.items() if w <= at)]
    assert marks.due_keys(at) == marks.stored_due_keys(at)
    for key in keys:
        assert marks.wake(key) == truth.get(key), key


@pytest.mark.parametrize("n_keys", [3, WAKES_KEPT, WAKES_KEPT + 1, 3 * WAKES_KEPT])
@pytest.mark.parametrize("seed", range(4))
def test_the_copy_of_the_wake_times_answers_what_sql_holds(n_keys: int, seed: int):
    # R37 wake-ups: set, lowered, moved past the copy's horizon, removed; ties of wake times
    # (many keys due at once); a fresh copy over the same storage agrees too.
    rng = random.Random(seed)
    storage, marks = _store()
    keys = [f"k{i:03d}" for i in range(n_keys)]
    for step in range(400):
        key = rng.choice(keys)
        op = rng.random()
        if op < 0.1:
            marks.set_wake(key, None)
        elif op < 0.4:
            marks.set_wake(key, rng.randrange(0, 50), earlier_only=True)  # many ties
        else:
            marks.set_wake(key, rng.randrange(0, 5_000))
        if step % 25 == 0:
            _agree(storage, marks, keys, rng.randrange(0, 5_000))
    _agree(storage, marks, keys, 2_500)
    _agree(storage, QueueMarks(storage), keys, 2_500)


def test_a_first_read_of_the_wake_times_is_one_statement_whatever_the_number_of_keys():
    storage, writer = _store()
    for i in range(10 * WAKES_KEPT):
        writer.set_wake(f"k{i:04d}", 1_000 + i)
    marks = QueueMarks(storage)
    before = storage.statements
    assert marks.earliest_wake() == 1_000
    assert storage.statements - before == 1
    before = storage.statements
    assert marks.due_keys(1_000 + WAKES_KEPT - 1) == [f"k{i:04d}" for i in range(WAKES_KEPT)]
    assert storage.statements == before  # within what the copy keeps


def test_a_rolled_back_transaction_forgets_the_copy():
    storage, marks = _store()
    marks.set_wake("a", 5)

    def move_then_fail() -> None:
        marks.set_wake("a", 1)
        raise RuntimeError("rolled back")

    with pytest.raises(RuntimeError):
        storage.transaction(move_then_fail)
    assert marks.wake("a") == 5 and marks.earliest_wake() == 5


def test_a_wake_time_moved_past_the_copys_horizon_is_not_taken_for_one_the_copy_holds(
        monkeypatch: pytest.MonkeyPatch):
    # R37 wake-ups: the copy holds the earliest WAKES_KEPT wake times; a key set past the next
    # one stays out of it, so when the kept keys go, the earliest is read again. Were it kept,
    # the copy would answer the moved key's time as the earliest, past a key it never read, and
    # the alarm would be armed late.
    from semaphore.client import _queue_store

    monkeypatch.setattr(_queue_store, "WAKES_KEPT", 2)
    storage, writer = _store()
    for key, at in (("a", 1), ("b", 2), ("c", 3), ("d", 4)):
        writer.set_wake(key, at)
    marks = QueueMarks(storage)
    assert marks.earliest_wake() == 1  # a and b kept; c is the horizon
    marks.set_wake("d", 5)
    marks.set_wake("a", None)
    marks.set_wake("b", None)
    assert marks.earliest_wake() == 3 and marks.due_keys(4) == ["c"]


def test_a_kept_wake_time_moved_past_the_copys_horizon_leaves_the_copy(monkeypatch: pytest.MonkeyPatch):
    # R37 wake-ups: a key the copy holds, set later than the copy's horizon, leaves it (its new
    # time answered from its own read); were its old time kept, the key would be pumped and the
    # alarm fire early.
    from semaphore.client import _queue_store

    monkeypatch.setattr(_queue_store, "WAKES_KEPT", 2)
    storage, writer = _store()
    for key, at in (("a", 1), ("b", 2), ("c", 3)):
        writer.set_wake(key, at)
    marks = QueueMarks(storage)
    assert marks.earliest_wake() == 1  # a and b kept; c is the horizon
    marks.set_wake("a", 6)
    assert marks.wake("a") == 6 and marks.stored_wake("a") == 6
    assert marks.earliest_wake() == 2 and marks.due_keys(2) == ["b"]
