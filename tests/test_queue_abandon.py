"""An abandoned queue instance (:meth:`SemaphoreQueue.abandon`, what the test kit's eviction does
as the death of the object would) writes and admits nothing more, even where a callback or a
failed cleanup turned its cancellation into an ordinary exception: its copies of the items and
the client's rows are stale once the new instance works on the same storage (R37, one queue per
object). The soak found the first such path (seed 106, mode over: an item admitted under a
second permit by the dead instance's kick loop)."""

from __future__ import annotations

import asyncio

from semaphore.testing import T0, ClientSide, HolderSide, Net, SimClock, async_test

KEY = "acct"


def holder_at(clock: SimClock) -> HolderSide:
    return HolderSide(clock, limit=5, leases=None)


def stop(side: ClientSide, holder: HolderSide) -> None:
    side.driver.close()
    holder.driver.close()


@async_test
async def test_r37_an_evicted_pump_with_a_pass_still_asked_of_it_writes_nothing():
    # The object is evicted while its pump waits for the holder and an enqueue asked that kick
    # for one more pass. Before, the pump's cleanup wrote the key's wake time over the stale
    # copy, and when that write failed the failure replaced the cancellation and the kick loop
    # ran the pass that was asked for, admitting with the dead instance's copies.
    clock = SimClock(T0)
    holder = holder_at(clock)
    net = Net(holder, clock)

    async def slow(key: str, message: dict) -> dict:
        await clock.sleep(500)  # a holder call takes 500 ms
        return await net(key, message)

    side = ClientSide("c1", clock, slow, on_admit=lambda s, item: None)
    await side.queue.enqueue(KEY, "g", "a")
    await clock.advance(100)   # its pump waits for the holder
    await side.queue.enqueue(KEY, "g", "b")   # one more pass asked of the running kick
    old = side.queue
    before = old.storage.statements
    side.evict()
    await clock.advance(30_000)
    assert old.storage.statements == before   # the dead instance ran no statement
    assert {i.item_id: i.state.value for i in side.queue.items(KEY)} == {"a": "running", "b": "running"}
    stop(side, holder)


@async_test
async def test_r37_a_check_running_that_swallows_the_cancellation_does_not_keep_the_dead_pump_going():
    # A reconcile check (check_running) of the alarm's pump turns its cancellation into an
    # exception: before, that counted as "still running" and the pump went on to request,
    # claim and admit with the dead instance's copies.
    clock = SimClock(T0)
    holder = holder_at(clock)
    block = {"on": False}
    admits: list[tuple[str, object]] = []

    async def check(side, item):
        if not block["on"]:
            return True
        try:
            await clock.sleep(100_000)
        except asyncio.CancelledError:
            raise RuntimeError("check_running cleanup failed") from None  # replaces the cancellation
        return True

    side = ClientSide("c1", clock, Net(holder, clock),
                      on_admit=lambda s, item: admits.append((item.item_id, asyncio.current_task())),
                      check_running=check, reconcile_after_ms=5_000)
    await side.queue.enqueue(KEY, "g", "a")
    await clock.advance(3_000)
    assert side.queue.item("a").state.value == "running"
    await clock.advance(6_000)      # the first check answers
    block["on"] = True
    await clock.advance(6_000)      # the second one blocks inside the alarm's pump
    stuck = side.driver.task
    assert stuck is not None and not stuck.done()
    await side.queue.enqueue(KEY, "g", "b")   # waits behind the stuck pump
    old = side.queue
    side.evict()
    before = old.storage.statements
    await clock.advance(2_000)
    assert old.storage.statements == before
    assert [i for i, task in admits if task is stuck] == []
    stop(side, holder)


@async_test
async def test_r37_work_whose_cleanup_fails_on_eviction_does_not_count_as_a_call():
    # A work coroutine's cleanup raises when the eviction cancels it: before, the dead instance
    # counted the call as failed, and with its attempts used up completed the item (its permit
    # released over the dead instance's copy of the client's rows). A call cut short by an
    # eviction does not count: the item still runs, for the next instance to retry.
    clock = SimClock(T0)
    holder = holder_at(clock)
    calls: list[str] = []

    async def work(item):
        calls.append(item.item_id)
        try:
            await clock.sleep(60_000)
        except asyncio.CancelledError:
            raise RuntimeError("work cleanup failed") from None  # replaces the cancellation

    side = ClientSide("c1", clock, Net(holder, clock), work=work, work_attempts=1)
    await side.queue.enqueue(KEY, "g", "a")
    await clock.advance(3_000)
    assert side.queue.item("a").state.value == "running" and calls == ["a"]
    old = side.queue
    before = old.storage.statements
    side.evict()
    for _ in range(20):
        await asyncio.sleep(0)
    assert old.storage.statements == before
    item = side.queue.item("a")
    assert item is not None and item.state.value == "running" and not item.error
    stop(side, holder)


@async_test
async def test_r37_a_permit_asked_of_an_abandoned_instance_is_refused_at_once():
    # An abandoned instance pumps nothing: before, permit() on it wrote an item and waited for
    # an admission that could never come (for ever without a timeout). It is refused instead,
    # naming the misuse, and writes nothing.
    from semaphore.errors import ConfigurationError

    clock = SimClock(T0)
    holder = holder_at(clock)
    side = ClientSide("c1", clock, Net(holder, clock))
    old = side.queue
    side.evict()
    before = old.storage.statements

    async def use() -> None:
        async with old.permit(KEY, "g"):
            pass

    task = asyncio.ensure_future(use())
    await clock.advance(60_000)
    assert task.done(), "permit() on an abandoned instance still waits"
    assert isinstance(task.exception(), ConfigurationError) and "abandoned" in str(task.exception())
    assert old.storage.statements == before
    assert side.queue.items(KEY) == []
    stop(side, holder)
