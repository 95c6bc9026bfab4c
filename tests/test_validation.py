"""Tier 1: message validation (SPEC R7, I5).

Every invalid message is answered with ``{"v": 1, "error": {"code": "invalid_message", "field":
..., "message": ...}}`` naming the exact field, and writes nothing: every table (``sqlite_master``
included), the alarm and the statement counter are compared before and after.

Hostile ids and shapes (fault 8): the id alphabet of ``semaphore.wire`` (no control characters,
NUL included, no surrogate code points, 1-256 characters) applies to every id field; a NUL cut by
SQLite's JSON functions must not let one client's grant be stored as another's or a group escape
its limit; a lone surrogate must not fail the round of every other client; nesting of any depth
(in unknown keys, known fields, or as the whole message) and integers of thousands of digits get
an error value (or are ignored, for unknown keys), never an exception. The randomised version of
these checks is ``test_protocol_fuzz.py``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from semaphore.core.wire import PermitRequest, SyncMessage, parse_message
from semaphore.errors import InvalidMessageError, error_from_reply
from semaphore.testing import Bed, async_test, by_id, dump, request, sync

BIG = 2**53
HUGE = 10**5000  # str() of it raises ValueError (more than 4,300 digits)


def deep_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def deep_mixed(depth: int) -> dict[str, Any]:
    """``depth`` levels of dicts, each holding a list holding the next dict (2 * depth levels)."""
    root: dict[str, Any] = {}
    node = root
    for _ in range(depth):
        child: dict[str, Any] = {}
        node["k"] = [child, 1, "x"]
        node = child
    return root


DEEP_LIST = deep_list(100_000)
DEEP_DICT = deep_mixed(500)


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
    # Hostile ids (fault 8): control characters (NUL, C0, DEL, C1) and surrogate code points are
    # refused in every id field. "client-1\x00x" would be cut to "client-1" by SQLite's JSON
    # functions; a lone surrogate cannot be bound to SQL at all.
    ("clientId-nul", base_request, _set(["clientId"], "client-1\x00x"), "clientId"),
    ("clientId-nul-only", base_request, _set(["clientId"], "\x00"), "clientId"),
    ("clientId-newline", base_request, _set(["clientId"], "a\nb"), "clientId"),
    ("clientId-tab", base_request, _set(["clientId"], "\ta"), "clientId"),
    ("clientId-unit-separator", base_request, _set(["clientId"], "a\x1f"), "clientId"),
    ("clientId-del", base_request, _set(["clientId"], "a\x7f"), "clientId"),
    ("clientId-c1-nel", base_request, _set(["clientId"], "a\x85"), "clientId"),
    ("clientId-c1-last", base_request, _set(["clientId"], "\x9fa"), "clientId"),
    ("clientId-lone-high-surrogate", base_request, _set(["clientId"], "c\ud800"), "clientId"),
    ("clientId-lone-low-surrogate", base_request, _set(["clientId"], "\udfffc"), "clientId"),
    ("clientId-split-surrogate-pair", base_request, _set(["clientId"], "\ud83d\ude00"), "clientId"),
    ("clientId-257-astral", base_request, _set(["clientId"], "\U0001f600" * 257), "clientId"),
    ("clientId-deep-dict", base_request, _set(["clientId"], DEEP_DICT), "clientId"),
    ("sync-clientId-nul", base_sync, _set(["clientId"], "client-1\x00"), "clientId"),
    ("sync-clientId-surrogate", base_sync, _set(["clientId"], "\udbff"), "clientId"),
    ("demand-group-nul", base_request, _set(["demand", 1, "group"], "g\x00x"), "demand[1].group"),
    ("demand-group-surrogate", base_request, _set(["demand", 0, "group"], "\ud800"), "demand[0].group"),
    ("demand-group-c1", base_request, _set(["demand", 0, "group"], "g\x80"), "demand[0].group"),
    ("grants-id-nul", base_request, _set(["grants", 1, "grantId"], "gr-1\x00"), "grants[1].grantId"),
    ("grants-id-surrogate", base_request, _set(["grants", 0, "grantId"], "gr\udc00"), "grants[0].grantId"),
    ("leases-id-nul", base_request, _set(["leases", 1, "leaseId"], "ls-1\x00"), "leases[1].leaseId"),
    ("leases-id-surrogate", base_request, _set(["leases", 0, "leaseId"], "\ud8ff"), "leases[0].leaseId"),
    ("sync-grants-id-surrogate", base_sync, _set(["grants", 0, "grantId"], "\ud800x"), "grants[0].grantId"),
    ("sync-leases-id-nul", base_sync, _set(["leases", 0, "leaseId"], "\x00ls-1"), "leases[0].leaseId"),
    # label (R38 decision): optional; when present a string of 1 to 200 characters in the id
    # alphabet (no control characters, no surrogates), on requests and syncs alike.
    ("label-int", base_request, _set(["label"], 7), "label"),
    ("label-bool", base_request, _set(["label"], True), "label"),
    ("label-list", base_request, _set(["label"], ["exports"]), "label"),
    ("label-empty", base_request, _set(["label"], ""), "label"),
    ("label-201", base_request, _set(["label"], "l" * 201), "label"),
    ("label-long-str", base_request, _set(["label"], "l" * 1_000_000), "label"),
    ("label-nul", base_request, _set(["label"], "exports\x00eu"), "label"),
    ("label-newline", base_request, _set(["label"], "a\nb"), "label"),
    ("label-surrogate", base_request, _set(["label"], "x\ud800"), "label"),
    ("label-deep", base_request, _set(["label"], DEEP_DICT), "label"),
    ("sync-label-201", base_sync, _set(["label"], "\U0001f600" * 201), "label"),
    ("sync-label-int", base_sync, _set(["label"], 0), "label"),
    # Integers of thousands of digits (str() of them raises) and hostile shapes in known fields.
    ("v-huge", base_request, _set(["v"], HUGE), "v"),
    ("v-deep", base_request, _set(["v"], DEEP_DICT), "v"),
    ("type-deep", base_request, _set(["type"], DEEP_LIST), "type"),
    ("type-long-str", base_request, _set(["type"], "r" * 1_000_000), "type"),
    ("demand-count-huge-digits", base_request, _set(["demand", 0, "count"], HUGE), "demand[0].count"),
    ("demand-count-huge-negative", base_request, _set(["demand", 1, "count"], -HUGE), "demand[1].count"),
    ("demand-oldestAt-huge-digits", base_request, _set(["demand", 0, "oldestAt"], HUGE), "demand[0].oldestAt"),
    ("demand-deep-list", base_request, _set(["demand"], DEEP_LIST), "demand[0]"),
    ("demand-entry-deep", base_request, _set(["demand", 0], DEEP_LIST), "demand[0]"),
    ("grants-claimed-huge-digits", base_request, _set(["grants", 0, "claimed"], HUGE), "grants[0].claimed"),
    ("grants-released-huge-negative", base_request, _set(["grants", 1, "released"], -HUGE),
     "grants[1].released"),
    ("grants-deep-dict", base_request, _set(["grants"], DEEP_DICT), "grants"),
    ("leases-drawn-huge-digits", base_request, _set(["leases", 0, "drawn"], HUGE), "leases[0].drawn"),
    ("leases-stopped-deep", base_request, _set(["leases", 0, "stopped"], DEEP_LIST), "leases[0].stopped"),
    ("message-deep-list", base_request, _replace(DEEP_LIST), ""),
    ("message-deep-list-500", base_request, _replace(deep_list(500)), ""),
    ("message-huge-int", base_request, _replace(HUGE), ""),
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
    if isinstance(message, str):  # taken as JSON text (R7 "JSON text"): answered as text
        assert isinstance(reply, str)
        reply = json.loads(reply)
    assert set(reply) == {"v", "error"} and reply["v"] == 1
    error = reply["error"]
    assert set(error) == {"code", "field", "message"}
    assert error["code"] == "invalid_message"
    assert error["field"] == field
    assert isinstance(error["message"], str) and error["message"]
    assert error["message"].isascii() and len(error["message"]) < 200  # never a repr of the input
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


# --------------------------------------------------------------------------- hostile ids (fault 8)


async def _twin_rounds(rounds: list[list[Any]], hostile: dict[int, list[Any]], **options: Any
                       ) -> tuple[list[list[dict[str, Any]]], list[list[dict[str, Any]]], Bed, Bed]:
    """Run the same valid rounds on two beds; the second also gets ``hostile[i]`` in round i.
    Both end with the same tables. Returns (valid replies without the hostile messages, valid
    replies with them, the hostile messages' replies per round, the bed that got them)."""
    plain_bed, hostile_bed = Bed(**options), Bed(**options)
    clean, dirty, bad = [], [], []
    for i, messages in enumerate(rounds):
        clean.append(await plain_bed.round(*messages))
        extra = hostile.get(i, [])
        replies = await hostile_bed.round(*extra, *messages)
        bad.append(replies[:len(extra)])
        dirty.append(replies[len(extra):])
    assert dump(hostile_bed.storage) == dump(plain_bed.storage)
    hostile_bed.check()
    return clean, dirty, bad, hostile_bed  # type: ignore[return-value]


def _assert_invalid(reply: dict[str, Any], field: str) -> None:
    assert "error" in reply, f"expected invalid_message on {field}, got {reply}"
    assert reply["error"]["code"] == "invalid_message" and reply["error"]["field"] == field, reply


@async_test
async def test_r7_nul_client_id_cannot_take_or_see_another_clients_grants():
    # R7 (fault 8): "a\x00evil" used to pass validation and be cut to "a" by SQLite's JSON
    # functions: its grant was stored as a's (a's reply listed it, a's need shrank). Now it is an
    # invalid id, and a's replies are exactly those of a world without the hostile message.
    rounds = [[request("a", {"g": 2})], [request("a", {"g": 3})]]
    hostile = {0: [request("a\x00evil", {"g": 4})], 1: [request("a\x00", {"g": 1}), sync("a\x00x")]}
    clean, dirty, bad, bed = await _twin_rounds(rounds, hostile, limit=10)
    assert dirty == clean
    for replies in bad:
        for reply in replies:
            _assert_invalid(reply, "clientId")
    assert {r["client_id"] for r in bed.grants().values()} == {"a"}


@async_test
async def test_r7_nul_group_cannot_escape_its_group_limit():
    # R7 / I1 (fault 8): "bulk\x00x" used to be allocated as a group without a limit and then be
    # stored (cut at the NUL) as "bulk", charging bulk past its limit of 1.
    bed = Bed(limit=10, group_limit={"bulk": 1})
    [first] = await bed.round(request("x", {"bulk": 1}))
    assert [g["permits"] for g in first["grants"]] == [1]
    [other, reply] = await bed.round(request("x", {"bulk": 1}), request("y", [("bulk\x00x", 5, 0)]))
    _assert_invalid(reply, "demand[0].group")
    assert "error" not in other
    usage = await bed.usage()
    assert set(usage["groups"]) == {"bulk"} and usage["groups"]["bulk"]["outstanding"] == 1
    assert usage["outstanding"] == 1
    assert {(r["client_id"], r["group_name"]) for r in bed.grants().values()} == {("x", "bulk")}
    bed.check()


@async_test
async def test_r7_lone_surrogate_in_any_id_does_not_fail_the_round_of_others():
    # R7 / R2 (fault 8): a lone surrogate used to pass validation and fail the SQL binding, so
    # the whole round (every client in it) was answered round_failed. Now only the hostile
    # message is refused, with its field; the others are served as if it had never been sent.
    options = dict(limit=10, leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 2})
    # Ids are deterministic (id1, id2, ...): a scratch bed tells which ids round 0 hands b.
    [seed] = await Bed(**options).round(request("b", {"h": 2}, leases=[]))
    gid = seed["grants"][0]["grantId"] if seed["grants"] else None
    lid = seed["leases"][0]["leaseId"] if seed["leases"] else None
    grants_b = [(gid, 1, 0)] if gid else []
    leases_b = [(lid, 1, 0, False)] if lid else []
    rounds = [[request("b", {"h": 2}, leases=[])],
              [request("a", {"g": 3}), request("b", {"h": 3}, grants=grants_b, leases=leases_b)]]
    surrogate = "\ud800"
    hostile = {1: [
        request("c" + surrogate, {"g": 1}),
        request("d", [(surrogate, 1, 0)]),
        request("e", {"g": 1}, grants=[("gr" + surrogate, 0, 0)]),
        request("f", {"g": 1}, leases=[(surrogate + "ls", 0, 0, False)]),
        sync("b", grants=[(surrogate, 0, 0)]),
    ]}
    clean, dirty, bad, _ = await _twin_rounds(rounds, hostile, **options)
    assert all("error" not in r for rs in clean for r in rs)
    assert dirty == clean
    fields = ["clientId", "demand[0].group", "grants[0].grantId", "leases[0].leaseId", "grants[0].grantId"]
    for reply, field in zip(bad[1], fields):
        _assert_invalid(reply, field)


@async_test
async def test_r7_deep_unknown_keys_are_ignored_without_recursion():
    # R7 (fault 8): unknown keys are ignored, so they must not be walked either: 500 levels of
    # dicts and lists (and 100,000 levels of lists) used to make handle() raise RecursionError
    # while copying the message. The reply equals that of the same message without them.
    clean_bed, deep_bed = Bed(limit=10), Bed(limit=10)
    [c0] = await clean_bed.round(request("a", {"g": 2}))
    m = request("a", {"g": 2})
    m["trace"] = DEEP_DICT
    m["more"] = DEEP_LIST
    [d0] = await deep_bed.round(m)
    assert d0 == c0
    gid = c0["grants"][0]["grantId"]
    m = request("a", {"g": 3}, grants=[(gid, 1, 0)])
    m["demand"][0]["meta"] = DEEP_DICT
    m["grants"][0]["meta"] = DEEP_LIST
    [d1] = await deep_bed.round(m)
    [c1] = await clean_bed.round(request("a", {"g": 3}, grants=[(gid, 1, 0)]))
    assert d1 == c1
    s = sync("a", grants=[(gid, 2, 1)])
    s["x"] = deep_mixed(5000)
    assert await deep_bed.sem.handle(s) == await clean_bed.sem.handle(sync("a", grants=[(gid, 2, 1)]))
    assert dump(deep_bed.storage) == dump(clean_bed.storage)


@async_test
async def test_r7_deeply_nested_non_dict_message_is_an_error_value():
    # R7 (fault 8): a message that is a list nested 100,000 (or 500) levels deep is answered
    # with the error value for the whole message (field ""), not a RecursionError.
    bed = Bed(limit=5)
    for message in (DEEP_LIST, deep_list(500), [DEEP_DICT]):
        reply = await bed.sem.handle(message)
        _assert_invalid(reply, "")
    assert dump(bed.storage) == {"sqlite_master": []}


@pytest.mark.parametrize("ident", [
    "x" * 256,
    "\U0001f600" * 256,                      # 256 code points (512 UTF-16 units, 1 KB UTF-8)
    "tenant one/wf:2",
    "quote\" back\\slash 'single'",
    '{"json": [1, 2]}',
    "\u00e9",                                 # NFC e-acute ...
    "e\u0301",                                # ... and NFD: two different ids
    "line\u2028separator",
    "\ufeffbom",
    "nbsp\u00a0zwsp\u200b",
    "\uffff\ufffe",                           # noncharacters are valid Unicode scalars
    "\u00a0",                                 # first code point after C1
    "\U0010ffff",
], ids=lambda s: ascii(s)[:30])
@async_test
async def test_r7_id_alphabet_allowed_ids_round_trip_exactly(ident):
    # R7 (decision, wire docstring): any Unicode except control characters and surrogates, 1-256
    # code points, compared exactly. Such ids reach storage, replies and usage unchanged.
    from semaphore.core.wire import check_id, id_problem

    assert id_problem(ident) is None and check_id(ident, "clientId") == ident
    bed = Bed(limit=10, group_limit={ident: 2}, leases={"provisioning": {"mode": "strict"}, "permitsPerLease": 2})
    [reply] = await bed.round(request(ident, [(ident, 5, 0)], leases=[]))
    assert "error" not in reply
    assert {g["group"] for g in reply["grants"]} | {x["group"] for x in reply["leases"]} == {ident}
    rows = list(bed.grants().values()) + list(bed.leases().values())
    assert rows and all(r["client_id"] == ident and r["group_name"] == ident for r in rows)
    usage = await bed.usage()
    assert list(usage["groups"]) == [ident] and usage["groups"][ident]["limit"] == 2
    assert usage["outstanding"] + usage["leaseFootprint"] == 2  # the group limit held (I1)
    gid = reply["grants"][0]["grantId"] if reply["grants"] else None
    if gid:
        s = await bed.sem.handle(sync(ident, grants=[(gid, 1, 0)]))
        assert by_id(s)[gid]["claimed"] == 1
    bed.check()


def test_r7_id_alphabet_forbidden_characters():
    # R7 (decision): every control character (C0 incl. NUL, DEL, C1) and every surrogate code
    # point is refused, wherever it is; the error names the field and the code point.
    from semaphore.core.wire import check_id, id_problem
    from semaphore.errors import InvalidMessageError as Invalid

    forbidden = [chr(c) for c in range(0x20)] + [chr(c) for c in range(0x7f, 0xa0)]
    forbidden += ["\ud800", "\udbff", "\udc00", "\udfff", "\ud83d"]
    for char in forbidden:
        for ident in (char, "a" + char, char + "b", "x" * 128 + char + "y" * 127):
            problem = id_problem(ident)
            assert problem is not None and f"U+{ord(char):04X}" in problem, (ascii(ident), problem)
            with pytest.raises(Invalid) as raised:
                check_id(ident, "demand[3].group")
            assert raised.value.field == "demand[3].group"
    assert id_problem(" ") is None and id_problem("\x20\x7e\xa0") is None
    for value in ("", "x" * 257, None, 7, True, 1.5, ["a"], {"a": 1}, b"a"):
        assert id_problem(value) is not None


def test_r7_js_proxies_are_read_one_level_at_a_time():
    # R7 (fault 8): a message handed over as JavaScript proxies (not converted by the SDK) is
    # converted one level per field read (to_py(depth=1)): an unknown key is never converted,
    # a proxy that cannot be read fails its field, and JS null counts as a missing value.
    converted: list[str] = []

    class Proxy:
        def __init__(self, value: Any, name: str) -> None:
            self.value, self.name = value, name

        def to_py(self, depth: int = -1) -> Any:
            if depth != 1:
                raise AssertionError(f"{self.name}: converted deeply (depth={depth})")
            converted.append(self.name)
            if isinstance(self.value, dict):
                return {k: Proxy(v, f"{self.name}.{k}") if isinstance(v, (dict, list)) else v
                        for k, v in self.value.items()}
            return [Proxy(v, f"{self.name}[{i}]") if isinstance(v, (dict, list)) else v
                    for i, v in enumerate(self.value)]

    class Broken:
        def to_py(self, depth: int = -1) -> Any:
            raise RuntimeError("getter threw")

    class JsNull:
        pass

    m = request("a", {"g": 2}, grants=[("gr", 1, 0)], leases=[])
    m["unknown"] = {"deep": [{"x": 1}]}
    parsed = parse_message(Proxy(m, "m"))
    assert isinstance(parsed, PermitRequest) and parsed.demand[0].group == "g"
    assert parsed.grants[0].grant_id == "gr" and parsed.leases == ()
    assert not any(name.startswith("m.unknown") for name in converted)
    bad = request("a", {"g": 2})
    bad["demand"][0]["count"] = Broken()
    with pytest.raises(InvalidMessageError) as raised:
        parse_message(bad)
    assert raised.value.field == "demand[0].count"
    bad = request("a", {"g": 2})
    bad["clientId"] = JsNull()
    with pytest.raises(InvalidMessageError) as raised:
        parse_message(bad)
    assert raised.value.field == "clientId" and "required" in raised.value.reason
    with pytest.raises(InvalidMessageError) as raised:
        parse_message(Broken())
    assert raised.value.field == ""
