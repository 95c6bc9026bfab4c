"""Code shape guard (architecture issue): no function of the library is longer than
``MAX_LINES`` lines, so each rule stays small enough to read beside its SPEC text.

A function's length is counted from its ``def`` line to its last line, inclusive (docstring,
comments and blank lines included; decorators not); nested functions are measured on their own
and count toward their enclosing function too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "src" / "semaphore"
MAX_LINES = 60


def function_lengths(path: Path) -> list[tuple[str, int, int]]:
    """``(qualified name, first line, length)`` of every function and method in ``path``."""
    found: list[tuple[str, int, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert child.end_lineno is not None
                found.append((prefix + child.name, child.lineno, child.end_lineno - child.lineno + 1))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), "")
    return found


def test_library_modules_are_found():
    modules = sorted(str(p.relative_to(LIBRARY)) for p in LIBRARY.rglob("*.py"))
    expected = {"holder/_semaphore.py", "core/allocation.py", "scheduler.py", "core/config.py"}
    assert expected <= set(modules), modules
    assert all(function_lengths(LIBRARY / m) for m in ("holder/_semaphore.py", "core/allocation.py"))


def test_no_library_function_is_longer_than_60_lines():
    too_long = [
        f"{path.relative_to(ROOT)}:{line} {name} ({length} lines)"
        for path in sorted(LIBRARY.rglob("*.py"))
        for name, line, length in function_lengths(path)
        if length > MAX_LINES
    ]
    assert not too_long, f"functions longer than {MAX_LINES} lines (split them):\n" + "\n".join(too_long)


def test_the_measure_counts_def_to_last_line(tmp_path: Path):
    sample = tmp_path / "sample.py"
    sample.write_text("class A:\n    @staticmethod\n    def f():\n        x = 1\n\n        return x\n")
    assert function_lengths(sample) == [("A.f", 3, 4)]


CLIENT = LIBRARY / "client"
#: The client modules that read and write its tables (each over an in-memory copy).
CLIENT_STORES = {"_store.py", "_item_store.py", "_queue_store.py"}
MAX_CLIENT_MODULE_LINES = 500


def sql_calls(path: Path) -> list[int]:
    """Lines of ``path`` calling ``.exec(...)`` or ``.one(...)`` (a storage's SQL methods)."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("exec", "one")]


#: The client modules that hold its schema (tables and indexes), installed through the runtime.
CLIENT_SCHEMAS = {"_client_model.py", "_queue_model.py"}
#: SQL in a string: a statement's or a clause's keyword (any case), or a column compared with a
#: bound parameter, a number, a quoted text or what an f-string puts after it (``"done_pending
#: = 0"``, ``f"finished_at < {cutoff}"``).
_SQL_TEXT = re.compile(r"(?i)\b(select|insert\s+into|delete\s+from|where|order\s+by|group\s+by|json_each)\b"
                       r"|\bupdate\s+\w+\s+set\b|\b\w+\s*(?:=|==|<>|!=|<=|>=|<|>)\s*(?:\?|\d|'|$)")


def sql_texts(path: Path) -> list[int]:
    """Lines of ``path`` with a string (not a docstring) that reads as SQL: a statement or a
    condition, such as ``" AND done_pending = 0"``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docs and _SQL_TEXT.search(node.value)]


def test_the_sql_text_check_sees_conditions_in_any_case_and_shape(tmp_path: Path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""A docstring may say SELECT x WHERE y = ?."""\n'
                      'A = " AND done_pending = 0"\nB = "done_pending = 0"\nC = f"finished_at < {1}"\n'
                      'D = "select x from t where y"\nE = "and owner <> \'\'"\nF = "no sql here, and none or so"\n')
    assert sorted(sql_texts(sample)) == [2, 3, 4, 5, 6]


def test_only_the_client_store_and_schema_modules_write_sql_text():
    # A condition built elsewhere (the queue's pump once passed its purge's predicate to the
    # item store) is policy in SQL where no twin can hold it: the stores' interfaces take values.
    found = {path.name: sql_texts(path) for path in sorted(CLIENT.glob("*.py"))}
    outside = {name: lines for name, lines in found.items() if lines and name not in CLIENT_STORES | CLIENT_SCHEMAS}
    assert not outside, f"SQL text outside the client's store and schema modules: {outside}"


def test_only_the_client_store_modules_run_sql():
    # Every other client module asks a store, whose copy must see every write (docs/ARCHITECTURE.md).
    found = {path.name: sql_calls(path) for path in sorted(CLIENT.glob("*.py"))}
    assert all(found[name] for name in CLIENT_STORES)
    outside = {name: lines for name, lines in found.items() if lines and name not in CLIENT_STORES}
    assert not outside, f"SQL outside the client's store modules: {outside}"


def test_no_client_module_is_longer_than_500_lines():
    long = {p.name: n for p in sorted(CLIENT.glob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_CLIENT_MODULE_LINES}
    assert not long, f"client modules over {MAX_CLIENT_MODULE_LINES} lines (split them): {long}"


def client_calls_with_hooks(path: Path) -> list[str]:
    """``line: call`` of every call in ``path`` that hands a callback to the client
    (``on_reply=``) or sends through the client's own apply-and-commit methods
    (``client.request`` / ``client.sync`` / ``client.flush``)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if not isinstance(node, ast.Call):
            continue
        if any(k.arg == "on_reply" for k in node.keywords):
            found.append(f"{node.lineno}: on_reply=")
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in ("request", "sync", "flush")
                and isinstance(func.value, ast.Attribute) and func.value.attr == "client"):
            found.append(f"{node.lineno}: client.{func.attr}(...)")
    return found


def test_the_queue_applies_replies_in_its_own_transaction_with_no_callback_from_the_client():
    # R35, R37: the queue sends (client.send_request / send_sync) and applies the answer with its
    # own step in one transaction it opens; the client never calls back into the queue.
    found = {p.name: calls for p in sorted(CLIENT.glob("_queue*.py")) if (calls := client_calls_with_hooks(p))}
    assert not found, f"the queue hands the client a callback, or lets it commit a reply: {found}"
    pump = (CLIENT / "_queue_pump.py").read_text(encoding="utf-8")
    assert "self.client.apply(reply)" in pump


def test_the_hook_finder_sees_hooks_and_the_committing_calls(tmp_path: Path):
    src = tmp_path / "m.py"
    src.write_text("async def f(self):\n    await self.client.sync(k, on_reply=self.h)\n"
                   "    await self.client.request(k, d)\n    await self.client.send_sync(k)\n")
    assert client_calls_with_hooks(src) == ["2: on_reply=", "2: client.sync(...)", "3: client.request(...)"]
