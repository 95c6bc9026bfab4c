"""Wire messages as JSON text (SPEC R7, "JSON text"): a message may cross the RPC as the JSON
text of its plain dict, and is then answered with the JSON text of the reply.

Why: on the real runtime a dict crossing a Durable Object RPC is converted field by field
between Python and JavaScript at both ends (the SDK's ``python_to_rpc`` and the proxy reads on
the other side), which costs more than ``json.dumps``/``json.loads`` of the same message; a
string crosses as one value. ``scripts/bench_runtime.py`` measures the difference.

Pure: no ``js``, ``pyodide`` or ``workers`` here.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ..errors import InvalidMessageError

__all__ = ["MAX_MESSAGE_DEPTH", "JsonTextError", "too_deep", "decode", "decode_message", "encode"]

#: The deepest nesting of arrays and objects a message given as JSON text may have (a valid
#: message nests 3 levels; unknown fields are ignored, so a deeper one is allowed, up to this).
MAX_MESSAGE_DEPTH = 64

#: A JSON string literal (unrolled: no backtracking per character) and a bracket outside one.
#: A string that does not end (no closing quote, perhaps a lone backslash last) runs to the end
#: of the text: a match from an opening quote always succeeds, so ``re.sub`` reads each character
#: once (linear). Without that, it failed from such a quote and was retried from every later one:
#: ``'"' + '\\"' * n`` cost O(n**2). Such a text is not JSON, and ``json.loads`` refuses it.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_JSON_BRACKET = re.compile(r"[\[\]{}]")


def too_deep(text: str, limit: int) -> bool:
    """Whether the JSON ``text`` nests arrays and objects deeper than ``limit``, read from its
    brackets outside string literals, before any parser sees it. The check must come first:
    ``json.loads`` recurses once per level, and in Pyodide a deep enough text overflows the
    WebAssembly stack, a fatal error of the whole isolate, before Python's recursion limit
    could raise ``RecursionError``."""
    depth = 0
    for bracket in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        if bracket.group() in "[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


class JsonTextError(ValueError):
    """Text that :func:`decode` refuses; ``str()`` says why, never quoting the text."""


def _refuse_constant(name: str) -> Any:
    raise JsonTextError(f"{name} is not a JSON number (NaN and Infinity are refused)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonTextError(f"{text[:40]} is beyond the largest finite number")
    return value


def decode(text: str, limit: int = MAX_MESSAGE_DEPTH) -> Any:
    """The value of the JSON ``text`` (a message, a reply, a request body), or
    :class:`JsonTextError` saying why not: nesting deeper than ``limit`` (read before any parser
    runs), malformed text, ``NaN``, ``Infinity`` or a number that overflows to infinity
    (``1e999``), which ``json.loads`` would accept and JSON cannot carry."""
    too_deep_reason = f"nested deeper than {limit} levels"
    if too_deep(text, limit):
        raise JsonTextError(too_deep_reason)
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:  # not reached below the limit; kept as a last guard
        raise JsonTextError(too_deep_reason) from None
    except JsonTextError:  # a hook's refusal
        raise
    except ValueError as exc:  # JSONDecodeError, an int of too many digits
        raise JsonTextError(f"not valid JSON: {exc}") from None


def decode_message(text: str) -> Any:
    """:func:`decode` of a message given as JSON ``text``, for
    :func:`~semaphore.core.wire.parse_message` to validate; what it refuses is an
    :class:`InvalidMessageError` of field ``""`` (the message itself), its reason starting
    ``message text: ...``."""
    try:
        return decode(text)
    except JsonTextError as exc:
        raise InvalidMessageError("", f"message text: {exc}") from None


def encode(value: Any) -> str:
    """``value`` (a wire message or reply: plain dicts, lists, str, finite numbers, bool, None)
    as compact JSON text. Raises ``ValueError`` for NaN or Infinity, which JSON cannot carry."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
