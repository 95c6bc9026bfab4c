"""src/entry.py's Default WorkerEntrypoint (the HTTP front) inside Pyodide: workers.Request in,
workers.Response out, and RPC to the AccountLimit holder through the SDK-wrapped env; bodies
nested too deeply or holding NaN, payloads over the row limit, and a blank or padded admin token."""

import json

from standins import Runtime, settle_queue

from entry import AccountLimit, Default

VARS = {"LEASES": "off",  # grants: these follow claims and their confirming syncs
        "ACCOUNT_CONCURRENCY": "7", "ROUND_WAIT_MS": "10", "ROUND_PERIOD_MS": "0",
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


def full_runtime():
    from entry import JobQueue
    return Runtime({"ACCOUNT_LIMIT": AccountLimit, "JOB_QUEUE": JobQueue}, vars=VARS, auto_alarms=False)


def tables(rt, binding, name):
    return [r["name"] for r in rt.sql(binding, name, "SELECT name FROM sqlite_master ORDER BY name")]


async def test_reads_of_a_never_used_account_create_no_storage():
    # Unauthenticated reads of any name must leave nothing behind: no CREATE TABLE, no alarm.
    rt = full_runtime()
    resp = await rt.fetch(Default, "http://w/accounts/ghost/usage")
    assert resp.status == 200
    usage = await body(resp)
    assert usage == {"limit": 7, "outstanding": 0, "leaseFootprint": 0, "liveLeases": 0,
                     "retiredLeases": 0, "charged": 0, "available": 7, "groups": {}, "defaultLimit": 7,
                     "limitOverride": None}
    resp = await rt.fetch(Default, "http://w/accounts/ghost/queues/q")
    assert resp.status == 200 and await body(resp) == {"account": "ghost", "queue": "q", "jobs": []}
    # Admin calls that find nothing create nothing either.
    auth = {"authorization": "Bearer s3cret"}
    resp = await rt.fetch(Default, "http://w/accounts/ghost/jobs/x/complete", method="POST", headers=auth)
    assert resp.status == 404
    resp = await rt.fetch(Default, "http://w/accounts/ghost/limit", method="PUT", headers=auth,
                          body=json.dumps({"limit": None}))
    assert resp.status == 200 and (await body(resp))["limit"] == 7
    queue_name = json.dumps(["ghost", "q"])
    assert tables(rt, "ACCOUNT_LIMIT", "ghost") == []
    assert tables(rt, "JOB_QUEUE", queue_name) == []
    assert rt.get_alarm("ACCOUNT_LIMIT", "ghost") is None and rt.get_alarm("JOB_QUEUE", queue_name) is None
    # The empty usage has the shape of a used account's usage.
    resp = await rt.fetch(Default, "http://w/accounts/acme/queues/q/jobs", method="POST", headers=auth,
                          body=json.dumps({"id": "j1"}))
    assert resp.status == 201
    await rt.fire_alarm("JOB_QUEUE", json.dumps(["acme", "q"]), force=True)
    used = await body(await rt.fetch(Default, "http://w/accounts/acme/usage"))
    assert set(used) == set(usage) and used["outstanding"] == 1, used
    assert tables(rt, "ACCOUNT_LIMIT", "acme") != []
    # An account with an override but no semaphore tables still reads without creating them.
    resp = await rt.fetch(Default, "http://w/accounts/ghost/limit", method="PUT", headers=auth,
                          body=json.dumps({"limit": 3}))
    assert resp.status == 200
    rt.evict("ACCOUNT_LIMIT", "ghost")
    usage = await body(await rt.fetch(Default, "http://w/accounts/ghost/usage"))
    assert (usage["limit"], usage["limitOverride"]) == (3, 3)
    assert tables(rt, "ACCOUNT_LIMIT", "ghost") == ["app_account_settings", "sqlite_autoindex_app_account_settings_1"]


async def test_every_error_value_carries_v1():
    rt = runtime()
    auth = {"authorization": "Bearer s3cret"}
    url = "http://w/accounts/acme/limit"
    resp = await rt.fetch(Default, url, method="PUT", headers=auth, body=json.dumps({"limit": -2}))
    assert resp.status == 400
    err = await body(resp)
    assert err["v"] == 1 and err["error"]["code"] == "invalid_limit" and err["error"]["field"] == "limit", err
    # The holder's RPC error value itself carries it (SPEC R7's shape).
    reply = await rt.stub("ACCOUNT_LIMIT", "acme").set_limit(True)
    assert reply["v"] == 1 and reply["error"]["code"] == "invalid_limit"
    for method, path, headers, data, status in (
        ("GET", "http://w/nope", {}, None, 404),
        ("POST", "http://w/accounts/a/usage", {}, None, 405),
        ("PUT", url, {}, json.dumps({"limit": 1}), 401),
        ("PUT", url, auth, "{not json", 400),
        ("PUT", url, auth, "{}", 400),
        ("GET", "http://w/accounts/acme/queues/q", {"authorization": "Bearer wrong"}, None, 401),
    ):
        resp = await rt.fetch(Default, path, method=method, headers=headers, body=data)
        err = await body(resp)
        assert resp.status == status and err["v"] == 1 and set(err["error"]) >= {"code", "message"}, (path, err)


AUTH = {"authorization": "Bearer s3cret"}


async def test_an_invalid_var_is_a_json_configuration_error_on_every_route():
    # Before: ACCOUNT_CONCURRENCY="oops" made the AccountLimit constructor raise, and every
    # holder route answered the runtime's plain-text 500.
    from entry import JobQueue

    routes = [("GET", "http://w/accounts/acme/usage", None),
              ("PUT", "http://w/accounts/acme/limit", json.dumps({"limit": 3})),
              ("POST", "http://w/accounts/acme/queues/q/jobs", json.dumps({"id": "j1"})),
              ("GET", "http://w/accounts/acme/queues/q", None),
              ("POST", "http://w/accounts/acme/jobs/j1/complete", None),
              ("POST", "http://w/accounts/acme/permits", json.dumps({"type": "sync", "v": 1, "clientId": "c",
                                                                      "grants": []})),
              ("GET", "http://w/healthz", None)]
    for var, value in (("ACCOUNT_CONCURRENCY", "oops"), ("ACCOUNT_CONCURRENCY", str(2**53)),
                       ("LEASES", '{"ttlMs": 0}'), ("LEASES", "{"), ("JOB_RETENTION_MS", "0")):
        rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "JOB_QUEUE": JobQueue}, vars={**VARS, var: value},
                     auto_alarms=False)
        for method, url, data in routes:
            resp = await rt.fetch(Default, url, method=method, headers=AUTH, body=data)
            assert resp.status == 500 and resp.headers.get("content-type") == "application/json", (var, url)
            err = await body(resp)
            assert err["v"] == 1 and err["error"]["code"] == "configuration_error", (var, url, err)
            assert err["error"]["field"] == var and var in err["error"]["message"], (var, url, err)
        # Over real RPC the holder answers the same value (its constructor did not fail).
        reply = await rt.stub("ACCOUNT_LIMIT", "acme").usage()
        assert reply["error"]["code"] == "configuration_error" and reply["error"]["field"] == var, reply
        assert tables(rt, "ACCOUNT_LIMIT", "acme") == []
        rt.close()


async def test_put_limit_overwrites_a_corrupt_stored_override():
    rt = runtime()
    url = "http://w/accounts/acme/limit"
    resp = await rt.fetch(Default, url, method="PUT", headers=AUTH, body=json.dumps({"limit": 3}))
    assert resp.status == 200
    rt.sql("ACCOUNT_LIMIT", "acme", "UPDATE app_account_settings SET value = 'oops' WHERE key = 'limit'")
    rt.evict("ACCOUNT_LIMIT", "acme")
    usage = await body(await rt.fetch(Default, "http://w/accounts/acme/usage"))
    assert usage["limit"] is None, usage  # unresolvable, not a crash
    resp = await rt.fetch(Default, url, method="PUT", headers=AUTH, body=json.dumps({"limit": 5}))
    assert resp.status == 200 and await body(resp) == {"limit": 5, "override": 5, "defaultLimit": 7}
    rt.evict("ACCOUNT_LIMIT", "acme")
    usage = await body(await rt.fetch(Default, "http://w/accounts/acme/usage"))
    assert (usage["limit"], usage["limitOverride"]) == (5, 5), usage


async def test_leases_var_admits_jobs_from_a_lease():
    from entry import JobQueue

    leases = '{"provisioning": {"mode": "strict"}, "permitsPerLease": 2, "ttlMs": 4000}'
    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "JOB_QUEUE": JobQueue}, vars={**VARS, "LEASES": leases},
                 auto_alarms=False)
    resp = await rt.fetch(Default, "http://w/accounts/acme/queues/q/jobs", method="POST", headers=AUTH,
                          body=json.dumps({"id": "j1"}))
    assert resp.status == 201
    for _ in range(3):
        await rt.fire_alarm("JOB_QUEUE", json.dumps(["acme", "q"]), force=True)
        jobs = (await body(await rt.fetch(Default, "http://w/accounts/acme/queues/q")))["jobs"]
        if jobs[0]["state"] == "running":
            break
    assert jobs[0]["state"] == "running" and jobs[0]["permit"]["kind"] == "lease", jobs
    usage = await body(await rt.fetch(Default, "http://w/accounts/acme/usage"))
    assert (usage["leaseFootprint"], usage["liveLeases"]) == (2, 1), usage


async def test_queue_view_shows_the_holders_blocked_reason_of_queued_jobs():
    # GET /accounts/{account}/queues/{queue}: each job carries the holder's latest blocked entry
    # for its group while it is queued ({"reason", "waiting", "at"}), else null.
    from entry import JobQueue

    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit, "JOB_QUEUE": JobQueue}, vars={**VARS, "ACCOUNT_CONCURRENCY": "1"},
                 auto_alarms=False)
    before = rt.now()
    # Each enqueue is pumped by the queue itself, at once, in the background (SPEC R37
    # wake-ups): a round gives j1 a grant, j2 is blocked by the limit.
    for job_id in ("j1", "j2"):
        resp = await rt.fetch(Default, "http://w/accounts/acme/queues/q/jobs", method="POST", headers=AUTH,
                              body=json.dumps({"id": job_id}))
        assert resp.status == 201
    await settle_queue(rt, "JOB_QUEUE", json.dumps(["acme", "q"]))
    j1, j2 = (await body(await rt.fetch(Default, "http://w/accounts/acme/queues/q")))["jobs"]
    assert (j1["state"], j1["blocked"]) == ("running", None), j1
    assert j2["state"] == "queued" and set(j2["blocked"]) == {"reason", "waiting", "at"}, j2
    assert (j2["blocked"]["reason"], j2["blocked"]["waiting"]) == ("limit", 1), j2
    assert type(j2["blocked"]["at"]) is int and before <= j2["blocked"]["at"] <= rt.now(), j2


def strict(text):
    """``text`` as JSON proper (``NaN``/``Infinity``, which ``json.loads`` reads, raise)."""
    def refuse(name):
        raise AssertionError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


async def test_a_deep_or_non_finite_body_is_a_400_on_every_route_that_reads_one():
    # Issue 21 (6, 8): a deeply nested body raised RecursionError out of read_json on CPython (a
    # 500); inside Pyodide json.loads overflows the WebAssembly stack first, a fatal error of the
    # whole interpreter (this test, on the previous code, ends the harness). NaN and Infinity
    # were accepted and written back bare. Both are 400 invalid_json now, on every route that
    # reads a body, through the SDK's Request.
    rt = full_runtime()
    deep = "[" * 100_000 + "]" * 100_000
    nan = '{"id": "j1", "limit": NaN, "payload": [Infinity], "reason": "x"}'
    for method, path in (("PUT", "/accounts/acme/limit"), ("POST", "/accounts/acme/queues/q/jobs"),
                         ("POST", "/accounts/acme/permits"), ("POST", "/accounts/acme/holders/c/settle")):
        for text, why in ((deep, "nested deeper than 64"), (nan, "not a JSON number")):
            resp = await rt.fetch(Default, "http://w" + path, method=method, headers=AUTH, body=text)
            err = strict(await resp.text())
            assert resp.status == 400 and err["error"]["code"] == "invalid_json", (path, err)
            assert why in err["error"]["message"], (path, err)
    assert tables(rt, "ACCOUNT_LIMIT", "acme") == [] and tables(rt, "JOB_QUEUE", json.dumps(["acme", "q"])) == []


async def test_a_payload_over_the_row_limit_is_a_413_and_leaves_no_directory_entry():
    # Issue 21 (7): a payload over Durable Object SQL's 2 MB row limit escaped as a 500
    # (SQLITE_TOOBIG from the queue's insert), and the job directory kept the entry registered
    # before it: the id then belonged to a job that does not exist (409 in any other queue).
    rt = full_runtime()
    url = "http://w/accounts/acme/queues/{}/jobs"
    big = json.dumps({"id": "big", "payload": "x" * 1_900_000})
    resp = await rt.fetch(Default, url.format("q"), method="POST", headers=AUTH, body=big)
    err = strict(await resp.text())
    assert resp.status == 413 and err["error"]["code"] == "payload_too_large", err
    assert err["error"]["field"] == "payload", err
    # A body over MAX_BODY_BYTES (2,000,000) is refused before it is scanned or parsed (read_json).
    huge = json.dumps({"id": "big", "payload": [0] * 1_000_000})
    resp = await rt.fetch(Default, url.format("q"), method="POST", headers=AUTH, body=huge)
    err = strict(await resp.text())
    assert resp.status == 413 and err["error"]["code"] == "payload_too_large", err
    assert "2000000" in err["error"]["message"] and "field" not in err["error"], err
    assert tables(rt, "ACCOUNT_LIMIT", "acme") == []  # nothing registered
    resp = await rt.fetch(Default, url.format("other"), method="POST", headers=AUTH,
                          body=json.dumps({"id": "big", "payload": {"small": True}}))
    assert resp.status == 201, await resp.text()


async def test_a_blank_admin_token_is_not_configured_and_surrounding_whitespace_is_stripped():
    # Issue 21 (9): a whitespace-only ADMIN_TOKEN counted as configured; one with a stray newline
    # was a token nobody could send (the runtime's Headers trim the value sent).
    url = "http://w/accounts/acme/limit"
    limit = json.dumps({"limit": 3})
    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit}, vars={**VARS, "ADMIN_TOKEN": " \n"}, auto_alarms=False)
    for headers in ({"authorization": "Bearer  \n"}, {"authorization": "Bearer "}, {}):
        resp = await rt.fetch(Default, url, method="PUT", headers=headers, body=limit)
        err = await body(resp)
        assert resp.status == 401 and "not configured" in err["error"]["message"], (headers, err)
    assert tables(rt, "ACCOUNT_LIMIT", "acme") == []
    rt.close()
    rt = Runtime({"ACCOUNT_LIMIT": AccountLimit}, vars={**VARS, "ADMIN_TOKEN": "s3cret\n"}, auto_alarms=False)
    resp = await rt.fetch(Default, url, method="PUT", headers=AUTH, body=limit)
    assert resp.status == 200 and (await body(resp))["limit"] == 3
