"""The honest client model the Hypothesis machines share (tests/test_core_machine.py over the pure
core, tests/test_lease_properties.py over SQLite): it queues items, claims and draws only what it
was granted, runs its items under them, releases and reports cumulative counts (SPEC R13, R30,
R34), and checks on every reply that nothing it runs is forgotten or settled (I2)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from semaphore.core.wire import Demand

#: The groups every machine uses.
GROUPS = ("g0", "g1", "g2")

Reports = tuple[tuple[tuple[str, int, int], ...], tuple[tuple[str, int, int, bool], ...]]


@dataclass
class Client:
    """An honest client: queued items per group, the grants and leases it knows with its
    cumulative counts, and the items running under each."""

    cid: str
    lease_capable: bool
    queue: dict[str, list[int]] = field(default_factory=lambda: {g: [] for g in GROUPS})
    grants: dict[str, dict[str, Any]] = field(default_factory=dict)
    leases: dict[str, dict[str, Any]] = field(default_factory=dict)
    running: dict[tuple[str, str], int] = field(default_factory=dict)  # (kind, id) -> items
    history: list[Reports] = field(default_factory=list)

    def reports(self, record: bool = True) -> Reports:
        grants = tuple((gid, g["claimed"], g["released"]) for gid, g in sorted(self.grants.items()))
        leases = tuple((lid, x["drawn"], x["released"], x["stopped"]) for lid, x in sorted(self.leases.items()))
        if record:
            self.history.append((grants, leases))
        return grants, leases

    def demand(self) -> tuple[Demand, ...]:
        return tuple(Demand(g, len(q), min(q)) for g, q in sorted(self.queue.items()) if q)

    def queued(self, group: str) -> int:
        return len(self.queue[group])

    def run(self, kind: str, ident: str, group: str, n: int) -> None:
        del self.queue[group][:n]
        key = (kind, ident)
        self.running[key] = self.running.get(key, 0) + n

    def draw(self) -> None:
        """R34: draw queued items from live leases, one permit each, no round trip; a reusable
        lease's slots may be drawn again once released (R34a): at most ``permits`` run at once."""
        for lid, x in sorted(self.leases.items()):
            if x["stopped"]:
                continue
            left = x["permits"] - (self.running.get(("lease", lid), 0) if x["reusable"] else x["drawn"])
            k = min(left, self.queued(x["group"]))
            if k > 0:
                x["drawn"] += k
                self.run("lease", lid, x["group"], k)

    def absorb(self, reply: dict[str, Any]) -> None:
        """Take in a reply: new and re-sent grants and leases, retirements, settlements (R8)."""
        assert "error" not in reply, reply
        for s in reply["grants"]:
            self._absorb_grant(s)
        for s in reply["leases"]:
            self._absorb_lease(s)
        if reply["contended"]:  # R29: return idle lease permits of groups with nothing queued
            for x in self.leases.values():
                if not x["stopped"] and self.queued(x["group"]) == 0:
                    x["stopped"] = True

    def _absorb_grant(self, s: dict[str, Any]) -> None:
        gid = s["grantId"]
        mine = self.grants.get(gid)
        if s["status"] == "not_found":
            if mine is not None:
                assert self.running.get(("grant", gid), 0) == 0, f"I2: grant {gid} forgotten while running"
                del self.grants[gid]
            return
        if mine is None:
            if not (s["claimed"] or s["released"]):  # else a stale replay naming a settled grant
                self.grants[gid] = {"group": s["group"], "permits": s["permits"], "claimed": 0, "released": 0}
        else:
            mine["permits"] = s["permits"]  # shrinks at reclaim (R15)

    def _absorb_lease(self, s: dict[str, Any]) -> None:
        lid = s["leaseId"]
        mine = self.leases.get(lid)
        if s["status"] == "settled":
            if mine is not None:
                assert self.running.get(("lease", lid), 0) == 0, f"I2: lease {lid} settled while running"
                del self.leases[lid]
            return
        if mine is None:
            if s["group"] is not None and s["drawn"] == 0:
                # a lease we never heard of (its reply was lost): live, or already retired
                self.leases[lid] = {"group": s["group"], "permits": s["permits"], "drawn": 0,
                                    "released": 0, "stopped": s["status"] != "live",
                                    "reusable": bool(s.get("reusable"))}
            return
        if s["status"] == "retired":
            mine["stopped"] = True  # R33: a retired lease stops drawing at once

    def _confirmed(self, gid: str) -> int:
        return self.running.get(("grant", gid), 0) + self.grants[gid]["released"]

    def claims_to_make(self) -> bool:
        """Claim unclaimed grant permits for queued items (confirmed by the next sync, R15a)."""
        changed = False
        for gid, g in sorted(self.grants.items()):
            pending = sum(h["claimed"] - self._confirmed(hid) for hid, h in self.grants.items()
                          if h["group"] == g["group"])
            k = min(g["permits"] - g["claimed"], self.queued(g["group"]) - pending)
            if k > 0:
                g["claimed"] += k
                changed = True
        return changed

    def confirm(self, reply: dict[str, Any]) -> None:
        """R15a: start items for claims the reply shows recorded; drop the others."""
        for s in reply["grants"]:
            g = self.grants.get(s["grantId"])
            if g is None:
                continue
            gid = s["grantId"]
            k = min(min(s["claimed"], g["claimed"]) - self._confirmed(gid), self.queued(g["group"]))
            if k > 0:
                self.run("grant", gid, g["group"], k)
            g["claimed"] = self._confirmed(gid)

    def wind_down(self) -> None:
        """For the I3 drain: drop queued items, release everything running, stop every lease."""
        for q in self.queue.values():
            q.clear()
        for (kind, ident), n in list(self.running.items()):
            if n > 0:
                (self.grants if kind == "grant" else self.leases)[ident]["released"] += n
                self.running[(kind, ident)] = 0
        for x in self.leases.values():
            x["stopped"] = True
