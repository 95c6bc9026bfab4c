"""When the holder rewrites a client's row of ``durability_semaphore_clients`` (SPEC R38
decision "last seen"): only when something it records changes, so a sync that changes nothing
commits no write (a Durable Object call that writes is answered only after its commit)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ClientSeen", "LAST_SEEN_REFRESH_MS", "clients_to_record"]

#: How stale a stored ``last_report_at`` may get before a report that changes nothing else
#: rewrites it: ``holders()`` shows when a client was last heard from to within this much.
LAST_SEEN_REFRESH_MS = 60_000


@dataclass(frozen=True)
class ClientSeen:
    """A client's stored row: when it last reported, whether it holds claimed, unreleased
    permits, when those may expire (crash expiry; ``None``: never), and its label."""

    last_report_at: int
    claims: bool
    expires_at: int | None
    label: str | None


def clients_to_record(stored: Mapping[str, ClientSeen], holding: Sequence[str], idle: Sequence[str],
                      claiming: frozenset[str], now: int, claim_ttl_ms: int | None,
                      labels: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """Of the clients that reported at ``now``, those whose row to write (``holding``: they hold
    a grant or a lease) and those whose row to delete (``idle``: they hold nothing): a row is
    written when it is missing, its ``claims`` flag or label changes, its crash expiry moves
    (``claim_ttl_ms`` set and the client claiming: ``now + claim_ttl_ms``) or is turned off, or
    its ``last_report_at`` is :data:`LAST_SEEN_REFRESH_MS` old; deleted only when it exists."""
    write = []
    for c in holding:
        row = stored.get(c)
        claims = c in claiming
        if row is None or row.claims != claims or (claim_ttl_ms is not None and claims) \
                or (claim_ttl_ms is None and row.expires_at is not None) \
                or (c in labels and labels[c] != row.label) or now - row.last_report_at >= LAST_SEEN_REFRESH_MS:
            write.append(c)
    return write, [c for c in idle if c in stored]
