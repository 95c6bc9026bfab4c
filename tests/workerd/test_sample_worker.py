"""README "Use it in your Worker", tier 3: the sample Worker written from the README runs on
workerd.

The sample is created fresh, outside the checkout, from the README's blocks and vendored with
the README's route 2 from the wheel built offline (``tests/sample_worker.py``, shared with the
tier-1 ``tests/test_sample_worker.py``). The workerd config is generated from the sample's own
``wrangler.toml`` (so its modules are the sample's ``entry.py`` and ``python_modules/``, nothing
of this checkout's ``src/``), and the test drives the sample's front over HTTP: one job runs
under a permit (``POST /run``), and the holder's ``usage()`` (``GET /usage``) goes back to 0
outstanding once the release is reported (releases ride on the client's next message, at the
latest ``report_releases_within_ms``, 10 s, later). The HTTP exchange is printed (``-s``).
"""

from __future__ import annotations

import json
import re
import time

import pytest

from sample_worker import ROOT, built_wheel, create_sample, readme_files, wheel_modules

from .harness import collect_modules, generate_config
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
