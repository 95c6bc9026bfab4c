"""The holder's round record: one structured record per round, logged and handed to a hook.

After every round the holder builds a :class:`RoundRecord` from what the round already has (the
:class:`~semaphore.core.rounds.RoundOutcome` of its decision, the statements its transaction ran,
its wall time; no extra SQL), logs it as one JSON line at ``INFO`` on the logger
``semaphore.round`` and passes it to the application's ``on_round`` callable, if any. A failed
round (its transaction rolled back, or its limits could not be resolved) gets a record too, with
``failed`` and ``error``. Neither the log nor the hook can change the round: an exception from the
hook is logged (``semaphore.round``, ``ERROR``) and dropped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.rounds import RoundOutcome

__all__ = ["RoundRecord", "OnRound", "round_record", "failed_record", "emit"]

log = logging.getLogger("semaphore.round")

#: The ``on_round=`` option of :class:`~semaphore.DurabilitySemaphore`: a synchronous callable
#: taking the :class:`RoundRecord` of every round (its return value is ignored).
OnRound = Callable[["RoundRecord"], Any]


@dataclass(frozen=True, kw_only=True)
class RoundRecord:
    """What one round did (see :meth:`to_dict` for its JSON form).

    :ivar at: when the round began (the holder's clock, epoch ms).
    :ivar duration_ms: wall time from the round taking its batch to its commit (or failure), ms.
    :ivar requests: clients in the round (each with its latest demand, SPEC R10).
    :ivar admitted: permits granted in the round's new grants; ``grants_issued`` how many grants.
    :ivar leases_issued: new leases; ``lease_permits_issued`` their permits.
    :ivar leases_retired: leases that stopped being live in the round (TTL, ineligible, stopped).
    :ivar blocked: blocked reason -> permits left waiting (the round's ``blocked`` entries, R23).
    :ivar sql_statements: SQL statements the round's transaction ran.
    :ivar charged: charged capacity after the round (``None`` if it failed); ``limit`` the limit
        it ran under (``None`` when not resolved).
    :ivar contended: the round's R29 flag.
    :ivar failed: the round was not committed; ``error`` says why.
    """

    at: int
    duration_ms: float
    requests: int
    admitted: int = 0
    grants_issued: int = 0
    leases_issued: int = 0
    lease_permits_issued: int = 0
    leases_retired: int = 0
    blocked: Mapping[str, int] = field(default_factory=dict)
    sql_statements: int = 0
    charged: int | None = None
    limit: int | None = None
    contended: bool = False
    failed: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON-ready camelCase keys: ``at``, ``durationMs``, ``requests``,
        ``admitted``, ``grantsIssued``, ``leasesIssued``, ``leasePermitsIssued``,
        ``leasesRetired``, ``blocked`` ({reason: waiting}), ``sqlStatements``, ``charged``,
        ``limit``, ``contended``, ``failed``, ``error``."""
        return {
            "at": self.at, "durationMs": self.duration_ms, "requests": self.requests,
            "admitted": self.admitted, "grantsIssued": self.grants_issued,
            "leasesIssued": self.leases_issued, "leasePermitsIssued": self.lease_permits_issued,
            "leasesRetired": self.leases_retired, "blocked": dict(self.blocked),
            "sqlStatements": self.sql_statements, "charged": self.charged, "limit": self.limit,
            "contended": self.contended, "failed": self.failed, "error": self.error,
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as one line of compact JSON (what the ``semaphore.round`` log line is)."""
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=False)


def round_record(at: int, duration_ms: float, sql_statements: int, outcome: RoundOutcome) -> RoundRecord:
    """The record of a committed round, from its decision's :class:`RoundOutcome`."""
    return RoundRecord(
        at=at, duration_ms=round(duration_ms, 3), requests=outcome.requests, admitted=outcome.admitted,
        grants_issued=outcome.grants_issued, leases_issued=outcome.leases_issued,
        lease_permits_issued=outcome.lease_permits_issued, leases_retired=outcome.leases_retired,
        blocked=dict(outcome.blocked), sql_statements=sql_statements, charged=outcome.charged,
        limit=outcome.limit, contended=outcome.contended,
    )


def failed_record(at: int, duration_ms: float, sql_statements: int, requests: int, limit: Any,
                  error: BaseException) -> RoundRecord:
    """The record of a round that was not committed (``error``: why; nothing was written)."""
    return RoundRecord(
        at=at, duration_ms=round(duration_ms, 3), requests=requests, sql_statements=sql_statements,
        limit=limit if type(limit) is int else None, failed=True,
        error=f"{type(error).__name__}: {error}" if str(error) else type(error).__name__,
    )


def emit(record: RoundRecord, on_round: OnRound | None) -> None:
    """Log ``record`` (one JSON line at ``INFO`` on ``semaphore.round``; ``WARNING`` for a failed
    round) and pass it to ``on_round``; never raises (a failing hook is logged)."""
    level = logging.WARNING if record.failed else logging.INFO
    if log.isEnabledFor(level):  # handler errors are the logging module's (handleError)
        log.log(level, record.to_json())
    if on_round is None:
        return
    try:
        on_round(record)
    except Exception:
        log.exception("on_round raised; the round is not affected")
