"""Reading a :class:`~semaphore.simulate.engine.Result`: the summary table
(:func:`summary`), the time series as CSV (:func:`write_csv`) and the figures as plain data
(:func:`figures`)."""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path
from typing import Any

from .cost import cost
from .engine import Result

__all__ = ["summary", "overload", "offered_load", "write_csv", "figures", "CSV_COLUMNS"]

#: Columns of the time-series CSV (one row per sample; ``t_s`` virtual seconds since the start).
CSV_COLUMNS = ("t_s", "running", "charged", "limit", "ceiling", "queued", "admitted", "completed")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _ms(stats: dict[str, float], key: str) -> str:
    return f"{stats[key] / 1000:.2f} s" if key in stats else "-"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _per(result: Result, n: int) -> str:
    value = result.per_item(n)
    return "-" if value is None else f"{value:.3f}"


def describe(result: Result) -> str:
    """One line saying what was simulated."""
    s = result.scenario
    leases = s.leases if isinstance(s.leases, str) else "custom"
    if s.leases != "off" and isinstance(s.leases, str):
        leases += "".join(f" {name}" for name, on in (("reusable", s.reusable), ("lease-first", s.lease_first)) if on)
    faults = [f"{k} {getattr(s, k):g}" for k in ("lose_request", "lose_reply", "duplicate", "delay",
                                                 "evict_client_p", "evict_holder_p") if getattr(s, k)]
    return (f"seed {s.seed}: {s.run_s:g} s virtual, limit {s.limit}"
            + (f" (group limits {s.group_limits})" if s.group_limits else "")
            + f", {s.clients} client objects, {s.groups} groups ({s.groups_per_client} per client), arrivals "
            + "+".join(s.arrivals) + f", jobs {s.job_duration} ({_job(s)}), leases {leases}, rounds "
            + f"{s.round_wait_ms}/{s.round_period_ms} ms"
            + (f", requests held {min(s.hold_blocked_ms, s.request_wait_ms)} ms"
               if s.hold_blocked_ms and s.request_wait_ms else "")
            + ", faults " + (", ".join(faults) or "off"))


def _job(s: Any) -> str:
    if s.job_duration == "lognormal":
        return f"mu {s.job_mu:g}, sigma {s.job_sigma:g}"
    return f"{'mean ' if s.job_duration == 'exponential' else ''}{s.job_ms / 1000:g} s"


def offered_load(result: Result) -> float:
    """The permits the run's demand would keep busy: items enqueued per second times the mean
    job duration of the scenario (a standing backlog adds an item only as one starts, so it
    never counts above what was admitted)."""
    s = result.scenario
    mean_ms = math.exp(s.job_mu + s.job_sigma ** 2 / 2) if s.job_duration == "lognormal" else s.job_ms
    return result.enqueued * mean_ms / max(1, result.run_ms)


def overload(result: Result) -> str | None:
    """A warning when demand outgrew the limit: the offered load (:func:`offered_load`) is
    above 1.5 times the limit and more than the limit's worth of items is still queued at the
    end. Such a run's waits grow with its length, so its figures say more about the run's
    length than about the protocol; ``None`` otherwise."""
    s = result.scenario
    queued = result.samples[-1].queued if result.samples else 0
    load = offered_load(result)
    if load <= 1.5 * s.limit or queued <= s.limit:
        return None
    return (f"warning: demand exceeds the limit: an offered load of about {load:.0f} permits against a limit "
            f"of {s.limit}; {queued} items still queued at the end ({result.enqueued} enqueued, {result.admitted} "
            f"admitted), so waits grow with the run's length. Raise --limit, or lower the arrivals or the job "
            f"duration.")


def summary(result: Result) -> str:
    """The readable summary table of a run."""
    r = result
    lat, free = r.latency_ms, r.free_to_start_ms
    rows = [
        ("utilization (running / limit, whole run)", _pct(r.utilization)),
        (f"utilization while a backlog existed ({r.backlog_ms / max(1, r.run_ms):.0%} of the run)",
         _pct(r.utilization_backlog)),
        ("items enqueued / admitted / completed", f"{r.enqueued} / {r.admitted} / {r.completed}"
         + (f" ({r.by_lease} from leases)" if r.by_lease else "")),
        ("wait from enqueue to start p50 / p95 / p99", f"{_ms(lat, 'p50')} / {_ms(lat, 'p95')} / {_ms(lat, 'p99')}"),
        ("wait from a freed permit to the next start p50 / p95 / p99",
         f"{_ms(free, 'p50')} / {_ms(free, 'p95')} / {_ms(free, 'p99')}"),
        ("worst overshoot: running - limit", f"{r.max_running_over} (max running {r.max_running})"),
        ("worst overshoot: charged - limit",
         f"{r.max_charged_over} (max charged {r.max_charged}, ceiling {r.ceiling})"),
        ("holder calls per admitted item",
         f"{_per(r, r.calls)} (requests {_per(r, r.requests)}, syncs {_per(r, r.syncs)})"),
        ("holder calls", f"{r.calls}: {r.requests} requests, {r.syncs} syncs"
         + "".join(f", {n} {k}" for k, n in r.sync_reasons.items())),
        ("blocked item-seconds by reason", ", ".join(f"{k} {v / 1000:.0f}" for k, v in r.blocked_ms.items()) or "-"),
    ]
    if r.usage is not None:
        c = cost(r.usage, r.admitted)
        u = r.usage
        rows += [
            ("billed requests per item (holder calls + alarms)",
             f"{_num(c.requests_per_item)} ({u.holder_calls} calls, {u.holder_alarms} holder alarms, "
             f"{u.client_alarms} client alarms)"),
            ("active object-seconds per item (holder / clients)",
             f"{_num(c.active_s_per_item)} ({u.holder_active_s:.0f} s / {u.client_active_s:.0f} s)"),
            ("USD per million items (requests + duration)",
             "-" if c.usd_per_million_items is None else
             f"{c.usd_per_million_items:.2f} ({c.usd_requests * 1e6 / max(1, r.admitted):.2f} + "
             f"{c.usd_duration * 1e6 / max(1, r.admitted):.2f}; Cloudflare's published prices)"),
        ]
    if any(r.net[k] for k in r.net if k != "sent") or r.client_evictions or r.holder_evictions:
        faults = ", ".join(f"{k} {v}" for k, v in r.net.items() if k != "sent" and v)
        rows.append(("faults injected", f"{faults or 'no message faults'}; evictions: {r.client_evictions} client, "
                     f"{r.holder_evictions} holder"))
    if r.problems:
        rows.append(("PROBLEMS", "; ".join(r.problems[:3])))
    width = max(len(k) for k, _ in rows)
    lines = [describe(r), ""] + [f"  {k:<{width}}  {v}" for k, v in rows]
    warning = overload(r)
    if warning:
        lines += ["", warning]
    return "\n".join(lines) + f"\n\n({r.wall_s:.1f} s of wall time)"


def write_csv(result: Result, path: str | Path) -> Path:
    """Write the time series (:data:`CSV_COLUMNS`, one row per sample) to ``path``."""
    path = Path(path)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for s in result.samples:
            writer.writerow([f"{s.t_ms / 1000:g}", s.running, s.charged, s.limit, s.ceiling, s.queued,
                             s.admitted, s.completed])
    return path


def figures(result: Result) -> dict[str, Any]:
    """The measured figures as plain data (JSON-compatible; no time series)."""
    data = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)
            if f.name not in ("scenario", "samples", "usage")}
    if result.usage is not None:
        c = cost(result.usage, result.admitted)
        data.update(usage=dataclasses.asdict(result.usage), billed_requests=result.usage.requests,
                    active_s=result.usage.active_s, usd_per_million_items=c.usd_per_million_items)
    data.update(max_running_over=result.max_running_over, max_charged_over=result.max_charged_over,
                calls=result.calls, scenario=result.scenario.to_mapping())
    return data
