"""Tier 1: a protocol-input fuzzer for the holder (SPEC R7, I1-I5; fault 8: hostile ids and shapes).

Hypothesis generates hostile values (nesting thousands of levels deep, NUL and other control
characters, lone surrogates, integers far beyond 2**53 or of thousands of digits, negative
numbers, NaN/infinite/fractional floats, booleans where integers are expected and integers where
booleans are, wrong types everywhere, lists of more than 1,000 entries, ids over 256 characters)
and puts them into otherwise valid messages, one mutation each, so the field the error must name
is known exactly. Three properties:

* ``test_parse_message_*``: :func:`semaphore.wire.parse_message` on any input returns a typed
  message or raises :class:`InvalidMessageError` (never another exception), names the expected
  field, and describes the input in a short ASCII message; deep unknown keys change nothing.
* ``test_hostile_messages_interleaved_with_valid_traffic``: several clients (some with exotic but
  valid ids and groups, some with lease support) run rounds, syncs and a final drain against the
  real holder on the SQLite test bed, twice: once alone, once with hostile messages (many from
  the very clients in the round) and deep unknown keys interleaved. After every hostile message:
  the reply is ``{"v": 1, "error": {"code": "invalid_message", "field": <the mutated field>,
  "message": ...}}``, every table, the alarm and the SQL statement counter are unchanged (I5).
  After every round: the valid replies, tables and alarm equal those of the run without hostile
  messages (no message affects another client's answer), the aggregates equal a full
  recomputation (``check_aggregates``), nothing exceeds the limit or a group limit (I1), every
  stored owner and group is an id some valid client sent, byte for byte. At the end everything is
  released and charged capacity returns to zero (I3).

Examples: ``PROTOCOL_FUZZ_EXAMPLES`` (default 40 for the holder test, 10x that for the parser
tests); derandomized like the other property tests, so a run is reproducible.
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from semaphore.core.wire import MAX_INT, PermitRequest, SyncMessage, parse_message
from semaphore.errors import InvalidMessageError
from semaphore.testing import Bed, check_aggregates, dump, run

EXAMPLES = int(os.environ.get("PROTOCOL_FUZZ_EXAMPLES", "40"))
COMMON = dict(deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much, HealthCheck.large_base_example])
HOLDER_SETTINGS = settings(max_examples=EXAMPLES, **COMMON)
PARSER_SETTINGS = settings(max_examples=EXAMPLES * 10, **COMMON)

LIMIT = 16
GROUP_LIMITS = {"bulk": 2, "\u00e9": 1}
# Valid ids that are easy to get wrong: the longest allowed, astral characters, NFC and NFD
# spellings of one letter, a group that is a prefix of a limited group, JSON-looking text.
CLIENTS = ("c0", "\U0001f600 client", "k" * 256, "bulk", '{"id":1}', "tab\u00a0nbsp")
GROUPS = ("g", "bulk", "bulk x", "\u00e9", "e\u0301", "\U0001f600" * 3, "\u2028")
LEASE_CAPABLE = {"c0", "bulk", "k" * 256}
LEASES = {"provisioning": {"mode": "strict"}, "permitsPerLease": 2, "ttlMs": 60_000}


# ----------------------------------------------------------------------------- hostile values


def deep_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def deep_dict(depth: int) -> dict[str, Any]:
    """``depth`` dicts, each holding a list holding the next (2 * depth levels)."""
    root: dict[str, Any] = {}
    node = root
    for _ in range(depth):
        child: dict[str, Any] = {}
        node["k"] = [child]
        node = child
    return root


_FORBIDDEN = [chr(c) for c in range(0x20)] + [chr(c) for c in range(0x7F, 0xA0)]

deep = st.one_of(st.integers(1, 3000).map(deep_list), st.integers(1, 1500).map(deep_dict))


class Huge:
    """An integer of thousands of digits (``str()`` of it raises ValueError), drawn as this
    placeholder and made real by :func:`real` only when the message is built: Hypothesis reuses
    integers it generated as later integer choices, and then cannot print them (more than 4,300
    digits) while shrinking a failure."""

    def __init__(self, digits: int, negative: bool) -> None:
        self.digits, self.negative = digits, negative

    def __repr__(self) -> str:
        return f"{'-' if self.negative else ''}10**{self.digits}"

    def value(self) -> int:
        return -(10**self.digits) - 7 if self.negative else 10**self.digits + 1


def real(value: Any) -> Any:
    """A drawn hostile value with :class:`Huge` placeholders (top level or in a dict) made real."""
    if isinstance(value, Huge):
        return value.value()
    if isinstance(value, dict):
        return {k: real(v) for k, v in value.items()}
    return value


huge_ints = st.one_of(
    st.integers(MAX_INT + 1, 2**80),
    st.integers(-(2**80), -1),
    st.builds(Huge, st.integers(4301, 6000), st.booleans()),
    st.sampled_from([2**53, 2**63, 2**64, -(2**63), -1]),
)
bad_floats = st.floats(allow_nan=True, allow_infinity=True).filter(
    lambda f: not (math.isfinite(f) and f.is_integer() and 0 <= f <= MAX_INT))
json_like = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4)),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=8,
)
shapes = st.one_of(deep, st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), json_like,
                                                                             max_size=3))
valid_id_text = st.text(st.characters(exclude_categories=("Cc", "Cs")), min_size=1, max_size=12)
surrogates = st.integers(0xD800, 0xDFFF).map(chr)


@st.composite
def poisoned_ids(draw: Any) -> str:
    """A valid id with one control character or lone surrogate inserted somewhere."""
    base = draw(valid_id_text)
    bad = draw(st.one_of(st.sampled_from(_FORBIDDEN), surrogates))
    at = draw(st.integers(0, len(base)))
    return (base[:at] + bad + base[at:])[:256]


hostile_ids = st.one_of(
    poisoned_ids(),
    st.just(""),
    st.integers(257, 2000).map(lambda n: "x" * n),
    st.integers(257, 300).map(lambda n: "\U0001f600" * n),
    st.integers(), st.floats(), st.booleans(), st.none(), shapes,
)
hostile_counts = st.one_of(huge_ints, bad_floats, st.booleans(), st.text(max_size=5), st.none(), shapes)
hostile_bools = st.one_of(st.integers(), st.floats(), st.text(max_size=5), st.none(), shapes)
hostile_versions = st.one_of(
    st.integers().filter(lambda v: v != 1), st.floats().filter(lambda v: v != 1.0), huge_ints,
    st.booleans(), st.text(max_size=5), st.none(), shapes,
)
hostile_types = st.one_of(
    st.text(max_size=10).filter(lambda t: t not in ("request", "sync")),
    st.sampled_from(["Request", "sync\x00", "request ", "\ud800"]),
    st.integers(), st.booleans(), st.none(), shapes,
)


def hostile_lists(key: str) -> Any:
    """Not a list of at most 1,000 entries (``None`` is "absent" for ``leases``: valid)."""
    entry = {"demand": {"group": "g", "count": 1, "oldestAt": 0},
             "grants": {"grantId": "x", "claimed": 0, "released": 0},
             "leases": {"leaseId": "x", "drawn": 0, "released": 0, "stopped": False}}[key]
    too_long = st.integers(1001, 1200).map(
        lambda n: [{**entry, ("group" if key == "demand" else "grantId" if key == "grants" else "leaseId"): f"i{i}"}
                   for i in range(n)])
    options = [too_long, st.text(max_size=5), st.integers(), st.floats(), st.booleans(), deep_dict_strategy]
    if key != "leases":
        options.append(st.none())
    return st.one_of(*options)


deep_dict_strategy = st.one_of(st.integers(1, 1500).map(deep_dict),
                               st.dictionaries(st.text(max_size=3), json_like, max_size=3))
hostile_entries = st.one_of(st.integers(), st.text(max_size=5), st.none(), st.booleans(),
                            st.lists(json_like, max_size=3), st.integers(1, 3000).map(deep_list))

ID_KEYS = {"demand": "group", "grants": "grantId", "leases": "leaseId"}
COUNT_KEYS = {"demand": ("count", "oldestAt"), "grants": ("claimed", "released"), "leases": ("drawn", "released")}


def field_name(path: tuple[Any, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


@st.composite
def mutations(draw: Any, message: dict[str, Any]) -> tuple[Any, str]:
    """One hostile change to a copy of the valid ``message``: ``(hostile message, field)``."""
    m = copy.deepcopy(message)
    lists = [k for k in ("demand", "grants", "leases") if isinstance(m.get(k), list)]
    entries = [(k, i) for k in lists for i in range(len(m[k]))]
    kinds = ["v", "type", "clientId", "list", "delete", "whole"]
    if entries:
        kinds += ["entry", "id", "count", "order", "duplicate"]
        kinds += ["stopped"] if any(key == "leases" for key, _ in entries) else []
    kind = draw(st.sampled_from(kinds))
    if kind == "whole":
        return draw(st.one_of(hostile_entries, st.just("request"))), ""  # not an object
    if kind in ("v", "type", "clientId"):
        m[kind] = real(draw({"v": hostile_versions, "type": hostile_types, "clientId": hostile_ids}[kind]))
        return m, kind
    if kind == "list":
        key = draw(st.sampled_from(["grants", "leases"] + (["demand"] if m["type"] == "request" else [])))
        m[key] = draw(hostile_lists(key))
        return m, key
    if kind == "delete":
        paths: list[tuple[Any, ...]] = [("v",), ("type",), ("clientId",), ("grants",)]
        paths += [("demand",)] if m["type"] == "request" else []
        for key, i in entries:
            paths += [(key, i, f) for f in m[key][i]]  # every entry key is required
        path = draw(st.sampled_from(paths))
        target = m
        for part in path[:-1]:
            target = target[part]
        del target[path[-1]]
        return m, field_name(path)
    key, i = draw(st.sampled_from(entries if kind != "stopped" else [e for e in entries if e[0] == "leases"]))
    entry = m[key][i]
    if kind == "entry":
        m[key][i] = draw(hostile_entries)
        return m, field_name((key, i))
    if kind == "id":
        entry[ID_KEYS[key]] = draw(hostile_ids)
        return m, field_name((key, i, ID_KEYS[key]))
    if kind == "count":
        name = draw(st.sampled_from(COUNT_KEYS[key]))
        entry[name] = real(draw(hostile_counts))
        return m, field_name((key, i, name))
    if kind == "stopped":
        entry["stopped"] = draw(hostile_bools)
        return m, field_name((key, i, "stopped"))
    if kind == "order" and key != "demand":
        high = COUNT_KEYS[key][0]
        if entry[high] < MAX_INT:  # released > claimed (or drawn)
            entry["released"] = draw(st.integers(entry[high] + 1, MAX_INT))
            return m, field_name((key, i, "released"))
    if kind == "duplicate" and i > 0:
        entry[ID_KEYS[key]] = m[key][draw(st.integers(0, i - 1))][ID_KEYS[key]]
        return m, field_name((key, i, ID_KEYS[key]))
    m[key][i] = None  # fallback for the combinations above that do not apply: a null entry
    return m, field_name((key, i))


def with_deep_extras(message: dict[str, Any], depth: int) -> dict[str, Any]:
    """The same message with unknown keys nested ``depth`` levels deep (valid: R7 ignores them)."""
    m = copy.deepcopy(message)
    m["x-trace"] = deep_dict(depth)
    for key in ("demand", "grants", "leases"):
        for entry in m.get(key) or ():
            entry["x-meta"] = deep_list(depth)
    return m


# ----------------------------------------------------------------------------- valid messages

valid_demand = st.dictionaries(st.sampled_from(GROUPS), st.integers(0, 4), max_size=3)
valid_reports = st.lists(
    st.tuples(valid_id_text, st.integers(0, MAX_INT), st.integers(0, MAX_INT)).map(
        lambda t: {"grantId": t[0], "claimed": max(t[1], t[2]), "released": min(t[1], t[2])}),
    max_size=3, unique_by=lambda g: g["grantId"])
valid_lease_reports = st.lists(
    st.tuples(valid_id_text, st.integers(0, 50), st.integers(0, 50), st.booleans()).map(
        lambda t: {"leaseId": t[0], "drawn": max(t[1], t[2]), "released": min(t[1], t[2]), "stopped": t[3]}),
    max_size=3, unique_by=lambda x: x["leaseId"])


@st.composite
def valid_messages(draw: Any) -> dict[str, Any]:
    kind = draw(st.sampled_from(["request", "sync"]))
    m: dict[str, Any] = {"type": kind, "v": draw(st.sampled_from([1, 1.0])),
                         "clientId": draw(st.one_of(valid_id_text, st.sampled_from(CLIENTS))),
                         "grants": draw(valid_reports)}
    if kind == "request":
        m["demand"] = [{"group": g, "count": c, "oldestAt": draw(st.integers(0, MAX_INT))}
                       for g, c in draw(valid_demand).items()]
    if draw(st.booleans()):
        m["leases"] = draw(valid_lease_reports)
    return m


# ----------------------------------------------------------------------------- parser properties


def _check_error(exc: InvalidMessageError, field: str | None = None) -> None:
    assert isinstance(exc.field, str)
    if field is not None:
        assert exc.field == field, (exc.field, field, exc.message)
    wire = exc.to_wire()
    assert wire["v"] == 1 and wire["error"]["code"] == "invalid_message" and wire["error"]["field"] == exc.field
    assert wire["error"]["message"].isascii() and len(wire["error"]["message"]) < 200


@PARSER_SETTINGS
@given(st.data())
def test_parse_message_hostile_mutation_names_its_field(data):
    # R7: one hostile change to a valid message is refused, naming exactly the changed field.
    message = data.draw(valid_messages())
    assert isinstance(parse_message(message), (PermitRequest, SyncMessage))
    hostile, field = data.draw(mutations(message))
    try:
        parse_message(hostile)
    except InvalidMessageError as exc:
        _check_error(exc, field)
    else:
        raise AssertionError(f"accepted a hostile message (expected an error on {field!r})")


@PARSER_SETTINGS
@given(st.one_of(json_like, deep, hostile_ids, hostile_counts,
                 st.dictionaries(st.sampled_from(["v", "type", "clientId", "demand", "grants", "leases", "x"]),
                                 st.one_of(json_like, hostile_ids, hostile_counts), max_size=6)))
def test_parse_message_garbage_never_raises_anything_else(garbage):
    # R7: whatever arrives, the answer is a typed message or InvalidMessageError, nothing else.
    try:
        parse_message(real(garbage))
    except InvalidMessageError as exc:
        _check_error(exc)


@PARSER_SETTINGS
@given(valid_messages(), st.integers(1, 3000))
def test_parse_message_deep_unknown_keys_change_nothing(message, depth):
    # R7: unknown keys, however deep, are ignored (and never walked).
    assert parse_message(with_deep_extras(message, depth)) == parse_message(message)


# ----------------------------------------------------------------------------- holder property


class _Client:
    """An honest client: remembers the grants and leases its last reply listed."""

    def __init__(self, cid: str) -> None:
        self.cid = cid
        self.grants: dict[str, int] = {}
        self.leases: dict[str, int] = {}

    def learn(self, reply: dict[str, Any]) -> None:
        assert "error" not in reply, reply
        self.grants = {g["grantId"]: g["permits"] for g in reply["grants"] if g["status"] != "not_found"}
        self.leases = {x["leaseId"]: x["permits"] for x in reply["leases"] if x["status"] != "settled"}

    def message(self, kind: str, demand: dict[str, int], progress: int, now: int) -> dict[str, Any]:
        """progress 0: nothing claimed yet; 1: everything claimed/drawn; 2: all released too."""
        grants = [{"grantId": gid, "claimed": p if progress else 0, "released": p if progress == 2 else 0}
                  for gid, p in sorted(self.grants.items())]
        m: dict[str, Any] = {"type": kind, "v": 1, "clientId": self.cid, "grants": grants}
        if kind == "request":
            m["demand"] = [{"group": g, "count": c, "oldestAt": now} for g, c in sorted(demand.items())]
        if self.cid in LEASE_CAPABLE:
            m["leases"] = [{"leaseId": lid, "drawn": p if progress else 0, "released": p if progress == 2 else 0,
                            "stopped": progress == 2} for lid, p in sorted(self.leases.items())]
        return m


def _new_bed() -> Bed:
    return Bed(limit=LIMIT, group_limit=dict(GROUP_LIMITS), leases=dict(LEASES), round_wait_ms=100,
               round_period_ms=200, grant_timeout_ms=5_000)


def _assert_invariants(bed: Bed) -> None:
    agg = bed.check()  # aggregates == full recomputation, rows consistent
    charged = agg["total"]["outstanding"] + agg["total"]["lease_footprint"]
    assert charged <= LIMIT, f"I1: charged {charged} > limit {LIMIT}"
    for group, a in agg["groups"].items():
        assert group in GROUPS, f"stored group {group!r} is not one a client sent"
        if group in GROUP_LIMITS:
            assert a["outstanding"] + a["lease_footprint"] <= GROUP_LIMITS[group], f"I1: group {group!r}"
    for row in list(bed.grants().values()) + list(bed.leases().values()):
        assert row["client_id"] in CLIENTS, f"stored owner {row['client_id']!r} is not a client's id"


async def _hostile_send(bed: Bed, message: Any, field: str) -> None:
    """Send one hostile message: answered at once with the error value naming ``field``, and
    nothing written (tables, alarm, not one SQL statement; I5)."""
    before, alarm, statements = dump(bed.storage), bed.storage.alarm, bed.storage.statements
    task = bed.send(message)
    await bed.settle()
    assert task.done(), "an invalid message must be answered at once"
    reply = task.result()
    if isinstance(message, str):  # taken as JSON text (R7 "JSON text"): answered as text
        assert isinstance(reply, str), reply
        reply = json.loads(reply)
    assert set(reply) == {"v", "error"} and reply["v"] == 1, reply
    assert set(reply["error"]) == {"code", "field", "message"}, reply
    assert reply["error"]["code"] == "invalid_message" and reply["error"]["field"] == field, (field, reply)
    assert dump(bed.storage) == before
    assert bed.storage.alarm == alarm and bed.storage.statements == statements


async def _drive(data: Any, rounds: int) -> None:
    clean, hostile = _new_bed(), _new_bed()
    clients = [_Client(c) for c in CLIENTS]
    depth = data.draw(st.sampled_from([0, 1, 50, 1200]), label="deep extra keys")
    for _ in range(rounds):
        plan = []
        for client in clients:
            action = data.draw(st.sampled_from(["skip", "request", "request", "sync"]), label=client.cid[:10])
            if action != "skip":
                demand = data.draw(valid_demand) if action == "request" else {}
                plan.append((client, client.message(action, demand, data.draw(st.integers(0, 2)), clean.now)))
        if not plan:
            continue
        clean_tasks, hostile_tasks = [], []
        for client, message in plan:
            for _ in range(data.draw(st.integers(0, 1), label="hostile before")):
                base = data.draw(st.sampled_from([m for _, m in plan]))
                bad, field = data.draw(mutations(base), label="hostile")
                await _hostile_send(hostile, bad, field)
            clean_tasks.append(clean.send(message))
            hostile_tasks.append(hostile.send(with_deep_extras(message, depth) if depth else message))
            await clean.settle()
            await hostile.settle()
        for _ in range(data.draw(st.integers(0, 2), label="hostile after")):
            bad, field = data.draw(mutations(data.draw(st.sampled_from([m for _, m in plan]))))
            await _hostile_send(hostile, bad, field)
        expected = await clean.finish(*clean_tasks)
        got = await hostile.finish(*hostile_tasks)
        assert got == expected, "a hostile message changed a valid client's reply"
        assert dump(hostile.storage) == dump(clean.storage)
        assert hostile.storage.alarm == clean.storage.alarm
        for (client, _), reply in zip(plan, expected):
            client.learn(reply)
        _assert_invariants(clean)
        _assert_invariants(hostile)
    # I3: everything released and deadlines passed: charged capacity returns to zero.
    for bed in (clean, hostile):
        await bed.clock.advance(LEASES["ttlMs"] + 10_000)
    for client in clients:
        if client.grants or client.leases:
            m = client.message("sync", {}, 2, clean.now)
            [a], [b] = await clean.round(m), await hostile.round(m)
            assert a == b
    for bed in (clean, hostile):
        _assert_invariants(bed)
        total = check_aggregates(bed.storage)["total"]
        assert total["outstanding"] == 0 and total["lease_footprint"] == 0, f"I3: {total}"
    assert dump(hostile.storage) == dump(clean.storage)


@HOLDER_SETTINGS
@given(st.data(), st.integers(1, 3))
def test_hostile_messages_interleaved_with_valid_traffic(data, rounds):
    # R7, I1, I3, I5: hostile messages get their error value, write nothing, and change no
    # valid client's reply; deep unknown keys are ignored.
    run(_drive(data, rounds))
