#!/usr/bin/env python3
"""One holder on the real runtime (workerd + Pyodide), driven over HTTP: figures and ratios.

Starts the pinned ``workerd`` on the project's ``wrangler.toml`` (tier 3's setup:
``semaphore.testing.workerd``, with the development Pyodide bundle built as ``scripts/devbundle.sh``
does where ``../shared/devbundle`` exists), drives ONE holder (the ``AccountLimit`` of account
``bench``) through the reference Worker's HTTP front from bounded local clients (asyncio, one
keep-alive HTTP/1.1 connection per client), stops workerd and removes its files. It measures, in
one run:

(a) the **no-op RPC**: ``GET /accounts/bench/ping`` (the front, one RPC to the holder that reads
    and writes nothing): latency of one client at a time, and throughput of ``--concurrency``
    clients; every other figure is given as a ratio against it;
(b) **syncs**: ``POST /accounts/bench/permits`` with a ``sync`` of a client holding one claimed
    grant (a heartbeat: applied in its own transaction, answered without a round): latency of one
    client at a time, and throughput and latency of ``--concurrency`` clients;
(c) **batched requests**: ``--concurrency`` clients each sending a ``request`` (demand 1, the
    grant it got last time reported fully released) as soon as its previous one was answered,
    under a limit of half of them, so every round admits, releases, deletes and blocks; rounds
    of ``--round-wait-ms``/``--round-period-ms`` (50/100 ms by default, short so the round
    timing does not bound the throughput);
(d) a **round with ``--clients`` requesting clients** (1,000): workerd restarted on the same
    storage (the same holder object) with ``ROUND_WAIT_MS`` long enough (``--big-round-wait-ms``)
    for every client's request to arrive; each client reports the grants it got last round as
    fully released and asks for one permit in each of two groups, under a limit of ``--clients``
    (so each round admits ~``--clients`` permits and blocks as many). Its cost inside the object
    is the round's ``durationMs`` (from taking the batch to the commit) in the holder's round log
    line (logger ``semaphore.round``), median over ``--rounds`` rounds after a warm-up round; the
    same workload on CPython (the test kit's real SQLite, the same library code) is measured
    beside it;
(e) **jobs through client objects**, on the first workerd (after (b), before (c)): ``--jobs`` in-Worker jobs
    (``{"workMs": 1}`` payloads) enqueued at once over ``--queues`` ``JobQueue`` objects under a
    limit of a tenth of them, until every job has run once and the holder charges nothing: the
    workerd CPU per job (its whole life: the enqueue through the front, the queue object's
    admission, run and completion, the holder's share) and its ratio against the no-op RPC's CPU
    per call.

The throughput phases run ``--duration`` seconds each. Every figure is printed with its ratio
against the no-op RPC (throughputs: figure / no-op throughput; latencies and the round:
figure / no-op p50 latency), then the issue's goals (>= 1,000 batched requests/s, >= 500
syncs/s, a 1,000-client round <= 50 ms inside the object) and whether each is met. The clients
share the machine with workerd: the workerd CPU column says how busy the runtime was (100% = one
core). Figures from a busy machine are noisy: compare ratios within one run.

    .venv/bin/python scripts/bench_runtime.py                       # about 2 minutes
    .venv/bin/python scripts/bench_runtime.py --duration 5 --clients 500 --rounds 3

Exit status 0 after a run (goals missed or not), 1 when workerd cannot start or a phase fails
(with a message saying why), 2 for bad options.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from semaphore.testing.workerd import (  # noqa: E402
    ENV_COMPAT_FLAGS,
    ENV_PYODIDE_CACHE,
    ENV_WORKERD_SKIP,
    WorkerdError,
    WorkerdProcess,
    generate_config,
    workerd_binary,
)

ACCOUNT = "bench"
GOAL_REQUESTS_PER_S = 1000.0
GOAL_SYNCS_PER_S = 500.0
GOAL_ROUND_MS = 50.0
GROUPS = 10
#: Every workerd this run started (stopped again at exit, whatever happened).
STARTED: list[WorkerdProcess] = []


class BenchError(Exception):
    """A phase could not be measured (the message says why)."""


# ------------------------------------------------------------------------------ HTTP client
class Conn:
    """One keep-alive HTTP/1.1 connection (a bounded local client): one request at a time."""

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
            self.reader = self.writer = None

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(status, parsed JSON body). Reconnects once if the server closed the connection."""
        data = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n{self.headers}"
                f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n").encode()
        for attempt in (0, 1):
            if self.writer is None:
                await self._open()
            assert self.reader is not None and self.writer is not None
            try:
                self.writer.write(head + data)
                await self.writer.drain()
                return await self._response()
            except (ConnectionError, asyncio.IncompleteReadError):
                await self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _response(self) -> tuple[int, Any]:
        assert self.reader is not None
        status_line = await self.reader.readuntil(b"\r\n")
        status = int(status_line.split()[1])
        length, chunked, close = None, False, False
        while True:
            line = await self.reader.readuntil(b"\r\n")
            if line == b"\r\n":
                break
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value:
                chunked = True
            elif name == "connection" and value == "close":
                close = True
        if chunked:
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                parts.append(await self.reader.readexactly(size))
                await self.reader.readexactly(2)
            raw = b"".join(parts)
        else:
            raw = await self.reader.readexactly(length or 0)
        if close:
            await self.close()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode("utf-8", "replace")


@dataclass
class Result:
    """What one phase measured."""

    done: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    cpu_s: float = 0.0  # workerd CPU time during the phase

    @property
    def per_s(self) -> float:
        return self.done / self.seconds if self.seconds else 0.0

    def pct(self, q: float) -> float:
        if not self.latencies_ms:
            return float("nan")
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def cpu_pct(self) -> float:
        return 100.0 * self.cpu_s / self.seconds if self.seconds else 0.0

    @property
    def cpu_ms_per_op(self) -> float:
        return 1000.0 * self.cpu_s / self.done if self.done else float("nan")


def ok(status: int, body: Any, what: str) -> Any:
    if status != 200 or (isinstance(body, dict) and "error" in body):
        raise BenchError(f"{what}: HTTP {status} {str(body)[:300]}")
    return body


def workerd_cpu_s(proc: WorkerdProcess) -> float:
    """workerd's CPU time so far (user + system, every thread), from /proc; 0 where unknown."""
    try:
        assert proc.proc is not None
        fields = Path(f"/proc/{proc.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AssertionError):
        return 0.0


async def closed_loop(proc: WorkerdProcess, conns: list[Conn], duration_s: float,
                      step: Callable[[int, Conn], Awaitable[None]]) -> Result:
    """Each connection runs ``step(i, conn)`` again and again for ``duration_s``; every completed
    step counts, with its latency."""
    result = Result()
    deadline = time.perf_counter() + duration_s

    async def worker(i: int, conn: Conn) -> None:
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            try:
                await step(i, conn)
            except BenchError as exc:
                result.errors.append(str(exc))
                if len(result.errors) > 20:
                    raise
                continue
            result.latencies_ms.append((time.perf_counter() - t) * 1000)
            result.done += 1

    cpu0, t0 = workerd_cpu_s(proc), time.perf_counter()
    await asyncio.gather(*(worker(i, c) for i, c in enumerate(conns)))
    result.seconds = time.perf_counter() - t0
    result.cpu_s = workerd_cpu_s(proc) - cpu0
    return result


# ------------------------------------------------------------------------------ messages
def sync_msg(client: str, grants: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "sync", "v": 1, "clientId": client, "grants": grants}


def request_msg(client: str, demand: list[tuple[str, int]], grants: list[dict[str, Any]],
                oldest_at: int) -> dict[str, Any]:
    return {"type": "request", "v": 1, "clientId": client, "grants": grants,
            "demand": [{"group": g, "count": n, "oldestAt": oldest_at} for g, n in demand]}


def released(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The client's active grants not yet fully released, reported as claimed and released."""
    return [{"grantId": g["grantId"], "claimed": g["permits"], "released": g["permits"]}
            for g in reply.get("grants", []) if g.get("status") == "active" and g["released"] < g["permits"]]


def round_lines(proc: WorkerdProcess) -> list[dict[str, Any]]:
    out = []
    for line in proc.logs.splitlines():
        if '"sqlStatements"' in line and "{" in line:
            try:
                out.append(json.loads(line[line.index("{"):]))
            except ValueError:
                continue
    return out


# ------------------------------------------------------------------------------ phases
async def noop_phase(proc: WorkerdProcess, conns: list[Conn], samples: int, duration_s: float
                     ) -> tuple[Result, Result]:
    async def ping(i: int, conn: Conn) -> None:
        ok(*await conn.call("GET", f"/accounts/{ACCOUNT}/ping"), "GET .../ping")

    for _ in range(100):  # warm
        await ping(0, conns[0])
    serial = await sequential(proc, conns[0], samples, ping)
    loaded = await closed_loop(proc, conns, duration_s, ping)
    return serial, loaded


async def sequential(proc: WorkerdProcess, conn: Conn, samples: int,
                     step: Callable[[int, Conn], Awaitable[None]]) -> Result:
    result = Result()
    cpu0, t0 = workerd_cpu_s(proc), time.perf_counter()
    for _ in range(samples):
        t = time.perf_counter()
        await step(0, conn)
        result.latencies_ms.append((time.perf_counter() - t) * 1000)
        result.done += 1
    result.seconds = time.perf_counter() - t0
    result.cpu_s = workerd_cpu_s(proc) - cpu0
    return result


async def sync_phase(proc: WorkerdProcess, conns: list[Conn], admin: Conn, samples: int,
                     duration_s: float) -> tuple[Result, Result]:
    """Each sync client first gets one grant (one round) and claims it; its syncs then report
    it claimed (a heartbeat). Afterwards the grants are released."""
    n = len(conns)
    ok(*await admin.call("PUT", f"/accounts/{ACCOUNT}/limit", {"limit": n}), "PUT .../limit")
    now = int(time.time() * 1000)

    async def get_grant(i: int) -> dict[str, Any]:
        reply = ok(*await conns[i].call("POST", f"/accounts/{ACCOUNT}/permits",
                                        request_msg(f"sync-{i}", [("sync", 1)], [], now)), "request")
        grants: list[dict[str, Any]] = [g for g in reply["grants"] if g["status"] == "active"]
        if len(grants) != 1:
            raise BenchError(f"sync client {i}: expected one grant, got {reply}")
        return grants[0]

    grants = await asyncio.gather(*(get_grant(i) for i in range(n)))
    claimed = [[{"grantId": g["grantId"], "claimed": g["permits"], "released": 0}] for g in grants]

    async def sync(i: int, conn: Conn) -> None:
        ok(*await conn.call("POST", f"/accounts/{ACCOUNT}/permits", sync_msg(f"sync-{i}", claimed[i])), "sync")

    for i in range(n):
        await sync(i, conns[i])  # each claim once (R15a), warm
    serial = await sequential(proc, conns[0], samples, sync)
    loaded = await closed_loop(proc, conns, duration_s, sync)
    done = [[{"grantId": g["grantId"], "claimed": g["permits"], "released": g["permits"]}] for g in grants]
    await asyncio.gather(*(conns[i].call("POST", f"/accounts/{ACCOUNT}/permits", sync_msg(f"sync-{i}", done[i]))
                           for i in range(n)))
    return serial, loaded


async def request_phase(proc: WorkerdProcess, conns: list[Conn], admin: Conn, duration_s: float
                        ) -> tuple[Result, list[dict[str, Any]]]:
    n = len(conns)
    ok(*await admin.call("PUT", f"/accounts/{ACCOUNT}/limit", {"limit": max(1, n // 2)}), "PUT .../limit")
    reports: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    oldest = int(time.time() * 1000)

    async def request(i: int, conn: Conn) -> None:
        message = request_msg(f"req-{i}", [(f"g{i % GROUPS}", 1)], reports[i], oldest)
        reports[i] = released(ok(*await conn.call("POST", f"/accounts/{ACCOUNT}/permits", message), "request"))

    before = len(round_lines(proc))
    result = await closed_loop(proc, conns, duration_s, request)
    rounds = round_lines(proc)[before:]
    # Release what the clients still hold (a sync each).
    await asyncio.gather(*(conns[i].call("POST", f"/accounts/{ACCOUNT}/permits",
                                         sync_msg(f"req-{i}", reports[i])) for i in range(n) if reports[i]))
    return result, rounds


async def big_round_phase(proc: WorkerdProcess, conns: list[Conn], admin: Conn, rounds: int
                          ) -> tuple[list[dict[str, Any]], list[float]]:
    """``rounds`` + 1 rounds of every client at once (the first is a warm-up). Returns the
    measured rounds' log records and, per round, ms from the round's start to its last reply."""
    n = len(conns)
    ok(*await admin.call("PUT", f"/accounts/{ACCOUNT}/limit", {"limit": n}), "PUT .../limit")
    reports: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    records: list[dict[str, Any]] = []
    deliveries: list[float] = []
    for k in range(rounds + 1):
        before = len(round_lines(proc))
        oldest = int(time.time() * 1000)

        async def one(i: int, oldest: int = oldest) -> float:
            demand = [(f"g{i % GROUPS}", 1), (f"g{(i + GROUPS // 2) % GROUPS}", 1)]
            reply = ok(*await conns[i].call("POST", f"/accounts/{ACCOUNT}/permits",
                                            request_msg(f"c-{i}", demand, reports[i], oldest)), "request")
            reports[i] = released(reply)
            return time.time() * 1000

        answered = await asyncio.gather(*(one(i) for i in range(n)))
        new = round_lines(proc)[before:]
        if len(new) != 1 or new[0]["requests"] != n:
            raise BenchError(f"round {k}: expected one round of {n} clients, the holder ran "
                             f"{[r['requests'] for r in new]} (raise --big-round-wait-ms)")
        if k:
            records.append(new[0])
            deliveries.append(max(answered) - new[0]["at"])
    return records, deliveries


async def jobs_phase(proc: WorkerdProcess, conns: list[Conn], admin: Conn, jobs: int, queues: int
                     ) -> tuple[Result, int]:
    """``jobs`` in-Worker jobs (``{"workMs": 1}``) enqueued at once over ``queues`` JobQueue
    client objects (``POST .../queues/{q}/jobs``), under a limit of a tenth of them: each is
    registered, queued, admitted (a lease or a grant of the holder), run, completed and its
    release applied at the holder. Measured from the first enqueue until every job has run once
    and the holder charges nothing (``GET .../usage`` every 250 ms). Returns the phase (``done``
    = jobs) and the number of usage polls."""
    ok(*await admin.call("PUT", f"/accounts/{ACCOUNT}/limit", {"limit": max(1, jobs // 10)}), "PUT .../limit")
    run = secrets.token_hex(4)
    result = Result()
    cpu0, t0 = workerd_cpu_s(proc), time.perf_counter()

    async def enqueue(i: int) -> None:
        conn = conns[i % len(conns)]
        status, body = await conn.call("POST", f"/accounts/{ACCOUNT}/queues/q{i % queues}/jobs",
                                       {"id": f"bench-{run}-{i}", "group": f"g{i % GROUPS}", "payload": {"workMs": 1}})
        if status != 201:
            raise BenchError(f"enqueue of job {i}: HTTP {status}: {body}")

    for start in range(0, jobs, len(conns)):  # one call per connection at a time
        await asyncio.gather(*(enqueue(i) for i in range(start, min(jobs, start + len(conns)))))
    polls, deadline = 0, time.perf_counter() + 600
    while True:
        usage = ok(*await admin.call("GET", f"/accounts/{ACCOUNT}/usage"), "GET .../usage")
        polls += 1
        if usage["charged"] == 0 and usage["outstanding"] == 0:
            runs = [ok(*await admin.call("GET", f"/accounts/{ACCOUNT}/queues/q{q}/runs"), "GET .../runs")["runs"]
                    for q in range(queues)]
            ended = [r["jobId"] for rs in runs for r in rs if r["jobId"].startswith(f"bench-{run}-") and r["endedAt"]]
            if len(set(ended)) == jobs:
                break
        if time.perf_counter() > deadline:
            raise BenchError(f"jobs phase: not done after 600 s (usage {usage})")
        await asyncio.sleep(0.25)
    result.seconds = time.perf_counter() - t0
    result.cpu_s = workerd_cpu_s(proc) - cpu0
    if len(ended) != jobs:
        raise BenchError(f"jobs phase: {len(ended)} finished runs for {jobs} jobs (a job ran twice)")
    result.done = jobs
    return result, polls


def cpython_round(clients: int, rounds: int) -> list[float]:
    """The same workload as :func:`big_round_phase` on CPython: the library's holder on the test
    kit (real SQLite in a temp file), requests handed to ``handle()`` directly. ``durationMs``
    of each measured round (after a warm-up round)."""
    from semaphore import DurabilityScheduler, DurabilitySemaphore
    from semaphore.testing import LocalContext, LocalStorage

    records: list[Any] = []

    async def run(path: str) -> None:
        ctx = LocalContext(LocalStorage(path))
        holder = DurabilitySemaphore(scheduler=DurabilityScheduler(ctx), limit=clients, round_wait_ms=20,
                                     round_period_ms=0, grant_timeout_ms=60_000, on_round=records.append)
        reports: list[list[dict[str, Any]]] = [[] for _ in range(clients)]
        for _ in range(rounds + 1):
            oldest = int(time.time() * 1000)
            messages = [request_msg(f"c-{i}", [(f"g{i % GROUPS}", 1), (f"g{(i + GROUPS // 2) % GROUPS}", 1)],
                                    reports[i], oldest) for i in range(clients)]
            replies = await asyncio.gather(*(holder.handle(m) for m in messages))
            reports = [released(r) for r in replies]

    with tempfile.TemporaryDirectory(prefix="bench-runtime-cpython-", dir=ROOT / ".tmp") as tmp:
        asyncio.run(run(os.path.join(tmp, "holder.sqlite")))
    sizes = [r.requests for r in records]
    if sizes[1:] != [clients] * rounds:
        raise BenchError(f"CPython rounds had {sizes} clients, not {clients} each")
    return [r.duration_ms for r in records[1:]]


# ------------------------------------------------------------------------------ workerd
def devbundle_env() -> None:
    """What ``scripts/devbundle.sh``'s ``use_devbundle`` does, by running it: where the shared
    folder has the builder, build the development Pyodide bundle and export its variables here."""
    if os.environ.get(ENV_WORKERD_SKIP):
        raise BenchError(f"workerd cannot run Python here: {os.environ[ENV_WORKERD_SKIP]}")
    if os.environ.get(ENV_PYODIDE_CACHE):
        return
    script = ('. "$1/scripts/devbundle.sh"; use_devbundle "$1" >&2 || exit 1; '
              'printf "%s\\n%s\\n%s\\n" "${SEMAPHORE_PYODIDE_CACHE:-}" "${SEMAPHORE_COMPAT_FLAGS:-}" '
              '"${SEMAPHORE_WORKERD_SKIP:-}"')
    env = dict(os.environ, PATH=f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run(["bash", "-c", script, "bench_runtime", str(ROOT)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise BenchError("building the development Pyodide bundle failed (scripts/devbundle.sh; see above)")
    cache, flags, skip = (done.stdout.splitlines() + ["", "", ""])[:3]
    if skip:
        raise BenchError(f"workerd cannot run Python here: {skip}")
    if cache:
        os.environ[ENV_PYODIDE_CACHE] = cache
    if flags:
        os.environ[ENV_COMPAT_FLAGS] = flags


def start_workerd(base: Path, name: str, storage: Path, vars_override: dict[str, str],
                  token: str) -> WorkerdProcess:
    binary = workerd_binary()
    assert binary is not None  # checked by main()
    config = generate_config(ROOT / "wrangler.toml", base / f"config-{name}", storage_dir=storage, port=0,
                             vars_override=vars_override, secrets={"ADMIN_TOKEN": token})
    proc = WorkerdProcess(config, binary=binary, log_dir=base / f"logs-{name}")
    STARTED.append(proc)
    try:
        proc.start()
    except WorkerdError as err:
        tail = "\n".join(err.output.strip().splitlines()[-15:])
        raise BenchError(f"workerd could not start: {err}\n--- workerd output (tail) ---\n{tail}") from None
    return proc


async def connections(proc: WorkerdProcess, n: int, token: str) -> list[Conn]:
    headers = {"authorization": f"Bearer {token}", "connection": "keep-alive"}
    conns = [Conn(proc.address, int(proc.port or 0), headers) for _ in range(n)]
    for i in range(0, n, 100):  # open them in batches
        await asyncio.gather(*(c._open() for c in conns[i:i + 100]))
    return conns


async def close_all(conns: list[Conn]) -> None:
    await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)


def raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < need:
            raise BenchError(f"--clients needs ~{need} open files; the hard limit is {hard}")


# ------------------------------------------------------------------------------ report
def verdict(value: float, goal: float, higher: bool) -> str:
    met = value >= goal if higher else value <= goal
    return "met" if met else "NOT met"


def report(args: argparse.Namespace, figures: dict[str, Any]) -> None:
    noop_serial: Result = figures["noop_serial"]
    noop_loaded: Result = figures["noop_loaded"]
    base_ms, base_per_s = noop_serial.pct(0.5), noop_loaded.per_s
    rows: list[tuple[str, ...]] = []

    def cpu(r: Result) -> str:
        return f"{r.cpu_pct:.0f}% of a core, {r.cpu_ms_per_op:.2f} ms/op"

    def lat(label: str, r: Result) -> None:
        rows.append((label, f"{r.pct(0.5):.1f} / {r.pct(0.95):.1f} ms", "",
                     f"{r.pct(0.5) / base_ms:.2f}x / {r.pct(0.95) / base_ms:.2f}x", ""))

    def thr(label: str, r: Result, goal: float | None = None) -> None:
        g = "" if goal is None else f">= {goal:,.0f}/s: {verdict(r.per_s, goal, True)}"
        rows.append((label, f"{r.per_s:,.0f}/s", cpu(r), f"{r.per_s / base_per_s:.2f}x", g))

    c = args.concurrency
    lat("(a) no-op RPC latency p50 / p95, 1 client", noop_serial)
    thr(f"(a) no-op RPC throughput, {c} clients", noop_loaded)
    lat(f"(a) no-op RPC latency p50 / p95, {c} clients", noop_loaded)
    lat("(b) sync latency p50 / p95, 1 client", figures["sync_serial"])
    thr(f"(b) sync throughput, {c} clients", figures["sync_loaded"], GOAL_SYNCS_PER_S)
    lat(f"(b) sync latency p50 / p95, {c} clients", figures["sync_loaded"])
    req: Result = figures["requests"]
    thr(f"(c) batched requests throughput, {c} clients", req, GOAL_REQUESTS_PER_S)
    lat(f"(c) request latency p50 / p95, {c} clients", req)
    rr = figures["request_rounds"]
    if rr:
        per_round = statistics.median(r["requests"] for r in rr)
        dur = statistics.median(r["durationMs"] for r in rr)
        rows.append(("(c) its rounds: count, clients per round, ms in the object",
                     f"{len(rr)}, {per_round:.0f}, {dur:.1f} ms (medians)", "", f"{dur / base_ms:.2f}x", ""))
    big = figures["big_rounds"]
    n, base_d = args.clients, figures["noop_restart_ms"]
    ms = statistics.median(r["durationMs"] for r in big)
    rows.append((f"(d) {n:,}-client round in the object (median of {len(big)})",
                 f"{ms:.1f} ms (min {min(r['durationMs'] for r in big):.1f})", "", f"{ms / base_d:.1f}x",
                 f"<= {GOAL_ROUND_MS:.0f} ms: {verdict(ms, GOAL_ROUND_MS, False)}"))
    rows.append(("(d) its SQL statements / permits admitted / blocked",
                 f"{statistics.median(r['sqlStatements'] for r in big):.0f} / "
                 f"{statistics.median(r['admitted'] for r in big):.0f} / "
                 f"{statistics.median(sum(r['blocked'].values()) for r in big):.0f}", "", "", ""))
    deliver = statistics.median(figures["deliveries"])
    rows.append((f"(d) round start to the last of its {n:,} HTTP replies", f"{deliver:.0f} ms", "",
                 f"{deliver / base_d:.1f}x", ""))
    cp = figures.get("cpython")
    if cp:
        cms = statistics.median(cp)
        rows.append(("(d) the same round on CPython (test kit, real SQLite)", f"{cms:.1f} ms", "",
                     f"workerd / CPython {ms / cms:.2f}x", ""))
    jobs: Result = figures["jobs"]
    rows.append((f"(e) {jobs.done:,} jobs through {args.queues} queue objects, per job",
                 f"{jobs.seconds * 1000 / jobs.done:.1f} ms of wall time", cpu(jobs),
                 f"{jobs.cpu_ms_per_op / noop_loaded.cpu_ms_per_op:.1f}x the no-op's CPU", ""))
    head = ("figure", "value", "workerd CPU", "vs no-op", "goal (issue)")
    width = [max(len(r[i]) for r in [*rows, head]) for i in range(len(head))]
    print("  ".join(h.ljust(w) for h, w in zip(head, width)))
    print("  ".join("-" * w for w in width))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, width)).rstrip())
    print(f"\nvs no-op: a throughput / the no-op RPC's ({base_per_s:,.0f}/s with {c} clients); a latency or a\n"
          f"round / the no-op RPC's 1-client p50 ({base_ms:.1f} ms; for (d) {base_d:.1f} ms, measured again after\n"
          "the restart). workerd CPU: its user + system time over the phase (100% = one core; ms/op: per\n"
          "answered call), the load it carried beside this script's clients and the machine's other work.\n"
          "(e): each job's whole life, in workerd: its enqueue (the front, the job's registration at the\n"
          "holder, the queue object's insert), its admission, run and completion in the queue object, the\n"
          "holder's share of the requests and syncs, and the phase's usage polls "
          f"({figures['job_polls']}); vs no-op: its CPU\nper job / the no-op RPC's CPU per call.")
    errors = [e for k in ("noop_loaded", "sync_loaded", "requests") for e in figures[k].errors]
    if errors:
        print(f"errors during the throughput phases: {len(errors)}, e.g. {errors[0]}")


# ------------------------------------------------------------------------------ main
async def run(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    token = secrets.token_hex(16)
    storage = base / "storage"
    fast = {"ACCOUNT_CONCURRENCY": "10", "GRANT_TIMEOUT_MS": "60000", "ROUND_WAIT_MS": str(args.round_wait_ms),
            "ROUND_PERIOD_MS": str(args.round_period_ms), "HOLD_BLOCKED_MS": "0", "REQUEST_WAIT_MS": "0"}
    figures: dict[str, Any] = {}
    t = time.perf_counter()
    proc = start_workerd(base, "fast", storage, fast, token)
    print(f"workerd started in {time.perf_counter() - t:.1f} s (rounds {args.round_wait_ms}/{args.round_period_ms} ms)",
          flush=True)
    try:
        conns = await connections(proc, args.concurrency, token)
        admin = conns[0]
        try:
            figures["noop_serial"], figures["noop_loaded"] = await noop_phase(
                proc, conns, args.samples, args.duration)
            print(f"  (a) no-op: p50 {figures['noop_serial'].pct(0.5):.1f} ms, "
                  f"{figures['noop_loaded'].per_s:,.0f}/s", flush=True)
            figures["sync_serial"], figures["sync_loaded"] = await sync_phase(
                proc, conns, admin, args.samples, args.duration)
            print(f"  (b) syncs: p50 {figures['sync_serial'].pct(0.5):.1f} ms, "
                  f"{figures['sync_loaded'].per_s:,.0f}/s", flush=True)
            # (e) before (c): the contended rounds of (c) are the last ones (d)'s holder ran, so
            # (d)'s first requests wait for its batched round instead of being served at once (R9a)
            figures["jobs"], figures["job_polls"] = await jobs_phase(proc, conns, admin, args.jobs, args.queues)
            print(f"  (e) jobs: {args.jobs} in {figures['jobs'].seconds:.1f} s, "
                  f"{figures['jobs'].cpu_ms_per_op:.1f} ms of workerd CPU each", flush=True)
            figures["requests"], figures["request_rounds"] = await request_phase(proc, conns, admin, args.duration)
            print(f"  (c) requests: {figures['requests'].per_s:,.0f}/s in {len(figures['request_rounds'])} rounds",
                  flush=True)
        finally:
            await close_all(conns)
    finally:
        proc.stop()
    big = {**fast, "ROUND_WAIT_MS": str(args.big_round_wait_ms), "ROUND_PERIOD_MS": "0"}
    t = time.perf_counter()
    proc = start_workerd(base, "big", storage, big, token)  # the same storage: the same holder object
    print(f"workerd restarted in {time.perf_counter() - t:.1f} s on the same storage "
          f"(ROUND_WAIT_MS {args.big_round_wait_ms})", flush=True)
    try:
        conns = await connections(proc, args.clients, token)
        try:
            async def ping(i: int, conn: Conn) -> None:
                ok(*await conn.call("GET", f"/accounts/{ACCOUNT}/ping"), "GET .../ping")

            for _ in range(100):  # warm
                await ping(0, conns[0])
            figures["noop_restart_ms"] = (await sequential(proc, conns[0], args.samples, ping)).pct(0.5)
            figures["big_rounds"], figures["deliveries"] = await big_round_phase(proc, conns, conns[0], args.rounds)
            print(f"  (d) {args.clients}-client rounds: {[r['durationMs'] for r in figures['big_rounds']]} ms",
                  flush=True)
        finally:
            await close_all(conns)
    finally:
        proc.stop()
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per throughput phase (default 10)")
    ap.add_argument("--concurrency", type=int, default=200,
                    help="clients (connections) of the throughput phases (default 200)")
    ap.add_argument("--clients", type=int, default=1000, help="requesting clients of the big round (default 1000)")
    ap.add_argument("--rounds", type=int, default=5, help="measured big rounds, after a warm-up one (default 5)")
    ap.add_argument("--samples", type=int, default=300, help="sequential samples per latency figure (default 300)")
    ap.add_argument("--round-wait-ms", type=int, default=50, help="ROUND_WAIT_MS of (a)-(c) (default 50)")
    ap.add_argument("--round-period-ms", type=int, default=100, help="ROUND_PERIOD_MS of (a)-(c) (default 100)")
    ap.add_argument("--big-round-wait-ms", type=int, default=6000,
                    help="ROUND_WAIT_MS of (d): every client's request must arrive within it (default 6000)")
    ap.add_argument("--jobs", type=int, default=400, help="in-Worker jobs of (e) (default 400)")
    ap.add_argument("--queues", type=int, default=4, help="queue objects the jobs of (e) go to (default 4)")
    ap.add_argument("--no-cpython", action="store_true", help="skip the CPython round of (d)")
    ap.add_argument("--keep", action="store_true", help="keep workerd's config, logs and storage (printed)")
    args = ap.parse_args()
    for name in ("duration", "concurrency", "clients", "rounds", "samples", "big_round_wait_ms", "jobs", "queues"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.round_wait_ms < 0 or args.round_period_ms < 0:
        ap.error("round times must be >= 0")

    load = os.getloadavg()
    print(f"bench_runtime: one holder (account {ACCOUNT!r}) in workerd, driven over HTTP from local clients; "
          f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    (ROOT / ".tmp").mkdir(exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="bench-runtime-", dir=ROOT / ".tmp"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks stop workerd
    started = time.perf_counter()
    try:
        raise_fd_limit(max(args.clients, args.concurrency) * 3 + 256)
        binary = workerd_binary()
        if binary is None or not binary.exists():
            raise BenchError(f"no workerd binary{f' at {binary}' if binary else ''}: run scripts/setup "
                             "(the npm-pinned workerd) or set SEMAPHORE_WORKERD")
        devbundle_env()
        figures = asyncio.run(run(args, base))
        if not args.no_cpython:
            figures["cpython"] = cpython_round(args.clients, args.rounds)
            print(f"  (d) CPython: {[round(x, 1) for x in figures['cpython']]} ms", flush=True)
    except BenchError as exc:
        print(f"bench_runtime: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_runtime: interrupted", file=sys.stderr)
        return 1
    finally:
        for proc in STARTED:  # a no-op for those already stopped
            proc.stop()
        if args.keep:
            print(f"kept {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    print()
    report(args, figures)
    print(f"\ntotal run time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
