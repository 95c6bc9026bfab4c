"""``python -m semaphore.simulate [options] [--scenario FILE.toml|.json] [--out DIR]``: run a
what-if scenario, print its summary, write ``simulation.csv`` and ``simulation.png`` into
``--out`` (default: the current folder). See :mod:`semaphore.simulate`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn, TextIO

from ..errors import ConfigurationError
from .engine import ProgressHook, run_scenario
from .report import figures, summary, write_csv
from .scenario import (
    CHOICES,
    Scenario,
    ScenarioError,
    add_options,
    load_scenario,
    save_scenario,
    scenario_from_args,
)

__all__ = ["main", "parser", "progress_line"]

#: Wall seconds after which a progress line is shown (``--progress`` shows it at once).
PROGRESS_AFTER_S = 5.0


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are two lines (the error, then where the options are
    listed), not the whole usage of some sixty flags."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog} --help lists every option\n")


def parser() -> argparse.ArgumentParser:
    """The command line: the run's own flags, then one flag per scenario option."""
    ap = _Parser(
        prog="python -m semaphore.simulate",
        description="What-if simulator: the real holder, client and queue code of durability-semaphore "
                    "on a virtual clock, each object on its own SQLite. Prints utilization, admission "
                    "latency, overshoot, holder calls per item and blocked time; writes the time series "
                    "(simulation.csv) and its plot (simulation.png). Every option below is also a key of "
                    "a scenario file (TOML or JSON); flags given override the file.")
    ap.add_argument("--scenario", metavar="FILE", help="a scenario file (.toml, else JSON) of option keys")
    ap.add_argument("--out", metavar="DIR", default=".", help="folder for simulation.csv and simulation.png "
                                                                "(default: the current one)")
    ap.add_argument("--no-plot", action="store_true", help="do not draw simulation.png (no matplotlib needed)")
    ap.add_argument("--save-scenario", metavar="FILE", help="also write the effective scenario to FILE "
                                                            "(.toml, else JSON)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON instead of the table")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help=f"progress line on stderr (default: after {PROGRESS_AFTER_S:g} s of wall time)")
    add_options(ap)
    return ap


def progress_line(stream: TextIO = sys.stderr, *, after_s: float = PROGRESS_AFTER_S) -> ProgressHook:
    """A progress hook writing ``simulating: 40% (120/300 s virtual), 6.1 s wall`` on one line
    of ``stream`` once ``after_s`` wall seconds have passed, at most twice a second."""
    last = [-1.0]

    def show(fraction: float, wall_s: float) -> None:
        if wall_s < after_s or (wall_s - last[0] < 0.5 and fraction < 1.0):
            return
        last[0] = wall_s
        stream.write(f"\rsimulating: {fraction:4.0%}, {wall_s:.1f} s wall" + ("\n" if fraction >= 1.0 else ""))
        stream.flush()

    return show


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status: 0, or 1 if an item ran without charged
    capacity (a bug). An invalid scenario, option, file or folder, or a plot without matplotlib,
    exits 2 with two lines (:meth:`_Parser.error`), the first naming the option."""
    ap = parser()
    args = ap.parse_args(argv)
    scenario = _scenario(ap, args)
    for warning in scenario.warnings():
        print(warning, file=sys.stderr)
    if not args.no_plot:
        from .plot import PlotUnavailable, require

        try:
            require()  # before the run, not after it
        except PlotUnavailable as exc:
            ap.error(str(exc))
    out = Path(args.out)
    with _refused(ap, "out", "a folder, or a path where one can be made"):
        out.mkdir(parents=True, exist_ok=True)
    if args.save_scenario:
        with _refused(ap, "save_scenario", "a path where a file can be written"):
            save_scenario(scenario, args.save_scenario)
    hook = None if args.progress is False else progress_line(after_s=0.0 if args.progress else PROGRESS_AFTER_S)
    started = time.perf_counter()
    with _refused(ap, "arrivals_csv", CHOICES["arrivals_csv"]):
        result = run_scenario(scenario, progress=hook)
    with _refused(ap, "out", "a folder where files can be written"):
        written = [str(write_csv(result, out / "simulation.csv"))]
        if not args.no_plot:
            from .plot import plot

            written.append(str(plot(result, out / "simulation.png")))
    print(json.dumps(figures(result), indent=2) if args.json else summary(result))
    print(f"wrote {', '.join(written)} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 1 if result.problems else 0


def _scenario(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Scenario:
    """The scenario of the command line: ``--scenario``'s file (if given), the flags over it."""
    with _refused(ap, "scenario", "a TOML (.toml) or JSON file of option keys"):
        base = load_scenario(args.scenario) if args.scenario else Scenario()
        return scenario_from_args(args, base)


@contextmanager
def _refused(ap: argparse.ArgumentParser, name: str, valid: str) -> Iterator[None]:
    """Turn an invalid scenario (:class:`ScenarioError`), an option the library refuses
    (:class:`ConfigurationError`, which names it) or an ``OSError`` of the file or folder of
    option ``name`` into a usage error (exit 2) naming the option."""
    try:
        yield
    except ScenarioError as exc:
        ap.error(str(exc))
    except ConfigurationError as exc:
        field = exc.field or name
        ap.error(f"invalid {exc}" if str(exc).startswith(f"{field}:") else f"invalid {field}: {exc}")
    except OSError as exc:
        where = exc.filename if exc.filename is not None else ""
        ap.error(f"invalid {name}: {str(where)!r}: {exc.strerror or exc} (valid: {valid})")


if __name__ == "__main__":
    raise SystemExit(main())
