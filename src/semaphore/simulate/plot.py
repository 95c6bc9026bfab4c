"""The plot of a run (matplotlib, Agg backend, imported only here and only when plotting)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .engine import Result

__all__ = ["plot", "require", "PlotUnavailable"]


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (``pip install 'durability-semaphore[simulate]'``)."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable(
            "the plot needs matplotlib: pip install 'durability-semaphore[simulate]' (or matplotlib), "
            "or pass --no-plot") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def require() -> None:
    """Raise :class:`PlotUnavailable` now if matplotlib is missing (the command line checks
    before a run, not after it)."""
    _pyplot()


def plot(result: Result, path: str | Path, *, title: str | None = None) -> Path:
    """Draw ``result``'s time series into a PNG at ``path``: top, charged capacity and running
    items against the limit (and the ceiling, if leases may go above it); middle, queue depth;
    bottom, items admitted per sample interval."""
    plt = _pyplot()
    samples = result.samples
    t = [s.t_ms / 1000 for s in samples]
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(10, 7.5), sharex=True,
                                        gridspec_kw={"height_ratios": [3, 1.4, 1.4]})
    top.step(t, [s.charged for s in samples], where="post", color="tab:orange", label="charged at the holder")
    top.step(t, [s.running for s in samples], where="post", color="tab:blue", label="running items")
    top.axhline(result.scenario.limit, color="black", linestyle="--", linewidth=1, label="limit")
    if result.ceiling != result.scenario.limit:
        top.axhline(result.ceiling, color="grey", linestyle=":", linewidth=1, label="ceiling (limit + extra)")
    top.set_ylabel("permits")
    top.set_ylim(0, max([result.ceiling, result.max_charged, result.max_running]) * 1.3 + 1)
    top.legend(loc="upper left", fontsize="small", ncol=4)
    util = "-" if result.utilization is None else f"{result.utilization:.1%}"
    top.set_title(title or f"utilization {util}, worst charged - limit {result.max_charged_over}", fontsize="medium")
    mid.fill_between(t, [s.queued for s in samples], step="post", color="tab:red", alpha=0.4)
    mid.set_ylabel("queued items")
    low.bar(t, [s.admitted for s in samples], width=result.scenario.sample_ms / 1000, align="edge",
            color="tab:green")
    low.set_ylabel(f"admitted / {result.scenario.sample_ms / 1000:g} s")
    low.set_xlabel("virtual time (s)")
    for ax in (top, mid, low):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
