"""Wire message builders for tests: :func:`request` and :func:`sync` build the messages a client
sends (SPEC §3) from short tuples; :func:`by_id` and :func:`blocked` read replies."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["request", "sync", "by_id", "blocked"]


def _demand(demand: Mapping[str, int] | Iterable[Any], oldest_at: int) -> list[dict[str, Any]]:
    if isinstance(demand, Mapping):
        return [{"group": g, "count": c, "oldestAt": oldest_at} for g, c in demand.items()]
    out = []
    for d in demand:
        if isinstance(d, Mapping):
            out.append(dict(d))
        elif len(d) == 2:
            out.append({"group": d[0], "count": d[1], "oldestAt": oldest_at})
        else:
            out.append({"group": d[0], "count": d[1], "oldestAt": d[2]})
    return out


def _grants(grants: Iterable[Any]) -> list[dict[str, Any]]:
    return [
        dict(g) if isinstance(g, Mapping) else {"grantId": g[0], "claimed": g[1], "released": g[2]}
        for g in grants
    ]


def _leases(leases: Iterable[Any] | None) -> list[dict[str, Any]] | None:
    if leases is None:
        return None
    return [
        dict(x) if isinstance(x, Mapping)
        else {"leaseId": x[0], "drawn": x[1], "released": x[2], "stopped": x[3] if len(x) > 3 else False}
        for x in leases
    ]


def _with_leases(message: dict[str, Any], leases: Iterable[Any] | None, label: str | None = None) -> dict[str, Any]:
    lease_list = _leases(leases)
    if lease_list is not None:
        message["leases"] = lease_list
    if label is not None:
        message["label"] = label
    return message


def request(
    client_id: str,
    demand: Mapping[str, int] | Iterable[Any] = (),
    grants: Iterable[Any] = (),
    leases: Iterable[Any] | None = None,
    *,
    oldest_at: int = 0,
    label: str | None = None,
) -> dict[str, Any]:
    """A ``request`` message (SPEC §3).

    ``demand`` is ``{group: count}`` (all waiting since ``oldest_at``) or a list of
    ``(group, count)``, ``(group, count, oldestAt)`` or dicts; ``grants`` a list of
    ``(grantId, claimed, released)`` or dicts; ``leases`` ``None`` (the client does not support
    leases: no ``leases`` field) or a list of ``(leaseId, drawn, released[, stopped])`` or dicts;
    ``label`` the client's label (``None``: no ``label`` field). For example::

        >>> request("c1", {"g": 2})["demand"]
        [{'group': 'g', 'count': 2, 'oldestAt': 0}]
    """
    message: dict[str, Any] = {
        "type": "request",
        "v": 1,
        "clientId": client_id,
        "demand": _demand(demand, oldest_at),
        "grants": _grants(grants),
    }
    return _with_leases(message, leases, label)


def sync(client_id: str, grants: Iterable[Any] = (), leases: Iterable[Any] | None = None, *,
         label: str | None = None) -> dict[str, Any]:
    """A ``sync`` message (reports only, answered at once); ``grants``, ``leases`` and ``label``
    as for :func:`request`."""
    message: dict[str, Any] = {"type": "sync", "v": 1, "clientId": client_id, "grants": _grants(grants)}
    return _with_leases(message, leases, label)


def by_id(reply: Mapping[str, Any], kind: str = "grants") -> dict[str, dict[str, Any]]:
    """``reply["grants"]`` (or ``reply["leases"]`` with ``kind="leases"``) keyed by id."""
    key = "grantId" if kind == "grants" else "leaseId"
    return {x[key]: x for x in reply[kind]}


def blocked(reply: Mapping[str, Any]) -> dict[str, tuple[str, int]]:
    """``{group: (reason, waiting)}`` of a reply's ``blocked`` list."""
    return {b["group"]: (b["reason"], b["waiting"]) for b in reply["blocked"]}
