"""SPEC R13: cumulative counts are high-water marks (the one helper the holder and the client
both use to merge a report or a reply into what they hold)."""

from __future__ import annotations

__all__ = ["raise_counts"]


def raise_counts(used: int, released: int, reported_used: int, reported_released: int,
                 cap: int) -> tuple[int, int]:
    """Merge a cumulative ``(used, released)`` pair (claimed/released of a grant, drawn/released
    of a lease) with a reported one (SPEC R13): each count only rises, ``used`` never above
    ``cap`` (the grant's or lease's permits) and ``released`` never above ``used``. Lost,
    repeated or reordered reports therefore never free capacity twice (I2)."""
    new_used = min(max(used, reported_used), cap)
    return new_used, min(max(released, reported_released), new_used)
