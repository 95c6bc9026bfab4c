"""Python face of the JavaScript runtime stand-ins (standins.mjs), for in-Pyodide tests.

A test builds a ``Runtime`` from a mapping of binding name -> DurableObject subclass. The JS side
then plays workerd: it constructs each object from JavaScript with ``(ctx, env)`` JS objects (so
the real ``workers`` SDK wraps them exactly as in production), delivers RPC calls through
``structuredClone`` and the same Python-side conversion workerd uses (``python_from_rpc`` on the
arguments, ``python_to_rpc`` on the result), and runs ``alarm()`` handlers.

    rt = Runtime({"HOLDER": Holder})
    stub = rt.env.HOLDER.getByName("key")     # rt.env is the SDK's _EnvWrapper, as self.env is
    reply = await stub.handle({"type": "request", ...})
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import _standin_js  # registered by harness.mjs
import js
from pyodide.code import relaxed_call
from pyodide.ffi import JsProxy, create_proxy, to_js
from workers import python_from_rpc, python_to_rpc
from workers.rpc import _EnvWrapper

try:
    from pyodide.ffi import jsnull
except ImportError:  # older Pyodide
    jsnull = None

__all__ = ["Runtime", "Skip", "js_to_py", "raw_js", "close_all", "settle_queue"]


class Skip(Exception):
    """Raise inside a test to report it as skipped."""


_open_runtimes: list[Runtime] = []


def js_to_py(value: Any) -> Any:
    """Convert a JS value to plain Python (null/undefined -> None, objects -> dicts)."""
    if value is None or value is jsnull:
        return None
    if isinstance(value, JsProxy):
        return python_from_rpc(value)
    return value


def raw_js(value: Any) -> Any:
    """Python dict/list -> JS object/array (dicts become plain objects, not Maps)."""
    return to_js(value, dict_converter=js.Object.fromEntries)


async def _dispatch(inst: Any, method: str, *args: Any) -> Any:
    # Same path as workerd's introspection.wrapper_func for a non-handler RPC method
    # (the JS side already refused missing and underscore-prefixed names).
    fn = getattr(inst, method)
    py_args = [python_from_rpc(a) for a in args]
    result = fn(*py_args)
    if inspect.isawaitable(result):
        result = await result
    return python_to_rpc(result)


async def _dispatch_fetch(inst: Any, request: Any) -> Any:
    # workerd calls `fetch` through wrapper_func with relaxed=True.
    result = relaxed_call(inst.fetch, python_from_rpc(request))
    if inspect.isawaitable(result):
        result = await result
    return python_to_rpc(result)


_dispatch_proxy = create_proxy(_dispatch)
_dispatch_fetch_proxy = create_proxy(_dispatch_fetch)


class Runtime:
    """One isolated 'deployment': fresh objects, fresh SQLite databases, no alarms."""

    def __init__(self, bindings: dict[str, type], *, auto_alarms: bool = True,
                 vars: dict[str, Any] | None = None):
        self.js = _standin_js.newRuntime(auto_alarms, _dispatch_proxy, _dispatch_fetch_proxy)
        self._class_proxies = []
        for binding, cls in bindings.items():
            proxy = create_proxy(cls)
            self._class_proxies.append(proxy)
            self.js.define(binding, proxy, cls.__name__)
        for name, value in (vars or {}).items():
            self.js.setEnvValue(name, value)
        # What a Durable Object sees as self.env, and what `workers.env` returns.
        self.env = _EnvWrapper(self.js.env)
        _open_runtimes.append(self)

    # -- addressing -----------------------------------------------------------------------
    def stub(self, binding: str, name: str):
        return getattr(self.env, binding).getByName(name)

    def _record(self, binding: str, name: str):
        return self.js.recordFor(binding, name)

    async def instance(self, binding: str, name: str) -> Any:
        """The live Python object (constructed on first use), for white-box checks."""
        return await self.js.instanceForPython(self._record(binding, name))

    def evict(self, binding: str, name: str) -> None:
        """Drop the in-memory instance; storage and alarm survive (like an eviction/restart)."""
        self.js.evict(binding, name)

    async def fetch(self, entrypoint: type, url: str, *, method: str = "GET",
                    headers: dict[str, str] | None = None, body: str | None = None) -> Any:
        """Send an HTTP request to a WorkerEntrypoint class; returns the JS Response."""
        init = {"method": method, "headers": headers or {}}
        if body is not None:
            init["body"] = body
        request = js.Request.new(url, raw_js(init))
        proxy = create_proxy(entrypoint)
        try:
            return await self.js.fetchEntrypoint(proxy, request)
        finally:
            proxy.destroy()

    # -- alarms and time ------------------------------------------------------------------
    def get_alarm(self, binding: str, name: str) -> int | float | None:
        return js_to_py(self._record(binding, name).alarm)

    async def fire_alarm(self, binding: str, name: str, *, force: bool = False) -> dict:
        """Run the alarm handler now if the alarm is due (or set, with force=True)."""
        res = await self.js.fireAlarm(self._record(binding, name), raw_js({"force": force}))
        return js_to_py(res)

    async def fire_due_alarms(self) -> int:
        return int(await self.js.fireDueAlarms())

    async def quiesce(self, timeout_ms: int = 20_000) -> None:
        """Stop automatic alarms and wait until no alarm handler is running (call at the end of
        a test with ``auto_alarms=True``, so no handler touches storage after ``close()``)."""
        await self.js.quiesce(timeout_ms)

    def now(self) -> int:
        return int(_standin_js.clock.now())

    def advance(self, ms: int | float) -> int:
        """Move Date.now() (and time.time()) forward; auto alarms are re-armed."""
        return int(_standin_js.clock.advance(ms))

    # -- inspection -----------------------------------------------------------------------
    def sql(self, binding: str, name: str, query: str, *args: Any) -> list[dict]:
        """Run SQL straight on an object's database (no gates, no SDK) for assertions."""
        rows = self.js.rawQuery(binding, name, query, *[python_to_rpc(a) for a in args])
        return [dict(r) for r in js_to_py(rows)]

    @property
    def events(self) -> list[dict]:
        return js_to_py(self.js.events)

    def close(self) -> None:
        if not self.js.closed:
            self.js.close()
        for p in self._class_proxies:
            try:
                p.destroy()
            except Exception:
                pass
        self._class_proxies = []


PUMPS_BOUND_S = 20.0  # a background pump still running after this is a hang, not a slow machine


async def settle_queue(rt: Runtime, binding: str, name: str, *, timeout_s: float = PUMPS_BOUND_S,
                       live_only: bool = False) -> Any:
    """Wait until the background pumps of the object's live instance (its ``queue``, a
    SemaphoreQueue) have ended, and return the instance. An ``enqueue()``, a ``permit()`` and a
    completion are pumped by their own instance at once, in the background, not through the
    object's alarm (SPEC R37 wake-ups), so a test waits for those pumps, not for an alarm. The
    work its callbacks run is left running (``await inst.queue.drain()`` waits for that too).
    A pump that does not end within ``timeout_s`` fails the test. With ``live_only``, an object
    with no live instance is left alone (``None``) rather than constructed."""
    if live_only and js_to_py(rt._record(binding, name).instance) is None:
        return None
    inst = await rt.instance(binding, name)

    async def settled() -> None:
        while tasks := [t for t in inst.queue._pumps() if not t.done()]:
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        await asyncio.wait_for(settled(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"{binding} {name!r}: a background pump still runs after {timeout_s} s") from None
    return inst


def close_all() -> None:
    while _open_runtimes:
        _open_runtimes.pop().close()
    _standin_js.clock.reset()
