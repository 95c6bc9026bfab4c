"""The wire builders (``semaphore.core.wire.grant_state`` & co.) are the one encoding of every
reply shape (SPEC R8): the holder builds replies with them directly, and the typed dataclasses
encode through them. Checked here against the dataclasses, field by field, and round-tripped
through ``from_wire``."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from semaphore.core.wire import (
    Blocked,
    BlockedReason,
    GrantState,
    GrantStatus,
    LeaseState,
    LeaseStatus,
    PermitResponse,
    blocked_entry,
    grant_state,
    lease_state,
    permit_response,
)

ids = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)
counts = st.integers(0, 2**53 - 1)
times = st.none() | counts

grants = st.builds(GrantState, ids, st.none() | ids, counts, counts, counts, times, st.sampled_from(GrantStatus))
leases = st.builds(LeaseState, ids, st.none() | ids, counts, counts, counts, times, st.sampled_from(LeaseStatus))
blocks = st.builds(Blocked, ids, st.sampled_from(BlockedReason), counts)


@given(grants)
def test_r8_grant_state_builder_is_the_dataclass_encoding(g: GrantState):
    wire = grant_state(g.grant_id, g.group, g.permits, g.claimed, g.released, g.claim_by, g.status.value)
    assert wire == g.to_wire()
    assert set(wire) == {"grantId", "group", "permits", "claimed", "released", "claimBy", "status"}
    assert GrantState.from_wire(wire) == g


@given(leases)
def test_r8_lease_state_builder_is_the_dataclass_encoding(x: LeaseState):
    wire = lease_state(x.lease_id, x.group, x.permits, x.drawn, x.released, x.expires_at, x.status.value)
    assert wire == x.to_wire()
    assert set(wire) == {"leaseId", "group", "permits", "drawn", "released", "expiresAt", "status"}
    assert LeaseState.from_wire(wire) == x


@given(st.lists(grants, max_size=3), st.lists(leases, max_size=3), st.lists(blocks, max_size=3), st.booleans(),
       counts)
def test_r8_permit_response_builder_is_the_dataclass_encoding(gs, xs, bs, contended, next_at):
    response = PermitResponse(tuple(gs), tuple(xs), tuple(bs), contended, next_at)
    wire = permit_response([g.to_wire() for g in gs], [x.to_wire() for x in xs],
                           [blocked_entry(b.group, b.reason.value, b.waiting) for b in bs], contended, next_at)
    assert wire == response.to_wire()
    assert wire["v"] == 1 and set(wire) == {"v", "grants", "leases", "blocked", "contended", "nextRequestAt"}
    assert PermitResponse.from_wire(wire) == response
