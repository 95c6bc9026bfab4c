"""Reference Worker: one account-wide concurrency budget, queues that run jobs under it.

* ``AccountLimit`` (binding ``ACCOUNT_LIMIT``, one per account id) is the holder: it wraps
  :class:`semaphore.DurabilitySemaphore` and exposes the RPC method ``permits(message)``. It also
  keeps the account's job directory (job id -> queue), so a job can be completed by id alone.
* ``JobQueue`` (binding ``JOB_QUEUE``, one per (account, queue), named ``["account", "queue"]``) is a client: a
  :class:`semaphore.SemaphoreQueue` whose items are the queue's jobs, admitted under the
  account's budget through the client helper (``ACCOUNT_LIMIT`` by name, RPC ``permits``).
* ``Default`` is the HTTP front (JSON in and out).

A job's work is external: admission marks it ``running`` (its permit is held), and
``POST /accounts/{account}/jobs/{id}/complete`` releases the permit.

Configuration (``[vars]`` in wrangler.toml, all optional): ``ACCOUNT_CONCURRENCY`` (default limit
per account, 10), ``GRANT_TIMEOUT_MS``, ``ROUND_WAIT_MS``, ``ROUND_PERIOD_MS``. Secret
``ADMIN_TOKEN`` guards every request that changes state.
"""

from __future__ import annotations

import hmac
import json
import re
from typing import Any
from urllib.parse import unquote, urlparse

from workers import DurableObject, Response, WorkerEntrypoint

from semaphore import (
    DurabilityScheduler,
    DurabilitySemaphore,
    QueueItem,
    SemaphoreClient,
    SemaphoreQueue,
    timeout,
)
from semaphore.runtime import Storage, plain
from semaphore.wire import MAX_ID_LENGTH, MAX_INT

__all__ = ["AccountLimit", "JobQueue", "Default"]

DEFAULT_CONCURRENCY = 10
SETTINGS = "app_account_settings"
JOBS = "app_job_directory"
RPC_TIMEOUT_MS = 5_000

#: How client objects reach an account's holder (SPEC R36): env.ACCOUNT_LIMIT.getByName(account),
#: RPC method ``permits``, each call bounded by a timeout.
limits = DurabilitySemaphore.client(binding="ACCOUNT_LIMIT", invoke=lambda stub, message: stub.permits(message))


def env_int(env: Any, name: str, default: int, minimum: int = 0) -> int:
    """Read an integer ``[vars]`` entry; a missing one gives ``default``; a malformed one is a
    configuration error reported with its name."""
    raw = getattr(env, name, None)
    if raw is None or str(raw).strip() == "":
        return default
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class AccountLimit(DurableObject):
    """Holder of one account's concurrency budget (one object per account id)."""

    def __init__(self, ctx: Any, env: Any) -> None:
        super().__init__(ctx, env)
        self.storage = Storage(ctx)
        self.default_limit = env_int(env, "ACCOUNT_CONCURRENCY", DEFAULT_CONCURRENCY)
        self._override: int | None = None
        self._override_loaded = False
        self.scheduler = DurabilityScheduler(ctx)
        self.semaphore = DurabilitySemaphore(
            scheduler=self.scheduler,
            limit=self.current_limit,
            grant_timeout_ms=env_int(env, "GRANT_TIMEOUT_MS", 10_000, 1),
            round_wait_ms=env_int(env, "ROUND_WAIT_MS", 1000),
            round_period_ms=env_int(env, "ROUND_PERIOD_MS", 2000),
        )

    # -- configuration -------------------------------------------------------------------
    def _settings(self) -> None:
        if self._override_loaded:
            return
        self.storage.exec(f"CREATE TABLE IF NOT EXISTS {SETTINGS} (key TEXT PRIMARY KEY, value INTEGER NOT NULL)")
        row = self.storage.one(f"SELECT value FROM {SETTINGS} WHERE key = 'limit'")
        self._override = None if row is None else int(row["value"])
        self._override_loaded = True

    def current_limit(self) -> int:
        """The account's limit: the stored override, else ``ACCOUNT_CONCURRENCY``."""
        self._settings()
        return self.default_limit if self._override is None else self._override

    # -- RPC methods -----------------------------------------------------------------------
    async def permits(self, message: Any) -> dict[str, Any]:
        """The semaphore's wire endpoint (requests and syncs from client objects)."""
        return await self.semaphore.handle(message)

    async def usage(self) -> dict[str, Any]:
        usage = await self.semaphore.usage()
        usage["defaultLimit"] = self.default_limit
        usage["limitOverride"] = self._override
        return usage

    async def set_limit(self, limit: Any) -> dict[str, Any]:
        """Set (an int >= 0) or clear (``None``) this account's limit override. Takes effect at
        the next round; lowering it never revokes running work (SPEC R24)."""
        limit = plain(limit)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or not 0 <= limit <= MAX_INT):
            return {"error": {"code": "invalid_limit", "field": "limit",
                              "message": "limit must be an integer from 0 to 2**53 - 1, or null"}}
        self._settings()
        if limit is None:
            self.storage.exec(f"DELETE FROM {SETTINGS} WHERE key = 'limit'")
        else:
            self.storage.exec(
                f"INSERT INTO {SETTINGS}(key, value) VALUES ('limit', ?)"
                " ON CONFLICT(key) DO UPDATE SET value = excluded.value", limit)
        self._override = limit
        return {"limit": self.current_limit(), "override": limit, "defaultLimit": self.default_limit}

    async def register_job(self, job_id: Any, queue: Any) -> dict[str, Any]:
        """Record that ``job_id`` lives in ``queue`` (idempotent). Answers the queue the job is
        registered to, which differs from ``queue`` when the id is already taken elsewhere."""
        job_id, queue = str(plain(job_id)), str(plain(queue))
        self._jobs_table()
        self.storage.exec(f"INSERT INTO {JOBS}(job_id, queue) VALUES (?, ?) ON CONFLICT(job_id) DO NOTHING",
                          job_id, queue)
        row = self.storage.one(f"SELECT queue FROM {JOBS} WHERE job_id = ?", job_id)
        return {"jobId": job_id, "queue": str(row["queue"]) if row else queue}

    async def find_job(self, job_id: Any) -> dict[str, Any]:
        """The queue holding ``job_id``: ``{"queue": name}`` or ``{"queue": None}``."""
        self._jobs_table()
        row = self.storage.one(f"SELECT queue FROM {JOBS} WHERE job_id = ?", str(plain(job_id)))
        return {"queue": str(row["queue"]) if row else None}

    def _jobs_table(self) -> None:
        self.storage.exec(f"CREATE TABLE IF NOT EXISTS {JOBS} (job_id TEXT PRIMARY KEY, queue TEXT NOT NULL)")

    async def alarm(self, alarm_info: Any = None) -> None:
        await self.scheduler.alarm(alarm_info)


def job_view(item: QueueItem) -> dict[str, Any]:
    """JSON view of a queued job."""
    return {
        "id": item.item_id,
        "group": item.group,
        "state": item.state.value,
        "payload": item.payload,
        "enqueuedAt": item.enqueued_at,
        "startedAt": item.started_at or None,
        "finishedAt": item.finished_at or None,
        "permit": None if item.permit is None else {"kind": item.permit.kind.value, "id": item.permit.id},
    }


class JobQueue(DurableObject):
    """A queue of jobs of one account (one object per (account, queue)).

    Jobs are items of a :class:`SemaphoreQueue` keyed by the account id: they wait for permits of
    the account's ``AccountLimit`` (rounds, or draws from leases), run while they hold one, and
    release it on completion. Everything is in this object's SQLite storage, so eviction loses
    nothing; the object's alarm drives the queue."""

    def __init__(self, ctx: Any, env: Any) -> None:
        super().__init__(ctx, env)
        self.scheduler = DurabilityScheduler(ctx)
        self.client = SemaphoreClient(ctx, limits.with_(timeout(RPC_TIMEOUT_MS)).transport(env))
        self.queue = SemaphoreQueue(client=self.client, scheduler=self.scheduler, on_admit=self.start_job)

    def start_job(self, item: QueueItem) -> None:
        """Admission callback. The reference app's work is external: holding the permit while the
        job is ``running`` is the whole effect, so there is nothing to start here (and calling
        it twice for the same job, as the queue may after an eviction, is harmless)."""

    async def enqueue(self, account: Any, job_id: Any, group: Any, payload: Any = None) -> dict[str, Any]:
        """Queue a job (idempotent on ``job_id``)."""
        account, job_id, group = str(plain(account)), str(plain(job_id)), str(plain(group))
        known = self.queue.item(job_id) is not None
        item = await self.queue.enqueue(account, group, job_id, plain(payload))
        return {"job": job_view(item), "created": not known}

    async def complete(self, job_id: Any) -> dict[str, Any]:
        """The job's work finished: release its permit (or cancel it if still queued)."""
        job_id = str(plain(job_id))
        changed = await self.queue.complete(job_id)
        item = self.queue.item(job_id)
        return {"job": None if item is None else job_view(item), "changed": changed}

    async def status(self, account: Any) -> dict[str, Any]:
        """Every job of this queue (of ``account``) with its state."""
        return {"jobs": [job_view(item) for item in self.queue.items(key=str(plain(account)))]}

    async def alarm(self, alarm_info: Any = None) -> None:
        await self.scheduler.alarm(alarm_info)


# ------------------------------------------------------------------------------- HTTP front
class HttpError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def json_response(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data), status=status, headers={"content-type": "application/json"})


def require_admin(request: Any, env: Any) -> None:
    token = getattr(env, "ADMIN_TOKEN", None)
    if not token:
        raise HttpError(401, "unauthorized", "ADMIN_TOKEN is not configured; state changes are disabled")
    header = request.headers.get("authorization") or ""
    if not hmac.compare_digest(header.encode(), f"Bearer {token}".encode()):
        raise HttpError(401, "unauthorized", "missing or wrong Authorization: Bearer token")


async def read_json(request: Any) -> dict[str, Any]:
    text = await request.text()
    if not text:
        return {}
    try:
        body = json.loads(text)
    except ValueError:
        raise HttpError(400, "invalid_json", "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HttpError(400, "invalid_json", "request body must be a JSON object")
    return body


def holder(env: Any, account: str) -> Any:
    return env.ACCOUNT_LIMIT.getByName(account)


def job_queue(env: Any, account: str, queue: str) -> Any:
    # An unambiguous name: "a:b" + "c" and "a" + "b:c" must be different objects.
    return env.JOB_QUEUE.getByName(json.dumps([account, queue]))


def identifier(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH:
        raise HttpError(400, "invalid_request", f"{name} must be a string of 1 to {MAX_ID_LENGTH} characters")
    return value


ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(r"^/healthz$"), "healthz"),
    ("GET", re.compile(r"^/accounts/([^/]+)/usage$"), "usage"),
    ("PUT", re.compile(r"^/accounts/([^/]+)/limit$"), "set_limit"),
    ("POST", re.compile(r"^/accounts/([^/]+)/queues/([^/]+)/jobs$"), "enqueue"),
    ("GET", re.compile(r"^/accounts/([^/]+)/queues/([^/]+)$"), "queue_status"),
    ("POST", re.compile(r"^/accounts/([^/]+)/jobs/([^/]+)/complete$"), "complete"),
    ("POST", re.compile(r"^/accounts/([^/]+)/permits$"), "permits"),
]


class Default(WorkerEntrypoint):
    """HTTP front. Every answer is JSON; errors are ``{"error": {"code", "message"}}``."""

    async def fetch(self, request: Any) -> Response:
        path = urlparse(request.url).path
        method = str(request.method).upper()
        try:
            for route_method, pattern, name in ROUTES:
                match = pattern.match(path)
                if match:
                    if route_method != method:
                        continue
                    params = [identifier(unquote(p), "path segment") for p in match.groups()]
                    return await getattr(self, f"route_{name}")(request, *params)
            if any(p.match(path) for _, p, _ in ROUTES):
                raise HttpError(405, "method_not_allowed", f"{method} is not allowed on {path}")
            raise HttpError(404, "not_found", f"no route for {path}")
        except HttpError as exc:
            return json_response({"error": {"code": exc.code, "message": exc.message}}, exc.status)

    async def route_healthz(self, request: Any) -> Response:
        return json_response({"ok": True})

    async def route_usage(self, request: Any, account: str) -> Response:
        return json_response(plain(await holder(self.env, account).usage()))

    async def route_set_limit(self, request: Any, account: str) -> Response:
        require_admin(request, self.env)
        body = await read_json(request)
        if "limit" not in body:
            raise HttpError(400, "invalid_limit", "body must be {\"limit\": int >= 0 | null}")
        result = plain(await holder(self.env, account).set_limit(body["limit"]))
        if "error" in result:
            return json_response(result, 400)
        return json_response(result)

    async def route_enqueue(self, request: Any, account: str, queue: str) -> Response:
        require_admin(request, self.env)
        body = await read_json(request)
        job_id = identifier(body.get("id"), "id")
        group = identifier(body.get("group", "default"), "group")
        owner = plain(await holder(self.env, account).register_job(job_id, queue))
        if owner["queue"] != queue:
            raise HttpError(409, "conflict", f"job {job_id!r} already belongs to queue {owner['queue']!r}")
        result = plain(await job_queue(self.env, account, queue).enqueue(account, job_id, group, body.get("payload")))
        return json_response(result, 201 if result["created"] else 200)

    async def route_complete(self, request: Any, account: str, job_id: str) -> Response:
        require_admin(request, self.env)
        found = plain(await holder(self.env, account).find_job(job_id))
        if found["queue"] is None:
            raise HttpError(404, "not_found", f"no job {job_id!r} in account {account!r}")
        result = plain(await job_queue(self.env, account, found["queue"]).complete(job_id))
        if result["job"] is None:
            raise HttpError(404, "not_found", f"no job {job_id!r} in queue {found['queue']!r}")
        return json_response(result)

    async def route_queue_status(self, request: Any, account: str, queue: str) -> Response:
        result = plain(await job_queue(self.env, account, queue).status(account))
        return json_response({"account": account, "queue": queue, **result})

    async def route_permits(self, request: Any, account: str) -> Response:
        """Operator endpoint: one wire message straight to the account's holder (SPEC §3), e.g.
        to inspect a client's grants with a ``sync``. Admin only."""
        require_admin(request, self.env)
        body = await read_json(request)
        result = plain(await holder(self.env, account).permits(body))
        error = result.get("error") if isinstance(result, dict) else None
        if isinstance(error, dict):  # an error value (SPEC R7): not a 200
            return json_response(result, 400 if error.get("code") == "invalid_message" else 503)
        return json_response(result)
