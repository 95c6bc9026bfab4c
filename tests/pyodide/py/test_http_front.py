"""src/entry.py's Default WorkerEntrypoint (the HTTP front) inside Pyodide: workers.Request in,
workers.Response out, and RPC to the AccountLimit holder through the SDK-wrapped env."""

import json

from entry import AccountLimit, Default
from standins import Runtime

VARS = {"ACCOUNT_CONCURRENCY": "7", "ROUND_WAIT_MS": "10", "ROUND_PERIOD_MS": "0",
        "ADMIN_TOKEN": "s3cret"}


def runtime():
    return Runtime({"ACCOUNT_LIMIT": AccountLimit}, vars=VARS, auto_alarms=False)


async def body(resp):
    return json.loads(await resp.text())


async def test_healthz_and_unknown_routes():
    rt = runtime()
    resp = await rt.fetch(Default, "http://w/healthz")
    assert resp.status == 200 and resp.headers.get("content-type") == "application/json"
    assert await body(resp) == {"ok": True}
    resp = await rt.fetch(Default, "http://w/nope")
    assert resp.status == 404 and (await body(resp))["error"]["code"] == "not_found"
    resp = await rt.fetch(Default, "http://w/accounts/a/usage", method="POST")
    assert resp.status == 405


async def test_usage_over_rpc_is_json_serialisable():
    rt = runtime()
    resp = await rt.fetch(Default, "http://w/accounts/acme/usage")
    assert resp.status == 200
    usage = await body(resp)
    assert usage["limit"] == 7 and usage["defaultLimit"] == 7 and usage["limitOverride"] is None
    assert usage["outstanding"] == 0 and usage["groups"] == {}


async def test_set_limit_needs_the_admin_token_and_takes_effect():
    rt = runtime()
    url = "http://w/accounts/acme/limit"
    resp = await rt.fetch(Default, url, method="PUT", body=json.dumps({"limit": 3}))
    assert resp.status == 401
    auth = {"authorization": "Bearer s3cret"}
    resp = await rt.fetch(Default, url, method="PUT", headers=auth, body=json.dumps({"limit": 3}))
    assert resp.status == 200 and await body(resp) == {"limit": 3, "override": 3, "defaultLimit": 7}
    resp = await rt.fetch(Default, url, method="PUT", headers=auth, body=json.dumps({"limit": -2}))
    assert resp.status == 400 and (await body(resp))["error"]["code"] == "invalid_limit"
    resp = await rt.fetch(Default, url, method="PUT", headers=auth, body="{not json")
    assert resp.status == 400 and (await body(resp))["error"]["code"] == "invalid_json"
    usage = await body(await rt.fetch(Default, "http://w/accounts/acme/usage"))
    assert usage["limit"] == 3 and usage["limitOverride"] == 3
    # The override is durable: a fresh holder instance reads it back from SQLite.
    rt.evict("ACCOUNT_LIMIT", "acme")
    usage = await body(await rt.fetch(Default, "http://w/accounts/acme/usage"))
    assert usage["limit"] == 3
    resp = await rt.fetch(Default, url, method="PUT", headers=auth, body=json.dumps({"limit": None}))
    assert (await body(resp))["limit"] == 7
