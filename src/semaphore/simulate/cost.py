"""What a run costs on Cloudflare: billed requests, active object time and dollars per million
admitted items, from the published Durable Objects prices.

Cloudflare bills a Durable Object for **requests** (each RPC call, each alarm invocation) and
for **duration**: wall-clock time while the object is active (running a call or an event
handler, or idle but unable to hibernate: awaiting an outgoing call, a pending timer), as GB-s
of its memory (128 MB per object). An object idle and eligible for hibernation is not billed,
even before it hibernates. Source: https://developers.cloudflare.com/durable-objects/platform/pricing/
(Workers Paid plan; the included monthly quota is left out: these are marginal prices).

:class:`Usage` is what a run measured; :func:`cost` prices it with :class:`Prices` (every price
a named field, so another plan or a future price list is one argument away).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Prices", "PRICES", "Usage", "Cost", "cost", "PRICING_SOURCE", "ActiveTime"]

#: Where the default prices come from.
PRICING_SOURCE = "https://developers.cloudflare.com/durable-objects/platform/pricing/"


@dataclass(frozen=True)
class Prices:
    """Durable Objects prices (Workers Paid plan, beyond the included quota)."""

    #: USD per million requests (an RPC call, an alarm invocation, an HTTP request).
    usd_per_million_requests: float = 0.15
    #: USD per million GB-s of duration.
    usd_per_million_gb_s: float = 12.50
    #: Memory billed per active object, GB (128 MB).
    gb_per_object: float = 0.128


#: The published prices (see :data:`PRICING_SOURCE`).
PRICES = Prices()


@dataclass(frozen=True)
class Usage:
    """What a run used: billed requests and active object-seconds, holder and clients apart."""

    #: RPC calls the holder object received (requests and syncs of every client object).
    holder_calls: int
    #: Alarm invocations of the holder object and of the client objects.
    holder_alarms: int
    client_alarms: int
    #: Seconds the holder object was active (a call in progress, round timers included).
    holder_active_s: float
    #: Seconds client objects were active for the protocol, summed over the objects (awaiting
    #: a holder call, or waiting in memory to retry); their own work is not counted: it costs
    #: the same whatever admits it.
    client_active_s: float

    @property
    def requests(self) -> int:
        """Billed requests: holder calls plus every alarm invocation."""
        return self.holder_calls + self.holder_alarms + self.client_alarms

    @property
    def active_s(self) -> float:
        """Active object-seconds, holder and clients."""
        return self.holder_active_s + self.client_active_s


@dataclass(frozen=True)
class Cost:
    """A run's usage priced: dollars for its requests and its duration, and per million items."""

    usage: Usage
    items: int
    usd_requests: float
    usd_duration: float

    @property
    def usd(self) -> float:
        return self.usd_requests + self.usd_duration

    @property
    def usd_per_million_items(self) -> float | None:
        """Dollars per million admitted items (``None`` when nothing was admitted)."""
        return self.usd * 1_000_000 / self.items if self.items else None

    @property
    def requests_per_item(self) -> float | None:
        return self.usage.requests / self.items if self.items else None

    @property
    def active_s_per_item(self) -> float | None:
        return self.usage.active_s / self.items if self.items else None


def cost(usage: Usage, items: int, prices: Prices = PRICES) -> Cost:
    """Price ``usage`` for ``items`` admitted items."""
    return Cost(usage, items,
                usage.requests * prices.usd_per_million_requests / 1_000_000,
                usage.active_s * prices.gb_per_object * prices.usd_per_million_gb_s / 1_000_000)


class ActiveTime:
    """The time an object is active: the union of the intervals with at least one activity in
    progress (calls overlapping in time count once). ``begin(now)`` / ``end(now)`` bracket one
    activity; :meth:`total_ms` closes the open interval at ``now``."""

    def __init__(self) -> None:
        self._open = 0
        self._since = 0
        self._ms = 0

    def begin(self, now: int) -> None:
        if self._open == 0:
            self._since = now
        self._open += 1

    def end(self, now: int) -> None:
        self._open -= 1
        if self._open == 0:
            self._ms += now - self._since

    def total_ms(self, now: int) -> int:
        return self._ms + (now - self._since if self._open else 0)
