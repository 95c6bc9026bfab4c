"""Tier 1: ``GET /metrics`` of the reference Worker (src/entry.py) on host CPython (issue 11).

The Worker runs as in tests/test_reference_worker.py: a stand-in ``workers`` module, objects on
the library's test bed (real SQLite), RPC as direct calls, and here a third namespace for the
``AccountIndex``. The exposition is parsed with ``prometheus_client``'s own text parser and
checked against ``GET .../usage``; the round counters against the holder's round records.
Checked too: the route needs the admin token, reads never create storage (a made-up account is
never listed; an empty registry creates nothing), label values are escaped, a holder that fails
shows ``semaphore_up 0``, and the cap on listed accounts.
"""

from __future__ import annotations

import asyncio
import json
import types
from urllib.parse import quote

from prometheus_client.parser import text_string_to_metric_families

import test_reference_worker as reference
from test_reference_worker import AUTH, TOKEN, _Namespace, _Request

entry = reference.entry  # the reference Worker's module, with a stand-in ``workers`` (fixture)


class World:
    def __init__(self, entry, **vars) -> None:
        self.env = types.SimpleNamespace(**{"ACCOUNT_CONCURRENCY": "2", "ADMIN_TOKEN": TOKEN,
                                            "ROUND_WAIT_MS": "0", "ROUND_PERIOD_MS": "0", **vars})
        self.env.ACCOUNT_LIMIT = _Namespace(self.env, entry.AccountLimit)
        self.env.JOB_QUEUE = _Namespace(self.env, entry.JobQueue)
        self.env.ACCOUNT_INDEX = _Namespace(self.env, entry.AccountIndex)
        self.entry = entry

    async def raw(self, method: str, path: str, body=None, headers=None):
        req = _Request("http://w" + path, method, headers or {}, "" if body is None else json.dumps(body))
        resp = await self.entry.Default(None, self.env).fetch(req)
        await reference.settle(self.env)
        return resp.status, resp.body, resp.headers

    async def fetch(self, method: str, path: str, body=None, headers=None):
        status, text, _ = await self.raw(method, path, body, headers)
        return status, json.loads(text)

    async def metrics(self) -> dict[str, dict[tuple, float]]:
        """``/metrics`` parsed: sample name -> {sorted label items: value}; also checks the
        content type and that every family has HELP and TYPE."""
        status, text, headers = await self.raw("GET", "/metrics", headers=AUTH)
        assert status == 200, text
        assert headers["content-type"].startswith("text/plain; version=0.0.4"), headers
        out: dict[str, dict[tuple, float]] = {}
        for family in text_string_to_metric_families(text):
            assert family.documentation and family.type in ("gauge", "counter"), family
            for s in family.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out


def run(coro):
    return asyncio.run(coro)


def acct(name: str, **labels: str) -> tuple:
    return tuple(sorted({"account": name, **labels}.items()))


async def run_jobs(world: World, account: str, queue: str, jobs: list[str], group: str = "default") -> None:
    for job_id in jobs:
        status, _ = await world.fetch("POST", f"/accounts/{account}/queues/{queue}/jobs",
                                      {"id": job_id, "group": group}, headers=AUTH)
        assert status == 201
    jq = world.env.JOB_QUEUE.getByName(json.dumps([account, queue]))
    for _ in range(3):  # the queue's alarm asks for permits (a round) and admits what fits
        await jq.alarm()


def test_metrics_need_the_admin_token_and_an_empty_registry_creates_nothing(entry):
    world = World(entry)

    async def scenario():
        for headers in (None, {"authorization": "Bearer nope"}):
            status, body = await world.fetch("GET", "/metrics", headers=headers)
            assert status == 401 and body["v"] == 1 and body["error"]["code"] == "unauthorized", body
        assert (await world.fetch("GET", "/accounts/ghost/usage"))[0] == 200
        assert (await world.fetch("PUT", "/accounts/ghost/limit", {"limit": None}, headers=AUTH))[0] == 200
        m = await world.metrics()
        assert m == {"semaphore_accounts": {(): 0}}, m

    run(scenario())
    assert world.env.ACCOUNT_INDEX.tables("accounts") == []
    assert world.env.ACCOUNT_LIMIT.tables("ghost") == []


def test_metrics_match_usage_and_count_rounds_admitted_and_blocked(entry):
    world = World(entry, LEASES="off")  # grants: every admission a round's
    odd = 'b"x\\y'  # a quote and a backslash: escaped in the label value

    async def scenario():
        records: list = []
        await run_jobs(world, "a", "q", ["j1", "j2", "j3"], group="g1")  # limit 2: one waits
        a = world.env.ACCOUNT_LIMIT.getByName("a")
        hook = a.semaphore.on_round
        a.semaphore.on_round = lambda r: (records.append(r), hook(r))
        await run_jobs(world, "a", "q2", ["k1"], group="g2")
        assert (await world.fetch("PUT", f"/accounts/{quote(odd, safe='')}/limit", {"limit": 5}, headers=AUTH))[0] == 200
        assert (await world.fetch("GET", "/accounts/ghost/usage"))[0] == 200  # a read: never listed
        m = await world.metrics()
        assert m["semaphore_accounts"] == {(): 2}
        assert m["semaphore_up"] == {acct("a"): 1, acct(odd): 1}
        for name in ("a", odd):
            usage = (await world.fetch("GET", f"/accounts/{quote(name, safe='')}/usage"))[1]
            assert m["semaphore_charged"][acct(name)] == usage["charged"]
            assert m["semaphore_limit"][acct(name)] == usage["limit"]
            assert m["semaphore_available"][acct(name)] == usage["available"]
            for group, g in usage["groups"].items():
                assert m["semaphore_group_charged"][acct(name, group=group)] == g["charged"]
        assert m["semaphore_charged"][acct("a")] == 2 and m["semaphore_limit"][acct(odd)] == 5
        assert m["semaphore_group_charged"][acct("a", group="g1")] == 2  # g2's job waits (the limit)
        counters = a.storage.exec("SELECT name, value FROM app_round_metrics")
        counted = {r["name"]: r["value"] for r in counters}
        assert m["semaphore_rounds_total"][acct("a")] == counted["rounds"] >= 2
        assert m["semaphore_admitted_total"][acct("a")] == counted["admitted"] == 2
        assert m["semaphore_blocked_total"][acct("a", reason="limit")] == counted["blocked:limit"] >= 1
        assert m["semaphore_failed_rounds_total"][acct("a")] == 0
        assert m["semaphore_rounds_total"][acct(odd)] == 0  # a limit, no round yet
        assert records and all(not r.failed for r in records)

    run(scenario())
    assert world.env.ACCOUNT_LIMIT.tables("ghost") == []
    assert "ghost" not in world.env.ACCOUNT_INDEX.objects["accounts"].storage.exec("SELECT account FROM app_accounts")


def test_a_holder_that_fails_shows_up_0_and_the_rest_still_render(entry, monkeypatch):
    world = World(entry)

    async def scenario():
        for name in ("a", "b"):
            assert (await world.fetch("PUT", f"/accounts/{name}/limit", {"limit": 3}, headers=AUTH))[0] == 200

        async def down():
            raise RuntimeError("holder down")

        monkeypatch.setattr(world.env.ACCOUNT_LIMIT.getByName("b"), "metrics", down)
        m = await world.metrics()
        assert m["semaphore_up"] == {acct("a"): 1, acct("b"): 0}
        assert acct("b") not in m["semaphore_charged"] and m["semaphore_limit"][acct("a")] == 3

    run(scenario())


def test_the_listed_accounts_are_capped(entry, monkeypatch):
    monkeypatch.setattr(entry, "METRICS_MAX_ACCOUNTS", 3)
    world = World(entry)

    async def scenario():
        for i in range(5):
            assert (await world.fetch("PUT", f"/accounts/acct{i}/limit", {"limit": i}, headers=AUTH))[0] == 200
        m = await world.metrics()
        assert m["semaphore_accounts"] == {(): 5}
        assert sorted(dict(k)["account"] for k in m["semaphore_up"]) == ["acct0", "acct1", "acct2"]

    run(scenario())


def test_a_failed_registration_is_retried_later_and_never_fails_the_write(entry):
    world = World(entry)

    async def scenario():
        index = world.env.ACCOUNT_INDEX.getByName("accounts")
        real, calls = index.add, []

        async def down(account):
            calls.append(account)
            raise RuntimeError("index down")

        index.add = down
        assert (await world.fetch("PUT", "/accounts/a/limit", {"limit": 3}, headers=AUTH))[0] == 200
        index.add = real
        assert (await world.fetch("PUT", "/accounts/a/limit", {"limit": 4}, headers=AUTH))[0] == 200
        assert calls == ["a"] and (await world.metrics())["semaphore_accounts"] == {(): 0}  # not yet again
        a = world.env.ACCOUNT_LIMIT.getByName("a")
        later = a.scheduler.clock() + entry.INDEX_RETRY_MS
        a.scheduler.clock = lambda: later
        assert (await world.fetch("PUT", "/accounts/a/limit", {"limit": 5}, headers=AUTH))[0] == 200
        assert (await world.metrics())["semaphore_limit"] == {acct("a"): 5}

    run(scenario())


def test_label_values_are_escaped(entry):
    assert entry.label_value('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    text = entry.render_metrics(1, [('x"\\\ny', {"usage": {"charged": 1, "limit": 2, "available": 1,
                                                               "groups": {'g"': {"charged": 1}}},
                                                     "counters": {"rounds": 3}})])
    [up] = [f for f in text_string_to_metric_families(text) if f.name == "semaphore_up"]
    assert up.samples[0].labels == {"account": 'x"\\\ny'}
    [gc] = [f for f in text_string_to_metric_families(text) if f.name == "semaphore_group_charged"]
    assert gc.samples[0].labels == {"account": 'x"\\\ny', "group": 'g"'}
