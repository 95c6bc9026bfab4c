"""The soak: many seeds of the fault simulation (``semaphore.simulate.soak``) in every mode.

    scripts/soak [--seeds N] [--ops M] [--seed S] [--jobs J] [--skew-ms MS]
                 [--modes defaults,none,batched,strict,under,over,held,reuse,reuse-held]

Runs seeds ``0 .. N-1`` (or only ``--seed S``) in each mode; ``--ops`` is the total budget of
holder operations (messages the holder handles in the faulty phases), split evenly over the
runs (seeds x modes), so the default, 100 seeds in the 9 modes and 100,000 operations, is 111 per
run; each run
then heals and settles (those operations are counted too). A progress bar goes to stderr, the
summary table to stdout: operations, faults injected by kind, violations of I1-I5, items lost
or run twice. Every failing run is printed with its seed, mode and what was found, and
``--seed S`` replays it exactly (all randomness comes from the seed, time is virtual; the script
pins PYTHONHASHSEED so set iteration is the same too). Exit code 1 on any violation.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from semaphore.simulate.soak import KINDS, MODES, RunResult, run_one, summarize  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=100, help="seeds 0..N-1 (default 100)")
    ap.add_argument("--ops", type=int, default=100_000,
                    help="total holder operations over all runs (default 100000)")
    ap.add_argument("--seed", type=int, default=None, help="replay this one seed")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ",".join(MODES))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    ap.add_argument("--skew-ms", type=int, default=200, help="each object's clock offset within +-MS")
    ap.add_argument("--ops-per-run", type=int, default=None, help="override the per-run budget")
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    return args


def _work(task: tuple[int, str, int, int]) -> RunResult:
    seed, mode, ops, skew = task
    logging.disable(logging.CRITICAL)  # failures are injected on purpose
    return run_one(seed, mode, ops=ops, skew_ms=skew)


class Progress:
    """A progress bar on stderr (redrawn in place on a terminal, every 10% otherwise)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.ops, self.failed = total, 0, 0, 0
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._last_tenth = -1

    def step(self, r: RunResult) -> None:
        self.done += 1
        self.ops += r.stats.ops
        self.failed += r.failed
        tenth = self.done * 10 // self.total
        if not self.tty and tenth == self._last_tenth and self.done != self.total:
            return
        self._last_tenth = tenth
        width = 30
        filled = width * self.done // self.total
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} runs  "
                f"{self.ops:,} ops  {self.failed} failed  {elapsed:.0f}s  eta {eta:.0f}s")
        sys.stderr.write(("\r" + line) if self.tty else line + "\n")
        if self.tty and self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def run_all(tasks: list[tuple[int, str, int, int]], jobs: int) -> list[RunResult]:
    progress = Progress(len(tasks))
    results: list[RunResult] = []
    if jobs <= 1 or len(tasks) == 1:
        for t in tasks:
            results.append(_work(t))
            progress.step(results[-1])
    else:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            for r in pool.imap_unordered(_work, tasks):
                results.append(r)
                progress.step(r)
    order = {(s, m): i for i, (s, m, _, _) in enumerate(tasks)}
    return sorted(results, key=lambda r: order[(r.seed, r.mode)])


def render(table: dict[str, dict[str, int]], modes: list[str]) -> str:
    cols = [*modes, "total"]
    label_w = max(len(k) for k in table)
    widths = [max(len(c), *(len(f"{row.get(c, sum(row.values())):,}") for row in table.values())) for c in cols]
    lines = [f"{'':<{label_w}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True))]
    for label, row in table.items():
        total = max(row.values()) if label.startswith(("fault: max", "max ")) else sum(row.values())
        values = [*(row[m] for m in modes), total]
        lines.append(f"{label:<{label_w}}  " + "  ".join(f"{v:>{w},}" for v, w in zip(values, widths, strict=True)))
    return "\n".join(lines)


def report(results: list[RunResult], args: argparse.Namespace, per_run: int) -> int:
    table = summarize(results, args.modes)
    seeds = sorted({r.seed for r in results})
    print(f"soak: {len(seeds)} seed(s) x {len(args.modes)} mode(s), {per_run:,} holder operations per run "
          f"in the faulty phase, clock skew within +-{args.skew_ms} ms")
    print(render(table, args.modes))
    failed = [r for r in results if r.failed]
    bad = sum(sum(r.stats.violations[k] for k in KINDS) for r in results)
    for r in failed:
        kinds = {k: v for k, v in r.stats.violations.items() if v}
        print(f"FAILED seed {r.seed} mode {r.mode}: {kinds}  (replay: scripts/soak --seed {r.seed} "
              f"--modes {r.mode} --ops-per-run {per_run} --skew-ms {args.skew_ms})")
        for kind, detail in r.found[:5]:
            print(f"    {kind}: {detail}")
    print(f"result: {'FAIL' if failed else 'OK'} - {bad} violation(s) in {len(failed)} run(s)")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":  # set iteration order is part of the replay
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, __file__, *argv])
    args = parse(argv)
    seeds = [args.seed] if args.seed is not None else list(range(args.seeds))
    per_run = args.ops_per_run or max(1, args.ops // max(1, args.seeds * len(args.modes)))
    tasks = [(s, m, per_run, args.skew_ms) for s in seeds for m in args.modes]
    started = time.monotonic()
    results = run_all(tasks, args.jobs)
    code = report(results, args, per_run)
    sys.stderr.write(f"soak: {len(tasks)} runs in {time.monotonic() - started:.1f}s with {args.jobs} job(s)\n")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
