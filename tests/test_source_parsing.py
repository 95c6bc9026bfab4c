"""The code-reading tests parse source with ``ast.parse``; a garbage cycle collected inside it,
whose finalizer formats a traceback (an asyncio task of an earlier test logging "exception was
never retrieved"), must not fail them (CPython 3.11: "AST constructor recursion depth mismatch").
The suite's ``ast.parse`` is the one ``tests/conftest.py`` installs."""

from __future__ import annotations

import ast
import gc
import traceback


def _failing_lookup() -> int:
    table: dict[str, int] = {}
    return table["a"] + table["b"]  # a binary operation: its traceback line gets caret anchors (ast.parse)


class _FormatsATracebackWhenCollected:
    def __init__(self) -> None:
        self.cycle = self  # freed only by the cyclic collector

    def __del__(self) -> None:
        try:
            _failing_lookup()
        except KeyError as exc:
            traceback.format_exception(exc)


def test_a_finalizer_that_formats_a_traceback_inside_ast_parse_does_not_fail_it():
    source = open(ast.__file__, encoding="utf-8").read()
    threshold = gc.get_threshold()
    for _ in range(200):
        _FormatsATracebackWhenCollected()
    gc.set_threshold(1)  # collect at once, inside the parse, as a loaded suite may
    try:
        assert isinstance(ast.parse(source), ast.Module)
    finally:
        gc.set_threshold(*threshold)
        gc.collect()
