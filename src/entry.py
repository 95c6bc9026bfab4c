"""Reference Worker: one account-wide concurrency budget, queues that run jobs under it.

* ``AccountLimit`` (binding ``ACCOUNT_LIMIT``, one per account id) is the holder: it wraps
  :class:`semaphore.DurabilitySemaphore` and exposes the RPC method ``permits(message)``.
* ``Default`` is the HTTP front (JSON in and out).

Configuration (``[vars]`` in wrangler.toml, all optional): ``ACCOUNT_CONCURRENCY`` (default limit
per account, 10), ``GRANT_TIMEOUT_MS``, ``ROUND_WAIT_MS``, ``ROUND_PERIOD_MS``. Secret
``ADMIN_TOKEN`` guards every request that changes state.
"""

from __future__ import annotations

import hmac
import json
import re
from typing import Any
from urllib.parse import urlparse

from workers import DurableObject, Response, WorkerEntrypoint

from semaphore import DurabilityScheduler, DurabilitySemaphore
from semaphore.runtime import Storage, plain

__all__ = ["AccountLimit", "Default"]

DEFAULT_CONCURRENCY = 10
SETTINGS = "app_account_settings"


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
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            return {"error": {"code": "invalid_limit", "field": "limit",
                              "message": "limit must be an integer >= 0 or null"}}
        self._settings()
        if limit is None:
            self.storage.exec(f"DELETE FROM {SETTINGS} WHERE key = 'limit'")
        else:
            self.storage.exec(
                f"INSERT INTO {SETTINGS}(key, value) VALUES ('limit', ?)"
                " ON CONFLICT(key) DO UPDATE SET value = excluded.value", limit)
        self._override = limit
        return {"limit": self.current_limit(), "override": limit, "defaultLimit": self.default_limit}

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


ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("GET", re.compile(r"^/healthz$"), "healthz"),
    ("GET", re.compile(r"^/accounts/([^/]+)/usage$"), "usage"),
    ("PUT", re.compile(r"^/accounts/([^/]+)/limit$"), "set_limit"),
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
                    return await getattr(self, f"route_{name}")(request, *match.groups())
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
