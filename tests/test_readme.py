"""The Python blocks of the README and the docs run: each block :data:`RUN_BY` names is run here
against the test kit, and the README's complete Worker is run, its ``wrangler.toml`` checked
against its classes, and the two bundled by ``wrangler deploy --dry-run`` in a fresh folder.
(Every other code block of the pages is compiled and import-checked, or parsed, by
``tests/test_docs_site.py``.) Blocks are known by the page and the heading they stand under.

How they run: blocks that define Durable Object classes import ``workers``, so a tiny stand-in
module (:func:`workers_standin`: a ``DurableObject`` and a ``WorkerEntrypoint`` that keep
``ctx`` and ``env``, a ``Response`` that keeps its body) is put in ``sys.modules`` for the test
only. The blocks construct ``DurabilityScheduler(ctx)`` and ``SemaphoreClient(ctx, ...)`` with
no clock (the wall clock in a Worker); :func:`clock` makes a :class:`~semaphore.testing.SimClock`
their default for the test, so rounds, claim windows and alarms run on virtual time, and each
test asserts the objects really got it. Fragments that use names from their context
(``async with self.queue.permit(...)``) run with top-level ``await`` in a namespace that
provides those names. Error tracebacks point at the page's own lines.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import logging
import re
import sys
import tomllib
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import semaphore.client._client as client_module
import semaphore.scheduler as scheduler_module
from sample_worker import built_wheel, create_sample
from semaphore import (
    BlockedReason,
    DurabilityScheduler,
    DurabilitySemaphore,
    GrantStatus,
    ItemState,
    LeaseConfig,
    LeaseStatus,
    LimitedGroups,
    PermitKind,
    Provisioning,
    parse_message,
)
from semaphore.testing import (
    T0,
    AlarmDriver,
    Bed,
    ClientSide,
    HolderSide,
    LocalContext,
    Namespace,
    Net,
    SimClock,
    TaskAlarmDriver,
    VirtualClock,
    async_test,
)
from semaphore.testing import blocked as blocked_of
from test_wrangler import _run_dry_run, _setup_problem, _uploaded

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TUTORIAL = ROOT / "docs" / "tutorial.md"
WORKER_HEADING = "## A complete Worker"

#: (page, heading a ```python block stands under) -> the test of this module that runs it.
RUN_BY = {
    ("README.md", WORKER_HEADING): "test_the_readme_worker_holds_the_limit_across_objects",
    ("docs/reference/holder.md", "# The holder: `DurabilitySemaphore`"):
        "test_the_holder_class_grants_under_its_limits_and_reclaims",
    ("docs/reference/wire.md", "# Wire format"): "test_the_wire_format_is_what_the_holder_answers",
    ("docs/reference/leases.md", "# Leases"): "test_the_lease_options_construct",
    ("docs/reference/client.md", "# The client side"): "test_the_client_object_admits_jobs_under_the_limit",
    ("docs/reference/client.md", "## Permits: `async with queue.permit(...)`"):
        "test_the_permit_fragment_holds_and_releases_a_permit",
    ("docs/guides/testing.md", "# Testing your Worker"): "test_the_testing_guides_example_passes",
}

pytestmark = pytest.mark.usefixtures("quiet_logs")


# ================================================================== the pages' blocks
@dataclass(frozen=True)
class Block:
    page: Path
    line: int  #: the page's line of the first line of code (after the fence)
    lang: str
    text: str
    heading: str


def blocks(text: str, page: Path = README) -> list[Block]:
    """The fenced blocks of a Markdown text, with the heading each stands under."""
    found: list[Block] = []
    heading, fence, body, start = "", None, [], 0
    for number, line in enumerate(text.splitlines(), 1):
        if fence is None:
            if line.startswith("```"):
                fence, body, start = line[3:].strip(), [], number + 1
            elif line.startswith("#"):
                heading = line.strip()
        elif line.startswith("```"):
            found.append(Block(page, start, fence, "\n".join(body) + "\n", heading))
            fence = None
        else:
            body.append(line)
    return found


def page_blocks(page: str | Path) -> list[Block]:
    path = ROOT / page
    return blocks(path.read_text(encoding="utf-8"), path)


def block(page: str, heading: str, lang: str = "python") -> Block:
    found = [b for b in page_blocks(page) if b.heading == heading and b.lang == lang]
    assert len(found) == 1, f"{page}: {len(found)} {lang} blocks under {heading!r}, expected 1"
    return found[0]


def _compile(b: Block, tree: ast.Module) -> types.CodeType:
    ast.increment_lineno(tree, b.line - 1)  # tracebacks point at the page's lines
    return compile(tree, str(b.page), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


async def run(b: Block, namespace: dict[str, Any], statements: slice = slice(None)) -> dict[str, Any]:
    """Run the block's ``statements`` (top-level ``await`` allowed) in ``namespace``."""
    tree = ast.parse(b.text)
    tree.body = tree.body[statements]
    result = eval(_compile(b, tree), namespace)
    if inspect.iscoroutine(result):
        await result
    return namespace


def values(b: Block, namespace: dict[str, Any]) -> list[Any]:
    """The value of each expression statement of the block."""
    out = []
    for stmt in ast.parse(b.text).body:
        assert isinstance(stmt, ast.Expr), f"{b.page}:{b.line + stmt.lineno - 1}: not an expression"
        expr = ast.Expression(stmt.value)
        ast.increment_lineno(expr, b.line - 1)
        out.append(eval(compile(expr, str(b.page), "eval"), namespace))
    return out


# ================================================================== what the blocks need
@pytest.fixture
def workers_standin(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A ``workers`` module for the test: ``DurableObject`` and ``WorkerEntrypoint`` keep ``ctx``
    and ``env``; ``Response`` keeps its body and status."""
    module = types.ModuleType("workers")

    class DurableObject:
        def __init__(self, ctx: Any, env: Any) -> None:
            self.ctx = ctx
            self.env = env

    class Response:
        def __init__(self, body: Any = None, status: int = 200, headers: Any = None) -> None:
            self.body, self.status, self.headers = body, status, headers

    module.DurableObject = DurableObject
    module.WorkerEntrypoint = DurableObject
    module.Response = Response
    monkeypatch.setitem(sys.modules, "workers", module)
    return module


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SimClock:
    """Virtual time as the default clock of ``DurabilityScheduler`` and ``SemaphoreClient``
    (the holder and the queue default to the scheduler's)."""
    sim = SimClock(T0)
    monkeypatch.setattr(scheduler_module, "system_clock", sim)
    monkeypatch.setattr(client_module, "system_clock", sim)
    return sim


class Env:
    """An object's ``env``: attributes as given."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


async def until(clock: VirtualClock, condition: Any, within_ms: int = 60_000, step_ms: int = 250) -> None:
    end = clock.now + within_ms
    while not condition():
        assert clock.now < end, "condition not reached in virtual time"
        await clock.advance(step_ms)


def holder_class(b: Block) -> type:
    return run_sync_defs(b)["AccountLimit"]


def run_sync_defs(b: Block) -> dict[str, Any]:
    """Run a block of definitions (no top-level await) and return its namespace."""
    namespace: dict[str, Any] = {"__name__": f"readme_{b.line}"}
    exec(_compile(b, ast.parse(b.text)), namespace)
    return namespace


# ================================================================== every named block exists
def test_every_block_run_by_names_exists_and_its_test_is_defined():
    for (page, heading), name in RUN_BY.items():
        block(page, heading)  # exactly one python block there
        assert callable(globals().get(name)), f"RUN_BY names {name}, which this module does not define"


def test_a_missing_or_doubled_block_fails_the_lookup(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# T\n\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n\n## U\n\n```toml\na = 1\n```\n")
    found = page_blocks(page)
    assert [(b.heading, b.lang, b.line) for b in found] == [("# T", "python", 4), ("# T", "python", 8),
                                                            ("## U", "toml", 14)]
    with pytest.raises(AssertionError, match="2 python blocks under '# T'"):
        block(str(page), "# T")
    with pytest.raises(AssertionError, match="0 python blocks under '## U'"):
        block(str(page), "## U")


# ================================================================== the README's length
#: The README is the front page: past this, move the text into the docs site and link it.
README_MAX_LINES = 200


def test_the_readme_is_at_most_200_lines():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move text to docs/"


# ================================================================== the README's complete Worker
def readme_worker() -> dict[str, str]:
    """``{path: content}`` of the README's Worker: each block's first line is ``# <path>``."""
    files = {}
    for lang in ("toml", "python"):
        b = block("README.md", WORKER_HEADING, lang)
        first = b.text.split("\n", 1)[0]
        assert first.startswith("# "), f"README.md:{b.line}: the block does not start with # <path>"
        files[first[2:].strip()] = b.text
    assert sorted(files) == ["src/entry.py", "wrangler.toml"], sorted(files)
    return files


def test_the_tutorial_shows_the_readme_worker_unchanged():
    tutorial = {b.text.split("\n", 1)[0][2:].strip(): b.text for b in page_blocks("docs/tutorial.md")
                if b.heading == "## 1. An empty folder and two files" and b.lang in ("toml", "python")}
    assert tutorial == readme_worker()


def _do_classes(workers_standin: types.ModuleType, names: dict[str, Any]) -> set[str]:
    return {n for n, v in names.items() if isinstance(v, type) and issubclass(v, workers_standin.DurableObject)
            and v is not workers_standin.DurableObject and n != "Default"}


def test_the_readme_wrangler_toml_binds_and_migrates_the_classes(workers_standin, monkeypatch):
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    files = readme_worker()
    config = tomllib.loads(files["wrangler.toml"])
    names = run_sync_defs(block("README.md", WORKER_HEADING))
    classes = _do_classes(workers_standin, names)
    assert config["main"] == "src/entry.py" and "python_workers" in config["compatibility_flags"]
    bindings = {b["name"]: b["class_name"] for b in config["durable_objects"]["bindings"]}
    assert set(bindings.values()) == classes == {"AccountLimit", "Exports"}
    (migration,) = config["migrations"]
    assert set(migration["new_sqlite_classes"]) == classes  # both SQLite-backed
    code = files["src/entry.py"]
    used_bindings = set(re.findall(r'binding="(\w+)"', code)) | set(re.findall(r"self\.env\.([A-Z_]+)", code))
    assert used_bindings == set(bindings), (used_bindings, bindings)
    assert set(re.findall(r"env\.([A-Z_]+)\)", code)) <= set(config["vars"])  # the vars it reads
    assert config["observability"]["enabled"] is True


class Request:
    def __init__(self, url: str, method: str = "POST") -> None:
        self.url, self.method = url, method


@async_test
async def test_the_readme_worker_holds_the_limit_across_objects(clock: SimClock, workers_standin, monkeypatch) -> None:
    """Six exports of one account and one of another, each in its own client object: at most
    EXPORTS_PER_ACCOUNT (2) of an account's run at once, the other account is not held up."""
    configured = []
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: configured.append(kw))
    names = run_sync_defs(block("README.md", WORKER_HEADING))
    assert configured == [{"stream": sys.stdout, "level": logging.INFO}]  # stdout: console.log in workerd
    running: dict[str, set[str]] = {"acme": set(), "beta": set()}
    most = {"acme": 0, "beta": 0}

    async def do_export(account: str, name: str) -> str:  # the README's stands for real work
        running[account].add(name)
        most[account] = max(most[account], len(running[account]))
        await clock.sleep(2_000)
        running[account].discard(name)
        return f"{account}/{name} exported"

    names["do_export"] = do_export

    def make(cls: type) -> Any:
        def made(name: str) -> Any:
            obj = cls(LocalContext(name=name), env)
            driver = AlarmDriver if cls is names["AccountLimit"] else TaskAlarmDriver
            driver(clock, obj.ctx.storage, obj.alarm)
            return obj
        return made

    env = Env(EXPORTS_PER_ACCOUNT="2", ACCOUNT_LIMIT=Namespace(make(names["AccountLimit"])),
              EXPORTS=Namespace(make(names["Exports"])))
    front = names["Default"](None, env)
    urls = [f"https://exports.example/exports/acme/e{n}" for n in range(1, 7)] + ["https://exports.example/exports/beta/e1"]
    tasks = [asyncio.ensure_future(front.fetch(Request(url))) for url in urls]
    await until(clock, lambda: all(t.done() for t in tasks), within_ms=120_000)
    assert [t.result().body for t in tasks] == [url.split("/exports/", 1)[1] + " exported" for url in urls]
    assert most == {"acme": 2, "beta": 1}  # the account's limit, across six objects
    assert sorted(env.EXPORTS.objects) == sorted(url.split("/exports/", 1)[1] for url in urls)
    exports = next(iter(env.EXPORTS.objects.values()))
    assert exports.queue.scheduler.clock is clock and exports.queue.client.clock is clock
    await clock.advance(15_000)
    for account in ("acme", "beta"):
        assert (await env.ACCOUNT_LIMIT.getByName(account).semaphore.usage())["charged"] == 0
    # Any other request is answered 404 by the front, reaching no object (it used to crash on "/").
    for url, method in (("https://exports.example/", "GET"), ("https://exports.example/exports/acme", "POST"),
                        ("https://exports.example/exports/acme/e1", "GET"),
                        ("https://exports.example/exports//e1", "POST"), ("https://exports.example/x/a/b", "POST")):
        answer = await front.fetch(Request(url, method))
        assert answer.status == 404 and "POST /exports/<account>/<name>" in answer.body, (url, method)
    assert len(env.EXPORTS.objects) == len(urls)


def test_wrangler_bundles_the_readme_worker(tmp_path_factory):
    problem = _setup_problem()
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    sample = create_sample(tmp_path_factory.mktemp("readme-worker") / "exports", built_wheel(), readme_worker())
    proc, outdir = _run_dry_run(sample.root, tmp_path_factory.mktemp("readme-wrangler"))
    assert proc.returncode == 0, f"wrangler deploy --dry-run failed\n{proc.stdout}\n{proc.stderr}"
    for line in ("env.ACCOUNT_LIMIT (AccountLimit)", "env.EXPORTS (Exports)", 'env.EXPORTS_PER_ACCOUNT ("2")'):
        assert line in proc.stdout, f"{line!r} not in wrangler's output:\n{proc.stdout}"
    assert (outdir / "entry.py").read_text(encoding="utf-8") == readme_worker()["src/entry.py"]
    uploaded = _uploaded(outdir)
    assert "python_modules/semaphore/holder/_semaphore.py" in uploaded  # the library is uploaded ...
    kept_out = [f for f in uploaded if f.startswith(("python_modules/semaphore/testing/",
                                                       "python_modules/semaphore/simulate/"))]
    assert not kept_out, kept_out  # ... but not the test kit and the simulator it never imports


def test_the_testing_guides_example_passes() -> None:
    names = run_sync_defs(block("docs/guides/testing.md", "# Testing your Worker"))
    names["test_the_limit_holds"]()  # an @async_test function: it runs on a loop of its own


@async_test
async def test_the_holder_class_grants_under_its_limits_and_reclaims(clock: SimClock, workers_standin) -> None:
    AccountLimit = holder_class(block("docs/reference/holder.md", "# The holder: `DurabilitySemaphore`"))
    env = Env(ACCOUNT_CONCURRENCY="3")
    holder = AccountLimit(LocalContext(name="acct-1"), env)
    assert holder.ctx is not None and holder.env is env  # the stand-in DurableObject's
    assert holder.scheduler.clock is clock and holder.semaphore.clock is clock
    AlarmDriver(clock, holder.ctx.storage, holder.alarm)
    message = {"type": "request", "v": 1, "clientId": "jobs-1", "grants": [],
               "demand": [{"group": "bulk-exports", "count": 5, "oldestAt": T0},
                          {"group": "default", "count": 5, "oldestAt": T0 + 1}]}
    reply = asyncio.ensure_future(holder.permits(message))
    await until(clock, reply.done)
    grants = {g["group"]: g["permits"] for g in reply.result()["grants"]}
    assert grants == {"bulk-exports": 2, "default": 1}  # group_limit {"bulk-exports": 2}, limit 3
    assert blocked_of(reply.result()) == {"bulk-exports": ("group_limit", 3), "default": ("limit", 4)}
    assert (await holder.semaphore.usage())["charged"] == 3
    await clock.advance(11_000)  # nothing claimed: the alarm (delegated) reclaims at claimBy
    assert (await holder.semaphore.usage())["charged"] == 0


@async_test
async def test_the_wire_format_is_what_the_holder_answers() -> None:
    b = block("docs/reference/wire.md", "# Wire format")
    message, shape = values(b, {})
    assert parse_message(message).client_id == "queue-7"
    bed = Bed(limit=5, clock=VirtualClock(1_764_500_000_000), leases={"provisioning": {"mode": "strict"}})
    reply = await bed.one(message)

    def check(value: Any, expected: Any, where: str) -> None:
        if isinstance(expected, dict):
            assert isinstance(value, dict) and set(value) == set(expected), (where, value)
            for key in expected:
                check(value[key], expected[key], f"{where}.{key}")
        elif isinstance(expected, list):
            assert isinstance(value, list) and value, (where, value)
            for item in value:
                check(item, expected[0], f"{where}[]")
        elif isinstance(expected, set):
            assert isinstance(value, dict) and set(value) == expected, (where, sorted(value), sorted(expected))
        elif isinstance(expected, type):
            assert isinstance(value, expected), (where, value)
        else:
            assert value == expected, (where, value)

    check(reply, shape, "reply")
    # the comments list the values of "status" and "reason": exactly the library's enums
    listed = {m["key"]: set(m["values"].split(" | "))
              for m in re.finditer(r'"(?P<key>\w+)": \[.*# (?P<values>\w+(?: \| \w+)+)$', b.text, re.MULTILINE)}
    assert listed == {"grants": {s.value for s in GrantStatus}, "leases": {s.value for s in LeaseStatus},
                      "blocked": {r.value for r in BlockedReason}}
    assert {g["status"] for g in reply["grants"]} <= listed["grants"]
    assert {x["status"] for x in reply["leases"]} <= listed["leases"]
    assert {x["reason"] for x in reply["blocked"]} <= listed["blocked"]
    assert {g["grantId"]: g["status"] for g in reply["grants"] if g["group"] is None} == {"9f...": "not_found"}


def _literal(text: str, at: int) -> tuple[Any, int]:
    """The Python literal (a ``{...}`` or a ``"..."``) starting at ``text[at]``, and its end."""
    if text[at] == '"':
        end = text.index('"', at + 1) + 1
    else:
        depth, end = 0, at
        while True:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
            if depth == 0:
                break
    return ast.literal_eval(text[at:end]), end


def _lease_variants(b: Block, base: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``leases=`` options the block's comments name: ``or <literal>`` replaces the line's
    option (``/ <literal>`` right after one replaces its ``extra``), ``also <name>`` is the
    option's snake_case spelling. A comment-only line continues the previous option's."""
    variants, option = [], None
    for line in b.text.splitlines():
        key = re.match(r'\s*"(\w+)":', line)
        option = key.group(1) if key else option
        comment = line.partition("#")[2]
        for alt in re.finditer(r"\bor (?=[{\"])", comment):
            value, end = _literal(comment, alt.end())
            variants.append(dict(base, **{option: value}))
            if comment[end:].startswith(" / "):
                extra, _ = _literal(comment, end + 3)
                variants.append(dict(base, **{option: dict(value, extra=extra)}))
        for snake in re.findall(r"\balso (\w+)", comment):
            variants.append({(snake if k == option else k): v for k, v in base.items()})
    return variants


@async_test
async def test_the_lease_options_construct() -> None:
    b = block("docs/reference/leases.md", "# Leases")
    s = DurabilityScheduler(LocalContext())
    (sem,) = values(b, {"DurabilitySemaphore": DurabilitySemaphore, "s": s})
    assert isinstance(sem, DurabilitySemaphore) and isinstance(sem.leases, LeaseConfig)
    assert (sem.limit, sem.leases.mode, sem.leases.permits_per_lease, sem.leases.ttl_ms, sem.leases.limited_groups) \
        == (100, Provisioning.STRICT, 64, 1_800_000, LimitedGroups.EXCLUDE)
    base = ast.literal_eval(_strip_comments(b.text))
    variants = _lease_variants(b, base)
    modes = set()
    for leases in variants:  # every spelling the comments offer constructs
        config = DurabilitySemaphore(scheduler=s, limit=100, leases=leases).leases
        assert config is not None
        modes.add(config.mode)
    assert modes == set(Provisioning) and len(variants) >= 7, variants
    assert {v.get("limitedGroups") for v in variants} >= {"withinGroupLimit"}
    assert {"permits_per_lease", "ttl_ms", "limited_groups"} <= {k for v in variants for k in v}


def _strip_comments(text: str) -> str:
    """The ``leases={...}`` literal of the block, without its comments."""
    code = "\n".join(line.partition("#")[0] for line in text.splitlines())
    return re.search(r"leases=(\{.*\})\)", code, re.DOTALL).group(1)


@async_test
async def test_the_client_object_admits_jobs_under_the_limit(clock: SimClock, workers_standin) -> None:
    AccountLimit = holder_class(block("docs/reference/holder.md", "# The holder: `DurabilitySemaphore`"))
    names = run_sync_defs(block("docs/reference/client.md", "# The client side"))
    JobQueue = names["JobQueue"]

    def make_holder(name: str) -> Any:
        holder = AccountLimit(LocalContext(name=name), env)
        AlarmDriver(clock, holder.ctx.storage, holder.alarm)
        return holder

    env = Env(ACCOUNT_CONCURRENCY="3", ACCOUNT_LIMIT=Namespace(make_holder))
    jobs = JobQueue(LocalContext(name="jobs-1"), env)
    assert jobs.scheduler.clock is clock and jobs.client.clock is clock
    TaskAlarmDriver(clock, jobs.ctx.storage, jobs.alarm)
    for job_id, group in [("b1", "bulk-exports"), ("b2", "bulk-exports"), ("b3", "bulk-exports"),
                          ("d1", "default"), ("d2", "default")]:
        assert await jobs.submit("acct-1", job_id, group, {"job": job_id}) == "queued"
        await clock.advance(10)  # oldest first: the bulk exports are older
    state = lambda: {i.item_id: i.state for i in jobs.queue.items()}  # noqa: E731
    await until(clock, lambda: list(state().values()).count(ItemState.RUNNING) == 3)
    assert [i for i, s in state().items() if s is ItemState.RUNNING] == ["b1", "b2", "d1"]
    assert await jobs.submit("acct-1", "b1", "bulk-exports", {"job": "b1"}) == "running"  # idempotent
    assert jobs.queue.item("b3").blocked.reason is BlockedReason.GROUP_LIMIT  # bulk-exports: 2
    assert jobs.queue.item("d2").blocked.reason is BlockedReason.LIMIT  # ACCOUNT_CONCURRENCY 3
    assert all(i.admitted for i in jobs.queue.items(state=ItemState.RUNNING))  # start_job returned
    await jobs.finished("b1")
    await jobs.finished("d1")
    await until(clock, lambda: state()["b3"] is ItemState.RUNNING and state()["d2"] is ItemState.RUNNING)
    for job_id in ("b2", "b3", "d2"):
        await jobs.finished(job_id)
    assert set(state().values()) == {ItemState.DONE}
    await clock.advance(15_000)
    assert (await env.ACCOUNT_LIMIT.getByName("acct-1").semaphore.usage())["charged"] == 0


@async_test
async def test_the_permit_fragment_holds_and_releases_a_permit() -> None:
    b = block("docs/reference/client.md", "## Permits: `async with queue.permit(...)`")
    clock = SimClock(T0)
    holder = HolderSide(clock, limit=1)
    side = ClientSide("c1", clock, Net(holder, clock))
    task = asyncio.ensure_future(run(b, {"self": side, "key": "acct"}))
    await until(clock, task.done)
    item = task.result()["item"]  # bound by the block's `as item`
    # the holder's default leases: the permit is a slot of a reusable lease
    assert item.is_permit and item.permit is not None and item.permit.kind is PermitKind.LEASE
    done = side.queue.item(item.item_id)  # leaving the block released it (the next pump deletes it)
    assert done is None or done.state is ItemState.DONE
    await clock.advance(15_000)
    assert (await holder.usage())["charged"] == 0
