"""Crash expiry of claimed permits (issue 11): ``claim_ttl_ms``, off by default. With it, the
holder releases the claimed permits of a client it has not heard from for that long (R18's
exception, like Redisson's lease time); a live client's queue heartbeats its claims so running
work keeps its permit; nothing is freed twice (I2)."""

from __future__ import annotations

import pytest

from semaphore import ConfigurationError, HolderUnavailableError, PermitResponse
from semaphore.testing import T0, Bed, ClientSide, HolderSide, Net, SimClock, async_test, request, sync

pytestmark = pytest.mark.usefixtures("quiet_logs")
TTL = 5_000


async def claimed(bed: Bed, client: str = "c", permits: int = 3, claim: int = 2) -> str:
    (reply,) = await bed.round(request(client, {"g": permits}))
    (grant,) = reply["grants"]
    await bed.sem.handle(sync(client, [(grant["grantId"], claim, 0)]))
    return grant["grantId"]


@async_test
async def test_claims_of_a_client_unheard_of_for_claim_ttl_ms_are_released_by_the_alarm():
    bed = Bed(10, grant_timeout_ms=600_000, claim_ttl_ms=TTL)
    gid = await claimed(bed)
    assert (await bed.usage())["outstanding"] == 3
    await bed.clock.advance(TTL - 100)
    assert (await bed.usage())["outstanding"] == 3  # not yet
    await bed.clock.advance(200)
    u = await bed.usage()
    assert u["outstanding"] == 1  # the 2 claimed released; the unclaimed 1 waits for its claimBy
    (h,) = (await bed.sem.holders())["holders"]
    assert [(g["claimed"], g["released"]) for g in h["grants"]] == [(2, 2)]
    # The client was alive after all: its reports free nothing twice (I2), a new claim is charged.
    for released in (0, 1, 2):
        await bed.sem.handle(sync("c", [(gid, 2, released)]))
        assert (await bed.usage())["outstanding"] == 1
    await bed.sem.handle(sync("c", [(gid, 3, 2)]))
    assert (await bed.usage())["outstanding"] == 1  # the 3rd permit claimed: still charged
    bed.check()


@async_test
async def test_reports_heartbeat_the_claims_and_the_default_never_expires():
    bed = Bed(10, grant_timeout_ms=600_000, claim_ttl_ms=TTL)
    gid = await claimed(bed)
    for _ in range(10):
        await bed.clock.advance(TTL // 2)
        await bed.sem.handle(sync("c", [(gid, 2, 0)]))
    assert (await bed.usage())["outstanding"] == 3
    off = Bed(10, grant_timeout_ms=600_000)
    await claimed(off)
    await off.clock.advance(10 * TTL)
    assert (await off.usage())["outstanding"] == 3  # R18: off by default


@async_test
async def test_replies_carry_claim_ttl_ms_only_when_set_and_it_is_validated():
    bed = Bed(10, claim_ttl_ms=TTL)
    (reply,) = await bed.round(request("c", {"g": 1}))
    assert reply["claimTtlMs"] == TTL and PermitResponse.from_wire(reply).claim_ttl_ms == TTL
    off = Bed(10)
    (reply,) = await off.round(request("c", {"g": 1}))
    assert "claimTtlMs" not in reply and PermitResponse.from_wire(reply).claim_ttl_ms is None
    for bad in (0, -1, "5", True):
        with pytest.raises(ConfigurationError) as err:
            Bed(10, claim_ttl_ms=bad)
        assert err.value.field == "claim_ttl_ms"


def _client(clock: SimClock, holder: HolderSide, started: list[str], name: str = "c1") -> tuple[Net, ClientSide]:
    net = Net(holder, clock)
    side = ClientSide(name, clock, net, on_admit=lambda s, item: started.append(item.item_id),
                      report_releases_within_ms=60_000)
    return net, side


@async_test
async def test_a_live_queue_heartbeats_its_claims_so_long_work_keeps_its_permit():
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, grant_timeout_ms=10_000, claim_ttl_ms=TTL)
    started: list[str] = []
    net, side = _client(clock, holder, started)
    await side.queue.enqueue("acct", "g", "long")
    await clock.advance(3000)
    assert started == ["long"]
    await clock.advance(60_000)  # the job runs a minute: 12 claim TTLs
    assert (await holder.usage())["outstanding"] == 1
    syncs = [m for m in net.sent if m["type"] == "sync"]
    assert len(syncs) >= 60_000 // TTL  # a heartbeat at least every claim_ttl_ms / 2... roughly
    await side.queue.complete("long")
    await clock.advance(70_000)
    assert (await holder.usage())["outstanding"] == 0


@async_test
async def test_a_client_cut_off_from_the_holder_loses_its_claims_after_claim_ttl_ms():
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=2, grant_timeout_ms=10_000, claim_ttl_ms=TTL)
    started: list[str] = []
    net, side = _client(clock, holder, started)
    await side.queue.enqueue("acct", "g", "job")
    await clock.advance(3000)
    assert started == ["job"] and (await holder.usage())["outstanding"] == 1

    def cut(key: str, message: dict) -> None:
        raise HolderUnavailableError("partitioned (test)")

    net.intercept = cut
    await clock.advance(TTL + 2_000)
    assert (await holder.usage())["outstanding"] == 0  # the documented risk: the job runs uncharged
