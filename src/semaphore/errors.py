"""Typed exceptions of the semaphore library.

Across RPC, errors travel as *values* (``{"v": 1, "error": {...}}``, SPEC R7) because a Python
exception loses its type when it crosses a Durable Object boundary. On either side of the wire
the Python API raises the typed exceptions defined here; :func:`error_from_reply` turns an error
value back into one.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "SemaphoreError",
    "InvalidMessageError",
    "RoundFailedError",
    "HolderUnavailableError",
    "SemaphoreTimeoutError",
    "PermitTimeoutError",
    "ConfigurationError",
    "error_from_reply",
]


class SemaphoreError(Exception):
    """Base class of every error raised by this library."""

    #: Wire code of the error value this exception corresponds to.
    code: str = "error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field

    def to_wire(self) -> dict[str, Any]:
        """The error value sent across RPC for this exception (SPEC R7)."""
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field is not None:
            error["field"] = self.field
        return {"v": 1, "error": error}


class InvalidMessageError(SemaphoreError, ValueError):
    """A message broke the wire format (SPEC R7). ``field`` names the offending field,
    e.g. ``"demand[2].count"`` (``""``: the message itself is not an object); ``reason`` says
    why, describing the received value in a few ASCII characters at most (never its ``repr``,
    which a hostile value could make huge or unprintable). Nothing was written."""

    code = "invalid_message"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message, field=field)
        self.reason = message


class RoundFailedError(SemaphoreError):
    """The holder could not commit the round (or sync) that carried this message (SPEC R2).
    Nothing of that round was written; ask again."""

    code = "round_failed"


class HolderUnavailableError(SemaphoreError):
    """The holder could not be reached, or failed without an error value (e.g. it was evicted
    while the request waited for its round, SPEC R4). Safe to retry."""

    code = "unavailable"


class SemaphoreTimeoutError(HolderUnavailableError, TimeoutError):
    """A call to the holder did not answer within the caller's timeout. The holder may still
    have processed it; cumulative reports make a retry safe."""

    code = "timeout"


class PermitTimeoutError(SemaphoreError, TimeoutError):
    """No permit came within the ``timeout_ms`` of :meth:`SemaphoreQueue.permit
    <semaphore.client.SemaphoreQueue.permit>`. The request was withdrawn: nothing stays charged
    for it (a claim already sent is released when the holder answers it). Not a holder failure:
    the holder may be up and simply have no capacity free (its ``blocked`` reason says why).

    :ivar blocked: the holder's latest ``blocked`` entry for the key and group, if any."""

    code = "permit_timeout"

    def __init__(self, message: str, *, blocked: Any = None) -> None:
        super().__init__(message)
        self.blocked = blocked


class ConfigurationError(SemaphoreError, ValueError):
    """An option given to the library is invalid (raised at construction)."""

    code = "configuration"


_BY_CODE: dict[str, type[SemaphoreError]] = {
    cls.code: cls
    for cls in (RoundFailedError, HolderUnavailableError, SemaphoreTimeoutError, PermitTimeoutError,
                ConfigurationError)
}


def error_from_reply(reply: Any) -> SemaphoreError | None:
    """Return the typed exception for an error reply, or ``None`` if ``reply`` is not one."""
    if not isinstance(reply, dict) or "error" not in reply:
        return None
    error = reply.get("error")
    if not isinstance(error, dict):
        return SemaphoreError(f"malformed error reply: {error!r}")
    code = str(error.get("code", "error"))
    message = str(error.get("message", "")) or code
    field = error.get("field")
    if code == InvalidMessageError.code:
        reason = message
        prefix = f"{field}: "
        if field and reason.startswith(prefix):
            reason = reason[len(prefix):]
        return InvalidMessageError(str(field or ""), reason)
    cls = _BY_CODE.get(code, SemaphoreError)
    exc = cls(message, field=str(field) if field is not None else None)
    if cls is SemaphoreError:
        exc.code = code
    return exc
