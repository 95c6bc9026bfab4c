"""Tier 1: the SQL store and the in-memory store are interchangeable under the pure core (issue 9).

One Hypothesis state machine runs the same sequence of decisions of :mod:`semaphore.core.rounds`
against :class:`semaphore.holder._store.SqlStore` over real SQLite (``LocalStorage`` through the
:class:`semaphore.runtime.Storage` adapter, every decision inside ``storage.transaction`` as the
holder runs it) and against :class:`semaphore.testing._memory_store.MemoryStore`:

* rounds of one to three clients, each with one or two requests (R10) carrying random demand and
  random cumulative reports: for its own grants and leases, other clients' (R14), ids nobody
  issued, stopped leases (R30), with and without lease support (R5);
* syncs (R6), the reclaim alarm (R16), time advancing past claim deadlines and lease TTLs (R15,
  R31), the limit and group limits moving, failing to resolve (R12), ``canGrant`` flips (R22,
  R33), the lease configuration switched between every provisioning mode and off (R25, R27),
  with and without ``lease_secret``, and storage resets (both stores emptied; lease ids of the
  earlier epoch come back as reports, R32);
* random :class:`~semaphore.core.ledger.Reads` loaded from both.

Checked at every step: the limits resolved from each store, the reads each decision asks for and
the snapshot each store loads for them (rows, group aggregates, meta) are identical; replies are
identical (the order of the reply's list of other grants and leases, which follows the load
order, is not part of the contract: lists are compared sorted by id); and afterwards the whole
state (every row, group aggregate and meta row), ``next_reclaim_due``, ``live_lease_pairs``,
``groups_with_live_leases`` and ``group_rows`` are identical, and both stores' aggregates equal a
recomputation from their rows (R19, R38). Grant and lease ids come from deterministic factories
(one per store, same sequence), with non-ASCII characters so the SQL store's JSON bindings are
exercised.

Examples: ``STORE_CONTRACT_EXAMPLES`` (default 60, 40 steps), derandomized.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from semaphore.core.allocation import LIMIT_ERROR
from semaphore.core.config import LeaseConfig
from semaphore.core.ledger import Ledger, NotLoadedError, Reads, Snapshot
from semaphore.core.rounds import Limits, Pending, Policy, RoundOutcome, decide_sync, round_reads, sync_reads
from semaphore.core.rows import AGGREGATES, GrantRow, LeaseRow
from semaphore.core.wire import Demand, GrantReport, PermitRequest, SyncMessage, parse_message
from semaphore.holder._store import GRANTS, GROUPS, LEASES, SqlStore, drop_schema, ensure_schema, read_meta
from semaphore.runtime import Storage
from semaphore.testing import LocalContext, LocalStorage, check_aggregates
from semaphore.testing._memory_store import (
    MemoryStore,
    StoreState,
    resolve_limits,
    run_reclaim,
    run_round,
    run_sync,
)

T0 = 1_700_000_000_000
TTL = 20_000
CLIENTS = ("c0", "c1", "\U0001f600 c2", "e\u0301")
GROUPS_ = ("g0", "g1", "\u00e9", "bulk x")
LEASE_CONFIGS: tuple[LeaseConfig | None, ...] = (
    None,
    LeaseConfig.parse({"provisioning": {"mode": "strict"}, "permitsPerLease": 3, "ttlMs": TTL}),
    LeaseConfig.parse({"provisioning": {"mode": "under", "reserve": 3}, "permitsPerLease": 2, "ttlMs": TTL}),
    LeaseConfig.parse({"provisioning": {"mode": "over", "extra": {"ratio": 0.5}}, "permitsPerLease": 3,
                       "ttlMs": TTL // 2}),
    LeaseConfig.parse({"provisioning": {"mode": "over", "extra": {"count": 2}}, "permitsPerLease": 2,
                       "ttlMs": TTL, "limitedGroups": "withinGroupLimit"}),
    LeaseConfig.parse({"provisioning": {"mode": "strict"}, "permitsPerLease": 4, "ttlMs": TTL,
                       "limitedGroups": "withinGroupLimit"}),
)
APP_SECRET = hashlib.sha256(b"contract holder key").digest()

SETTINGS = settings(
    max_examples=int(os.environ.get("STORE_CONTRACT_EXAMPLES", "60")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    derandomize=True,
)


# ----------------------------------------------------------------------------- the two sides
class Side:
    """One store with its own deterministic id and secret factories (the same sequence on
    both sides as long as both make the same decisions)."""

    def __init__(self, sql: bool) -> None:
        self.ids = itertools.count()
        self.seeds = itertools.count()
        self.storage: Storage | None = None
        if sql:
            self.storage = Storage(LocalContext(LocalStorage()))
            ensure_schema(self.storage)
            self.store: SqlStore | MemoryStore = SqlStore(self.storage)
        else:
            self.store = MemoryStore()

    def new_id(self) -> str:
        return f"\u00e9-{next(self.ids)}"

    def new_secret(self) -> bytes:
        return hashlib.sha256(f"seed {next(self.seeds)}".encode()).digest()

    def run(self, fn: Callable[[], Any]) -> Any:
        """``fn`` in one transaction, as the holder runs a decision (R2)."""
        return self.storage.transaction(fn) if self.storage is not None else fn()

    def reset(self) -> None:
        """A storage reset (R3 ``migrate(None)`` then first use): every table emptied."""
        if self.storage is not None:
            drop_schema(self.storage)
            ensure_schema(self.storage)
        else:
            self.store = MemoryStore()

    def state(self) -> StoreState:
        if isinstance(self.store, MemoryStore):
            return self.store.state()
        assert self.storage is not None
        grants = {str(r["grant_id"]): GrantRow.from_row(r) for r in self.storage.exec(f"SELECT * FROM {GRANTS}")}
        leases = {str(r["lease_id"]): LeaseRow.from_row(r) for r in self.storage.exec(f"SELECT * FROM {LEASES}")}
        groups = {str(r["group_name"]): {a: int(r[a]) for a in AGGREGATES}
                  for r in self.storage.exec(f"SELECT * FROM {GROUPS}")}
        return {"grants": dict(sorted(grants.items())), "leases": dict(sorted(leases.items())),
                "groups": dict(sorted(groups.items())), "meta": dict(sorted(read_meta(self.storage).items()))}


def normal_snapshot(s: Snapshot) -> tuple[Any, ...]:
    """A snapshot with its rows sorted by id (their order is not part of the contract)."""
    return (sorted(s.grants, key=lambda g: g.grant_id), sorted(s.leases, key=lambda x: x.lease_id),
            dict(sorted(s.meta.items())), dict(sorted(s.groups.items())))


def normal_reply(reply: dict[str, Any]) -> dict[str, Any]:
    """A reply with its grant and lease lists sorted by id (R8 fixes their content, not the
    order of the other grants and leases, which follows the load order)."""
    out = dict(reply)
    if "grants" in out:
        out["grants"] = sorted(out["grants"], key=lambda g: g["grantId"])
        out["leases"] = sorted(out["leases"], key=lambda x: x["leaseId"])
    return out


# ----------------------------------------------------------------------------- messages
@dataclass
class Known:
    """Every id either side ever answered with (reports may name any of them, R14, R32)."""

    grants: set[str]
    leases: set[str]


@st.composite
def grant_reports(draw: Any, ids: list[str]) -> list[dict[str, Any]]:
    chosen = draw(st.lists(st.sampled_from(ids[-8:] + ["nobody's grant"]), max_size=3, unique=True))
    out = []
    for gid in chosen:
        claimed = draw(st.integers(0, 6))
        released = draw(st.sampled_from([0, 0, claimed // 2, claimed]))
        out.append({"grantId": gid, "claimed": claimed, "released": released})
    return out


@st.composite
def lease_reports(draw: Any, ids: list[str]) -> list[dict[str, Any]] | None:
    if not draw(st.sampled_from([True, True, True, False])):
        return None  # R5: no lease support
    chosen = draw(st.lists(st.sampled_from(ids[-8:] + ["fake.00000000.3.0"]), max_size=3, unique=True))
    out = []
    for lid in chosen:
        drawn = draw(st.integers(0, 5))
        out.append({"leaseId": lid, "drawn": drawn, "released": draw(st.sampled_from([0, 0, drawn // 2, drawn])),
                    "stopped": draw(st.sampled_from([False, False, True]))})
    return out


@st.composite
def messages(draw: Any, kind: str, client: str, known: Known, now: int) -> PermitRequest | SyncMessage:
    """A valid wire message (parsed as the holder parses it, R7) with random cumulative reports."""
    m: dict[str, Any] = {"type": kind, "v": 1, "clientId": client,
                         "grants": draw(grant_reports(sorted(known.grants)))}
    leases = draw(lease_reports(sorted(known.leases)))
    if leases is not None:
        m["leases"] = leases
    label = draw(st.sampled_from([None, None, "A", "B"]))  # R7, R38: labels set, changed, left out
    if label is not None:
        m["label"] = label
    if kind == "request":
        groups = draw(st.lists(st.sampled_from(GROUPS_), min_size=1, max_size=3, unique=True))
        m["demand"] = [{"group": g, "count": draw(st.integers(0, 6)),
                        "oldestAt": now - draw(st.sampled_from([0, 0, 1, 5_000]))} for g in groups]
    return parse_message(m)


# ----------------------------------------------------------------------------- the machine
class StoreContract(RuleBasedStateMachine):
    """The same decisions against both stores; everything observable compared at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.sql, self.mem = Side(sql=True), Side(sql=False)
        self.now = T0
        self.limit: Any = 6
        self.group_limits: dict[str, Any] = {}
        self.denied: set[tuple[str, str]] = set()
        self.config: LeaseConfig | None = LEASE_CONFIGS[1]
        self.app_secret: bytes | None = None
        self.known = Known(set(), set())
        self.last_round_at: int | None = None
        self.ttl: int | None = None

    @rule(ttl=st.sampled_from([None, 5_000, 30_000]))
    def set_ttl(self, ttl: int | None) -> None:
        # R18 decision (crash expiry), R38 (last seen): the TTL turned on, changed or off between messages.
        self.ttl = ttl

    @initialize(with_secret=st.booleans())
    def choose_secret(self, with_secret: bool) -> None:
        # R32: with lease_secret, ids of an earlier epoch verify after a reset and are charged.
        self.app_secret = APP_SECRET if with_secret else None

    # ------------------------------------------------------------------ plumbing
    def policy(self, side: Side) -> Policy:
        return Policy(leases=self.config, grant_timeout_ms=10_000, round_period_ms=2_000,
                      new_id=side.new_id, app_secret=self.app_secret, new_secret=side.new_secret,
                      claim_ttl_ms=self.ttl)

    def limits(self, side: Side, clients: list[Pending]) -> Limits:
        return resolve_limits(side.store, clients, limit=self.limit,
                              group_limit=lambda g: self.group_limits.get(g),
                              can_grant=lambda c, g: (c, g) not in self.denied,
                              leases_configured=self.config is not None)

    def compare_loads(self, reads: Callable[[Side], Reads]) -> None:
        """The reads a decision asks for and what each store loads for them are identical."""
        got = []
        for side in (self.sql, self.mem):
            def body(side: Side = side) -> tuple[Reads, tuple[Any, ...]]:
                meta = side.store.meta()
                r = reads(side)
                return r, normal_snapshot(side.store.load(r, meta))
            got.append(side.run(body))
        assert got[0] == got[1], f"loads differ:\nsql {got[0]}\nmem {got[1]}"

    def learn(self, reply: dict[str, Any]) -> None:
        self.known.grants |= {g["grantId"] for g in reply.get("grants", ())}
        self.known.leases |= {x["leaseId"] for x in reply.get("leases", ())}

    def next_request_at(self) -> int:
        if self.last_round_at is None:
            return self.now
        return max(self.now, self.last_round_at + 2_000)

    # ------------------------------------------------------------------ rules
    @rule(data=st.data())
    def round(self, data: st.DataObject) -> None:
        # R2, R8-R33 on both stores: identical limits, loads, replies and state.
        members = data.draw(st.lists(st.sampled_from(CLIENTS), min_size=1, max_size=3, unique=True))
        clients = []
        for i, cid in enumerate(members):
            n = data.draw(st.integers(1, 2))  # R10: a second request of the same client
            ms = [data.draw(messages("request", cid, self.known, self.now)) for _ in range(n)]
            clients.append(Pending(cid, i, [m for m in ms if isinstance(m, PermitRequest)]))
        limits = [self.limits(side, clients) for side in (self.sql, self.mem)]
        assert limits[0] == limits[1], "resolved limits differ (live_lease_pairs / groups_with_live_leases)"
        self.compare_loads(lambda side: round_reads(side.store.meta(), self.now, clients, limits[0],
                                                    self.policy(side)))
        outcomes: list[RoundOutcome] = [
            side.run(lambda side=side: run_round(side.store, self.now, clients, limits[0], self.policy(side)))
            for side in (self.sql, self.mem)]
        assert outcomes[0].contended == outcomes[1].contended
        assert set(outcomes[0].replies) == set(outcomes[1].replies) == set(members)
        for cid in members:
            assert normal_reply(outcomes[0].replies[cid]) == normal_reply(outcomes[1].replies[cid]), cid
            self.learn(outcomes[0].replies[cid])
        self.last_round_at = self.now

    @rule(data=st.data())
    def another_round(self, data: st.DataObject) -> None:
        self.round(data)  # rounds twice as likely as any other rule: more rows to compare

    @rule(data=st.data(), client=st.sampled_from(CLIENTS))
    def sync(self, data: st.DataObject, client: str) -> None:
        # R6: a sync's reports applied at once, on both stores alike.
        message = data.draw(messages("sync", client, self.known, self.now))
        assert isinstance(message, SyncMessage)
        self.compare_loads(lambda side: sync_reads(self.now, message))
        replies = []
        for side in (self.sql, self.mem):
            contended = bool(side.store.meta().get("contended", 0))
            starving = int(side.store.meta().get("starving", 0))
            replies.append(side.run(lambda side=side, contended=contended, starving=starving: run_sync(
                side.store, self.now, message, self.policy(side), contended, self.next_request_at(), starving)))
        assert replies[0].wrote == replies[1].wrote, replies
        replies = [r.reply for r in replies]
        assert normal_reply(replies[0]) == normal_reply(replies[1])
        self.learn(replies[0])

    @rule()
    def reclaim(self) -> None:
        # R15, R16: the reclaim alarm at the current time.
        self.compare_loads(lambda side: Reads(due_at=self.now))
        for side in (self.sql, self.mem):
            side.run(lambda side=side: run_reclaim(side.store, self.now))

    @rule(ms=st.sampled_from([0, 1, 500, 2_000, 6_000, 10_000, 11_000, TTL // 2, TTL, 30_000]))
    def advance(self, ms: int) -> None:
        self.now += ms  # R15 claim deadlines, R31 lease TTLs

    @rule(limit=st.one_of(st.integers(0, 12), st.just(LIMIT_ERROR)))
    def set_limit(self, limit: Any) -> None:
        self.limit = limit  # R12, R24, R33 (a lowered limit retires live leases)

    @rule(group=st.sampled_from(GROUPS_), gl=st.one_of(st.none(), st.integers(0, 6), st.just(LIMIT_ERROR)))
    def set_group_limit(self, group: str, gl: Any) -> None:
        self.group_limits[group] = gl  # R12, R27, R33

    @rule(client=st.sampled_from(CLIENTS), group=st.sampled_from(GROUPS_), allowed=st.booleans())
    def can_grant(self, client: str, group: str, allowed: bool) -> None:
        (self.denied.discard if allowed else self.denied.add)((client, group))  # R22, R33

    @rule(index=st.integers(0, len(LEASE_CONFIGS) - 1))
    def switch_leases(self, index: int) -> None:
        self.config = LEASE_CONFIGS[index]  # R25-R28; leases may outlive a config that had them

    @rule()
    def reset_storage(self) -> None:
        # R3, R32: both storages emptied; clients may still report what they held.
        for side in (self.sql, self.mem):
            side.reset()
        self.last_round_at = None

    @rule(data=st.data())
    def load_any_reads(self, data: st.DataObject) -> None:
        # The store contract itself: any Reads selects the same rows from both stores.
        ids = st.sampled_from(sorted(self.known.grants | self.known.leases) + ["none"])
        state = self.mem.state()
        edges = sorted({t + d for t in [self.now] + [g.claim_by for g in state["grants"].values()]
                        + [x.expires_at for x in state["leases"].values()] for d in (-1, 0, 1)})
        when = st.one_of(st.none(), st.sampled_from(edges))  # the deadlines themselves, and either side
        reads = Reads(
            clients=frozenset(data.draw(st.lists(st.sampled_from(CLIENTS), max_size=2))),
            grant_ids=frozenset(data.draw(st.lists(ids, max_size=3))),
            lease_ids=frozenset(data.draw(st.lists(ids, max_size=3))),
            due_at=data.draw(when), expired_at=data.draw(when),
            all_live_leases=data.draw(st.booleans()),
            live_lease_groups=frozenset(data.draw(st.lists(st.sampled_from(GROUPS_), max_size=2))),
            groups=frozenset(data.draw(st.lists(st.sampled_from(GROUPS_ + ("none",)), max_size=3))),
        )
        self.compare_loads(lambda side: reads)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def same_state(self) -> None:
        # Every row, group aggregate and meta row; and the store's other queries.
        sql, mem = self.sql.store, self.mem.store
        assert isinstance(mem, MemoryStore) and self.sql.storage is not None
        assert self.sql.state() == mem.state()
        assert sql.next_reclaim_due() == mem.next_reclaim_due()
        assert sql.live_lease_pairs(None) == mem.live_lease_pairs(None)
        assert sql.live_lease_pairs(CLIENTS[:2]) == mem.live_lease_pairs(CLIENTS[:2])
        assert sql.groups_with_live_leases() == mem.groups_with_live_leases()
        assert isinstance(sql, SqlStore)
        assert [dict(r) for r in sql.group_rows()] == mem.group_rows()

    @invariant()
    def aggregates_match_recomputation(self) -> None:
        # R19, R38: both stores' aggregates equal a recount of their rows.
        found = check_aggregates(self.sql.storage)
        mem = self.mem.store
        assert isinstance(mem, MemoryStore)
        assert mem.recount() == found["groups"]
        assert mem.totals() == found["total"]


    @invariant()
    def client_rows_match(self) -> None:
        # R38 (last seen): both stores keep the same client rows (last report, claims, expiry, label).
        rows = [side.run(lambda side=side: side.store.seen_rows(CLIENTS)) for side in (self.sql, self.mem)]
        assert rows[0] == rows[1], rows


StoreContract.TestCase.settings = SETTINGS
TestStoreContract = StoreContract.TestCase


def test_r2_memory_store_load_returns_copies():
    # R2: a decision that raises before persist changes nothing: loaded rows are copies.
    store = MemoryStore()
    clients = [Pending("a", 0, [PermitRequest("a", (Demand("g", 2, 0),))])]
    limits = resolve_limits(store, clients, limit=5)
    run_round(store, T0, clients, limits, Policy(new_id=lambda: "gid", new_secret=lambda: bytes(32)))
    before = store.state()
    snapshot = store.load(Reads(clients=frozenset({"a"}), due_at=T0 + 20_000, groups=frozenset({"g"})),
                          store.meta())
    assert len(snapshot.grants) == 1 and snapshot.groups == {"g": store.groups["g"]}
    snapshot.grants[0].permits = 0
    snapshot.groups["g"]["outstanding"] = 99
    snapshot.meta["outstanding"] = 99
    assert store.state() == before


# --- prefetch completeness: a decision looks up only what its Reads loaded -----------------
def _granted_store() -> tuple[MemoryStore, str]:
    store = MemoryStore()
    clients = [Pending("a", 0, [PermitRequest("a", (Demand("g", 2, 0),))])]
    outcome = run_round(store, T0, clients, resolve_limits(store, clients, limit=5),
                        Policy(new_id=lambda: "gid-1", new_secret=lambda: bytes(32)))
    assert outcome is not None and "gid-1" in store.grants
    return store, "gid-1"


def test_r2_a_lookup_of_a_row_the_reads_did_not_name_raises_instead_of_reading_not_found():
    # R2 (one decision over the rows loaded for it): a Reads that forgot an id would make the
    # decision answer "not found" for a row that exists; the ledger refuses the lookup instead.
    store, gid = _granted_store()
    ledger = Ledger(store.load(Reads(clients=frozenset({"b"})), None))  # not a's rows, not gid
    with pytest.raises(NotLoadedError, match="grant 'gid-1'"):
        ledger.grants.get(gid)
    with pytest.raises(NotLoadedError):
        _ = gid in ledger.grants
    # a reported id that is named but absent is truly not found; what the decision writes is known
    named = Ledger(store.load(Reads(grant_ids=frozenset({"gone"})), None))
    assert named.grants.get("gone") is None
    loaded = Ledger(store.load(Reads(clients=frozenset({"a"})), None))
    g = loaded.grants[gid]
    loaded.delete_grant(g)
    assert loaded.grants.get(gid) is None  # loaded, then deleted by this decision
    # a hand-built snapshot (no reads) is not checked
    assert Ledger(Snapshot()).grants.get("anything") is None


def test_r2_a_sync_whose_reads_miss_its_reported_grant_fails_loudly():
    # The same through a decision: decide_sync over a ledger loaded without the reported id.
    store, gid = _granted_store()
    message = SyncMessage("a", (GrantReport(gid, 1, 0),))
    wrong = Ledger(store.load(Reads(clients=frozenset({"b"})), None))
    with pytest.raises(NotLoadedError):
        decide_sync(wrong, T0 + 1, message, Policy(new_id=lambda: "x", new_secret=lambda: bytes(32)),
                    False, T0, 0)
    right = Ledger(store.load(sync_reads(T0 + 1, message), None))
    reply = decide_sync(right, T0 + 1, message, Policy(new_id=lambda: "x", new_secret=lambda: bytes(32)),
                        False, T0, 0)
    assert reply["grants"][0]["claimed"] == 1


def test_r2_selections_and_aggregates_need_their_reads():
    store, _ = _granted_store()
    ledger = Ledger(store.load(Reads(clients=frozenset({"a"})), None))
    with pytest.raises(NotLoadedError, match="grants due"):
        ledger.due_grants(T0)
    with pytest.raises(NotLoadedError, match="leases expired"):
        ledger.expired_leases(T0)
    with pytest.raises(NotLoadedError, match="every live lease"):
        ledger.live_leases()
    with pytest.raises(NotLoadedError, match="aggregates"):
        ledger.group_usage(["g"])
    covered = Ledger(store.load(Reads(due_at=T0, expired_at=T0, live_lease_groups=frozenset({"g"}),
                                      groups=frozenset({"g"})), None))
    assert covered.due_grants(T0) == [] and covered.live_leases(["g"]) == []
    assert covered.group_usage(["g"])["g"]["outstanding"] == 2
    with pytest.raises(NotLoadedError):
        covered.due_grants(T0 + 1)  # later than the reads' due_at
