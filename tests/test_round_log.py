"""Tier 1: the holder's round record (issue 11): one JSON line per round at INFO on the logger
``semaphore.round``, and the same :class:`RoundRecord` handed to ``on_round=``.

Checked: the fields of committed rounds (requests, admitted, grants and leases issued, leases
retired, blocked by reason, SQL statements equal to the statements the round's transaction ran,
charged and limit after the round equal to ``usage()``, contended), a failed round's record
(``failed``/``error``, nothing written), a hook that raises never changes a round, and the
option is checked.
"""

from __future__ import annotations

import json
import logging

import pytest

from semaphore.core.batching import ROUND_WAIT_MS
from semaphore.errors import ConfigurationError
from semaphore.holder._observe import RoundRecord
from semaphore.testing import Bed, DurableObjectRuleError, async_test, by_id, request, sync

STRICT = {"provisioning": {"mode": "strict"}, "permitsPerLease": 2, "ttlMs": 5000}


def round_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "semaphore.round"
            and r.getMessage().startswith("{")]


@async_test
async def test_a_committed_round_is_one_json_line_and_one_hook_call(caplog):
    caplog.set_level(logging.INFO, logger="semaphore.round")
    seen: list[RoundRecord] = []
    bed = Bed(3, group_limit={"g": 2}, on_round=seen.append)
    replies = await bed.round(request("a", {"g": 2}, oldest_at=1), request("b", {"g": 2, "h": 3}, oldest_at=2))
    assert [len(r["grants"]) for r in replies] == [1, 1]
    [record] = seen
    assert round_lines(caplog) == [record.to_dict()]
    d = record.to_dict()
    assert list(d) == ["at", "durationMs", "requests", "admitted", "grantsIssued", "leasesIssued",
                       "leasePermitsIssued", "leasesRetired", "blocked", "sqlStatements", "charged",
                       "limit", "contended", "failed", "error"]
    # a gets 2 of g (its group limit), b gets 1 of h (the limit): 2 of b's g wait for the group
    # limit, 2 of its h for the limit.
    assert (d["requests"], d["admitted"], d["grantsIssued"]) == (2, 3, 2), d
    assert d["blocked"] == {"group_limit": 2, "limit": 2}, d
    assert (d["leasesIssued"], d["leasePermitsIssued"], d["leasesRetired"]) == (0, 0, 0)
    assert d["contended"] is True and d["failed"] is False and d["error"] is None
    usage = await bed.usage()
    assert (d["charged"], d["limit"]) == (usage["charged"], usage["limit"]) == (3, 3)
    assert d["at"] == bed.t0 + ROUND_WAIT_MS and d["durationMs"] >= 0  # round_wait_ms after the first request
    assert d["sqlStatements"] > 0
    assert json.loads(record.to_json()) == d and "\n" not in record.to_json()


@async_test
async def test_sql_statements_are_the_statements_of_the_rounds_transaction():
    seen: list[RoundRecord] = []
    bed = Bed(5, on_round=seen.append)
    await bed.one(request("a", {"g": 1}))  # creates the schema (outside the round's transaction)
    count: list[int] = []
    original = bed.sem.storage.transaction

    def counted(fn):
        before = bed.sem.storage.statements
        try:
            return original(fn)
        finally:
            count.append(bed.sem.storage.statements - before)

    bed.sem.storage.transaction = counted
    [grant] = bed.grants()
    await bed.one(request("a", {"g": 2}, grants=[(grant, 1, 1)]))
    assert [r.sql_statements for r in seen[1:]] == count[:1] and count[0] > 0


@async_test
async def test_leases_issued_and_retired_are_counted():
    seen: list[RoundRecord] = []
    bed = Bed(4, leases=STRICT, on_round=seen.append)
    (ra,) = await bed.round(request("a", {"g": 1}, leases=[], oldest_at=1))
    [lease] = ra["leases"]
    r1 = seen[-1]
    assert (r1.admitted, r1.grants_issued, r1.leases_issued, r1.lease_permits_issued) == (1, 1, 1, 2), r1
    assert r1.charged == 3 and r1.leases_retired == 0
    # a stops its lease (nothing drawn): it leaves live and is settled in the next round.
    await bed.round(request("a", {}, leases=[(lease["leaseId"], 0, 0, True)]))
    r2 = seen[-1]
    assert (r2.leases_retired, r2.leases_issued, r2.admitted) == (1, 0, 0), r2
    assert r2.charged == (await bed.usage())["charged"] == 1


@async_test
async def test_a_failed_round_has_a_record_with_its_error_and_writes_nothing(caplog):
    caplog.set_level(logging.INFO, logger="semaphore.round")
    seen: list[RoundRecord] = []
    bed = Bed(5, on_round=seen.append)
    await bed.one(request("a", {"g": 1}))
    before = bed.dump()
    original = bed.storage.sql.exec
    state = {"armed": True}

    def exec_(query, *bindings):
        if state["armed"] and query.lstrip().upper().startswith(("INSERT", "UPDATE")):
            state["armed"] = False
            raise DurableObjectRuleError("injected storage failure")
        return original(query, *bindings)

    bed.storage.sql.exec = exec_
    reply = await bed.one(request("b", {"g": 1}))
    assert reply["error"]["code"] == "round_failed"
    assert bed.dump() == before
    record = seen[-1]
    assert record.failed and "injected storage failure" in (record.error or "")
    assert (record.requests, record.admitted, record.charged, record.limit) == (1, 0, None, 5)
    failed = [r for r in caplog.records if r.name == "semaphore.round" and r.getMessage().startswith("{")][-1]
    assert failed.levelno == logging.WARNING and json.loads(failed.getMessage())["failed"] is True


@async_test
async def test_a_raising_hook_is_logged_and_never_changes_the_round(caplog):
    caplog.set_level(logging.INFO, logger="semaphore.round")

    def boom(record):
        raise RuntimeError("hook down")

    bed = Bed(2, on_round=boom)
    plain = Bed(2)
    for b in (bed, plain):
        (r,) = await b.round(request("a", {"g": 3}, oldest_at=1))
        assert by_id(r) and r["contended"] is True
        await b.one(sync("a", [(r["grants"][0]["grantId"], 1, 0)]))
    assert bed.dump() == plain.dump()
    assert any("on_round raised" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)


def test_on_round_must_be_callable():
    with pytest.raises(ConfigurationError) as err:
        Bed(1, on_round=42)
    assert err.value.field == "on_round"


@async_test
async def test_without_info_logging_nothing_is_rendered(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="semaphore.round")
    rendered: list[int] = []
    monkeypatch.setattr(RoundRecord, "to_json", lambda self: rendered.append(1) or "{}")
    bed = Bed(2)
    await bed.one(request("a", {"g": 1}))
    assert rendered == [] and round_lines(caplog) == []
