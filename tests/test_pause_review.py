"""Cold review of bbf62ab (after 8 exchanges in one pump with a request, only requests pause
for retry_ms). The test failed on bbf62ab (B served 999 ms after A left); fixed: a release on
the key ends its request pause."""

from __future__ import annotations

import pytest

from semaphore.testing import async_test
from test_queue_handoff import _handoff

pytestmark = pytest.mark.usefixtures("quiet_logs")


@async_test
async def test_after_the_burst_a_same_object_waiter_still_waits_retry_ms_for_the_released_permit():
    """Defect (low): the change sends A's contended release at once (f4 passes: the sync goes
    1 ms after A left), but B, the same object's waiter for that very permit, is still served
    only when the request pause ends, retry_ms (999 ms) after A left, exactly as before the
    change; with round_period_ms=0 that is far more than "a round period", so the README's new
    Known-limit text (a contended key's release goes at once, only a not-yet-contended key costs
    its waiter a round period) over-promises. f4 checks only when the release message goes,
    not when the waiter is served. What is measured: the release, as a separate sync, reaches
    the holder at once, but B's request that would take the freed permit is held back by
    ``self._paused``.

    Fixed as suggested: a release that returns capacity ends the request pause on its key: drop
    ``self._paused[key]`` when a permit of the key is released locally (``_complete_item``), or
    when a paused pump's due report frees capacity, or let ``plan_exchange`` send the request,
    which carries the due reports (R11), instead of a separate sync. The next request then
    differs from the 8 identical ones the pause is there to stop, and it is bounded by the
    number of releases. Alternatively, weaken the README to say the waiter still waits up to
    retry_ms after such a burst."""
    log, left, got = await _handoff(round_wait_ms=0, round_period_ms=0)
    sent_release = min(t for t, _kind, grants in log if any(r for _c, r in grants))
    assert sent_release - left < 100  # what the change fixed
    assert got is not None
    assert got - left < 100, (f"B served {got - left} ms after A left (release sent {sent_release - left} ms"
                              " after): the request pause holds back the request that would take it")
