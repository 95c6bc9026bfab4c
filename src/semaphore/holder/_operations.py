"""The holder's operations API (issue 11): who holds what, and an audited force-settle.

:meth:`DurabilitySemaphore.holders`, :meth:`~DurabilitySemaphore.force_settle` and
:meth:`~DurabilitySemaphore.audit` format what :class:`~._store.SqlStore` reads and run the
force-settle decision (:mod:`semaphore.core.settle`) with its audit record in one transaction.
"""

from __future__ import annotations

import json
from typing import Any

from ..core.config import option_int
from ..core.rows import GrantRow, LeaseRow
from ..core.wire import MAX_INT, id_problem
from ..errors import ConfigurationError
from ..runtime import Storage
from ._steps import run_force_settle
from ._store import SqlStore

__all__ = ["MAX_PAGE", "holders_page", "audit_page", "force_settle"]

#: Most entries one page of :func:`holders_page` or :func:`audit_page` returns.
MAX_PAGE = 1000
#: Longest ``reason`` (and ``actor``) a force-settle accepts, in characters.
MAX_REASON = 1000
#: Grants (and leases) an audit record lists by id; beyond, it keeps exact totals and counts
#: (a row must stay under the storage's 2 MB: a client may hold thousands of grants).
MAX_AUDIT_ENTRIES = 100


def _page_limit(limit: Any) -> int:
    value = option_int(limit, "limit", 1)
    if value > MAX_PAGE:
        raise ConfigurationError(f"limit: at most {MAX_PAGE}", field="limit")
    return value


def _grant_view(g: GrantRow) -> dict[str, Any]:
    return {"grantId": g.grant_id, "group": g.group_name, "permits": g.permits, "claimed": g.claimed,
            "released": g.released, "issuedAt": g.issued_at, "claimBy": g.claim_by,
            "status": "expired" if g.reclaimed else "active", "charged": g.charge}


def _lease_view(x: LeaseRow) -> dict[str, Any]:
    return {"leaseId": x.lease_id, "group": x.group_name, "permits": x.permits, "drawn": x.drawn,
            "released": x.released, "stopped": x.stopped, "issuedAt": x.issued_at, "expiresAt": x.expires_at,
            "status": x.status, "reusable": x.reusable, "charged": x.footprint}


def _client_label(row: dict[str, Any] | None) -> str | None:
    label = None if row is None else row.get("label")
    return label if isinstance(label, str) else None


def _last_report(row: dict[str, Any] | None) -> int | None:
    return None if row is None else int(row["last_report_at"])


def holders_page(store: SqlStore, cursor: Any, limit: Any) -> dict[str, Any]:
    """One page of clients holding grants or leases (see :meth:`DurabilitySemaphore.holders`)."""
    if cursor is not None and (not isinstance(cursor, str) or id_problem(cursor) is not None):
        raise ConfigurationError("cursor: must be None or the cursor of the previous page", field="cursor")
    size = _page_limit(limit)
    ids, grant_rows, lease_rows, seen = store.holder_page(cursor, size)
    grants: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
    leases: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
    for r in sorted(grant_rows, key=lambda r: str(r["grant_id"])):
        g = GrantRow.from_row(r)
        grants[g.client_id].append(_grant_view(g))
    for r in sorted(lease_rows, key=lambda r: str(r["lease_id"])):
        x = LeaseRow.from_row(r)
        leases[x.client_id].append(_lease_view(x))
    holders = [{"clientId": i, "label": _client_label(seen.get(i)), "lastReportAt": _last_report(seen.get(i)),
                "charged": sum(g["charged"] for g in grants[i]) + sum(x["charged"] for x in leases[i]),
                "grants": grants[i], "leases": leases[i]} for i in ids]
    return {"holders": holders, "cursor": ids[-1] if len(ids) == size else None}


def _audit_view(r: dict[str, Any]) -> dict[str, Any]:
    detail = json.loads(str(r["detail"]))
    return {"auditId": int(r["audit_id"]), "at": int(r["at"]), "action": str(r["action"]),
            "clientId": str(r["client_id"]), "reason": str(r["reason"]),
            "actor": None if r["actor"] is None else str(r["actor"]),
            "grantPermits": int(r["grant_permits"]), "leasePermits": int(r["lease_permits"]),
            "grants": detail.get("grants", []), "leases": detail.get("leases", []),
            "grantCount": int(detail.get("grantCount", len(detail.get("grants", [])))),
            "leaseCount": int(detail.get("leaseCount", len(detail.get("leases", []))))}


def audit_page(store: SqlStore, cursor: Any, limit: Any) -> dict[str, Any]:
    """One page of audit records, newest first (see :meth:`DurabilitySemaphore.audit`)."""
    if cursor is not None and (isinstance(cursor, bool) or not isinstance(cursor, int)
                               or not 1 <= cursor <= MAX_INT):
        raise ConfigurationError("cursor: must be None or the cursor of the previous page", field="cursor")
    size = _page_limit(limit)
    records = [_audit_view(r) for r in store.audit_page(cursor, size)]
    return {"records": records, "cursor": records[-1]["auditId"] if len(records) == size else None}


def _text(value: Any, name: str, *, optional: bool) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_REASON:
        raise ConfigurationError(f"{name}: must be a non-empty string of at most {MAX_REASON} characters",
                                 field=name)
    return value


def force_settle(storage: Storage, store: SqlStore, now: int, client_id: Any, reason: Any,
                 actor: Any) -> dict[str, Any]:
    """Free every grant and lease of ``client_id`` and write the audit record, in one
    transaction (see :meth:`DurabilitySemaphore.force_settle`). Returns the record."""
    problem = id_problem(client_id)
    if problem is not None:
        raise ConfigurationError(f"client_id: {problem}", field="client_id")
    why = _text(reason, "reason", optional=False)
    who = _text(actor, "actor", optional=True)
    assert why is not None

    def body() -> int:
        s = run_force_settle(store, client_id)
        detail = {"grants": [{"grantId": i, "group": g, "permits": n} for i, g, n in s.grants[:MAX_AUDIT_ENTRIES]],
                  "leases": [{"leaseId": i, "group": g, "permits": n} for i, g, n in s.leases[:MAX_AUDIT_ENTRIES]],
                  "grantCount": len(s.grants), "leaseCount": len(s.leases)}
        return store.write_audit(now, "force_settle", client_id, why, who, s.grant_permits, s.lease_permits, detail)

    audit_id = storage.transaction(body)
    row = store.audit_page(audit_id + 1, 1)[0]
    return _audit_view(row)
