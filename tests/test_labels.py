"""Client labels (SPEC R38 decision, wire ``label``): a client sends a readable name with its
requests and syncs (by default its Durable Object's name, ``ctx.id.name``), the holder keeps it
beside the client's last report time in the same statement, and ``holders()`` shows it beside
the 64-hex id. Old clients send none (no label); a bad label is refused naming ``label`` and
changes nothing; a label costs no SQL statement of its own, at the holder or the client."""

from __future__ import annotations

from typing import Any

import pytest

from semaphore import ConfigurationError, Demand, PermitRequest, SemaphoreClient, SyncMessage, parse_message
from semaphore.core.wire import MAX_LABEL_LENGTH, label_problem
from semaphore.holder._store import CLIENTS
from semaphore.runtime import Storage
from semaphore.testing import (
    T0,
    Bed,
    ClientSide,
    HolderSide,
    LocalContext,
    LocalStorage,
    Net,
    SimClock,
    async_test,
    dump,
    request,
    sync,
)

KEY = "acct"


def labels(page: dict[str, Any]) -> dict[str, str | None]:
    return {h["clientId"]: h["label"] for h in page["holders"]}


def client(clock: SimClock, holder: HolderSide, name: str | None, **options: Any) -> SemaphoreClient:
    return SemaphoreClient(LocalContext(LocalStorage(), name=name), Net(holder, clock), clock=clock, **options)


# ============================================================================ end to end
@async_test
async def test_r38_a_client_object_named_x_is_listed_by_holders_with_label_x():
    # The default label is the name the object was reached by (ctx.id.name), not its id.
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=5, leases=None)
    c = client(clock, holder, "exports/eu-1")
    assert c.client_id == "id:exports/eu-1" and c.label == "exports/eu-1"
    applied = await c.request(KEY, [Demand("g", 1, T0)])
    assert applied.response.grants
    assert labels(await holder.sem.holders()) == {"id:exports/eu-1": "exports/eu-1"}


@async_test
async def test_r38_a_queue_in_a_named_object_labels_its_client_with_the_name():
    # Through the queue (permit()), as an application uses it: the sync confirming the claim
    # and the request both carry the label.
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, leases=None)
    side = ClientSide("jobs-7", clock, Net(holder, clock))
    async with side.queue.permit(KEY, "g"):
        page = await holder.sem.holders()
        assert labels(page) == {"jobs-7": "jobs-7"}
        assert page["holders"][0]["charged"] == 1
    side.driver.kill()


@async_test
async def test_r38_an_explicit_label_wins_and_none_sends_no_label():
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=5, leases=None)
    net_a, net_b = Net(holder, clock), Net(holder, clock)
    named = SemaphoreClient(LocalContext(name="obj-a"), net_a, clock=clock, label="exports (eu)")
    silent = SemaphoreClient(LocalContext(name="obj-b"), net_b, clock=clock, label=None)
    for c in (named, silent):
        await c.request(KEY, [Demand("g", 1, T0)])
        await c.sync(KEY)
    assert labels(await holder.sem.holders()) == {"id:obj-a": "exports (eu)", "id:obj-b": None}
    assert [m["label"] for m in net_a.sent] == ["exports (eu)"] * 2  # on the request and the sync
    assert net_b.sent and all("label" not in m for m in net_b.sent)


@async_test
async def test_r38_an_object_without_a_name_has_no_label():
    # newUniqueId ids: ctx.id.name is None on workerd (LocalContext(name=None) likewise).
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=5, leases=None)
    c = client(clock, holder, None)
    assert c.label is None and len(c.client_id) == 64
    await c.request(KEY, [Demand("g", 1, T0)])
    assert labels(await holder.sem.holders()) == {c.client_id: None}
    bare = Storage(LocalContext(LocalStorage()))  # a bare Storage has no ctx.id
    assert SemaphoreClient(bare, Net(holder, clock), client_id="bare").label is None


def test_r38_a_long_or_unprintable_object_name_is_cut_or_dropped_and_a_bad_label_is_refused():
    storage = LocalStorage()
    transport: Any = None
    long_name = "n" * 1024  # workerd passes names up to 1,024 bytes through
    assert SemaphoreClient(LocalContext(storage, name=long_name), transport).label == "n" * MAX_LABEL_LENGTH
    assert SemaphoreClient(LocalContext(storage, name="a\x00b"), transport).label is None
    assert SemaphoreClient(LocalContext(storage, name=""), transport).label is None
    for bad in ("", "x" * (MAX_LABEL_LENGTH + 1), "tab\there", "\ud800", 7):
        with pytest.raises(ConfigurationError) as raised:
            SemaphoreClient(LocalContext(storage, name="ok"), transport, label=bad)
        assert raised.value.field == "label" and "label" in str(raised.value)
    assert label_problem("x" * MAX_LABEL_LENGTH) is None and label_problem("exports \U0001f600 eu") is None


# ============================================================================ the wire
def test_r38_label_travels_only_when_set_and_parses_back():
    assert "label" not in PermitRequest("c").to_wire() and "label" not in SyncMessage("c").to_wire()
    req = PermitRequest("c", (Demand("g", 1, 0),), label="exports")
    assert req.to_wire()["label"] == "exports" and parse_message(req.to_wire()) == req
    s = SyncMessage("c", leases=(), label="exports")
    assert parse_message(s.to_wire()) == s
    assert parse_message({**request("c", {"g": 1}), "label": None}).label is None  # null: absent


@async_test
async def test_r38_old_clients_without_the_field_work_and_a_stored_label_stays_until_replaced():
    bed = Bed(10)
    (r,) = await bed.round(request("old", {"g": 1}))  # an older release: no label
    assert "error" not in r and labels(await bed.sem.holders()) == {"old": None}
    await bed.round(request("new", {"g": 1}, label="exports"))
    assert labels(await bed.sem.holders()) == {"old": None, "new": "exports"}
    # a message without the field (an older instance of the client) keeps the stored label
    assert "error" not in await bed.sem.handle(sync("new"))
    assert labels(await bed.sem.holders())["new"] == "exports"
    # a new label replaces it; the latest labelled message of a round wins (R10)
    await bed.round(request("new", {"g": 2}, label="first"), request("new", {"g": 2}, label="second"))
    assert labels(await bed.sem.holders())["new"] == "second"
    await bed.sem.handle(sync("new", label="renamed"))
    assert labels(await bed.sem.holders())["new"] == "renamed"


@async_test
async def test_r38_r7_a_bad_label_is_refused_naming_label_and_changes_nothing():
    bed = Bed(10)
    await bed.round(request("c", {"g": 1}, label="exports"))
    before, statements = dump(bed.storage), bed.storage.statements
    for bad in (request("c", {"g": 2}, label="x" * 201), sync("c", label="bad\nlabel")):
        reply = await bed.sem.handle(bad)
        assert reply["error"]["code"] == "invalid_message" and reply["error"]["field"] == "label", reply
    assert dump(bed.storage) == before and bed.storage.statements == statements
    assert labels(await bed.sem.holders()) == {"c": "exports"}


@async_test
async def test_r38_a_client_that_holds_nothing_leaves_no_label_behind():
    bed = Bed(10)
    (r,) = await bed.round(request("c", {"g": 1}, label="exports"))
    (g,) = r["grants"]
    await bed.sem.handle(sync("c", [(g["grantId"], 1, 1)], label="exports"))  # released in full: deleted
    assert (await bed.sem.holders())["holders"] == []
    assert not bed.dump()[CLIENTS]


# ============================================================================ cost
async def _holder_statements(label: str | None) -> list[int]:
    """Holder statements of each of a client's messages: a round, then three syncs."""
    bed = Bed(10)
    counts = []

    async def run(message: dict[str, Any]) -> dict[str, Any]:
        before = bed.storage.statements
        reply = await (bed.one(message) if message["type"] == "request" else bed.sem.handle(message))
        counts.append(bed.storage.statements - before)
        return reply

    (g,) = (await run(request("c", {"g": 3}, label=label)))["grants"]
    for claimed in (1, 2, 2):
        await run(sync("c", [(g["grantId"], claimed, 0)], label=label))
    assert labels(await bed.sem.holders()) == {"c": label}
    return counts


@async_test
async def test_r38_a_label_adds_no_sql_statement_at_the_holder():
    # The label rides on the upsert that records the client's last report time: with or without
    # one, every message costs the same statements (so an unchanged label writes nothing extra).
    assert await _holder_statements("exports") == await _holder_statements(None)


@async_test
async def test_r38_a_label_adds_no_sql_statement_at_the_client():
    async def client_statements(label: str | None) -> int:
        clock = SimClock(T0)
        holder = HolderSide(clock, limit=5, leases=None)
        c = client(clock, holder, "obj", label=label)
        c.ensure_schema()
        before = c.storage.statements
        applied = await c.request(KEY, [Demand("g", 2, T0)])
        (g,) = applied.response.grants
        c.claim(KEY, g.grant_id, 2)
        await c.sync(KEY)
        return c.storage.statements - before

    assert await client_statements("exports") == await client_statements(None)


# ============================================================================ storage of an older release
OLD_CLIENTS = ("CREATE TABLE durability_semaphore_clients (client_id TEXT PRIMARY KEY,"
               " last_report_at INTEGER NOT NULL, claims INTEGER NOT NULL DEFAULT 0, expires_at INTEGER)")


def columns(storage: LocalStorage, table: str) -> set[str]:
    return {str(r[1]) for r in storage.connection.execute(f"PRAGMA table_info({table})")}


@async_test
async def test_r1_r38_a_clients_table_of_an_older_release_gains_the_label_column():
    # R1: the table as the release before this one wrote it (no label column, one client row)
    # gains the column on first use; the client seen before has no label until it sends one.
    bed = Bed(10)
    (r,) = await bed.round(request("c", {"g": 1}))
    bed.storage.connection.execute(f"DROP TABLE {CLIENTS}")
    bed.storage.connection.execute(OLD_CLIENTS)
    bed.storage.connection.execute(f"INSERT INTO {CLIENTS} VALUES ('c', ?, 0, NULL)", (T0,))
    bed.evict()
    assert labels(await bed.sem.holders()) == {"c": None}
    assert "label" in columns(bed.storage, CLIENTS)
    await bed.sem.handle(sync("c", [(r["grants"][0]["grantId"], 1, 0)], label="exports"))
    assert labels(await bed.sem.holders()) == {"c": "exports"}
