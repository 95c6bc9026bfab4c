"""The client helper (SPEC R36): ``DurabilitySemaphore.client(...)`` over a stand-in ``env``.

The env/namespace/stub below stand in for the runtime boundary only (``getByName`` returning a
stub whose ``permits`` coroutine forwards to a real holder); the helper itself is not mocked."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from semaphore import (
    ConfigurationError,
    Demand,
    DurabilitySemaphore,
    HolderUnavailableError,
    InvalidMessageError,
    PermitRequest,
    RoundFailedError,
    SemaphoreClient,
    SemaphoreTimeoutError,
    retry,
    timeout,
)
from semaphore.rpc import SemaphoreRpc, get_by_name
from semaphore.testing import T0, HolderSide, LocalContext, LocalStorage, VirtualClock, async_test


class JsLikeReply:
    """Like a JsProxy of a JS object: converts with to_py()."""

    def __init__(self, value: dict) -> None:
        self._value = value

    def to_py(self) -> dict:
        return self._value


class Stub:
    def __init__(self, env: Env, name: str) -> None:
        self.env, self.name = env, name

    async def permits(self, message: Any) -> Any:
        self.env.calls.append((self.name, message))
        if self.env.fail:
            raise RuntimeError("JsException: Error: Durable Object reset because its code was updated")
        if self.env.hang:
            await asyncio.Event().wait()
        reply = await self.env.holders[self.name].handle(message)
        return JsLikeReply(reply) if self.env.proxy_replies else reply


class Namespace:
    def __init__(self, env: Env) -> None:
        self.env = env

    def getByName(self, name: str) -> Stub:
        self.env.resolved.append(name)
        return Stub(self.env, name)


class Env:
    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.holders: dict[str, HolderSide] = {}
        self.calls: list[tuple[str, Any]] = []
        self.resolved: list[str] = []
        self.fail = False
        self.hang = False
        self.proxy_replies = False
        self.ACCOUNT_LIMIT = Namespace(self)

    def holder(self, name: str) -> HolderSide:
        return self.holders.setdefault(name, HolderSide(self.clock, limit=3, round_wait_ms=0, round_period_ms=0, leases=None))


def message(client_id: str = "c1", count: int = 1) -> dict:
    return PermitRequest(client_id, (Demand("g", count, T0),), (), ()).to_wire()


def sync(client_id: str = "c1") -> dict:
    return {"type": "sync", "v": 1, "clientId": client_id, "grants": []}


limits = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke=lambda stub, msg: stub.permits(msg))


@async_test
async def test_request_resolves_the_holder_by_name():
    # R36: env.<BINDING>.getByName(key), then the application's RPC method
    env = Env(VirtualClock(T0))
    env.holder("acct-1")
    reply = await limits.request(env, "acct-1", sync())
    assert env.resolved == ["acct-1"] and env.calls[0][0] == "acct-1"
    assert reply["v"] == 1 and reply["grants"] == []
    assert isinstance(limits, SemaphoreRpc)
    # a typed message is sent as its wire dict, as JSON text (SPEC R7 "JSON text")
    await limits.request(env, "acct-1", PermitRequest("c1"))
    assert isinstance(env.calls[-1][1], str) and json.loads(env.calls[-1][1])["type"] == "request"


@async_test
async def test_method_name_and_proxy_replies():
    # R36: invoke may name the method; a JsProxy-like reply is converted with plain()
    env = Env(VirtualClock(T0))
    env.holder("a")
    env.proxy_replies = True
    helper = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke="permits")
    reply = await helper.request(env, "a", sync())
    assert type(reply) is dict and reply["contended"] is False


@async_test
async def test_namespace_escape_hatch():
    # R36: namespace= instead of a binding name: the namespace itself or env -> namespace
    env = Env(VirtualClock(T0))
    env.holder("a")
    direct = DurabilitySemaphore.client(namespace=env.ACCOUNT_LIMIT, invoke="permits")
    assert (await direct.request(object(), "a", sync()))["v"] == 1
    lazy = DurabilitySemaphore.client(namespace=lambda e: e.ACCOUNT_LIMIT, invoke="permits")
    assert (await lazy.request(env, "a", sync()))["v"] == 1
    assert env.resolved == ["a", "a"]
    with pytest.raises(ConfigurationError):
        DurabilitySemaphore.client(invoke="permits")
    with pytest.raises(ConfigurationError):
        DurabilitySemaphore.client(binding="X", namespace=env.ACCOUNT_LIMIT, invoke="permits")
    with pytest.raises(ConfigurationError):
        await DurabilitySemaphore.client(binding="MISSING", invoke="permits").request(env, "a", sync())


def test_a_missing_or_wrong_binding_fails_when_the_transport_is_made():
    # R36: misconfiguration is never retried as if the holder were down: the transport (made when
    # the client object builds its SemaphoreClient) raises at once, naming the binding.
    env = Env(VirtualClock(T0))
    with pytest.raises(ConfigurationError) as missing:
        DurabilitySemaphore.client(binding="NOPE", invoke="permits").transport(env)
    assert missing.value.field == "binding"
    assert "'NOPE'" in str(missing.value) and "[[durable_objects.bindings]]" in str(missing.value)
    env.GREETING = "hello"  # a [vars] entry, not a Durable Object namespace
    with pytest.raises(ConfigurationError) as wrong:
        DurabilitySemaphore.client(binding="GREETING", invoke="permits").transport(env)
    assert "env.GREETING is a str, not a Durable Object namespace" in str(wrong.value)
    with pytest.raises(ConfigurationError) as lazy:
        DurabilitySemaphore.client(namespace=lambda e: e.GREETING, invoke="permits").transport(env)
    assert lazy.value.field == "namespace"
    assert env.calls == [] and env.resolved == []  # nothing was sent


class _FetcherWrapper:
    """Named like the Workers SDK's wrapper of a service binding (``workers/rpc.py``): like the
    JS RPC stub it wraps, it answers every attribute with a callable."""

    def __init__(self, binding: object) -> None:
        self._binding = binding

    def __getattr__(self, name: str) -> Any:
        return lambda *args: None


def test_a_service_binding_under_the_holders_name_is_refused_when_the_transport_is_made():
    # R36: [[services]] under the holder's binding name answers getByName like any attribute;
    # its runtime class (the SDK's wrapper, or the JS constructor in Pyodide: tier 2) tells it
    # from a namespace, at once, instead of failing inside every RPC.
    env = Env(VirtualClock(T0))
    env.ACCOUNT_LIMIT = _FetcherWrapper(object())
    with pytest.raises(ConfigurationError) as refused:
        DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke="permits").transport(env)
    assert "env.ACCOUNT_LIMIT is a _FetcherWrapper, not a Durable Object namespace" in str(refused.value)


def test_get_by_name_falls_back_to_id_from_name():
    class Old:
        def idFromName(self, name: str) -> str:
            return f"id({name})"

        def get(self, ident: str) -> str:
            return f"stub[{ident}]"

    assert get_by_name(Old(), "k") == "stub[id(k)]"
    with pytest.raises(ConfigurationError):
        get_by_name(object(), "k")


@async_test
async def test_error_values_and_rpc_exceptions():
    # R7: error values raise typed exceptions; an RPC exception (JsException) -> HolderUnavailableError
    env = Env(VirtualClock(T0))
    env.holder("a")
    with pytest.raises(InvalidMessageError) as info:
        await limits.request(env, "a", {"type": "sync", "v": 2, "clientId": "c1", "grants": []})
    assert info.value.field == "v"
    env.fail = True
    with pytest.raises(HolderUnavailableError) as err:
        await limits.request(env, "a", sync())
    assert "JsException" in str(err.value) and not isinstance(err.value, SemaphoreTimeoutError)

    bad = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke=lambda stub, msg: 42)
    env.fail = False
    with pytest.raises(ConfigurationError) as wrong:  # not a holder's reply: never retried as if it were down
        await bad.request(env, "a", sync())
    assert wrong.value.field == "invoke" and "env.ACCOUNT_LIMIT" in str(wrong.value), wrong.value


class NotAHolder:
    """A Durable Object class that is not a holder: it has no ``permits`` method."""

    async def other(self, message: Any) -> Any:
        return {"v": 1}


class JsNoMethodStub:
    """How workerd answers a call of a method the Python object's class lacks (seen on workerd
    1.20261117.1: ``TypeError: Method permits does not exist``, as a JsException)."""

    async def permits(self, message: Any) -> Any:
        raise RuntimeError("JsException: TypeError: Method permits does not exist")


class JsCalleeConfigStub:
    """A callee whose constructor raised ConfigurationError: the JsException's message holds the
    Python traceback, its last line the exception."""

    async def permits(self, message: Any) -> Any:
        raise RuntimeError("JsException: PythonError: Traceback (most recent call last):\n"
                           '  File "/session/metadata/entry.py", line 20, in __init__\n'
                           "semaphore.errors.ConfigurationError: env has no var 'LIMIT'\n")


@pytest.mark.parametrize("stub", [NotAHolder(), JsNoMethodStub()], ids=["python-stand-in", "workerd"])
@async_test
async def test_a_binding_to_a_class_that_is_not_a_holder_is_a_configuration_error(stub):
    env = Env(VirtualClock(T0))
    env.ACCOUNT_LIMIT.getByName = lambda name: stub
    helper = limits.with_(retry(5))  # a ConfigurationError is never retried
    with pytest.raises(ConfigurationError) as err:
        await helper.request(env, "a", sync())
    assert err.value.field == "binding" and "env.ACCOUNT_LIMIT" in str(err.value), err.value
    assert "no RPC method" in str(err.value), err.value


@async_test
async def test_a_configuration_error_raised_in_the_holder_reaches_the_client_as_one():
    env = Env(VirtualClock(T0))
    env.ACCOUNT_LIMIT.getByName = lambda name: JsCalleeConfigStub()
    with pytest.raises(ConfigurationError) as err:
        await limits.with_(retry(5)).request(env, "a", sync())
    assert "env has no var 'LIMIT'" in str(err.value) and "env.ACCOUNT_LIMIT" in str(err.value), err.value
    env.fail, env.ACCOUNT_LIMIT = True, Namespace(env)  # any other RPC failure stays a holder failure
    with pytest.raises(HolderUnavailableError):
        await limits.request(env, "a", sync())


@async_test
async def test_timeout_raises_semaphore_timeout_error():
    # R36: a timeout transform composes with the helper
    clock = VirtualClock(T0)
    env = Env(clock)
    env.holder("a")
    env.hang = True
    helper = limits.with_(timeout(5_000, clock=clock))
    task = asyncio.ensure_future(helper.request(env, "a", sync()))
    await clock.advance(4_999)
    assert not task.done()
    await clock.advance(1)
    with pytest.raises(SemaphoreTimeoutError):
        await task
    # wall-clock variant (event loop time)
    with pytest.raises(SemaphoreTimeoutError):
        await limits.with_(timeout(20)).request(env, "a", sync())
    # an answer within the deadline passes through
    env.hang = False
    assert (await limits.with_(timeout(5_000)).request(env, "a", sync()))["v"] == 1
    with pytest.raises(ConfigurationError):
        timeout(0)


@async_test
async def test_transform_order_first_is_outermost():
    # R36: with_(a, b) == with_(a).with_(b); the first transform is the outermost
    env = Env(VirtualClock(T0))
    env.holder("a")
    trace: list[str] = []

    def tag(name: str):
        def transform(call):
            async def wrapped(key, msg):
                trace.append(f"{name}>")
                reply = await call(key, msg)
                trace.append(f"<{name}")
                return reply
            return wrapped
        return transform

    await limits.with_(tag("a"), tag("b")).request(env, "a", sync())
    assert trace == ["a>", "b>", "<b", "<a"]
    trace.clear()
    await limits.with_(tag("a")).with_(tag("b")).request(env, "a", sync())
    assert trace == ["a>", "b>", "<b", "<a"]
    assert limits.transforms == ()  # with_ returns a new helper


@async_test
async def test_retry_inside_timeout_vs_timeout_inside_retry():
    # R36: composition order matters and is documented: with_(retry(3), timeout(t)) times each try
    clock = VirtualClock(T0)
    env = Env(clock)
    env.holder("a")
    env.hang = True
    per_try = limits.with_(retry(3), timeout(1_000, clock=clock))
    task = asyncio.ensure_future(per_try.request(env, "a", sync()))
    await clock.advance(2_500)
    assert not task.done() and len(env.calls) == 3
    await clock.advance(600)
    with pytest.raises(SemaphoreTimeoutError):
        await task
    env.calls.clear()
    overall = limits.with_(timeout(1_000, clock=clock), retry(3))
    task = asyncio.ensure_future(overall.request(env, "a", sync()))
    await clock.advance(1_000)
    with pytest.raises(SemaphoreTimeoutError):
        await task
    assert len(env.calls) == 1


@async_test
async def test_helper_as_the_transport_of_a_client():
    # R35, R36: SemaphoreClient over the helper's transport
    clock = VirtualClock(T0)
    env = Env(clock)
    env.holder("acct")
    client = SemaphoreClient(LocalContext(LocalStorage(), name="c1"), limits.transport(env), clock=clock,
                             client_id="c1")
    applied = await client.request("acct", [Demand("g", 2, T0)])
    assert [g.permits for g in applied.response.grants] == [2]
    env.fail = True
    with pytest.raises(HolderUnavailableError):
        await client.sync("acct")


class ObjectsOnlyHolder:
    """A holder of a release before JSON text (SPEC §3): its ``handle`` takes only objects, so a
    message given as text is its ``invalid_message`` error of field ``""``, as an object."""

    def __init__(self, env: Env, name: str) -> None:
        self.env, self.name = env, name

    async def permits(self, message: Any) -> Any:
        self.env.calls.append((self.name, message))
        if isinstance(message, str):
            return InvalidMessageError("", "message must be an object, got a str").to_wire()
        return await self.env.holders[self.name].handle(message)


@async_test
async def test_messages_cross_the_rpc_as_json_text_answered_as_text():
    # SPEC R7 "JSON text": by default the helper sends each message as the JSON text of its wire
    # dict; the holder's handle() answers text, which the helper decodes to the same reply dict
    # that the object path gives.
    env = Env(VirtualClock(T0))
    env.holder("a")
    replies: list[Any] = []
    helper = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke=lambda stub, m: recorded(stub.permits(m)))

    async def recorded(call: Any) -> Any:
        replies.append(await call)
        return replies[-1]

    reply = await helper.request(env, "a", message("c1", 2))
    assert isinstance(env.calls[-1][1], str) and json.loads(env.calls[-1][1]) == message("c1", 2)
    assert isinstance(replies[-1], str) and json.loads(replies[-1]) == reply
    assert [g["permits"] for g in reply["grants"]] == [2], reply
    as_objects = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke=lambda stub, m: recorded(stub.permits(m)),
                                            encoding="object")
    again = await as_objects.request(env, "a", sync("c1"))
    assert env.calls[-1][1] == sync("c1") and isinstance(replies[-1], dict)
    assert again["grants"] == reply["grants"]
    with pytest.raises(ConfigurationError) as err:
        DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke="permits", encoding="json")  # type: ignore[arg-type]
    assert err.value.field == "encoding"
    assert limits.with_(retry(2)).encoding == "text" and as_objects.with_(retry(2)).encoding == "object"


@async_test
async def test_a_holder_that_takes_only_objects_is_sent_objects_from_its_first_answer_on():
    # SPEC R7 "JSON text": a holder of an earlier release refuses a text message (invalid_message
    # of the message itself, nothing written, I5); the helper sends that message again as an
    # object and every later one as objects, so such a holder costs one extra call per transport.
    env = Env(VirtualClock(T0))
    env.holder("a")
    env.ACCOUNT_LIMIT.getByName = lambda name: ObjectsOnlyHolder(env, name)
    helper = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke="permits")
    call = helper.call(env)
    reply = await call("a", message("c1", 1))
    assert [type(m) for _, m in env.calls] == [str, dict] and [g["permits"] for g in reply["grants"]] == [1]
    await call("a", sync("c1"))
    assert [type(m) for _, m in env.calls] == [str, dict, dict]
    # A holder that takes text and refuses a message for what it holds is not taken for an old one.
    # Learned for the helper (every request() makes its own transport): objects at once.
    await helper.request(env, "a", sync("c1"))
    assert [type(m) for _, m in env.calls] == [str, dict, dict, dict]
    env.ACCOUNT_LIMIT = Namespace(env)
    with pytest.raises(InvalidMessageError) as info:
        await limits.with_(retry(1)).request(env, "a", {"type": "sync", "v": 1, "clientId": "", "grants": []})
    assert info.value.field == "clientId" and all(isinstance(m, str) for _, m in env.calls[4:]), env.calls[4:]


@async_test
async def test_a_text_answer_that_is_not_json_is_not_a_holders_reply():
    # A method that answers text that is not JSON is misconfigured (invoke= calls the wrong
    # method): a ConfigurationError naming invoke, never retried as if the holder were down.
    env = Env(VirtualClock(T0))
    helper = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke=lambda stub, m: "pong").with_(retry(3))
    with pytest.raises(ConfigurationError) as err:
        await helper.request(env, "a", sync())
    assert err.value.field == "invoke" and "env.ACCOUNT_LIMIT" in str(err.value), err.value


class AnswersObjects:
    """A holder method that answers a text message with a fixed error value as an object."""

    def __init__(self, env: Env, error: InvalidMessageError | RoundFailedError) -> None:
        self.env, self.error = env, error

    async def permits(self, message: Any) -> Any:
        self.env.calls.append(("a", message))
        return self.error.to_wire()


@pytest.mark.parametrize("error", [RoundFailedError("round failed"), InvalidMessageError("clientId", "bad id")],
                         ids=["round-failed", "invalid-field"])
@async_test
async def test_only_a_refusal_of_the_message_itself_sends_objects(error):
    # R36 "encoding": an error value as an object is the holder's answer (raised, no resend)
    # unless it is invalid_message of the message itself (field ""), an older holder's refusal.
    env = Env(VirtualClock(T0))
    env.ACCOUNT_LIMIT.getByName = lambda name: AnswersObjects(env, error)
    helper = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke="permits")
    with pytest.raises(type(error)):
        await helper.request(env, "a", sync())
    assert [type(m) for _, m in env.calls] == [str]


class ReadsTheMessage:
    """A holder method written for dicts (it reads the message): a text message makes it raise,
    which crosses the RPC as an exception. ``fail`` makes every call fail (the holder is down)."""

    def __init__(self, env: Env, name: str) -> None:
        self.env, self.name = env, name

    async def permits(self, message: Any) -> Any:
        self.env.calls.append((self.name, message))
        if self.env.fail:
            raise RuntimeError("JsException: Error: Network connection lost")
        assert message["type"] in ("request", "sync")
        return await self.env.holders[self.name].handle(message)


@async_test
async def test_a_holder_method_that_reads_the_message_as_a_dict_gets_dicts():
    # R36 "encoding": until a holder has answered text, a call that fails as text is sent again
    # as an object; if that succeeds, objects from then on, for every request() of the helper.
    env = Env(VirtualClock(T0))
    env.holder("a")
    env.ACCOUNT_LIMIT.getByName = lambda name: ReadsTheMessage(env, name)
    helper = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke="permits").with_(retry(2))
    reply = await helper.request(env, "a", message("c1", 1))
    assert [g["permits"] for g in reply["grants"]] == [1]
    await helper.request(env, "a", sync("c1"))
    assert [type(m) for _, m in env.calls] == [str, dict, dict]


@async_test
async def test_a_holder_that_answered_text_is_never_sent_objects_when_it_fails():
    # R36 "encoding": once a text answer came, a failed call is the holder's failure (raised as
    # HolderUnavailableError, retried by the transforms), never a sign to send objects.
    env = Env(VirtualClock(T0))
    env.holder("a")
    helper = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke="permits")
    await helper.request(env, "a", sync("c1"))
    env.fail = True
    with pytest.raises(HolderUnavailableError):
        await helper.request(env, "a", sync("c1"))
    assert [type(m) for _, m in env.calls] == [str, str]
    # A holder down from the first call: the object attempt fails too, and nothing is learned.
    down = Env(VirtualClock(T0))
    down.holder("a")
    down.fail = True
    fresh = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke="permits")
    with pytest.raises(HolderUnavailableError):
        await fresh.request(down, "a", sync("c1"))
    down.fail = False
    await fresh.request(down, "a", sync("c1"))
    assert [type(m) for _, m in down.calls] == [str, dict, str]


@async_test
async def test_a_message_json_cannot_carry_goes_as_an_object_for_the_holder_to_judge():
    # R7: the text path answers as the dict path does: a NaN count is the holder's
    # invalid_message; an unknown field JSON cannot carry (a set) is ignored.
    env = Env(VirtualClock(T0))
    env.holder("a")
    limits = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke="permits")
    bad = message("c1", 1)
    bad["demand"][0]["count"] = float("nan")
    with pytest.raises(InvalidMessageError) as info:
        await limits.request(env, "a", bad)
    assert info.value.field == "demand[0].count" and isinstance(env.calls[-1][1], dict)
    extra = {**sync("c1"), "extra": {1, 2}}
    assert (await limits.request(env, "a", extra))["v"] == 1 and isinstance(env.calls[-1][1], dict)
    await limits.request(env, "a", sync("c1"))
    assert isinstance(env.calls[-1][1], str)  # the next message goes as text again
