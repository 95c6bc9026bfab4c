"""The per-key unit of work of a :class:`~semaphore.client.SemaphoreClient` (SPEC R35):
:meth:`SemaphoreClient.unit` returns a :class:`KeyUnit`, the same local changes (claim, release,
draw, release a draw, stop a lease) and reads of one key, run in the caller's storage
transaction, so a caller (the queue) commits them with its own rows. The row types and the merge
of a reply into them (R8, R13) live in :mod:`semaphore.core.client_state`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.client_state import GONE, ClientGrant, ClientLease, KeyState
from ._client_model import _SETTLED

if TYPE_CHECKING:
    from ._client import SemaphoreClient

__all__ = ["KeyUnit"]


class KeyUnit:
    """The unit of work of one key of a :class:`SemaphoreClient` (:meth:`SemaphoreClient.unit`).

    Its changes are local (reported with the next message, SPEC R13) and run in the caller's
    storage transaction: it opens none, so a caller composes them with its own writes in one
    ``client.storage.transaction(...)``. Outside a transaction each statement commits on its
    own; prefer the client's one-call methods (:meth:`SemaphoreClient.claim`, ...) then."""

    def __init__(self, client: SemaphoreClient, key: str) -> None:
        self.client = client
        self.key = key

    # ------------------------------------------------------------------ reads
    def grant(self, grant_id: str) -> ClientGrant | None:
        """One grant (tombstones included), or ``None``."""
        return self.client.grant(self.key, grant_id)

    def lease(self, lease_id: str) -> ClientLease | None:
        """One lease (tombstones included), or ``None``."""
        return self.client.lease(self.key, lease_id)

    def grants(self) -> list[ClientGrant]:
        """The live grants, earliest claim deadline first (:meth:`SemaphoreClient.grants`)."""
        return self.client.grants(self.key)

    def leases(self) -> list[ClientLease]:
        """The live leases, earliest expiry first (:meth:`SemaphoreClient.leases`)."""
        return self.client.leases(self.key)

    def state(self) -> KeyState:
        """The key's :class:`~semaphore.core.client_state.KeyState` (defaults if never used)."""
        return self.client.key_state(self.key)

    # ------------------------------------------------------------------ changes
    def claim(self, grant_id: str, count: int = 1) -> list[int]:
        """As :meth:`SemaphoreClient.claim`: the claimed slots, confirmed later (SPEC R15a)."""
        g = self.grant(grant_id)
        n = 0 if g is None or count <= 0 else min(count, g.unclaimed)
        if g is None or n <= 0:
            return []
        self.client._change_grant(self.key, grant_id, "claimed", g.claimed + n)
        return list(range(g.claimed + 1, g.claimed + n + 1))

    def release(self, grant_id: str, count: int = 1) -> int:
        """As :meth:`SemaphoreClient.release`: how many claimed permits were released."""
        n = self._releasable("grant", grant_id, count)
        if n > 0:
            g = self.grant(grant_id)
            assert g is not None
            self.client._change_grant(self.key, grant_id, "released", g.released + n)
        return n

    def _releasable(self, kind: str, permit_id: str, count: int) -> int:
        """How many of ``count`` permits of a grant (``kind`` ``"grant"``: confirmed, not
        released, SPEC R15a) or of a lease (``"lease"``: drawn, not released, R34) a release
        frees."""
        if count <= 0:
            return 0
        if kind == "grant":
            g = self.grant(permit_id)
            return 0 if g is None or g.status == GONE else min(count, g.releasable)
        x = self.lease(permit_id)
        return 0 if x is None or x.status == _SETTLED else min(count, x.in_use)

    def release_recorded(self, kind: str, permit_id: str) -> int:
        """Release one permit of a grant (``kind`` ``"grant"``) or a lease (``"lease"``), as
        :meth:`release` / :meth:`release_lease` do, for a caller that records the release itself
        in this transaction (the queue: ``release_n`` of the finished item, SPEC R35). Returns
        what to record, the row's new ``released`` count, while the row stays unwritten
        (:meth:`~semaphore.client._rows.ClientStore.record_release`); 0 when there is nothing to
        record (nothing to release, or the row was written)."""
        if self._releasable(kind, permit_id, 1) <= 0:
            return 0
        row = self.grant(permit_id) if kind == "grant" else self.lease(permit_id)
        assert row is not None
        released = row.released + 1
        recorded = self.client.rows.record_release(kind, self.key, permit_id, released, self.client._now())
        return released if recorded else 0

    def draw(self, lease_id: str, *, margin_ms: int = 0, now: int | None = None) -> int | None:
        """As :meth:`SemaphoreClient.draw` (SPEC R30, R34), judged at ``now`` (default: the
        client's clock): the drawn slot, or ``None``."""
        slots = self.draw_many(lease_id, 1, margin_ms=margin_ms, now=now)
        return slots[0] if slots else None

    def draw_many(self, lease_id: str, count: int, *, margin_ms: int = 0, now: int | None = None) -> list[int]:
        """:meth:`draw` ``count`` times, in one write: the slots drawn (fewer once the lease has
        none left to draw, none if it cannot be drawn from)."""
        lease = self.lease(lease_id)
        at = self.client._now() if now is None else now
        if lease is None or count <= 0 or not lease.drawable(at, margin_ms):
            return []
        n = min(count, lease.undrawn)
        self.client._change_lease(self.key, lease_id, "drawn", lease.drawn + n)
        return list(range(lease.drawn + 1, lease.drawn + n + 1))

    def release_lease(self, lease_id: str, count: int = 1) -> int:
        """As :meth:`SemaphoreClient.release_lease` (SPEC R34): how many were released."""
        n = self._releasable("lease", lease_id, count)
        if n > 0:
            lease = self.lease(lease_id)
            assert lease is not None
            self.client._change_lease(self.key, lease_id, "released", lease.released + n)
        return n

    _COUNTS = {"grant": ("claimed", "released"), "lease": ("drawn", "released", "stopped")}

    def _set_count(self, kind: str, row_id: str, column: str, value: int) -> None:
        """Write one count of a grant (``kind`` ``"grant"``) or lease (``"lease"``) as a step of
        the queue decided it (:mod:`semaphore.core.client_step`, which keeps within what the
        methods above allow); an unknown row is left alone."""
        assert column in self._COUNTS[kind], f"{kind} has no count {column!r}"
        if kind == "grant":
            self.client._change_grant(self.key, row_id, column, value)
        else:
            self.client._change_lease(self.key, row_id, column, value)

    def ask_holder(self) -> None:
        """As :meth:`SemaphoreClient.ask_holder`, in the caller's transaction: the key's next
        exchange goes at once."""
        self.client._touch_key(self.key, self.client._now(), needs_sync=1)

    def stop_lease(self, lease_id: str) -> bool:
        """As :meth:`SemaphoreClient.stop_lease` (SPEC R29, R37): False if already stopped or
        unknown."""
        lease = self.lease(lease_id)
        if lease is None or lease.stopped or lease.status == _SETTLED:
            return False
        self.client._change_lease(self.key, lease_id, "stopped", 1)
        return True
