"""Every public name has a docstring (issue 10).

Public: each class and function of ``semaphore.__all__`` and ``semaphore.testing.__all__``, and
every public method, property, classmethod and staticmethod of those classes, including the
ones they inherit from the library's own base classes (enum members and dataclass fields are
values, not code: their class documents them)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import semaphore
import semaphore.testing

PACKAGES = (semaphore, semaphore.testing)

#: Known gaps in files this test's author did not own (each must still be missing: when one
#: gets its docstring, drop it here). Empty is the goal.
KNOWN_MISSING: set[str] = set()


def _function(attr: Any) -> Any:
    if isinstance(attr, (staticmethod, classmethod)):
        return attr.__func__
    if isinstance(attr, property):
        return attr.fget
    return attr


def public_code() -> Iterator[tuple[str, Any]]:
    """``(qualified name, object)`` of every public class, function and method."""
    seen: set[int] = set()
    for package in PACKAGES:
        for name in package.__all__:
            obj = getattr(package, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or id(obj) in seen:
                continue
            seen.add(id(obj))
            yield f"{package.__name__}.{name}", obj
            if not inspect.isclass(obj):
                continue
            for klass in obj.__mro__:
                if not klass.__module__.startswith("semaphore"):
                    continue
                for member, attr in vars(klass).items():
                    function = _function(attr)
                    if member.startswith("_") or not inspect.isfunction(function) or id(function) in seen:
                        continue
                    seen.add(id(function))
                    yield f"{klass.__module__}.{klass.__qualname__}.{member}", function


def test_the_check_sees_the_public_api():
    names = {name for name, _ in public_code()}
    assert {"semaphore.DurabilitySemaphore", "semaphore.holder._semaphore.DurabilitySemaphore.handle",
            "semaphore.client._queue.SemaphoreQueue.permit", "semaphore.testing.async_test",
            "semaphore.testing._local.VirtualClock.now"} <= names
    assert len(names) > 200, len(names)


def _doc(obj: Any) -> str:
    """The object's own docstring: a class's is not inherited, and the signature a dataclass
    writes for a class without one does not count."""
    doc = (vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__) or ""
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
        return ""
    return doc.strip()


def test_every_public_name_has_a_docstring():
    missing = {name for name, obj in public_code() if not _doc(obj)}
    assert not missing - KNOWN_MISSING, "public names without a docstring:\n" + "\n".join(
        sorted(missing - KNOWN_MISSING))
    assert KNOWN_MISSING <= missing, f"documented now, drop from KNOWN_MISSING: {sorted(KNOWN_MISSING - missing)}"
