"""The client helper: reach the holder of a key over Durable Object RPC (SPEC R36).

Python shape of the original's ``DurabilitySemaphore.client({...})``::

    limits = DurabilitySemaphore.client(
        binding="ACCOUNT_LIMIT",                      # env.ACCOUNT_LIMIT is the namespace
        invoke=lambda stub, message: stub.permits(message),
    )

    # from a client Durable Object:
    reply = await limits.with_(timeout(5_000)).request(self.env, account_id, message)

    # or as the transport of a SemaphoreClient:
    client = SemaphoreClient(ctx, limits.with_(timeout(5_000)).transport(env))

* The holder is resolved with :func:`get_by_name` (``namespace.getByName(key)``; the runtime has
  no snake_case name for it). ``namespace=`` is the escape hatch when there is no binding name:
  a namespace object, or a callable ``env -> namespace``.
* ``invoke(stub, message)`` calls the RPC method the application chose (a method *name* string
  works too). Messages are sent positionally, as the JSON text of their wire dict (the
  default ``encoding="text"``: the holder's ``handle`` answers text, SPEC R7 "JSON text"; a
  holder of a release before it refuses text, and is sent dicts from then on) or as the dicts
  (``encoding="object"``).
* A reply that is not a plain dict (a ``JsProxy``) is converted with :func:`runtime.plain`; an
  error value (``{"v": 1, "error": ...}``) raises its typed exception (:mod:`semaphore.errors`);
  an exception from the RPC itself (``JsException`` in the runtime: its type is lost) becomes
  :class:`HolderUnavailableError`.
* Transforms wrap the call. A transform is a function ``next -> call`` where both are
  ``async (key, message) -> reply``. **Order**: ``helper.with_(a, b)`` is the same as
  ``helper.with_(a).with_(b)``; the *first* transform is the *outermost*: a call goes through
  ``a``, then ``b``, then the RPC. So ``with_(timeout(5_000), retry(3))`` bounds all attempts
  together by 5 s, while ``with_(retry(3), timeout(5_000))`` gives each attempt 5 s.
  :func:`timeout` and :func:`retry` are provided; any function of that shape composes.

This module never imports ``workers`` or ``js``: it duck-types what the runtime hands over.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from .clock import sleep_until, system_clock
from .core import json_text
from .core.wire import PermitRequest, SyncMessage
from .errors import (
    ConfigurationError,
    HolderUnavailableError,
    SemaphoreError,
    SemaphoreTimeoutError,
    error_from_reply,
)
from .runtime import binding_kind, plain

__all__ = [
    "Call",
    "Transform",
    "SemaphoreRpc",
    "client",
    "get_by_name",
    "timeout",
    "retry",
]

#: ``async (key, message) -> reply dict``: one call to the holder of ``key``.
Call = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
#: A caller transform: wraps a :data:`Call` into another.
Transform = Callable[[Call], Call]
#: ``(stub, message) -> reply`` (sync or awaitable), or the name of the stub's RPC method. The
#: message is the JSON text of the wire dict (``encoding="text"``, the default) or the dict.
Invoke = str | Callable[[Any, Any], Any]
#: How a message crosses the RPC (:attr:`SemaphoreRpc.encoding`).
Encoding = Literal["text", "object"]


def get_by_name(namespace: Any, name: str) -> Any:
    """The stub of the Durable Object named ``name`` in ``namespace``: ``namespace.getByName``
    (falling back to ``namespace.get(namespace.idFromName(name))`` on older runtimes)."""
    by_name = getattr(namespace, "getByName", None)
    if callable(by_name):
        return by_name(name)
    id_from_name = getattr(namespace, "idFromName", None)
    get = getattr(namespace, "get", None)
    if callable(id_from_name) and callable(get):
        return get(id_from_name(name))
    raise ConfigurationError(
        f"{type(namespace).__name__} is not a Durable Object namespace (no getByName)", field="namespace")


def _is_namespace(value: Any) -> bool:
    """Whether ``value`` is a Durable Object namespace: by its runtime class where the runtime
    tells it (:func:`runtime.binding_kind`: a service binding answers every attribute, so its
    ``getByName`` proves nothing), else by its attributes (a plain Python stand-in)."""
    kind = binding_kind(value)
    if kind is not None:
        return kind == "DurableObjectNamespace"
    return callable(getattr(value, "getByName", None)) or (
        callable(getattr(value, "idFromName", None)) and callable(getattr(value, "get", None)))


#: How the runtime says a stub's class has no RPC method of that name: workerd's Python objects
#: ("Method permits does not exist"), its JavaScript ones ("The RPC receiver does not implement
#: the method ...").
_NO_METHOD = re.compile(r"Method \S+ does not exist|does not implement the method")
#: The last line of a :class:`ConfigurationError` raised in the callee: it crosses RPC as a
#: ``JsException`` whose message holds the Python traceback.
_CALLEE_CONFIG = re.compile(r"(?:^|[\s.])ConfigurationError: (.*)$", re.MULTILINE)


def misconfiguration(exc: BaseException, stub: Any, where: str) -> ConfigurationError | None:
    """The :class:`ConfigurationError` an RPC failure ``exc`` stands for, or ``None`` (then it is a
    holder failure, retried): the stub's class has no such method (``where``'s class is not a
    holder; a Python stand-in's ``AttributeError`` on ``stub`` too), or the callee raised a
    ``ConfigurationError`` (a holder class without its SQLite migration, an ``env`` without the
    var its constructor reads)."""
    text = str(exc)
    if _NO_METHOD.search(text) or (isinstance(exc, AttributeError) and getattr(exc, "obj", None) is stub):
        return ConfigurationError(
            f"{where} has no RPC method that invoke= calls ({text.strip()}): bind the holder class (the one "
            "whose method answers DurabilitySemaphore.handle(message))", field="binding")
    found = _CALLEE_CONFIG.findall(text)
    if found:
        return ConfigurationError(f"{where}: {found[-1].strip()}", field="holder")
    return None


def objects_only(reply: Any) -> bool:
    """Whether ``reply``, the answer to a message sent as JSON text, says the holder takes only
    objects: the ``invalid_message`` error of field ``""`` (the message itself) that a holder
    of a release before JSON text (SPEC R7) answers to a string, as an object. A holder that
    takes text answers text, its errors too."""
    if not isinstance(reply, dict):
        return False
    error = reply.get("error")
    return isinstance(error, dict) and error.get("code") == "invalid_message" and not error.get("field")


def _foreign_reply(reply: Any, where: str) -> ConfigurationError:
    """The :class:`ConfigurationError` of a ``reply`` that is not a holder's (every reply and error
    value of ``DurabilitySemaphore.handle`` is an object with ``"v"``)."""
    return ConfigurationError(
        f"{where} answered a {type(reply).__name__} without \"v\", not a holder's reply: invoke= must call "
        "the holder's method that returns DurabilitySemaphore.handle(message)", field="invoke")


class _EncodingState:
    """What a helper learned of its holders (SPEC R36 decision "encoding"), shared by the helpers
    ``with_`` makes from it and every transport they make: ``objects``, a holder takes only
    objects (every later message goes as one); ``text_answered``, a holder answered text (a failed
    call is then the holder's failure, never a sign to try objects)."""

    __slots__ = ("objects", "text_answered")

    def __init__(self) -> None:
        self.objects = False
        self.text_answered = False


@dataclass(frozen=True)
class SemaphoreRpc:
    """The client helper returned by :meth:`DurabilitySemaphore.client` (immutable; ``with_``
    returns a new helper). See the module documentation."""

    invoke: Invoke
    binding: str | None = None
    namespace: Any = None
    transforms: tuple[Transform, ...] = ()
    #: How messages cross the RPC: ``"text"`` (the default), as their JSON text, answered as
    #: text by a holder that takes it and sent again as an object to one that does not (SPEC
    #: R7 "JSON text"); ``"object"``: as plain dicts, converted field by field by the runtime.
    encoding: Encoding = "text"
    #: What this helper (and every helper ``with_`` makes from it) learned of its holders'
    #: encoding (:class:`_EncodingState`).
    _encoding_state: _EncodingState = field(default_factory=lambda: _EncodingState(), compare=False, repr=False)

    def with_(self, *transforms: Transform) -> SemaphoreRpc:
        """A helper whose calls also go through ``transforms`` (first = outermost; transforms
        added by an earlier ``with_`` stay outside later ones)."""
        for t in transforms:
            if not callable(t):
                raise ConfigurationError(f"transform {t!r} is not callable", field="transforms")
        return SemaphoreRpc(self.invoke, self.binding, self.namespace, self.transforms + tuple(transforms),
                            self.encoding, self._encoding_state)

    def resolve_namespace(self, env: Any) -> Any:
        """The Durable Object namespace of the holder class in ``env``. Raises
        :class:`ConfigurationError` naming the binding when ``env`` has none of that name, or
        when what it has is not a Durable Object namespace (a var, a KV namespace, ...)."""
        ns = self.namespace
        if ns is not None:
            if not _is_namespace(ns) and callable(ns):
                ns = ns(env)
            if not _is_namespace(ns):
                raise ConfigurationError(
                    f"namespace= gave a {type(ns).__name__}, not a Durable Object namespace (no getByName)",
                    field="namespace")
            return ns
        assert self.binding is not None
        value = getattr(env, self.binding, None)
        if value is None and isinstance(env, dict):
            value = env.get(self.binding)
        if value is None:
            raise ConfigurationError(
                f"env has no binding {self.binding!r}: declare the holder class's Durable Object binding "
                f"under [[durable_objects.bindings]] in wrangler.toml (name = {self.binding!r})", field="binding")
        if not _is_namespace(value):
            raise ConfigurationError(
                f"env.{self.binding} is a {type(value).__name__}, not a Durable Object namespace: bind it "
                f"under [[durable_objects.bindings]] in wrangler.toml (name = {self.binding!r}, class_name = "
                "the holder class)", field="binding")
        return value

    def call(self, env: Any) -> Call:
        """The composed ``async (key, message) -> reply`` for ``env``. The holder's namespace is
        resolved here, at once: a missing or wrong binding raises :class:`ConfigurationError`
        (never retried as if the holder were down) when the transport is made, not at the first
        permit."""
        namespace = self.resolve_namespace(env)
        where = f"env.{self.binding}" if self.binding is not None else "namespace="
        composed: Call = _Transport(self, namespace, where).call
        for t in reversed(self.transforms):
            composed = t(composed)
        return composed

    async def request(self, env: Any, key: str, message: Any) -> dict[str, Any]:
        """Send ``message`` (a wire dict, or a typed :class:`PermitRequest`/:class:`SyncMessage`)
        to the holder of ``key`` and return its reply dict. Raises the typed exception of an
        error reply, :class:`HolderUnavailableError` if the RPC fails, and whatever the
        transforms raise (e.g. :class:`SemaphoreTimeoutError`)."""
        if isinstance(message, (PermitRequest, SyncMessage)):
            message = message.to_wire()
        return await self.call(env)(key, message)

    def transport(self, env: Any) -> Call:
        """This helper as the transport of a :class:`~semaphore.client.SemaphoreClient`."""
        return self.call(env)


class _Transport:
    """One helper's calls in one ``env``: the RPC itself, with the message's encoding (SPEC R36
    decision "encoding")."""

    def __init__(self, helper: SemaphoreRpc, namespace: Any, where: str) -> None:
        self.invoke, self.encoding, self.state = helper.invoke, helper.encoding, helper._encoding_state
        self.namespace, self.where = namespace, where

    async def call(self, key: str, message: dict[str, Any]) -> dict[str, Any]:
        text = None
        if self.encoding == "text" and not self.state.objects:
            try:
                text = json_text.encode(message)
            except (TypeError, ValueError):  # NaN, a set...: as an object, for the holder to judge (R7)
                text = None
        reply = await (self._send(key, message) if text is None else self._as_text(key, message, text))
        if not isinstance(reply, dict) or "v" not in reply:
            raise _foreign_reply(reply, f"{self.where} (holder {key!r})")
        error = error_from_reply(reply)
        if isinstance(error, ConfigurationError):  # the holder's class is misconfigured: name which
            raise ConfigurationError(f"{self.where} (holder {key!r}): {error.message}", field=error.field)
        if error is not None:
            raise error
        return reply

    async def _as_text(self, key: str, message: dict[str, Any], text: str) -> Any:
        """The message as JSON text; as an object instead (and every later one of the helper)
        when the holder shows it takes only objects: it answers the text with
        ``invalid_message`` of the message itself as an object, or, while no holder of the
        helper has answered text yet, the call fails and the same message as an object succeeds
        (a holder method that reads the message as a dict)."""
        try:
            reply = await self._send(key, text)
        except HolderUnavailableError:
            if self.state.text_answered:
                raise
            reply = await self._send(key, message)  # raises as the holder fails: nothing learned
            self.state.objects = True
            return reply
        if isinstance(reply, str):
            self.state.text_answered = True
            try:
                return json_text.decode(reply)
            except json_text.JsonTextError:
                raise _foreign_reply(reply, f"{self.where} (holder {key!r})") from None
        if objects_only(reply):
            self.state.objects = True  # a holder of a release before JSON text: objects from now on
            return await self._send(key, message)
        return reply

    async def _send(self, key: str, message: Any) -> Any:
        """One RPC to the holder of ``key``: its answer as plain Python; a failure of the RPC is
        :class:`HolderUnavailableError`, or the :class:`ConfigurationError` it stands for."""
        stub = None
        try:
            stub = get_by_name(self.namespace, key)
            result = getattr(stub, self.invoke)(message) if isinstance(self.invoke, str) else \
                self.invoke(stub, message)
            if inspect.isawaitable(result):
                result = await result
        except SemaphoreError:
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # JsException in the runtime: the callee's type is lost
            wrong = misconfiguration(exc, stub, f"{self.where} (holder {key!r})")
            if wrong is not None:
                raise wrong from exc
            raise HolderUnavailableError(f"RPC to holder {key!r} failed: {exc}") from exc
        return plain(result)


def client(
    binding: str | None = None,
    *,
    invoke: Invoke,
    namespace: Any = None,
    transforms: tuple[Transform, ...] = (),
    encoding: Encoding = "text",
) -> SemaphoreRpc:
    """``DurabilitySemaphore.client(binding=..., invoke=...)``: the client helper (SPEC R36).

    :param binding: name of the holder class's Durable Object binding in ``env``.
    :param invoke: ``(stub, message) -> awaitable reply`` calling the holder's RPC method, or the
        method's name (``"permits"``).
    :param namespace: escape hatch instead of ``binding``: the namespace object itself, or a
        callable ``env -> namespace``.
    :param transforms: initial transforms (see :meth:`SemaphoreRpc.with_`).
    :param encoding: ``"text"`` (default): each message crosses the RPC as its JSON text and a
        holder answers text (one string each way instead of an object converted field by field;
        a holder of a release before JSON text is detected by its first answer and sent objects
        from then on); ``"object"``: plain dicts, as before (SPEC R7 "JSON text").
    """
    if encoding not in ("text", "object"):
        raise ConfigurationError(f"encoding: 'text' or 'object', got {encoding!r}", field="encoding")
    if (binding is None) == (namespace is None):
        raise ConfigurationError("give exactly one of binding= or namespace=", field="binding")
    if not (callable(invoke) or isinstance(invoke, str)):
        raise ConfigurationError("invoke: a callable (stub, message) -> reply or a method name",
                                 field="invoke")
    return SemaphoreRpc(invoke, binding, namespace, encoding=encoding).with_(*transforms)


# ------------------------------------------------------------------------------ transforms


def timeout(ms: int, *, clock: Callable[[], int] | None = None) -> Transform:
    """Give up waiting after ``ms`` milliseconds with :class:`SemaphoreTimeoutError`.

    The holder may still process the message (the runtime has no RPC cancellation); cumulative
    reports make asking again safe. With a ``clock`` that has ``sleep_until`` (e.g.
    ``VirtualClock``) the deadline is measured on it; otherwise on the event loop."""
    if isinstance(ms, bool) or not isinstance(ms, int) or ms <= 0:
        raise ConfigurationError(f"timeout: ms must be a positive integer, got {ms!r}", field="timeout")

    def transform(call: Call) -> Call:
        async def timed(key: str, message: dict[str, Any]) -> dict[str, Any]:
            if clock is None or getattr(clock, "sleep_until", None) is None:
                try:
                    return await asyncio.wait_for(call(key, message), ms / 1000)
                except TimeoutError:
                    raise SemaphoreTimeoutError(f"holder {key!r} did not answer within {ms} ms") from None
            work = asyncio.ensure_future(call(key, message))
            timer = asyncio.ensure_future(sleep_until(clock, int(clock()) + ms))
            try:
                await asyncio.wait({work, timer}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                timer.cancel()
            if work.done():
                return work.result()
            work.cancel()
            raise SemaphoreTimeoutError(f"holder {key!r} did not answer within {ms} ms")

        return timed

    return transform


def retry(attempts: int, *, backoff_ms: int = 0, clock: Callable[[], int] | None = None) -> Transform:
    """Retry a call that raised :class:`HolderUnavailableError` (including timeouts) up to
    ``attempts`` times in all, sleeping ``backoff_ms * 2**i`` between attempts. Other errors
    (invalid message, round failed) are raised at once."""
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ConfigurationError(f"retry: attempts must be >= 1, got {attempts!r}", field="retry")
    sleep_clock = clock or system_clock

    def transform(call: Call) -> Call:
        async def retried(key: str, message: dict[str, Any]) -> dict[str, Any]:
            for i in range(attempts):
                try:
                    return await call(key, message)
                except HolderUnavailableError:
                    if i == attempts - 1:
                        raise
                    if backoff_ms:
                        await sleep_until(sleep_clock, int(sleep_clock()) + backoff_ms * 2**i)
            raise AssertionError("unreachable")

        return retried

    return transform

