"""Verifiable lease ids (SPEC R32): issuing them, verifying them, and the round's charge for
reports of leases the holder does not know.

Every lease id is ``<nonce>.<epoch>.<permits>.<mac>``: the nonce from the holder's
``id_factory``, the storage epoch (8 hex digits, 32 random bits drawn with the storage's lease-id
state), the lease's permits (decimal; followed by ``r`` for a reusable lease, R34a) and the first
32 hex digits of HMAC-SHA256 over the client id, nonce, epoch and permits field under
``lease_secret`` (keyed per holder) or the per-storage secret (meta rows ``lease_key_0..7``).
Pure: the callers pass the secret, the meta rows and the factories.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from ..errors import ConfigurationError
from .config import LeaseConfig
from .wire import MAX_ID_LENGTH, id_problem

__all__ = [
    "LeaseIdParts", "LEASE_NONCE_MAX", "LEASE_SECRET_MIN_BYTES", "LEASE_KEY_PREFIX", "LEASE_KEY_WORDS",
    "LEASE_EPOCH_KEY", "REUSABLE_MARK", "holder_key", "lease_id_for", "verified_lease_id", "configured_secret",
    "stored_secret", "stored_epoch", "issuing_key", "new_lease_id", "unknown_lease_charge", "unknown_footprint",
]

#: Meta rows holding the holder's per-storage lease-id secret (used when no ``lease_secret`` is
#: configured): 8 words of 32 bits (32 random bytes). Meta values are integers, and 32-bit words
#: cross the JavaScript boundary of Durable Object SQL exactly (a JS number holds integers below
#: 2**53 only).
LEASE_KEY_PREFIX = "lease_key_"
LEASE_KEY_WORDS = 8
#: Meta row holding the storage epoch: a random 32-bit number drawn with the storage's lease-id
#: state (first lease-issuing round), so a fresh or reset storage gets a new one. Every lease id
#: carries the epoch it was issued in: a verified unknown id of the current epoch is a lease this
#: storage settled, one of another epoch was issued before a storage reset (SPEC R32).
LEASE_EPOCH_KEY = "lease_epoch"
LEASE_EPOCH_CHARS = 8  # 32 bits, lower-case hex
#: Hex characters of the truncated HMAC-SHA256 that ends every lease id (128 bits).
LEASE_MAC_CHARS = 32
#: Decimal digits of the permits field: a lease carries fewer than 2**53 permits (R7). A reusable
#: lease's field ends in :data:`REUSABLE_MARK` besides (R32 decision): an id longer than the
#: wire's 256 characters (a reusable lease of 10**15 permits or more under a nonce of the longest
#: length) is refused at issue.
LEASE_PERMITS_CHARS = 16
#: The mark after the permits of a reusable lease's id (R32: a reset storage charges it as one
#: whatever the holder's ``reusable`` option is by then). Ids without it (every id of the
#: previous release, and one-shot leases) verify as before.
REUSABLE_MARK = "r"
#: Longest nonce ``id_factory`` may return for a lease: the holder appends
#: ``"." + epoch + "." + permits + "." + mac`` (at most 59 characters) and the id must stay
#: within the wire's 256 characters (R7).
LEASE_NONCE_MAX = MAX_ID_LENGTH - (3 + LEASE_EPOCH_CHARS + LEASE_PERMITS_CHARS + LEASE_MAC_CHARS)
#: Fewest bytes (UTF-8 for a ``str``) a configured ``lease_secret`` must have.
LEASE_SECRET_MIN_BYTES = 16
_LEASE_MAC_DOMAIN = b"durability-semaphore/lease-id/v2\0"
_EPOCH_DOMAIN = b"durability-semaphore/storage-epoch/v1\0"
_EPOCH_FIELD = re.compile(r"[0-9a-f]{8}")
_PERMITS_FIELD = re.compile(r"[1-9][0-9]{0,15}r?")
_MAC_FIELD = re.compile(r"[0-9a-f]{32}")


class LeaseIdParts(NamedTuple):
    """The fields of a lease id (SPEC R32): ``<nonce>.<epoch>.<permits>.<mac>``; ``reusable``:
    the permits field carries the reusable mark (R34a)."""

    nonce: str
    epoch: int
    permits: int
    reusable: bool = False


def stored_secret(meta: Mapping[str, int]) -> bytes | None:
    """The per-storage lease-id secret stored in ``meta`` (the rows already loaded by the round),
    or ``None`` if this storage never issued a lease without ``lease_secret`` (or was reset)."""
    words: list[int] = []
    for i in range(LEASE_KEY_WORDS):
        w = meta.get(f"{LEASE_KEY_PREFIX}{i}")
        if w is None or not 0 <= w < 2**32:
            return None
        words.append(w)
    return b"".join(int(w).to_bytes(4, "big") for w in words)


def stored_epoch(meta: Mapping[str, int]) -> int | None:
    """The storage epoch stored in ``meta``, or ``None`` if this storage never issued a lease."""
    epoch = meta.get(LEASE_EPOCH_KEY)
    return epoch if epoch is not None and 0 <= epoch < 2**32 else None


def _epoch_from(seed: bytes) -> int:
    # One-way: the epoch is public (in every id) and may come from the same seed as the secret.
    return int.from_bytes(hashlib.sha256(_EPOCH_DOMAIN + seed).digest()[:4], "big")


def holder_key(secret: bytes, object_id: str) -> bytes:
    """The MAC key of one holder under the application's ``lease_secret``: HMAC of the holder
    object's id (``ctx.id``), so holders sharing one secret (one per key) never accept each
    other's lease ids, while a holder whose storage was reset (same id) still does (R32)."""
    return hmac.new(secret, b"durability-semaphore lease key\0" + object_id.encode("utf-8"),
                    hashlib.sha256).digest()


def configured_secret(value: Any) -> bytes | None:
    """The ``lease_secret`` option as bytes (``str`` as UTF-8), validated."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            key = value.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigurationError("lease_secret: must encode as UTF-8", field="lease_secret") from None
    elif isinstance(value, bytes):
        key = value
    else:
        raise ConfigurationError("lease_secret: expected a str, bytes or None", field="lease_secret")
    if len(key) < LEASE_SECRET_MIN_BYTES:
        raise ConfigurationError(
            f"lease_secret: must have at least {LEASE_SECRET_MIN_BYTES} bytes (use a random "
            f"application secret, e.g. a Worker secret binding)", field="lease_secret")
    return key


def _lease_mac(secret: bytes, client_id: str, nonce: str, epoch: str, permits: str) -> str:
    # Client ids and nonces cannot contain NUL (wire.id_problem), epoch and permits are hex and
    # decimal digits: the NUL-separated message is unambiguous.
    fields = (client_id, nonce, epoch, permits)
    message = _LEASE_MAC_DOMAIN + b"\0".join(f.encode("utf-8", "surrogatepass") for f in fields)
    return hmac.new(secret, message, hashlib.sha256).hexdigest()[:LEASE_MAC_CHARS]


def lease_id_for(secret: bytes, client_id: str, nonce: str, epoch: int, permits: int,
                 reusable: bool = False) -> str:
    """The lease id the holder issues to ``client_id``: ``<nonce>.<epoch>.<permits>.<mac>``, with
    ``epoch`` the storage epoch in 8 hex digits, ``permits`` the lease's permits in decimal
    (followed by :data:`REUSABLE_MARK` for a ``reusable`` lease) and ``mac`` the first 32 hex
    digits of HMAC-SHA256(secret, domain + clientId, nonce, epoch and permits field,
    NUL-separated) (SPEC R32)."""
    e, p = f"{epoch:08x}", str(permits) + (REUSABLE_MARK if reusable else "")
    return f"{nonce}.{e}.{p}.{_lease_mac(secret, client_id, nonce, e, p)}"


def _split_lease_id(lease_id: str) -> tuple[str, str, str, str] | None:
    """``(nonce, epoch, permits, mac)`` of an id of the lease-id shape, else ``None``."""
    parts = lease_id.rsplit(".", 3)
    if len(parts) != 4:
        return None
    nonce, epoch, permits, mac = parts
    if not (nonce and _EPOCH_FIELD.fullmatch(epoch) and _PERMITS_FIELD.fullmatch(permits)
            and _MAC_FIELD.fullmatch(mac)):
        return None
    return nonce, epoch, permits, mac


def _mac_matches(secret: bytes, client_id: str, fields: tuple[str, str, str, str]) -> bool:
    nonce, epoch, permits, mac = fields  # constant-time comparison of the mac
    expected = _lease_mac(secret, client_id, nonce, epoch, permits)
    return hmac.compare_digest(expected.encode("ascii"), mac.encode("ascii"))


def verified_lease_id(secret: bytes, client_id: str, lease_id: str) -> LeaseIdParts | None:
    """The fields of ``lease_id`` if it is one issued under ``secret`` to ``client_id``, else
    ``None``: a fabricated id, another client's id, or one issued under another secret (a
    per-storage secret before a reset) or in an earlier format does not verify."""
    fields = _split_lease_id(lease_id)
    if fields is None or not _mac_matches(secret, client_id, fields):
        return None
    permits, reusable = _permits_field(fields[2])
    return LeaseIdParts(fields[0], int(fields[1], 16), permits, reusable)


def _permits_field(value: str) -> tuple[int, bool]:
    reusable = value.endswith(REUSABLE_MARK)
    return int(value[:-1] if reusable else value), reusable


def _pre_reset_permits(secret: bytes, client_id: str, lease_id: str, epoch: int | None) -> tuple[int, bool]:
    """SPEC R32: the permits of ``lease_id`` and whether it is marked reusable, if it verifies
    for ``client_id`` and was issued in another epoch than ``epoch`` (the storage's, ``None``
    before its first lease), else ``(0, False)``. The epoch is compared before the mac is
    computed: a replayed id of this storage costs no HMAC."""
    fields = _split_lease_id(lease_id)
    if fields is None or (epoch is not None and int(fields[1], 16) == epoch):
        return 0, False
    return _permits_field(fields[2]) if _mac_matches(secret, client_id, fields) else (0, False)


def issuing_key(meta: Mapping[str, int], app_secret: bytes | None,
                new_secret: Callable[[], bytes]) -> tuple[bytes, int, dict[str, int]]:
    """The lease-id secret and storage epoch to issue under, and the meta rows to write for them
    (SPEC R32). Created on first use: one call of ``new_secret`` (32 random bytes; randomness at
    import time is forbidden in Workers) gives the per-storage secret (kept only without
    ``lease_secret``, rows ``lease_key_0..7``) and the epoch (row ``lease_epoch``), written by the
    round's own meta upsert (a round that fails writes none, and its leases are not written
    either). Call once per round that issues leases."""
    secret, epoch = app_secret or stored_secret(meta), stored_epoch(meta)
    writes: dict[str, int] = {}
    if secret is not None and epoch is not None:
        return secret, epoch, writes
    seed = new_secret()
    if not isinstance(seed, bytes) or len(seed) != 4 * LEASE_KEY_WORDS:
        raise ConfigurationError(f"secret_factory: must return {4 * LEASE_KEY_WORDS} bytes",
                                 field="secret_factory")
    if secret is None:
        secret = seed
        for i in range(LEASE_KEY_WORDS):
            writes[f"{LEASE_KEY_PREFIX}{i}"] = int.from_bytes(seed[4 * i:4 * i + 4], "big")
    if epoch is None:
        epoch = _epoch_from(seed)
        writes[LEASE_EPOCH_KEY] = epoch
    return secret, epoch, writes


def new_lease_id(nonce: str, key: tuple[bytes, int], client_id: str, permits: int, reusable: bool = False) -> str:
    """A new lease id (SPEC R32, R7) with ``nonce`` (from ``id_factory``), which must be a wire
    id of at most :data:`LEASE_NONCE_MAX` characters (else :class:`ConfigurationError`)."""
    problem = id_problem(nonce)
    if problem is None and len(nonce) > LEASE_NONCE_MAX:
        problem = f"must be at most {LEASE_NONCE_MAX} characters, got {len(nonce)}"
    if problem is not None:
        raise ConfigurationError(
            f"id_factory: a lease id's nonce {problem} (the holder appends the epoch, permits "
            f"and mac, at most {MAX_ID_LENGTH - LEASE_NONCE_MAX} characters)", field="id_factory")
    lease_id = lease_id_for(key[0], client_id, nonce, key[1], permits, reusable)
    if len(lease_id) > MAX_ID_LENGTH:  # only a lease of 2**53 permits or more (R7 forbids it)
        raise ConfigurationError(f"leases: a lease of {permits} permits cannot be issued", field="leases")
    return lease_id


def unknown_lease_charge(unknown: Mapping[str, Mapping[str, tuple[int, int, bool]]], meta: Mapping[str, int],
                         app_secret: bytes | None, leases: LeaseConfig | None, ceiling: int | None) -> int:
    """SPEC R32: a round's transient charge for reports of leases the holder does not know
    (``unknown``: client id -> {lease id: the report's merged ``(drawn, released, stopped)``}).

    Charged: a report whose id verifies for the reporting client and carries an epoch other
    than this storage's (a lease issued before a storage reset, under ``lease_secret``; its
    client may still run its work), :func:`unknown_footprint` of it. Not charged:
    an id of the current epoch (a lease this storage issued and settled: a replay of it would
    withhold capacity forever and protect nothing), a fabricated id, another client's id, or one
    under another secret (the per-storage secret of a reset storage, an earlier format). Bounds
    (decision): at most ``permitsPerLease`` per client per round, ``ceiling`` in total (the
    limit's lease ceiling, ``None`` when the limit is unresolved), and nothing when leases are
    not configured."""
    if leases is None or not any(unknown.values()):
        return 0
    secret = app_secret or stored_secret(meta)
    if secret is None:  # no lease_secret and this storage never issued a lease
        return 0
    epoch = stored_epoch(meta)  # None: no lease issued since this storage was created
    cap = leases.permits_per_lease
    total = 0
    for client_id, reports in unknown.items():
        charge = 0
        for lease_id, report in reports.items():
            if charge >= cap:  # no more macs to check for this client (at most 1,000 ids)
                break
            drawn, released, stopped = report
            if not stopped or drawn > released:  # else nothing to charge: no mac to check
                permits, marked = _pre_reset_permits(secret, client_id, lease_id, epoch)
                # R32 decision: an id marked reusable charges as one whatever the option says
                # now; an unmarked one (one-shot, or issued before the mark) as the option says
                charge += unknown_footprint(report, permits, marked or leases.reusable)
        total += min(charge, cap)
    return total if ceiling is None else min(total, ceiling)


def unknown_footprint(report: tuple[int, int, bool], permits: int, reusable: bool) -> int:
    """SPEC R32: what an unknown lease of ``permits`` may run, from its merged report
    ``(drawn, released, stopped)``: once stopped, ``drawn - released`` (final, R30); before, its
    client may draw more until it hears ``retired`` (beside its request, R34a), so the count says
    nothing of what runs by then: ``permits - released`` (R30: a one-shot lease never runs more),
    or every permit of a ``reusable`` one (R30a: ``released`` bounds nothing; the id's mark, or
    an unmarked id while the holder issues reusable leases).
    Never above ``permits``."""
    drawn, released, stopped = report
    if stopped:
        return max(0, min(drawn - released, permits))
    return permits if reusable else max(0, permits - released)
