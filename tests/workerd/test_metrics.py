"""Tier 3: ``GET /metrics`` of the reference Worker in the real workerd (issue 11).

Two accounts run jobs through the Worker (real RPC from the JobQueues to the AccountLimit
holders, the holders registering themselves in the AccountIndex by ``ctx.id.name``); a third
account is only read. ``/metrics`` is parsed with ``prometheus_client``'s text parser and checked
against ``/usage``; the holders' JSON round lines (logger ``semaphore.round``) appear in
workerd's output.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .test_app import by_state, wait_for
from .test_runtime_wide import Front, front_of

pytestmark = pytest.mark.workerd

VARS = {
    "LEASES": "off",  # grants: every admission counted by semaphore_admitted_total
    "ACCOUNT_CONCURRENCY": "2",
    "GRANT_TIMEOUT_MS": "3000",
    "ROUND_WAIT_MS": "50",
    "ROUND_PERIOD_MS": "100",
}


def scrape(app: Front, auth: bool = True) -> tuple[int, str, dict[str, dict[tuple, float]]]:
    status, raw = app.proc.request("/metrics", method="GET", headers=dict(app.auth) if auth else {})
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    parsed: dict[str, dict[tuple, float]] = {}
    if status == 200:
        for family in text_string_to_metric_families(text):
            assert family.documentation and family.type in ("gauge", "counter"), family
            for s in family.samples:
                parsed.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return status, text, parsed


def acct(name: str, **labels: str) -> tuple:
    return tuple(sorted({"account": name, **labels}.items()))


def test_metrics_of_the_accounts_the_worker_has_seen(workerd_runtime, workerd_bin, project_wrangler_toml,
                                                     tmp_path):
    with front_of(workerd_runtime, workerd_bin, project_wrangler_toml, tmp_path, VARS) as app:
        _metrics(app)


def _metrics(app: Front) -> None:
    status, text, _ = scrape(app, auth=False)
    assert status == 401, text
    status, text, m = scrape(app)
    assert status == 200 and m == {"semaphore_accounts": {(): 0}}, text

    # m-a: limit 2, three jobs in group ga (one waits); m-b: override 3, one job in group gb.
    assert app.set_limit("m-b", 3)["limit"] == 3
    for job_id in ("j1", "j2", "j3"):
        app.enqueue("m-a", "q", job_id, group="ga")
    app.enqueue("m-b", "q", "k1", group="gb")
    wait_for(lambda: len(by_state(app.jobs("m-a", "q"), "running")) == 2, "two m-a jobs running")
    wait_for(lambda: len(by_state(app.jobs("m-b", "q"), "running")) == 1, "the m-b job running")
    time.sleep(0.5)  # a few more rounds: j3 waits for the limit
    assert app.usage("m-ghost")["charged"] == 0  # a read of a made-up account: never listed

    def settled() -> Any:
        status, text, m = scrape(app)
        assert status == 200, text
        blocked = m.get("semaphore_blocked_total", {}).get(acct("m-a", reason="limit"), 0)
        return (text, m) if blocked >= 1 and m["semaphore_admitted_total"].get(acct("m-b")) == 1 else None

    text, m = wait_for(settled, "m-a's blocked and m-b's admitted counters")
    print(f"--- /metrics ---\n{text}")
    assert m["semaphore_accounts"] == {(): 2}, text
    assert m["semaphore_up"] == {acct("m-a"): 1, acct("m-b"): 1}, text
    for name, group in (("m-a", "ga"), ("m-b", "gb")):
        usage = app.usage(name)
        assert m["semaphore_charged"][acct(name)] == usage["charged"], (usage, text)
        assert m["semaphore_limit"][acct(name)] == usage["limit"], (usage, text)
        assert m["semaphore_available"][acct(name)] == usage["available"], (usage, text)
        assert m["semaphore_group_charged"][acct(name, group=group)] == usage["groups"][group]["charged"]
        assert m["semaphore_rounds_total"][acct(name)] >= 1
        assert m["semaphore_failed_rounds_total"][acct(name)] == 0
    assert m["semaphore_charged"][acct("m-a")] == 2 and m["semaphore_limit"][acct("m-b")] == 3
    assert m["semaphore_admitted_total"][acct("m-a")] >= 2
    assert not any(dict(k)["account"] == "m-ghost" for k in m["semaphore_up"])

    # The holders' round lines (logger semaphore.round, one JSON object per line) in workerd's log.
    lines = [json.loads(line[line.index("{"):]) for line in app.proc.logs.splitlines()
             if '"sqlStatements"' in line and "{" in line]
    assert lines, app.proc.logs[-5000:]
    sample = next(x for x in lines if x["admitted"] > 0)
    print(f"--- a round line ---\n{json.dumps(sample)}")
    assert {"at", "durationMs", "requests", "admitted", "grantsIssued", "leasesIssued", "leasePermitsIssued",
            "leasesRetired", "blocked", "sqlStatements", "charged", "limit", "contended", "failed",
            "error"} == set(sample)
    assert sample["sqlStatements"] > 0 and sample["failed"] is False

    # Who holds what, an audited force-settle, and the record read back (issue 11's operations).
    page = app.ok("GET", "/accounts/m-a/holders?limit=10")
    assert len(page["holders"]) == 1 and page["cursor"] is None, page
    (holder,) = page["holders"]
    assert holder["charged"] == app.usage("m-a")["charged"] == 2, page
    print(f"--- GET /accounts/m-a/holders ---\n{json.dumps(page)}")
    (other,) = app.ok("GET", "/accounts/m-b/holders")["holders"]
    record = app.ok("POST", f"/accounts/m-b/holders/{other['clientId']}/settle",
                    {"reason": "tier-3 sample: its queue was deleted"})
    assert record["grantPermits"] == 1 and record["clientId"] == other["clientId"], record
    audit = app.ok("GET", "/accounts/m-b/audit")
    assert audit["records"] == [record], audit
    assert app.usage("m-b")["charged"] == 0
    print(f"--- POST .../settle, then GET /accounts/m-b/audit ---\n{json.dumps(audit)}")
