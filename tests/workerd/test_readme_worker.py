"""The README's complete Worker, tier 3: written from the README's two blocks into an empty folder
outside the checkout, vendored the offline way from the wheel built offline
(``tests/sample_worker.py``), and run on workerd with a config generated from its own
``wrangler.toml``. Seven exports start at once over HTTP, six of account ``acme`` and one of
``beta``, each in a client object of its own: every answer is its export's, and the holders'
round log lines (the README configures logging) show that no round left more than
``EXPORTS_PER_ACCOUNT`` (2) permits charged and that the limit made demand wait.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from sample_worker import built_wheel, create_sample
from test_readme import readme_worker

from .test_runtime_wide import front_of

pytestmark = pytest.mark.workerd

ROUND_LINE = re.compile(r'\{"at":\d+,"durationMs".*?"error":(?:null|"[^"]*")\}')


def test_the_readme_worker_keeps_each_accounts_exports_within_its_limit(workerd_runtime, workerd_bin,
                                                                        tmp_path_factory):
    project = create_sample(tmp_path_factory.mktemp("readme-worker3") / "exports", built_wheel(), readme_worker())
    paths = [f"/exports/acme/e{n}" for n in range(1, 7)] + ["/exports/beta/e1"]
    with front_of(workerd_runtime, workerd_bin, project.wrangler_toml, tmp_path_factory.mktemp("run"), {}) as front:
        with ThreadPoolExecutor(len(paths)) as pool:
            answers = list(pool.map(lambda p: front.proc.request(p, method="POST", timeout=120), paths))
        logs = front.proc.logs
    assert [(status, body.decode()) for status, body in answers] == [
        (200, f"{p.removeprefix('/exports/')} exported") for p in paths]
    rounds = [json.loads(m.group(0)) for m in ROUND_LINE.finditer(logs)]
    assert rounds, f"no round log line in workerd's output:\n{logs[-5000:]}"
    assert not any(r["failed"] for r in rounds), rounds
    assert max(r["charged"] for r in rounds) == 2 and all(r["limit"] == 2 for r in rounds), rounds
    # each export got one permit: with the default leases a lease of one slot (a grant with leases=None)
    assert sum(r["admitted"] + r["leasePermitsIssued"] for r in rounds) == len(paths)
    assert any(r["blocked"].get("limit", 0) > 0 for r in rounds), rounds  # the limit made exports wait
    print(f"\n{len(rounds)} rounds: " + "; ".join(
        f"{r['requests']} asked, {r['admitted']} granted, {r['leasePermitsIssued']} leased,"
        f" blocked {r['blocked']}, charged {r['charged']}"
        for r in rounds))
