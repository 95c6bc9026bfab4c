"""An operator's force-settle (issue 11): the one explicit exception to "never revoke".

:func:`decide_force_settle` declares a client gone for good: over a :class:`~.ledger.Ledger`
loaded with every grant and lease of that client, it frees what they charge (R19, R30) in a way
no later report of that client can undo or repeat (I2):

* each grant is deleted: its ``permits - released`` are freed; a later report of it is answered
  ``not_found`` and not applied (R14), so nothing is freed twice;
* each lease is stopped with ``drawn`` set to its ``released``: its footprint becomes 0 (R30),
  and since ``drawn`` is final once a lease is stopped (R31), a later report can raise neither
  ``drawn`` nor ``released`` past it; the client's next report of it is answered ``settled``
  (``released == drawn``) and the row deleted, so the client stops drawing from it.

Nothing here reads a clock or storage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .ledger import Ledger

__all__ = ["Settlement", "decide_force_settle", "decide_claim_expiry"]


@dataclass(frozen=True)
class Settlement:
    """What a force-settle freed: ``(id, group, permits)`` per grant and per lease."""

    client_id: str
    grants: tuple[tuple[str, str, int], ...] = ()
    leases: tuple[tuple[str, str, int], ...] = ()

    @property
    def grant_permits(self) -> int:
        """Grant permits freed (their ``permits - released``)."""
        return sum(n for _, _, n in self.grants)

    @property
    def lease_permits(self) -> int:
        """Lease footprint freed."""
        return sum(n for _, _, n in self.leases)


def decide_force_settle(ledger: Ledger, client_id: str) -> Settlement:
    """Free every grant and lease of ``client_id`` in ``ledger`` (see the module docs)."""
    grants = []
    for g in sorted((g for g in ledger.grants.values() if g.client_id == client_id), key=lambda g: g.grant_id):
        grants.append((g.grant_id, g.group_name, g.charge))
        ledger.delete_grant(g)
    leases = []
    for x in sorted((x for x in ledger.leases.values() if x.client_id == client_id), key=lambda x: x.lease_id):
        leases.append((x.lease_id, x.group_name, x.footprint))
        ledger.put_lease(replace(x, drawn=x.released, stopped=True, status="retired"))
    return Settlement(client_id, tuple(grants), tuple(leases))


def decide_claim_expiry(ledger: Ledger, stale: frozenset[str]) -> tuple[tuple[str, str, int], ...]:
    """Crash expiry (``claim_ttl_ms``, off by default): release the claimed permits of the
    ``stale`` clients (unheard of for ``claim_ttl_ms``) as if they had reported them released:
    ``released`` is raised to ``claimed`` (a high-water mark, R13, so a later report of that
    client frees nothing twice, I2); a grant released in full is deleted (R17). Unclaimed permits
    stay as they are (their deadline reclaims them, R15). Returns ``(grant id, group, permits
    freed)`` per grant changed."""
    freed = []
    for g in sorted((g for g in ledger.grants.values() if g.client_id in stale and g.claimed > g.released),
                    key=lambda g: g.grant_id):
        freed.append((g.grant_id, g.group_name, g.claimed - g.released))
        if g.claimed >= g.permits:
            ledger.delete_grant(g)
        else:
            ledger.put_grant(replace(g, released=g.claimed))
    return tuple(freed)
