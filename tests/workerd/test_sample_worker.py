"""The tutorial's fuller sample, tier 3: the sample Worker written from the docs runs on
workerd.

The sample is created fresh, outside the checkout, from the tutorial's blocks and vendored with
the offline route from the wheel built offline (``tests/sample_worker.py``, shared with the
tier-1 ``tests/test_sample_worker.py``). The workerd config is generated from the sample's own
``wrangler.toml`` (so its modules are the sample's ``entry.py`` and ``python_modules/``, nothing
of this checkout's ``src/``), and the tests drive the sample's front over HTTP:

* one job runs under a permit (``POST /run``), and the holder's ``usage()`` (``GET /usage``) goes
  back to 0 outstanding once the release is reported (releases ride on the client's next
  message, at the latest ``report_releases_within_ms``, 10 s, later);
* three jobs submitted to the same object's one queue (``POST /submit``, its ``work=``) run as
  background tasks of the Durable Object, after the handler that started them returned, at most
  two at a time, each once (``GET /job``), and their releases reach the holder.

The HTTP exchange is printed (``-s``), with timings.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from sample_worker import ROOT, built_wheel, create_sample, readme_files, wheel_modules
from semaphore.testing.workerd import collect_modules, generate_config

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
    modules = collect_modules(sample.root, "src/entry.py", rules=[])
    assert [(m.name, m.kind) for m in modules] == names
    assert names[0] == ("entry.py", "pythonModule")
    assert modules[0].content.decode() == readme_files()["src/entry.py"]
    by_name = {m.name: m for m in modules}
    vendored = {p.relative_to(sample.root).as_posix() for p in (sample.root / "python_modules").rglob("*")
                if p.is_file() and p.suffix != ".pyc"}
    assert set(by_name) == {"entry.py"} | vendored, sorted(set(by_name) ^ ({"entry.py"} | vendored))
    for name, content in wheel_modules(sample.wheel).items():
        assert by_name[f"python_modules/{name}"].content == content, name
    assert "python_modules/workers/__init__.py" in by_name
    assert not any(n.startswith("semaphore/") for n in by_name), "a semaphore/ module outside python_modules/"
    assert str(ROOT / "src") not in text
    for binding in ('(name = "BUDGET", durableObjectNamespace = (className = "Budget"))',
                    '(name = "JOBS", durableObjectNamespace = (className = "Jobs"))',
                    '(name = "LIMIT", text = "2")'):
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
            status, before = call("GET", "/usage?key=acme")
            assert status == 200 and before["outstanding"] == 0, before

            status, ran = call("POST", "/run?key=acme&job=report")
            assert status == 200, ran
            assert ran["key"] == "acme" and ran["job"] == "report" and ran["result"] == "report done", ran
            assert isinstance(ran["item"], str) and ran["item"], ran

            status, right_after = call("GET", "/usage?key=acme")
            assert status == 200, right_after
            released_at = time.monotonic()
            deadline = released_at + RELEASE_DEADLINE_S
            usage = right_after
            while usage["outstanding"] != 0 and time.monotonic() < deadline:
                time.sleep(0.5)
                status, usage = front.call("GET", "/usage?key=acme", auth=False)
                assert status == 200, usage
            exchange.append(f"... polled GET /usage?key=acme for {time.monotonic() - released_at:.1f} s -> "
                            f"{json.dumps(usage)}")
            assert usage["outstanding"] == 0, (
                f"the release did not reach the holder within {RELEASE_DEADLINE_S:.0f}s: {usage}")
            assert usage["limit"] == 2 and usage["leaseFootprint"] == 0 and usage.get("charged", 0) == 0, usage

            status, other = call("GET", "/usage?key=other")  # keys are separate budgets
            assert status == 200 and other["outstanding"] == 0, other
            status, missing = call("POST", "/run")
            assert status == 400, missing
        finally:
            print("\n--- sample Worker HTTP exchange ---\n" + "\n".join(exchange))


#: The background jobs of the second test: three of JOB_SECONDS each under the sample's LIMIT 2.
#: Longer than the holder's pacing, so that the limit binds: the first request (demand 1, sent
#: as j1 is queued) is served by the round 1 s later (``round_wait_ms``); the next request may go
#: 2 s after that round (``round_period_ms``) and its round runs 1 s later, so rounds come
#: ~3 s apart (seen on workerd). Jobs of 1 s are over before the next round (j1 ran alone, then
#: j2 and j3 together: the limit never bound); jobs of 3 s end just as it runs (j2 got the one
#: permit left, j3 waited on ``limit``, and no two ran at once). With 5 s, j2 starts while j1
#: runs and j3 waits blocked by ``limit`` until a release reaches the holder.
JOBS = ("j1", "j2", "j3")
JOB_SECONDS = 5.0
#: All three done well within this (about three rounds and two job lengths).
JOBS_DEADLINE_S = 60.0


def most_at_once(intervals: list[tuple[int, int]]) -> int:
    """The most of the ``(start, end)`` intervals (ms) that overlap at one instant (touching ends
    do not overlap)."""
    events = sorted([(end, -1) for _, end in intervals] + [(start, 1) for start, _ in intervals])
    running = peak = 0
    for _, step in events:  # at equal times the ends (-1) sort before the starts (+1)
        running += step
        peak = max(peak, running)
    return peak


def test_submitted_jobs_run_in_the_background_two_at_a_time(sample, workerd_runtime, workerd_bin, tmp_path):
    """Three jobs of 5 s are submitted with the sample's LIMIT 2. Each ``POST /submit`` answers
    at once (the item queued; nothing runs in the request); the queue's ``work=`` coroutine runs
    each job as a background task of the Durable Object, started by the pump of the alarm (or a
    background pump), and completes it after that handler returned, seconds after the submit
    answered. Polling ``GET /job`` until all are done: at most two ran at once (the running
    states sampled, and the intervals the job itself recorded in its table), each ran exactly
    once (a re-submit of ``j1`` is idempotent), one waited queued with ``blocked: limit`` while two
    ran, and once the releases
    reached the holder its usage is back to 0 charged and 0 outstanding."""
    exchange: list[str] = []
    t0 = time.monotonic()

    with front_of(workerd_runtime, workerd_bin, sample.wrangler_toml, tmp_path, {}) as front:
        def call(method: str, path: str, *, log: bool = True) -> tuple[int, dict]:
            started = time.monotonic()
            status, body = front.call(method, path, auth=False)
            if log:
                exchange.append(f"[{started - t0:6.2f} s] {method} {path} -> {status} {json.dumps(body)} "
                                f"({(time.monotonic() - started) * 1000:.0f} ms)")
            return status, body

        try:
            submitted: dict[str, float] = {}
            for job in JOBS:
                started = time.monotonic()
                status, view = call("POST", f"/submit?key=acme&job={job}&seconds={JOB_SECONDS}")
                submitted[job] = time.monotonic() - started
                assert status == 202, view
                assert view["job"] == job and view["state"] in ("queued", "claiming", "running"), view
                assert view["finished_at"] is None, view  # answered before the job could finish
            assert max(submitted.values()) < JOB_SECONDS, f"a submit waited for its job: {submitted}"
            status, again = call("POST", f"/submit?key=acme&job=j1&seconds={JOB_SECONDS}")  # idempotent
            assert status == 202 and again["job"] == "j1", again

            samples: list[dict[str, dict]] = []
            deadline = time.monotonic() + JOBS_DEADLINE_S
            last: dict[str, str] = {}
            while time.monotonic() < deadline:
                views = {job: call("GET", f"/job?key=acme&job={job}", log=False)[1] for job in JOBS}
                samples.append(views)
                states = {job: v["state"] for job, v in views.items()}
                if states != last:  # log each change of the states, with the views
                    exchange.append(f"[{time.monotonic() - t0:6.2f} s] GET /job x3 -> "
                                    + json.dumps({j: {k: v[k] for k in ("state", "permit", "blocked", "runs")}
                                                  for j, v in views.items()}))
                    last = states
                if all(s == "done" for s in states.values()):
                    break
                time.sleep(0.1)
            final = samples[-1]
            assert all(v["state"] == "done" for v in final.values()), f"not all done in {JOBS_DEADLINE_S:.0f} s: {final}"

            # At most two at once: in every sample, and by the job's own recorded intervals.
            running_counts = [sum(v["state"] == "running" for v in views.values()) for views in samples]
            assert max(running_counts) <= 2, running_counts
            assert max(running_counts) == 2, f"never two at once: {running_counts}"  # the limit is used
            intervals = [(final[job]["started_at"], final[job]["finished_at"]) for job in JOBS]
            for job, (start, end) in zip(JOBS, intervals):
                assert start is not None and end is not None and end - start >= JOB_SECONDS * 1000 - 50, (job, start, end)
            assert most_at_once(intervals) == 2, intervals
            # Each ran once (the re-submit of j1 queued nothing), under one permit, without error.
            for job in JOBS:
                view = final[job]
                assert view["runs"] == 1 and view["error"] is None, view
                assert view["permit"] in ("grant", "lease"), view
            # One waited queued while two ran, and the view said why.
            waited = {job for views in samples for job, v in views.items() if v["state"] == "queued"}
            reasons = {v["blocked"] for views in samples for v in views.values() if v["state"] == "queued"}
            exchange.append(f"... jobs seen queued: {sorted(waited)}; blocked reasons while queued: {sorted(map(str, reasons))}")
            assert waited, "no job was ever seen waiting, though three ran under a limit of 2"
            assert reasons <= {None, "limit"} and "limit" in reasons, reasons
            first = min(s for s, _ in intervals)
            exchange.append("... job intervals (ms from the first start): "
                            + ", ".join(f"{j} {s - first}..{e - first}" for j, (s, e) in zip(JOBS, intervals))
                            + f"; all three within {max(e for _, e in intervals) - first} ms")

            # The releases reach the holder: charged and outstanding back at 0.
            done_at = time.monotonic()
            deadline = done_at + RELEASE_DEADLINE_S
            status, usage = call("GET", "/usage?key=acme")
            while (usage.get("charged", 0) != 0 or usage["outstanding"] != 0) and time.monotonic() < deadline:
                time.sleep(0.5)
                status, usage = call("GET", "/usage?key=acme", log=False)
                assert status == 200, usage
            exchange.append(f"... polled GET /usage?key=acme for {time.monotonic() - done_at:.1f} s -> "
                            f"{json.dumps(usage)}")
            assert usage["outstanding"] == 0 and usage.get("charged", 0) == 0 and usage["leaseFootprint"] == 0, (
                f"the releases did not reach the holder within {RELEASE_DEADLINE_S:.0f}s: {usage}")
            status, unknown = call("GET", "/job?key=acme&job=nope")
            assert status == 200 and unknown["state"] == "unknown", unknown
        finally:
            print("\n--- sample Worker HTTP exchange (background jobs) ---\n" + "\n".join(exchange))
