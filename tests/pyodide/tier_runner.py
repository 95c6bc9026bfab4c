"""Tiny in-Pyodide test runner: runs every ``test_*`` function of one module.

Each result is handed to ``emit`` as a JSON string:
    {"event": "result", "test": name, "outcome": "passed"|"failed"|"skipped",
     "duration": seconds, "message": str, "traceback": str}
Plain and ``async`` test functions are supported; each runs with a timeout, and every stand-in
Runtime a test created is closed after it.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import sys
import time
import traceback

import standins


def _collect(mod):
    return [(name, obj) for name, obj in vars(mod).items()
            if name.startswith("test_") and inspect.isfunction(obj)
            and getattr(obj, "__module__", None) == mod.__name__]


async def _run_one(fn, timeout):
    result = fn()
    if inspect.isawaitable(result):
        await asyncio.wait_for(result, timeout)


async def main(module_name, only, timeout, emit, list_only=False):
    sys.dont_write_bytecode = True
    only = set(only) if only else None
    try:
        mod = importlib.import_module(module_name)
    except BaseException as exc:  # noqa: BLE001 - report collection errors as a failure
        emit(json.dumps({"event": "result", "test": "<import>", "outcome": "failed",
                         "duration": 0.0, "message": f"{type(exc).__name__}: {exc}",
                         "traceback": traceback.format_exc()}))
        return 1
    tests = _collect(mod)
    if list_only:
        for name, _ in tests:
            emit(json.dumps({"event": "test", "test": name}))
        return 0
    if only is not None:
        missing = only - {n for n, _ in tests}
        for name in sorted(missing):
            emit(json.dumps({"event": "result", "test": name, "outcome": "failed",
                             "duration": 0.0, "message": "no such test in module",
                             "traceback": ""}))
        tests = [(n, f) for n, f in tests if n in only]
    failed = 0
    for name, fn in tests:
        start = time.perf_counter()
        outcome, message, tb = "passed", "", ""
        try:
            await _run_one(fn, timeout)
        except standins.Skip as exc:
            outcome, message = "skipped", str(exc)
        except TimeoutError:
            outcome, message, tb = "failed", f"timed out after {timeout} s", traceback.format_exc()
        except BaseException as exc:  # noqa: BLE001
            outcome, message, tb = "failed", f"{type(exc).__name__}: {exc}", traceback.format_exc()
        finally:
            try:
                standins.close_all()
            except BaseException as exc:  # noqa: BLE001
                if outcome == "passed":
                    outcome, message, tb = "failed", f"closing runtimes: {exc}", traceback.format_exc()
        if outcome == "failed":
            failed += 1
        emit(json.dumps({"event": "result", "test": name, "outcome": outcome,
                         "duration": round(time.perf_counter() - start, 4),
                         "message": message, "traceback": tb}))
    return 1 if failed else 0
