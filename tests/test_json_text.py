"""Messages as JSON text (SPEC R7 decision "JSON text"): the holder's ``handle`` takes the JSON
text of a wire message and answers the JSON text of its reply, exactly the reply it gives the
dict; text it cannot read is an ``invalid_message`` of the message itself and writes nothing."""

from __future__ import annotations

import json

import pytest

from semaphore import InvalidMessageError, SyncMessage
from semaphore.core import json_text
from semaphore.testing import T0, HolderSide, VirtualClock, async_test, request, sync


def twin_holders() -> tuple[HolderSide, HolderSide]:
    return (HolderSide(VirtualClock(T0), limit=3, round_wait_ms=0, round_period_ms=0),
            HolderSide(VirtualClock(T0), limit=3, round_wait_ms=0, round_period_ms=0))


def rows(side: HolderSide) -> dict[str, list[tuple]]:
    return side.dump()


@async_test
async def test_a_text_message_is_answered_with_the_text_of_the_reply_the_dict_gets():
    # R7 "JSON text": the same request and sync, as dicts to one holder and as text to its twin:
    # the replies are equal and the twin's text is the compact JSON of its reply.
    as_dict, as_text = twin_holders()
    messages = [request("c1", {"g": 2}, oldest_at=T0), request("c2", {"g": 2}, oldest_at=T0), sync("c1")]
    for message in messages:
        reply = await as_dict.handle(message)
        text = await as_text.handle(json.dumps(message))
        assert isinstance(text, str) and json.loads(text) == reply
        assert text == json_text.encode(reply) and " " not in text.replace('" ', "")
    assert rows(as_dict) == rows(as_text)
    typed = await as_text.handle(SyncMessage("c1"))  # typed objects: answered as dicts
    assert isinstance(typed, dict) and typed["v"] == 1


@pytest.mark.parametrize("text, reason", [
    ("{", "not valid JSON"),
    ("", "not valid JSON"),
    ('{"type": "sync", "v": 1, "clientId": "c1", "grants": [], "x": NaN}', "not a JSON number"),
    ('{"type": "sync", "v": 1, "clientId": "c1", "grants": [], "x": 1e999}', "beyond the largest finite"),
    ('{"type": "sync", "v": 1, "clientId": "c1", "grants": [], "x": ' + "[" * 65 + "]" * 65 + "}", "deeper"),
    ("[]", "must be an object"),
    ('"sync"', "must be an object"),
])
@async_test
async def test_text_that_is_not_a_json_message_is_refused_and_changes_nothing(text, reason):
    # R7, I5: answered (as text) with invalid_message of the message itself; nothing written.
    side = HolderSide(VirtualClock(T0), limit=3, round_wait_ms=0, round_period_ms=0)
    await side.handle(request("c1", {"g": 1}, oldest_at=T0))
    before = rows(side)
    answer = await side.handle(text)
    assert isinstance(answer, str)
    error = json.loads(answer)["error"]
    assert error["code"] == "invalid_message" and error["field"] == "" and reason in error["message"], error
    assert text[:20] not in error["message"] or len(text) < 3  # the reason never quotes the text
    assert rows(side) == before


def test_nesting_is_refused_before_any_parser_reads_it():
    # In Pyodide json.loads of a deep enough text overflows the WebAssembly stack (a fatal error
    # of the isolate), so depth is read from the brackets first. 64 levels pass, 65 do not;
    # brackets inside strings are not nesting.
    assert not json_text.too_deep("[" * 64 + "]" * 64, 64) and json_text.too_deep("[" * 65 + "]" * 65, 64)
    assert not json_text.too_deep('["' + "[" * 100 + '"]', 64)
    assert not json_text.too_deep("[" + ",".join(["[]"] * 200) + "]", 64)  # siblings are not depth
    grants = [{"grantId": f"g{i}", "claimed": 1, "released": 0} for i in range(100)]
    message = {"type": "sync", "v": 1, "clientId": "c1", "grants": grants}
    assert json_text.decode_message(json.dumps(message)) == message
    deep = "[" * 100_000 + "]" * 100_000  # far past the recursion limit: refused, not raised
    with pytest.raises(InvalidMessageError) as info:
        json_text.decode_message(deep)
    assert info.value.field == "" and "deeper than 64" in info.value.reason


def test_encode_is_compact_and_refuses_what_json_cannot_carry():
    assert json_text.encode({"v": 1, "label": "é"}) == '{"v":1,"label":"é"}'
    with pytest.raises(ValueError):
        json_text.encode({"x": float("nan")})


def test_decode_refuses_what_is_not_json_proper():
    # The one decoder of messages and replies: a reply that is not JSON is refused the same way
    # (the client helper then calls it not a holder's reply).
    for text in ("{", "NaN", "[1e999]", "[" * 70 + "]" * 70):
        with pytest.raises(json_text.JsonTextError):
            json_text.decode(text)
    assert json_text.decode('{"v":1}') == {"v": 1}
