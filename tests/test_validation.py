"""Tier 1: message validation (SPEC R7, I5).

Every invalid message is answered with ``{"v": 1, "error": {"code": "invalid_message", "field":
..., "message": ...}}`` naming the exact field, and writes nothing: every table (``sqlite_master``
included), the alarm and the statement counter are compared before and after.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

from helpers import Bed, async_test, by_id, dump, request, sync
from semaphore.errors import InvalidMessageError, error_from_reply
from semaphore.wire import PermitRequest, SyncMessage, parse_message

BIG = 2**53


def base_request() -> dict[str, Any]:
    return request(
        "client-1",
        [("g", 2, 100), ("h", 1, 200)],
        grants=[("gr-1", 2, 1), ("gr-2", 0, 0)],
        leases=[("ls-1", 3, 1, False), ("ls-2", 2, 2, True)],
    )


def base_sync() -> dict[str, Any]:
    return sync("client-1", grants=[("gr-1", 2, 1)], leases=[("ls-1", 3, 1, False)])


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], Any]:
    def mutate(m: dict[str, Any]) -> None:
        target = m
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return mutate


def _del(path: list[Any]) -> Callable[[dict[str, Any]], Any]:
    def mutate(m: dict[str, Any]) -> None:
        target = m
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return mutate


class _Whole:
    def __init__(self, value: Any) -> None:
        self.value = value


def _replace(value: Any) -> Callable[[dict[str, Any]], Any]:
    """Replace the whole message by ``value``."""
    return lambda m: _Whole(value)


def _many(key: str, make: Callable[[int], Any]) -> Callable[[dict[str, Any]], Any]:
    return _set([key], [make(i) for i in range(1001)])


# (case id, base, mutation, expected field)
CASES: list[tuple[str, Callable[[], dict[str, Any]], Callable[[dict[str, Any]], Any], str]] = [
    # not a dict
    ("message-list", base_request, _replace([1, 2]), ""),
    ("message-str", base_request, _replace("request"), ""),
    ("message-none", base_request, _replace(None), ""),
    ("message-int", base_request, _replace(7), ""),
    # v and type
    ("v-missing", base_request, _del(["v"]), "v"),
    ("v-2", base_request, _set(["v"], 2), "v"),
    ("v-str", base_request, _set(["v"], "1"), "v"),
    ("v-bool", base_request, _set(["v"], True), "v"),
    ("type-missing", base_request, _del(["type"]), "type"),
    ("type-unknown", base_request, _set(["type"], "release"), "type"),
    ("type-int", base_request, _set(["type"], 1), "type"),
    # clientId
    ("clientId-missing", base_request, _del(["clientId"]), "clientId"),
    ("clientId-null", base_request, _set(["clientId"], None), "clientId"),
    ("clientId-int", base_request, _set(["clientId"], 42), "clientId"),
    ("clientId-empty", base_request, _set(["clientId"], ""), "clientId"),
    ("clientId-257", base_request, _set(["clientId"], "c" * 257), "clientId"),
    ("sync-clientId-empty", base_sync, _set(["clientId"], ""), "clientId"),
    # demand
    ("demand-missing", base_request, _del(["demand"]), "demand"),
    ("demand-dict", base_request, _set(["demand"], {"group": "g"}), "demand"),
    ("demand-str", base_request, _set(["demand"], "g"), "demand"),
    ("demand-entry-not-dict", base_request, _set(["demand", 1], ["h", 1, 200]), "demand[1]"),
    ("demand-entry-none", base_request, _set(["demand", 0], None), "demand[0]"),
    ("demand-group-missing", base_request, _del(["demand", 1, "group"]), "demand[1].group"),
    ("demand-group-int", base_request, _set(["demand", 0, "group"], 3), "demand[0].group"),
    ("demand-group-empty", base_request, _set(["demand", 0, "group"], ""), "demand[0].group"),
    ("demand-group-257", base_request, _set(["demand", 1, "group"], "g" * 257), "demand[1].group"),
    ("demand-group-duplicate", base_request, _set(["demand", 1, "group"], "g"), "demand[1].group"),
    ("demand-count-missing", base_request, _del(["demand", 1, "count"]), "demand[1].count"),
    ("demand-count-null", base_request, _set(["demand", 1, "count"], None), "demand[1].count"),
    ("demand-count-negative", base_request, _set(["demand", 0, "count"], -1), "demand[0].count"),
    ("demand-count-fraction", base_request, _set(["demand", 0, "count"], 1.5), "demand[0].count"),
    ("demand-count-str", base_request, _set(["demand", 0, "count"], "2"), "demand[0].count"),
    ("demand-count-bool", base_request, _set(["demand", 0, "count"], True), "demand[0].count"),
    ("demand-count-2**53", base_request, _set(["demand", 0, "count"], BIG), "demand[0].count"),
    ("demand-count-huge", base_request, _set(["demand", 0, "count"], 10**30), "demand[0].count"),
    ("demand-count-inf", base_request, _set(["demand", 0, "count"], float("inf")), "demand[0].count"),
    ("demand-count-nan", base_request, _set(["demand", 0, "count"], float("nan")), "demand[0].count"),
    ("demand-oldestAt-missing", base_request, _del(["demand", 0, "oldestAt"]), "demand[0].oldestAt"),
    ("demand-oldestAt-negative", base_request, _set(["demand", 1, "oldestAt"], -5), "demand[1].oldestAt"),
    ("demand-oldestAt-str", base_request, _set(["demand", 1, "oldestAt"], "now"), "demand[1].oldestAt"),
    ("demand-oldestAt-2**53", base_request, _set(["demand", 1, "oldestAt"], BIG), "demand[1].oldestAt"),
    ("demand-1001", base_request, _many("demand", lambda i: {"group": f"g{i}", "count": 1, "oldestAt": 0}),
     "demand"),
    # grants
    ("grants-missing", base_request, _del(["grants"]), "grants"),
    ("grants-null", base_request, _set(["grants"], None), "grants"),
    ("grants-dict", base_request, _set(["grants"], {}), "grants"),
    ("grants-entry-not-dict", base_request, _set(["grants", 1], "gr-2"), "grants[1]"),
    ("grants-id-missing", base_request, _del(["grants", 0, "grantId"]), "grants[0].grantId"),
    ("grants-id-int", base_request, _set(["grants", 0, "grantId"], 1), "grants[0].grantId"),
    ("grants-id-empty", base_request, _set(["grants", 1, "grantId"], ""), "grants[1].grantId"),
    ("grants-id-257", base_request, _set(["grants", 1, "grantId"], "x" * 257), "grants[1].grantId"),
    ("grants-id-duplicate", base_request, _set(["grants", 1, "grantId"], "gr-1"), "grants[1].grantId"),
    ("grants-claimed-missing", base_request, _del(["grants", 0, "claimed"]), "grants[0].claimed"),
    ("grants-claimed-negative", base_request, _set(["grants", 1, "claimed"], -1), "grants[1].claimed"),
    ("grants-claimed-fraction", base_request, _set(["grants", 0, "claimed"], 2.5), "grants[0].claimed"),
    ("grants-claimed-bool", base_request, _set(["grants", 0, "claimed"], False), "grants[0].claimed"),
    ("grants-claimed-2**53", base_request, _set(["grants", 0, "claimed"], BIG), "grants[0].claimed"),
    ("grants-released-missing", base_request, _del(["grants", 0, "released"]), "grants[0].released"),
    ("grants-released-negative", base_request, _set(["grants", 0, "released"], -1), "grants[0].released"),
    ("grants-released-over-claimed", base_request, _set(["grants", 0, "released"], 3), "grants[0].released"),
    ("grants-1001", base_request, _many("grants", lambda i: {"grantId": f"g{i}", "claimed": 0, "released": 0}),
     "grants"),
    ("sync-grants-missing", base_sync, _del(["grants"]), "grants"),
    ("sync-grants-released-over-claimed", base_sync, _set(["grants", 0, "released"], 9), "grants[0].released"),
    ("sync-grants-1001", base_sync, _many("grants", lambda i: {"grantId": f"g{i}", "claimed": 0, "released": 0}),
     "grants"),
    # leases
    ("leases-str", base_request, _set(["leases"], "ls-1"), "leases"),
    ("leases-dict", base_request, _set(["leases"], {"leaseId": "ls-1"}), "leases"),
    ("leases-entry-not-dict", base_request, _set(["leases", 0], 5), "leases[0]"),
    ("leases-id-missing", base_request, _del(["leases", 1, "leaseId"]), "leases[1].leaseId"),
    ("leases-id-empty", base_request, _set(["leases", 0, "leaseId"], ""), "leases[0].leaseId"),
    ("leases-id-257", base_request, _set(["leases", 0, "leaseId"], "l" * 257), "leases[0].leaseId"),
    ("leases-id-duplicate", base_request, _set(["leases", 1, "leaseId"], "ls-1"), "leases[1].leaseId"),
    ("leases-drawn-missing", base_request, _del(["leases", 0, "drawn"]), "leases[0].drawn"),
    ("leases-drawn-bool", base_request, _set(["leases", 0, "drawn"], True), "leases[0].drawn"),
    ("leases-drawn-negative", base_request, _set(["leases", 0, "drawn"], -3), "leases[0].drawn"),
    ("leases-drawn-2**53", base_request, _set(["leases", 0, "drawn"], BIG), "leases[0].drawn"),
    ("leases-released-fraction", base_request, _set(["leases", 1, "released"], 0.5), "leases[1].released"),
    ("leases-released-over-drawn", base_request, _set(["leases", 0, "released"], 4), "leases[0].released"),
    ("leases-stopped-missing", base_request, _del(["leases", 1, "stopped"]), "leases[1].stopped"),
    ("leases-stopped-int", base_request, _set(["leases", 1, "stopped"], 1), "leases[1].stopped"),
    ("leases-stopped-str", base_request, _set(["leases", 0, "stopped"], "false"), "leases[0].stopped"),
    ("leases-1001", base_request,
     _many("leases", lambda i: {"leaseId": f"l{i}", "drawn": 0, "released": 0, "stopped": False}), "leases"),
    ("sync-leases-released-over-drawn", base_sync, _set(["leases", 0, "released"], 9), "leases[0].released"),
    ("sync-leases-entry-not-dict", base_sync, _set(["leases", 0], []), "leases[0]"),
]


def build(base: Callable[[], dict[str, Any]], mutate: Callable[[dict[str, Any]], Any]) -> Any:
    message = copy.deepcopy(base())
    result = mutate(message)
    return result.value if isinstance(result, _Whole) else message


def test_bases_are_valid():
    # R7: the unmutated messages are valid, so each case fails only because of its mutation.
    assert isinstance(parse_message(base_request()), PermitRequest)
    assert isinstance(parse_message(base_sync()), SyncMessage)


async def _populated_bed() -> Bed:
    """A holder with durable state (grants, a lease, a reclaim alarm) and a round pending."""
    bed = Bed(limit=10, leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 2})
    await bed.round(request("client-1", {"g": 2}, leases=[]), request("other", {"h": 3}))
    bed.pending = bed.send(request("other", {"h": 4}))  # type: ignore[attr-defined]
    await bed.settle()
    return bed


@pytest.mark.parametrize("case,base,mutate,field", CASES, ids=[c[0] for c in CASES])
@async_test
async def test_r7_invalid_message_error_value_and_nothing_written(case, base, mutate, field):
    # R7 / I5: the reply is the invalid_message error value with the exact field path, and
    # nothing is written (every table incl. sqlite_master, the alarm, no SQL statement at all).
    bed = await _populated_bed()
    message = build(base, mutate)
    before, alarm, statements = dump(bed.storage), bed.storage.alarm, bed.storage.statements
    task = bed.send(message)
    await bed.settle()
    assert task.done(), "an invalid message must be answered at once"
    reply = task.result()
    assert set(reply) == {"v", "error"} and reply["v"] == 1
    error = reply["error"]
    assert set(error) == {"code", "field", "message"}
    assert error["code"] == "invalid_message"
    assert error["field"] == field
    assert isinstance(error["message"], str) and error["message"]
    assert dump(bed.storage) == before
    assert bed.storage.alarm == alarm
    assert bed.storage.statements == statements
    # the typed side (R7): the client turns the value into an InvalidMessageError with .field
    exc = error_from_reply(reply)
    assert isinstance(exc, InvalidMessageError) and exc.field == field and exc.code == "invalid_message"
    with pytest.raises(InvalidMessageError) as raised:
        parse_message(message)
    assert raised.value.field == field
    # the pending round is undisturbed
    [other] = await bed.finish(bed.pending)  # type: ignore[attr-defined]
    assert "error" not in other


@async_test
async def test_r7_invalid_message_on_fresh_storage_creates_no_schema():
    # R7 / I5: even the schema is not created by an invalid message.
    bed = Bed(limit=5)
    before = dump(bed.storage)
    reply = await bed.sem.handle({"type": "request", "v": 1, "clientId": "", "demand": [], "grants": []})
    assert reply["error"]["field"] == "clientId"
    assert dump(bed.storage) == before == {"sqlite_master": []}


def test_r7_limits_are_inclusive():
    # R7: 256-character ids, 1,000 entries and 2**53 - 1 are still valid.
    long_id = "x" * 256
    m = request(long_id, [(f"g{i}", 1, 2**53 - 1) for i in range(1000)],
                grants=[(f"{i}".rjust(256, "0"), 2**53 - 1, 2**53 - 1) for i in range(1000)],
                leases=[(f"l{i}", 0, 0, False) for i in range(1000)])
    parsed = parse_message(m)
    assert parsed.client_id == long_id and len(parsed.demand) == len(parsed.grants) == 1000


@async_test
async def test_r7_unknown_extra_keys_are_ignored():
    # R7: extra unknown keys (top level and in entries) are ignored (forward compatibility).
    bed = Bed(limit=10)
    [first] = await bed.round(request("a", {"g": 3}))
    gid = first["grants"][0]["grantId"]
    m = request("a", [("g", 5, 0)], grants=[(gid, 2, 1)])
    m["priority"] = "high"
    m["trace"] = {"id": 1}
    m["demand"][0]["weight"] = 7
    m["grants"][0]["note"] = None
    [r] = await bed.round(m)
    assert "error" not in r
    assert by_id(r)[gid]["claimed"] == 2 and by_id(r)[gid]["released"] == 1
    assert sorted(g["permits"] for g in r["grants"]) == [3, 4]  # need 5 - 1 unclaimed
    s = sync("a", grants=[(gid, 3, 1)])
    s["demand"] = "ignored in a sync"
    s["x"] = 1
    reply = await bed.sem.handle(s)
    assert "error" not in reply and by_id(reply)[gid]["claimed"] == 3


def test_r7_js_numbers_and_null_leases_decisions():
    # R7 (decisions): integral floats are integers (JavaScript numbers); `v: 1.0` is v1;
    # `leases: null` means absent (no lease support, R5).
    m = request("a", [("g", 2.0, 5.0)], grants=[("x", 1.0, 0.0)])
    m["v"] = 1.0
    m["leases"] = None
    parsed = parse_message(m)
    assert parsed.demand[0].count == 2 and isinstance(parsed.demand[0].count, int)
    assert parsed.leases is None


@async_test
async def test_r7_typed_messages_accepted():
    # R7 (Python API): typed PermitRequest/SyncMessage objects are accepted by handle().
    bed = Bed(limit=5)
    typed = parse_message(request("a", {"g": 2}))
    [r] = await bed.round(typed)
    assert [g["permits"] for g in r["grants"]] == [2]
    s = await bed.sem.handle(parse_message(sync("a")))
    assert len(s["grants"]) == 1
