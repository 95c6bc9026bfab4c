"""Tier 3: the runtime adapter's SQL (:class:`semaphore.runtime.Storage`) inside a real Python
Durable Object.

Inside workerd the Workers SDK hands a Python Durable Object ``ctx.storage`` wrapped in its RPC
converters; ``Storage`` runs SQL on the wrapped JavaScript object instead, binding parameters as
CPython's ``sqlite3`` binds them. Tiers 1 and 2 cannot show what workerd's SQLite does with them
(tier 2's Node stand-in differs: it throws on a bool where workerd binds the text ``'true'``).
A small Worker (written into a temporary folder, with this checkout's ``semaphore`` and the
vendored SDK) has one Durable Object whose ``probe()`` answers, for each value, what SQLite
stored in an INTEGER column (``typeof`` and ``quote``; ints around 2**53, where Pyodide turns to BigInts that workerd
refuses), and for a list, a tuple, a dict and an int beyond 2**53 - 1 the error ``Storage`` raises;
``GET /`` calls it.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from .small_worker import small_worker

pytestmark = pytest.mark.workerd

WRANGLER_TOML = """
name = "storage-probe"
main = "src/entry.py"
compatibility_date = "2026-11-01"
compatibility_flags = ["python_workers"]

[[durable_objects.bindings]]
name = "PROBE"
class_name = "Probe"

[[migrations]]
tag = "v1"
new_sqlite_classes = ["Probe"]
"""

ENTRY = '''
import json

from workers import DurableObject, Response, WorkerEntrypoint

from semaphore.runtime import Storage

VALUES = {"none": None, "true": True, "false": False, "int": 7, "safe": 2**53 - 2, "edge": 2**53 - 1, "-edge": -(2**53 - 1),
          "float": 1.5, "text": "é😀'",
          "bytes": b"\\x00\\xff"}


class Probe(DurableObject):
    def __init__(self, ctx, env):
        super().__init__(ctx, env)
        self.storage = Storage(ctx)

    async def probe(self):
        s = self.storage
        s.exec("CREATE TABLE IF NOT EXISTS t (name TEXT PRIMARY KEY, v INTEGER)")
        s.exec("DELETE FROM t")
        for name, value in VALUES.items():
            s.exec("INSERT INTO t(name, v) VALUES (?, ?)", name, value)
        stored = {r["name"]: [r["type"], r["q"]] for r in s.exec("SELECT name, typeof(v) AS type, quote(v) AS q FROM t")}
        refused = {}
        for name, value in {"list": [1], "tuple": (1,), "dict": {"a": 1}, "big": 2**53, "-big": -(2**53)}.items():
            try:
                s.exec("SELECT ?", value)
                refused[name] = None
            except (TypeError, OverflowError) as exc:
                refused[name] = [type(exc).__name__, str(exc)]

        def failing():
            s.exec("INSERT INTO t(name, v) VALUES ('rolled back', 1)")
            raise RuntimeError("boom")

        try:
            s.transaction(failing)
        except RuntimeError:
            pass
        kept = s.one("SELECT COUNT(*) AS n FROM t WHERE name = 'rolled back'")["n"]
        back = s.one("SELECT ? AS n, ? AS t, ? AS z, typeof(?) AS bare", 3, "x", None, 3)
        return json.dumps({"direct": s._direct, "stored": stored, "refused": refused, "rolled_back": kept == 0,
                           "back": back})


class Default(WorkerEntrypoint):
    async def fetch(self, request):
        answer = await self.env.PROBE.getByName("probe").probe()
        return Response(answer, headers={"content-type": "application/json"})
'''


@pytest.fixture(scope="module")
def probe(workerd_runtime, workerd_bin, tmp_path_factory):
    if workerd_runtime["skip"]:
        pytest.skip(workerd_runtime["skip"])
    with small_worker(tmp_path_factory.mktemp("storage-probe"), WRANGLER_TOML, ENTRY, workerd_bin) as proc:
        yield proc


def test_storage_binds_values_as_cpython_sqlite3_does_on_the_runtimes_sqlite(probe):
    with urllib.request.urlopen(f"{probe.url}/", timeout=60) as response:
        answer = json.loads(response.read())
    assert answer["direct"] is True, answer  # SQL on the wrapped object, not through the SDK's converters
    assert answer["stored"] == {
        "none": ["null", "NULL"],
        "true": ["integer", "1"],  # workerd alone binds JS true as the text 'true'
        "false": ["integer", "0"],
        "int": ["integer", "7"],
        "safe": ["integer", str(2**53 - 2)],  # Pyodide passes a number
        "edge": ["integer", str(2**53 - 1)],  # Pyodide would pass a BigInt: the adapter passes a number
        "-edge": ["integer", str(-(2**53 - 1))],
        "float": ["real", "1.5"],
        "text": ["text", "'é😀'''"],
        "bytes": ["blob", "X'00FF'"],
    }, answer
    assert answer["refused"] == {
        **{k: ["TypeError", f"cannot bind a {k} as an SQL parameter"] for k in ("list", "tuple", "dict")},
        # workerd refuses a BigInt with a bare "Cannot convert a BigInt value to a number"
        **{k: ["OverflowError", f"cannot bind {v} as an SQL parameter: the Workers runtime binds integers only up to"
                                f" {2**53 - 1} either way"] for k, v in (("big", 2**53), ("-big", -(2**53)))},
    }, answer
    assert answer["rolled_back"] is True, answer
    # workerd binds every JS number as a REAL: an INTEGER column's affinity stores an integral
    # one as the integer (every integer column of the library is declared so), and it reads back
    # as a Python int; only a bare parameter shows it (CPython's sqlite3 would say 'integer').
    assert answer["back"] == {"n": 3, "t": "x", "z": None, "bare": "real"}, answer
